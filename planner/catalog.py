"""Catalogs: models from Hugging Face ``config.json`` files, clusters from machine YAMLs.

``load_model`` takes a catalog name (``models/<name>.json``), a path to a ``config.json``, or a
dict (a Hugging Face config, or ``ModelSpec`` fields). It reads the Llama, Mixtral, Qwen2-MoE,
DeepSeek-V2/V3, GPT-2 and GPT-NeoX formats. ``load_cluster`` takes a machine name
(``hardware/<name>.yaml``) or a path, and the total GPU count. Units are converted once, here:
the YAML says GiB, GB/s, Gb/s and TFLOP/s in its key names; specs hold bytes, B/s and FLOP/s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from planner.errors import PlannerError, UnknownNameError
from planner.specs import ClusterSpec, ModelSpec

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = ROOT / "models"
HARDWARE_DIR = ROOT / "hardware"
GiB = 2**30


def model_names() -> list[str]:
    """Names the model catalog holds."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def cluster_names() -> list[str]:
    """Machine types the hardware catalog holds."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_model(source: str | Path | dict[str, Any]) -> ModelSpec:
    """A ``ModelSpec`` from a catalog name, a path to a config file, or a dict."""
    if isinstance(source, dict):
        return model_from_config(source, name=str(source.get("name", "custom")))
    path = resolve_source(source, MODELS_DIR, ".json", "model", model_names())
    return model_from_config(
        _read(path), name=path.stem if Path(source).suffix == "" else str(path)
    )


def load_cluster(source: str | Path, *, gpus: int) -> ClusterSpec:
    """A ``ClusterSpec`` of ``gpus`` GPUs of the machine type ``source`` (name or YAML path)."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus <= 0:
        raise PlannerError(f"gpus={gpus!r}: must be a positive whole number of GPUs")
    path = resolve_source(source, HARDWARE_DIR, ".yaml", "cluster", cluster_names())
    data = _read(path)
    if "usable_hbm_GiB" in data and not 0 < data["usable_hbm_GiB"] <= data.get("hbm_GiB", 0):
        raise PlannerError(
            f"cluster file {path}: usable_hbm_GiB={data['usable_hbm_GiB']} must be in "
            f"(0, hbm_GiB={data.get('hbm_GiB')}] (a process cannot allocate more than the GPU has)"
        )
    try:
        achieved = data["achieved"]
        return ClusterSpec(
            name=str(data["name"]),
            num_gpus=gpus,
            gpus_per_node=data["gpus_per_node"],
            hbm_bytes=round(data["hbm_GiB"] * GiB),
            hbm_bandwidth_Bps=data["hbm_bandwidth_GBps"] * 1e9,
            sm_count=data.get("sm_count"),
            bf16_flops=data["bf16_dense_tflops"] * 1e12,
            fp8_flops=(data["fp8_dense_tflops"] * 1e12) if data.get("fp8_dense_tflops") else None,
            fp32_flops=data["fp32_tflops"] * 1e12,
            nvlink_Bps=data["nvlink_GBps_per_direction"] * 1e9,
            nics_per_node=data["nics_per_node"],
            nic_Bps=data["nic_Gbps"] * 1e9 / 8,
            host_ram_bytes=round(data["host_ram_GiB"] * GiB),
            pcie_Bps=data["pcie_GBps_per_direction"] * 1e9,
            nvlink_latency_s=data["nvlink_latency_us"] * 1e-6,
            ib_latency_s=data["ib_latency_us"] * 1e-6,
            achieved=dict(achieved),
            achieved_max=dict(data.get("achieved_max") or {}),
            **{
                field: data[key] * 1e-6
                for field, key in (
                    ("kernel_overhead_s", "kernel_overhead_us"),
                    ("host_overhead_s", "host_overhead_us"),
                )
                if key in data
            },
            # What the CUDA runtime reports as the device's total; a file without it (a
            # user's own machine) gets the nominal HBM (ClusterSpec's default).
            **(
                {
                    "hbm_reserved_bytes": round(data["hbm_GiB"] * GiB)
                    - round(data["usable_hbm_GiB"] * GiB)
                }
                if "usable_hbm_GiB" in data
                else {}
            ),
        )
    except KeyError as exc:
        raise PlannerError(f"cluster file {path}: missing key {exc.args[0]!r}") from None
    except TypeError as exc:
        raise PlannerError(f"cluster file {path}: malformed value ({exc})") from None


