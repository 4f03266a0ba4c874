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

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from types import MappingProxyType

from planner.costs.work import ZERO, Gemm, Work, flash_overhead, work_sum
from planner.errors import PlannerError
from planner.specs import DTYPE_BYTES, ModelSpec

SOFTMAX_STAT_BYTES = 4  # flash attention keeps the fp32 log-sum-exp per query and head
LOGIT_BYTES = 4  # the vocab-parallel cross-entropy keeps fp32 softmax over the vocab shard
ROUTER_SCORE_BYTES = 5  # fp32 router scores + a bool routing map per token and expert
TOKEN_ID_BYTES = 8  # int64 token ids kept for the embedding's backward
CAUSAL = 0.5  # causal attention computes half of the s x s score matrix
# FP8 training (Transformer Engine's recipes, DeepSeek-V3's): a linear's input and, in
# backward, its output gradient are cast to FP8 before the GEMMs that read them, once row-wise
# and once transposed (column-wise), since Hopper's FP8 GEMMs take only the K-major layout
# (Transformer Engine, "Performance considerations: handling transposes"): read 2 bytes of
# BF16, write 1 + 1 of FP8 per element. The FP8 copy of the weights is made once per step and
# reused across micro-batches (Transformer Engine's FP8 weight caching), so it is left out;
# so is any fusion of the cast into the kernel before it. The router, the output head and
# attention stay in BF16 (DeepSeek-V3 report, section 3.3.1).
FP8_CAST_BYTES = 4
# What an FP8 tensor kept for backward costs per element: 1 byte plus its share of the
# fine-grained scales: one FP32 scale per 1x128 tile (DeepSeek-V3 report section 3.3.1;
# Transformer Engine's blockwise recipe) or one E8M0 scale per 32 elements (MXFP8 on
# Blackwell, OCP Microscaling spec v1.0), 1/32 byte either way. Per-tensor (delayed) scaling
# costs less; the fine-grained figure is kept as the larger of the two.
FP8_SAVED_BYTES = 1 + 1 / 32
# torchtitan's per-op selective activation checkpointing (activation_checkpoint.mode
# "selective", selective_ac_option "op"): inside each transformer block it keeps the outputs
# of matmuls (all but every second one, counted in forward order), of the fused attention and
# of reduce-scatters, and recomputes every other op (norms, rotary embedding, activation
# functions, residual adds). A Llama block's matmuls run wq, wk, wv, wo, w1, w3, w2: q, v,
# the w1 (gate) output and the w2 output are kept; k, wo's and w3's outputs are recomputed.
# MoE experts run grouped matmuls, which the policy does not keep. Torchtitan applies it per
# block, so embedding and head are outside it. The choice is ``recompute="op"``; groups it
# drops carry the OP tag, and ``ActGroup.added_by`` marks the one output it keeps that no
# other choice does (the w2 output, otherwise freed after the residual add).
OP = "op"
# Activation offload (``recompute="offload"``, Megatron-LM --cpu-offloading-num-layers with
# Transformer Engine's CPU offload): the block recomputes nothing and keeps nothing in HBM
# once its forward is done; its saved tensors go to host memory and come back for its
# backward, where they stand in HBM as a recompute's rebuilt tensors would.
OFFLOAD = "offload"
# Fine-grained activation offload (Megatron-LM --fine-grained-activation-offloading
# --offload-modules; its docs, user-guide/features/fine_grained_activation_offloading): each
# listed module's input goes to the host in forward and comes back before its backward, with
# pipeline parallelism and with module recompute. A choice names them as "offload:<module>"
# beside recompute modules ("layernorm+moe_act+offload:expert_fc1"). Each tags the groups
# that are its module's input: core_attn q, k and v (MLA: its up-projected q, k, v);
# attn_proj the attention output; mlp_norm the residual after attention; expert_fc1 the
# dispatched tokens; moe_act the routed experts' fc1 output. attn_norm (the block input,
# which full recompute keeps) is not modelled.
OFFLOAD_TAG = "offload:"


def offload_tags(choice: frozenset[str] | str) -> frozenset[str]:
    """The fine-grained offload tags of a recompute choice."""
    if isinstance(choice, str):
        return frozenset()
    return frozenset(m for m in choice if m.startswith(OFFLOAD_TAG))


@dataclass(frozen=True)
class Param:
    """One parameter tensor (or buffer) of the model."""

    key: str  # unique in the model; shared tensors appear in several blocks under one key
    numel: int
    tp_split: bool  # split over tp ranks (else replicated on each)
    expert: bool = False  # a routed expert: sharded over ep*etp, replicated over the rest
    trainable: bool = True  # buffers have no gradient and no optimizer state
    active: Fraction = Fraction(1)  # share one token passes through (routed experts: k/E)
    # The parameter tensors it stands for, as Megatron-LM's modules hold them (a weight and
    # its bias are two; q, k and v one fused linear_qkv; gate and up one linear_fc1): what a
    # framework that gathers tensor by tensor pays per collective (``Framework.zero3_slice_s``).
    tensors: int = 1


@dataclass(frozen=True)
class ActGroup:
    """A group of tensors saved in forward for backward, per micro-batch on one rank."""

    name: str
    bytes: int
    modules: tuple[str, ...] = ()  # recompute modules that drop it; () = only full; see below
    keep_always: bool = False  # the block input: kept even under full recompute
    added_by: str = ""  # kept only under this choice (a tensor other choices free at once)
    op_keeps: bool = False  # an all-to-all's output, which per-op checkpointing keeps (OP)


@dataclass(frozen=True)
class Shard:
    """Where a block runs: the parallel degrees and shapes that change its per-rank costs."""

    seq_len: int
    micro_batch: int = 1
    tp: int = 1
    cp: int = 1  # context parallel: the rank holds seq_len / cp tokens of each sequence
    # Consecutive cp ranks that split the heads by all-to-all (Layout.cp_a2a): cp under a2a,
    # the all-to-all level under a2a+p2p, 1 under the ring; the ring runs over cp / cp_a2a
    cp_a2a: int = 1
    ep: int = 1
    etp: int = 1  # expert tensor parallel: each expert's matrices split over etp ranks
    sequence_parallel: bool = True
    flash_attention: bool = True
    activation_dtype: str = "bf16"
    moe_load_imbalance: float = 1.0
    fp8: bool = False  # the transformer's linears run in FP8 (TrainingJob.compute_dtype)
    # FP8 linears keep their quantised input for the weight gradient, not the BF16 one
    # (Transformer Engine's Linear and GroupedLinear); frameworks whose FP8 linears keep the
    # high-precision input (torchao's Float8Linear, used by torchtitan) leave this off.
    fp8_saves_inputs: bool = False
    fp8_cache: bool = False  # activation-function inputs kept in FP8 too (Layout.fp8_cache)
    # Routing probabilities multiply the expert's activation output before its second linear
    # (Megatron-Core's grouped experts), so the combine keeps no expert outputs for the
    # probabilities' gradient; otherwise (a weighted sum after the combine) it keeps them.
    probs_in_expert: bool = False
    # The loss upcasts the logits to an FP32 copy of its own (torch's cross-entropy on
    # logits.float(), as torchtitan runs it) rather than in place (Megatron's vocab-parallel
    # cross-entropy; planner.run's loss).
    loss_copies_logits: bool = False
    # Megatron-LM's fused cross-entropy (TrainingJob.loss_fusion): none, native or te.
    loss_fusion: str = "none"
    # The model code's eager RMSNorm and gated MLP (Framework.unfused_norm, unfused_swiglu).
    unfused_norm: bool = False
    unfused_swiglu: bool = False
    # The loss is compiled (TrainingJob.compiled_loss): it keeps the logits in the activation
    # dtype and writes their gradient in it, with no FP32 copy.
    loss_compiled: bool = False
    loss_chunks: int = 1  # the output layer and loss over this many token chunks
    op_sac: bool = False  # per-op selective checkpointing is on the menu (torchtitan's; OP)
    qk_gathered: bool = False  # q and k all-gathered after their norms (TrainingJob field)
    # Whose eager ops compute the norms, rotary embeddings, SwiGLU and the loss, one kernel
    # per op (``eager_bytes``): "runtime" (planner.run.model, Framework.eager_passes),
    # "torchtitan" (its model code uncompiled, Framework.eager_model) or "" (fused kernels)
    eager_ops: str = ""
    # torchtitan's older eager RMSNorm class (TrainingJob.eager_norm), uncompiled
    eager_norm: bool = False
    # Bytes of a gradient element where the framework adds each micro-batch's weight
    # gradients into its gradient buffer in a pass of its own (Framework.
    # grad_accumulation_pass): read both, write the sum, per micro-batch; 0 where not
    grad_accumulation_bytes: int = 0

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on this rank (all tp ranks see them inside
        tensor-parallel regions; context parallelism splits each sequence over cp ranks)."""
        return self.micro_batch * self.seq_len // self.cp

    @property
    def sp_tokens(self) -> float:
        """Tokens a rank keeps outside tensor-parallel regions (sharded by sequence parallel)."""
        return self.tokens / self.tp if self.sequence_parallel else self.tokens

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.activation_dtype]

    @property
    def linear_input_bytes(self) -> float:
        """Bytes per element of a tensor kept for a quantised linear's weight gradient."""
        return FP8_SAVED_BYTES if self.fp8 and self.fp8_saves_inputs else self.act_bytes

    @property
    def act_input_bytes(self) -> float:
        """Bytes per element of an activation function's input kept for its backward."""
        return FP8_SAVED_BYTES if self.fp8 and self.fp8_cache else self.act_bytes


