"""A rank's model state, in bytes: weights, gradients, optimizer state, an EMA, what lives on
the host, and what the optimizer step moves.

Sharding groups: dense weights are split over ``tp`` and ZeRO-sharded over ``dp * cp`` (the
ranks that reduce their gradients); routed experts are split over ``ep * etp`` and
ZeRO-sharded over the expert-data-parallel group ``dp * cp * tp / (ep * etp)``.

Optimizer offload (``Layout.optimizer_offload``, a fraction ``f``): the rank keeps ``1 - f``
of its optimizer state in HBM; the rest lives on the host with what the framework keeps
there per offloaded element (``Framework.optimizer_offload``). Working weights and gradient
buffers stay in HBM as before (the framework copies from and into them). What the step moves
is in ``StageMemory.step_bytes`` (see ``planner.costs.timing.optimizer_seconds``).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.costs.blocks import Param
from planner.frameworks import framework, names_with
from planner.layout import Layout
from planner.specs import DTYPE_BYTES, TrainingJob


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
        able = names_with(lambda f: f.optimizer_offload)
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


# PyTorch's single-tensor AdamW step (torch/optim/adam.py, _single_tensor_adam, with a float
# learning rate) as passes over one parameter's elements, by the tensor each reads or writes:
# param.mul_(1 - lr * wd) reads and writes the parameter; exp_avg.lerp_(grad) reads both and
# writes exp_avg; exp_avg_sq.mul_(beta2) reads and writes it, .addcmul_(grad, grad) reads it
# and the gradient and writes it; exp_avg_sq.sqrt() reads it into a temporary (the moments'
# dtype), / bias_correction2_sqrt reads that into another, .add_(eps) reads and writes it;
# param.addcdiv_(exp_avg, denom) reads the three and writes the parameter. All BF16: 40 bytes
# an element, where a fused step moves 12 (moments read and written, gradient read, parameter
# written); on one H200, 31 ms a step for 3.1 billion parameters measured (torch.profiler,
# benchmarks/gpu_validate_profile.py 4 --moe), 33 ms at 0.8 of its HBM bandwidth.
SINGLE_TENSOR_ADAMW = {"param": 4, "exp_avg": 3, "exp_avg_sq": 5, "grad": 2, "temporary": 6}


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
    stepped_total = 0.0  # elements this rank's optimizer step updates
    moved_rw = 0.0  # gradient reads and weight writes the PCIe copies take off the GPU's step
    wb, gb = DTYPE_BYTES[job.weight_dtype], DTYPE_BYTES[job.grad_dtype]
    moments = 2 if job.optimizer == "adamw" else 1
    moment_b = DTYPE_BYTES[job.moment_dtype]
    if fw.narrow_moments_zero not in (None, layout.zero):
        moment_b = max(moment_b, DTYPE_BYTES["fp32"])  # the framework keeps FP32 moments here
    opt_b = (DTYPE_BYTES[job.master_dtype] if job.master_dtype else 0) + moments * moment_b
    ema_b = DTYPE_BYTES[job.ema] if job.ema else 0
    edp = layout.plane // (layout.ep * layout.etp)
    z = layout.zero
    held = held_unsharded(job, layout)
    working = DTYPE_BYTES[job.working_weight_dtype]
    # FSDP2 shards the parameters' storage whenever it shards anything: torchtitan's "ZeRO-2"
    # is reshard_after_forward off, which keeps the gathered working copy (held_unsharded).
    sharded_weights = fw.zero_shards_weights_from
    instances = layout.optimizer_instances  # ZeRO-1 over partial domains: a replica each
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
        stepped = local / (group // instances if z >= 1 else 1)  # elements its step updates
        stepped_total += stepped
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
    if fw.single_tensor_adamw and job.optimizer == "adamw" and not off:
        passes = SINGLE_TENSOR_ADAMW
        each = (
            passes["param"] * DTYPE_BYTES[job.master_dtype or job.weight_dtype]
            + (passes["exp_avg"] + passes["exp_avg_sq"] + passes["temporary"]) * moment_b
            + passes["grad"] * gb
        )
        out["step_hbm"] = stepped_total * each + 2 * out["ema"]
    if z >= 3 and layout.zero_hpz > 1:
        # ZeRO++'s secondary shard of every parameter, in its own dtype, from a step's first
        # forward gather through its optimizer step, which clears it (DeepSpeed's
        # partition_parameters.py _partition_param_sec at edaa7221: aligned numel / hpz
        # elements; stage3.py _post_step -> invalidate_secondary_tensor)
        out["weights"] += sum(p.numel / shards(p, layout) for p in params) * wb / layout.zero_hpz
    if layout.param_offload:
        # DeepSpeed's offload_param: the shards (and secondary shards: on the parameters'
        # remote device, partition_parameters.py:1887-1891) live in pinned host memory. The
        # GPU's part of the step sends its updated weights there over PCIe; an offloaded
        # part's host step writes them in place, with no copy back to the GPU.
        out["host"] += out["weights"]
        out["step_d2h"] += out["weights"] * (1 - off)
        out["step_h2d"] = 0.0
        out["weights"] = 0.0
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
