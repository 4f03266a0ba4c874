"""Megatron-LM arguments that build exactly the planned model, and what they cannot state.

Megatron-LM's defaults build another model than most configs describe: LayerNorm, GeLU,
biases on every linear layer, learned positions, tied embeddings, dropout 0.1, a vocabulary
padded to a multiple of 128 x tp, softmax routing after top-k. Every architecture flag is
therefore stated, with its value from the ``ModelSpec``; a feature no flag reaches becomes a
difference (the export is then not exact).

Facts used, all at NVIDIA/Megatron-LM commit d98e8a64 (the parser the test suite lists):
- ``megatron/training/arguments.py``: ``--rotary-base`` is parsed as an int;
  ``--add-qkv-bias`` is forced on whenever linear biases are (``args.add_qkv_bias = True``);
  MLA takes ``--rotary-scaling-factor``, ``--mscale``, ``--mscale-all-dim`` only;
- ``megatron/core/transformer/transformer_config.py`` (``MLATransformerConfig``): MLA's YaRN
  ``original_max_position_embeddings`` 4096, ``beta_fast`` 32, ``beta_slow`` 1, with no flag
  (``megatron/training/argument_utils.py`` skips its ``yarn_*`` mapping for MLA);
- ``megatron/core/models/common/embeddings/rotary_pos_embedding.py`` ``_apply_scaling``:
  ``--use-rope-scaling`` is Llama 3.1's scaling with low/high frequency factors 1 and 4 and an
  original context of 8192, only the factor a flag;
- ``megatron/core/transformer/moe/moe_utils.py`` ``topk_routing_with_score_function``:
  softmax after top-k (default) renormalises, ``--moe-router-pre-softmax`` does not; sigmoid
  scores are always renormalised when top-k > 1; ``group_limited_topk`` scores a group by the
  sum of its best top-k / group-top-k experts;
- ``megatron/core/models/gpt/gpt_layer_specs.py``: MLA's latent norms (DeepSeek's
  ``q_a_layernorm`` / ``kv_a_layernorm``) exist only with ``--qk-layernorm``;
- ``megatron/core/tokenizers/utils/build_tokenizer.py``: ``--padded-vocab-size`` fixes the
  embedding rows (otherwise the tokenizer's size is padded); the embedding splits them over tp.
"""

from __future__ import annotations

import functools
import itertools

from planner.catalog import model_index
from planner.specs import ModelSpec

# Llama 3.1 scaling as Megatron-LM fixes it (rotary_pos_embedding.py _apply_scaling defaults).
LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192.0,
}
# MLA's YaRN constants without a flag (transformer_config.py MLATransformerConfig defaults).
MLA_YARN_FIXED = {"original_max_position_embeddings": 4096.0, "beta_fast": 32.0, "beta_slow": 1.0}
# YaRN keys absent from a config take transformers' defaults (modeling_rope_utils.py
# _compute_yarn_parameters: beta_fast 32, beta_slow 1; get_mscale's mscale 1, all-dim 0).
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
# The ModelSpec fields stated (or reported) below.
# fmt: off
HANDLED = frozenset({
    "name", "hidden_size", "num_layers", "vocab_size", "num_attention_heads", "num_kv_heads",
    "head_dim", "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "mlp", "ffn_hidden_size", "num_experts",
    "experts_per_token", "moe_ffn_hidden_size", "num_shared_experts",
    "shared_expert_ffn_hidden_size", "shared_expert_gate", "router_expert_bias",
    "expert_groups", "groups_per_token", "first_dense_layers", "moe_layer_freq", "norm",
    "qkv_bias", "linear_bias", "tie_word_embeddings", "learned_positions", "num_mtp_layers",
    "attention_dropout", "hidden_dropout", "rope_theta", "rope_scaling", "norm_eps",
    "router_score", "router_renormalize", "router_scale", "group_score_experts", "o_proj_bias",
    "mlp_bias", "router_bias", "qk_norm", "attention_sinks", "sliding_window",
    "sliding_window_layers", "swiglu_limit", "post_norms", "norm_zero_centered",
    "rotary_percent", "nope_layers", "qk_l2_norm", "attention_chunk_size",
    "chunked_attention_layers", "moe_layers", "final_logit_softcap", "attention_logit_softcap",
})
# fmt: on


