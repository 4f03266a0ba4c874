"""Per-rank op orders of each pipeline schedule, run by a small dependency-driven executor.

The executor below starts each rank's next op as soon as the rank is free and the op's inputs
exist: F(mb, s) needs F(mb, s-1); B or BW(mb, s) needs F(mb, s) and B/BW(mb, s+1) (the last
stage only its forward); W(mb, s) needs B(mb, s). No communication time. Idle time per rank is
the step's makespan minus the rank's busy time, which the sources' bubble formulas state.

Where the formulas are exact here (checked below for several f/b/w): GPipe and 1F1B for any m;
interleaved 1F1B for every m Megatron-LM accepts; ZB-H1 for m >= p; DualPipe / DualPipeV when
f == b (the formula's accounting treats a forward and an input-gradient backward as the same
slot), as the idle time of the most idle rank (ranks run different numbers of F&B pairs, so with
an overlap gain fb < f+b+w they differ). Elsewhere a bound is tested instead.
"""

from __future__ import annotations

from collections import Counter
from typing import cast

import pytest

import planner
from planner.errors import PlannerError
from planner.layout import Schedule
from planner.schedules import Op, bubble_formula, in_flight, op_order, order_idle, stage_rank

LLAMA = planner.load_model("llama3-70b")  # 80 layers: enough stages for every grid point

# (schedule, pp, num_microbatches, virtual_stages): small, edge and typical settings.
GRID: list[tuple[str, int, int, int]] = [
    *[("gpipe", p, m, 1) for p, m in [(2, 1), (4, 3), (4, 8), (8, 12)]],
    *[("1f1b", p, m, 1) for p, m in [(2, 1), (4, 3), (4, 4), (4, 9), (8, 20)]],
    *[("zb-h1", p, m, 1) for p, m in [(2, 1), (4, 3), (4, 4), (4, 9), (8, 20)]],
    *[("interleaved", p, m, v) for p, m, v in [(2, 2, 2), (4, 4, 2), (4, 8, 2), (4, 12, 3)]],
    *[("interleaved", p, m, v) for p, m, v in [(8, 16, 2), (2, 6, 4), (8, 24, 3)]],
    *[("dualpipe", p, m, 1) for p, m in [(2, 4), (4, 8), (4, 10), (6, 18), (8, 20)]],
    *[("dualpipev", p, m, 2) for p, m in [(2, 4), (4, 8), (4, 9), (6, 13), (8, 20)]],
]
IDS = [f"{s}-p{p}-m{m}-v{v}" for s, p, m, v in GRID]
TIMES = [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 0.5), (1.0, 3.0, 0.5)]


def orders(schedule: str, p: int, m: int, v: int) -> list[list[Op]]:
    return [
        op_order(schedule, pp=p, num_microbatches=m, rank=r, virtual_stages=v) for r in range(p)
    ]


def layout(schedule: str, p: int, v: int) -> planner.Layout:
    kind = cast(Schedule, schedule)
    return planner.Layout.uniform(LLAMA, pp=p, schedule=kind, virtual_stages=v, dp=1, tp=1)


