"""Per-block costs from the model config alone: parameters, FLOPs and saved activations.

A *block* is a unit the pipeline can place: ``embedding``, ``layer.<i>`` (a whole transformer
layer: input norm, attention, pre-MLP norm, dense MLP or MoE), ``mtp.<j>`` (a DeepSeek-V3
multi-token-prediction module) and ``head`` (final norm, output projection, loss).

Parameters are exact per tensor, each marked with how tensor parallelism treats it (split or
replicated, following Megatron-LM: column/row/vocab-parallel linears split, MLA down
projections, norms and the router replicated) and whether it is a routed expert (sharded over
``ep``). Tensors shared between blocks (tied embedding/head, the MTP module's use of both)
carry the same ``key`` so a rank holding both counts them once.

FLOPs are per micro-batch per rank (a multiply-add is 2 FLOPs). Backward is split into the
input-gradient (B) and weight-gradient (W) halves for zero-bubble schedules.

Saved activations are named groups with their bytes per micro-batch per rank. Each group names
the Megatron-LM ``--recompute-modules`` values that drop it; a group no module drops is dropped
only by full recompute, and ``block_input`` never is. Conventions (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", section 4): sequence
parallelism shards everything outside the tensor-parallel regions over ``tp``; with flash
attention no s^2 tensor is saved, only the softmax statistics; dropout masks are 1 byte per
element.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction

from planner.errors import PlannerError
from planner.specs import DTYPE_BYTES, ModelSpec

SOFTMAX_STAT_BYTES = 4  # flash attention keeps the fp32 log-sum-exp per query and head
LOGIT_BYTES = 4  # the vocab-parallel cross-entropy keeps fp32 softmax over the vocab shard
ROUTER_SCORE_BYTES = 5  # fp32 router scores + a bool routing map per token and expert
TOKEN_ID_BYTES = 8  # int64 token ids kept for the embedding's backward
CAUSAL = 0.5  # causal attention computes half of the s x s score matrix
ELEMENTWISE = 5  # FLOPs counted per element of a norm or activation (memory-bound work)


@dataclass(frozen=True)
class Param:
    """One parameter tensor (or buffer) of the model."""

    key: str  # unique in the model; shared tensors appear in several blocks under one key
    numel: int
    tp_split: bool  # split over tp ranks (else replicated on each)
    expert: bool = False  # a routed expert: sharded over ep, replicated over dp*tp/ep
    trainable: bool = True  # buffers have no gradient and no optimizer state
    active: Fraction = Fraction(1)  # share one token passes through (routed experts: k/E)


@dataclass(frozen=True)
class ActGroup:
    """A group of tensors saved in forward for backward, per micro-batch on one rank."""

    name: str
    bytes: int
    modules: tuple[str, ...] = ()  # recompute modules that drop it; () = only full; see below
    keep_always: bool = False  # the block input: kept even under full recompute


@dataclass(frozen=True)
class Shard:
    """Where a block runs: the parallel degrees and shapes that change its per-rank costs."""

    seq_len: int
    micro_batch: int = 1
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = True
    flash_attention: bool = True
    activation_dtype: str = "bf16"
    moe_load_imbalance: float = 1.0

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch (all tp ranks see them inside tensor-parallel regions)."""
        return self.micro_batch * self.seq_len

    @property
    def sp_tokens(self) -> float:
        """Tokens a rank keeps outside tensor-parallel regions (sharded by sequence parallel)."""
        return self.tokens / self.tp if self.sequence_parallel else self.tokens

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.activation_dtype]


