"""torchtitan's model flavors at v0.2.2 as ``ModelSpec`` values, so that an export can check
that the flavor it names builds the planned model.

Sources, all at tag v0.2.2 (commit 73a0e697) of pytorch/torchtitan:
- ``torchtitan/models/llama3/__init__.py`` (``llama3_args``), ``model/args.py``
  (``TransformerModelArgs``: vocabulary 128256, norm_eps 1e-5; ``RoPEScalingArgs``: factor 8,
  low/high frequency factors 1 and 4, original context 8192), ``model/model.py``
  (``FeedForward``: width 4 * dim, two thirds of it, times ``ffn_dim_multiplier``, rounded up
  to ``multiple_of``; no biases, untied output);
- ``torchtitan/models/deepseek_v3/__init__.py`` (``deepseekv3_args``), ``model/args.py``
  (``DeepSeekV3ModelArgs``: norm_eps 1e-5, YaRN original 4096, theta 10000, factor 40, betas
  32 and 1, mscale 1), ``model/model.py`` (YaRN frequencies and the softmax mscale only when
  the sequence is longer than the original 4096, the mscale counted in the softmax alone; the
  final norm built without ``eps``: torch's default, the dtype's machine epsilon; layers from
  ``n_dense_layers`` on are MoE; no MTP);
- ``torchtitan/models/moe/moe.py`` (``MoEArgs``: a group scored by the sum of its best two
  experts; an expert bias buffer while ``load_balance_coeff`` is set, default 1e-3; sigmoid
  scores, not renormalised, top 1 and one shared expert by default);
- ``torchtitan/models/llama4/__init__.py`` (``llama4_args``), ``model/args.py``
  (``TransformerModelArgs``: vocabulary 202048, norm_eps 1e-5, MoE every second layer by
  default, chunks of 8192 tokens, ``RoPEScalingArgs`` factor 16, low and high frequency
  factors 1, original context 8192), ``model/model.py`` (the dense MLP as llama3's at 4 * dim;
  the experts' width the same divided by top-k + shared experts, rounded up to
  ``multiple_of``; layer i is MoE where (i + 1) % ``interleave_moe_layer_step`` is 0; with
  ``every_n_layers_nope`` layer i has no RoPE where i % n is 0, and the others attend within
  ``fixed_attn_block_size`` chunks; no q/k norm).
"""

from __future__ import annotations

import math
from typing import Any

from planner.specs import ModelSpec

LLAMA3_SCALING = (
    ("factor", 8.0),
    ("high_freq_factor", 4.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 8192.0),
    ("rope_type", "llama3"),
)
# flavor: (dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of, rope_theta)
LLAMA3 = {
    "8B": (4096, 32, 32, 8, 1.3, 1024, 500000.0),
    "70B": (8192, 80, 64, 8, 1.3, 4096, 500000.0),
    "405B": (16384, 126, 128, 8, 1.2, 4096, 500000.0),
}
# deepseekv3_args, in DeepSeekV3ModelArgs' and MoEArgs' own names (route_scale 1.0 and the
# absent groups are MoEArgs' defaults; q_lora_rank 0 is no query compression).
# fmt: off
DEEPSEEK_V3: dict[str, dict[str, Any]] = {
    "16B": dict(
        vocab_size=102400, dim=2048, inter_dim=10944, moe_inter_dim=1408, n_layers=27,
        n_dense_layers=1, n_heads=16, num_experts=64, num_shared_experts=2, top_k=6,
        num_expert_groups=None, num_limited_groups=None, score_func="softmax",
        route_norm=False, route_scale=1.0, q_lora_rank=0, mscale=0.70,
    ),
    "236B": dict(
        vocab_size=102400, dim=5120, inter_dim=12288, moe_inter_dim=1536, n_layers=60,
        n_dense_layers=1, n_heads=128, num_experts=160, num_shared_experts=2, top_k=6,
        num_expert_groups=8, num_limited_groups=3, score_func="softmax",
        route_norm=False, route_scale=16.0, q_lora_rank=1536, mscale=1.0,
    ),
    "671B": dict(
        vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61,
        n_dense_layers=3, n_heads=128, num_experts=256, num_shared_experts=1, top_k=8,
        num_expert_groups=8, num_limited_groups=4, score_func="sigmoid",
        route_norm=True, route_scale=2.5, q_lora_rank=1536, mscale=1.0,
    ),
}
# fmt: on
# llama4_args: flavor -> (experts, interleave_moe_layer_step, RoPE scaled, iRoPE)
LLAMA4 = {
    "17bx16e": (16, 1, True, False),
    "17bx128e": (128, 2, False, False),
    "17bx16e_irope": (16, 1, True, True),
    "17bx128e_irope": (128, 2, False, True),
}
# the flavors whose attention is FlexAttention (attn_type "flex"), which torchtitan v0.2.2's
# context parallelism refuses (TransformerModelArgs.update_from_config)
FLEX_FLAVORS = frozenset({("llama4", f) for f, (_, _, _, irope) in LLAMA4.items() if irope})
LLAMA4_SCALING = (
    ("factor", 16.0),
    ("high_freq_factor", 1.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 8192.0),
    ("rope_type", "llama3"),
)
YARN_ORIGINAL = 4096  # DeepSeekV3ModelArgs.original_seq_len
DEEPSEEK_QUIRK = (
    "torchtitan's DeepSeek-V3 final norm takes torch's default epsilon (the dtype's machine "
    "epsilon), not norm_eps"
)