def execute(
    schedule: str, p: int, m: int, v: int, f: float, b: float, w: float, fb: float | None = None
) -> list[float]:
    """Run every rank's order; return each rank's idle time. Fails on a deadlock."""
    ranks = orders(schedule, p, m, v)
    pair_time = f + b + w if fb is None else fb
    duration = {"F": f, "B": b, "W": w, "BW": b + w}
    last_stage = p * v - 1
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "B" | "W", mb, stage) -> end time

    def ready(op: Op) -> float | None:
        """When the op's inputs exist (None: not yet). Micro-batch ids are unique over both
        DualPipe directions, so (mb, stage) names one pass."""
        mb, s = op.microbatch, op.stage
        if op.kind == "F":
            return 0.0 if s == 0 else done.get(("F", mb, s - 1))
        if op.kind == "W":
            return done.get(("B", mb, s))
        needs = [("F", mb, s)] + ([] if s == last_stage else [("B", mb, s + 1)])
        times = [done.get(k) for k in needs]
        return None if None in times else max(t for t in times if t is not None)

    clock, busy, pos = [0.0] * p, [0.0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(ranks):
            while pos[r] < len(order):
                group = order[pos[r] : pos[r] + (2 if order[pos[r]].paired else 1)]
                starts = [ready(op) for op in group]
                if None in starts:
                    break
                start = max([clock[r]] + [t for t in starts if t is not None])
                took = pair_time if len(group) == 2 else duration[group[0].kind]
                for op in group:  # a BW completes both halves
                    for k in ("B", "W") if op.kind == "BW" else (op.kind,):
                        done[(k, op.microbatch, op.stage)] = start + took
                clock[r], busy[r], pos[r] = start + took, busy[r] + took, pos[r] + len(group)
                progress = True
    assert pos == [len(o) for o in ranks], f"deadlock at positions {pos}"
    makespan = max(clock)
    return [makespan - x for x in busy]


def peak_in_flight(order: list[Op]) -> dict[int, float]:
    """Micro-batches per stage with F done and BW/W not, at the first moment their total peaks."""
    live: Counter[int] = Counter()
    best, snapshot = -1, {}
    for op in order:
        live[op.stage] += {"F": 1, "BW": -1, "W": -1, "B": 0}[op.kind]
        if sum(live.values()) > best:
            best, snapshot = sum(live.values()), {s: float(c) for s, c in live.items()}
    return snapshot


# --- what each rank runs -------------------------------------------------------------------


@pytest.mark.parametrize(("schedule", "p", "m", "v"), GRID, ids=IDS)
def test_each_rank_runs_exactly_its_ops(schedule: str, p: int, m: int, v: int) -> None:
    lay = layout(schedule, p, v)
    for r, order in enumerate(orders(schedule, p, m, v)):
        # Which (micro-batch, stage, direction) pass through this rank, from the Layout alone.
        passes = []
        for k, stage in enumerate(lay.chunks_of_rank(r)):
            if schedule == "dualpipe":  # stage r serves direction 0, stage pp-1-r direction 1
                first = (m + 1) // 2
                mbs = range(first) if k == 0 else range(first, m)
            else:
                mbs = range(m)
            passes += [(mb, stage, k if schedule == "dualpipe" else 0) for mb in mbs]
        seen = Counter((op.kind, op.microbatch, op.stage, op.direction) for op in order)
        for mb, stage, d in passes:
            assert seen.pop(("F", mb, stage, d)) == 1
            full = seen.pop(("BW", mb, stage, d), 0)
            split = (seen.pop(("B", mb, stage, d), 0), seen.pop(("W", mb, stage, d), 0))
            assert (full, split) in [(1, (0, 0)), (0, (1, 1))], (mb, stage, d)
            if schedule in ("gpipe", "1f1b", "interleaved"):
                assert full == 1
            if schedule == "zb-h1":
                assert split == (1, 1)
        assert not seen, f"rank {r} runs ops it does not hold: {seen}"
        assert all(stage_rank(schedule, p, op.stage, op.direction) == r for op in order)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), GRID, ids=IDS)
def test_order_respects_local_dependencies(schedule: str, p: int, m: int, v: int) -> None:
    """On one rank: a stage's backward after its forward, W after its B; a paired F is followed
    by a backward (DualPipe's F&B), and only DualPipe schedules pair."""
    for order in orders(schedule, p, m, v):
        index = {(op.kind, op.microbatch, op.stage): i for i, op in enumerate(order)}
        for (kind, mb, s), i in index.items():
            if kind in ("B", "BW"):
                assert index[("F", mb, s)] < i
            if kind == "W":
                assert index[("B", mb, s)] < i
        for i, op in enumerate(order):
            if op.paired:
                assert op.kind == "F" and order[i + 1].kind in ("B", "BW")
                assert schedule in ("dualpipe", "dualpipev")
        if schedule in ("dualpipe", "dualpipev"):
            assert any(op.paired for op in order)


def test_stage_rank_agrees_with_layout() -> None:
    for schedule, p, _, v in GRID:
        lay = layout(schedule, p, v)
        for r in range(p):
            for k, stage in enumerate(lay.chunks_of_rank(r)):
                direction = k if schedule == "dualpipe" else 0
                assert stage_rank(schedule, p, stage, direction) == r


def test_one_f_one_b_warm_up_as_megatron() -> None:
    """min(p - r - 1, m) warm-up forwards, then the steady state's forward, then a backward."""
    for p, m in [(4, 9), (8, 3)]:
        for r, order in enumerate(orders("1f1b", p, m, 1)):
            before = next(i for i, op in enumerate(order) if op.kind == "BW")
            assert before == min(p - r - 1, m) + (1 if p - r - 1 < m else 0)


