"""Seconds of each pipeline stage's work for one micro-batch, and of each rank's per-step work.

This is the table both the analytic step time (``planner.steptime``) and the simulated
executor (``planner.simulate``) read, so they can disagree only in how they schedule it.

Per stage (one chunk of the layout, on one rank of its pipeline position):

- ``fwd``, ``bwd_input``, ``bwd_weight``: compute (``planner.costs.compute``) plus the
  tensor-parallel collectives inside the block (Megatron-LM runs them on the compute stream,
  so they are exposed: with sequence parallelism an all-gather and a reduce-scatter per
  tensor-parallel region, priced as one all-reduce of the region's activations);
- ``recompute``: forward work (and, under full recompute, its tensor-parallel collectives)
  repeated before the backward; counted inside ``bwd_input``;
- ``a2a_fwd`` / ``a2a_bwd``: expert-parallel all-to-alls per micro-batch: dispatch and combine
  in forward, their two transposes in backward (plus the forward pair again when recompute
  re-runs the MoE layer), exposed unless a schedule overlaps them (DualPipe's paired chunks);
- ``p2p`` / ``p2p_back``: sending this stage's output to the next stage / its input gradient
  to the previous one;
- ``grad_sync``: the data-parallel gradient reduction of the stage's parameters once per step
  (all-reduce under ZeRO-0, reduce-scatter under ZeRO-1/2; the updated parameters' all-gather
  is assumed overlapped with the next step's forward, as Megatron-LM's --overlap-param-gather);
- ``zero_gather`` / ``zero_reduce``: per micro-batch ZeRO-3 parameter all-gathers (each of
  forward and backward) and ZeRO-2/3 gradient reduce-scatters, prefetched and overlapped with
  compute, so only the excess over the op's compute is exposed.

Per rank: ``optimizer``: the optimizer step, memory-bound over the rank's state (read and
write master weights and moments, read gradients, write weights; an HBM EMA read and written).

Ignored: the tied embedding's gradient all-reduce between the first and last stage, the
cross-entropy's small tensor-parallel reductions, and the MoE router's auxiliary reductions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.costs.blocks import BlockCost, Param
from planner.costs.comm import Network, group, moe_dispatch_bytes
from planner.costs.compute import Rates, block_time
from planner.costs.memory import StageMemory, block_costs, shard_of, shards
from planner.layout import Layout, parse_recompute
from planner.schedules import stage_rank
from planner.specs import DTYPE_BYTES, ClusterSpec, ModelSpec, TrainingJob

# DeepSeek-V3 report section 3.2.2: 20 of the H800's 132 SMs suffice to run the all-to-all
# (and pipeline sends) while computation overlaps it; those SMs are lost to compute meanwhile.
OVERLAP_SM_SHARE = 20 / 132


@dataclass(frozen=True)
class StageTime:
    """Seconds of one stage's work for one micro-batch (``grad_sync``: once per step)."""

    stage: int
    fwd: float
    bwd_input: float
    bwd_weight: float
    recompute: float
    tp_fwd: float  # tensor-parallel collectives inside ``fwd``
    tp_bwd: float  # ... inside ``bwd_input`` (those re-run by recompute are in ``recompute``)
    a2a_fwd: float
    a2a_bwd: float
    p2p: float  # send of the forward output to the next stage
    p2p_back: float  # send of the input gradient to the previous stage
    grad_sync: float
    zero_gather: float
    zero_reduce: float

    @property
    def tp_comm(self) -> float:
        return self.tp_fwd + self.tp_bwd


