"""``simulate``: a discrete-event executor of a layout's training step.

Each pipeline rank runs its schedule's op order (``planner.schedules.op_order``) on one compute
stream, one op at a time, in order. An op starts when the rank is free and its inputs have
arrived: a forward needs the previous stage's output, a backward the next stage's input
gradient. Each is sent point-to-point (latency + bytes / bandwidth) at the end of the op that
produced it, and the sender waits for the send as Megatron-LM's 1F1B does, so the data is
there when the sending op ends. DualPipe's paired forward and backward run as one task that
overlaps their sends and all-to-alls with their compute. Op lengths come from the same
per-stage table as the analytic estimate (``planner.costs.timing``).

A second stream per rank carries the data-parallel gradient reduction: each stage's starts
when the stage's last gradient-producing op starts (bucketed reduction overlaps the last
backward) and queues behind the previous one; the optimizer step follows the later of the two
streams. The step ends when the last rank's optimizer step does.

Memory: each forward allocates its stage's saved activations for one micro-batch and the
backward that consumes them frees them (the weight-gradient op, when the schedule splits it
off); the rest of each rank's memory is the memory model's static buckets. The simulated peak
is those buckets plus the highest activation level reached; while a backward runs, the block
it recomputes holds its rebuilt tensors too, less what the chunk's later blocks have freed by
then (``costs.memory.rebuild_peak``).

The task graph is a networkx DiGraph; with a fixed op order its longest path is the step's
compute critical path. The simulation covers one representative rank per pipeline position:
the tp * dp ranks of a position run the same ops at the same times.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx

from planner.costs.comm import Network
from planner.costs.memory import StageMemory, block_costs, rebuild_peak, shard_of, stage_memory
from planner.costs.timing import StageTime, op_time, optimizer_time, paired_time, stage_times
from planner.estimate import check_layout
from planner.layout import Layout, parse_recompute
from planner.schedules import Op, layout_order
from planner.specs import ClusterSpec, ModelSpec, TrainingJob


@dataclass(frozen=True)
class Event:
    """One span on one rank's track (seconds)."""

    rank: int
    track: str  # "compute" or "comm"
    name: str
    start: float
    duration: float


@dataclass
class Simulation:
    """What one simulated step did, per pipeline rank."""

    step_time_s: float
    busy_s: list[float]  # compute-stream busy time per pipeline rank
    idle_s: list[float]  # step time minus busy time
    peak_bytes: list[int]  # memory peak per pipeline rank
    memory_timeline: list[list[tuple[float, int]]]  # (seconds, bytes) after each change
    events: list[Event] = field(default_factory=list)

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write a Chrome trace (JSON) that Perfetto and chrome://tracing open: one process
        per pipeline rank, with compute and communication tracks and a memory counter."""
        out: list[dict[str, object]] = []
        for rank in range(len(self.busy_s)):
            out.append(_meta(rank, "process_name", f"pipeline rank {rank}"))
            out.append(_meta(rank, "process_sort_index", rank, key="sort_index"))
            for tid, track in enumerate(("compute", "comm")):
                out.append({**_meta(rank, "thread_name", track), "tid": tid})
        for e in self.events:
            out.append(
                {
                    "ph": "X",
                    "pid": e.rank,
                    "tid": 0 if e.track == "compute" else 1,
                    "name": e.name,
                    "ts": e.start * 1e6,
                    "dur": e.duration * 1e6,
                }
            )
        for rank, timeline in enumerate(self.memory_timeline):
            for t, nbytes in timeline:
                out.append(
                    {
                        "ph": "C",
                        "pid": rank,
                        "name": "memory",
                        "ts": t * 1e6,
                        "args": {"GiB": nbytes / 2**30},
                    }
                )
        target = Path(path)
        target.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))
        return target


def _meta(rank: int, name: str, value: object, *, key: str = "name") -> dict[str, object]:
    return {"ph": "M", "pid": rank, "tid": 0, "name": name, "args": {key: value}}


@dataclass
class _Task:
    rank: int
    ops: tuple[Op, ...]
    duration: float
    start: float = 0.0

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def name(self) -> str:
        return " & ".join(f"{o.kind}{o.microbatch} s{o.stage}" for o in self.ops)


def simulate(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, layout: Layout
) -> Simulation:
    """Run one training step of ``layout`` event by event (see the module docstring)."""
    m = check_layout(model, cluster, job, layout)
    network = Network.of(cluster)
    times = stage_times(model, cluster, job, layout, network)
    memory = stage_memory(model, job, layout, num_microbatches=m)
    tasks = _tasks(layout, times, m)
    _run(layout, tasks)
    events: list[Event] = []
    busy, ends = [], []
    for rank, mine in enumerate(tasks):
        events += [Event(rank, "compute", t.name, t.start, t.duration) for t in mine]
        comm_end = _grad_sync(rank, mine, times, events)
        end = max(mine[-1].end, comm_end)
        opt = optimizer_time(memory[rank], cluster)
        events.append(Event(rank, "compute", "optimizer", end, opt))
        ends.append(end + opt)
        busy.append(sum(t.duration for t in mine) + opt)
    step = max(ends)
    timelines, peaks = _memory(model, job, layout, tasks, memory)
    return Simulation(
        step_time_s=step,
        busy_s=busy,
        idle_s=[step - b for b in busy],
        peak_bytes=peaks,
        memory_timeline=timelines,
        events=events,
    )


def _tasks(layout: Layout, times: list[StageTime], m: int) -> list[list[_Task]]:
    """Each rank's ops as tasks with durations; a paired F joins the op after it."""
    out = []
    for rank in range(layout.pp):
        order = layout_order(layout, rank, m)
        mine: list[_Task] = []
        i = 0
        while i < len(order):
            op = order[i]
            if op.paired and i + 1 < len(order):
                nxt = order[i + 1]
                duration = paired_time(times[op.stage], times[nxt.stage], nxt.kind)
                mine.append(_Task(rank, (op, nxt), duration))
                i += 2
                continue
            mine.append(_Task(rank, (op,), op_time(times[op.stage], op.kind)))
            i += 1
        out.append(mine)
    return out


