"""Communication time model: which ranks form each group, and how long collectives take.

Rank order (Megatron-LM's default ``order="tp-cp-ep-dp-pp"`` in
``megatron/core/parallel_state.py``): tp is innermost, then cp, then dp, and pp outermost, so
global rank ``g = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))`` and GPU ``g``
sits in NVLink domain ``g // domain_gpus`` (``ClusterSpec.domain_gpus``: a node's GPUs on an
HGX/DGX node; on GB200 NVL72 up to 72 GPUs of 18 trays, each tray with its own NICs). Below,
"node" is that NVLink domain: what decides whether a group's traffic stays on NVLink. The
"dp" group is the one gradients are reduced and ZeRO state sharded over: the data-parallel
ranks with the context-parallel ones (Megatron-LM's data-parallel group with context
parallelism). Experts see the whole ``tp * cp * dp`` plane of
each pipeline stage (MoE parallel folding), ordered etp-ep-edp: local index
``l = tp_rank + tp * (cp_rank + cp * dp_rank)``, ``etp_rank = l % etp``,
``ep_rank = (l // etp) % ep`` and expert-data-parallel index ``l // (etp * ep)``, so an ETP
group is ``etp`` consecutive global ranks, an EP group strides by ``etp`` and an EDP group by
``etp * ep``.

Time conventions (NCCL bus bandwidth, nccl-tests ``doc/PERFORMANCE.md``, algbw vs busbw):
a ring all-reduce over n ranks moves ``2(n-1)/n`` of the buffer through each rank,
reduce-scatter and all-gather ``(n-1)/n`` of the full buffer, at the achieved bus bandwidth
``link bandwidth * cluster.achieved["nvlink" | "ib"]``. Latency (alpha) is one path latency
per ring step inside a node (``n-1`` steps for reduce-scatter / all-gather, twice that for
all-reduce) and, across nodes, one per tree level ``ceil(log2 nodes)`` for all-reduce (twice:
reduce then broadcast) and one per ring step for reduce-scatter and all-gather, which NCCL
runs only as rings (``Network.reduce_scatter``). A group spanning nodes runs
hierarchically, with g members on the busiest of its N nodes: reduce-scatter over NVLink
inside the node, then the inter-node collective of ``nbytes / g`` over N nodes at each
GPU's IB share, then all-gather over NVLink.

Every group of one kind is assumed to run its collective at the same time (all dp groups
reduce gradients together, all EP groups dispatch together), so each GPU gets its own share
of the node's NICs rather than the whole node's bandwidth. A group on one node never touches
IB; a single-member group costs nothing.

A full-mesh node (AMD Infinity Fabric, ``ClusterSpec.nvlink_peer_Bps``) has one link per pair
of GPUs and no switch: a GPU sending to k peers at once uses k links, so a collective over m
GPUs of the node runs at ``min(nvlink_Bps, (m - 1) * peer)`` and a send to one GPU at one
link's rate (RCCL builds its rings over the mesh's links; on MI300X 2 GPUs reach 47.7 GB/s of
all-reduce bus bandwidth where 8 reach 312.9, stas00/ml-engineering network/README.md).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from planner.costs.blocks import Shard
from planner.errors import PlannerError
from planner.layout import Layout
from planner.memo import Memo
from planner.specs import ClusterSpec, ModelSpec
from planner.topology import gpu

GroupKind = Literal["tp", "cp", "dp", "ep", "etp", "edp", "pp"]

# Per MoE layer and micro-batch: dispatch and combine in forward, and their two transposes in
# backward (the gradient of a dispatch is a combine-shaped all-to-all and vice versa).
MOE_ALL_TO_ALLS_PER_LAYER = 4


# -- rank order ---------------------------------------------------------------------------


def rank_of(layout: Layout, *, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
    """Global rank of the GPU at these coordinates (Megatron-LM order, see module docstring)."""
    for name, value, size in (
        ("tp", tp_rank, layout.tp),
        ("cp", cp_rank, layout.cp),
        ("dp", dp_rank, layout.dp),
        ("pp", pp_rank, layout.pp),
    ):
        if not 0 <= value < size:
            raise PlannerError(f"{name}_rank={value}: must be in 0..{size - 1}")
    return tp_rank + layout.tp * (cp_rank + layout.cp * (dp_rank + layout.dp * pp_rank))


def group(layout: Layout, kind: GroupKind, rank: int) -> list[int]:
    """Sorted global ranks of the ``kind`` group that ``rank`` belongs to ("dp": the ranks
    that reduce gradients together, data and context parallel)."""
    if not 0 <= rank < layout.world_size:
        raise PlannerError(f"rank={rank}: must be in 0..{layout.world_size - 1}")
    tp, cp, dp, ep = layout.tp, layout.cp, layout.dp, layout.ep
    tp_rank, cp_rank = rank % tp, (rank // tp) % cp
    dp_rank, pp_rank = (rank // (tp * cp)) % dp, rank // layout.plane
    at = dict(tp_rank=tp_rank, cp_rank=cp_rank, dp_rank=dp_rank, pp_rank=pp_rank)
    if kind == "tp":
        return [rank_of(layout, **(at | {"tp_rank": t})) for t in range(tp)]
    if kind == "cp":
        return [rank_of(layout, **(at | {"cp_rank": c})) for c in range(cp)]
    if kind == "dp":
        # rank_of over every (cp_rank, dp_rank): cp_rank + cp * dp_rank runs over 0..cp*dp-1
        first = pp_rank * layout.plane + tp_rank
        return list(range(first, first + tp * cp * dp, tp))
    if kind == "pp":
        return [rank_of(layout, **(at | {"pp_rank": p})) for p in range(layout.pp)]
    base = pp_rank * layout.plane  # first rank of this pipeline stage's plane
    local = rank - base
    etp = layout.etp
    if kind == "etp":
        first = base + (local // etp) * etp
        return list(range(first, first + etp))
    if kind == "ep":
        first = base + (local // (etp * ep)) * etp * ep + local % etp
        return list(range(first, first + etp * ep, etp))
    if kind == "edp":
        return list(range(base + local % (etp * ep), base + layout.plane, etp * ep))
    raise PlannerError(f"kind={kind!r}: must be one of tp, cp, dp, ep, etp, edp, pp")


@dataclass(frozen=True)
class Transfer:
    """One communication's seconds, and how long it keeps each of the GPU's links busy:
    ``ib`` its share of the node's NICs, ``nvlink`` its NVLink ports. A transfer that uses
    both at once (an all-to-all) keeps each busy for its own part; one whose phases run in
    turn (a hierarchical reduce-scatter) for the phase on that link. What else runs on the
    same link at the same time has to share it (``planner.costs.timing``)."""

    seconds: float
    ib: float
    nvlink: float

    def __add__(self, other: Transfer) -> Transfer:
        return Transfer(
            self.seconds + other.seconds, self.ib + other.ib, self.nvlink + other.nvlink
        )

    def __sub__(self, other: Transfer) -> Transfer:
        return Transfer(
            self.seconds - other.seconds, self.ib - other.ib, self.nvlink - other.nvlink
        )

    def __mul__(self, k: float) -> Transfer:
        return Transfer(self.seconds * k, self.ib * k, self.nvlink * k)


NO_TRANSFER = Transfer(0.0, 0.0, 0.0)


# -- network ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Network:
    """Per-GPU link figures of one cluster, read once from its topology graph.

    ``nvlink_Bps`` and ``ib_Bps`` are per GPU per direction at line rate; ``ib_Bps`` is the
    GPU's share of the fabric when every GPU of a node talks off-node at once. Collectives
    use them times the achieved fractions (``*_bus_Bps``). ``gpus_per_node`` is the GPUs of
    one NVLink domain as the job is placed (``ClusterSpec.domain_gpus``); ``nvlink_peer_Bps``
    one link of a full-mesh node (None: a switch, every group at ``nvlink_Bps``).
    """

    gpus_per_node: int
    nvlink_Bps: float
    ib_Bps: float
    nvlink_latency_s: float
    ib_latency_s: float
    nvlink_achieved: float
    ib_achieved: float
    nvlink_peer_Bps: float | None = None

    @classmethod
    def of(cls, cluster: ClusterSpec) -> Network:
        """Figures of ``cluster`` (cached per machine type and NVLink domain; see ``_read``)."""
        domain = cluster.domain_gpus
        update: dict[str, Any] = {"num_gpus": 2 * domain}
        if cluster.nvlink_domain_gpus is not None:
            update["nvlink_domain_gpus"] = domain  # two domains of the job's placement
        return _network(cluster.model_copy(update=update))

    @classmethod
    def _read(cls, cluster: ClusterSpec) -> Network:
        """Figures of ``cluster`` from ``cluster.topology()``.

        Every GPU of node 0 sends to a neighbour at once: to the next GPU of its node for
        NVLink, to the same GPU of node 1 (its rail peer, the route NCCL's rings and trees
        take) for IB. A GPU's bandwidth is the minimum over its path's edges of the edge's
        bandwidth divided by the number of those concurrent paths crossing it in that
        direction: GPUs sharing a NIC split it, so the IB share comes out as
        ``nics_per_node * nic_Bps / gpus_per_node`` (or the PCIe link, if slower). The
        latency is the sum of the path's edge latencies. The figures are read from a
        two-node copy of the cluster: the fabric is a non-blocking fat tree, so a GPU's share
        does not depend on the node count, and the graph of 2 nodes builds in a millisecond
        where 2,048 nodes take a quarter of a second (a one-node job's IB figures are never
        used: its groups stay on the node).
        """
        per_node = cluster.domain_gpus  # every GPU of NVLink domain 0
        graph = cluster.topology()
        if per_node > 1:
            ring = [_path(graph, i, (i + 1) % per_node) for i in range(per_node)]
        else:  # no peer on the node: GPU to switch and back stands for the NVLink path
            ring = [[(gpu(0), "nvswitch0"), ("nvswitch0", gpu(0))]]
        nvlink = _concurrent_paths(graph, ring)
        ib = _concurrent_paths(graph, [_path(graph, i, i + per_node) for i in range(per_node)])
        peer = None
        if cluster.nvlink_peer_Bps is not None:  # the ring's hop is one link of the mesh
            peer = nvlink[0]
            nvlink = (min(cluster.nvlink_Bps, (per_node - 1) * peer), nvlink[1])
        return cls(
            gpus_per_node=per_node,
            nvlink_Bps=nvlink[0],
            ib_Bps=ib[0],
            nvlink_latency_s=nvlink[1],
            ib_latency_s=ib[1],
            nvlink_achieved=_achieved(cluster, "nvlink"),
            ib_achieved=_achieved(cluster, "ib"),
            nvlink_peer_Bps=peer,
        )

    @property
    def nvlink_bus_Bps(self) -> float:
        """Achieved NVLink bus bandwidth per GPU per direction (B/s)."""
        return self.nvlink_Bps * self.nvlink_achieved

    @property
    def ib_bus_Bps(self) -> float:
        """Achieved IB bus bandwidth per GPU per direction (B/s)."""
        return self.ib_Bps * self.ib_achieved

    def nvlink_bus_to(self, peers: int) -> float:
        """Achieved NVLink bus bandwidth per GPU per direction (B/s) while it sends to
        ``peers`` GPUs of its node at once: ``nvlink_bus_Bps`` through a switch; on a full
        mesh one link per peer, up to all of them."""
        if self.nvlink_peer_Bps is None or peers < 1:
            return self.nvlink_bus_Bps
        return min(self.nvlink_Bps, peers * self.nvlink_peer_Bps) * self.nvlink_achieved

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def p2p_time(self, nbytes: float, src: int, dst: int) -> float:
        """One send from ``src`` to ``dst`` (pipeline activations): latency + bytes over
        NVLink inside a node, over the GPU's IB share across nodes."""
        return self.p2p(nbytes, src, dst).seconds

    def p2p(self, nbytes: float, src: int, dst: int) -> Transfer:
        """``p2p_time`` with the link it keeps busy."""
        if src == dst or nbytes <= 0:
            return NO_TRANSFER
        if self.node_of(src) == self.node_of(dst):
            t = self.nvlink_latency_s + nbytes / self.nvlink_bus_to(1)
            return Transfer(t, 0.0, t)
        t = self.ib_latency_s + nbytes / self.ib_bus_Bps
        return Transfer(t, t, 0.0)

    def all_reduce_time(self, nbytes: float, ranks: Sequence[int]) -> float:
        """All-reduce of an ``nbytes`` buffer on each rank (hierarchical across nodes)."""
        return self.all_reduce(nbytes, ranks).seconds

    def all_reduce(self, nbytes: float, ranks: Sequence[int]) -> Transfer:
        """``all_reduce_time`` with the links it keeps busy: a reduce-scatter and an
        all-gather, one after the other."""
        half = self.reduce_scatter(nbytes, ranks, ring=False)
        return Transfer(2 * half.seconds, 2 * half.ib, 2 * half.nvlink)

    def reduce_scatter_time(self, nbytes: float, ranks: Sequence[int]) -> float:
        """Reduce-scatter of a full (unsharded) ``nbytes`` buffer per rank."""
        return self.reduce_scatter(nbytes, ranks).seconds

    def reduce_scatter(self, nbytes: float, ranks: Sequence[int], *, ring: bool = True) -> Transfer:
        """``reduce_scatter_time`` with the links it keeps busy: NVLink for the in-node
        phase, InfiniBand for the phase across nodes (they run one after the other).

        Across nodes NCCL runs reduce-scatter and all-gather as a ring (it has no tree for
        them; ``ring``): n - 1 steps, nodes - 1 of them across the network, each paying its
        link's latency, so a group of n ranks on N nodes pays (n - N) NVLink and (N - 1)
        network latencies (NCCL's own tuner, ``src/graph/tuning.cc``: ``(nsteps -
        nInterSteps) * intraLat + nInterSteps * interLat``, nsteps = n - 1, nInterSteps =
        N - 1). An all-reduce's halves (``ring=False``) take the tree's depth instead."""
        per_node, nodes = self._spread(ranks)
        if nbytes <= 0 or per_node * nodes == 1:
            return NO_TRANSFER
        intra = self._intra(nbytes, per_node)
        inter = self._inter(nbytes / per_node, nodes, per_node if ring else None)
        return Transfer(intra + inter, inter, intra)

    def all_gather_time(self, nbytes: float, ranks: Sequence[int]) -> float:
        """All-gather into a full ``nbytes`` buffer per rank (mirror of reduce-scatter)."""
        return self.reduce_scatter_time(nbytes, ranks)

    def all_gather(self, nbytes: float, ranks: Sequence[int]) -> Transfer:
        """``all_gather_time`` with the links it keeps busy."""
        return self.reduce_scatter(nbytes, ranks)

    def all_to_all_time(self, nbytes: float, ranks: Sequence[int]) -> float:
        """All-to-all where each rank sends ``nbytes`` in total, an equal share to every
        member (its own share stays local). Off-node shares go over the GPU's IB share and
        on-node shares over NVLink at the same time; the busiest node sets the time."""
        return self.all_to_all(nbytes, ranks).seconds

    def all_to_all(self, nbytes: float, ranks: Sequence[int]) -> Transfer:
        """``all_to_all_time`` with the links it keeps busy (both at once)."""
        members = set(ranks)
        n = len(members)
        if nbytes <= 0 or n <= 1:
            return NO_TRANSFER
        counts = Counter(self.node_of(r) for r in members)
        on = off = 0.0
        for here in set(counts.values()):
            on = max(on, nbytes * (here - 1) / n / self.nvlink_bus_to(here - 1))
            off = max(off, nbytes * (n - here) / n / self.ib_bus_Bps)
        # All peers are posted at once, so one path latency, the slowest kind in use.
        latency = self.ib_latency_s if len(counts) > 1 else self.nvlink_latency_s
        return Transfer(max(on, off) + latency, off, on)

    def moe_all_to_all_time(
        self, nbytes: float, ranks: Sequence[int], model: ModelSpec, dispatcher: str = "alltoall"
    ) -> float:
        """One MoE dispatch (or combine) of ``nbytes`` (``moe_dispatch_bytes``: k copies of
        each token) over the EP group ``ranks`` by ``dispatcher`` (``moe_all_to_all``)."""
        return self.moe_all_to_all(nbytes, ranks, model, dispatcher).seconds

    def moe_all_to_all(
        self, nbytes: float, ranks: Sequence[int], model: ModelSpec, dispatcher: str = "alltoall"
    ) -> Transfer:
        """``moe_all_to_all_time`` with the links it keeps busy (both at once).

        - ``alltoall``: every copy of a token crosses to its expert's rank (a plain
          all-to-all), whatever the router.
        - ``deepep``: DeepEP's kernels send a token across InfiniBand once per other node
          holding one of its experts and forward it to that node's GPUs over NVLink
          (DeepSeek-V3 report section 3.2.2; DeepEP layout.cu counts a token once per node),
          so the InfiniBand bytes are one copy per other node hit. The nodes a token hits
          follow from its router: ``groups_per_token`` of ``expert_groups`` groups where the
          router limits them (DeepSeek-V3: 4 of 8, EP 64 over 8 nodes), else k of the
          experts, spread evenly over the nodes. DeepEP's measured rates are near the links'
          (H800: 153-158 GB/s over NVLink, 43-58 GB/s per 400 Gb/s NIC; DeepEP README), so
          the links' achieved rates stand.
        - ``allgather``: Megatron-LM's allgather dispatcher: each rank gathers every token of
          the group (one copy each, whatever k) and keeps those its experts take; the
          combine is the matching reduce-scatter."""
        members = set(ranks)
        if dispatcher == "allgather":
            if nbytes <= 0 or len(members) <= 1:
                return NO_TRANSFER
            one_copy = nbytes / model.experts_per_token
            return self.all_gather(one_copy * len(members), ranks)
        here, nodes = self._spread(members)
        if dispatcher != "deepep" or nbytes <= 0 or nodes == 1:
            return self.all_to_all(nbytes, ranks)
        groups, limit = model.expert_groups, model.groups_per_token
        if limit is None or groups % nodes:  # no node-limited groups: each expert its own
            groups, limit = model.num_experts, model.experts_per_token
        if groups % nodes:
            return self.all_to_all(nbytes, ranks)
        # Groups are spread evenly over the nodes; a token picks ``limit`` of ``groups``.
        per = groups // nodes
        missed = math.comb(groups - per, limit) / math.comb(groups, limit)
        other_nodes = (nodes - 1) * (1 - missed)  # expected other nodes one token visits
        one_copy = nbytes / model.experts_per_token
        ib = one_copy * other_nodes / self.ib_bus_Bps
        nvlink = nbytes * (1 - 1 / len(members)) / self.nvlink_bus_to(here - 1)
        return Transfer(max(ib, nvlink) + self.ib_latency_s, ib, nvlink)

    # -- helpers --------------------------------------------------------------------------
    def _spread(self, ranks: Iterable[int]) -> tuple[int, int]:
        """(members on the busiest node, nodes spanned) of a group."""
        per_node = self.gpus_per_node  # node_of, inlined: groups here run to thousands
        counts = Counter(r // per_node for r in set(ranks))
        if not counts:
            raise PlannerError("ranks=[]: a collective needs at least one rank")
        return max(counts.values()), len(counts)

    def _intra(self, nbytes: float, members: int) -> float:
        """Ring reduce-scatter (or all-gather) of ``nbytes`` over ``members`` GPUs of a node."""
        steps = members - 1
        return steps / members * nbytes / self.nvlink_bus_to(steps) + steps * self.nvlink_latency_s

    def _inter(self, nbytes: float, nodes: int, ring_per_node: int | None = None) -> float:
        """Reduce-scatter (or all-gather) of ``nbytes`` per GPU over ``nodes`` nodes, each
        GPU on its own IB share. Latency: a tree's depth; or, for a ring of
        ``ring_per_node`` ranks on each node, the ring's steps beyond the in-node phase's
        (``Network.reduce_scatter``): nodes - 1 across the network and (nodes - 1) *
        (ring_per_node - 1) more over NVLink."""
        if nodes == 1:
            return 0.0
        bandwidth = (nodes - 1) / nodes * nbytes / self.ib_bus_Bps
        if ring_per_node is None:
            return bandwidth + math.ceil(math.log2(nodes)) * self.ib_latency_s
        nvlink_steps = (nodes - 1) * (ring_per_node - 1)
        return bandwidth + (nodes - 1) * self.ib_latency_s + nvlink_steps * self.nvlink_latency_s


def _concurrent_paths(graph: Any, paths: list[list[tuple[str, str]]]) -> tuple[float, float]:
    """(bandwidth, latency) of the first path while all ``paths`` carry traffic at once."""
    load = Counter(hop for path in paths for hop in path)  # directed: links are per direction
    first = paths[0]
    bandwidth = min(graph.edges[hop]["bandwidth_Bps"] / load[hop] for hop in first)
    latency = sum(graph.edges[hop]["latency_s"] for hop in first)
    return float(bandwidth), float(latency)


def _path(graph: Any, src: int, dst: int) -> list[tuple[str, str]]:
    import networkx as nx

    nodes = nx.shortest_path(graph, gpu(src), gpu(dst))
    return list(itertools.pairwise(nodes))


def _achieved(cluster: ClusterSpec, kind: str) -> float:
    try:
        return float(cluster.achieved[kind])
    except KeyError:
        raise PlannerError(
            f"ClusterSpec.achieved.{kind}: missing; the communication model needs it"
        ) from None


_NETWORKS: Memo[Network] = Memo("comm.networks", limit=256)


def _network(cluster: ClusterSpec) -> Network:
    return _NETWORKS.get(cluster.model_dump_json(), lambda: Network._read(cluster))


# -- where each group runs ------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where one kind of group of a layout runs: its ``size`` (GPUs), the NVLink domains it
    spans (``domains``) and the most of its members one domain holds (``per_domain``), read
    off the group of global rank 0 (domains hold whole groups or groups whole domains when
    the degrees divide the domain, as the search's do)."""

    kind: GroupKind
    size: int
    domains: int
    per_domain: int
    name: str = ""  # how it is printed: the kind, or "dp*cp" for the gradients' group with cp

    @property
    def link(self) -> str:
        """What its collectives cross: "none" (one GPU), "NVLink" or "InfiniBand"."""
        if self.size == 1:
            return "none"
        return "NVLink" if self.domains == 1 else "InfiniBand"

    def describe(self, domain_gpus: int) -> str:
        """``ep 64: inside one NVLink domain of 64 GPUs (NVLink)``."""
        name = self.name or self.kind
        if self.size == 1:
            return f"{name} 1"
        if self.domains == 1:
            return f"{name} {self.size}: inside one NVLink domain of {domain_gpus} GPUs (NVLink)"
        return (
            f"{name} {self.size}: across {self.domains} NVLink domains, {self.per_domain} "
            f"in each (InfiniBand{', NVLink inside each' if self.per_domain > 1 else ''})"
        )


PLACED_KINDS: tuple[GroupKind, ...] = ("tp", "cp", "ep", "etp", "dp", "edp", "pp")


def placements(layout: Layout, cluster: ClusterSpec) -> list[Placement]:
    """Where each kind of group of ``layout`` runs on ``cluster`` (``Placement``): tp, cp, ep,
    etp, dp (data and context parallel, the gradients' group), edp and pp; the expert kinds
    only for a layout with expert parallelism."""
    network = Network.of(cluster)  # its nodes are the job's NVLink domains
    out = []
    for kind in PLACED_KINDS:
        if kind in ("ep", "etp", "edp") and layout.ep == 1 and layout.etp == 1:
            continue
        ranks = group(layout, kind, 0)
        per_domain, domains = network._spread(ranks)
        name = "dp*cp" if kind == "dp" and layout.cp > 1 else kind
        out.append(Placement(kind, len(ranks), domains, per_domain, name))
    return out


# -- MoE traffic --------------------------------------------------------------------------


def moe_dispatch_bytes(model: ModelSpec, shard: Shard) -> float:
    """Bytes one rank sends in ONE all-to-all (dispatch or combine) of one MoE layer for one
    micro-batch: its ``sp_tokens * k`` token copies of ``hidden`` activations, times
    ``moe_load_imbalance`` for the busiest rank. A forward pass has a dispatch and a combine,
    the backward their two transposes: ``MOE_ALL_TO_ALLS_PER_LAYER`` (4) all-to-alls per MoE
    layer per micro-batch, each of this size."""
    return (
        shard.sp_tokens
        * model.experts_per_token
        * model.hidden_size
        * shard.act_bytes
        * shard.moe_load_imbalance
    )