def _llama3(flavor: str) -> dict[str, Any]:
    dim, layers, heads, kv, multiplier, multiple_of, theta = LLAMA3[flavor]
    ffn = int(multiplier * int(2 * 4 * dim / 3))
    return {
        "hidden_size": dim,
        "num_layers": layers,
        "vocab_size": 128256,
        "num_attention_heads": heads,
        "num_kv_heads": kv,
        "head_dim": dim // heads,
        "attention": "gqa",
        "mlp": "swiglu",
        "ffn_hidden_size": multiple_of * math.ceil(ffn / multiple_of),
        "tie_word_embeddings": False,
        "norm_eps": 1e-5,
        "rope_theta": theta,
        "rope_scaling": LLAMA3_SCALING,
    }


def _llama4(flavor: str) -> dict[str, Any]:
    experts, step, scaled, irope = LLAMA4[flavor]
    dim, layers, multiple_of = 5120, 48, 2048
    hidden = int(1.2 * int(2 * 4 * dim / 3))  # ffn_dim_multiplier 1.2
    moe = int(hidden / 2)  # top_k 1 + one shared expert
    moe += -moe % multiple_of
    fields: dict[str, Any] = {
        "hidden_size": dim,
        "num_layers": layers,
        "vocab_size": 202048,
        "num_attention_heads": 40,
        "num_kv_heads": 8,
        "head_dim": dim // 40,
        "attention": "gqa",
        "mlp": "swiglu",
        "ffn_hidden_size": multiple_of * math.ceil(hidden / multiple_of),
        "num_experts": experts,
        "experts_per_token": 1,
        "moe_ffn_hidden_size": moe,
        "num_shared_experts": 1,
        "shared_expert_ffn_hidden_size": moe,
        "router_expert_bias": True,  # load_balance_coeff 1e-3
        "moe_layers": tuple(i for i in range(layers) if (i + 1) % step == 0),
        "router_score": "sigmoid",
        "router_renormalize": False,
        "tie_word_embeddings": False,
        "norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA4_SCALING if scaled else (),
    }
    if irope:  # every_n_layers_nope 4, fixed_attn_block_size 8192
        nope = tuple(range(0, layers, 4))
        fields.update(
            nope_layers=nope,
            attention_chunk_size=8192,
            chunked_attention_layers=tuple(i for i in range(layers) if i not in nope),
        )
    return fields


def _deepseek_v3(flavor: str, seq_len: int) -> dict[str, Any]:
    a = DEEPSEEK_V3[flavor]
    yarn = (
        (
            ("beta_fast", 32.0),
            ("beta_slow", 1.0),
            ("factor", 40.0),
            ("mscale", a["mscale"]),
            ("mscale_all_dim", a["mscale"]),
            ("original_max_position_embeddings", float(YARN_ORIGINAL)),
            ("rope_type", "yarn"),
        )
        if seq_len > YARN_ORIGINAL
        else ()
    )
    groups = a["num_limited_groups"]
    return {
        "hidden_size": a["dim"],
        "num_layers": a["n_layers"],
        "vocab_size": a["vocab_size"],
        "num_attention_heads": a["n_heads"],
        "num_kv_heads": a["n_heads"],
        "head_dim": 128 + 64,  # qk_nope_head_dim + qk_rope_head_dim (the args' defaults)
        "attention": "mla",
        "q_lora_rank": a["q_lora_rank"] or None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mlp": "swiglu",
        "ffn_hidden_size": a["inter_dim"],
        "num_experts": a["num_experts"],
        "experts_per_token": a["top_k"],
        "moe_ffn_hidden_size": a["moe_inter_dim"],
        "num_shared_experts": a["num_shared_experts"],
        "shared_expert_ffn_hidden_size": a["moe_inter_dim"],
        "router_expert_bias": True,
        "expert_groups": a["num_expert_groups"] or 1,
        "groups_per_token": groups,
        "group_score_experts": 2 if groups else None,
        "first_dense_layers": a["n_dense_layers"],
        "tie_word_embeddings": False,
        "norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": yarn,
        "router_score": a["score_func"],
        "router_renormalize": a["route_norm"],
        "router_scale": a["route_scale"],
    }


def flavors(seq_len: int) -> dict[tuple[str, str], ModelSpec]:
    """Every llama3, llama4 and deepseek_v3 flavor as the model it builds at ``seq_len``."""
    out = {("llama3", f): ModelSpec(name=f"llama3 {f}", **_llama3(f)) for f in LLAMA3}
    for f in LLAMA4:
        out["llama4", f] = ModelSpec(name=f"llama4 {f}", **_llama4(f))
    for f in DEEPSEEK_V3:
        out["deepseek_v3", f] = ModelSpec(name=f"deepseek_v3 {f}", **_deepseek_v3(f, seq_len))
    return out


def mismatches(model: ModelSpec, flavor: ModelSpec) -> list[str]:
    """Each field where ``flavor`` builds another model than ``model`` (the name aside)."""
    out = [
        f"{name} {getattr(flavor, name)!r} (flavor) vs {getattr(model, name)!r} (model)"
        for name in ModelSpec.model_fields
        if name != "name" and getattr(flavor, name) != getattr(model, name)
    ]
    if flavor.attention == "mla":
        out.append(DEEPSEEK_QUIRK)
    return out
