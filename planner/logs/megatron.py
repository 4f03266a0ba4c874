"""Megatron-LM: a run's arguments as the planner's model, job and layout, and its training log
as a measured run.

``row_of`` states a run from its arguments (Megatron-LM's flag names, ``Args``) as the columns
of ``planner.fit``'s run rows; ``benchmarks/harvest_megatron_ci.py`` reads Megatron-LM's
functional tests with it, and ``read`` reads a training log with it. Line formats, at
Megatron-LM commit d98e8a64:

- the argument block, printed once per start by rank 0 (``_print_args`` in
  ``megatron/training/arguments.py:1990``): ``------------------------ arguments
  ------------------------``, then ``  <name> <dots to column 48> <value>`` per argument (its
  ``dest``: ``num_layers``, ``tensor_model_parallel_size``, ...), then ``--------------------
  end of arguments ---------------------``;
- the padded vocabulary (``vocab_size_with_padding``,
  ``megatron/core/tokenizers/utils/build_tokenizer.py:141``): `` > padded vocab (size: V) with
  D dummy tokens (new size: N)``; the argument block is printed before the tokenizer sets
  ``padded_vocab_size``;
- one line per logged interval, printed by the last rank (``training_log``,
  ``megatron/training/training.py:3567-3575``): `` [date time] iteration <i>/<total> |
  consumed samples: <n> | elapsed time per iteration (ms): <t> | ...`` (older releases print
  no date), the mean over the ``--log-interval`` iterations the line closes;
- memory, by each data-parallel rank 0 after the first iterations and every
  ``--log-memory-interval`` (``report_memory``, ``megatron/training/utils/common_utils.py:313``):
  ``[Rank r] (after <i> iterations) memory (MB) | allocated: a | max allocated: b | reserved: c
  | max reserved: d`` in MiB (2**20 bytes).

Lines may carry a launcher's prefix (torchrun's ``[default0]:``, ``[rank0]:``, srun's ``0: ``,
Open MPI's ``[1,0]<stdout>:``). A log holds one run and may hold several starts of it (a
restart from a checkpoint prints the argument block again, and the iteration count resumes):
each start's first ``WARMUP`` iterations are left out of the median (initialisation,
compilation, the allocator's first growth). The step time is the median of the remaining
logged intervals; the memory peaks are the largest ``max allocated`` and ``max reserved`` any
rank reports (they are peaks since the process started).
"""

from __future__ import annotations

import ast
import math
import re
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import PlannerError
from planner.logs import LoggedRun

if TYPE_CHECKING:
    from planner.layout import Layout
    from planner.specs import ModelSpec, TrainingJob

WARMUP = 3  # iterations of each start left out of the median


class Unstated(PlannerError):
    """A run the planner cannot state; the message says what it lacks."""


# Arguments that make a run the planner cannot state: argument -> why.
UNSTATED = {
    "--multi-latent-attention": "multi-latent attention (no GPT spec key)",
    "--mtp-num-layers": "multi-token prediction (no GPT spec key)",
    "--experimental-attention-variant": "experimental attention variant",
    "--pipeline-model-parallel-layout": "pipeline layout string (uneven split)",
    "--decoder-first-pipeline-num-layers": "uneven pipeline split",
    "--decoder-last-pipeline-num-layers": "uneven pipeline split",
    "--account-for-embedding-in-pipeline-split": "uneven pipeline split",
    "--account-for-loss-in-pipeline-split": "uneven pipeline split",
    "--quick-geglu": "quick-GeGLU MLP (no GPT spec key)",
    "--window-size": "sliding-window attention (no GPT spec key)",
    "--attention-output-gate": "attention output gate (no GPT spec key)",
    "--export-kd-teacher-load": "knowledge distillation (a teacher forward per step)",
    "--step-batch-size-schedule": "batch-size schedule",
    "--rampup-batch-size": "batch-size ramp-up",
    "--fine-grained-activation-offloading": "fine-grained activation offloading",
    "--heterogeneous-layers-config-path": "heterogeneous layers",
    "--add-qkv-bias": "q/k/v bias apart from the linear biases (no GPT spec key)",
    "--qk-layernorm": "qk-layernorm (no GPT spec key)",
    # the last stage keeps the output layer's inputs and logits gradients of the first
    # --wgrad-deferral-limit micro-batches to the pipeline flush (tensor_parallel/layers.py,
    # pipeline_parallel/schedules.py finish_embedding_wgrad_compute at d98e8a64)
    "--defer-embedding-wgrad-compute": "output-layer weight gradients deferred to the flush",
}


