"""Input schema: what a model, a cluster and a training job are, with units in the field names.

Everything a user passes or a file holds is one of these pydantic models: typed, documented,
constrained, and strict about unknown keys (``extra="forbid"``), so a misspelled key is an
error instead of a silently ignored setting. ``Layout`` (the answer's shape) lives in
``planner.layout``.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from planner.errors import PlannerError, one_line
from planner.frameworks import (
    DEFAULT_FRAMEWORK,
    FRAMEWORK_NAMES,
    FRAMEWORKS,
    LAUNCHERS,
    framework,
    names_with,
)

DType = Literal["fp32", "bf16", "fp16", "fp8"]
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


class Spec(BaseModel):
    """Base of every spec: strict, frozen, and raising one-line ``PlannerError``s."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise one_line(exc, type(self).__name__) from None


class ModelSpec(Spec):
    """A transformer language model, normalised from any supported ``config.json`` format.

    Counts are exact integers; nothing here is in bytes (dtypes belong to the job).
    """

    name: str = Field(description="Catalog name or a label for the model.")
    hidden_size: int = Field(gt=0, description="Model width h (elements).")
    num_layers: int = Field(gt=0, description="Transformer layers in the main model.")
    vocab_size: int = Field(gt=0, description="Vocabulary size V (tokens).")
    num_attention_heads: int = Field(gt=0, description="Query heads.")
    num_kv_heads: int = Field(gt=0, description="Key/value heads (== query heads for MHA).")
    head_dim: int = Field(gt=0, description="Per-head width of q/k/v for MHA/GQA (elements).")
    attention: Literal["mha", "gqa", "mla"] = Field(description="Attention kind.")
    q_lora_rank: int | None = Field(
        default=None,
        ge=0,
        description="MLA query compression width d_cq (None: no q down-projection).",
    )
    kv_lora_rank: int = Field(default=0, ge=0, description="MLA key/value compression width d_c.")
    qk_nope_head_dim: int = Field(
        default=0, ge=0, description="MLA per-head q/k width without RoPE."
    )
    qk_rope_head_dim: int = Field(default=0, ge=0, description="MLA per-head q/k RoPE width.")
    v_head_dim: int = Field(default=0, ge=0, description="MLA per-head value width.")
    mlp: Literal["swiglu", "geglu", "gelu", "relu2"] = Field(
        description="MLP kind: gated (SiLU: swiglu; tanh GeLU: geglu, Gemma) with gate and up "
        "projections, or plain (GeLU; squared ReLU: relu2, Nemotron) with one."
    )
    ffn_hidden_size: int = Field(gt=0, description="Dense MLP intermediate width (elements).")
    num_experts: int = Field(
        default=0, ge=0, description="Routed experts per MoE layer (0: dense)."
    )
    experts_per_token: int = Field(default=0, ge=0, description="Routed experts each token visits.")
    moe_ffn_hidden_size: int = Field(default=0, ge=0, description="Routed expert width.")
    num_shared_experts: int = Field(default=0, ge=0, description="Shared experts per MoE layer.")
    shared_expert_ffn_hidden_size: int = Field(
        default=0, ge=0, description="Width of one shared expert (elements)."
    )
    shared_expert_gate: bool = Field(
        default=False,
        description="A sigmoid gate Linear(h, 1) scales the shared expert (Qwen2-MoE).",
    )
    router_expert_bias: bool = Field(
        default=False,
        description="Per-expert routing bias buffer (DeepSeek-V3 aux-loss-free balancing).",
    )
    expert_groups: int = Field(
        default=1, gt=0, description="Groups the routed experts are split into (DeepSeek n_group)."
    )
    groups_per_token: int | None = Field(
        default=None,
        gt=0,
        description="Most groups one token's experts may come from (DeepSeek topk_group; None: "
        "no limit). With groups on separate nodes this is node-limited routing.",
    )
    first_dense_layers: int = Field(
        default=0, ge=0, description="Leading layers with a dense MLP instead of MoE."
    )
    moe_layer_freq: int = Field(default=1, gt=0, description="Every k-th layer after those is MoE.")
    norm: Literal["rmsnorm", "layernorm"] = Field(
        default="rmsnorm", description="Normalisation kind (layernorm has a bias)."
    )
    qkv_bias: bool = Field(default=False, description="Bias on the q/k/v projections.")
    linear_bias: bool = Field(
        default=False, description="Bias on every other linear layer (GPT-2/3 style)."
    )
    tie_word_embeddings: bool = Field(description="The output head shares the embedding matrix.")
    learned_positions: int = Field(
        default=0, ge=0, description="Rows of a learned position embedding (0 with RoPE)."
    )
    num_mtp_layers: int = Field(
        default=0, ge=0, description="Multi-token-prediction modules (DeepSeek-V3: 1)."
    )
    attention_dropout: float = Field(default=0.0, ge=0, lt=1, description="Attention dropout p.")
    hidden_dropout: float = Field(default=0.0, ge=0, lt=1, description="Residual dropout p.")
    # What a launch config needs to build this exact model; no cost reads them. None: the
    # source did not record it (an export then says it cannot state the model exactly).
    rope_theta: float | None = Field(
        default=None, gt=0, description="RoPE base theta (config rope_theta; None: no RoPE)."
    )
    rope_scaling: tuple[tuple[str, str | float], ...] = Field(
        default=(),
        description="The config's rope_scaling entries as (key, value) pairs sorted by key, "
        "its kind under 'rope_type' (empty: no scaling).",
    )
    norm_eps: float | None = Field(
        default=None, gt=0, description="Epsilon of every norm (rms_norm_eps, layer_norm_epsilon)."
    )
    router_score: Literal["softmax", "sigmoid"] | None = Field(
        default=None, description="Router score function over the experts (None: dense)."
    )
    router_renormalize: bool | None = Field(
        default=None,
        description="The chosen experts' weights are rescaled to sum to 1 (Mixtral; "
        "norm_topk_prob in DeepSeek and Qwen2-MoE configs).",
    )
    router_scale: float = Field(
        default=1.0,
        gt=0,
        description="Factor on the chosen experts' weights (DeepSeek's routed_scaling_factor).",
    )
    group_score_experts: int | None = Field(
        default=None,
        gt=0,
        description="A group's routing score sums its best this-many expert scores (DeepSeek-V3 "
        "noaux_tc: 2; DeepSeek-V2 group_limited_greedy, the group's best: 1; None: no groups).",
    )
    # Attention and MLP details of newer families; the defaults are the Llama shape.
    o_proj_bias: bool = Field(
        default=False,
        description="Bias on the attention output projection (Llama attention_bias, gpt-oss).",
    )
    mlp_bias: bool = Field(
        default=False,
        description="Bias on the MLP's and the routed experts' linears (Llama mlp_bias, gpt-oss).",
    )
    router_bias: bool = Field(
        default=False, description="A learned bias on the router's logits (gpt-oss)."
    )
    qk_norm: bool = Field(
        default=False,
        description="RMSNorm over each head's query and key, head_dim weights each (Qwen3).",
    )
    attention_sinks: bool = Field(
        default=False, description="A learned sink logit per query head in the softmax (gpt-oss)."
    )
    sliding_window: int | None = Field(
        default=None,
        gt=0,
        description="Keys a query attends to at most in a windowed layer, itself included "
        "(tokens; None: full causal attention everywhere).",
    )
    sliding_window_layers: tuple[int, ...] | None = Field(
        default=None,
        description="Main-model layers (0-based, increasing) with the window; None: every "
        "layer when sliding_window is set (Mistral).",
    )
    post_norms: bool = Field(
        default=False,
        description="A norm over the attention's and the MLP's outputs before each residual "
        "add, beside the pre-norms (Gemma 2/3's post_attention_layernorm and "
        "post_feedforward_layernorm): two more norms a layer.",
    )
    norm_zero_centered: bool = Field(
        default=False,
        description="Norms scale by (1 + weight) with the weight stored about zero (Gemma's "
        "RMSNorm, Nemotron's LayerNorm1P); costs as any norm.",
    )
    rotary_percent: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Share of each head's q/k width the rotary embedding turns (config "
        "partial_rotary_factor: Nemotron, GLM-4.5 0.5).",
    )
    nope_layers: tuple[int, ...] | None = Field(
        default=None,
        description="Main-model layers (0-based, increasing) with no rotary embedding (Llama "
        "4's global layers); None: every layer has it.",
    )
    qk_l2_norm: bool = Field(
        default=False,
        description="A parameter-free L2 norm over each head's query and key on the layers "
        "with a rotary embedding (Llama 4's use_qk_norm).",
    )
    attention_chunk_size: int | None = Field(
        default=None,
        gt=0,
        description="Tokens per chunk in a chunked-attention layer: a query attends to the "
        "keys of its own chunk up to itself (Llama 4's attention_chunk_size; None: no chunks).",
    )
    chunked_attention_layers: tuple[int, ...] | None = Field(
        default=None,
        description="Main-model layers (0-based, increasing) with chunked attention; None: "
        "every layer when attention_chunk_size is set.",
    )
    moe_layers: tuple[int, ...] | None = Field(
        default=None,
        description="Main-model layers (0-based, increasing) with an MoE MLP, where a config "
        "lists them (Llama 4's interleave_moe_layer_step); None: first_dense_layers and "
        "moe_layer_freq decide.",
    )
    final_logit_softcap: float | None = Field(
        default=None,
        gt=0,
        description="The logits pass through cap * tanh(logits / cap) before the loss (Gemma "
        "2's final_logit_softcapping; None: no cap).",
    )
    attention_logit_softcap: float | None = Field(
        default=None,
        gt=0,
        description="The attention scores pass through cap * tanh(score / cap) inside the "
        "fused kernel (Gemma 2's attn_logit_softcapping; None: no cap). One tanh a score "
        "beside the softmax's exponential: not priced.",
    )
    swiglu_limit: float | None = Field(
        default=None,
        gt=0,
        description="gpt-oss's clamped gated activation: gate clamped above at the limit, up "
        "to +-limit, out = (up + 1) * gate * sigmoid(1.702 gate) (transformers' GptOssExperts; "
        "config swiglu_limit). None: plain SwiGLU. Costs as SwiGLU.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        if self.attention == "mla":
            for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, key) <= 0:
                    raise PlannerError(f"ModelSpec.{key}={getattr(self, key)}: MLA needs it > 0")
        elif self.num_attention_heads % self.num_kv_heads:
            raise PlannerError(
                f"ModelSpec.num_kv_heads={self.num_kv_heads}: must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise PlannerError(
                    f"ModelSpec.experts_per_token={self.experts_per_token}: must be in "
                    f"1..num_experts={self.num_experts}"
                )
            if self.moe_ffn_hidden_size <= 0:
                raise PlannerError("ModelSpec.moe_ffn_hidden_size=0: MoE models need it > 0")
            if self.num_experts % self.expert_groups:
                raise PlannerError(
                    f"ModelSpec.expert_groups={self.expert_groups}: must divide "
                    f"num_experts={self.num_experts}"
                )
        if self.sliding_window_layers is not None and self.sliding_window is None:
            raise PlannerError(
                "ModelSpec.sliding_window_layers: set without sliding_window (the window size)"
            )
        for key in (
            "sliding_window_layers",
            "nope_layers",
            "chunked_attention_layers",
            "moe_layers",
        ):
            layers = getattr(self, key)
            if layers is not None and (
                list(layers) != sorted(set(layers))
                or not all(0 <= i < self.num_layers for i in layers)
            ):
                raise PlannerError(
                    f"ModelSpec.{key}={list(layers)}: must be increasing layer indices in "
                    f"0..{self.num_layers - 1}"
                )
        if self.chunked_attention_layers is not None and self.attention_chunk_size is None:
            raise PlannerError(
                "ModelSpec.chunked_attention_layers: set without attention_chunk_size (the "
                "chunk's tokens)"
            )
        if self.attention_chunk_size is not None and self.sliding_window is not None:
            raise PlannerError(
                f"ModelSpec.attention_chunk_size={self.attention_chunk_size}: chunked attention "
                "beside a sliding window is not represented; set one of them"
            )
        if self.moe_layers is not None and not self.num_experts:
            raise PlannerError("ModelSpec.moe_layers: set on a model without routed experts")
        if self.groups_per_token is not None and self.groups_per_token > self.expert_groups:
            raise PlannerError(
                f"ModelSpec.groups_per_token={self.groups_per_token}: must be at most "
                f"expert_groups={self.expert_groups}"
            )
        return self

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLP has a gate projection beside the up projection (SwiGLU, GeGLU)."""
        return self.mlp in ("swiglu", "geglu")

    def is_moe_layer(self, index: int) -> bool:
        """Whether main-model layer ``index`` (0-based) has an MoE MLP. MTP layers
        (``index >= num_layers``) follow the first_dense_layers/moe_layer_freq rule."""
        if not self.num_experts or index < self.first_dense_layers:
            return False
        if self.moe_layers is not None and index < self.num_layers:
            return index in self.moe_layers
        return index % self.moe_layer_freq == 0

    def attention_chunk(self, index: int) -> int | None:
        """Tokens per attention chunk of main-model layer ``index`` (None: no chunks). MTP
        layers attend fully."""
        if self.attention_chunk_size is None or index >= self.num_layers:
            return None
        layers = self.chunked_attention_layers
        return self.attention_chunk_size if layers is None or index in layers else None

    def has_rope(self, index: int) -> bool:
        """Whether layer ``index`` turns q and k by a rotary embedding (not with learned
        positions, nor on ``nope_layers``)."""
        if self.learned_positions:
            return False
        return self.nope_layers is None or index >= self.num_layers or index not in self.nope_layers

    def attention_window(self, index: int) -> int | None:
        """Keys a query of main-model layer ``index`` (0-based) attends to at most (None: all
        before it). MTP layers (``index >= num_layers``) attend fully."""
        if self.sliding_window is None or index >= self.num_layers:
            return None
        if self.sliding_window_layers is None or index in self.sliding_window_layers:
            return self.sliding_window
        return None

    def num_params(self, *, active: bool = False, include_mtp: bool = True) -> int:
        """All parameters (MTP included where the config has it), or with ``active=True`` the
        parameters one token passes through: routed experts count ``experts_per_token`` of
        ``num_experts``; embedding and head count whole. Buffers (the router bias) are not
        parameters. Computed from the per-tensor table in ``planner.costs.blocks``."""
        from planner.costs.blocks import model_param_count

        return model_param_count(self, active=active, include_mtp=include_mtp)


DEFAULT_TIME_LIMIT_S = 10.0  # planner.plan's, the CLI's and a sweep case's search limit
MAX_GPUS = 2**24  # ClusterSpec.num_gpus: the enumeration of degrees takes O(sqrt) of it


class ClusterSpec(Spec):
    """A homogeneous GPU cluster: ``num_nodes`` nodes of ``gpus_per_node`` identical GPUs,
    joined by NVLink within each NVLink domain (a node, or ``nvlink_domain_gpus`` GPUs of
    several nodes on a rack-scale fabric) and by the nodes' NICs across domains."""

    name: str = Field(description="Machine type name (catalog name or a label).")
    num_gpus: int = Field(
        gt=0,
        le=MAX_GPUS,
        description=f"Total GPUs in the job (at most {MAX_GPUS:,}, a hundred times the largest "
        "clusters built).",
    )
    gpus_per_node: int = Field(
        gt=0,
        description="GPUs of one node: one host (its CPUs, host RAM and NICs), launched as one "
        "machine. On an HGX/DGX node they are also its NVLink domain; on a rack-scale NVLink "
        "system a node is a compute tray (GB200 NVL72: 4 GPUs) and nvlink_domain_gpus joins "
        "trays.",
    )
    nvlink_domain_gpus: int | None = Field(
        default=None,
        gt=0,
        description="GPUs one NVLink switch fabric joins across nodes, a whole number of nodes "
        "(GB200 NVL72: 72, 18 trays of 4). None: the node's gpus_per_node (an HGX/DGX node). A "
        "job is placed in domains of domain_gpus GPUs (the largest whole number of nodes, at "
        "most this, that divides the job); a group inside one is priced at NVLink bandwidth.",
    )
    nvlink_peer_Bps: float | None = Field(
        default=None,
        gt=0,
        description="Bandwidth of the one direct link between two GPUs of a full-mesh node (no "
        "switch: AMD Infinity Fabric), per direction (B/s): a GPU talking to k peers at once "
        "uses k links, min(k x this, nvlink_Bps). None: a switched fabric, where any group "
        "reaches nvlink_Bps.",
    )
    hbm_bytes: int = Field(gt=0, description="Nominal HBM capacity per GPU (bytes).")
    hbm_reserved_bytes: int = Field(
        default=0,
        ge=0,
        description="HBM per GPU that no process can allocate (bytes): nominal hbm_bytes less "
        "the device total the CUDA runtime reports (torch.cuda.mem_get_info()[1]; PyTorch's OOM "
        "message 'GPU 0 has a total capacity of X GiB'). Stated as what the driver keeps, so a "
        "copy with another hbm_bytes keeps the same reserve. The CUDA context is allocated in "
        "what is left. Default 0 (a user-built ClusterSpec); the hardware catalog states it.",
    )
    hbm_bandwidth_Bps: float = Field(gt=0, description="HBM bandwidth per GPU (bytes/s).")
    sm_count: int | None = Field(
        default=None,
        gt=0,
        description="Streaming multiprocessors per GPU: GEMM tiles run in waves of this many "
        "(None: no wave quantisation).",
    )
    bf16_flops: float = Field(gt=0, description="Dense BF16 tensor-core peak per GPU (FLOP/s).")
    fp8_flops: float | None = Field(
        default=None, gt=0, description="Dense FP8 peak per GPU (FLOP/s); None without FP8."
    )
    fp32_flops: float = Field(gt=0, description="Non-tensor FP32 peak per GPU (FLOP/s).")
    nvlink_Bps: float = Field(
        gt=0,
        description="NVLink (or Infinity Fabric) bandwidth per GPU per direction (B/s): all of "
        "its links together.",
    )
    nics_per_node: int = Field(gt=0, description="Compute-fabric NICs per node.")
    nic_Bps: float = Field(gt=0, description="Bandwidth per NIC per direction (bytes/s).")
    host_ram_bytes: int = Field(gt=0, description="Host memory per node (bytes).")
    pcie_Bps: float = Field(gt=0, description="GPU-host bandwidth per GPU per direction (B/s).")
    gpu_nic_Bps: float | None = Field(
        default=None,
        gt=0,
        description="Bandwidth of the path from a GPU to its NIC per direction (B/s), where it "
        "is not the host link (HGX B300: PCIe Gen6 to a ConnectX-8 on the GPU board, while the "
        "host is reached at Gen5). None: pcie_Bps.",
    )
    host_memory_Bps: float | None = Field(
        default=None,
        gt=0,
        description="Host memory bandwidth per node, all sockets (B/s): what an offloaded "
        "optimizer's host step runs at (None: unknown; offload is then refused).",
    )
    nvlink_latency_s: float = Field(ge=0, description="Small-message NVLink latency (s).")
    ib_latency_s: float = Field(ge=0, description="Small-message InfiniBand latency (s).")
    kernel_overhead_s: float = Field(
        default=4e-6,
        ge=0,
        description="GPU time per kernel beyond its work (s): launch latency and "
        "under-filled waves. Default: a convention of a few microseconds per launch.",
    )
    host_overhead_s: float = Field(
        default=0.0,
        ge=0,
        description="Host time per kernel the cost model counts (s): the framework's Python, "
        "autograd and the launch, overlapped with the GPU's work; 0 when the host never binds. "
        "The catalog's machines state 70 us, measured on an eager PyTorch layer.",
    )
    framework_host_overhead_s: dict[str, float] = Field(
        default_factory=dict,
        description="Host time per counted kernel (s) for jobs of the frameworks named, where "
        "it differs from host_overhead_s: the host's time is the framework's Python as much as "
        "the CPU's (planner calibrate --runs fits one per framework among the runs).",
    )
    framework_fragmentation: dict[str, float] = Field(
        default_factory=dict,
        description="Caching allocator's reserved over allocated bytes, less 1, measured on this "
        "machine per framework (planner calibrate --log): a job of that framework that does "
        "not set TrainingJob.fragmentation takes it.",
    )
    framework_buffers_at_peak: dict[str, float] = Field(
        default_factory=dict,
        description="Share of the transient buffers live at the memory peak, measured on this "
        "machine per framework (planner calibrate --log): a job of that framework that does "
        "not set TrainingJob.buffers_at_peak takes it.",
    )
    achieved: dict[str, float] = Field(
        description="Achieved fraction of peak per kind of work (gemm, attention, memory_bound, "
        "nvlink, ib): starting points before calibration."
    )
    sustained_tensor_rate: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Tensor-core rate a training run sustains at the GPU's power limit over the "
        "rate of a short timing (what the achieved GEMM and attention fractions are): GEMMs "
        "and attention run at their fraction times this. 1: not measured, no slowing.",
    )
    achieved_max: dict[str, float] = Field(
        default_factory=dict,
        description="Highest achieved fraction a fit may set per kind of work (e.g. gemm: the "
        "best matmul rate measured on this GPU); kinds not named are capped at 1 (peak).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ClusterSpec:
        if self.hbm_reserved_bytes >= self.hbm_bytes:
            raise PlannerError(
                f"ClusterSpec.hbm_reserved_bytes={self.hbm_reserved_bytes}: must be below "
                f"hbm_bytes={self.hbm_bytes} (some HBM must be left to allocate)"
            )
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise PlannerError(
                f"ClusterSpec.num_gpus={self.num_gpus}: above one node it must be a whole "
                f"number of nodes (a multiple of gpus_per_node={self.gpus_per_node})"
            )
        domain = self.nvlink_domain_gpus
        if domain is not None and domain % self.gpus_per_node:
            raise PlannerError(
                f"ClusterSpec.nvlink_domain_gpus={domain}: must be a whole number of nodes (a "
                f"multiple of gpus_per_node={self.gpus_per_node})"
            )
        peer = self.nvlink_peer_Bps
        if peer is not None:
            if domain not in (None, self.gpus_per_node) or self.gpus_per_node < 2:
                raise PlannerError(
                    f"ClusterSpec.nvlink_peer_Bps={peer:g}: a full mesh links the GPUs of one "
                    f"node (at least 2, and no nvlink_domain_gpus beyond it); this cluster has "
                    f"gpus_per_node={self.gpus_per_node}, nvlink_domain_gpus={domain}"
                )
            if peer > self.nvlink_Bps:
                raise PlannerError(
                    f"ClusterSpec.nvlink_peer_Bps={peer:g}: one link cannot carry more than "
                    f"all of a GPU's links, nvlink_Bps={self.nvlink_Bps:g} B/s"
                )
        for key, value in self.achieved.items():
            if not 0 < value <= 1:
                raise PlannerError(f"ClusterSpec.achieved.{key}={value}: must be in (0, 1]")
        # as TrainingJob.fragmentation (below 1) and TrainingJob.buffers_at_peak (up to 1)
        for field, top in (("framework_fragmentation", "1)"), ("framework_buffers_at_peak", "1]")):
            for name, value in getattr(self, field).items():
                if name not in FRAMEWORKS:
                    raise PlannerError(
                        f"ClusterSpec.{field}.{name}: not a framework; use one of "
                        f"{', '.join(FRAMEWORK_NAMES)}"
                    )
                below_top = value < 1 if top == "1)" else value <= 1
                if not (math.isfinite(value) and value >= 0 and below_top):
                    raise PlannerError(f"ClusterSpec.{field}.{name}={value}: must be in [0, {top}")
        for name, seconds in self.framework_host_overhead_s.items():
            if name not in FRAMEWORKS:
                raise PlannerError(
                    f"ClusterSpec.framework_host_overhead_s.{name}: not a framework; use one of "
                    f"{', '.join(FRAMEWORK_NAMES)}"
                )
            if not (math.isfinite(seconds) and seconds >= 0):
                raise PlannerError(
                    f"ClusterSpec.framework_host_overhead_s.{name}={seconds}: must be a "
                    "non-negative number of seconds"
                )
        return self

    def job_on(self, job: TrainingJob) -> TrainingJob:
        """``job`` with this machine's measured memory figures for its framework
        (``framework_fragmentation``, ``framework_buffers_at_peak``) where the job does not set
        its own."""
        update = {
            key: table[job.framework]
            for key, table in (
                ("fragmentation", self.framework_fragmentation),
                ("buffers_at_peak", self.framework_buffers_at_peak),
            )
            if job.framework in table and key not in job.model_fields_set
        }
        return job.model_copy(update=update) if update else job

    @property
    def usable_hbm_bytes(self) -> int:
        """HBM a process can allocate per GPU (bytes): nominal less what the driver keeps."""
        return self.hbm_bytes - self.hbm_reserved_bytes

    @property
    def num_nodes(self) -> int:
        """Nodes the job spans (a partial node counts as one)."""
        return max(1, self.num_gpus // self.gpus_per_node)

    @property
    def domain_gpus(self) -> int:
        """GPUs of this job that share one NVLink domain, as the job is placed: the node's
        GPUs where NVLink stays in the node; on a rack-scale fabric the largest whole number
        of nodes, at most ``nvlink_domain_gpus``, that divides the job: the whole job when it
        fits one domain (NVIDIA's GB200 performance runs ask Slurm for that segment: 16 trays
        of 4 per rack for 64, 128 or 256 GPUs; see ``hardware/gb200.yaml``). The job's ranks
        fill one domain after another."""
        per_node, domain = self.gpus_per_node, self.nvlink_domain_gpus
        if domain is None or domain == per_node or self.num_gpus <= per_node:
            return per_node
        nodes = self.num_gpus // per_node
        most = domain // per_node
        return per_node * max(k for k in range(1, most + 1) if nodes % k == 0)

    def topology(self) -> Any:
        """The cluster as a networkx graph (see ``planner.topology``), built on each call."""
        from planner.topology import build_topology

        return build_topology(self)


# What each framework keeps its state in when the user does not say (TrainingJob fields left
# out take these; the others the field defaults): the registry's entries, with their sources
# (``planner.frameworks``).
FRAMEWORK_DTYPES: dict[str, dict[str, str | None]] = {
    name: {
        "weight_dtype": f.weight_dtype,
        "grad_dtype": f.grad_dtype,
        "master_dtype": f.master_dtype,
    }
    for name, f in FRAMEWORKS.items()
}


def _has(f: Any, field: str) -> bool:
    """Whether framework ``f`` has the switch ``field`` (a ``Framework`` field)."""
    return bool(getattr(f, field))


# Job settings only some frameworks run (Framework fields), and what the others do instead.
FRAMEWORK_SWITCHES = (
    ("compiled_loss", "compiles_loss", "runs its own cross-entropy; only {names} compile the loss"),
    (
        "moe_force_balance",
        "force_balance",
        "has no switch for it (Megatron-LM's --moe-router-force-load-balancing); {names} have one",
    ),
    (
        "compiled_model",
        "eager_model",
        "runs its own kernels; only {names} compiles its model with torch.compile",
    ),
    (
        "loss_chunks",
        "chunks_loss",
        "runs the loss over the whole logits; chunking it is {names}'s (ChunkedCELoss)",
    ),
    (
        "exposed_grad_reduce",
        "grad_reduce_switch",
        "overlaps its gradient reduction as it runs; only {names} have a switch for it",
    ),
    (
        "eager_norm",
        "eager_model",
        "runs its own norm kernels; the eager RMSNorm class of its own model code was {names}'s",
    ),
)


class TrainingJob(Spec):
    """What one training step does and which precisions it keeps its state in. The state
    dtypes a job leaves out are its framework's defaults (``FRAMEWORK_DTYPES``)."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "sequence_parallel" in data:
            raise PlannerError(
                f"TrainingJob.sequence_parallel={data['sequence_parallel']!r}: sequence "
                f"parallelism is a layout decision now (Layout.sequence_parallel, searched "
                f"through SearchSpace.sequence_parallel)"
            )
        return data

    @model_validator(mode="after")
    def _framework_dtypes(self) -> TrainingJob:
        # Fields the user left out take the framework's value; model_fields_set keeps only
        # what the user gave, so with_framework can re-derive them for another framework.
        for key, value in FRAMEWORK_DTYPES[self.framework].items():
            if key not in self.model_fields_set:
                object.__setattr__(self, key, value)
        return self

    @model_validator(mode="after")
    def _framework_switches(self) -> TrainingJob:
        fw = framework(self.framework)
        for field, has, others in FRAMEWORK_SWITCHES:
            value = getattr(self, field)
            if (value > 1 if field == "loss_chunks" else value) and not getattr(fw, has):
                names = names_with(partial(_has, field=has))
                raise PlannerError(
                    f"TrainingJob.{field}={value!r}: framework={self.framework!r} "
                    + others.format(names=names)
                )
        return self

    @model_validator(mode="after")
    def _loss_fusion_framework(self) -> TrainingJob:
        offered = framework(self.framework).loss_fusions
        if self.loss_fusion not in offered:
            raise PlannerError(
                f"TrainingJob.loss_fusion={self.loss_fusion!r}: framework={self.framework!r} "
                f"offers {', '.join(offered)} (a fused cross-entropy runs under "
                f"{names_with(lambda f: len(f.loss_fusions) > 1)})"
            )
        return self

    @model_validator(mode="after")
    def _dispatcher_framework(self) -> TrainingJob:
        runs = framework(self.framework).dispatchers
        if self.moe_dispatcher not in runs:
            raise PlannerError(
                f"TrainingJob.moe_dispatcher={self.moe_dispatcher!r}: framework="
                f"{self.framework!r} runs {', '.join(runs)}"
            )
        return self

    @model_validator(mode="after")
    def _grouped_tensor_framework(self) -> TrainingJob:
        if self.moe_grouped_tensor and not framework(self.framework).expert_gemm_launch_s:
            raise PlannerError(
                f"TrainingJob.moe_grouped_tensor=True: framework={self.framework!r} does not "
                "launch its experts' GEMMs one by one; the switch is Megatron-LM's "
                "(--moe-use-grouped-tensor)"
            )
        return self

    def with_framework(self, name: str) -> TrainingJob:
        """This job run by framework ``name``: the dtypes it was given stay, the others become
        that framework's defaults; a setting of ``FRAMEWORK_SWITCHES`` (a compiled loss or
        model, a chunked loss, routing by random logits) stays only where the framework runs
        it, a fused cross-entropy only where the framework offers it (Megatron-LM); the grouped
        expert kernel only where the framework would otherwise launch its experts one by one
        (elsewhere they already are one kernel)."""
        given = self.model_dump(include=self.model_fields_set - {"framework"})
        for field, has, _ in FRAMEWORK_SWITCHES:
            if not getattr(framework(name), has):
                given.pop(field, None)
        if given.get("loss_fusion") not in framework(name).loss_fusions:
            given.pop("loss_fusion", None)
        if not framework(name).expert_gemm_launch_s:
            given.pop("moe_grouped_tensor", None)
        return TrainingJob(**given, framework=name)

    @field_validator("framework")
    @classmethod
    def _known_framework(cls, value: str) -> str:
        if value not in FRAMEWORKS:
            raise PlannerError(
                f"TrainingJob.framework={value!r}: use one of {', '.join(FRAMEWORK_NAMES)}"
            )
        return value

    seq_len: int = Field(gt=0, description="Tokens per sequence.")
    global_batch: int = Field(gt=0, description="Sequences per optimizer step.")
    weight_dtype: DType = Field(
        default="bf16",
        description="Dtype the parameters are kept in (framework default; an FP32 copy is "
        "cast to the activation dtype for compute and gathers).",
    )
    grad_dtype: DType = Field(
        default="fp32", description="Dtype of the gradient buffers (framework default)."
    )
    master_dtype: DType | None = Field(
        default="fp32",
        description="Dtype of the optimizer's master weights (None: the parameters are the "
        "master copy; framework default).",
    )
    moment_dtype: DType = Field(
        default="fp32",
        description="Dtype of the optimizer moments. Megatron-LM keeps narrower ones only "
        "through its distributed optimizer (ZeRO-1); at other ZeRO stages they are FP32.",
    )
    compute_dtype: Literal["bf16", "fp8"] = Field(default="bf16", description="GEMM precision.")
    activation_dtype: DType = Field(default="bf16", description="Dtype of saved activations.")
    optimizer: Literal["adamw", "sgd"] = Field(
        default="adamw", description="adamw keeps two moments per parameter; sgd with momentum one."
    )
    ema: DType | None = Field(
        default=None,
        description="Dtype of an exponential moving average of the weights (None: no EMA).",
    )
    flash_attention: bool = Field(
        default=True, description="Fused attention: no s^2 tensors are saved."
    )
    transformer_engine: bool | None = Field(
        default=None,
        description="The framework runs Transformer Engine's modules (None: its own default, "
        "planner.frameworks' Framework.transformer_engine). False for Megatron-LM's "
        "--transformer-impl local: no TE workspace and, without flash attention, Megatron-LM's "
        "own core attention, which keeps one score-sized buffer for the run "
        "(planner.costs.memory.core_attention_buffer_bytes).",
    )
    framework: str = Field(
        default=DEFAULT_FRAMEWORK,
        description="The training software: what it overlaps with compute (tensor-parallel "
        "communication, ZeRO gathers and reduce-scatters, the gradient reduction) and what it "
        "holds; one of planner.frameworks.FRAMEWORKS. An export's target implies it.",
    )
    # torchtitan compiles its loss with torch.compile when compile is on (compile.components
    # holds "loss" by default) since commit bbb1b616e (2025-04-02, PR #1033, "result in
    # reduction of memory"); before it, train.py left the loss eager ("compiling loss function
    # causes CUDA errors, turning off for now", at 9dec370, 2024-12-26). Inductor fuses the
    # FP32 upcast, log-softmax and its backward: the loss keeps the BF16 logits and writes their
    # BF16 gradient, where the eager loss keeps an FP32 copy and FP32 gradients.
    compiled_loss: bool = Field(
        default=False,
        description="The cross-entropy runs under torch.compile (torchtitan with "
        "compile.enable since April 2025, or an eager torch runtime that compiles it): the "
        "loss keeps the logits in the activation dtype and no FP32 copy. torchtitan and torch "
        "only.",
    )
    # torchtitan's model code runs as eager PyTorch ops unless compile.enable holds the model
    # (job_config.py: compile.enable False by default): each TransformerBlock is then
    # compiled ("Compiling each TransformerBlock with torch.compile", llama3/infra/
    # parallelize.py at v0.2.2) and Inductor fuses its elementwise ops.
    compiled_model: bool = Field(
        default=False,
        description="The model's layers run under torch.compile (torchtitan's compile.enable "
        "with the model among compile.components): their elementwise ops fused. False: "
        "torchtitan's model code runs eager ops, each a kernel of its own "
        "(Framework.eager_model), unless a compiled loss or async tensor parallelism, which "
        "compile the model with it, says otherwise. torchtitan only.",
    )
    # torchtitan before 2025-04 (#1115): its own RMSNorm class (torchtitan/models/norms.py at
    # 9dec370, the model's default norm_type "rmsnorm") ran x.float(), pow, mean, rsqrt,
    # type_as and the weight's multiply, a kernel each, and kept the FP32 input for backward.
    eager_norm: bool = Field(
        default=False,
        description="The model code's own eager RMSNorm (torchtitan before April 2025: its "
        "RMSNorm class, norm_type 'rmsnorm'), a kernel per op over an FP32 copy of the input, "
        "in place of the fused nn.RMSNorm; priced where the model runs uncompiled. torchtitan "
        "only.",
    )
    # torchtitan's Qwen3 tensor-parallel plan up to 8c1d1c5f (2025-10-14, PR #1870 "Remove
    # unnecessary all-gather qwen3", after issue #1867): q_norm and k_norm ran as NoParallel
    # with a Replicate output (torchtitan/distributed/__init__.py's NoParallel redistributes
    # its DTensor output to it), so each layer all-gathered q and k over the tensor-parallel
    # group, forward and backward, and the rotary embedding ran on every head on every rank.
    qk_norm_gathered: bool = Field(
        default=False,
        description="q and k are all-gathered over the tensor-parallel group after their norms "
        "and the rotary embedding runs unsharded (torchtitan's Qwen3 before commit 8c1d1c5f, "
        "PR #1870); only where the model has q/k norms and tp > 1.",
    )
    # torchtitan's ChunkedCELoss (torchtitan/components/loss.py; its recipes' loss since
    # 786e26f8, 2026-04-27, num_chunks 8, after v0.2.2's TOML configs): the final norm's
    # output is cut by token into chunks, and each chunk's output layer, loss and their
    # backward run in forward, its input gradient gathered in an FP32 buffer.
    loss_chunks: int = Field(
        default=1,
        ge=1,
        description="The output layer and loss run over this many chunks of a micro-batch's "
        "tokens, each chunk's backward at once (torchtitan's ChunkedCELoss num_chunks, 8 in "
        "its recipes since April 2026): a chunk's logits live at a time, and an FP32 "
        "gradient of the output layer's input is kept instead. 1: the whole logits at once. "
        "torchtitan only.",
    )
    # Megatron-LM's fused cross-entropy (--cross-entropy-loss-fusion, with
    # --cross-entropy-fusion-impl; planner.costs.blocks prices what each holds). Megatron-LM's
    # own training script refuses the TE implementation since 2025 ("disabled due to
    # stability issues", megatron/training/arguments.py at d98e8a64); Megatron-Bridge runs it
    # (its performance recipes set cross_entropy_fusion_impl: "te").
    loss_fusion: Literal["none", "native", "te"] = Field(
        default="none",
        description="Megatron-LM's fused cross-entropy: 'none' (the vocab-parallel "
        "cross-entropy in place over one FP32 copy of the logits), 'native' "
        "(--cross-entropy-loss-fusion: the same under torch.compile, one FP32 copy more while "
        "it runs) or 'te' (--cross-entropy-fusion-impl te: Transformer Engine's kernel writes "
        "the gradient over the logits, no FP32 copy). Megatron-LM only.",
    )
    # Default 1.04: Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for
    # Mixture-of-Experts" (arXiv 2408.15664), Table 2: MaxVio_global = max expert load / mean
    # load - 1 = 0.04 for Loss-Free Balancing (the router DeepSeek-V3 uses) on its 1B and 3B
    # models; auxiliary-loss balancing reaches 0.72 (1B) and 0.52 (3B). It is a global,
    # per-expert figure: one micro-batch is noisier (the paper plots MaxVio_batch but gives no
    # number), while a rank holding several experts averages part of it out. So 1.04 is the
    # least a balanced router shows, not a worst case. Applies only with ep > 1 (with ep = 1
    # a rank holds every expert and receives exactly its own tokens' copies).
    # How the tokens reach their experts (Megatron-LM --moe-token-dispatcher-type, torchtitan
    # comm_backend): NCCL all-to-all; an all-gather of every token of the expert-parallel
    # group and a reduce-scatter back (Megatron-LM's allgather, its parser's default); or
    # DeepEP's kernels (Megatron-LM flex with backend deepep, torchtitan deepep), which send
    # a token across InfiniBand once per node it visits and forward it over NVLink (DeepEP
    # csrc/kernels/legacy/layout.cu counts a token once per node; internode.cu's NVLink
    # forwarder). Only DeepEP deduplicates: a plain all-to-all carries every copy.
    moe_dispatcher: Literal["alltoall", "allgather", "deepep"] = Field(
        default="alltoall",
        description="How MoE tokens reach their experts: 'alltoall' (NCCL all-to-all, one "
        "copy per routed expert), 'allgather' (every token of the expert-parallel group "
        "gathered, outputs reduce-scattered) or 'deepep' (DeepEP kernels: one InfiniBand copy "
        "per node a token visits, forwarded over NVLink). Each framework runs some of them.",
    )
    # Megatron-LM's routed experts run through Transformer Engine's GroupedLinear, one cuBLAS
    # GEMM per local expert launched by the host once it has read the tokens per expert
    # (Framework.expert_gemm_launch_s); --moe-use-grouped-tensor (TransformerConfig at
    # d98e8a64; the TE operation fuser turns it on) runs them as one grouped kernel with the
    # splits on the device instead, which CUDA graphs can capture.
    moe_grouped_tensor: bool = Field(
        default=False,
        description="Megatron-LM's --moe-use-grouped-tensor: the routed experts' GEMMs as one "
        "grouped kernel with device-side splits, not one launch per local expert. Only where "
        "the framework launches them one by one (Megatron-LM); torchtitan's are one kernel.",
    )
    # Megatron-LM's --moe-router-force-load-balancing (TransformerConfig.
    # moe_router_force_load_balancing, router.py and moe_utils.apply_random_logits at
    # d98e8a64): for benchmarks, the router's logits are replaced by random normal ones, their
    # gradient passed straight through to the router's.
    moe_force_balance: bool = Field(
        default=False,
        description="Megatron-LM's --moe-router-force-load-balancing: routing by random "
        "normal logits (a straight-through estimator), tokens spread evenly over the experts "
        "in expectation whatever the router learned; the planner's own runtime draws them on "
        "the CPU, so their routing is known before a run (planner.run.requests). Priced as "
        "any router: moe_load_imbalance.",
    )
    attention_kernel: Literal["fused", "fa2"] = Field(
        default="fused",
        description="The fused attention kernel the training runs: 'fused' the GPU's fastest "
        "(cuDNN through Transformer Engine or PyTorch, FlashAttention-3; "
        "achieved['attention']), 'fa2' FlashAttention-2 (the flash-attn 2 package, PyTorch's "
        "SDPA flash backend, which torchtitan picked on Hopper before October 2025; "
        "achieved['attention_fa2'], well below the fastest on Hopper).",
    )
    # Megatron-LM overlaps tensor-parallel collectives only under --tp-comm-overlap (off by
    # default in its parser; Transformer Engine's userbuffers, with sequence parallelism);
    # torchtitan only under parallelism.enable_async_tensor_parallel, which runs under
    # torch.compile of the model (job_config.py at v0.2.2). The exports write the switches.
    tp_comm_overlap: bool = Field(
        default=True,
        description="The framework's tensor-parallel communication overlap is switched on "
        "(Megatron-LM --tp-comm-overlap, torchtitan async TP); False leaves every "
        "tensor-parallel collective exposed, as each framework runs by default.",
    )
    # Megatron-LM reduces the gradients beside the last backward only under
    # --overlap-grad-reduce (off in its parser); its 2021 local DDP never did
    # (planner.frameworks, megatron-2021). The exports write the switch.
    exposed_grad_reduce: bool = Field(
        default=False,
        description="The data-parallel gradient reduction runs after the step's last backward "
        "instead of beside it (Megatron-LM without --overlap-grad-reduce); False overlaps it "
        "as the framework can.",
    )
    moe_load_imbalance: float = Field(
        default=1.04,
        ge=1.0,
        description="Busiest expert-parallel rank's routed tokens / the balanced share, per "
        "micro-batch (used only when ep > 1). Default 1.04: MaxVio_global = 0.04 of "
        "Loss-Free Balancing (DeepSeek-V3's router) in Wang et al. 2024, arXiv 2408.15664, "
        "Table 2; a global per-expert figure, so a floor for one micro-batch. Auxiliary-loss "
        "routers measured 1.52-1.72 there (MaxVio_global 0.52 and 0.72).",
    )
    cuda_context_bytes: int = Field(
        default=int(0.75 * 2**30), ge=0, description="CUDA context and kernels per GPU (bytes)."
    )
    comm_buffer_bytes: int = Field(
        default=int(1.0 * 2**30),
        ge=0,
        description="NCCL communication buffers per GPU (bytes); seed 001 section 6: 0.8-2 GB.",
    )
    workspace_bytes: int | None = Field(
        default=None,
        ge=0,
        description="GEMM libraries' workspaces held in PyTorch's caching allocator for the "
        "whole run, per GPU (bytes): PyTorch's cuBLAS workspace, and where the framework runs "
        "Transformer Engine its GEMM workspace and, with routed experts, its grouped GEMM's "
        "four streams' (planner.costs.memory.workspace_bytes). None: those libraries' sizes "
        "at compute capability 9.0 and up (32 MiB each); older GPUs take less "
        "(planner.costs.memory.workspace_bytes(..., sm90=False)).",
    )
    fragmentation: float = Field(
        default=0.10,
        ge=0,
        lt=1,
        description="Allocator fragmentation as a fraction of allocated bytes; seed 001: 5-30%.",
    )
    buffers_at_peak: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="Share of the transient buffers (pipeline transfers, reduce buckets, "
        "ZeRO-3's gathered weights, the context-parallel ring, an eager backward's temporaries) "
        "live at the rank's memory peak. 1 (the default) adds them all to the peak; a "
        "calibrated machine states its own per framework (ClusterSpec.framework_buffers_at_peak, "
        "planner calibrate --log).",
    )
    # Default 0.05: planner validate (benchmarks/RESULTS.md) finds the predicted per-rank
    # peak within 4.8% of real runs on every rank of its 11 layouts, median 1.6% (23 ranks),
    # and Megatron-LM's CI memory tests of a 7B model (benchmarks/published_memory.py) within
    # 2.2%. A 5% margin covers every rank measured.
    memory_margin: float = Field(
        default=0.05,
        ge=0,
        lt=0.5,
        description="Fraction of usable HBM kept free for the memory model's own error: a "
        "rank's predicted peak may reach usable_hbm_bytes * (1 - memory_margin). Default "
        "0.05: planner validate keeps every rank's predicted peak within 4.8% of real runs, "
        "median 1.6% (benchmarks/RESULTS.md).",
    )

    @property
    def working_weight_dtype(self) -> str:
        """Dtype the weights are computed with and gathered in: FP32 parameters are cast to
        the activation dtype first (mixed precision; FSDP2's param_dtype)."""
        if DTYPE_BYTES[self.activation_dtype] < DTYPE_BYTES[self.weight_dtype]:
            return self.activation_dtype
        return self.weight_dtype

    @property
    def tokens_per_step(self) -> int:
        """Tokens consumed by one optimizer step."""
        return self.seq_len * self.global_batch


class SearchSpace(Spec):
    """Allowed values of each decision; ``None`` leaves a decision free."""

    tp: list[int] | None = Field(default=None, description="Allowed tensor-parallel degrees.")
    cp: list[int] | None = Field(
        default=None,
        description="Allowed context-parallel degrees (None: those that leave each rank at "
        "least 4,096 tokens of a sequence, solve.space.CP_MIN_TOKENS).",
    )
    cp_comm_type: list[Literal["p2p", "a2a", "a2a+p2p"]] | None = Field(
        default=None,
        description="Allowed Layout.cp_comm_type values where cp > 1 (None: all three, where "
        "the model's heads split over the all-to-all's ranks and the framework runs them; "
        "a2a+p2p with its all-to-all over the cp ranks one node holds).",
    )
    pp: list[int] | None = Field(default=None, description="Allowed pipeline degrees.")
    dp: list[int] | None = Field(default=None, description="Allowed data-parallel degrees.")
    ep: list[int] | None = Field(default=None, description="Allowed expert-parallel degrees.")
    etp: list[int] | None = Field(
        default=None,
        description="Allowed expert tensor-parallel degrees (None: 1 and the configuration's "
        "tp, Megatron-LM's default).",
    )
    zero: list[Literal[0, 1, 2, 3]] | None = Field(default=None, description="Allowed ZeRO stages.")
    param_offload: list[bool] | None = Field(
        default=None,
        description="Allowed Layout.param_offload values under ZeRO-3 (None: off; [False, "
        "True] searches both where the framework has it, DeepSpeed's offload_param).",
    )
    zero_hpz: list[int] | None = Field(
        default=None,
        description="Allowed Layout.zero_hpz values under ZeRO-3 (None: 1, and the GPUs a node "
        "has where the framework has ZeRO++'s hierarchical partitioning and pure data "
        "parallelism spans nodes).",
    )
    micro_batch: list[int] | None = Field(default=None, description="Allowed micro-batch sizes.")
    schedules: list[str] | None = Field(default=None, description="Allowed pipeline schedules.")
    virtual_stages: list[int] | None = Field(default=None, description="Allowed chunks per rank.")
    recompute: list[str] | None = Field(
        default=None, description="Allowed recompute choices (none, selective, full, module sets)."
    )
    ema: list[Literal["hbm", "host"]] | None = Field(default=None, description="EMA placements.")
    optimizer_offload: list[float] | None = Field(
        default=None,
        description="Allowed Layout.optimizer_offload fractions, each in [0, 1] (None: 0, no "
        "offload; it is searched only when asked, e.g. [0, 1], since it doubles the "
        "configurations one time budget has to cover).",
    )
    fp8_cache: list[bool] | None = Field(
        default=None,
        description="Allowed Layout.fp8_cache values (None: off; [False, True] searches both, "
        "for FP8 Megatron-LM jobs).",
    )
    sequence_parallel: list[bool] | None = Field(
        default=None,
        description="Allowed Layout.sequence_parallel values where tp > 1 (None: on, which "
        "never loses: the same bytes moved, fewer kept, and Megatron-LM's tensor-parallel "
        "overlap needs it; [False, True] searches both).",
    )
    framework: str | list[str] | None = Field(
        default=None,
        description="The framework that runs the plan: only layouts it runs, priced as it runs "
        "them. None: the job's framework (any layout for one without a launcher); a name or a "
        "list of names from planner.frameworks.LAUNCHERS; 'any': each of them. With several, "
        "each is searched (the time limit shared), the plan is the fastest, its job carries the "
        "framework chosen, and Plan.frameworks says what the best plan of each costs. Also "
        "accepted as target= (an export's word for it).",
    )

    @model_validator(mode="before")
    @classmethod
    def _target_is_framework(cls, data: Any) -> Any:
        if isinstance(data, dict) and "target" in data:
            data = dict(data)
            target = data.pop("target")
            if data.get("framework", target) != target:
                raise PlannerError(
                    f"SearchSpace.target={target!r} and framework={data['framework']!r}: "
                    "the same setting; give one"
                )
            data["framework"] = target
        return data

    @field_validator("framework")
    @classmethod
    def _known_framework(cls, value: str | list[str] | None) -> str | list[str] | None:
        names = [value] if isinstance(value, str) else value or []
        if isinstance(value, list) and not value:
            raise PlannerError("SearchSpace.framework=[]: name at least one framework")
        for name in names:
            if name not in LAUNCHERS and not (name == "any" and isinstance(value, str)):
                raise PlannerError(
                    f"SearchSpace.framework={value!r}: use one of any, {', '.join(LAUNCHERS)}"
                )
        return value

    @property
    def target(self) -> str | list[str] | None:
        """``framework`` by the word exports use for it."""
        return self.framework

    def frameworks_for(self, job: TrainingJob) -> list[str | None]:
        """The frameworks searched for ``job``, each a launcher's name (None: any layout,
        for a job whose framework has none, like the eager ``torch`` runtime)."""
        if self.framework is None:
            return [job.framework if job.framework in LAUNCHERS else None]
        if self.framework == "any":
            return list(LAUNCHERS)
        if isinstance(self.framework, str):
            return [self.framework]
        return list(dict.fromkeys(self.framework))

    @model_validator(mode="after")
    def _positive(self) -> SearchSpace:
        for key in (
            "tp",
            "cp",
            "pp",
            "dp",
            "ep",
            "etp",
            "micro_batch",
            "virtual_stages",
            "zero_hpz",
        ):
            values = getattr(self, key)
            if values is not None and (not values or min(values) <= 0):
                raise PlannerError(f"SearchSpace.{key}={values}: needs positive values")
        offload = self.optimizer_offload
        if offload is not None and (not offload or not all(0 <= f <= 1 for f in offload)):
            raise PlannerError(
                f"SearchSpace.optimizer_offload={offload}: needs fractions in [0, 1]"
            )
        return self
