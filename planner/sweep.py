"""Batch sweeps: plan many (model, machine type, GPU count, job) cases, resumably.

Each case is planned by ``planner.plan`` in a worker (a local process pool by default, or
Ray tasks with the optional ``ray`` extra). Its row goes into a SQLite database the moment it
finishes, keyed by a hash of everything that determines its answer (the model, cluster and
job specs, the search space and the time limit), so an interrupted sweep run again picks up
where it stopped: finished cases are read back, not planned again. A case that raises
records its error and the sweep goes on; an infeasible job is a finished case (its row says
why). Rows hold the headline figures (step time, MFU, tokens/s, memory) and the whole plan as
JSON.

Warm starts: the cases that differ only in their GPU count form a chain, in order of GPU
count, and each case's search starts from the plan of the one before it (``plan``'s
``hints``; with more GPUs the same tensor and pipeline degrees hold no more per rank, so
that plan usually fits and prunes from the start). A case then waits for the one before it;
chains run side by side. What a case finds depends only on its own inputs and that plan,
so a resumed or rerun sweep gets the same rows, on any backend (the wall clock is no part
of a case's answer: ``CLOCK_FACTOR``); its key includes the key of the case it starts
from. Bounds are not carried over: with more GPUs a step can fall by more than the
GPU count grows (memory freed lets recomputation go), so no bound of one count holds for
another.

Refinement (``refine``, on by default): a chain's plans come from one direction only, and a
larger count's plan, restated for a smaller count, is often faster than what that count's
own search found in its time (Llama 3 70B on 1,024 H800: 36.65 s planned, 33.14 s from the
2,048-GPU plan restated; ``benchmarks/RESULTS.md``). Once a chain is finished, each case not
proven (optimal or infeasible) gets a second case (``Case.refines``): the other counts'
plans are restated for it (``planner.solve.search.hinted_steps``), and where one is faster
by the estimate, the case is planned again with those as hints; its row then replaces the
first when its step is lower. A second case whose neighbours offer nothing faster is
recorded as ``kept`` and costs no search. It too depends only on its inputs and the plans
it is given, so a resumed sweep gets the same rows.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import socket
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.catalog import load_cluster, load_model
from planner.children import die_with_parent
from planner.errors import PlannerError
from planner.layout import Layout
from planner.specs import DEFAULT_TIME_LIMIT_S, ModelSpec, SearchSpace, TrainingJob

GiB = 2**30

# A case's row must not depend on where it ran: its key holds its inputs only, and a sweep
# on Ray and one in a local pool must agree. ``plan``'s deterministic budget (``time_limit_s``)
# decides what the search explores; its wall-clock stop, by default at ``time_limit_s``,
# would cut a search short on a loaded worker (a Ray node starting its own processes on the
# same cores once ran a 0.5 s search ten times slower: "feasible" there, "optimal" in the
# local pool, the same layout). So a case's clock stops it only this many times past its
# time limit, a safety stop for a machine many times slower than the budget assumes.
CLOCK_FACTOR = 10

COLUMNS = (
    "model",
    "gpu",
    "gpus",
    "seq_len",
    "global_batch",
    "status",
    "step_time_s",
    "mfu",
    "tokens_per_s",
    "tflops_per_gpu",
    "peak_gib",
    "gap",
    "layout",
    "solve_time_s",
    "error",
    "refined",  # planned again from another GPU count's plan (see the module docstring)
)


@dataclass(frozen=True)
class Case:
    """One planning problem of a sweep (specs as JSON-ready dicts, so workers can rebuild
    them anywhere)."""

    model: dict[str, Any]
    gpu: str
    gpus: int
    job: dict[str, Any]
    space: dict[str, Any]
    time_limit_s: float
    warm_from: str | None = None  # the key of the case whose plan seeds this one's search
    refines: str | None = None  # a refinement: the key of the case it plans again
    neighbours: tuple[str, ...] = ()  # ... and of the cases whose plans it is offered

    @property
    def key(self) -> str:
        """Hash of everything that determines the case's answer."""
        cluster = load_cluster(self.gpu, gpus=self.gpus).model_dump(mode="json")
        parts: list[Any] = [self.model, cluster, self.job, self.space, self.time_limit_s]
        if self.warm_from is not None:
            parts.append({"warm_from": self.warm_from})
        if self.refines is not None:
            parts.append({"refines": self.refines, "neighbours": list(self.neighbours)})
        blob = json.dumps(parts, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    @property
    def chain(self) -> str:
        """What the cases of one chain share: all but the GPU count (and the seeding)."""
        parts = [self.model, self.gpu, self.job, self.space, self.time_limit_s]
        return json.dumps(parts, sort_keys=True)

    @property
    def needs(self) -> tuple[str, ...]:
        """The keys of the cases whose plans this one is given."""
        if self.refines is not None:
            return (self.refines, *self.neighbours)
        return (self.warm_from,) if self.warm_from is not None else ()


def cases(
    models: Sequence[str | ModelSpec],
    gpus: Sequence[int],
    *,
    clusters: Sequence[str] = ("h100",),
    jobs: Sequence[TrainingJob],
    space: SearchSpace | None = None,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    warm_start: bool = True,
) -> list[Case]:
    """Every combination, in a stable order (model, machine type, job, GPU count); with
    ``warm_start`` each case starts from the plan of the next smaller GPU count of its
    chain (see the module docstring)."""
    if not models or not gpus or not clusters or not jobs:
        raise PlannerError("sweep: models, gpus, clusters and jobs must each list one or more")
    for n in gpus:
        if n <= 0:
            raise PlannerError(f"sweep.gpus: {n} must be a positive GPU count")
    specs = [m if isinstance(m, ModelSpec) else load_model(m) for m in models]
    for gpu in clusters:
        load_cluster(gpu, gpus=1)  # an unknown machine type fails here, before any work
    space_dict = (space or SearchSpace()).model_dump(mode="json")
    out: list[Case] = []
    for m, gpu, j in itertools.product(specs, clusters, jobs):
        before: Case | None = None
        for n in sorted(gpus):
            if before is not None and before.gpus == n:  # listed twice: the same case
                out.append(before)
                continue
            case = Case(
                model=m.model_dump(mode="json"),
                gpu=gpu,
                gpus=n,
                job=j.model_dump(mode="json"),
                space=space_dict,
                time_limit_s=time_limit_s,
                warm_from=before.key if warm_start and before is not None else None,
            )
            out.append(case)
            before = case
    return out


def run_case(case: Case, hints: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Plan one case, its search seeded with ``hints`` (layouts as JSON: the plan of the case
    it starts from; for a refinement, the plan it refines and then its neighbours' plans); a
    row for the database (never raises: errors become the row)."""
    if case.refines is not None:
        return _refined(case, hints)
    return _planned(case, hints)


def _refined(case: Case, hints: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A refinement (see the module docstring): the case planned again from those of its
    neighbours' plans that, restated for it, the estimate puts faster than its own; a
    ``kept`` row where none is."""
    from planner.solve.search import hinted_steps  # workers import the solver lazily

    kept = {"gpus": case.gpus, "status": "kept", "plan": None}
    try:
        model = ModelSpec(**case.model)
        cluster = load_cluster(case.gpu, gpus=case.gpus)
        job = TrainingJob(**case.job)
        space = SearchSpace(**case.space)
        mine, *others = hinted_steps(model, cluster, job, space, [Layout(**h) for h in hints])
        if mine is None:
            return kept
        faster = [o[1] for o in sorted(filter(None, others), key=lambda o: o[0]) if o[0] < mine[0]]
    except Exception as exc:  # no refinement beats a failed check: the first row stands
        return {**kept, "error": f"{type(exc).__name__}: " + " ".join(str(exc).split())[:300]}
    if not faster:
        return kept
    row = _planned(case, [f.model_dump(mode="json") for f in faster])
    return {**row, "refined": True}


def _planned(case: Case, hints: Sequence[dict[str, Any]]) -> dict[str, Any]:
    from planner.solve import plan  # workers import the solver lazily

    started = time.perf_counter()
    row: dict[str, Any] = {
        "model": case.model["name"],
        "gpu": case.gpu,
        "gpus": case.gpus,
        "seq_len": case.job["seq_len"],
        "global_batch": case.job["global_batch"],
    }
    try:
        model = ModelSpec(**case.model)
        cluster = load_cluster(case.gpu, gpus=case.gpus)
        job = TrainingJob(**case.job)
        space = SearchSpace(**case.space)
        seeds = [Layout(**h) for h in hints]
        # One process per case: the sweep's own workers take the cores. The wall clock
        # stops the search only far past its budget (see ``CLOCK_FACTOR``).
        result = plan(
            model,
            cluster,
            job,
            space,
            time_limit_s=case.time_limit_s,
            processes=1,
            hints=seeds,
            clock_limit_s=CLOCK_FACTOR * case.time_limit_s,
        )
    except PlannerError as exc:
        return {**row, "status": "failed", "error": str(exc), "plan": None}
    except Exception as exc:  # a bug in one case must not stop the sweep
        return {
            **row,
            "status": "failed",
            "error": f"{type(exc).__name__}: " + " ".join(str(exc).split())[:300],
            "plan": None,
        }
    row["status"] = result.status
    row["solve_time_s"] = time.perf_counter() - started
    row["plan"] = result.model_dump(mode="json")
    if result.layout is None or result.estimate is None:
        explanation = result.explanation.summary if result.explanation else "no layout fits"
        return {**row, "error": explanation}
    est, lay = result.estimate, result.layout
    return {
        **row,
        "step_time_s": est.step_time_s,
        "mfu": est.mfu,
        "tokens_per_s": est.tokens_per_s,
        "tflops_per_gpu": est.tflops_per_gpu,
        "peak_gib": max(m.peak_bytes for m in est.memory) / GiB,
        "gap": result.gap,
        "layout": lay.shape(""),
    }


# -- the database ----------------------------------------------------------------------


class Store:
    """The sweep's SQLite file: one row per finished case, written as it finishes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.db = sqlite3.connect(self.path)
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS cases (key TEXT PRIMARY KEY, row TEXT NOT NULL, "
                "status TEXT NOT NULL, finished REAL NOT NULL)"
            )
            self.db.commit()
        except sqlite3.DatabaseError as exc:
            raise PlannerError(f"sweep.db={str(path)!r}: not a sweep database ({exc})") from None

    def done(self) -> dict[str, dict[str, Any]]:
        rows = self.db.execute("SELECT key, row FROM cases").fetchall()
        return {key: json.loads(row) for key, row in rows}

    def put(self, key: str, row: dict[str, Any]) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO cases VALUES (?, ?, ?, ?)",
            (key, json.dumps(row), row["status"], time.time()),
        )
        self.db.commit()  # nothing finished is lost if the sweep is killed next

    def close(self) -> None:
        self.db.close()


def layouts_in(db: str | Path) -> list[Layout]:
    """The layout of every planned case in a sweep database (for ``plan``'s hints), in the
    order the cases finished; one line of error for a file that is not one."""
    if not Path(db).is_file():
        raise PlannerError(f"sweep.db={str(db)!r}: no such file")
    try:  # read-only: a file that is not a sweep's is left as it was
        con = sqlite3.connect(f"file:{Path(db).resolve()}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT row FROM cases ORDER BY finished").fetchall()
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        raise PlannerError(f"sweep.db={str(db)!r}: not a sweep database ({exc})") from None
    out: list[Layout] = []
    for (text,) in rows:
        layout = (json.loads(text).get("plan") or {}).get("layout")
        if layout:
            found = Layout(**layout)
            if found not in out:
                out.append(found)
    return out


# -- running ---------------------------------------------------------------------------

Progress = Callable[[int, int, int, int], None]  # done, running, failed, total


def sweep(
    models: Sequence[str | ModelSpec],
    gpus: Sequence[int],
    *,
    clusters: Sequence[str] = ("h100",),
    jobs: Sequence[TrainingJob],
    space: SearchSpace | None = None,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    db: str | Path = "sweep.sqlite",
    workers: int | None = None,
    ray_address: str | None = None,
    retry_failed: bool = False,
    progress: Progress | None = None,
    warm_start: bool = True,
    refine: bool = True,
) -> list[dict[str, Any]]:
    """Plan every (model, machine type, job, GPU count) and return one row per case, in the
    cases' order; ``warm_start``: each GPU count's search starts from the plan of the next
    smaller one; ``refine``: then each is planned again from the other counts' plans where
    one of them is faster (see the module docstring). Rows already in ``db`` are returned without
    planning again (failed ones are retried when ``retry_failed``). ``workers``: local
    processes (default: the CPUs);
    ``ray_address``: run on Ray instead ("auto" joins a running cluster, "local" starts one
    here). ``progress(done, running, failed, total)`` is called as cases start and finish."""
    if not time_limit_s > 0:
        raise PlannerError(
            f"sweep.time_limit_s={time_limit_s:g}: must be a positive number of seconds"
        )
    todo = cases(
        models,
        gpus,
        clusters=clusters,
        jobs=jobs,
        space=space,
        time_limit_s=time_limit_s,
        warm_start=warm_start,
    )
    return run(
        todo,
        db=db,
        workers=workers,
        ray_address=ray_address,
        retry_failed=retry_failed,
        progress=progress,
        refine=refine,
    )


def run(
    todo: Sequence[Case],
    *,
    db: str | Path = "sweep.sqlite",
    workers: int | None = None,
    ray_address: str | None = None,
    retry_failed: bool = False,
    progress: Progress | None = None,
    refine: bool = True,
) -> list[dict[str, Any]]:
    """Plan the cases not yet in ``db`` (see ``sweep``); one row per case, in order; with
    ``refine``, then the chains' refinements (see the module docstring), each case's row the
    faster of its own and its refinement's."""
    keys = [c.key for c in todo]
    store = Store(db)
    try:
        finished = store.done()
        if retry_failed:
            finished = {k: r for k, r in finished.items() if r["status"] != "failed"}
        pending = [(k, c) for k, c in zip(keys, todo, strict=True) if k not in finished]
        pending = list(dict((k, c) for k, c in pending).items())  # a case listed twice once
        counts = {"done": len(todo) - len(pending), "failed": 0, "total": len(todo)}
        counts["failed"] = sum(1 for k in keys if finished.get(k, {}).get("status") == "failed")

        def report(running: int) -> None:
            if progress is not None:
                progress(counts["done"], running, counts["failed"], counts["total"])

        def finish(key: str, row: dict[str, Any]) -> None:
            store.put(key, row)
            finished[key] = row
            counts["done"] += 1
            counts["failed"] += row["status"] == "failed"

        report(0)
        runner = _ray if ray_address is not None else _local
        feed = _Feed(pending, finished)
        runner(pending, finish, report, feed, workers=workers, ray_address=ray_address)
        if not refine:
            return [finished[k] for k in keys]
        second = {c.refines: c for c in refinements(todo, finished)}
        later = list({c.key: c for c in second.values() if c.key not in finished}.items())
        counts["total"] += len(second)
        counts["done"] += len(second) - len(later)
        if later:
            feed = _Feed(later, finished)
            runner(later, finish, report, feed, workers=workers, ray_address=ray_address)
        out = []
        for k in keys:
            first, other = finished[k], second.get(k)
            again = finished.get(other.key) if other is not None else None
            out.append(again if again is not None and _faster(again, first) else first)
        return out
    finally:
        store.close()


def refinements(todo: Sequence[Case], finished: dict[str, dict[str, Any]]) -> list[Case]:
    """Each case of a chain of two or more that has a plan and no proof (optimal or
    infeasible), planned again from the other counts' plans (see the module docstring)."""
    chains: dict[str, dict[str, Case]] = {}
    for c in todo:
        if c.refines is None:
            chains.setdefault(c.chain, {})[c.key] = c
    out = []
    for members in chains.values():
        planned = [k for k in members if _hints(finished.get(k))]
        for key, case in members.items():
            if key not in planned or finished[key]["status"] in ("optimal", "infeasible"):
                continue
            others = tuple(k for k in planned if k != key)
            if others:
                out.append(
                    dataclasses.replace(case, warm_from=None, refines=key, neighbours=others)
                )
    return out


def _faster(again: dict[str, Any] | None, first: dict[str, Any]) -> bool:
    """Whether a refinement's row ``again`` has a plan faster than the first row's."""
    if again is None or again.get("step_time_s") is None:
        return False
    return bool(first.get("step_time_s") is None or again["step_time_s"] < first["step_time_s"])


class _Feed:
    """The pending cases, in order; each is ready once the case it starts from is finished
    (at once when that case is not part of this sweep), and goes out with that case's plan
    as its hints."""

    def __init__(self, pending: list[tuple[str, Case]], finished: dict[str, dict[str, Any]]):
        self.waiting = list(pending)
        self.finished = finished
        self.keys = {key for key, _ in pending}

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def ready(self, most: int) -> list[tuple[str, Case, list[dict[str, Any]]]]:
        out: list[tuple[str, Case, list[dict[str, Any]]]] = []
        for item in list(self.waiting):
            if len(out) >= most:
                break
            key, case = item
            if any(k in self.keys and k not in self.finished for k in case.needs):
                continue
            self.waiting.remove(item)
            hints = [h for k in case.needs for h in _hints(self.finished.get(k))]
            out.append((key, case, hints))
        return out


def _hints(row: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The layout of a finished row's plan, as JSON (none for a failed or infeasible one)."""
    layout = ((row or {}).get("plan") or {}).get("layout")
    return [layout] if layout else []


def _local(
    pending: list[tuple[str, Case]],
    finish: Callable[[str, dict[str, Any]], None],
    report: Callable[[int], None],
    feed: _Feed,
    *,
    workers: int | None,
    ray_address: str | None,
) -> None:
    if not pending:
        return
    n = max(1, min(workers or multiprocessing.cpu_count(), len(pending)))
    context = multiprocessing.get_context("spawn")  # no inherited threads or solver state
    pool = ProcessPoolExecutor(max_workers=n, mp_context=context, initializer=die_with_parent)
    running: dict[Future[dict[str, Any]], str] = {}

    def submit() -> None:
        for key, case, hints in feed.ready(n - len(running)):
            running[pool.submit(run_case, case, hints)] = key

    try:
        submit()
        report(len(running))
        while running:
            ready, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in ready:
                key = running.pop(future)
                finish(key, _result(future))
            submit()
            report(len(running))
    except BaseException:  # Ctrl-C or an error: what finished is stored; stop the rest now
        children = list(getattr(pool, "_processes", {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for child in children:
            child.terminate()
        raise
    pool.shutdown()


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null for the block: what native libraries write there
    (Ray's C++ client) as well as Python's."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


RAY_CONNECT_S = 5.0  # how long a Ray head's address may take to accept a connection


def check_reachable(address: str) -> None:
    """Refuse, in one line and before Ray starts (whose native client logs a score of lines
    while it retries), a ``host:port`` Ray address nothing answers at; "auto" (a head this
    machine knows of) is left to Ray."""
    if address == "auto":
        return
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise PlannerError(f"--ray={address!r}: expected host:port, local or auto")
    try:
        socket.create_connection((host, int(port)), timeout=RAY_CONNECT_S).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__.replace("Error", " error").strip()
        raise PlannerError(f"--ray={address!r}: cannot reach a Ray head there ({why})") from None


def _result(future: Future[dict[str, Any]]) -> dict[str, Any]:
    try:
        return future.result()
    except Exception as exc:  # the worker died (killed, out of memory): record it
        return {"status": "failed", "error": f"worker: {type(exc).__name__}: {exc}"}


def _ray(
    pending: list[tuple[str, Case]],
    finish: Callable[[str, dict[str, Any]], None],
    report: Callable[[int], None],
    feed: _Feed,
    *,
    workers: int | None,
    ray_address: str | None,
) -> None:
    try:
        import ray
    except ImportError:
        raise PlannerError(
            "sweep.ray_address: Ray is not installed; pip install 'planner[ray]'"
        ) from None
    started_here = not ray.is_initialized()
    if started_here:
        if ray_address == "local":
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        else:
            check_reachable(ray_address or "auto")
            with _native_stderr_silenced():  # its client's retries log a line a second
                try:
                    ray.init(address=ray_address, log_to_driver=False)
                except (ConnectionError, RuntimeError) as exc:
                    raise PlannerError(f"--ray={ray_address!r}: {exc}") from None
    try:
        task = ray.remote(run_case)
        refs: dict[Any, str] = {}

        def submit() -> None:
            for key, case, hints in feed.ready(len(pending)):
                refs[task.remote(case, hints)] = key

        submit()
        report(len(refs))
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=1)
            for ref in ready:
                key = refs.pop(ref)
                try:
                    row = ray.get(ref)
                except Exception as exc:  # a task that died
                    row = {"status": "failed", "error": f"ray: {type(exc).__name__}: {exc}"}
                finish(key, row)
            submit()
            report(len(refs))
    finally:
        if started_here:
            ray.shutdown()


# -- output ----------------------------------------------------------------------------


def write(rows: Iterable[dict[str, Any]], path: str | Path) -> None:
    """Write rows as CSV (the headline columns) or JSON (everything, plans included), by
    the file's suffix."""
    path = Path(path)
    rows = list(rows)
    if path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=2) + "\n")
        return
    if path.suffix != ".csv":
        raise PlannerError(f"sweep --out={str(path)!r}: use a .csv or .json file name")
    with path.open("w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        out.writeheader()
        for row in rows:
            out.writerow({k: row.get(k, "") for k in COLUMNS})
