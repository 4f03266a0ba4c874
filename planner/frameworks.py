"""The training frameworks a job can run under, as data: one frozen entry per framework.

An entry says what the framework keeps its state in when the job does not say, what it
overlaps with compute, what it holds in memory beyond the model's own tensors, what it can
offload, and what its launcher can state (``Launcher``: the schedules, ZeRO stages and
recompute choices an export can write, and the rules between them). Every other module asks
the entry (``framework(job.framework)``) instead of comparing names, so a new framework is one
entry here plus its export target.

Sources are cited next to each entry's fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from planner import memo
from planner.errors import PlannerError
from planner.schedules import DEFAULT_SCHEDULE

TpOverlap = Literal["userbuffers", "async", "none"]
# How a pipeline runtime holds its tensors (planner.costs.memory.stage_memory's ``runtime``)
Runtime = Literal["megatron", "torch"]
# The SMs of a GPU whose cluster does not state them (ClusterSpec.sm_count None): an H100's,
# H800's or H200's 132.
UNSTATED_SM_COUNT = 132


@dataclass(frozen=True)
class Overlap:
    """What a framework runs beside compute, on a GPU of ``sm_count`` SMs (communication
    kernels take whole SMs from the compute beside them: ``costs.overlap``)."""

    zero: bool  # ZeRO-3 gathers / ZeRO-2/3 reduce-scatters prefetched and overlapped
    grad_sync: bool  # the data-parallel reduction starts with the stage's last backward
    # ZeRO-1/2's all-gather of the updated weights runs beside the next step's forward
    # (``planner.timeline``), not in series after the optimizer step.
    param_gather: bool = False
    # Of a paired forward and backward (DualPipe, Megatron-LM's expert all-to-all overlap),
    # the share of their all-to-alls and sends hidden behind the other chunk's compute: 1
    # where the runtime overlaps them as DeepSeek-V3's report states (section 3.2.1), 0 where
    # it runs the pair's two halves in turn (``costs.overlap``).
    pair_hidden: float = 1.0
    # The schedules whose pipeline sends it posts asynchronously: the sender computes on,
    # the receiver waits for the data just before the op that needs it (``planner.timeline``).
    async_send_schedules: tuple[str, ...] = ()
    # Resolved for one schedule by ``costs.overlap.overlap_of``.
    async_sends: bool = False
    # The GPU's SMs: the cluster's (``costs.overlap.overlap_of``); an entry's are
    # ``UNSTATED_SM_COUNT``, as are those of a cluster that does not state its own.
    sm_count: int = UNSTATED_SM_COUNT

    @property
    def pairs_in_turn(self) -> bool:
        """The runtime runs a pair's forward and backward one after the other (nothing of
        either hidden: ``pair_hidden`` 0), as the simulator then does (``planner.executor``)."""
        return self.pair_hidden == 0


@dataclass(frozen=True)
class OptimizerOffload:
    """Optimizer-state offload to the host as the framework runs it, per offloaded element:
    the bytes the host holds, the bytes that cross PCIe each way per step, and its rules."""

    host_bytes: int
    d2h_bytes: int
    h2d_bytes: int
    whole_only: bool  # all of the state or none
    zero: int | None  # the one ZeRO stage it offloads through (None: any)
    zero_rule: str = ""  # why, in the framework's own terms


@dataclass(frozen=True)
class Launcher:
    """What the framework's launcher can state (``SearchSpace.framework``; ``planner.export``):
    each tuple lists the values it accepts (None: any the planner searches)."""

    # The schedules it runs, each with its own name for it, and for the others the one it
    # runs on the same stages instead (DEFAULT_SCHEDULE where none is named).
    schedule_names: tuple[tuple[str, str], ...]
    nearest: tuple[tuple[str, str], ...] = ()
    zero: tuple[int, ...] | None = None
    recompute: tuple[str, ...] | None = None  # one choice for every layer
    cp: tuple[int, ...] | None = None
    cp_comm_type: tuple[str, ...] | None = None  # Layout.cp_comm_type values where cp > 1
    # Context parallelism only with tp = pp = 1 (DeepSpeed's Ulysses for Hugging Face models,
    # registered beside ZeRO alone), and not for multi-latent attention (its keys and values
    # differ in head size, which Ulysses's all-to-all of equal k and v refuses).
    cp_alone: bool = False
    cp_mla: bool = True
    # ZeRO++'s hierarchical partitioning (Layout.zero_hpz; DeepSpeed zero_hpz_partition_size)
    zero_hpz: bool = False
    # ZeRO-3's weight shards on the host (Layout.param_offload; DeepSpeed offload_param)
    param_offload: bool = False
    # ZeRO-1 over partial data-parallel domains (Layout.optimizer_instances; Megatron-LM's
    # --num-distributed-optimizer-instances)
    optimizer_instances: bool = False
    sequence_parallel: tuple[bool, ...] | None = None
    even_stages: bool = False
    pipeline_zero: tuple[int, ...] | None = None  # ZeRO stages allowed with pp > 1
    tensor_zero: tuple[int, ...] | None = None  # ZeRO stages allowed with tp > 1

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedules it runs (the planner's names)."""
        return tuple(ours for ours, _ in self.schedule_names)

    def own_name(self, schedule: str) -> str:
        """Its name for ``schedule`` (one it runs)."""
        return dict(self.schedule_names)[schedule]

    def runs_instead(self, schedule: str) -> str:
        """The schedule it runs on the same stages in place of ``schedule``."""
        if schedule in self.schedules:
            return schedule
        return dict(self.nearest).get(schedule, DEFAULT_SCHEDULE)