def model_args(model: ModelSpec, *, tp: int, seq_len: int) -> tuple[list[str], list[str]]:
    """The arguments that build ``model`` split over ``tp`` ranks, and what they cannot state."""
    args = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size)]
    args += ["--num-attention-heads", str(model.num_attention_heads)]
    args += ["--ffn-hidden-size", str(model.ffn_hidden_size)]
    differences: list[str] = []
    args += _attention(model, differences)
    if model.swiglu_limit is not None:
        # gpt-oss: quick-GeLU gate x (up + 1), both clamped (Megatron-LM arguments.py:
        # --quick-geglu, --glu-linear-offset, --activation-func-clamp-value)
        args += ["--quick-geglu", "--glu-linear-offset", "1.0"]
        args += ["--activation-func-clamp-value", repr(model.swiglu_limit)]
    elif model.mlp == "swiglu":
        args += ["--swiglu"]  # else Megatron's GeLU (F.gelu)
    elif model.mlp == "relu2":
        args += ["--squared-relu"]
    elif model.mlp == "geglu":
        args += ["--swiglu"]
        differences.append(
            "GeGLU (gated tanh GeLU): Megatron-LM's arguments gate by SiLU only; builds SwiGLU "
            "(the same shapes and cost)"
        )
    args += ["--normalization", "RMSNorm" if model.norm == "rmsnorm" else "LayerNorm"]
    if model.norm_zero_centered:  # weights stored about zero, scaled by 1 + w
        args += ["--apply-layernorm-1p"]
    differences += _unstated_layers(model)
    if model.norm_eps is None:
        differences.append("norm epsilon not recorded in the model; Megatron-LM uses 1e-5")
    else:
        args += ["--norm-epsilon", repr(model.norm_eps)]
    args += _biases(model, differences)
    args += _positions(model, seq_len, differences)
    args += _vocabulary(model, tp, differences)
    if not model.tie_word_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    args += ["--attention-dropout", repr(model.attention_dropout)]
    args += ["--hidden-dropout", repr(model.hidden_dropout)]
    if model.num_experts:
        args += _moe(model, differences)
    if model.num_mtp_layers:
        args += ["--mtp-num-layers", str(model.num_mtp_layers)]
    differences += _unknown_features(model)
    return args, [f"model: {d}" for d in differences]


def _attention(model: ModelSpec, differences: list[str]) -> list[str]:
    if model.attention != "mla":
        args = ["--kv-channels", str(model.head_dim)]
        if model.attention == "gqa":
            args += ["--group-query-attention", "--num-query-groups", str(model.num_kv_heads)]
        args += ["--qk-layernorm"] if model.qk_norm else []
        args += ["--qk-l2-norm"] if model.qk_l2_norm else []  # Llama 4's, on the RoPE layers
        return [*args, *_sinks_and_windows(model)]
    if model.qk_norm:
        differences.append("per-head q/k norms with MLA: Megatron-LM's MLA has none")
    args = ["--multi-latent-attention"]
    if model.q_lora_rank:
        args += ["--q-lora-rank", str(model.q_lora_rank)]
    args += ["--kv-lora-rank", str(model.kv_lora_rank)]
    args += ["--qk-head-dim", str(model.qk_nope_head_dim)]
    args += ["--qk-pos-emb-head-dim", str(model.qk_rope_head_dim)]
    args += ["--v-head-dim", str(model.v_head_dim)]
    return [*args, "--qk-layernorm", *_sinks_and_windows(model)]  # the latent norms


def _sinks_and_windows(model: ModelSpec) -> list[str]:
    """Sink logits (the ``learnable`` softmax offset) and windows (``is_layer_window_attention``
    in transformer/utils.py: a window (left, right) of keys, a 1 in the per-layer list marking
    a windowed layer). Per-head q/k norms are ``--qk-layernorm`` (gpt_layer_specs.py)."""
    args: list[str] = []
    if model.attention_sinks:
        args += ["--softmax-type", "learnable"]
    if model.sliding_window is not None:  # the window counts the query itself
        args += ["--window-size", f"{model.sliding_window - 1},0"]
        if model.sliding_window_layers is not None:
            windowed = set(model.sliding_window_layers)
            flags = [int(i in windowed) for i in range(model.num_layers)]
            args += ["--window-attn-skip-freq", _pattern(flags)]
    return args


def _unstated_layers(model: ModelSpec) -> list[str]:
    """Layer features no Megatron-LM argument states: what the export cannot build."""
    out = []
    if model.post_norms:
        out.append("norms after the attention and the MLP (Gemma's): no argument; builds none")
    if model.attention_chunk_size is not None:
        out.append(
            f"chunked attention ({model.attention_chunk_size} tokens): no argument; builds "
            "full causal attention on those layers"
        )
    for cap, what in (
        (model.final_logit_softcap, "logits"),
        (model.attention_logit_softcap, "attention scores"),
    ):
        if cap is not None:
            out.append(f"soft cap {cap} on the {what}: no argument; builds none")
    return out


