"""``plan``: the search over degrees and schedules, a CP-SAT model per choice, and the proof.

The outer decisions (tp, pp, dp, ep, ZeRO stage, micro-batch, schedule and its virtual stages,
EMA placement) are enumerated within the ``SearchSpace``; each combination (a ``Config``) gets
an admissible lower bound on its step time (every block's cheapest work, spread perfectly over
the ranks, plus the all-to-alls no schedule but DualPipe hides) and a memory lower bound
(every rank's share of the model state). Configurations are solved in order of their bound,
each by its own CP-SAT model (``planner.solve.model``) warm-started from a balanced layout
with one recompute option for every layer. The search stops when the next bound is no better
than the best layout found: then the best is optimal, or else the gap is the distance to the
smallest bound not yet closed.

Dominance rules applied before solving (each says why it loses nothing):
- ZeRO-0 is never better than ZeRO-1: same compute, the reduce-scatter is half the all-reduce
  and the parameter all-gather overlaps the next forward; ZeRO-1 holds less.
- GPipe is never better than 1F1B: the same bubble, more activations.
- An EMA in host RAM costs no step time and no HBM: when the job has one, host RAM is used
  unless the average rank's share times the GPUs of a node exceeds the node's RAM (then the
  HBM variant is searched too; the model checks the heaviest rank's host RAM either way).

The budget is CP-SAT's deterministic time (one worker, interleaved search), so the same inputs
give the same plan on any machine and under any load; wall time is only a safety net (three
times the budget). Python's own work (bounds, tables, model building) is not in the budget.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from planner.costs.blocks import block_cost
from planner.costs.comm import Network
from planner.errors import PlannerError
from planner.estimate import evaluate
from planner.layout import SCHEDULES, Layout, parse_recompute
from planner.solve.explain import Replan, explain
from planner.solve.model import StageModel
from planner.solve.result import Alternative, Plan
from planner.solve.tables import Config, Option, Tables, _even_counts, build, choice_name
from planner.specs import ClusterSpec, ModelSpec, SearchSpace, TrainingJob

log = logging.getLogger(__name__)

DEFAULT_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "dualpipe", "dualpipev")
DEFAULT_MICRO_BATCHES = (1, 2, 4, 8)
DEFAULT_VIRTUAL = (2, 4)


def plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace | None = None,
    *,
    time_limit_s: float = 30.0,
    top_k: int = 1,
    workers: int = 1,
    seed: int = 0,
    explain_infeasible: bool = True,
) -> Plan:
    """The fastest layout of ``model`` on ``cluster`` for ``job`` within ``space``, with a
    proof of how close to optimal it is (see the module docstring)."""
    started = time.perf_counter()
    space = space or SearchSpace()
    network = Network.of(cluster)
    configs = list(enumerate_configs(model, cluster, job, space))
    if job.ema and space.ema is None:
        # The EMA goes to host RAM (no HBM, no step time) unless the host cannot hold it.
        configs += [
            dataclasses.replace(c, ema="hbm")
            for c in configs
            if (t := _tables(model, cluster, job, c)) is not None and not _host_fits(t, cluster, c)
        ]
    bounded = sorted(
        ((bound, c) for c in configs if (bound := lower_bound(model, cluster, job, c)) is not None),
        key=lambda x: (x[0], _key(x[1])),
    )
    found: list[tuple[float, Config, Layout]] = []
    pending: list[tuple[float, Config]] = []  # not closed yet: (bound, config)

    def best() -> float:
        return found[0][0] if found else math.inf

    spent = [0.0]  # CP-SAT deterministic time: the budget, so answers do not depend on load

    def left() -> float:
        if time.perf_counter() - started > 3 * time_limit_s + 5:  # wall-clock safety net
            return 0.0
        return time_limit_s - spent[0]

    def attempt(bound: float, config: Config, limit: float) -> None:
        t0 = time.perf_counter()
        out = solve_config(
            model,
            cluster,
            job,
            config,
            network,
            space=space,
            time_limit_s=limit,
            workers=workers,
            seed=seed,
        )
        spent[0] += out.work
        if out.layout is not None:
            found.append((out.objective, config, out.layout))
            found.sort(key=lambda x: (x[0], _key(x[1])))
        if out.status in ("unknown", "feasible"):
            pending.append((max(bound, out.bound), config))
        log.debug(
            "%s bound %.4f: %s %.4f (proven >= %.4f) in %.2f s",
            config,
            bound,
            out.status,
            out.objective,
            out.bound,
            time.perf_counter() - t0,
        )

    # First pass: every configuration whose bound beats the best so far, briefly.
    quick = max(0.3, min(2.0, time_limit_s / 20))
    for index, (bound, config) in enumerate(bounded):
        if bound >= best() * (1 - 1e-9):
            break
        if left() <= 0:
            pending += bounded[index:]
            break
        attempt(bound, config, min(quick, left()))
    # Second pass: reopen the unclosed ones in order of bound, with the time that is left.
    while pending and left() > 0:
        pending.sort(key=lambda x: (x[0], _key(x[1])))
        bound, config = pending.pop(0)
        if bound >= best() * (1 - 1e-9):
            pending = []
            break
        attempt(bound, config, left())
    open_bounds = [b for b, _ in pending if b < best()]
    if not found:
        if open_bounds or any(b < math.inf for b, _ in pending):
            raise PlannerError(
                f"time_limit_s={time_limit_s}: no layout found in time and infeasibility not "
                f"proven; allow more time"
            )
        explanation = None
        if explain_infeasible:
            explanation = explain(
                model,
                cluster,
                job,
                space,
                lightest=_lightest(model, cluster, job, configs),
                replan=_replan(workers, seed),
                time_limit_s=time_limit_s,
            )
        return Plan(
            status="infeasible",
            solve_time_s=time.perf_counter() - started,
            configurations=len(configs),
            explanation=explanation,
        )
    objective, config, layout = found[0]
    lower = min([objective, *open_bounds])
    gap = max(0.0, (objective - lower) / objective)
    status = "optimal" if not open_bounds else "feasible"
    estimate = evaluate(model, cluster, job, layout)
    alternatives = [
        Alternative(
            layout=alt,
            step_time_s=evaluate(model, cluster, job, alt).step_time_s,
            peak_bytes=evaluate(model, cluster, job, alt).peak_bytes,
        )
        for _, c, alt in _distinct(found[1:], exclude=config)[: max(0, top_k - 1)]
    ]
    return Plan(
        status=status,
        layout=layout,
        estimate=estimate,
        objective_s=objective,
        lower_bound_s=lower,
        gap=0.0 if status == "optimal" else gap,
        solve_time_s=time.perf_counter() - started,
        configurations=len(configs),
        alternatives=alternatives,
    )


def _replan(workers: int, seed: int) -> Replan:
    def replan(
        model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, space: SearchSpace, limit: float
    ) -> Plan | None:
        try:
            return plan(
                model,
                cluster,
                job,
                space,
                time_limit_s=limit,
                workers=workers,
                seed=seed,
                explain_infeasible=False,
            )
        except PlannerError:  # no answer within the time: neither a fit nor a proof
            return None

    return replan


def _lightest(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, configs: list[Config]
) -> tuple[float, str] | None:
    """The configuration with the smallest memory floor, and that floor (bytes)."""
    best: tuple[float, str] | None = None
    for c in configs:
        t = _tables(model, cluster, job, c)
        if t is None:
            continue
        need = _memory_floor(t, c)
        if best is None or need < best[0]:
            where = f"tp={c.tp} pp={c.pp} dp={c.dp} ep={c.ep} ZeRO-{c.zero} {c.schedule}"
            best = (need, where)
    return best


def _distinct(
    found: list[tuple[float, Config, Layout]], *, exclude: Config
) -> list[tuple[float, Config, Layout]]:
    seen = {_degrees(exclude)}
    out = []
    for item in found:
        key = _degrees(item[1])
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


def _degrees(c: Config) -> tuple[object, ...]:
    return (c.tp, c.pp, c.dp, c.ep, c.schedule, c.virtual_stages)


def _key(c: Config) -> tuple[object, ...]:
    """Deterministic tie-break between configurations."""
    return (c.pp, c.tp, c.ep, c.zero, c.micro_batch, c.schedule, c.virtual_stages, c.ema)


# -- the outer decisions ---------------------------------------------------------------------


def enumerate_configs(model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, space: SearchSpace):  # type: ignore[no-untyped-def]
    n = cluster.num_gpus
    tps = space.tp or [t for t in _divisors(cluster.gpus_per_node) if n % t == 0]
    for tp in tps:
        if tp > cluster.gpus_per_node or n % tp or not _tp_fits(model, tp):
            continue
        pps = space.pp or _divisors(n // tp)
        for pp in pps:
            if (n // tp) % pp:
                continue
            dp = n // (tp * pp)
            if space.dp and dp not in space.dp:
                continue
            eps = space.ep or (
                [e for e in _divisors(dp * tp) if model.num_experts % e == 0]
                if model.num_experts
                else [1]
            )
            for ep in eps:
                if (dp * tp) % ep or (model.num_experts and model.num_experts % ep):
                    continue
                yield from _per_degrees(model, cluster, job, space, tp, pp, dp, ep)


def _per_degrees(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace,
    tp: int,
    pp: int,
    dp: int,
    ep: int,
) -> Iterator[Config]:
    zeros = space.zero or [1, 2, 3]
    mbs = space.micro_batch or list(DEFAULT_MICRO_BATCHES)
    schedules = space.schedules or (list(DEFAULT_SCHEDULES) if pp > 1 else ["1f1b"])
    emas = space.ema or (["host"] if job.ema else ["hbm"])
    for zero, mb, schedule, ema in itertools.product(zeros, mbs, schedules, emas):
        if schedule not in SCHEDULES:
            raise PlannerError(f"SearchSpace.schedules: unknown schedule {schedule!r}")
        if job.global_batch % (dp * mb):
            continue
        m = job.global_batch // (dp * mb)
        for v in _virtuals(space, schedule):
            stages = pp * v
            if stages > model.num_layers + 2:
                continue
            if not _schedule_ok(schedule, pp, m, v):
                continue
            yield Config(tp, pp, dp, ep, zero, mb, schedule, v, ema, m)


def _virtuals(space: SearchSpace, schedule: str) -> list[int]:
    if schedule == "interleaved":
        return [v for v in (space.virtual_stages or DEFAULT_VIRTUAL) if v >= 2]
    if schedule == "dualpipev":
        return [2] if not space.virtual_stages or 2 in space.virtual_stages else []
    return [1] if not space.virtual_stages or 1 in space.virtual_stages else []


def _schedule_ok(schedule: str, pp: int, m: int, v: int) -> bool:
    if schedule == "interleaved":
        return pp > 1 and m % pp == 0
    if schedule in ("dualpipe", "dualpipev"):
        return pp % 2 == 0 and m >= 2 * pp and (schedule == "dualpipev" or m % 2 == 0)
    return True


def _tp_fits(model: ModelSpec, tp: int) -> bool:
    from planner.costs.blocks import Shard

    try:
        block_cost(model, "layer.0", Shard(seq_len=1, tp=tp))
    except PlannerError:
        return False
    return True


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# -- bounds ----------------------------------------------------------------------------------


def lower_bound(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> float | None:
    """A step time no layout of ``config`` beats, or None if no layout of it can fit.

    The step is at least the mean over ranks of (own work + own wait). Summed over ranks the
    work is m times every stage's forward and backward (each stage runs every micro-batch
    once), at least every block's cheapest option plus what every schedule but DualPipe
    exposes (all-to-alls, pipeline sends). The mean of the waits is ``order_idle`` at the
    overall mean op times (each stage is among the "others" of equally many ranks; DualPipe's
    correction is convex, so its mean is at least its value at the mean), with each mean
    taken at its lower end where the formula adds it and its upper end where it subtracts."""
    t = _tables(model, cluster, job, config)
    if t is None or any(not k.options for k in t.kinds.values()):
        return None
    if not _fits_at_all(t, cluster, job, config):
        return None
    if config.ema == "host" and not _host_fits(t, cluster, config):
        return None
    S, m, p = config.stages, config.num_microbatches, config.pp
    blocks = t.layer_kinds + t.first_fixed + t.last_fixed
    opts = [t.kinds[b].options for b in blocks]
    forced = _forced_recompute(model, t, cluster, job, config)
    if forced is None:
        return None  # even recomputing everything leaves too many activations
    moe = sum(t.kinds[b].cost.moe_layers for b in blocks)
    dual = config.schedule in ("dualpipe", "dualpipev")
    fpair, comb = min(t.forward_pair), min(t.combine)
    sends_f = 0.0 if dual else moe * fpair + sum(t.p2p)
    sends_b = 0.0 if dual else moe * 2 * comb + sum(t.p2p_back)
    fwd = sum(min(o.row.fwd for o in os) for os in opts)
    bin_lo = sum(min(o.row.bwd_input for o in os) for os in opts) + forced
    bin_hi = sum(max(o.row.bwd_input for o in os) for os in opts)
    bw = sum(os[0].row.bwd_weight for os in opts)  # recompute does not change it
    g_lo, g_hi = _collective(t, "gather", low=True), _collective(t, "gather", low=False)
    r_lo, r_hi = _collective(t, "reduce", low=True), _collective(t, "reduce", low=False)
    # Sums over stages of each op's time: a max of work (+ exposed sends) and ZeRO comm.
    f_lo = max(fwd + sends_f, g_lo)
    b_lo = max(bin_lo + sends_b, g_lo)
    w_lo, w_hi = max(bw, r_lo), bw + r_hi
    bw_lo = max(bin_lo + bw + sends_b, g_lo + r_lo)
    f_hi = fwd + moe * fpair + sum(t.p2p) + g_hi
    b_hi = bin_hi + moe * (2 * comb + fpair) + sum(t.p2p_back) + g_hi
    lin, k = t.idle_linear, t.idle_k
    tail = _optimizer_floor(t, config)
    if config.schedule == "zb-h1":
        # F, B and W each run m times on their stage and enter the wait with (p-1)(F+B-W):
        # W's net coefficient is m/p - (p-1)/S.
        net = m / p - lin["f"] / S
        return (m / p + lin["f"] / S) * (f_lo + b_lo) + net * (w_lo if net >= 0 else w_hi) + tail
    busy = m * (f_lo + bw_lo) / p
    if dual:
        # Every task lasts at least its communication too (a pair: max(compute, comm)).
        comm = moe * (fpair + 2 * comb) + sum(t.p2p) + sum(t.p2p_back)
        busy = max(busy, m * comm / p)
    if not dual:
        return busy + (lin["f"] * f_lo + lin["b"] * b_lo + lin["w"] * w_lo) / S + tail
    # DualPipe: k'(FB + B - 2W), with FB >= F + BW (a pair holds a forward and a full
    # backward) >= F + B + W and >= F + W: at least k'(F + 2B - W_hi) or k'(F + B - W_hi)...
    # the first needs only FB >= F + B + W, the second also W <= BW; take the larger.
    k1 = lin["fb"]
    idle = k1 * max(f_lo + 2 * b_lo + w_lo - 2 * w_hi, f_lo + b_lo - w_hi) / S
    assert k is not None
    idle += max(k * (f_lo - b_hi), -f_hi) / S
    return busy + idle + tail


def _forced_recompute(
    model: ModelSpec, t: Tables, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> float | None:
    """The least recompute time (seconds per micro-batch, all layers) that makes the ranks'
    activations fit together, or None if none does.

    Summed over ranks, the memory peaks hold every rank's state and buffers plus, at the
    least, each stage's saved bytes times the micro-batches its holders keep in flight
    (``schedules.in_flight``), at least ``w`` (the smallest such count) per stage. So the
    layers' saved bytes may total at most (ranks x usable - state) / w; the cheapest way
    there is the fractional multiple-choice knapsack over the recompute options (convex
    hull, cheapest seconds per byte first), a bound on any integral choice."""
    from planner.schedules import in_flight

    usable = (cluster.hbm_bytes - job.cuda_context_bytes) / (1 + job.fragmentation)
    copies = 2 if config.schedule == "dualpipe" else 1
    state = copies * sum(_gpu_state(t.kinds[k].state) for k in t.layer_kinds)
    state += sum(_gpu_state(s) for s in t.fixed_state) + config.pp * t.buffers
    proto = config.layout(model, _even_counts(model, config), {})
    weight = [0.0] * config.stages
    for r in range(config.pp):
        for stage, count in in_flight(proto, r, config.num_microbatches).items():
            weight[stage] += count
    w = min(weight)
    fixed = t.first_fixed + t.last_fixed
    fixed_saved = sum(min(o.saved for o in t.kinds[b].options) for b in fixed)
    budget = (config.pp * usable - state) / w - fixed_saved
    kinds: dict[str, int] = {}
    for k in t.layer_kinds:
        kinds[k] = kinds.get(k, 0) + 1
    hulls = {k: _hull(t.kinds[k].options) for k in kinds}
    saved = sum(n * hulls[k][0][0] for k, n in kinds.items())
    if saved <= budget:
        return 0.0
    steps = []  # (seconds per byte saved, bytes saved, seconds) for every layer of a kind
    for k, n in kinds.items():
        h = hulls[k]
        for (s0, t0), (s1, t1) in itertools.pairwise(h):
            steps.append(((t1 - t0) / (s0 - s1), n * (s0 - s1), n * (t1 - t0)))
    extra = 0.0
    for _rate, gain, cost in sorted(steps):  # cheapest seconds per byte first
        need = saved - budget
        if need <= 0:
            break
        take = min(1.0, need / gain)
        saved -= take * gain
        extra += take * cost
    return extra if saved <= budget * (1 + 1e-12) else None


def _hull(options: list[Option]) -> list[tuple[float, float]]:
    """(saved bytes, seconds) of the options on the lower convex hull of the time each saved
    budget costs, fastest (most bytes) first."""
    efficient: list[tuple[float, float]] = []
    for saved, seconds in sorted({(o.saved, o.time) for o in options}):
        if not efficient or seconds < efficient[-1][1]:  # less time than anything leaner
            efficient.append((saved, seconds))
    hull: list[tuple[float, float]] = []
    for pt in efficient:  # ascending bytes, descending time: keep the convex lower chain
        while len(hull) >= 2:
            (s0, t0), (s1, t1) = hull[-2], hull[-1]
            if (t1 - t0) * (pt[0] - s0) >= (pt[1] - t0) * (s1 - s0):
                hull.pop()  # hull[-1] lies on or above the chord from hull[-2] to pt
            else:
                break
        hull.append(pt)
    return hull[::-1]


def _optimizer_floor(t: Tables, config: Config) -> float:
    """The mean rank's optimizer step: the tail is at least the largest rank's."""
    copies = 2 if config.schedule == "dualpipe" else 1

    def traffic(state: dict[str, float]) -> float:
        return 2 * state["optimizer"] + state["grads"] + state["weights"] + 2 * state["ema"]

    total = copies * sum(traffic(t.kinds[k].state) for k in t.layer_kinds)
    total += sum(traffic(s) for s in t.fixed_state)
    return total / config.pp / t.opt_Bps


SLOW_PAIR = 132 / 112  # a DualPipe pair's compute slowdown (``costs.timing.OVERLAP_SM_SHARE``)


def _collective(t: Tables, kind: str, *, low: bool) -> float:
    """ZeRO reduce-scatters ("reduce") or all-gathers ("gather") summed over stages, at the
    cheapest (``low``) or costliest stage's rate: all the bytes, plus every stage's latency
    (an expert latency only counts once at the low end: one stage may hold every expert)."""
    reduce = kind == "reduce"
    dense = sum(t.kinds[k].dense_grad if reduce else t.kinds[k].dense_weight for k in t.layer_kinds)
    expert = sum(
        t.kinds[k].expert_grad if reduce else t.kinds[k].expert_weight for k in t.layer_kinds
    )
    for d, e in t.fixed_grad if reduce else t.fixed_weight:
        dense, expert = dense + d, expert + e
    pairs = list(
        zip(
            t.reduce_dense if reduce else t.gather_dense,
            t.reduce_expert if reduce else t.gather_expert,
            strict=True,
        )
    )
    pick = min if low else max
    a_d, a_e = pick(d.a for d, _ in pairs), pick(e.a for _, e in pairs)
    c_d, c_e = pick(d.c for d, _ in pairs), pick(e.c for _, e in pairs)
    stages = len(pairs)
    expert_latency = (c_e if expert else 0.0) * (1 if low else stages)
    return a_d * dense + a_e * expert + stages * c_d + expert_latency


def _fits_at_all(tables: Tables, cluster: ClusterSpec, job: TrainingJob, config: Config) -> bool:
    """Every rank holds its share of the model state: if the average share alone is over
    the usable HBM, no partition fits."""
    usable = (cluster.hbm_bytes - job.cuda_context_bytes) / (1 + job.fragmentation)
    # Pigeonhole: some rank holds at least ceil(layer copies / pp) layers.
    copies = 2 if config.schedule == "dualpipe" else 1
    most = -(-copies * len(tables.layer_kinds) // config.pp)
    lightest = min(_gpu_state(tables.kinds[k].state) for k in set(tables.layer_kinds))
    heaviest_rank = most * lightest + tables.buffers
    return max(_memory_floor(tables, config), heaviest_rank) <= usable


def _host_fits(tables: Tables, cluster: ClusterSpec, config: Config) -> bool:
    """The average rank's host-RAM EMA, times the GPUs of a node, within the node's RAM."""
    copies = 2 if config.schedule == "dualpipe" else 1
    host = copies * sum(tables.kinds[k].state["host"] for k in tables.layer_kinds)
    host += sum(s["host"] for s in tables.fixed_state)
    per_node = min(cluster.gpus_per_node, cluster.num_gpus)
    return host / config.pp * per_node <= cluster.host_ram_bytes


def _memory_floor(tables: Tables, config: Config) -> float:
    """The average rank's model state and buffers (bytes): some rank needs at least this."""
    state = sum(_gpu_state(tables.kinds[k].state) for k in tables.layer_kinds)
    copies = 2 if config.schedule == "dualpipe" else 1  # DualPipe keeps two copies
    fixed = sum(_gpu_state(s) for s in tables.fixed_state)
    return (copies * state + fixed) / config.pp + tables.buffers


