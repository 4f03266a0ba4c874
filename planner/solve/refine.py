"""One configuration's CP-SAT model, solved and refined: its stage boundaries and recompute,
warm-started from the rounded relaxation, each layout it returns run on the timeline and its
chains added while the two differ (``solve_config``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from planner.costs.comm import Network
from planner.estimate import step_run
from planner.layout import Layout, parse_recompute
from planner.solve.bounds import bound_tables
from planner.solve.budget import (
    CPSAT_SECONDS,
    RELAXATION_OPS,
    SECONDS_PER_MODEL_OP,
    costing_charge,
    order_size,
)
from planner.solve.lpbound import lp_counts
from planner.solve.model import StageModel
from planner.solve.space import target_rules
from planner.solve.tables import Config, build, choice_name, even_counts, rank_orders
from planner.solve.warm import warm_start
from planner.specs import ClusterSpec, ModelSpec, SearchSpace, TrainingJob
from planner.timeline import shape_forms


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
    """Solve one configuration's CP-SAT model, warm-started, adding the chains of tasks
    that set each candidate's step until the model's step time is the timeline's (see the
    module docstring)."""
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
    small = order_size(config) <= RELAXATION_OPS
    rules = target_rules(space)
    even = lp_counts(model, cluster, job, config) if choices is None and small else None
    if rules is not None and rules.even_stages:
        even = even_counts(model, config)
    values, work = warm_start(tables, cluster, job, time_limit_s, even)
    work *= CPSAT_SECONDS  # warm_start's work is CP-SAT's (completions of pinned models)
    sm = StageModel(tables, cluster, job)
    if rules is not None:  # what the target launcher can state
        sm.one_recompute_choice()
        if rules.even_stages:
            sm.fix(even_counts(model, config))
    sm.add_forms(
        list(
            shape_forms(config.schedule, config.pp, config.num_microbatches, config.virtual_stages)
        )
    )
    seeds = [config.layout(model, even_counts(model, config), {})]
    if values is not None:
        seeds.append(config.layout(model, *sm.decode(values)))
    tasks = costing_charge(model, config)  # the charge for one costed layout
    work += order_size(config) * SECONDS_PER_MODEL_OP  # building the model
    best: tuple[float, Layout] | None = None
    for layout in seeds:
        timeline = step_run(model, cluster, job, layout)[2]
        sm.add_forms(timeline.forms)
        work += tasks
        # The warm start fits: a candidate, unless a target launcher's rules (one recompute
        # choice, even stages) bind the model and not the warm start.
        candidate = layout is not seeds[0] and rules is None
        if candidate and (best is None or timeline.step_s < best[0]):
            best = (timeline.step_s, layout)
    if values is not None:  # after the seeds' chains, so the hint completes with them
        work += sm.hint_all(values) * CPSAT_SECONDS
    status, bound = "unknown", 0.0
    # Short solves first, each longer than the last: a layout the model's chains misjudge
    # comes back soon and its chains join the model, where one long solve would spend the
    # whole budget on the optimum of a model that lacks them.
    step = FIRST_SOLVE
    while True:
        given = max(0.01, min(step, time_limit_s - work))
        sol = sm.solve(
            time_limit_s=given / CPSAT_SECONDS, workers=workers, seed=seed, wall_s=wall_s
        )
        step *= GROWTH
        spent = sol.work * CPSAT_SECONDS
        if sol.status == "infeasible":
            return Outcome("infeasible", work=work + spent)
        if sol.status == "unknown":
            # Nothing in the time given: all of it is charged (a solve the wall clock cut
            # short reports less), so the loop ends however short the solves come back.
            work += max(spent, given)
            if time_limit_s - work > 0.01:
                continue
            break
        work += spent
        bound = sol.bound_s
        layout = config.layout(model, sol.counts, sol.recompute)
        timeline = step_run(model, cluster, job, layout)[2]
        work += tasks
        if best is None or timeline.step_s < best[0]:
            best = (timeline.step_s, layout)
        exact = timeline.step_s <= sol.objective_s * (1 + EXACT)
        # No chain of this layout is new to the model: the two differ by the model's
        # rounding of each block to whole microseconds alone.
        stated = exact or not sm.add_forms(timeline.forms)
        if (stated and sol.status == "optimal") or time_limit_s - work <= 0.01:
            status = sol.status if stated else "feasible"
            break
        assert sol.values is not None
        work += sm.hint_all(sol.values) * CPSAT_SECONDS
    if best is None:
        return Outcome("unknown", work=work)
    return Outcome(status, best[0], min(bound, best[0]), best[1], work)


# The model's step time, in whole microseconds per block, and the timeline's differ by
# rounding: within this fraction they are taken as one.
EXACT = 1e-5


FIRST_SOLVE = 0.05  # deterministic seconds of the first solve of a configuration's model


GROWTH = 1.5  # each later solve's limit over the one before


def _choices(space: SearchSpace) -> list[str] | None:
    if space.recompute is None:
        return None
    return [choice_name(parse_recompute(r)) for r in space.recompute]