def _biases(model: ModelSpec, differences: list[str]) -> list[str]:
    """Megatron-LM has two bias switches: every linear layer (q/k/v, attention output, MLP and
    experts, router: its default) or q/k/v alone (``--add-qkv-bias``)."""
    has = {
        "q/k/v": model.qkv_bias,
        "attention output": model.linear_bias or model.o_proj_bias,
        "MLP": model.linear_bias or model.mlp_bias,
    }
    if model.num_experts:
        has["router"] = model.router_bias
    if all(has.values()):
        return []
    if not any(on for part, on in has.items() if part != "q/k/v"):
        return ["--disable-bias-linear", *(["--add-qkv-bias"] if model.qkv_bias else [])]
    differences.append(
        f"biases on {', '.join(p for p, on in has.items() if on)} only: Megatron-LM biases "
        f"all of {', '.join(has)} or q/k/v alone; builds them on all"
    )
    return []


def _positions(model: ModelSpec, seq_len: int, differences: list[str]) -> list[str]:
    if model.learned_positions:
        rows = str(model.learned_positions)
        return ["--position-embedding-type", "learned_absolute", "--max-position-embeddings", rows]
    scaling = dict(model.rope_scaling)
    kind = scaling.pop("rope_type", None)
    factor = scaling.pop("factor", None)
    mla = model.attention == "mla"  # MLA builds its own rotary embedding (--rope-type)
    kind = kind if kind is None or factor is not None else "(no factor)"
    args = ["--position-embedding-type", "yarn" if kind == "yarn" and not mla else "rope"]
    args += ["--max-position-embeddings", str(seq_len)]
    if model.rotary_percent != 1.0:
        args += ["--rotary-percent", repr(model.rotary_percent)]
    if model.nope_layers is not None:  # a 1 marks a layer without RoPE (arguments.py)
        nope = set(model.nope_layers)
        args += ["--no-rope-freq", _pattern([int(i in nope) for i in range(model.num_layers)])]
    if model.rope_theta is None:
        differences.append("RoPE base not recorded in the model; Megatron-LM uses 10000")
    else:
        if model.rope_theta != int(model.rope_theta):
            differences.append(
                f"RoPE base {model.rope_theta}: Megatron-LM's --rotary-base takes an integer; "
                f"builds {int(model.rope_theta)}"
            )
        args += ["--rotary-base", str(int(model.rope_theta))]
    if kind == "llama3" and not mla:
        rest = {k: scaling.get(k) for k in LLAMA3_FIXED}
        if rest != LLAMA3_FIXED or set(scaling) - set(LLAMA3_FIXED):
            differences.append(
                f"Llama 3 RoPE scaling {dict(model.rope_scaling)}: Megatron-LM fixes "
                f"{LLAMA3_FIXED} and takes only the factor"
            )
        return [*args, "--use-rope-scaling", "--rope-scaling-factor", repr(factor)]
    if kind == "yarn":
        return args + _yarn(model, factor, scaling, differences)
    if kind is not None:
        differences.append(
            f"RoPE scaling {kind!r} {dict(model.rope_scaling)}: no Megatron-LM flag states it; "
            "builds unscaled RoPE"
        )
    return args + (["--rope-type", "rope"] if mla else [])


def _yarn(
    model: ModelSpec, factor: object, scaling: dict[str, str | float], differences: list[str]
) -> list[str]:
    values = {**YARN_DEFAULTS, **scaling}
    # transformers' truncate (default true) rounds the correction range to whole dimensions,
    # as Megatron-LM's yarn_correction_range_round_to_int (default true)
    rounded = values.pop("truncate", 1.0) != 0.0
    extra = set(values) - set(YARN_DEFAULTS) - {"original_max_position_embeddings"}
    if extra:
        differences.append(f"YaRN keys {sorted(extra)}: no Megatron-LM flag states them")
    args = ["--rotary-scaling-factor", repr(factor)]
    args += ["--mscale", repr(values["mscale"]), "--mscale-all-dim", repr(values["mscale_all_dim"])]
    if model.attention == "mla":
        fixed = {k: values.get(k) for k in MLA_YARN_FIXED}
        if fixed != MLA_YARN_FIXED or not rounded:
            differences.append(
                f"YaRN {fixed}, rounded {rounded}, with MLA: Megatron-LM fixes "
                f"{MLA_YARN_FIXED} and rounds"
            )
        return ["--rope-type", "yarn", *args]
    if not rounded:
        args.append("--no-yarn-correction-range-round-to-int")
    original = values.get("original_max_position_embeddings")
    if original is None:
        differences.append("YaRN original context not recorded in the model; Megatron uses 4096")
        original = 4096.0
    return [
        *args,
        "--yarn-original-max-position-embeddings",
        str(int(float(original))),
        "--yarn-beta-fast",
        repr(values["beta_fast"]),
        "--yarn-beta-slow",
        repr(values["beta_slow"]),
    ]