@dataclass
class BlockCost:
    """Costs of one block on one rank for one micro-batch."""

    name: str
    params: list[Param] = field(default_factory=list)
    fwd_flops: float = 0.0
    bwd_input_flops: float = 0.0
    bwd_weight_flops: float = 0.0
    saved: list[ActGroup] = field(default_factory=list)
    module_flops: dict[str, float] = field(default_factory=dict)  # forward FLOPs per module

    @property
    def bwd_flops(self) -> float:
        return self.bwd_input_flops + self.bwd_weight_flops

    def saved_bytes(self, dropped: frozenset[str] | str = frozenset()) -> int:
        """Bytes kept for backward under a recompute choice (a module set or ``"full"``)."""
        return sum(g.bytes for g in self.saved if not _is_dropped(g, dropped))

    def rebuilt_bytes(self, dropped: frozenset[str] | str) -> int:
        """Bytes re-materialised in backward under a recompute choice (one micro-batch)."""
        return sum(g.bytes for g in self.saved if _is_dropped(g, dropped))

    def recompute_flops(self, dropped: frozenset[str] | str) -> float:
        """Forward FLOPs repeated in backward to rebuild what ``dropped`` discards."""
        if dropped == "full":
            return self.fwd_flops
        chosen = set(dropped)
        if "moe" in chosen:  # the whole MoE layer is re-run, its parts with it
            chosen -= {"moe_act", "shared_experts"}
        return sum(self.module_flops.get(m, 0.0) for m in chosen)

    def menu(self) -> list[frozenset[str] | str]:
        """Recompute choices worth considering: none, each module this block has, full."""
        modules = sorted({m for g in self.saved for m in g.modules})
        choices: list[frozenset[str] | str] = [frozenset()]
        choices += [frozenset({m}) for m in modules]
        if any(not g.keep_always for g in self.saved):
            choices.append("full")
        return choices

    # -- builders -------------------------------------------------------------------------
    def linear(
        self,
        key: str,
        d_in: int,
        d_out: int,
        *,
        tokens: float,
        split: bool,
        bias: bool = False,
        module: str = "",
    ) -> None:
        """A linear layer applied to ``tokens`` tokens: params, and 2*tokens*in*out FLOPs each
        for forward, input gradient and weight gradient (divided over tp when split)."""
        self.params.append(Param(key, d_in * d_out + (d_out if bias else 0), tp_split=split))
        flops = 2.0 * tokens * d_in * d_out
        self.fwd_flops += flops
        self.bwd_input_flops += flops
        self.bwd_weight_flops += flops
        if module:
            self.module_flops[module] = self.module_flops.get(module, 0.0) + flops

    def save(self, name: str, nbytes: float, *modules: str, keep: bool = False) -> None:
        self.saved.append(ActGroup(name, round(nbytes), tuple(modules), keep))

    def norm(self, key: str, width: int, kind: str) -> None:
        self.params.append(Param(key, width * (2 if kind == "layernorm" else 1), tp_split=False))


def _is_dropped(group: ActGroup, dropped: frozenset[str] | str) -> bool:
    if group.keep_always:
        return False
    if dropped == "full":
        return True
    return any(m in dropped for m in group.modules)


# ---------------------------------------------------------------------------------------
# names


def block_names(model: ModelSpec) -> list[str]:
    """Blocks in model (pipeline) order: embedding, layers, MTP modules, head."""
    return (
        ["embedding"]
        + [f"layer.{i}" for i in range(model.num_layers)]
        + [f"mtp.{j}" for j in range(model.num_mtp_layers)]
        + ["head"]
    )


def block_cost(model: ModelSpec, name: str, shard: Shard) -> BlockCost:
    """Parameters, FLOPs and saved activations of block ``name`` under ``shard``."""
    _check_shard(model, shard)
    cost = BlockCost(name)
    if name == "embedding":
        _embedding(cost, model, shard)
    elif name == "head":
        _head(cost, model, shard)
    elif name.startswith("layer."):
        index = _index(name, model.num_layers)
        prefix = f"layer.{index}."
        _layer(cost, model, shard, prefix, moe=model.is_moe_layer(index))
        # Group names are local to the block; parameter keys stay model-wide.
        cost.saved = [replace(g, name=g.name.removeprefix(prefix)) for g in cost.saved]
    elif name.startswith("mtp."):
        index = _index(name, model.num_mtp_layers)
        _mtp(cost, model, shard, index)
    else:
        raise PlannerError(f"block={name!r}: not a block of {model.name}; see block_names()")
    return cost


