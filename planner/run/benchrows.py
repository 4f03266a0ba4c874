"""What ``planner calibrate --sweep`` reports (``planner.run.bench``): a row model per kind
of measurement, the ``Sweep`` that holds them, and how widths shrink on CPU (``scale``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from planner.specs import ModelSpec

# Training sequence lengths: Llama 3 pre-trained on 8,192-token sequences ("The Llama 3
# Herd of Models", arXiv 2407.21783, section 3.4.1); DeepSeek-V3 on 4K ("DeepSeek-V3
# Technical Report", arXiv 2412.19437, section 4.2).
SEQ = {"llama3-8b": 8192, "llama3-70b": 8192, "deepseek-v3": 4096}


class GemmRow(BaseModel):
    model: str
    name: str = Field(description="Which GEMM of the layer.")
    tp: int = Field(description="Tensor- (experts: expert-tensor-) parallel degree.")
    m: int
    n: int
    k: int
    groups: int = Field(description="Independent products in one kernel (grouped experts).")
    measured_s: float
    flops_per_s: float = Field(description="Achieved FLOP/s.")
    predicted_s: float = Field(description="planner.costs.compute for this shape (s).")
    error: float = Field(description="predicted / measured - 1.")


class AttentionRow(BaseModel):
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    phase: str = Field(description="fwd or bwd.")
    flops: float = Field(description="The cost model's count (FLOP).")
    measured_s: float
    flops_per_s: float
    predicted_s: float
    error: float


class MemoryRow(BaseModel):
    kernel: str
    bytes: int = Field(description="Bytes read + written.")
    measured_s: float
    bytes_per_s: float
    predicted_s: float
    error: float


class BlockRow(BaseModel):
    model: str
    block: str
    micro_batch: int
    seq_len: int
    recompute: str
    fwd_s: float
    predicted_fwd_s: float
    fwd_error: float
    bwd_s: float = Field(description="Backward, recompute included (s).")
    predicted_bwd_s: float
    bwd_error: float
    kept_bytes: int = Field(description="Bytes the forward leaves for backward (its output too).")
    predicted_kept_bytes: int = Field(description="The block's saved activation bytes.")
    kept_error: float
    peak_bytes: int = Field(description="Highest allocated in forward+backward above the start.")
    reserved_bytes: int | None = Field(description="Allocator's reserved peak; None on CPU.")


class Sweep(BaseModel):
    device: str
    device_name: str
    dtype: str
    scale: float = Field(description="Factor on every width and length (1: real widths).")
    when: str
    torch: str
    reference: str = Field(description="Whose rates price the rows.")
    rates: dict[str, float | None] = Field(description="Those rates (FLOP/s, B/s, s).")
    gemm: list[GemmRow]
    attention: list[AttentionRow]
    memory: list[MemoryRow]
    blocks: list[BlockRow]
    not_run: dict[str, list[str]] = Field(
        description="Recompute choices the planner has for each block that the real layer "
        "does not implement."
    )


def dim(x: float, scale: float) -> int:
    """A width or length at ``scale``: exact at 1, else a multiple of 8, at least 8."""
    return int(x) if scale == 1 else max(8, round(x * scale / 8) * 8)


def scaled_model(model: ModelSpec, scale: float) -> ModelSpec:
    """``model`` with its widths (and head counts) times ``scale``; head dims kept."""
    if scale == 1:
        return model
    kv = max(1, round(model.num_kv_heads * scale))
    heads = max(kv, round(model.num_attention_heads * scale) // kv * kv)
    update: dict[str, Any] = {
        "hidden_size": dim(model.hidden_size, scale),
        "ffn_hidden_size": dim(model.ffn_hidden_size, scale),
        "num_attention_heads": heads,
        "num_kv_heads": kv,
    }
    for key in ("moe_ffn_hidden_size", "shared_expert_ffn_hidden_size", "kv_lora_rank"):
        if getattr(model, key):
            update[key] = dim(getattr(model, key), scale)
    if model.q_lora_rank:
        update["q_lora_rank"] = dim(model.q_lora_rank, scale)
    return model.model_copy(update=update)
