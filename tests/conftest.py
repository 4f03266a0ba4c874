"""What every test shares: each plan a test makes goes through the independent checker, and
the slow tests run only when asked for, the longest files first.

``plan_checked`` (autouse) replaces ``planner.plan`` for the test's duration, under every
name a test or the library's front ends call it by (``planner.plan``, ``planner.solve.plan``,
the CLI's and ``planner.sweep``'s in-process calls), with a wrapper that runs
``planner.check.check_plan`` on the plan and fails the test with the problems it lists.
So no planning test can forget the checker. A test that makes a plan the checker must
reject says so with ``@pytest.mark.unchecked_plans("why")``. The search's own re-plans
(the fixes an infeasible plan's explanation tries, ``planner.solve.search._replan``) call
the solver's module-level ``plan`` directly and are not checked here: they are planned
without an explanation of their own, which the checker would rightly require.

Tests marked ``slow`` (the marker is registered in pyproject.toml) are deselected by the
default ``-m "not slow"`` there; ``-m "slow or not slow"``, as CI runs, or ``--all`` runs
them too.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import planner
import planner.cli
import planner.solve
from planner.check import check_plan
from planner.solve import search

# The modules whose ``plan`` attribute callers look up: the package, the solver package
# (``planner.sweep`` and ``planner.run.validate`` import it from there when they run) and
# the CLI, which imported the name at load.
PLAN_HOLDERS = (planner, planner.solve, planner.cli)
SIGNATURE = inspect.signature(search.plan)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all", action="store_true", default=False, help="run the slow tests too (no -m filter)"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "unchecked_plans(reason): the test makes plans the independent checker rejects, "
        "on purpose (say why)",
    )
    if config.getoption("all"):
        config.option.markexpr = ""  # every test, whatever -m the options hold
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        # Each worker's share of the cores for PyTorch's (OpenMP) thread pool in the tests it
        # runs in-process, read when torch is first imported (here, none yet is): a pool as
        # wide as the machine contends with the other workers for their cores and does no
        # more work.
        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


@dataclass
class CheckedPlans:
    """The plans a test made, in order; each passed ``check_plan`` (or the test failed)."""

    plans: list[planner.Plan] = field(default_factory=list)


def checking(record: CheckedPlans, *, enforce: bool = True) -> Callable[..., planner.Plan]:
    """``planner.plan`` with every result checked against its own inputs and space."""

    def plan(*args: Any, **kwargs: Any) -> planner.Plan:
        result = search.plan(*args, **kwargs)  # looked up per call: a test may replace it
        bound = SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        job, problems = costed_job(given["job"], given["space"], result)
        problems += check_plan(given["model"], given["cluster"], job, result, space=given["space"])
        if problems and enforce:
            pytest.fail(
                f"check_plan rejects the plan (status {result.status}):\n  "
                + "\n  ".join(problems),
                pytrace=False,
            )
        record.plans.append(result)
        return result

    return plan


def costed_job(
    job: planner.TrainingJob, space: planner.SearchSpace | None, result: planner.Plan
) -> tuple[planner.TrainingJob, list[str]]:
    """The job the plan is checked against: the one given, or, for a space with a target
    launcher, the job run with that launcher's framework, as the plan was costed (a plan for
    DeepSpeed is priced with what DeepSpeed overlaps and holds); a plan that records any
    other job is a problem."""
    names = (space or planner.SearchSpace()).frameworks_for(job)
    if len(names) > 1 and result.job is not None:  # the plan is run by the fastest of them
        if result.job.framework not in names:
            return job, [f"plan records framework {result.job.framework!r}, not one of {names}"]
        return job.with_framework(result.job.framework), []
    target = names[0]
    expected = job if target in (None, job.framework) else job.with_framework(target)
    if result.job is not None and result.job != expected:
        return expected, [f"plan records job {result.job!r}, expected {expected!r}"]
    return expected, []


@pytest.fixture(autouse=True)
def plan_checked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> CheckedPlans:
    """Every plan the test makes, each run through ``check_plan`` (see the module
    docstring); a test marked ``unchecked_plans`` gets its plans unchecked."""
    record = CheckedPlans()
    enforce = request.node.get_closest_marker("unchecked_plans") is None
    wrapper = checking(record, enforce=enforce)
    for holder in PLAN_HOLDERS:
        monkeypatch.setattr(holder, "plan", wrapper)
    return record


# The files that take longest in the full run (tens of seconds each on two cores), started
# first: with a file's tests kept on one worker (--dist loadfile), the two workers then
# finish together instead of one running a long file alone at the end.
LONG_FIRST = (
    "test_plan.py",
    "test_cli.py",
    "test_bounds.py",
    "test_run_memory.py",
    "test_run_layouts.py",
    "test_sweep.py",
    "test_calibrate.py",
    "test_readme.py",
    "test_logs_megatron.py",
    "test_accuracy.py",
    "test_packaging.py",
    "test_timeline.py",
    "test_export.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # stable