@dataclass(frozen=True, eq=False)
class BlockCost:
    """Costs of one block on one rank for one micro-batch (built by ``BlockBuilder``;
    frozen: ``block_cost`` results are shared)."""

    name: str
    params: tuple[Param, ...] = ()
    fwd: Work = ZERO
    bwd_input: Work = ZERO
    bwd_weight: Work = ZERO
    saved: tuple[ActGroup, ...] = ()
    # Bytes held above the saved ones for a moment while the block's forward or backward
    # runs (the head: its logits in the activation dtype and the loss's FP32 copy). Counted
    # with what its backward rebuilds (``rebuilt_bytes``): where a chunk's last block is the
    # head, its backward follows its forward with no other forward between (every schedule
    # here), so the level then is the level at the end of that forward.
    transient: int = 0
    module_work: Mapping[str, Work] = field(default_factory=dict)  # forward work per module
    tp_collectives: float = 0  # tensor-parallel all-reduces (or AG+RS pairs) in forward
    moe_layers: int = 0  # MoE layers in the block: 4 expert all-to-alls each per micro-batch
    tokens_per_expert: float = 0.0  # tokens each local expert's GEMMs see (busiest rank)
    tp: int = 1  # tensor-parallel degree the block is sharded over (GEMM shapes)
    # Bytes of keys and values this rank holds for one micro-batch (every attention of the
    # block): what one step of the context-parallel ring sends on
    cp_kv_bytes: float = 0.0
    # Bytes of queries, keys, values and attention outputs this rank holds for one
    # micro-batch (every attention of the block): what the all-to-alls of Layout.cp_comm_type
    # "a2a" move, queries, keys and values before each attention and its output after
    cp_a2a_bytes: float = 0.0
    attention_fwd: Work = ZERO  # the fused attention kernels' forward work (the ring hides
    attention_bwd: Work = ZERO  # its sends behind a cp-th of it per step) and backward work
    fp8: bool = False  # linears cast their inputs and output gradients to FP8
    # saved_bytes / rebuilt_bytes by recompute choice (the block's own answers, kept)
    _memo: dict[tuple[object, ...], int] = field(default_factory=dict, repr=False, compare=False)

    @property
    def fwd_flops(self) -> float:
        return self.fwd.flops

    @property
    def bwd_input_flops(self) -> float:
        return self.bwd_input.flops

    @property
    def bwd_weight_flops(self) -> float:
        return self.bwd_weight.flops

    @property
    def bwd_flops(self) -> float:
        return self.bwd_input_flops + self.bwd_weight_flops

    def saved_bytes(self, dropped: frozenset[str] | str = frozenset()) -> int:
        """Bytes kept for backward under a recompute choice (a module set or ``"full"``)."""
        key = ("saved", dropped)
        if key not in self._memo:
            self._memo[key] = sum(g.bytes for g in self.saved if _is_kept(g, dropped))
        return self._memo[key]

    def kept_bytes(self, name: str, dropped: frozenset[str] | str = frozenset()) -> int:
        """Bytes of the saved group ``name`` kept for backward under a recompute choice."""
        return sum(g.bytes for g in self.saved if g.name == name and _is_kept(g, dropped))

    def rebuilt_bytes(self, dropped: frozenset[str] | str) -> int:
        """Bytes a backward holds above the saved ones under a recompute choice (one
        micro-batch): what it re-materialises, or the block's ``transient`` if more."""
        key = ("rebuilt", dropped)
        if key not in self._memo:
            if dropped == OFFLOAD:  # what comes back from the host for the backward
                rebuilt = self.saved_bytes(frozenset())
            else:
                rebuilt = sum(
                    g.bytes for g in self.saved if not g.added_by and _is_dropped(g, dropped)
                )
            self._memo[key] = max(rebuilt, self.transient)
        return self._memo[key]

    def offloaded_bytes(self, choice: frozenset[str] | str) -> int:
        """Bytes a choice sends to the host per micro-batch: the whole saved set under
        layer offload (``OFFLOAD``), else the groups its ``offload:`` tags name that its
        recompute modules do not already drop."""
        if choice == OFFLOAD:
            return self.saved_bytes(frozenset())
        tags = offload_tags(choice)
        if not tags:
            return 0
        recomputed = frozenset(choice) - tags
        return sum(
            g.bytes
            for g in self.saved
            if tags & set(g.modules) and not g.added_by and not _is_dropped(g, recomputed)
        )

    def recompute_work(self, dropped: frozenset[str] | str) -> Work:
        """Forward work repeated in backward to rebuild what ``dropped`` discards."""
        if dropped == "full":
            return self.fwd
        if dropped == OFFLOAD:
            return ZERO
        chosen = set(dropped)
        if OP in chosen and self.moe_layers:  # grouped expert matmuls are not kept
            chosen.add("moe")
        if "moe" in chosen:  # the whole MoE layer is re-run, its parts with it
            chosen -= {"moe_act", "shared_experts"}
        total = ZERO
        for m in sorted(chosen):
            total += self.module_work.get(m, ZERO)
        return total

    def recompute_flops(self, dropped: frozenset[str] | str) -> float:
        """Forward FLOPs repeated in backward to rebuild what ``dropped`` discards."""
        return self.recompute_work(dropped).flops

    def menu(self) -> list[frozenset[str] | str]:
        """Recompute choices worth considering: none, each module this block has, the
        cheapest combinations of modules, full.

        Combinations: modules in order of the recompute each costs per byte it frees
        (FLOPs first, then memory traffic), and every prefix of that order of two modules or
        more: the greedy frontier of the knapsack "free the most bytes for the least
        recompute". It holds the set DeepSeek-V3 trained with (RMSNorm, MLA up-projections
        and the SwiGLU output: layernorm+mla_up_proj+moe_act) without listing all 2^k sets."""
        modules = sorted(
            {m for g in self.saved for m in g.modules if not m.startswith(OFFLOAD_TAG)} - {OP}
        )
        choices: list[frozenset[str] | str] = [frozenset()]
        if any(OP in g.modules for g in self.saved):
            choices.append(frozenset({OP}))
        choices += [frozenset({m}) for m in modules]
        kept = self.saved_bytes(frozenset())
        freed = {m: kept - self.saved_bytes(frozenset({m})) for m in modules}
        useful = [m for m in modules if freed[m] > 0]

        def price(m: str) -> tuple[float, float, str]:
            work = self.recompute_work(frozenset({m}))
            return (work.flops / freed[m], work.memory / freed[m], m)

        order = sorted(useful, key=price)
        for k in range(2, len(order) + 1):
            choice = frozenset(order[:k])
            if choice not in choices:
                choices.append(choice)
        if any(not g.keep_always for g in self.saved):
            choices.append("full")
        return choices


