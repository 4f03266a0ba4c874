"""A layout's training step executed on modelled hardware: the judge of the closed-form timing.

``planner.timeline`` prices each task as the largest of a few sums (``costs.overlap``: what a
schedule hides behind what is a rule per schedule). This module reaches the step time another
way: each pipeline rank's program is run kernel by kernel and transfer by transfer on the
resources they share, and what overlaps is whatever the dependencies and the resources let
run at once. Nothing here reads ``costs.overlap``'s terms or ``planner.timeline``'s run; what
is shared is the one derivation of what each rank does (the schedule's op order and its
dependencies, ``timeline.program``) and of what each piece costs alone (each block's compute
and each transfer's seconds and link use, ``costs.timing``).

What runs (per representative rank: one per pipeline position; the tp, cp, dp and ep ranks
of a position run the same program at the same times, so a collective within those groups
loads that rank's own links):

- **Compute stream.** A block's forward, input-gradient, weight-gradient and recompute work,
  one kernel at a time in the order they become ready. A block with routed experts is split
  at its all-to-alls: the work before the dispatch (attention, router, shared expert), the
  routed experts' share of its work (``BlockCost.module_work["moe"]``), then the combine.
  Within a block, tensor- and context-parallel communication and activation copies to the
  host are taken as the block's own figures state them (``costs.timing.block_row``); they
  are not flows here.
- **Communication streams**, each in order: ``ep`` (expert dispatch and combine), ``p2p``
  (pipeline sends), ``dp`` (gradient reductions, ZeRO-2/3 reduce-scatters) and ``zero``
  (ZeRO-3 gathers, ZeRO-1/2 gathers of the updated weights).
- **Links.** Each rank's InfiniBand share and NVLink ports, each direction apart. A transfer
  alone takes its own seconds and keeps each link busy for its stated part
  (``costs.comm.Transfer``); transfers active on one link at once share it in proportion to
  their demand, so each is slowed by the link's oversubscription (the worst of its links).
  A pipeline send loads the sender's outgoing and the receiver's incoming links.
- **SMs.** While a collective kernel runs it holds SMs the compute cannot use: NCCL's
  ``costs.overlap.NCCL_SMS``, DeepEP's dispatch and combine ``PAIRED_COMM_SMS`` (DeepSeek-V3
  report section 3.2.2); the compute stream runs at the share left. And while compute runs
  beside it, the collective's own blocks get SMs only as the compute's leave them: its rate
  drops to ``costs.overlap.beside_rate`` of its rate alone (0.30 of what its blocks move
  alone, measured on an H200; a transfer whose link is far slower than its blocks, most
  InfiniBand traffic, keeps its rate), and recovers when the compute stream goes idle.

What waits for what: a task (one op, or a paired forward and backward) starts when the
rank's previous task is done and its inputs have arrived (a send from another rank arrives
when its flow ends); within an op, each block's pieces run in order; a paired task runs its
two chunks as two chains on one compute stream, so one chunk's all-to-alls hide behind the
other's compute exactly as far as their lengths allow; where the framework's runtime runs a
pair's two ops one after the other (``Overlap.pairs_in_turn``: torch's pipelining runtime),
so does the executor. Sends are synchronous (the sender's op
ends with its send) except where the framework posts them asynchronously
(``Overlap.async_sends``). Where the framework overlaps the data-parallel reduction
(``Overlap.grad_sync``), each block's share of its stage's reduction is issued once the
block's weight gradients of the last micro-batch are made (the framework's buckets, at block
granularity), else all after the rank's last op. ZeRO-3 gathers are prefetched one block
ahead where the framework overlaps them (``Overlap.zero``), else run in the op's series; a
ZeRO-1/2 gather of the updated weights overlapped with the next step's forward
(``Overlap.param_gather``) is issued at the step's start, each block's first forward waiting
for its share, else it follows the optimizer step. The optimizer step runs on the compute
stream after the rank's last op and its reductions.

Ignored: the rendezvous of a send with its receive (a send starts when issued), the SMs of
pipeline sends and of tensor-parallel collectives (and their slowing beside compute), the
HBM bandwidth communication takes from compute beside it, the host's launch gaps between
ops. A collective's latency is stretched with its bandwidth when it shares a link.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from planner.costs.activations import extended
from planner.costs.comm import Network, Transfer
from planner.costs.compute import Rates, work_time
from planner.costs.memory import block_costs, shard_of, stage_memory
from planner.costs.overlap import NCCL_SMS, PAIRED_COMM_SMS, beside_rate, overlap_of
from planner.costs.timing import (
    StageTime,
    TpComm,
    block_row,
    expert_all_to_alls,
    first_rank,
    optimizer_time,
    stage_times,
)
from planner.estimate import check_layout
from planner.frameworks import Overlap
from planner.layout import Layout, parse_recompute
from planner.schedules import Op, steady_lengths
from planner.specs import ClusterSpec, ModelSpec, TrainingJob
from planner.timeline import Program, dep_key, op_inputs, program

COMPUTE = "compute"
STREAMS = (COMPUTE, "ep", "p2p", "dp", "zero")
LINK_NAMES = ("ib", "nvl")


# -- what each piece costs alone ------------------------------------------------------------


@dataclass(frozen=True)
class BlockWork:
    """One block's pieces per micro-batch (seconds alone)."""

    name: str
    fwd: float
    bwd: float  # input-gradient work, recompute apart
    wgt: float
    recompute: float
    moe_layers: int
    moe_rerun: int
    moe_share: float  # of its work, the routed experts' (between dispatch and combine)
    share: float  # of its stage's parameter bytes on this rank (its share of each collective)


