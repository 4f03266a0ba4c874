"""``plan``: the search over degrees and schedules, a CP-SAT model per choice, and the proof.

The outer decisions (tp, pp, dp, ep, ZeRO stage, micro-batch, schedule and its virtual stages,
EMA placement) are enumerated within the ``SearchSpace``; each combination (a ``Config``) gets
a cheap lower bound on its step time (the mean rank's share of every block's cheapest work,
plus the communication in series with it and the optimizer step; ``planner.solve.bounds``)
and a memory lower bound (every rank's share of the model state). First, a feasible answer:
the configurations' even layouts with every layer fully recomputed are costed in order of
bound until one fits. Then configurations are taken in order of their bound. When one's turn
first comes, its linear relaxation (``planner.solve.lpbound``: fractional layers, the
timeline's chains of its shape, each rank's memory) is solved and it goes back in line with
the larger bound; on its second turn it gets its own CP-SAT model (``planner.solve.model``),
warm-started from the rounded relaxation. The model states the step time as the largest of
the chains the timeline reports; each layout it returns is run on the timeline
(``planner.timeline``, what ``evaluate`` reports) and, while the two differ, that layout's
chains join the model and it is solved again. So every layout's figure here is its
timeline's step time, and every bound a bound on that. The plan's layout is then simulated
(``planner.simulate``) and, where the two models disagree, chosen by both (``_judged``). The
search stops when the next bound is no better than the best layout found: then the best is
optimal, or else the gap is the distance to the smallest bound not yet closed.

Dominance rules applied before solving (each says why it loses nothing):
- ZeRO-0 is never better than ZeRO-1: same compute, the reduce-scatter is half the all-reduce
  and the parameter all-gather overlaps the next forward; ZeRO-1 holds less.
- GPipe is never better than 1F1B: the same bubble, more activations.
- With one data-parallel rank (dp * cp = 1, and, for MoE models, one rank in the experts'
  data-parallel group, dp * cp * tp / ep), ZeRO-2 and 3 are never better than ZeRO-1: they
  have nothing to shard, and add buffers and collectives (``space.enumerate_configs``).
- An EMA in host RAM costs no step time and no HBM: when the job has one, host RAM is used
  unless the average rank's share times the GPUs of a node exceeds the node's RAM (then the
  HBM variant is searched too; the model checks the heaviest rank's host RAM either way).

Between the lanes' rounds, moves around the best layout found (``planner.solve.neighbours``):
the sets of degrees one or two choices away from its own (a pipeline stage more for half the
expert-parallel degree, another ZeRO stage), each costed by its quick layout in the lane that
owns it, the faster taken, within ``neighbours.MOVE_SHARE`` of the budget. The line of
bounds says what a set cannot beat, not what it reaches; the moves find the fast sets next
to a fast one. They change what is found, never what is proven.

Both cores: the sets of degrees (tp, pp, dp, ep, micro-batch) are split between ``LANES``
lanes by a hash of their degrees (``planner.solve.lanes``); each lane searches its own sets
as above (``planner.solve.lanesearch``), in rounds of a fixed deterministic length run side
by side, one lane in this process and one in a forked one, and the best layout found is
shared between rounds.
What each lane does in a round depends only on its own state and the best step time at the
round's start, so the plan is the same with one process or two: two only bring it sooner.

What the search explores is decided by a deterministic budget, 30% of ``time_limit_s`` per
lane: CP-SAT's own deterministic time (one worker, interleaved search) plus a fixed charge
for each piece of Python work (per bound, per relaxation by its size, per layout costed by its
blocks and ops, per model built by its ops; ``planner.solve.budget``), so the same inputs give
the same plan on a loaded or an idle machine. ``time_limit_s`` of wall clock is a safety stop only:
when it cuts the search short (a machine several times slower than the charges assume, or
one core doing both lanes' work on a loaded machine) the plan says so
(``Plan.stopped_by_clock``) and may then depend on the machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

from planner.costs.activations import offloads_activations
from planner.errors import PlannerError
from planner.estimate import Estimate, evaluate
from planner.layout import Layout
from planner.recipes import known_layouts
from planner.simulate import SIM_TOLERANCE, simulated_step
from planner.solve import lanes, neighbours
from planner.solve.bounds import (
    bound_tables,
    host_fits,
    memory_floor,
)
from planner.solve.budget import DETERMINISTIC_SHARE, QUICK_SHARE, Budget
from planner.solve.explain import Replan, explain
from planner.solve.first import (
    first_fit,
    hint_configs,
    hinted_layouts,
    host_ok,
    offloaded_layouts,
    without_offload,
)
from planner.solve.lanes import LANES, default_processes
from planner.solve.lanesearch import (
    TOKENS,
    LaneSettings,
    degrees_key,
    lane_close,
    lane_open,
    lane_quick,
    lane_rank,
    lane_step,
    shard_key,
)
from planner.solve.result import Alternative, FrameworkBest, Plan, SimulatedStep
from planner.solve.space import check_step_size, enumerate_configs, for_target
from planner.solve.tables import (
    Config,
    states,
    tie_break,
)
from planner.specs import (
    DEFAULT_TIME_LIMIT_S,
    ClusterSpec,
    ModelSpec,
    SearchSpace,
    TrainingJob,
)

log = logging.getLogger(__name__)


def plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace | None = None,
    *,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    top_k: int = 4,
    workers: int = 1,
    seed: int = 0,
    explain_infeasible: bool = True,
    processes: int | None = None,
    hints: Sequence[Layout] = (),
    clock_limit_s: float | None = None,
) -> Plan:
    """The fastest layout of ``model`` on ``cluster`` for ``job`` within ``space``, with a
    proof of how close to optimal it is (see the module docstring). ``workers``: CP-SAT's
    workers per configuration (more than one interleaved in one thread, deterministically);
    ``processes``: how many processes run the search's lanes (default: the CPUs, at most
    ``lanes.LANES``); the plan does not depend on it, only how soon it comes. ``hints``:
    layouts of neighbouring jobs (a sweep's other GPU counts, say), costed here with this
    job's data-parallel degree before the search starts (``hinted_layouts``): a good one prunes
    early. They change what the search finds first, and so the plan, never what a bound
    proves. ``clock_limit_s``: the wall-clock safety stop (default ``time_limit_s``); a
    caller whose answer must not depend on the machine's load (a sweep) sets it well past
    the time the budget takes."""
    started = time.perf_counter()
    if not (math.isfinite(time_limit_s) and time_limit_s > 0):
        raise PlannerError(
            f"time_limit_s={time_limit_s:g}: must be a finite positive number of seconds"
        )
    if clock_limit_s is not None and not (math.isfinite(clock_limit_s) and clock_limit_s > 0):
        raise PlannerError(
            f"clock_limit_s={clock_limit_s:g}: must be a finite positive number of seconds"
        )
    if processes is not None and processes < 1:
        raise PlannerError(f"processes={processes}: must be a positive process count")
    asked = space or SearchSpace()
    names = asked.frameworks_for(job)
    if len(names) > 1:
        return _plan_each(
            names,
            model,
            cluster,
            job,
            asked,
            time_limit_s=time_limit_s,
            top_k=top_k,
            workers=workers,
            seed=seed,
            explain_infeasible=explain_infeasible,
            processes=processes,
            hints=hints,
            clock_limit_s=clock_limit_s,
        )
    space, job = _target(asked, cluster, job)
    check_step_size(cluster, job, space)
    # The caller's hints, then the catalog's published layouts of this model on this machine
    known = [*hints, *(k for k in known_layouts(model, cluster, job) if k not in hints)]
    configs = _configs(model, cluster, job, space, known)
    if job.ema and space.ema is None:
        # The EMA goes to host RAM (no HBM, no step time) unless the host cannot hold it;
        # what a rank keeps there depends on its degrees, ZeRO stage and DualPipe's copies.
        crowded: dict[tuple[object, ...], bool] = {}

        def holds(c: Config) -> tuple[object, ...]:
            return (c.tp, c.cp, c.pp, c.dp, c.ep, c.etp, c.zero, c.copies)

        for c in configs:
            if holds(c) not in crowded:
                try:  # the state alone: no recompute option needs pricing for this
                    crowded[holds(c)] = not host_fits(*states(model, job, c), cluster, c)
                except PlannerError:  # degrees the model refuses: bound_tables skips them
                    crowded[holds(c)] = False
        configs += [dataclasses.replace(c, ema="hbm") for c in configs if crowded[holds(c)]]
    clock = time_limit_s if clock_limit_s is None else clock_limit_s
    budget = Budget(DETERMINISTIC_SHARE * LANES * time_limit_s, started + clock)
    found: list[tuple[float, Config, Layout]] = []

    def best() -> float:
        return found[0][0] if found else math.inf

    over_host: list[Layout] = []  # layouts that fit HBM but not the host's RAM

    def keep(step: float, config: Config, layout: Layout, *, host_checked: bool = False) -> None:
        # What the stage model does not hold: the host RAM of offloaded activations, which
        # depends on the options it chose (checked here, on the layouts that offload).
        if (
            not host_checked
            and offloads_activations(layout)
            and not host_ok(job, cluster, layout, evaluate(model, cluster, job, layout))
        ):
            over_host.append(layout)
            return
        found.append((step, config, layout))
        found.sort(key=lambda x: (x[0], tie_break(x[1])))
        if not offloads_activations(layout):  # the climb's layouts offload none
            climb.seen(step, config)

    def owner(config: Config) -> int:
        """The lane a configuration's set of degrees is searched in."""
        return lanes.lane_of(shard_key(config), LANES)

    def on_each(call: Any, by_lane: dict[int, Any]) -> list[Any]:
        """``call(token, lane, what)`` in each lane for its own ``what``, side by side."""
        asked = [(lane, (call, (token, lane, what))) for lane, what in by_lane.items()]
        return lanes.run_on(asked, procs)

    token = f"{os.getpid()}:{next(TOKENS)}"
    procs = default_processes() if processes is None else processes
    climb = neighbours.Climb(
        configs,
        neighbours.MOVE_SHARE * budget.limit,
        neighbours.Lanes(owner, partial(on_each, lane_rank), partial(on_each, lane_quick)),
    )

    for item in offloaded_layouts(model, cluster, job, space, configs, budget):
        keep(*item, host_checked=True)  # each checked as its bisection ran
    # Activation offload is searched above, on its own: the lanes' stage models know the
    # space's other recompute choices only.
    space = without_offload(space)
    first = first_fit(model, cluster, job, space, configs, budget)
    if first is not None:
        keep(*first)
    for item in hinted_layouts(model, cluster, job, configs, known, budget, space):
        keep(*item)
    # The sets of degrees (and micro-batch) go to the lanes by what their blocks' costs
    # depend on (``shard_key``), so one lane builds those once; each lane searches its own
    # (``lanesearch``), the lanes side by side in rounds of a fixed deterministic length,
    # sharing the best layout found between rounds (``planner.solve.lanes``).
    groups: dict[tuple[int, ...], list[Config]] = {}
    for c in configs:
        groups.setdefault(degrees_key(c), []).append(c)
    shares = [[m for m in groups.values() if owner(m[0]) == lane] for lane in range(LANES)]
    settings = LaneSettings(
        quick_budget=QUICK_SHARE * max(0.0, budget.limit - budget.spent) / LANES,
        first_limit=max(0.3, min(2.0, budget.limit / LANES / 10)),
        workers=workers,
        seed=seed,
    )
    round_s = settings.first_limit  # a round: about one first-pass solve per lane

    def on_lanes(call: Any, *rest: Any) -> list[Any]:
        return lanes.run_on([(lane, (call, (token, lane, *rest))) for lane in range(LANES)], procs)

    pending: list[tuple[float, Config]] = []  # not closed: (bound, config)
    opened = False
    try:
        lanes.run_on(
            [
                (lane, (lane_open, (token, lane, model, cluster, job, space, share, settings)))
                for lane, share in enumerate(shares)
            ],
            procs,
        )
        opened = True
        while budget.left() > 0:
            left = budget.left()
            steps = on_lanes(
                lane_step, best(), min(round_s, left / LANES), left / LANES, budget.wall_left()
            )
            busy = False
            for out in steps:  # in lane order: the same whatever finished first
                budget.charge(out.spent)
                for item in out.found:
                    keep(*item)
                busy = busy or out.busy
            # Moves around the best layout, within their share of the budget (``neighbours``)
            for item in climb.climb(found[0][:2], budget) if found else []:
                keep(*item)
            if not busy:
                break
        for still in on_lanes(lane_close):
            pending += still
        opened = False
    finally:
        if opened:  # interrupted: free the lanes' state
            with contextlib.suppress(Exception):
                on_lanes(lane_close)
    open_bounds = [b for b, _ in pending if b < best() * (1 - 1e-9)]
    if log.isEnabledFor(logging.DEBUG):
        for b, c in sorted(pending, key=lambda x: (x[0], tie_break(x[1])))[:12]:
            log.debug("open %.4f %s", b, c)
    if not found:
        if over_host:
            raise PlannerError(
                f"SearchSpace.recompute={space.recompute}: the {len(over_host)} layouts found "
                f"that fit HBM keep more offloaded activations than a node's host RAM "
                f"({cluster.host_ram_bytes / 2**30:.0f} GiB); offload fewer modules"
            )
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
    lower = min([found[0][0], *open_bounds])
    searched = time.perf_counter() - started  # the simulations below are not the search's
    finalists = [found[0], *_distinct(found[1:], exclude=found[0][1])]
    every = _judged(model, cluster, job, finalists, keep=top_k, processes=procs)
    judged = every[:top_k]
    (objective, _, layout), estimate, simulated = judged[0]
    assert simulated is not None  # the plan's layout is always simulated (``_judged``)
    gap = max(0.0, (objective - lower) / objective)
    status = "optimal" if not open_bounds and gap <= 1e-9 else "feasible"
    simulation = SimulatedStep(
        step_time_s=simulated,
        difference=simulated / estimate.step_time_s - 1,
        tolerance=SIM_TOLERANCE,
        chosen=_chosen(every, finalists[0]),
    )
    alternatives = [
        Alternative(
            layout=alt,
            step_time_s=est.step_time_s,
            peak_bytes=est.peak_bytes,
            simulated_step_s=sim,
        )
        for (_, _, alt), est, sim in judged[1:]
    ]
    return Plan(
        status=status,
        layout=layout,
        estimate=estimate,
        objective_s=objective,
        lower_bound_s=lower,
        gap=0.0 if status == "optimal" else gap,
        solve_time_s=searched,
        configurations=len(configs),
        alternatives=alternatives,
        simulation=simulation,
        stopped_by_clock=budget.stopped_by_clock,
        model=model,
        cluster=cluster,
        job=job,
        space=asked,
    )


def _target(
    asked: SearchSpace, cluster: ClusterSpec, job: TrainingJob
) -> tuple[SearchSpace, TrainingJob]:
    """The space as the job's target launcher runs it, and the job under that framework with
    the machine's measured memory figures (``ClusterSpec.job_on``)."""
    space = for_target(asked, job)
    return space, cluster.job_on(_framework_for(job, space))


def _configs(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace,
    hints: Sequence[Layout],
) -> list[Config]:
    """The configurations the search takes: the space's, and those of ``hints`` with virtual
    stages outside its menu (``hint_configs``)."""
    configs = list(enumerate_configs(model, cluster, job, space))
    return configs + hint_configs(model, cluster, job, space, configs, hints)


def hinted_steps(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace | None,
    hints: Sequence[Layout],
) -> list[tuple[float, Layout] | None]:
    """Each of the ``hints`` restated for this job as ``plan`` restates them
    (``hinted_layouts``: this job's data-parallel degree, the nearest micro-batch and
    expert-parallel degree that divide) with its estimated step, or None where it does not
    restate or fit; all None where the space holds several frameworks. What a sweep asks of
    its other GPU counts' plans before it plans a case again from them (``planner.sweep``)."""
    asked = space or SearchSpace()
    if len(asked.frameworks_for(job)) > 1:
        return [None] * len(hints)
    target, job = _target(asked, cluster, job)
    configs = _configs(model, cluster, job, target, hints)
    budget = Budget(math.inf, math.inf)  # no budget: every hint is costed
    out: list[tuple[float, Layout] | None] = []
    for hint in hints:
        found = hinted_layouts(model, cluster, job, configs, [hint], budget, target)
        out.append((found[0][0], found[0][2]) if found else None)
    return out


Judged = tuple[tuple[float, Config, Layout], Estimate, float | None]
JUDGED = 8  # the most final candidates simulated where the search's best disagrees


def _judged(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    finalists: list[tuple[float, Config, Layout]],
    keep: int = 1,
    processes: int = 1,
) -> list[Judged]:
    """The final candidates (the search's best, then the best of each other set of degrees,
    in the estimate's order), each with its estimate and, where judged, its simulated step;
    the one the plan takes first.

    The search's best is simulated. Where its simulation and estimate agree (within
    ``SIM_TOLERANCE``) it stays the plan. Where they do not, the two models price that
    layout's overlap differently, so every other candidate that could beat it (estimated
    faster than its slower figure; at most ``JUDGED``) is simulated too, and the plan takes
    the one whose slower figure, estimate or simulation, is the least (a layout is counted at
    what the more pessimistic model says of it) where that is less than the search's best's by
    more than the tolerance, the most the two models are taken to disagree by without
    saying so. The others follow in the estimate's order, at least ``keep`` in all where there
    are as many.

    With ``processes`` > 1 the runner-up is simulated in a search lane beside the best, in
    case the best disagrees (its figure is read only then): the same plan, sooner."""
    first = finalists[0]
    est = evaluate(model, cluster, job, first[2])
    sims = [(0, (simulated_step, (model, cluster, job, first[2])))]
    if processes > 1 and len(finalists) > 1 and JUDGED > 1:
        sims.append((1, (simulated_step, (model, cluster, job, finalists[1][2]))))
    ahead = lanes.run_on(sims, processes)
    out: list[Judged] = [(first, est, ahead[0])]
    agrees = _agrees(out[0])
    bar = max(est.step_time_s, out[0][2] or 0.0)
    for item in finalists[1:]:  # in the estimate's order: once one cannot win, none can
        judge = not agrees and item[0] < bar and len(out) < JUDGED
        if not judge and len(out) >= keep:
            break
        other = evaluate(model, cluster, job, item[2])
        sim = None
        if judge:
            early = len(ahead) > 1 and item is finalists[1]
            sim = ahead[1] if early else simulated_step(model, cluster, job, item[2])
        out.append((item, other, sim))
    if agrees:
        return out
    slower = {i: max(j[1].step_time_s, j[2]) for i, j in enumerate(out) if j[2] is not None}
    best = min(slower, key=lambda i: (slower[i], i))
    if slower[best] >= slower[0] * (1 - SIM_TOLERANCE):
        return out  # no better by more than the two models' own disagreement: kept
    return [out[best], *(j for i, j in enumerate(out) if i != best)]


def _agrees(judged: Judged) -> bool:
    _, est, sim = judged
    return sim is None or abs(sim / est.step_time_s - 1) <= SIM_TOLERANCE


def _chosen(judged: list[Judged], first: tuple[float, Config, Layout]) -> str:
    """Why the plan is not the search's best by the estimate, in words ("" where it is)."""
    (_, _, layout), est, sim = judged[0]
    if judged[0][0] is first:
        return ""
    (_, _, was), was_est, was_sim = next(j for j in judged if j[0] is first)
    assert sim is not None and was_sim is not None
    return (
        f"the search's best by the estimate, {was.degrees()} {was.schedule} "
        f"({was_est.step_time_s:.3f} s), simulates at {was_sim:.3f} s "
        f"({was_sim / was_est.step_time_s - 1:+.1%}); of the "
        f"{sum(j[2] is not None for j in judged)} final candidates simulated, "
        f"{layout.degrees()} {layout.schedule} is the fastest counted at the slower of its "
        f"estimate ({est.step_time_s:.3f} s) and its simulation ({sim:.3f} s)"
    )


def _framework_for(job: TrainingJob, space: SearchSpace) -> TrainingJob:
    """The job under the software the space's target launcher runs: a plan for Megatron-LM
    is costed with what Megatron-LM overlaps, and so on."""
    if space.framework is None or job.framework == space.framework:
        return job
    assert isinstance(space.framework, str)  # one framework: for_target resolved it
    if "framework" in job.model_fields_set:
        raise PlannerError(
            f"TrainingJob.framework={job.framework!r}: SearchSpace.framework={space.framework!r} "
            f"runs the plan with {space.framework}; leave the framework out or make them agree"
        )
    return job.with_framework(space.framework)


def _plan_each(
    names: list[str | None],
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    asked: SearchSpace,
    *,
    time_limit_s: float,
    clock_limit_s: float | None,
    **options: Any,
) -> Plan:
    """The best plan of each framework in ``names`` (the time limit shared evenly), and of
    them the fastest, which says in ``Plan.frameworks`` what each framework's best costs."""
    if "framework" in job.model_fields_set:
        raise PlannerError(
            f"TrainingJob.framework={job.framework!r}: SearchSpace.framework={asked.framework!r} "
            f"searches each of {', '.join(str(n) for n in names)}; leave the framework out"
        )
    started = time.perf_counter()
    share = time_limit_s / len(names)
    clock = None if clock_limit_s is None else clock_limit_s / len(names)
    plans: list[Plan] = []
    each: list[FrameworkBest] = []
    errors: list[PlannerError] = []
    for name in names:
        try:
            one = plan(
                model,
                cluster,
                job,
                asked.model_copy(update={"framework": name}),
                time_limit_s=share,
                clock_limit_s=clock,
                **options,
            )
        except PlannerError as exc:  # no layout in its share of the time, none proven
            errors.append(exc)
            each.append(FrameworkBest(framework=str(name), status="unsettled"))
            continue
        plans.append(one)
        each.append(
            FrameworkBest(
                framework=str(name),
                status=one.status,
                step_time_s=one.estimate.step_time_s if one.estimate else None,
                gap=one.gap,
            )
        )
    if not plans:
        raise errors[0]
    feasible = [p for p in plans if p.estimate is not None]
    best = min(feasible, key=lambda p: p.estimate.step_time_s) if feasible else plans[0]  # type: ignore[union-attr]
    update: dict[str, Any] = {}
    if best.objective_s is not None:
        # The proof covers every framework: the least bound of them all (none where one
        # framework's search settled nothing).
        bounds = [p.lower_bound_s for p in feasible if p.lower_bound_s is not None]
        lower = 0.0 if errors else min(bounds)
        gap = max(0.0, (best.objective_s - lower) / best.objective_s)
        update = {
            "lower_bound_s": lower,
            "gap": 0.0 if gap <= 1e-9 else gap,
            "status": "optimal" if gap <= 1e-9 and best.status == "optimal" else "feasible",
        }
    return best.model_copy(
        update=update
        | {
            "frameworks": each,
            "space": asked,
            "solve_time_s": time.perf_counter() - started,
            "configurations": sum(p.configurations for p in plans),
            "stopped_by_clock": any(p.stopped_by_clock for p in plans),
        }
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
        t = bound_tables(model, cluster, job, c)
        if t is None:
            continue
        need = memory_floor(t, c)
        if best is None or need < best[0]:
            where = (
                f"tp={c.tp} cp={c.cp} pp={c.pp} dp={c.dp} ep={c.ep} etp={c.etp} ZeRO-{c.zero} "
                f"{c.schedule}"
            )
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
    return (c.tp, c.cp, c.pp, c.dp, c.ep, c.etp, c.schedule, c.virtual_stages)


# -- the lanes (see ``plan``): each searches its share of the sets of degrees ------------


# -- one configuration -----------------------------------------------------------------------
