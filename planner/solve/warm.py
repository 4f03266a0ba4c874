"""Warm starts: a balanced partition with recompute that fits, completed by CP-SAT."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from planner.costs.state import gpu_state_bytes
from planner.solve.model import StageModel
from planner.solve.tables import Option, Tables
from planner.specs import ClusterSpec, TrainingJob


def warm_start(
    tables: Tables,
    cluster: ClusterSpec,
    job: TrainingJob,
    time_limit_s: float,
    ranks_even: list[int] | None = None,
) -> tuple[list[int] | None, float]:
    """A balanced partition with one option for every layer: the fastest option that fits.
    ``ranks_even`` (layers per stage that even out the ranks rather than the stages; see
    ``lpbound.lp_counts``: the rounded relaxation) is tried first, with each stage's recompute mix
    chosen by the solver."""
    names: set[str] | None = None
    for kind in set(tables.layer_kinds):
        opts = {o.name for o in tables.kinds[kind].options}
        names = opts if names is None else names & opts
    ordered = sorted(
        names or set(),
        key=lambda n: sum(
            next(o.time for o in tables.kinds[k].options if o.name == n)
            for k in set(tables.layer_kinds)
        ),
    )
    by_time = balanced(tables, lambda o: o.time)
    # A second partition for tight memory: balance what each stage holds (its state and the
    # leanest option's activations), with the leanest option everywhere.
    by_memory = balanced(tables, lambda o: o.saved, state=True)
    partitions = [p for p in (ranks_even, by_time) if p is not None]
    candidates = [(p, name) for name in ordered for p in partitions]
    if ordered and by_memory != by_time:
        candidates.append((by_memory, ordered[-1]))
    spent = 0.0
    if ranks_even is not None:
        # The rank-balanced partition with each stage's recompute mix left to the solver:
        # memory often binds on some ranks only, and one option for every layer overpays.
        pinned = StageModel(tables, cluster, job)
        pinned.fix(ranks_even)
        values, work = pinned.complete(time_limit_s=min(0.4, time_limit_s / 2))
        spent += work
        if values is not None:
            return values, spent
    for counts, name in candidates:
        option = {k: name for k in set(tables.layer_kinds)}
        for fixed in tables.first_fixed + tables.last_fixed:
            fixed_opts = [o.name for o in tables.kinds[fixed].options]
            option[fixed] = name if name in fixed_opts else fixed_opts[0]
        pinned = StageModel(tables, cluster, job)
        pinned.fix(counts, option)
        values, work = pinned.complete(time_limit_s=min(1.0, time_limit_s))
        spent += work
        if values is not None:
            return values, spent
    # No single option fits: keep a partition and let the solver mix the options per stage.
    for partition in dict.fromkeys((*map(tuple, partitions), tuple(by_memory))):
        pinned = StageModel(tables, cluster, job)
        pinned.fix(list(partition))
        values, work = pinned.complete(time_limit_s=min(0.5, time_limit_s))
        spent += work
        if values is not None:
            return values, spent
    return None, spent


def balanced(tables: Tables, cost: Callable[[Option], float], *, state: bool = False) -> list[int]:
    """Layers per stage so every stage gets about the same total of ``cost`` (the least over
    a block's options, plus its state bytes when ``state``), the embedding's and head's own
    counted on the first and last stage; every stage but the first and last keeps a layer."""

    def block(k: str) -> float:
        extra = gpu_state_bytes(tables.kinds[k].state) if state else 0.0
        return min(cost(o) for o in tables.kinds[k].options) + extra

    per = [block(k) for k in tables.layer_kinds]
    stages, n = tables.config.stages, len(per)
    first = sum(block(b) for b in tables.first_fixed)
    last = sum(block(b) for b in tables.last_fixed)
    target = (sum(per) + first + last) / stages
    cumulative = list(itertools.accumulate(per, initial=first))
    bounds = [0]
    for s in range(1, stages):
        cut = next((i for i, c in enumerate(cumulative) if c >= target * s), n)
        low = bounds[-1] + (1 if s > 1 else 0)  # middle stages hold a layer
        high = n - (stages - 1 - s)
        bounds.append(min(max(cut, low), high))
    bounds.append(n)
    return [b - a for a, b in itertools.pairwise(bounds)]
