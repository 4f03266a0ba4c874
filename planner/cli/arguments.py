"""The ``planner`` command's flags: the argparse parser, one builder per command, and the tables
that map library fields to the flags that set them."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from planner.frameworks import FRAMEWORK_NAMES, LAUNCHERS
from planner.layout import SCHEDULES
from planner.schedules import DEFAULT_SCHEDULE
from planner.specs import DEFAULT_TIME_LIMIT_S

# ``planner --help``'s opening words (argparse rewraps them).
DESCRIPTION = (
    "The ``planner`` command: a thin map from subcommand to library call, then printing.\n\n"
    "User mistakes print one line on stderr and exit with code 2; no traceback.\n"
)
PLOT_PREFIX_HELP = "write PREFIX-memory.svg and PREFIX-time.svg (PREFIX.png or .pdf: that format)"

# The flags that state the job; --recipe states them all instead.
JOB_FLAGS = ("model", "cluster", "gpus", "seq_len", "global_batch")

# The CLI's flag for each SearchSpace field an explanation may name (fields without a flag
# keep their Python name).
SPACE_FLAGS = {
    "tp": "--tp",
    "cp": "--cp",
    "cp_comm_type": "--cp-comm-type",
    "pp": "--pp",
    "ep": "--ep",
    "etp": "--etp",
    "micro_batch": "--micro-batch",
    "schedules": "--schedule",
    "zero": "--zero",
    "zero_hpz": "--zero-hpz",
    "recompute": "--recompute",
    "sequence_parallel": "--sequence-parallel",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's own usage errors: one line, exit 2
        print(f"planner: {message}", file=sys.stderr)
        raise SystemExit(2)


def parser() -> argparse.ArgumentParser:
    """Every command with its flags, in the order ``planner --help`` lists them."""
    p = _Parser(prog="planner", description=DESCRIPTION)
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
    _plan_args(sub.add_parser("plan", help="find the fastest layout that fits, with its proof"))
    _export_args(
        sub.add_parser("export", help="launch config of a plan (from planner plan --json)")
    )
    _sweep_args(
        sub.add_parser("sweep", help="plan many cluster sizes (and models, jobs), resumably")
    )
    _validate_args(
        sub.add_parser(
            "validate",
            help="run small layouts for real (PyTorch, CPU or CUDA) against the cost model",
        )
    )
    _calibrate_args(
        sub.add_parser(
            "calibrate",
            help="fit a cluster profile YAML to measured runs (--runs), or measure this machine",
        )
    )
    alloc = sub.add_parser(
        "allocator",
        help="replay a PyTorch memory snapshot through the caching allocator: the least "
        "memory the run fits in",
    )
    alloc.add_argument(
        "snapshot",
        help="a file torch.cuda.memory._dump_snapshot wrote, recorded from the run's first "
        "allocation (torch.cuda.memory._record_memory_history)",
    )
    alloc.add_argument(
        "--device",
        type=int,
        default=None,
        help="the device's trace (default: the one device with a trace)",
    )
    alloc.add_argument(
        "--capacity",
        type=float,
        nargs="+",
        metavar="GIB",
        help="say whether the run fits in each of these GiB (exit 3 if not in one)",
    )
    alloc.add_argument("--json", action="store_true", help="print JSON for machines")
    sim = sub.add_parser("simulate", help="run a stated layout's step event by event")
    _layout_args(sim)
    sim.add_argument("--trace", default=None, help="write a Perfetto/Chrome trace JSON here")
    return p


def _job_args(cmd: argparse.ArgumentParser) -> None:
    """The model, machine and job, by flags or by --recipe (plan, memory, evaluate, simulate)."""
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
    _precision_args(cmd)
    cmd.add_argument(
        "--compiled-loss",
        action="store_true",
        help="the loss runs under torch.compile (torchtitan with compile on, or torch): BF16 "
        "logits kept, no FP32 copy",
    )
    cmd.add_argument(
        "--compiled-model",
        action="store_true",
        help="torchtitan's layers run under torch.compile (compile.enable): their elementwise "
        "ops fused, where uncompiled each is a kernel of its own",
    )
    cmd.add_argument(
        "--eager-norm",
        action="store_true",
        help="torchtitan's own eager RMSNorm class (its code before April 2025, norm_type "
        "rmsnorm): a kernel per op over an FP32 copy, where nn.RMSNorm is one fused kernel",
    )
    cmd.add_argument(
        "--loss-chunks",
        type=int,
        default=None,
        metavar="N",
        help="torchtitan's ChunkedCELoss: the output layer and loss over N chunks of tokens, "
        "each chunk's backward at once (its recipes use 8 since April 2026; default 1)",
    )
    cmd.add_argument(
        "--loss-fusion",
        default=None,
        choices=["none", "native", "te"],
        help="Megatron-LM's fused cross-entropy (default none): native "
        "(--cross-entropy-loss-fusion, one FP32 copy of the logits more while it runs) or te "
        "(--cross-entropy-fusion-impl te, the gradient written over the logits)",
    )


# The layout flags' destinations and defaults: a --layout file states them all, so beside it
# any of them set otherwise is refused (planner.cli.inputs.build).
LAYOUT_DEFAULTS: dict[str, object] = {
    "tp": 1, "cp": 1, "pp": 1, "ep": 1, "etp": 1, "zero": 1, "micro_batch": 1,
    "schedule": DEFAULT_SCHEDULE, "virtual_stages": None, "recompute": "none",
    "fp8_cache": False, "ema_on_host": False, "optimizer_offload": 0.0, "offload_layers": 0,
    "no_sequence_parallel": False, "cp_comm_type": "p2p", "cp_a2a_size": None, "zero_hpz": 1,
    "param_offload": False, "optimizer_instances": 1,
}  # fmt: skip


def _layout_args(cmd: argparse.ArgumentParser) -> None:
    """The job and one stated layout, by flags or by a file (memory, evaluate, simulate)."""
    _job_args(cmd)
    for degree in ("tp", "cp", "pp", "ep", "etp"):
        cmd.add_argument(f"--{degree}", type=int, default=1, help=f"{degree} degree")
    cmd.add_argument(
        "--cp-comm-type",
        default="p2p",
        choices=["p2p", "a2a", "a2a+p2p"],
        help="with cp > 1: p2p, keys and values around a ring behind the attention (default); "
        "a2a, heads split by all-to-all (DeepSpeed-Ulysses); a2a+p2p, all-to-all within "
        "groups of --cp-a2a-size ranks and a ring across them (Megatron-LM's names)",
    )
    cmd.add_argument(
        "--cp-a2a-size",
        type=int,
        default=None,
        metavar="N",
        help="with --cp-comm-type a2a+p2p: the all-to-all groups' size (dividing cp)",
    )
    cmd.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage")
    cmd.add_argument(
        "--zero-hpz",
        type=int,
        default=1,
        metavar="N",
        help="ZeRO-3 with ZeRO++'s secondary weight shard over N consecutive data-parallel "
        "ranks (DeepSpeed zero_hpz_partition_size; default 1, off)",
    )
    cmd.add_argument(
        "--optimizer-instances",
        type=int,
        default=1,
        metavar="N",
        help="ZeRO-1 over N partial data-parallel domains, each sharding the optimizer state "
        "(Megatron-LM's --num-distributed-optimizer-instances; default 1, the whole group)",
    )
    cmd.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    cmd.add_argument(
        "--schedule", default=DEFAULT_SCHEDULE, choices=SCHEDULES, help="pipeline schedule"
    )
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
        "--param-offload",
        action="store_true",
        help="ZeRO-3's weight shards in host memory, copied in over PCIe for each gather "
        "(DeepSpeed offload_param)",
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


def _plan_args(cmd: argparse.ArgumentParser) -> None:
    """The degrees, schedules and choices ``plan`` may search, and its limits."""
    _job_args(cmd)
    for degree in ("tp", "cp", "pp", "ep", "etp", "micro-batch", "zero"):
        cmd.add_argument(f"--{degree}", type=int, nargs="+", default=None, help=f"allowed {degree}")
    cmd.add_argument("--schedule", nargs="+", choices=SCHEDULES, default=None, help="allowed")
    cmd.add_argument(
        "--from",
        dest="from_plan",
        default=None,
        metavar="PLAN_JSON",
        help="re-plan an earlier plan (planner plan --json) for its model, machine and job, on "
        "--gpus N if given, starting from its layout; says what changed",
    )
    cmd.add_argument(
        "--hints",
        nargs="+",
        default=None,
        metavar="FILE",
        help="start the search from the layouts in these plans (planner plan --json) or sweep "
        "databases (planner sweep --db), each restated for this job where it can be",
    )
    cmd.add_argument(
        "--zero-hpz",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="allowed ZeRO++ secondary shard sizes under ZeRO-3 (default 1, and a node's GPUs "
        "where the framework has it and data parallelism spans nodes)",
    )
    cmd.add_argument(
        "--cp-comm-type",
        nargs="+",
        choices=["p2p", "a2a", "a2a+p2p"],
        default=None,
        help="allowed context-parallel communication where cp > 1 (default all: the ring, the "
        "heads split by all-to-all where they divide, and both, all-to-all within a node and "
        "a ring across nodes)",
    )
    cmd.add_argument("--recompute", nargs="+", default=None, help="allowed recompute choices")
    cmd.add_argument(
        "--fp8-cache",
        action="store_true",
        help="also try keeping SwiGLU inputs in FP8 (FP8 compute, framework megatron)",
    )
    cmd.add_argument(
        "--optimizer-offload",
        type=float,
        nargs="+",
        default=None,
        metavar="FRACTION",
        help="allowed fractions of the optimizer state kept and stepped on the host, e.g. 0 1 "
        "(default 0: not searched; megatron with ZeRO-1, or deepspeed with 1)",
    )
    cmd.add_argument(
        "--param-offload",
        action="store_true",
        help="also try ZeRO-3 with its weight shards in host memory (DeepSpeed offload_param)",
    )
    cmd.add_argument(
        "--sequence-parallel",
        nargs="+",
        choices=["on", "off"],
        default=None,
        help="allowed sequence parallelism where tp > 1 (default on: it never loses)",
    )
    cmd.add_argument(
        "--target",
        nargs="+",
        default=None,
        choices=["any", *LAUNCHERS],
        help="the framework(s) that run the plan: only layouts they run, priced as they run "
        "them (default: --framework's, megatron); several or 'any': the best plan of each, "
        "and the fastest of them",
    )
    cmd.add_argument(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT_S,
        help=f"seconds the search may take (default {DEFAULT_TIME_LIMIT_S:g})",
    )
    cmd.add_argument("--json", action="store_true", help="print the plan as JSON")
    cmd.add_argument("--plot", default=None, metavar="PREFIX", help=PLOT_PREFIX_HELP)


def _export_args(cmd: argparse.ArgumentParser) -> None:
    """The plan to export, the launcher and where the files go."""
    cmd.add_argument("--plan", required=True, help="a plan JSON file ('-' reads stdin)")
    cmd.add_argument("--target", required=True, choices=LAUNCHERS)
    cmd.add_argument("--out", default=None, help="directory to write the config files into")
    cmd.add_argument("--json", action="store_true", help="print the export as JSON")
    cmd.add_argument(
        "--force",
        action="store_true",
        help="write the launch config even when the plan does not fit HBM (default: refuse, "
        "exit 3)",
    )


def _sweep_args(cmd: argparse.ArgumentParser) -> None:
    """The cases ``sweep`` plans (every combination of the lists) and where rows go."""
    cmd.add_argument("--model", nargs="+", required=True, help="catalog names or config paths")
    cmd.add_argument("--cluster", nargs="+", default=["h100"], help="machine types")
    cmd.add_argument("--gpus", type=int, nargs="+", required=True, help="total GPU counts")
    cmd.add_argument("--seq-len", type=int, nargs="+", required=True, help="tokens/sequence")
    cmd.add_argument("--global-batch", type=int, nargs="+", required=True, help="sequences/step")
    _precision_args(cmd)
    cmd.add_argument(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT_S,
        help=f"seconds per case (default {DEFAULT_TIME_LIMIT_S:g})",
    )
    cmd.add_argument("--db", default="sweep.sqlite", help="results database (resumes from it)")
    cmd.add_argument("--workers", type=int, default=None, help="local processes (default: CPUs)")
    cmd.add_argument("--ray", default=None, metavar="ADDRESS", help="run on Ray: auto | local")
    cmd.add_argument("--retry-failed", action="store_true", help="plan failed cases again")
    cmd.add_argument(
        "--no-warm-start",
        action="store_true",
        help="plan each GPU count on its own (default: start from the next smaller count's plan)",
    )
    cmd.add_argument(
        "--no-refine",
        action="store_true",
        help="skip the second pass (default: a case is planned again from the other GPU "
        "counts' plans where one, restated for it, is faster)",
    )
    cmd.add_argument("--out", default=None, help="write rows to a .csv or .json file")
    cmd.add_argument("--json", action="store_true", help="print the rows as JSON")
    cmd.add_argument(
        "--plot", default=None, metavar="FILE", help="write the sweep curves (.png, .svg or .pdf)"
    )


def _validate_args(cmd: argparse.ArgumentParser) -> None:
    """Which small layouts ``validate`` runs for real, and how."""
    cmd.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu: one gloo process per rank, FP32; cuda: one NCCL process per rank on its own "
        "GPU, BF16, with the allocator's allocated and reserved peaks (default cpu)",
    )
    cmd.add_argument("--steps", type=int, default=3, help="timed steps per layout after warm-up")
    cmd.add_argument("--rounds", type=int, default=1, help="run the set this many times over")
    cmd.add_argument("--only", type=int, nargs="+", default=None, help="case numbers (1-based)")
    cmd.add_argument(
        "--set",
        default="small",
        choices=("small", "one-gpu", "one-gpu-moe"),
        help="small: the small MoE model's layouts of 1-4 ranks (default); one-gpu: a 4-layer "
        "Llama 3 8B at sequence 4,096 in twelve single-GPU layouts (micro-batch x recompute; "
        "--device cuda); one-gpu-moe: a 2-layer Mixtral 8x7B in six",
    )
    cmd.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="also write each layout's run as a Megatron-LM-format log there (for planner "
        "calibrate --log)",
    )
    cmd.add_argument("--json", action="store_true", help="one JSON entry per layout and rank")
    cmd.add_argument(
        "--cluster", default=None, help="a calibrated profile YAML (default: calibrate now)"
    )
    cmd.add_argument(
        "--cap",
        type=float,
        default=None,
        metavar="MIB",
        help="instead: plan 2 ranks under this memory cap and run the plans for real",
    )


def _calibrate_args(cmd: argparse.ArgumentParser) -> None:
    """``calibrate``: fitting to measured runs, measuring this machine, or a device sweep."""
    cmd.add_argument(
        "--runs",
        default=None,
        metavar="CSV",
        help="measured runs to fit (columns: model,tp,pp,dp,micro_batch,global_batch,seq_len,"
        "step_s; optional ep,vp,schedule,recompute,zero,precision,framework,gpu,id)",
    )
    cmd.add_argument(
        "--log",
        nargs="+",
        default=None,
        metavar="FILE",
        help="training logs to fit (Megatron-LM, torchtitan, DeepSpeed): each states its model, "
        "layout and job and measured its step time (and memory where logged); fits the time "
        "and memory constants, each run held out in turn",
    )
    cmd.add_argument(
        "--plan-limit",
        type=float,
        default=10.0,
        metavar="S",
        help="with --log: seconds to plan the logs' job with the machine before and after the "
        "fit, to show how far the fit moves the plan (0: do not plan; default 10)",
    )
    cmd.add_argument(
        "--cluster",
        default=None,
        help="with --runs or --log: the machine type name or YAML to start from; with --sweep: "
        "price the rows with its rates instead of rates fitted to the run",
    )
    cmd.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu: gloo worker processes, FP32; cuda: NCCL, one GPU per process, BF16 "
        "(default cpu)",
    )
    cmd.add_argument(
        "--sweep",
        action="store_true",
        help="instead: measure ONE device against the cost model: the GEMMs of Llama 3 8B/70B "
        "and DeepSeek-V3 layers at tp 1, 2, 4, 8 (FLOP/s), causal attention forward and "
        "backward by sequence length, copy/add/RMSNorm (bytes/s), and real-width layers by "
        "micro-batch and recompute choice (time, kept bytes, peaks); prints tables and "
        "writes every row as JSON (--out, default sweep-<device>.json)",
    )
    cmd.add_argument(
        "--scale",
        type=float,
        default=None,
        help="with --sweep: factor on every width and length (default 1 on cuda, 1/32 on cpu, "
        "so a CPU sweep takes seconds)",
    )
    cmd.add_argument(
        "--folds",
        type=int,
        default=None,
        help="with --runs: k of the k-fold held-out error (0: none; default 5, or every run "
        "on its own when fewer)",
    )
    cmd.add_argument(
        "--rounds", type=int, default=3, help="with --runs or --log: linearisations of the fit"
    )
    cmd.add_argument("--processes", type=int, default=2, help="worker processes ('GPUs')")
    cmd.add_argument(
        "--out",
        default=None,
        help="YAML to write (default: <cluster>-fitted.yaml, or <device>-<processes>.yaml); "
        "with --sweep, JSON (default sweep-<device>.json)",
    )
    cmd.add_argument("--name", default=None, help="machine name in the profile")


def _precision_args(cmd: argparse.ArgumentParser) -> None:
    """The job's precisions and framework, as every command that builds a job takes them."""
    cmd.add_argument("--compute-dtype", default="bf16", choices=["bf16", "fp8"], help="GEMMs")
    cmd.add_argument("--moment-dtype", default="fp32", help="optimizer moment dtype")
    cmd.add_argument("--grad-dtype", default=None, help="gradient dtype (default: the framework's)")
    cmd.add_argument("--ema", default=None, help="EMA dtype (omit for no EMA)")
    cmd.add_argument(
        "--memory-margin",
        type=float,
        default=None,
        metavar="FRACTION",
        help="share of usable HBM kept free for the memory model's error (default 0.05); "
        "each estimate states the risk its headroom leaves",
    )
    cmd.add_argument(
        "--framework",
        default=None,
        choices=FRAMEWORK_NAMES,
        help="training software: what overlaps with compute (default megatron, or --target's)",
    )
    cmd.add_argument(
        "--moe-dispatcher",
        default=None,
        choices=["alltoall", "allgather", "deepep"],
        help="how MoE tokens reach their experts (default alltoall: NCCL all-to-all; deepep "
        "crosses InfiniBand once per node a token visits)",
    )
    cmd.add_argument(
        "--moe-grouped-tensor",
        dest="moe_grouped_tensor",
        action="store_const",
        const=True,
        default=None,
        help="Megatron-LM's --moe-use-grouped-tensor: the routed experts' GEMMs as one grouped "
        "kernel, not one host launch per local expert",
    )
    cmd.add_argument(
        "--no-tp-comm-overlap",
        dest="tp_comm_overlap",
        action="store_const",
        const=False,
        default=None,
        help="the framework's tensor-parallel overlap is off (Megatron-LM without "
        "--tp-comm-overlap, torchtitan without async TP): tensor-parallel collectives exposed",
    )
    cmd.add_argument(
        "--exposed-grad-reduce",
        dest="exposed_grad_reduce",
        action="store_const",
        const=True,
        default=None,
        help="the data-parallel gradient reduction after the last backward, not beside it "
        "(Megatron-LM without --overlap-grad-reduce)",
    )
    cmd.add_argument(
        "--attention-kernel",
        default=None,
        choices=["fused", "fa2"],
        help="fused attention kernel (default fused: the GPU's fastest, cuDNN or "
        "FlashAttention-3; fa2: FlashAttention-2, which on Hopper reaches about 0.30 of peak)",
    )
