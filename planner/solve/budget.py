"""The search's deterministic budget: what it may spend, and what each piece of work costs.

What the search explores is decided by a deterministic budget, ``DETERMINISTIC_SHARE`` of
``time_limit_s`` per lane: CP-SAT's own deterministic time (one worker, interleaved search)
plus a fixed charge for each piece of Python work (per bound, per relaxation by its size, per
layout costed by its blocks and ops, per model built by its ops), so the same inputs give the
same plan on a loaded or an idle machine. The wall clock is a safety stop only
(``Budget.deadline``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from planner.costs.activations import long_step
from planner.solve.tables import Config
from planner.specs import ModelSpec

DETERMINISTIC_SHARE = 0.3  # of time_limit_s per lane: the budget (see the module docstring)


# Deterministic charges for Python work, in seconds of budget, fitted to times measured on
# this project's 2-core reference machine (an op is one forward or backward of one
# micro-batch on one stage, ``order_size``): a configuration's own bound and the bound of a
# set of degrees (which builds two tables); a relaxation (its timeline runs and linear
# program); costing a layout (its memory and stage tables per block, then the timeline);
# checking a layout's memory alone; building a CP-SAT model and stating its chains. Refitted
# on the 11 jobs of benchmarks/plan_speed.py at 10 s (wall time per call against the
# charge; benchmarks/RESULTS.md, 2026-11-25); the first sight of a shape (its program and
# memory points, its chains) and the relaxation's per-op and per-stage terms refitted on 62
# configurations of pp 2 to 64 and up to 184,320 ops (llama3-8b, llama3-70b, deepseek-v3
# on H800; cold and warm calls timed apart). The relaxation's terms from the work it did,
# fitted on 1,033 relaxations as the lanes run them (seven of the 11 jobs at 10 s and five
# at 60 s, each timed inside the search, its tables already built by the configuration's
# bound; relative least squares, then scaled so that the charges add up to 95% of the time
# taken: median error 23%, charge over time 0.59x to 1.50x from the 10th to the 90th
# percentile; the earlier fit, on relaxations timed alone with their tables cold, charged
# the lanes' 1.8 times their time). A configuration's bound under one recompute choice
# (one mean-rank bound per choice, its tables built where the lane has none): 1.0 ms, the
# 10,120 such bounds of the 11 jobs at 10 s took 10.1 s (5e-4 before charged half of it).
# Its crowded rank per choice (``bounds.one_choice_bound``): 2.3 ms, the mean of 502 in the
# lanes of the same jobs at 10 s (1.1 to 2.8 ms per job).
SECONDS_PER_BOUND = 1.0e-3


SECONDS_PER_CHOICE_BOUND = 2.3e-3


SECONDS_PER_DEGREES_BOUND = 2.2e-3


SECONDS_PER_RELAXATION = 1.7e-3


SECONDS_PER_DRAIN = 1.5e-3


SECONDS_PER_DRAIN_CELL = 2e-7  # per chain and stage of the dual descent


SECONDS_PER_SHAPE = 6e-3  # a shape's chains, once per lane


SECONDS_PER_SHAPE_OP = 6e-7  # per op and timeline run, more on deep pipelines


SECONDS_PER_LP_NONZERO = 3.6e-6  # per nonzero a relaxation sets


SECONDS_PER_LP_SOLVED = 7.1e-7  # per nonzero in the model at each solve


SECONDS_PER_LP_RUN_OP = 2.6e-6  # per op of a timeline run at a relaxation's point


SECONDS_PER_LP_PIVOT = 5.3e-9  # per simplex pivot and nonzero in the model


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


# The relaxation runs the timeline on the configuration's shape: beyond this many ops per
# step (many micro-batches on a deep pipeline) that costs more than the bound saves.
RELAXATION_OPS = 250_000


SECONDS_PER_OP = SECONDS_PER_MODEL_OP  # what building a model takes per op, for wall checks


def costing_charge(model: ModelSpec, config: Config, *, extended: bool = False) -> float:
    """The charge for costing one layout of ``config``: its whole step (``step_run``, as the
    solver runs it), or with ``extended`` as ``evaluate`` does (``costed_microbatches``)."""
    blocks = model.num_layers + model.num_mtp_layers + 2
    ops = _ops(config, costed_microbatches(config) if extended else config.num_microbatches)
    return blocks * SECONDS_PER_BLOCK + ops * SECONDS_PER_TIMELINE_OP


def costed_microbatches(config: Config) -> int:
    """The micro-batches ``evaluate`` walks to cost one of ``config``'s layouts
    (``estimate.extended_run``): all of them, or a long step's two shorter lengths."""
    lengths = long_step(config.pp, config.virtual_stages, config.num_microbatches)
    return sum(lengths) if lengths else config.num_microbatches


def shape_key(config: Config) -> tuple[str, int, int, int]:
    return (config.schedule, config.pp, config.num_microbatches, config.virtual_stages)


def program_charge(
    config: Config, seen: set[tuple[str, int, int, int]], *, extended: bool = False
) -> float:
    """The charge for building ``config``'s schedule program and memory points, the first
    time (``seen``: the shapes already charged, updated): the whole step's, or with
    ``extended`` those ``evaluate`` builds (``costed_microbatches``)."""
    m = costed_microbatches(config) if extended else config.num_microbatches
    key = (config.schedule, config.pp, m, config.virtual_stages)
    if key in seen:
        return 0.0
    seen.add(key)
    return _ops(config, m) * SECONDS_PER_PROGRAM_OP * (1 + config.pp / 16)


def _ops(config: Config, microbatches: int) -> int:
    return 3 * microbatches * config.stages * config.copies


def drain_charge(config: Config, *, new_shape: bool) -> float:
    """The charge for a configuration's fill-and-drain bound (``bounds.fill_and_drain``):
    its dual descent over the chains, and, the first time a lane meets the shape, building
    the shape's chains (one timeline run per profile of ``timeline.shape_forms``)."""
    from planner.timeline import heavy_ranks

    profiles = 2 + len(heavy_ranks(config.pp))  # and the ranks' peaks (``crowded_rank``)
    chains = config.pp * profiles
    charge = SECONDS_PER_DRAIN + chains * config.stages * SECONDS_PER_DRAIN_CELL
    if new_shape:
        per_op = SECONDS_PER_SHAPE_OP * (1 + config.pp / 20)
        charge += SECONDS_PER_SHAPE + order_size(config) * profiles * per_op
    return charge


def choice_charge(config: Config) -> float:
    """The charge for a configuration's bound under one recompute choice
    (``bounds.one_choice_bound``): the mean rank's and the crowded rank's per choice (the
    first sight of a shape's peaks is charged with its chains, ``drain_charge``)."""
    return SECONDS_PER_CHOICE_BOUND


def relaxation_seconds(nonzeros: int, solved: int, run_ops: int, pivots: int) -> float:
    """The charge for a relaxation (``lpbound``) from the work it did: the nonzeros it set,
    the nonzeros in its model at each solve, the ops of the timeline runs that found its
    chains, and each solve's simplex pivots times its nonzeros."""
    return (
        SECONDS_PER_RELAXATION
        + nonzeros * SECONDS_PER_LP_NONZERO
        + solved * SECONDS_PER_LP_SOLVED
        + run_ops * SECONDS_PER_LP_RUN_OP
        + pivots * SECONDS_PER_LP_PIVOT
    )


def order_size(c: Config) -> int:
    """Ops in all the ranks' orders of one step (a forward and a backward per chunk)."""
    return _ops(c, c.num_microbatches)
