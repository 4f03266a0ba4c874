"""The activation levels the solver states its memory over are the op order's own: every
level a rank passes through is implied by one of them, and each of them is passed through."""

from __future__ import annotations

import pytest

from planner.costs.activations import activation_levels
from planner.layout import chunks_of
from planner.schedules import SCHEDULES, memory_order, op_order, schedule_of

Level = tuple[tuple[int, ...], int | None]


def _walk(schedule: str, pp: int, m: int, v: int, rank: int, chunks: list[int]) -> set[Level]:
    """Every level of the op order, walked op by op as its activations come and go
    (``memory_order``): after each forward, and at the start of each backward with its chunk
    rebuilding."""
    count = dict.fromkeys(chunks, 0)
    seen: set[Level] = set()
    order = op_order(schedule, pp=pp, num_microbatches=m, rank=rank, virtual_stages=v)
    for op in memory_order(schedule, order):
        if op.kind == "F":
            count[op.stage] += 1
            seen.add((tuple(count[c] for c in chunks), None))
        if op.kind in ("B", "BW"):
            seen.add((tuple(count[c] for c in chunks), op.stage))
        if op.kind in ("BW", "W"):
            count[op.stage] -= 1
    return seen


def _implies(y: Level, x: Level) -> bool:
    return (x[1] is None or y[1] == x[1]) and all(a >= b for a, b in zip(y[0], x[0], strict=True))


SHAPES = [
    (name, pp, m, v)
    for name in SCHEDULES
    for pp in (1, 2, 4)
    for m in (8, 12)
    for v in ([2, 3] if schedule_of(name).virtual_stages is None else [0])
    if schedule_of(name).runs(pp, m, v or schedule_of(name).default_virtual_stages)
]


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), SHAPES)
def test_levels_are_the_op_orders_undominated_ones(schedule: str, pp: int, m: int, v: int) -> None:
    v = v or schedule_of(schedule).default_virtual_stages
    for rank in range(pp):
        chunks = list(dict.fromkeys(chunks_of(schedule, pp, v, rank)))
        walked = _walk(schedule, pp, m, v, rank, chunks)
        levels = activation_levels(schedule, pp, m, v, rank, chunks)
        assert set(levels) <= walked  # each is passed through
        assert all(any(_implies(y, x) for y in levels) for x in walked)  # and covers the rest
        assert not any(  # none implies another
            _implies(y, x) for x in levels for y in levels if x != y
        )
