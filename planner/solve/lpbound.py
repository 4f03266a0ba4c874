"""A lower bound on a configuration's step time from the linear relaxation of its model.

The step time is the longest chain of tasks through the ranks' op orders
(``planner.timeline``); each chain's length is a sum of task lengths, and each task's length
the largest of a few sums of per-stage quantities (``planner.costs.overlap``). This bound
states that over fractional layers: how many layers of each kind each stage holds, and how
many of them take each recompute option, may be any non-negative numbers that add up
(every stage but the first and last holds at least one layer), each rank's memory at every
activation level its op order passes through stays within the cap (its state, its chunks'
saved bytes times the micro-batches in flight, the buffers; a recompute's rebuild and
ZeRO-3's gathered copy left out), and the step is at least every chain the timeline reports
for a few layouts of the configuration (the even partition, then the rounded relaxation's
own, in turn). Each of those relaxes the CP-SAT model (``planner.solve.model``) or drops a
chain from it, so the optimum is at most the step time of every layout of the configuration.

What it relaxes beyond the counts: whether a stage holds routed experts (their collectives'
latencies, which the CP-SAT model counts where it does, are left out).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
from ortools.linear_solver import pywraplp

from planner.costs.cap import memory_cap
from planner.costs.overlap import task_terms
from planner.costs.quantities import Bytes, Prim, Row, stage_quantities
from planner.memo import Memo
from planner.solve import ranks
from planner.solve.bounds import bound_tables
from planner.solve.tables import Config, Kind, Option, Tables, even_counts, rank_orders
from planner.specs import ClusterSpec, ModelSpec, TrainingJob
from planner.timeline import Form, run_values, shape_forms

ROUNDS = 2  # relaxations solved, each with the chains of the last one's rounded layout

Lin = dict[int, float]  # variable index -> coefficient; index -1 holds the constant
GiB = float(2**30)  # memory rows are stated in GiB, near the time rows' magnitudes


def lp_bound(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> float | None:
    """A step time no layout of ``config`` beats (``math.inf`` when none fits memory), or
    None when the configuration has no tables."""
    out = _relaxation(model, cluster, job, config)
    return None if out is None else out[0]


def lp_counts(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> list[int] | None:
    """Layers per stage of the relaxation's optimum, rounded: a starting point."""
    out = _relaxation(model, cluster, job, config)
    return None if out is None else out[1]


_RELAXED: Memo[tuple[float, list[int] | None] | None] = Memo("lpbound.relaxation", limit=4096)


