"""``planner.sweep``: every case planned once, rows in SQLite as they finish, resumed after
a kill with nothing recomputed and nothing lost, failures recorded, the Ray backend, and the
same rows wherever a case ran. The plans of a sweep's worker processes are out of the
``plan_checked`` fixture's reach: ``checked`` runs each row's plan through the checker."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

import planner
from planner.check import check_plan
from planner.layout import Layout
from planner.plots import plot_sweep
from planner.solve import search
from planner.sweep import Store, cases, run, run_case, write

PLANNER = str(Path(sys.executable).parent / "planner")
SMALL = planner.load_model("llama3-8b").model_copy(update={"num_layers": 4, "name": "llama4l"})
JOB = planner.TrainingJob(
    seq_len=2048, global_batch=64
)  # small cases the search proves optimal on 8 GPUs


def rows_in(db: Path) -> dict[str, tuple[str, float]]:
    with sqlite3.connect(db) as con:
        return {k: (s, f) for k, s, f in con.execute("SELECT key, status, finished FROM cases")}


def rows_so_far(db: Path) -> dict[str, tuple[str, float]]:
    """``rows_in`` while a sweep may still be making the database: none before its file
    and its table exist (the file appears first; a poll between the two saw no table)."""
    if not db.exists():
        return {}
    try:
        return rows_in(db)
    except sqlite3.OperationalError:  # the table not made yet
        return {}


def checked(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows``, after every plan in them passed ``check_plan`` against its own inputs."""
    for row in rows:
        if row.get("plan") is None:
            continue
        plan = planner.Plan.model_validate(row["plan"])
        assert plan.model and plan.cluster and plan.job
        problems = check_plan(plan.model, plan.cluster, plan.job, plan, space=plan.space)
        assert problems == [], (row["gpus"], problems)
    return rows


def answer(row: dict[str, Any]) -> tuple[object, ...]:
    """What a case's row says about its plan (not how long it took)."""
    plan = row["plan"]
    return (row["status"], row["layout"], row["step_time_s"], plan["gap"], plan["lower_bound_s"])