@dataclass(frozen=True)
class StageWork:
    """One stage's blocks and transfers (a collective's figure is the whole stage's)."""

    blocks: tuple[BlockWork, ...]
    dispatch: Transfer  # one MoE layer's, per micro-batch
    combine: Transfer
    p2p: Transfer
    p2p_back: Transfer
    grad_sync: Transfer
    param_gather: Transfer
    zero_gather: Transfer
    zero_reduce: Transfer


def stage_work(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, layout: Layout
) -> list[StageWork]:
    """Each stage's pieces, from the cost model's per-block and per-stage figures."""
    network = Network.of(cluster)
    rates = Rates.of(cluster, job)
    shard = shard_of(job, layout)
    costs = block_costs(model, layout, shard)
    tp = TpComm.of(model, job, layout, network, shard, sm_count=cluster.sm_count)
    times: list[StageTime] = stage_times(model, cluster, job, layout, network)
    out = []
    for index, stage in enumerate(layout.stages):
        rank = first_rank(layout, index)
        dispatch, combine = expert_all_to_alls(model, job, layout, network, shard, rank)
        rows = []
        for placed in stage.blocks:
            cost = costs[placed.block]
            row = block_row(cost, rates, parse_recompute(placed.recompute), tp)
            moe = 0.0
            if cost.moe_layers and "moe" in cost.module_work:
                whole = work_time(cost.fwd, rates)
                moe = min(1.0, work_time(cost.module_work["moe"], rates) / whole) if whole else 0.0
            held = sum(
                p.numel / (layout.ep * layout.etp if p.expert else layout.tp if p.tp_split else 1)
                for p in cost.params
                if p.trainable
            )
            rows.append((placed.block, row, cost.moe_layers, moe, held))
        total = sum(r[4] for r in rows)
        blocks = tuple(
            BlockWork(
                name=block,
                fwd=row.fwd,
                bwd=row.bwd_input - row.recompute,
                wgt=row.bwd_weight,
                recompute=row.recompute,
                moe_layers=layers,
                moe_rerun=row.moe_rerun,
                moe_share=moe,
                share=held / total if total else 1.0 / len(rows),
            )
            for block, row, layers, moe, held in rows
        )
        st = times[index]
        out.append(
            StageWork(
                blocks,
                dispatch,
                combine,
                st.p2p,
                st.p2p_back,
                st.grad_sync,
                st.param_gather,
                st.zero_gather,
                st.zero_reduce,
            )
        )
    return out


# -- the engine -----------------------------------------------------------------------------


