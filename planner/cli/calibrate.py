"""``planner calibrate``: a cluster profile fitted to measured runs (--runs), measured on this
machine, or one device's sweep against the cost model (--sweep)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from planner.catalog import load_cluster
from planner.errors import PlannerError

if TYPE_CHECKING:
    from planner.fit import FitReport
    from planner.run.device import Device


# For a constant a fit leaves at its bound: the runs whose time it sets apart from the others.
PINNED_BY = {
    "gemm": "large models at large micro-batches, where the step is mostly GEMMs",
    "attention": "long sequences (8,192 tokens and more) at several lengths",
    "memory_bound": "small hidden sizes, where norms and activations weigh",
    "nvlink": "tensor parallelism of 2 to 8 within a node at several widths",
    "ib": "data or pipeline parallelism across nodes at several GPU counts",
    "kernel_overhead_s": "small models, where the GPU's time per kernel shows",
    "host_overhead_s": "small models at micro-batch 1, where the host's launches bind",
    "nvlink_latency_s": "small messages within a node (high tp, small micro-batches)",
    "ib_latency_s": "small messages across nodes (many nodes, small micro-batches)",
}


def calibrate_command(args: argparse.Namespace) -> None:
    """Fit to runs, sweep one device, or measure this machine into a profile YAML."""
    if args.runs is not None and args.log is not None:
        raise PlannerError("--runs and --log: give one (a CSV of runs, or training logs)")
    if args.runs is not None:
        _fit_runs(args)
        return
    if args.log is not None:
        from planner.cli.calibrate_logs import fit_logs

        fit_logs(args)
        return
    if args.cluster is not None and not args.sweep:
        raise PlannerError(
            "--cluster: only with --runs or --sweep (without them, calibrate measures this machine)"
        )
    try:
        from planner.run.calibrate import measure, write_profile
        from planner.run.device import Device
    except ImportError as exc:  # torch is the optional extra ``run``
        raise PlannerError(
            f"calibrate needs PyTorch: pip install -e '.[run]' ({exc.msg})"
        ) from None

    device = Device.of(args.device)
    if args.sweep:
        _device_sweep(args, device)
        return
    if args.processes < 2:
        raise PlannerError(f"--processes={args.processes}: needs at least 2 (pairs for p2p)")
    device.check_workers(args.processes, "--processes")
    machine = f"{device.kind}-{args.processes}"
    path = Path(args.out or f"{machine}.yaml")
    if path.parent and not path.parent.is_dir():
        raise PlannerError(f"--out={args.out}: no such directory {path.parent}")
    with Console(stderr=True).status(f"measuring with {args.processes} workers"):
        found = measure(args.processes, device)
    data = write_profile(found, path, name=args.name or machine)
    _print_profile(data, path, args.processes, device)


def _print_profile(data: dict[str, Any], path: Path, processes: int, device: Device) -> None:
    """The measured rates, and each block's measured time against the profile's prediction."""
    console = Console()
    rates = Table(title=f"{path}: this machine as {processes} 'GPUs'")
    rates.add_column("quantity")
    rates.add_column("value", justify="right")
    for what, value in (
        (f"GEMM ({device.dtype_name.upper()})", f"{data['bf16_dense_tflops'] * 1e3:.1f} GFLOP/s"),
        (
            "attention",
            f"{data['bf16_dense_tflops'] * data['achieved']['attention'] * 1e3:.1f} GFLOP/s",
        ),
        ("memory copy", f"{data['hbm_bandwidth_GBps']:.1f} GB/s"),
        ("all-reduce bus bandwidth", f"{data['nvlink_GBps_per_direction']:.2f} GB/s"),
        ("latency per ring step", f"{data['nvlink_latency_us']:.1f} us"),
        ("per-operator overhead (fitted)", f"{data['kernel_overhead_us']:.1f} us"),
    ):
        rates.add_row(what, value)
    console.print(rates)
    checks = Table(
        title="block times, one micro-batch: measured vs the cost model with this profile"
    )
    for col in ("block", "phase", "measured ms", "predicted ms", "error"):
        checks.add_column(col, justify="left" if col in ("block", "phase") else "right")
    for c in data["checks"]:
        error = f"{c['error']:+.1%}" if c["error"] is not None else "-"
        checks.add_row(
            c["block"],
            c["phase"],
            f"{c['measured_s'] * 1e3:.2f}",
            f"{c['predicted_s'] * 1e3:.2f}",
            error,
        )
    console.print(checks)
    console.print(f"Use it with --cluster {path} (plan, evaluate, simulate, validate).")


def _device_sweep(args: argparse.Namespace, device: Device) -> None:
    """``calibrate --sweep``: one device against the cost model (``planner.run.bench``)."""
    from planner.run.bench import sweep
    from planner.run.benchtable import print_sweep

    path = Path(args.out or f"sweep-{device.kind}.json")
    if path.parent and not path.parent.is_dir():
        raise PlannerError(f"--out={args.out}: no such directory {path.parent}")
    reference = load_cluster(args.cluster, gpus=1) if args.cluster else None
    with Console(stderr=True).status(f"measuring {device.name()}") as status:
        result = sweep(
            device,
            scale=args.scale,
            reference=reference,
            progress=lambda what: status.update(f"measuring {device.name()}: {what}"),
        )
    path.write_text(result.model_dump_json(indent=2))
    print_sweep(result, Console(width=max(Console().width, 150)))
    Console().print(f"Every row: {path}")


def _fit_runs(args: argparse.Namespace) -> None:
    """``calibrate --runs``: the cost model's constants fitted to measured step times."""
    import yaml

    from planner.catalog import cluster_yaml
    from planner.fit import fit_runs, read_runs

    if args.cluster is None:
        raise PlannerError("--runs: needs --cluster, the machine type the runs ran on (e.g. h100)")
    if args.rounds < 1:
        raise PlannerError(f"--rounds={args.rounds}: must be at least 1")
    base = load_cluster(args.cluster, gpus=1)
    runs = read_runs(args.runs, gpu=base.name)
    if args.folds is None:
        args.folds = min(5, len(runs)) if len(runs) >= 2 else 0
    if args.folds == 1 or args.folds < 0 or args.folds > len(runs):
        raise PlannerError(
            f"--folds={args.folds}: must be 0 (none) or 2..{len(runs)} (the number of runs)"
        )
    path = Path(args.out or f"{Path(base.name).stem}-fitted.yaml")
    if path.parent and not path.parent.is_dir():
        raise PlannerError(f"--out={args.out}: no such directory {path.parent}")
    errors = Console(stderr=True)
    with errors.status("fitting") as status:
        report = fit_runs(
            base,
            runs,
            folds=args.folds,
            rounds=args.rounds,
            progress=lambda line: status.update(f"fitting: {line}"),
        )
    fitted = report.cluster.model_copy(update={"name": args.name or f"{base.name}-fitted"})
    held = report.heldout_mape
    note = (
        f"fitted by planner calibrate --runs {args.runs} ({len(runs)} runs): MAPE "
        f"{report.before_mape:.1%} before, {report.fit_mape:.1%} after"
        + (f", {held:.1%} held out ({report.folds}-fold)" if held is not None else "")
        + f"; informed: {', '.join(report.informed) or 'none'}; the rest kept from {args.cluster}"
    )
    path.write_text(yaml.safe_dump(cluster_yaml(fitted, sources={"fit": note}), sort_keys=False))
    print_time_fit(report, args.cluster, path)


