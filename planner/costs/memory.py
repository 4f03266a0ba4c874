"""Per-rank memory of a layout, in bytes, bucket by bucket: the buckets' assembly, with the
buffers; the model state is ``planner.costs.state``'s, the activations
``planner.costs.activations``', the cap ``planner.costs.cap``'s.

What each bucket holds (one rank of a pipeline position; every rank of that position holds
the same):

- ``weights``: working weights in ``weight_dtype``; ZeRO-3 shards them.
- ``grads``: gradient buffers in ``grad_dtype``; ZeRO-2 and -3 shard them.
- ``optimizer``: master weights (``master_dtype``) and moments (two for AdamW, one for SGD
  with momentum) in ``moment_dtype`` (FP32 at the ZeRO stages where the framework keeps no
  narrower ones: ``Framework.narrow_moments_zero``); ZeRO-1 and up shard them.
- ``ema``: an EMA copy in the job's ``ema`` dtype when it lives in HBM, sharded like the
  optimizer state.
- ``activations``: saved activations of the micro-batches in flight at the rank's peak (the
  schedule's op order says how many of each chunk), with what one block rebuilds while a
  backward recomputes it (less what the chunk's later blocks have freed by then).
- ``buffers``: NCCL communication buffers (``TrainingJob.comm_buffer_bytes``; NCCL
  allocates them itself, outside PyTorch's caching allocator, so ``StageMemory.nccl_bytes``
  takes them out of the allocator's figures), pipeline send/receive tensors, ZeRO-3's
  gathered copy of the largest block (twice: the one in use and the one prefetched),
  under ZeRO-2/3 one reduce bucket (the largest block's unsharded gradients), with context
  parallelism the ring's receive buffers (a block's keys and values and their gradients, in
  use and arriving: 4 times its K and V), and for an eager PyTorch runtime the gradients a
  backward holds in flight.
- ``buffers`` also hold the GEMM libraries' workspaces, allocated once through PyTorch's
  caching allocator and kept for the run (``workspace_bytes``), and Megatron-LM's own core
  attention's score buffer where it runs (``core_attention_buffer_bytes``).
- ``context``: CUDA context and kernels.
- ``fragmentation``: the job's fraction of all allocated bytes above.

Sharding groups: dense weights are split over ``tp`` and ZeRO-sharded over ``dp * cp`` (the
ranks that reduce their gradients); routed experts are split over ``ep * etp`` and
ZeRO-sharded over the expert-data-parallel group ``dp * cp * tp / (ep * etp)``. Context
parallelism splits every activation by sequence: a rank keeps ``tokens / cp`` of each
micro-batch. Tensors shared by
several blocks on one rank (a tied embedding and head) count once; on different ranks each
rank holds its own copy, as Megatron-LM does.

Ignored: the optimizer's temporary buffers during the step (none of that size in the fused
optimizers the frameworks run; a foreach AdamW holds one parameter-sized copy, measured on an
H200: benchmarks/RESULTS.md, 2026-11-26), NCCL's own memory beyond the
stated buffer, activation-gradient tensors in flight during backward (bounded by one block's
activations; counted in buffers for an eager PyTorch runtime, ``runtime="torch"``), and the
host side of an EMA kept on the host and of an offloaded optimizer (reported as
``host_bytes``, and checked against the node's host RAM by the search).

Optimizer offload: see ``planner.costs.state``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from planner.costs.activations import (
    activation_offload_rule,
    activation_peak,
    activation_peaks,
    backward_temporaries,
    first_backward_peak,
    rebuild_peak,
)
from planner.costs.blocks import BlockCost, Param, Shard, block_cost
from planner.costs.state import STEP_KEYS, optimizer_offload_rule, shards, state_bytes
from planner.errors import PlannerError
from planner.frameworks import Runtime, framework, names_with
from planner.layout import Layout, parse_recompute
from planner.schedules import schedule_of
from planner.specs import DTYPE_BYTES, ModelSpec, TrainingJob

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
    nccl_bytes: int = Field(
        default=0,
        description="Part of the 'buffers' bucket NCCL allocates itself, outside PyTorch's "
        "caching allocator (bytes): in the device's use, not in max_memory_allocated or "
        "max_memory_reserved.",
    )
    step_grad_bytes: int = Field(
        default=0,
        description="Gradient bytes the runtime frees after each step and makes again in "
        "the rank's first backward (0: it keeps them from step to step); the 'grads' bucket "
        "holds them only where the peak comes after that backward.",
    )
    step_bytes: dict[str, int] = Field(
        default_factory=dict,
        description="Bytes the rank's optimizer step moves, by path: 'step_hbm' (the GPU's "
        "part), 'step_d2h' and 'step_h2d' (gradients to and weights from an offloaded part, "
        "over PCIe), 'step_host' (the host CPU's part, through host memory).",
    )

    @property
    def allocated_bytes(self) -> int:
        """Peak bytes in live tensors: what torch.cuda.max_memory_allocated reports (NCCL's
        own buffers are not the caching allocator's)."""
        return self.reserved_bytes - self.buckets["fragmentation"]

    @property
    def reserved_bytes(self) -> int:
        """Peak bytes the caching allocator holds in segments (live tensors and the free space
        fragmentation strands): what torch.cuda.max_memory_reserved reports. With the CUDA
        context and NCCL's buffers it is the rank's use of the device's usable HBM
        (``peak_bytes``)."""
        return self.peak_bytes - self.buckets["context"] - self.nccl_bytes


# How the pipeline runtime holds its tensors unless said (``stage_memory``): Megatron-LM's.
DEFAULT_RUNTIME: Runtime = "megatron"


def ring_buffer_bytes(cp: int, costs: Sequence[BlockCost]) -> float:
    """The context-parallel ring's receive buffers on a rank holding blocks ``costs``: a
    block's keys and values and their gradients, in use and arriving (4 times its K and V,
    the largest block's); nothing without context parallelism."""
    return 4 * max(c.cp_kv_bytes for c in costs) if cp > 1 else 0.0


def model_compiled(job: TrainingJob, layout: Layout) -> bool:
    """Whether torch.compile runs ``job``'s model: where it says so
    (``TrainingJob.compiled_model``), or where something that runs only under it is on: a
    compiled loss (torchtitan's compile.enable compiles the model with it, as the export
    writes it) or async tensor parallelism with tp > 1 (``TrainingJob.tp_comm_overlap``;
    torchtitan runs it only under torch.compile)."""
    return job.compiled_model or job.compiled_loss or (layout.tp > 1 and job.tp_comm_overlap)


def eager_ops(job: TrainingJob, layout: Layout) -> str:
    """Whose eager ops the blocks' elementwise work is priced as (``Shard.eager_ops``):
    the project's own runtime's always, torchtitan's model code where nothing compiles it,
    else none (fused kernels)."""
    fw = framework(job.framework)
    if fw.eager_passes:
        return "runtime"
    if fw.eager_model and not model_compiled(job, layout):
        return "torchtitan"
    return ""


def shard_of(job: TrainingJob, layout: Layout) -> Shard:
    """The per-rank shapes a layout gives every block of a job."""
    fw = framework(job.framework)
    if layout.fp8_cache and (job.compute_dtype != "fp8" or not fw.fp8_cache):
        raise PlannerError(
            f"Layout.fp8_cache=True: needs compute_dtype='fp8' and framework="
            f"{names_with(lambda f: f.fp8_cache, quote=True)} (the one with a switch for it, "
            f"TransformerConfig.activation_func_fp8_input_store); the job has "
            f"compute_dtype={job.compute_dtype!r}, framework={job.framework!r}"
        )
    reason = optimizer_offload_rule(job, layout.optimizer_offload, layout.zero)
    if reason:
        raise PlannerError(f"Layout.optimizer_offload={layout.optimizer_offload:g}: {reason}")
    eager = eager_ops(job, layout)
    return Shard(
        seq_len=job.seq_len,
        micro_batch=layout.micro_batch,
        tp=layout.tp,
        cp=layout.cp,
        cp_a2a=layout.cp_a2a if layout.cp > 1 else 1,
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
        loss_chunks=job.loss_chunks,
        loss_fusion=job.loss_fusion,
        unfused_norm=fw.unfused_norm,
        unfused_swiglu=fw.unfused_swiglu,
        eager_ops=eager,
        eager_norm=job.eager_norm and eager == "torchtitan",
        grad_accumulation_bytes=DTYPE_BYTES[job.grad_dtype] if fw.grad_accumulation_pass else 0,
        op_sac=fw.op_sac,
        qk_gathered=job.qk_norm_gathered,
    )


MIB = 2**20
# PyTorch's cuBLAS workspace, one per handle and stream, from its caching allocator
# (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize: 4096 KiB x 8 at compute
# capability 9.0 and up, else 2 x 4096 KiB + 8 x 16 KiB; CUBLAS_WORKSPACE_CONFIG overrides;
# cuBLASLt shares it by default, TORCH_CUBLASLT_UNIFIED_WORKSPACE). One stream runs the
# GEMMs PyTorch issues itself, but handles are per thread (DeviceThreadHandlePool), and a
# training step runs GEMMs on two: the training loop's (forward) and autograd's own device
# thread (backward, and the forward a recompute repeats in it). Every trace of a real run
# holds both (benchmarks/logs/h200/alloc: a 32 MiB request at the first forward GEMM and
# one at the first backward GEMM, neither ever released).
TORCH_CUBLAS_WORKSPACE = {True: 32 * MIB, False: 8 * MIB + 128 * 1024}
CUBLAS_THREADS = 2
# Transformer Engine's GEMM workspace (transformer_engine/pytorch/module/base.py,
# get_cublas_workspace_size_bytes: 32 MiB + 256 B at compute capability 9.0 and up, else
# 4 MiB, torch.empty on first use) and, for its grouped GEMMs, one such per stream of
# get_multi_stream_cublas_workspace (tex.get_num_cublas_streams(): 4).
TE_WORKSPACE = {True: 32 * MIB + 256, False: 4 * MIB}
TE_GROUPED_STREAMS = 4


def workspace_bytes(
    model: ModelSpec,
    job: TrainingJob,
    *,
    sm90: bool = True,
    cublas_bytes: int | None = None,
    transformer_engine: bool | None = None,
    grouped_experts: bool | None = None,
) -> int:
    """Bytes the GEMM libraries hold in the caching allocator for the whole run:
    ``job.workspace_bytes`` where stated, else PyTorch's cuBLAS workspaces, one for each
    thread that runs GEMMs (``cublas_bytes`` each where CUBLAS_WORKSPACE_CONFIG sets it),
    plus, where the framework runs Transformer Engine (``transformer_engine`` overrides),
    TE's workspace and, for routed experts run as grouped GEMMs (``grouped_experts``; by
    default whenever the model has them), its four streams' workspaces. ``sm90``: the sizes
    at compute capability 9.0 and up (Hopper, Blackwell), else Ampere's."""
    if job.workspace_bytes is not None:
        return job.workspace_bytes
    per_handle = TORCH_CUBLAS_WORKSPACE[sm90] if cublas_bytes is None else cublas_bytes
    total = CUBLAS_THREADS * per_handle
    if runs_transformer_engine(job) if transformer_engine is None else transformer_engine:
        grouped = bool(model.num_experts) if grouped_experts is None else grouped_experts
        total += TE_WORKSPACE[sm90] * (1 + TE_GROUPED_STREAMS * grouped)
    return total


def runs_transformer_engine(job: TrainingJob) -> bool:
    """Whether ``job``'s framework runs Transformer Engine's modules: the job's own
    ``transformer_engine`` where stated, else the framework's default."""
    if job.transformer_engine is not None:
        return job.transformer_engine
    return framework(job.framework).transformer_engine


def core_attention_buffer_bytes(
    model: ModelSpec, job: TrainingJob, *, tp: int, cp: int, micro_batch: int
) -> float:
    """Bytes of the score buffer Megatron-LM's own core attention keeps for the run, where
    the framework has one (``Framework.core_attention_buffer``) and the job runs it: without
    Transformer Engine and without flash attention. DotProductAttention computes its scores
    with ``torch.baddbmm`` from a ``[micro_batch * heads / tp, s / cp, s]`` tensor in the
    activation dtype that it takes from the global memory buffer, which keeps the largest
    tensor asked of it for the rest of the run (megatron/core/transformer/
    dot_product_attention.py, ``GlobalMemoryBuffer`` in megatron/core/utils.py at d98e8a64).
    Counted on every rank, as the search's tables count it (a rank holding no attention layer
    never makes it; no layout but one with an empty first or last stage has such a rank).
    Megatron-LM's functional tests with ``--transformer-impl local`` (63 dense runs) fell
    short by 70 MiB at the median where this buffer is 64 MiB
    (``benchmarks/published_memory.py --csv benchmarks/megatron_ci_runs.csv``)."""
    if not framework(job.framework).core_attention_buffer:
        return 0.0
    if runs_transformer_engine(job) or job.flash_attention or not model.num_attention_heads:
        return 0.0
    s = job.seq_len
    heads = model.num_attention_heads // tp
    return float(micro_batch * heads * (s // cp) * s * DTYPE_BYTES[job.activation_dtype])


def held_bytes(model: ModelSpec, job: TrainingJob, *, tp: int, cp: int, micro_batch: int) -> float:
    """Bytes a rank holds for the whole run beside its model state and activations: the
    job's communication buffers, the GEMM libraries' workspaces (``workspace_bytes``) and
    the core attention's score buffer (``core_attention_buffer_bytes``)."""
    return float(
        job.comm_buffer_bytes
        + workspace_bytes(model, job)
        + core_attention_buffer_bytes(model, job, tp=tp, cp=cp, micro_batch=micro_batch)
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
    runtime: Runtime = DEFAULT_RUNTIME,
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


def first_backward_walk(
    c: int,
    layout: Layout,
    costs: dict[str, BlockCost],
    job: TrainingJob,
    runtime: Runtime,
    last: int,
) -> tuple[float, float]:
    """``activations.first_backward_peak`` of chunk ``c``: its blocks' gradient bytes on
    this rank (a parameter two blocks share counted at the first to make it, the last in
    model order), and the logits the torch pipeline runtime keeps through the last stage's
    backward (as ``_rank_memory`` does for ``rebuild_peak``)."""
    placed = layout.stages[c].blocks
    blocks = [(costs[b.block], parse_recompute(b.recompute)) for b in placed]
    seen: set[str] = set()
    grads: list[float] = []
    for cost, _ in reversed(blocks):
        mine = [p for p in cost.params if p.key not in seen]
        seen.update(p.key for p in mine)
        grads.append(state_bytes(mine, job=job, layout=layout, ema_on_gpu=False)["grads"])
    grads.reverse()
    kept = 0.0
    if runtime == "torch" and layout.pp > 1 and c == last:
        kept = blocks[-1][0].kept_bytes("logits")
    return first_backward_peak(blocks, grads, kept)


def grads_freed(job: TrainingJob, layout: Layout) -> bool:
    """Whether the job's runtime frees the gradients between optimizer steps
    (``Framework.frees_grads``). ``planner.run`` ("unbuffered") keeps them in one flat buffer
    per data-parallel group of more than one rank below ZeRO-2 (Megatron-LM's contiguous
    buffer, which it all-reduces); then they stay. (Its experts' gradients are freed where
    their own group is one rank: not counted, so the prediction errs high by them.)"""
    frees = framework(job.framework).frees_grads
    if frees == "unbuffered":
        return not (layout.zero < 2 and layout.dp > 1)
    return frees == "always"


def _rank_memory(
    rank: int,
    model: ModelSpec,
    job: TrainingJob,
    layout: Layout,
    shard: Shard,
    costs: dict[str, BlockCost],
    num_microbatches: int,
    runtime: Runtime = DEFAULT_RUNTIME,
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
    first, rest = activation_peaks(
        layout, rank, num_microbatches, per_chunk, rebuild, (after_forward, after_backward)
    )
    plist = list(params.values())
    ema_on_gpu = layout.ema == "hbm"
    state = state_bytes(plist, job=job, layout=layout, ema_on_gpu=ema_on_gpu)
    made = state["grads"] if grads_freed(job, layout) else 0.0
    activations, grads = max(first, rest), state["grads"]
    if made:
        # Gradients a runtime frees after each step are made again in the rank's first
        # backward: a peak before it (one micro-batch's forward and loss, as with no
        # gradient accumulation) holds none; during it, those of the blocks done; after it,
        # all. The buckets are what is live at the peak.
        c = max(chunks)  # the chunk whose backward runs first on this rank
        walked = first_backward_walk(c, layout, costs, job, runtime, last)
        walk = first - rebuild[c] + walked[0]  # the others' level at most first's less c's
        activations, grads = max(
            (first, 0.0), (walk - walked[1], walked[1]), (rest, made), key=lambda x: sum(x)
        )
    emb = state_bytes(
        [p for p in plist if p.key in EMBEDDING_HEAD_KEYS],
        job=job,
        layout=layout,
        ema_on_gpu=ema_on_gpu,
    )
    held = held_bytes(model, job, tp=layout.tp, cp=layout.cp, micro_batch=layout.micro_batch)
    buffers = 0.0  # transient: the job's share of them is live at the peak (buffers_at_peak)
    if torch_pp:  # receive buffers per chunk and micro-batch
        ends = sum((c > 0) + (c < last) for c in dict.fromkeys(chunks))
        buffers += ends * num_microbatches * hidden
    elif layout.pp > 1:  # one send and one receive buffer of a micro-batch's hidden states
        buffers += 2 * hidden
    buffers += reduce_bucket_bytes(model, job, layout)
    buffers += ring_buffer_bytes(layout.cp, [costs[n] for n in names])
    if runtime == "torch":
        buffers += max(backward_temporaries(costs[n], job, layout, shard, model) for n in names)
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
        "grads": grads,
        "optimizer": state["optimizer"],
        "ema": state["ema"],
        "activations": activations,
        "buffers": held + job.buffers_at_peak * buffers,
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
        nccl_bytes=int(job.comm_buffer_bytes),
        step_grad_bytes=round(made),
        step_bytes={k: round(state[k]) for k in STEP_KEYS},
    )
