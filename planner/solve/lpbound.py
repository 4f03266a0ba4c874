"""A lower bound on a configuration's step time from the linear relaxation of its model.

The step time is the longest chain of tasks through the ranks' op orders
(``planner.timeline``); each chain's length is a sum of task lengths, and each task's length
the largest of a few sums of per-stage quantities (``planner.costs.overlap``). This bound
states that over fractional layers: how many layers of each kind each stage holds, and how
many of them take each recompute option, may be any non-negative numbers that add up
(every stage but the first and last holds at least one layer), each rank's memory at every
activation level its op order passes through stays within the cap (its state, its chunks'
saved bytes times the micro-batches in flight, the buffers, what the backward rebuilds
there; see below), and the step is at least every chain of tasks the timeline reports for
the points tried. Each of those relaxes the CP-SAT model (``planner.solve.model``) or drops
a chain from it, so the optimum is at most the step time of every layout of the
configuration.

The chains: those of the schedule's shape (``timeline.shape_forms``) and of the even
partition; then, round by round, those the timeline takes at a query point near the
relaxation's own optimum (fractional counts and options: each task's length the largest of
its terms there, each rank's end its longest path; ``_rounds``) and at its rounding, until a
round finds none new, the bound meets the least step of a point queried, or the rounds
(``ROUNDS``, fewer on long steps) are done. A chain is a valid row whatever the point it
came from, so the bound holds after any round; the rounds only raise it, towards the longest
path over all layouts of fractional layers (the pipeline's waits between uneven chunks
included), where the shape's chains alone see only a few layouts' paths.

Memory rows hold, beside the level, what the chunk whose backward runs there rebuilds above
it (the CP-SAT model's terms): each fixed block's rebuilt bytes, less what the fixed blocks
after it saved; under one recompute choice (below), that choice's on every chunk sure to hold
a layer (every stage but the first and last; a lone stage). Under ZeRO-3 the gathered copy
of the largest block the rank surely holds, twice. A layer's rebuild under a mix of choices,
and ZeRO-3's resident gathered weights, are left out.

One recompute choice for every layer (``one_choice``: what a target launcher states): the
bound is the least over the choices of the relaxation with every layer at that choice,
which a fractional mix of choices would otherwise undercut (a mix may fit where no single
choice does).

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
from planner.solve.bounds import bound_tables, choice_bounds
from planner.solve.budget import order_size, relaxation_seconds
from planner.solve.tables import (
    Config,
    Kind,
    Option,
    Tables,
    even_counts,
    layer_choices,
    rank_orders,
)
from planner.specs import ClusterSpec, ModelSpec, TrainingJob
from planner.timeline import Form, program, run_values, shape_forms

ROUNDS = 16  # relaxations solved, each with the chains of the last one's point and rounding

ROUND_OPS = 24_000  # rounds past the first take at most this over the step's ops

DAG_OPS = 3_000  # the largest step (ops of all ranks' orders) whose every task gets a start


Lin = dict[int, float]  # variable index -> coefficient; index -1 holds the constant
GiB = float(2**30)  # memory rows are stated in GiB, near the time rows' magnitudes


def lp_bound(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    config: Config,
    *,
    one_choice: bool = False,
    cutoff: float = math.inf,
    deep: bool = True,
) -> float | None:
    """A step time no layout of ``config`` beats (``math.inf`` when none fits memory), or
    None when the configuration has no tables. ``one_choice``: only layouts whose layers all
    take one recompute choice count (a target launcher's rule). ``cutoff``: a step the
    caller needs the bound to reach (its best layout's): a choice's rounds stop once its
    bound reaches it, so a bound at or past the cutoff may be less tight than it could be.
    ``deep``: the rounds of chains at the relaxation's own points and, on short steps, every
    task's start; without, the chains of the shape and of the even partition alone (one
    solve per choice: a cheaper, weaker bound)."""
    out = _relaxation(model, cluster, job, config, one_choice, cutoff, deep)
    return None if out is None else out[0]


def charged_bound(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    config: Config,
    *,
    one_choice: bool = False,
    cutoff: float = math.inf,
    deep: bool = True,
) -> tuple[float | None, float]:
    """``lp_bound``, and its deterministic charge from the work it did
    (``budget.relaxation_seconds``; without ``one_choice``, ``lp_counts``'s too)."""
    out = _relaxation(model, cluster, job, config, one_choice, cutoff, deep)
    return (None, relaxation_seconds(0, 0, 0, 0)) if out is None else (out[0], out[2])


def lp_counts(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> list[int] | None:
    """Layers per stage of the relaxation's optimum, rounded: a starting point."""
    out = _relaxation(model, cluster, job, config, False, math.inf, True)
    return None if out is None else out[1]


def choice_bound(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config, choice: str
) -> float | None:
    """``lp_bound`` over the layouts whose layers all take recompute ``choice`` (``math.inf``
    when none fits memory, or the choice is not every layer kind's); None when the
    configuration has no tables."""
    t = bound_tables(model, cluster, job, config)
    if t is None or any(not k.options for k in t.kinds.values()):
        return None
    if choice not in layer_choices(t):
        return math.inf
    lp, seen = _built(t, config, memory_cap(cluster, job), True)
    lp.choose(choice)
    return _rounds(lp, model, config, seen, math.inf, True)[0]


_RELAXED: Memo[tuple[float, list[int] | None, float] | None] = Memo(
    "lpbound.relaxation", limit=4096
)


def _relaxation(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    config: Config,
    one_choice: bool,
    cutoff: float,
    deep: bool,
) -> tuple[float, list[int] | None, float] | None:
    key = (model, cluster.model_dump_json(), job, config.key(), one_choice, cutoff, deep)
    return _RELAXED.get(key, lambda: _least(model, cluster, job, config, one_choice, cutoff, deep))


def _least(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    config: Config,
    one_choice: bool,
    cutoff: float,
    deep: bool,
) -> tuple[float, list[int] | None, float] | None:
    """The relaxation, or under one recompute choice the least of each choice's: one model,
    each choice set by its variables' bounds, every chain found under one kept for the
    next (a chain holds whatever the choice). A choice's rounds stop once its bound reaches
    ``cutoff`` (see ``lp_bound``)."""
    t = bound_tables(model, cluster, job, config)
    if t is None or any(not k.options for k in t.kinds.values()):
        return None
    lp, seen = _built(t, config, memory_cap(cluster, job), deep)
    if not one_choice:
        return (*_rounds(lp, model, config, seen, cutoff, deep), lp.work())
    # Each choice's cheap bound (``bounds.choice_bounds``; absent: it cannot fit) orders
    # them; rounds only raise a choice's bound, so one whose cheap bound is already no less
    # than the least found cannot lower it.
    cheap = choice_bounds(model, cluster, job, config)
    best: tuple[float, list[int] | None] = (math.inf, None)
    for value, choice in sorted((v, c) for c, v in cheap.items()):
        if value >= best[0]:
            break
        lp.choose(choice)
        out = _rounds(lp, model, config, seen, cutoff, deep)
        if out[0] < best[0]:
            best = out
    return (*best, lp.work())


def _built(t: Tables, config: Config, cap: float, deep: bool) -> tuple[_Lp, list[Form]]:
    """The relaxation's model (each rank's allocated bytes within ``cap``) with the chains
    of the schedule's shape (and, ``deep``, on a short step every task's start)."""
    orders = rank_orders(config.schedule, config.pp, config.num_microbatches, config.virtual_stages)
    lp = _Lp(t, orders, cap, starts=deep)
    seen = list(
        shape_forms(config.schedule, config.pp, config.num_microbatches, config.virtual_stages)
    )
    lp.add_forms(seen)
    return lp, seen


def _rounds(
    lp: _Lp, model: ModelSpec, config: Config, seen: list[Form], cutoff: float, deep: bool
) -> tuple[float, list[int] | None]:
    """The relaxation's bound under its current choice (``math.inf`` when nothing fits), with
    the chains of the even partition, then those of each round's query point and rounding
    (see the module docstring), and its rounded counts; ``seen`` grows with the chains
    added.

    The query point is halfway between the relaxation's optimum and the point whose step
    was the least so far (an in-out stabilisation: cuts at the optimum alone swing from one
    extreme layout to another); where it gives no new chain, the optimum itself is queried.
    The least step of any point queried bounds the relaxation's limit from above, so the
    rounds stop once the bound reaches it, or ``cutoff``. Without ``deep``, one solve."""
    counts: list[int] | None = even_counts(model, config)
    center: dict[int, float] | None = None
    least = math.inf
    found: list[Form] = []
    if counts:
        center = lp.point(counts)
        found, least = lp.chains_at(center)
    bound, best = 0.0, None
    rounds = max(2, min(ROUNDS, ROUND_OPS // order_size(config))) if deep else 1
    for _ in range(rounds):
        new = [f for f in found if f not in seen]
        seen += new
        lp.add_forms(new)
        value = lp.solve()
        if value is None:
            return math.inf, None
        if math.isnan(value):  # no proof either way: keep what the earlier rounds proved
            break
        bound, rounded = max(bound, value), lp.counts()
        best = rounded if rounded is not None else best
        if bound >= min(least * (1 - 1e-6), cutoff):
            break  # the relaxation's limit, or the step the caller needs, is reached
        optimum = lp.point(None)
        queries = [_between(optimum, center), optimum] if center is not None else [optimum]
        if rounded not in (None, counts):
            queries.append(lp.point(rounded))
        counts = rounded
        found = []
        for query in queries:
            forms, step = lp.chains_at(query)
            if step < least:
                center, least = query, step
            found += [f for f in forms if f not in seen and f not in found]
            if found and query is not queries[-1] and query is not optimum:
                break  # the stabilised point cut: the optimum is not needed this round
        if not found:
            break
    return bound, best


def _between(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    """The point halfway between two points."""
    return {i: 0.5 * a.get(i, 0.0) + 0.5 * b.get(i, 0.0) for i in a.keys() | b.keys()}


def _fixed(t: Tables, s: int) -> list[str]:
    S = t.config.stages
    return (t.first_fixed if s == 0 else []) + (t.last_fixed if s == S - 1 else [])


class _Lp:
    """The relaxation (see the module docstring), built with sparse rows."""

    def __init__(self, t: Tables, orders: list[Any], cap: float, *, starts: bool = True):
        self.t, self.orders = t, orders
        self.overlap = t.overlap
        self.s = pywraplp.Solver.CreateSolver("GLOP")
        assert self.s is not None
        self.vars: list[Any] = []
        # Deterministic measures of the work done (``work``): nonzeros set, nonzeros in the
        # model at each solve, ops of the timeline runs, pivots times nonzeros.
        self.nonzeros = self.solved = self.run_ops = self.pivots = 0
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
        # Each layer kind's option the chains take: its first, or the one choice.
        self.pick = {k: 0 for k in kinds}
        # Per recompute choice every layer kind has, a switch held at 1 while it is the one
        # choice (0 otherwise): the layers' rebuild rows are scaled by it (``choose``).
        self.switch = {name: self._var(0.0) for name in layer_choices(t)}
        self._compact()
        self.lengths: dict[Any, int] = {}  # task key -> its length's variable
        self._memory(cap)
        self.step = self._var(math.inf)
        self.s.Objective().SetCoefficient(self.vars[self.step], 1.0)
        self.s.Objective().SetMinimization()
        if starts and t.config.pp > 1 and order_size(t.config) <= DAG_OPS:
            self._starts()

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
                self.nonzeros += 1

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

    def choose(self, choice: str | None) -> None:
        """Every layer at recompute ``choice`` (None: any mix), by the variables' bounds."""
        kinds = dict.fromkeys(self.t.layer_kinds)
        for k in kinds:
            names = [o.name for o in self.t.kinds[k].options]
            self.pick[k] = 0 if choice is None else names.index(choice)
            for s in range(self.t.config.stages):
                for i, v in enumerate(self.y[s][k]):
                    allowed = choice is None or i == self.pick[k]
                    self.vars[v].SetUb(self.s.infinity() if allowed else 0.0)
        for name, v in self.switch.items():
            on = float(name == choice)
            self.vars[v].SetBounds(on, on)

    def _memory(self, cap: float) -> None:
        """Each rank's memory at every level its op order passes through, within the cap
        (rows in GiB): what it holds, the level, and what the chunk whose backward runs
        there rebuilds above it (``_rebuild``). Relaxed: a layer's rebuild counts only under
        one recompute choice and on a chunk sure to hold a layer; of ZeRO-3's gathered copy
        only the largest block the rank surely holds, twice (the CP-SAT model's floor of it)."""
        d = _RankLin(self)
        t = self.t
        for r, order in enumerate(self.orders):
            static = ranks.held(d, t, r, order)
            if t.config.zero >= 3:
                static = _plus(static, {-1: 2 * self._surely_held(order.chunks)})
            rebuild = {c: self._rebuild(c) for c in order.chunks}
            for level, rb in ranks.levels(d, order):
                row = _plus(static, level)
                above = rebuild[rb] if rb is not None else None
                if above is not None:
                    row = _plus(row, {above: 1.0})
                self._row(_scale(row, 1 / GiB), -math.inf, cap / GiB)

    def _sure(self, s: int) -> bool:
        """Whether stage s holds a layer in every layout (every stage but the first and
        last holds one; a lone stage holds them all)."""
        S = self.t.config.stages
        return S == 1 or 0 < s < S - 1

    def _surely_held(self, chunks: list[int]) -> float:
        """The largest gathered weights (ZeRO-3's working copy) of a block the rank holds in
        every layout: its fixed blocks, and a layer kind on a chunk sure to hold a layer
        when the model has one kind of layer."""
        t = self.t
        sizes = [t.kinds[n].shard_weight for c in chunks for n in _fixed(t, c)]
        kinds = set(t.layer_kinds)
        if len(kinds) == 1 and any(self._sure(c) for c in chunks):
            sizes.append(t.kinds[next(iter(kinds))].shard_weight)
        return max(sizes, default=0.0)

    def _saved_by(self, names: list[str]) -> Lin:
        """Saved bytes of fixed blocks, by their (fractional) options."""
        out: Lin = {}
        for n in names:
            for v, o in zip(self.z[n], self.t.kinds[n].options, strict=True):
                if o.saved:
                    out[v] = out.get(v, 0.0) + o.saved
        return out

    def _rebuild(self, c: int) -> int | None:
        """A variable at least what chunk c's backward rebuilds above its level (the CP-SAT
        model's terms, ``StageModel._memory``): each fixed block's rebuilt bytes less those
        the fixed blocks after it saved; under one recompute choice, on a chunk sure to hold
        a layer, that choice's less what the chunk's closing fixed blocks saved. None when
        there is nothing to rebuild."""
        t = self.t
        fixed = _fixed(t, c)
        tail = [n for n in fixed if n in t.last_fixed]
        rows: list[Lin] = []
        if self._sure(c):
            for name, switch in self.switch.items():
                layer = max(
                    next(o.rebuilt for o in t.kinds[k].options if o.name == name) for k in self.y[c]
                )
                if layer:
                    rows.append(_plus({switch: layer}, _scale(self._saved_by(tail), -1.0)))
        for n in fixed:
            later = tail[tail.index(n) + 1 :] if n in tail else tail
            rebuilt = {
                v: o.rebuilt
                for v, o in zip(self.z[n], t.kinds[n].options, strict=True)
                if o.rebuilt
            }
            if rebuilt:
                rows.append(_plus(rebuilt, _scale(self._saved_by(later), -1.0)))
        if not rows:
            return None
        v = self._var(math.inf)
        for lin in rows:
            self._row(_plus({v: 1.0}, _scale(lin, -1.0)), 0.0, math.inf)
        return v

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

    def _weighted(self, coeffs: Any) -> Lin:
        """``sum(c * prim)`` over ``(prim, c)`` pairs, over the stages' variables."""
        weights: dict[int, np.ndarray] = {}
        for p, c in coeffs:
            index, matrix, _ = self.stage_rows[p[1]]
            weights.setdefault(p[1], np.zeros(matrix.shape[0]))[index[p[0]]] += c
        lin: Lin = {}
        for stage, w in weights.items():
            _, matrix, const = self.stage_rows[stage]
            row = w @ matrix
            for i, x in zip(self.stage_vars[stage], row.tolist(), strict=True):
                if x:
                    lin[i] = lin.get(i, 0.0) + x
            lin[-1] = lin.get(-1, 0.0) + float(w @ const)
        return lin

    def _length(self, key: Any) -> int:
        """A variable at least each of the task's terms (``costs.overlap.task_terms``): its
        length, as the timeline takes it, the largest of them."""
        if key not in self.lengths:
            v = self.lengths[key] = self._var(math.inf)
            for term in task_terms(key, self.overlap):
                self._row(_plus({v: 1.0}, _scale(self._weighted(term.coeffs), -1.0)), 0, math.inf)
        return self.lengths[key]

    def _starts(self) -> None:
        """The program's longest path over the counts: a start per task, at least each
        predecessor's start plus its length plus the send it waits for (where sends are
        asynchronous), and the step at least each rank's last end plus its optimizer step
        (``timeline.run_values``, row for row)."""
        config = self.t.config
        prog = program(config.schedule, config.pp, config.num_microbatches, config.virtual_stages)
        start = [self._var(math.inf) for _ in prog.key]
        for g in prog.topo:
            for p, send in zip(prog.preds[g], prog.sends[g], strict=True):
                lin = {start[g]: 1.0, start[p]: -1.0, self._length(prog.key[p]): -1.0}
                if send is not None and self.overlap.async_sends:
                    _add_into(lin, self._weighted([(send, 1.0)]), -1.0)
                self._row(lin, 0.0, math.inf)
        for r, tasks in enumerate(prog.by_rank):
            last = tasks[-1]
            lin = {self.step: 1.0, start[last]: -1.0, self._length(prog.key[last]): -1.0}
            _add_into(lin, self._optimizer(r), -1.0)
            self._row(lin, 0.0, math.inf)

    def add_forms(self, forms: list[Form]) -> None:
        """step >= each chain, every task in it at least the largest of its terms."""
        for form in forms:
            lin: Lin = {self.step: 1.0}
            prims = []
            for key, c in form.items():
                if key[0] == "task":
                    v = self._length(key[1])
                    lin[v] = lin.get(v, 0.0) - c
                elif key[0] == "prim":
                    prims.append((key[1], c))
                else:
                    _add_into(lin, self._optimizer(key[1]), -c)
            _add_into(lin, self._weighted(prims), -1.0)
            self._row(lin, 0.0, math.inf)

    def point(self, counts: list[int] | None) -> dict[int, float]:
        """A point of the relaxation's space: ``counts`` layers per stage, every layer at
        its first option (the one choice, under one), every fixed block at its first; or,
        for None, the relaxation's own optimum (fractional counts and options)."""
        point: dict[int, float] = {-1: 1.0}
        if counts is None:
            for i, var in enumerate(self.vars):
                value = var.solution_value()
                if value:
                    point[i] = value
            return point
        start = 0
        for s, n in enumerate(counts):
            for k in self.t.layer_kinds[start : start + n]:
                first = self.y[s][k][self.pick[k]]
                point[first] = point.get(first, 0.0) + 1
            start += n
        for vs in self.z.values():
            point[vs[0]] = 1.0
        return point

    def chains_at(self, point: dict[int, float]) -> tuple[list[Form], float]:
        """The timeline's chains, and its step, with the relaxation's quantities at
        ``point`` (no layout is built)."""

        def at(lin: Lin) -> float:
            return sum(c * point.get(i, 0.0) for i, c in lin.items())

        self.run_ops += order_size(self.t.config)
        run = run_values(
            self.t.config,
            {p: at(lin) for p, lin in self.prim.items()},
            [at(self._optimizer(r)) for r in range(self.t.config.pp)],
            num_microbatches=self.t.config.num_microbatches,
            overlap=self.overlap,
            detail=False,
        )
        return run.forms, run.step_s

    def work(self) -> float:
        """The charge for what was done so far (``budget.relaxation_seconds``)."""
        return relaxation_seconds(self.nonzeros, self.solved, self.run_ops, self.pivots)

    def solve(self) -> float | None:
        self.solved += self.nonzeros
        status = self.s.Solve()
        self.pivots += self.s.iterations() * self.nonzeros  # the last solve's pivots
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