@dataclass(frozen=True)
class Framework:
    """One training framework (``TrainingJob.framework``)."""

    name: str
    label: str  # how its users call it
    # The state dtypes a job that leaves them out takes (``TrainingJob``).
    weight_dtype: str
    grad_dtype: str
    master_dtype: str | None
    # Time: what it overlaps (``costs.overlap``), and its tensor-parallel overlap
    # (``costs.timing.tp_exposed``), which may need sequence parallelism.
    overlap: Overlap
    tp_overlap: TpOverlap
    tp_overlap_needs_sp: bool = False
    # Of what its tensor-parallel overlap could hide (``costs.timing.tp_exposed``), the share
    # it does hide: a fit to published on/off measurements (torchtitan) or, where there are
    # none, to the published runs it applies to, each source held out (Megatron-LM).
    tp_overlap_hidden: float = 1.0
    # Memory: how its kernels and runtime hold tensors (``costs.memory``, ``costs.blocks``).
    compiles_loss: bool = False  # its loss may run under torch.compile (compiled_loss)
    chunks_loss: bool = False  # its loss may run in chunks of tokens (loss_chunks)
    fp8_keeps_fp8_inputs: bool = False  # FP8 linears keep the FP8 copy of their input
    fp8_cache: bool = False  # a switch to keep the FP8 activation input (Layout.fp8_cache)
    probs_in_expert: bool = False  # routing probabilities applied inside the expert
    loss_copies_logits: bool = False  # the eager loss keeps an FP32 copy of the logits
    # Its model code's RMSNorm upcasts in eager ops (Hugging Face's LlamaRMSNorm): the FP32
    # copy of the input and the normalised BF16 tensor before the weight are kept too.
    unfused_norm: bool = False
    # Its gated MLP multiplies act(gate) by up in eager ops: act(gate) is kept too.
    unfused_swiglu: bool = False
    # Its norms, rotary embeddings, SwiGLU backward and loss run as eager FP32 ops, one kernel
    # each (planner.run.model, which planner validate runs): their passes are priced as such
    # (costs.blocks.eager_bytes), beside the fused kernels' the others run.
    eager_passes: bool = False
    # Its model code runs as eager PyTorch ops unless compiled (TrainingJob.compiled_model):
    # SwiGLU as F.silu and a multiply, the loss as F.cross_entropy over an FP32 copy of the
    # logits, the rotary embedding as x * cos + rotate_half(x) * sin (or its complex product),
    # each op a kernel of its own; its norms nn.RMSNorm, one fused kernel (PyTorch's CUDA
    # rms_norm, pytorch#153666, 2.9). Priced by costs.blocks.eager_bytes(..., "torchtitan").
    eager_model: bool = False
    # It can route by random logits for benchmarks (TrainingJob.moe_force_balance)
    force_balance: bool = False
    # Its real runs' pipeline runtime as planner validate measures it (torch: PyTorch's
    # pipelining holds stage outputs and receive buffers; costs.memory.stage_memory)
    pipeline_runtime: Runtime = "megatron"
    # It adds each micro-batch's weight gradients into the gradient buffer in a pass of its
    # own (read both, write the sum): planner.run's buffer hooks; Megatron-LM's GEMMs
    # accumulate into main_grad directly (gradient_accumulation_fusion). Priced alike at every
    # ZeRO stage, though planner.run's ZeRO-2 adds only the owner's share
    grad_accumulation_pass: bool = False
    # Whether its training step frees the gradients (zero_grad(set_to_none=True)), so that
    # the next step's first backward makes them again (costs.memory.grads_freed): "never"
    # (Megatron-LM's gradient buffer, zeroed in place), "always", or "unbuffered" (planner.run:
    # all but a data-parallel group's flat buffer below ZeRO-2).
    frees_grads: Literal["never", "always", "unbuffered"] = "never"
    # Its AdamW is PyTorch's single-tensor implementation (torch.optim.AdamW(foreach=False),
    # planner.run): eight eager kernels per parameter tensor, each a pass over its elements
    # (costs.state.SINGLE_TENSOR_ADAMW), where a fused step reads and writes each tensor once.
    single_tensor_adamw: bool = False
    # It is the project's own runtime (planner.run): its runs' allocator requests can be
    # written without a GPU (planner.run.requests) and replayed against their logged peaks.
    own_runtime: bool = False
    # The fused cross-entropy implementations it offers (TrainingJob.loss_fusion).
    loss_fusions: tuple[str, ...] = ("none",)
    # Its linears and grouped experts run Transformer Engine's GEMMs, each with TE's own
    # workspace in the caching allocator (costs.memory.workspace_bytes)
    transformer_engine: bool = False
    # Without Transformer Engine (TrainingJob.transformer_engine False) and without flash
    # attention its own core attention computes the scores into a tensor of its global memory
    # buffer, kept for the run (costs.memory.core_attention_buffer_bytes)
    core_attention_buffer: bool = False
    op_sac: bool = False  # per-op selective checkpointing ("op" recompute)
    zero_shards_weights_from: int = 3  # the ZeRO stage from which weights are sharded
    # The one ZeRO stage at which it keeps optimizer moments narrower than FP32
    # (TrainingJob.moment_dtype); at the others it keeps FP32 moments (None: any stage).
    narrow_moments_zero: int | None = None
    holds_unsharded: bool = False  # FSDP2 keeps gathered working weights (held_unsharded)
    fixed_reduce_buckets: bool = False  # reduce buckets of a fixed size, not the largest block
    max_live_parameters: int | None = None  # ZeRO-3 gathered parameters kept resident
    optimizer_offload: OptimizerOffload | None = None
    activation_offload: bool = False  # layer and fine-grained activation offload
    launcher: Launcher | None = None  # None: no launch config is written for it
    # It prices measured runs only: its layouts are not searched, since no launcher the
    # planner knows states them (the reason, for the one-line refusal).
    costing_only: str = ""
    # The MoE dispatchers it runs (``TrainingJob.moe_dispatcher``).
    dispatchers: tuple[str, ...] = ("alltoall",)
    # None: ZeRO-3 gathers and reduce-scatters flat buckets. Else it runs one collective per
    # parameter tensor through c10d's list collectives, which copy each rank's slice by
    # itself, and this is the host's time per slice copy (s) (``costs.timing``).
    zero3_slice_s: float | None = None
    # It has a switch that runs the data-parallel gradient reduction after the step's last
    # backward instead of beside it (TrainingJob.exposed_grad_reduce).
    grad_reduce_switch: bool = False
    # Host seconds per routed-expert GEMM it launches one at a time, with the GPU's queue
    # empty: those GEMMs take the longer of their GPU time and their launches
    # (``costs.compute.work_time``); 0: its experts' GEMMs run as one grouped kernel, or it
    # is not known to launch them one by one.
    expert_gemm_launch_s: float = 0.0


