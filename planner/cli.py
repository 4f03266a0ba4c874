"""The ``planner`` command: a thin map from subcommand to library call, then printing.

User mistakes print one line on stderr and exit with code 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from planner.catalog import cluster_names, load_cluster, load_model, model_names
from planner.costs.memory import BUCKETS
from planner.errors import PlannerError
from planner.estimate import Estimate, evaluate
from planner.layout import SCHEDULES, Layout
from planner.specs import TrainingJob

GiB = 2**30
SHORT = {"optimizer": "optim", "activations": "activ", "fragmentation": "frag", "context": "ctx"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's own usage errors: one line, exit 2
        print(f"planner: {message}", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="planner", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("models", help="list the model catalog")
    sub.add_parser("clusters", help="list the machine types")
    mem = sub.add_parser("memory", help="per-rank memory of a stated layout")
    mem.add_argument("--model", required=True, help="catalog name or path to config.json")
    mem.add_argument("--cluster", required=True, help="machine type name or path to YAML")
    mem.add_argument("--gpus", type=int, required=True, help="total GPUs")
    mem.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    mem.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    for degree in ("tp", "pp", "ep"):
        mem.add_argument(f"--{degree}", type=int, default=1, help=f"{degree} degree")
    mem.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage")
    mem.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    mem.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule")
    mem.add_argument("--virtual-stages", type=int, default=None, help="chunks per rank")
    mem.add_argument(
        "--recompute", default="none", help="none | selective | full | modules joined by '+'"
    )
    mem.add_argument("--moment-dtype", default="fp32", help="optimizer moment dtype")
    mem.add_argument("--grad-dtype", default="bf16", help="gradient dtype")
    mem.add_argument("--ema", default=None, help="EMA dtype (omit for no EMA)")
    mem.add_argument("--ema-on-host", action="store_true", help="keep the EMA in host RAM")
    mem.add_argument("--json", action="store_true", help="print JSON for machines")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "models":
            print("\n".join(model_names()))
        elif args.command == "clusters":
            print("\n".join(cluster_names()))
        elif args.command == "memory":
            _memory(args)
    except PlannerError as exc:
        print(f"planner: {exc}", file=sys.stderr)
        return 2
    return 0


def _memory(args: argparse.Namespace) -> None:
    model = load_model(args.model)
    cluster = load_cluster(args.cluster, gpus=args.gpus)
    job = TrainingJob(
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        moment_dtype=args.moment_dtype,
        grad_dtype=args.grad_dtype,
        ema=args.ema,
    )
    world = args.tp * args.pp
    if args.gpus % world:
        raise PlannerError(f"--gpus={args.gpus}: must be a multiple of tp*pp={world}")
    layout = Layout.uniform(
        model,
        pp=args.pp,
        tp=args.tp,
        dp=args.gpus // world,
        ep=args.ep,
        zero=args.zero,
        micro_batch=args.micro_batch,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        recompute=args.recompute,
        ema="host" if args.ema_on_host else "hbm",
    )
    est = evaluate(model, cluster, job, layout)
    if args.json:
        print(json.dumps({"layout": layout.model_dump(), "estimate": est.model_dump()}, indent=1))
    else:
        _print_memory(model.name, layout, est)


def _print_memory(name: str, layout: Layout, est: Estimate) -> None:
    console = Console(width=max(Console().width, 132))
    title = (
        f"{name}: per-rank memory (GiB) - tp={layout.tp} pp={layout.pp} dp={layout.dp} "
        f"ep={layout.ep} zero={layout.zero} micro_batch={layout.micro_batch} "
        f"x{est.num_microbatches} {layout.schedule}"
    )
    table = Table(title=title)
    table.add_column("rank", justify="right")
    table.add_column("blocks", no_wrap=True)
    for bucket in BUCKETS:
        table.add_column(SHORT.get(bucket, bucket), justify="right")
    table.add_column("peak", justify="right")
    table.add_column("of HBM", justify="right")
    for s in est.memory:
        blocks = _summarise(layout, s.chunks)
        cells = [f"{s.buckets[b] / GiB:.2f}" for b in BUCKETS]
        share = s.peak_bytes / est.hbm_bytes
        style = "red" if share > 1 else ""
        table.add_row(
            str(s.stage), blocks, *cells, f"{s.peak_bytes / GiB:.2f}", f"{share:.0%}", style=style
        )
    console.print(table)
    verdict = "fits" if est.fits else "does NOT fit"
    console.print(
        f"Peak {est.peak_bytes / GiB:.2f} GiB per GPU against {est.hbm_bytes / GiB:.2f} GiB HBM:"
        f" {verdict}. Includes weights, gradients, optimizer state, EMA, saved activations of"
        " the schedule's in-flight micro-batches, communication buffers, CUDA context and"
        " fragmentation; ignores optimizer-step temporaries. Step time is not modelled yet."
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


if __name__ == "__main__":
    raise SystemExit(main())