class Args:
    """A run's MODEL_ARGS; ``stated`` records each Megatron-LM default taken for a missing
    argument, for the row's notes."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.defaults: list[str] = []

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def stated(self, key: str, default: Any) -> Any:
        if key in self.values:
            return self.values[key]
        said = f"{key.removeprefix('--')} {default}"
        if said not in self.defaults:  # a default read twice is listed once
            self.defaults.append(said)
        return default


def padded_vocab(args: Args, tp: int) -> int:
    """The vocabulary size the run used: the tokenizer's, padded up to a multiple of
    --make-vocab-size-divisible-by x tp, as Megatron-LM pads it."""
    if "--padded-vocab-size" in args:
        return int(args.get("--padded-vocab-size"))
    kind = args.stated("--tokenizer-type", "GPT2BPETokenizer")  # pretrain_gpt.py's default
    if kind == "GPT2BPETokenizer":
        vocab = 50257  # the GPT-2 BPE vocabulary (vocab.json)
    elif kind == "NullTokenizer" and "--vocab-size" in args:
        vocab = int(args.get("--vocab-size"))
    elif kind == "TikTokenizer":
        vocab = int(args.stated("--vocab-size", 2**17))  # DEFAULT_TIKTOKEN_MAX_VOCAB
    else:
        raise Unstated(f"vocabulary of {kind} not stated in the config")
    multiple = int(args.stated("--make-vocab-size-divisible-by", 128)) * tp
    return math.ceil(vocab / multiple) * multiple


def layer_pattern(value: Any, layers: int) -> tuple[int, int]:
    """(first dense layers, MoE every k-th layer) of --moe-layer-freq: an integer k, or a
    pattern such as ``([0]*3+[1]*11)``; Unstated if ModelSpec cannot express it."""
    text = str(value).strip()
    if text.isdigit():
        return 0, int(text)
    pattern: list[int] = []
    for term in text.strip("()").split("+"):
        match = re.fullmatch(r"\s*\[([01,\s]+)\]\s*(?:\*\s*(\d+))?\s*", term)
        if not match:
            raise Unstated("moe-layer-freq pattern not parsed")
        items = [int(x) for x in match.group(1).replace(",", " ").split()]
        pattern += items * int(match.group(2) or 1)
    if len(pattern) != layers:
        raise Unstated("moe-layer-freq pattern does not cover the layers")
    dense = next((i for i, x in enumerate(pattern) if x), layers)
    for freq in range(1, layers + 1):
        if all(x == (i >= dense and i % freq == 0) for i, x in enumerate(pattern)):
            return dense, freq
    raise Unstated("moe-layer-freq pattern not expressible (dense layers, then every k-th)")


def as_list(value: Any) -> list[str]:
    """A multi-valued argument (``[a b]`` or a YAML list) as its items."""
    if isinstance(value, list):
        return " ".join(str(v) for v in value).split()
    return str(value).strip("[]").split()


def model_spec(args: Args, tp: int, notes: list[str]) -> str:
    """The GPT spec (``planner.fit.GPT_KEYS``) of the run's model."""
    hidden = int(args.get("--hidden-size"))
    heads = int(args.get("--num-attention-heads"))
    layers = int(args.get("--num-layers"))
    if int(args.get("--kv-channels", hidden // heads)) * heads != hidden:
        raise Unstated("kv-channels x heads != hidden (no GPT spec key)")
    dropout = float(args.stated("--hidden-dropout", 0.1))
    if float(args.stated("--attention-dropout", 0.1)) != dropout:
        raise Unstated("hidden and attention dropout differ (one GPT spec key)")
    spec = [f"hidden={hidden}", f"layers={layers}", f"heads={heads}"]
    spec.append(f"vocab={padded_vocab(args, tp)}")
    if args.get("--group-query-attention"):  # else Megatron-LM ignores --num-query-groups
        kv = int(args.stated("--num-query-groups", 1))
        if kv != heads:
            spec.append(f"kv={kv}")
    swiglu = bool(args.get("--swiglu"))
    if "--ffn-hidden-size" in args:
        ffn = int(args.get("--ffn-hidden-size"))
    elif swiglu:
        ffn = int((4 * hidden * 2 / 3) / 64) * 64  # arguments.py's SwiGLU default
        args.defaults.append(f"ffn-hidden-size {ffn} (SwiGLU)")
    else:
        ffn = 4 * hidden
    if ffn != 4 * hidden:
        spec.append(f"ffn={ffn}")
    if swiglu:
        spec.append("swiglu=1")
    elif args.get("--squared-relu"):  # Megatron-LM's squared_relu, ungated
        spec.append("relu2=1")
    if args.stated("--normalization", "LayerNorm") == "RMSNorm":
        spec.append("rmsnorm=1")
    position = args.stated("--position-embedding-type", "learned_absolute")
    if args.get("--use-rotary-position-embeddings"):
        position = "rope"
    if position in ("rope", "yarn"):
        spec.append("rope=1")
    elif position != "learned_absolute":
        raise Unstated(f"position embedding {position} (no GPT spec key)")
    elif int(args.get("--max-position-embeddings")) != int(args.get("--seq-length")):
        notes.append(f"{args.get('--max-position-embeddings')} learned position rows")
    if args.get("--disable-bias-linear"):
        spec.append("bias=0")
    if args.get("--untie-embeddings-and-output-weights"):
        spec.append("tied=0")
    if dropout:
        spec.append(f"dropout={dropout:g}")
    experts = int(args.get("--num-experts") or 0)
    if experts:
        spec += moe_spec(args, experts, ffn, layers)
    return "gpt:" + ";".join(spec)


def moe_spec(args: Args, experts: int, ffn: int, layers: int) -> list[str]:
    """The GPT spec's MoE keys."""
    spec = [f"experts={experts}", f"topk={int(args.stated('--moe-router-topk', 2))}"]
    if int(args.get("--moe-ffn-hidden-size") or ffn) != ffn:
        spec.append(f"moeffn={int(args.get('--moe-ffn-hidden-size'))}")
    if args.get("--moe-shared-expert-intermediate-size"):
        spec.append(f"shared={int(args.get('--moe-shared-expert-intermediate-size'))}")
        if args.get("--moe-shared-expert-gate"):
            spec.append("sgate=1")
    if "--moe-layer-freq" in args:
        dense, freq = layer_pattern(args.get("--moe-layer-freq"), layers)
        spec += [f"dense={dense}"] if dense else []
        spec += [f"moefreq={freq}"] if freq > 1 else []
    if args.get("--moe-router-score-function", "softmax") == "sigmoid":
        spec.append("sigmoid=1")
    if args.get("--moe-router-enable-expert-bias"):
        spec.append("ebias=1")
    if args.get("--moe-router-num-groups"):
        spec.append(f"groups={int(args.get('--moe-router-num-groups'))}")
        if args.get("--moe-router-group-topk"):
            spec.append(f"gtopk={int(args.get('--moe-router-group-topk'))}")
    if args.get("--moe-router-topk-scaling-factor"):
        spec.append(f"rscale={float(args.get('--moe-router-topk-scaling-factor')):g}")
    return spec


# torch dtypes as arguments.py's validate_args maps --main-params-dtype and --exp-avg-dtype
# (printed as torch.float32 and so on), by the planner's names
STATE_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def optimizer_dtypes(args: Args) -> dict[str, str]:
    """The optimizer state's dtypes a run states: with --use-precision-aware-optimizer, the
    moments' (--exp-avg-dtype and --exp-avg-sq-dtype, where they agree) and the master
    weights' (--main-params-dtype); without it Megatron-LM keeps both in FP32 and the
    columns stay empty (the defaults)."""
    if not args.get("--use-precision-aware-optimizer"):
        return {"moment_dtype": "", "master_dtype": ""}
    avg, sq = (
        STATE_DTYPES.get(str(args.get(f))) for f in ("--exp-avg-dtype", "--exp-avg-sq-dtype")
    )
    master = STATE_DTYPES.get(str(args.get("--main-params-dtype")))
    return {"moment_dtype": avg if avg and avg == sq else "", "master_dtype": master or ""}


def row_of(args: Args, gpus: int, notes: list[str]) -> dict[str, str]:
    """The columns of ``planner.fit``'s run rows (``RUN_COLUMNS``, ``OPTIONAL_COLUMNS``) that
    a Megatron-LM run's arguments state on ``gpus`` GPUs: model (a GPT spec), layout, job
    and the switches that change its time or memory (``Unstated`` where the planner cannot
    state the run; a note per model detail the spec leaves out goes to ``notes``)."""
    for key, why in UNSTATED.items():
        if args.get(key) not in (None, False):
            raise Unstated(why)
    if args.get("--softmax-type", "vanilla") != "vanilla":
        raise Unstated("attention softmax variant (no GPT spec key)")
    if args.get("--optimizer", "adam") != "adam":
        raise Unstated(f"optimizer {args.get('--optimizer')} (no column)")
    if args.get("--recompute-method", "uniform") != "uniform":
        raise Unstated("block recompute of some layers (no recompute value)")

    # Precision
    if args.get("--fp8-format"):
        precision = "fp8"
    elif args.get("--fp16"):
        precision = "fp16"
    elif args.get("--bf16"):
        precision = "bf16"
    else:
        raise Unstated("FP32 training (no precision value)")

    # Layout
    tp = int(args.stated("--tensor-model-parallel-size", 1))
    pp = int(args.stated("--pipeline-model-parallel-size", 1))
    cp = int(args.stated("--context-parallel-size", 1))
    if gpus % (tp * pp * cp):
        raise Unstated("GPU count not a multiple of tp*pp*cp")
    dp = gpus // (tp * pp * cp)
    layers = int(args.get("--num-layers"))
    vp = 1
    if "--num-virtual-stages-per-pipeline-rank" in args:
        vp = int(args.get("--num-virtual-stages-per-pipeline-rank"))
    elif "--virtual-pipeline-model-parallel-size" in args:
        vp = int(args.get("--virtual-pipeline-model-parallel-size"))
    elif "--num-layers-per-virtual-pipeline-stage" in args:
        vp = layers // pp // int(args.get("--num-layers-per-virtual-pipeline-stage"))
    if pp == 1:
        vp = 1
    elif layers % (pp * vp):
        raise Unstated("layers do not divide into pp x vp stages (uneven split)")
    schedule = "interleaved" if vp > 1 else "1f1b"
    micro = int(args.get("--micro-batch-size"))
    global_batch = int(args.stated("--global-batch-size", micro * dp))
    if global_batch % (micro * dp):
        raise Unstated("global batch not a multiple of micro-batch x dp")
    if args.get("--use-megatron-fsdp"):
        strategy = args.stated("--data-parallel-sharding-strategy", "optim_grads_params")
        zero = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}[strategy]
    elif args.get("--use-torch-fsdp2"):
        zero = 3
    else:
        zero = 1 if args.get("--use-distributed-optimizer") else 0

    model = model_spec(args, tp, notes)
    ep, etp, dispatcher = 1, 1, ""
    if args.get("--num-experts"):
        ep = int(args.stated("--expert-model-parallel-size", 1))
        etp = int(args.stated("--expert-tensor-parallel-size", tp))  # Megatron-LM: tp if unset
        if (dp * cp * tp) % (ep * etp):
            raise Unstated("ep * etp does not divide dp*cp*tp")
        dispatcher = args.stated("--moe-token-dispatcher-type", "allgather")
        if dispatcher == "flex":
            if args.stated("--moe-flex-dispatcher-backend", "deepep") != "deepep":
                raise Unstated("flex dispatcher with a backend other than DeepEP (no value)")
            dispatcher = "deepep"
        if args.get("--overlap-moe-expert-parallel-comm"):
            schedule += "-ep-overlap"

    # Recompute
    granularity = args.get("--recompute-granularity")
    if args.get("--recompute-activations"):
        granularity = "selective"
    recompute = "none"
    if granularity == "full":
        recompute = "full"  # method uniform or unset: every layer
    elif granularity == "selective" and "--recompute-modules" in args:
        recompute = f"selective({'+'.join(as_list(args.get('--recompute-modules')))})"
    elif granularity == "selective":
        recompute = "selective"

    # Attention kernel: Transformer Engine's fused kernels unless unfused is asked for;
    # the local implementation computes the scores unfused
    impl = args.stated("--transformer-impl", "transformer_engine")
    if impl == "local":
        flash = bool(args.get("--use-flash-attn"))
    else:
        flash = args.stated("--attention-backend", "auto") != "unfused"
    if cp > 1 and not flash:
        raise Unstated("context parallelism with unfused attention")

    return {
        "model": model,
        "num_gpus": str(gpus),
        "tp": str(tp),
        "pp": str(pp),
        "dp": str(dp),
        "ep": str(ep),
        "cp": str(cp),
        "vp": str(vp),
        "micro_batch": str(micro),
        "global_batch": str(global_batch),
        "seq_len": str(int(args.get("--seq-length"))),
        "schedule": schedule,
        "recompute": recompute,
        "precision": precision,
        "framework": "megatron",
        "flash_attention": str(flash).lower(),
        # --transformer-impl local: Megatron-LM's own modules (TrainingJob.transformer_engine)
        "transformer_engine": str(impl != "local").lower(),
        "tp_comm_overlap": str(bool(args.get("--tp-comm-overlap"))).lower(),
        # without --overlap-grad-reduce the DDP reduction (ZeRO 0 and 1; Megatron FSDP's
        # reduce-scatters are its own) follows the last backward
        "exposed_grad_reduce": str(
            zero <= 1 and dp > 1 and not args.get("--overlap-grad-reduce")
        ).lower(),
        "fp8_cache": "false",
        "dispatcher": dispatcher,
        # --num-distributed-optimizer-instances: ZeRO-1 over partial data-parallel domains
        "optimizer_instances": str(int(args.get("--num-distributed-optimizer-instances", 1))),
        "moe_force_balance": str(bool(args.get("--moe-router-force-load-balancing"))).lower(),
        "grad_dtype": "bf16" if args.get("--grad-reduce-in-bf16") else "",
        "sequence_parallel": str(bool(args.get("--sequence-parallel")) and tp > 1).lower(),
        # --attention-backend flash: Transformer Engine's FlashAttention path, the flash-attn
        # package (FlashAttention-2); auto runs cuDNN's fused attention
        "attention_kernel": "fa2" if args.stated("--attention-backend", "auto") == "flash" else "",
        # --cross-entropy-loss-fusion: the compiled cross-entropy, native unless the
        # implementation is stated (ModelParallelConfig.cross_entropy_fusion_impl)
        "loss_fusion": args.stated("--cross-entropy-fusion-impl", "native")
        if args.get("--cross-entropy-loss-fusion")
        else "",
        **optimizer_dtypes(args),
        # q and k stay split with their heads through their norms (the all-gather is a
        # torchtitan plan's: TrainingJob.qk_norm_gathered)
        "qk_norm_gathered": "",
        "etp": str(etp),
        "zero": str(zero),
    }


# -- the log ---------------------------------------------------------------------------------

# Printed names (an argument's dest) that are not the flag's own name: dest -> (flag, negated)
DEST_FLAGS: dict[str, tuple[str, bool]] = {
    "add_bias_linear": ("--disable-bias-linear", True),  # TransformerConfig.add_bias_linear
    "fp8": ("--fp8-format", False),  # TransformerConfig.fp8
}
# Arguments no Megatron-LM run has, which ``planner validate`` adds to the argument block of
# its own runs' logs: the TrainingJob fields its runtime differs in (framework "torch", the
# dtypes it keeps, no CUDA context or NCCL buffers in the prediction). A Megatron-LM log has
# none and reads as Megatron-LM's own job.
JOB_PREFIX = "planner_job_"

PREFIX = re.compile(r"^(?:\[(?:default|rank)?\d+\]:|\d+: |\[\d+,\d+\]<std(?:out|err)>:) ?")
ARGS_START = re.compile(r"-{8,} arguments -{8,}")
ARGS_END = re.compile(r"-{8,} end of arguments -{8,}")
ARG_LINE = re.compile(r"^\s*([A-Za-z_]\w*) \.* ?(.*)$")
ITERATION = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \|.*? elapsed time per iteration \(ms\): ([0-9.]+) \|"
)
MEMORY = re.compile(
    r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| "
    r"max allocated: ([0-9.]+) \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+)"
)
VOCAB = re.compile(r"> padded vocab \(size: (\d+)\) with (\d+) dummy tokens \(new size: (\d+)\)")
MIB = 2**20


