"""``planner sweep``: many cases planned, resumably, with their rows as a table, JSON, a file or
curves."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from planner.cli.inputs import positive_seconds, training_job, writable_file
from planner.cli.render import writable
from planner.errors import PlannerError
from planner.plots import picture_format


def sweep_command(args: argparse.Namespace) -> None:
    """Plan every case the lists make, resuming from the database; print or write the rows."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from planner.sweep import cases, run, write

    positive_seconds(args.time_limit)
    if args.workers is not None and args.workers <= 0:
        raise PlannerError(f"--workers={args.workers}: must be a positive process count")
    jobs = [training_job(args, s, b) for s in args.seq_len for b in args.global_batch]
    if args.plot:
        picture_format(args.plot, option="--plot")
    writable_file("--out", args.out)  # before the cases run, not after
    writable_file("--db", args.db)
    # Bad input fails here, in one line, before any progress bar is drawn.
    todo = cases(
        args.model,
        args.gpus,
        clusters=args.cluster,
        jobs=jobs,
        time_limit_s=args.time_limit,
        warm_start=not args.no_warm_start,
    )
    columns = (
        TextColumn("sweep"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[state]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=args.json) as bar:
        task = bar.add_task("sweep", total=None, state="")

        def progress(done: int, running: int, failed: int, total: int) -> None:
            state = f"{running} running, {failed} failed"
            bar.update(task, completed=done, total=total, state=state)

        rows = run(
            todo,
            db=args.db,
            workers=args.workers,
            ray_address=args.ray,
            retry_failed=args.retry_failed,
            progress=progress,
            refine=not args.no_refine,
        )
    if args.out:
        write(rows, args.out)
    if args.plot:
        from planner.plots import plot_sweep

        print(f"sweep curves: {writable(args.plot, plot_sweep, rows)}", file=sys.stderr)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "plan"} for r in rows], indent=1))
        return
    _print_rows(rows, args.db)


def _print_rows(rows: list[dict[str, Any]], db: str) -> None:
    """One line per case: its plan's step, MFU, throughput and peak, or why it has none."""
    table = Table(title=f"sweep: {len(rows)} cases (database {db})")
    for col, justify in (
        ("model", "left"),
        ("GPUs", "right"),
        ("status", "left"),
        ("step (s)", "right"),
        ("MFU (of BF16 peak)", "right"),
        ("tokens/s", "right"),
        ("peak (GiB)", "right"),
        ("layout / why not", "left"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        ok = r.get("step_time_s") is not None
        table.add_row(
            r["model"],
            f"{r['gpus']} {r['gpu']}",
            r["status"],
            f"{r['step_time_s']:.3f}" if ok else "",
            f"{r['mfu']:.1%}" if ok else "",
            f"{r['tokens_per_s']:,.0f}" if ok else "",
            f"{r['peak_gib']:.1f}" if ok else "",
            (r.get("layout") or (r.get("error") or "")[:80])
            + (" (from another count's plan)" if r.get("refined") else ""),
        )
    Console(width=max(Console().width, 132)).print(table)