class Item:
    """A kernel on a compute stream, a transfer on a communication stream, or an instant
    (``stream`` None) that marks a point of the program."""

    __slots__ = (
        "beside",
        "end",
        "label",
        "left",
        "links",
        "npreds",
        "on_start",
        "rank",
        "rate",
        "ready",
        "released_by",
        "since",
        "sms",
        "start",
        "stream",
        "succs",
        "version",
        "work",
    )

    def __init__(
        self,
        rank: int,
        stream: str | None,
        work: float,
        label: Any,
        links: tuple[tuple[Any, float], ...] = (),
        sms: int = 0,
    ) -> None:
        self.rank, self.stream, self.work, self.label = rank, stream, work, label
        self.links, self.sms = links, sms
        self.beside = 1.0  # a flow's rate while its rank computes (``costs.overlap.beside_rate``)
        self.succs: list[Item] = []
        self.on_start: list[Item] = []
        self.npreds = 0
        self.ready = self.start = self.end = -1.0
        self.left = work
        self.rate = 1.0
        self.since = 0.0
        self.version = 0
        self.released_by: Item | None = None

    def after(self, *preds: Item | None) -> Item:
        """This item waits for each of ``preds`` to end (None: no wait)."""
        for p in preds:
            if p is not None:
                p.succs.append(self)
                self.npreds += 1
        return self

    def started_by(self, pred: Item) -> Item:
        """This item waits for ``pred`` to start."""
        pred.on_start.append(self)
        self.npreds += 1
        return self


class Engine:
    """Runs items on streams and links to completion (see the module docstring)."""

    def __init__(self, ranks: int, sm_count: int) -> None:
        self.now = 0.0
        self.sm_count = sm_count
        self.heap: list[tuple[float, int, int, Item]] = []
        self.seq = 0
        self.queues: dict[tuple[int, str], deque[Item]] = defaultdict(deque)
        self.running: dict[tuple[int, str], Item | None] = {}
        self.held = [0] * ranks
        self.compute: list[Item | None] = [None] * ranks
        self.slowed: list[set[Item]] = [set() for _ in range(ranks)]  # flows with beside < 1
        self.load: dict[Any, float] = defaultdict(float)
        self.flows: dict[Any, set[Item]] = defaultdict(set)
        self.items: list[Item] = []
        self._pending: list[Item] = []

    def add(self, item: Item) -> Item:
        self.items.append(item)
        return item

    # A ready item joins its stream's queue; an instant ends at once.
    def _release(self, item: Item, by: Item | None) -> None:
        item.npreds -= 1
        if by is not None and (item.released_by is None or by.end >= item.released_by.end):
            item.released_by = by
        if item.npreds == 0:
            self._pending.append(item)

    def _drain(self) -> None:
        while self._pending:
            item = self._pending.pop()
            item.ready = self.now
            if item.stream is None or item.work <= 0:
                item.start = self.now
                for s in item.on_start:
                    self._release(s, None)
                self._end(item)
                continue
            key = (item.rank, item.stream)
            self.queues[key].append(item)
            if self.running.get(key) is None:
                self._start_next(key)

    def _start_next(self, key: tuple[int, str]) -> None:
        queue = self.queues[key]
        if not queue:
            self.running[key] = None
            return
        item = queue.popleft()
        self.running[key] = item
        item.start = item.since = self.now
        item.left = item.work
        for s in item.on_start:
            self._release(s, None)
        if item.stream == COMPUTE:
            self.compute[item.rank] = item
            item.rate = self._compute_rate(item.rank)
            self._schedule(item)
            self._rerate(self.slowed[item.rank])
            return
        self._flow_change(item, +1)

    def _end(self, item: Item) -> None:
        item.end = self.now
        if item.stream is not None and item.work > 0:
            key = (item.rank, item.stream)
            if item.stream == COMPUTE:
                self.compute[item.rank] = None
                if not self.queues[key]:  # no kernel follows at once: the flows speed up
                    self._rerate(self.slowed[item.rank])
            else:
                self._flow_change(item, -1)
            self._start_next(key)
        for s in item.succs:
            self._release(s, item)

    def _compute_rate(self, rank: int) -> float:
        return max(1.0 / self.sm_count, 1.0 - self.held[rank] / self.sm_count)

    def _flow_rate(self, item: Item) -> float:
        worst = 1.0
        for link, _ in item.links:
            worst = max(worst, self.load[link])
        if item.beside < 1.0 and self.compute[item.rank] is not None:
            return min(1.0 / worst, item.beside)
        return 1.0 / worst

    def _rerate(self, items: set[Item]) -> None:
        """The rates of ``items`` again, after what they share changed: a link's load, a
        rank's SMs held, or whether its compute runs."""
        for other in items:
            rate = (
                self._compute_rate(other.rank)
                if other.stream == COMPUTE
                else self._flow_rate(other)
            )
            if rate != other.rate:
                self._advance(other)
                other.rate = rate
                self._schedule(other)

    def _flow_change(self, item: Item, sign: int) -> None:
        """A transfer starts (+1) or ends (-1): its links' loads and its ranks' SMs change,
        and with them the rates of what shares them."""
        touched: set[Item] = set()
        for link, demand in item.links:
            self.load[link] += sign * demand
            on = self.flows[link]
            if sign > 0:
                on.add(item)
            else:
                on.discard(item)
            touched |= on
        if item.sms:
            self.held[item.rank] += sign * item.sms
            c = self.compute[item.rank]
            if c is not None:
                touched.add(c)
        if item.beside < 1.0:
            (self.slowed[item.rank].add if sign > 0 else self.slowed[item.rank].discard)(item)
        if sign > 0:
            touched.discard(item)
            item.rate = self._flow_rate(item)
            self._schedule(item)
        self._rerate(touched)

    def _advance(self, item: Item) -> None:
        item.left = max(0.0, item.left - item.rate * (self.now - item.since))
        item.since = self.now

    def _schedule(self, item: Item) -> None:
        item.version += 1
        self.seq += 1
        heapq.heappush(self.heap, (self.now + item.left / item.rate, self.seq, item.version, item))

    def run(self) -> float:
        """Run every item to its end; the time the last one ends."""
        roots = [i for i in self.items if i.npreds == 0]
        self._pending.extend(reversed(roots))
        self._drain()
        while self.heap:
            when, _, version, item = heapq.heappop(self.heap)
            if version != item.version or item.end >= 0:
                continue
            self.now = when
            item.left = 0.0
            self._end(item)
            self._drain()
        unfinished = [i for i in self.items if i.end < 0]
        assert not unfinished, f"{len(unfinished)} pieces never ran: the program deadlocks"
        return self.now


