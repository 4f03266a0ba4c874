"""Hugging Face ``config.json`` formats: one reader per ``model_type``, each turning a config
into ``ModelSpec`` fields, and the fields that would change the cost refused where a reader
does not cost them (``model_from_config``).

Reads the Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, DeepSeek-V2/V3, Kimi K2,
gpt-oss, GPT-2, GPT-NeoX, Phi-3/Phi-4, Nemotron, Gemma 2, Gemma 3, GLM-4.5 (glm4_moe) and Llama 4
formats. A multimodal config (Gemma 3's gemma3, Llama 4's llama4) is read for its language model,
its ``text_config``: the vision tower is not costed (it is not trained with the language model
in the jobs planned here, and its parameters are left out of every count).
"""

from __future__ import annotations

import json
from typing import Any

from planner.errors import PlannerError
from planner.specs import ModelSpec


def model_from_config(cfg: dict[str, Any], *, name: str) -> ModelSpec:
    """Normalise a Hugging Face ``config.json`` (or ``ModelSpec`` fields) into a ``ModelSpec``.

    Fields are read per ``model_type`` (each reader's docstring lists its rules). A field
    that changes parameters, FLOPs or memory in some Hugging Face family (``_COST_FIELDS``)
    and that the reader does not cost is refused when its value is not inert (null, false,
    0, empty, or all layers ``full_attention``), never ignored. Fields that change no cost
    are harmless and pass: ``rope_theta``/``rope_scaling`` (position encoding), norm epsilons,
    ``max_position_embeddings`` (the job's ``seq_len`` is what is costed),
    ``quantization_config`` and ``torch_dtype`` (how the checkpoint is stored; the job's
    dtypes are costed), token ids, ``initializer_range``, ``use_cache``, router loss
    coefficients, ``architectures``, ``auto_map``, ``transformers_version``."""
    if "model_type" not in cfg and "attention" in cfg:
        return ModelSpec(**cfg)
    kind = cfg.get("model_type")
    if kind in _TEXT_MODEL:  # a multimodal config: its language model's own config
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise PlannerError(
                f"model config {name}: model_type={kind!r} needs a text_config object (the "
                "language model's config)"
            )
        kind = _TEXT_MODEL[str(kind)]
        cfg = {**text, "model_type": kind}
    reader = _READERS.get(str(kind))
    if reader is None:
        raise PlannerError(
            f"model config {name}: model_type={kind!r} is not supported; supported: "
            f"{', '.join(sorted(_READERS))}"
        )
    for field in _WHOLE_FIELDS.intersection(cfg):
        value = cfg[field]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise PlannerError(
                f"model config {name}: {field}={json.dumps(value)} must be a whole number "
                "(a JSON number, not a string)"
            )
    for field in _REAL_FIELDS.intersection(cfg):
        value = cfg[field]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise PlannerError(
                f"model config {name}: {field}={json.dumps(value)} must be a number "
                "(a JSON number, not a string)"
            )
    try:
        fields = reader(cfg)
        _refuse_uncosted(cfg, _COSTED.get(str(kind), frozenset()), str(kind))
    except KeyError as exc:
        raise PlannerError(
            f"model config {name}: missing key {exc.args[0]!r} (required for model_type {kind})"
        ) from None
    except _Refused as exc:
        raise PlannerError(
            f"model config {name}: {exc.field}={json.dumps(exc.value)} is not supported "
            f"({exc.rule})"
        ) from None
    return ModelSpec(name=name, **fields)


class _Refused(Exception):
    """A config field whose value changes the cost in a way the reader does not cost."""

    def __init__(self, field: str, value: Any, rule: str) -> None:
        super().__init__(field)
        self.field, self.value, self.rule = field, value, rule


# Fields that change parameters, FLOPs or saved activations in some Hugging Face family,
# with what they change. A reader lists those it costs in ``_COSTED``.
_COST_FIELDS = {
    "sliding_window": "attention to a window of keys",
    "use_sliding_window": "attention to a window of keys",
    "layer_types": "attention to a window of keys in some layers",
    "sliding_window_pattern": "attention to a window of keys in some layers",
    "attention_chunk_size": "attention within chunks of keys",
    "attention_bias": "biases on the attention projections",
    "mlp_bias": "biases on the MLP projections",
    "qk_layernorm": "norms on queries and keys",
    "use_qk_norm": "norms on queries and keys",
    "num_local_experts": "routed experts",
    "num_experts": "routed experts",
    "n_routed_experts": "routed experts",
    "n_shared_experts": "shared experts",
    "shared_expert_intermediate_size": "shared experts",
    "decoder_sparse_step": "which layers are MoE",
    "mlp_only_layers": "which layers are MoE",
    "first_k_dense_replace": "which layers are MoE",
    "moe_layer_freq": "which layers are MoE",
    "q_lora_rank": "latent attention",
    "kv_lora_rank": "latent attention",
    "num_nextn_predict_layers": "multi-token-prediction modules",
    "final_logit_softcapping": "a tanh soft cap on the logits",
    "attn_logit_softcapping": "a tanh soft cap on the attention scores",
    "partial_rotary_factor": "a rotary embedding over part of each head",
    "no_rope_layers": "layers without a rotary embedding",
    "interleave_moe_layer_step": "which layers are MoE",
    "moe_layers": "which layers are MoE",
}