FRAMEWORKS: dict[str, Framework] = {
    # Megatron-LM. State: BF16 working weights, FP32 master weights and AdamW moments, and
    # gradients accumulated and reduced in an FP32 main-grad buffer (arguments.py turns on
    # accumulate_allreduce_grads_in_fp32 for --bf16 unless --grad-reduce-in-bf16).
    # Overlap: --overlap-grad-reduce and --overlap-param-gather (distributed optimizer: the
    # updated weights' all-gathers overlap the next step's forward, distrib_optimizer.py and
    # distributed_data_parallel.py's forward pre-hooks at d98e8a64); --tp-comm-overlap
    # (Transformer Engine userbuffers), which needs sequence parallelism.
    # Memory: Transformer Engine's FP8 linears quantise their input once and keep that copy;
    # TransformerConfig.activation_func_fp8_input_store caches the FP8 activation input; the
    # MoE layer applies the routing probabilities inside the expert. Offload: the
    # HybridDeviceOptimizer (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py at
    # d98e8a64): FP32 master, pinned FP32 gradient copy and two FP32 moments on the host
    # (16 B), FP32 each way over PCIe; --cpu-offloading-num-layers and
    # --fine-grained-activation-offloading for activations.
    "megatron": Framework(
        name="megatron",
        label="Megatron-LM",
        weight_dtype="bf16",
        grad_dtype="fp32",
        master_dtype="fp32",
        # Pairs (--overlap-moe-expert-parallel-comm): 0.57 of their all-to-alls hidden, a
        # joint fit to the three published on/off measurements of Megatron-LM's own teams
        # (benchmarks/moe_ladders.py --pairs), each on the ratio, held out by the other two:
        # Qwen3-235B-A22B on 256 H100, EP32 DeepEP, 19.7 -> 17.6 s (Megatron-MoE-ModelZoo
        # best_practice/qwen3/readme.md), -5.7%; Qwen3-30B-A3B on 16 H100, EP16 all-to-all,
        # 41.25 -> 31.31 s (Megatron-Bridge docs/training/communication-overlap.md), +1.0%;
        # the same with HybridEP, 24.71 -> 20.99 s (Megatron-Bridge
        # skills/nemo-mbridge-perf-expert-parallel-overlap/SKILL.md), +7.3%. The combined 1F1B
        # interleaves the two halves layer by layer, so the all-to-alls that wait on their
        # own layer's compute stay exposed.
        # Sends: --overlap-p2p-communication is on unless --no-overlap-p2p-communication
        # (arguments.py:3118-3120 at d98e8a64), and forced off without virtual stages
        # (arguments.py:1010-1018): the interleaved schedules post their sends and receives
        # asynchronously.
        overlap=Overlap(
            zero=True,
            grad_sync=True,
            param_gather=True,
            pair_hidden=0.57,
            async_send_schedules=("interleaved", "interleaved-ep-overlap"),
        ),
        # Without --overlap-grad-reduce (off in its parser, arguments.py:3121) the reduction
        # runs after the last backward (finish_grad_sync, called by finalize_model_grads,
        # starts and finishes it there: param_and_grad_buffer.py:805 at d98e8a64)
        grad_reduce_switch=True,
        tp_overlap="userbuffers",
        tp_overlap_needs_sp=True,
        # Userbuffers hide 0.55 of what they could: no published on/off pair exists, so the
        # share was fitted to the 30 published runs it applies to (Megatron-LM-run, tp > 1,
        # overlap on; benchmarks/tp_overlap_pairs.py --megatron). Those runs barely pin it:
        # mean |error| 13.9% at 1, 10.8% at 0.50, 9.6% at 0, and since unstated recompute is
        # costed as the fastest that fits, the fit runs to 0.05 (each source held out 10.2%
        # against 11.0% at 0.55), a share no overlap that runs at all would leave: the fit
        # absorbs the model's optimism there (bias -9.5% at 1) rather than measure the
        # overlap. Kept at 0.55, beside torchtitan's async TP, which its own measured on/off
        # pairs put at 0.45.
        tp_overlap_hidden=0.55,
        # Routed experts (--moe-grouped-gemm: TEGroupedMLP, experts.py at d98e8a64) run
        # through Transformer Engine's GroupedLinear, which issues one cuBLAS GEMM per local
        # expert over four streams (nvte_multi_stream_cublas_gemm), each with its own cuBLASLt
        # descriptors and heuristic query on the host, after the host has read the tokens per
        # expert (tokens_per_expert.tolist(); the all-to-all dispatcher also synchronises
        # before its EP all-to-all), so the launches run with the GPU's queue empty. 48 us per
        # launch (Python and C++ per expert, cuBLASLt descriptors and heuristic query per call,
        # per-parameter gradient hooks): a fit to the ratios between the layouts of the 17
        # measured MoE ladders (benchmarks/expert_launch.py; pair error 0.121 -> 0.096, 16 of
        # 17 ladders ordered exactly either way, mean |error| 10.1% -> 8.0%). Each source held
        # out: Megatron-MoE-ModelZoo's ladder 0.329 -> 0.219 at 40 us fitted on the paper's;
        # the MoE Parallel Folding paper's 16 ladders 0.095 -> 0.098 at 58 us fitted on the
        # other (its Table 4, nine ladders, 0.101 -> 0.085 with the rest of the paper). Not
        # charged for a job with TrainingJob.moe_grouped_tensor (--moe-use-grouped-tensor:
        # TE's grouped tensor path, one kernel with device-side splits; costs.compute.Rates.of).
        expert_gemm_launch_s=48e-6,
        # --cross-entropy-loss-fusion with --cross-entropy-fusion-impl native or te
        # (megatron/core/models/common/language_module/language_module.py at d98e8a64).
        loss_fusions=("none", "native", "te"),
        transformer_engine=True,
        force_balance=True,  # --moe-router-force-load-balancing
        # --transformer-impl local: DotProductAttention takes [b * heads / tp, s, s] from
        # parallel_state.get_global_memory_buffer() ("mpu"), which GlobalMemoryBuffer keeps
        # (megatron/core/transformer/dot_product_attention.py, megatron/core/utils.py at
        # d98e8a64)
        core_attention_buffer=True,
        # --exp-avg-dtype / --exp-avg-sq-dtype take effect only on the precision-aware
        # optimizer, which needs --use-distributed-optimizer (arguments.py at d98e8a64): the
        # distributed optimizer's ZeRO-1. Elsewhere the moments are FP32.
        narrow_moments_zero=1,
        fp8_keeps_fp8_inputs=True,
        fp8_cache=True,
        probs_in_expert=True,
        optimizer_offload=OptimizerOffload(
            host_bytes=16,
            d2h_bytes=4,
            h2d_bytes=4,
            whole_only=False,
            zero=1,
            zero_rule="Megatron-LM offloads through its distributed optimizer (ZeRO-1), "
            "not ZeRO-{zero} (--optimizer-cpu-offload needs --use-precision-aware-optimizer, "
            "which needs --use-distributed-optimizer; Megatron FSDP is not supported)",
        ),
        activation_offload=True,
        # --num-layers-per-virtual-pipeline-stage turns 1F1B into the interleaved schedule.
        # --overlap-moe-expert-parallel-comm merges a forward with another micro-batch's
        # backward (combined_1f1b.py), on the no-pipelining and the interleaved paths.
        launcher=Launcher(
            schedule_names=(
                ("1f1b", "1F1B"),
                ("interleaved", "interleaved 1F1B"),
                ("1f1b-ep-overlap", "1F1B with --overlap-moe-expert-parallel-comm"),
                (
                    "interleaved-ep-overlap",
                    "interleaved 1F1B with --overlap-moe-expert-parallel-comm",
                ),
            ),
            nearest=(("dualpipev", "interleaved"),),
            # DistributedDataParallelConfig.num_distributed_optimizer_instances (distributed/
            # distributed_data_parallel_config.py, parallel_state.py's intra/inter partial
            # data-parallel groups at d98e8a64)
            optimizer_instances=True,
        ),
        # --moe-token-dispatcher-type allgather | alltoall | flex, flex with
        # --moe-flex-dispatcher-backend deepep (transformer_config.py at d98e8a64).
        dispatchers=("alltoall", "allgather", "deepep"),
    ),
    # torchtitan (FSDP2). State: FP32 parameters, which are the master copy, cast to BF16
    # for compute and for FSDP2's all-gather (MixedPrecisionPolicy param_dtype=bfloat16);
    # gradients reduced and kept in FP32 (reduce_dtype=float32); FP32 AdamW moments.
    # Overlap: FSDP2 prefetches its all-gathers (in forward too, the ZeRO-2 gather of the
    # weights each step) and reduce-scatters in backward; async
    # tensor parallelism decomposes the collectives behind the partial matmuls on copy
    # engines. Memory: torchao's float8 linears keep the BF16 input and quantise it again
    # in backward; FSDP2 shards the parameters' storage whenever it shards anything, and
    # keeps the gathered copy with reshard_after_forward off; the eager loss keeps an FP32
    # copy of the logits; per-op selective activation checkpointing.
    "torchtitan": Framework(
        name="torchtitan",
        label="torchtitan",
        eager_model=True,
        # train_step opens with self.optimizers.zero_grad(), torch's default set_to_none=True
        # (torchtitan/train.py at v0.1.0, v0.2.0 and v0.2.2, and trainer.py up to f84224af,
        # 2026-08-13, when CUDA graph capture made it set_to_none=disable_cuda_graphs, False by
        # default: the later trainer keeps them)
        frees_grads="always",
        weight_dtype="fp32",
        grad_dtype="fp32",
        master_dtype=None,
        # Pairs: torch.distributed.pipelining runs an OVERLAP_F_B action's forward and
        # backward in turn unless a custom function is registered for it (schedules.py,
        # _PipelineScheduleRuntime; torch 2.13), and torchtitan registers none outside its
        # experiments: DualPipeV's pairs hide nothing.
        overlap=Overlap(zero=True, grad_sync=True, param_gather=True, pair_hidden=0.0),
        tp_overlap="async",
        # Async TP hides 0.45 of what it could: a fit to torchtitan's five published on/off
        # pairs (benchmarks/tp_overlap_pairs.py: Llama 3 8B and 70B, BF16 and float8, June
        # 2025 and December 2024 files, on hardware/h100-96gb.yaml at its 500 W peak, with the
        # FlashAttention-2 kernel torchtitan then ran on Hopper; measured step ratios
        # x0.86-x0.95, against x0.78-x0.82 with all of it hidden). Each file held out: +3.7%
        # to +10.2% and -5.5% on the ratio.
        tp_overlap_hidden=0.45,
        compiles_loss=True,
        chunks_loss=True,
        loss_copies_logits=True,
        op_sac=True,
        zero_shards_weights_from=2,
        holds_unsharded=True,
        # job.toml's parallelism.pipeline_parallel_schedule values (torchtitan 73a0e69).
        launcher=Launcher(
            schedule_names=(
                ("1f1b", "1F1B"),
                ("interleaved", "Interleaved1F1B"),
                ("gpipe", "GPipe"),
                ("dualpipev", "DualPipeV"),
            ),
            zero=(0, 2, 3),
            nearest=(("interleaved-ep-overlap", "interleaved"),),
            recompute=("none", "full"),
            # its context parallelism is the ring (context_parallel_rotate_method passes keys
            # and values; it has no head split by all-to-all)
            cp_comm_type=("p2p",),
            sequence_parallel=(True,),  # its tensor parallelism shards the norms by sequence
        ),
        # comm_backend "standard" (all-to-all) or "deepep" (torchtitan b5bcd76c
        # torchtitan/models/common/config_utils.py).
        dispatchers=("alltoall", "deepep"),
    ),
    # DeepSpeed. State: BF16 weights and gradients, FP32 master weights and moments (the
    # ZeRO optimizer's FP32 partition). Overlap: ZeRO's overlap_comm (the reduction beside the
    # backward; the ZeRO-1/2 optimizer all-gathers the updated partitions at the end of its
    # step, stage_1_and_2.py, in series); no tensor-parallel
    # overlap (AutoTP all-reduces whole activations). Memory: Transformer Engine's FP8
    # linears; reduce buckets of reduce_bucket_size elements; ZeRO-3 keeps up to
    # stage3_max_live_parameters gathered (deepspeed/runtime/zero/config.py defaults).
    # Offload: ZeRO-Offload (stage_1_and_2.py at edaa7221): FP32 master and moments, the
    # FP32 gradient partition and a 16-bit copy of the updated weights (18 B); gradients
    # cross as FP32, weights back as 16-bit; all of the state or none.
    "deepspeed": Framework(
        name="deepspeed",
        label="DeepSpeed",
        weight_dtype="bf16",
        grad_dtype="bf16",
        master_dtype="fp32",
        overlap=Overlap(zero=True, grad_sync=True, pair_hidden=0.0),
        tp_overlap="none",
        fp8_keeps_fp8_inputs=True,
        fixed_reduce_buckets=True,
        max_live_parameters=1_000_000_000,
        optimizer_offload=OptimizerOffload(
            host_bytes=18, d2h_bytes=4, h2d_bytes=2, whole_only=True, zero=None
        ),
        launcher=Launcher(
            schedule_names=(("1f1b", "1F1B"),),
            recompute=("none", "full"),
            even_stages=True,
            pipeline_zero=(0, 1),
            # AutoTP asserts ZeRO stage <= 2 (deepspeed/runtime/engine.py,
            # _configure_tensor_parallel_states at 38327e07: "the compatibility between
            # 'autotp' and 'zero_stage = 3' has not been validated")
            tensor_zero=(0, 1, 2),
            # Its sequence parallelism is Ulysses (the heads split by all-to-all), as
            # deepspeed/runtime/sequence_parallel/ulysses_sp.py (edaa7221) adds it to a Hugging
            # Face model under ZeRO: UlyssesSPAttentionHF.register_with_transformers and
            # ds_config's sequence_parallel_size (docs/_tutorials/ulysses-alst-sequence-
            # parallelism.md); its k and v must share one shape (ulysses_sp.py:160).
            cp_comm_type=("a2a",),
            cp_alone=True,
            cp_mla=False,
            # zero_optimization.zero_hpz_partition_size (deepspeed/runtime/zero/config.py:309
            # at edaa7221): groups of consecutive global ranks (utils/groups.py:878-886)
            zero_hpz=True,
            # zero_optimization.offload_param (runtime/zero/offload_config.py at edaa7221:
            # "Valid only with stage 3")
            param_offload=True,
            sequence_parallel=(False,),  # AutoTP all-reduces whole activations
        ),
    ),
    # The eager PyTorch runtime of ``planner validate`` (gloo on CPU, NCCL on a GPU): FP32
    # parameters as the master copy, FP32 gradients and moments; each collective runs in
    # turn with the compute.
    "torch": Framework(
        name="torch",
        label="eager PyTorch",
        weight_dtype="fp32",
        grad_dtype="fp32",
        master_dtype=None,
        overlap=Overlap(zero=False, grad_sync=False, pair_hidden=0.0),  # torch's runtime
        tp_overlap="none",
        compiles_loss=True,
        eager_passes=True,
        force_balance=True,  # planner.run.model.MoE.force_balance
        pipeline_runtime="torch",
        grad_accumulation_pass=True,
        frees_grads="unbuffered",
        single_tensor_adamw=True,
        own_runtime=True,
    ),
}