# -- each rank's program --------------------------------------------------------------------


def _links(transfer: Transfer, sender: int, receiver: int | None) -> tuple[tuple[Any, float], ...]:
    """A transfer's demand on each link it uses (its busy seconds over its seconds): a
    collective within the rank's groups both ways on its own links, a send out of the
    sender's and into the receiver's."""
    if transfer.seconds <= 0:
        return ()
    out = []
    for name, busy in (("ib", transfer.ib), ("nvl", transfer.nvlink)):
        if busy <= 0:
            continue
        demand = min(1.0, busy / transfer.seconds)
        if receiver is None:
            out += [((sender, name, "out"), demand), ((sender, name, "in"), demand)]
        else:
            out += [((sender, name, "out"), demand), ((receiver, name, "in"), demand)]
    return tuple(out)


@dataclass
class _Op:
    """One op's items: where it starts and ends, and the send that carries its result."""

    first: Item
    last: Item
    send: Item | None = None


class _Builder:
    """Turns a schedule's tasks into items (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        prog: Program,
        stages: list[StageWork],
        optimizer: list[float],
        overlap: Overlap,
        a2a_sms: int,
        payload_Bps: tuple[float, float] | None = None,
    ) -> None:
        self.e, self.prog, self.stages = engine, prog, stages
        self.payload_Bps = payload_Bps
        self.last = len(stages) - 1  # the last stage (DualPipe's directions share the stages)
        self.links: dict[tuple[Transfer, int, int | None], tuple[tuple[Any, float], ...]] = {}
        self.optimizer, self.overlap, self.a2a_sms = optimizer, overlap, a2a_sms
        self.ops: dict[tuple[str, int, int, int], _Op] = {}
        self.owner = {dep_key(op): g for g, group in enumerate(prog.ops) for op in group}
        self.task_start: list[Item] = []
        self.task_end: list[Item] = []
        self.reductions: dict[int, list[Item]] = defaultdict(list)
        self.last_grad = {(r, g, s) for r, pairs in enumerate(prog.last_grad) for s, g in pairs}
        self.first_forward: set[tuple[int, int]] = set()  # (rank, stage) seen
        self.gathers: dict[tuple[int, int], list[Item]] = {}  # ZeRO-1/2, per (rank, stage)

    def item(self, rank: int, stream: str | None, work: float, label: Any) -> Item:
        made = Item(rank, stream, work, label)
        self.e.items.append(made)
        return made

    def flow(
        self, rank: int, stream: str, t: Transfer, label: Any, to: int | None = None, sms: int = 0
    ) -> Item:
        key = (t, rank, to)
        links = self.links.get(key)
        if links is None:
            links = self.links[key] = _links(t, rank, to)
        made = Item(rank, stream, t.seconds, label, links, sms)
        if self.payload_Bps is not None and sms:
            ib, nvl = self.payload_Bps
            made.beside = beside_rate(t.seconds, t.ib * ib + t.nvlink * nvl, sms)
        self.e.items.append(made)
        return made

    def build(self) -> list[Item]:
        """Every task's items; each rank's end (its optimizer step, or the weight gathers
        after it)."""
        prog = self.prog
        self.task_start = [None] * len(prog.key)  # type: ignore[list-item]
        self.task_end = [None] * len(prog.key)  # type: ignore[list-item]
        prev: dict[int, Item] = {}
        self._param_gathers()
        for g in prog.topo:
            r = prog.rank[g]
            gate = self.item(r, None, 0.0, ("task", g)).after(prev.get(r))
            for op in prog.ops[g]:
                for d in op_inputs(op, self.last):
                    p = self.owner[d]
                    if prog.rank[p] != r:
                        gate.after(self.ops[d].send)
            end = self.item(r, None, 0.0, ("end", g))
            turn = gate
            for op in prog.ops[g]:
                built = self._op(r, g, op, turn)
                self.ops[dep_key(op)] = built
                end.after(built.last)
                if self.overlap.pairs_in_turn:  # the pair's next op waits for this one
                    turn = built.last
            self.task_start[g], self.task_end[g] = gate, end
            prev[r] = end
        ends = []
        for r, tasks in enumerate(prog.by_rank):
            last = self.task_end[tasks[-1]]
            reduce = self.reductions[r]
            if not self.overlap.grad_sync:
                reduce = self._tail_sync(r, last)
            opt = self.item(r, COMPUTE, self.optimizer[r], ("optimizer",)).after(last, *reduce)
            end = opt
            if not self.overlap.param_gather:
                for s, _ in prog.last_grad[r]:
                    t = self.stages[s].param_gather
                    if t.seconds > 0:
                        end = self.flow(r, "dp", t, ("weight gather", s), sms=NCCL_SMS).after(end)
            ends.append(end)
        return ends

    def _param_gathers(self) -> None:
        """ZeRO-1/2's gathers of the updated weights overlapped with the forward: issued at
        the step's start, one per block, in the order the rank's forwards need them."""
        if not self.overlap.param_gather:
            return
        for r, pairs in enumerate(self.prog.last_grad):
            for s in sorted({s for s, _ in pairs}):
                st = self.stages[s]
                if st.param_gather.seconds <= 0:
                    continue
                self.gathers[(r, s)] = [
                    self.flow(r, "zero", st.param_gather * b.share, ("weight gather", s, b.name))
                    for b in st.blocks
                ]

    def _tail_sync(self, r: int, last: Item) -> list[Item]:
        out = []
        for s, _ in self.prog.last_grad[r]:
            st = self.stages[s]
            if st.grad_sync.seconds > 0:
                out.append(
                    self.flow(r, "dp", st.grad_sync, ("grad sync", s), sms=NCCL_SMS).after(last)
                )
        return out

    def _receiver(self, op: Op, forward: bool) -> int | None:
        """The rank of the op that consumes ``op``'s result, when another rank."""
        s, mb, d = op.stage, op.microbatch, op.direction
        key = ("F", mb, s + 1, d) if forward else ("B", mb, s - 1, d)
        g = self.owner.get(key)
        if g is None:
            return None
        return self.prog.rank[g]

    def _op(self, r: int, g: int, op: Op, gate: Item) -> _Op:
        st = self.stages[op.stage]
        merge = len(self.prog.ops[g]) == 1 or self.overlap.pairs_in_turn
        if op.kind == "F":
            last = self._forward(r, op, st, gate, merge)
            to = self._receiver(op, True)
            send_t = st.p2p
        elif op.kind == "W":
            return _Op(gate, self._weights(r, g, op, st, gate, merge))
        else:
            last = self._backward(r, g, op, st, gate, merge)
            to = self._receiver(op, False)
            send_t = st.p2p_back
        send = None
        if to is not None and to != r:
            send = self.flow(r, "p2p", send_t, (op.kind + " send", op.microbatch, op.stage), to=to)
            send.after(last)
            if not self.overlap.async_sends:
                last = send
        return _Op(gate, last, send)

    def _a2a(self, chain: _Chain, t: Transfer, label: Any) -> None:
        chain.then(self.flow(chain.rank, "ep", t, label, sms=self.a2a_sms))

    def _moe(self, chain: _Chain, b: BlockWork, work: float, tag: Any, back: bool) -> None:
        """``work`` of a block with routed experts, split at its all-to-alls, per layer: in
        a forward (or its recompute), the share outside the experts, the dispatch, the
        experts' share, the combine; in a backward, the combine's transpose, the experts',
        the dispatch's transpose (each combine-sized), then the rest."""
        st = self.stages[tag[2]]
        k = b.moe_layers
        outside, inside = work * (1 - b.moe_share) / k, work * b.moe_share / k
        for layer in range(k):
            if not back:
                chain.compute(outside, (*tag, "attention", layer))
            first, second = (st.combine, st.combine) if back else (st.dispatch, st.combine)
            self._a2a(chain, first, (*tag, "combine" if back else "dispatch", layer))
            chain.compute(inside, (*tag, "experts", layer))
            self._a2a(chain, second, (*tag, "dispatch" if back else "combine", layer))
            if back:
                chain.compute(outside, (*tag, "attention", layer))

    def _gather(self, chain: _Chain, st: StageWork, b: BlockWork, tag: Any) -> None:
        """ZeRO-3's gather of a block's weights before it runs: one block ahead where the
        framework overlaps it (issued when the block before starts), else in the op's
        series."""
        if st.zero_gather.seconds <= 0:
            return
        gather = self.flow(
            chain.rank, "zero", st.zero_gather * b.share, (*tag, "gather"), sms=NCCL_SMS
        )
        running = chain.flush()
        if self.overlap.zero and chain.block_start is not None:
            gather.started_by(chain.block_start)
        else:
            gather.after(running)
        chain.wait(gather)

    def _forward(self, r: int, op: Op, st: StageWork, gate: Item, merge: bool) -> Item:
        chain = _Chain(self, r, gate, merge)
        key = (r, op.stage)
        gathers = self.gathers.get(key) if key not in self.first_forward else None
        self.first_forward.add(key)
        for i, b in enumerate(st.blocks):
            tag = ("F", op.microbatch, op.stage, b.name)
            self._gather(chain, st, b, tag)
            if gathers:
                chain.wait(gathers[i])
            chain.start_block(tag, needed=st.zero_gather.seconds > 0)
            if b.moe_layers:
                self._moe(chain, b, b.fwd, tag, back=False)
            else:
                chain.compute(b.fwd, tag)
        return chain.flush()

    def _backward(self, r: int, g: int, op: Op, st: StageWork, gate: Item, merge: bool) -> Item:
        chain = _Chain(self, r, gate, merge)
        fused = op.kind == "BW"
        sync = self.overlap.grad_sync and (r, g, op.stage) in self.last_grad and fused
        for b in reversed(st.blocks):
            tag = (op.kind, op.microbatch, op.stage, b.name)
            self._gather(chain, st, b, tag)
            chain.start_block(tag, needed=st.zero_gather.seconds > 0)
            if b.recompute > 0:
                if b.moe_rerun:
                    self._moe(chain, b, b.recompute, (*tag, "recompute"), back=False)
                else:
                    chain.compute(b.recompute, (*tag, "recompute"))
            work = b.bwd + (b.wgt if fused else 0.0)
            if b.moe_layers:
                self._moe(chain, b, work, tag, back=True)
            else:
                chain.compute(work, tag)
            if fused:
                self._after_weights(chain, st, b, tag, sync)
        return chain.flush()

    def _weights(self, r: int, g: int, op: Op, st: StageWork, gate: Item, merge: bool) -> Item:
        chain = _Chain(self, r, gate, merge)
        sync = self.overlap.grad_sync and (r, g, op.stage) in self.last_grad
        for b in reversed(st.blocks):
            tag = ("W", op.microbatch, op.stage, b.name)
            chain.compute(b.wgt, tag)
            self._after_weights(chain, st, b, tag, sync)
        return chain.flush()

    def _after_weights(
        self, chain: _Chain, st: StageWork, b: BlockWork, tag: Any, sync: bool
    ) -> None:
        """A block's weight gradients are made: ZeRO-2/3's reduce-scatter of them (the op
        waits for it where the framework does not overlap it) and, after the last
        micro-batch, its share of the stage's data-parallel reduction."""
        r = chain.rank
        if st.zero_reduce.seconds > 0:
            rs = self.flow(r, "dp", st.zero_reduce * b.share, (*tag, "reduce"), sms=NCCL_SMS)
            rs.after(chain.flush())
            self.reductions[r].append(rs)
            if not self.overlap.zero:
                chain.wait(rs)
        if sync and st.grad_sync.seconds > 0:
            red = self.flow(r, "dp", st.grad_sync * b.share, (*tag, "grad sync"), sms=NCCL_SMS)
            self.reductions[r].append(red.after(chain.flush()))