def recognises(text: str) -> bool:
    """Whether ``text`` has Megatron-LM's argument block or iteration lines."""
    return bool(ARGS_START.search(text) or "elapsed time per iteration (ms)" in text)


def _value(text: str) -> Any:
    """A printed argument value as Python: None, a bool, a number, a list, an enum's member
    name (``AttnBackend.auto`` -> ``auto``) or the text itself."""
    text = text.strip()
    if text in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[text]
    member = re.fullmatch(r"[A-Z]\w*\.(\w+)", text)
    if member:
        return member.group(1)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def flag_values(printed: dict[str, Any]) -> dict[str, Any]:
    """Printed arguments (dest -> value) as ``Args`` values (flag -> value); an argument
    printed as None is left out, as if not given."""
    values: dict[str, Any] = {}
    for dest, value in printed.items():
        if value is None or dest.startswith(JOB_PREFIX):
            continue
        flag, negated = DEST_FLAGS.get(dest, ("--" + dest.replace("_", "-"), False))
        values[flag] = (not value) if negated else value
    return values


class _Start:
    """One start of the run: its arguments and the intervals it logged."""

    def __init__(self, printed: dict[str, Any] | None) -> None:
        self.printed = printed
        self.intervals: list[tuple[int, float]] = []  # (iteration, ms per iteration)