# DeepSpeed as it ran ZeRO-3 from v0.3.13 (March 2021, ZeRO-3's first release) to v0.5.5
# (October 2021): the releases of the time of the Megatron-LM SC'21 paper's comparison
# (Table 2; arXiv 2104.04473, April 2021, which names no version):
# - each parameter's all-gather first synchronises the device (``_allgather_param``:
#   torch.cuda.synchronize(), partition_parameters.py at v0.3.13 to v0.5.10), so no
#   gather overlaps compute, and a submodule's fetch waits for it
#   (``fetch_sub_module``, stage3.py);
# - each parameter tensor is gathered, and its gradient reduce-scattered, by its own
#   collective (``_allgather_param``, ``_reduce_scatter_gradient``) with a list of one
#   slice per rank, and PyTorch's ProcessGroupNCCL of that time copies every slice of a
#   list collective by itself (one Tensor.copy_ per rank after the all-gather, before the
#   reduce-scatter): host work per tensor that grows with the data-parallel ranks.
#   From v0.5.6 a flat _all_gather_base replaced the list where PyTorch had it.
# The host time per slice copy, 6 us (PyTorch's dispatch, the caching allocator's
# recordStream and cudaMemcpyAsync), is a fit to that table's three ZeRO-3 rows of the
# 175B model, checked on the three of the 530B model it never saw
# (``benchmarks/ptdp_vs_zero3.py``). Otherwise it is DeepSpeed's entry, less what
# no run of that time is priced with here (FP8, offload) and its launcher: a layout for it
# is not exported.
FRAMEWORKS["deepspeed-2021"] = dataclasses.replace(
    FRAMEWORKS["deepspeed"],
    name="deepspeed-2021",
    label="DeepSpeed 0.3.13-0.5.5 (2021)",
    overlap=dataclasses.replace(FRAMEWORKS["deepspeed"].overlap, zero=False),
    fp8_keeps_fp8_inputs=False,
    optimizer_offload=None,
    launcher=None,
    zero3_slice_s=6e-6,
    costing_only="it prices DeepSpeed as it ran in 2021",
)