@pytest.mark.slow
def test_every_case_is_planned_and_kept(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite"
    seen: list[tuple[int, int, int, int]] = []
    rows = planner.sweep(
        [SMALL],
        [8, 16, 32],
        jobs=[JOB],
        time_limit_s=10,  # the search's work budget; each case takes about a second
        db=db,
        workers=2,
        progress=lambda *a: seen.append(a),
    )
    checked(rows)
    assert [r["gpus"] for r in rows] == [8, 16, 32]
    for r in rows:  # a proven optimum, or a layout both models count faster (it says why)
        plan = planner.Plan.model_validate(r["plan"])
        assert r["status"] == "optimal" or (plan.simulation and plan.simulation.chosen), r
    direct = planner.plan(SMALL, planner.load_cluster("h100", gpus=16), JOB, time_limit_s=10)
    assert rows[1]["step_time_s"] == pytest.approx(direct.estimate.step_time_s)  # type: ignore[union-attr]
    # done, running, failed, total: the three cases and a refinement of each unproven one
    unproven = sum(r["status"] not in ("optimal", "infeasible") for r in rows)
    assert seen[-1] == (3 + unproven, 0, 0, 3 + unproven)
    assert len(rows_in(db)) == 3 + unproven
    # A second run reads the database: no case planned again.
    again = planner.sweep([SMALL], [8, 16, 32], jobs=[JOB], time_limit_s=10, db=db, workers=2)
    assert again == rows
    write(rows, tmp_path / "out.csv")
    write(rows, tmp_path / "out.json")
    with (tmp_path / "out.csv").open() as f:
        assert [int(r["gpus"]) for r in csv.DictReader(f)] == [8, 16, 32]
    assert json.loads((tmp_path / "out.json").read_text())[0]["plan"]["status"] == "optimal"
    picture = plot_sweep(rows, tmp_path / "sweep.svg").read_text()
    assert "llama4l on h100" in picture and "infeasible" not in picture


def test_a_failing_case_is_recorded_and_the_sweep_goes_on(tmp_path: Path) -> None:
    good = cases([SMALL], [8], jobs=[JOB], time_limit_s=5)[0]
    broken = dataclasses.replace(good, model={**good.model, "hidden_size": -1})
    rows = checked(run([broken, good], db=tmp_path / "f.db", workers=1))
    assert rows[0]["status"] == "failed" and "hidden_size" in rows[0]["error"]
    assert rows[1]["status"] == "optimal"
    assert [s for s, _ in rows_in(tmp_path / "f.db").values()].count("failed") == 1
    # Failed cases are kept as they are on a rerun, planned again only when asked to.
    assert run([broken, good], db=tmp_path / "f.db", workers=1) == rows
    again = run([broken, good], db=tmp_path / "f.db", retry_failed=True, workers=1)
    assert again[0]["status"] == "failed"


@pytest.mark.slow
def test_an_interrupted_sweep_resumes_without_recomputing(tmp_path: Path) -> None:
    db = tmp_path / "resume.sqlite"
    gpus = ["8", "16", "24", "32"]  # killed after two rows: two left to the second run
    cmd = [
        PLANNER,
        "sweep",
        "--model",
        "llama3-8b",
        "--gpus",
        *gpus,
        "--seq-len",
        "2048",
        "--global-batch",
        "96",
        "--time-limit",
        "2",  # the search's work budget: a case takes a second or two
        "--workers",
        "1",
        "--db",
        str(db),
        "--json",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.time() + 240
    while time.time() < deadline and len(rows_so_far(db)) < 2:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its workers, mid-way
    proc.wait()
    before = rows_in(db)
    assert 2 <= len(before) < len(gpus), before
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    after = rows_in(db)
    assert len(after) >= len(gpus)  # the cases, and a refinement of each unproven one
    for key, (status, finished) in before.items():  # kept as they were: not planned again
        assert after[key] == (status, finished)
    printed = json.loads(done.stdout)
    assert [r["gpus"] for r in printed] == [int(g) for g in gpus]


def test_bad_sweep_input_is_one_line(tmp_path: Path) -> None:
    for args, field in (
        (["--model", "nope", "--gpus", "8"], "nope"),
        (["--model", "llama3-8b", "--gpus", "0"], "gpus"),
        (["--model", "llama3-8b", "--gpus", "8", "--cluster", "tpu9"], "tpu9"),
    ):
        out = subprocess.run(
            [
                PLANNER,
                "sweep",
                *args,
                "--seq-len",
                "1024",
                "--global-batch",
                "8",
                "--db",
                str(tmp_path / "x.db"),
            ],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and field in out.stderr
    not_db = tmp_path / "not.db"
    not_db.write_text("hello")
    with pytest.raises(planner.PlannerError, match="not a sweep database"):
        planner.sweep([SMALL], [8], jobs=[JOB], db=not_db)


@pytest.mark.slow
def test_ray_backend_on_a_local_instance(tmp_path: Path) -> None:
    """The same cases on Ray and in the local pool give the same rows: status, layout, step
    and bound. (Ray starting its own processes on this machine's cores once slowed a case
    tenfold, and the wall clock then cut its search short: "feasible" on Ray, "optimal"
    here; ``test_a_case_gives_the_same_row_on_a_slow_worker`` holds that case.)"""
    pytest.importorskip("ray")
    local = planner.sweep([SMALL], [8, 16], jobs=[JOB], time_limit_s=5, db=tmp_path / "a.db")
    on_ray = planner.sweep(
        [SMALL],
        [8, 16],
        jobs=[JOB],
        time_limit_s=5,
        db=tmp_path / "b.db",
        workers=2,
        ray_address="local",
    )
    checked(local + on_ray)
    assert [answer(a) for a in local] == [answer(b) for b in on_ray]
    assert not any(r["plan"]["stopped_by_clock"] for r in local + on_ray)


def test_a_case_gives_the_same_row_on_a_slow_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """A case run on a worker so slow that its search takes three times its time limit is
    planned the same: the search's deterministic budget decides what it explores, and the
    sweep's wall-clock stop lies far past it (``sweep.CLOCK_FACTOR``). With the clock
    stopping at the time limit, this case came back "feasible" on such a worker."""
    case = cases([SMALL], [8], jobs=[JOB], time_limit_s=5)[0]
    run_case(case)  # warm: imports and the schedules' cached programs
    idle = run_case(case)
    assert idle["status"] == "optimal"
    # The search reads its clock running this many times fast: as on a slower machine.
    factor = 3 * case.time_limit_s / idle["plan"]["solve_time_s"]
    start = time.perf_counter()
    slow_clock = types.SimpleNamespace(
        perf_counter=lambda: start + factor * (time.perf_counter() - start)
    )
    monkeypatch.setattr(search, "time", slow_clock)
    loaded = run_case(case)
    assert loaded["plan"]["solve_time_s"] > case.time_limit_s  # it did run past the limit
    assert not loaded["plan"]["stopped_by_clock"]
    assert answer(loaded) == answer(idle)


def test_each_gpu_count_starts_from_the_plan_of_the_one_before() -> None:
    """Cases that differ only in GPU count form a chain in count order; each names the key
    of the case before it (so warm and cold rows never mix in one database) and is ready
    only once that case is finished, then gets its plan's layout as a hint."""
    from planner.sweep import _Feed

    warm = cases([SMALL], [32, 8, 16, 16], jobs=[JOB, JOB.model_copy(update={"seq_len": 512})])
    cold = cases([SMALL], [32, 8, 16, 16], jobs=[JOB], warm_start=False)
    chain = warm[:4]
    assert [c.gpus for c in chain] == [8, 16, 16, 32]
    assert chain[0].warm_from is None and warm[4].warm_from is None  # each job's own chain
    assert chain[1].warm_from == chain[0].key and chain[3].warm_from == chain[1].key
    assert chain[2] == chain[1]  # listed twice: one case
    assert all(c.warm_from is None for c in cold)
    assert cold[0].key == chain[0].key and cold[1].key != chain[1].key

    pending = list({c.key: c for c in chain}.items())
    finished: dict[str, dict[str, object]] = {}
    feed = _Feed(pending, finished)
    [(key, case, hints)] = feed.ready(8)
    assert case.gpus == 8 and hints == []
    assert feed.ready(8) == []  # 16 waits for 8
    layout = planner.Layout.uniform(SMALL, pp=2, dp=4).model_dump(mode="json")
    finished[key] = {"status": "optimal", "plan": {"layout": layout}}
    [(_, case, hints)] = feed.ready(8)
    assert case.gpus == 16 and hints == [layout]


def test_a_case_is_planned_again_from_a_faster_neighbours_plan(tmp_path: Path) -> None:
    """The refinement pass: each unproven case of a chain gets a second case seeded with the
    other counts' plans; where one, restated for it, is faster by the estimate, the case is
    planned again from it and its row replaces the first; where none is, the second case is
    recorded as kept, costs no search, and the first row stands. Proven cases (optimal,
    infeasible) get none."""
    from planner.sweep import _Feed, refinements

    chain = cases([SMALL], [8, 16, 32], jobs=[JOB], time_limit_s=2)
    slow = Layout.uniform(SMALL, pp=4, dp=4, recompute="full")  # what 16 GPUs "found"
    fast = Layout.uniform(SMALL, dp=8)  # the 8-GPU plan: dp 16 on 16 GPUs
    cluster = planner.load_cluster("h100", gpus=16)
    slow_step = planner.evaluate(SMALL, cluster, JOB, slow).step_time_s

    def row(layout: Layout | None, status: str, step: float | None = None) -> dict[str, Any]:
        plan = {"layout": layout.model_dump(mode="json")} if layout is not None else None
        return {"status": status, "plan": plan, "step_time_s": step, "gpus": 0}

    finished = {
        chain[0].key: row(fast, "optimal"),
        chain[1].key: row(slow, "feasible", slow_step),
        chain[2].key: row(None, "infeasible"),
    }
    [again] = refinements(chain, finished)  # the proven 8 and 32 get none
    assert again.refines == chain[1].key and again.neighbours == (chain[0].key,)
    assert again.key not in {c.key for c in chain}
    [(_, case, hints)] = _Feed([(again.key, again)], finished).ready(4)
    assert hints == [slow.model_dump(mode="json"), fast.model_dump(mode="json")]
    refined = run_case(case, hints)
    assert refined["refined"] and refined["step_time_s"] < slow_step
    checked([refined])
    # a neighbour no faster than the case's own plan: kept, no search
    kept = run_case(case, [fast.model_dump(mode="json"), slow.model_dump(mode="json")])
    assert kept["status"] == "kept" and kept["plan"] is None


@pytest.mark.slow
def test_a_sweep_returns_the_faster_of_a_case_and_its_refinement(tmp_path: Path) -> None:
    """With the first pass already in the database (one slow plan among them), ``run``
    plans only the refinement and returns, for that case, its faster row; the others as
    they were."""
    chain = cases([SMALL], [8, 16], jobs=[JOB], time_limit_s=2)
    slow = Layout.uniform(SMALL, pp=4, dp=4, recompute="full")
    fast = Layout.uniform(SMALL, dp=8)
    cluster = planner.load_cluster("h100", gpus=16)
    slow_step = planner.evaluate(SMALL, cluster, JOB, slow).step_time_s
    db = tmp_path / "r.sqlite"
    store = Store(db)
    first = [
        {"gpus": 8, "status": "optimal", "plan": {"layout": fast.model_dump(mode="json")}},
        {
            "gpus": 16,
            "status": "feasible",
            "step_time_s": slow_step,
            "plan": {"layout": slow.model_dump(mode="json")},
        },
    ]
    for case, row in zip(chain, first, strict=True):
        store.put(case.key, row)
    store.close()
    rows = run(chain, db=db, workers=1)
    assert rows[0] == first[0]
    assert rows[1]["refined"] and rows[1]["step_time_s"] < slow_step
    assert run(chain, db=db, workers=1, refine=False)[1] == first[1]


def test_a_ray_address_nothing_answers_at_is_one_line() -> None:
    from planner.sweep import check_reachable

    with pytest.raises(planner.PlannerError, match=r"^--ray='127.0.0.1:1': cannot reach"):
        check_reachable("127.0.0.1:1")  # nothing listens on port 1: refused at once
    with pytest.raises(planner.PlannerError, match=r"expected host:port, local or auto$"):
        check_reachable("headnode")
    check_reachable("auto")  # left to Ray
