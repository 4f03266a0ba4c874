"""Planner speed and proof quality over a fixed suite of jobs, at several time limits.

The suite: 11 jobs, dense and MoE, 8 to 16,384 GPUs (``SUITE``). Each is planned at each
time limit (default 2 s, 10 s and 60 s); for every run the table gives the status, the gap to
the proven bound, the bound, the plan's step time, the wall time and its ratio to the limit,
and the configurations the search costed. The summary gives, per limit, how many jobs are
proven optimal (gap <= 0.5%), the median and worst gap, and the median ratio of the step time
to the longest limit's step time (how much a shorter budget costs); all of them are ratios
taken in one run on one machine, so they compare across limits, not across machines.

Each gap is then split three ways against the best step and the highest bound any limit
reached: the incumbent's part (how much faster a layout exists), the bound's part (how much
higher a bound was proven) and what no run closed.

For the longest limit it also gives the best uniform-partition layout with one recompute
choice for every layer at the plan's own degrees: how much the non-uniform stages and
per-block recompute buy.

Run: ``.venv/bin/python benchmarks/plan_speed.py [--limits 2 10 60] [--only NAME ...]``
(about 13 minutes at the default limits on a 2-core machine).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import planner
from planner.errors import PlannerError
from planner.layout import Layout

PROVEN = 0.005  # a gap this small counts as proven optimal


@dataclass(frozen=True)
class Job:
    name: str
    model: str
    gpu: str
    gpus: int
    job: planner.TrainingJob


SUITE = [
    Job(
        "llama3-8b-8-h100",
        "llama3-8b",
        "h100",
        8,
        planner.TrainingJob(seq_len=8192, global_batch=64),
    ),
    Job(
        "mixtral-8x7b-64-h100",
        "mixtral-8x7b",
        "h100",
        64,
        planner.TrainingJob(seq_len=4096, global_batch=256),
    ),
    Job(
        "llama3-70b-64-h100",
        "llama3-70b",
        "h100",
        64,
        planner.TrainingJob(seq_len=8192, global_batch=128, compute_dtype="fp8"),
    ),
    Job(
        "qwen2-57b-a14b-128-h100",
        "qwen2-57b-a14b",
        "h100",
        128,
        planner.TrainingJob(seq_len=4096, global_batch=512),
    ),
    Job(
        "mixtral-8x22b-256-h100",
        "mixtral-8x22b",
        "h100",
        256,
        planner.TrainingJob(seq_len=4096, global_batch=1024),
    ),
    Job(
        "llama3-70b-512-h100",
        "llama3-70b",
        "h100",
        512,
        planner.TrainingJob(seq_len=8192, global_batch=1024, compute_dtype="fp8"),
    ),
    Job(
        "deepseek-v2-512-h800",
        "deepseek-v2",
        "h800",
        512,
        planner.TrainingJob(seq_len=4096, global_batch=2304),
    ),
    Job(
        "gpt3-175b-1024-a100",
        "gpt3-175b",
        "a100",
        1024,
        planner.TrainingJob(seq_len=2048, global_batch=1536),
    ),
    Job(
        "deepseek-v3-2048-h800",
        "deepseek-v3",
        "h800",
        2048,
        planner.TrainingJob(
            seq_len=4096, global_batch=15360, compute_dtype="fp8", moment_dtype="bf16", ema="fp32"
        ),
    ),
    Job(
        "llama3-405b-8192-h100",
        "llama3-405b",
        "h100",
        8192,
        planner.TrainingJob(seq_len=8192, global_batch=2048),
    ),
    Job(
        "llama3-405b-16384-h100",
        "llama3-405b",
        "h100",
        16384,
        planner.TrainingJob(seq_len=8192, global_batch=2048),
    ),
]


@dataclass(frozen=True)
class Result:
    job: str
    limit: float
    status: str
    gap: float | None
    bound: float | None
    step: float | None
    wall: float
    configurations: int
    layout: Layout | None


def best_uniform(
    model: planner.ModelSpec, cluster: planner.ClusterSpec, job: planner.TrainingJob, lay: Layout
) -> float | None:
    """The fastest fitting uniform split at ``lay``'s degrees, one recompute for all."""
    best = None
    for recompute in ("none", "selective", "full"):
        try:
            uniform = Layout.uniform(
                model,
                pp=lay.pp,
                tp=lay.tp,
                cp=lay.cp,
                dp=lay.dp,
                ep=lay.ep,
                etp=lay.etp,
                sequence_parallel=lay.sequence_parallel,
                zero=lay.zero,
                micro_batch=lay.micro_batch,
                schedule=lay.schedule,
                virtual_stages=lay.virtual_stages,
                recompute=recompute,
                ema=lay.ema,
            )
        except PlannerError:  # the plan's stage count leaves some stage without a layer
            return None
        try:
            est = planner.evaluate(model, cluster, job, uniform)
        except PlannerError:  # a recompute the plan's schedule refuses (its expert overlap)
            continue
        if est.fits and (best is None or est.step_time_s < best):
            best = est.step_time_s
    return best


