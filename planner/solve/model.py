"""The CP-SAT model of one ``Config``: stage boundaries and recompute, minimising step time.

Decisions: where each stage starts (an integer per stage; the count of each layer kind in a
stage comes from prefix-count tables by element constraints), how many layers of each kind in
each stage take each recompute option, and the option of each embedding / MTP / head block.

The objective is ``planner.steptime``'s formula stated over the same numbers
(``planner.solve.tables``): op times are maxima of linear terms (``add_max_equality``, exact,
so no term can be inflated to shrink another), each rank's work is its op order's task counts
times those op times, its wait is ``order_idle`` over the stages it does not hold, and the
tail is the exposed gradient reduction plus the optimizer step. Memory per rank is
``planner.costs.memory``'s buckets with the activation peak taken over every level the rank's
op order passes through.

Resolution: times are integers of ``UNIT`` seconds (each block's time rounds to the nearest
unit); bytes are exact integers (rounded up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model

from planner.costs.timing import OVERLAP_SM_SHARE
from planner.solve.tables import Tables
from planner.specs import ClusterSpec, TrainingJob

UNIT = 1e-6  # seconds per time unit
KIB = 1024  # bytes per memory unit
SLOW, FAST = 132, 112  # pair compute slowdown 132/112 = 1/(1 - 20/132)
assert abs(FAST / SLOW - (1 - OVERLAP_SM_SHARE)) < 1e-12

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

    # -- stage quantities --------------------------------------------------------------
    def _stage_terms(self) -> None:
        t = self.t
        self.fwd, self.bin, self.bw, self.moe, self.rerun = [], [], [], [], []
        self.sync, self.gather, self.reduce, self.has_expert = [], [], [], []
        for s in range(self.S):
            self.fwd.append(self._sum(s, lambda o: q(o.row.fwd)))
            self.bin.append(self._sum(s, lambda o: q(o.row.bwd_input)))
            self.bw.append(self._sum(s, lambda o: q(o.row.bwd_weight)))
            self.moe.append(self._sum(s, lambda o: o.row.moe_layers))
            self.rerun.append(self._sum(s, lambda o: o.row.moe_rerun))
            fixed_dense, fixed_expert = t.fixed_grad[s]
            fixed_wd, fixed_we = t.fixed_weight[s]
            has_expert = self._has_expert(s, fixed_expert)
            self.has_expert.append(has_expert)

            def affine(
                a: Any, kind_bytes: Any, fixed: float, c: float, on: Any, s: int = s
            ) -> Expr:
                """a x + c seconds for x bytes, c only when the stage has such bytes."""
                return self._layers(s, lambda k: q(a * kind_bytes(k))) + q(a * fixed) + q(c) * on

            gd, ge = t.grad_dense[s], t.grad_expert[s]
            self.sync.append(
                affine(gd.a, lambda k: k.dense_grad, fixed_dense, gd.c, True)
                + affine(ge.a, lambda k: k.expert_grad, fixed_expert, ge.c, has_expert)
            )
            ad, ae = t.gather_dense[s], t.gather_expert[s]
            self.gather.append(
                affine(ad.a, lambda k: k.dense_weight, fixed_wd, ad.c, True)
                + affine(ae.a, lambda k: k.expert_weight, fixed_we, ae.c, has_expert)
            )
            rd, re = t.reduce_dense[s], t.reduce_expert[s]
            self.reduce.append(
                affine(rd.a, lambda k: k.dense_grad, fixed_dense, rd.c, True)
                + affine(re.a, lambda k: k.expert_grad, fixed_expert, re.c, has_expert)
            )

    def _has_expert(self, s: int, fixed_expert: float) -> Any:
        if fixed_expert > 0:
            return True
        if "moe" not in self.kinds:
            return False
        return self.has_layers[s]["moe"]

    def _a2a_fwd(self, s: int) -> Expr:
        return self.moe[s] * q(self.t.forward_pair[s])

    def _a2a_bwd(self, s: int) -> Expr:
        return self.moe[s] * q(2 * self.t.combine[s]) + self.rerun[s] * q(self.t.forward_pair[s])

    # -- op times ----------------------------------------------------------------------
    def _op_times(self) -> None:
        """Op times are created on first use (``op``, ``pair``); an hour bounds them."""
        self._ops: dict[tuple[Any, ...], Any] = {}
        self.hi = q(3600.0)

    def op(self, kind: str, s: int, *, overlapped: bool = False) -> Any:
        """The time of one op of stage s (an exact max, created on first use)."""
        key = (kind, s, overlapped)
        if key in self._ops:
            return self._ops[key]
        t = self.t
        send = 0 if overlapped else 1
        if kind == "F":
            terms = [self.fwd[s] + send * (self._a2a_fwd(s) + q(t.p2p[s])), self.gather[s]]
        elif kind == "B":
            terms = [self.bin[s] + send * (self._a2a_bwd(s) + q(t.p2p_back[s])), self.gather[s]]
        elif kind == "W":
            terms = [self.bw[s], self.reduce[s]]
        else:
            work = self.bin[s] + self.bw[s]
            terms = [
                work + send * (self._a2a_bwd(s) + q(t.p2p_back[s])),
                self.gather[s] + self.reduce[s],
            ]
        v = self.m.new_int_var(0, self.hi, f"op[{kind}][{s}]{'o' if overlapped else ''}")
        self.m.add_max_equality(v, terms)
        self._ops[key] = v
        return v

    def pair(self, f: int, b: int, kind: str) -> Any:
        """A DualPipe pair: max(compute slowed by the communication's SMs, communication)."""
        key = ("pair", f, b, kind)
        if key in self._ops:
            return self._ops[key]
        t = self.t
        work = self.op("F", f, overlapped=True) + self.op(kind, b, overlapped=True)
        comm = self._a2a_fwd(f) + self._a2a_bwd(b) + q(t.p2p[f]) + q(t.p2p_back[b])
        v = self.m.new_int_var(0, self.hi, f"pair[{f}][{b}][{kind}]")
        const = q(t.p2p[f]) + q(t.p2p_back[b])
        if const > 0:
            on: Any = True
        else:
            # The all-to-alls exist only where the stage has MoE layers and the EP group
            # spans more than one GPU (else they take no time).
            flags = [
                self.has_expert[f] if t.forward_pair[f] > 0 else False,
                self.has_expert[b] if t.combine[b] + t.forward_pair[b] > 0 else False,
            ]
            live = [x for x in flags if not isinstance(x, bool)]
            if any(x is True for x in flags):
                on = True
            elif not live:
                on = False
            else:
                on = self.m.new_bool_var(f"pair_comm[{f}][{b}]")
                self.m.add_max_equality(on, live)
        if on is True:
            slowed = self._slowed(work, f"slowed[{f}][{b}][{kind}]")
            self.m.add_max_equality(v, [slowed, comm])
        elif on is False:
            self.m.add_max_equality(v, [work, comm])
        else:
            full = self._slowed(work, f"slowed[{f}][{b}][{kind}]")
            slowed = self.m.new_int_var(0, self.hi * 2, f"slowed_if[{f}][{b}][{kind}]")
            self.m.add(slowed == full).only_enforce_if(on)
            self.m.add(slowed == work).only_enforce_if(on.negated())
            self.m.add_max_equality(v, [slowed, comm])
        self._ops[key] = v
        return v

    def _slowed(self, work: Expr, name: str) -> Any:
        """floor(work * 132 / 112), stated as two linear inequalities (exact for integers,
        and visible to the LP relaxation, which a division constraint is not)."""
        v = self.m.new_int_var(0, self.hi * 2, name)
        self.m.add(FAST * v <= SLOW * work)
        self.m.add(FAST * v >= SLOW * work - (FAST - 1))
        return v

    def task(self, task: tuple[Any, ...]) -> Any:
        if task[0] == "pair":
            return self.pair(task[1], task[2], task[3])
        return self.op(task[0], task[1])

    # -- memory ------------------------------------------------------------------------
    def _memory(self) -> None:
        t, m, job = self.t, self.m, self.job
        usable = math.floor(
            (self.cluster.hbm_bytes - job.cuda_context_bytes) / (1 + job.fragmentation) / KIB
        )
        for r, rank in enumerate(t.ranks):
            chunks = rank.chunks
            static = sum(
                [self._layers(c, lambda k: _ceil(_state_gpu(k.state))) for c in chunks],
                _ceil(_state_gpu(t.fixed_state[r])) + _ceil(t.buffers),
            )
            host = sum(
                [self._layers(c, lambda k: _ceil(k.state["host"])) for c in chunks],
                _ceil(t.fixed_state[r]["host"]),
            )
            saved = {c: self._sum(c, lambda o: _ceil(o.saved)) for c in chunks}
            # What a backward rebuilds above the chunk's level: a block's rebuilt bytes less
            # those the blocks after it have freed (costs.memory.rebuild_peak). Only the fixed
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
            for counts, rb in rank.levels:
                level = sum(n * saved[c] for n, c in zip(counts, chunks, strict=True) if n)
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
            m.add(static + act + extra <= usable)
            if t.config.ema == "host":
                per_node = min(self.cluster.gpus_per_node, self.cluster.num_gpus)
                m.add(host * per_node <= self.cluster.host_ram_bytes // KIB)

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
        t, m = self.t, self.m
        n_others = t.others
        big = self.hi * n_others * 4
        self.pipe = m.new_int_var(0, big, "pipe")
        self.tail = m.new_int_var(0, big, "tail")
        for r, rank in enumerate(t.ranks):
            busy = sum(count * self.task(task) for task, count in rank.tasks.items())
            others = [s for s in range(self.S) if s not in rank.chunks] or list(range(self.S))
            idle = self._idle(others, r)
            m.add(n_others * self.pipe >= n_others * busy + idle)
            opt = self._optimizer(r)
            tail_r = m.new_int_var(0, big, f"tail[{r}]")
            m.add(tail_r >= opt)
            slack = self._slack(r)
            for j in range(len(rank.last_grad)):
                queued = sum(self.sync[stage] for stage, _ in rank.last_grad[j:])
                suffix = sum(n * self.task(task) for task, n in rank.last_grad[j][1].items())
                m.add(tail_r >= opt + queued - suffix - slack)
            m.add(self.tail >= tail_r)
        m.minimize(self.pipe + self.tail)

    def _idle(self, others: list[int], r: int) -> Expr:
        """``order_idle`` over the means of the other stages, times their count."""
        t = self.t
        lin = t.idle_linear
        scale = t.others / len(others)  # 1 unless a rank holds every stage (pp = 1)
        ops = {
            "f": [self.op("F", s) for s in others],
            "b": [self.op("B", s) for s in others],
            "w": [self.op("W", s) for s in others],
            "fb": [self.pair(s, s, "BW") for s in others],
        }
        # Fresh expressions for every term: CP-SAT's += may grow an expression in place.
        terms: list[Expr] = []
        for key in ("f", "b", "w", "fb"):
            if lin[key]:
                c = _int(lin[key] * scale)
                terms += [c * v for v in ops[key]]
        if t.idle_k is not None:
            corr = self.m.new_int_var(-self.hi * t.others, self.hi * t.others, f"idle_corr[{r}]")
            k = _int(t.idle_k * scale)
            self.m.add(corr >= sum(k * v for v in ops["f"]) - sum(k * v for v in ops["b"]))
            self.m.add(corr >= -sum(_int(scale) * v for v in ops["f"]))
            terms.append(corr)
        expr: Expr = sum(terms) if terms else 0
        return expr

    def _optimizer(self, r: int) -> Expr:
        t = self.t
        rate = t.opt_Bps

        def traffic(state: dict[str, float]) -> float:
            return 2 * state["optimizer"] + state["grads"] + state["weights"] + 2 * state["ema"]

        return sum(
            [self._layers(c, lambda k: q(traffic(k.state) / rate)) for c in t.ranks[r].chunks],
            q(traffic(t.fixed_state[r]) / rate),
        )

    def _slack(self, r: int) -> Expr:
        if self.t.config.schedule not in ("gpipe", "1f1b", "interleaved"):
            return 0
        return sum(self.op("BW", j) for j in range(r))

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
            recompute=self._recompute_names(solver, counts),
            objective_s=solver.objective_value * UNIT,
            bound_s=solver.best_objective_bound * UNIT,
            work=work,
        )

    def _recompute_names(self, solver: Any, counts: list[int]) -> dict[str, str]:
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
                    names += [o.name] * solver.value(var)
                queue[k] = names[::-1]
            for i in range(layer, layer + n):
                out[f"layer.{i}"] = queue[self.t.layer_kinds[i]].pop()
            layer += n
        for name, vars_ in self.x.items():
            for var, o in zip(vars_, self.t.kinds[name].options, strict=True):
                if solver.value(var):
                    out[name] = o.name
        return out

    def fix(self, counts: list[int], option: dict[str, str] | None = None) -> None:
        """Pin the stage sizes and, if given, one option per kind (a candidate to complete;
        without options the recompute is left to the solver)."""
        acc = 0
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

    def one_recompute_choice(self) -> None:
        """Every transformer layer takes the same recompute choice (what a launcher that
        states one choice for all layers can run): one of the names every layer kind has."""
        names = None
        for k in self.kinds:
            own = [o.name for o in self.t.kinds[k].options]
            names = own if names is None else [n for n in names if n in own]
        pick = {n: self.m.new_bool_var(f"uniform[{n}]") for n in names or []}
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

    def hint_all(self, values: list[int]) -> None:
        """Warm start from a completed candidate of an identically built model."""
        self.m.clear_hints()  # type: ignore[no-untyped-call]
        for index, value in enumerate(values):
            self.m.add_hint(self.m.get_int_var_from_proto_index(index), value)


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


def _state_gpu(state: dict[str, float]) -> float:
    return state["weights"] + state["grads"] + state["optimizer"] + state["ema"]