def model_param_count(model: ModelSpec, *, active: bool = False, include_mtp: bool = True) -> int:
    """Trainable parameters of the whole model, each shared tensor counted once."""
    shard = Shard(seq_len=1)
    seen: dict[str, Param] = {}
    for name in block_names(model):
        if name.startswith("mtp.") and not include_mtp:
            continue
        for p in block_cost(model, name, shard).params:
            seen.setdefault(p.key, p)
    total = Fraction(0)
    for p in seen.values():
        if p.trainable:
            total += p.numel * (p.active if active else 1)
    return int(total)


def _index(name: str, limit: int) -> int:
    try:
        index = int(name.split(".", 1)[1])
    except ValueError:
        index = -1
    if not 0 <= index < limit:
        raise PlannerError(f"block={name!r}: index must be in 0..{limit - 1}")
    return index


def _check_shard(model: ModelSpec, shard: Shard) -> None:
    t = shard.tp
    checks = [
        ("num_attention_heads", model.num_attention_heads),
        ("ffn_hidden_size", model.ffn_hidden_size),
    ]  # the vocabulary need not divide: launchers pad it (ignored here, < 128*tp rows)
    if model.attention != "mla":
        checks.append(("num_kv_heads", model.num_kv_heads))
    if model.num_shared_experts:
        checks.append(("shared_expert_ffn_hidden_size", _shared_width(model)))
    for key, value in checks:
        if value % t:
            raise PlannerError(f"Layout.tp={t}: tensor parallel degree must divide {key}={value}")
    if model.num_experts and model.num_experts % shard.ep:
        raise PlannerError(
            f"Layout.ep={shard.ep}: expert parallel degree must divide "
            f"num_experts={model.num_experts}"
        )


def _shared_width(model: ModelSpec) -> int:
    return model.num_shared_experts * (
        model.shared_expert_ffn_hidden_size or model.moe_ffn_hidden_size
    )


# ---------------------------------------------------------------------------------------
# blocks


def _embedding(cost: BlockCost, model: ModelSpec, shard: Shard) -> None:
    h = model.hidden_size
    # Vocab-parallel embedding: each tp rank holds V/tp rows; lookups are gathers (no GEMM).
    cost.params.append(Param("word_embeddings", model.vocab_size * h, tp_split=True))
    if model.learned_positions:
        cost.params.append(Param("position_embeddings", model.learned_positions * h, False))
    cost.save("token_ids", shard.tokens * TOKEN_ID_BYTES, keep=True)
    if model.hidden_dropout:
        cost.save("embedding_dropout_mask", shard.sp_tokens * h)


def _head(cost: BlockCost, model: ModelSpec, shard: Shard, *, prefix: str = "") -> None:
    """Final norm, output projection over the vocabulary shard, fp32 cross-entropy."""
    h, v = model.hidden_size, model.vocab_size
    if not prefix:
        cost.save("block_input", shard.sp_tokens * h * shard.act_bytes, keep=True)
    _saved_norm(cost, model, shard, prefix + "final_norm", prefix + "final_norm_out")
    key = "word_embeddings" if model.tie_word_embeddings else "output"
    flops = 2.0 * shard.tokens * h * v / shard.tp
    cost.params.append(Param(key, v * h, tp_split=True))
    cost.fwd_flops += flops
    cost.bwd_input_flops += flops
    cost.bwd_weight_flops += flops
    cost.save(prefix + "logits", shard.tokens * v / shard.tp * LOGIT_BYTES)


def _saved_norm(cost: BlockCost, model: ModelSpec, shard: Shard, key: str, saved: str) -> None:
    """A replicated norm whose output is saved (Megatron's ``layernorm`` module drops it)."""
    h = model.hidden_size
    cost.norm(key, h, model.norm)
    cost.save(saved, shard.sp_tokens * h * shard.act_bytes, "layernorm")
    cost.module_flops["layernorm"] = (
        cost.module_flops.get("layernorm", 0.0) + ELEMENTWISE * shard.sp_tokens * h
    )