@dataclass
class BlockBuilder:
    """A ``BlockCost`` while its block's parts are added (``build`` freezes it)."""

    name: str
    params: list[Param] = field(default_factory=list)
    # each phase's and each module's parts, added once in ``build`` (``work_sum``)
    fwd: list[Work] = field(default_factory=list)
    bwd_input: list[Work] = field(default_factory=list)
    bwd_weight: list[Work] = field(default_factory=list)
    saved: list[ActGroup] = field(default_factory=list)
    transient: int = 0  # see ``BlockCost.transient``
    module_work: dict[str, list[Work]] = field(default_factory=dict)
    tp_collectives: float = 0
    moe_layers: int = 0
    tokens_per_expert: float = 0.0
    tp: int = 1
    cp_kv_bytes: float = 0.0
    cp_a2a_bytes: float = 0.0
    attention_fwd: Work = ZERO
    attention_bwd: Work = ZERO
    fp8: bool = False

    def build(self) -> BlockCost:
        """The block's costs, frozen."""
        return BlockCost(
            name=self.name,
            params=tuple(self.params),
            fwd=work_sum(self.fwd),
            bwd_input=work_sum(self.bwd_input),
            bwd_weight=work_sum(self.bwd_weight),
            saved=tuple(self.saved),
            transient=self.transient,
            module_work=MappingProxyType({m: work_sum(w) for m, w in self.module_work.items()}),
            tp_collectives=self.tp_collectives,
            moe_layers=self.moe_layers,
            tokens_per_expert=self.tokens_per_expert,
            tp=self.tp,
            cp_kv_bytes=self.cp_kv_bytes,
            cp_a2a_bytes=self.cp_a2a_bytes,
            attention_fwd=self.attention_fwd,
            attention_bwd=self.attention_bwd,
            fp8=self.fp8,
        )

    # -- builders -------------------------------------------------------------------------
    def add(self, fwd: Work, bwd_input: Work, bwd_weight: Work = ZERO, *modules: str) -> None:
        """Add work to each phase; ``modules`` re-run ``fwd`` when they are recomputed."""
        self.fwd.append(fwd)
        self.bwd_input.append(bwd_input)
        self.bwd_weight.append(bwd_weight)
        self.rerun(fwd, *modules)

    def gemm(self, shape: Gemm, *modules: str, kind: str = "gemm", quantized: bool = True) -> None:
        """A GEMM and its two backward GEMMs (input and weight gradient), same FLOPs each,
        each with its own shape (``Gemm.backward``). In FP8 training a ``quantized`` GEMM
        also casts its input in forward and its output gradient in backward to FP8, each
        in both layouts the GEMMs read (``FP8_CAST_BYTES``)."""
        dgrad, wgrad = shape.backward()
        fwd, bwd_input, bwd_weight = (
            Work(kernels=1, shapes=((g, 1.0),), **{kind: g.flops}) for g in (shape, dgrad, wgrad)
        )
        if self.fp8 and quantized:
            cast = FP8_CAST_BYTES * shape.groups
            fwd += Work(memory=cast * shape.m * shape.k, kernels=1)
            bwd_input += Work(memory=cast * shape.m * shape.n, kernels=1)
        self.add(fwd, bwd_input, bwd_weight, *modules)

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
        fused: bool = False,
    ) -> None:
        """A linear layer applied to ``tokens`` tokens: params, and 2*tokens*in*out FLOPs each
        for forward, input gradient and weight gradient (divided over tp when split: the
        callers pass tokens/tp; the GEMM itself runs all tokens on a tp-th of the outputs).
        ``fused``: its weight (and bias) are part of the tensors of the linear before it."""
        tensors = 0 if fused else 1 + bias
        numel = d_in * d_out + (d_out if bias else 0)
        self.params.append(Param(key, numel, tp_split=split, tensors=tensors))
        t = self.tp if split else 1
        self.gemm(Gemm(tokens * t, d_out / t, d_in), *([module] if module else []))

    def elementwise(self, nbytes: float, *modules: str) -> None:
        """A memory-bound kernel moving ``nbytes`` in forward; its backward reads the saved
        input and the output gradient and writes the input gradient: twice the traffic."""
        self.add(Work(memory=nbytes, kernels=1), Work(memory=2 * nbytes, kernels=1), ZERO, *modules)

    def save(
        self,
        name: str,
        nbytes: float,
        *modules: str,
        keep: bool = False,
        added_by: str = "",
        op_keeps: bool = False,
    ) -> None:
        self.saved.append(ActGroup(name, round(nbytes), tuple(modules), keep, added_by, op_keeps))

    def rerun(self, work: Work, *modules: str) -> None:
        """Forward work a recompute of ``modules`` repeats (``add`` registers its own; alone,
        work forward counts as part of another op: one half of a fused GEMM)."""
        for m in modules:
            self.module_work.setdefault(m, []).append(work)

    def norm(self, key: str, width: int, kind: str) -> None:
        layernorm = kind == "layernorm"  # a weight and a bias
        self.params.append(
            Param(key, width * (1 + layernorm), tp_split=False, tensors=1 + layernorm)
        )


def _is_dropped(group: ActGroup, dropped: frozenset[str] | str) -> bool:
    if group.keep_always or dropped == OFFLOAD:
        return False
    if dropped == "full":
        return True
    if OP in dropped and "moe" in group.modules and not group.op_keeps:
        return True
    return any(m in dropped for m in group.modules)


def _is_kept(group: ActGroup, dropped: frozenset[str] | str) -> bool:
    """Whether ``group`` stays in HBM for the backward (an offloaded block keeps none)."""
    if dropped == OFFLOAD:
        return False
    if group.added_by:
        return dropped != "full" and group.added_by in dropped
    return not _is_dropped(group, dropped)


def _op(shard: Shard) -> tuple[str, ...]:
    """The OP tag where per-op selective checkpointing is on the menu."""
    return (OP,) if shard.op_sac else ()


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
    """Parameters, FLOPs and saved activations of block ``name`` under ``shard``.

    Results are cached (a model has many identical layers and the planner asks often):
    treat the returned ``BlockCost`` as read-only."""
    return _block_cost(model, name, shard)


@functools.lru_cache(maxsize=65536)
def _block_cost(model: ModelSpec, name: str, shard: Shard) -> BlockCost:
    _check_shard(model, shard)
    cost = BlockBuilder(name, tp=shard.tp, fp8=shard.fp8)
    if name == "embedding":
        _embedding(cost, model, shard)
    elif name == "head":
        _head(cost, model, shard)
    elif name.startswith("layer."):
        index = _index(name, model.num_layers)
        prefix = f"layer.{index}."
        moe, window = model.is_moe_layer(index), model.attention_window(index)
        chunk, rope = model.attention_chunk(index), model.has_rope(index)
        _layer(cost, model, shard, prefix, moe=moe, window=window, chunk=chunk, rope=rope)
        # Group names are local to the block; parameter keys stay model-wide.
        cost.saved = [replace(g, name=g.name.removeprefix(prefix)) for g in cost.saved]
    elif name.startswith("mtp."):
        index = _index(name, model.num_mtp_layers)
        _mtp(cost, model, shard, index)
    else:
        raise PlannerError(f"block={name!r}: not a block of {model.name}; see block_names()")
    if shard.grad_accumulation_bytes:
        trainable = [p for p in cost.params if p.trainable]
        numel = sum(
            p.numel / (shard.ep * shard.etp)
            if p.expert
            else p.numel / (shard.tp if p.tp_split else 1)
            for p in trainable
        )
        accumulate = 3 * numel * shard.grad_accumulation_bytes
        cost.add(ZERO, ZERO, Work(memory=accumulate, kernels=sum(p.tensors for p in trainable)))
    return cost.build()


def model_param_count(model: ModelSpec, *, active: bool = False, include_mtp: bool = True) -> int:
    """Trainable parameters of the whole model, each shared tensor counted once."""
    return _model_param_count(model, active, include_mtp)


