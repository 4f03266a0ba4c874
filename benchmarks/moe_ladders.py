"""Does the time model order measured MoE layouts as reality did?

A *ladder* (``benchmarks/moe_ladders.csv``) is one MoE model on one cluster for one job,
measured by one team under several parallel layouts. For each ladder this prints every
layout's measured figure, its predicted step time (``planner.evaluate``) and MFU, the error of
the prediction where the measured figure converts to a step time, and whether the predicted
order of the layouts is the measured one (Kendall's tau over the pairs, and the pairs the
model orders backwards). The summary counts the ladders ordered exactly.

Conventions:

- A measured MFU or TFLOP/s per GPU becomes a step time with the planner's own FLOP count
  (``planner.estimate.model_flops_per_token``); the sources count their FLOPs their own way
  (Megatron-LM's ``num_floating_point_operations``; the MoE Parallel Folding paper's MFU), so
  the absolute errors carry that difference. Within a ladder every row has the same model
  and job, so the order does not depend on it.
- What a row leaves out is taken as the framework runs it by default, and printed: a blank
  micro-batch is 1, an unstated dispatcher NCCL all-to-all, an ``fsdp`` row ZeRO-3 (Megatron
  FSDP) without pipelining. An unstated recompute is the fastest choice Megatron-LM can state
  under which the layout fits HBM in the model (``published_throughput.recompute_choices``:
  none, every combination of the modules the model has, full). Unstated
  virtual stages with pp > 1 (the MoE Parallel Folding paper's tables give none, and call
  their layouts "optimal configurations") are the fastest that fits of 1 to 8 chunks per rank
  that divide its layers evenly (``interleaved`` when more than 1), the same rule for every
  such row.
- A row whose layout the planner refuses (a degree that does not divide) is listed with the
  reason and left out of its ladder's order.

``--pairs`` prints instead the published measurements of Megatron-LM's expert all-to-all
overlap (``--overlap-moe-expert-parallel-comm``) on and off for one layout, the model's
ratio of the two, and the share of a pair's all-to-alls hidden (``Overlap.pair_hidden``)
fitted to each measurement, to all of them, and to all but each one (leave one source out):
where the registry's value for Megatron-LM comes from.

Run: ``.venv/bin/python benchmarks/moe_ladders.py [--only LADDER ...] [--json] [--pairs]``.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import sys
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

from published_throughput import fastest_fitting, recompute_choices

import planner
from planner.estimate import model_flops_per_token

HERE = Path(__file__).resolve().parent
LADDERS = HERE / "moe_ladders.csv"


Costed = tuple[planner.ModelSpec, planner.ClusterSpec, planner.TrainingJob, planner.Layout]


@dataclass
class Row:
    ladder: str
    id: str
    layout: str
    measured: float  # the source's figure
    metric: str
    measured_step_s: float | None
    predicted_step_s: float | None
    predicted_mfu: float | None
    error: float | None  # predicted / measured step - 1
    assumed: str
    skipped: str = ""
    # What was costed, where a row was: (model, cluster, job, layout)
    costed: (
        tuple[planner.ModelSpec, planner.ClusterSpec, planner.TrainingJob, planner.Layout] | None
    ) = None


def _int(text: str, default: int) -> int:
    return int(text) if text.strip() else default


def _layout(model: planner.ModelSpec, r: dict[str, str], recompute: str) -> planner.Layout:
    tp, pp, dp = _int(r["tp"], 1), _int(r["pp"], 1), _int(r["dp"], 1)
    vp, ep, etp, cp = _int(r["vp"], 1), _int(r["ep"], 1), _int(r["etp"], 1), _int(r["cp"], 1)
    return _shaped(model, r, recompute, tp, pp, dp, vp, ep, etp, cp)


def _shaped(
    model: planner.ModelSpec,
    r: dict[str, str],
    recompute: str,
    tp: int,
    pp: int,
    dp: int,
    vp: int,
    ep: int,
    etp: int,
    cp: int,
) -> planner.Layout:
    fsdp = r["schedule"] == "fsdp"
    schedule = "1f1b" if fsdp else r["schedule"]
    if schedule == "1f1b" and vp > 1:
        schedule = "interleaved"
    if "a2aoverlap" in r["id"]:  # Megatron-LM's --overlap-moe-expert-parallel-comm
        schedule = {"interleaved": "interleaved-ep-overlap", "1f1b": "1f1b-ep-overlap"}[schedule]
    fields = {
        "tp": tp,
        "dp": dp,
        "cp": cp,
        "ep": ep,
        "etp": etp,
        "zero": 3 if fsdp else 1,
        "micro_batch": _int(r["micro_batch"], 1),
        "schedule": schedule,
        "recompute": recompute,
    }
    stages = pp * vp
    if model.num_layers < stages:  # the embedding and the head take a stage of their own
        counts = [0] + [1] * (stages - 2) + [0]
        if sum(counts) != model.num_layers:
            raise planner.PlannerError(f"{model.num_layers} layers cannot fill {stages} stages")
        return planner.Layout.from_counts(model, counts=counts, pp=pp, virtual_stages=vp, **fields)
    return planner.Layout.uniform(model, pp=pp, virtual_stages=vp if vp > 1 else None, **fields)


def _measured_step(
    model: planner.ModelSpec, r: dict[str, str], cluster: planner.ClusterSpec
) -> float | None:
    value, gpus = float(r["value"]), int(r["num_gpus"])
    tokens = int(r["global_batch"]) * int(r["seq_len"])
    flops = model_flops_per_token(model, int(r["seq_len"])) * tokens
    if r["metric"] == "mfu":
        return flops / (value * cluster.bf16_flops * gpus)
    if r["metric"] == "tflops_per_gpu":
        return flops / (value * 1e12 * gpus)
    if r["metric"] == "tokens_per_s_per_gpu":
        return tokens / (value * gpus)
    if r["metric"] == "step_time_s":
        return value
    return None


def cost(r: dict[str, str]) -> Row:
    model = planner.load_model(r["model"])
    cluster = planner.load_cluster(r["gpu"], gpus=int(r["num_gpus"]))
    dispatcher = r["dispatcher"] if r["dispatcher"] in ("alltoall", "allgather", "deepep") else ""
    job = planner.TrainingJob(
        seq_len=int(r["seq_len"]),
        global_batch=int(r["global_batch"]),
        compute_dtype="fp8" if r["precision"] == "fp8" else "bf16",
        framework="megatron",
        moe_dispatcher=dispatcher or "alltoall",
    )
    assumed = []
    if not r["micro_batch"].strip():
        assumed.append("micro-batch 1")
    if not dispatcher:
        assumed.append("NCCL all-to-all")
    base = Row(r["ladder"], r["id"], "", float(r["value"]), r["metric"], None, None, None, None, "")
    measured = _measured_step(model, r, cluster)
    stated = r["recompute"].strip()
    if stated.startswith("selective(") and stated.endswith(")"):  # Megatron-LM's modules
        stated = stated.removeprefix("selective(").removesuffix(")")
    unstated = stated in ("", "unstated")
    tries = recompute_choices(model, "megatron") if unstated else [stated]
    pp = _int(r["pp"], 1)
    per_rank = model.num_layers // pp
    virtuals = (
        [1]
        if r["vp"].strip() or pp == 1
        else [v for v in range(1, 9) if model.num_layers % (pp * v) == 0 and v <= per_rank]
    )
    layouts: dict[str, planner.Layout] = {}

    def estimate(recompute: str) -> planner.Estimate:
        """The fastest of the virtual-stage counts that fits HBM in the model (the run
        trained: not the planner's cap under its margin for the model's own error)."""
        found: list[tuple[float, planner.Layout, planner.Estimate]] = []
        for v in virtuals:
            row = r
            if len(virtuals) > 1:
                row = {**r, "vp": str(v), "schedule": "interleaved" if v > 1 else r["schedule"]}
            try:
                layout = _layout(model, row, recompute)
                est = planner.evaluate(model, cluster, job, layout)
            except planner.PlannerError:
                if v == 1:
                    raise
                continue
            found.append((0.0 if est.headroom >= 0 else 1.0, layout, est))
        _, layouts[recompute], est = min(found, key=lambda f: (f[0], f[2].step_time_s))
        return est

    try:
        recompute, est = fastest_fitting(tries, estimate)
    except planner.PlannerError as exc:
        base.skipped = str(exc)
        return base
    layout = layouts[recompute]
    if len(virtuals) > 1:
        assumed.append(f"{layout.virtual_stages} virtual stages (fastest that fits)")
    if unstated:
        assumed.append(f"recompute {recompute} (fastest that fits)")
    if est.headroom < 0:
        assumed.append("DOES NOT FIT HBM in the model")
    name = f"tp{layout.tp} pp{layout.pp} dp{layout.dp} ep{layout.ep} etp{layout.etp}"
    name += f" cp{layout.cp} v{layout.virtual_stages} z{layout.zero} {layout.schedule}"
    return Row(
        r["ladder"],
        r["id"],
        name,
        float(r["value"]),
        r["metric"],
        measured,
        est.step_time_s,
        est.mfu,
        est.step_time_s / measured - 1 if measured else None,
        ", ".join(assumed),
        costed=(model, cluster, job, layout),
    )


def kendall(measured: list[float], predicted: list[float]) -> tuple[float, list[tuple[int, int]]]:
    """Kendall's tau of two orders of step times, and the pairs ordered backwards (ties in
    the measurement are not counted)."""
    agree = disagree = 0
    backwards = []
    for i, j in itertools.combinations(range(len(measured)), 2):
        m = measured[i] - measured[j]
        p = predicted[i] - predicted[j]
        if m == 0:
            continue
        if m * p > 0:
            agree += 1
        else:
            disagree += 1
            backwards.append((i, j))
    pairs = agree + disagree
    return ((agree - disagree) / pairs if pairs else 1.0), backwards


def qwen3_30b_a3b() -> planner.ModelSpec:
    """Qwen3-30B-A3B, from its Megatron-LM arguments in Megatron-MoE-ModelZoo
    (model_configs/benchmarking/Qwen3-30B-A3B.yaml at e865051: 48 layers, hidden 2048, 32
    heads, 4 query groups, kv-channels 128, 128 experts of 768, top 8); the rest (vocabulary,
    untied embeddings, q/k norms, no shared expert) as its family's Qwen3-235B-A22B."""
    return planner.load_model("qwen3-235b-a22b").model_copy(
        update={
            "name": "qwen3-30b-a3b",
            "num_layers": 48,
            "hidden_size": 2048,
            "num_attention_heads": 32,
            "num_kv_heads": 4,
            "head_dim": 128,
            "ffn_hidden_size": 6144,
            "moe_ffn_hidden_size": 768,
        }
    )


