"""``planner validate``: small layouts run for real (PyTorch) against the cost model, or the
memory-cap demonstration (--cap).

PyTorch is the optional extra ``run``: it is imported when the command runs, so that the rest
of the CLI works without it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from planner.catalog import load_cluster
from planner.errors import PlannerError
from planner.layout import Layout
from planner.specs import ClusterSpec, ModelSpec

if TYPE_CHECKING:
    from planner.run.device import Device
    from planner.run.validate import Entry

Cases = list[tuple[ModelSpec, Layout]]


def validate_command(args: argparse.Namespace) -> None:
    """Run the validation layouts (or the memory-cap demonstration) and print each
    rank's predicted against measured memory and time."""
    try:
        from planner.run.device import Device
        from planner.run.validate import one_gpu_set, small_job, validate, validation_set
    except ImportError as exc:  # torch is the optional extra ``run``
        raise PlannerError(f"validate needs PyTorch: pip install -e '.[run]' ({exc.msg})") from None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    device = Device.of(args.device)
    if args.set.startswith("one-gpu"):
        if not device.is_cuda:
            raise PlannerError(
                f"--set={args.set}: runs real widths at sequence 4,096: needs --device cuda"
            )
        job, cases = one_gpu_set(device.dtype_name, moe=args.set == "one-gpu-moe")
    else:
        job, cases = small_job(dtype=device.dtype_name), validation_set()
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir is not None and not log_dir.is_dir():
        raise PlannerError(f"--log-dir={args.log_dir}: no such directory")
    if args.only:
        bad = [i for i in args.only if not 1 <= i <= len(cases)]
        if bad:
            raise PlannerError(f"--only={bad[0]}: cases are numbered 1..{len(cases)}")
    gpus = device.count() if device.is_cuda else None  # on CUDA, one GPU per rank
    cases = _chosen(cases, args.only, gpus)
    if args.steps < 1:
        raise PlannerError(f"--steps={args.steps}: needs at least 1 timed step")
    if args.rounds < 1:
        raise PlannerError(f"--rounds={args.rounds}: needs at least 1 round")
    if args.cap is not None:
        _cap_demo(args, device)
        return
    profiles = _profiles(cases, args.cluster, device, gpus)
    columns = (TextColumn("running layouts"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("validate", total=len(cases) * args.rounds)
        entries = validate(
            cases,
            job=job,
            log_dir=log_dir,
            steps=args.steps,
            rounds=args.rounds,
            clusters=profiles.get,
            progress=lambda done, _: bar.update(task, completed=done),
            device=device,
        )
    if args.json:
        print(json.dumps([e.model_dump() for e in entries], indent=2))
        return
    _print_entries(entries, gpus)


def _chosen(cases: Cases, only: list[int] | None, gpus: int | None) -> Cases:
    """The cases ``--only`` numbers (each must have a GPU per rank on CUDA), or on CUDA every
    case that has."""
    if only:
        for i in only:
            if gpus is not None and cases[i - 1][1].world_size > gpus:
                raise PlannerError(
                    f"--only={i}: case {i} runs {cases[i - 1][1].world_size} ranks; --device=cuda "
                    f"needs a GPU per rank, {gpus} visible"
                )
        return [cases[i - 1] for i in only]
    if gpus is not None:
        return [case for case in cases if case[1].world_size <= gpus]
    return cases


def _profiles(
    cases: Cases, cluster: str | None, device: Device, gpus: int | None
) -> dict[int, ClusterSpec]:
    """A cluster profile per world size: from ``--cluster``, or calibrated on this machine."""
    from planner.run.calibrate import calibrated_cluster

    profiles: dict[int, ClusterSpec] = {}
    if cluster is not None:
        for ranks in sorted({layout.world_size for _, layout in cases}):
            profiles[ranks] = load_cluster(cluster, gpus=ranks)
    # One rank runs alone on a core as each of two does: it takes the 2-worker profile. On
    # CUDA a profile of n workers needs n GPUs; without them, no step-time prediction.
    worlds = sorted({max(layout.world_size, 2) for _, layout in cases} - set(profiles))
    worlds = [w for w in worlds if gpus is None or w <= gpus]
    err = Console(stderr=True)
    with tempfile.TemporaryDirectory() as folder:
        for ranks in worlds:
            with err.status(f"calibrating this machine with {ranks} workers"):
                profiles[ranks] = calibrated_cluster(ranks, Path(folder), device)
    if 1 in {layout.world_size for _, layout in cases} and 1 not in profiles and 2 in profiles:
        profiles[1] = profiles[2].model_copy(update={"num_gpus": 1})
    return profiles


def _cap_demo(args: argparse.Namespace, device: Device) -> None:
    """``--cap``: plan 2 ranks with and without the memory cap, run both plans, and print
    whether the rejected layout peaks above the cap and the accepted one below."""
    from planner.run.calibrate import calibrated_cluster
    from planner.run.validate import cap_demo, layout_name

    if device.is_cuda:
        raise PlannerError("--cap: the memory-cap demonstration runs on --device cpu only")
    if args.cap <= 0:
        raise PlannerError(f"--cap={args.cap}: must be a positive number of MiB")
    err = Console(stderr=True)
    with tempfile.TemporaryDirectory() as folder:
        if args.cluster is not None:
            cluster = load_cluster(args.cluster, gpus=2)
        else:
            with err.status("calibrating this machine with 2 workers"):
                cluster = calibrated_cluster(2, Path(folder))
    with err.status("planning with and without the cap, and running both plans"):
        demo = cap_demo(cluster, round(args.cap * 2**20))
    if args.json:
        print(json.dumps({**demo.model_dump(), "shown": demo.shown}, indent=2))
        return
    console = Console()
    console.print(
        f"Memory cap {args.cap:g} MiB per rank (the planner keeps {demo.margin * 100:g}% of it "
        "free for its memory model's error: predicted peaks stay within "
        f"{args.cap * (1 - demo.margin):.1f} MiB):"
    )
    for what, run in (("rejected", demo.rejected), ("accepted", demo.accepted)):
        name = layout_name(run.layout)
        measured = ", ".join(f"{b / 2**20:.1f}" for b in run.measured_peak_bytes)
        console.print(
            f"  {what}: {name}: predicted {run.predicted_peak_bytes / 2**20:.1f} MiB, "
            f"measured {measured} MiB per rank, predicted step {run.predicted_step_s:.3f} s"
        )
    verdict = "shown" if demo.shown else "[red]not shown[/red]"
    console.print(f"Rejected layout peaks above the cap and accepted below: {verdict}")


def _error(err: float, ok: bool) -> str:
    """An error figure, red where it is out of bounds."""
    return f"{err:+.1%}" if ok else f"[red]{err:+.1%}[/red]"


def _print_entries(entries: list[Entry], gpus: int | None) -> None:
    """Each rank's predicted against measured memory and time, then the layouts ranked by
    step time."""
    from planner.run.validate import label, ranking

    table = Table(title="cost model vs real run, per rank: error = predicted / measured - 1")
    heads: tuple[str, ...] = ("layout", "rank", "pred MiB", "peak MiB", "peak", "alloc MiB")
    heads += ("resv MiB", "wts", "grads", "opt", "act", "other")
    for col in (*heads, "step s", "time"):
        table.add_column(col, justify="left" if col == "layout" else "right", no_wrap=True)
    for e in entries:
        row = [label(e), str(e.rank), f"{e.predicted_peak_bytes / 2**20:.1f}"]
        row.append(f"{e.measured_peak_bytes / 2**20:.1f}")
        row.append(_error(e.peak_error, abs(e.peak_error) <= 0.05))
        row.append(f"{e.allocated_peak_bytes / 2**20:.1f}")
        reserved = e.reserved_peak_bytes
        row.append(f"{reserved / 2**20:.1f}" if reserved is not None else "not measured")
        for key in ("weights", "grads", "optimizer", "activations", "other"):
            b = e.buckets[key]
            row.append(_error(b.error, b.agrees) if b.measured_bytes else "-")
        row.append(f"{e.measured_step_s:.3f}")
        p = e.predicted_step_s
        row.append(
            _error(p / e.measured_step_s - 1, abs(p / e.measured_step_s - 1) <= 0.2) if p else "-"
        )
        table.add_row(*row)
    console = Console(width=max(Console().width, 160))
    console.print(table)
    console.print(
        "pred MiB: the cost model's peak; peak MiB: measured live tensor bytes in one step "
        "(peak: their error), each bucket at its own highest level; red: off by more than 5% "
        "and 1 MiB. alloc / resv MiB: the CUDA caching allocator's allocated and reserved peaks "
        "(on CPU: the live bytes; reserved not measured). other: pipeline buffers, gathered "
        "weights, reduce "
        "buckets and gradients in flight in backward (predicted as buffers). step s: median "
        "measured step wall time; time: the cost model's step time with a profile of this "
        "machine calibrated for that many workers (red: off by more than 20%)."
    )
    r = ranking(entries, cores=gpus)
    if r.layouts:
        verdict = "same order" if r.same_order else f"[red]{r.discordant_pairs} pairs swapped[/red]"
        console.print(
            f"\nStep-time ranking, fastest first (measured s / predicted s): {verdict}, "
            f"mean |error| {r.mean_abs_error:.1%}"
        )
        for name, m, p in zip(r.layouts, r.measured_s, r.predicted_s, strict=True):
            console.print(f"  {name:<40} {m:.3f} / {p:.3f}")
    for name, why in r.left_out.items():
        console.print(f"  not ranked: {name} ({why})")