def read(text: str, path: str) -> LoggedRun:
    """A Megatron-LM training log as a run (see the module docstring)."""
    from planner.fit import layout_from_row
    from planner.specs import TrainingJob

    where = f"log={path!r}"
    lines = text.split("\n")
    notes: list[str] = []
    if not text.endswith("\n") and lines[-1].strip():
        lines = lines[:-1]  # the log stops mid-line: the last line is not whole
        notes.append("the last line is cut off: left out")
    starts: list[_Start] = []
    memory: list[tuple[float, float]] = []
    vocab: int | None = None
    printed: dict[str, Any] | None = None
    for raw in lines:
        line = PREFIX.sub("", raw.rstrip("\r"))
        if printed is not None:
            if ARGS_END.search(line):
                starts.append(_Start(printed))
                printed = None
            elif m := ARG_LINE.match(line):
                printed[m.group(1)] = _value(m.group(2))
            continue
        if ARGS_START.search(line):
            printed = {}
        elif m := ITERATION.search(line):
            iteration, ms = int(m.group(1)), float(m.group(3))
            if not starts or (starts[-1].intervals and iteration <= starts[-1].intervals[-1][0]):
                # the count went back without an argument block: a start of its own
                starts.append(_Start(starts[-1].printed if starts else None))
            starts[-1].intervals.append((iteration, ms))
        elif m := MEMORY.search(line):
            memory.append((float(m.group(4)), float(m.group(6))))
        elif m := VOCAB.search(line):
            vocab = int(m.group(3))
    blocks = [s.printed for s in starts if s.printed is not None]
    if not blocks:
        raise PlannerError(
            f"{where}: no argument block ('--- arguments ---', printed by rank 0 at start): the "
            "model and layout are not stated"
        )
    intervals = [i for s in starts for i in s.intervals]
    if not intervals:
        raise PlannerError(
            f"{where}: no iteration line ('elapsed time per iteration (ms)'): nothing measured"
        )
    rows = [_row(b, vocab, where, notes if i == 0 else []) for i, b in enumerate(blocks)]
    for i, row in enumerate(rows[1:], start=2):
        differ = sorted(k for k in row if row[k] != rows[0][k])
        if differ:
            raise PlannerError(
                f"{where}: start {i} ran another layout or model than start 1 ({differ[0]}: "
                f"{rows[0][differ[0]]} then {row[differ[0]]}); give each run its own log"
            )
    kept = [ms for s in starts for ms in _steady(s.intervals)]
    if not kept:
        raise PlannerError(
            f"{where}: {len(intervals)} iteration line(s), all within the first {WARMUP} "
            "iterations of a start (warm-up); needs one after"
        )
    notes.append(
        f"median of {len(kept)} logged interval(s) over {len(starts)} start(s), the first "
        f"{WARMUP} iterations of each start left out"
    )
    model, job, layout = layout_from_row(rows[0], where)
    overrides = {
        k.removeprefix(JOB_PREFIX): v for k, v in blocks[0].items() if k.startswith(JOB_PREFIX)
    }
    if overrides:
        try:
            job = TrainingJob(**{**job.model_dump(), **overrides})
        except ValueError as exc:
            raise PlannerError(f"{where}: {str(exc).splitlines()[0]}") from None
    return LoggedRun(
        path=path,
        framework=job.framework,
        model=model,
        job=job,
        layout=layout,
        step_s=statistics.median(kept) / 1e3,
        iterations=len(kept),
        allocated_peak_bytes=round(max(a for a, _ in memory) * MIB) if memory else None,
        reserved_peak_bytes=round(max(r for _, r in memory) * MIB) if memory else None,
        notes=tuple(notes),
    )