# Fields the readers take as counts (widths, layers, heads, experts) and as rates or
# factors: what a config states as anything else (a string "4096") is refused by name.
_WHOLE_FIELDS = frozenset(
    {
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "vocab_size", "head_dim", "moe_intermediate_size",
        "shared_expert_intermediate_size", "num_experts", "num_local_experts",
        "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "experts_per_token",
        "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step", "n_group",
        "topk_group", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
        "v_head_dim", "num_nextn_predict_layers", "sliding_window", "n_embd", "n_head",
        "n_inner", "n_layer", "n_positions",
    }
)  # fmt: skip
_REAL_FIELDS = frozenset(
    {
        "attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop", "rms_norm_eps",
        "layer_norm_eps", "layer_norm_epsilon", "rope_theta", "routed_scaling_factor",
        "swiglu_limit",
    }
)  # fmt: skip


def _inert(field: str, value: Any) -> bool:
    """Whether ``value`` leaves the cost as the plain field's absence would."""
    if value is None or value is False or value == 0 or value == [] or value == {}:
        return True
    if field in ("decoder_sparse_step", "moe_layer_freq", "interleave_moe_layer_step"):
        return bool(value == 1)
    if field == "partial_rotary_factor":
        return bool(value == 1)
    if field == "no_rope_layers" and isinstance(value, list):
        return all(v == 1 for v in value)  # 1: the layer has RoPE (Llama4TextConfig)
    if field == "layer_types" and isinstance(value, list):
        return all(t == "full_attention" for t in value)
    return False


def _refuse_uncosted(cfg: dict[str, Any], costed: frozenset[str], kind: str) -> None:
    for field, what in _COST_FIELDS.items():
        if field in cfg and field not in costed and not _inert(field, cfg[field]):
            raise _Refused(field, cfg[field], f"{what}; the {kind} reader does not cost it")


