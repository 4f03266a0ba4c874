"""Blocks of a ``ModelSpec`` as PyTorch modules, for real runs on small shapes.

They keep for backward what fused training kernels keep (Megatron-LM with Transformer
Engine), which is what ``planner.costs.blocks`` counts:
- RMSNorm keeps its input and the per-token inverse RMS (not an FP32 copy of the input, as
  PyTorch's decomposed ``rms_norm`` does in BF16);
- rotary embeddings keep nothing (their cos/sin tables are constants);
- attention is ``scaled_dot_product_attention`` (flash attention on CPU), laid out
  [batch, seq, heads, dim] so its output is the output projection's input without a copy;
- SwiGLU keeps the gate and up projections and recomputes the SiLU in backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import PlannerError
from planner.specs import ModelSpec


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        xf, g = x.float(), grad.float()
        normed = xf * rstd
        grad_w = (g * normed).sum(dim=tuple(range(g.dim() - 1)))
        gw = g * weight.float()
        grad_x = rstd * (gw - normed * (gw * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, width: int, dtype: torch.dtype, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _RMSNorm.apply(x, self.weight, self.eps)
        return out


class _Rotary(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin over the last dim; keeps nothing for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.tables = (cos, sin)  # constants, not activations
        return x * cos + _rotate_half(x) * sin

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.tables
        return grad * cos - _rotate_half(grad * sin), None, None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up (the SiLU is recomputed in backward)."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        g = gate.float()
        s = torch.sigmoid(g)
        silu = g * s
        grad_up = (grad.float() * silu).to(up.dtype)
        grad_gate = (grad.float() * up.float() * (s * (1 + g * (1 - s)))).to(gate.dtype)
        return grad_gate, grad_up


class DenseLayer(nn.Module):
    """One transformer layer of a dense GQA/MHA model with a SwiGLU MLP."""

    def __init__(self, model: ModelSpec, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if model.attention == "mla" or model.mlp != "swiglu" or model.norm != "rmsnorm":
            raise PlannerError(
                f"model {model.name}: real runs cover GQA/MHA attention with a SwiGLU MLP and "
                "RMSNorm so far"
            )
        h, d = model.hidden_size, model.head_dim
        self.nq, self.nkv, self.d = model.num_attention_heads, model.num_kv_heads, d

        def linear(i: int, o: int, bias: bool = False) -> nn.Linear:
            return nn.Linear(i, o, bias=bias, dtype=dtype)

        self.input_norm = RMSNorm(h, dtype)
        self.q_proj = linear(h, self.nq * d, model.qkv_bias)
        self.k_proj = linear(h, self.nkv * d, model.qkv_bias)
        self.v_proj = linear(h, self.nkv * d, model.qkv_bias)
        self.o_proj = linear(self.nq * d, h, model.linear_bias)
        self.pre_mlp_norm = RMSNorm(h, dtype)
        self.gate_proj = linear(h, model.ffn_hidden_size, model.linear_bias)
        self.up_proj = linear(h, model.ffn_hidden_size, model.linear_bias)
        self.down_proj = linear(model.ffn_hidden_size, h, model.linear_bias)
        self.rope = not model.learned_positions

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.input_norm(x)
        q = self.q_proj(y).view(b, s, self.nq, self.d)
        k = self.k_proj(y).view(b, s, self.nkv, self.d)
        v = self.v_proj(y).view(b, s, self.nkv, self.d)
        if self.rope:
            cos, sin = _tables(s, self.d, x.dtype)
            q, k = _Rotary.apply(q, cos, sin), _Rotary.apply(k, cos, sin)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=self.nkv != self.nq,
        )  # [b, heads, s, d] laid out as [b, s, heads, d]
        out: torch.Tensor = self.o_proj(o.transpose(1, 2).reshape(b, s, self.nq * self.d))
        return out

    def mlp(self, y: torch.Tensor) -> torch.Tensor:
        """The MLP after its norm (Megatron's ``mlp`` module: its recompute keeps the input)."""
        out: torch.Tensor = self.down_proj(_SwiGLU.apply(self.gate_proj(y), self.up_proj(y)))
        return out

    def forward(self, x: torch.Tensor, recompute: str = "none") -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        if recompute == "full":
            out: torch.Tensor = checkpoint(self._plain, x, use_reentrant=False)
            return out
        x = x + self.attention(x)
        y = self.pre_mlp_norm(x)
        if recompute == "mlp":
            return x + checkpoint(self.mlp, y, use_reentrant=False)
        if recompute != "none":
            raise PlannerError(f"recompute={recompute!r}: real runs cover none, mlp and full")
        return x + self.mlp(y)

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.mlp(self.pre_mlp_norm(x))


_TABLES: dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(s: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rotary position embeddings, [s, 1, d] (shared by every layer)."""
    key = (s, d, dtype)
    if key not in _TABLES:
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = torch.outer(torch.arange(s, dtype=torch.float32), inv)
        full = torch.cat((angles, angles), dim=-1)[:, None, :]
        _TABLES[key] = (full.cos().to(dtype), full.sin().to(dtype))
    return _TABLES[key]
