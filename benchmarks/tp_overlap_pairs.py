"""Tensor-parallel overlap on and off: how much of what it could hide does it hide?

torchtitan's published measurements of one layout with async tensor parallelism off and on
(tokens per second per GPU), the model's ratio of the two step times, and the share of the
hideable tensor-parallel communication (``Framework.tp_overlap_hidden``,
``planner.costs.timing.tp_exposed``) fitted to each pair, to all pairs, and to every source
but one (leave one source out): where the registry's value for torchtitan comes from.

Pairs, on Grand Teton H100s (96 GB HBM2e, 500 W: ``hardware/h100-96gb.yaml``, whose peak is
the low end of torchtitan's "between SXM and NVL"):

- torchtitan ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (June 2025): Llama 3
  70B on 256 H100 (FSDP 32, TP 8, torch.compile, full activation checkpointing, local batch
  16) and Llama 3 8B on 64 H100 (FSDP 8, TP 8, torch.compile, per-op selective
  checkpointing, local batch 12), in BF16 and float8 tensorwise. The float8 rowwise rows are
  left out: the file notes their vanilla-TP baseline as abnormally low (torchtitan#1207).
  Sequence 8,192 (torchtitan's Llama 3 training configs; the file does not state it); the loss
  compiled (``compile.components`` holds the loss since April 2025);
- torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (December 2024), Table 4: Llama 3
  70B on 256 H100 (FSDP 32, TP 8, torch.compile, float8, local batch 16), 829 -> 876; the
  loss eager then.

Megatron-LM's userbuffers overlap has no published on/off pair. ``--megatron`` sweeps its
share over the published rows it applies to (``published_runs.csv``: run by Megatron-LM or
priced as it, tp > 1, overlap not switched off) and reports each source's error per share and
each source held out (the share fitted on the others, on a 0.05 grid).

Run: ``.venv/bin/python benchmarks/tp_overlap_pairs.py [--megatron]``.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass

import published_throughput
from rankings import source_key

import planner
from planner import frameworks

JUNE = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
DEC = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md Table 4"


@dataclass
class Pair:
    """One layout measured with async TP off and on (tokens/s per GPU)."""

    name: str
    model: planner.ModelSpec
    cluster: planner.ClusterSpec
    job: planner.TrainingJob
    layout: planner.Layout
    tps_off: float
    tps_on: float
    source: str

    @property
    def measured(self) -> float:
        """Step on / step off."""
        return self.tps_off / self.tps_on


def pairs() -> list[Pair]:
    l70, l8 = planner.load_model("llama3-70b"), planner.load_model("llama3-8b")
    big = planner.Layout.uniform(l70, tp=8, dp=32, zero=3, micro_batch=16, recompute="full")
    small = planner.Layout.uniform(l8, tp=8, dp=8, zero=3, micro_batch=12, recompute="op")
    out = []
    for name, model, gpus, layout, batch, dtype, off, on, source, compiled in (
        ("llama3-70b 256 H100 bf16", l70, 256, big, 512, "bf16", 597.3, 652.4, JUNE, True),
        ("llama3-70b 256 H100 fp8", l70, 256, big, 512, "fp8", 809.8, 942.4, JUNE, True),
        ("llama3-8b 64 H100 bf16", l8, 64, small, 96, "bf16", 4378.0, 4809.4, JUNE, True),
        ("llama3-8b 64 H100 fp8", l8, 64, small, 96, "fp8", 5078.1, 5570.1, JUNE, True),
        ("llama3-70b 256 H100 fp8 (Dec 2024)", l70, 256, big, 512, "fp8", 829, 876, DEC, False),
    ):
        job = planner.TrainingJob(
            seq_len=8192,
            global_batch=batch,
            compute_dtype=dtype,
            framework="torchtitan",
            compiled_loss=compiled,
            # both files predate torchtitan's cuDNN-first attention on Hopper (2025-10-09):
            # PyTorch's FlashAttention-2 kernel (torchtitan/models/attention.py at 0354f22f)
            attention_kernel="fa2",
        )
        cluster = planner.load_cluster("h100-96gb", gpus=gpus)
        out.append(Pair(name, model, cluster, job, layout, off, on, source))
    return out


def ratio(pair: Pair, hidden: float) -> tuple[float, float, float]:
    """The model's on / off step ratio with ``hidden`` of the hideable communication
    hidden, and the two step times (seconds)."""
    with frameworks.replaced("torchtitan", tp_overlap_hidden=hidden):
        off_job = pair.job.model_copy(update={"tp_comm_overlap": False})
        off = planner.evaluate(pair.model, pair.cluster, off_job, pair.layout).step_time_s
        on = planner.evaluate(pair.model, pair.cluster, pair.job, pair.layout).step_time_s
    return on / off, off, on


def fit(chosen: list[Pair]) -> float:
    """The share hidden, on a 0.01 grid in [0, 1], whose ratios are nearest the measured
    ones over ``chosen`` (least squares)."""
    grid = [i / 100 for i in range(101)]
    curves = {p.name: [ratio(p, h)[0] for h in grid] for p in chosen}

    def loss(i: int) -> float:
        return sum((curves[p.name][i] - p.measured) ** 2 for p in chosen)

    return grid[min(range(len(grid)), key=loss)]


def megatron_rows() -> list[dict[str, str]]:
    """Published rows Megatron-LM's tensor-parallel overlap applies to."""
    rows = published_throughput.read_rows()
    own = ("torchtitan", "deepspeed", "deepspeed-2021", "torch")
    return [
        r
        for r in rows
        if int(r["tp"]) > 1 and r.get("tp_comm_overlap") != "false" and r["framework"] not in own
    ]