def stage_times(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, layout: Layout, network: Network
) -> list[StageTime]:
    """One ``StageTime`` per entry of ``layout.stages``."""
    rates = Rates.of(cluster, job)
    shard = shard_of(job, layout)
    costs = block_costs(model, layout, shard)
    act = shard.sp_tokens * model.hidden_size * shard.act_bytes  # a stage boundary's tensor
    region = shard.tokens * model.hidden_size * shard.act_bytes  # a tp region's activations
    a2a_bytes = moe_dispatch_bytes(model, shard) if model.num_experts else 0.0
    # FP8 training dispatches the FP8-quantised expert inputs (1 byte per element plus one
    # fp32 scale per 128 elements) and combines in BF16 (DeepSeek-V3 report section 3.3.2);
    # backward all-to-alls carry activation gradients at the activation dtype.
    dispatch_share = (1 + 4 / 128) / shard.act_bytes if job.compute_dtype == "fp8" else 1.0
    out = []
    for index, stage in enumerate(layout.stages):
        rank = first_rank(layout, index)
        tp_ar = network.all_reduce_time(region, group(layout, "tp", rank))
        ep_group = group(layout, "ep", rank)
        combine = network.moe_all_to_all_time(a2a_bytes, ep_group, model)
        dispatch = network.moe_all_to_all_time(a2a_bytes * dispatch_share, ep_group, model)
        forward_pair = dispatch + combine
        total = BlockRow()
        params: dict[str, Param] = {}
        for placed in stage.blocks:
            cost = costs[placed.block]
            total += block_row(cost, rates, parse_recompute(placed.recompute), tp_ar)
            for p in cost.params:
                params.setdefault(p.key, p)
        dense, expert = _grad_bytes(list(params.values()), job, layout)
        out.append(
            StageTime(
                stage=index,
                fwd=total.fwd,
                bwd_input=total.bwd_input,
                bwd_weight=total.bwd_weight,
                recompute=total.recompute,
                tp_fwd=total.tp_fwd,
                tp_bwd=total.tp_fwd,
                a2a_fwd=total.moe_layers * forward_pair,
                a2a_bwd=total.moe_layers * 2 * combine + total.moe_rerun * forward_pair,
                p2p=stage_send(layout, network, index, act),
                p2p_back=stage_send(layout, network, index - 1, act) if index else 0.0,
                grad_sync=_grad_sync(layout, network, rank, dense, expert),
                zero_gather=_zero_gather(layout, network, rank, params, job),
                zero_reduce=_zero_reduce(layout, network, rank, dense, expert),
            )
        )
    return out


@dataclass(frozen=True)
class BlockRow:
    """One block's share of its stage's ``StageTime`` (seconds per micro-batch; the MoE
    counts are layers). Stages add these up; the solver adds them up the same way."""

    fwd: float = 0.0  # compute and tensor-parallel collectives
    bwd_input: float = 0.0  # with the recompute (and the collectives it re-runs)
    bwd_weight: float = 0.0
    recompute: float = 0.0
    tp_fwd: float = 0.0
    moe_layers: int = 0
    moe_rerun: int = 0  # MoE layers whose forward (and all-to-alls) recompute repeats

    def __add__(self, other: BlockRow) -> BlockRow:
        return BlockRow(
            self.fwd + other.fwd,
            self.bwd_input + other.bwd_input,
            self.bwd_weight + other.bwd_weight,
            self.recompute + other.recompute,
            self.tp_fwd + other.tp_fwd,
            self.moe_layers + other.moe_layers,
            self.moe_rerun + other.moe_rerun,
        )


def block_row(
    cost: BlockCost, rates: Rates, choice: frozenset[str] | str, tp_all_reduce: float
) -> BlockRow:
    """A block's row under recompute ``choice``, with ``tp_all_reduce`` seconds per
    tensor-parallel collective of its activations."""
    t = block_time(cost, rates, choice)
    tp_fwd = cost.tp_collectives * tp_all_reduce
    rerun_tp = tp_fwd if choice == "full" else 0.0
    return BlockRow(
        fwd=t.fwd + tp_fwd,
        bwd_input=t.bwd_input + t.recompute + tp_fwd + rerun_tp,
        bwd_weight=t.bwd_weight,
        recompute=t.recompute + rerun_tp,
        tp_fwd=tp_fwd,
        moe_layers=cost.moe_layers,
        moe_rerun=cost.moe_layers if _reruns_moe(choice) else 0,
    )


