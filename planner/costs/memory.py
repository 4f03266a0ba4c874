"""Per-rank memory of a layout, in bytes, bucket by bucket.

What each bucket holds (one rank of a pipeline position; every rank of that position holds
the same):

- ``weights``: working weights in ``weight_dtype``; ZeRO-3 shards them.
- ``grads``: gradient buffers in ``grad_dtype``; ZeRO-2 and -3 shard them.
- ``optimizer``: master weights (``master_dtype``) and moments (two for AdamW, one for SGD
  with momentum) in ``moment_dtype``; ZeRO-1 and up shard them.
- ``ema``: an EMA copy in the job's ``ema`` dtype when it lives in HBM, sharded like the
  optimizer state.
- ``activations``: saved activations of the micro-batches in flight at the rank's peak (the
  schedule's op order says how many of each chunk), with what one block rebuilds while a
  backward recomputes it (less what the chunk's later blocks have freed by then).
- ``buffers``: NCCL communication buffers, pipeline send/receive tensors, ZeRO-3's
  gathered copy of the largest block (twice: the one in use and the one prefetched),
  under ZeRO-2/3 one reduce bucket (the largest block's unsharded gradients), with context
  parallelism the ring's receive buffers (a block's keys and values and their gradients, in
  use and arriving: 4 times its K and V), and for an eager PyTorch runtime the gradients a
  backward holds in flight.
- ``context``: CUDA context and kernels.
- ``fragmentation``: the job's fraction of all allocated bytes above.

Sharding groups: dense weights are split over ``tp`` and ZeRO-sharded over ``dp * cp`` (the
ranks that reduce their gradients); routed experts are split over ``ep * etp`` and
ZeRO-sharded over the expert-data-parallel group ``dp * cp * tp / (ep * etp)``. Context
parallelism splits every activation by sequence: a rank keeps ``tokens / cp`` of each
micro-batch. Tensors shared by
several blocks on one rank (a tied embedding and head) count once; on different ranks each
rank holds its own copy, as Megatron-LM does.

Ignored: the optimizer's temporary buffers during the step, NCCL's own memory beyond the
stated buffer, activation-gradient tensors in flight during backward (bounded by one block's
activations; counted in buffers for an eager PyTorch runtime, ``runtime="torch"``), and the
host side of an EMA kept on the host and of an offloaded optimizer (reported as
``host_bytes``, and checked against the node's host RAM by the search).

Optimizer offload (``Layout.optimizer_offload``, a fraction ``f``): the rank keeps ``1 - f``
of its optimizer state in HBM; the rest lives on the host with what the framework keeps
there per offloaded element (``Framework.optimizer_offload``). Working weights and gradient buffers
stay in HBM as before (the framework copies from and into them). What the step moves is in
``StageMemory.step_bytes`` (see ``planner.costs.timing.optimizer_seconds``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.costs.blocks import OFFLOAD, OFFLOAD_TAG, BlockCost, Param, Shard, block_cost
from planner.errors import PlannerError
from planner.frameworks import FRAMEWORKS, Framework, framework
from planner.layout import Layout, parse_recompute
from planner.schedules import op_order, schedule_of
from planner.specs import DTYPE_BYTES, ClusterSpec, ModelSpec, TrainingJob

BUCKETS = (
    "weights",
    "grads",
    "optimizer",
    "ema",
    "activations",
    "buffers",
    "context",
    "fragmentation",
)
Runtime = Literal["megatron", "torch"]
EMBEDDING_HEAD_KEYS = frozenset({"word_embeddings", "output", "position_embeddings"})
# Whether FP8 linears keep the FP8 copy of their input for the weight gradient
# (Framework.fp8_keeps_fp8_inputs): Megatron-LM and DeepSpeed run Transformer Engine's
# linears, which quantise the input once and keep that copy. torchtitan's float8 linears
# (torchao) keep the BF16 input and quantise it again in backward: torchtitan's own table
# shows it, Llama 3.1 8B on 8 H100 reserving 77.0 GiB with torch.compile and 76.8 GiB with
# Float8 added (benchmarks/llama3_h100_202412_torchtitan.md, Table 1).
# DeepSpeed's ZeRO buffers (Framework.fixed_reduce_buckets, Framework.max_live_parameters;
# deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig defaults;
# planner.export.deepspeed writes both values into ds_config.json):
# - reduce_bucket_size = 5e8 elements. With contiguous_gradients (default on), stages 1-2
#   allocate a gradient bucket ("ipg_buffer") of that many elements in the 16-bit dtype before
#   each backward, and a second one with overlap_comm (stage_1_and_2.py,
#   DeepSpeedZeroOptimizer.backward); with pipeline parallelism, one
#   (DeepSpeedZeroOptimizer.reduce_gradients). Stage 3 allocates one flat bucket of that size
#   at start-up (stage3.py). Whatever the model's size: 0.93 GiB each in BF16.
# - stage3_max_live_parameters = 1e9 elements: stage 3 keeps up to that many gathered
#   parameters resident before it releases any (and, with max_reuse_distance = 1e9, does not
#   release those it will reuse soon, as at the turn from forward to backward).
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000


def usable_hbm(cluster: ClusterSpec) -> int:
    """Usable HBM per GPU (bytes): what the CUDA runtime reports as the device's total."""
    return cluster.usable_hbm_bytes


