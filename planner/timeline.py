"""One training step of a layout, task by task: the timing semantics every estimate shares.

Each pipeline rank runs its schedule's op order (``planner.schedules.op_order``) on one
compute stream, one task at a time (a DualPipe pair is one task). A task starts when the rank
is free and its inputs have arrived: a forward needs the previous stage's output, a backward
the next stage's input gradient (a weight-gradient op its own input-gradient op). The send
that carries them is inside the producing task (``planner.costs.overlap``), so the data is
there when that task ends; where the framework sends asynchronously
(``Overlap.async_sends``: Megatron-LM's interleaved schedules) the send leaves the producing
task and the receiving task starts no sooner than the producer's end plus the send, a chain
that then holds the send's quantity. Task lengths come from ``planner.costs.overlap``.

A second stream per rank carries the data-parallel gradient reduction: each stage's starts
with the stage's last gradient-producing task (when the framework overlaps it: bucketed
reduction overlaps the last backward; otherwise after the rank's last task) and queues behind
the one before; the optimizer step follows the later of the two streams. While a reduction
overlaps the rank's compute it shares the links with the tasks' own transfers and holds
``costs.overlap.nccl_share`` of the SMs, so from the start of the task it begins with, the
rank's end is also at least:

- for each link, the time that link needs for everything still to cross it (the tasks'
  transfers, then the reductions') plus the optimizer step;
- the rank's remaining tasks back to back, slowed by the reductions' SM share, plus the
  optimizer step.

The step ends when the last rank's does. Every figure is the length of a chain of tasks and
transfers, a sum of per-stage quantities: ``Timeline.forms`` gives, per rank, the chain that
set its end, as coefficients of those quantities, which is how the solver
(``planner.solve.model``) states the same step time over its variables.

The tp * dp ranks of a pipeline position run the same tasks at the same times, so one
representative rank per position is run.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from planner import frameworks
from planner.costs.overlap import (
    Parts,
    TaskKey,
    link_use,
    nccl_share,
    task_parts,
    task_time,
    values,
)
from planner.costs.quantities import LINKS, Part, Prim, Quantity, name
from planner.costs.timing import StageTime
from planner.frameworks import Overlap
from planner.schedules import Op, op_order

FormKey = tuple[Any, ...]  # ("task", TaskKey) | ("prim", Prim) | ("opt", rank)
GATHER = name(Quantity.PARAM_GATHER)
Form = dict[FormKey, float]


@dataclass(frozen=True)
class Task:
    """One task on one rank's compute stream (seconds)."""

    rank: int
    key: TaskKey
    ops: tuple[Op, ...]
    start: float
    duration: float

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def name(self) -> str:
        return " & ".join(f"{o.kind}{o.microbatch} s{o.stage}" for o in self.ops)


@dataclass(frozen=True)
class Sync:
    """One stage's gradient reduction on a rank's communication stream (seconds)."""

    stage: int
    start: float
    duration: float


@dataclass
class RankRun:
    """What one pipeline rank did in the step. Its ``tasks`` are listed when first asked
    for: a step of many micro-batches has millions, and a search that costs layouts needs
    only the critical rank's (for the breakdown)."""

    syncs: list[Sync]
    optimizer_start: float
    optimizer: float
    end: float
    form: Form  # the chain that set ``end``
    listing: Callable[[], list[Task]] = field(default=list, repr=False)

    @functools.cached_property
    def tasks(self) -> list[Task]:
        return self.listing()


@dataclass
class Timeline:
    """One step, rank by rank (see the module docstring)."""

    ranks: list[RankRun]
    step_s: float
    critical_rank: int
    breakdown: dict[str, float]  # empty when run without the per-stage table
    num_microbatches: int

    @property
    def forms(self) -> list[Form]:
        return [r.form for r in self.ranks]


def run(
    layout: Any,
    times: list[StageTime],
    optimizer: list[float],
    *,
    num_microbatches: int,
    overlap: Overlap,
) -> Timeline:
    """Run one step of ``layout`` over its per-stage ``times`` (see the module docstring)
    with what runs beside compute (``costs.overlap.overlap_of``)."""
    return run_values(
        layout,
        values(times),
        optimizer,
        num_microbatches=num_microbatches,
        overlap=overlap,
        times=times,
    )