class _Chain:
    """One op's pieces in series on a rank. Consecutive compute with nothing between it
    (no transfer, no wait, no block whose start something watches) is one kernel of their
    summed work: the compute stream would run them back to back at the same rate. Not in a
    paired task (``merge`` false), whose two chunks take turns on the compute stream piece
    by piece."""

    def __init__(self, builder: _Builder, rank: int, at: Item, merge: bool = True) -> None:
        self.b, self.rank, self.at, self.merge = builder, rank, at, merge
        self.work = 0.0
        self.labels: list[Any] = []
        self.waits: list[Item] = []
        self.block_start: Item | None = None  # the instant the last watched block started

    def compute(self, work: float, label: Any) -> None:
        if self.labels and not self.merge:
            self.flush()
        self.work += work
        self.labels.append(label)

    def flush(self) -> Item:
        """The pieces so far as one item (the chain's end when there are none)."""
        if self.labels or self.waits:
            label = _merged(self.labels) if self.labels else ("wait",)
            stream = COMPUTE if self.labels else None
            self.at = self.b.item(self.rank, stream, self.work, label).after(self.at, *self.waits)
            self.work, self.labels, self.waits = 0.0, [], []
        return self.at

    def then(self, item: Item) -> None:
        """``item`` follows the pieces so far."""
        self.at = item.after(self.flush())

    def wait(self, item: Item) -> None:
        """What comes next also waits for ``item``."""
        self.flush()
        self.waits.append(item)

    def start_block(self, tag: Any, needed: bool) -> None:
        """A block starts; where something is issued when it does (a prefetch), mark it."""
        if needed:
            self.block_start = self.b.item(self.rank, None, 0.0, tag).after(self.flush())
            self.at = self.block_start


