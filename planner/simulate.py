"""``simulate``: a layout's training step executed on modelled hardware, with memory over time.

The step is ``planner.executor.execute``: each pipeline rank's program run kernel by kernel
and transfer by transfer on the compute and communication streams, SMs and links they share
(see that module for what is modelled and what is ignored). It does not read the closed-form
timing (``planner.timeline``, ``costs.overlap``) that ``evaluate`` and the search use, so the
two figures can disagree: ``planner.check`` compares them, within a stated tolerance.

Memory: each forward allocates its stage's saved activations for one micro-batch and the
backward that consumes them frees them (the weight-gradient op, when the schedule splits it
off); the rest of each rank's memory is the memory model's static buckets. The simulated peak
is those buckets plus the highest activation level reached; while a backward runs, the block
it recomputes holds its rebuilt tensors too, less what the chunk's later blocks have freed by
then (``costs.activations.rebuild_peak``).

The tp * dp ranks of a pipeline position run the same ops at the same times, so one
representative rank per position is simulated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.costs.activations import rebuild_peak
from planner.costs.memory import (
    DEFAULT_RUNTIME,
    StageMemory,
    block_costs,
    first_backward_walk,
    shard_of,
    stage_memory,
)
from planner.executor import STREAMS, execute, label_text
from planner.layout import Layout, parse_recompute
from planner.schedules import schedule_of
from planner.specs import ClusterSpec, ModelSpec, TrainingJob
from planner.timeline import Task

# How far the simulated step may be from the closed-form estimate before the two are said to
# disagree (``planner.check``; ``Plan.simulation``; where a plan's do, ``plan`` simulates its
# other final candidates and takes the fastest at the slower of each one's two figures). The
# two price overlap differently (the estimate by a rule per schedule, the simulator by
# streams, SMs and links shared): on 40 random real-size layouts the middle 80% of their
# differences lie within -2.8% and +4.7%, on the catalog's recipes -10.7% to +2.0%
# (benchmarks/sim_agreement.py prints every figure). 3%: the agreement a plan is held to.
SIM_TOLERANCE = 0.03


@dataclass(frozen=True)
class Event:
    """One span on one rank's track (seconds). Its names are read as text on demand: a step
    holds hundreds of thousands of spans and most are never printed."""

    rank: int
    # "ops" (one span per task of the schedule) or a stream: "compute", "ep", "p2p", "dp" or
    # "zero" (``executor.STREAMS``)
    track: str
    label: Any  # what ran: text, or the executor's label (``executor.label_text``)
    start: float
    duration: float
    waited: Any = None  # the label of what it was last to wait for before it could start

    @property
    def name(self) -> str:
        return label_text(self.label)

    @property
    def waited_for(self) -> str:
        """What it was last to wait for ("" where nothing held it)."""
        return "" if self.waited is None else label_text(self.waited)


@dataclass
class Simulation:
    """What one simulated step did, per pipeline rank."""

    step_time_s: float
    busy_s: list[float]  # compute-stream busy time per pipeline rank
    idle_s: list[float]  # step time minus busy time
    peak_bytes: list[int]  # memory peak per pipeline rank
    memory_timeline: list[list[tuple[float, int]]]  # (seconds, bytes) after each change
    events: list[Event] = field(default_factory=list)
    # Seconds each rank's links were in full use, by "<ib|nvl> <out|in>" (``executor``)
    link_busy_s: dict[str, list[float]] = field(default_factory=dict)

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write a Chrome trace (JSON) that Perfetto and chrome://tracing open: one process
        per pipeline rank, with compute and communication tracks and a memory counter."""
        out: list[dict[str, object]] = []
        for rank in range(len(self.busy_s)):
            out.append(_meta(rank, "process_name", f"pipeline rank {rank}"))
            out.append(_meta(rank, "process_sort_index", rank, key="sort_index"))
            for tid, track in enumerate(TRACKS):
                out.append({**_meta(rank, "thread_name", track), "tid": tid})
        tids = {track: tid for tid, track in enumerate(TRACKS)}
        for e in self.events:
            span: dict[str, object] = {
                "ph": "X",
                "pid": e.rank,
                "tid": tids.get(e.track, 0),
                "name": e.name,
                "ts": e.start * 1e6,
                "dur": e.duration * 1e6,
            }
            if e.waited_for:
                span["args"] = {"waited for": e.waited_for}
            out.append(span)
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


TRACKS = ("ops", *STREAMS)  # each rank's tracks in a trace, top to bottom


def _meta(rank: int, name: str, value: object, *, key: str = "name") -> dict[str, object]:
    return {"ph": "M", "pid": rank, "tid": 0, "name": name, "args": {key: value}}


