"""Lanes of search work, run side by side on the machine's cores, deterministically.

The search (``planner.solve.search``) takes its work in batches of ``LANES`` independent
jobs (a set of degrees' bounds, a relaxation, a configuration's CP-SAT model) whose results
it applies in the order it asked for them. What it asks for, and what it does with the
answers, never depends on which job finished first or on how many processes ran them: the
batches are the same whether ``run`` uses one process or several, so the plan is the same
on one core or two, only sooner on two.

Each job names a key (the degrees its configuration's costs depend on) and always runs in
the lane that key maps to: lane 0 is this process, each other lane one forked process. The
cost tables, relaxations and schedule programs a job builds are cached in the process that
ran it, so a set of degrees' later jobs find them there. The forked processes are started
once per Python process and reused by every ``plan`` call (a fork costs milliseconds; a
fresh interpreter with OR-Tools and NumPy about a second)."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
import threading
import zlib
from collections.abc import Callable, Sequence
from multiprocessing.pool import AsyncResult, Pool
from typing import Any

from planner.children import die_with_parent

LANES = 2  # jobs per batch, whatever the processes: the plan does not depend on the machine

Job = tuple[Callable[..., Any], tuple[Any, ...]]  # (function, arguments)
_POOLS: list[Pool] = []


def default_processes() -> int:
    """Processes for the search's lanes: the CPUs this process may use, at most ``LANES``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(LANES, cpus))


def lane_of(key: object, processes: int) -> int:
    """The lane a key's jobs run in (stable across runs and machines)."""
    return zlib.crc32(repr(key).encode()) % processes if processes > 1 else 0


def run_on(jobs: Sequence[tuple[int, Job]], processes: int) -> list[Any]:
    """Each job's ``fn(*args)``, in the order given; a job given lane ``n`` runs in lane
    ``n % processes`` (0: this process), every time, so state a job leaves in its process
    is there for the next job of that lane; the lanes run side by side (``fn`` and the
    arguments must pickle for lanes other than 0)."""
    if processes > 1 and not _can_fork():
        processes = 1
    by_lane: dict[int, list[int]] = {}
    for i, (lane, _) in enumerate(jobs):
        by_lane.setdefault(lane % processes, []).append(i)
    results: list[Any] = [None] * len(jobs)
    waiting: list[tuple[list[int], AsyncResult[list[Any]]]] = []
    for lane, where in sorted(by_lane.items()):
        if lane:
            batch = [jobs[i][1] for i in where]
            waiting.append((where, _pool(lane).apply_async(_run_all, (batch,))))
    for i in by_lane.get(0, []):
        fn, args = jobs[i][1]
        results[i] = fn(*args)
    for where, pending in waiting:
        for i, value in zip(where, pending.get(), strict=True):
            results[i] = value
    return results


def _run_all(batch: list[Job]) -> list[Any]:
    return [fn(*args) for fn, args in batch]


def _can_fork() -> bool:
    """Fork keeps the parent's imports and caches; it is safe on Linux only (macOS's system
    libraries do not survive a fork after they start threads), and a daemonic process (a
    worker of some other pool) may not have children. Elsewhere the lanes run in turn."""
    return (
        sys.platform == "linux"
        and "fork" in multiprocessing.get_all_start_methods()
        and not multiprocessing.current_process().daemon
    )


def _pool(lane: int) -> Pool:
    """The one-process pool of lane ``lane`` (1 and up), started on first use."""
    while len(_POOLS) < lane:
        # The kernel's parent-death signal follows the thread that forked: only a pool the
        # main thread starts asks for it (a worker thread's exit would end lanes still in use).
        main = threading.current_thread() is threading.main_thread()
        context = multiprocessing.get_context("fork")
        _POOLS.append(context.Pool(1, initializer=die_with_parent if main else None))
    return _POOLS[lane - 1]


def shutdown() -> None:
    """Stop the lanes' processes (they start again on the next batch that needs them)."""
    for pool in _POOLS:
        pool.terminate()
        pool.join()
    _POOLS.clear()


atexit.register(shutdown)