def _relaxation(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> tuple[float, list[int] | None] | None:
    key = (model, cluster.model_dump_json(), job, config.key())
    return _RELAXED.get(key, lambda: _solve(model, cluster, job, config))


def _solve(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> tuple[float, list[int] | None] | None:
    t = bound_tables(model, cluster, job, config)
    if t is None or any(not k.options for k in t.kinds.values()):
        return None
    orders = rank_orders(config.schedule, config.pp, config.num_microbatches, config.virtual_stages)
    lp = _Lp(t, orders, cluster, job)
    seen = list(
        shape_forms(config.schedule, config.pp, config.num_microbatches, config.virtual_stages)
    )
    counts = even_counts(model, config)
    bound, best = 0.0, None
    for _ in range(ROUNDS):
        new = [f for f in lp.chains(counts) if f not in seen]
        seen += new
        lp.add_forms(new if bound else seen)
        value = lp.solve()
        if value is None:
            return math.inf, None
        if math.isnan(value):  # no proof either way: keep what the earlier rounds proved
            break
        bound, rounded = max(bound, value), lp.counts()
        best = rounded if rounded is not None else best
        if rounded is None or rounded == counts:
            break
        counts = rounded
    return bound, best


def _fixed(t: Tables, s: int) -> list[str]:
    S = t.config.stages
    return (t.first_fixed if s == 0 else []) + (t.last_fixed if s == S - 1 else [])


class _Lp:
    """The relaxation (see the module docstring), built with sparse rows."""

    def __init__(self, t: Tables, orders: list[Any], cluster: ClusterSpec, job: TrainingJob):
        self.t, self.orders = t, orders
        self.overlap = t.overlap
        self.s = pywraplp.Solver.CreateSolver("GLOP")
        assert self.s is not None
        self.vars: list[Any] = []
        S = t.config.stages
        kinds = Counter(t.layer_kinds)
        self.y = [
            {k: [self._var(n) for _ in t.kinds[k].options] for k, n in kinds.items()}
            for _ in range(S)
        ]
        for k, n in kinds.items():
            self._row({v: 1.0 for s in range(S) for v in self.y[s][k]}, n, n)
        for s in range(1, S - 1):
            self._row({v: 1.0 for k in kinds for v in self.y[s][k]}, 1, math.inf)
        self.z = {
            n: [self._var(1) for _ in t.kinds[n].options] for n in t.first_fixed + t.last_fixed
        }
        for vs in self.z.values():
            self._row(dict.fromkeys(vs, 1.0), 1, 1)
        self.prim = self._prims()
        self._compact()
        self.task_cache: dict[Any, list[tuple[int, np.ndarray]]] = {}
        self._memory(memory_cap(cluster, job))
        self.nonzeros = 0  # a deterministic measure of the work done
        self.step = self._var(math.inf)
        self.s.Objective().SetCoefficient(self.vars[self.step], 1.0)
        self.s.Objective().SetMinimization()

    # -- building blocks -----------------------------------------------------------------
    def _var(self, upper: float) -> int:
        up = self.s.infinity() if math.isinf(upper) else upper
        self.vars.append(self.s.NumVar(0, up, ""))
        return len(self.vars) - 1

    def _row(self, lin: Lin, lo: float, hi: float) -> None:
        """lo <= lin <= hi (the constant moved to the bounds)."""
        const = lin.get(-1, 0.0)
        inf = self.s.infinity()
        row = self.s.Constraint(
            -inf if math.isinf(lo) else lo - const, inf if math.isinf(hi) else hi - const
        )
        for i, c in lin.items():
            if i >= 0 and c:
                row.SetCoefficient(self.vars[i], c)

    def _sum(self, s: int, value: Any, *, fixed: bool = True) -> Lin:
        """Stage s's blocks' value(option) times their (fractional) counts."""
        out: Lin = {}
        for k, vs in self.y[s].items():
            for v, o in zip(vs, self.t.kinds[k].options, strict=True):
                out[v] = value(o)
        if fixed:
            for name in _fixed(self.t, s):
                for v, o in zip(self.z[name], self.t.kinds[name].options, strict=True):
                    out[v] = value(o)
        return out

    def _layers(self, s: int, value: Any) -> Lin:
        """Stage s's layers' value(kind) times their (fractional) counts."""
        return {v: value(self.t.kinds[k]) for k, vs in self.y[s].items() for v in vs}

    # -- the model ---------------------------------------------------------------------
    def _prims(self) -> dict[Prim, Lin]:
        """Every stage's quantities as ``costs.quantities`` states them, over fractional
        counts (``_StageLin``)."""
        out: dict[Prim, Lin] = {}
        for s in range(self.t.config.stages):
            for key, lin in stage_quantities(_StageLin(self, s), self.t.comm[s]).items():
                out[(key, s)] = lin
        return out

    def _memory(self, cap: float) -> None:
        """Each rank's memory at every level its op order passes through, within the cap
        (rows in GiB). Relaxed: the recompute's rebuilt tensors and ZeRO-3's gathered copy
        are left out."""
        d = _RankLin(self)
        for r, order in enumerate(self.orders):
            static = ranks.held(d, self.t, r, order)
            for level, _ in ranks.levels(d, order):
                self._row(_scale(_plus(static, level), 1 / GiB), -math.inf, cap / GiB)

    def _optimizer(self, r: int) -> Lin:
        return ranks.optimizer(_RankLin(self), self.t, r, self.orders[r])

    def _compact(self) -> None:
        """Each stage's quantities as one matrix over the stage's variables, so a chain's
        row is a few small products rather than a sum of dictionaries."""
        by_stage: dict[int, list[Prim]] = {}
        for p in self.prim:
            by_stage.setdefault(p[1], []).append(p)
        self.stage_vars: dict[int, list[int]] = {}
        self.stage_rows: dict[int, tuple[dict[str, int], np.ndarray, np.ndarray]] = {}
        for stage, names in by_stage.items():
            cols = sorted({i for p in names for i in self.prim[p] if i >= 0})
            where = {i: j for j, i in enumerate(cols)}
            matrix = np.zeros((len(names), len(cols)))
            const = np.zeros(len(names))
            for row, p in enumerate(names):
                for i, x in self.prim[p].items():
                    if i >= 0:
                        matrix[row, where[i]] = x
                    else:
                        const[row] = x
            self.stage_vars[stage] = cols
            self.stage_rows[stage] = ({p[0]: r for r, p in enumerate(names)}, matrix, const)

    def _task_weights(self, key: Any) -> list[tuple[int, np.ndarray]]:
        """A task's first term (its compute and what runs in series with it:
        ``costs.overlap.task_terms``) as a weight on each stage's quantities."""
        if key not in self.task_cache:
            weights: dict[int, np.ndarray] = {}
            for p, k in task_terms(key, self.overlap)[0].coeffs:
                index, matrix, _ = self.stage_rows[p[1]]
                weights.setdefault(p[1], np.zeros(matrix.shape[0]))[index[p[0]]] += k
            self.task_cache[key] = list(weights.items())
        return self.task_cache[key]

    def add_forms(self, forms: list[Form]) -> None:
        """step >= each chain, every task in it at least its first term."""
        for form in forms:
            weights: dict[int, np.ndarray] = {}
            lin: Lin = {self.step: 1.0}
            for key, c in form.items():
                if key[0] == "task":
                    for stage, w in self._task_weights(key[1]):
                        if stage in weights:
                            weights[stage] += c * w
                        else:
                            weights[stage] = c * w
                elif key[0] == "prim":
                    index, matrix, _ = self.stage_rows[key[1][1]]
                    w = weights.setdefault(key[1][1], np.zeros(matrix.shape[0]))
                    w[index[key[1][0]]] += c
                else:
                    _add_into(lin, self._optimizer(key[1]), -c)
            for stage, w in weights.items():
                _, matrix, const = self.stage_rows[stage]
                row = w @ matrix
                for i, x in zip(self.stage_vars[stage], row.tolist(), strict=True):
                    lin[i] = lin.get(i, 0.0) - x
                lin[-1] = lin.get(-1, 0.0) - float(w @ const)
            self._row(lin, 0.0, math.inf)
            self.nonzeros += len(lin)

    def chains(self, counts: list[int]) -> list[Form]:
        """The timeline's chains for ``counts`` layers per stage, every block at its first
        option: the relaxation's own quantities at that point (no layout is built)."""
        point: dict[int, float] = {-1: 1.0}
        start = 0
        for s, n in enumerate(counts):
            for k in self.t.layer_kinds[start : start + n]:
                first = self.y[s][k][0]
                point[first] = point.get(first, 0.0) + 1
            start += n
        for vs in self.z.values():
            point[vs[0]] = 1.0

        def at(lin: Lin) -> float:
            return sum(c * point.get(i, 0.0) for i, c in lin.items())

        run = run_values(
            self.t.config,
            {p: at(lin) for p, lin in self.prim.items()},
            [at(self._optimizer(r)) for r in range(self.t.config.pp)],
            num_microbatches=self.t.config.num_microbatches,
            overlap=self.overlap,
            detail=False,
        )
        return run.forms

    def solve(self) -> float | None:
        status = self.s.Solve()
        if status == pywraplp.Solver.INFEASIBLE:
            return None
        if status != pywraplp.Solver.OPTIMAL:
            return math.nan
        return float(self.s.Objective().Value())

    def counts(self) -> list[int] | None:
        """Layers per stage, rounded to whole layers that add up (largest remainders), every
        stage but the first and last keeping one."""
        S = self.t.config.stages
        frac = [
            sum(self.vars[v].solution_value() for vs in self.y[s].values() for v in vs)
            for s in range(S)
        ]
        total = len(self.t.layer_kinds)
        low = [1 if 0 < s < S - 1 else 0 for s in range(S)]
        base = [max(lo, math.floor(f + 1e-9)) for f, lo in zip(frac, low, strict=True)]
        while sum(base) > total:
            i = max((s for s in range(S) if base[s] > low[s]), key=lambda s: base[s] - frac[s])
            base[i] -= 1
        while sum(base) < total:
            i = max(range(S), key=lambda s: frac[s] - base[s])
            base[i] += 1
        return base if sum(base) == total else None


def _scale(lin: Lin, c: float) -> Lin:
    return {i: c * x for i, x in lin.items()}


def _add_into(lin: Lin, other: Lin, c: float) -> None:
    """lin += c * other, in place."""
    for i, x in other.items():
        lin[i] = lin.get(i, 0.0) + c * x


def _plus(a: Lin, b: Lin) -> Lin:
    out = dict(a)
    for i, x in b.items():
        out[i] = out.get(i, 0.0) + x
    return out


class _StageLin:
    """The relaxation's domain of one stage's quantities (``costs.quantities.Domain``):
    sums over fractional counts, in seconds. It relaxes one thing more: whether the stage
    holds routed experts is not stated, so their collectives' latencies are left out."""

    def __init__(self, lp: _Lp, s: int) -> None:
        self.lp, self.s = lp, s

    def blocks(self, seconds: Callable[[Row], float]) -> Lin:
        return self.lp._sum(self.s, lambda o: seconds(o.row))

    def count(self, number: Callable[[Row], int]) -> Lin:
        return self.lp._sum(self.s, lambda o: number(o.row))

    def per(self, count: Lin, seconds: float) -> Lin:
        return _scale(count, seconds)

    def const(self, seconds: float) -> Lin:
        return {-1: seconds}

    def over_bytes(self, kind: Bytes, per_byte: float) -> Lin:
        lin = _scale(self.lp._layers(self.s, lambda k: k.nbytes[kind]), per_byte)
        lin[-1] = lin.get(-1, 0.0) + per_byte * self.lp.t.fixed_bytes[self.s][kind]
        return lin

    def if_expert(self, seconds: float) -> Lin:
        return {}

    def add(self, a: Lin, b: Lin) -> Lin:
        return _plus(a, b)


class _RankLin:
    """The relaxation's domain of a rank's sums (``planner.solve.ranks.RankDomain``): over
    fractional counts, in seconds and bytes."""

    def __init__(self, lp: _Lp) -> None:
        self.lp = lp

    def layers(self, stage: int, value: Callable[[Kind], float], unit: ranks.Unit) -> Lin:
        return self.lp._layers(stage, value)

    def blocks(self, stage: int, value: Callable[[Option], float], unit: ranks.Unit) -> Lin:
        return self.lp._sum(stage, value)

    def const(self, value: float, unit: ranks.Unit) -> Lin:
        return {-1: value}

    def add(self, a: Lin, b: Lin) -> Lin:
        return _plus(a, b)

    def scale(self, x: Lin, n: int) -> Lin:
        return _scale(x, n)