def simulated_step(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, layout: Layout
) -> float:
    """``simulate(...).step_time_s`` alone: the step executed, without the events, the
    per-rank timelines and the memory a full ``Simulation`` gathers (what a judge of the
    step needs and no more)."""
    return execute(model, cluster, cluster.job_on(job), layout).step_s


def simulate(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, layout: Layout
) -> Simulation:
    """Run one training step of ``layout`` event by event (see the module docstring)."""
    job = cluster.job_on(job)  # the machine's measured memory figures (ClusterSpec.job_on)
    run = execute(model, cluster, job, layout)
    memory = stage_memory(model, job, layout, num_microbatches=run.num_microbatches)
    events = [
        Event(
            item.rank,
            item.stream,
            item.label,
            item.start,
            item.end - item.start,
            item.released_by.label if item.released_by is not None else None,
        )
        for item in run.items
        if item.stream is not None and item.work > 0
    ]
    prog = run.prog
    tasks = [
        [
            Task(
                rank,
                prog.key[g],
                prog.ops[g],
                run.task_start[g].end,
                run.task_end[g].end - run.task_start[g].end,
            )
            for g in mine
        ]
        for rank, mine in enumerate(prog.by_rank)
    ]
    events += [Event(t.rank, "ops", t.name, t.start, t.duration) for mine in tasks for t in mine]
    step = run.step_s
    timelines, peaks = _memory(model, job, layout, tasks, memory)
    return Simulation(
        step_time_s=step,
        busy_s=run.busy_s,
        idle_s=[step - b for b in run.busy_s],
        peak_bytes=peaks,
        memory_timeline=timelines,
        events=events,
        link_busy_s=run.link_busy_s,
    )


def _memory(
    model: ModelSpec,
    job: TrainingJob,
    layout: Layout,
    tasks: list[list[Task]],
    memory: list[StageMemory],
) -> tuple[list[list[tuple[float, int]]], list[int]]:
    """Activation bytes over time per rank, on top of the memory model's static buckets."""
    costs = block_costs(model, layout, shard_of(job, layout))
    last = len(layout.stages) - 1
    saved, rebuild = [], []
    for stage in layout.stages:
        choices = [(costs[b.block], parse_recompute(b.recompute)) for b in stage.blocks]
        saved.append(sum(c.saved_bytes(ch) for c, ch in choices))
        rebuild.append(round(rebuild_peak(choices)))
    # Under the expert all-to-all overlap a pair's forward fills as its backward empties,
    # layer by layer (``schedules.memory_order``): its activations count from the pair's end.
    lockstep = schedule_of(layout.schedule).ep_overlap
    timelines, peaks = [], []
    for rank, mine in enumerate(tasks):
        b = memory[rank].buckets
        # gradients the runtime frees each step come back at the end of the first backward
        made = memory[rank].step_grad_bytes
        static = sum(b[k] for k in ("weights", "optimizer", "ema", "buffers"))
        static += 0 if made else b["grads"]
        # A rank's tasks run one after another in program order: a change is placed by its
        # task, its side of the task (start 0, end 1) and kind (frees 0 before allocations
        # 1), not by its time, whose rounding can put a task's start an ulp before the end
        # of the task before it. (order, time, bytes)
        changes: list[tuple[tuple[int, int, int], float, int]] = []
        backwards = (i for i, t in enumerate(mine) if any(o.kind in ("B", "BW") for o in t.ops))
        first = next(backwards, -1) if made else -1  # the step's first backward
        if first >= 0:
            changes.append(((first, 1, 1), mine[first].end, made))
        for i, task in enumerate(mine):
            for op in task.ops:
                if op.kind == "F":
                    if lockstep and len(task.ops) == 2:
                        changes.append(((i, 1, 1), task.end, saved[op.stage]))
                    else:
                        changes.append(((i, 0, 1), task.start, saved[op.stage]))
                # A backward holds the tensors it rebuilds; the step's first one, where it
                # frees its saved tensors as it goes, also the gradients the runtime freed,
                # made block by block (costs.memory.first_backward_walk).
                held = rebuild[op.stage] if op.kind in ("B", "BW") else 0
                if i == first and op.kind == "BW":
                    held = round(
                        first_backward_walk(op.stage, layout, costs, job, DEFAULT_RUNTIME, last)[0]
                    )
                if held:
                    changes.append(((i, 0, 1), task.start, held))
                    changes.append(((i, 1, 0), task.end, -held))
                if op.kind in ("BW", "W"):
                    changes.append(((i, 1, 0), task.end, -saved[op.stage]))
        level, high = 0, 0
        timeline = [(0.0, static + b["context"])]
        for _, t, delta in sorted(changes):
            level += delta
            high = max(high, level)
            timeline.append((t, static + b["context"] + level))
        allocated = static + high
        peaks.append(round(allocated + b["context"] + round(job.fragmentation * allocated)))
        timelines.append(timeline)
    return timelines, peaks
