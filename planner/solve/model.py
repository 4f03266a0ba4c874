"""The CP-SAT model of one ``Config``: stage boundaries and recompute, minimising step time.

Decisions: where each stage starts (an integer per stage; the count of each layer kind in a
stage comes from prefix-count tables by element constraints), how many layers of each kind in
each stage take each recompute option, and the option of each embedding / MTP / head block.

The objective is the step time of ``planner.timeline``: the largest over a set of *forms*,
each the length of one chain of tasks and transfers (``Timeline.forms``), a sum of task
lengths and per-stage quantities. A task's length is the largest of its terms
(``planner.costs.overlap.task_terms``), stated here as ``>=`` constraints on one variable per
task kind (every form counts tasks positively, so minimising never inflates one). Which
chains bind depends on the layout, so the search adds forms as it meets layouts
(``add_forms``): with a subset of the forms the optimum is a lower bound on every layout's
real step time, and it is that step time once the forms of the layout it picks are in.
Memory per rank is ``planner.costs.memory``'s buckets with the activation peak taken over
every level the rank's op order passes through.

Symmetry: there is none left to break, by construction. Layers are not assigned one by one
(where every permutation of a stage's equal layers among its options would be a separate,
equal solution for the search to refute): a stage is a contiguous range given by its start,
starts are ordered by constraint, and recompute is a count of a stage's layers of each kind
taking each option, so one layout is one assignment. Options that tie on everything the model
reads are merged when the tables are built (``tables._undominated`` keeps the first), so no
two values of a count describe one layout either. Between configurations, ZeRO stages that
shard nothing are dropped before any model is built (``space.enumerate_configs``).

Resolution: times are integers of ``UNIT`` seconds (each block's time rounds to the nearest
unit); bytes are exact integers (rounded up).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ortools.sat.python import cp_model

from planner.costs.cap import memory_cap
from planner.costs.overlap import TaskKey, Term, task_terms
from planner.costs.quantities import Bytes, Prim, Row, stage_quantities
from planner.frameworks import framework
from planner.solve import ranks
from planner.solve.tables import Kind, Option, Tables, layer_choices
from planner.specs import DTYPE_BYTES, ClusterSpec, TrainingJob
from planner.timeline import Form

UNIT = 1e-6  # seconds per time unit
KIB = 1024  # bytes per memory unit

Expr = Any  # cp_model linear expression


def q(seconds: float) -> int:
    """Seconds as whole time units."""
    return round(seconds / UNIT)


@dataclass
class Solution:
    status: str  # "optimal" | "feasible" | "infeasible" | "unknown"
    counts: list[int]  # layers per stage
    recompute: dict[str, str]  # block name -> recompute option
    objective_s: float
    bound_s: float
    work: float = 0.0  # CP-SAT deterministic time spent
    values: list[int] | None = None  # every variable's value, to warm-start a re-solve


class StageModel:
    """Variables and constraints for one config (see the module docstring)."""

    def __init__(self, t: Tables, cluster: ClusterSpec, job: TrainingJob) -> None:
        self.t, self.cluster, self.job = t, cluster, job
        self.m = cp_model.CpModel()
        self.S = t.config.stages
        self.L = len(t.layer_kinds)
        self._boundaries()
        self._recompute()
        self._stage_terms()
        self._op_times()
        self._memory()
        self._objective()
        self.base_vars = len(self.m.proto.variables)

    # -- decisions ---------------------------------------------------------------------
    def _boundaries(self) -> None:
        """start[s]: first layer of stage s; per kind, layers before x by an element table."""
        m, S, L = self.m, self.S, self.L
        self.start = [m.new_int_var(0, L, f"stage_start[{s}]") for s in range(S + 1)]
        m.add(self.start[0] == 0)
        m.add(self.start[S] == L)
        for s in range(S):
            middle = 0 < s < S - 1
            m.add(self.start[s + 1] >= self.start[s] + (1 if middle else 0))
        kinds = sorted(set(self.t.layer_kinds))
        self.kinds = kinds
        self.n: list[dict[str, Any]] = []
        prefix: dict[str, list[Any]] = {}
        for k in kinds:
            table = [0]
            for lk in self.t.layer_kinds:
                table.append(table[-1] + (lk == k))
            prefix[k] = []
            for s in range(S + 1):
                v = m.new_int_var(0, table[-1], f"prefix[{k}][{s}]")
                m.add_element(self.start[s], table, v)
                prefix[k].append(v)
        for s in range(S):
            self.n.append({k: prefix[k][s + 1] - prefix[k][s] for k in kinds})

    def _recompute(self) -> None:
        """r[s][kind][option]: layers of a kind in a stage taking an option; fixed blocks
        (embedding, MTP, head) pick one option each."""
        m = self.m
        self.r: list[dict[str, list[Any]]] = []
        self.present: list[dict[str, list[Any]]] = []
        for s in range(self.S):
            rs: dict[str, list[Any]] = {}
            ps: dict[str, list[Any]] = {}
            for k in self.kinds:
                opts = self.t.kinds[k].options
                rs[k] = [m.new_int_var(0, self.L, f"r[{s}][{k}][{o.name}]") for o in opts]
                m.add(sum(rs[k]) == self.n[s][k])
                ps[k] = []
                for i, o in enumerate(opts):
                    b = m.new_bool_var(f"present[{s}][{k}][{o.name}]")
                    m.add(rs[k][i] <= self.L * b)
                    m.add(rs[k][i] >= b)
                    ps[k].append(b)
            self.r.append(rs)
            self.present.append(ps)
        self.x: dict[str, list[Any]] = {}
        for name in self.t.first_fixed + self.t.last_fixed:
            opts = self.t.kinds[name].options
            self.x[name] = [m.new_bool_var(f"x[{name}][{o.name}]") for o in opts]
            m.add_exactly_one(self.x[name])
        self.has_layers = []
        for s in range(self.S):
            self.has_layers.append(
                {k: self._any(self.n[s][k], f"has[{s}][{k}]") for k in self.kinds}
            )

    def _fixed_of(self, s: int) -> list[str]:
        out = []
        if s == 0:
            out += self.t.first_fixed
        if s == self.S - 1:
            out += self.t.last_fixed
        return out

    def _sum(self, s: int, value: Any) -> Expr:
        """Sum over the stage's blocks of value(option) (layers by counts, fixed by choice)."""
        terms = []
        for k in self.kinds:
            for var, o in zip(self.r[s][k], self.t.kinds[k].options, strict=True):
                c = value(o)
                if c:
                    terms.append(c * var)
        for name in self._fixed_of(s):
            for var, o in zip(self.x[name], self.t.kinds[name].options, strict=True):
                c = value(o)
                if c:
                    terms.append(c * var)
        return sum(terms) if terms else 0

    def _layers(self, s: int, value: Any) -> Expr:
        """Sum over the stage's layers of value(kind) (choice-independent quantities)."""
        terms = [
            value(self.t.kinds[k]) * self.n[s][k] for k in self.kinds if value(self.t.kinds[k])
        ]
        return sum(terms) if terms else 0

    def _any(self, count: Expr, name: str) -> Any:
        b = self.m.new_bool_var(name)
        self.m.add(count >= 1).only_enforce_if(b)
        self.m.add(count == 0).only_enforce_if(b.negated())
        return b

    # -- stage quantities ------------------------------------------------------------
    def _stage_terms(self) -> None:
        """Every per-stage quantity the task terms name, as ``costs.quantities`` states
        them, over this model's variables (``_StageExpr``) in time units."""
        t = self.t
        self.prim: dict[Prim, Expr] = {}
        self.has_expert: list[Any] = []
        for s in range(self.S):
            self.has_expert.append(self._has_expert(s, t.fixed_bytes[s][Bytes.EXPERT_GRAD]))
            for key, expr in stage_quantities(_StageExpr(self, s), t.comm[s]).items():
                self.prim[(key, s)] = expr

    def _has_expert(self, s: int, fixed_expert: float) -> Any:
        if fixed_expert > 0:
            return True
        moe = [k for k in self.kinds if k.startswith("moe")]
        if not moe:
            return False
        if len(moe) == 1:
            return self.has_layers[s][moe[0]]
        has = self.m.new_bool_var(f"has_expert[{s}]")
        self.m.add_max_equality(has, [self.has_layers[s][k] for k in moe])
        return has

    # -- task lengths ------------------------------------------------------------------
    def _op_times(self) -> None:
        """Task lengths are created on first use (``task``); an hour bounds them."""
        self._tasks: dict[TaskKey, Any] = {}
        self.hi = q(3600.0)
        self.overlap = self.t.overlap

    def task(self, key: TaskKey) -> Any:
        """The length of one task kind: at least each of its terms."""
        if key in self._tasks:
            return self._tasks[key]
        v = self.m.new_int_var(0, self.hi, f"task{key}")
        for term in task_terms(key, self.overlap):
            self._at_least(v, term)
        self._tasks[key] = v
        return v

    def _at_least(self, v: Any, term: Term) -> None:
        """``v >= term``, scaled to integer coefficients (exact for the shares used)."""
        fracs = [(p, Fraction(c).limit_denominator(10_000)) for p, c in term.coeffs if c]
        if not fracs:
            return
        scale = math.lcm(*(f.denominator for _, f in fracs))
        rhs = sum(int(f * scale) * self.prim[p] for p, f in fracs)
        self.m.add(scale * v >= rhs)

    # -- memory ------------------------------------------------------------------------
    def _memory(self) -> None:
        t, m, job = self.t, self.m, self.job
        usable = math.floor(memory_cap(self.cluster, job) / KIB)
        d = _RankExpr(self)
        for r, rank in enumerate(t.ranks):
            chunks = rank.chunks
            static = ranks.held(d, t, r, rank)
            # What a backward rebuilds above the chunk's level: a block's rebuilt bytes less
            # those the blocks after it have freed (costs.activations.rebuild_peak). Only the fixed
            # blocks that close the last stage (MTP, head) are counted as after a layer: exact
            # when a chunk's most-rebuilding layer is its last (every layer of a chunk taking
            # one choice), and never below the exact term otherwise.
            rebuild = {}
            for c in chunks:
                v = m.new_int_var(0, 2**40, f"rebuild[{c}]")
                fixed = self._fixed_of(c)
                tail = [n for n in fixed if n in t.last_fixed]
                for k in self.kinds:
                    for b, o in zip(self.present[c][k], t.kinds[k].options, strict=True):
                        if o.rebuilt:
                            m.add(v >= _ceil(o.rebuilt) * b - self._saved_by(tail))
                for name in fixed:
                    later = tail[tail.index(name) + 1 :] if name in tail else tail
                    for b, o in zip(self.x[name], t.kinds[name].options, strict=True):
                        if o.rebuilt:
                            m.add(v >= _ceil(o.rebuilt) * b - self._saved_by(later))
                rebuild[c] = v
            act = m.new_int_var(0, 2**40, f"activations[{r}]")
            for level, rb in ranks.levels(d, rank):
                m.add(act >= level + (rebuild[rb] if rb is not None else 0))
            extra: Expr = 0
            if t.config.zero >= 3:  # the gathered working copy of the largest block, twice
                biggest = m.new_int_var(0, 2**40, f"biggest[{r}]")
                for c in chunks:
                    for k in self.kinds:
                        m.add(biggest >= _ceil(t.kinds[k].shard_weight) * self.has_layers[c][k])
                    for name in self._fixed_of(c):
                        m.add(biggest >= _ceil(t.kinds[name].shard_weight))
                extra = 2 * biggest
                max_live = framework(job.framework).max_live_parameters
                if max_live is not None:  # resident up to stage3_max_live_parameters
                    resident = sum(
                        [self._layers(c, lambda k: _ceil(k.shard_weight)) for c in chunks],
                        sum(
                            _ceil(t.kinds[n].shard_weight)
                            for c in chunks
                            for n in self._fixed_of(c)
                        ),
                    )
                    wb = DTYPE_BYTES[job.working_weight_dtype]
                    live = m.new_int_var(0, 2**40, f"live[{r}]")
                    m.add_min_equality(live, [resident, max_live * wb // KIB])
                    gathered = m.new_int_var(0, 2**40, f"gathered[{r}]")
                    m.add(gathered >= 2 * biggest)
                    m.add(gathered >= live)
                    extra = gathered
            m.add(static + act + extra <= usable)
            if t.config.ema == "host" or t.config.optimizer_offload > 0:
                per_node = min(self.cluster.gpus_per_node, self.cluster.num_gpus)
                m.add(ranks.host(d, t, r, rank) * per_node <= self.cluster.host_ram_bytes // KIB)

    def _saved_by(self, names: list[str]) -> Expr:
        """Saved KiB (rounded down) of fixed blocks, by their chosen options."""
        terms = [
            _floor(o.saved) * b
            for n in names
            for b, o in zip(self.x[n], self.t.kinds[n].options, strict=True)
            if o.saved
        ]
        return sum(terms) if terms else 0

    # -- objective ---------------------------------------------------------------------
    def _objective(self) -> None:
        self.step = self.m.new_int_var(0, self.hi * 64, "step")
        self.forms: set[tuple[tuple[Any, float], ...]] = set()
        self.m.minimize(self.step)

    def add_forms(self, forms: list[Form]) -> int:
        """``step >=`` each chain (``planner.timeline.Timeline.forms``); returns how many
        were new."""
        added = 0
        for form in forms:
            key = tuple(sorted(form.items(), key=repr))
            if key in self.forms:
                continue
            self.forms.add(key)
            fracs = [(k, Fraction(c).limit_denominator(10_000)) for k, c in form.items() if c]
            scale = math.lcm(*(f.denominator for _, f in fracs)) if fracs else 1
            expr = sum(int(f * scale) * self._form_term(k) for k, f in fracs)
            self.m.add(scale * self.step >= expr)
            added += 1
        return added

    def _form_term(self, key: tuple[Any, ...]) -> Expr:
        if key[0] == "task":
            return self.task(key[1])
        if key[0] == "prim":
            return self.prim[key[1]]
        return self._optimizer(key[1])

    def _optimizer(self, r: int) -> Expr:
        return ranks.optimizer(_RankExpr(self), self.t, r, self.t.ranks[r])

    # -- solving -----------------------------------------------------------------------
    def solve(
        self, *, time_limit_s: float, workers: int, seed: int, wall_s: float | None = None
    ) -> Solution:
        """Solve within ``time_limit_s`` of CP-SAT's deterministic time (about seconds on
        this kind of machine), so the same inputs give the same answer anywhere; ``wall_s``
        caps the wall-clock seconds too (the answer then depends on the machine's speed)."""
        solver = _solver(time_limit_s, workers=workers, seed=seed, wall_s=wall_s)
        status = solver.solve(self.m)
        work = solver.deterministic_time
        if status == cp_model.INFEASIBLE:
            return Solution("infeasible", [], {}, math.inf, math.inf, work)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return Solution("unknown", [], {}, math.inf, 0.0, work)
        counts = [
            solver.value(self.start[s + 1]) - solver.value(self.start[s]) for s in range(self.S)
        ]
        return Solution(
            status="optimal" if status == cp_model.OPTIMAL else "feasible",
            counts=counts,
            recompute=self._recompute_names(solver.value, counts),
            objective_s=solver.objective_value * UNIT,
            bound_s=solver.best_objective_bound * UNIT,
            work=work,
            values=list(solver.response_proto.solution),
        )

    def decode(self, values: list[int]) -> tuple[list[int], dict[str, str]]:
        """Layers per stage and each block's recompute option of a full assignment."""

        def value(var: Any) -> int:
            return values[int(var.Index())]

        counts = [value(self.start[s + 1]) - value(self.start[s]) for s in range(self.S)]
        return counts, self._recompute_names(value, counts)

    def _recompute_names(self, value: Any, counts: list[int]) -> dict[str, str]:
        """Each layer's option: within a stage, layers of a kind take the options in menu
        order (the most recomputed last, as Megatron-LM's block method recomputes a stage's
        first layers... here any fixed order is equivalent: a stage's cost only depends on how
        many of its layers take each option)."""
        out: dict[str, str] = {}
        layer = 0
        for s, n in enumerate(counts):
            queue: dict[str, list[str]] = {}
            for k in self.kinds:
                names: list[str] = []
                for var, o in zip(self.r[s][k], self.t.kinds[k].options, strict=True):
                    names += [o.name] * value(var)
                queue[k] = names[::-1]
            for i in range(layer, layer + n):
                out[f"layer.{i}"] = queue[self.t.layer_kinds[i]].pop()
            layer += n
        for name, vars_ in self.x.items():
            for var, o in zip(vars_, self.t.kinds[name].options, strict=True):
                if value(var):
                    out[name] = o.name
        return out

    def fix(self, counts: list[int], option: dict[str, str] | None = None) -> None:
        """Pin the stage sizes and, if given, one option per kind (a candidate to complete;
        without options the recompute is left to the solver)."""
        acc = 0
        self._pinned_counts = list(counts)
        for s, n in enumerate(counts):
            self.m.add(self.start[s] == acc)
            acc += n
        if option is None:
            return
        for s in range(self.S):
            for k in self.kinds:
                for var, o in zip(self.r[s][k], self.t.kinds[k].options, strict=True):
                    if o.name != option.get(k):
                        self.m.add(var == 0)
        for name, vars_ in self.x.items():
            for var, o in zip(vars_, self.t.kinds[name].options, strict=True):
                if o.name != option.get(name):
                    self.m.add(var == 0)

    def pin_recompute(self, options: dict[str, str]) -> None:
        """Pin every block's recompute option (block name -> a ``Layout`` recompute string)
        for a model whose stage sizes are pinned (``fix``): each stage's count of every
        option of every layer kind, and each fixed block's option."""
        from planner.layout import parse_recompute
        from planner.solve.tables import choice_name

        layer = 0
        for s, n in enumerate(self._pinned_counts):
            wanted: dict[str, dict[str, int]] = {k: {} for k in self.kinds}
            for i in range(layer, layer + n):
                k = self.t.layer_kinds[i]
                name = choice_name(parse_recompute(options.get(f"layer.{i}", "none")))
                wanted[k][name] = wanted[k].get(name, 0) + 1
            layer += n
            for k in self.kinds:
                names = [o.name for o in self.t.kinds[k].options]
                missing = set(wanted[k]) - set(names)
                assert not missing, f"stage {s} {k}: options {missing} not in {names}"
                for var, name in zip(self.r[s][k], names, strict=True):
                    self.m.add(var == wanted[k].get(name, 0))
        for name, vars_ in self.x.items():
            chosen = choice_name(parse_recompute(options.get(name, "none")))
            for var, o in zip(vars_, self.t.kinds[name].options, strict=True):
                self.m.add(var == int(o.name == chosen))

    def one_recompute_choice(self) -> None:
        """Every transformer layer takes the same recompute choice (what a launcher that
        states one choice for all layers can run): one of the names every layer kind has."""
        pick = {n: self.m.new_bool_var(f"uniform[{n}]") for n in layer_choices(self.t)}
        self.m.add_exactly_one(pick.values())
        for s in range(self.S):
            for k in self.kinds:
                for var, o in zip(self.r[s][k], self.t.kinds[k].options, strict=True):
                    if o.name in pick:
                        self.m.add(var <= self.L * pick[o.name])
                    else:
                        self.m.add(var == 0)

    def complete(self, *, time_limit_s: float) -> tuple[list[int] | None, float]:
        """Values of every variable of this (pinned) model, or None when it does not fit;
        and the deterministic time spent."""
        solver = _solver(time_limit_s, workers=1, seed=0)
        status = solver.solve(self.m)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None, solver.deterministic_time
        return list(solver.response_proto.solution), solver.deterministic_time

    def hint_all(self, values: list[int]) -> float:
        """Warm start from a completed candidate of an identically built model (the
        variables every such model makes when built), with the task lengths and step the
        chains made since completed for it: a whole assignment, which the solver takes as
        its first solution. Returns the deterministic time that completion took."""
        self.m.clear_hints()  # type: ignore[no-untyped-call]
        base = values[: self.base_vars]
        full, work = self._completed(base)
        for index, value in enumerate(full or base):
            self.m.add_hint(self.m.get_int_var_from_proto_index(index), value)
        return work

    def _completed(self, base: list[int]) -> tuple[list[int] | None, float]:
        """Every variable's value with the built ones fixed to ``base``: the least task
        lengths and step they allow (None when they do not fit, as a stale candidate may)."""
        if len(self.m.proto.variables) == len(base):
            return base, 0.0
        pinned = self.m.clone()
        step = self.step.Index()  # the candidate's own step knew none of the chains
        for index, value in enumerate(base):
            if index != step:
                pinned.add(pinned.get_int_var_from_proto_index(index) == value)
        solver = _solver(0.5, workers=1, seed=0)
        status = solver.solve(pinned)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None, solver.deterministic_time
        return list(solver.response_proto.solution), solver.deterministic_time


def _solver(
    limit: float, *, workers: int, seed: int, wall_s: float | None = None
) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.max_deterministic_time = max(limit, 0.01)
    safety = 10 * max(limit, 0.01) + 1  # a wall-clock safety net only
    p.max_time_in_seconds = max(0.01, min(safety, wall_s)) if wall_s is not None else safety
    p.num_workers = max(1, workers)
    p.interleave_search = workers > 1  # subsolvers take turns in one thread: deterministic
    p.random_seed = seed
    # Presolve spends seconds on these small models (dual strengthening over the wide time
    # and byte domains) and the search proves optimality in a fraction of that.
    p.cp_model_presolve = False
    return solver


def _ceil(x: float) -> int:
    """Bytes as whole KiB, rounded up (memory is never under-counted)."""
    return math.ceil(x / KIB - 1e-9)


def _floor(x: float) -> int:
    """Bytes as whole KiB, rounded down (for bytes subtracted from a peak)."""
    return math.floor(x / KIB + 1e-9)


def _int(x: float) -> int:
    r = round(x)
    assert abs(r - x) < 1e-9, x
    return r


class _StageExpr:
    """The CP-SAT domain of one stage's quantities (``costs.quantities.Domain``): sums over
    the stage's layers per option and its fixed blocks' choices, every coefficient in whole
    time units (rounded where it is written), the expert latency on when the stage holds
    routed experts."""

    def __init__(self, model: StageModel, s: int) -> None:
        self.model, self.s = model, s

    def blocks(self, seconds: Callable[[Row], float]) -> Expr:
        return self.model._sum(self.s, lambda o: q(seconds(o.row)))

    def count(self, number: Callable[[Row], int]) -> Expr:
        return self.model._sum(self.s, lambda o: number(o.row))

    def per(self, count: Expr, seconds: float) -> Expr:
        return count * q(seconds)

    def const(self, seconds: float) -> Expr:
        return q(seconds)

    def over_bytes(self, kind: Bytes, per_byte: float) -> Expr:
        layers = self.model._layers(self.s, lambda k: q(per_byte * k.nbytes[kind]))
        return layers + q(per_byte * self.model.t.fixed_bytes[self.s][kind])

    def if_expert(self, seconds: float) -> Expr:
        return q(seconds) * self.model.has_expert[self.s]

    def add(self, a: Expr, b: Expr) -> Expr:
        return a + b


class _RankExpr:
    """The CP-SAT domain of a rank's sums (``planner.solve.ranks.RankDomain``): seconds in
    whole time units, bytes in whole KiB rounded up, each where it is written."""

    def __init__(self, model: StageModel) -> None:
        self.model = model

    def layers(self, stage: int, value: Callable[[Kind], float], unit: ranks.Unit) -> Expr:
        return self.model._layers(stage, lambda k: _whole(value(k), unit))

    def blocks(self, stage: int, value: Callable[[Option], float], unit: ranks.Unit) -> Expr:
        return self.model._sum(stage, lambda o: _whole(value(o), unit))

    def const(self, value: float, unit: ranks.Unit) -> Expr:
        return _whole(value, unit)

    def add(self, a: Expr, b: Expr) -> Expr:
        return a + b

    def scale(self, x: Expr, n: int) -> Expr:
        return n * x


def _whole(value: float, unit: ranks.Unit) -> int:
    """Seconds as whole time units, bytes as whole KiB (rounded up)."""
    return q(value) if unit is ranks.Unit.SECONDS else _ceil(value)