def print_time_fit(report: FitReport, cluster: str, path: Path) -> None:
    """The fitted time constants beside those of the machine ``cluster`` names, and each
    run's seconds per step measured, predicted before and after the fit, and held out."""
    console = Console(width=max(Console().width, 140))
    runs = report.runs
    base = load_cluster(cluster, gpus=1)
    held = report.heldout_mape
    constants = Table(title=f"{path}: constants fitted to {len(runs)} measured runs")
    for col in ("constant", "before", "fitted", ""):
        constants.add_column(col, justify="left" if col in ("constant", "") else "right")
    for c in report.constants:
        unit = "" if c.fraction else " us"
        before = c.show(c.read(base))
        after = report.values[c.name]
        informed = c.name in report.informed
        note = "no run depends on it: kept"
        if c.name in report.at_bound:
            note = (
                "at its physical bound: the runs hold something the model does not price; "
                f"runs that pin it: {PINNED_BY.get(c.key, 'more varied runs')}"
            )
        elif informed:
            note = ""
        constants.add_row(
            escape(c.name), f"{before:.3g}{unit}", f"{after:.3g}{unit}" if informed else "-", note
        )
    console.print(constants)
    rows = Table(title="seconds per step: measured, and predicted before and after the fit")
    for col in ("run", "measured s", "before s", "fitted s", "error", "held-out error"):
        rows.add_column(col, justify="left" if col == "run" else "right")
    for i, run in enumerate(report.runs):
        m = report.measured_s[i]
        rows.add_row(
            run.name,
            f"{m:.3f}",
            f"{report.before_s[i]:.3f}",
            f"{report.fitted_s[i]:.3f}",
            f"{report.fitted_s[i] / m - 1:+.1%}",
            f"{report.heldout_s[i] / m - 1:+.1%}" if report.heldout_s is not None else "-",
        )
    console.print(rows)
    console.print(
        f"MAPE {report.before_mape:.1%} with {cluster}'s constants, {report.fit_mape:.1%} "
        "fitted"
        + (
            f", {held:.1%} on runs each fold did not see ({report.folds}-fold)"
            if held is not None
            else ""
        )
    )
    if held is not None and held >= report.before_mape:
        console.print(
            f"The fit predicts the runs it did not see no better than {cluster}'s own "
            f"constants ({held:.1%} held out against {report.before_mape:.1%}): keep "
            f"--cluster {cluster}, or add runs that differ in what the constants price "
            "(GPU counts across nodes, model sizes, micro-batches, tp)."
        )
    console.print(f"Use it with --cluster {path} (plan, evaluate, simulate).")