@dataclass
class Pair:
    """One layout measured with the expert all-to-all overlap off and on (seconds)."""

    name: str
    model: planner.ModelSpec
    cluster: planner.ClusterSpec
    job: planner.TrainingJob
    off: planner.Layout
    on: planner.Layout
    measured_off: float
    measured_on: float
    source: str


def pairs() -> list[Pair]:
    q235 = planner.load_model("qwen3-235b-a22b")
    q30 = qwen3_30b_a3b()

    def big(schedule: str) -> planner.Layout:
        return planner.Layout.uniform(
            q235,
            tp=2,
            pp=8,
            dp=16,
            ep=32,
            virtual_stages=4,
            schedule=schedule,
            recompute="layernorm+moe_act",
        )

    def small(label: str, dispatcher: str, off: float, on: float, source: str) -> Pair:
        """Qwen3-30B-A3B on 16 H100, EP16, sequence 4,096, global batch 1,024."""
        layout = partial(planner.Layout.uniform, q30, dp=16, ep=16)
        return Pair(
            f"qwen3-30b-a3b, 16 H100, ep16, {label}",
            q30,
            planner.load_cluster("h100", gpus=16),
            planner.TrainingJob(seq_len=4096, global_batch=1024, moe_dispatcher=dispatcher),
            layout(schedule="1f1b"),
            layout(schedule="1f1b-ep-overlap"),
            off,
            on,
            source,
        )

    return [
        Pair(
            "qwen3-235b-a22b, 256 H100, tp2 pp8 vp4 ep32, DeepEP",
            q235,
            planner.load_cluster("h100", gpus=256),
            planner.TrainingJob(seq_len=4096, global_batch=2048, moe_dispatcher="deepep"),
            big("interleaved"),
            big("interleaved-ep-overlap"),
            19.7,
            17.6,
            "yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md (H100 table, "
            "'Cross-node EP strategy' rows, '+1f1b overlap')",
        ),
        small(
            "NCCL all-to-all",
            "alltoall",
            41.25,
            31.31,
            "NVIDIA-NeMo/Megatron-Bridge docs/training/communication-overlap.md at 319a6eb1 "
            "(H100 x16, EP16, alltoall; sequence, micro and global batch not stated: 4,096, 1 "
            "and 1,024 taken, the ratio hardly depends on them)",
        ),
        small(
            "HybridEP (priced as DeepEP)",
            "deepep",
            24.7138,
            20.9920,
            "NVIDIA-NeMo/Megatron-Bridge skills/nemo-mbridge-perf-expert-parallel-overlap/"
            "SKILL.md at 067f987d, 'HybridEP Production-Shape Benchmark' (2026-07-25: TP1 PP1 "
            "CP1 EP16, MBS 1, GBS 1,024, sequence 4,096, BF16, force-balanced routing, flex "
            "dispatcher with HybridEP, CUDA graphs on the router and preprocess in both; on: "
            "the independent validation run). Its Nsight comparison measured 36.55% of the "
            "communication time concurrent with GEMMs and attention with the overlap on "
            "(0.11% off). HybridEP, NVIDIA's hierarchical dispatch, is priced as DeepEP's",
        ),
    ]