# Megatron-LM as it ran the SC'21 paper's runs (arXiv 2104.04473; the paper's scripts are
# examples/sc21 at commit 6985e589, August 2021):
# - every pipeline send and receive is blocking: _communicate posts them with
#   torch.distributed.batch_isend_irecv, waits on each request and then calls
#   torch.cuda.synchronize() (megatron/p2p_communication.py), in the interleaved schedule too,
#   so neither the sender nor the receiver computes while a send runs;
# - no distributed optimizer (it came in 2022): every rank keeps and steps the whole optimizer
#   state of its tensor- and pipeline-parallel shard (ZeRO 0);
# - the data-parallel reduction: --DDP-impl local (the parser's default, megatron/arguments.py)
#   all-reduces the gradient buffers in train_step after the last backward
#   (TrainingJob.exposed_grad_reduce, as run_table_1.sh runs it from 39B up); --DDP-impl torch
#   (run_table_1.sh up to 18B, pp 1) is PyTorch's DDP, bucketed beside the last backward;
# - no Transformer Engine and no tensor-parallel overlap (userbuffers came in 2023).
# Memory is priced as Megatron-LM's today (no run of that time states its memory). It costs
# measured runs; a layout for it is not exported.
FRAMEWORKS["megatron-2021"] = dataclasses.replace(
    FRAMEWORKS["megatron"],
    name="megatron-2021",
    label="Megatron-LM (2021, SC'21)",
    overlap=dataclasses.replace(
        FRAMEWORKS["megatron"].overlap, param_gather=False, async_send_schedules=()
    ),
    tp_overlap="none",
    transformer_engine=False,
    fp8_keeps_fp8_inputs=False,
    fp8_cache=False,
    optimizer_offload=None,
    activation_offload=False,
    launcher=None,
    loss_fusions=("none",),
    dispatchers=("alltoall",),
    expert_gemm_launch_s=0.0,
    costing_only="it prices Megatron-LM as it ran in 2021",
)