def _vocabulary(model: ModelSpec, tp: int, differences: list[str]) -> list[str]:
    """The tokenizer, and the embedding's rows fixed at the model's vocabulary."""
    rows = model.vocab_size
    if rows % tp:
        rows += tp - rows % tp
        differences.append(
            f"vocabulary {model.vocab_size}: Megatron-LM splits the embedding over tp={tp} "
            f"ranks evenly; builds {rows} rows"
        )
    repo = hf_repo(model.name)
    tokenizer = (
        ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", repo]
        if repo
        else ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(model.vocab_size)]
    )
    return [*tokenizer, "--padded-vocab-size", str(rows)]


def _moe(model: ModelSpec, differences: list[str]) -> list[str]:
    k = model.experts_per_token
    args = ["--num-experts", str(model.num_experts), "--moe-router-topk", str(k)]
    args += ["--moe-ffn-hidden-size", str(model.moe_ffn_hidden_size)]
    args += ["--moe-layer-freq", layer_freq(model)]
    if model.num_shared_experts:
        width = model.num_shared_experts * model.shared_expert_ffn_hidden_size
        args += ["--moe-shared-expert-intermediate-size", str(width)]
        if model.shared_expert_gate:
            args.append("--moe-shared-expert-gate")
    args += _router(model, differences)
    if model.router_scale != 1.0:
        args += ["--moe-router-topk-scaling-factor", repr(model.router_scale)]
    if model.router_expert_bias:
        if model.router_score != "sigmoid":
            differences.append("expert bias with softmax routing: Megatron-LM needs sigmoid")
        args.append("--moe-router-enable-expert-bias")
    if model.groups_per_token is not None and model.groups_per_token < model.expert_groups:
        args += ["--moe-router-num-groups", str(model.expert_groups)]
        args += ["--moe-router-group-topk", str(model.groups_per_token)]
        summed = k // model.groups_per_token
        if model.group_score_experts != summed:
            differences.append(
                f"group score from the best {model.group_score_experts or '(not recorded)'} "
                f"expert(s) of a group: Megatron-LM sums the best top-k / group-top-k = {summed}"
            )
    return [*args, "--moe-grouped-gemm"]


def _router(model: ModelSpec, differences: list[str]) -> list[str]:
    score, renorm, k = model.router_score, model.router_renormalize, model.experts_per_token
    if score is None or renorm is None:
        differences.append(
            "router score function or renormalisation not recorded in the model; Megatron-LM "
            "renormalises a softmax over the chosen experts"
        )
        return []
    args = ["--moe-router-score-function", score]
    if score == "sigmoid":
        if not renorm and k > 1:
            differences.append(
                "sigmoid routing without renormalisation: Megatron-LM always renormalises"
            )
        return args
    if renorm and k == 1:
        differences.append(
            "softmax top-1 renormalised (every weight 1): Megatron-LM refuses it; builds "
            "--moe-router-pre-softmax"
        )
    return args + (["--moe-router-pre-softmax"] if not renorm or k == 1 else [])


def layer_freq(model: ModelSpec) -> str:
    """Megatron's list form of which layers are MoE, e.g. ([0]*3+[1]*58)."""
    return _pattern([int(model.is_moe_layer(i)) for i in range(model.num_layers)])


def _pattern(flags: list[int]) -> str:
    """A per-layer 0/1 list in the pattern form Megatron-LM's parser evaluates."""
    return "(" + "+".join(f"[{f}]*{len(list(g))}" for f, g in itertools.groupby(flags)) + ")"


def _unknown_features(model: ModelSpec) -> list[str]:
    """Fields away from their default that this module does not state: a feature added to
    ``ModelSpec`` after it, reported rather than silently dropped."""
    return [
        f"ModelSpec.{name}={getattr(model, name)!r}: not stated by the Megatron-LM export"
        for name, field in ModelSpec.model_fields.items()
        if name not in HANDLED
        and getattr(model, name) != field.get_default(call_default_factory=True)
    ]


@functools.lru_cache(maxsize=1)
def _catalog_sources() -> dict[str, str]:
    return {k: str(v.get("source", "")) for k, v in model_index().items()}


def hf_repo(name: str) -> str | None:
    """The Hugging Face repository a catalog model's config came from (its tokenizer), or
    None (a model from elsewhere, or a synthetic config)."""
    source = _catalog_sources().get(name, "")
    prefix = "https://huggingface.co/"
    if not source.startswith(prefix):
        return None
    owner_repo = source.removeprefix(prefix).split("/")[:2]
    return "/".join(owner_repo) if len(owner_repo) == 2 else None
