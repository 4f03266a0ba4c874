"""Megatron-LM command-line arguments for a plan.

Flag names are those of NVIDIA/Megatron-LM's parser (``megatron/training/arguments.py``, many
flags generated from ``TransformerConfig`` / ``ModelParallelConfig`` fields); the test suite
holds the full list read at commit d98e8a64 (2026-08-22) and checks every exported flag
against it.

What maps exactly:
- degrees: ``--tensor-model-parallel-size``, ``--context-parallel-size`` (with
  ``--cp-comm-type``: p2p, the ring, a2a, the heads split by all-to-all, or a2a+p2p with
  ``--hierarchical-context-parallel-sizes``, as ``Layout.cp_comm_type`` prices it),
  ``--pipeline-model-parallel-size``,
  ``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``; data parallelism is
  what the world size leaves;
- stages, uneven ones included: ``--pipeline-model-parallel-layout``, one stage per ``|``
  (``E`` embedding, ``t`` transformer layer, ``m`` MTP layer, ``L`` head and loss), virtual
  stages in Megatron's order (stage i on rank i mod pp), so the interleaved schedule's
  virtual pipeline size follows from it;
- recompute: one choice for every layer (``--recompute-granularity``, ``--recompute-modules``),
  or full recompute of the first k layers of every stage (``--recompute-method block``);
- ZeRO-1: ``--use-distributed-optimizer``; ZeRO-2/3: Megatron-FSDP with
  ``--data-parallel-sharding-strategy optim_grads`` / ``optim_grads_params``;
- micro and global batch, sequence length, BF16 / FP8 (blockwise); Megatron-LM's own modules
  (``TrainingJob.transformer_engine`` False) as ``--transformer-impl local``; FlashAttention-2
  (``TrainingJob.attention_kernel``) as ``--attention-backend flash``; the fused
  cross-entropy (``TrainingJob.loss_fusion`` native) as ``--cross-entropy-loss-fusion
  --cross-entropy-fusion-impl native`` (te, which pretrain_gpt.py refuses, is a difference);
- the model itself: every architecture flag, from the ``ModelSpec``
  (``planner.export.megatron_model``); a feature no flag states is a difference;
- the overlap the time model assumes for Megatron-LM (``TrainingJob.framework``):
  ``--tp-comm-overlap`` with sequence parallelism, ``--overlap-grad-reduce`` and
  ``--overlap-param-gather``; the expert all-to-all overlap of the ``*-ep-overlap``
  schedules, ``--overlap-moe-expert-parallel-comm``;
- the MoE dispatcher (``TrainingJob.moe_dispatcher``): ``--moe-token-dispatcher-type``
  alltoall or allgather, or flex with ``--moe-flex-dispatcher-backend deepep``; the experts
  as one grouped kernel (``TrainingJob.moe_grouped_tensor``): ``--moe-use-grouped-tensor``.

What does not: Megatron-LM picks 1F1B or interleaved 1F1B from the degrees and has no ZB-H1 or
DualPipe schedule (DualPipe runs as 1F1B on the same stages, DualPipeV as interleaved 1F1B
with two chunks per rank); per-block recompute mixes become one choice that saves no more
than any block did; an EMA is left to the training script; a model feature no flag states
(DeepSeek-V2's group scoring by the best expert, a vocabulary tp does not divide) is listed,
and the export is then not exact.
"""

from __future__ import annotations

import itertools
import shlex

from planner.export import (
    Export,
    finish,
    heaviest_choice,
    inputs,
    settle,
    uniform_recompute,
    with_recompute,
    without_hpz,
    without_param_offload,
)
from planner.export.megatron_model import model_args
from planner.frameworks import target
from planner.layout import Layout
from planner.schedules import schedule_of
from planner.solve.result import Plan
from planner.specs import TrainingJob

COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


# TrainingJob.moe_dispatcher in Megatron-LM's flags (transformer_config.py at d98e8a64:
# moe_token_dispatcher_type allgather | alltoall | flex, flex's backend deepep by default).
DISPATCHER_ARGS = {
    "alltoall": ["--moe-token-dispatcher-type", "alltoall"],
    "allgather": ["--moe-token-dispatcher-type", "allgather"],
    "deepep": ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"],
}


