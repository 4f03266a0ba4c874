"""The search's moves around its best layout (``planner.solve.neighbours``): which sets are
neighbours, that a climb ends at a layout none of its neighbours beats, and that the moves
reach layouts the search's line of bounds does not at the same budget."""

from __future__ import annotations

import math

import pytest

import planner
from planner.solve import neighbours
from planner.solve.budget import Budget
from planner.solve.first import quick_layout, without_offload
from planner.solve.lanesearch import LaneSettings, lane_close, lane_open, lane_quick, lane_rank
from planner.solve.search import _framework_for, plan
from planner.solve.space import enumerate_configs, for_target
from planner.solve.tables import Config

DOUBLED = {"tp", "cp", "pp", "ep", "etp", "micro_batch"}


def _job() -> tuple[
    planner.ModelSpec, planner.ClusterSpec, planner.TrainingJob, planner.SearchSpace, list[Config]
]:
    model = planner.load_model("mixtral-8x7b")
    cluster = planner.load_cluster("h100", gpus=64)
    job = planner.TrainingJob(seq_len=4096, global_batch=256)
    space = for_target(planner.SearchSpace(), job)
    job = cluster.job_on(_framework_for(job, space))
    space = without_offload(space)
    return model, cluster, job, space, list(enumerate_configs(model, cluster, job, space))


def _in_process(model, cluster, job, space, token: str) -> neighbours.Lanes:  # type: ignore[no-untyped-def]
    """The climb's lanes as one lane in this process."""
    lane_open(token, 0, model, cluster, job, space, [], LaneSettings(0.0, 0.3, 1, 0))
    return neighbours.Lanes(
        owner=lambda c: 0,
        rank=lambda by: [lane_rank(token, 0, cs) for cs in by.values()],
        quick=lambda batch: [lane_quick(token, 0, c) for c in batch.values()],
    )


def test_neighbours_are_one_or_two_moves_and_all_of_them() -> None:
    *_, configs = _job()
    climb = neighbours.Climb(configs, math.inf, neighbours.Lanes(lambda c: 0, None, None))  # type: ignore[arg-type]
    start = next(c for c in configs if c.pp == 2 and c.ep == 8 and c.tp == 1 and c.zero == 1)
    got = list(climb.neighbours(start))

    def moves(c: Config) -> list[str]:
        return [f for f in neighbours.MOVES if getattr(c, f) != getattr(start, f)]

    def one_move(c: Config, f: str) -> bool:
        a, b = getattr(c, f), getattr(start, f)
        return f not in DOUBLED or a in (2 * b, b / 2)

    for c in got:
        changed = moves(c)
        assert 1 <= len(changed) <= 2, changed
        assert all(one_move(c, f) for f in changed), (changed, c)
        assert c.tp * c.cp * c.pp * c.dp == start.tp * start.cp * start.pp * start.dp
    # Every set of choices one or two moves away appears exactly once, one-move sets first
    wanted = {
        tuple(getattr(c, f) for f in neighbours.MOVES)
        for c in configs
        if 1 <= len(moves(c)) <= 2 and all(one_move(c, f) for f in moves(c))
    }
    keys = [tuple(getattr(c, f) for f in neighbours.MOVES) for c in got]
    assert sorted(keys, key=repr) == sorted(wanted, key=repr)
    assert [len(moves(c)) for c in got] == sorted(len(moves(c)) for c in got)
    # Each keeps the incumbent's other options where its set has them
    for c in got:
        if c.ema != start.ema:
            same = [
                o for o in configs if all(getattr(o, f) == getattr(c, f) for f in neighbours.MOVES)
            ]
            assert all(o.ema != start.ema for o in same)


def test_a_climb_ends_where_no_neighbour_is_faster() -> None:
    """With no patience limit and no budget limit, the climb's last incumbent beats the quick
    layout of every neighbour whose bound could beat it (checked here by costing them all)."""
    model, cluster, job, space, configs = _job()
    token = "test-climb"
    lanes = _in_process(model, cluster, job, space, token)
    try:
        climb = neighbours.Climb(configs, math.inf, lanes)
        start = next(
            c
            for c in configs
            if c.pp == 4 and c.ep == 2 and c.tp == 2 and c.zero == 1 and c.schedule == "1f1b"
        )
        first = quick_layout(model, cluster, job, space, start, Budget(math.inf, math.inf), set())
        assert first is not None
        patience = neighbours.PATIENCE
        neighbours.PATIENCE = 10**9
        try:
            found = climb.climb((first[0], start), Budget(math.inf, math.inf))
        finally:
            neighbours.PATIENCE = patience
        best = min([(first[0], start), *((s, c) for s, c, _ in found)], key=lambda x: x[0])
        assert best[0] < first[0]  # this start is not a local optimum
        assert best[1] in climb.exhausted
        for other in climb.neighbours(best[1]):
            quick = quick_layout(
                model, cluster, job, space, other, Budget(math.inf, math.inf), set()
            )
            if quick is not None:
                assert quick[0] >= best[0] * (1 - 1e-9), (other, quick[0], best[0])
    finally:
        lane_close(token, 0)


@pytest.mark.slow
def test_the_moves_find_what_the_line_misses() -> None:
    """Llama 3 405B on 16,384 H100: the plan a 2 s search finds without the moves (the line's
    quick layouts and first solves) is not a local optimum; the climb from it reaches a
    faster layout, each one it returns priced as ``evaluate`` prices it."""
    model = planner.load_model("llama3-405b")
    cluster = planner.load_cluster("h100", gpus=16384)
    job = cluster.job_on(planner.TrainingJob(seq_len=8192, global_batch=2048))
    share = neighbours.MOVE_SHARE
    try:
        neighbours.MOVE_SHARE = 0.0
        without = plan(model, cluster, job, time_limit_s=2, clock_limit_s=120)
    finally:
        neighbours.MOVE_SHARE = share
    assert without.layout is not None
    space = without_offload(for_target(planner.SearchSpace(), job))
    configs = list(enumerate_configs(model, cluster, job, space))
    lay = without.layout
    fields = (*neighbours.MOVES, "dp")
    start = next(c for c in configs if all(getattr(c, f) == getattr(lay, f) for f in fields))
    token = "test-line-misses"
    lanes = _in_process(model, cluster, job, space, token)
    try:
        climb = neighbours.Climb(configs, math.inf, lanes)
        found = climb.climb((without.objective_s, start), Budget(math.inf, math.inf))
    finally:
        lane_close(token, 0)
    best = min(found, key=lambda x: x[0])
    assert best[0] < without.objective_s * 0.97
    for step, _, layout in found[:4]:
        assert step == pytest.approx(planner.evaluate(model, cluster, job, layout).step_time_s)