def megatron_errors(rows: list[dict[str, str]], hidden: float) -> dict[str, list[float]]:
    """Each source's signed relative errors with Megatron-LM hiding ``hidden``."""
    out: dict[str, list[float]] = defaultdict(list)
    with frameworks.replaced("megatron", tp_overlap_hidden=hidden):
        for r, measured, predicted, _ in published_throughput.costed_rows(rows):
            out[source_key(r["source"])].append(predicted / measured - 1)
    return out


def megatron_sweep() -> None:
    rows = megatron_rows()
    grid = [i / 20 for i in range(21)]
    errors = {h: megatron_errors(rows, h) for h in grid}

    def mape(h: float, sources: list[str]) -> float:
        e = [x for s in sources for x in errors[h][s]]
        return sum(abs(x) for x in e) / len(e)

    sources = sorted(errors[1.0], key=lambda s: -len(errors[1.0][s]))
    shipped = frameworks.framework("megatron").tp_overlap_hidden
    print(f"Megatron-LM userbuffers overlap: registry share {shipped:.2f}")
    for h in (1.0, 0.75, 0.5, 0.25, 0.0):
        flat = [x for s in sources for x in errors[h][s]]
        print(
            f"  share {h:.2f}: {len(flat)} rows, mean |error| {mape(h, sources):.1%}, "
            f"bias {sum(flat) / len(flat):+.1%}"
        )
    held_abs = shipped_abs = 0.0
    for held in sources:
        rest = [s for s in sources if s != held]
        fitted = min(grid, key=lambda h: mape(h, rest))
        best = min(grid, key=lambda h: mape(h, [held]))
        n = len(errors[1.0][held])
        held_abs += n * mape(fitted, [held])
        shipped_abs += n * mape(shipped, [held])
        print(
            f"  held out {held} ({n} rows): share fitted on the others "
            f"{fitted:.2f}, its error {mape(fitted, [held]):.1%} (at the registry's "
            f"{mape(shipped, [held]):.1%}; its own best share {best:.2f})"
        )
    rows_n = sum(len(errors[1.0][s]) for s in sources)
    every = min(grid, key=lambda h: mape(h, sources))
    print(
        f"  each source held out: {held_abs / rows_n:.1%} (row-weighted) against "
        f"{shipped_abs / rows_n:.1%} at the registry's share; fitted on all: {every:.2f} "
        f"({mape(every, sources):.1%})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megatron", action="store_true", help="sweep Megatron-LM's share")
    if parser.parse_args().megatron:
        megatron_sweep()
        return 0
    shipped = frameworks.framework("torchtitan").tp_overlap_hidden
    every = pairs()
    print(f"torchtitan async TP, on / off (registry: {shipped:.2f} of the hideable hidden)")
    for p in every:
        r, off, on = ratio(p, shipped)
        full = ratio(p, 1.0)[0]
        print(
            f"  {p.name}: measured x{p.measured:.3f} ({p.tps_off:g} -> {p.tps_on:g} tokens/s/GPU);"
            f" predicted {off:.2f} -> {on:.2f} s (x{r:.3f}, {r / p.measured - 1:+.1%}); all "
            f"hidden x{full:.3f}; fitted alone {fit([p]):.2f}"
        )
    for source in (JUNE, DEC):
        held = [p for p in every if p.source == source]
        rest = [p for p in every if p.source != source]
        h = fit(rest)
        errors = ", ".join(f"{ratio(p, h)[0] / p.measured - 1:+.1%}" for p in held)
        print(f"  held out {source}: fitted on the other source {h:.2f}; its pairs {errors}")
    print(f"  fitted on all: {fit(every):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