def usable_peak_bytes(cluster: ClusterSpec, job: TrainingJob) -> int:
    """The most a rank's predicted peak (``StageMemory.peak_bytes``, which already holds the
    CUDA context and fragmentation) may be: usable HBM less the job's margin for the memory
    model's own error, ``floor(usable_hbm_bytes * (1 - memory_margin))``.

    Usable, not nominal, HBM (``usable_hbm``): what the CUDA runtime reports as the device's
    total is what a process can allocate (79.15 GiB of an H100's 80). The margin is
    ``TrainingJob.memory_margin`` (see there for the measured error it covers)."""
    return math.floor(usable_hbm(cluster) * (1 - job.memory_margin))


def memory_cap(cluster: ClusterSpec, job: TrainingJob) -> float:
    """The bytes a rank's ALLOCATED memory may reach: weights + grads + optimizer + ema +
    activations + buffers, i.e. before the CUDA context and fragmentation are added.

    ``(usable_hbm_bytes * (1 - memory_margin) - cuda_context_bytes) / (1 + fragmentation)``:
    usable HBM (what the CUDA runtime reports as the device's total, not the nominal
    capacity), less the margin kept free for the memory model's own error, less the CUDA
    context (allocated inside usable HBM), divided by the allocator's fragmentation factor
    (fragmentation is a fraction of the allocated bytes). A rank whose allocated bytes stay
    within this has ``peak_bytes <= usable_peak_bytes(cluster, job)`` (up to rounding of each
    bucket to whole bytes). This and ``usable_peak_bytes`` are the one definition of the cap
    for every consumer (the solver's memory constraint, its bounds and explanations,
    ``Estimate.fits``, ``check_plan``, exports, sweeps): none computes it by hand."""
    usable = usable_hbm(cluster) * (1 - job.memory_margin)
    return (usable - job.cuda_context_bytes) / (1 + job.fragmentation)


class StageMemory(BaseModel):
    """Memory of one rank at pipeline position ``stage``, all in bytes."""

    model_config = ConfigDict(frozen=True)

    stage: int = Field(description="Pipeline rank (0-based); its chunks are listed in `chunks`.")
    chunks: list[int] = Field(description="Indices of the layout's stages this rank holds.")
    blocks: list[str] = Field(description="Blocks this rank holds, in model order.")
    buckets: dict[str, int] = Field(description="Bytes per bucket; they sum to peak_bytes.")
    peak_bytes: int = Field(description="Predicted peak allocation on the rank (bytes).")
    params: int = Field(description="Trainable parameters resident before ZeRO-3 sharding.")
    embedding_head_bytes: int = Field(
        description="Part of weights+grads+optimizer+ema that is embedding/head state (bytes)."
    )
    host_bytes: int = Field(
        description="Host RAM the rank uses for an EMA kept on the host and an offloaded "
        "optimizer (bytes)."
    )
    step_bytes: dict[str, int] = Field(
        default_factory=dict,
        description="Bytes the rank's optimizer step moves, by path: 'step_hbm' (the GPU's "
        "part), 'step_d2h' and 'step_h2d' (gradients to and weights from an offloaded part, "
        "over PCIe), 'step_host' (the host CPU's part, through host memory).",
    )

    @property
    def allocated_bytes(self) -> int:
        """Peak bytes in live tensors: what torch.cuda.max_memory_allocated reports."""
        return self.peak_bytes - self.buckets["context"] - self.buckets["fragmentation"]

    @property
    def reserved_bytes(self) -> int:
        """Peak bytes the caching allocator holds in segments (live tensors and the free space
        fragmentation strands): what torch.cuda.max_memory_reserved reports. With the CUDA
        context it is the rank's use of the device's usable HBM (``peak_bytes``)."""
        return self.peak_bytes - self.buckets["context"]


