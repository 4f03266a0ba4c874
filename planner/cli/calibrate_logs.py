"""``planner calibrate --log FILE ...``: what a team's training logs teach the cost model.

Every log becomes a measured run (``planner.logs.runs_from_logs``); the time constants are
fitted to the runs' step times and the memory constants to their logged peaks
(``planner.logs.calibrate``), each run held out in turn (fit on every other run, predict this
one). The profile written (``--out``) is the machine with both: ``planner plan --cluster
profile.yaml`` uses it. Last, the logs' own job is planned with the machine before and after
the fit (``--plan-limit`` seconds each), to show how far the fit moves the plan.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from planner.catalog import load_cluster
from planner.errors import PlannerError

if TYPE_CHECKING:
    from planner.logs import LoggedRun
    from planner.logs.calibrate import MemoryReport
    from planner.specs import ClusterSpec

GiB = 2**30


def fit_logs(args: argparse.Namespace) -> None:
    """Read the logs, fit time and memory, write the profile, print what changed."""
    import yaml

    from planner.catalog import cluster_yaml
    from planner.cli.calibrate import print_time_fit
    from planner.fit import fit_runs
    from planner.logs import runs_from_logs
    from planner.logs.calibrate import fit_memory

    if args.cluster is None:
        raise PlannerError("--log: needs --cluster, the machine type the runs ran on (e.g. h100)")
    if args.rounds < 1:
        raise PlannerError(f"--rounds={args.rounds}: must be at least 1")
    if args.plan_limit < 0:
        raise PlannerError(f"--plan-limit={args.plan_limit:g}: must be 0 (no plan) or more")
    base = load_cluster(args.cluster, gpus=1)
    runs = runs_from_logs(args.log)
    path = Path(args.out or f"{Path(base.name).stem}-fitted.yaml")
    if path.parent and not path.parent.is_dir():
        raise PlannerError(f"--out={args.out}: no such directory {path.parent}")
    _print_runs(runs)
    folds = len(runs) if len(runs) >= 2 else 0
    with Console(stderr=True).status("fitting the time constants") as status:
        timed = fit_runs(
            base,
            [r.run() for r in runs],
            folds=folds,
            rounds=args.rounds,
            progress=lambda line: status.update(f"fitting the time constants: {line}"),
        )
        status.update("fitting the memory constants")
        memory = fit_memory(runs)
    fitted = timed.cluster.model_copy(
        update={
            "name": args.name or f"{base.name}-fitted",
            "framework_buffers_at_peak": {k: v[0] for k, v in memory.fitted.items()},
            "framework_fragmentation": {k: v[1] for k, v in memory.fitted.items()},
        }
    )
    note = (
        f"fitted by planner calibrate --log ({len(runs)} logs): step-time MAPE "
        f"{timed.before_mape:.1%} before, {timed.fit_mape:.1%} after"
        + (f", {timed.heldout_mape:.1%} held out" if timed.heldout_mape is not None else "")
        + "; memory: "
        + _memory_summary(memory)
        + f"; the rest kept from {args.cluster}"
    )
    path.write_text(yaml.safe_dump(cluster_yaml(fitted, sources={"fit": note}), sort_keys=False))
    print_time_fit(timed, args.cluster, path)
    _print_memory(memory, runs)
    _print_replayed(runs)
    if args.plan_limit > 0:
        _plan_moves(runs[0], base.name, args.cluster, path, args.plan_limit)


def _print_runs(runs: list[LoggedRun]) -> None:
    """What each log states and measured."""
    table = Table(title=f"{len(runs)} logs read: what each states and measured")
    numbers = ("step s", "steps", "alloc GiB", "resv GiB")
    for col in ("log", "framework", "model", "layout", *numbers):
        table.add_column(col, justify="right" if col in numbers else "left", overflow="fold")
    for r in runs:
        recompute = sorted({b.recompute for s in r.layout.stages for b in s.blocks} - {"none"})
        table.add_row(
            r.name,
            r.framework,
            _model_text(r),
            f"{r.layout.shape()} {'+'.join(recompute) or 'no recompute'}",
            f"{r.step_s:.4f}",
            str(r.iterations),
            f"{r.allocated_peak_bytes / GiB:.2f}" if r.allocated_peak_bytes else "-",
            f"{r.reserved_peak_bytes / GiB:.2f}" if r.reserved_peak_bytes else "-",
        )
    console = _console()
    console.print(table)
    for r in runs:
        for note in r.notes:
            console.print(f"  {r.name}: {note}")


def _console() -> Console:
    """A console wide enough for a table of runs (a pipe's 80 columns fold every cell)."""
    return Console(width=max(Console().width, 140))


def _model_text(run: LoggedRun) -> str:
    """The model's shape in a few words (a log's model has no catalog name)."""
    m = run.model
    experts = f", {m.num_experts} experts top-{m.experts_per_token}" if m.num_experts else ""
    return f"{m.num_layers} layers, hidden {m.hidden_size}{experts}"


def _memory_summary(report: MemoryReport) -> str:
    """The memory errors before, after and held out, in one line."""
    parts = []
    for what, measured in (
        ("allocated", report.measured_allocated),
        ("reserved", report.measured_reserved),
    ):
        before = report.mape(getattr(report, f"before_{what}"), measured)
        if before is None:
            continue
        after = report.mape(getattr(report, f"fitted_{what}"), measured)
        held = report.mape(getattr(report, f"heldout_{what}"), measured)
        parts.append(
            f"{what} peaks MAPE {before:.1%} before, {after:.1%} after"
            + (f", {held:.1%} held out" if held is not None else "")
        )
    return "; ".join(parts) or "no log states memory"


def _print_memory(report: MemoryReport, runs: list[LoggedRun]) -> None:
    """The memory constants before and after, and each run's peaks."""
    console = _console()
    constants = Table(title="memory constants per framework: before (the jobs') and fitted")
    for col in ("constant", "before", "fitted", ""):
        constants.add_column(col, justify="left" if col in ("constant", "") else "right")
    for name in report.frameworks:
        for i, key in enumerate(("buffers_at_peak", "fragmentation")):
            label = f"{key}[{name}]"
            informed = report.informed[name][i]
            note = "" if informed else "no log measures it: kept"
            if label in report.at_bound:
                note = "at its bound: the runs hold something the memory model does not price"
            after = report.fitted[name][i]
            constants.add_row(
                escape(label),
                f"{report.before[name][i]:.3f}",
                f"{after:.3f}" if informed else "-",
                note,
            )
    console.print(constants)
    rows = Table(
        title="memory peaks per run: measured GiB, and the error before, fitted and held out"
    )
    stages = ("before", "fitted", "held out")
    for col in ("log", "alloc GiB", *stages, "resv GiB", *stages):
        left = col == "log"
        rows.add_column(col, justify="left" if left else "right", overflow="fold")

    def cells(what: str, i: int) -> list[str]:
        measured = getattr(report, f"measured_{what}")[i]
        if np.isnan(measured):
            return ["-"] * 4
        out = [f"{measured / GiB:.2f}"]
        for stage in ("before", "fitted", "heldout"):
            value = getattr(report, f"{stage}_{what}")[i]
            out.append("-" if np.isnan(value) else f"{value / measured - 1:+.1%}")
        return out

    for i, r in enumerate(runs):
        rows.add_row(r.name, *cells("allocated", i), *cells("reserved", i))
    console.print(rows)
    console.print(
        "Memory: " + _memory_summary(report) + ". allocated: the allocator's max_memory_allocated; "
        "reserved: max_memory_reserved (NCCL's own buffers and the CUDA context are in neither)."
    )


def replayable(run: LoggedRun) -> bool:
    """Whether a log's reserved peak can be set against its requests written without a GPU:
    the project's own runtime (``planner validate``'s logs, framework "torch") on one GPU,
    with a reserved peak logged and PyTorch installed."""
    import importlib.util

    from planner.frameworks import framework

    return (
        framework(run.framework).own_runtime
        and run.layout.world_size == 1
        and bool(run.reserved_peak_bytes)
        and importlib.util.find_spec("torch") is not None
    )


def replayed_reserved(run: LoggedRun) -> int:
    """The reserved peak (bytes) of the run's layout, its caching allocator's requests
    written on the meta device (``planner.run.requests``) and replayed
    (``planner.allocator``): nothing fitted."""
    from planner.allocator import replay
    from planner.run.requests import requests

    return replay(requests(run.model, run.job, run.layout)).peak_reserved


def _print_replayed(runs: list[LoggedRun]) -> None:
    """Each own one-GPU run's reserved peak against its requests replayed, where it has one."""
    mine = [r for r in runs if replayable(r)]
    if not mine:
        return
    table = Table(
        title="reserved peaks replayed: the runtime's requests written without a GPU "
        "(planner.run.requests) through the caching allocator; nothing fitted"
    )
    for col in ("log", "resv GiB", "replayed GiB", "error"):
        table.add_column(col, justify="left" if col == "log" else "right", overflow="fold")
    errors = []
    with Console(stderr=True).status("replaying the runs' requests") as status:
        for i, r in enumerate(mine, 1):
            status.update(f"replaying the runs' requests: {r.name} ({i} of {len(mine)})")
            measured = r.reserved_peak_bytes or 1
            try:
                reserved = replayed_reserved(r)
            except PlannerError as exc:  # a layout the runtime does not run: said, not fatal
                table.add_row(r.name, f"{measured / GiB:.2f}", "-", f"not replayed: {exc}")
                continue
            errors.append(reserved / measured - 1)
            table.add_row(
                r.name, f"{measured / GiB:.2f}", f"{reserved / GiB:.2f}", f"{errors[-1]:+.1%}"
            )
    console = _console()
    console.print(table)
    if not errors:
        return
    routed = any(r.model.num_experts for r in mine)
    console.print(
        f"Reserved peaks replayed: MAPE {np.mean(np.abs(errors)):.1%} over {len(errors)} logs "
        f"(worst {max(errors, key=abs):+.1%})."
        + (
            " A router's tokens per expert are taken even: the runs' own routing is not in "
            "their logs."
            if routed
            else ""
        )
    )


def _plan_moves(run: LoggedRun, name: str, cluster: str, path: Path, limit: float) -> None:
    """Plan the first log's job on its GPU count with the machine before and after the fit."""
    from planner.solve import plan

    console = _console()
    gpus = run.layout.world_size
    found = []
    with Console(stderr=True).status(f"planning the logs' job on {gpus} GPUs, before and after"):
        for source in (cluster, str(path)):
            machine: ClusterSpec = load_cluster(source, gpus=gpus)
            try:
                found.append(plan(run.model, machine, run.job, time_limit_s=limit))
            except PlannerError as exc:
                console.print(f"The logs' job is not planned: {exc}")
                return
    before, after = found
    console.print(
        f"The logs' job ({run.name}: {run.job.seq_len:,} tokens x {run.job.global_batch} "
        f"sequences on {gpus} GPU{'s' * (gpus > 1)}), planned for {limit:g} s each:"
    )
    for what, result in ((f"{name} before the fit", before), (f"{path} after it", after)):
        if result.layout is None or result.estimate is None:
            console.print(f"  {what}: no layout fits")
            continue
        est = result.estimate
        console.print(
            f"  {what}: {result.layout.shape()}, {est.step_time_s:.3f} s a step predicted, "
            f"peak {est.peak_bytes / GiB:.1f} GiB of {est.cap_bytes / GiB:.1f} GiB usable"
        )
    if before.layout is not None and after.layout is not None:
        same = before.layout == after.layout
        console.print(
            "  The fit leaves the plan's layout as it was."
            if same
            else "  The fit moves the plan to another layout."
        )
