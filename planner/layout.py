"""A layout: how one model is laid out over the cluster, the planner's answer and its input.

Vocabulary (used everywhere inside): ``tp`` tensor, ``cp`` context, ``pp`` pipeline, ``dp``
data and ``ep`` expert parallel degrees. World size is ``tp * cp * pp * dp``. Routed experts
are sharded over ``ep`` ranks and replicated over ``dp * cp * tp / ep`` (expert tensor
parallelism is 1, the DeepSeek-V3 recipe); dense weights are split over ``tp`` and replicated
over ``dp * cp``. Context-parallel ranks hold other tokens of the same sequences: the batch
is split over ``dp`` only.

Rank order (tp innermost, then cp, then dp, then pp, as Megatron-LM orders them) belongs to the
communication model; here a rank is identified by its pipeline position only, because all
ranks of one pipeline position hold the same amount of memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from planner.errors import PlannerError
from planner.schedules import SCHEDULE_NAMES, schedule_of
from planner.specs import ModelSpec, Spec

Schedule = str  # a name in planner.schedules.SCHEDULES
SCHEDULES: tuple[str, ...] = SCHEDULE_NAMES

# Megatron-LM's --recompute-modules vocabulary (megatron/core/transformer/transformer_config.py).
# Megatron-LM's --offload-modules vocabulary that the cost model prices (costs.blocks).
OFFLOAD_MODULES: tuple[str, ...] = ("core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
RECOMPUTE_MODULES: tuple[str, ...] = (
    "core_attn",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "moe_act",
    "shared_experts",
)


# What a model must have for each recompute or offload module to name anything in it, and
# what naming the module without that means.
_NEEDS: dict[str, tuple[str, Callable[[ModelSpec], bool]]] = {
    "mla_up_proj": (
        "its attention is not multi-head latent attention",
        lambda m: m.attention == "mla",
    ),
    "mlp": (
        "every layer is MoE (recompute moe or moe_act)",
        lambda m: any(not m.is_moe_layer(i) for i in range(m.num_layers)),
    ),
    "moe": ("it has no routed experts", lambda m: m.num_experts > 0),
    "moe_act": ("it has no routed experts", lambda m: m.num_experts > 0),
    "expert_fc1": ("it has no routed experts", lambda m: m.num_experts > 0),
    "shared_experts": ("it has no shared experts", lambda m: m.num_shared_experts > 0),
}


def model_lacks(model: ModelSpec, module: str) -> str:
    """Why ``model`` has nothing for the recompute or offload ``module`` to name ("" when it
    has)."""
    why, has = _NEEDS.get(module, ("", lambda m: True))
    return "" if has(model) else why


def model_modules(model: ModelSpec) -> list[str]:
    """The ``RECOMPUTE_MODULES`` that name something in ``model``, in that order."""
    return [m for m in RECOMPUTE_MODULES if not model_lacks(model, m)]


def parse_recompute(choice: str) -> frozenset[str] | Literal["full", "offload"]:
    """``"none"`` -> {}, ``"selective"`` -> Megatron's default {core_attn}, ``"full"`` -> keep
    only the block input, ``"layernorm+mla_up_proj"`` -> those modules, ``"offload"`` -> keep
    everything, on the host (``costs.blocks.OFFLOAD``)."""
    if choice in ("full", "offload"):
        return choice  # type: ignore[return-value]
    if choice == "none":
        return frozenset()
    if choice == "selective":
        return frozenset({"core_attn"})
    if choice == "op":  # torchtitan's per-op selective checkpointing (costs.blocks.OP)
        return frozenset({"op"})
    modules = frozenset(choice.split("+"))
    offloads = {"offload:" + m for m in OFFLOAD_MODULES}
    unknown = sorted(modules - set(RECOMPUTE_MODULES) - offloads)
    if unknown:
        raise PlannerError(
            f"recompute={choice!r}: unknown module {unknown[0]!r}; use none, selective, full, op, "
            f"offload or '+'-joined modules from {', '.join(RECOMPUTE_MODULES)} and "
            f"offload:<module> for {', '.join(OFFLOAD_MODULES)}"
        )
    return modules


def chunks_of(schedule: str, pp: int, virtual_stages: int, rank: int) -> list[int]:
    """Stage indices pipeline rank ``rank`` holds under ``schedule`` (see
    ``Layout.chunks_of_rank``)."""
    return schedule_of(schedule).chunks(pp, virtual_stages, rank)


class BlockPlacement(Spec):
    """One block of the model on a stage, with its recompute choice."""

    block: str = Field(description="Block name: embedding, layer.<i>, mtp.<j> or head.")
    recompute: str = Field(
        default="none",
        description="none | selective | full | op (torchtitan's per-op selective "
        "checkpointing) | '+'-joined Megatron recompute modules.",
    )

    @model_validator(mode="after")
    def _known_choice(self) -> BlockPlacement:
        parse_recompute(self.recompute)
        return self


@functools.lru_cache(maxsize=65536)
def _placement(block: str, recompute: str) -> BlockPlacement:
    """Placements are frozen, so layouts built by the thousand (the search) share them."""
    return BlockPlacement(block=block, recompute=recompute)


class Stage(Spec):
    """A contiguous run of blocks that one pipeline rank (or one virtual chunk) executes."""

    blocks: list[BlockPlacement] = Field(min_length=1, description="Blocks in execution order.")


class Layout(Spec):
    """Parallel degrees, ZeRO stage, micro-batching, schedule and per-block placement."""

    tp: int = Field(default=1, gt=0, description="Tensor-parallel degree (within a node).")
    cp: int = Field(
        default=1,
        gt=0,
        description="Context-parallel degree: each sequence's tokens split over cp ranks, "
        "which share every attention as cp_comm_type says (Megatron-LM --context-parallel-size; "
        "torchtitan context_parallel_degree).",
    )
    cp_comm_type: Literal["p2p", "a2a", "a2a+p2p"] = Field(
        default="p2p",
        description="How the context-parallel ranks share a sequence's attention: p2p, keys "
        "and values passed around a ring behind each attention's work; a2a, all-to-alls that "
        "trade the sequence split for a head split before each attention and back after it, "
        "exposed (DeepSpeed-Ulysses); a2a+p2p, all-to-alls within groups of cp_a2a_size "
        "consecutive cp ranks and a ring across the groups (Megatron-LM --cp-comm-type). No "
        "effect with cp = 1.",
    )
    cp_a2a_size: int | None = Field(
        default=None,
        gt=1,
        description="With cp_comm_type a2a+p2p: the all-to-all level's size, consecutive cp "
        "ranks (1 < size < cp, dividing cp; Megatron-LM --hierarchical-context-parallel-sizes "
        "size cp/size). None otherwise.",
    )
    pp: int = Field(default=1, gt=0, description="Pipeline-parallel degree (ranks).")
    dp: int = Field(default=1, gt=0, description="Data-parallel degree.")
    ep: int = Field(default=1, gt=0, description="Expert-parallel degree (divides dp*cp*tp).")
    etp: int = Field(
        default=1,
        gt=0,
        description="Expert tensor-parallel degree: each routed expert's matrices split over "
        "etp ranks, which gather the tokens dispatched to it and reduce-scatter its output "
        "(Megatron-LM --expert-tensor-parallel-size; ep*etp divides dp*cp*tp, the experts "
        "folded onto the ranks attention uses, as Megatron-Core's MoE parallel folding).",
    )
    zero: Literal[0, 1, 2, 3] = Field(
        default=1, description="0: replicated; 1: shard optimizer; 2: +grads; 3: +weights."
    )
    zero_hpz: int = Field(
        default=1,
        gt=0,
        description="ZeRO++ hierarchical partitioning (DeepSpeed zero_hpz_partition_size; "
        "ZeRO-3 only): above 1, each rank also keeps a secondary shard of its weights over "
        "groups of this many consecutive data-parallel ranks, from which every parameter "
        "gather but a step's first forward one runs. 1: off.",
    )
    optimizer_instances: int = Field(
        default=1,
        gt=0,
        description="ZeRO-1 over a partial data-parallel domain (Megatron-LM's "
        "--num-distributed-optimizer-instances): the gradient group split into this many "
        "instances of consecutive ranks, each sharding the optimizer state over its own ranks "
        "and holding a replica of it; gradients reduce-scattered within an instance, then "
        "all-reduced across instances; weights all-gathered within one. 1: the whole group.",
    )
    param_offload: bool = Field(
        default=False,
        description="ZeRO-3's weight shards (and ZeRO++'s secondary ones) kept in pinned host "
        "memory, each gather copying the rank's shard to the GPU over PCIe first (DeepSpeed "
        "zero_optimization.offload_param; ZeRO-3 only).",
    )
    micro_batch: int = Field(default=1, gt=0, description="Sequences per micro-batch.")
    num_microbatches: int | None = Field(
        default=None, gt=0, description="Micro-batches per step per pipeline (None: from the job)."
    )
    schedule: str = Field(
        default="1f1b", description="Pipeline schedule (a name in planner.schedules.SCHEDULES)."
    )
    virtual_stages: int = Field(default=1, gt=0, description="Model chunks per pipeline rank.")
    stages: list[Stage] = Field(
        min_length=1, description="pp * virtual_stages stages in model order (a chunk each)."
    )
    ema: Literal["hbm", "host"] = Field(
        default="hbm", description="Where the EMA copy lives when the job keeps one."
    )
    optimizer_offload: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Fraction of the rank's optimizer state (master weights and moments) kept "
        "in host memory and stepped by the host CPU, its gradients copied to the host and its "
        "updated weights back over PCIe (Megatron-LM --optimizer-cpu-offload with "
        "--optimizer-offload-fraction; DeepSpeed zero_optimization.offload_optimizer, whole "
        "only). 0: all on the GPU.",
    )
    sequence_parallel: bool = Field(
        default=True,
        description="With tp > 1, the activations outside the tensor-parallel regions (norms, "
        "dropout, residuals) split over the tp ranks by sequence, each region's all-reduce "
        "run as an all-gather and a reduce-scatter (Megatron-LM --sequence-parallel; its "
        "tensor-parallel communication overlap needs it). No effect with tp = 1.",
    )
    fp8_cache: bool = Field(
        default=False,
        description="Keep the activation functions' inputs (SwiGLU's gate and up outputs) in "
        "FP8 for backward instead of BF16 (Megatron-Core TransformerConfig."
        "activation_func_fp8_input_store; DeepSeek-V3 report section 3.3.3); needs FP8 "
        "compute and framework megatron.",
    )

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, value: str) -> str:
        schedule_of(value)  # a one-line error naming the known schedules
        return value

    @model_validator(mode="after")
    def _degrees(self) -> Layout:
        if self.plane % self.ep:
            raise PlannerError(
                f"Layout.ep={self.ep}: expert parallel degree ep={self.ep} must divide "
                f"dp*cp*tp={self.plane}"
            )
        if self.plane % (self.ep * self.etp):
            raise PlannerError(
                f"Layout.etp={self.etp}: ep*etp={self.ep * self.etp} must divide "
                f"dp*cp*tp={self.plane}"
            )
        if self.param_offload and self.zero != 3:
            raise PlannerError(
                f"Layout.param_offload=True: the weights offloaded are ZeRO-3's shards; needs "
                f"zero=3 (has {self.zero})"
            )
        experts = self.plane // (self.ep * self.etp)  # the expert data-parallel group
        if self.optimizer_instances > 1 and (
            self.zero != 1
            or self.grad_group % self.optimizer_instances
            or experts % self.optimizer_instances
        ):
            raise PlannerError(
                f"Layout.optimizer_instances={self.optimizer_instances}: partial distributed "
                f"optimizer domains need zero=1 (has {self.zero}) and a count dividing "
                f"dp*cp={self.grad_group} and the expert data-parallel group ({experts})"
            )
        if self.zero_hpz > 1 and (self.zero != 3 or self.grad_group % self.zero_hpz):
            raise PlannerError(
                f"Layout.zero_hpz={self.zero_hpz}: a secondary ZeRO-3 shard over groups of "
                f"data-parallel ranks needs zero=3 (has {self.zero}) and a size dividing "
                f"dp*cp={self.grad_group}"
            )
        hierarchical = self.cp_comm_type == "a2a+p2p" and self.cp > 1
        if hierarchical and not (
            self.cp_a2a_size and self.cp_a2a_size < self.cp and self.cp % self.cp_a2a_size == 0
        ):
            raise PlannerError(
                f"Layout.cp_a2a_size={self.cp_a2a_size}: cp_comm_type a2a+p2p needs the "
                f"all-to-all level's size, above 1, below cp={self.cp} and dividing it"
            )
        if self.cp_a2a_size is not None and not hierarchical:
            raise PlannerError(
                f"Layout.cp_a2a_size={self.cp_a2a_size}: only with cp_comm_type a2a+p2p and "
                f"cp > 1 (it has cp_comm_type={self.cp_comm_type!r}, cp={self.cp})"
            )
        entry = schedule_of(self.schedule)
        expected_v = entry.virtual_stages
        if expected_v is None:
            if self.virtual_stages < 2:
                raise PlannerError(
                    f"Layout.virtual_stages={self.virtual_stages}: {self.schedule} needs >= 2"
                )
        elif self.virtual_stages != expected_v:
            raise PlannerError(
                f"Layout.virtual_stages={self.virtual_stages}: schedule {self.schedule} "
                f"needs virtual_stages={expected_v}"
            )
        if entry.even_pp and self.pp % 2:
            raise PlannerError(f"Layout.pp={self.pp}: {self.schedule} needs an even pp")
        if len(self.stages) != self.pp * self.virtual_stages:
            raise PlannerError(
                f"Layout.stages has {len(self.stages)} stages: must be pp*virtual_stages="
                f"{self.pp * self.virtual_stages}"
            )
        return self

    def layer_recompute(self) -> list[str]:
        """Each transformer layer's recompute choice, in order."""
        return [b.recompute for s in self.stages for b in s.blocks if b.block.startswith("layer.")]

    @property
    def world_size(self) -> int:
        """GPUs the layout occupies: tp * cp * pp * dp."""
        return self.tp * self.cp * self.pp * self.dp

    def degrees(self, sep: str = "=") -> str:
        """The parallel degrees as text: ``tp=8 pp=16 dp=64 ep=1`` (``sep=""``:
        ``tp8 pp16 dp64 ep1``), context and expert tensor parallelism only where above 1,
        context parallelism by all-to-all marked ``cp=4(a2a)`` (``cp=16(a2a8+p2p)``)."""
        parts = [("tp", self.tp), ("cp", self.cp), ("pp", self.pp), ("dp", self.dp)]
        parts += [("ep", self.ep), ("etp", self.etp)]
        return " ".join(
            f"{name}{sep}{value}" + (self._cp_mark if name == "cp" else "")
            for name, value in parts
            if value > 1 or name not in ("cp", "etp")
        )

    @property
    def _cp_mark(self) -> str:
        if self.cp_comm_type == "a2a":
            return "(a2a)"
        if self.cp_comm_type == "a2a+p2p":
            return f"(a2a{self.cp_a2a_size}+p2p)"
        return ""

    @property
    def cp_a2a(self) -> int:
        """Consecutive cp ranks that split the heads by all-to-all: cp under a2a,
        cp_a2a_size under a2a+p2p, 1 under the ring (p2p)."""
        if self.cp_comm_type == "a2a":
            return self.cp
        return self.cp_a2a_size or 1

    def shape(self, sep: str = "=") -> str:
        """The degrees, ZeRO stage, micro-batch and schedule as text:
        ``tp=8 pp=16 dp=64 ep=1 ZeRO-1 mb1 interleaved v2`` (``sep`` as ``degrees``)."""
        v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        zero = f"ZeRO-{self.zero}" + (f" hpZ{self.zero_hpz}" if self.zero_hpz > 1 else "")
        if self.optimizer_instances > 1:
            zero += f" x{self.optimizer_instances} instances"
        zero += " params-on-host" if self.param_offload else ""
        return f"{self.degrees(sep)} {zero} mb{self.micro_batch} {self.schedule}{v}"

    @property
    def plane(self) -> int:
        """Ranks of one pipeline position: tp * cp * dp (what the experts fold onto, as
        Megatron-LM's MoE parallel folding does: ep divides it)."""
        return self.tp * self.cp * self.dp

    @property
    def grad_group(self) -> int:
        """Ranks that reduce a dense parameter's gradients and shard its ZeRO state: the
        data-parallel and the context-parallel ones (context-parallel ranks see other tokens
        of the same sequences; Megatron-LM's data-parallel group with context parallelism)."""
        return self.dp * self.cp

    def chunks_of_rank(self, rank: int) -> list[int]:
        """Stage indices that pipeline rank ``rank`` holds.

        interleaved: chunk c runs on rank c % pp; dualpipev (V shape): chunk c on rank c for
        c < pp, else 2*pp-1-c; dualpipe holds stage r and its mirror pp-1-r on rank r (two
        copies of the model across the pipeline, DeepSeek-V3 report Table 2: parameters 2x).
        """
        assert 0 <= rank < self.pp
        return chunks_of(self.schedule, self.pp, self.virtual_stages, rank)

    @classmethod
    def uniform(
        cls,
        model: ModelSpec,
        *,
        pp: int = 1,
        recompute: str | Mapping[str, str] = "none",
        virtual_stages: int | None = None,
        schedule: Schedule = "1f1b",
        **fields: Any,
    ) -> Layout:
        """Split the transformer layers as evenly as possible over ``pp * virtual_stages``
        stages (earlier stages take the remainder); embedding first, MTP and head last."""
        v = virtual_stages or schedule_of(schedule).default_virtual_stages
        chunks = pp * v
        if model.num_layers < chunks:
            raise PlannerError(
                f"Layout.pp={pp}: {model.num_layers} layers cannot fill pp*virtual_stages="
                f"{chunks} stages"
            )
        base, extra = divmod(model.num_layers, chunks)
        counts = [base + (1 if i < extra else 0) for i in range(chunks)]
        return cls.from_counts(
            model,
            counts=counts,
            pp=pp,
            recompute=recompute,
            virtual_stages=v,
            schedule=schedule,
            **fields,
        )

    @classmethod
    def from_counts(
        cls,
        model: ModelSpec,
        *,
        counts: Sequence[int],
        pp: int | None = None,
        recompute: str | Mapping[str, str] = "none",
        virtual_stages: int | None = None,
        schedule: Schedule = "1f1b",
        **fields: Any,
    ) -> Layout:
        """Stages with ``counts[i]`` transformer layers each; a count may be 0 only for a stage
        that also holds the embedding or the head. ``recompute`` is one choice for every
        layer or a mapping from block name to choice (unlisted blocks: none)."""
        from planner.costs.blocks import block_names

        if sum(counts) != model.num_layers or min(counts) < 0:
            raise PlannerError(
                f"Layout.counts={list(counts)}: must be >= 0 and sum to num_layers="
                f"{model.num_layers}"
            )
        v = virtual_stages or schedule_of(schedule).default_virtual_stages
        pp = pp if pp is not None else len(counts) // v
        names = block_names(model)
        layers = [n for n in names if n.startswith("layer.")]
        tail = [n for n in names if n.startswith("mtp.")] + ["head"]

        def choice(name: str) -> str:
            if isinstance(recompute, str):
                return recompute if name.startswith(("layer.", "mtp.")) else "none"
            return recompute.get(name, "none")

        stages: list[list[str]] = []
        start = 0
        for i, count in enumerate(counts):
            blocks = layers[start : start + count]
            start += count
            if i == 0:
                blocks = ["embedding", *blocks]
            if i == len(counts) - 1:
                blocks = blocks + tail
            if not blocks:
                raise PlannerError(f"Layout.counts[{i}]=0: a stage needs at least one block")
            stages.append(blocks)
        return cls(
            pp=pp,
            virtual_stages=v,
            schedule=schedule,
            stages=[Stage(blocks=[_placement(b, choice(b)) for b in blocks]) for blocks in stages],
            **fields,
        )