def optimizer_time(memory: StageMemory, cluster: ClusterSpec) -> float:
    """Seconds of one rank's optimizer step (memory-bound; see the module docstring)."""
    b = memory.buckets
    traffic = 2 * b["optimizer"] + b["grads"] + b["weights"] + 2 * b["ema"]
    return traffic / (cluster.hbm_bandwidth_Bps * cluster.achieved.get("memory_bound", 1.0))


# -- helpers --------------------------------------------------------------------------------


def _reruns_moe(choice: frozenset[str] | str) -> bool:
    """Whether recompute repeats the MoE layer's forward (and so its all-to-alls)."""
    return choice == "full" or (isinstance(choice, frozenset) and "moe" in choice)


def _holder(layout: Layout, stage: int) -> int:
    """Pipeline rank holding ``stage`` (direction 0 for DualPipe, whose ranks also hold a
    mirror copy of another stage)."""
    return stage_rank(layout.schedule, layout.pp, stage, 0)


def first_rank(layout: Layout, stage: int) -> int:
    return _holder(layout, stage) * layout.tp * layout.dp


def stage_send(layout: Layout, network: Network, stage: int, nbytes: float) -> float:
    """Send to the next stage's holder (DualPipe's second direction mirrors the same hop)."""
    if stage + 1 >= len(layout.stages):
        return 0.0
    return network.p2p_time(nbytes, first_rank(layout, stage), first_rank(layout, stage + 1))


def _grad_bytes(params: list[Param], job: TrainingJob, layout: Layout) -> tuple[float, float]:
    """Unsharded gradient bytes on one rank: (dense, routed experts)."""
    gb = DTYPE_BYTES[job.grad_dtype]
    dense = sum(p.numel / shards(p, layout) * gb for p in params if p.trainable and not p.expert)
    expert = sum(p.numel / shards(p, layout) * gb for p in params if p.trainable and p.expert)
    return dense, expert


def dp_groups(layout: Layout, rank: int) -> tuple[list[int], list[int]]:
    """Gradient-reduction groups of a rank's dense and expert parameters. DualPipe keeps each
    stage on two ranks (both directions), so their gradients are reduced together."""
    dense, expert = group(layout, "dp", rank), group(layout, "edp", rank)
    if layout.schedule == "dualpipe":
        pp_rank = rank // (layout.tp * layout.dp)
        mirror = rank + (layout.pp - 1 - 2 * pp_rank) * layout.tp * layout.dp
        if mirror != rank:
            dense = dense + group(layout, "dp", mirror)
            expert = expert + group(layout, "edp", mirror)
    return dense, expert


def _grad_sync(layout: Layout, network: Network, rank: int, dense: float, expert: float) -> float:
    if layout.zero >= 2:  # reduced per micro-batch instead (``zero_reduce``)
        return 0.0
    dense_group, expert_group = dp_groups(layout, rank)
    collective = network.all_reduce_time if layout.zero == 0 else network.reduce_scatter_time
    return collective(dense, dense_group) + collective(expert, expert_group)


def _zero_reduce(layout: Layout, network: Network, rank: int, dense: float, expert: float) -> float:
    if layout.zero < 2:
        return 0.0
    dense_group, expert_group = dp_groups(layout, rank)
    return network.reduce_scatter_time(dense, dense_group) + network.reduce_scatter_time(
        expert, expert_group
    )


def _zero_gather(
    layout: Layout, network: Network, rank: int, params: dict[str, Param], job: TrainingJob
) -> float:
    if layout.zero < 3:
        return 0.0
    wb = DTYPE_BYTES[job.weight_dtype]
    ps = list(params.values())
    dense = sum(p.numel / shards(p, layout) * wb for p in ps if not p.expert)
    expert = sum(p.numel / shards(p, layout) * wb for p in ps if p.expert)
    dense_group, expert_group = dp_groups(layout, rank)
    return network.all_gather_time(dense, dense_group) + network.all_gather_time(
        expert, expert_group
    )