# Hugging Face Transformers' models trained by its Trainer with DeepSpeed ZeRO (the
# Trainer's --deepspeed ds_config.json): DeepSpeed's state, buffers and overlap, and the
# model code's own tensors (transformers/models/llama/modeling_llama.py at v5.17.0):
# LlamaRMSNorm upcasts its input to FP32 in eager ops (kept by pow and the multiply) and keeps
# the normalised BF16 tensor for the weight's gradient; LlamaMLP keeps act_fn(gate) for the
# multiply beside gate and up; ForCausalLMLoss (transformers/loss/loss_utils.py) upcasts the
# logits and runs cross-entropy on the copy. SDPA attention keeps q, k, v at their own
# head counts (enable_gqa), its output and the log-sum-exp, as the fused kernels do. Measured
# with saved-tensor hooks on transformers 5.17.0's LlamaForCausalLM
# (benchmarks/hf_saved_tensors.py): 8 ffn + 24 hidden bytes a token a layer (MHA), which
# this entry reproduces. Time is priced as DeepSpeed's (the eager ops' extra kernels and
# passes are not). It costs given layouts (memory, evaluate, published runs); it is not a
# planning target (costing_only).
FRAMEWORKS["hf-deepspeed"] = dataclasses.replace(
    FRAMEWORKS["deepspeed"],
    name="hf-deepspeed",
    label="Hugging Face Trainer with DeepSpeed",
    loss_copies_logits=True,
    unfused_norm=True,
    unfused_swiglu=True,
    launcher=None,
    costing_only="the Trainer runs data parallelism with ZeRO alone and no export states its "
    "arguments yet",
)