def _llama(cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama: GQA, SwiGLU, RMSNorm. Costed: ``attention_bias`` (biases on q, k, v and o, as
    transformers' LlamaAttention), ``mlp_bias`` (on gate, up and down, LlamaMLP), ``head_dim``.
    Refused: ``sliding_window`` and every other ``_COST_FIELDS`` entry (LlamaAttention has no
    window)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    attention_bias = bool(cfg.get("attention_bias", False))
    return {
        "hidden_size": h,
        "num_layers": cfg["num_hidden_layers"],
        "vocab_size": cfg["vocab_size"],
        "num_attention_heads": heads,
        "num_kv_heads": kv,
        "head_dim": cfg.get("head_dim") or h // heads,
        "attention": "mha" if kv == heads else "gqa",
        "mlp": "swiglu",
        "ffn_hidden_size": cfg["intermediate_size"],
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "attention_dropout": float(cfg.get("attention_dropout", 0.0) or 0.0),
        "norm_eps": cfg.get("rms_norm_eps"),
        **_rope(cfg),
        "qkv_bias": attention_bias,
        "o_proj_bias": attention_bias,
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
    }


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """RoPE base and scaling as the config states them. Older files name the scaling kind
    'type', newer ones 'rope_type' (transformers' modeling_rope_utils reads either)."""
    scaling = dict(cfg.get("rope_scaling") or {})
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    pairs = (
        (k, v if isinstance(v, str) else float(v) if isinstance(v, int | float) else str(v))
        for k, v in scaling.items()
        if v is not None
    )
    return {"rope_theta": cfg.get("rope_theta"), "rope_scaling": tuple(sorted(pairs))}


def _mixtral(cfg: dict[str, Any]) -> dict[str, Any]:
    """Mixtral: Mistral's attention with routed SwiGLU experts. Costed: ``sliding_window`` on
    every layer (``_mistral``). Refused: biases (MixtralAttention and its experts have none,
    whatever the config says)."""
    fields = _llama({**cfg, "attention_bias": False, "mlp_bias": False})
    fields.update(_window(cfg))
    fields.update(
        num_experts=cfg["num_local_experts"],
        experts_per_token=cfg["num_experts_per_tok"],
        moe_ffn_hidden_size=cfg["intermediate_size"],
        # transformers' MixtralSparseMoeBlock: softmax over all experts, top-k, the k
        # weights divided by their sum
        router_score="softmax",
        router_renormalize=True,
    )
    return fields


def _qwen2_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE: ``_qwen2``'s attention, routed experts and one gated shared expert. Refused:
    ``decoder_sparse_step`` other than 1 and a non-empty ``mlp_only_layers`` (dense layers
    between MoE ones), ``use_sliding_window`` true (``_qwen_window``)."""
    fields = _llama({**cfg, "attention_bias": False, "mlp_bias": False})
    _qwen_window(cfg)
    _every_layer_moe(cfg)
    shared = cfg.get("shared_expert_intermediate_size", 0)
    fields.update(
        qkv_bias=True,  # Qwen2 attention has biases on q, k and v (not on o)
        num_experts=cfg["num_experts"],
        experts_per_token=cfg["num_experts_per_tok"],
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        num_shared_experts=1 if shared else 0,
        shared_expert_ffn_hidden_size=shared,
        shared_expert_gate=bool(shared),
        # transformers' Qwen2MoeSparseMoeBlock: softmax, top-k, renormalised only with
        # norm_topk_prob (Qwen2MoeConfig default False)
        router_score="softmax",
        router_renormalize=bool(cfg.get("norm_topk_prob", False)),
    )
    return fields


def _deepseek(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3 and Kimi K2: MLA, dense then MoE layers, shared experts. Costed: the MLA
    ranks, ``n_routed_experts``, ``n_shared_experts``, ``first_k_dense_replace``,
    ``moe_layer_freq``, ``num_nextn_predict_layers`` (MTP modules). Harmless: the routing
    rule's fields (``scoring_func``, ``topk_method``, ``n_group``/``topk_group``, scaling).
    Refused: ``attention_bias`` true (biases on the MLA projections are not costed)."""
    heads = cfg["num_attention_heads"]
    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    return {
        "hidden_size": cfg["hidden_size"],
        "num_layers": cfg["num_hidden_layers"],
        "vocab_size": cfg["vocab_size"],
        "num_attention_heads": heads,
        "num_kv_heads": heads,
        "head_dim": nope + rope,
        "attention": "mla",
        "q_lora_rank": cfg.get("q_lora_rank"),
        "kv_lora_rank": cfg["kv_lora_rank"],
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": cfg["v_head_dim"],
        "mlp": "swiglu",
        "ffn_hidden_size": cfg["intermediate_size"],
        "num_experts": cfg.get("n_routed_experts") or 0,
        "experts_per_token": cfg.get("num_experts_per_tok") or 0,
        "moe_ffn_hidden_size": cfg.get("moe_intermediate_size") or 0,
        "num_shared_experts": cfg.get("n_shared_experts") or 0,
        "shared_expert_ffn_hidden_size": cfg.get("moe_intermediate_size") or 0,
        # noaux_tc routing keeps a per-expert bias buffer (e_score_correction_bias)
        "router_expert_bias": cfg.get("topk_method") == "noaux_tc",
        # Group-limited routing: experts in n_group groups, each token within topk_group.
        "expert_groups": cfg.get("n_group") or 1,
        "groups_per_token": cfg.get("topk_group")
        if cfg.get("topk_method") in ("noaux_tc", "group_limited_greedy")
        else None,
        "first_dense_layers": cfg.get("first_k_dense_replace", 0),
        "moe_layer_freq": cfg.get("moe_layer_freq", 1),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "num_mtp_layers": cfg.get("num_nextn_predict_layers", 0) or 0,
        "attention_dropout": float(cfg.get("attention_dropout", 0.0) or 0.0),
        "norm_eps": cfg.get("rms_norm_eps"),
        **_rope(cfg),
        **(_deepseek_router(cfg) if cfg.get("n_routed_experts") else {}),
    }


def _deepseek_router(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's MoEGate (modeling_deepseek.py of the DeepSeek-V2/V3 Hub repos): scoring_func
    over the experts, a group scored by its best expert (group_limited_greedy) or the sum of
    its best two (noaux_tc), norm_topk_prob, routed_scaling_factor."""
    groups = {"noaux_tc": 2, "group_limited_greedy": 1}.get(str(cfg.get("topk_method")))
    return {
        "router_score": cfg.get("scoring_func"),
        "router_renormalize": cfg.get("norm_topk_prob"),
        "router_scale": float(cfg.get("routed_scaling_factor") or 1.0),
        "group_score_experts": groups if cfg.get("topk_group") else None,
    }


def _gpt_style(h: int, heads: int, **rest: Any) -> dict[str, Any]:
    """GPT-2/3 and GPT-NeoX: multi-head attention, GeLU MLP, LayerNorm, biases everywhere."""
    return {
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_kv_heads": heads,
        "head_dim": h // heads,
        "attention": "mha",
        "mlp": "gelu",
        "norm": "layernorm",
        "qkv_bias": True,
        "linear_bias": True,
        **rest,
    }


def _gpt2(cfg: dict[str, Any]) -> dict[str, Any]:
    act = cfg.get("activation_function", "gelu_new")
    if "gelu" not in act:
        raise PlannerError(f"model config: activation_function={act!r}: only GeLU is supported")
    return _gpt_style(
        cfg["n_embd"],
        cfg["n_head"],
        num_layers=cfg["n_layer"],
        vocab_size=cfg["vocab_size"],
        ffn_hidden_size=cfg.get("n_inner") or 4 * cfg["n_embd"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        learned_positions=cfg["n_positions"],
        attention_dropout=float(cfg.get("attn_pdrop", 0.1)),
        hidden_dropout=float(cfg.get("resid_pdrop", 0.1)),
        norm_eps=cfg.get("layer_norm_epsilon"),
    )


def _gpt_neox(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-NeoX. Costed: ``attention_bias`` (GPTNeoXConfig default true: biases on the fused
    qkv and the output projection; the MLP's biases are always there)."""
    attention_bias = bool(cfg.get("attention_bias", True))
    return _gpt_style(
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        num_layers=cfg["num_hidden_layers"],
        vocab_size=cfg["vocab_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        hidden_dropout=float(cfg.get("hidden_dropout", 0.0) or 0.0),
        norm_eps=cfg.get("layer_norm_eps"),
        qkv_bias=attention_bias,
        linear_bias=attention_bias,
        mlp_bias=True,
    )


def _window(cfg: dict[str, Any]) -> dict[str, Any]:
    """``sliding_window`` on every layer, as transformers' MistralAttention and
    MixtralAttention apply it (null: full attention)."""
    window = cfg.get("sliding_window")
    if window is None:
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise _Refused("sliding_window", window, "must be a positive whole number of tokens")
    return {"sliding_window": window}


def _mistral(cfg: dict[str, Any]) -> dict[str, Any]:
    """Mistral: Llama's shape with a sliding window. Costed: ``sliding_window`` on every layer
    (a query attends to itself and the window-1 tokens before it; Mistral 7B paper, arXiv
    2310.06825, section 2). Refused: biases (MistralAttention and MistralMLP have none,
    whatever the config says), ``layer_types`` with windowed layers."""
    fields = _llama({**cfg, "attention_bias": False, "mlp_bias": False})
    fields.update(_window(cfg))
    return fields


def _qwen_window(cfg: dict[str, Any]) -> None:
    """Qwen2/Qwen3 configs carry ``sliding_window`` and ``max_window_layers``, which act only
    with ``use_sliding_window`` true (false in every released config). Which layers then get
    the window is read two ways: the config docstring says the bottom ``max_window_layers``,
    the modeling code the layers from ``max_window_layers`` on (transformers issue #35896),
    so a true ``use_sliding_window`` is refused rather than costed one of the two ways."""
    if cfg.get("use_sliding_window"):
        rule = (
            "which layers get the window depends on max_window_layers, which transformers "
            "reads two ways (issue #35896); set it false"
        )
        raise _Refused("use_sliding_window", cfg["use_sliding_window"], rule)


def _every_layer_moe(cfg: dict[str, Any]) -> None:
    """Qwen MoE layer placement: layer i is MoE when (i+1) % decoder_sparse_step == 0 and i
    is not in ``mlp_only_layers``; only every layer MoE is represented."""
    step = cfg.get("decoder_sparse_step", 1)
    if step != 1:
        raise _Refused("decoder_sparse_step", step, "only 1, every layer MoE, is costed")
    if cfg.get("mlp_only_layers"):
        only = cfg["mlp_only_layers"]
        raise _Refused("mlp_only_layers", only, "only [], every layer MoE, is costed")


def _qwen2(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2 and Qwen2.5 (dense): Llama's shape with biases on q, k and v, not on o
    (transformers' Qwen2Attention; the model cards: "Attention QKV bias"). Harmless:
    ``sliding_window``, ``max_window_layers`` while ``use_sliding_window`` is false. Refused:
    ``use_sliding_window`` true (``_qwen_window``), ``attention_bias``/``mlp_bias`` true (the
    modeling code does not read them)."""
    _qwen_window(cfg)
    fields = _llama({**cfg, "attention_bias": False, "mlp_bias": False})
    fields.update(qkv_bias=True)
    return fields


def _qwen3(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3 (dense): Llama's shape with an RMSNorm over each head's query and key (q_norm,
    k_norm of head_dim weights; transformers' Qwen3Attention). Costed: ``attention_bias``
    (on q, k, v and o), ``head_dim``. Harmless and refused as ``_qwen2``."""
    _qwen_window(cfg)
    fields = _llama({**cfg, "mlp_bias": False})
    fields.update(qk_norm=True)
    return fields


def _qwen3_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE: ``_qwen3``'s attention; every layer routes to ``num_experts_per_tok`` of
    ``num_experts`` SwiGLU experts of ``moe_intermediate_size``, with no shared expert and a
    bias-free router (transformers' Qwen3MoeSparseMoeBlock: softmax, top-k, renormalised
    with ``norm_topk_prob``). Refused: as ``_qwen2_moe``."""
    fields = _qwen3(cfg)
    _every_layer_moe(cfg)
    fields.update(
        num_experts=cfg["num_experts"],
        experts_per_token=cfg["num_experts_per_tok"],
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        router_score="softmax",
        router_renormalize=bool(cfg.get("norm_topk_prob", False)),
    )
    return fields


def _gpt_oss(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss (transformers' GptOss modeling; OpenAI's gpt-oss model card, arXiv 2508.10925):
    GQA with biases on q, k, v and o (``attention_bias``) and a learned sink logit per head;
    ``layer_types`` alternate a window of ``sliding_window`` keys and full attention
    (GptOssConfig's default when absent: sliding first); every layer routes to
    ``num_experts_per_tok`` of ``num_local_experts`` gated experts of ``intermediate_size``,
    with biases on the experts' projections and on the router, and a clamped activation
    (``swiglu_limit``, kept for the exports; it costs as SwiGLU). Harmless:
    ``initial_context_length``, ``quantization_config`` (MXFP4 storage of the
    checkpoint). Refused: ``experts_per_token`` differing from ``num_experts_per_tok``."""
    n = cfg["num_hidden_layers"]
    if cfg.get("experts_per_token", cfg["num_experts_per_tok"]) != cfg["num_experts_per_tok"]:
        rule = f"must equal num_experts_per_tok={cfg['num_experts_per_tok']}"
        raise _Refused("experts_per_token", cfg["experts_per_token"], rule)
    windows = _layer_windows(cfg, n, lambda i: i % 2 == 0)
    fields = _llama({**cfg, "mlp_bias": False})
    fields.update(windows)
    fields.update(
        num_experts=cfg["num_local_experts"],
        experts_per_token=cfg["num_experts_per_tok"],
        moe_ffn_hidden_size=cfg["intermediate_size"],
        mlp_bias=True,  # GptOssExperts: gate_up_proj_bias and down_proj_bias
        router_bias=True,  # GptOssTopKRouter.bias
        attention_sinks=True,  # GptOssAttention.sinks
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),  # GptOssConfig's default: 7.0
        # GptOssTopKRouter: top-k of the logits, softmax over those k (the same weights as
        # a softmax over all experts renormalised over the chosen ones)
        router_score="softmax",
        router_renormalize=True,
    )
    return fields


def _activation(cfg: dict[str, Any], allowed: dict[str, str], *keys: str) -> str:
    """The MLP kind of the config's activation under the first of ``keys`` present (refused
    where ``allowed`` does not list it)."""
    for key in keys:
        if key in cfg and cfg[key] is not None:
            act = cfg[key]
            if act not in allowed:
                raise _Refused(key, act, f"one of {', '.join(sorted(allowed))}")
            return allowed[act]
    return next(iter(allowed.values()))


def _phi3(cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 and Phi-4 (transformers' Phi3 modeling): Llama's shape with q, k and v in one
    ``qkv_proj`` and gate and up in one ``gate_up_proj`` (the same parameters as apart), no
    biases, SwiGLU. Costed: ``sliding_window`` on every layer (Phi3Attention hands the
    config's window to every layer; Phi-3-mini-4k: 2047, Phi-4: null),
    ``partial_rotary_factor`` (Phi-4-mini: 0.75), ``resid_pdrop`` and ``embd_pdrop`` as the
    residual dropout (0 in the released configs). Refused: ``embd_pdrop`` other than 0 or
    ``resid_pdrop`` (one dropout probability is costed), an activation other than SiLU."""
    cfg = {"rope_theta": 10000.0, **cfg}  # Phi3Config's default
    _activation(cfg, {"silu": "swiglu"}, "hidden_act")
    resid, embd = cfg.get("resid_pdrop", 0.0) or 0.0, cfg.get("embd_pdrop", 0.0) or 0.0
    if embd not in (0, resid):
        raise _Refused("embd_pdrop", embd, f"must be 0 or resid_pdrop={resid}")
    fields = _llama({**cfg, "attention_bias": False, "mlp_bias": False})
    fields.update(_window(cfg))
    fields.update(
        hidden_dropout=float(resid),
        rotary_percent=float(cfg.get("partial_rotary_factor", 1.0) or 1.0),
    )
    return fields


def _nemotron(cfg: dict[str, Any]) -> dict[str, Any]:
    """Nemotron (transformers' Nemotron modeling; Nemotron-4 340B report, arXiv 2406.11704,
    section 2.2): a plain MLP of up and down projections with squared ReLU (``hidden_act``
    relu2), LayerNorm1P (a weight stored about zero, and a bias), GQA, a rotary embedding over
    ``partial_rotary_factor`` of each head (NemotronConfig's default 0.5), untied embeddings
    by default. Costed: ``attention_bias`` (q, k, v and o), ``mlp_bias``, ``head_dim``.
    Refused: any other activation."""
    cfg = {"rope_theta": 10000.0, **cfg}  # NemotronConfig's default
    mlp = _activation(cfg, {"relu2": "relu2"}, "hidden_act")
    fields = _llama(cfg)
    fields.update(
        mlp=mlp,
        norm="layernorm",
        norm_zero_centered=True,
        norm_eps=cfg.get("norm_eps"),
        rotary_percent=float(cfg.get("partial_rotary_factor", 0.5)),
    )
    return fields


# Gemma's activation: tanh-approximated GeLU, gated (transformers' Gemma2MLP, Gemma3MLP)
_GEGLU = {"gelu_pytorch_tanh": "geglu", "gelu_tanh": "geglu"}


def _layer_windows(
    cfg: dict[str, Any], n: int, sliding: Any, *, default_window: int | None = None
) -> dict[str, Any]:
    """Per-layer attention (gpt-oss, Gemma): ``layer_types`` where the config lists them,
    else ``sliding`` (the layers the model's config class makes sliding); the windowed
    layers attend to ``sliding_window`` keys (``default_window`` where the config leaves it
    out; None: the key is required), the query itself included (transformers'
    sliding-window mask keeps keys q - w < k <= q)."""
    types = cfg.get("layer_types") or [
        "sliding_attention" if sliding(i) else "full_attention" for i in range(n)
    ]
    known = {"sliding_attention", "full_attention"}
    if len(types) != n or not set(types) <= known:
        rule = f"{n} entries of sliding_attention or full_attention, one per layer"
        raise _Refused("layer_types", types, rule)
    windowed = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not windowed:
        return {}
    window = _window({"sliding_window": cfg.get("sliding_window", default_window)})
    if not window:  # windowed layers need their window
        raise KeyError("sliding_window")
    return {**window, "sliding_window_layers": windowed}


def _gemma(cfg: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 2 and 3 share: GeGLU, four RMSNorms a layer (before and after the
    attention and the MLP) scaling by (1 + weight), tied embeddings by default, biases on
    q, k, v and o with ``attention_bias``. ``cfg`` carries the config class's defaults for
    the keys a released config leaves out (Gemma 3's nested text configs state only what
    differs from them); a key stated null stays null."""
    mlp = _activation(cfg, _GEGLU, "hidden_activation", "hidden_act")
    fields = _llama({**cfg, "mlp_bias": False})
    fields.update(
        mlp=mlp,
        post_norms=True,
        norm_zero_centered=True,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )
    return fields


# transformers' Gemma2Config defaults (configuration_gemma2.py) for what a config leaves out
_GEMMA2 = {
    "vocab_size": 256000, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False,
    "sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
}  # fmt: skip
# transformers' Gemma3TextConfig defaults (configuration_gemma3.py): the released Gemma 3
# configs' text_config lists only the keys that differ from them
_GEMMA3 = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0, "attention_bias": False, "sliding_window": 4096,
    "sliding_window_pattern": 6, "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}  # fmt: skip


def _gemma2(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 (transformers' Gemma2 modeling; Gemma 2 report, arXiv 2408.00118, section 2):
    ``_gemma``'s layers; every other layer, from the first, attends to a window of
    ``sliding_window`` keys (Gemma2Config: layer i slides when (i + 1) % 2), the rest fully;
    the logits soft-capped (``final_logit_softcapping``, costed: a tanh over the logits and
    its output kept) and the attention scores (``attn_logit_softcapping``, inside the kernel:
    not priced). Harmless: ``query_pre_attn_scalar`` (the attention's scale)."""
    cfg = {**_GEMMA2, **cfg}
    fields = _gemma(cfg)
    n = cfg["num_hidden_layers"]
    fields.update(_layer_windows(cfg, n, lambda i: (i + 1) % 2, default_window=4096))
    fields.update(_softcaps(cfg))
    return fields


def _gemma3(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's language model (``gemma3_text``, or the ``text_config`` of a ``gemma3``
    config; transformers' Gemma3 modeling; Gemma 3 report, arXiv 2503.19786, section 2):
    ``_gemma``'s layers with an RMSNorm over each head's query and key (q_norm, k_norm); five
    local layers to one global (Gemma3TextConfig: layer i slides unless (i + 1) %
    ``sliding_window_pattern`` is 0, or as ``layer_types`` lists); soft caps where set (none
    in the released configs). Harmless: ``query_pre_attn_scalar``, ``rope_local_base_freq``
    (the local layers' RoPE base)."""
    cfg = {**_GEMMA3, **cfg}
    fields = _gemma(cfg)
    n, pattern = cfg["num_hidden_layers"], cfg["sliding_window_pattern"]
    windows = _layer_windows(cfg, n, lambda i: (i + 1) % pattern, default_window=4096)
    fields.update(windows, qk_norm=True)
    fields.update(_softcaps(cfg))
    return fields


def _softcaps(cfg: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, field in (
        ("final_logit_softcapping", "final_logit_softcap"),
        ("attn_logit_softcapping", "attention_logit_softcap"),
    ):
        cap = cfg.get(key)
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, int | float) or cap <= 0:
                raise _Refused(key, cap, "must be a positive number or null")
            out[field] = float(cap)
    return out


def _glm4_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5 and GLM-4.5-Air (transformers' Glm4Moe modeling; arXiv 2508.06471): GQA with
    biases on q, k and v (``attention_bias``; never on o), an RMSNorm over each head's query
    and key with ``use_qk_norm``, a rotary embedding over ``partial_rotary_factor`` of each
    head (default 0.5); ``first_k_dense_replace`` dense layers, then every layer routes to
    ``num_experts_per_tok`` of ``n_routed_experts`` by sigmoid scores with a correction bias
    buffer and ``n_shared_experts`` shared experts (DeepSeek-V3's router and MoE block);
    ``num_nextn_predict_layers`` MTP modules (DeepSeek-V3's). Defaults where a key is absent:
    Glm4MoeConfig's."""
    cfg = {"rope_theta": 10000.0, **cfg}
    fields = _llama({**cfg, "attention_bias": False, "mlp_bias": False})
    groups, topk_group = cfg.get("n_group", 1) or 1, cfg.get("topk_group", 1) or 1
    fields.update(
        qkv_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=bool(cfg.get("use_qk_norm", False)),
        rotary_percent=float(cfg.get("partial_rotary_factor", 0.5)),
        num_experts=cfg["n_routed_experts"],
        experts_per_token=cfg["num_experts_per_tok"],
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        num_shared_experts=cfg.get("n_shared_experts", 1),
        shared_expert_ffn_hidden_size=cfg["moe_intermediate_size"],
        router_expert_bias=True,  # Glm4MoeTopkRouter's e_score_correction_bias buffer
        expert_groups=groups,
        groups_per_token=topk_group,
        group_score_experts=2 if groups > 1 else None,  # DeepseekV3TopkRouter's group score
        first_dense_layers=cfg.get("first_k_dense_replace", 1),
        num_mtp_layers=cfg.get("num_nextn_predict_layers", 1) or 0,
        router_score="sigmoid",
        router_renormalize=bool(cfg.get("norm_topk_prob", True)),
        router_scale=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
    )
    return fields


def _llama4(cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama 4's language model (``llama4_text``, or the ``text_config`` of a ``llama4``
    config; transformers' Llama4 modeling): GQA; ``no_rope_layers`` marks each layer 1 with
    RoPE, 0 without (default: every fourth layer without, ``no_rope_layer_interval``); the
    RoPE layers attend within chunks of ``attention_chunk_size`` tokens and the others
    globally (Llama4TextConfig's layer_types; or as ``layer_types`` lists), and carry a
    parameter-free L2 norm over queries and keys with ``use_qk_norm``; ``moe_layers`` (default
    every ``interleave_moe_layer_step``-th layer from step - 1) route each token to
    ``num_experts_per_tok`` of ``num_local_experts`` experts of ``intermediate_size`` by a
    sigmoid of the top logits, beside one shared expert of ``intermediate_size``; the other
    layers are dense MLPs of ``intermediate_size_mlp``. Harmless: ``attn_temperature_tuning``,
    ``floor_scale``, ``attn_scale`` (the NoPE layers' query scaling). Defaults where a key is
    absent: Llama4TextConfig's."""
    cfg = {"rope_theta": 500000.0, **cfg}
    n = cfg["num_hidden_layers"]
    _activation(cfg, {"silu": "swiglu"}, "hidden_act")
    interval = cfg.get("no_rope_layer_interval", 4)
    rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if len(rope) != n or not set(rope) <= {0, 1}:
        raise _Refused("no_rope_layers", rope, f"{n} entries of 0 or 1, one per layer")
    types = cfg.get("layer_types") or ["chunked_attention" if r else "full_attention" for r in rope]
    if len(types) != n or not set(types) <= {"chunked_attention", "full_attention"}:
        rule = f"{n} entries of chunked_attention or full_attention, one per layer"
        raise _Refused("layer_types", types, rule)
    step = cfg.get("interleave_moe_layer_step", 1)
    moe_layers = cfg.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, n, step))
    fields = _llama({**cfg, "attention_bias": False, "mlp_bias": False})
    width = cfg.get("intermediate_size", 8192)
    fields.update(
        ffn_hidden_size=cfg.get("intermediate_size_mlp", 16384),
        nope_layers=tuple(i for i, r in enumerate(rope) if not r) or None,
        qk_l2_norm=bool(cfg.get("use_qk_norm", True)),
        num_experts=cfg.get("num_local_experts", 16),
        experts_per_token=cfg.get("num_experts_per_tok", 1),
        moe_ffn_hidden_size=width,
        num_shared_experts=1,  # Llama4TextMoe.shared_expert
        shared_expert_ffn_hidden_size=width,
        moe_layers=tuple(moe_layers),
        router_score="sigmoid",
        router_renormalize=False,  # Llama4Router: sigmoid of the top-k logits, as they are
    )
    chunked = tuple(i for i, t in enumerate(types) if t == "chunked_attention")
    chunk = cfg.get("attention_chunk_size", 8192)
    if chunked and chunk:
        fields.update(attention_chunk_size=chunk, chunked_attention_layers=chunked)
    return fields


# The ``_COST_FIELDS`` each reader costs (or rules on itself); the rest are refused unless inert.
_MLA_MOE = frozenset(
    {
        "q_lora_rank",
        "kv_lora_rank",
        "n_routed_experts",
        "n_shared_experts",
        "first_k_dense_replace",
        "moe_layer_freq",
        "num_nextn_predict_layers",
    }
)
_QWEN = frozenset({"sliding_window", "use_sliding_window"})
_QWEN_MOE = _QWEN | {"num_experts", "decoder_sparse_step", "mlp_only_layers"}
_COSTED: dict[str, frozenset[str]] = {
    "llama": frozenset({"attention_bias", "mlp_bias"}),
    "mistral": frozenset({"sliding_window"}),
    "mixtral": frozenset({"sliding_window", "num_local_experts"}),
    "qwen2": _QWEN,
    "qwen2_moe": _QWEN_MOE | {"shared_expert_intermediate_size"},
    "qwen3": _QWEN | {"attention_bias"},
    "qwen3_moe": _QWEN_MOE | {"attention_bias"},
    "deepseek_v2": _MLA_MOE,
    "deepseek_v3": _MLA_MOE,
    "kimi_k2": _MLA_MOE,
    "gpt2": frozenset(),
    "gpt_neox": frozenset({"attention_bias"}),
    "gpt_oss": frozenset({"attention_bias", "sliding_window", "layer_types", "num_local_experts"}),
    "phi3": frozenset({"sliding_window", "partial_rotary_factor"}),
    "nemotron": frozenset({"attention_bias", "mlp_bias", "partial_rotary_factor"}),
    "gemma2": frozenset(
        {
            "attention_bias",
            "sliding_window",
            "layer_types",
            "final_logit_softcapping",
            "attn_logit_softcapping",
        }
    ),
    "gemma3_text": frozenset(
        {
            "attention_bias",
            "sliding_window",
            "layer_types",
            "sliding_window_pattern",
            "final_logit_softcapping",
            "attn_logit_softcapping",
        }
    ),
    "glm4_moe": _MLA_MOE - {"q_lora_rank", "kv_lora_rank", "moe_layer_freq"}
    | {"attention_bias", "use_qk_norm", "partial_rotary_factor"},
    "llama4_text": frozenset(
        {
            "attention_chunk_size",
            "layer_types",
            "use_qk_norm",
            "num_local_experts",
            "no_rope_layers",
            "interleave_moe_layer_step",
            "moe_layers",
        }
    ),
}

# Multimodal configs whose language model is read: the model_type of their text_config
_TEXT_MODEL = {"gemma3": "gemma3_text", "llama4": "llama4_text"}


def language_model_only(cfg: dict[str, Any]) -> bool:
    """Whether ``cfg`` is a multimodal config of which only the language model is read (its
    vision tower is not costed)."""
    return cfg.get("model_type") in _TEXT_MODEL


_READERS = {
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2": _qwen2,
    "qwen2_moe": _qwen2_moe,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    # Kimi K2 ships DeepSeek-V3's architecture under its own model_type (its config names
    # DeepseekV3ForCausalLM; Moonshot's deployment guide: "Kimi-K2 reuses the
    # DeepSeekV3CausalLM architecture").
    "kimi_k2": _deepseek,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "gpt_oss": _gpt_oss,
    "phi3": _phi3,
    "nemotron": _nemotron,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "glm4_moe": _glm4_moe,
    "llama4_text": _llama4,
}
