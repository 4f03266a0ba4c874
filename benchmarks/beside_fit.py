"""The share of its rate a collective keeps beside compute (``costs.overlap.BESIDE_COMPUTE``),
within what was measured, judged on the published corpus source by source.

On one H200 a collective's stand-in (a grid-stride copy on a second stream) kept 0.29-0.31
of its rate alone beside a Llama 3 8B layer's forward and backward with 256-thread blocks,
and 0.48-0.52 with 512-thread blocks, NCCL's default (``benchmarks/logs/h200/overlap``): the
physical range. This simulates every row of ``benchmarks/published_runs.csv``
(``published_throughput.costed_rows``) at each share of a grid over that range, then, for
each source (``rankings.source_key``), picks the share that fits every other source best
(mean absolute error of the simulated step) and predicts the held-out source with it. Only
rows whose collectives overlap compute over NVLink move; printed: each share's error over
all rows and over the rows that move, the held-out errors, and each moving row.

Run: ``.venv/bin/python benchmarks/beside_fit.py`` (about 8 minutes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import published_throughput
import rankings

import planner
from planner.costs import overlap
from planner.simulate import simulated_step

GRID = (0.29, 0.35, 0.41, 0.47, 0.52)


def main() -> int:
    rows = published_throughput.read_rows()
    shipped = overlap.BESIDE_COMPUTE
    sims: dict[float, list[float]] = {}
    meta = []
    for row, measured, _closed, costed in published_throughput.costed_rows(rows):
        cluster = planner.load_cluster(
            published_throughput.PROFILES.get(row["gpu"], row["gpu"]), gpus=int(row["num_gpus"])
        )
        run = costed.run
        meta.append((row["id"], rankings.source_key(row["source"]), measured, (run, cluster)))
    for share in GRID:
        overlap.BESIDE_COMPUTE = share
        out = []
        for _, _, _, (run, cluster) in meta:
            out.append(simulated_step(run.model, cluster, run.job, run.layout))
        sims[share] = out
    overlap.BESIDE_COMPUTE = shipped
    measured = np.array([m for _, _, m, _ in meta])
    err = {s: np.array(v) / measured - 1 for s, v in sims.items()}
    moving = [i for i in range(len(meta)) if abs(err[GRID[0]][i] - err[GRID[-1]][i]) > 1e-6]
    print(f"{len(meta)} rows; {len(moving)} move with the share")
    for s in GRID:
        e = err[s]
        print(
            f"  share {s:.2f}: all rows {np.mean(abs(e)):.2%} ({np.mean(e):+.2%}); moving rows "
            f"{np.mean(abs(e[moving])):.2%} ({np.mean(e[moving]):+.2%})"
        )
    sources = sorted({src for _, src, _, _ in meta})
    held: list[float] = []
    print("held out by source (the share fitted on every other source):")
    for src in sources:
        mine = [i for i, m in enumerate(meta) if m[1] == src]
        rest = [i for i, m in enumerate(meta) if m[1] != src]
        best = min(GRID, key=lambda s: float(np.mean(abs(err[s][rest]))))
        e = err[best][mine]
        held += list(e)
        if any(i in moving for i in mine):
            print(f"  {src[:60]:60s} {len(mine):3d} rows: share {best:.2f}, {np.mean(abs(e)):.2%}")
    best_all = min(GRID, key=lambda s: float(np.mean(abs(err[s]))))
    print(
        f"  held out, all rows: {np.mean(np.abs(held)):.2%} ({np.mean(held):+.2%}); "
        f"fitted on all: {best_all:.2f}"
    )
    print("moving rows (error at each share):")
    for i in moving:
        cells = " ".join(f"{err[s][i]:+6.1%}" for s in GRID)
        print(f"  {meta[i][0][:56]:56s} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