def megatron(plan: Plan) -> Export:
    """Megatron-LM arguments for ``plan`` (see the module docstring)."""
    model, _, job, planned = inputs(plan)
    differences: list[str] = []
    runs = without_hpz(_schedule(planned, differences), "Megatron-LM", differences)
    runs = without_param_offload(runs, "Megatron-LM", differences)
    runs = settle(plan, _recompute_runs(runs, differences), differences)
    args, unstated = model_args(model, tp=runs.tp, seq_len=job.seq_len)
    differences += unstated
    args += ["--seq-length", str(job.seq_len)]
    args += ["--micro-batch-size", str(runs.micro_batch)]
    args += ["--global-batch-size", str(job.global_batch)]
    args += ["--tensor-model-parallel-size", str(runs.tp)]
    if runs.cp > 1:
        args += ["--context-parallel-size", str(runs.cp), "--cp-comm-type", runs.cp_comm_type]
        if runs.cp_a2a_size:
            ring = runs.cp // runs.cp_a2a_size
            args += ["--hierarchical-context-parallel-sizes", str(runs.cp_a2a_size), str(ring)]
    args += ["--pipeline-model-parallel-size", str(runs.pp)]
    if model.num_experts:
        args += ["--expert-model-parallel-size", str(runs.ep)]
        args += ["--expert-tensor-parallel-size", str(runs.etp)]
        args += DISPATCHER_ARGS[job.moe_dispatcher]
        if job.moe_grouped_tensor:
            args.append("--moe-use-grouped-tensor")
        if schedule_of(runs.schedule).ep_overlap:
            args.append("--overlap-moe-expert-parallel-comm")
    if runs.tp > 1 and runs.sequence_parallel:
        args.append("--sequence-parallel")
        if job.tp_comm_overlap:
            # The time model hides tensor-parallel collectives as Transformer Engine's
            # userbuffers do (planner.costs.timing.TP_RS_SPLITS): state that they are on.
            args.append("--tp-comm-overlap")
    if runs.pp > 1 or runs.virtual_stages > 1:
        args += ["--pipeline-model-parallel-layout", pipeline_layout(runs)]
    args += recompute_args(runs)
    args += zero_args(runs.zero, overlap=not job.exposed_grad_reduce)
    if runs.optimizer_instances > 1:  # ZeRO-1 over partial data-parallel domains
        args += ["--num-distributed-optimizer-instances", str(runs.optimizer_instances)]
    args += _optimizer_args(job, runs)
    if job.master_dtype != "fp32":
        # --main-params-dtype takes fp32 or fp16 (arguments.py), through the distributed
        # optimizer's precision-aware path
        if job.master_dtype == "fp16" and runs.zero == 1:
            if "--use-precision-aware-optimizer" not in args:
                args.append("--use-precision-aware-optimizer")
            args += ["--main-params-dtype", "fp16"]
        else:
            differences.append(
                f"master weights {job.master_dtype or 'as the parameters'}: Megatron-LM's "
                "--main-params-dtype takes fp32 or fp16, with its distributed optimizer; "
                "keeps FP32 master weights"
            )
    if job.transformer_engine is False:  # Megatron-LM's own modules (costs.memory)
        args += ["--transformer-impl", "local"]
    if job.moe_force_balance and model.num_experts:  # routing by random logits
        args.append("--moe-router-force-load-balancing")
    if job.attention_kernel == "fa2":  # the flash-attn package; "auto" runs cuDNN (TE fused)
        args += ["--attention-backend", "flash"]
    if job.loss_fusion != "none":
        args += ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"]
    if job.loss_fusion == "te":
        differences.append(
            "cross-entropy fusion te: pretrain_gpt.py refuses --cross-entropy-fusion-impl te "
            "(arguments.py); native is written, whose compiled loss holds one FP32 copy of "
            "the logits more (Megatron-Bridge runs te: cross_entropy_fusion_impl: te)"
        )
    args.append("--bf16")
    if job.compute_dtype == "fp8":
        args += ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
    if runs.fp8_cache:  # a TransformerConfig field without a pretrain_gpt.py flag
        differences.append(
            "FP8 caching of activation inputs: pretrain_gpt.py has no flag; set "
            "TransformerConfig.activation_func_fp8_input_store=True in the model provider"
        )
    if job.grad_dtype == "bf16":  # Megatron-LM accumulates and reduces in FP32 unless told
        args.append("--grad-reduce-in-bf16")
    if job.ema:
        differences.append(
            f"EMA ({job.ema}, {planned.ema}): Megatron-LM keeps none; the training script must"
        )
    world = runs.world_size
    command = (
        f"# {model.name}: {world} GPUs, tp {runs.tp} x cp {runs.cp} x pp {runs.pp} x dp {runs.dp}"
        f" (Megatron-LM arguments, flag names as of commit {COMMIT[:8]})\n"
        f"torchrun --nproc-per-node <gpus per node> --nnodes <nodes> pretrain_gpt.py \\\n  "
        + " \\\n  ".join(_pairs(args))
        + "\n"
    )
    return finish("megatron", plan, runs, {"megatron.sh": command}, differences, args)