def activation_peak(
    layout: Layout,
    rank: int,
    num_microbatches: int,
    per_chunk: dict[int, float],
    rebuild: dict[int, float],
    kept: tuple[dict[int, float], dict[int, float]] | None = None,
) -> float:
    """Highest activation level on ``rank`` as its op order runs: each forward adds its
    chunk's saved bytes for one micro-batch and the backward that consumes them (the
    weight-gradient op when the schedule splits it off) removes them; while a backward runs,
    the block it recomputes holds its rebuilt tensors too (``rebuild``: see ``rebuild_peak``).
    ``kept``: bytes each forward and each backward of a chunk leave until the step ends
    (tensors a runtime holds on to, see ``stage_memory``). ``schedules.in_flight`` gives the
    same counts in closed form where chunks save equal bytes and nothing is kept.

    The level at any point of the order is a sum over chunks of counts times those bytes;
    ``level_points`` lists the counts at the points that can be highest, once per schedule
    shape, so each call costs the points, not the order's length."""
    after_forward, after_backward = kept or ({}, {})
    peak = 0.0
    points = level_points(layout.schedule, layout.pp, num_microbatches, layout.virtual_stages, rank)
    for flight, rebuilt, forwards, backwards in points:
        level = sum(n * per_chunk[c] for c, n in flight)
        level += sum(n * after_forward.get(c, 0.0) for c, n in forwards)
        level += sum(n * after_backward.get(c, 0.0) for c, n in backwards)
        if rebuilt >= 0:
            level += rebuild[rebuilt]
        peak = max(peak, level)
    return peak


Counts = tuple[tuple[int, int], ...]  # (chunk, count) pairs, by chunk


