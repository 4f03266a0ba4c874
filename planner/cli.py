"""The ``planner`` command: a thin map from subcommand to library call, then printing.

User mistakes print one line on stderr and exit with code 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from planner.catalog import cluster_names, load_cluster, load_model, model_names
from planner.costs.memory import BUCKETS
from planner.errors import PlannerError
from planner.estimate import Estimate, evaluate
from planner.layout import SCHEDULES, Layout
from planner.plots import picture_format, picture_paths
from planner.recipes import Recipe, load_recipe, recipe_names
from planner.simulate import simulate
from planner.solve import plan
from planner.solve.result import Plan
from planner.specs import ClusterSpec, ModelSpec, SearchSpace, TrainingJob

GiB = 2**30
SHORT = {"optimizer": "optim", "activations": "activ", "fragmentation": "frag", "context": "ctx"}
PLOT_PREFIX_HELP = "write PREFIX-memory.svg and PREFIX-time.svg (PREFIX.png or .pdf: that format)"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's own usage errors: one line, exit 2
        print(f"planner: {message}", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="planner", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, what in (
        ("models", "the model catalog"),
        ("clusters", "the machine types"),
        ("recipes", "the published layouts (--recipe NAME)"),
    ):
        listing = sub.add_parser(name, help=f"list {what}")
        listing.add_argument("--json", action="store_true", help="print JSON for machines")
    _layout_args(sub.add_parser("memory", help="per-rank memory of a stated layout"))
    _layout_args(sub.add_parser("evaluate", help="memory and step time of a stated layout"))
    pl = sub.add_parser("plan", help="find the fastest layout that fits, with its proof")
    _job_args(pl)
    for degree in ("tp", "cp", "pp", "ep", "etp", "micro-batch", "zero"):
        pl.add_argument(f"--{degree}", type=int, nargs="+", default=None, help=f"allowed {degree}")
    pl.add_argument("--schedule", nargs="+", choices=SCHEDULES, default=None, help="allowed")
    pl.add_argument("--recompute", nargs="+", default=None, help="allowed recompute choices")
    pl.add_argument(
        "--fp8-cache",
        action="store_true",
        help="also try keeping SwiGLU inputs in FP8 (FP8 compute, framework megatron)",
    )
    pl.add_argument(
        "--optimizer-offload",
        type=float,
        nargs="+",
        default=None,
        metavar="FRACTION",
        help="allowed fractions of the optimizer state kept and stepped on the host, e.g. 0 1 "
        "(default 0: not searched; megatron with ZeRO-1, or deepspeed with 1)",
    )
    pl.add_argument(
        "--sequence-parallel",
        nargs="+",
        choices=["on", "off"],
        default=None,
        help="allowed sequence parallelism where tp > 1 (default on: it never loses)",
    )
    pl.add_argument(
        "--target",
        default="any",
        choices=["any", "megatron", "torchtitan", "deepspeed"],
        help="only plans this launcher can state",
    )
    pl.add_argument("--time-limit", type=float, default=10.0, help="wall-clock seconds")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--plot", default=None, metavar="PREFIX", help=PLOT_PREFIX_HELP)
    ex = sub.add_parser("export", help="launch config of a plan (from planner plan --json)")
    ex.add_argument("--plan", required=True, help="a plan JSON file ('-' reads stdin)")
    ex.add_argument("--target", required=True, choices=["megatron", "torchtitan", "deepspeed"])
    ex.add_argument("--out", default=None, help="directory to write the config files into")
    ex.add_argument("--json", action="store_true", help="print the export as JSON")
    ex.add_argument(
        "--force",
        action="store_true",
        help="write the launch config even when the plan does not fit HBM (default: refuse, "
        "exit 3)",
    )
    sw = sub.add_parser("sweep", help="plan many cluster sizes (and models, jobs), resumably")
    sw.add_argument("--model", nargs="+", required=True, help="catalog names or config paths")
    sw.add_argument("--cluster", nargs="+", default=["h100"], help="machine types")
    sw.add_argument("--gpus", type=int, nargs="+", required=True, help="total GPU counts")
    sw.add_argument("--seq-len", type=int, nargs="+", required=True, help="tokens/sequence")
    sw.add_argument("--global-batch", type=int, nargs="+", required=True, help="sequences/step")
    sw.add_argument("--compute-dtype", default="bf16", choices=["bf16", "fp8"], help="GEMMs")
    sw.add_argument("--moment-dtype", default="fp32", help="optimizer moment dtype")
    sw.add_argument("--grad-dtype", default=None, help="gradient dtype (default: the framework's)")
    sw.add_argument("--ema", default=None, help="EMA dtype (omit for no EMA)")
    sw.add_argument(
        "--framework",
        default=None,
        choices=["megatron", "torchtitan", "deepspeed", "torch"],
        help="training software: what overlaps with compute (default megatron, or --target's)",
    )
    sw.add_argument("--time-limit", type=float, default=10.0, help="per case (s)")
    sw.add_argument("--db", default="sweep.sqlite", help="results database (resumes from it)")
    sw.add_argument("--workers", type=int, default=None, help="local processes (default: CPUs)")
    sw.add_argument("--ray", default=None, metavar="ADDRESS", help="run on Ray: auto | local")
    sw.add_argument("--retry-failed", action="store_true", help="plan failed cases again")
    sw.add_argument(
        "--no-warm-start",
        action="store_true",
        help="plan each GPU count on its own (default: start from the next smaller count's plan)",
    )
    sw.add_argument("--out", default=None, help="write rows to a .csv or .json file")
    sw.add_argument("--json", action="store_true", help="print the rows as JSON")
    sw.add_argument(
        "--plot", default=None, metavar="FILE", help="write the sweep curves (.png, .svg or .pdf)"
    )
    va = sub.add_parser(
        "validate", help="run small layouts for real (PyTorch, CPU or CUDA) against the cost model"
    )
    va.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu: one gloo process per rank, FP32; cuda: one NCCL process per rank on its own "
        "GPU, BF16, with the allocator's allocated and reserved peaks (default cpu)",
    )
    va.add_argument("--steps", type=int, default=3, help="timed steps per layout after warm-up")
    va.add_argument("--rounds", type=int, default=1, help="run the set this many times over")
    va.add_argument("--only", type=int, nargs="+", default=None, help="case numbers (1-based)")
    va.add_argument("--json", action="store_true", help="one JSON entry per layout and rank")
    va.add_argument(
        "--cluster", default=None, help="a calibrated profile YAML (default: calibrate now)"
    )
    va.add_argument(
        "--cap",
        type=float,
        default=None,
        metavar="MIB",
        help="instead: plan 2 ranks under this memory cap and run the plans for real",
    )
    ca = sub.add_parser(
        "calibrate",
        help="fit a cluster profile YAML to measured runs (--runs), or measure this machine",
    )
    ca.add_argument(
        "--runs",
        default=None,
        metavar="CSV",
        help="measured runs to fit (columns: model,tp,pp,dp,micro_batch,global_batch,seq_len,"
        "step_s; optional ep,vp,schedule,recompute,zero,precision,framework,gpu,id)",
    )
    ca.add_argument(
        "--cluster",
        default=None,
        help="with --runs: the machine type name or YAML to start from; with --sweep: price "
        "the rows with its rates instead of rates fitted to the run",
    )
    ca.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu: gloo worker processes, FP32; cuda: NCCL, one GPU per process, BF16 "
        "(default cpu)",
    )
    ca.add_argument(
        "--sweep",
        action="store_true",
        help="instead: measure ONE device against the cost model: the GEMMs of Llama 3 8B/70B "
        "and DeepSeek-V3 layers at tp 1, 2, 4, 8 (FLOP/s), causal attention forward and "
        "backward by sequence length, copy/add/RMSNorm (bytes/s), and real-width layers by "
        "micro-batch and recompute choice (time, kept bytes, peaks); prints tables and "
        "writes every row as JSON (--out, default sweep-<device>.json)",
    )
    ca.add_argument(
        "--scale",
        type=float,
        default=None,
        help="with --sweep: factor on every width and length (default 1 on cuda, 1/32 on cpu, "
        "so a CPU sweep takes seconds)",
    )
    ca.add_argument(
        "--folds",
        type=int,
        default=None,
        help="with --runs: k of the k-fold held-out error (0: none; default 5, or every run "
        "on its own when fewer)",
    )
    ca.add_argument("--rounds", type=int, default=3, help="with --runs: linearisations of the fit")
    ca.add_argument("--processes", type=int, default=2, help="worker processes ('GPUs')")
    ca.add_argument(
        "--out",
        default=None,
        help="YAML to write (default: <cluster>-fitted.yaml, or <device>-<processes>.yaml); "
        "with --sweep, JSON (default sweep-<device>.json)",
    )
    ca.add_argument("--name", default=None, help="machine name in the profile")
    sim = sub.add_parser("simulate", help="run a stated layout's step event by event")
    _layout_args(sim)
    sim.add_argument("--trace", default=None, help="write a Perfetto/Chrome trace JSON here")
    return p


JOB_FLAGS = ("model", "cluster", "gpus", "seq_len", "global_batch")


def _job_args(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--recipe",
        default=None,
        help="a published layout (planner recipes) or its YAML: its model, machine, GPUs and "
        "job (and, for memory/evaluate/simulate, its layout) instead of the flags below",
    )
    cmd.add_argument("--model", help="catalog name or path to config.json (required)")
    cmd.add_argument("--cluster", help="machine type name or path to YAML (required)")
    cmd.add_argument("--gpus", type=int, help="total GPUs (required)")
    cmd.add_argument("--seq-len", type=int, help="tokens per sequence (required)")
    cmd.add_argument("--global-batch", type=int, help="sequences per step (required)")
    cmd.add_argument("--compute-dtype", default="bf16", choices=["bf16", "fp8"], help="GEMMs")
    cmd.add_argument("--moment-dtype", default="fp32", help="optimizer moment dtype")
    cmd.add_argument("--grad-dtype", default=None, help="gradient dtype (default: the framework's)")
    cmd.add_argument("--ema", default=None, help="EMA dtype (omit for no EMA)")
    cmd.add_argument(
        "--framework",
        default=None,
        choices=["megatron", "torchtitan", "deepspeed", "torch"],
        help="training software: what overlaps with compute (default megatron, or --target's)",
    )
    cmd.add_argument(
        "--compiled-loss",
        action="store_true",
        help="the loss runs under torch.compile (torchtitan with compile on, or torch): BF16 "
        "logits kept, no FP32 copy",
    )


def _layout_args(cmd: argparse.ArgumentParser) -> None:
    _job_args(cmd)
    for degree in ("tp", "cp", "pp", "ep", "etp"):
        cmd.add_argument(f"--{degree}", type=int, default=1, help=f"{degree} degree")
    cmd.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage")
    cmd.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    cmd.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule")
    cmd.add_argument("--virtual-stages", type=int, default=None, help="chunks per rank")
    cmd.add_argument(
        "--recompute",
        default="none",
        help="none | selective | full | op (torchtitan's per-op) | modules joined by '+'",
    )
    cmd.add_argument(
        "--fp8-cache",
        action="store_true",
        help="keep SwiGLU inputs in FP8 (FP8 compute, framework megatron)",
    )
    cmd.add_argument("--ema-on-host", action="store_true", help="keep the EMA in host RAM")
    cmd.add_argument(
        "--optimizer-offload",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="fraction of the optimizer state kept and stepped on the host (0 to 1; default 0)",
    )
    cmd.add_argument(
        "--offload-layers",
        type=int,
        default=0,
        metavar="N",
        help="the first N transformer layers keep their activations on the host (Megatron-LM "
        "--cpu-offloading-num-layers; pp 1, no recompute)",
    )
    cmd.add_argument(
        "--no-sequence-parallel",
        action="store_true",
        help="with tp > 1, keep norm/dropout activations whole on each tp rank",
    )
    cmd.add_argument(
        "--layout", default=None, help="a layout or plan JSON file (instead of the layout flags)"
    )
    cmd.add_argument("--json", action="store_true", help="print JSON for machines")
    cmd.add_argument("--plot", default=None, metavar="PREFIX", help=PLOT_PREFIX_HELP)


# Exit codes: a script can tell a plan that fits from an infeasible job from bad input.
EXIT_FITS, EXIT_BAD_INPUT, EXIT_INFEASIBLE = 0, 2, 3


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Exit 0: done (a plan or layout that fits); 2: bad input (one line on
    stderr); 3: infeasible (no layout fits, a stated layout does not fit, or an export of a
    plan that does not fit, refused without --force), with the explanation printed."""
    args = _parser().parse_args(argv)
    try:
        fits: bool | None = True
        if args.command in ("models", "clusters", "recipes"):
            _catalog(args)
        elif args.command in ("memory", "evaluate"):
            fits = _evaluate(args)
        elif args.command == "simulate":
            _simulate(args)
        elif args.command == "plan":
            fits = _plan(args)
        elif args.command == "sweep":
            _sweep(args)
        elif args.command == "export":
            fits = _export(args)
        elif args.command == "validate":
            _validate(args)
        elif args.command == "calibrate":
            _calibrate(args)
    except PlannerError as exc:
        print(f"planner: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_FITS if fits else EXIT_INFEASIBLE


def _catalog(args: argparse.Namespace) -> None:
    if args.command == "recipes":
        _recipes(args)
        return
    if args.command == "models":
        rows = [
            {
                "name": n,
                "params": (m := load_model(n)).num_params(),
                "active_params": m.num_params(active=True),
                "mtp_params": m.num_params() - m.num_params(include_mtp=False),
                "layers": m.num_layers,
                "experts": m.num_experts,
            }
            for n in model_names()
        ]
        heads = {
            "name": "model",
            "params": "params (B)",
            "active_params": "active (B)",
            "mtp_params": "of which MTP (B)",
        }
    else:
        rows = []
        for n in cluster_names():
            c = load_cluster(n, gpus=1)
            rows.append(
                {
                    "name": n,
                    "hbm_gib": c.hbm_bytes / GiB,
                    "usable_hbm_gib": c.usable_hbm_bytes / GiB,
                    "gpus_per_node": c.gpus_per_node,
                    "nvlink_GBps": c.nvlink_Bps / 1e9,
                    "nic_GBps": c.nic_Bps / 1e9,
                }
            )
        heads = {
            "name": "machine type",
            "hbm_gib": "HBM (GiB)",
            "usable_hbm_gib": "usable (GiB)",
            "gpus_per_node": "GPUs/node",
            "nvlink_GBps": "NVLink (GB/s/dir)",
            "nic_GBps": "NIC (GB/s/dir)",
        }
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    table = Table()
    for key in rows[0]:
        table.add_column(heads.get(key, key), justify="left" if key == "name" else "right")
    for r in rows:
        table.add_row(*(_cell(k, v) for k, v in r.items()))
    console = Console(width=max(Console().width, 100))
    console.print(table)
    split = []
    for r in rows:
        total, mtp = r.get("params"), r.get("mtp_params")
        if isinstance(total, int) and isinstance(mtp, int) and mtp:
            main_model = _cell("params", total - mtp)
            split.append(
                f"{r['name']}: {_cell('params', total)}B = {main_model}B main model + "
                f"{_cell('params', mtp)}B MTP"
            )
    if split:
        console.print(
            "params and active include the multi-token-prediction (MTP) modules where a config "
            "has them (num_nextn_predict_layers), their embedding and head being the main "
            f"model's, counted once: {'; '.join(split)}."
        )


def _cell(key: str, value: object) -> str:
    if key == "mtp_params" and value == 0:
        return "-"
    if key in ("params", "active_params", "mtp_params") and isinstance(value, int):
        return f"{value / 1e9:,.1f}"
    if key == "usable_hbm_gib" and isinstance(value, float):
        return f"{value:.2f}"
    return f"{value:.0f}" if isinstance(value, float) else str(value)


def _training_job(args: argparse.Namespace, seq_len: int, global_batch: int) -> TrainingJob:
    """The job the dtype flags describe, at this sequence length and global batch."""
    return TrainingJob(
        seq_len=seq_len,
        global_batch=global_batch,
        moment_dtype=args.moment_dtype,
        compute_dtype=args.compute_dtype,
        ema=args.ema,
        **({"grad_dtype": args.grad_dtype} if args.grad_dtype else {}),
        **({"framework": args.framework} if getattr(args, "framework", None) else {}),
        **({"compiled_loss": True} if getattr(args, "compiled_loss", False) else {}),
    )


def _recipe(args: argparse.Namespace) -> Recipe | None:
    """The recipe ``--recipe`` names, if any; the job flags must then be left out."""
    given = [f"--{f.replace('_', '-')}" for f in JOB_FLAGS if getattr(args, f) is not None]
    if args.recipe is None:
        missing = [f"--{f.replace('_', '-')}" for f in JOB_FLAGS if getattr(args, f) is None]
        if missing:
            raise PlannerError(f"{missing[0]}: required (or --recipe NAME; see planner recipes)")
        return None
    if given:
        raise PlannerError(
            f"{given[0]}: --recipe={args.recipe} sets the model, machine, GPUs and job; "
            "leave it out"
        )
    return load_recipe(args.recipe)


def _job(
    args: argparse.Namespace, recipe: Recipe | None = None
) -> tuple[ModelSpec, ClusterSpec, TrainingJob]:
    recipe = recipe or _recipe(args)
    if recipe is not None:
        return recipe.model, recipe.cluster, recipe.job
    model = load_model(args.model)
    cluster = load_cluster(args.cluster, gpus=args.gpus)
    job = _training_job(args, args.seq_len, args.global_batch)
    return model, cluster, job


def _build(args: argparse.Namespace) -> tuple[ModelSpec, ClusterSpec, TrainingJob, Layout]:
    recipe = _recipe(args)
    model, cluster, job = _job(args, recipe)
    if recipe is not None and not args.layout:
        return model, cluster, job, recipe.layout
    if args.layout:
        layout = _layout_file(args.layout)
        if layout.world_size != cluster.num_gpus:
            raise PlannerError(
                f"--layout={args.layout!r}: its tp*cp*pp*dp={layout.world_size} must equal "
                f"--gpus={cluster.num_gpus}"
            )
        return model, cluster, job, layout
    for degree in ("tp", "cp", "pp", "ep", "etp"):
        if getattr(args, degree) <= 0:
            raise PlannerError(f"--{degree}={getattr(args, degree)}: must be a positive degree")
    if args.virtual_stages is not None and args.virtual_stages <= 0:
        raise PlannerError(
            f"--virtual-stages={args.virtual_stages}: must be a positive number of chunks per rank"
        )
    world = args.tp * args.cp * args.pp
    if args.gpus % world:
        raise PlannerError(f"--gpus={args.gpus}: must be a multiple of tp*cp*pp={world}")
    layout = Layout.uniform(
        model,
        pp=args.pp,
        tp=args.tp,
        cp=args.cp,
        dp=args.gpus // world,
        ep=args.ep,
        etp=args.etp,
        zero=args.zero,
        micro_batch=args.micro_batch,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        recompute=_offload_layers(model, args.recompute, args.offload_layers),
        ema="host" if args.ema_on_host else "hbm",
        fp8_cache=args.fp8_cache,
        sequence_parallel=not args.no_sequence_parallel,
        optimizer_offload=args.optimizer_offload,
    )
    return model, cluster, job, layout


def _positive_seconds(value: float) -> None:
    if not value > 0:
        raise PlannerError(f"--time-limit={value:g}: must be a positive number of seconds")


def _offload_layers(model: ModelSpec, recompute: str, n: int) -> str | dict[str, str]:
    """``--recompute`` for every layer, or with ``--offload-layers N`` the first N layers
    offloaded and the rest at ``--recompute``."""
    if n == 0:
        return recompute
    if not 0 < n < model.num_layers:
        raise PlannerError(
            f"--offload-layers={n}: must be between 1 and {model.num_layers - 1} (the model "
            f"has {model.num_layers} layers; one at least stays in HBM)"
        )
    return {f"layer.{i}": "offload" if i < n else recompute for i in range(model.num_layers)}


def _layout_file(path: str) -> Layout:
    """A layout from a JSON file: a ``Layout``, or a plan (``planner plan --json``)."""

    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise PlannerError(f"--layout={path!r}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise PlannerError(f"--layout={path!r}: not JSON ({exc})") from None
    if isinstance(data, dict) and "status" in data and "layout" in data:
        if data["layout"] is None:
            raise PlannerError(f"--layout={path!r}: the plan is infeasible; it has no layout")
        data = data["layout"]
    if not isinstance(data, dict):
        raise PlannerError(f"--layout={path!r}: expected a JSON object (a layout or a plan)")
    return Layout(**data)


def _evaluate(args: argparse.Namespace) -> bool:
    """Print the layout's memory (and time); whether it fits."""
    model, cluster, job, layout = _build(args)
    est = evaluate(model, cluster, job, layout)
    if args.plot:
        _plot(args.plot, est, model.name)
    if args.json:
        print(json.dumps({"layout": layout.model_dump(), "estimate": est.model_dump()}, indent=1))
        return est.fits
    _print_memory(model.name, layout, est, job.memory_margin)
    if args.command == "evaluate":
        _print_time(est, job.framework)
    return est.fits


def _simulate(args: argparse.Namespace) -> None:
    model, cluster, job, layout = _build(args)
    sim = simulate(model, cluster, job, layout)
    est = evaluate(model, cluster, job, layout)
    if args.plot:
        _plot(args.plot, est, model.name)
    path = sim.to_chrome_trace(args.trace) if args.trace else None
    if args.json:
        out = {
            "step_time_s": sim.step_time_s,
            "analytic_step_time_s": est.step_time_s,
            "busy_s": sim.busy_s,
            "idle_s": sim.idle_s,
            "peak_bytes": sim.peak_bytes,
            "trace": str(path) if path else None,
        }
        print(json.dumps(out, indent=1))
        return
    console = Console(width=max(Console().width, 100))
    table = Table(title=f"{model.name}: simulated step, per pipeline rank")
    for col in ("rank", "busy (s)", "idle (s)", "idle", "peak (GiB)"):
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
        )
    console.print(table)
    diff = est.step_time_s / sim.step_time_s - 1
    console.print(
        f"Simulated step {sim.step_time_s:.3f} s; analytic estimate {est.step_time_s:.3f} s "
        f"({diff:+.1%})."
        + (f" Trace written to {path} (open in https://ui.perfetto.dev)." if path else "")
    )


def _plan(args: argparse.Namespace) -> bool:
    """Plan and print; whether a layout that fits was found."""
    if args.plot:
        picture_paths(args.plot, option="--plot")  # a bad suffix fails before the search
    _positive_seconds(args.time_limit)
    model, cluster, job = _job(args)
    space = SearchSpace(
        tp=args.tp,
        cp=args.cp,
        pp=args.pp,
        ep=args.ep,
        etp=args.etp,
        micro_batch=args.micro_batch,
        zero=args.zero,
        schedules=args.schedule,
        recompute=args.recompute,
        fp8_cache=[False, True] if args.fp8_cache else None,
        optimizer_offload=args.optimizer_offload,
        sequence_parallel=(
            [v == "on" for v in args.sequence_parallel] if args.sequence_parallel else None
        ),
        target=args.target,
    )
    console = Console(width=max(Console().width, 132), stderr=True)
    with console.status(f"planning {model.name} on {cluster.num_gpus} x {cluster.name} ..."):
        result = plan(model, cluster, job, space, time_limit_s=args.time_limit)
    if args.plot and result.estimate is not None:
        _plot(args.plot, result.estimate, model.name)
    found = result.layout is not None and result.estimate is not None
    if args.json:
        print(result.model_dump_json(indent=1))
        return found
    out = Console(width=max(Console().width, 132))
    if result.layout is None or result.estimate is None:
        out.print(
            f"[bold red]infeasible[/]: {result.explanation.summary if result.explanation else ''}"
        )
        if result.explanation:
            for b in result.explanation.binding:
                out.print(f"  binds: {b.family} on {b.where}: {b.excess}")
            for fix in result.explanation.fixes:
                out.print(f"  fix: {cli_words(fix)}")
        return False
    lay = result.layout
    layers = [sum(b.block.startswith("layer.") for b in s.blocks) for s in lay.stages]
    _print_memory(model.name, lay, result.estimate, job.memory_margin)
    _print_time(result.estimate, (result.job or job).framework)
    gap = (
        f"gap {result.gap:.1%} to the proven bound {result.lower_bound_s:.3f} s"
        if result.gap
        else "proven optimal"
    )
    out.print(
        f"[bold]{result.status}[/] ({gap}) after {result.solve_time_s:.1f} s over "
        f"{result.configurations} degree/schedule combinations. Layout: {lay.degrees()} "
        f"ZeRO-{lay.zero} micro-batch {lay.micro_batch} x"
        f"{result.estimate.num_microbatches} {lay.schedule}"
        + (f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else "")
        + (", SwiGLU inputs kept in FP8" if lay.fp8_cache else "")
        + (", sequence parallelism off" if lay.tp > 1 and not lay.sequence_parallel else "")
        + (
            f", {lay.optimizer_offload:.0%} of the optimizer state on the host"
            if lay.optimizer_offload
            else ""
        )
        + f", layers per stage {layers}."
    )
    _print_decisions(lay, result.estimate, result.job or job)
    _print_runners_up(result)
    return True


def _print_decisions(layout: Layout, est: Estimate, job: TrainingJob) -> None:
    """Each stage's blocks and recompute, where the EMA lives, and why a stage holds no
    transformer layer."""
    console = Console(width=max(Console().width, 132))
    table = Table(title="decisions per stage: blocks and their recompute")
    for col in ("stage", "rank", "blocks", "layers", "recompute (layers)"):
        left = col in ("blocks", "recompute (layers)")
        table.add_column(col, justify="left" if left else "right")
    ranks = {c: s.stage for s in est.memory for c in s.chunks}
    empty = []
    for i, stage in enumerate(layout.stages):
        kinds: dict[str, int] = {}
        for b in stage.blocks:
            if b.block.startswith(("layer.", "mtp.")):
                kinds[b.recompute] = kinds.get(b.recompute, 0) + 1
        n = sum(b.block.startswith("layer.") for b in stage.blocks)
        if n == 0:
            empty.append(i)
        table.add_row(
            str(i),
            str(ranks.get(i, "")),
            _summarise(layout, [i]),
            str(n),
            ", ".join(f"{k} x{v}" for k, v in kinds.items()) or "-",
        )
    console.print(table)
    notes = []
    if job.ema:
        where = "host RAM" if layout.ema == "host" else "HBM (the ema bucket)"
        notes.append(f"EMA ({job.ema}) kept in {where}.")
    notes.append(
        f"Headroom kept: {job.memory_margin:.0%} of usable HBM below the cap for the memory "
        f"model's error; the heaviest rank leaves {est.headroom:.1%} free."
    )
    for i in empty:
        notes.append(
            f"Stage {i} holds no transformer layer, only {_summarise(layout, [i])}: its "
            "embedding or head work (and MTP) is that stage's share of each micro-batch; the "
            "search found no faster layout that gives it a layer."
        )
    console.print(" ".join(notes))


def _print_runners_up(result: Plan) -> None:
    """The next layouts the search found, with what each costs against the plan."""
    if not result.alternatives or result.estimate is None:
        return
    console = Console(width=max(Console().width, 132))
    base = result.estimate.step_time_s
    table = Table(title="runners-up (other degrees or schedules the search found)")
    for col in ("layout", "step s", "vs plan", "peak GiB"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for alt in result.alternatives:
        table.add_row(
            alt.layout.shape(),
            f"{alt.step_time_s:.3f}",
            f"{alt.step_time_s / base - 1:+.1%}",
            f"{alt.peak_bytes / GiB:.2f}",
        )
    console.print(table)


def _sweep(args: argparse.Namespace) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from planner.sweep import cases, run, write

    _positive_seconds(args.time_limit)
    if args.workers is not None and args.workers <= 0:
        raise PlannerError(f"--workers={args.workers}: must be a positive process count")
    jobs = [_training_job(args, s, b) for s in args.seq_len for b in args.global_batch]
    if args.plot:
        picture_format(args.plot, option="--plot")
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
        )
    if args.out:
        write(rows, args.out)
    if args.plot:
        from planner.plots import plot_sweep

        print(f"sweep curves: {_writable(args.plot, plot_sweep, rows)}", file=sys.stderr)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "plan"} for r in rows], indent=1))
        return
    table = Table(title=f"sweep: {len(rows)} cases (database {args.db})")
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
            r.get("layout") or (r.get("error") or "")[:80],
        )
    Console(width=max(Console().width, 132)).print(table)