def _row(
    printed: dict[str, Any], vocab: int | None, where: str, notes: list[str]
) -> dict[str, str]:
    """The run row one argument block states."""
    values = flag_values(printed)
    if JOB_PREFIX + "activation_dtype" in printed and not (
        values.get("--bf16") or values.get("--fp16") or values.get("--fp8-format")
    ):
        # an FP32 run of planner validate: the job's own dtypes replace the row's precision
        values["--bf16"] = True
    if vocab is not None and "--padded-vocab-size" not in values:
        values["--padded-vocab-size"] = vocab
    gpus = printed.get("world_size")
    if not isinstance(gpus, int) or gpus < 1:
        raise PlannerError(f"{where}: the argument block states no world_size: the GPU count")
    args = Args(values)
    try:
        row = row_of(args, gpus, notes)
    except PlannerError as exc:
        raise PlannerError(f"{where}: the planner cannot state this run: {exc}") from None
    if args.defaults:
        notes.insert(0, "Megatron-LM defaults (not in the log): " + ", ".join(args.defaults))
    return row


def _steady(intervals: list[tuple[int, float]]) -> list[float]:
    """The ms per iteration of one start's intervals after its first ``WARMUP`` iterations:
    an interval closing at iteration i covers the ``log_interval`` iterations up to i, so it
    is kept where i is at least ``WARMUP`` past the start's first logged iteration."""
    if not intervals:
        return []
    first = intervals[0][0]
    return [ms for i, ms in intervals if i >= first + WARMUP and math.isfinite(ms)]