@functools.lru_cache(maxsize=1024)
def level_points(
    schedule: str, pp: int, num_microbatches: int, virtual_stages: int, rank: int
) -> tuple[tuple[Counts, int, Counts, Counts], ...]:
    """The points of ``rank``'s op order where its activation level can peak, as counts:
    (micro-batches in flight per chunk, the chunk whose backward is rebuilding or -1,
    forwards done per chunk, backwards done per chunk); the level there is each count times
    the chunk's bytes (``activation_peak``). Points after a forward and after a backward,
    and at each backward's start with its rebuild. Bytes are never negative, so of two
    points with the same in-flight counts and rebuild the later one is at least as high
    (the done counts only grow): only the last of each is kept."""
    order = op_order(
        schedule,
        pp=pp,
        num_microbatches=num_microbatches,
        rank=rank,
        virtual_stages=virtual_stages,
    )
    chunks = sorted({op.stage for op in order})
    at = {c: i for i, c in enumerate(chunks)}
    flight = [0] * len(chunks)
    forwards = [0] * len(chunks)
    backwards = [0] * len(chunks)
    last: dict[tuple[tuple[int, ...], int], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for op in order:
        i = at[op.stage]
        if op.kind == "F":
            flight[i] += 1
            forwards[i] += 1
            last[(tuple(flight), -1)] = (tuple(forwards), tuple(backwards))
        if op.kind in ("B", "BW"):
            last[(tuple(flight), op.stage)] = (tuple(forwards), tuple(backwards))
        if op.kind in ("BW", "W"):
            flight[i] -= 1
        if op.kind in ("B", "BW"):
            backwards[i] += 1
            last[(tuple(flight), -1)] = (tuple(forwards), tuple(backwards))

    def pairs(counts: tuple[int, ...]) -> Counts:
        return tuple((c, n) for c, n in zip(chunks, counts, strict=True) if n)

    return tuple(
        (pairs(flight_), rebuilt, pairs(f), pairs(b)) for (flight_, rebuilt), (f, b) in last.items()
    )


def ring_buffer_bytes(cp: int, costs: Sequence[BlockCost]) -> float:
    """The context-parallel ring's receive buffers on a rank holding blocks ``costs``: a
    block's keys and values and their gradients, in use and arriving (4 times its K and V,
    the largest block's); nothing without context parallelism."""
    return 4 * max(c.cp_kv_bytes for c in costs) if cp > 1 else 0.0


def rebuild_peak(
    blocks: Sequence[tuple[BlockCost, frozenset[str] | str]], kept: float = 0.0
) -> float:
    """Most bytes a chunk's backward holds above its saved level for one micro-batch, from
    recomputation: backward runs the chunk's blocks last to first, each freeing its saved
    tensors when done, so when block k rebuilds, the blocks after it have already freed
    theirs: max over k of (rebuilt(k) - saved by the blocks after k), and never below 0.
    (Measured with real runs: a head's saved logits, freed before the last layer rebuilds,
    hide that layer's rebuild entirely.) ``kept``: bytes of the last block's saved tensors
    that stay until the chunk's whole backward is done (a stage output the runtime holds)."""
    peak, after = 0.0, 0.0
    for cost, choice in reversed(blocks):
        peak = max(peak, cost.rebuilt_bytes(choice) - after)
        after += cost.saved_bytes(choice) - kept
        kept = 0.0
    return peak


def _backward_temporaries(
    cost: BlockCost, job: TrainingJob, layout: Layout, shard: Shard, model: ModelSpec
) -> float:
    """What an eager PyTorch backward of the block holds besides saved tensors: the gradient
    flowing back (one micro-batch's hidden states) and, below ZeRO-2, one parameter's fresh
    gradient before it is added into the accumulated one (its largest); ZeRO-2/3 count fresh
    gradients as their reduce bucket. Megatron-LM's fused weight-gradient accumulation and
    in-place gradient buffers avoid most of both, so the default runtime leaves them out."""
    flowing = shard.sp_tokens * model.hidden_size * shard.act_bytes
    if layout.zero >= 2:
        return flowing
    fresh = max((p.numel / shards(p, layout) for p in cost.params if p.trainable), default=0.0)
    return flowing + fresh * DTYPE_BYTES[job.grad_dtype]


def shards(p: Param, layout: Layout) -> int:
    """How many ranks split ``p``: tp for tensor-parallel tensors, ep * etp for routed
    experts."""
    return (layout.tp if p.tp_split else 1) * (layout.ep * layout.etp if p.expert else 1)


# Optimizer offload, per element of the offloaded optimizer state, as each framework does it
# (Framework.optimizer_offload, with its sources): the bytes the host holds, and those that
# cross PCIe each way. Megatron-LM's updated FP32 master crosses back as FP32 (a non_blocking
# copy converts on the GPU: PyTorch aten/src/ATen/native/cuda/Copy.cu); DeepSpeed's 16-bit
# weights copy crosses as 16-bit. Host memory each element's step reads and writes: the
# gradient read, master and moments read and written, plus the two PCIe copies landing in
# and leaving host memory.
OFFLOAD_STATE_BYTES = 12  # of those on the host: the FP32 master and the two FP32 moments
# What the optimizer step moves, by path (state_bytes' keys, StageMemory.step_bytes').
STEP_KEYS = ("step_hbm", "step_d2h", "step_h2d", "step_host")


def optimizer_offload_rule(job: TrainingJob, fraction: float, zero: int | None = None) -> str:
    """Why ``fraction`` of the optimizer state cannot be offloaded for this job (and ZeRO
    stage), or "" when it can."""
    if fraction == 0:
        return ""
    fw = framework(job.framework)
    rule = fw.optimizer_offload
    if rule is None:
        able = " or ".join(n for n, f in FRAMEWORKS.items() if f.optimizer_offload)
        return (
            f"framework {job.framework!r} has no optimizer-only offload (torchtitan's "
            f"enable_cpu_offload moves weights and gradients too); offload needs {able}"
        )
    if job.optimizer != "adamw" or job.master_dtype != "fp32":
        return (
            "offload runs the host's AdamW on FP32 master weights; the job has "
            f"optimizer={job.optimizer!r}, master_dtype={job.master_dtype!r}"
        )
    if rule.whole_only and fraction != 1:
        return f"{fw.label} offloads all of the optimizer state or none, not {fraction:g}"
    if rule.zero is not None and zero is not None and zero != rule.zero:
        return rule.zero_rule.format(zero=zero)
    return ""


def gpu_state_bytes(state: dict[str, float]) -> float:
    """The part of ``state_bytes``'s buckets that lives in HBM: weights, gradients,
    optimizer state and an HBM EMA."""
    return state["weights"] + state["grads"] + state["optimizer"] + state["ema"]


def state_bytes(
    params: Sequence[Param], *, job: TrainingJob, layout: Layout, ema_on_gpu: bool
) -> dict[str, float]:
    """Weights, gradients, optimizer state and EMA of ``params`` on one rank (bytes), what
    lives on the host (``host``), and what the optimizer step moves (``STEP_KEYS``: HBM bytes
    of the GPU's part; PCIe bytes each way of an offloaded part; host memory bytes of the
    host's part)."""
    out = dict.fromkeys(("weights", "grads", "optimizer", "ema", "host", *STEP_KEYS), 0.0)
    off = layout.optimizer_offload
    fw = framework(job.framework)
    moved_rw = 0.0  # gradient reads and weight writes the PCIe copies take off the GPU's step
    wb, gb = DTYPE_BYTES[job.weight_dtype], DTYPE_BYTES[job.grad_dtype]
    moments = 2 if job.optimizer == "adamw" else 1
    opt_b = (DTYPE_BYTES[job.master_dtype] if job.master_dtype else 0) + moments * DTYPE_BYTES[
        job.moment_dtype
    ]
    ema_b = DTYPE_BYTES[job.ema] if job.ema else 0
    edp = layout.plane // (layout.ep * layout.etp)
    z = layout.zero
    held = held_unsharded(job, layout)
    working = DTYPE_BYTES[job.working_weight_dtype]
    # FSDP2 shards the parameters' storage whenever it shards anything: torchtitan's "ZeRO-2"
    # is reshard_after_forward off, which keeps the gathered working copy (held_unsharded).
    sharded_weights = fw.zero_shards_weights_from
    for p in params:
        local = p.numel / shards(p, layout)
        group = edp if p.expert else layout.grad_group
        out["weights"] += local * wb / (group if z >= sharded_weights else 1)
        if held:
            out["weights"] += local * working
        if not p.trainable:
            continue
        out["grads"] += local * gb / (group if z >= 2 else 1)
        if held and layout.pp > 1:
            out["grads"] += local * gb
        stepped = local / (group if z >= 1 else 1)  # elements this rank's step updates
        out["optimizer"] += stepped * opt_b * (1 - off)
        ema = stepped * ema_b
        out["ema" if ema_on_gpu else "host"] += ema
        if off:
            assert fw.optimizer_offload is not None  # optimizer_offload_rule refuses it
            moved = stepped * off
            host = fw.optimizer_offload.host_bytes
            out["host"] += moved * host
            d2h, h2d = fw.optimizer_offload.d2h_bytes, fw.optimizer_offload.h2d_bytes
            out["step_d2h"] += moved * d2h
            out["step_h2d"] += moved * h2d
            # the step reads the gradient copy, reads and writes master and moments, writes
            # a weight copy where the framework keeps one (DeepSpeed's 16-bit); the copies
            # write the gradient into and read the weights out of host memory
            copy = host - OFFLOAD_STATE_BYTES - d2h
            out["step_host"] += moved * (d2h + 2 * OFFLOAD_STATE_BYTES + copy + d2h + h2d)
            moved_rw += moved * (gb + wb)
    # The GPU's part reads and writes its master weights and moments, reads the gradients and
    # writes the weights (less those of the offloaded elements, which the PCIe copies move),
    # reads and writes an HBM EMA.
    gpu = 2 * out["optimizer"] + out["grads"] + out["weights"] + 2 * out["ema"]
    out["step_hbm"] = gpu - min(moved_rw, out["grads"] + out["weights"])
    return out


def held_unsharded(job: TrainingJob, layout: Layout) -> bool:
    """Whether a torchtitan rank keeps FSDP2's unsharded working parameters from forward to
    backward on top of its shards: with ``zero=2`` (exported as fsdp_reshard_after_forward
    "never") and with pipeline parallelism (reshard_after_forward off when PP is on, its
    default policy). With PP the schedule also turns gradient sync off for every micro-batch
    but the last, so FSDP2 accumulates unsharded gradients in its reduce dtype until then
    (torch.distributed.pipelining's stage backward; FSDP2's to_accumulated_grad_if_needed):
    such a rank holds those too (``state_bytes``)."""
    return framework(job.framework).holds_unsharded and (
        layout.zero == 2 or (layout.zero >= 3 and layout.pp > 1)
    )


def shard_of(job: TrainingJob, layout: Layout) -> Shard:
    """The per-rank shapes a layout gives every block of a job."""
    fw = framework(job.framework)
    if layout.fp8_cache and (job.compute_dtype != "fp8" or not fw.fp8_cache):
        raise PlannerError(
            f"Layout.fp8_cache=True: needs compute_dtype='fp8' and framework="
            f"{_with(lambda f: f.fp8_cache, quote=True)} (the one with a switch for it, "
            f"TransformerConfig.activation_func_fp8_input_store); the job has "
            f"compute_dtype={job.compute_dtype!r}, framework={job.framework!r}"
        )
    reason = optimizer_offload_rule(job, layout.optimizer_offload, layout.zero)
    if reason:
        raise PlannerError(f"Layout.optimizer_offload={layout.optimizer_offload:g}: {reason}")
    return Shard(
        seq_len=job.seq_len,
        micro_batch=layout.micro_batch,
        tp=layout.tp,
        cp=layout.cp,
        ep=layout.ep,
        etp=layout.etp,
        sequence_parallel=layout.sequence_parallel and layout.tp > 1,
        flash_attention=job.flash_attention,
        activation_dtype=job.activation_dtype,
        # With ep = 1 a rank holds every expert and receives exactly its own tokens' copies:
        # routing imbalance moves work between experts, not between ranks.
        moe_load_imbalance=job.moe_load_imbalance if layout.ep > 1 else 1.0,
        fp8=job.compute_dtype == "fp8",
        fp8_saves_inputs=fw.fp8_keeps_fp8_inputs,
        fp8_cache=layout.fp8_cache,
        probs_in_expert=fw.probs_in_expert,
        loss_copies_logits=fw.loss_copies_logits,
        loss_compiled=job.compiled_loss,
        op_sac=fw.op_sac,
    )


def reduce_bucket_bytes(model: ModelSpec, job: TrainingJob, layout: Layout) -> float:
    """ZeRO-2 and -3 shard the gradients, but a block's gradients exist whole on the rank
    until they are reduce-scattered: one reduce bucket, here the largest block's gradients
    (the same on every rank; measured with ZeRO-2 and FSDP2 in ``planner.run``)."""
    if framework(job.framework).fixed_reduce_buckets:
        if layout.zero == 0:
            return 0.0
        # stages 1-2 double their bucket for overlap_comm (as exported) unless pipelined
        buckets = 2 if layout.zero < 3 and layout.pp == 1 else 1
        bucket = DEEPSPEED_REDUCE_BUCKET_ELEMENTS * DTYPE_BYTES[job.working_weight_dtype]
        return float(buckets * bucket)
    if layout.zero < 2:
        return 0.0
    biggest = _largest_block_grads(model, shard_of(job, layout), layout.tp, layout.ep * layout.etp)
    return biggest * DTYPE_BYTES[job.grad_dtype]


@functools.lru_cache(maxsize=4096)
def _largest_block_grads(model: ModelSpec, shard: Shard, tp: int, ep: int) -> float:
    """Trainable elements of the block with the most of them on one rank (the search asks
    for every configuration it bounds): dense tensors split over ``tp``, routed experts over
    ``ep`` (the expert-parallel times the expert tensor-parallel degree, as ``shards``)."""
    names = ["embedding", "head"]
    names += list({model.is_moe_layer(i): f"layer.{i}" for i in range(model.num_layers)}.values())
    names += [f"mtp.{j}" for j in range(min(model.num_mtp_layers, 1))]
    return max(
        sum(
            p.numel / ((tp if p.tp_split else 1) * (ep if p.expert else 1))
            for p in block_cost(model, n, shard).params
            if p.trainable
        )
        for n in names
    )


def block_costs(model: ModelSpec, layout: Layout, shard: Shard) -> dict[str, BlockCost]:
    """Cost of every block the layout places, by block name."""
    costs: dict[str, BlockCost] = {}
    for stage in layout.stages:
        for placed in stage.blocks:
            costs.setdefault(placed.block, block_cost(model, placed.block, shard))
    return costs


def stage_memory(
    model: ModelSpec,
    job: TrainingJob,
    layout: Layout,
    *,
    num_microbatches: int,
    runtime: Runtime = "megatron",
) -> list[StageMemory]:
    """Memory of every pipeline rank of ``layout`` (one entry per pipeline position).

    ``runtime`` says how the pipeline runtime holds its tensors (they differ only for
    pp > 1). ``"megatron"`` (Megatron-LM, the default): a stage output's data is freed once
    sent; one send and one receive buffer of a micro-batch's hidden states.
    ``"torch"`` (``torch.distributed.pipelining``, as measured by ``planner validate``):
    - each in-flight micro-batch's stage output is held until its backward is done (the
      last stage's output is its logits, so they outlive the head's backward);
    - every micro-batch has its own receive buffers, made once and kept: hidden states
      into a chunk that is not the first (the chunk's saved input is that buffer), their
      gradients into one that is not the last;
    - its multi-chunk schedules (interleaved, zb-h1, dualpipev) keep every send until the
      step ends: each stage output sent forward and each input gradient sent back stays
      (counted with the activations, in op order);
    - an eager backward holds the gradient flowing back and a parameter's fresh gradient
      before accumulation (``_backward_temporaries``; in ``buffers``, like the reduce
      bucket)."""
    shard = shard_of(job, layout)
    reason = activation_offload_rule(model, job, layout)
    if reason:
        raise PlannerError(f"recompute='offload': {reason}")
    costs = block_costs(model, layout, shard)
    return [
        _rank_memory(rank, model, job, layout, shard, costs, num_microbatches, runtime)
        for rank in range(layout.pp)
    ]


def offloaded_blocks(layout: Layout) -> list[str]:
    """The blocks whose activations go to the host whole (``recompute="offload"``)."""
    return [b.block for s in layout.stages for b in s.blocks if b.recompute == OFFLOAD]


def offloads_activations(layout: Layout) -> bool:
    """Whether any block sends activations to the host (layer or fine-grained offload)."""
    return any(OFFLOAD in b.recompute for s in layout.stages for b in s.blocks)


def activation_offload_rule(model: ModelSpec, job: TrainingJob, layout: Layout) -> str:
    """Why the layout's activation offload cannot run, or "" (also when it has none). As
    Megatron-LM runs it (--cpu-offloading-num-layers N; megatron/core/transformer/
    transformer_config.py at d98e8a64): Transformer Engine's CPU offload of the first N
    transformer layers, N below the layer count, without pipeline parallelism and without
    activation recompute anywhere."""
    fine = any(OFFLOAD_TAG in b.recompute for s in layout.stages for b in s.blocks)
    offloaded = offloaded_blocks(layout)
    able = framework(job.framework).activation_offload
    where = _with(lambda f: f.activation_offload)
    if fine and not able:
        return f"fine-grained activation offload runs under {where} only, not {job.framework!r}"
    if fine and offloaded:
        return (
            "Megatron-LM runs fine-grained (offload:<module>) and layer offload (offload) "
            "one at a time"
        )
    if not offloaded:
        return ""
    if not able:
        return f"activation offload runs under {where} only, not {job.framework!r}"
    if layout.pp > 1 or layout.virtual_stages > 1:
        return (
            "Megatron-LM offloads activations without pipeline parallelism only "
            f"(pp={layout.pp}, virtual_stages={layout.virtual_stages})"
        )
    if any(not name.startswith("layer.") for name in offloaded):
        return "only transformer layers offload their activations"
    others = {b.recompute for s in layout.stages for b in s.blocks} - {OFFLOAD, "none"}
    if others:
        return f"Megatron-LM offloads with no activation recompute, not with {sorted(others)}"
    if len(offloaded) >= model.num_layers:
        return (
            f"{len(offloaded)} of {model.num_layers} layers offloaded: Megatron-LM keeps at "
            "least one in HBM"
        )
    return ""


def _rank_memory(
    rank: int,
    model: ModelSpec,
    job: TrainingJob,
    layout: Layout,
    shard: Shard,
    costs: dict[str, BlockCost],
    num_microbatches: int,
    runtime: Runtime = "megatron",
) -> StageMemory:
    chunks = layout.chunks_of_rank(rank)
    params: dict[str, Param] = {}
    names: list[str] = []
    per_chunk: dict[int, float] = {}
    rebuild: dict[int, float] = {}
    hidden = shard.sp_tokens * model.hidden_size * shard.act_bytes  # one micro-batch's
    torch_pp = runtime == "torch" and layout.pp > 1
    # torch.distributed.pipelining's multi-chunk schedules (_PipelineScheduleRuntime) wait on
    # their sends only when the step ends ("send ops should be waited on before step()
    # exits"): every stage output sent forward and every input gradient sent back stays
    # referenced until then.
    held_sends = torch_pp and schedule_of(layout.schedule).torch_holds_sends
    after_forward: dict[int, float] = {}
    after_backward: dict[int, float] = {}
    last = len(layout.stages) - 1
    for c in dict.fromkeys(chunks):  # a chunk listed twice is held once
        blocks = [(costs[b.block], parse_recompute(b.recompute)) for b in layout.stages[c].blocks]
        for placed, (cost, _) in zip(layout.stages[c].blocks, blocks, strict=True):
            names.append(placed.block)
            for p in cost.params:
                params.setdefault(p.key, p)
        per_chunk[c] = float(sum(cost.saved_bytes(choice) for cost, choice in blocks))
        kept = 0.0
        if torch_pp:
            if c == last:  # the last stage's output is the logits: held through its backward
                kept = blocks[-1][0].kept_bytes("logits")
            elif held_sends:
                after_forward[c] = hidden
            else:
                per_chunk[c] += hidden
            if c > 0 and held_sends:
                after_backward[c] = hidden
            if c > 0:  # the input a chunk keeps is its receive buffer, counted in buffers
                per_chunk[c] -= blocks[0][0].kept_bytes("block_input", blocks[0][1])
        rebuild[c] = rebuild_peak(blocks, kept)
    activations = activation_peak(
        layout, rank, num_microbatches, per_chunk, rebuild, (after_forward, after_backward)
    )
    plist = list(params.values())
    ema_on_gpu = layout.ema == "hbm"
    state = state_bytes(plist, job=job, layout=layout, ema_on_gpu=ema_on_gpu)
    emb = state_bytes(
        [p for p in plist if p.key in EMBEDDING_HEAD_KEYS],
        job=job,
        layout=layout,
        ema_on_gpu=ema_on_gpu,
    )
    buffers = float(job.comm_buffer_bytes)
    if torch_pp:  # receive buffers per chunk and micro-batch
        ends = sum((c > 0) + (c < last) for c in dict.fromkeys(chunks))
        buffers += ends * num_microbatches * hidden
    elif layout.pp > 1:  # one send and one receive buffer of a micro-batch's hidden states
        buffers += 2 * hidden
    buffers += reduce_bucket_bytes(model, job, layout)
    buffers += ring_buffer_bytes(layout.cp, [costs[n] for n in names])
    if runtime == "torch":
        buffers += max(_backward_temporaries(costs[n], job, layout, shard, model) for n in names)
    if layout.zero >= 3:  # the gathered working copy of the largest block, and the prefetched
        biggest = max(sum(p.numel / shards(p, layout) for p in costs[n].params) for n in names)
        gathered = 2 * biggest
        live = framework(job.framework).max_live_parameters
        if live is not None:  # resident up to stage3_max_live_parameters
            resident = sum(p.numel / shards(p, layout) for p in plist)
            gathered = max(gathered, min(live, resident))
        buffers += gathered * DTYPE_BYTES[job.working_weight_dtype]
    # offloaded activations on the host: each chunk's per micro-batch, as many micro-batches
    # as the op order holds at once (the same walk as the HBM activations')
    host_chunk = {
        c: float(
            sum(
                costs[b.block].offloaded_bytes(parse_recompute(b.recompute))
                for b in layout.stages[c].blocks
            )
        )
        for c in chunks
    }
    offloaded_activations = 0.0
    if any(host_chunk.values()):
        none = dict.fromkeys(chunks, 0.0)
        offloaded_activations = activation_peak(layout, rank, num_microbatches, host_chunk, none)
    buckets = {
        "weights": state["weights"],
        "grads": state["grads"],
        "optimizer": state["optimizer"],
        "ema": state["ema"],
        "activations": activations,
        "buffers": buffers,
        "context": float(job.cuda_context_bytes),
    }
    allocated = sum(v for k, v in buckets.items() if k != "context")
    buckets["fragmentation"] = job.fragmentation * allocated
    rounded = {k: round(buckets[k]) for k in BUCKETS}
    return StageMemory(
        stage=rank,
        chunks=chunks,
        blocks=names,
        buckets=rounded,
        peak_bytes=sum(rounded.values()),
        params=sum(p.numel // shards(p, layout) for p in plist if p.trainable),
        embedding_head_bytes=round(emb["weights"] + emb["grads"] + emb["optimizer"] + emb["ema"]),
        host_bytes=round(state["host"] + offloaded_activations),
        step_bytes={k: round(state[k]) for k in STEP_KEYS},
    )


def _with(has: Callable[[Framework], object], quote: bool = False) -> str:
    """The frameworks that ``has`` a feature, for an error that names them."""
    return " or ".join(repr(n) if quote else n for n, f in FRAMEWORKS.items() if has(f))