FRAMEWORK_NAMES: tuple[str, ...] = tuple(FRAMEWORKS)
DEFAULT_FRAMEWORK = "megatron"  # a job that names none runs under it
LAUNCHERS: tuple[str, ...] = tuple(n for n, f in FRAMEWORKS.items() if f.launcher is not None)


@contextlib.contextmanager
def replaced(name: str, base: Framework | None = None, **changes: Any) -> Iterator[Framework]:
    """Entry ``name`` as ``base`` (another entry; default its own) with ``changes``, while the
    block runs, then as it was: how a benchmark sweeps a fitted constant and a test pins one.
    The planner's caches are emptied on the way in and out (their keys name a framework, not
    its fields)."""
    entry = framework(name)
    FRAMEWORKS[name] = dataclasses.replace(base or entry, name=name, **changes)
    memo.clear_all()
    try:
        yield FRAMEWORKS[name]
    finally:
        FRAMEWORKS[name] = entry
        memo.clear_all()


def framework(name: str) -> Framework:
    """The registry entry of ``name`` (a one-line error naming the known ones otherwise)."""
    try:
        return FRAMEWORKS[name]
    except KeyError:
        raise PlannerError(
            f"framework={name!r}: unknown framework; use one of {', '.join(FRAMEWORK_NAMES)}"
        ) from None