def _plot(prefix: str, est: Estimate, name: str) -> None:
    from planner.plots import plot_memory, plot_step_time

    memory_path, time_path = picture_paths(prefix, option="--plot")
    memory = _writable(memory_path, plot_memory, est, title=f"{name}: memory per pipeline rank")
    title = f"{name}: step time {est.step_time_s:.3f} s by part"
    step = _writable(time_path, plot_step_time, est, title=title)
    print(f"pictures: {memory}, {step}", file=sys.stderr)


def _writable(path: str | Path, draw: Any, *args: Any, **kwargs: Any) -> str:
    try:
        return str(draw(*args, path, **kwargs))
    except OSError as exc:
        raise PlannerError(f"--plot={str(path)!r}: cannot write ({exc.strerror})") from None


def _export(args: argparse.Namespace) -> bool:
    """Write the plan's launch config; False (exit 3) when it does not fit and --force is
    not given."""

    from planner import export
    from planner.solve.result import Plan

    try:
        text = sys.stdin.read() if args.plan == "-" else Path(args.plan).read_text()
    except OSError as exc:
        raise PlannerError(f"--plan={args.plan!r}: cannot read ({exc.strerror})") from None
    try:
        result = Plan.model_validate_json(text)
    except ValueError as exc:
        first = str(exc).splitlines()[0]
        raise PlannerError(f"--plan={args.plan!r}: not a plan JSON ({first})") from None
    est = result.estimate
    if est is not None and result.layout is not None and not est.fits and not args.force:
        print(
            f"planner: --plan={args.plan!r}: the plan does not fit HBM (peak "
            f"{est.peak_bytes / GiB:.2f} GiB per GPU, cap {est.cap_bytes / GiB:.2f} GiB); "
            "nothing written (--force writes it anyway)",
            file=sys.stderr,
        )
        return False
    out = getattr(export, args.target)(result)
    if args.out:
        folder = Path(args.out)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for name, content in out.files.items():
                (folder / name).write_text(content)
        except OSError as exc:
            raise PlannerError(f"--out={args.out!r}: cannot write ({exc.strerror})") from None
    if args.json:
        print(out.model_dump_json(indent=1))
        return True
    for name, content in out.files.items():
        print(f"==> {name} <==\n{content}")
    print(out.summary(), file=sys.stderr)
    return True