@functools.lru_cache(maxsize=1024)
def _model_param_count(model: ModelSpec, active: bool, include_mtp: bool) -> int:
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
        checks.append(("shared_expert_ffn_hidden_size", shared_width(model)))
    for key, value in checks:
        if value % t:
            raise PlannerError(f"Layout.tp={t}: tensor parallel degree must divide {key}={value}")
    if model.num_experts and model.num_experts % shard.ep:
        raise PlannerError(
            f"Layout.ep={shard.ep}: expert parallel degree must divide "
            f"num_experts={model.num_experts}"
        )
    if model.num_experts and model.moe_ffn_hidden_size % shard.etp:
        raise PlannerError(
            f"Layout.etp={shard.etp}: expert tensor parallel degree must divide "
            f"moe_ffn_hidden_size={model.moe_ffn_hidden_size}"
        )
    if shard.cp > 1 and shard.seq_len % (2 * shard.cp):
        # Megatron-LM splits each sequence into 2 * cp chunks, rank i holding chunks i and
        # 2cp-1-i, so every rank gets as much of the causal mask's work (load balance).
        raise PlannerError(
            f"Layout.cp={shard.cp}: context parallelism needs seq_len={shard.seq_len} to "
            f"divide into 2*cp={2 * shard.cp} equal chunks"
        )
    if shard.cp > 1 and not shard.flash_attention:
        raise PlannerError(
            f"Layout.cp={shard.cp}: context parallelism runs on fused (flash) attention; the "
            f"job has flash_attention=False"
        )
    if shard.cp_a2a > 1:
        reason = a2a_rule(model, shard.tp, shard.cp_a2a)
        if reason:
            kind = "a2a" if shard.cp_a2a == shard.cp else "a2a+p2p"
            raise PlannerError(f"Layout.cp_comm_type={kind!r}: {reason}")


def a2a_rule(model: ModelSpec, tp: int, a2a: int) -> str:
    """Why a model cannot split its heads over ``a2a`` context-parallel ranks by all-to-all
    (``Layout.cp_comm_type`` a2a, or a2a+p2p's all-to-all level), or "" where it can: each
    tensor-parallel rank's query heads and key/value heads must divide by a2a (Transformer
    Engine's AttnFuncWithCPAndQKVOA2A asserts both; it does not replicate key/value heads)."""
    heads = [("num_attention_heads", model.num_attention_heads)]
    if model.attention != "mla":  # MLA keeps a key per head
        heads.append(("num_kv_heads", model.num_kv_heads))
    for key, value in heads:
        if value % (tp * a2a):
            return (
                f"each rank's heads split over {a2a} ranks by all-to-all: tp*{a2a}={tp * a2a} "
                f"must divide {key}={value}"
            )
    return ""


def shared_width(model: ModelSpec) -> int:
    """The shared experts' MLP width together (elements)."""
    return model.num_shared_experts * (
        model.shared_expert_ffn_hidden_size or model.moe_ffn_hidden_size
    )


# ---------------------------------------------------------------------------------------
# blocks


def _embedding(cost: BlockBuilder, model: ModelSpec, shard: Shard) -> None:
    h = model.hidden_size
    # Vocab-parallel embedding: each tp rank holds V/tp rows; lookups are gathers (no GEMM).
    cost.params.append(Param("word_embeddings", model.vocab_size * h, tp_split=True))
    if model.learned_positions:
        cost.params.append(Param("position_embeddings", model.learned_positions * h, False))
    cost.save("token_ids", shard.tokens * TOKEN_ID_BYTES, keep=True)
    # Gather rows, write the output; backward scatter-adds into the gradient rows.
    cost.elementwise(2 * shard.tokens * h * shard.act_bytes)
    cost.tp_collectives += 1  # partial lookups of each vocab shard are summed over tp
    if model.hidden_dropout:
        cost.save("embedding_dropout_mask", shard.sp_tokens * h)
        cost.elementwise(shard.sp_tokens * h * (2 * shard.act_bytes + 1))


def _head(cost: BlockBuilder, model: ModelSpec, shard: Shard, *, prefix: str = "") -> None:
    """Final norm, output projection over the vocabulary shard, fp32 cross-entropy."""
    h, v = model.hidden_size, model.vocab_size
    if not prefix:
        cost.save("block_input", shard.sp_tokens * h * shard.act_bytes, keep=True)
    _saved_norm(
        cost,
        model,
        shard,
        prefix + "final_norm",
        prefix + "final_norm_out",
        quantized=False,
        in_block=False,
    )
    key = "word_embeddings" if model.tie_word_embeddings else "output"
    cost.params.append(Param(key, v * h, tp_split=True))
    cost.tp_collectives += 1  # sequence-parallel input gathered over tp (or its grad reduced)
    _sequence_dim_copies(cost, model, shard, 1)
    cost.gemm(Gemm(shard.tokens, v / shard.tp, h), quantized=False)
    elements = shard.tokens * v / shard.tp
    logits = elements * LOGIT_BYTES
    if model.final_logit_softcap:
        _softcap(cost, shard, elements, prefix)
    if shard.loss_chunks > 1:
        _chunked_loss(cost, shard, h, elements, prefix)
        return
    if shard.loss_compiled:
        # One fused kernel forms the log-softmax from the logits as they are and, in backward,
        # their gradient in the same dtype: those logits are kept, and the gradient is what
        # the backward holds above them.
        cost.save(prefix + "logits", elements * shard.act_bytes)
        cost.transient = max(cost.transient, round(elements * shard.act_bytes))
        cost.elementwise(2 * logits)
        return
    if shard.loss_fusion == "te":
        # Transformer Engine's parallel_cross_entropy (transformer_engine/pytorch/
        # cross_entropy.py): its Triton kernel forms the loss and writes the logits' gradient
        # over the logits in forward, keeps them in their own dtype, and scales them in place
        # in backward, which returns that same tensor: the logits kept, nothing beside.
        cost.save(prefix + "logits", elements * shard.act_bytes)
        cost.elementwise(2 * logits)
        return
    cost.save(prefix + "logits", logits)
    if shard.loss_fusion == "native":
        # Megatron-LM's --cross-entropy-loss-fusion (megatron/core/fusions/
        # fused_cross_entropy.py at d98e8a64): the vocab-parallel cross-entropy's steps under
        # torch.compile (megatron/core/jit.py). Compiled, its in-place updates of the FP32
        # copy (-=, exp(out=), div_) write new buffers while the copy lives: one FP32 logits
        # more than the unfused loss, beside the narrow logits. Megatron-LM's functional
        # tests measure it: gpt3_mcore_te_tp2_pp2_cross_entropy_loss_fusion peaks 3.4-4.0
        # bytes a logit above the same test without the fusion on H100, GB200 and A100
        # (benchmarks/megatron_ci_runs.csv).
        cost.transient = max(cost.transient, round(elements * (shard.act_bytes + LOGIT_BYTES)))
        cost.elementwise(2 * logits)
        return
    # The in-place loss (Megatron-LM's vocab-parallel cross-entropy without the fusion, the
    # eager runtime's): logits narrower than FP32 live while it forms the FP32 softmax from
    # them, in place; FP32 logits become the softmax in place; its backward turns the
    # softmax into the gradient in place and holds as much again in the logits' dtype.
    # The copying loss, cross-entropy on logits.float() (torchtitan's, Hugging Face's): the
    # FP32 copy lives while the log-softmax it keeps is written, and in backward the
    # incoming gradient and the input's gradient, both FP32, live beside it: 2 x 4 bytes a
    # logit above the 4 kept, its narrow logits freed before either.
    # With tp > 1 it is DTensor's loss-parallel log-softmax (torchtitan's default,
    # parallelism.disable_loss_parallel false), which follows the decomposition: the FP32
    # copy, the shifted copy and its exponential live at once beside the narrow logits
    # (torch/distributed/tensor/parallel/loss.py, _log_softmax), 2 + 2 x 4 above the kept
    # 4, and its backward holds three FP32 tensors beside the kept one.
    # Measured on one H200 (benchmarks/gpu_memory.py --loss eager / parallel, the latter on
    # a one-rank mesh): 8.00 bytes a logit above the kept log-softmax in backward (4.00 in
    # forward), and 12.00 (10.00 in forward) for loss-parallel.
    if shard.loss_copies_logits:
        above = (3 if shard.tp > 1 else 2) * LOGIT_BYTES
        cost.transient = max(cost.transient, round(elements * above))
    elif shard.act_bytes < LOGIT_BYTES:
        cost.transient = max(cost.transient, round(elements * shard.act_bytes))
    cost.elementwise(2 * logits)  # fp32 softmax cross-entropy: read and write the logits
    if shard.eager_ops:
        _eager(cost, elements, "loss", shard.act_bytes, style=shard.eager_ops)


def _softcap(cost: BlockBuilder, shard: Shard, elements: float, prefix: str) -> None:
    """cap * tanh(logits / cap) before the loss (Gemma 2's final_logit_softcapping, as
    transformers' Gemma2ForCausalLM writes it: divide, tanh, multiply, three kernels over the
    logits in their dtype each way). The tanh's output is kept for its backward; the divide
    and the multiply by a constant keep nothing. Under a chunked loss it lives with its
    chunk's logits and is left out of that chunk's peak."""
    a = shard.act_bytes
    cost.add(
        Work(memory=3 * 2 * elements * a, kernels=3),
        Work(memory=(2 + 3 + 2) * elements * a, kernels=3),  # the tanh's reads its output too
    )
    if shard.loss_chunks == 1:
        cost.save(prefix + "softcap_tanh", elements * a)