def _key(op: Op) -> tuple[str, int, int, int]:
    kind = "B" if op.kind in ("B", "BW") else op.kind
    return (kind, op.microbatch, op.stage, op.direction)


def _run(layout: Layout, tasks: list[list[_Task]]) -> None:
    """Give every task its start time: the longest path through the task graph."""
    graph: nx.DiGraph[int] = nx.DiGraph()
    flat = [t for mine in tasks for t in mine]
    ids = {id(t): i for i, t in enumerate(flat)}
    owner: dict[tuple[str, int, int, int], int] = {}
    for index, task in enumerate(flat):
        graph.add_node(index)
        for op in task.ops:
            owner[_key(op)] = index
    last = len(layout.stages) - 1
    for mine in tasks:  # each rank runs its tasks in order
        for a, b in itertools.pairwise(mine):
            graph.add_edge(ids[id(a)], ids[id(b)], delay=0.0)
    for index, task in enumerate(flat):
        for op in task.ops:
            for dep in _inputs(op, last):
                src = owner[dep]
                if src != index:
                    graph.add_edge(src, index, delay=0.0)
    for index in nx.topological_sort(graph):
        task = flat[index]
        task.start = max(
            (flat[p].end + graph.edges[p, index]["delay"] for p in graph.predecessors(index)),
            default=0.0,
        )


def _inputs(op: Op, last: int) -> list[tuple[str, int, int, int]]:
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


def _grad_sync(rank: int, mine: list[_Task], times: list[StageTime], events: list[Event]) -> float:
    """Queue each stage's gradient reduction on the rank's comm stream; return its end."""
    last_grad: dict[int, _Task] = {}
    for task in mine:
        for op in task.ops:
            if op.kind in ("BW", "W"):
                last_grad[op.stage] = task
    free = 0.0
    for stage, task in sorted(last_grad.items(), key=lambda kv: kv[1].start):
        seconds = times[stage].grad_sync
        if seconds <= 0:
            continue
        start = max(task.start, free)
        events.append(Event(rank, "comm", f"grad sync s{stage}", start, seconds))
        free = start + seconds
    return free


def _memory(
    model: ModelSpec,
    job: TrainingJob,
    layout: Layout,
    tasks: list[list[_Task]],
    memory: list[StageMemory],
) -> tuple[list[list[tuple[float, int]]], list[int]]:
    """Activation bytes over time per rank, on top of the memory model's static buckets."""
    costs = block_costs(model, layout, shard_of(job, layout))
    saved, rebuild = [], []
    for stage in layout.stages:
        choices = [(costs[b.block], parse_recompute(b.recompute)) for b in stage.blocks]
        saved.append(sum(c.saved_bytes(ch) for c, ch in choices))
        rebuild.append(round(rebuild_peak(choices)))
    timelines, peaks = [], []
    for rank, mine in enumerate(tasks):
        b = memory[rank].buckets
        static = sum(b[k] for k in ("weights", "grads", "optimizer", "ema", "buffers"))
        changes: list[tuple[float, int, int]] = []  # (time, order: frees first, bytes)
        for task in mine:
            for op in task.ops:
                if op.kind == "F":
                    changes.append((task.start, 1, saved[op.stage]))
                if op.kind in ("B", "BW") and rebuild[op.stage]:
                    changes.append((task.start, 1, rebuild[op.stage]))
                    changes.append((task.end, 0, -rebuild[op.stage]))
                if op.kind in ("BW", "W"):
                    changes.append((task.end, 0, -saved[op.stage]))
        level, high = 0, 0
        timeline = [(0.0, static + b["context"])]
        for t, _, delta in sorted(changes):
            level += delta
            high = max(high, level)
            timeline.append((t, static + b["context"] + level))
        allocated = static + high
        peaks.append(round(allocated + b["context"] + round(job.fragmentation * allocated)))
        timelines.append(timeline)
    return timelines, peaks