def target(name: str) -> Launcher:
    """The launcher of framework ``name``, an export target."""
    entry = framework(name).launcher
    if entry is None:
        raise PlannerError(
            f"target={name!r}: {name} has no launcher to export to; use one of "
            f"{', '.join(LAUNCHERS)}"
        )
    return entry


def launcher(name: str) -> Launcher | None:
    """What ``name``'s launcher can state (None for ``"any"`` or a framework without one)."""
    entry = FRAMEWORKS.get(name)
    return entry.launcher if entry is not None else None


# The ZeRO-3 settings only some launchers state (Launcher fields of the same names), by what
# each does in the framework's words.
ZERO3_EXTRAS = {
    "param_offload": "ZeRO-3's weights on the host (offload_param)",
    "zero_hpz": "ZeRO++'s hierarchical partitioning (zero_hpz_partition_size)",
}


# Other layout settings only some launchers state (Launcher fields of the same names).
LAYOUT_EXTRAS = {
    "optimizer_instances": "ZeRO-1 over partial data-parallel domains "
    "(--num-distributed-optimizer-instances)",
}


def launchers_with(field: str) -> str:
    """The frameworks whose launcher states ``Launcher.<field>``, quoted, for an error."""
    return names_with(lambda f: bool(f.launcher and getattr(f.launcher, field)), quote=True)


def names_with(has: Callable[[Framework], object], *, quote: bool = False) -> str:
    """The frameworks that ``has`` a feature, for an error that names them
    (``megatron or deepspeed``; quoted: ``'megatron'``)."""
    return " or ".join(repr(n) if quote else n for n, f in FRAMEWORKS.items() if has(f))
