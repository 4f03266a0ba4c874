"""Analytic step time: the busiest rank's work plus the schedule's bubble and exposed comms.

Read from the per-stage table of ``planner.costs.timing`` (the simulator reads the same one):

    step = m x (busiest rank's work per micro-batch)      compute, recompute, tp comm,
                                                          exposed all-to-all, ZeRO comm
         + bubble_formula(schedule, f, b, w, fb)          as each schedule's source states it
         + 2 (pp - 1) x p2p                               one hop per stage boundary on the
                                                          way down (forward) and up (backward)
         + exposed gradient reduction + optimizer step    on the rank where they end last

The bubble uses the largest per-chunk forward / backward / weight-gradient times over the
ranks, so it is exact for equal stages and an approximation otherwise (the simulator is the
reference there, and ``tests/test_agreement.py`` reports the difference). The gradient
reduction overlaps the rank's last gradient-producing op; ranks that finish their backward
early (1F1B drains from the last rank to the first) hide that much more of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.costs.timing import StageTime, op_time, paired_time
from planner.layout import Layout
from planner.schedules import bubble_formula, op_order

PARTS = (
    "compute",
    "recompute",
    "tp_comm",
    "expert_all_to_all",
    "zero_comm",
    "bubble",
    "pipeline_p2p",
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
    critical = max(range(layout.pp), key=lambda r: work[r]["busy"])
    f, b, w, fb = _chunk_times(layout, times)
    bubble = bubble_formula(
        layout.schedule,
        pp=layout.pp,
        num_microbatches=m,
        virtual_stages=layout.virtual_stages,
        f=f,
        b=b,
        w=w,
        fb=fb,
    )
    hop = max((t.p2p for t in times), default=0.0)
    p2p = 2 * (layout.pp - 1) * hop
    pipeline = work[critical]["busy"] + bubble + p2p
    tail = [
        max(0.0, work[r]["sync"] - work[r]["last"] - _slack(layout, times, r, hop)) + optimizer[r]
        for r in range(layout.pp)
    ]
    end_rank = max(range(layout.pp), key=lambda r: tail[r])
    sync = tail[end_rank] - optimizer[end_rank]
    c = work[critical]
    breakdown = {
        "compute": c["compute"],
        "recompute": c["recompute"],
        "tp_comm": c["tp"],
        "expert_all_to_all": c["busy"] - c["compute"] - c["recompute"] - c["tp"] - c["zero"],
        "zero_comm": c["zero"],
        "bubble": bubble,
        "pipeline_p2p": p2p,
        "grad_sync": sync,
        "optimizer": optimizer[end_rank],
    }
    return StepTime(total=pipeline + tail[end_rank], breakdown=breakdown, critical_rank=critical)


def _rank_work(layout: Layout, times: list[StageTime], rank: int, m: int) -> dict[str, float]:
    """Busy seconds of ``rank``'s compute stream, split into parts, and its gradient sync."""
    out = dict.fromkeys(("busy", "compute", "recompute", "tp", "zero", "sync", "last"), 0.0)
    order = op_order(
        layout.schedule,
        pp=layout.pp,
        num_microbatches=m,
        rank=rank,
        virtual_stages=layout.virtual_stages,
    )
    i = 0
    while i < len(order):
        op = order[i]
        ops = order[i : i + 2] if op.paired else order[i : i + 1]
        if op.paired:
            out["busy"] += paired_time(times[op.stage], times[ops[1].stage], ops[1].kind)
        else:
            out["busy"] += op_time(times[op.stage], op.kind)
        for o in ops:
            t = times[o.stage]
            base = _base(t, o.kind)
            out["zero"] += op_time(t, o.kind) - base - _a2a(t, o.kind)
            out["recompute"] += t.recompute if o.kind in ("B", "BW") else 0.0
            out["tp"] += _tp(t, o.kind)
            out["compute"] += (
                base - (t.recompute if o.kind in ("B", "BW") else 0.0) - _tp(t, o.kind)
            )
            if o.kind in ("BW", "W"):
                out["last"] = op_time(t, o.kind)
        i += len(ops)
    stages = layout.chunks_of_rank(rank)
    out["sync"] = sum(times[s].grad_sync for s in dict.fromkeys(stages))
    return out


def _base(t: StageTime, kind: str) -> float:
    """An op's compute (with tp comm and recompute), without all-to-all or ZeRO waits."""
    return {"F": t.fwd, "B": t.bwd_input, "W": t.bwd_weight}.get(kind, t.bwd_input + t.bwd_weight)


def _a2a(t: StageTime, kind: str) -> float:
    return {"F": t.a2a_fwd, "W": 0.0}.get(kind, t.a2a_bwd)


def _tp(t: StageTime, kind: str) -> float:
    """The tp collectives inside an op (those re-run by recompute count as recompute)."""
    return {"F": t.tp_fwd, "W": 0.0}.get(kind, t.tp_bwd)


def _chunk_times(layout: Layout, times: list[StageTime]) -> tuple[float, float, float, float]:
    """Largest forward, input-gradient, weight-gradient and paired times of one chunk."""
    f = max(op_time(t, "F") for t in times)
    b = max(op_time(t, "B") for t in times)
    w = max(op_time(t, "W") for t in times)
    fb = max(paired_time(t, t, "BW") for t in times)
    return f, b, w, fb


def _slack(layout: Layout, times: list[StageTime], rank: int, hop: float) -> float:
    """How much earlier than the last rank to finish ``rank`` ends its backward: 1F1B-like
    schedules drain from the last rank to the first, one backward and one hop apart."""
    if layout.schedule not in ("gpipe", "1f1b", "interleaved"):
        return 0.0
    b = max(op_time(t, "BW") for t in times) / layout.virtual_stages
    return rank * (b + hop)
