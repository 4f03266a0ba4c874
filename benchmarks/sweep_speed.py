"""Sweep speed: DeepSeek-V3 and Llama 3 70B over 16 GPU counts from 64 to 16,384, then the
same sweep again from its database.

Run: ``.venv/bin/python benchmarks/sweep_speed.py [--time-limit SECONDS] [--workers N]``.
Prints the wall time of the first run (every case planned), of the second (read back from
SQLite), each case's status, and writes ``sweep_speed.svg`` beside the database.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import planner
from planner.plots import plot_sweep

GPUS = [64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 16384]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=8.0, help="per case (s)")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--db", default=None, help="database path (default: a fresh temp file)")
    args = parser.parse_args()
    db = Path(args.db) if args.db else Path(tempfile.mkdtemp()) / "sweep.sqlite"
    job = planner.TrainingJob(
        seq_len=4096, global_batch=15360, compute_dtype="fp8", moment_dtype="bf16"
    )
    models = ["deepseek-v3", "llama3-70b"]
    runs = []
    for attempt in ("first", "second"):
        started = time.perf_counter()
        rows = planner.sweep(
            models,
            GPUS,
            clusters=["h800"],
            jobs=[job],
            time_limit_s=args.time_limit,
            db=db,
            workers=args.workers,
        )
        runs.append(time.perf_counter() - started)
        print(f"{attempt} run: {len(rows)} cases in {runs[-1]:.1f} s")
    for r in rows:
        figure = ""
        if r.get("step_time_s"):
            figure = f"{r['step_time_s']:.2f} s, gap {r['gap']:.1%}, MFU {r['mfu']:.1%}"
        where = f"  {r['model']:12} {r['gpus']:>6} GPUs: {r['status']:10}"
        print(f"{where} {figure} {r.get('layout') or ''}")
    gaps = sorted(r["gap"] for r in rows if r.get("gap") is not None)
    proven = sum(1 for r in rows if r["status"] in ("optimal", "infeasible"))
    if gaps:
        print(
            f"{proven} of {len(rows)} cases proven (optimal or infeasible); gap median "
            f"{gaps[len(gaps) // 2]:.1%}, worst {gaps[-1]:.1%}"
        )
    picture = plot_sweep(rows, db.with_suffix(".svg"))
    print(f"first run {runs[0]:.1f} s, second {runs[1]:.2f} s; curves in {picture}")


if __name__ == "__main__":
    main()
