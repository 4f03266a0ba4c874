"""Seconds of each pipeline stage's work for one micro-batch, and of each rank's per-step work.

This is the table every timing consumer reads: the timeline (``planner.timeline``, behind
``evaluate``) and the solver's tables (``planner.solve.tables``) both take their numbers from
here and state what runs beside what with the one set of rules in ``planner.costs.overlap``;
the simulator (``planner.executor``, behind ``simulate``) takes each block's and transfer's
figures from here and lets resources decide what overlaps.

Per stage (one chunk of the layout, on one rank of its pipeline position):

- ``fwd``, ``bwd_input``, ``bwd_weight``: compute (``planner.costs.compute``) plus the part of
  the block's tensor-parallel collectives the framework leaves exposed (``tp_exposed``), and
  the SMs the hidden part's kernels take from the compute;
- ``recompute``: forward work (and, under full recompute, its tensor-parallel collectives)
  repeated before the backward; counted inside ``bwd_input``;
- ``a2a_fwd`` / ``a2a_bwd``: expert-parallel all-to-alls per micro-batch: dispatch and combine
  in forward, their two transposes in backward (plus the forward pair again when recompute
  re-runs the MoE layer);
- ``p2p`` / ``p2p_back``: sending this stage's output to the next stage / its input gradient
  to the previous one;
- ``grad_sync``: the data-parallel gradient reduction of the stage's parameters once per step
  (all-reduce under ZeRO-0, reduce-scatter under ZeRO-1);
- ``param_gather``: under ZeRO-1 and 2, the all-gather of the stage's updated working weights
  over the same groups, once per step (``planner.timeline`` says where it runs: overlapped
  where the framework overlaps it, Megatron-LM's ``--overlap-param-gather`` and FSDP2's
  prefetch; after the optimizer step otherwise, as DeepSpeed's ZeRO-1/2 optimizer runs it);
- ``zero_gather`` / ``zero_reduce``: per micro-batch ZeRO-3 parameter all-gathers (each of
  forward and backward) and ZeRO-2/3 gradient reduce-scatters.

Every communication is a ``Transfer``: its seconds and how long it keeps the GPU's InfiniBand
share and its NVLink ports busy, so transfers in flight at once share the links.

Per rank: ``optimizer``: the optimizer step, memory-bound over the rank's state (read and
write master weights and moments, read gradients, write weights; an HBM EMA read and
written), and an offloaded part's PCIe copies and host step (``optimizer_seconds``).

Ignored: the tied embedding's gradient all-reduce between the first and last stage, the
cross-entropy's small tensor-parallel reductions, and the MoE router's auxiliary reductions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Literal

from planner.costs.blocks import BlockCost, Param, Shard
from planner.costs.comm import NO_TRANSFER, Network, Transfer, group, moe_dispatch_bytes
from planner.costs.compute import BlockTime, Rates, block_time, work_time
from planner.costs.memory import StageMemory, block_costs, shard_of
from planner.costs.quantities import (
    BYTES,
    OFF,
    Bytes,
    FloatStage,
    Quantity,
    Rate,
    StageComm,
    stage_quantities,
    transfer,
)
from planner.costs.state import shards
from planner.errors import PlannerError
from planner.frameworks import UNSTATED_SM_COUNT, framework
from planner.layout import Layout, parse_recompute
from planner.memo import Memo
from planner.schedules import schedule_of, stage_rank
from planner.specs import DTYPE_BYTES, ClusterSpec, ModelSpec, TrainingJob

# Tensor-parallel overlap as each framework does it (``TrainingJob.framework``):
# - megatron (``--tp-comm-overlap``, Transformer Engine userbuffers): the all-gather before
#   the column-parallel GEMMs runs as a ring exchange in tp steps, each step's transfer
#   behind the previous step's partial GEMM, so one step in tp is exposed, on 1 SM; the
#   reduce-scatter after the row-parallel GEMMs is pipelined in 4 splits on 24 SMs, the last
#   split exposed (Megatron-Bridge's published H100 userbuffers configurations, e.g.
#   ``userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048``: qkv/fc1 fprop ring_exchange,
#   proj fprop pipeline num_sm=24 num_splits=4; backward bulk overlaps on 2-16 SMs);
# - torchtitan (async TP): both collectives decomposed into tp steps behind the partial
#   matmuls, one step exposed, on copy engines rather than SMs (PyTorch, "[Distributed w/
#   TorchTitan] Introducing Async Tensor Parallelism in PyTorch", discuss.pytorch.org/t/209487);
# - deepspeed and the eager torch runtime: no overlap.
# Either way no more is hidden than the block's own compute in that phase.
TP_RS_SPLITS = 4
TP_RS_SMS = 24
# All-to-alls of one attention pass under Layout.cp_comm_type "a2a": three for q, k and v before
# it and one for its output after (backward: the output's gradient, then dq, dk and dv), each
# as large as the rank's own tensor, on the compute stream's critical path (Transformer
# Engine's AttnFuncWithCPAndQKVOA2A, context_parallel.py at d0067d0: each call is async only
# so that one tensor's reorder overlaps the next one's transfer; DeepSpeed's
# DistributedAttention and UlyssesSPAttentionHF issue the same four).
CP_A2A_CALLS = 4
GB = 1e9


@dataclass(frozen=True)
class StageTime:
    """Seconds of one stage's work for one micro-batch (``grad_sync``: once per step)."""

    stage: int
    fwd: float
    bwd_input: float
    bwd_weight: float
    recompute: float
    tp_fwd: float  # exposed tensor-parallel communication inside ``fwd``
    tp_bwd: float  # ... inside ``bwd_input`` (those re-run by recompute are in ``recompute``)
    a2a_fwd: Transfer
    a2a_bwd: Transfer
    p2p: Transfer  # send of the forward output to the next stage
    p2p_back: Transfer  # send of the input gradient to the previous stage
    grad_sync: Transfer
    param_gather: Transfer
    zero_gather: Transfer
    zero_reduce: Transfer
    cp_fwd: float = 0.0  # exposed context-parallel ring inside ``fwd``
    cp_bwd: float = 0.0  # ... inside ``bwd_input``
    offload_fwd: float = 0.0  # exposed activation copies to the host inside ``fwd``
    offload_bwd: float = 0.0  # ... and back, inside ``bwd_input``

    @property
    def tp_comm(self) -> float:
        return self.tp_fwd + self.tp_bwd

    @classmethod
    def work_only(cls, stage: int, fwd: float, bwd_input: float, bwd_weight: float) -> StageTime:
        """A stage that computes and sends, reduces and gathers nothing."""
        return cls(
            stage=stage,
            fwd=fwd,
            bwd_input=bwd_input,
            bwd_weight=bwd_weight,
            recompute=0.0,
            tp_fwd=0.0,
            tp_bwd=0.0,
            a2a_fwd=NO_TRANSFER,
            a2a_bwd=NO_TRANSFER,
            p2p=NO_TRANSFER,
            p2p_back=NO_TRANSFER,
            grad_sync=NO_TRANSFER,
            param_gather=NO_TRANSFER,
            zero_gather=NO_TRANSFER,
            zero_reduce=NO_TRANSFER,
        )