# -- writing: a log in Megatron-LM's line formats ------------------------------------------


def argument_lines(printed: dict[str, Any]) -> list[str]:
    """The argument block as ``_print_args`` prints it (sorted, case-blind, dots to column
    48)."""
    body = [f"  {k} {'.' * (48 - len(k))} {v}" for k, v in printed.items()]
    return [
        "------------------------ arguments ------------------------",
        *sorted(body, key=str.lower),
        "-------------------- end of arguments ---------------------",
    ]


def iteration_line(
    iteration: int, total: int, samples: int, ms: float, global_batch: int, loss: float
) -> str:
    """One ``training_log`` line (the fields every run prints)."""
    return (
        f" iteration {iteration:8d}/{total:8d} | consumed samples: {samples:12d} | elapsed time "
        f"per iteration (ms): {ms:.1f} | global batch size: {global_batch:5d} | lm loss: "
        f"{loss:.6E} | loss scale: 1.0 | number of skipped iterations:   0 | number of nan "
        "iterations:   0 |"
    )


def memory_line(rank: int, iteration: int, allocated: int, reserved: int | None) -> str:
    """One ``report_memory`` line; the current figures printed as the peaks (a run that
    keeps one step's peaks); reserved as allocated where not measured (the CPU)."""
    a = allocated / MIB
    r = (reserved if reserved is not None else allocated) / MIB
    return (
        f"[Rank {rank}] (after {iteration} iterations) memory (MB) | allocated: {a:.2f} | "
        f"max allocated: {a:.2f} | reserved: {r:.2f} | max reserved: {r:.2f}"
    )


