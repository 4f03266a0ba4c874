"""Analytic step time: the busiest rank's work plus the schedule's bubble and exposed comms.

Read from the per-stage table of ``planner.costs.timing`` (the simulator reads the same one):

    step = max over ranks r of
             r's work over its op order              compute, recompute, tp comm, exposed
                                                     all-to-all, pipeline sends, ZeRO waits
           + order_idle(schedule, f, b, w, fb)       the schedule's bubble as its source states
                                                     it (exact for the orders here), with one
                                                     chunk's times averaged over the stages r
                                                     does not hold
         + max over ranks of the exposed gradient reduction + optimizer step

This is exact for equal stages and for 1F1B's classic (m - 1) max t + sum t with unequal
ones, and an approximation otherwise (the simulator is the reference there;
``tests/test_agreement.py`` bounds the difference). Every term is a maximum of sums of stage
times, which is what lets the solver state it exactly. The gradient reduction overlaps the
rank's last gradient-producing op; ranks that finish their backward early (1F1B drains from
the last rank to the first) hide that much more of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from planner.costs.timing import OpParts, StageTime, op_parts, op_time, pair_parts, paired_time
from planner.layout import Layout
from planner.schedules import Op, layout_order, order_idle

PARTS = (
    "compute",
    "recompute",
    "tp_comm",
    "expert_all_to_all",
    "zero_comm",
    "pipeline_p2p",
    "bubble",
    "grad_sync",
    "optimizer",
)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step and how they split (``breakdown`` sums to ``total``)."""

    total: float
    breakdown: dict[str, float]
    critical_rank: int


def step_time(
    layout: Layout, times: list[StageTime], optimizer: list[float], *, num_microbatches: int
) -> StepTime:
    """The analytic step time of ``layout`` (see the module docstring)."""
    m = num_microbatches
    work = [_rank_work(layout, times, r, m) for r in range(layout.pp)]
    idle = [rank_idle(layout, times, r, m) for r in range(layout.pp)]
    critical = max(range(layout.pp), key=lambda r: work[r].total + idle[r])
    tail = [
        max(0.0, _exposed_sync(layout, times, r, m) - _slack(layout, times, r)) + optimizer[r]
        for r in range(layout.pp)
    ]
    end_rank = max(range(layout.pp), key=lambda r: tail[r])
    c = work[critical]
    breakdown = {
        "compute": c.compute,
        "recompute": c.recompute,
        "tp_comm": c.tp,
        "expert_all_to_all": c.a2a,
        "zero_comm": c.zero,
        "pipeline_p2p": c.p2p,
        "bubble": idle[critical],
        "grad_sync": tail[end_rank] - optimizer[end_rank],
        "optimizer": optimizer[end_rank],
    }
    total = c.total + idle[critical] + tail[end_rank]
    return StepTime(total=total, breakdown=breakdown, critical_rank=critical)


def rank_idle(layout: Layout, times: list[StageTime], rank: int, m: int) -> float:
    """How long ``rank`` waits on the others: its schedule's bubble with one chunk's times
    averaged over the stages it does not hold (for 1F1B with stage times t_s the step is then
    m t_r + sum of the other stages' t_s, the classic (m - 1) max t + sum t at the busiest)."""
    others = [t for t in times if t.stage not in layout.chunks_of_rank(rank)] or times
    return order_idle(
        layout.schedule,
        pp=layout.pp,
        num_microbatches=m,
        virtual_stages=layout.virtual_stages,
        f=_mean(op_time(t, "F") for t in others),
        b=_mean(op_time(t, "B") for t in others),
        w=_mean(op_time(t, "W") for t in others),
        fb=_mean(paired_time(t, t, "BW") for t in others),
    )


def _mean(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items)


def _rank_work(layout: Layout, times: list[StageTime], rank: int, m: int) -> OpParts:
    """The busy time of ``rank``'s compute stream over its op order, by part."""
    total = OpParts()
    order = _order(layout, rank, m)
    i = 0
    while i < len(order):
        op = order[i]
        if op.paired:
            nxt = order[i + 1]
            parts = pair_parts(times[op.stage], times[nxt.stage], nxt.kind)
            i += 2
        else:
            parts = op_parts(times[op.stage], op.kind)
            i += 1
        total = OpParts(*(getattr(total, k) + getattr(parts, k) for k in _FIELDS))
    return total


_FIELDS = ("compute", "recompute", "tp", "a2a", "p2p", "zero")


def _order(layout: Layout, rank: int, m: int) -> list[Op]:
    return layout_order(layout, rank, m)


def _exposed_sync(layout: Layout, times: list[StageTime], rank: int, m: int) -> float:
    """How far the rank's gradient reductions run past its last op. Each stage's reduction
    starts with the stage's last gradient-producing op and they queue on one stream; op start
    times are the rank's running busy time (its idle gaps, which would hide more, ignored)."""
    clock, starts = 0.0, {}
    order = _order(layout, rank, m)
    i = 0
    while i < len(order):
        op = order[i]
        group = order[i : i + 2] if op.paired else order[i : i + 1]
        for o in group:
            if o.kind in ("BW", "W"):
                starts[o.stage] = clock
        if op.paired:
            clock += paired_time(times[op.stage], times[group[1].stage], group[1].kind)
        else:
            clock += op_time(times[op.stage], op.kind)
        i += len(group)
    free = 0.0
    for stage, start in sorted(starts.items(), key=lambda kv: kv[1]):
        if times[stage].grad_sync > 0:
            free = max(free, start) + times[stage].grad_sync
    return max(0.0, free - clock)


def _slack(layout: Layout, times: list[StageTime], rank: int) -> float:
    """How much earlier than rank 0 ``rank`` ends its backward: 1F1B-like schedules drain the
    last micro-batch's backward from the last rank to the first, so rank r finishes before
    rank 0 by the backwards of ranks 0..r-1 (of their first chunk, the last one to run)."""
    if layout.schedule not in ("gpipe", "1f1b", "interleaved"):
        return 0.0
    return sum(op_time(times[j], "BW") for j in range(rank))