def _merged(labels: list[Any]) -> Any:
    first, last = labels[0], labels[-1]
    if len(labels) == 1:
        return first
    if len(first) >= 4 and len(last) >= 4 and first[:3] == last[:3]:
        return (*first[:3], f"{first[3]}..{last[3]}")
    return first


# -- the result -----------------------------------------------------------------------------


@dataclass
class Execution:
    """One executed step: its time, each rank's end and compute time, each link's use and
    every item (for timelines). Where a long step was run at two shorter lengths and
    extended, the items are the longer run's."""

    step_s: float
    rank_end_s: list[float]
    busy_s: list[float]
    link_busy_s: dict[str, list[float]]  # "<link> <out|in>" -> seconds of full use per rank
    items: list[Item] = field(repr=False)
    task_start: list[Item] = field(repr=False)
    task_end: list[Item] = field(repr=False)
    prog: Program = field(repr=False)
    num_microbatches: int = 0
    run_microbatches: int = 0


@dataclass(frozen=True)
class Inputs:
    """What a layout's step is executed from."""

    num_microbatches: int
    stages: list[StageWork]
    optimizer: list[float]  # each rank's optimizer step (seconds)
    overlap: Overlap
    a2a_sms: int  # SMs an expert all-to-all holds
    payload_Bps: tuple[float, float]  # InfiniBand's and NVLink's achieved rates, per GPU