def _widen(a: int) -> int:
    """Bytes one eager upcast of an element of ``a`` bytes to FP32 moves (none if FP32)."""
    return a + 4 if a < 4 else 0


def eager_bytes(op: str, a: int, style: str = "runtime") -> tuple[float, float, int, int]:
    """Bytes an element of ``op``'s tensor moves, forward and backward, beyond the fused
    kernel's passes priced beside it, and the extra kernels, in the eager runtime of
    ``planner.run.model`` (activations of ``a`` bytes, FP32 arithmetic): each eager op one
    kernel that reads its operands and writes its result.

    - ``rmsnorm`` (``_RMSNorm``, over the hidden width): forward: the input upcast, x^2,
      mean, x * rstd, * weight (4 + 4 + 4 + 8 + 8 bytes in FP32, 28) and the downcast; backward:
      the input and the gradient upcast, x * rstd, g * normed, its sum over tokens, g * w,
      gw * normed, its mean, normed * mean, the difference, rstd * it (8 + 12 + 4 + 8 + 12 + 4 +
      8 + 12 + 8 = 76) and the downcast. Priced beside it: 2a forward, 4a backward.
    - ``rotary`` (``_Rotary``, over q's and k's widths): x * cos, -half, cat, * sin, the sum
      (2a + a + 2a + 2a + 3a = 10a) each way. Priced: 2a forward, 4a backward.
    - ``swiglu`` (``_SwiGLU``, over the MLP width): forward silu(gate) * up (2a + 3a); backward:
      gate and the gradient (twice) and up upcast, sigmoid, g * s, grad * silu, 1 - s,
      g * (1 - s), 1 + it, s * it, grad * up, the product (8 + 12 + 12 + 8 + 12 + 8 + 12 + 12 +
      12 = 96) and two downcasts. Priced: 3a forward, 6a backward (the fused kernel's).
    - ``loss`` (``Head`` and ``_CrossEntropy``, over the logits): forward the logits' upcast,
      max, the in-place subtract, exp and divide, the sum (4 + 8 + 8 + 4 + 8 = 32); backward
      the in-place scale (8) and the downcast, within the 16 bytes priced backward (8
      forward).

    ``style`` "torchtitan": torchtitan's model code run uncompiled
    (``_torchtitan_eager_bytes``)."""
    w = _widen(a)
    if style == "torchtitan":
        return _torchtitan_eager_bytes(op, a, w)
    if op == "rmsnorm":
        return 28 + 2 * w - 2 * a, 76 + 3 * w - 4 * a, 6, 11
    if op == "rotary":
        return 8 * a, 6 * a, 4, 4
    if op == "swiglu":
        return 2 * a, 96 + 6 * w - 6 * a, 1, 14
    if op == "loss":
        return 32 + w - 8, 0.0, 5, 1
    raise ValueError(op)


def _torchtitan_eager_bytes(op: str, a: int, w: int) -> tuple[float, float, int, int]:
    """``eager_bytes`` of torchtitan's model code run without torch.compile (its Llama 3 and
    Qwen3 models: torchtitan/models/llama3/model/model.py at v0.2.2, experiments/qwen3 at
    d66b72a6), each PyTorch op one kernel reading its operands and writing its result, and
    autograd's backward one kernel per op's derivative:

    - ``rmsnorm``: nn.RMSNorm, one fused kernel each way since PyTorch 2.9 (the CUDA
      ``_fused_rms_norm`` of pytorch#153666): nothing beyond the fused passes priced;
    - ``rotary``: x * cos + rotate_half(x) * sin in the activation dtype (Qwen3), or the
      complex product over an FP32 copy (Llama 3): 10a bytes each way either way, as
      ``planner.run.model``'s (8a forward and 6a backward beyond the 2a and 4a priced);
    - ``swiglu``: F.silu(gate) * up: forward silu (2a) and the multiply (3a), 5a against the
      fused kernel's 3a; backward the multiply's two products (3a each) and silu's derivative
      (``silu_backward``: the gradient and the gate in, 3a), 9a against 6a: 2a and 3a more,
      one and two kernels more;
    - ``loss``: F.cross_entropy over ``pred.float()``: forward the upcast (a + w), the
      log-softmax (3w: read twice, write once) and the picked entries; backward the negative
      log-likelihood's gradient (w), the log-softmax's (3w) and the downcast (w + a): a + 2w
      forward beyond the 2w priced and a + w backward beyond the 4w, two kernels more each
      way."""
    if op == "rmsnorm":
        return 0.0, 0.0, 0, 0
    if op == "rotary":
        return 8 * a, 6 * a, 4, 4
    if op == "swiglu":
        return 2 * a, 3 * a, 1, 2
    if op == "loss":
        return a + 2 * w, a + w, 2, 2
    raise ValueError(op)


def _sequence_dim_copies(cost: BlockBuilder, model: ModelSpec, shard: Shard, pairs: int) -> None:
    """torchtitan's model code uncompiled with sequence parallelism: its activations are
    [batch, sequence, hidden], sharded over tp on the sequence (dim 1), and PyTorch's
    functional collectives gather and reduce-scatter on dim 0 only, so each all-gather's
    output is rearranged by a copy (``torch.cat(torch.chunk(out, tp, dim=0), dim=1)``) and
    each reduce-scatter's input by another (``chunk`` on dim 1, ``cat`` on dim 0):
    torch/distributed/_functional_collectives.py, ``all_gather_tensor`` and
    ``reduce_scatter_tensor``, which DTensor's redistributions call. Each copy reads and
    writes the whole gathered region; ``pairs`` all-gather and reduce-scatter pairs forward,
    and as many backward (each one's gradient is the other). Megatron-LM keeps [sequence,
    batch, hidden] and gathers on dim 0: no copy. Left out at micro-batch 1, where recent
    PyTorch takes the rearrangement as a view, and under torch.compile, which may fuse it."""
    if shard.eager_ops != "torchtitan" or shard.tp < 2 or shard.micro_batch < 2:
        return
    if not shard.sequence_parallel:
        return
    region = shard.tokens * model.hidden_size * shard.act_bytes
    copies = Work(memory=pairs * 2 * 2 * region, kernels=2 * pairs)
    cost.add(copies, copies, ZERO)


def _eager(
    cost: BlockBuilder, elements: float, op: str, a: int, *modules: str, style: str = "runtime"
) -> None:
    """The eager ops' passes over ``elements`` beyond the fused ones (``eager_bytes`` of
    ``style``); a recompute of ``modules`` repeats the forward's."""
    fwd, bwd, kf, kb = eager_bytes(op, a, style)
    cost.add(
        Work(memory=elements * fwd, kernels=kf),
        Work(memory=elements * bwd, kernels=kb),
        ZERO,
        *modules,
    )


def _chunked_loss(cost: BlockBuilder, shard: Shard, h: int, elements: float, prefix: str) -> None:
    """torchtitan's ChunkedCELoss (``TrainingJob.loss_chunks``; torchtitan/components/loss.py
    at b5bcd76c): the final norm's output, replicated over tp, is cut into n chunks of
    tokens; each chunk's output layer and loss run and at once their backward (``chunk_loss.
    backward()``), so one chunk's logits live at a time, at most what the whole loss holds
    at its peak (the kept log-softmax and the most its forward or backward holds above it,
    the copying loss's or the compiled one's), an n-th of it. Each chunk's input gradient
    goes into an FP32 buffer of every token (GradAccumulator, dtype float32), kept to the
    backward of the layers. The same FLOPs and traffic; the chunks' extra launches and the
    head's backward moving into the forward are left out."""
    a = shard.act_bytes
    if shard.loss_compiled:
        per_logit = 2 * a  # the kept logits and their gradient, in the activation dtype
    else:
        above = (3 if shard.tp > 1 else 2) * LOGIT_BYTES if shard.loss_copies_logits else a
        per_logit = LOGIT_BYTES + above
    cost.save(prefix + "loss_input_grad", shard.tokens * h * DTYPE_BYTES["fp32"])
    cost.transient = max(cost.transient, round(elements * per_logit / shard.loss_chunks))
    cost.elementwise(2 * elements * LOGIT_BYTES)


