"""Real-width layers for ``planner calibrate --sweep``: one ``planner.run.model.DenseLayer``
of each model, by micro-batch size and recompute choice, timed forward and backward and
read for the bytes it keeps, beside ``planner.costs.compute.block_time`` and the block's
saved bytes in ``planner.costs.blocks`` (what ``planner.costs.memory`` sums per stage).

The layer's memory is read with ``Device.memory``: on CUDA the caching allocator, on CPU
the live tensor bytes; "kept" is what a forward leaves allocated (what autograd saves, and
the output, which has the size of the input the cost model counts as ``block_input``).
"""

from __future__ import annotations

from typing import Any

import torch

from planner.catalog import load_model
from planner.costs.blocks import block_cost
from planner.costs.compute import Rates, block_time
from planner.costs.memory import shard_of
from planner.layout import Layout, parse_recompute
from planner.run.benchrows import SEQ, BlockRow, dim, scaled_model
from planner.run.device import Device
from planner.specs import ModelSpec

# A real-width DeepSeek-V3 MoE layer holds 256 experts of 3 x 7168 x 2048 = 44M parameters
# (its config.json): 22.5 GB of BF16 weights and as much again in gradients. Cut to 16, what
# one rank of 16-way expert parallelism holds.
BLOCK_EXPERTS = 16
BLOCKS = (  # model, block, micro-batch sizes
    ("llama3-8b", "layer.0", (1, 2)),
    ("llama3-70b", "layer.0", (1, 2)),
    ("deepseek-v3", "layer.3", (1,)),  # its first MoE layer (3 dense ones come first)
)


def block_model(name: str) -> ModelSpec:
    """The catalog model, a DeepSeek-V3 layer cut to ``BLOCK_EXPERTS`` experts with plain
    top-k routing (the real router has no group limit)."""
    model = load_model(name)
    if model.num_experts > BLOCK_EXPERTS:
        update = {"num_experts": BLOCK_EXPERTS, "expert_groups": 1, "groups_per_token": 1}
        model = model.model_copy(update=update)
    return model


def real_choices(model: ModelSpec, block: str) -> tuple[str, ...]:
    """The recompute choices ``DenseLayer`` runs for this block (``planner.layout`` names)."""
    ffn = "moe" if model.is_moe_layer(int(block.split(".")[1])) else "mlp"
    return ("none", "selective", ffn, "full")


def block_rows(
    name: str,
    block: str,
    micro_batches: tuple[int, ...],
    *,
    dev: Device,
    scale: float,
    rates: Rates,
    repeat: int,
) -> list[BlockRow]:
    """One row per micro-batch size and recompute choice of block ``block`` of ``name``."""
    from planner.run.model import DenseLayer

    model = scaled_model(block_model(name), scale)
    seq = dim(SEQ[name], scale)
    moe = model.is_moe_layer(int(block.split(".")[1]))
    torch.manual_seed(0)
    with torch.device(dev.torch_device):
        layer = DenseLayer(model, dev.dtype, moe=moe)
    rows = []
    for mb in micro_batches:
        job = job_for(seq, dev.dtype_name, micro_batch=mb)
        cost = block_cost(model, block, shard_of(job, Layout.uniform(model, micro_batch=mb)))
        with torch.device(dev.torch_device):
            x = torch.randn(mb, seq, model.hidden_size, dtype=dev.dtype, requires_grad=True)
            grad = torch.randn(mb, seq, model.hidden_size, dtype=dev.dtype)
        for choice in real_choices(model, block):
            measured = _measure_block(layer, x, grad, choice, dev, repeat)
            dropped = parse_recompute(choice)
            t = block_time(cost, rates, dropped)
            predicted_bwd = t.bwd_input + t.bwd_weight + t.recompute
            kept = cost.saved_bytes(dropped)
            rows.append(
                BlockRow(
                    model=name,
                    block=block,
                    micro_batch=mb,
                    seq_len=seq,
                    recompute=choice,
                    fwd_s=measured["fwd_s"],
                    predicted_fwd_s=t.fwd,
                    fwd_error=t.fwd / measured["fwd_s"] - 1,
                    bwd_s=measured["bwd_s"],
                    predicted_bwd_s=predicted_bwd,
                    bwd_error=predicted_bwd / measured["bwd_s"] - 1,
                    kept_bytes=measured["kept"],
                    predicted_kept_bytes=kept,
                    kept_error=kept / measured["kept"] - 1,
                    peak_bytes=measured["peak"],
                    reserved_bytes=measured["reserved"],
                )
            )
        del x, grad
    return rows


def _measure_block(
    layer: torch.nn.Module,
    x: torch.Tensor,
    grad: torch.Tensor,
    choice: str,
    dev: Device,
    repeat: int,
) -> dict[str, Any]:
    """Forward and backward seconds (each backward into fresh gradients, as a first
    micro-batch's); then, gradients in place, the bytes one forward leaves allocated (its
    output and what autograd keeps) and the peak of forward and backward above the start."""

    def forward() -> torch.Tensor:
        out: torch.Tensor = layer(x, choice)
        return out

    def fresh_forward() -> torch.Tensor:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        return forward()

    fwd = dev.median_time(forward, repeat=repeat)
    bwd = dev.median_time_after(fresh_forward, lambda y: y.backward(grad), repeat=repeat)
    fresh_forward().backward(grad)  # gradients exist before the memory is read: not the block's
    with dev.memory() as watch:
        grads = [p.grad for p in layer.parameters()]
        watch.include(list(layer.parameters()), grads, x, x.grad, grad)
        y = forward()
        kept = watch.allocated() - watch.base
        y.backward(grad)
        del y
        peak = watch.peak_allocated() - watch.base
        reserved = watch.peak_reserved()
    return {
        "fwd_s": fwd,
        "bwd_s": bwd,
        "kept": kept,
        "peak": peak,
        "reserved": reserved,
    }


def not_run(scale: float) -> dict[str, list[str]]:
    """Per block, the planner's recompute choices (its menu) the real layer lacks."""
    out = {}
    for name, block, _ in BLOCKS:
        model = scaled_model(block_model(name), scale)
        shard = shard_of(job_for(dim(SEQ[name], scale), "bf16"), Layout.uniform(model))
        menu = block_cost(model, block, shard).menu()
        have = {parse_recompute(c) for c in real_choices(model, block)}
        out[f"{name} {block}"] = [_choice_name(c) for c in menu if c not in have]
    return out


def job_for(seq: int, dtype: str, *, micro_batch: int = 1) -> Any:
    """The job a real run keeps (``planner.run.validate.small_job``): every tensor in
    ``dtype``, the eager ``torch`` runtime; one step of ``micro_batch`` sequences."""
    from planner.run.validate import small_job

    return small_job(seq_len=seq, global_batch=micro_batch, dtype=dtype)


def _choice_name(choice: frozenset[str] | str) -> str:
    return choice if isinstance(choice, str) else "+".join(sorted(choice)) or "none"