def cluster_yaml(cluster: ClusterSpec, *, sources: dict[str, str] | None = None) -> dict[str, Any]:
    """``cluster`` as a machine YAML's fields (``load_cluster``'s inverse, without the GPU
    count): what ``planner calibrate`` writes for ``--cluster``."""
    data: dict[str, Any] = {
        "name": cluster.name,
        "gpus_per_node": cluster.gpus_per_node,
        "hbm_GiB": cluster.hbm_bytes / GiB,
        "usable_hbm_GiB": (cluster.hbm_bytes - cluster.hbm_reserved_bytes) / GiB,
        "hbm_bandwidth_GBps": cluster.hbm_bandwidth_Bps / 1e9,
        "sm_count": cluster.sm_count,
        "bf16_dense_tflops": cluster.bf16_flops / 1e12,
        "fp8_dense_tflops": cluster.fp8_flops / 1e12 if cluster.fp8_flops else None,
        "fp32_tflops": cluster.fp32_flops / 1e12,
        "nvlink_GBps_per_direction": cluster.nvlink_Bps / 1e9,
        "nics_per_node": cluster.nics_per_node,
        "nic_Gbps": cluster.nic_Bps * 8 / 1e9,
        "host_ram_GiB": cluster.host_ram_bytes / GiB,
        "pcie_GBps_per_direction": cluster.pcie_Bps / 1e9,
        "nvlink_latency_us": cluster.nvlink_latency_s * 1e6,
        "ib_latency_us": cluster.ib_latency_s * 1e6,
        "kernel_overhead_us": cluster.kernel_overhead_s * 1e6,
        "host_overhead_us": cluster.host_overhead_s * 1e6,
        "achieved": {k: float(v) for k, v in cluster.achieved.items()},
    }
    data = {k: _short(v) for k, v in data.items()}
    data["achieved"] = {k: _short(v) for k, v in data["achieved"].items()}
    if cluster.achieved_max:
        data["achieved_max"] = dict(cluster.achieved_max)
    if sources:
        data["sources"] = dict(sources)
    return data


def _short(value: Any) -> Any:
    """Floats to 6 significant digits (a YAML a person reads); other values as they are."""
    return float(f"{value:.6g}") if isinstance(value, float) else value


def resolve_source(
    source: str | Path, folder: Path, suffix: str, kind: str, known: list[str]
) -> Path:
    """The catalog file ``source`` names (``folder/<source><suffix>``), or ``source`` as a
    path; a one-line error listing the ``known`` names otherwise."""
    candidate = Path(source)
    if candidate.suffix == "" and not candidate.exists():
        path = folder / f"{source}{suffix}"
        if not path.exists():
            raise UnknownNameError(
                f"{kind}={str(source)!r}: unknown {kind} name; known: {', '.join(known)} "
                f"(or pass a path to a file)"
            )
        return path
    if not candidate.is_file():
        raise PlannerError(f"{kind}={str(source)!r}: no such file")
    return candidate


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise PlannerError(f"file {path}: unreadable ({exc.__class__.__name__})") from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        reason = str(exc).splitlines()[0]
        raise PlannerError(f"file {path}: malformed ({reason})") from None
    if not isinstance(data, dict):
        raise PlannerError(f"file {path}: expected a mapping at the top level")
    return data


# ---------------------------------------------------------------------------------------
# Hugging Face config formats


def model_from_config(cfg: dict[str, Any], *, name: str) -> ModelSpec:
    """Normalise a Hugging Face ``config.json`` (or ``ModelSpec`` fields) into a ``ModelSpec``."""
    if "model_type" not in cfg and "attention" in cfg:
        return ModelSpec(**cfg)
    kind = cfg.get("model_type")
    reader = _READERS.get(str(kind))
    if reader is None:
        raise PlannerError(
            f"model config {name}: model_type={kind!r} is not supported; supported: "
            f"{', '.join(sorted(_READERS))}"
        )
    try:
        fields = reader(cfg)
    except KeyError as exc:
        raise PlannerError(
            f"model config {name}: missing key {exc.args[0]!r} (required for model_type {kind})"
        ) from None
    return ModelSpec(name=name, **fields)


def _llama(cfg: dict[str, Any]) -> dict[str, Any]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise PlannerError("model config: attention_bias/mlp_bias=true is not supported for llama")
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
    }


def _mixtral(cfg: dict[str, Any]) -> dict[str, Any]:
    fields = _llama(cfg)
    fields.update(
        num_experts=cfg["num_local_experts"],
        experts_per_token=cfg["num_experts_per_tok"],
        moe_ffn_hidden_size=cfg["intermediate_size"],
    )
    return fields


def _qwen2_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    fields = _llama({**cfg, "attention_bias": False})
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise PlannerError(
            "model config: decoder_sparse_step != 1 or mlp_only_layers is not supported; "
            "every layer must be MoE"
        )
    shared = cfg.get("shared_expert_intermediate_size", 0)
    fields.update(
        qkv_bias=True,  # Qwen2 attention has biases on q, k and v (not on o)
        num_experts=cfg["num_experts"],
        experts_per_token=cfg["num_experts_per_tok"],
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        num_shared_experts=1 if shared else 0,
        shared_expert_ffn_hidden_size=shared,
        shared_expert_gate=bool(shared),
    )
    return fields


def _deepseek(cfg: dict[str, Any]) -> dict[str, Any]:
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
    )


def _gpt_neox(cfg: dict[str, Any]) -> dict[str, Any]:
    return _gpt_style(
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        num_layers=cfg["num_hidden_layers"],
        vocab_size=cfg["vocab_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        hidden_dropout=float(cfg.get("hidden_dropout", 0.0) or 0.0),
    )


_READERS = {
    "llama": _llama,
    "mistral": _llama,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
}