def _print_time(est: Estimate, framework: str) -> None:
    console = Console(width=max(Console().width, 100))
    table = Table(title=f"step time: {est.step_time_s:.3f} s")
    table.add_column("part")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for part, seconds in est.breakdown.items():
        table.add_row(part, f"{seconds:.3f}", f"{seconds / est.step_time_s:.1%}")
    console.print(table)
    console.print(
        f"Parts of the critical pipeline rank {est.critical_rank}. "
        f"{est.tokens_per_s:,.0f} tokens/s, {est.tflops_per_gpu:.0f} model TFLOP/s per GPU, MFU "
        f"{est.mfu:.1%} (6 x active matmul parameters + causal attention per token, against "
        f"the dense BF16 peak). Includes compute at the machine catalog's efficiencies, recompute, "
        f"the tensor-parallel and expert all-to-all communication {framework} leaves exposed, "
        f"the context-parallel ring's sends attention does not hide, "
        f"pipeline sends and bubble, links and SMs shared by overlapped collectives, exposed "
        f"gradient reduction and the optimizer step; ignores stragglers, failures, data "
        f"loading and checkpointing. Expected error: {est.expected_error}."
    )


def _print_memory(name: str, layout: Layout, est: Estimate, margin: float) -> None:
    console = Console(width=max(Console().width, 132))
    title = (
        f"{name}: per-rank memory (GiB) - {layout.degrees()} "
        f"zero={layout.zero} micro_batch={layout.micro_batch} "
        f"x{est.num_microbatches} {layout.schedule}"
    )
    table = Table(title=title)
    table.add_column("rank", justify="right")
    table.add_column("blocks", no_wrap=True)
    for bucket in BUCKETS:
        table.add_column(SHORT.get(bucket, bucket), justify="right")
    table.add_column("peak", justify="right")
    table.add_column("of usable", justify="right")
    for s in est.memory:
        blocks = _summarise(layout, s.chunks)
        cells = [f"{s.buckets[b] / GiB:.2f}" for b in BUCKETS]
        share = s.peak_bytes / est.usable_hbm_bytes
        style = "red" if s.peak_bytes > est.cap_bytes else ""
        table.add_row(
            str(s.stage), blocks, *cells, f"{s.peak_bytes / GiB:.2f}", f"{share:.0%}", style=style
        )
    console.print(table)
    console.print(
        f"{_memory_summary(est, margin)} Includes weights, gradients, optimizer state, EMA, "
        "saved activations of the schedule's in-flight micro-batches, communication buffers, "
        "CUDA context and fragmentation; ignores optimizer-step temporaries."
    )
    host = max(s.host_bytes for s in est.memory)
    if host:
        held = []
        if layout.optimizer_offload:
            held.append(f"{layout.optimizer_offload:.0%} of the optimizer state")
        if layout.ema == "host":
            held.append("the EMA")
        offloaded = sum("offload" in b.recompute for s in layout.stages for b in s.blocks)
        if offloaded:  # whole layers (offload) or module inputs (offload:<module>)
            held.append(f"activations offloaded from {offloaded} layers")
        console.print(
            f"Host RAM: up to {host / GiB:.2f} GiB per rank for {' and '.join(held)} (not in "
            "HBM; checked against the node's RAM with every GPU of the node at that figure)."
        )