def printed_values(flags: list[str]) -> dict[str, Any]:
    """Megatron-LM flags (``["--num-layers", "4", "--swiglu", ...]``) as ``_print_args`` prints
    them: dest -> value (a flag alone: True; several values: a list)."""
    flag_dests = {flag: (dest, negated) for dest, (flag, negated) in DEST_FLAGS.items()}
    printed: dict[str, Any] = {}
    i = 0
    while i < len(flags):
        flag = flags[i]
        values = []
        i += 1
        while i < len(flags) and not flags[i].startswith("--"):
            values.append(_value(flags[i]))
            i += 1
        dest, negated = flag_dests.get(flag, (flag.removeprefix("--").replace("-", "_"), False))
        value: Any = True if not values else values[0] if len(values) == 1 else values
        printed[dest] = (not value) if negated else value
    return printed


def arguments(model: ModelSpec, job: TrainingJob, layout: Layout) -> dict[str, Any]:
    """The argument block (dest -> value) of a run of ``layout`` of ``model`` under ``job``:
    the model as ``planner export --target megatron`` states it, the layout in Megatron-LM's
    degrees (virtual stages as ``virtual_pipeline_model_parallel_size``), and, under
    ``JOB_PREFIX``, every ``job`` field that Megatron-LM's arguments do not state as ``job``
    has it (what ``read`` applies on top of them)."""
    from planner.export.megatron import recompute_args, zero_args
    from planner.export.megatron_model import model_args
    from planner.fit import layout_from_row

    flags, _ = model_args(model, tp=layout.tp, seq_len=job.seq_len)
    flags += recompute_args(layout) + zero_args(layout.zero, overlap=not job.exposed_grad_reduce)
    printed = printed_values(flags)
    printed.update(
        seq_length=job.seq_len,
        micro_batch_size=layout.micro_batch,
        global_batch_size=job.global_batch,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        virtual_pipeline_model_parallel_size=layout.virtual_stages if layout.pp > 1 else None,
        world_size=layout.world_size,
        data_parallel_size=layout.dp,
        sequence_parallel=layout.sequence_parallel and layout.tp > 1,
        bf16=job.activation_dtype == "bf16",
        fp16=job.activation_dtype == "fp16",
    )
    if model.num_experts:
        printed.update(
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            moe_token_dispatcher_type=job.moe_dispatcher,
        )
    stated = {**printed, JOB_PREFIX + "activation_dtype": job.activation_dtype}
    _, base, _ = layout_from_row(_row(stated, None, "arguments", []), "arguments")
    for key, value in job.model_dump().items():
        if getattr(base, key) != value:
            printed[JOB_PREFIX + key] = value
    return printed


def write_log(
    path: str | Path,
    model: ModelSpec,
    job: TrainingJob,
    layout: Layout,
    step_s: list[float],
    memory: list[tuple[int, int, int | None]],
    losses: list[float] | None = None,
    *,
    append: bool = False,
) -> None:
    """A log of a run in Megatron-LM's line formats: the argument block (``arguments``), one
    iteration line per step of ``step_s`` (seconds; every step, warm-up included, as
    ``--log-interval 1`` logs them) and one memory line per rank of ``memory`` (rank,
    allocated peak, reserved peak or None: bytes) after the last step. ``append``: add the run
    to the file as a further start (a restart prints its argument block again)."""
    total = len(step_s)
    lines = argument_lines(arguments(model, job, layout))
    for i, seconds in enumerate(step_s, start=1):
        loss = losses[i - 1] if losses and i <= len(losses) else float("nan")
        lines.append(
            iteration_line(i, total, i * job.global_batch, seconds * 1e3, job.global_batch, loss)
        )
    lines += [memory_line(rank, total, a, r) for rank, a, r in memory]
    with Path(path).open("a" if append else "w") as out:
        out.write("\n".join(lines) + "\n")
