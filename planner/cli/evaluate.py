"""``planner memory``, ``planner evaluate`` and ``planner simulate``: one stated layout's
memory, step time, and event-by-event step."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from planner.cli.inputs import build, writable_file
from planner.cli.render import GiB, plot_estimate, print_groups, print_memory, print_time
from planner.estimate import evaluate
from planner.simulate import simulate


def evaluate_command(args: argparse.Namespace) -> bool:
    """Print the layout's memory (and time); whether it fits."""
    model, cluster, job, layout = build(args)
    est = evaluate(model, cluster, job, layout)
    if args.plot:
        plot_estimate(args.plot, est, model.name)
    if args.json:
        print(json.dumps({"layout": layout.model_dump(), "estimate": est.model_dump()}, indent=1))
    else:
        print_memory(model.name, layout, est, job.memory_margin)
        if args.command == "evaluate":
            print_time(est, job, layout, cluster)
            print_groups(layout, cluster)
    if not est.fits:  # exit 3: the reason on stderr too, where scripts look
        over = (est.peak_bytes - est.cap_bytes) / 2**30
        print(
            f"planner: the layout does not fit: its heaviest rank peaks {over:.2f} GiB over the "
            f"cap of {est.cap_bytes / 2**30:.2f} GiB (usable HBM less the "
            f"{job.memory_margin:.0%} margin)",
            file=sys.stderr,
        )
    return est.fits


def simulate_command(args: argparse.Namespace) -> None:
    """Print the layout's step event by event per pipeline rank, against the estimate."""
    writable_file("--trace", args.trace)
    model, cluster, job, layout = build(args)
    sim = simulate(model, cluster, job, layout)
    est = evaluate(model, cluster, job, layout)
    if args.plot:
        plot_estimate(args.plot, est, model.name)
    path = sim.to_chrome_trace(args.trace) if args.trace else None
    if args.json:
        out = {
            "step_time_s": sim.step_time_s,
            "analytic_step_time_s": est.step_time_s,
            "busy_s": sim.busy_s,
            "idle_s": sim.idle_s,
            "peak_bytes": sim.peak_bytes,
            "link_busy_s": sim.link_busy_s,
            "trace": str(path) if path else None,
        }
        print(json.dumps(out, indent=1))
        return
    console = Console(width=max(Console().width, 100))
    table = Table(title=f"{model.name}: simulated step, per pipeline rank")
    links = sorted(sim.link_busy_s)
    for col in ("rank", "busy (s)", "idle (s)", "idle", "peak (GiB)", *links):
        table.add_column(col, justify="right")
    for r, (busy, idle, peak) in enumerate(
        zip(sim.busy_s, sim.idle_s, sim.peak_bytes, strict=True)
    ):
        table.add_row(
            str(r),
            f"{busy:.3f}",
            f"{idle:.3f}",
            f"{idle / sim.step_time_s:.0%}",
            f"{peak / GiB:.2f}",
            *(f"{sim.link_busy_s[k][r] / sim.step_time_s:.0%}" for k in links),
        )
    console.print(table)
    diff = sim.step_time_s / est.step_time_s - 1
    console.print(
        f"Simulated step {sim.step_time_s:.3f} s; analytic estimate {est.step_time_s:.3f} s "
        f"(simulated {diff:+.1%}). Busy: the compute stream's seconds; the link columns: the "
        f"share of the step each of the rank's links (InfiniBand share, NVLink ports; each "
        f"direction) is in full use. The simulator executes each rank's kernels and "
        f"transfers on shared streams, SMs and links (planner.executor); the estimate prices "
        f"overlap by a rule per schedule."
        + (f" Trace written to {path} (open in https://ui.perfetto.dev)." if path else "")
    )
