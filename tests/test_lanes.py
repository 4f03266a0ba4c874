"""``planner.solve.lanes``: jobs come back in the order given, each in its lane's process
every time (so state a job leaves there is found by the next), with one process or several."""

from __future__ import annotations

import os

import pytest

import planner
from planner.errors import PlannerError
from planner.solve import lanes

_STATE: dict[str, int] = {}


def _bump(name: str) -> tuple[int, int]:
    """This process's count of ``name`` after one more, and the process id."""
    _STATE[name] = _STATE.get(name, 0) + 1
    return _STATE[name], os.getpid()


def test_results_in_order_and_state_stays_in_its_lane() -> None:
    for processes in (1, 2):
        tag = f"p{processes}"
        first = lanes.run_on([(lane, (_bump, (f"{tag}-{lane}",))) for lane in (0, 1)], processes)
        second = lanes.run_on([(lane, (_bump, (f"{tag}-{lane}",))) for lane in (0, 1)], processes)
        assert [count for count, _ in first] == [1, 1]
        assert [count for count, _ in second] == [2, 2]  # each lane found its own state
        assert [pid for _, pid in first] == [pid for _, pid in second]
        assert first[0][1] == os.getpid()  # lane 0 is this process
        if processes > 1 and lanes._can_fork():
            assert first[1][1] != os.getpid()


def test_keys_pick_lanes_stably() -> None:
    keys = [(tp, pp, 1, 1, 1) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8)]
    picked = [lanes.lane_of(k, lanes.LANES) for k in keys]
    assert picked == [lanes.lane_of(k, lanes.LANES) for k in keys]
    assert set(picked) == set(range(lanes.LANES))  # both lanes get sets of degrees
    assert {lanes.lane_of(k, 1) for k in keys} == {0}


def test_a_process_count_below_one_is_refused() -> None:
    model = planner.load_model("llama3-8b").model_copy(update={"num_layers": 2})
    cluster = planner.load_cluster("h100", gpus=8)
    job = planner.TrainingJob(seq_len=2048, global_batch=8)
    with pytest.raises(PlannerError, match=r"^processes=0: must be a positive process count$"):
        planner.plan(model, cluster, job, time_limit_s=1, processes=0)