def _saved_norm(
    cost: BlockBuilder,
    model: ModelSpec,
    shard: Shard,
    key: str,
    saved: str,
    *,
    quantized: bool,
    in_block: bool = True,
) -> None:
    """A replicated norm whose output is saved (Megatron's ``layernorm`` module drops it):
    as its consumer keeps it, the FP8 copy for a ``quantized`` linear (``Shard``). Per-op
    checkpointing recomputes it ``in_block`` (not the final norm, outside the blocks)."""
    h = model.hidden_size
    cost.norm(key, h, model.norm)
    elements = shard.sp_tokens * h
    kept = shard.linear_input_bytes if quantized else shard.act_bytes
    op = _op(shard) if in_block else ()
    cost.save(saved, elements * kept, "layernorm", *op)
    cost.elementwise(2 * elements * shard.act_bytes, "layernorm", *op)
    if shard.eager_ops and model.norm == "rmsnorm":
        # torchtitan's older RMSNorm runs the ops of the project's runtime's (an FP32 upcast,
        # x^2, mean, x * rstd, the downcast, the weight's multiply): priced as those
        style = "runtime" if shard.eager_norm else shard.eager_ops
        _eager(cost, elements, "rmsnorm", shard.act_bytes, "layernorm", *op, style=style)
    if (shard.unfused_norm or shard.eager_norm) and model.norm == "rmsnorm":
        # The eager RMSNorm keeps an FP32 copy of its input where the fused norm keeps the
        # input itself (counted as the block's input), and its normalised tensor in the
        # input's dtype for the weight's gradient: (4 - a) + a bytes an element more.
        fp32 = DTYPE_BYTES["fp32"]
        cost.save(saved + "_fp32", elements * fp32, "layernorm", *op)


def _layer(
    cost: BlockBuilder,
    model: ModelSpec,
    shard: Shard,
    prefix: str,
    *,
    moe: bool,
    keep: bool = True,
    window: int | None = None,
    chunk: int | None = None,
    rope: bool = True,
) -> None:
    h, a, sp = model.hidden_size, shard.act_bytes, shard.sp_tokens
    cost.save(prefix + "block_input", sp * h * a, keep=keep)
    _saved_norm(
        cost, model, shard, prefix + "input_norm", prefix + "input_norm_out", quantized=True
    )
    if model.attention == "mla":
        _mla(cost, model, shard, prefix, window, chunk)
    else:
        _gqa(cost, model, shard, prefix, window, chunk, rope=rope)
    if model.post_norms:
        _post_norm(cost, model, shard, prefix + "post_attention_norm")
    _residual(cost, model, shard, prefix + "attn_dropout_mask")
    cost.save(prefix + "residual_mid", sp * h * a, OFFLOAD_TAG + "mlp_norm", *_op(shard))
    # An MoE layer's router (BF16) keeps the norm output; its FP8 copies are the experts'.
    _saved_norm(
        cost, model, shard, prefix + "pre_mlp_norm", prefix + "pre_mlp_norm_out", quantized=not moe
    )
    if moe:
        _moe(cost, model, shard, prefix)
    else:
        _dense_mlp(cost, model, shard, prefix)
    if model.post_norms:
        _post_norm(cost, model, shard, prefix + "post_mlp_norm")
    _residual(cost, model, shard, prefix + "mlp_dropout_mask")
    cost.tp_collectives += 2  # attention and MLP outputs: one all-reduce (or RS + AG) each
    _sequence_dim_copies(cost, model, shard, 2)


def _post_norm(cost: BlockBuilder, model: ModelSpec, shard: Shard, key: str) -> None:
    """A norm over a branch's output before the residual add (Gemma's post-attention and
    post-feedforward norms). Its backward needs its input, the branch's output, which nothing
    else keeps (the residual add does not): kept until the backward; only full recompute
    drops it."""
    elements = shard.sp_tokens * model.hidden_size
    cost.norm(key, model.hidden_size, model.norm)
    cost.save(key + "_in", elements * shard.act_bytes, *_op(shard))
    cost.elementwise(2 * elements * shard.act_bytes, *_op(shard))  # read + write


def _residual(cost: BlockBuilder, model: ModelSpec, shard: Shard, mask: str) -> None:
    """(Dropout and) residual add: read the branch output and the residual, write the sum;
    backward passes the gradient to both (as much traffic)."""
    elements = shard.sp_tokens * model.hidden_size
    traffic = 3 * elements * shard.act_bytes
    if model.hidden_dropout:
        cost.save(mask, elements)
        traffic += elements  # the 1-byte mask
    work = Work(memory=traffic, kernels=1)
    cost.add(work, work, ZERO, *_op(shard))


def _mtp(cost: BlockBuilder, model: ModelSpec, shard: Shard, index: int) -> None:
    """DeepSeek-V3 multi-token prediction module: normalise the previous depth's hidden state
    and the embedding of the token ``index+1`` ahead, project the concatenation (2h -> h),
    run one transformer layer, then the shared head and its loss. The embedding and the
    output head are the main model's (same keys): a rank holding both counts them once."""
    h, a, sp = model.hidden_size, shard.act_bytes, shard.sp_tokens
    prefix = f"mtp.{index}."
    cost.save(prefix + "hidden_input", sp * h * a, keep=True)
    cost.save(prefix + "token_ids", shard.tokens * TOKEN_ID_BYTES, keep=True)
    cost.params.append(Param("word_embeddings", model.vocab_size * h, tp_split=True))
    _saved_norm(cost, model, shard, prefix + "enorm", prefix + "enorm_out", quantized=True)
    _saved_norm(cost, model, shard, prefix + "hnorm", prefix + "hnorm_out", quantized=True)
    cost.linear(prefix + "eh_proj", 2 * h, h, tokens=shard.tokens / shard.tp, split=True)
    moe = model.is_moe_layer(model.num_layers + index)
    _layer(cost, model, shard, prefix + "layer.", moe=moe, keep=False)
    _head(cost, model, shard, prefix=prefix)


def attended_share(seq_len: int, window: int | None, chunk: int | None = None) -> float:
    """Share of a sequence's s x s score matrix that causal flash attention computes: half
    (``CAUSAL``), or with a sliding window w < s, where query p attends to min(p+1, w) keys,
    (s*w - w^2/2) / s^2. The exact count of attended pairs is s*w - w^2/2 + w/2; like the
    causal half (s^2/2 of s(s+1)/2 pairs), the half diagonal is left out, so the share is
    continuous at w = s and never above the causal one.

    With chunks of c < s tokens (Llama 4's chunked attention) a query attends causally within
    its own chunk: floor(s/c) causal c x c blocks and one of the remainder r, (s//c * c^2 +
    r^2) / 2 / s^2 (c/2s where c divides s), the half diagonals left out as above."""
    if chunk is not None and chunk < seq_len:
        full, rest = divmod(seq_len, chunk)
        return CAUSAL * (full * chunk * chunk + rest * rest) / seq_len**2
    if window is None or window >= seq_len:
        return CAUSAL
    return (seq_len * window - window * window / 2) / seq_len**2