def pipeline_layout(layout: Layout) -> str:
    """``--pipeline-model-parallel-layout``: each stage's blocks as letters, stages joined by
    ``|``, repeated runs folded into Megatron's ``(...)*n`` and ``x*n`` forms."""
    stages = [_stage_letters([b.block for b in s.blocks]) for s in layout.stages]
    runs = [(s, len(list(g))) for s, g in itertools.groupby(stages)]
    pieces = []
    for i, (s, n) in enumerate(runs):
        last = i == len(runs) - 1
        if n == 1:
            pieces.append(s if last else s + "|")
        elif last:  # a folded group ends with "|": keep the final stage out of it
            pieces.append((f"({s}|)*{n - 1}," if n > 2 else f"{s}|") + s)
        else:
            pieces.append(f"({s}|)*{n},")
    return "".join(pieces)


def _stage_letters(blocks: list[str]) -> str:
    letters = ""
    for b in blocks:
        letters += {"embedding": "E", "head": "L"}.get(b, "m" if b.startswith("mtp.") else "t")
    # Fold runs of three or more: "ttt" -> "t*3".
    return "".join(
        f"{ch}*{n}" if (n := len(list(g))) >= 3 else ch * n for ch, g in itertools.groupby(letters)
    )


def _schedule(layout: Layout, differences: list[str]) -> Layout:
    nearest = target("megatron").runs_instead(layout.schedule)
    if nearest == layout.schedule:
        return layout
    chunked = schedule_of(nearest).virtual_stages != 1
    differences.append(
        f"schedule {layout.schedule}: Megatron-LM has no such schedule; runs {nearest} on the "
        "same stages" + (" (chunk c on rank c mod pp instead of the V shape)" if chunked else "")
    )
    return layout.model_copy(update={"schedule": nearest})


def _offloaded(layout: Layout) -> int:
    return sum(b.recompute == "offload" for s in layout.stages for b in s.blocks)


def _offload_runs(layout: Layout, differences: list[str]) -> Layout:
    """Megatron-LM offloads the first n transformer layers' activations (Transformer
    Engine's CPU offload, --cpu-offloading-num-layers n); the layout's n offloaded layers
    moved there."""
    n = _offloaded(layout)
    first = {f"layer.{i}" for i in range(n)}
    stages = [
        s.model_copy(
            update={
                "blocks": [
                    b.model_copy(update={"recompute": "offload" if b.block in first else "none"})
                    for b in s.blocks
                ]
            }
        )
        for s in layout.stages
    ]
    runs = layout.model_copy(update={"stages": stages})
    if runs != layout:
        differences.append(
            f"activation offload of {n} layers: Megatron-LM offloads the first {n}, without "
            "recompute elsewhere; runs that"
        )
    return runs


def _recompute_runs(layout: Layout, differences: list[str]) -> Layout:
    if _offloaded(layout):
        return _offload_runs(layout, differences)
    if uniform_recompute(layout) is not None or _block_full(layout) is not None:
        return layout
    choice = heaviest_choice(layout)
    differences.append(
        f"recompute differs per layer: Megatron-LM states one choice (or full recompute of the "
        f"first k layers of every stage); runs {choice} on every layer"
    )
    return with_recompute(layout, choice)


