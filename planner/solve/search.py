"""``plan``: the search over degrees and schedules, a CP-SAT model per choice, and the proof.

The outer decisions (tp, pp, dp, ep, ZeRO stage, micro-batch, schedule and its virtual stages,
EMA placement) are enumerated within the ``SearchSpace``; each combination (a ``Config``) gets
an admissible lower bound on its step time (every block's cheapest work, spread perfectly over
the ranks, plus the all-to-alls no schedule but DualPipe hides) and a memory lower bound
(every rank's share of the model state). Configurations are taken in order of their bound.
When one's turn first comes, its heaviest-rank bound (``planner.solve.rankbound``: whole layers
dealt to ranks, each rank's memory forcing its own recompute) is worked out and it goes back
in line with the larger of the two; on its second turn it gets its own CP-SAT model
(``planner.solve.model``), warm-started from a partition that evens out the ranks. The search
stops when the next bound is no better than the best layout found: then the best is optimal,
or else the gap is the distance to the smallest bound not yet closed.

Dominance rules applied before solving (each says why it loses nothing):
- ZeRO-0 is never better than ZeRO-1: same compute, the reduce-scatter is half the all-reduce
  and the parameter all-gather overlaps the next forward; ZeRO-1 holds less.
- GPipe is never better than 1F1B: the same bubble, more activations.
- An EMA in host RAM costs no step time and no HBM: when the job has one, host RAM is used
  unless the average rank's share times the GPUs of a node exceeds the node's RAM (then the
  HBM variant is searched too; the model checks the heaviest rank's host RAM either way).

``time_limit_s`` is wall-clock seconds for the whole search. Half of it is the solvers'
budget of CP-SAT's deterministic time (one worker, interleaved search), so the same inputs
give the same plan on any machine and under any load; the other half is left for Python's
own work (bounds, tables, model building), which that budget does not count. Only when the
wall clock runs out first (a slow or loaded machine) does the answer depend on the machine.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import time
from dataclasses import dataclass

from planner.costs.comm import Network
from planner.errors import PlannerError
from planner.estimate import evaluate
from planner.layout import Layout, parse_recompute
from planner.solve.bounds import bound_tables, host_fits, lower_bound, memory_floor
from planner.solve.explain import Replan, explain
from planner.solve.model import StageModel
from planner.solve.rankbound import heaviest_rank_bound, rank_balanced_counts
from planner.solve.result import Alternative, Plan
from planner.solve.space import TARGETS, enumerate_configs, for_target
from planner.solve.tables import Config, build, choice_name, even_counts, rank_orders
from planner.solve.warm import warm_start
from planner.specs import ClusterSpec, ModelSpec, SearchSpace, TrainingJob

log = logging.getLogger(__name__)

DETERMINISTIC_SHARE = 0.5  # of time_limit_s, for CP-SAT (see the module docstring)


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
    asked = space or SearchSpace()
    space = for_target(asked)
    network = Network.of(cluster)
    configs = list(enumerate_configs(model, cluster, job, space))
    if job.ema and space.ema is None:
        # The EMA goes to host RAM (no HBM, no step time) unless the host cannot hold it.
        configs += [
            dataclasses.replace(c, ema="hbm")
            for c in configs
            if (t := bound_tables(model, cluster, job, c)) is not None
            and not host_fits(t, cluster, c)
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
    budget = DETERMINISTIC_SHARE * time_limit_s
    deadline = started + 0.9 * time_limit_s  # the rest for building the last model and the answer

    def wall_left() -> float:
        return deadline - time.perf_counter()

    def left() -> float:
        return 0.0 if wall_left() <= 0 else budget - spent[0]

    def attempt(bound: float, config: Config, limit: float) -> bool:
        """Solve ``config``; False when there is no time left to build its model."""
        t0 = time.perf_counter()
        if _order_size(config) * SECONDS_PER_OP > wall_left():
            pending.append((bound, config))
            return False
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
            wall_s=wall_left(),
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
        return True

    # First pass: every configuration whose bound beats the best so far, briefly. A
    # configuration's heaviest-rank bound is only worked out when its mean bound comes up
    # (it is dearer); it goes back in line with the larger of the two.
    quick = max(0.3, min(2.0, budget / 10))
    queue = [(bound, _key(c), False, c) for bound, c in bounded]
    heapq.heapify(queue)
    while queue:
        bound, key, refined, config = queue[0]
        if bound >= best() * (1 - 1e-9):
            break
        if left() <= 0:
            break
        heapq.heappop(queue)
        if not refined:
            heavy = None
            size = _order_size(config)
            if size <= HEAVY_BOUND_OPS and size * SECONDS_PER_OP < wall_left():
                heavy = heaviest_rank_bound(model, cluster, job, config)
            heapq.heappush(queue, (max(bound, heavy or bound), key, True, config))
            continue
        attempt(bound, config, min(quick, left()))
    pending += [(bound, c) for bound, _, _, c in queue]
    # Second pass: reopen the unclosed ones in order of bound, with the time that is left.
    while pending and left() > 0:
        pending.sort(key=lambda x: (x[0], _key(x[1])))
        bound, config = pending.pop(0)
        if bound >= best() * (1 - 1e-9):
            pending = []
            break
        if not attempt(bound, config, left()):
            break
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
            model=model,
            cluster=cluster,
            job=job,
            space=asked,
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
        model=model,
        cluster=cluster,
        job=job,
        space=asked,
    )


# The heaviest-rank bound walks every rank's op order: beyond this many ops per step (many
# micro-batches on a deep pipeline) the walk costs more than the bound saves.
HEAVY_BOUND_OPS = 250_000


SECONDS_PER_OP = 1e-5  # building a model walks each op of the orders (about 7 us here)


def _order_size(c: Config) -> int:
    """Ops in all the ranks' orders of one step (a forward and a backward per chunk)."""
    return 3 * c.num_microbatches * c.stages * (2 if c.schedule == "dualpipe" else 1)


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
        t = bound_tables(model, cluster, job, c)
        if t is None:
            continue
        need = memory_floor(t, c)
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
    wall_s: float | None = None,
) -> Outcome:
    """Solve one configuration's CP-SAT model, warm-started (see the module docstring)."""
    choices = _choices(space)
    bounded = bound_tables(model, cluster, job, config) if choices is None else None
    if bounded is not None:  # the bound's tables lack only the rank orders: add them
        orders = rank_orders(
            config.schedule, config.pp, config.num_microbatches, config.virtual_stages
        )
        tables = dataclasses.replace(bounded, ranks=orders)
    else:
        tables = build(model, cluster, job, config, network, choices=choices)
    if any(not k.options for k in tables.kinds.values()):
        return Outcome("infeasible")
    even = rank_balanced_counts(model, cluster, job, config) if choices is None else None
    values, warm = warm_start(tables, cluster, job, time_limit_s, even)
    sm = StageModel(tables, cluster, job)
    rules = TARGETS.get(space.target)
    if rules is not None:  # what the target launcher can state
        sm.one_recompute_choice()
        if rules.get("even_stages"):
            sm.fix(even_counts(model, config))
    if values is not None:
        sm.hint_all(values)
    sol = sm.solve(
        time_limit_s=max(0.01, time_limit_s - warm), workers=workers, seed=seed, wall_s=wall_s
    )
    work = warm + sol.work
    if sol.status in ("infeasible", "unknown"):
        return Outcome(sol.status, work=work)
    layout = config.layout(model, sol.counts, sol.recompute)
    return Outcome(sol.status, sol.objective_s, sol.bound_s, layout, work)


def _choices(space: SearchSpace) -> list[str] | None:
    if space.recompute is None:
        return None
    return [choice_name(parse_recompute(r)) for r in space.recompute]