def inputs(model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, layout: Layout) -> Inputs:
    """The pieces, optimizer steps and framework facts a step of ``layout`` runs on."""
    m = check_layout(model, cluster, job, layout)
    memory = stage_memory(model, job, layout, num_microbatches=m)
    network = Network.of(cluster)
    return Inputs(
        num_microbatches=m,
        stages=stage_work(model, cluster, job, layout),
        optimizer=[optimizer_time(s, cluster) for s in memory],
        overlap=overlap_of(job, cluster, layout.schedule),
        a2a_sms=PAIRED_COMM_SMS if job.moe_dispatcher == "deepep" else NCCL_SMS,
        payload_Bps=(network.ib_bus_Bps, network.nvlink_bus_Bps),
    )


def execute(model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, layout: Layout) -> Execution:
    """Execute one training step of ``layout`` (see the module docstring). A step longer
    than a schedule's steady lengths (``schedules.steady_lengths``: 8 and 16 times pp * v
    micro-batches) is run at those two lengths and extended: past the fill every micro-batch
    repeats the steady state, so the step grows by the same amount per micro-batch."""
    given = inputs(model, cluster, job, layout)
    m = given.num_microbatches
    common = (given.stages, given.optimizer, given.overlap, given.a2a_sms)
    lengths = steady_lengths(layout.pp, layout.virtual_stages)
    if m <= lengths[1]:
        return run_stages(layout, *common, m, payload_Bps=given.payload_Bps)
    a, b = (run_stages(layout, *common, n, m, payload_Bps=given.payload_Bps) for n in lengths)
    b.step_s = extended(a.step_s, b.step_s, lengths, m)
    b.rank_end_s = [
        extended(x, y, lengths, m) for x, y in zip(a.rank_end_s, b.rank_end_s, strict=True)
    ]
    b.busy_s = [extended(x, y, lengths, m) for x, y in zip(a.busy_s, b.busy_s, strict=True)]
    b.link_busy_s = {
        k: [extended(x, y, lengths, m) for x, y in zip(a.link_busy_s[k], v, strict=True)]
        for k, v in b.link_busy_s.items()
    }
    return b


