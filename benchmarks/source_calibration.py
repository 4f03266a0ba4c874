"""Constants fitted across sources, judged on the source held out (leave one source out).

For each GPU with runs from several sources, the catalog's constants (``planner.fit.CONSTANTS``:
achieved fractions of GEMM, attention, memory-bound, NVLink and InfiniBand peaks; per-kernel GPU
and host overheads; link latencies) are fitted (``planner.fit.fit_runs``, within physical
bounds) to every source but one, and that source's runs are predicted with them. A source is
one publication or measurement set:

- ``vtrain``: vTrain's single-node A100 iterations (Megatron-DeepSpeed, small GPTs; every
  ``--vtrain-every``-th row, to bound the run time);
- ``megatron-ci``: Megatron-LM's functional tests (``benchmarks/megatron_ci_runs.csv``);
- each source of ``benchmarks/published_runs.csv`` (a paper, a repository's benchmark page),
  named as ``benchmarks/rankings.py`` names it.

Printed per GPU: each source's rows, its error at the catalog's constants and held out (mean
|error| and mean signed error), the constants fitted without it, and the constants fitted on
all sources. A held-out error that does not improve on the catalog's means the constants do
not carry from one source to another; a fitted value far from its datasheet or benchmark
source (a host overhead of a millisecond, InfiniBand at a tenth of its line rate) means a
mechanism is missing.

Run: ``.venv/bin/python benchmarks/source_calibration.py [--gpu a100 h100] [--rounds 2]
[--vtrain-every 3] [--ci-every 1] [--exclude megatron-ci vtrain]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import published_throughput
import rankings
import vtrain_fidelity

import planner
from planner.fit import Run, fit_runs, predict

# Where the host overhead starts (us per kernel): above the GPU's time on small models, so the
# fit can see it (a maximum's losing term has no slope; vtrain_fidelity.START_HOST_US).
START = {"host_overhead_s": vtrain_fidelity.START_HOST_US}


def _csv_runs(path: Path, name: str | None, every: int) -> dict[tuple[str, str], list[Run]]:
    """Runs of a runs CSV by (GPU, source); ``name`` names every row's source if given."""
    out: dict[tuple[str, str], list[Run]] = defaultdict(list)
    rows = published_throughput.read_rows(path)[::every]
    for row, _, _, costed in published_throughput.costed_rows(rows):
        source = name or rankings.source_key(row["source"])
        out[(row["gpu"], source)].append(costed.run)
    return out


def load(vtrain_every: int, ci_every: int) -> dict[str, dict[str, list[Run]]]:
    """Runs by GPU, then by source."""
    by: dict[str, dict[str, list[Run]]] = defaultdict(dict)
    rows = vtrain_fidelity.read_rows(vtrain_fidelity.DATA)[::vtrain_every]
    by["a100"]["vtrain"] = vtrain_fidelity.runs(rows)
    found = _csv_runs(published_throughput.DATA, None, 1)
    if rankings.CI_RUNS.exists():
        found |= _csv_runs(rankings.CI_RUNS, "megatron-ci", ci_every)
    for (gpu, source), runs in found.items():
        by[gpu][source] = runs
    return by


def errors(predicted: np.ndarray, runs: list[Run]) -> tuple[float, float]:
    """(mean |error|, mean signed error) of ``predicted`` seconds against ``runs``."""
    measured = np.array([r.measured_step_s for r in runs])
    e = predicted / measured - 1
    return float(np.abs(e).mean()), float(e.mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", nargs="+", default=["a100", "h100"])
    parser.add_argument("--rounds", type=int, default=2, help="linearisation rounds per fit")
    parser.add_argument("--vtrain-every", type=int, default=3)
    parser.add_argument("--ci-every", type=int, default=1)
    parser.add_argument(
        "--exclude",
        nargs="+",
        default=[],
        metavar="SOURCE",
        help="leave these sources out of every fit and every figure (e.g. megatron-ci vtrain: "
        "the published training runs alone)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    by = load(args.vtrain_every, args.ci_every)
    for gpu in args.gpu:
        sources = {s: r for s, r in by.get(gpu, {}).items() if r and s not in args.exclude}
        if len(sources) < 2:
            print(f"{gpu}: {len(sources)} source(s), nothing to hold out")
            continue
        catalog = planner.load_cluster(gpu, gpus=8)
        total = sum(len(r) for r in sources.values())
        print(f"\n== {gpu}: {total} runs from {len(sources)} sources")
        print(
            f"  {'source held out':34} {'rows':>5} {'catalog |e|':>11} {'bias':>7} "
            f"{'held out |e|':>12} {'bias':>7}  constants fitted on the others"
        )
        pooled_before: list[float] = []
        pooled_after: list[float] = []
        for held, runs in sorted(sources.items(), key=lambda kv: -len(kv[1])):
            train = [r for s, rs in sources.items() if s != held for r in rs]
            found = fit_runs(catalog, train, folds=0, rounds=args.rounds, start=START)
            before = predict(catalog, runs)
            after = predict(found.cluster, runs)
            b_mape, b_bias = errors(before, runs)
            a_mape, a_bias = errors(after, runs)
            pooled_before += [b_mape] * len(runs)
            pooled_after += [a_mape] * len(runs)
            print(
                f"  {held[:34]:34} {len(runs):5} {b_mape:11.1%} {b_bias:+7.1%} "
                f"{a_mape:12.1%} {a_bias:+7.1%}  {found.fitted_text()}",
                flush=True,
            )
        every = [r for rs in sources.values() for r in rs]
        found = fit_runs(catalog, every, folds=0, rounds=args.rounds, start=START)
        print(
            f"  all {total} runs: catalog {np.mean(pooled_before):.1%}, each source held out "
            f"{np.mean(pooled_after):.1%} (row-weighted); fitted on all: "
            f"{found.fitted_text()} (informed: {', '.join(found.informed)})"
        )
    print(f"wall time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