def run_values(
    shape: Any,
    val: dict[Prim, float],
    optimizer: list[float],
    *,
    num_microbatches: int,
    overlap: Overlap,
    times: list[StageTime] | None = None,
    detail: bool = True,
) -> Timeline:
    """Run one step of a pipeline ``shape`` (anything with ``schedule``, ``pp`` and
    ``virtual_stages``, a ``Layout`` say) over per-stage quantities ``val``. Without
    ``detail`` the ranks' task and reduction lists are left empty (only ends and chains)."""
    prog = program(shape.schedule, shape.pp, num_microbatches, shape.virtual_stages)
    lengths = {key: task_time(key, val, overlap) for key in prog.keys}
    dur = [lengths[k] for k in prog.key]
    start = [0.0] * len(dur)
    via = [-1] * len(dur)
    lag: list[Prim | None] = [None] * len(dur)  # the send on the edge from via[g], if waited
    for g in prog.topo:
        best, arg, sent = 0.0, -1, None
        for p, send in zip(prog.preds[g], prog.sends[g], strict=True):
            waited = send if overlap.async_sends else None  # an asynchronous send's wait
            e = start[p] + dur[p] + (val[waited] if waited is not None else 0.0)
            if e > best:
                best, arg, sent = e, p, waited
        start[g], via[g], lag[g] = best, arg, sent
    run = _Run(prog, val, dur, start, via, overlap, detail, lag)
    ranks = [run.finish(r, optimizer[r]) for r in range(shape.pp)]
    critical = max(range(shape.pp), key=lambda r: (ranks[r].end, -r))
    step = ranks[critical].end
    breakdown = (
        _breakdown(ranks[critical], times, step, overlap.async_sends) if times is not None else {}
    )
    return Timeline(ranks, step, critical, breakdown, num_microbatches)


@functools.lru_cache(maxsize=256)
def shape_forms(schedule: str, pp: int, m: int, v: int) -> tuple[Form, ...]:
    """Chains of a schedule's shape that hold whatever the stages cost: each rank's own
    tasks back to back, every rank's end with equal stages, and with some ranks' own stages
    (``heavy_ranks``) ten times the others' in turn (the chain through all of that rank's
    tasks and the waits around them). They seed the solver's and the bounds' sets (cached:
    they depend on the shape alone)."""
    stages = pp * v
    prog = program(schedule, pp, m, v)
    # Each rank's own tasks back to back: its end is at least their sum.
    forms: list[Form] = []
    for r, tasks in enumerate(prog.by_rank):
        busy: Form = {("opt", r): 1.0}
        for g in tasks:
            busy[("task", prog.key[g])] = busy.get(("task", prog.key[g]), 0.0) + 1.0
        forms.append(busy)
    held = [{op.stage for g in tasks for op in prog.ops[g]} for tasks in prog.by_rank]
    profiles = [set[int](), *(held[r] for r in heavy_ranks(pp))]
    shape = _Shape(schedule, pp, v)
    for heavy in profiles:
        times = [_work_only(s, 10.0 if s in heavy else 1.0) for s in range(stages)]
        run = run_values(
            shape,
            values(times),
            [0.0] * pp,
            num_microbatches=m,
            overlap=frameworks.framework(frameworks.DEFAULT_FRAMEWORK).overlap,
            detail=False,
        )
        forms += [f for f in run.forms if f not in forms]
    return tuple(forms)


def _work_only(stage: int, seconds: float) -> StageTime:
    """A stage whose forward, input- and weight-gradient work take ``seconds`` each and
    which sends and reduces nothing."""
    return StageTime.work_only(stage, seconds, seconds, seconds)