def _core_attention(
    cost: BlockBuilder,
    model: ModelSpec,
    shard: Shard,
    *,
    d_qk: int,
    d_v: int,
    window: int | None = None,
    chunk: int | None = None,
) -> None:
    """Softmax(QK^T)V over the rank's heads; causal, so half the score matrix is computed
    (less with a sliding ``window`` or in ``chunk``s: ``attended_share``).

    With context parallelism the rank holds tokens / cp queries of each sequence and sees
    every key as the ring passes them (``cp_kv_bytes`` per step); the load-balanced split
    (see ``_check_shard``) gives each rank a cp-th of the causal work, in blocks of
    seq_len / cp tokens. Under all-to-alls over a2a ranks (``Shard.cp_a2a``) the rank runs an
    a2a-th of the heads over a2a times the tokens instead: the same FLOPs, in blocks a2a
    times longer (one block of seq_len where the all-to-alls span cp)."""
    b, s = shard.micro_batch, shard.seq_len
    queries = shard.tokens  # b * s / cp
    heads = model.num_attention_heads / shard.tp
    # Flash attention skips the masked half of a causal score matrix (and what lies outside a
    # sliding window); unfused attention computes the whole matrix and masks it (FLOPs here
    # are those executed), so a window changes neither its FLOPs nor its saved s x s tensors.
    # Flash attention saves no score matrix: a window changes its FLOPs only.
    share = attended_share(s, window, chunk) if shard.flash_attention else 1.0
    qk = 2.0 * queries * s * heads * d_qk * share
    av = 2.0 * queries * s * heads * d_v * share
    # Backward: dQ, dK (from QK^T) and dV, dP (from PV) are 2x forward; flash attention also
    # recomputes the scores QK^T in backward instead of saving them.
    if shard.flash_attention:
        block = s * shard.cp_a2a // shard.cp
        if chunk is not None and chunk < block:  # independent causal problems of a chunk each
            block, window = chunk, None
        extra = flash_overhead(block, (d_qk + d_v) / 2, causal=True, window=window)
        fwd_flops, bwd_flops = qk + av, 2 * (qk + av) + qk
        fwd = Work(attention=fwd_flops, kernels=1, attention_overhead=fwd_flops * extra)
        bwd = Work(attention=bwd_flops, kernels=1, attention_overhead=bwd_flops * extra)
        cost.add(fwd, bwd, ZERO, "core_attn")
        cost.attention_fwd += fwd
        cost.attention_bwd += bwd
        cost.save("softmax_stats", queries * heads * SOFTMAX_STAT_BYTES, "core_attn")
        return
    # Unfused: two batched GEMMs each way and a memory-bound softmax over the scores.
    # One (s x d) @ (d x s) and one (s x s) @ (s x d) product per head; their backward
    # products are all activation gradients, so all run in B (none waits for W).
    batch = b * heads
    fwd = bwd = ZERO
    for shape in (Gemm(s, s, d_qk, batch), Gemm(s, d_v, s, batch)):
        fwd += Work(gemm=shape.flops, kernels=1, shapes=((shape, 1.0),))
        for g in shape.backward():
            bwd += Work(gemm=g.flops, kernels=1, shapes=((g, 1.0),))
    cost.add(fwd, bwd, ZERO, "core_attn")
    scores = b * heads * s * s  # elements of the s x s probabilities on this rank
    a = shard.act_bytes
    cost.elementwise(scores * a * 2, "core_attn")  # scale, mask, softmax: read + write
    if model.attention_dropout:
        cost.elementwise(scores * (2 * a + 1), "core_attn")
    cost.save("attn_probs", scores * a, "core_attn")
    if model.attention_dropout:
        cost.save("attn_dropout_mask", scores * 1, "core_attn")
        cost.save("attn_dropout_out", scores * a, "core_attn")


def _gqa(
    cost: BlockBuilder,
    model: ModelSpec,
    shard: Shard,
    prefix: str,
    window: int | None = None,
    chunk: int | None = None,
    *,
    rope: bool = True,
) -> None:
    h, d, t = model.hidden_size, model.head_dim, shard.tp
    nq, nkv = model.num_attention_heads, model.num_kv_heads
    tokens, a = shard.tokens, shard.act_bytes
    op = OP if shard.op_sac else ""
    bias = model.qkv_bias
    cost.linear(prefix + "q_proj", h, nq * d, tokens=tokens / t, split=True, bias=bias)
    # k and v are held with q as one linear_qkv tensor (and one bias)
    kv = functools.partial(cost.linear, tokens=tokens / t, split=True, bias=bias, fused=True)
    kv(prefix + "k_proj", h, nkv * d, module=op)
    kv(prefix + "v_proj", h, nkv * d)
    # q, k, v as the fused attention reads them (after the rotary embedding)
    attn_in = OFFLOAD_TAG + "core_attn"
    cost.save(prefix + "q", tokens * nq * d * a / t, attn_in)
    cost.save(prefix + "k", tokens * nkv * d * a / t, attn_in, *_op(shard))
    cost.save(prefix + "v", tokens * nkv * d * a / t, attn_in)
    if model.qk_norm or (model.qk_l2_norm and rope):
        _qk_norm(cost, model, shard, prefix, weights=model.qk_norm)
    # Where q and k are gathered after their norms (TrainingJob.qk_norm_gathered), each
    # layer all-gathers them over tp, and their gradients in backward (an all-gather of a
    # region is half its all-reduce, the unit of tp_collectives), and the rotary embedding
    # that follows runs on every head.
    gathered = model.qk_norm and shard.qk_gathered and t > 1
    if gathered:
        cost.tp_collectives += (nq + nkv) * d / h / 2
    if rope and not model.learned_positions:  # rotary embedding of q and k: read + write
        turned = (nq + nkv) * d * model.rotary_percent  # the share partial_rotary_factor turns
        on = 1 if gathered else t
        cost.elementwise(2 * tokens * turned * a / on, *_op(shard))
        if shard.eager_ops:
            _eager(cost, tokens * turned / on, "rotary", a, *_op(shard), style=shard.eager_ops)
    if shard.cp_a2a > 1:  # q, k and v to the head split, the output back
        cost.cp_a2a_bytes += 2 * tokens * (nq + nkv) * d * a / t
    if shard.cp_a2a < shard.cp:  # the K and V the context ring passes (as many bytes a step
        cost.cp_kv_bytes += 2 * tokens * nkv * d * a / t  # after the all-to-all as before)
    if model.attention_sinks:
        # One learned logit per query head joins each softmax (gpt-oss): parameters, and
        # work too small to count (one exponential per query and head).
        cost.params.append(Param(prefix + "sinks", nq, tp_split=True))
    _core_attention(cost, model, shard, d_qk=d, d_v=d, window=window, chunk=chunk)
    cost.save(
        prefix + "attn_proj_in",
        tokens * nq * d * shard.linear_input_bytes / t,
        OFFLOAD_TAG + "attn_proj",
    )
    cost.linear(
        prefix + "o_proj",
        nq * d,
        h,
        tokens=tokens / t,
        split=True,
        bias=model.linear_bias or model.o_proj_bias,
        module=op,
    )


def _qk_norm(
    cost: BlockBuilder, model: ModelSpec, shard: Shard, prefix: str, *, weights: bool = True
) -> None:
    """RMSNorm over each head's query and key before the rotary embedding (Qwen3's q_norm and
    k_norm: head_dim weights each, shared by the heads, so replicated over tp). Its backward
    needs its inputs, the q and k projections' outputs, which nothing else keeps: Megatron's
    ``layernorm`` recompute module covers the two layer norms only, so only full recompute
    drops them. Per-op checkpointing keeps the q projection's output (its ``q`` group
    stands for it) and recomputes the k projection, so it drops both copies here. Without
    ``weights`` it is Llama 4's parameter-free L2 norm: the same passes, no parameters."""
    d, t, tokens, a = model.head_dim, shard.tp, shard.tokens, shard.act_bytes
    nq, nkv = model.num_attention_heads, model.num_kv_heads
    if weights:
        cost.norm(prefix + "q_norm", d, model.norm)
        cost.norm(prefix + "k_norm", d, model.norm)
    cost.save(prefix + "q_norm_in", tokens * nq * d * a / t, *_op(shard))
    cost.save(prefix + "k_norm_in", tokens * nkv * d * a / t, *_op(shard))
    cost.elementwise(2 * tokens * (nq + nkv) * d * a / t, *_op(shard))  # read + write


def _mla(
    cost: BlockBuilder,
    model: ModelSpec,
    shard: Shard,
    prefix: str,
    window: int | None = None,
    chunk: int | None = None,
) -> None:
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
    cost.save(prefix + "mla_latent_norm_out", tokens * (latent + dc) * shard.linear_input_bytes, up)
    cost.elementwise(2 * tokens * (latent + dc) * a, up)  # the latent norms
    cost.elementwise(2 * tokens * (n / t + 1) * dr * a)  # rotary part of q and of the shared k
    cost.save(prefix + "qkv", tokens * n * (2 * dq + dv) * a / t, up, OFFLOAD_TAG + "core_attn")
    if shard.cp_a2a > 1:  # q, k and v to the head split, the output back
        cost.cp_a2a_bytes += 2 * tokens * n * (dq + dv) * a / t
    if shard.cp_a2a < shard.cp:  # per-head K and V, as the ring passes
        cost.cp_kv_bytes += tokens * n * (dq + dv) * a / t
    _core_attention(cost, model, shard, d_qk=dq, d_v=dv, window=window, chunk=chunk)
    cost.save(
        prefix + "attn_proj_in",
        tokens * n * dv * shard.linear_input_bytes / t,
        OFFLOAD_TAG + "attn_proj",
    )
    cost.linear(prefix + "o_proj", n * dv, h, tokens=tokens / t, split=True)