def test_interleaved_walks_chunks_as_megatron() -> None:
    """p=4, v=2, m=8, rank 0: 4*2-2 + 4 = 10 warm-up forwards, chunk 0 (stage 0) for micro-batches
    0-3, chunk 1 (stage 4) for 0-3, chunk 0 for 4-5; then F(6, stage 0) and the first backward
    on the last chunk, micro-batch 0."""
    order = orders("interleaved", 4, 8, 2)[0]
    head = [(op.kind, op.microbatch, op.stage) for op in order[:12]]
    forwards = [(mb, 0) for mb in range(4)] + [(mb, 4) for mb in range(4)] + [(4, 0), (5, 0)]
    assert head == [("F", mb, s) for mb, s in forwards] + [("F", 6, 0), ("BW", 0, 4)]
    # m == p: since Megatron-Core's commit 4295be1a6c (2024-11-01) the warm-up is the same
    # (p-r-1)*2 + (v-1)*p forwards, capped at m*v: ranks 0 and 1 run all 8 forwards first,
    # rank 3 only 4 and then one forward and one backward in turn (no special case for m == p).
    kinds = [[op.kind for op in order] for order in orders("interleaved", 4, 4, 2)]
    assert kinds[0] == kinds[1] == ["F"] * 8 + ["BW"] * 8
    assert kinds[3] == ["F"] * 4 + ["F", "BW"] * 4 + ["BW"] * 4


def test_dualpipe_rank_0_matches_the_readme_figure() -> None:
    """deepseek-ai/DualPipe README figure (8 ranks, 20 micro-batches), device 0: forwards 0-6,
    then F, B, W of the reverse direction's first three, its fourth F, then 7 overlapped with
    the reverse fourth's backward; it ends with B and W of 6, 7, 8 and 9 in turn."""
    order = orders("dualpipe", 8, 20, 1)[0]
    short = [(op.kind, op.microbatch, op.paired) for op in order]
    reverse = [(k, 10 + i, False) for i in range(3) for k in ("F", "B", "W")]
    assert short[:17] == [("F", i, False) for i in range(7)] + reverse + [("F", 13, False)]
    assert short[17:19] == [("F", 7, True), ("BW", 13, False)]
    assert short[-8:] == [(k, i, False) for i in range(6, 10) for k in ("B", "W")]
    assert {op.direction for op in order[7:16]} == {1}


def test_dualpipe_middle_ranks_do_not_overlap_their_first_pair() -> None:
    """deepseek-ai/DualPipe step 4: the middle ranks (pp/2 - 1 and pp/2) run their first F and
    B unoverlapped "to further reduce bubble size"; rank 3 of 8 after its nine forwards (five
    of direction 0, four of direction 1): F4 alone, the reverse direction's first backward, and
    only then an overlapped pair."""
    for r in (3, 4):
        order = orders("dualpipe", 8, 20, 1)[r]
        assert [op.kind for op in order[:11]] == ["F"] * 9 + ["BW", "F"]
        assert [op.paired for op in order[:11]] == [False] * 10 + [True]
    # Rank 2: eight forwards, then B, W, F of step 3, then its first pair, overlapped.
    assert [op.kind for op in orders("dualpipe", 8, 20, 1)[2][8:12]] == ["B", "W", "F", "F"]
    assert orders("dualpipe", 8, 20, 1)[2][11].paired


def test_dualpipev_rank_1_matches_the_readme_figure() -> None:
    """deepseek-ai/DualPipe README DualPipeV figure (4 ranks, 10 micro-batches), device 1: the
    last ten cells are backwards 8 6 9 7, W 9, B 8, W 7, B 9, W 8, W 9 (chunk 1's 8 and 9 are
    the ascending leg's)."""
    order = orders("dualpipev", 4, 10, 2)[1]
    tail = [(op.kind, op.microbatch, op.stage) for op in order[-10:]]
    assert tail == [
        ("BW", 8, 6),
        ("BW", 6, 1),
        ("B", 9, 6),
        ("B", 7, 1),
        ("W", 9, 6),
        ("B", 8, 1),
        ("W", 7, 1),
        ("B", 9, 1),
        ("W", 8, 1),
        ("W", 9, 1),
    ]


