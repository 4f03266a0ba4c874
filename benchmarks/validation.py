"""The cost model against real runs on this machine: the targets of ``planner validate``.

1. Calibrate this machine (``planner.run.calibrate``) for 2 and 4 worker processes.
2. Run the validation set (``planner.run.validate.validation_set``: 11 layouts of a
   4-layer Mixtral-shaped model) ``--rounds`` times over (step time: the median of the
   rounds) and compare every rank with the cost model.
3. Plan 2 ranks under a 62 MiB cap and run both the rejected and the accepted plan.

Printed targets:
- memory: layouts whose every rank's predicted peak is within 5% of the measured one;
  buckets (weights, gradients, optimizer state, activations) within 5% or 1 MiB;
- time: the predicted order of the rankable layouts (``validate.ranking``) against the
  measured one, and the step-time errors of every layout;
- the cap: the rejected layout peaks above it and the accepted one below;
- wall time of the whole validation set.

Run: ``.venv/bin/python benchmarks/validation.py [--steps N] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from planner.run.calibrate import calibrated_cluster
from planner.run.validate import (
    COMPARED,
    cap_demo,
    label,
    layout_name,
    ranking,
    validate,
    validation_set,
)

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    parser.add_argument("--rounds", type=int, default=3, help="times the set runs over")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        profiles = {n: calibrated_cluster(n, Path(folder)) for n in (2, 4)}
        profiles[1] = profiles[2].model_copy(update={"num_gpus": 1})
        calibrate_s = time.perf_counter() - start
    for n in (2, 4):
        c = profiles[n]
        print(
            f"profile, {n} workers: GEMM {c.bf16_flops / 1e9:.1f} GFLOP/s, memory "
            f"{c.hbm_bandwidth_Bps / 1e9:.1f} GB/s, all-reduce bus {c.nvlink_Bps / 1e9:.2f} "
            f"GB/s, {c.nvlink_latency_s * 1e6:.0f} us per ring step, "
            f"{c.kernel_overhead_s * 1e6:.0f} us per operator (fitted)"
        )
    print(f"calibration: {calibrate_s:.0f} s")

    start = time.perf_counter()
    entries = validate(
        validation_set(), steps=args.steps, rounds=args.rounds, clusters=profiles.__getitem__
    )
    run_s = time.perf_counter() - start

    layouts: dict[str, list] = {}
    for e in entries:
        layouts.setdefault(label(e), []).append(e)
    print("\nlayout                                   peak error per rank       step s  predicted")
    for name, ranks in layouts.items():
        peaks = " ".join(f"{e.peak_error:+.1%}" for e in ranks)
        measured = max(e.measured_step_s for e in ranks)
        predicted = ranks[0].predicted_step_s or float("nan")
        error = predicted / measured - 1
        print(f"{name:<40} {peaks:<26} {measured:.3f}  {predicted:.3f} ({error:+.0%})")

    within = sum(all(abs(e.peak_error) <= 0.05 for e in ranks) for ranks in layouts.values())
    print(f"\npeak within 5% on every rank: {within} of {len(layouts)} layouts (target: 8)")
    for bucket in COMPARED:
        agree = sum(all(e.buckets[bucket].agrees for e in ranks) for ranks in layouts.values())
        worst = max(abs(e.buckets[bucket].error) for e in entries)
        print(f"  {bucket:<12} within 5% or 1 MiB: {agree} of {len(layouts)}; worst {worst:.1%}")
    both = sum(
        all(abs(e.peak_error) <= 0.05 and all(e.buckets[k].agrees for k in COMPARED) for e in ranks)
        for ranks in layouts.values()
    )
    print(f"  peak and the four buckets agree on every rank: {both} of {len(layouts)} (target: 8)")
    all_peaks = [abs(e.peak_error) for e in entries]
    print(
        f"  per-rank peak |error|: median {statistics.median(all_peaks):.1%}, "
        f"worst {max(all_peaks):.1%}"
    )

    r = ranking(entries)
    print(
        f"\ntime ranking of {len(r.layouts)} layouts: "
        f"{'same order' if r.same_order else f'{r.discordant_pairs} pairs swapped'}, "
        f"mean |error| {r.mean_abs_error:.1%} (target: same order of at least 4, error < 20%)"
    )
    for name, m, p in zip(r.layouts, r.measured_s, r.predicted_s, strict=True):
        print(f"  {name:<40} measured {m:.3f} s, predicted {p:.3f} s ({p / m - 1:+.1%})")
    for name, why in r.left_out.items():
        print(f"  not ranked: {name}: {why}")
    print(
        f"validation set: {run_s:.0f} s for {len(layouts)} layouts x {args.rounds} rounds "
        "(target: one round in CI under 10 min)"
    )

    demo = cap_demo(profiles[2], 62 * MiB)
    print(f"\ncap {demo.cap_bytes / MiB:.0f} MiB, planner margin {demo.margin:.0%}:")
    for what, run in (("rejected", demo.rejected), ("accepted", demo.accepted)):
        print(
            f"  {what}: {layout_name(run.layout)}: "
            f"predicted {run.predicted_peak_bytes / MiB:.1f} MiB, measured "
            + ", ".join(f"{b / MiB:.1f}" for b in run.measured_peak_bytes)
            + " MiB"
        )
    print(f"  shown: {demo.shown}")


if __name__ == "__main__":
    main()
