"""Blocks of a ``ModelSpec`` as PyTorch modules, for real runs on small shapes.

They keep for backward what fused training kernels keep (Megatron-LM with Transformer
Engine), which is what ``planner.costs.blocks`` counts:
- RMSNorm keeps its input and the per-token inverse RMS (not an FP32 copy of the input, as
  PyTorch's decomposed ``rms_norm`` does in BF16);
- rotary embeddings keep nothing (their cos/sin tables are constants);
- attention is ``scaled_dot_product_attention`` (flash attention on CPU), laid out
  [batch, seq, heads, dim] so its output is the output projection's input without a copy;
- SwiGLU keeps the gate and up projections and recomputes the SiLU in backward;
- an MoE router keeps its FP32 scores and a boolean routing map, token permutation an int32
  row map, and the weighted combine the experts' outputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import PlannerError
from planner.layout import parse_recompute
from planner.specs import ModelSpec

# The recompute choices a layer runs besides "full": none, core attention (Megatron-LM's
# selective default), or one of the feed-forward modules.
_RUNS: tuple[frozenset[str], ...] = (
    frozenset(),
    frozenset({"core_attn"}),
    frozenset({"mlp"}),
    frozenset({"moe"}),
)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """FP32 for 16-bit tensors (the kernels compute in FP32); wider dtypes as they are."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = _wide(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * _wide(weight)).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        xf, g = _wide(x), _wide(grad)
        normed = xf * rstd
        grad_w = (g * normed).sum(dim=tuple(range(g.dim() - 1)))
        gw = g * _wide(weight)
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
        g = _wide(gate)
        s = torch.sigmoid(g)
        silu = g * s
        grad_up = (_wide(grad) * silu).to(up.dtype)
        grad_gate = (_wide(grad) * _wide(up) * (s * (1 + g * (1 - s)))).to(gate.dtype)
        return grad_gate, grad_up


class _Attention(torch.autograd.Function):
    """Causal softmax(q k^T / sqrt(d)) v, as flash attention keeps it: q, k, v, the output and
    the FP32 log-sum-exp per query and head (the probabilities are rebuilt in backward). For
    value widths PyTorch's own flash kernel does not take (MLA: v narrower than q and k).
    Layout [batch, heads, seq, dim]."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        scores = _wide(q) @ _wide(k).transpose(-1, -2) * scale
        s = scores.shape[-1]
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        lse = scores.logsumexp(-1)
        out = (torch.exp(scores - lse[..., None]) @ _wide(v)).to(v.dtype)
        # Laid out [batch, seq, heads, dim]: the output projection reads it without a copy.
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, out, lse = ctx.saved_tensors
        qw, kw, vw, g = _wide(q), _wide(k), _wide(v), _wide(grad)
        s = q.shape[-2]
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = (qw @ kw.transpose(-1, -2) * ctx.scale).masked_fill(causal, float("-inf"))
        p = torch.exp(scores - lse[..., None])
        grad_v = p.transpose(-1, -2) @ g
        grad_p = g @ vw.transpose(-1, -2)
        grad_s = p * (grad_p - (g * _wide(out)).sum(-1, keepdim=True))
        grad_q = grad_s @ kw * ctx.scale
        grad_k = grad_s.transpose(-1, -2) @ qw * ctx.scale
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


class _Router(torch.autograd.Function):
    """Top-k routing: FP32 scores (softmax, or sigmoid with DeepSeek's bias for the choice
    only), the k best experts of each token in expert order, their scores renormalised.
    Keeps the scores and the boolean routing map (Megatron-LM keeps the same two)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        k: int,
        sigmoid: bool,
        bias: torch.Tensor | None,
        chosen: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        wide = _wide(logits)
        scores = torch.sigmoid(wide) if sigmoid else torch.softmax(wide, -1)
        if chosen is not None:  # picked already (MoE.force_balance)
            experts = chosen
        else:
            choice = scores + bias if bias is not None else scores
            experts = choice.topk(k, dim=-1).indices.sort(dim=-1).values
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, experts, True)
        picked = scores.gather(-1, experts)
        probs = picked / picked.sum(-1, keepdim=True)
        ctx.save_for_backward(scores, routing_map)
        ctx.sigmoid = sigmoid
        ctx.mark_non_differentiable(experts)
        return probs.to(logits.dtype), experts

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor, _: Any
    ) -> tuple[torch.Tensor, None, None, None, None]:
        scores, routing_map = ctx.saved_tensors
        picked = scores[routing_map].view(grad.shape)
        total = picked.sum(-1, keepdim=True)
        g = _wide(grad)
        grad_picked = (g - (g * picked).sum(-1, keepdim=True) / total) / total
        grad_scores = torch.zeros_like(scores)
        grad_scores[routing_map] = grad_picked.flatten()
        if ctx.sigmoid:
            grad_logits = grad_scores * scores * (1 - scores)
        else:
            grad_logits = scores * (grad_scores - (grad_scores * scores).sum(-1, keepdim=True))
        return grad_logits.to(grad.dtype), None, None, None, None