def _block_full(layout: Layout) -> int | None:
    """k when every stage recomputes fully exactly its first k layers (all of them when it
    has k or fewer) and no other layer recomputes: Megatron's ``block`` method. Only without
    virtual stages, where a Megatron stage is one of ours."""
    if layout.virtual_stages > 1:
        return None
    partial: set[int] = set()
    whole: list[int] = []
    for s in layout.stages:
        choices = [b.recompute for b in s.blocks if b.block.startswith("layer.")]
        lead = next((i for i, c in enumerate(choices) if c != "full"), len(choices))
        if any(c != "none" for c in choices[lead:]):
            return None
        if lead < len(choices):
            partial.add(lead)
        else:
            whole.append(len(choices))
    if len(partial) != 1:
        return None
    k = partial.pop()
    return k if k > 0 and all(n <= k for n in whole) else None


def recompute_args(layout: Layout) -> list[str]:
    if _offloaded(layout):
        return ["--cpu-offloading-num-layers", str(_offloaded(layout))]
    choice = uniform_recompute(layout)
    if choice is None:
        k = _block_full(layout)
        assert k is not None
        return [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            str(k),
        ]
    if choice == "none":
        return []
    offload = [m.removeprefix("offload:") for m in choice.split("+") if m.startswith("offload:")]
    if offload:  # fine-grained: these modules' inputs on the host, the rest recomputed
        rest = "+".join(m for m in choice.split("+") if not m.startswith("offload:")) or "none"
        flags = ["--fine-grained-activation-offloading", "--offload-modules", *offload]
        return flags + recompute_args(with_recompute(layout, rest))
    if choice == "full":
        return [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ]
    modules = ["core_attn"] if choice == "selective" else choice.split("+")
    return ["--recompute-granularity", "selective", "--recompute-modules", *modules]


def _optimizer_args(job: TrainingJob, runs: Layout) -> list[str]:
    """Moments in a narrower dtype and the optimizer state offloaded to the host: both go
    through the distributed optimizer's precision-aware path (Megatron-LM arguments.py:
    --optimizer-cpu-offload needs --use-precision-aware-optimizer, which needs
    --use-distributed-optimizer; --exp-avg-dtype / --exp-avg-sq-dtype take effect with it).
    At other ZeRO stages the moments stay FP32, as the plan costs them."""
    args: list[str] = []
    narrow = job.moment_dtype != "fp32"
    if runs.zero != 1:  # FP32 moments, as the plan costed them (Framework.narrow_moments_zero)
        return args
    if narrow or runs.optimizer_offload:
        args.append("--use-precision-aware-optimizer")
    if narrow:
        args += ["--exp-avg-dtype", job.moment_dtype, "--exp-avg-sq-dtype", job.moment_dtype]
    if runs.optimizer_offload:
        args += ["--optimizer-cpu-offload", "--optimizer-offload-fraction"]
        args += [repr(runs.optimizer_offload), "--overlap-cpu-optimizer-d2h-h2d"]
    return args


def zero_args(zero: int, *, overlap: bool = True) -> list[str]:
    """The data-parallel flags of ZeRO stage ``zero``; ``overlap`` False leaves the gradient
    reduction (and so the weights' gather, which needs it) after the last backward
    (``TrainingJob.exposed_grad_reduce``)."""
    overlapped = ["--overlap-grad-reduce"] if overlap else []
    if zero == 0:
        return overlapped
    if zero == 1:
        gather = ["--overlap-param-gather"] if overlap else []
        return ["--use-distributed-optimizer", *overlapped, *gather]
    strategy = "optim_grads" if zero == 2 else "optim_grads_params"
    return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]


def _pairs(args: list[str]) -> list[str]:
    """Each flag with its values on one line, shell-quoted."""
    lines: list[str] = []
    for a in args:
        if a.startswith("--") or not lines:
            lines.append(shlex.quote(a))
        else:
            lines[-1] += " " + shlex.quote(a)
    return lines