def _layer(
    cost: BlockCost, model: ModelSpec, shard: Shard, prefix: str, *, moe: bool, keep: bool = True
) -> None:
    h, a, sp = model.hidden_size, shard.act_bytes, shard.sp_tokens
    cost.save(prefix + "block_input", sp * h * a, keep=keep)
    _saved_norm(cost, model, shard, prefix + "input_norm", prefix + "input_norm_out")
    if model.attention == "mla":
        _mla(cost, model, shard, prefix)
    else:
        _gqa(cost, model, shard, prefix)
    if model.hidden_dropout:
        cost.save(prefix + "attn_dropout_mask", sp * h)
    cost.save(prefix + "residual_mid", sp * h * a)
    _saved_norm(cost, model, shard, prefix + "pre_mlp_norm", prefix + "pre_mlp_norm_out")
    if moe:
        _moe(cost, model, shard, prefix)
    else:
        _dense_mlp(cost, model, shard, prefix)
    if model.hidden_dropout:
        cost.save(prefix + "mlp_dropout_mask", sp * h)


def _mtp(cost: BlockCost, model: ModelSpec, shard: Shard, index: int) -> None:
    """DeepSeek-V3 multi-token prediction module: normalise the previous depth's hidden state
    and the embedding of the token ``index+1`` ahead, project the concatenation (2h -> h),
    run one transformer layer, then the shared head and its loss. The embedding and the
    output head are the main model's (same keys): a rank holding both counts them once."""
    h, a, sp = model.hidden_size, shard.act_bytes, shard.sp_tokens
    prefix = f"mtp.{index}."
    cost.save(prefix + "hidden_input", sp * h * a, keep=True)
    cost.save(prefix + "token_ids", shard.tokens * TOKEN_ID_BYTES, keep=True)
    cost.params.append(Param("word_embeddings", model.vocab_size * h, tp_split=True))
    _saved_norm(cost, model, shard, prefix + "enorm", prefix + "enorm_out")
    _saved_norm(cost, model, shard, prefix + "hnorm", prefix + "hnorm_out")
    cost.linear(prefix + "eh_proj", 2 * h, h, tokens=shard.tokens / shard.tp, split=True)
    moe = model.is_moe_layer(model.num_layers + index)
    _layer(cost, model, shard, prefix + "layer.", moe=moe, keep=False)
    _head(cost, model, shard, prefix=prefix)


def _core_attention(
    cost: BlockCost, model: ModelSpec, shard: Shard, *, d_qk: int, d_v: int
) -> None:
    """Softmax(QK^T)V over the rank's heads; causal, so half the score matrix is computed."""
    b, s = shard.micro_batch, shard.seq_len
    heads = model.num_attention_heads / shard.tp
    qk = 2.0 * b * s * s * heads * d_qk * CAUSAL
    av = 2.0 * b * s * s * heads * d_v * CAUSAL
    cost.fwd_flops += qk + av
    cost.module_flops["core_attn"] = qk + av
    # Backward: dQ, dK (from QK^T) and dV, dP (from PV) are 2x forward; flash attention also
    # recomputes the scores QK^T in backward instead of saving them.
    cost.bwd_input_flops += 2 * (qk + av) + (qk if shard.flash_attention else 0.0)
    if shard.flash_attention:
        cost.save("softmax_stats", b * s * heads * SOFTMAX_STAT_BYTES, "core_attn")
        return
    scores = b * heads * s * s  # elements of the s x s probabilities on this rank
    a = shard.act_bytes
    cost.save("attn_probs", scores * a, "core_attn")
    if model.attention_dropout:
        cost.save("attn_dropout_mask", scores * 1, "core_attn")
        cost.save("attn_dropout_out", scores * a, "core_attn")