def _ffn(
    cost: BlockBuilder,
    model: ModelSpec,
    shard: Shard,
    *,
    name: str,
    width: int,
    tokens: float,
    modules: tuple[str, ...],
    act_modules: tuple[str, ...],
    kind: str = "gemm",
) -> None:
    """Saved tensors and work of fc1 (gate+up when gated) -> activation -> fc2 for ``tokens``
    tokens on this rank at ``width`` (already divided by tp where split). Checkpointing the
    module (``modules``) re-runs all of it; ``act_modules`` re-run only the activation."""
    h, a = model.hidden_size, shard.act_bytes
    fc1_out = 2 * width if model.gated_mlp else width
    # Routed experts: one grouped GEMM over the rank's experts, each with its own tokens.
    routed = kind == "expert"
    rows = cost.tokens_per_expert if routed else tokens
    groups = tokens / rows if routed and rows else 1.0
    cost.gemm(Gemm(rows, fc1_out, h, groups, routed), *modules, kind=kind)
    act_only = [m for m in act_modules if m not in modules]
    # Per-op checkpointing re-runs a whole MoE layer (its grouped matmuls are not kept): the
    # "moe" tag already covers its experts.
    op = _op(shard) if "moe" not in modules else ()
    cost.elementwise(tokens * (fc1_out + width) * a, *modules, *act_only, *op)
    gated = model.gated_mlp
    if gated and shard.eager_ops:
        _eager(cost, tokens * width, "swiglu", a, *modules, *act_only, *op, style=shard.eager_ops)
    # Per-op checkpointing keeps w1's output and w2's; recomputes w3 (gated) or fc2 (not).
    cost.gemm(Gemm(rows, h, width, groups, routed), *modules, *([] if gated else op), kind=kind)
    if shard.fp8 and shard.fp8_cache:  # quantise the kept copy, dequantise it in backward
        elements = tokens * fc1_out
        cost.add(Work(memory=3 * elements, kernels=1), Work(memory=3 * elements, kernels=1))
    kept = shard.act_input_bytes
    # the routed experts' activation input: what offloading moe_act sends to the host
    off = (OFFLOAD_TAG + "moe_act",) if routed else ()
    if gated and op:  # gate (w1) and up (w3) halves: per-op checkpointing keeps only w1's
        up = Gemm(rows, width, h, groups, routed)
        cost.rerun(Work(kernels=1, shapes=((up, 1.0),), **{kind: up.flops}), *op)
        cost.save(f"{name}_gate_out", tokens * width * kept, *modules, *off)
        cost.save(f"{name}_up_out", tokens * width * kept, *modules, *op, *off)
        cost.save(f"{name}_out", tokens * h * a, added_by=OP)  # w2's output
    else:
        cost.save(f"{name}_fc1_out", tokens * fc1_out * kept, *modules, *off)
    act_tags = (*modules, *act_modules, *op)
    cost.save(f"{name}_act", tokens * width * shard.linear_input_bytes, *act_tags)
    if gated and shard.unfused_swiglu and not routed:  # act(gate), kept by the multiply
        cost.save(f"{name}_act_gate", tokens * width * a, *act_tags)


def _fc_params(model: ModelSpec, width: int) -> int:
    gate_up = 2 * width if model.gated_mlp else width
    bias = (gate_up + model.hidden_size) if model.linear_bias or model.mlp_bias else 0
    return model.hidden_size * gate_up + width * model.hidden_size + bias


def _fc_tensors(model: ModelSpec) -> int:
    """Tensors of one MLP: linear_fc1 (gate and up fused) and linear_fc2, with their biases."""
    return 2 * (1 + (model.linear_bias or model.mlp_bias))


def _dense_mlp(cost: BlockBuilder, model: ModelSpec, shard: Shard, prefix: str) -> None:
    t = shard.tp
    fc = _fc_params(model, model.ffn_hidden_size)
    cost.params.append(Param(prefix + "mlp", fc, True, tensors=_fc_tensors(model)))
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


def _moe(cost: BlockBuilder, model: ModelSpec, shard: Shard, prefix: str) -> None:
    """Router (replicated) + routed experts (sharded over ep, each split over etp: the etp
    ranks of an expert gather the tokens dispatched to it, each computes its slice of the
    expert's width, and their outputs are reduce-scattered back) + shared experts (split over
    tp like a dense MLP and reduced over the full data-parallel group, as Megatron-LM's
    SharedExpertMLP)."""
    h, e, k, a = model.hidden_size, model.num_experts, model.experts_per_token, shard.act_bytes
    sp = shard.sp_tokens
    cost.moe_layers += 1
    bias = model.router_bias
    cost.params.append(
        Param(prefix + "router", e * h + (e if bias else 0), False, tensors=1 + bias)
    )
    if model.router_expert_bias:
        cost.params.append(Param(prefix + "router_bias", e, False, trainable=False))
    cost.gemm(Gemm(sp, e, h), "moe", quantized=False)
    cost.elementwise(sp * e * 4 * 2, "moe")  # fp32 scores: softmax/sigmoid and top-k
    cost.save(prefix + "router_scores", sp * e * ROUTER_SCORE_BYTES, "moe")
    # All experts of the layer as one tensor; a rank keeps e/ep of them (memory.py).
    cost.params.append(
        Param(
            prefix + "experts",
            e * _fc_params(model, model.moe_ffn_hidden_size),
            tp_split=False,
            expert=True,
            active=Fraction(k, e),
            tensors=e * _fc_tensors(model),
        )
    )
    # Each rank dispatches its sp tokens x k copies; balanced routing brings as many back,
    # the busiest rank moe_load_imbalance times that.
    copies = sp * k * shard.moe_load_imbalance
    gathered = copies * shard.etp  # the tokens of the etp ranks of its experts
    cost.tokens_per_expert = gathered * shard.ep / e  # the busiest rank holds e/ep experts
    # torchtitan's per-op checkpointing (OP) keeps the outputs of all-to-alls
    # (_c10d_functional.all_to_all_single is on its save list, torchtitan
    # models/deepseek_v3/infra/parallelize.py _op_sac_save_list, 82a9530f6): under expert
    # parallelism the dispatched tokens and the combined expert outputs stay for the
    # backward, which recomputes the rest of the MoE layer from them.
    a2a_kept = shard.op_sac and shard.ep > 1
    cost.save(
        prefix + "moe_dispatched",
        gathered * h * shard.linear_input_bytes,
        "moe",
        OFFLOAD_TAG + "expert_fc1",
        op_keeps=a2a_kept,
    )
    if a2a_kept:
        cost.save(prefix + "moe_combined", copies * h * a, "moe", added_by=OP)
    # Permute tokens into expert order before dispatch, and back (weighted) after combine.
    cost.elementwise(2 * copies * h * a, "moe")
    cost.elementwise(2 * copies * h * a, "moe")
    _ffn(
        cost,
        model,
        shard,
        name="moe",
        width=model.moe_ffn_hidden_size // shard.etp,
        tokens=gathered,
        modules=("moe",),
        act_modules=("moe_act",),
        kind="expert",
    )
    if shard.probs_in_expert:  # the weighted activation keeps its FP32 probabilities
        cost.save(prefix + "moe_probs", copies * 4, "moe")
    else:  # the experts' outputs stay for the backward of the probability-weighted combine
        cost.save(prefix + "moe_expert_out", copies * h * a, "moe")
    if model.num_shared_experts:
        width = shared_width(model)
        shared = _fc_params(model, width)
        cost.params.append(
            Param(prefix + "shared_experts", shared, True, tensors=_fc_tensors(model))
        )
        if shard.fp8 and shard.fp8_saves_inputs:  # its own FP8 copy of the router's input
            copy = sp * h * shard.linear_input_bytes
            cost.save(prefix + "shared_input", copy, "layernorm", "shared_experts", "moe")
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
            cost.params.append(Param(prefix + "shared_gate", h, tp_split=False))
            cost.gemm(Gemm(sp, 1, h), "shared_experts", "moe", quantized=False)
            cost.save(prefix + "shared_gate_out", sp * a, "shared_experts", "moe")
    # "moe" re-runs the whole layer (router, experts, shared experts): every piece above is
    # registered under it.