# The CLI's flag for each SearchSpace field an explanation may name (fields without a flag
# keep their Python name).
SPACE_FLAGS = {
    "tp": "--tp",
    "cp": "--cp",
    "pp": "--pp",
    "ep": "--ep",
    "etp": "--etp",
    "micro_batch": "--micro-batch",
    "schedules": "--schedule",
    "zero": "--zero",
    "recompute": "--recompute",
    "sequence_parallel": "--sequence-parallel",
}


def cli_words(text: str) -> str:
    """An explanation's fix in the CLI's own flags: "free SearchSpace.tp" becomes "drop
    --tp", "SearchSpace.optimizer_offload=[0, 1]" becomes "--optimizer-offload 0 1"."""
    text = text.replace("SearchSpace.optimizer_offload=[0, 1]", "--optimizer-offload 0 1")
    text = text.replace(
        "SearchSpace.recompute=[none, offload], pp=1", "--recompute none offload --pp 1"
    )
    for field, flag in SPACE_FLAGS.items():
        text = text.replace(f"free SearchSpace.{field})", f"drop {flag})")
    return text


def _memory_summary(est: Estimate, margin: float) -> str:
    """The peak against usable HBM and the cap, and the headroom the heaviest rank keeps."""
    usable, cap = est.usable_hbm_bytes / GiB, est.cap_bytes / GiB
    top = max(est.memory, key=lambda s: s.peak_bytes)
    head = (
        f"Peak {est.peak_bytes / GiB:.2f} GiB per GPU (allocated {top.allocated_bytes / GiB:.2f}"
        f" GiB in tensors, reserved {top.reserved_bytes / GiB:.2f} GiB by the caching "
        f"allocator, plus {top.buckets['context'] / GiB:.2f} GiB of CUDA context); usable "
        f"HBM {usable:.2f} GiB (of "
        f"{est.hbm_bytes / GiB:.4g} GiB), cap {cap:.2f} GiB after the {margin * 100:g}% margin for "
        "the memory model's error:"
    )
    if est.fits:
        return (
            f"{head} fits, the heaviest rank leaves {est.headroom:.1%} of usable HBM "
            f"({usable - est.peak_bytes / GiB:.2f} GiB) free."
        )
    return (
        f"{head} does NOT fit, the heaviest rank is {est.peak_bytes / GiB - cap:.2f} GiB over "
        f"the cap ({est.headroom:.1%} of usable HBM left free)."
    )