def _gpu_state(s: dict[str, float]) -> float:
    return s["weights"] + s["grads"] + s["optimizer"] + s["ema"]


_TABLES: dict[tuple[object, ...], Tables | None] = {}


def _tables(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> Tables | None:
    key = (model, cluster.model_dump_json(), job, config)
    if key not in _TABLES:
        try:
            _TABLES[key] = build(model, cluster, job, config, Network.of(cluster), light=True)
        except PlannerError:
            _TABLES[key] = None
    return _TABLES[key]


# -- one configuration -----------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One configuration's solve: "optimal", "feasible" (time ran out), "infeasible" (proven:
    no layout of it fits) or "unknown" (time ran out before any layout)."""

    status: str
    objective: float = math.inf
    bound: float = 0.0
    layout: Layout | None = None
    work: float = 0.0


def solve_config(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    config: Config,
    network: Network,
    *,
    space: SearchSpace,
    time_limit_s: float,
    workers: int,
    seed: int,
) -> Outcome:
    """Solve one configuration's CP-SAT model, warm-started (see the module docstring)."""
    tables = build(model, cluster, job, config, network, choices=_choices(space))
    if any(not k.options for k in tables.kinds.values()):
        return Outcome("infeasible")
    values, warm = _warm_start(tables, cluster, job, time_limit_s)
    sm = StageModel(tables, cluster, job)
    if values is not None:
        sm.hint_all(values)
    sol = sm.solve(time_limit_s=max(0.01, time_limit_s - warm), workers=workers, seed=seed)
    work = warm + sol.work
    if sol.status in ("infeasible", "unknown"):
        return Outcome(sol.status, work=work)
    layout = config.layout(model, sol.counts, sol.recompute)
    return Outcome(sol.status, sol.objective_s, sol.bound_s, layout, work)