def run_stages(
    shape: Any,
    stages: list[StageWork],
    optimizer: list[float],
    overlap: Overlap,
    a2a_sms: int,
    n: int,
    m: int | None = None,
    *,
    payload_Bps: tuple[float, float] | None = None,
) -> Execution:
    """Run ``n`` micro-batches of a pipeline ``shape`` (anything with ``schedule``, ``pp``
    and ``virtual_stages``: a ``Layout`` say) over its stages' pieces, each rank then taking
    its ``optimizer`` step; ``m``: the step's micro-batches, where ``n`` is a shorter run;
    ``payload_Bps``: InfiniBand's and NVLink's achieved rates per GPU, from which each
    collective's slowing beside compute follows (``costs.overlap.beside_rate``; None: none
    is slowed)."""
    layout = shape
    prog = program(layout.schedule, layout.pp, n, layout.virtual_stages)
    engine = Engine(layout.pp, overlap.sm_count)
    builder = _Builder(engine, prog, stages, optimizer, overlap, a2a_sms, payload_Bps)
    ends = builder.build()
    step = engine.run()
    busy = [0.0] * layout.pp
    for item in engine.items:
        if item.stream == COMPUTE:
            busy[item.rank] += item.end - item.start
    links: dict[str, list[float]] = {
        f"{name} {way}": [0.0] * layout.pp for name in LINK_NAMES for way in ("out", "in")
    }
    # A transfer keeps each of its links in full use for its demand times its work, however
    # its rate varied: the link's busy seconds are the transfers' own.
    for item in engine.items:
        for (rank, name, way), demand in item.links:
            links[f"{name} {way}"][rank] += demand * item.work
    return Execution(
        step_s=step,
        rank_end_s=[e.end for e in ends],
        busy_s=busy,
        link_busy_s=links,
        items=engine.items,
        task_start=builder.task_start,
        task_end=builder.task_end,
        prog=prog,
        num_microbatches=n if m is None else m,
        run_microbatches=n,
    )


def label_text(label: Any) -> str:
    """An item's label as a line: ``("F", 3, 1, "layer.4", "dispatch", 0)`` reads
    "F mb3 s1 layer.4 dispatch 0"."""
    if not isinstance(label, tuple):
        return str(label)
    if label and label[0] in ("F", "B", "W", "BW") and len(label) >= 3:
        kind, mb, stage, *rest = label
        return " ".join([f"{kind} mb{mb} s{stage}", *map(str, rest)])
    return " ".join(map(str, label))