def _summarise(layout: Layout, chunks: list[int]) -> str:
    """``E L0-3 | L58-60 mtp.0 head``: each chunk's blocks, layer runs shortened."""
    out = []
    for c in chunks:
        names = [b.block for b in layout.stages[c].blocks]
        layers = [int(n.split(".")[1]) for n in names if n.startswith("layer.")]
        parts = ["E"] if names[0] == "embedding" else []
        if layers:
            parts.append(f"L{layers[0]}-{layers[-1]}" if len(layers) > 1 else f"L{layers[0]}")
        parts += [n for n in names if n.startswith("mtp.") or n == "head"]
        out.append(" ".join(parts))
    return " | ".join(out)


def _validate(args: argparse.Namespace) -> None:
    try:
        from planner.run.calibrate import calibrated_cluster
        from planner.run.device import Device
        from planner.run.validate import (
            cap_demo,
            label,
            layout_name,
            ranking,
            validate,
            validation_set,
        )
    except ImportError as exc:  # torch is the optional extra ``run``
        raise PlannerError(f"validate needs PyTorch: pip install -e '.[run]' ({exc.msg})") from None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    cases = validation_set()
    if args.only:
        bad = [i for i in args.only if not 1 <= i <= len(cases)]
        if bad:
            raise PlannerError(f"--only={bad[0]}: cases are numbered 1..{len(cases)}")
    device = Device.of(args.device)
    gpus = device.count() if device.is_cuda else None  # on CUDA, one GPU per rank
    if args.only:
        for i in args.only:
            if gpus is not None and cases[i - 1][1].world_size > gpus:
                raise PlannerError(
                    f"--only={i}: case {i} runs {cases[i - 1][1].world_size} ranks; --device=cuda "
                    f"needs a GPU per rank, {gpus} visible"
                )
        cases = [cases[i - 1] for i in args.only]
    elif gpus is not None:
        cases = [case for case in cases if case[1].world_size <= gpus]
    if args.steps < 1:
        raise PlannerError(f"--steps={args.steps}: needs at least 1 timed step")
    if args.rounds < 1:
        raise PlannerError(f"--rounds={args.rounds}: needs at least 1 round")
    if args.cap is not None:
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
        return
    profiles: dict[int, ClusterSpec] = {}
    if args.cluster is not None:
        for ranks in sorted({layout.world_size for _, layout in cases}):
            profiles[ranks] = load_cluster(args.cluster, gpus=ranks)
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
    columns = (TextColumn("running layouts"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("validate", total=len(cases) * args.rounds)
        entries = validate(
            cases,
            steps=args.steps,
            rounds=args.rounds,
            clusters=profiles.get,
            progress=lambda done, _: bar.update(task, completed=done),
            device=device,
        )
    if args.json:
        print(json.dumps([e.model_dump() for e in entries], indent=2))
        return
    table = Table(title="cost model vs real run, per rank: error = predicted / measured - 1")
    heads: tuple[str, ...] = ("layout", "rank", "pred MiB", "peak MiB", "peak", "alloc MiB")
    heads += ("resv MiB", "wts", "grads", "opt", "act", "other")
    for col in (*heads, "step s", "time"):
        table.add_column(col, justify="left" if col == "layout" else "right", no_wrap=True)

    def cell(err: float, ok: bool) -> str:
        return f"{err:+.1%}" if ok else f"[red]{err:+.1%}[/red]"

    for e in entries:
        row = [label(e), str(e.rank), f"{e.predicted_peak_bytes / 2**20:.1f}"]
        row.append(f"{e.measured_peak_bytes / 2**20:.1f}")
        row.append(cell(e.peak_error, abs(e.peak_error) <= 0.05))
        row.append(f"{e.allocated_peak_bytes / 2**20:.1f}")
        reserved = e.reserved_peak_bytes
        row.append(f"{reserved / 2**20:.1f}" if reserved is not None else "not measured")
        for key in ("weights", "grads", "optimizer", "activations", "other"):
            b = e.buckets[key]
            row.append(cell(b.error, b.agrees) if b.measured_bytes else "-")
        row.append(f"{e.measured_step_s:.3f}")
        p = e.predicted_step_s
        row.append(
            cell(p / e.measured_step_s - 1, abs(p / e.measured_step_s - 1) <= 0.2) if p else "-"
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


def _calibrate(args: argparse.Namespace) -> None:
    if args.runs is not None:
        _fit_runs(args)
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
    console = Console()
    rates = Table(title=f"{path}: this machine as {args.processes} 'GPUs'")
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


def _device_sweep(args: argparse.Namespace, device: Any) -> None:
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
    import yaml

    from planner.catalog import cluster_yaml
    from planner.fit import CONSTANTS as FIT_CONSTANTS
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
    console = Console()
    constants = Table(title=f"{path}: constants fitted to {len(runs)} measured runs")
    for col in ("constant", "before", "fitted", ""):
        constants.add_column(col, justify="left" if col in ("constant", "") else "right")
    for c in FIT_CONSTANTS:
        unit = "" if c.fraction else " us"
        before = c.show(c.read(base))
        after = report.values[c.name]
        informed = c.name in report.informed
        constants.add_row(
            c.name,
            f"{before:.3g}{unit}",
            f"{after:.3g}{unit}" if informed else "-",
            "" if informed else "no run depends on it: kept",
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
        f"MAPE {report.before_mape:.1%} with {args.cluster}'s constants, {report.fit_mape:.1%} "
        "fitted"
        + (
            f", {held:.1%} on runs each fold did not see ({report.folds}-fold)"
            if held is not None
            else ""
        )
    )
    console.print(f"Use it with --cluster {path} (plan, evaluate, simulate).")


def _degrees(layout: Layout) -> str:
    """``tp8 pp16 dp64 ep1 ZeRO-2 mb1 interleaved v8 recompute none``."""
    recompute = sorted(
        {b.recompute for s in layout.stages for b in s.blocks if b.block.startswith("layer.")}
    )
    return (
        f"{layout.degrees('')} ZeRO-{layout.zero} mb{layout.micro_batch} {layout.schedule} "
        f"v{layout.virtual_stages} "
        f"recompute {'/'.join(recompute)}"
    )


def _recipes(args: argparse.Namespace) -> None:
    recipes = [load_recipe(n) for n in recipe_names()]
    rows = [
        {
            "name": r.name,
            "model": r.model.name,
            "machine": f"{r.cluster.num_gpus} x {r.cluster.name}",
            "layout": _degrees(r.layout),
            "measured": r.measured,
            "source": r.source,
        }
        for r in recipes
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    table = Table(title="published layouts: planner evaluate --recipe NAME (or plan --recipe NAME)")
    for key in ("name", "model", "machine", "layout", "measured"):
        table.add_column(key)
    for r in rows:
        table.add_row(r["name"], r["model"], r["machine"], r["layout"], r["measured"])
    Console(width=max(Console().width, 132)).print(table)


if __name__ == "__main__":
    raise SystemExit(main())