def heavy_ranks(pp: int) -> list[int]:
    """Every rank of a short pipeline; the ends and three between of a long one."""
    if pp <= 8:
        return list(range(pp))
    return sorted({0, pp // 4, pp // 2, 3 * pp // 4, pp - 1})


@dataclass(frozen=True)
class _Shape:
    schedule: str
    pp: int
    virtual_stages: int


@dataclass(frozen=True)
class Program:
    """A schedule's tasks for one shape, flattened: what does not depend on durations."""

    key: list[TaskKey]  # per task
    ops: list[tuple[Op, ...]]
    rank: list[int]
    preds: list[list[int]]  # the rank's previous task and the tasks whose results it needs
    # per pred: the send that carries its result to another rank (a quantity of the
    # producing stage), None for the rank's own previous task and same-rank results
    sends: list[list[Prim | None]]
    topo: list[int]  # an order in which every task comes after its preds
    by_rank: list[list[int]]
    last_grad: list[list[tuple[int, int]]]  # per rank: (stage, task) of its last gradient op
    keys: frozenset[TaskKey]


@functools.lru_cache(maxsize=256)
def program(schedule: str, pp: int, m: int, v: int) -> Program:
    """The tasks of ``schedule`` on ``pp`` ranks with ``m`` micro-batches and ``v`` chunks
    per rank, and their dependencies (cached: many layouts share a shape)."""
    key: list[TaskKey] = []
    ops: list[tuple[Op, ...]] = []
    rank: list[int] = []
    by_rank: list[list[int]] = []
    for r in range(pp):
        order = op_order(schedule, pp=pp, num_microbatches=m, rank=r, virtual_stages=v)
        mine = []
        i = 0
        while i < len(order):
            op = order[i]
            if op.paired:
                nxt = order[i + 1]
                key.append(("pair", op.stage, nxt.stage, nxt.kind))
                ops.append((op, nxt))
                i += 2
            else:
                key.append((op.kind, op.stage))
                ops.append((op,))
                i += 1
            rank.append(r)
            mine.append(len(key) - 1)
        by_rank.append(mine)
    owner = {dep_key(op): g for g, group in enumerate(ops) for op in group}
    last = pp * v - 1
    preds: list[list[int]] = []
    sends: list[list[Prim | None]] = []
    for g, group in enumerate(ops):
        needs = [(owner[d], _send(d, g, owner, rank)) for op in group for d in op_inputs(op, last)]
        kept = [(p, sent) for p, sent in needs if p != g]
        preds.append([p for p, _ in kept])
        sends.append([sent for _, sent in kept])
    for tasks in by_rank:
        for a, b in itertools.pairwise(tasks):
            preds[b].insert(0, a)
            sends[b].insert(0, None)
    last_grad = []
    for tasks in by_rank:
        grads: dict[int, int] = {}
        for g in tasks:
            for op in ops[g]:
                if op.kind in ("BW", "W"):
                    grads[op.stage] = g
        last_grad.append(sorted(grads.items(), key=lambda kv: kv[1]))
    return Program(
        key, ops, rank, preds, sends, _topo(preds, by_rank), by_rank, last_grad, frozenset(key)
    )


def _send(
    dep: tuple[str, int, int, int], g: int, owner: dict[Any, int], rank: list[int]
) -> Prim | None:
    """The send that carries result ``dep`` to task ``g`` when they sit on two ranks: a
    forward's output (the producing stage's ``p2p``) or an input gradient (its
    ``p2p_back``)."""
    if rank[owner[dep]] == rank[g]:
        return None
    quantity = Quantity.P2P if dep[0] == "F" else Quantity.P2P_BACK
    return (name(quantity), dep[2])


def _topo(preds: list[list[int]], by_rank: list[list[int]]) -> list[int]:
    """Ranks advanced in turn, each as far as its next task's inputs are done."""
    done = [False] * len(preds)
    pos = [0] * len(by_rank)
    order: list[int] = []
    while len(order) < len(preds):
        progressed = False
        for r, tasks in enumerate(by_rank):
            while pos[r] < len(tasks):
                g = tasks[pos[r]]
                if not all(done[p] for p in preds[g]):
                    break
                done[g] = True
                order.append(g)
                pos[r] += 1
                progressed = True
        assert progressed, "the schedule's op orders deadlock"
    return order


def dep_key(op: Op) -> tuple[str, int, int, int]:
    kind = "B" if op.kind in ("B", "BW") else op.kind
    return (kind, op.microbatch, op.stage, op.direction)


def op_inputs(op: Op, last: int) -> list[tuple[str, int, int, int]]:
    """The ops whose results ``op`` needs (their sends are inside them)."""
    s, mb, d = op.stage, op.microbatch, op.direction
    if op.kind == "F":
        return [("F", mb, s - 1, d)] if s > 0 else []
    if op.kind == "W":
        return [("B", mb, s, d)]
    deps = [("F", mb, s, d)]
    if s < last:
        deps.append(("B", mb, s + 1, d))
    return deps


@dataclass
class _Run:
    """The tasks' starts; each rank's reductions, optimizer step and end."""

    prog: Program
    val: dict[Prim, float]
    dur: list[float]
    start: list[float]
    via: list[int]
    overlap: Overlap
    detail: bool
    lag: list[Prim | None]

    def finish(self, r: int, optimizer: float) -> RankRun:
        """Queue rank r's reductions, then its optimizer step; set its end."""
        prog, start, dur = self.prog, self.start, self.dur
        tasks = prog.by_rank[r]
        last = tasks[-1]
        last_end = start[last] + dur[last]
        syncs: list[Sync] = []
        queue: list[tuple[int, Any]] = []  # per reduction: its stage and what it followed
        for stage, g in prog.last_grad[r]:
            seconds = self._stream_seconds(stage)
            if seconds <= 0:
                continue
            begin, how = (
                (start[g], ("start", g)) if self.overlap.grad_sync else (last_end, ("end", last))
            )
            if syncs and syncs[-1].start + syncs[-1].duration > begin:
                begin, how = syncs[-1].start + syncs[-1].duration, ("sync", len(syncs) - 1)
            syncs.append(Sync(stage, begin, seconds))
            queue.append((stage, how))
        opt_start, opt_how = last_end, ("end", last)
        if syncs and syncs[-1].start + syncs[-1].duration > last_end:
            opt_start = syncs[-1].start + syncs[-1].duration
            opt_how = ("sync", len(syncs) - 1)
        # ZeRO-1/2's weight all-gathers in series after the optimizer step, where the
        # framework does not overlap them with the next step's forward.
        tail = optimizer + (0.0 if self.overlap.param_gather else self._after_step(r))
        best: tuple[float, Any] = (opt_start + tail, opt_how)
        if self.overlap.grad_sync and syncs:
            window = self._windows(r, syncs, tail)
            if window[0] > best[0] * (1 + 1e-12):
                best = window
        return RankRun(
            listing=functools.partial(self._tasks, r) if self.detail else list,
            syncs=syncs,
            optimizer_start=opt_start,
            optimizer=optimizer,
            end=best[0],
            form=self._form(best[1], r, queue),
        )

    def _stream(self, stage: int, part: Part) -> dict[Prim, float]:
        """What a stage's entry on the reduction stream is made of (``part`` of it): its
        gradient reduction, and ZeRO-1/2's all-gather of its updated weights where the
        framework overlaps that with the next step's forward. The gather is queued here,
        behind the reduction, in place of beside the next step's first forward: the same
        seconds, links and SMs, hidden behind the last backward instead of the first forward
        (a forward is about half a backward, so this hides less than it would there)."""
        out = {(name(Quantity.GRAD_SYNC, part), stage): 1.0}
        if self.overlap.param_gather:
            out[(name(Quantity.PARAM_GATHER, part), stage)] = 1.0
        return out

    def _stream_seconds(self, stage: int) -> float:
        return sum(self.val[p] * c for p, c in self._stream(stage, Part.SECONDS).items())

    def _after_step(self, r: int) -> float:
        """Seconds of rank r's weight all-gathers after its optimizer step (ZeRO-1/2 where
        the framework does not overlap them)."""
        return sum(self.val[(GATHER, stage)] for stage, _ in self.prog.last_grad[r])

    def _tasks(self, r: int) -> list[Task]:
        prog, start, dur = self.prog, self.start, self.dur
        return [Task(r, prog.key[g], prog.ops[g], start[g], dur[g]) for g in prog.by_rank[r]]

    def _windows(self, r: int, syncs: list[Sync], optimizer: float) -> tuple[float, Any]:
        """The largest link or SM budget from a reduction's first task (or the rank's first
        task, for the links) to the rank's end (see the module docstring)."""
        prog, start, dur, val = self.prog, self.start, self.dur, self.val
        tasks = prog.by_rank[r]
        index = {g: i for i, g in enumerate(tasks)}
        firsts = [g for stage, g in prog.last_grad[r] if self._stream_seconds(stage) > 0]
        suffix = {key: [0.0] * (len(tasks) + 1) for key in (*LINKS, "time")}
        use: dict[tuple[TaskKey, str], float] = {}
        for i in range(len(tasks) - 1, -1, -1):
            key = prog.key[tasks[i]]
            for link in LINKS:
                if (key, link) not in use:
                    use[(key, link)] = _link_seconds(key, link, val)
                suffix[link][i] = suffix[link][i + 1] + use[(key, link)]
            suffix["time"][i] = suffix["time"][i + 1] + dur[tasks[i]]
        best: tuple[float, Any] = (0.0, None)
        for j, g in enumerate([tasks[0], *firsts]):
            i = index[g]
            queued = syncs if j == 0 else syncs[j - 1 :]
            stages = [s.stage for s in queued]
            budgets: dict[str, float] = {
                link: suffix[link][i]
                + sum(val[p] * c for s in stages for p, c in self._stream(s, link).items())
                for link in LINKS
            }
            if j:
                budgets["time"] = suffix["time"][i] + nccl_share(self.overlap) * sum(
                    s.duration for s in queued
                )
            for budget, seconds in budgets.items():
                total = start[g] + seconds + optimizer
                if total > best[0]:
                    best = (total, ("window", g, i, budget, stages))
        return best

    def _form(self, how: Any, r: int, queue: list[tuple[int, Any]]) -> Form:
        """The chain that ``how`` describes, as coefficients (see ``Timeline.forms``)."""
        form: Form = defaultdict(float)
        form[("opt", r)] += 1.0
        if not self.overlap.param_gather:
            for stage, _ in self.prog.last_grad[r]:
                form[("prim", (GATHER, stage))] += 1.0
        if how[0] == "window":
            _, g, i, budget, stages = how
            for t in self.prog.by_rank[r][i:]:
                key = self.prog.key[t]
                if budget == "time":
                    form[("task", key)] += 1.0
                else:
                    for p, c in link_use(key, budget).items():
                        form[("prim", p)] += c
            for s in stages:
                if budget == "time":
                    for p, c in self._stream(s, Part.SECONDS).items():
                        form[("prim", p)] += c * nccl_share(self.overlap)
                else:
                    for p, c in self._stream(s, Part(budget)).items():
                        form[("prim", p)] += c
            how = ("start", g)
        while how[0] == "sync":
            stage, before = queue[how[1]]
            for p, c in self._stream(stage, Part.SECONDS).items():
                form[("prim", p)] += c
            how = before
        kind, g = how
        if kind == "start":  # up to g's start: the chain into it, with the send it waited for
            if self.lag[g] is not None:
                form[("prim", self.lag[g])] += 1.0
            g = self.via[g]
        while g >= 0:
            form[("task", self.prog.key[g])] += 1.0
            if self.lag[g] is not None:
                form[("prim", self.lag[g])] += 1.0
            g = self.via[g]
        return dict(form)


def _link_seconds(key: TaskKey, link: str, val: dict[Prim, float]) -> float:
    return sum(c * val[p] for p, c in link_use(key, link).items())


PARTS = (
    "compute",
    "recompute",
    "tp_comm",
    "cp_comm",
    "offload_copy",
    "expert_all_to_all",
    "zero_comm",
    "pipeline_p2p",
    "bubble",
    "grad_sync",
    "optimizer",
)


def _breakdown(
    run: RankRun, times: list[StageTime], step: float, async_sends: bool = False
) -> dict[str, float]:
    """The critical rank's step by part: its tasks' parts, the wait between them (bubble),
    and what follows its last task (exposed reduction, then the optimizer step)."""
    busy = Parts()
    for t in run.tasks:
        busy = busy + task_parts(t.key, times, t.duration, async_sends=async_sends)
    last = run.tasks[-1].end
    tail = step - last
    return {
        "compute": busy.compute,
        "recompute": busy.recompute,
        "tp_comm": busy.tp,
        "cp_comm": busy.cp,
        "offload_copy": busy.offload,
        "expert_all_to_all": busy.a2a,
        "zero_comm": busy.zero,
        "pipeline_p2p": busy.p2p,
        "bubble": last - busy.total,
        "grad_sync": tail - run.optimizer,
        "optimizer": run.optimizer,
    }