def _gqa(cost: BlockCost, model: ModelSpec, shard: Shard, prefix: str) -> None:
    h, d, t = model.hidden_size, model.head_dim, shard.tp
    nq, nkv = model.num_attention_heads, model.num_kv_heads
    tokens, a = shard.tokens, shard.act_bytes
    cost.linear(prefix + "q_proj", h, nq * d, tokens=tokens / t, split=True, bias=model.qkv_bias)
    cost.linear(prefix + "k_proj", h, nkv * d, tokens=tokens / t, split=True, bias=model.qkv_bias)
    cost.linear(prefix + "v_proj", h, nkv * d, tokens=tokens / t, split=True, bias=model.qkv_bias)
    cost.save(prefix + "qkv", tokens * (nq + 2 * nkv) * d * a / t)
    _core_attention(cost, model, shard, d_qk=d, d_v=d)
    cost.save(prefix + "attn_proj_in", tokens * nq * d * a / t)
    cost.linear(prefix + "o_proj", nq * d, h, tokens=tokens / t, split=True, bias=model.linear_bias)


def _mla(cost: BlockCost, model: ModelSpec, shard: Shard, prefix: str) -> None:
    """Multi-head latent attention (DeepSeek-V2/V3). Down projections are replicated on every
    tp rank and run on all tokens (Megatron-LM's ``parallel_mode='duplicated'``); the up
    projections (the per-head q RoPE part included) are column-parallel."""
    h, t, a, tokens = model.hidden_size, shard.tp, shard.act_bytes, shard.tokens
    n = model.num_attention_heads
    dn, dr, dv, dc = (
        model.qk_nope_head_dim,
        model.qk_rope_head_dim,
        model.v_head_dim,
        model.kv_lora_rank,
    )
    dq = dn + dr
    up = "mla_up_proj"
    latent = 0
    if model.q_lora_rank:
        dcq = model.q_lora_rank
        cost.linear(prefix + "q_down", h, dcq, tokens=tokens, split=False)
        cost.norm(prefix + "q_norm", dcq, model.norm)
        cost.linear(prefix + "q_up", dcq, n * dq, tokens=tokens / t, split=True, module=up)
        latent += dcq
    else:
        cost.linear(prefix + "q_proj", h, n * dq, tokens=tokens / t, split=True, module=up)
    cost.linear(prefix + "kv_down", h, dc + dr, tokens=tokens, split=False)
    cost.norm(prefix + "kv_norm", dc, model.norm)
    cost.linear(prefix + "kv_up", dc, n * (dn + dv), tokens=tokens / t, split=True, module=up)
    cost.save(prefix + "mla_latents", tokens * (latent + dc + dr) * a)
    cost.save(prefix + "mla_latent_norm_out", tokens * (latent + dc) * a, up)
    cost.save(prefix + "qkv", tokens * n * (2 * dq + dv) * a / t, up)
    _core_attention(cost, model, shard, d_qk=dq, d_v=dv)
    cost.save(prefix + "attn_proj_in", tokens * n * dv * a / t)
    cost.linear(prefix + "o_proj", n * dv, h, tokens=tokens / t, split=True)


def _ffn(
    cost: BlockCost,
    model: ModelSpec,
    shard: Shard,
    *,
    name: str,
    width: int,
    tokens: float,
    modules: tuple[str, ...],
    act_modules: tuple[str, ...],
) -> None:
    """Saved tensors and FLOPs of fc1 (gate+up when gated) -> activation -> fc2 for ``tokens``
    tokens on this rank at ``width`` (already divided by tp where split)."""
    h, a = model.hidden_size, shard.act_bytes
    fc1_out = 2 * width if model.mlp == "swiglu" else width
    fc1 = 2.0 * tokens * h * fc1_out
    fc2 = 2.0 * tokens * width * h
    cost.fwd_flops += fc1 + fc2
    cost.bwd_input_flops += fc1 + fc2
    cost.bwd_weight_flops += fc1 + fc2
    for m in modules:  # checkpointing the MLP re-runs fc1 and the activation
        cost.module_flops[m] = cost.module_flops.get(m, 0.0) + fc1 + ELEMENTWISE * tokens * width
    for m in set(act_modules) - set(modules):  # output-discarding: only the activation
        cost.module_flops[m] = cost.module_flops.get(m, 0.0) + ELEMENTWISE * tokens * width
    cost.save(f"{name}_fc1_out", tokens * fc1_out * a, *modules)
    cost.save(f"{name}_act", tokens * width * a, *modules, *act_modules)