def stage_times(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, layout: Layout, network: Network
) -> list[StageTime]:
    """One ``StageTime`` per entry of ``layout.stages``: each block's row (its compute and
    the communication inside it) and the stage's quantities as ``costs.quantities`` states
    them, over the layout's own blocks."""
    rates = Rates.of(cluster, job)
    shard = shard_of(job, layout)
    costs = block_costs(model, layout, shard)
    tp = TpComm.of(model, job, layout, network, shard, sm_count=cluster.sm_count)
    sends = stage_sends(model, layout, network, shard)
    out = []
    for index, stage in enumerate(layout.stages):
        rank = first_rank(layout, index)
        position = position_comm(model, job, layout, network, shard, rank, rates.pcie_Bps)
        comm = stage_comm(position, *sends[index])
        rows: list[BlockRow] = []
        params: dict[str, Param] = {}
        for placed in stage.blocks:
            cost = costs[placed.block]
            rows.append(block_row(cost, rates, parse_recompute(placed.recompute), tp))
            for p in cost.params:
                params.setdefault(p.key, p)
        total = sum(rows, BlockRow())
        values = stage_quantities(FloatStage(rows, stage_bytes(params, job, layout)), comm)
        out.append(
            StageTime(
                stage=index,
                fwd=values[Quantity.FWD],
                bwd_input=values[Quantity.BWD_INPUT],
                bwd_weight=values[Quantity.BWD_WEIGHT],
                recompute=total.recompute,
                tp_fwd=total.tp_fwd,
                tp_bwd=total.tp_bwd,
                a2a_fwd=transfer(values, Quantity.A2A_FWD),
                a2a_bwd=transfer(values, Quantity.A2A_BWD),
                p2p=transfer(values, Quantity.P2P),
                p2p_back=transfer(values, Quantity.P2P_BACK),
                grad_sync=transfer(values, Quantity.GRAD_SYNC),
                param_gather=transfer(values, Quantity.PARAM_GATHER),
                zero_gather=transfer(values, Quantity.ZERO_GATHER),
                zero_reduce=transfer(values, Quantity.ZERO_REDUCE),
                cp_fwd=total.cp_fwd,
                cp_bwd=total.cp_bwd,
                offload_fwd=total.offload_fwd,
                offload_bwd=total.offload_bwd,
            )
        )
    return out