# --- bubbles --------------------------------------------------------------------------------


def formula(schedule: str, p: int, m: int, v: int, times: tuple[float, ...]) -> float:
    f, b, w, *fb = times
    return bubble_formula(
        schedule,
        pp=p,
        num_microbatches=m,
        virtual_stages=v,
        f=f,
        b=b,
        w=w,
        fb=fb[0] if fb else None,
    )


def test_bubble_formula_values() -> None:
    """The sources' figures with unit times (B = b + w = 2 for the sources' full backward)."""
    one = {"f": 1.0, "b": 1.0, "w": 1.0}
    assert bubble_formula("1f1b", pp=8, num_microbatches=32, virtual_stages=1, **one) == 21
    assert bubble_formula("gpipe", pp=8, num_microbatches=32, virtual_stages=1, **one) == 21
    # Interleaved: a rank's F and B are v chunks' worth; (p-1)(F+B)/v.
    assert bubble_formula("interleaved", pp=8, num_microbatches=32, virtual_stages=2, **one) == 21
    assert bubble_formula("zb-h1", pp=8, num_microbatches=32, virtual_stages=1, **one) == 7
    # DualPipe: (PP/2-1)(F&B+B-3W) = 3 * (3 + 2 - 3); DualPipeV on 4 ranks has PP = 8 stages.
    assert bubble_formula("dualpipe", pp=8, num_microbatches=32, virtual_stages=1, **one) == 6
    assert bubble_formula("dualpipev", pp=4, num_microbatches=8, virtual_stages=2, **one) == 6
    kw = {"pp": 8, "num_microbatches": 32, "virtual_stages": 1, "fb": 2.0}
    assert bubble_formula("dualpipe", **kw, **one) == 3  # type: ignore[arg-type]


@pytest.mark.parametrize(("schedule", "p", "m", "v"), GRID, ids=IDS)
def test_idle_time_matches_the_sources(schedule: str, p: int, m: int, v: int) -> None:
    for times in TIMES:
        idle = execute(schedule, p, m, v, *times)
        stated = formula(schedule, p, m, v, times)
        f, b, _ = times
        if schedule in ("gpipe", "1f1b", "interleaved") or (schedule == "zb-h1" and m >= p):
            assert idle == pytest.approx([stated] * p)
        elif schedule == "zb-h1":
            # Fewer micro-batches than ranks: too few W passes to fill the cool-down; the
            # bubble lies between the stated one and 1F1B's.
            one_f_one_b = formula("1f1b", p, m, v, times)
            assert all(stated - 1e-9 <= x <= one_f_one_b + 1e-9 for x in idle)
        elif f == b:
            assert idle == pytest.approx([stated] * p)
        else:
            # The formula counts a forward and an input-gradient backward as equal slots; off
            # by at most one (f - b) per warm-up position.
            positions = (p if schedule == "dualpipe" else 2 * p) // 2 - 1
            assert abs(max(idle) - stated) <= positions * abs(f - b) + 1e-9


@pytest.mark.parametrize(("schedule", "p", "m"), [("dualpipe", 8, 20), ("dualpipev", 4, 9)])
@pytest.mark.parametrize("fb", [2.0, 2.5, 3.0])
def test_dualpipe_bubble_with_overlap_gain(schedule: str, p: int, m: int, fb: float) -> None:
    """An overlapped F&B pair shorter than f+b+w: the stated bubble is the most idle rank's."""
    v = 2 if schedule == "dualpipev" else 1
    idle = execute(schedule, p, m, v, 1.0, 1.0, 1.0, fb)
    stated = formula(schedule, p, m, v, (1.0, 1.0, 1.0, fb))
    assert max(idle) == pytest.approx(stated)
    assert all(x <= stated + 1e-9 for x in idle)