def _fc_params(model: ModelSpec, width: int) -> int:
    gate_up = 2 * width if model.mlp == "swiglu" else width
    bias = (gate_up + model.hidden_size) if model.linear_bias else 0
    return model.hidden_size * gate_up + width * model.hidden_size + bias


def _dense_mlp(cost: BlockCost, model: ModelSpec, shard: Shard, prefix: str) -> None:
    t = shard.tp
    cost.params.append(Param(prefix + "mlp", _fc_params(model, model.ffn_hidden_size), True))
    _ffn(
        cost,
        model,
        shard,
        name="mlp",
        width=model.ffn_hidden_size // t,
        tokens=shard.tokens,
        modules=("mlp",),
        act_modules=(),
    )


def _moe(cost: BlockCost, model: ModelSpec, shard: Shard, prefix: str) -> None:
    """Router (replicated) + routed experts (sharded over ep, not split over tp: expert tensor
    parallelism 1) + shared experts (split over tp like a dense MLP and reduced over the full
    data-parallel group, as Megatron-LM's SharedExpertMLP)."""
    h, e, k, a = model.hidden_size, model.num_experts, model.experts_per_token, shard.act_bytes
    sp = shard.sp_tokens
    start = cost.fwd_flops
    cost.params.append(Param(prefix + "router", e * h, tp_split=False))
    if model.router_expert_bias:
        cost.params.append(Param(prefix + "router_bias", e, False, trainable=False))
    router = 2.0 * sp * h * e
    cost.fwd_flops += router
    cost.bwd_input_flops += router
    cost.bwd_weight_flops += router
    cost.save(prefix + "router_scores", sp * e * ROUTER_SCORE_BYTES, "moe")
    # All experts of the layer as one tensor; a rank keeps e/ep of them (memory.py).
    cost.params.append(
        Param(
            prefix + "experts",
            e * _fc_params(model, model.moe_ffn_hidden_size),
            tp_split=False,
            expert=True,
            active=Fraction(k, e),
        )
    )
    # Each rank dispatches its sp tokens x k copies; balanced routing brings as many back,
    # the busiest rank moe_load_imbalance times that.
    copies = sp * k * shard.moe_load_imbalance
    cost.save(prefix + "moe_dispatched", copies * h * a, "moe")
    _ffn(
        cost,
        model,
        shard,
        name="moe",
        width=model.moe_ffn_hidden_size,
        tokens=copies,
        modules=("moe",),
        act_modules=("moe_act",),
    )
    # The experts' outputs stay for the backward of the probability-weighted combine.
    cost.save(prefix + "moe_expert_out", copies * h * a, "moe")
    if model.num_shared_experts:
        width = _shared_width(model)
        cost.params.append(Param(prefix + "shared_experts", _fc_params(model, width), True))
        _ffn(
            cost,
            model,
            shard,
            name="shared",
            width=width // shard.tp,
            tokens=shard.tokens,
            modules=("shared_experts", "moe"),
            act_modules=(),
        )
        if model.shared_expert_gate:
            cost.linear(prefix + "shared_gate", h, 1, tokens=sp, split=False)
            cost.save(prefix + "shared_gate_out", sp * a, "shared_experts", "moe")
    # "moe" re-runs the whole layer: router, experts and shared experts (normal checkpoint).
    cost.module_flops["moe"] = cost.fwd_flops - start