def _choices(space: SearchSpace) -> list[str] | None:
    if space.recompute is None:
        return None
    return [choice_name(parse_recompute(r)) for r in space.recompute]


def _warm_start(
    tables: Tables, cluster: ClusterSpec, job: TrainingJob, time_limit_s: float
) -> tuple[list[int] | None, float]:
    """A balanced partition with one option for every layer: the fastest option that fits."""
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
    by_time = _balanced(tables, lambda o: o.time)
    # A second partition for tight memory: balance what each stage holds (its state and the
    # leanest option's activations), with the leanest option everywhere.
    by_memory = _balanced(tables, lambda o: o.saved, state=True)
    candidates = [(by_time, name) for name in ordered]
    if ordered and by_memory != by_time:
        candidates.append((by_memory, ordered[-1]))
    spent = 0.0
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
    for partition in dict.fromkeys((tuple(by_time), tuple(by_memory))):
        pinned = StageModel(tables, cluster, job)
        pinned.fix(list(partition))
        values, work = pinned.complete(time_limit_s=min(0.5, time_limit_s))
        spent += work
        if values is not None:
            return values, spent
    return None, spent


def _balanced(tables: Tables, cost: Callable[[Option], float], *, state: bool = False) -> list[int]:
    """Layers per stage so every stage gets about the same total of ``cost`` (the least over
    a block's options, plus its state bytes when ``state``), the embedding's and head's own
    counted on the first and last stage; every stage but the first and last keeps a layer."""

    def block(k: str) -> float:
        extra = _gpu_state(tables.kinds[k].state) if state else 0.0
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