def stage_bytes(
    params: Mapping[str, Param], job: TrainingJob, layout: Layout
) -> dict[Bytes, float]:
    """A stage's bytes that its collectives move (``costs.quantities.Bytes``): the unsharded
    gradients of its trainable parameters and its working weights, dense and routed experts
    apart; shared tensors once."""
    gb, wb = DTYPE_BYTES[job.grad_dtype], DTYPE_BYTES[job.working_weight_dtype]
    out = dict.fromkeys(BYTES, 0.0)
    for p in params.values():
        local = p.numel / shards(p, layout)
        if p.trainable:
            out[Bytes.EXPERT_GRAD if p.expert else Bytes.DENSE_GRAD] += local * gb
        out[Bytes.EXPERT_WEIGHT if p.expert else Bytes.DENSE_WEIGHT] += local * wb
    return out


def position_comm(
    model: ModelSpec,
    job: TrainingJob,
    layout: Layout,
    network: Network,
    shard: Shard,
    rank: int,
    pcie_Bps: float = math.inf,
) -> StageComm:
    """The transfers of a stage held at ``rank``'s pipeline position, its sends aside (none:
    ``stage_comm`` adds them): its all-to-alls, and
    its gradient reduction (all-reduce under ZeRO-0, reduce-scatter under ZeRO-1), ZeRO-1/2's
    all-gather of the updated weights, ZeRO-3's gather and ZeRO-2/3's reduce-scatter, over
    the dense and the expert groups."""
    dispatch, combine = expert_all_to_alls(model, job, layout, network, shard, rank)
    dense, expert = dp_groups(layout, rank)
    z = layout.zero
    sync: Collective = "all_reduce" if z == 0 else "reduce_scatter"
    comm = StageComm(
        forward_pair=dispatch + combine,
        combine=combine,
        p2p=NO_TRANSFER,
        p2p_back=NO_TRANSFER,
        grad_sync=_rates(network, sync, dense, expert) if z <= 1 else (OFF, OFF),
        param_gather=_rates(network, "all_gather", dense, expert) if z in (1, 2) else (OFF, OFF),
        zero_gather=_rates(network, "all_gather", dense, expert) if z >= 3 else (OFF, OFF),
        zero_reduce=_rates(network, "reduce_scatter", dense, expert) if z >= 2 else (OFF, OFF),
    )
    if z == 1 and layout.optimizer_instances > 1:
        partial_sync, partial_gather = _partial_domains(network, layout, dense, expert)
        comm = dataclasses.replace(comm, grad_sync=partial_sync, param_gather=partial_gather)
    if z >= 3 and layout.zero_hpz > 1:
        comm = dataclasses.replace(
            comm, zero_gather=_hpz_gather(network, job, layout, dense, expert)
        )
    if z >= 3 and layout.param_offload:
        comm = dataclasses.replace(
            comm, zero_gather=_from_host(comm.zero_gather, job, layout, dense, expert, pcie_Bps)
        )
    slice_s = framework(job.framework).zero3_slice_s
    if z >= 3 and slice_s is not None and len(set(dense)) > 1:
        comm = per_tensor_collectives(comm, slice_s, len(set(dense)))
    return comm


def _partial_domains(
    network: Network, layout: Layout, dense: list[int], expert: list[int]
) -> tuple[tuple[Rate, Rate], tuple[Rate, Rate]]:
    """ZeRO-1's collectives over partial data-parallel domains (``Layout.optimizer_instances``
    = N; Megatron-LM's partial distributed optimizer): each group is cut into N instances of
    consecutive members (parallel_state.py's intra-partial groups at d98e8a64). The
    gradients are reduce-scattered within the rank's instance, then its shard (an
    instance-size-th of the bytes) all-reduced with the same shard of the other instances
    (the members at its place in each); the updated weights are all-gathered within the
    instance ("During the final micro-batch backpropagation, gradient ReduceScatters occur
    within the distributed domain, followed by AllReduce in the non-distributed domain.
    Parameter AllGathers are performed only within the distributed domain": Megatron-Bridge
    docs/performance-guide.md)."""
    n = layout.optimizer_instances  # divides both groups (Layout's validation)
    syncs, gathers = [], []
    for ranks in (dense, expert):
        members = list(dict.fromkeys(ranks))
        size = len(members) // n
        inner, across = members[:size], members[::size]
        rs = _rates(network, "reduce_scatter", inner, inner)[0]
        ar = _rates(network, "all_reduce", across, across)[0]
        syncs.append(Rate(rs.per_byte + ar.per_byte * (1 / size), rs.latency + ar.latency))
        gathers.append(_rates(network, "all_gather", inner, inner)[0])
    return (syncs[0], syncs[1]), (gathers[0], gathers[1])