@dataclass(frozen=True)
class OpParts:
    """Seconds of one task on a rank's compute stream, by what they are spent on."""

    compute: float = 0.0  # forward / backward work (tensor-parallel comm and recompute apart)
    recompute: float = 0.0
    tp: float = 0.0
    a2a: float = 0.0  # exposed expert all-to-all
    p2p: float = 0.0  # exposed pipeline send
    zero: float = 0.0  # exposed wait for ZeRO gathers / reduce-scatters

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.tp + self.a2a + self.p2p + self.zero


def op_parts(st: StageTime, kind: str, *, overlapped: bool = False) -> OpParts:
    """One op (``F``, ``B``, ``W`` or fused ``BW``) of stage ``st``. Its sends block the rank
    (Megatron-LM's 1F1B waits for each send-and-receive pair), so the forward carries the
    send of its output and the backward the send of its input gradient, as its expert
    all-to-alls are exposed; ``overlapped`` leaves both out (a DualPipe pair hides them).
    ZeRO-3 gathers the stage's weights before ``F`` and ``B``/``BW`` and ZeRO-2/3
    reduce-scatter the gradients ``W``/``BW`` produce, prefetched or overlapped: the op lasts
    as long as the longer of its work and that communication."""
    comms = not overlapped
    if kind == "F":
        parts = OpParts(
            compute=st.fwd - st.tp_fwd,
            tp=st.tp_fwd,
            a2a=st.a2a_fwd * comms,
            p2p=st.p2p * comms,
        )
        hidden = st.zero_gather
    elif kind == "W":
        parts, hidden = OpParts(compute=st.bwd_weight), st.zero_reduce
    else:
        weight = st.bwd_weight if kind == "BW" else 0.0
        parts = OpParts(
            compute=st.bwd_input + weight - st.recompute - st.tp_bwd,
            recompute=st.recompute,
            tp=st.tp_bwd,
            a2a=st.a2a_bwd * comms,
            p2p=st.p2p_back * comms,
        )
        hidden = st.zero_gather + (st.zero_reduce if kind == "BW" else 0.0)
    return replace(parts, zero=max(0.0, hidden - parts.total))


def op_time(st: StageTime, kind: str) -> float:
    """Seconds of one op on its rank's compute stream (see ``op_parts``)."""
    return op_parts(st, kind).total


def pair_parts(f: StageTime, b: StageTime, b_kind: str) -> OpParts:
    """DualPipe's overlapped pair: one chunk's forward runs alongside another's backward, the
    all-to-alls and pipeline sends of each hidden behind the other's compute (DeepSeek-V3
    report section 3.2.1); what the communication takes beyond the compute is exposed. The
    communication kernels occupy ``OVERLAP_SM_SHARE`` of the SMs meanwhile, so the compute
    runs that much slower (the slowdown is counted as all-to-all time)."""
    fp, bp = op_parts(f, "F", overlapped=True), op_parts(b, b_kind, overlapped=True)
    work = fp.total + bp.total
    a2a, p2p = f.a2a_fwd + b.a2a_bwd, f.p2p + b.p2p_back
    slowed = work / (1 - OVERLAP_SM_SHARE) if a2a + p2p > 0 else work
    excess = max(slowed, a2a + p2p) - work
    share = a2a / (a2a + p2p) if a2a + p2p > 0 else 0.0
    return OpParts(
        compute=fp.compute + bp.compute,
        recompute=fp.recompute + bp.recompute,
        tp=fp.tp + bp.tp,
        zero=fp.zero + bp.zero,
        a2a=excess * share,
        p2p=excess * (1 - share),
    )


def paired_time(f: StageTime, b: StageTime, b_kind: str) -> float:
    """Seconds of a DualPipe pair (see ``pair_parts``)."""
    return pair_parts(f, b, b_kind).total