def _ratio(pair: Pair, hidden: float) -> tuple[float, float, float]:
    """The model's on / off step ratio with ``hidden`` of a pair's all-to-alls hidden, and
    the two step times (seconds)."""
    import dataclasses

    from planner import frameworks

    overlap = dataclasses.replace(frameworks.framework("megatron").overlap, pair_hidden=hidden)
    with frameworks.replaced("megatron", overlap=overlap):
        off = planner.evaluate(pair.model, pair.cluster, pair.job, pair.off).step_time_s
        on = planner.evaluate(pair.model, pair.cluster, pair.job, pair.on).step_time_s
    return on / off, off, on


def fit_hidden(chosen: list[Pair]) -> float:
    """The share hidden, on a 0.01 grid in [0, 1], whose on/off ratios are nearest the
    measured ones over ``chosen`` (least squares)."""
    grid = [i / 100 for i in range(101)]
    curves = {p.name: [_ratio(p, h)[0] for h in grid] for p in chosen}

    def loss(i: int) -> float:
        return sum((curves[p.name][i] - p.measured_on / p.measured_off) ** 2 for p in chosen)

    return grid[min(range(len(grid)), key=loss)]


def print_pairs() -> None:
    from planner.frameworks import framework
    from planner.simulate import simulated_step

    shipped = framework("megatron").overlap.pair_hidden
    every = pairs()
    print(f"Megatron-LM's expert all-to-all overlap, on / off (registry: {shipped:.2f} hidden)")
    for p in every:
        ratio, off, on = _ratio(p, shipped)
        own = fit_hidden([p])
        rest = [q for q in every if q is not p]
        held = fit_hidden(rest) if rest else float("nan")
        held_ratio = _ratio(p, held)[0]
        measured = p.measured_on / p.measured_off
        sim_off = simulated_step(p.model, p.cluster, p.job, p.off)
        sim = simulated_step(p.model, p.cluster, p.job, p.on) / sim_off
        print(
            f"  {p.name}: measured {p.measured_off:.2f} -> {p.measured_on:.2f} s "
            f"(x{measured:.3f}); predicted {off:.2f} -> {on:.2f} s (x{ratio:.3f}, "
            f"{ratio / measured - 1:+.1%}); fitted alone {own:.2f}; fitted on the others "
            f"{held:.2f}, which predicts x{held_ratio:.3f} ({held_ratio / measured - 1:+.1%}); "
            f"simulated x{sim:.3f} ({sim / measured - 1:+.1%})"
        )
        print(f"    source: {p.source}")
    print(f"  fitted on all: {fit_hidden(every):.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", default=None, help="ladder names")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--pairs", action="store_true", help="the expert all-to-all overlap's on/off pairs"
    )
    args = parser.parse_args(argv)
    if args.pairs:
        print_pairs()
        return 0
    rows = list(csv.DictReader(LADDERS.open()))
    ladders: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        if args.only is None or r["ladder"] in args.only:
            ladders.setdefault(r["ladder"], []).append(r)
    out, exact, counted, errors = [], 0, 0, []
    for name, members in ladders.items():
        costed = [cost(r) for r in members]
        ok = [c for c in costed if not c.skipped and c.measured_step_s and c.predicted_step_s]
        measured = [c.measured_step_s for c in ok]
        predicted = [c.predicted_step_s for c in ok]
        tau, backwards = kendall(measured, predicted)  # type: ignore[arg-type]
        if len(ok) >= 2:
            counted += 1
            exact += not backwards
        errors += [c.error for c in ok if c.error is not None]
        out.append(
            {"ladder": name, "tau": tau, "rows": [asdict(replace(c, costed=None)) for c in costed]}
        )
        if args.json:
            continue
        print(f"\n{name}: Kendall tau {tau:+.2f}, {len(backwards)} pair(s) backwards")
        order = sorted(range(len(ok)), key=lambda i: measured[i])  # type: ignore[arg-type, return-value]
        for rank, i in enumerate(order, 1):
            c = ok[i]
            print(
                f"  {rank}. {c.layout:58s} measured {c.measured:8.3f} {c.metric:22s} "
                f"= {c.measured_step_s:7.3f} s; predicted {c.predicted_step_s:7.3f} s "
                f"({c.error:+.1%}), MFU {c.predicted_mfu:.1%}"
                + (f"  [{c.assumed}]" if c.assumed else "")
            )
        for c in costed:
            if c.skipped:
                print(f"  -  {c.id}: not costed: {c.skipped}")
        for i, j in backwards:
            print(f"  backwards: {ok[i].layout} vs {ok[j].layout}")
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        return 0
    mean = sum(abs(e) for e in errors) / len(errors) if errors else float("nan")
    sign = sum(errors) / len(errors) if errors else float("nan")
    print(
        f"\n{exact} of {counted} ladders ordered exactly as measured; step-time error over "
        f"{len(errors)} rows: mean |error| {mean:.1%}, mean signed {sign:+.1%} (the planner's "
        "FLOP count converts measured MFU and TFLOP/s to seconds)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