def test_executor_catches_a_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor is not vacuous: a last rank that runs its backward before its forward
    never finishes."""
    real = op_order

    def broken(schedule: str, **kw: int) -> list[Op]:
        order = real(schedule, **kw)
        return order[::-1] if kw["rank"] == kw["pp"] - 1 else order

    monkeypatch.setattr(f"{__name__}.op_order", broken)
    with pytest.raises(AssertionError, match="deadlock"):
        execute("1f1b", 4, 8, 1, 1.0, 1.0, 1.0)


# --- memory ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("schedule", "p", "m", "v"), GRID, ids=IDS)
def test_in_flight_is_the_orders_peak(schedule: str, p: int, m: int, v: int) -> None:
    lay = layout(schedule, p, v)
    for r, order in enumerate(orders(schedule, p, m, v)):
        assert peak_in_flight(order) == in_flight(lay, r, m)


def test_zb_h1_holds_p_on_every_rank() -> None:
    """Qi et al. section 2.1: W delayed so every stage has the same number in flight (1F1B's
    first-rank peak p), not 1F1B's p - r."""
    lay = layout("zb-h1", 8, 1)
    assert [sum(in_flight(lay, r, 32).values()) for r in range(8)] == [8.0] * 8


def test_dualpipe_activation_per_device_pp_plus_one() -> None:
    """deepseek-ai/DualPipe README: PP + 1 stages of activations per device, PP the number of
    stages: pp for DualPipe, 2 * pp for DualPipeV (its chunks are half a rank's layers)."""
    for schedule, v, stages in [("dualpipe", 1, 8), ("dualpipev", 2, 16)]:
        lay = layout(schedule, 8, v)
        for r, order in enumerate(orders(schedule, 8, 32, v)):
            assert sum(peak_in_flight(order).values()) == stages + 1
            assert sum(in_flight(lay, r, 32).values()) == stages + 1


# --- unsupported micro-batch counts ---------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v"),
    [
        ("interleaved", 4, 6, 2),  # Megatron-LM: a multiple of pp
        ("dualpipe", 4, 7, 1),  # deepseek-ai/DualPipe: even, >= 2 * pp
        ("dualpipe", 4, 6, 1),
        ("dualpipev", 4, 7, 2),  # >= 2 * pp
        ("1f1b", 4, 0, 1),
    ],
)
def test_unsupported_micro_batch_counts(schedule: str, p: int, m: int, v: int) -> None:
    with pytest.raises(PlannerError, match=rf"^Layout\.num_microbatches={m}: "):
        op_order(schedule, pp=p, num_microbatches=m, rank=0, virtual_stages=v)
    with pytest.raises(PlannerError, match=rf"^Layout\.num_microbatches={m}: "):
        bubble_formula(schedule, pp=p, num_microbatches=m, virtual_stages=v, f=1, b=1, w=1)


def test_wrong_virtual_stages_or_schedule() -> None:
    with pytest.raises(PlannerError, match=r"^Layout\.virtual_stages=1: interleaved"):
        op_order("interleaved", pp=4, num_microbatches=8, rank=0)
    with pytest.raises(PlannerError, match=r"^Layout\.virtual_stages=1: dualpipev"):
        op_order("dualpipev", pp=4, num_microbatches=8, rank=0)
    with pytest.raises(PlannerError, match=r"^Layout\.schedule='pipedream'"):
        op_order("pipedream", pp=4, num_microbatches=8, rank=0)


@pytest.mark.parametrize(
    ("schedule", "p", "v"),
    [("dualpipe", 4, 1), ("dualpipe", 8, 1), ("dualpipev", 4, 2), ("dualpipev", 8, 2)],
)
@pytest.mark.parametrize(
    ("f", "b", "w"), [(2, 3, 1), (1, 1.5, 1), (3, 4, 2), (1.5, 1, 0.5), (3, 3.5, 1), (1, 2, 0.5)]
)
@pytest.mark.parametrize("gain", [0.0, 0.3, 0.8])
def test_order_idle_is_exact_for_dualpipe(
    schedule: str, p: int, v: int, f: float, b: float, w: float, gain: float
) -> None:
    """The sources state DualPipe's bubble for f = b; ``order_idle`` adds the order's exact
    dependence on f - b, which the executor confirms for any overlap gain."""
    fb = f + b + w - gain * min(f, b)
    m = 4 * p
    idle = max(execute(schedule, p, m, v, f, b, w, fb))
    expected = order_idle(
        schedule, pp=p, num_microbatches=m, virtual_stages=v, f=f, b=b, w=w, fb=fb
    )
    assert idle == pytest.approx(expected)
    source = bubble_formula(
        schedule, pp=p, num_microbatches=m, virtual_stages=v, f=f, b=b, w=w, fb=fb
    )
    assert (idle == pytest.approx(source)) == (f == b)