def _from_host(
    gather: tuple[Rate, Rate],
    job: TrainingJob,
    layout: Layout,
    dense: list[int],
    expert: list[int],
    pcie_Bps: float,
) -> tuple[Rate, Rate]:
    """ZeRO-3's gather with the shards on the host (``Layout.param_offload``): each first
    copies the rank's shard to the GPU over PCIe (DeepSpeed's gather moves ds_tensor to the
    device before the all-gather), a group-size-th of the gathered bytes (of the secondary
    group's under ZeRO++, for all but a step's first forward gather), in series with it."""
    w = _whole_share(job, layout)
    out = []
    for rate, ranks in zip(gather, (dense, expert), strict=True):
        n = max(1, len(set(ranks)))
        share = w / n + (1 - w) / min(n, layout.zero_hpz)
        out.append(Rate(rate.per_byte + Transfer(share / pcie_Bps, 0.0, 0.0), rate.latency))
    return out[0], out[1]


def _whole_share(job: TrainingJob, layout: Layout) -> float:
    """Of a step's 2m ZeRO-3 gathers (a forward and a backward for each of m micro-batches),
    the share over the whole data-parallel group: all, or under ZeRO++'s hierarchical
    partitioning a step's first forward one alone (``_hpz_gather``)."""
    if layout.zero_hpz == 1:
        return 1.0
    return 1 / (2 * (job.global_batch // (layout.dp * layout.micro_batch)))


def _hpz_gather(
    network: Network, job: TrainingJob, layout: Layout, dense: list[int], expert: list[int]
) -> tuple[Rate, Rate]:
    """ZeRO-3's parameter gather under ZeRO++'s hierarchical partitioning
    (``Layout.zero_hpz``), per gather: a step's first forward gathers each parameter from
    the primary shards over the whole data-parallel group; every later gather, forward and
    backward, from the secondary shards over ``zero_hpz`` consecutive ranks of it
    (DeepSpeed's partition_parameters.py all_gather_coalesced: the secondary group wherever
    ds_secondary_tensor is set; stage3.py _post_step clears it). Of a step's 2m gathers (a
    forward and a backward for each of m micro-batches) one takes the whole group, so each
    is priced at (whole + (2m - 1) x secondary) / 2m: exact over the step, the first
    forward's extra spread over every micro-batch."""
    whole = _rates(network, "all_gather", dense, expert)
    inner = _rates(network, "all_gather", dense[: layout.zero_hpz], expert[: layout.zero_hpz])
    w = _whole_share(job, layout)
    return tuple(  # type: ignore[return-value]
        Rate(a.per_byte * w + b.per_byte * (1 - w), a.latency * w + b.latency * (1 - w))
        for a, b in zip(whole, inner, strict=True)
    )


def per_tensor_collectives(comm: StageComm, slice_s: float, ranks: int) -> StageComm:
    """``comm`` where ZeRO-3 gathers and reduce-scatters each parameter tensor by its own
    collective through c10d's list collectives (``Framework.zero3_slice_s``): each tensor
    pays the collective's latency (not once per stage) and the host's copy of each of the
    ``ranks`` slices, ``slice_s`` apiece (the links idle meanwhile). The expert group's
    tensors are priced at the dense group's (the frameworks that do this predate MoE)."""
    host = Transfer(ranks * slice_s, 0.0, 0.0)
    (gather, gather_e), (reduce, reduce_e) = comm.zero_gather, comm.zero_reduce
    return dataclasses.replace(
        comm,
        zero_gather=(Rate(gather.per_byte, NO_TRANSFER), gather_e),
        zero_reduce=(Rate(reduce.per_byte, NO_TRANSFER), reduce_e),
        gather_per_tensor=gather.latency + host,
        reduce_per_tensor=reduce.latency + host,
    )


def stage_comm(position: StageComm, p2p: Transfer, p2p_back: Transfer) -> StageComm:
    """A stage's transfers: those of its position (``position_comm``) and its two sends."""
    return dataclasses.replace(position, p2p=p2p, p2p_back=p2p_back)


def stage_sends(
    model: ModelSpec, layout: Layout, network: Network, shard: Shard
) -> list[tuple[Transfer, Transfer]]:
    """Each stage's pipeline sends: its output forward to the next stage's holder, and its
    input gradient back to the previous one's (a stage boundary's hidden states)."""
    act = shard.sp_tokens * model.hidden_size * shard.act_bytes
    forward = [stage_send(layout, network, s, act) for s in range(len(layout.stages))]
    return [(forward[s], forward[s - 1] if s else NO_TRANSFER) for s in range(len(forward))]


Collective = Literal["all_reduce", "reduce_scatter", "all_gather"]
_RATES: Memo[Rate] = Memo("timing.rates")


def _rates(
    network: Network, kind: Collective, dense: list[int], expert: list[int]
) -> tuple[Rate, Rate]:
    """The rates of collective ``kind`` over the dense and the expert group. A collective's
    time depends only on how its group spreads over nodes, so rates are kept by that."""
    method = {
        "all_reduce": network.all_reduce,
        "reduce_scatter": network.reduce_scatter,
        "all_gather": network.all_gather,
    }[kind]
    out = [
        _RATES.get((kind, network, network._spread(ranks)), partial(Rate.fit, method, ranks))
        for ranks in (dense, expert)
    ]
    return out[0], out[1]


def expert_all_to_alls(
    model: ModelSpec, job: TrainingJob, layout: Layout, network: Network, shard: object, rank: int
) -> tuple[Transfer, Transfer]:
    """One MoE layer's dispatch and combine for one micro-batch at ``rank``'s position. FP8
    training dispatches the FP8-quantised expert inputs (1 byte per element plus one fp32
    scale per 128 elements) and combines in BF16 (DeepSeek-V3 report section 3.3.2);
    backward all-to-alls carry activation gradients at the activation dtype. With expert
    tensor parallelism the dispatch is followed by an all-gather of the tokens over the
    expert's etp ranks and the combine preceded by a reduce-scatter of its outputs."""
    if not model.num_experts:
        return NO_TRANSFER, NO_TRANSFER
    nbytes = moe_dispatch_bytes(model, shard)  # type: ignore[arg-type]
    act_bytes = shard.act_bytes  # type: ignore[attr-defined]
    share = (1 + 4 / 128) / act_bytes if job.compute_dtype == "fp8" else 1.0
    ep_group = group(layout, "ep", rank)
    how = job.moe_dispatcher
    combine = network.moe_all_to_all(nbytes, ep_group, model, how)
    dispatch = network.moe_all_to_all(nbytes * share, ep_group, model, how)
    if layout.etp > 1:
        etp_group = group(layout, "etp", rank)
        dispatch = dispatch + network.all_gather(nbytes * share * layout.etp, etp_group)
        combine = network.reduce_scatter(nbytes * layout.etp, etp_group) + combine
    return dispatch, combine


@dataclass(frozen=True)
class TpComm:
    """One tensor-parallel collective of a block's activations, and how the framework
    overlaps it (see ``TP_RS_SPLITS``); and one step of the context-parallel ring (see
    ``cp_exposed``)."""

    seconds: float  # one all-reduce (an all-gather and a reduce-scatter) of a region
    mode: str  # "none" | "userbuffers" | "async"
    tp: int
    cp: int = 1  # ranks of the context ring (cp / Layout.cp_a2a)
    ring_latency: float = 0.0  # one ring step's latency (its slowest hop) ...
    ring_Bps: float = math.inf  # ... and bandwidth
    # One all-to-all over the Layout.cp_a2a consecutive cp ranks that split the heads: its
    # latency and its seconds per byte a rank holds (``Network.all_to_all``, affine in bytes)
    a2a_latency: float = 0.0
    a2a_s_per_byte: float = 0.0
    rs_sm_share: float = TP_RS_SMS / UNSTATED_SM_COUNT  # of the GPU's, the reduce-scatter's
    hidden: float = 1.0  # of what the overlap could hide, the share it does (Framework)

    @classmethod
    def of(
        cls,
        model: ModelSpec,
        job: TrainingJob,
        layout: Layout,
        network: Network,
        shard: object,
        *,
        sm_count: int | None,
    ) -> TpComm:
        """The collectives of ``layout`` on GPUs of ``sm_count`` SMs (None: unstated,
        ``frameworks.UNSTATED_SM_COUNT``)."""
        region = shard.tokens * model.hidden_size * shard.act_bytes  # type: ignore[attr-defined]
        seconds = network.all_reduce_time(region, group(layout, "tp", 0))
        share = TP_RS_SMS / (sm_count or UNSTATED_SM_COUNT)
        hidden = framework(job.framework).tp_overlap_hidden
        mode = tp_overlap_mode(job, layout)
        ranks = group(layout, "cp", 0)
        if len(ranks) < 2:
            return cls(seconds, mode, layout.tp, rs_sm_share=share, hidden=hidden)
        # The heads split over the first cp_a2a consecutive cp ranks, and the ring joins one
        # rank of each such group (Megatron-LM's hierarchical groups, create_hierarchical_
        # groups: level 0 consecutive, level 1 strided by its size).
        a2a = layout.cp_a2a if layout.cp > 1 else 1
        ring = ranks[::a2a]
        hops = list(zip(ring, ring[1:] + ring[:1], strict=True))
        # Every rank sends to the next at once: a step lasts as long as its slowest hop, and
        # a ring that leaves its NVLink domain crosses InfiniBand at each GPU's share of the
        # NICs (on a full-mesh node each hop is one link).
        if any(network.node_of(a) != network.node_of(b) for a, b in hops):
            latency, Bps = network.ib_latency_s, network.ib_bus_Bps
        else:
            latency, Bps = network.nvlink_latency_s, network.nvlink_bus_to(1)
        one, two = (network.all_to_all_time(n * GB, ranks[:a2a]) for n in (1, 2))
        return cls(
            seconds,
            mode,
            layout.tp,
            len(ring),
            latency,
            Bps,
            a2a_latency=2 * one - two,
            a2a_s_per_byte=(two - one) / GB,
            rs_sm_share=share,
            hidden=hidden,
        )

    def ring_step(self, nbytes: float) -> float:
        """Seconds of one step of the context-parallel ring carrying ``nbytes``."""
        return self.ring_latency + nbytes / self.ring_Bps


def cp_exposed(cost: BlockCost, rates: Rates, tp: TpComm) -> tuple[float, float]:
    """(forward, backward) seconds of a block's context-parallel communication that its
    attention does not hide, per micro-batch.

    The ring (``Layout.cp_comm_type`` "p2p": Megatron-LM's default, Transformer Engine's "p2p"
    context-parallel communication): attention runs in cp steps, the first on the rank's own
    keys and values, each later one on the block the previous step's send brought, so each
    of the cp - 1 sends hides behind a cp-th of the attention kernel's work. Backward sends
    the keys and values on and their gradients along (twice the bytes per step), and after
    its last step the gradients still go one hop home, with nothing to hide behind. The
    sends' SM use is left out.

    The all-to-alls ("a2a": DeepSpeed-Ulysses, Transformer Engine's "a2a"): before each
    attention the queries, keys and values trade the sequence split for a head split, and
    after it the output trades back; backward moves their gradients the same way. Nothing
    runs beside them, so all of it is exposed: ``CP_A2A_CALLS`` collectives a pass, moving
    the block's ``cp_a2a_bytes``.

    Both ("a2a+p2p", Transformer Engine's hierarchical context parallelism): the all-to-alls
    within each group of ``Layout.cp_a2a_size`` ranks, then the ring over the groups
    (``tp.cp`` of them) with as many key and value bytes a step."""
    moved = 0.0
    if cost.cp_a2a_bytes > 0:
        moved = CP_A2A_CALLS * tp.a2a_latency + cost.cp_a2a_bytes * tp.a2a_s_per_byte
    if tp.cp <= 1 or cost.cp_kv_bytes <= 0:
        return moved, moved
    steps = tp.cp - 1
    fwd = work_time(cost.attention_fwd, rates) / tp.cp
    bwd = work_time(cost.attention_bwd, rates) / tp.cp
    exposed_fwd = steps * max(0.0, tp.ring_step(cost.cp_kv_bytes) - fwd)
    exposed_bwd = steps * max(0.0, tp.ring_step(2 * cost.cp_kv_bytes) - bwd)
    return moved + exposed_fwd, moved + exposed_bwd + tp.ring_step(cost.cp_kv_bytes)


def tp_overlap_mode(job: TrainingJob, layout: Layout) -> str:
    """What the framework overlaps of tensor-parallel communication: nothing unless the job
    switches it on (``TrainingJob.tp_comm_overlap``); Megatron-LM needs sequence
    parallelism for it."""
    fw = framework(job.framework)
    if not job.tp_comm_overlap:
        return "none"
    if fw.tp_overlap_needs_sp and not layout.sequence_parallel:
        return "none"
    return fw.tp_overlap


def tp_exposed(comm: float, compute: float, tp: TpComm) -> tuple[float, float]:
    """(exposed seconds, SM slowdown seconds) of ``comm`` seconds of a block's
    tensor-parallel collectives beside ``compute`` seconds of its work (see ``TP_RS_SPLITS``)."""
    if comm <= 0 or tp.mode == "none" or tp.tp <= 1:
        return comm, 0.0
    if tp.mode == "userbuffers":
        floor = comm / 2 / tp.tp + comm / 2 / TP_RS_SPLITS
        exposed = comm - tp.hidden * (comm - max(floor, comm - compute))
        return exposed, tp.rs_sm_share * (comm - exposed) / 2
    exposed = comm - tp.hidden * (comm - max(comm / tp.tp, comm - compute))
    return exposed, 0.0


@dataclass(frozen=True)
class BlockRow:
    """One block's share of its stage's ``StageTime`` (seconds per micro-batch; the MoE
    counts are layers). Stages add these up; the solver adds them up the same way."""

    fwd: float = 0.0  # compute and exposed tensor- and context-parallel communication
    bwd_input: float = 0.0  # with the recompute (and the communication it re-runs)
    bwd_weight: float = 0.0
    recompute: float = 0.0
    tp_fwd: float = 0.0
    tp_bwd: float = 0.0
    moe_layers: int = 0
    moe_rerun: int = 0  # MoE layers whose forward (and all-to-alls) recompute repeats
    cp_fwd: float = 0.0  # exposed context-parallel ring inside ``fwd`` ...
    cp_bwd: float = 0.0  # ... and inside ``bwd_input`` (a re-run ring is in ``recompute``)
    offload_fwd: float = 0.0  # exposed copy of offloaded activations inside ``fwd`` ...
    offload_bwd: float = 0.0  # ... and of their return inside ``bwd_input``
    zero_tensors: int = 0  # trainable parameter tensors (``Param.tensors``) ZeRO-3 gathers

    def __add__(self, other: BlockRow) -> BlockRow:
        return BlockRow(
            self.fwd + other.fwd,
            self.bwd_input + other.bwd_input,
            self.bwd_weight + other.bwd_weight,
            self.recompute + other.recompute,
            self.tp_fwd + other.tp_fwd,
            self.tp_bwd + other.tp_bwd,
            self.moe_layers + other.moe_layers,
            self.moe_rerun + other.moe_rerun,
            self.cp_fwd + other.cp_fwd,
            self.cp_bwd + other.cp_bwd,
            self.offload_fwd + other.offload_fwd,
            self.offload_bwd + other.offload_bwd,
            self.zero_tensors + other.zero_tensors,
        )


def block_row(cost: BlockCost, rates: Rates, choice: frozenset[str] | str, tp: TpComm) -> BlockRow:
    """A block's row under recompute ``choice``: its compute, its tensor-parallel
    collectives (``tp.seconds`` each) as far as the framework leaves them exposed, and its
    context-parallel ring as far as its attention leaves it exposed (``cp_exposed``; a
    recompute that re-runs the attention re-runs the ring)."""
    t = block_time(cost, rates, choice)
    comm = cost.tp_collectives * tp.seconds
    tp_f, sm_f = tp_exposed(comm, t.fwd, tp)
    tp_b, sm_b = tp_exposed(comm, t.bwd_input, tp)
    cp_f, cp_b = cp_exposed(cost, rates, tp)
    rerun = (tp_f, sm_f) if choice == "full" else (0.0, 0.0)
    rerun_ring = cp_f if choice == "full" or "core_attn" in choice else 0.0
    off_f, off_b = offload_exposed(cost, rates, t, choice)
    return BlockRow(
        fwd=t.fwd + tp_f + sm_f + cp_f + off_f,
        bwd_input=t.bwd_input + t.recompute + tp_b + sm_b + sum(rerun) + cp_b + rerun_ring + off_b,
        bwd_weight=t.bwd_weight,
        recompute=t.recompute + sum(rerun) + rerun_ring,
        tp_fwd=tp_f,
        tp_bwd=tp_b,
        moe_layers=cost.moe_layers,
        moe_rerun=cost.moe_layers if _reruns_moe(choice) else 0,
        cp_fwd=cp_f,
        cp_bwd=cp_b,
        offload_fwd=off_f,
        offload_bwd=off_b,
        zero_tensors=sum(p.tensors for p in cost.params if p.trainable),
    )


def offload_exposed(
    cost: BlockCost, rates: Rates, t: BlockTime, choice: frozenset[str] | str
) -> tuple[float, float]:
    """(forward, backward) seconds of a block's activation copies to and from the host that
    compute does not hide, per micro-batch (``BlockCost.offloaded_bytes``). Transformer
    Engine's CPU offload (Megatron-LM --cpu-offloading-num-layers) copies a layer's saved
    tensors to the host on a stream of their own as its forward saves them, beside the next
    layer's forward, and brings them back one layer ahead in backward (TE cpu_offload.py;
    its docs: offload starts as soon as tensors are saved, reload is prefetched); Megatron-
    LM's fine-grained offload does the same per module input. Counted: each block's copies
    against one layer's compute in that direction, at the PCIe rate. Ignored: the copies'
    share of HBM bandwidth, and the longer window a copy gets when more layers stay in HBM."""
    nbytes = cost.offloaded_bytes(choice)
    if not nbytes:
        return 0.0, 0.0
    copy = nbytes / rates.pcie_Bps
    return max(0.0, copy - t.fwd), max(0.0, copy - t.bwd_input - t.bwd_weight)


@dataclass(frozen=True)
class StepRates:
    """Rates of the optimizer step's paths on one GPU (bytes/s): its HBM, its PCIe link
    each way, and its share of the node's host memory bandwidth."""

    hbm: float
    pcie: float
    host: float | None  # None: the cluster does not state its host memory bandwidth

    @classmethod
    def of(cls, cluster: ClusterSpec) -> StepRates:
        host = None
        if cluster.host_memory_Bps is not None:
            share = cluster.host_memory_Bps / cluster.gpus_per_node  # every GPU offloads at once
            host = share * cluster.achieved.get("host_memory", 1.0)
        return cls(
            hbm=cluster.hbm_bandwidth_Bps * cluster.achieved.get("memory_bound", 1.0),
            pcie=cluster.pcie_Bps * cluster.achieved.get("pcie", 1.0),
            host=host,
        )


def optimizer_time(memory: StageMemory, cluster: ClusterSpec) -> float:
    """Seconds of one rank's optimizer step (see ``optimizer_seconds``)."""
    return optimizer_seconds(memory.step_bytes, StepRates.of(cluster))


def optimizer_seconds(state: Mapping[str, float], rates: StepRates) -> float:
    """Seconds of the optimizer step that moves these bytes (``costs.memory.STEP_KEYS`` of
    ``state_bytes``, or ``StageMemory.step_bytes``).

    The GPU's part is memory-bound: master weights and moments read and written, gradients
    read, weights written, an HBM EMA read and written. An offloaded part is a pipeline per
    parameter, as Megatron-LM's HybridDeviceOptimizer runs it with
    --overlap-cpu-optimizer-d2h-h2d (each tensor's host step starts once its gradient has
    arrived, its weights go back while the next one steps): the slowest of the gradient
    copies, the host's step and the weight copies, the first tensor's fill ignored. Both
    parts are added, though Megatron-LM runs the GPU's part between the host's copies: a
    bound above by the smaller part, kept so a rank's step stays a sum over its layers.
    Ignored: the NICs' traffic sharing the PCIe switches, and the host CPU's arithmetic
    beyond its memory traffic."""
    seconds = state["step_hbm"] / rates.hbm
    if state["step_d2h"] or state["step_h2d"] or state["step_host"]:
        if rates.host is None:
            raise PlannerError(
                "ClusterSpec.host_memory_Bps=None: an offloaded optimizer needs the host "
                "memory bandwidth (state it in the cluster YAML as host_memory_GBps)"
            )
        links = max(state["step_d2h"], state["step_h2d"]) / rates.pcie
        seconds += max(links, state["step_host"] / rates.host)
    return seconds


# -- helpers --------------------------------------------------------------------------------


def _reruns_moe(choice: frozenset[str] | str) -> bool:
    """Whether recompute repeats the MoE layer's forward (and so its all-to-alls)."""
    return choice == "full" or (isinstance(choice, frozenset) and "moe" in choice)


def _holder(layout: Layout, stage: int) -> int:
    """Pipeline rank holding ``stage`` (direction 0 for DualPipe, whose ranks also hold a
    mirror copy of another stage)."""
    return stage_rank(layout.schedule, layout.pp, stage, 0)


def first_rank(layout: Layout, stage: int) -> int:
    return _holder(layout, stage) * layout.plane


def stage_send(layout: Layout, network: Network, stage: int, nbytes: float) -> Transfer:
    """Send to the next stage's holder (DualPipe's second direction mirrors the same hop)."""
    if stage + 1 >= len(layout.stages):
        return NO_TRANSFER
    return network.p2p(nbytes, first_rank(layout, stage), first_rank(layout, stage + 1))


def dp_groups(layout: Layout, rank: int) -> tuple[list[int], list[int]]:
    """Gradient-reduction groups of a rank's dense and expert parameters. DualPipe keeps each
    stage on two ranks (both directions), so their gradients are reduced together."""
    dense, expert = group(layout, "dp", rank), group(layout, "edp", rank)
    if schedule_of(layout.schedule).copies == 2:
        pp_rank = rank // layout.plane
        mirror = rank + (layout.pp - 1 - 2 * pp_rank) * layout.plane
        if mirror != rank:
            dense = dense + group(layout, "dp", mirror)
            expert = expert + group(layout, "edp", mirror)
    return dense, expert
