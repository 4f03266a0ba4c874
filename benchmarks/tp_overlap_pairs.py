"""Tensor-parallel overlap on and off: how much of what it could hide does it hide?

torchtitan's published measurements of one layout with async tensor parallelism off and on
(tokens per second per GPU), the model's ratio of the two step times, and the share of the
hideable tensor-parallel communication (``Framework.tp_overlap_hidden``,
``planner.costs.timing.tp_exposed``) fitted to each pair, to all pairs, and to every source
but one (leave one source out): where the registry's value for torchtitan comes from.

Pairs, on Grand Teton H100s (96 GB HBM2e, 500 W: ``hardware/h100-96gb.yaml``, whose compute
is the 700 W part's, which scales both sides of a pair alike):

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

Run: ``.venv/bin/python benchmarks/tp_overlap_pairs.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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
        )
        cluster = planner.load_cluster("h100-96gb", gpus=gpus)
        out.append(Pair(name, model, cluster, job, layout, off, on, source))
    return out


def ratio(pair: Pair, hidden: float) -> tuple[float, float, float]:
    """The model's on / off step ratio with ``hidden`` of the hideable communication
    hidden, and the two step times (seconds)."""
    entry = frameworks.FRAMEWORKS["torchtitan"]
    frameworks.FRAMEWORKS["torchtitan"] = dataclasses.replace(entry, tp_overlap_hidden=hidden)
    try:
        off_job = pair.job.model_copy(update={"tp_comm_overlap": False})
        off = planner.evaluate(pair.model, pair.cluster, off_job, pair.layout).step_time_s
        on = planner.evaluate(pair.model, pair.cluster, pair.job, pair.layout).step_time_s
    finally:
        frameworks.FRAMEWORKS["torchtitan"] = entry
    return on / off, off, on


def fit(chosen: list[Pair]) -> float:
    """The share hidden, on a 0.01 grid in [0, 1], whose ratios are nearest the measured
    ones over ``chosen`` (least squares)."""
    grid = [i / 100 for i in range(101)]
    curves = {p.name: [ratio(p, h)[0] for h in grid] for p in chosen}

    def loss(i: int) -> float:
        return sum((curves[p.name][i] - p.measured) ** 2 for p in chosen)

    return grid[min(range(len(grid)), key=loss)]


def main() -> int:
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
