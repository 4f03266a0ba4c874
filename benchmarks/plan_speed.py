"""Planner speed and quality on the two large targets, and its gain over uniform layouts.

- DeepSeek-V3 on 2048 H800 (sequence 4096, global batch 15360, FP8, BF16 moments, FP32 EMA).
- Llama 3 405B on 16384 H100 (sequence 8192, 16M tokens per step: global batch 2048).

For each: wall time, status, gap to the proven bound, the plan's step time, and the best
uniform-partition layout with one recompute choice for every layer at the plan's own degrees
(how much the non-uniform stages and per-block recompute buy).

Run: ``.venv/bin/python benchmarks/plan_speed.py [--time-limit SECONDS]``.
"""

from __future__ import annotations

import argparse
import time

import planner
from planner.layout import Layout

CASES = [
    (
        "deepseek-v3",
        "h800",
        2048,
        planner.TrainingJob(
            seq_len=4096, global_batch=15360, compute_dtype="fp8", moment_dtype="bf16", ema="fp32"
        ),
    ),
    ("llama3-405b", "h100", 16384, planner.TrainingJob(seq_len=8192, global_batch=2048)),
]


def best_uniform(
    model: planner.ModelSpec, cluster: planner.ClusterSpec, job: planner.TrainingJob, lay: Layout
) -> float | None:
    best = None
    for recompute in ("none", "selective", "full"):
        uniform = Layout.uniform(
            model,
            pp=lay.pp,
            tp=lay.tp,
            dp=lay.dp,
            ep=lay.ep,
            zero=lay.zero,
            micro_batch=lay.micro_batch,
            schedule=lay.schedule,
            virtual_stages=lay.virtual_stages,
            recompute=recompute,
            ema=lay.ema,
        )
        est = planner.evaluate(model, cluster, job, uniform)
        if est.fits and (best is None or est.step_time_s < best):
            best = est.step_time_s
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args()
    for name, gpu, gpus, job in CASES:
        model, cluster = planner.load_model(name), planner.load_cluster(gpu, gpus=gpus)
        started = time.perf_counter()
        plan = planner.plan(model, cluster, job, time_limit_s=args.time_limit)
        wall = time.perf_counter() - started
        assert plan.layout is not None and plan.estimate is not None
        lay = plan.layout
        uniform = best_uniform(model, cluster, job, lay)
        gain = f"{uniform / plan.estimate.step_time_s - 1:+.1%}" if uniform else "none fits"
        print(
            f"{name} on {gpus} {gpu}: {plan.status}, gap {plan.gap:.1%} "
            f"(bound {plan.lower_bound_s:.2f} s), wall {wall:.1f} s for a "
            f"{args.time_limit:.0f} s budget, {plan.configurations} configurations; "
            f"step {plan.estimate.step_time_s:.2f} s with tp={lay.tp} pp={lay.pp} dp={lay.dp} "
            f"ep={lay.ep} ZeRO-{lay.zero} mb={lay.micro_batch} {lay.schedule} "
            f"v={lay.virtual_stages}; best uniform layout at these degrees: "
            f"{uniform if uniform is None else round(uniform, 2)} s ({gain} slower)"
        )


if __name__ == "__main__":
    main()