class _StraightThrough(torch.autograd.Function):
    """``drawn`` in the forward, the gradient passed on to ``real`` unchanged (Megatron-LM's
    RandomSTE, moe_utils.py at d98e8a64)."""

    @staticmethod
    def forward(ctx: Any, real: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
        return drawn

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Permute(torch.autograd.Function):
    """Rows of x in expert order (each token once per expert it visits); keeps only the
    int32 row map (the rows themselves are kept by the experts' first GEMMs)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.tokens = x.shape[0]
        return x.index_select(0, rows.long())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (rows,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.tokens, grad.shape[-1])
        return out.index_add_(0, rows.long(), grad), None


class _Unpermute(torch.autograd.Function):
    """Sum each token's expert rows back into token order; keeps only the int32 row map."""

    @staticmethod
    def forward(ctx: Any, rows_out: torch.Tensor, rows: torch.Tensor, tokens: int) -> torch.Tensor:
        ctx.save_for_backward(rows)
        out = rows_out.new_zeros(tokens, rows_out.shape[-1])
        return out.index_add_(0, rows.long(), rows_out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows.long()), None, None


class SwiGLUMLP(nn.Module):
    def __init__(self, h: int, width: int, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, width, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(h, width, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(width, h, bias=bias, dtype=dtype)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(_SwiGLU.apply(self.gate_proj(y), self.up_proj(y)))
        return out


class MoE(nn.Module):
    """Router, routed experts (each token to its k experts, outputs weighted by the routing
    probabilities) and shared experts, on one rank (all experts local)."""

    def __init__(self, model: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        h, e = model.hidden_size, model.num_experts
        self.k = model.experts_per_token
        self.sigmoid = model.router_expert_bias  # DeepSeek-V3: sigmoid scores, bias to pick
        self.router = nn.Linear(h, e, bias=False, dtype=dtype)
        self.register_buffer("bias", torch.zeros(e) if model.router_expert_bias else None)
        self.experts = nn.ModuleList(
            SwiGLUMLP(h, model.moe_ffn_hidden_size, dtype) for _ in range(e)
        )
        shared = model.num_shared_experts * (
            model.shared_expert_ffn_hidden_size or model.moe_ffn_hidden_size
        )
        self.shared = SwiGLUMLP(h, shared, dtype) if model.num_shared_experts else None
        if model.shared_expert_gate:
            raise PlannerError(f"model {model.name}: shared-expert gates are not covered yet")
        self.group: Any = None  # expert-parallel process group (None: every expert here)
        self.ep, self.ep_rank = 1, 0
        self.balanced = False  # force_balance
        self.counts: list[int] = []  # tokens per expert of the last call, where known

    def force_balance(self) -> None:
        """Route by random logits (``TrainingJob.moe_force_balance``, Megatron-LM's
        --moe-router-force-load-balancing): each call draws standard normal FP32 logits for
        its tokens from PyTorch's CPU generator, picks each token's experts there (so the
        tokens per expert are known without reading the device, and without a GPU:
        ``planner.run.requests``), and scores them from those logits on the device; their
        gradient goes to the router's own logits unchanged. A recompute draws the same
        logits again: torch.utils.checkpoint restores the CPU generator's state for it."""
        self.balanced = True

    def shard_experts(self, group: Any, ep: int, ep_rank: int) -> None:
        """Keep experts ``ep_rank * E/ep ..`` of ``E`` only; tokens reach them, and come back,
        by all-to-all over ``group`` (the ``ep`` ranks that split the experts)."""
        total = len(self.experts)
        if total % ep:
            raise PlannerError(f"Layout.ep={ep}: must divide the {total} routed experts")
        width = total // ep
        self.experts = nn.ModuleList(list(self.experts)[ep_rank * width : (ep_rank + 1) * width])
        self.group, self.ep, self.ep_rank, self.num_experts = group, ep, ep_rank, total

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        b, s, h = y.shape
        flat = y.reshape(b * s, h)
        logits = self.router(flat)
        counts: list[int] | None = None
        if not self.balanced:
            probs, experts = _Router.apply(logits, self.k, self.sigmoid, self.bias)
        else:
            drawn = torch.randn(logits.shape, dtype=torch.float32, device="cpu")
            picked = drawn.topk(self.k, dim=-1).indices.sort(dim=-1).values
            if self.group is None:  # the tokens per expert, read on the host
                counts = torch.bincount(picked.flatten(), minlength=len(self.experts)).tolist()
            fake = _StraightThrough.apply(logits, drawn.to(logits.device, logits.dtype))
            chosen = picked.to(logits.device)
            probs, experts = _Router.apply(fake, self.k, self.sigmoid, None, chosen)
        order = experts.flatten().argsort(stable=True)  # copies in expert order
        rows = (order // self.k).to(torch.int32)
        dispatched = _Permute.apply(flat, rows)
        if self.group is None:
            if counts is None:
                counts = torch.bincount(experts.flatten(), minlength=len(self.experts)).tolist()
            self.counts = counts
            # An expert no token reached still runs (on no rows): its gradient is zero,
            # not missing, so sharded data parallelism reduces the same tensors everywhere.
            outs = [
                expert(part)
                for expert, part in zip(self.experts, dispatched.split(counts), strict=True)
            ]
            expert_out = torch.cat(outs)  # kept by the weighted combine below
        else:
            expert_out = self._expert_parallel(dispatched, experts)
        weighted = expert_out * probs.flatten()[order, None]
        out = _Unpermute.apply(weighted, rows, b * s).view(b, s, h)
        if self.shared is not None:
            out = out + self.shared(y)
        return out

    def _expert_parallel(self, dispatched: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Rows in global expert order go to the ranks holding their experts (all-to-all),
        through the local experts, and back in the same order."""
        import torch.distributed as dist
        from torch.distributed._functional_collectives import (
            all_to_all_single_autograd as all_to_all,
        )

        width = len(self.experts)
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts)
        every = [torch.empty_like(counts) for _ in range(self.ep)]
        dist.all_gather(every, counts, group=self.group)  # rows each rank sends each expert
        mine = [c[self.ep_rank * width : (self.ep_rank + 1) * width].tolist() for c in every]
        send = counts.view(self.ep, width).sum(1).tolist()
        recv = [sum(c) for c in mine]
        received = all_to_all(
            dispatched, output_split_sizes=recv, input_split_sizes=send, group=self.group
        )
        outs = []
        for source, part in zip(mine, received.split(recv), strict=True):
            for expert, rows in zip(self.experts, part.split(source), strict=True):
                outs.append(expert(rows))
        local = torch.cat(outs)
        back: torch.Tensor = all_to_all(
            local, output_split_sizes=send, input_split_sizes=recv, group=self.group
        )
        return back


class MLA(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv projections with
    their norms, a rotary part per head for q and one shared by all heads for k."""

    def __init__(self, model: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        h, n = model.hidden_size, model.num_attention_heads
        self.n, self.dn, self.dr = n, model.qk_nope_head_dim, model.qk_rope_head_dim
        self.dv, self.dc = model.v_head_dim, model.kv_lora_rank
        dq = self.dn + self.dr
        if model.q_lora_rank:
            self.q_down = nn.Linear(h, model.q_lora_rank, bias=False, dtype=dtype)
            self.q_norm: nn.Module | None = RMSNorm(model.q_lora_rank, dtype)
            self.q_up = nn.Linear(model.q_lora_rank, n * dq, bias=False, dtype=dtype)
        else:
            self.q_norm = None
            self.q_up = nn.Linear(h, n * dq, bias=False, dtype=dtype)
        self.kv_down = nn.Linear(h, self.dc + self.dr, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(self.dc, dtype)
        self.kv_up = nn.Linear(self.dc, n * (self.dn + self.dv), bias=False, dtype=dtype)
        self.o_proj = nn.Linear(n * self.dv, h, bias=False, dtype=dtype)

    def forward(self, y: torch.Tensor, rebuild_core: bool = False) -> torch.Tensor:
        b, s, _ = y.shape
        n, dn, dr = self.n, self.dn, self.dr
        q_in = self.q_norm(self.q_down(y)) if self.q_norm is not None else y
        q = self.q_up(q_in).view(b, s, n, dn + dr)
        latent = self.kv_down(y)
        kv = self.kv_up(self.kv_norm(latent[..., : self.dc])).view(b, s, n, dn + self.dv)
        cos, sin = _tables(s, dr, y.dtype, y.device)
        q_rope = _Rotary.apply(q[..., dn:], cos, sin)
        k_rope = _Rotary.apply(latent[..., None, self.dc :], cos, sin).expand(b, s, n, dr)
        q = torch.cat((q[..., :dn], q_rope), dim=-1).transpose(1, 2)
        k = torch.cat((kv[..., :dn], k_rope), dim=-1).transpose(1, 2)
        v = kv[..., dn:].contiguous().transpose(1, 2)  # its own tensor, as fused kernels take
        o = _core(_Attention.apply, q, k, v, rebuild=rebuild_core)  # [b, n, s, dv]
        out: torch.Tensor = self.o_proj(o.transpose(1, 2).reshape(b, s, n * self.dv))
        return out


class DenseLayer(nn.Module):
    """One transformer layer: GQA/MHA or MLA attention, then a SwiGLU MLP (or, ``moe``, an
    MoE)."""

    def __init__(
        self, model: ModelSpec, dtype: torch.dtype = torch.bfloat16, *, moe: bool = False
    ) -> None:
        super().__init__()
        if model.mlp != "swiglu" or model.norm != "rmsnorm":
            raise PlannerError(
                f"model {model.name}: real runs cover SwiGLU MLPs and RMSNorm so far"
            )
        h, d = model.hidden_size, model.head_dim
        self.nq, self.nkv, self.d = model.num_attention_heads, model.num_kv_heads, d

        def linear(i: int, o: int, bias: bool = False) -> nn.Linear:
            return nn.Linear(i, o, bias=bias, dtype=dtype)

        self.input_norm = RMSNorm(h, dtype)
        self.mla = MLA(model, dtype) if model.attention == "mla" else None
        if self.mla is None:
            self.q_proj = linear(h, self.nq * d, model.qkv_bias)
            self.k_proj = linear(h, self.nkv * d, model.qkv_bias)
            self.v_proj = linear(h, self.nkv * d, model.qkv_bias)
            self.o_proj = linear(self.nq * d, h, model.linear_bias)
        self.pre_mlp_norm = RMSNorm(h, dtype)
        self.ffn: nn.Module = (
            MoE(model, dtype)
            if moe
            else SwiGLUMLP(h, model.ffn_hidden_size, dtype, model.linear_bias)
        )
        self.rope = not model.learned_positions

    def attention(self, x: torch.Tensor, rebuild_core: bool = False) -> torch.Tensor:
        """Norm, attention and output projection; ``rebuild_core``: Megatron-LM's
        ``core_attn`` recompute (the fused attention re-runs in backward; with flash
        attention that drops only its softmax statistics)."""
        b, s, _ = x.shape
        y = self.input_norm(x)
        if self.mla is not None:
            out: torch.Tensor = self.mla(y, rebuild_core)
            return out
        q = self.q_proj(y).view(b, s, self.nq, self.d)
        k = self.k_proj(y).view(b, s, self.nkv, self.d)
        v = self.v_proj(y).view(b, s, self.nkv, self.d)
        if self.rope:
            cos, sin = _tables(s, self.d, x.dtype, x.device)
            q, k = _Rotary.apply(q, cos, sin), _Rotary.apply(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # [b, heads, s, d] laid out as [b, s, heads, d]
        o = _core(self._sdpa, q, k, v, rebuild=rebuild_core)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.nq * self.d))

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.nkv != self.nq
        )
        return out

    def mlp(self, y: torch.Tensor) -> torch.Tensor:
        """The MLP (or MoE) after its norm: Megatron's ``mlp`` / ``moe`` module, whose
        recompute keeps its input."""
        out: torch.Tensor = self.ffn(y)
        return out

    def forward(self, x: torch.Tensor, recompute: str = "none") -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        modules = parse_recompute(recompute)  # "selective" is {core_attn}, as a log names it
        if modules == "full":
            out: torch.Tensor = checkpoint(self._plain, x, use_reentrant=False)
            return out
        if modules not in _RUNS:
            raise PlannerError(
                f"recompute={recompute!r}: real runs cover none, selective, mlp, moe and full"
            )
        x = x + self.attention(x, rebuild_core="core_attn" in modules)
        y = self.pre_mlp_norm(x)
        # Megatron-LM's modules: ``mlp`` is a dense layer's MLP, ``moe`` an MoE layer's.
        if ("moe" if isinstance(self.ffn, MoE) else "mlp") in modules:
            return x + checkpoint(self.mlp, y, use_reentrant=False)
        return x + self.mlp(y)

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.mlp(self.pre_mlp_norm(x))


def _core(
    fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rebuild: bool
) -> torch.Tensor:
    """The core attention ``fn(q, k, v)``, checkpointed when ``rebuild`` (it then keeps
    only q, k and v; its output is kept by the output projection either way)."""
    from torch.utils.checkpoint import checkpoint

    out: torch.Tensor = checkpoint(fn, q, k, v, use_reentrant=False) if rebuild else fn(q, k, v)
    return out


_TABLES: dict[tuple[int, int, torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(
    s: int, d: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rotary position embeddings, [s, 1, d] (shared by every layer), on
    ``device``."""
    key = (s, d, dtype, device)
    if key not in _TABLES:
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = torch.outer(torch.arange(s, dtype=torch.float32), inv)
        full = torch.cat((angles, angles), dim=-1)[:, None, :]
        _TABLES[key] = (full.cos().to(dtype).to(device), full.sin().to(dtype).to(device))
    return _TABLES[key]


class Embedding(nn.Module):
    """Token embedding: keeps the int64 token ids for its backward."""

    def __init__(self, model: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.randn(model.vocab_size, model.hidden_size, dtype=dtype) * 0.02
        )

    def forward(self, ids: torch.Tensor, recompute: str = "none") -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Head(nn.Module):
    """Final norm and the output projection to FP32 logits (the loss is applied after it);
    ``weight``: the embedding's, when the model ties them."""

    def __init__(
        self, model: ModelSpec, dtype: torch.dtype, weight: nn.Parameter | None = None
    ) -> None:
        super().__init__()
        self.norm = RMSNorm(model.hidden_size, dtype)
        self.weight = (
            weight
            if weight is not None
            else nn.Parameter(torch.randn(model.vocab_size, model.hidden_size, dtype=dtype) * 0.02)
        )

    def forward(self, x: torch.Tensor, recompute: str = "none") -> torch.Tensor:
        return F.linear(self.norm(x), self.weight).float()


class _CrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over tokens as fused kernels do it (Megatron-LM's vocab-parallel
    cross-entropy): the softmax is taken in place over the FP32 logits, which are kept as
    the probabilities and turned into the logits' gradient in place in backward; no second
    vocabulary-sized tensor is ever allocated."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The softmax overwrites the FP32 logits (nothing else keeps them): no second copy.
        probs = _wide(logits.detach()).reshape(-1, logits.shape[-1])
        probs.sub_(probs.max(-1, keepdim=True).values).exp_()
        probs.div_(probs.sum(-1, keepdim=True))
        rows = torch.arange(probs.shape[0], device=probs.device)
        picked = probs[rows, target.reshape(-1)]
        ctx.save_for_backward(probs, target)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return -picked.log().mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        probs, target = ctx.saved_tensors
        rows = torch.arange(probs.shape[0], device=probs.device)
        probs[rows, target.reshape(-1)] -= 1  # the saved buffer becomes the gradient
        probs.mul_(grad / probs.shape[0])
        return probs.view(ctx.shape).to(ctx.dtype), None


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over tokens (see ``_CrossEntropy``)."""
    out: torch.Tensor = _CrossEntropy.apply(logits, target)
    return out