def run(case: Job, limit: float) -> Result:
    model, cluster = planner.load_model(case.model), planner.load_cluster(case.gpu, gpus=case.gpus)
    started = time.perf_counter()
    plan = planner.plan(model, cluster, case.job, time_limit_s=limit)
    wall = time.perf_counter() - started
    step = plan.estimate.step_time_s if plan.estimate is not None else None
    return Result(
        case.name,
        limit,
        plan.status,
        plan.gap,
        plan.lower_bound_s,
        step,
        wall,
        plan.configurations,
        plan.layout,
    )


def _text(x: float | None, unit: str = "s", digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f} {unit}".strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limits", type=float, nargs="+", default=[2.0, 10.0, 60.0])
    parser.add_argument("--only", nargs="+", default=None, help="job names (see SUITE)")
    args = parser.parse_args()
    names = {c.name for c in SUITE}
    unknown = sorted(set(args.only or []) - names)
    if unknown:
        parser.error(f"--only {unknown[0]}: not a job of the suite ({', '.join(sorted(names))})")
    if min(args.limits) <= 0:
        parser.error(f"--limits {min(args.limits)}: time limits must be positive seconds")
    limits = sorted(args.limits)
    cases = [c for c in SUITE if args.only is None or c.name in args.only]
    results: dict[tuple[str, float], Result] = {}
    print(
        f"{'job':24} {'limit':>6} {'status':10} {'gap':>7} {'bound':>9} {'step':>9} "
        f"{'wall':>8} {'wall/limit':>10} {'configs':>8}"
    )
    for case in cases:
        for limit in limits:
            r = results[case.name, limit] = run(case, limit)
            gap = "-" if r.gap is None else f"{r.gap:.1%}"
            print(
                f"{r.job:24} {limit:5.0f}s {r.status:10} {gap:>7} {_text(r.bound):>9} "
                f"{_text(r.step):>9} {_text(r.wall, 's', 1):>8} {r.wall / limit:10.2f} "
                f"{r.configurations:8d}",
                flush=True,
            )
    longest = limits[-1]
    print("\nper limit (gap <= 0.5% counts as proven):")
    for limit in limits:
        rows = [results[c.name, limit] for c in cases]
        gaps = [r.gap for r in rows if r.gap is not None]
        proven = sum(g <= PROVEN for g in gaps)
        slower = [
            r.step / results[r.job, longest].step
            for r in rows
            if r.step is not None and results[r.job, longest].step is not None
        ]
        print(
            f"  {limit:5.0f} s: proven {proven}/{len(rows)}, gap median "
            f"{statistics.median(gaps) if gaps else float('nan'):.1%} worst "
            f"{max(gaps) if gaps else float('nan'):.1%}; step / step at {longest:.0f} s: median "
            f"{statistics.median(slower) if slower else float('nan'):.3f}, worst "
            f"{max(slower) if slower else float('nan'):.3f}; wall / limit median "
            f"{statistics.median(r.wall / limit for r in rows):.2f}"
        )
    print(
        "\nwhere each gap lies, against the best step and the highest bound of any limit: the "
        "incumbent's part (its step over the best found), the bound's part (its bound under "
        "the highest) and what no run closed:"
    )
    for case in cases:
        rows = [results[case.name, limit] for limit in limits]
        steps = [r.step for r in rows if r.step is not None]
        bounds = [r.bound for r in rows if r.bound is not None]
        if not steps or not bounds:
            continue
        best, high = min(steps), max(bounds)
        parts = []
        for r in rows:
            if r.step is None or r.bound is None:
                continue
            parts.append(
                f"{r.limit:.0f} s: {(r.step - best) / r.step:.1%} + {(high - r.bound) / r.step:.1%}"
                f" + {(best - high) / r.step:.1%}"
            )
        print(f"  {case.name:24} " + "; ".join(parts))
    print(f"\nat {longest:.0f} s, the best uniform layout at the plan's degrees:")
    for case in cases:
        r = results[case.name, longest]
        if r.layout is None or r.step is None:
            print(f"  {case.name}: no plan")
            continue
        model = planner.load_model(case.model)
        cluster = planner.load_cluster(case.gpu, gpus=case.gpus)
        uniform = best_uniform(model, cluster, case.job, r.layout)
        lay = r.layout
        gain = f"{uniform / r.step - 1:+.1%} slower" if uniform else "none fits or splits evenly"
        print(
            f"  {case.name}: plan {r.step:.2f} s (tp={lay.tp} cp={lay.cp} pp={lay.pp} "
            f"dp={lay.dp} ep={lay.ep} etp={lay.etp} ZeRO-{lay.zero} mb={lay.micro_batch} "
            f"{lay.schedule} "
            f"v={lay.virtual_stages}); uniform {_text(uniform)} ({gain})"
        )


if __name__ == "__main__":
    main()
