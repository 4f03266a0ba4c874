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
(``planner.timeline``, what ``evaluate`` and ``simulate`` report) and, while the two differ,
that layout's chains join the model and it is solved again. So every layout's figure here is
its simulated step time, and every bound a bound on that. The search stops when the next
bound is no better than the best layout found: then the best is optimal, or else the gap is
the distance to the smallest bound not yet closed.

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

Both cores: the sets of degrees (tp, pp, dp, ep, micro-batch) are split between ``LANES``
lanes by a hash of their degrees (``planner.solve.lanes``); each lane searches its own sets
as above (``_Lane``), in rounds of a fixed deterministic length run side by side, one lane in
this process and one in a forked one, and the best layout found is shared between rounds.
What each lane does in a round depends only on its own state and the best step time at the
round's start, so the plan is the same with one process or two: two only bring it sooner.

What the search explores is decided by a deterministic budget, 30% of ``time_limit_s`` per
lane: CP-SAT's own deterministic time (one worker, interleaved search) plus a fixed charge
for each piece of Python work (per bound, per relaxation by its size, per layout costed by its
blocks and ops, per model built by its ops; ``Budget``), so the same inputs give the same
plan on a loaded or an idle machine. ``time_limit_s`` of wall clock is a safety stop only:
when it cuts the search short (a machine several times slower than the charges assume, or
one core doing both lanes' work on a loaded machine) the plan says so
(``Plan.stopped_by_clock``) and may then depend on the machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from planner.costs.activations import offloads_activations
from planner.costs.cap import memory_cap, usable_peak_bytes
from planner.costs.comm import Network
from planner.costs.memory import stage_memory
from planner.errors import PlannerError
from planner.estimate import Estimate, evaluate, step_run
from planner.frameworks import FRAMEWORKS, framework
from planner.layout import Layout, parse_recompute
from planner.solve import lanes
from planner.solve.bounds import (
    bound_tables,
    communication_floor,
    crowded_rank,
    degrees_bound,
    fill_and_drain,
    host_fits,
    lower_bound,
    memory_floor,
    state_fits,
)
from planner.solve.explain import Replan, explain
from planner.solve.lanes import LANES, default_processes
from planner.solve.lpbound import lp_bound, lp_counts
from planner.solve.model import StageModel
from planner.solve.result import Alternative, Plan
from planner.solve.space import enumerate_configs, for_target, target_rules
from planner.solve.tables import (
    Config,
    Option,
    Tables,
    build,
    choice_name,
    even_counts,
    rank_orders,
    states,
)
from planner.solve.warm import balanced, warm_start
from planner.specs import ClusterSpec, ModelSpec, SearchSpace, TrainingJob
from planner.timeline import shape_forms

log = logging.getLogger(__name__)

DETERMINISTIC_SHARE = 0.3  # of time_limit_s per lane: the budget (see the module docstring)
# Deterministic charges for Python work, in seconds of budget, fitted to times measured on
# this project's 2-core reference machine (an op is one forward or backward of one
# micro-batch on one stage, ``_order_size``): a configuration's own bound and the bound of a
# set of degrees (which builds two tables); a relaxation (its timeline runs and linear
# program); costing a layout (its memory and stage tables per block, then the timeline);
# checking a layout's memory alone; building a CP-SAT model and stating its chains. Refitted
# on the 11 jobs of benchmarks/plan_speed.py at 10 s (wall time per call against the
# charge; benchmarks/RESULTS.md, 2026-11-25); the first sight of a shape (its program and
# memory points, its chains) and the relaxation's per-op and per-stage terms refitted on 62
# configurations of pp 2 to 64 and up to 184,320 ops (llama3-8b, llama3-70b, deepseek-v3
# on H800; cold and warm calls timed apart).
SECONDS_PER_BOUND = 5e-4
SECONDS_PER_DEGREES_BOUND = 2.2e-3
SECONDS_PER_RELAXATION = 4.2e-3
SECONDS_PER_DRAIN = 1.5e-3
SECONDS_PER_DRAIN_CELL = 2e-7  # per chain and stage of the dual descent
SECONDS_PER_SHAPE = 6e-3  # a shape's chains, once per lane
SECONDS_PER_SHAPE_OP = 6e-7  # per op and timeline run, more on deep pipelines
SECONDS_PER_RELAXATION_OP = 5e-6
SECONDS_PER_RELAXATION_STAGE2 = 5e-5  # its chains span every stage: per stage squared
SECONDS_PER_BLOCK = 3.4e-4
SECONDS_PER_MEMORY_BLOCK = 5e-5  # building the layout and its memory (2.3 to 3.0 ms a call)
SECONDS_PER_TIMELINE_OP = 1e-6
SECONDS_PER_MODEL_OP = 1e-5
# The first time a lane meets a schedule's shape: its task program and each rank's memory
# points (``timeline.program``, ``memory.level_points``), per op, more on deep pipelines.
SECONDS_PER_PROGRAM_OP = 4e-6
# Budget seconds per second of CP-SAT's deterministic time: its models here take 1.7 s of
# wall time per deterministic second on the reference machine (the 38 solves of
# llama3-8b-8-h100 at 10 s in benchmarks/plan_speed.py: 7.19 s against 4.15).
CPSAT_SECONDS = 1.7
QUICK_SHARE = 0.4  # of the budget left after the bounds, at most, for layouts before proofs


@dataclass
class Budget:
    """Deterministic work left (see the module docstring) and the wall-clock safety stop."""

    limit: float
    deadline: float
    spent: float = 0.0
    stopped_by_clock: bool = False

    def charge(self, seconds: float) -> None:
        self.spent += seconds

    def left(self) -> float:
        if time.perf_counter() >= self.deadline:
            self.stopped_by_clock = True
            return 0.0
        return max(0.0, self.limit - self.spent)

    def wall_left(self) -> float:
        return self.deadline - time.perf_counter()


def plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace | None = None,
    *,
    time_limit_s: float = 30.0,
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
    job's data-parallel degree before the search starts (``_hinted``): a good one prunes
    early. They change what the search finds first, and so the plan, never what a bound
    proves. ``clock_limit_s``: the wall-clock safety stop (default ``time_limit_s``); a
    caller whose answer must not depend on the machine's load (a sweep) sets it well past
    the time the budget takes."""
    started = time.perf_counter()
    if not time_limit_s > 0:
        raise PlannerError(f"time_limit_s={time_limit_s:g}: must be a positive number of seconds")
    if clock_limit_s is not None and not clock_limit_s > 0:
        raise PlannerError(f"clock_limit_s={clock_limit_s:g}: must be a positive number of seconds")
    if processes is not None and processes < 1:
        raise PlannerError(f"processes={processes}: must be a positive process count")
    asked = space or SearchSpace()
    space = for_target(asked)
    job = _framework_for(job, space)
    configs = list(enumerate_configs(model, cluster, job, space))
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
    procs = default_processes() if processes is None else processes
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
            and not _host_ok(job, cluster, layout, evaluate(model, cluster, job, layout))
        ):
            over_host.append(layout)
            return
        found.append((step, config, layout))
        found.sort(key=lambda x: (x[0], _key(x[1])))

    for item in _offloaded(model, cluster, job, space, configs, budget):
        keep(*item, host_checked=True)  # each checked as its bisection ran
    # Activation offload is searched above, on its own: the lanes' stage models know the
    # space's other recompute choices only.
    space = without_offload(space)
    first = _feasible(model, cluster, job, space, configs, budget)
    if first is not None:
        keep(*first)
    for item in _hinted(model, cluster, job, configs, hints, budget):
        keep(*item)
    # The sets of degrees (and micro-batch) go to the lanes by their key; each lane searches
    # its own (``_Lane``), the lanes side by side in rounds of a fixed deterministic length,
    # sharing the best layout found between rounds (``planner.solve.lanes``).
    groups: dict[tuple[int, ...], list[Config]] = {}
    for c in configs:
        groups.setdefault(_degrees_key(c), []).append(c)
    shares = [
        [m for k, m in groups.items() if lanes.lane_of(k, LANES) == lane] for lane in range(LANES)
    ]
    settings = _Settings(
        quick_budget=QUICK_SHARE * max(0.0, budget.limit - budget.spent) / LANES,
        first_limit=max(0.3, min(2.0, budget.limit / LANES / 10)),
        workers=workers,
        seed=seed,
    )
    token = f"{os.getpid()}:{next(_TOKENS)}"
    round_s = settings.first_limit  # a round: about one first-pass solve per lane

    def on_lanes(call: Any, *rest: Any) -> list[Any]:
        return lanes.run_on([(lane, (call, (token, lane, *rest))) for lane in range(LANES)], procs)

    pending: list[tuple[float, Config]] = []  # not closed: (bound, config)
    opened = False
    try:
        lanes.run_on(
            [
                (lane, (_lane_open, (token, lane, model, cluster, job, space, share, settings)))
                for lane, share in enumerate(shares)
            ],
            procs,
        )
        opened = True
        while budget.left() > 0:
            left = budget.left()
            steps = on_lanes(
                _lane_step, best(), min(round_s, left / LANES), left / LANES, budget.wall_left()
            )
            busy = False
            for out in steps:  # in lane order: the same whatever finished first
                budget.charge(out.spent)
                for item in out.found:
                    keep(*item)
                busy = busy or out.busy
            if not busy:
                break
        for still in on_lanes(_lane_close):
            pending += still
        opened = False
    finally:
        if opened:  # interrupted: free the lanes' state
            with contextlib.suppress(Exception):
                on_lanes(_lane_close)
    open_bounds = [b for b, _ in pending if b < best() * (1 - 1e-9)]
    if log.isEnabledFor(logging.DEBUG):
        for b, c in sorted(pending, key=lambda x: (x[0], _key(x[1])))[:12]:
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
    objective, config, layout = found[0]
    lower = min([objective, *open_bounds])
    gap = max(0.0, (objective - lower) / objective)
    status = "optimal" if not open_bounds else "feasible"
    estimate = evaluate(model, cluster, job, layout)
    alternatives = []
    for _, _c, alt in _distinct(found[1:], exclude=config)[: max(0, top_k - 1)]:
        other = evaluate(model, cluster, job, alt)
        alternatives.append(
            Alternative(layout=alt, step_time_s=other.step_time_s, peak_bytes=other.peak_bytes)
        )
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
        stopped_by_clock=budget.stopped_by_clock,
        model=model,
        cluster=cluster,
        job=job,
        space=asked,
    )


def _feasible(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace,
    configs: list[Config],
    budget: Budget,
) -> tuple[float, Config, Layout] | None:
    """A first layout that fits, before any bound is worked out: even stages, every layer
    with the leanest recompute the space allows (full, unless it says otherwise), for the
    configurations that hold the least per rank first (the most ZeRO sharding, the fewest
    micro-batches in flight, the smallest micro-batch), the fewest model-parallel ranks
    (tp * pp) among those, one per set of degrees. It goes on until one fits or every set
    was tried, whatever the budget: a user always gets an answer when such a layout exists
    (each costing is charged all the same)."""
    allowed = space.recompute or ["full"]
    lean = "full" if "full" in allowed else allowed[-1]

    def order(c: Config) -> tuple[object, ...]:
        return (-c.zero, c.micro_batch, c.pipeline.leanness, c.tp * c.cp * c.pp, _key(c))

    seen: set[tuple[object, ...]] = set()
    programs: set[tuple[str, int, int, int]] = set()
    for config in sorted(configs, key=order):
        shape = (config.tp, config.cp, config.pp, config.dp, config.ep, config.etp)
        if shape in seen:  # one try per degrees: the leanest of them
            continue
        seen.add(shape)
        # Sets whose share of the model state alone is over the cap are passed over before
        # any layout is costed (an infeasible job's thousands of micro-batches make each
        # costing long).
        budget.charge(SECONDS_PER_BOUND)
        tables = bound_tables(model, cluster, job, config)
        if tables is None or not state_fits(tables, cluster, job, config):
            continue
        budget.charge(_costing(model, config) + _program_charge(config, programs))
        try:
            layout = config.layout(model, even_counts(model, config), _uniform(model, lean))
            est = evaluate(model, cluster, job, layout)
        except PlannerError:
            continue
        if est.fits and _host_ok(job, cluster, layout, est):
            return est.step_time_s, config, layout
    return None


def without_offload(space: SearchSpace) -> SearchSpace:
    """``space`` without activation offload among its recompute choices (layers it does not
    offload run without recompute: "offload" alone leaves "none")."""
    if not space.recompute or "offload" not in space.recompute:
        return space
    rest = [r for r in space.recompute if r != "offload"]
    return space.model_copy(update={"recompute": rest or ["none"]})


OFFLOAD_SHARE = 0.25  # of the budget the activation-offload search may take


def _offloaded(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace,
    configs: list[Config],
    budget: Budget,
) -> list[tuple[float, Config, Layout]]:
    """Layouts with activation offload ("offload" in the space's recompute list), as
    Megatron-LM runs it: the first n transformer layers of a layout without pipeline
    parallelism offloaded, the others without recompute (``costs.memory.
    activation_offload_rule``). Each layer offloaded holds less and adds its copies' exposed
    time, so a configuration's fastest is the fewest layers that fit: found exactly, by
    bisection over n, for each configuration until its share of the budget is spent."""
    if not space.recompute or "offload" not in space.recompute:
        return []
    if not framework(job.framework).activation_offload:
        able = " or ".join(n for n, f in FRAMEWORKS.items() if f.activation_offload)
        raise PlannerError(
            f"SearchSpace.recompute={space.recompute}: activation offload runs under "
            f"{able} only, not {job.framework!r}"
        )
    stop = budget.spent + OFFLOAD_SHARE * max(0.0, budget.limit - budget.spent)
    out = []
    for config in sorted(configs, key=_key):
        if config.pp != 1 or config.virtual_stages != 1 or budget.spent > stop:
            continue
        tables = bound_tables(model, cluster, job, config)
        if tables is None or not state_fits(tables, cluster, job, config):
            continue
        tried: dict[int, tuple[Estimate, Layout] | None] = {}

        def run(
            n: int,
            config: Config = config,
            tried: dict[int, tuple[Estimate, Layout] | None] = tried,
        ) -> tuple[Estimate, Layout] | None:
            if n not in tried:
                budget.charge(_costing(model, config))
                offload = {f"layer.{i}": "offload" for i in range(n)}
                try:
                    layout = config.layout(model, [model.num_layers], offload)
                    est = evaluate(model, cluster, job, layout)
                except PlannerError:
                    tried[n] = None
                else:
                    ok = est.fits and _host_ok(job, cluster, layout, est)
                    tried[n] = (est, layout) if ok else None
            return tried[n]

        low, high = 1, model.num_layers - 1
        if high < low or run(high) is None:
            continue
        while low < high:
            mid = (low + high) // 2
            if run(mid) is not None:
                high = mid
            else:
                low = mid + 1
        fit = run(high)
        if fit is not None:
            out.append((fit[0].step_time_s, config, fit[1]))
    return out


def _hinted(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    configs: list[Config],
    hints: Sequence[Layout],
    budget: Budget,
) -> list[tuple[float, Config, Layout]]:
    """The ``hints`` that fit this job, each with its step time: a hint keeps its tensor and
    pipeline degrees, stages, recompute, ZeRO stage, schedule and micro-batch and takes the
    data-parallel degree this job's GPU count leaves (and the micro-batches per step that
    gives); its micro-batch, when the batch no longer divides, the largest smaller one that
    does, and its expert-parallel degree the nearest that divides. A hint whose degrees fall
    outside the space is passed over."""
    out: list[tuple[float, Config, Layout]] = []
    known = set(configs)
    programs: set[tuple[str, int, int, int]] = set()
    for hint in hints:
        layers = [b.block for s in hint.stages for b in s.blocks if b.block.startswith("layer.")]
        if len(layers) != model.num_layers:
            continue  # another model's layout
        dp = cluster.num_gpus // (hint.tp * hint.cp * hint.pp)
        rest = dict(
            tp=hint.tp,
            cp=hint.cp,
            pp=hint.pp,
            dp=dp,
            zero=hint.zero,
            schedule=hint.schedule,
            virtual_stages=hint.virtual_stages,
            ema=hint.ema,
            fp8_cache=hint.fp8_cache,
            sequence_parallel=hint.sequence_parallel,
            etp=hint.etp,
            optimizer_offload=hint.optimizer_offload,
        )
        same = [c for c in known if all(getattr(c, k) == v for k, v in rest.items())]
        if not same:
            continue

        def near(c: Config, hint: Layout = hint) -> tuple[object, ...]:
            # The hint's micro-batch, else the largest smaller one (it holds less), then the
            # nearest expert-parallel degree, the larger of two as near (it holds less).
            mb = c.micro_batch
            return (
                mb != hint.micro_batch,
                mb > hint.micro_batch,
                -mb,
                abs(math.log(c.ep / hint.ep)),
                -c.ep,
            )

        config = min(same, key=near)
        budget.charge(_costing(model, config) + _program_charge(config, programs))
        try:
            layout = Layout(
                **{
                    **hint.model_dump(),
                    "dp": config.dp,
                    "ep": config.ep,
                    "micro_batch": config.micro_batch,
                    "num_microbatches": None,
                }
            )
            est = evaluate(model, cluster, job, layout)
        except PlannerError:
            continue
        if est.fits and _host_ok(job, cluster, layout, est):
            out.append((est.step_time_s, config, layout))
    return out


def _quick(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace,
    config: Config,
    budget: Budget,
    programs: set[tuple[str, int, int, int]],
) -> tuple[float, Layout] | None:
    """The faster of two layouts of ``config`` (even layer counts; stages even in time),
    each rank's layers at the fastest choice of ``_ladder`` (a recompute option per kind of
    layer, in the space) that its memory fits, and its step time; None when none fits."""
    t = bound_tables(model, cluster, job, config)
    if t is None:
        return None
    allowed = {choice_name(parse_recompute(r)) for r in space.recompute or []}
    ordered = _ladder(t, allowed)
    # Two partitions: even layer counts, and stages even in time with the embedding's and
    # head's own work counted (``warm.balanced``), unless the target launcher runs even
    # layer counts only.
    partitions = [even_counts(model, config)]
    rules = target_rules(space)
    if rules is None or not rules.even_stages:
        partitions.append(balanced(t, lambda o: o.time))
    cap = usable_peak_bytes(cluster, job)
    blocks = model.num_layers + model.num_mtp_layers + 2
    budget.charge(_program_charge(config, programs))
    holders = _holders(config)

    def peaks(counts: list[int], choice: dict[str, str]) -> list[float]:
        """Each rank's peak with ``choice`` for every layer (by kind)."""
        budget.charge(blocks * SECONDS_PER_MEMORY_BLOCK)
        layout = config.layout(model, counts, _by_kind(model, t, choice))
        memory = stage_memory(model, job, layout, num_microbatches=config.num_microbatches)
        return [s.peak_bytes for s in memory]

    best: tuple[float, Layout] | None = None
    for counts in dict.fromkeys(map(tuple, partitions)):
        try:
            if not ordered or max(peaks(list(counts), ordered[-1])) > cap:
                continue  # the leanest choice does not fit: no choice does
            # Each rank at the fastest choice its own memory fits (a rank's memory depends
            # on its own blocks alone; the ladder's bytes fall as its time rises, so a
            # rank's fitting choices are a tail of it, found by bisection, all ranks at
            # once); a stage two ranks hold (DualPipe) at the leaner of their choices.
            low = [0] * config.pp
            high = [len(ordered) - 1] * config.pp
            while any(lo < hi for lo, hi in zip(low, high, strict=True)):
                middle = sorted(
                    {(lo + hi) // 2 for lo, hi in zip(low, high, strict=True) if lo < hi}
                )
                at = {i: peaks(list(counts), ordered[i]) for i in middle}
                for r in range(config.pp):
                    mid = (low[r] + high[r]) // 2
                    if low[r] < high[r] and mid in at:
                        if at[mid][r] <= cap:
                            high[r] = mid
                        else:
                            low[r] = mid + 1
            stage_choice = [ordered[max(high[r] for r in holders[c])] for c in range(config.stages)]
            layout = config.layout(model, list(counts), _by_stage(t, list(counts), stage_choice))
            budget.charge(_costing(model, config))
            est = evaluate(model, cluster, job, layout)
            good = est.fits and _host_ok(job, cluster, layout, est)
            if good and (best is None or est.step_time_s < best[0]):
                best = (est.step_time_s, layout)
        except PlannerError:
            continue
    return best


def _holders(config: Config) -> list[list[int]]:
    """The ranks that hold each stage."""
    from planner.layout import chunks_of

    out: list[list[int]] = [[] for _ in range(config.stages)]
    for r in range(config.pp):
        for c in chunks_of(config.schedule, config.pp, config.virtual_stages, r):
            out[c].append(r)
    return out


def _by_stage(t: Tables, counts: list[int], choices: list[dict[str, str]]) -> dict[str, str]:
    """Each layer's recompute from its stage's choice by kind; the embedding's and the first
    stage's fixed blocks from the first stage's, MTP modules from the last stage's."""
    out: dict[str, str] = {}
    i = 0
    for c, n in enumerate(counts):
        for layer in range(i, i + n):
            out[f"layer.{layer}"] = choices[c][t.layer_kinds[layer]]
        i += n
    out |= {n: choices[0][n] for n in t.first_fixed if n in choices[0]}
    out |= {n: choices[-1][n] for n in t.last_fixed if n in choices[-1]}
    return out


def _fill(config: Config) -> float:
    """1 + (pp - 1) / m: 1F1B's step over its busiest rank's work with even stages."""
    return 1 + (config.pp - 1) / config.num_microbatches


def _relaxation_may_prune(config: Config, bound: float, best: float) -> bool:
    """Whether the relaxation could lift ``bound`` to ``best``: it adds at most the
    pipeline's fill and drain, about (stages - 1) of m micro-batches' worth for one chunk
    (taken twice, for safety). Only decides what is worth computing, never what is proven."""
    if math.isinf(best) or config.pp == 1:
        return config.pp > 1
    fill = 2 * (config.stages - 1) / config.num_microbatches
    return bound * (1 + fill) >= best


def _framework_for(job: TrainingJob, space: SearchSpace) -> TrainingJob:
    """The job under the software the space's target launcher runs: a plan for Megatron-LM
    is costed with what Megatron-LM overlaps, and so on."""
    if space.target == "any" or job.framework == space.target:
        return job
    if "framework" in job.model_fields_set:
        raise PlannerError(
            f"TrainingJob.framework={job.framework!r}: SearchSpace.target={space.target!r} "
            f"runs the plan with {space.target}; leave the framework out or make them agree"
        )
    return job.with_framework(space.target)


def _ladder(t: Tables, allowed: set[str]) -> list[dict[str, str]]:
    """Recompute choices for the quick layouts, fastest first: each name every kind has, for
    all of them; and, for each option of the layer kind with the most layers, every other
    layer kind and MTP module at its fastest option that keeps no larger a share of its
    most saved bytes (kinds have different menus: DeepSeek-V3's dense and MoE layers share
    only five of their options, and the best of its MoE layers' is not one of them).
    Options outside the space's recompute list are left out (MTP modules may stay as they
    are)."""
    kinds = sorted(set(t.layer_kinds))
    main = max(kinds, key=lambda k: (t.layer_kinds.count(k), k))
    mtp = [n for n in t.first_fixed + t.last_fixed if n.startswith("mtp.")]
    weight = {k: t.layer_kinds.count(k) for k in kinds} | dict.fromkeys(mtp, 1)

    def menu(k: str) -> list[Option]:
        options = t.kinds[k].options
        keep = [o for o in options if not allowed or o.name in allowed or k in mtp]
        return keep or options

    most = {k: max(o.saved for o in menu(k)) or 1.0 for k in weight}
    ladder: dict[tuple[tuple[str, str], ...], float] = {}
    # The names every kind has, as one choice for all.
    shared = set.intersection(*({o.name for o in menu(k)} for k in weight))
    for name in shared:
        same = {k: next(o for o in menu(k) if o.name == name) for k in weight}
        key = tuple(sorted((k, o.name) for k, o in same.items()))
        ladder[key] = sum(weight[k] * o.time for k, o in same.items())
    for lead in menu(main):
        share = lead.saved / most[main]
        choice = {main: lead}
        for k in weight:
            if k == main:
                continue
            under = [o for o in menu(k) if o.saved <= share * most[k] * (1 + 1e-9)]
            choice[k] = (
                min(under, key=lambda o: (o.time, o.name))
                if under
                else min(menu(k), key=lambda o: (o.saved, o.time))
            )
        key = tuple(sorted((k, o.name) for k, o in choice.items()))
        ladder[key] = sum(weight[k] * o.time for k, o in choice.items())
    # Each choice slower than the one before keeps fewer bytes (the others lose to it), so
    # what fits is a tail of the list (``_quick`` bisects it).
    saved = {(k, o.name): o.saved for k in weight for o in menu(k)}
    out: list[dict[str, str]] = []
    least = math.inf
    for key, _ in sorted(ladder.items(), key=lambda kv: (kv[1], kv[0])):
        kept = sum(weight[k] * saved[(k, name)] for k, name in key)
        if kept < least:
            least = kept
            out.append(dict(key))
    return out


def _by_kind(model: ModelSpec, t: Tables, choice: dict[str, str]) -> dict[str, str]:
    """Each layer's and MTP module's recompute from its kind's choice."""
    out = {f"layer.{i}": choice[k] for i, k in enumerate(t.layer_kinds)}
    out |= {n: choice[n] for n in t.first_fixed + t.last_fixed if n in choice}
    return out


def _uniform(model: ModelSpec, choice: str) -> dict[str, str]:
    from planner.costs.blocks import block_names

    return {n: choice for n in block_names(model) if n.startswith(("layer.", "mtp."))}


def _host_ok(job: TrainingJob, cluster: ClusterSpec, layout: Layout, est: Estimate) -> bool:
    on_host = layout.ema == "host" and job.ema is not None
    if not (on_host or layout.optimizer_offload or offloads_activations(layout)):
        return True
    gpus = min(cluster.gpus_per_node, cluster.num_gpus)
    return max(s.host_bytes for s in est.memory) * gpus <= cluster.host_ram_bytes


# The relaxation runs the timeline on the configuration's shape: beyond this many ops per
# step (many micro-batches on a deep pipeline) that costs more than the bound saves.
RELAXATION_OPS = 250_000


SECONDS_PER_OP = SECONDS_PER_MODEL_OP  # what building a model takes per op, for wall checks


def _costing(model: ModelSpec, config: Config) -> float:
    """The charge for costing one layout of ``config`` (``step_run``)."""
    blocks = model.num_layers + model.num_mtp_layers + 2
    return blocks * SECONDS_PER_BLOCK + _order_size(config) * SECONDS_PER_TIMELINE_OP


def _shape(config: Config) -> tuple[str, int, int, int]:
    return (config.schedule, config.pp, config.num_microbatches, config.virtual_stages)


def _program_charge(config: Config, seen: set[tuple[str, int, int, int]]) -> float:
    """The charge for building ``config``'s schedule program and memory points, the first
    time (``seen``: the shapes already charged, updated)."""
    if _shape(config) in seen:
        return 0.0
    seen.add(_shape(config))
    return _order_size(config) * SECONDS_PER_PROGRAM_OP * (1 + config.pp / 16)


def _drain_charge(config: Config, *, new_shape: bool) -> float:
    """The charge for a configuration's fill-and-drain bound (``bounds.fill_and_drain``):
    its dual descent over the chains, and, the first time a lane meets the shape, building
    the shape's chains (one timeline run per profile of ``timeline.shape_forms``)."""
    from planner.timeline import heavy_ranks

    profiles = 2 + len(heavy_ranks(config.pp))  # and the ranks' peaks (``crowded_rank``)
    chains = config.pp * profiles
    charge = SECONDS_PER_DRAIN + chains * config.stages * SECONDS_PER_DRAIN_CELL
    if new_shape:
        per_op = SECONDS_PER_SHAPE_OP * (1 + config.pp / 20)
        charge += SECONDS_PER_SHAPE + _order_size(config) * profiles * per_op
    return charge


def _relaxation_charge(config: Config) -> float:
    """The charge for a configuration's relaxation (``lp_bound``)."""
    return (
        SECONDS_PER_RELAXATION
        + _order_size(config) * SECONDS_PER_RELAXATION_OP
        + config.stages**2 * SECONDS_PER_RELAXATION_STAGE2
    )


def _order_size(c: Config) -> int:
    """Ops in all the ranks' orders of one step (a forward and a backward per chunk)."""
    return 3 * c.num_microbatches * c.stages * c.copies


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


def _key(c: Config) -> tuple[object, ...]:
    """Deterministic tie-break between configurations."""
    return (
        c.pp,
        c.tp,
        c.cp,
        c.ep,
        c.etp,
        c.zero,
        c.micro_batch,
        c.schedule,
        c.virtual_stages,
        c.ema,
        c.fp8_cache,
        c.sequence_parallel,
        c.optimizer_offload,
    )


# -- the lanes (see ``plan``): each searches its share of the sets of degrees ------------

# A line's entry: (bound, tie-break key, tier, a set of degrees' members or a configuration).
Entry = tuple[float, tuple[object, ...], int, Any]
_TOKENS = itertools.count()
_LANE_STATE: dict[tuple[str, int], _Lane] = {}  # per plan call and lane, in its process


def _variants(members: list[Config]) -> list[list[Config]]:
    """A set of degrees' members by what ``degrees_bound`` cannot take the leanest of: FP8
    caching (less memory, more compute), sequence parallelism and optimizer offload (less
    memory, a slower optimizer step); in order of first appearance."""
    out: dict[tuple[object, ...], list[Config]] = {}
    for c in members:
        out.setdefault((c.fp8_cache, c.sequence_parallel, c.optimizer_offload), []).append(c)
    return list(out.values())


def _degrees_key(c: Config) -> tuple[int, ...]:
    """What a configuration's lane is chosen by: its degrees and micro-batch, which its
    cost tables, relaxation and schedule program depend on (and so are cached with it)."""
    return (c.tp, c.cp, c.pp, c.dp, c.ep, c.etp, c.micro_batch)


@dataclass(frozen=True)
class _Settings:
    quick_budget: float  # each lane's budget for layouts before proofs (``QUICK_SHARE``)
    first_limit: float  # a first-pass solve's limit
    workers: int
    seed: int


@dataclass(frozen=True)
class _StepOut:
    spent: float  # charged in the round
    found: list[tuple[float, Config, Layout]]  # layouts found in the round
    busy: bool  # something of the lane's is still below the best


def _lane_open(
    token: str,
    lane: int,
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace,
    sets: list[list[Config]],
    settings: _Settings,
) -> None:
    _LANE_STATE[(token, lane)] = _Lane(model, cluster, job, space, sets, settings)


def _lane_step(
    token: str, lane: int, best: float, round_s: float, share: float, wall_s: float
) -> _StepOut:
    return _LANE_STATE[(token, lane)].step(best, round_s, share, wall_s)


def _lane_close(token: str, lane: int) -> list[tuple[float, Config]]:
    """The lane's configurations still open, and its state dropped."""
    state = _LANE_STATE.pop((token, lane), None)
    return [] if state is None else state.open_entries()


class _Lane:
    """One lane's search over its sets of degrees: the tiers and passes of the module
    docstring, run a round at a time (``step``), each round until the lane has charged the
    round's budget. Every decision depends only on the lane's own state, the best step time
    it is told at the start of the round and what it finds itself in the round."""

    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        job: TrainingJob,
        space: SearchSpace,
        sets: list[list[Config]],
        settings: _Settings,
    ) -> None:
        self.model, self.cluster, self.job, self.space = model, cluster, job, space
        self.cap = memory_cap(cluster, job)
        self.settings = settings
        self.spent = self.round_spent = self.unreported = 0.0
        self.share = 0.0
        self.best = math.inf
        self.found: list[tuple[float, Config, Layout]] = []
        self.relaxed: set[Config] = set()  # configurations whose relaxation was charged
        self.shapes: set[tuple[str, int, int, int]] = set()  # whose chains were charged
        self.programs: set[tuple[str, int, int, int]] = set()  # whose programs were charged
        self.pending: list[tuple[float, Config]] = []
        self.stuck: list[tuple[float, Config]] = []
        self.phase = "quick"
        self.deadline = math.inf
        # Tier 0: one bound per set of degrees (its ZeRO stages, schedules and EMA
        # placements share it). The sets go in order of their bound plus the expert
        # all-to-alls and sends no schedule hides, with the pipeline's fill and drain added
        # as if the stages were even (an order for the quick phase only: nothing is proven
        # with it).
        line: list[tuple[float, Entry]] = []
        for members in sets:
            # A bound per variant of the layers' work and optimizer step (FP8 caching,
            # sequence parallelism, optimizer offload: each can raise one and lower the
            # other), each from its most sharded member; the set's is the least of them.
            bounds: list[tuple[float, Config]] = []
            for variant in _variants(members):
                self.charge(SECONDS_PER_DEGREES_BOUND)
                rep = max(variant, key=lambda c: (c.zero, _key(c)))
                bound = degrees_bound(model, cluster, job, rep)
                if bound is not None:
                    bounds.append((bound, rep))
            if bounds:
                bound, rep = min(bounds, key=lambda x: (x[0], _key(x[1])))
                rank = (bound + communication_floor(model, cluster, job, rep)) * _fill(rep)
                line.append((rank, (bound, (_key(rep), 0), 0, members)))
        line.sort(key=lambda x: (x[0], x[1][1]))
        self.line = [entry for _, entry in line]
        self.head = 0
        self.heap: list[Entry] = []
        self.quick_until = self.spent + settings.quick_budget

    def charge(self, seconds: float) -> None:
        self.spent += seconds
        self.round_spent += seconds
        self.unreported += seconds

    def keep(self, step: float, config: Config, layout: Layout) -> None:
        self.found.append((step, config, layout))
        self.best = min(self.best, step)

    def step(self, best: float, round_s: float, share: float, wall_s: float) -> _StepOut:
        """Work until the round's budget is charged (or nothing of the lane's is below the
        best); ``share``: the lane's part of the whole search's budget left."""
        self.best = min(self.best, best)
        self.round_spent = 0.0
        self.deadline = time.perf_counter() + wall_s
        self.share = share
        while self.round_spent < round_s and time.perf_counter() < self.deadline:
            if self.phase == "quick" and not self._quick():
                self.phase = "first"
                self.heap = self.line[self.head :] + self.heap
                self.head = len(self.line)
                heapq.heapify(self.heap)
            elif self.phase == "first" and not self._first():
                self.phase = "second"
                for bound, _, tier, item in self.heap:
                    self.pending += [(bound, c) for c in item] if tier == 0 else [(bound, item)]
                self.heap = []
            elif self.phase == "second" and not self._second():
                self.phase = "done"
            if self.phase == "done":
                break
        found, self.found = self.found, []
        spent, self.unreported = self.unreported, 0.0
        return _StepOut(spent, found, self.phase != "done")

    def open_entries(self) -> list[tuple[float, Config]]:
        """Every configuration not closed: its bound."""
        out = self.pending + self.stuck
        for bound, _, tier, item in self.line[self.head :] + self.heap:
            out += [(bound, c) for c in item] if tier == 0 else [(bound, item)]
        return out

    def _below(self, bound: float) -> bool:
        return bound < self.best * (1 - 1e-9)

    def _expand(self, bound: float, members: list[Config]) -> list[Entry]:
        """The tier-1 entries of a set of degrees' members."""
        out: list[Entry] = []
        for config in members:
            self.charge(SECONDS_PER_BOUND)
            cheap = lower_bound(self.model, self.cluster, self.job, config)
            if cheap is not None:
                out.append((max(bound, cheap), (_key(config), 1), 1, config))
        return out

    def _quick(self) -> bool:
        """Layouts early, so bounds prune: the next set of degrees below the best gets its
        members' bounds, and its configuration with the lowest bound of each schedule a
        layout costed (``_quick``); False when the quick budget or the line is done."""
        if self.spent >= self.quick_until:
            return False
        while self.head < len(self.line):
            bound, _, _, members = self.line[self.head]
            self.head += 1
            if not self._below(bound):
                self.heap.append(self.line[self.head - 1])
                continue
            own = self._expand(bound, members)
            self.heap += own
            # One configuration per schedule: the bound alone cannot tell a schedule's
            # bubble or memory, which decide which even layout is fast.
            firsts: dict[str, Entry] = {}
            for entry in sorted(own, key=lambda e: (e[0], e[1])):
                firsts.setdefault(entry[3].schedule, entry)
            for first_bound, _, _, config in sorted(firsts.values(), key=lambda e: (e[0], e[1])):
                if first_bound < self.best and self.spent < self.quick_until:
                    tally = Budget(math.inf, math.inf)
                    even = _quick(
                        self.model, self.cluster, self.job, self.space, config, tally, self.programs
                    )
                    self.charge(tally.spent)
                    if even is not None:
                        self.keep(even[0], config, even[1])
            return True
        return False

    def _first(self) -> bool:
        """Tier 1: a configuration's own cheap bound; tier 2: its relaxation; then its
        CP-SAT model, briefly. An entry moves to the next tier when it comes to the front
        of the line, with the larger of the bounds. False when the front is not below the
        best."""
        if not self.heap or not self._below(self.heap[0][0]):
            return False
        bound, key, tier, item = heapq.heappop(self.heap)
        if tier == 0:
            for entry in self._expand(bound, item):
                heapq.heappush(self.heap, entry)
        elif tier == 1:
            # The fill and drain over the schedule's chains and the busiest rank under its
            # own memory first (cheap once its shape's chains and peaks are known), then, if
            # the bound may still be lifted to the best, the relaxation.
            lifted = bound
            if item.pp > 1 and _order_size(item) <= RELAXATION_OPS:
                shape = _shape(item)
                self.charge(_program_charge(item, self.programs))
                self.charge(_drain_charge(item, new_shape=shape not in self.shapes))
                self.shapes.add(shape)
                tables = bound_tables(self.model, self.cluster, self.job, item)
                if tables is not None:
                    drain = fill_and_drain(tables, item)
                    lifted = max(lifted, drain, crowded_rank(tables, item, self.cap))
            if (
                self._below(lifted)
                and _order_size(item) <= RELAXATION_OPS
                and _relaxation_may_prune(item, lifted, self.best)
            ):
                self.charge(_relaxation_charge(item))
                self.relaxed.add(item)
                lifted = max(lifted, lp_bound(self.model, self.cluster, self.job, item) or 0.0)
            heapq.heappush(self.heap, (lifted, (key[0], 2), 2, item))
        else:
            again = self._attempt(bound, item, min(self.settings.first_limit, self.share))
            if again is not None:
                self.pending.append(again)
        return True

    def _second(self) -> bool:
        """Reopen the unclosed ones in order of bound, with the lane's share of the budget
        left. One that comes back with no better bound is not tried again (its bound stays
        open). False when none is below the best."""
        self.pending.sort(key=lambda x: (x[0], _key(x[1])))
        if not self.pending or not self._below(self.pending[0][0]):
            return False
        bound, config = self.pending.pop(0)
        again = self._attempt(bound, config, self.share)
        if again is not None:
            (self.stuck if again[0] <= bound * (1 + 1e-9) else self.pending).append(again)
        return True

    def _attempt(self, bound: float, config: Config, limit: float) -> tuple[float, Config] | None:
        """Solve ``config``; its entry when it stays open."""
        wall = self.deadline - time.perf_counter()
        if _order_size(config) * SECONDS_PER_OP > wall:
            return (bound, config)  # no time left to build its model
        self.charge(_program_charge(config, self.programs))
        if config not in self.relaxed:  # its warm start solves the relaxation
            self.relaxed.add(config)
            self.charge(_relaxation_charge(config))
        out = solve_config(
            self.model,
            self.cluster,
            self.job,
            config,
            Network.of(self.cluster),
            space=self.space,
            time_limit_s=limit,
            workers=self.settings.workers,
            seed=self.settings.seed,
            wall_s=wall,
        )
        self.charge(out.work)
        if out.layout is not None:
            self.keep(out.objective, config, out.layout)
        log.debug(
            "%s bound %.4f: %s %.4f (proven >= %.4f)",
            config,
            bound,
            out.status,
            out.objective,
            out.bound,
        )
        if out.status in ("unknown", "feasible"):
            return (max(bound, out.bound), config)
        return None


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
    small = _order_size(config) <= RELAXATION_OPS
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
    tasks = _costing(model, config)  # the charge for one costed layout
    work += _order_size(config) * SECONDS_PER_MODEL_OP  # building the model
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
