"""One lane's search over its share of the sets of degrees (``planner.solve.search``): the
sets in order of their bound, a quick layout each, then each configuration's relaxation and
CP-SAT model in turn (``planner.solve.refine``), in rounds of a fixed deterministic length
(``step``). The lanes run side by side (``planner.solve.lanes``); every decision depends only
on the lane's own state, the best step time it is told at the start of a round and what it
finds itself in the round.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from planner.costs.activations import long_step
from planner.costs.cap import memory_cap
from planner.costs.comm import Network
from planner.layout import Layout
from planner.solve.bounds import (
    bound_tables,
    communication_floor,
    crowded_rank,
    degrees_bound,
    fill_and_drain,
    lower_bound,
    one_choice_bound,
)
from planner.solve.budget import (
    RELAXATION_OPS,
    SECONDS_PER_BOUND,
    SECONDS_PER_DEGREES_BOUND,
    SECONDS_PER_OP,
    Budget,
    choice_charge,
    drain_charge,
    order_size,
    program_charge,
    shape_key,
)
from planner.solve.first import quick_layout
from planner.solve.lpbound import charged_bound
from planner.solve.refine import solve_config
from planner.solve.space import target_rules
from planner.solve.tables import Config, tie_break
from planner.specs import ClusterSpec, ModelSpec, SearchSpace, TrainingJob

log = logging.getLogger("planner.solve.search")
# Seconds per op of solving a long step (``costs.activations.long_step``), times
# 1 + pp / 2.5 (``long_solve_seconds``): Llama 3 70B on 64 H100 with 50,000 micro-batches
# took 7.2 s at pp 2 (300,000 ops) and 20.8 s at pp 4 (600,000 ops) on a 2-core VM, its
# first time.
SECONDS_PER_LONG_OP = 1.4e-5


def long_solve_seconds(config: Config) -> float:
    """Wall seconds a long step's solve is expected to take (``SECONDS_PER_LONG_OP``)."""
    return order_size(config) * SECONDS_PER_LONG_OP * (1 + config.pp / 2.5)


# A line's entry: (bound, tie-break key, tier, a set of degrees' members or a configuration).
Entry = tuple[float, tuple[object, ...], int, Any]


TOKENS = itertools.count()


_LANE_STATE: dict[tuple[str, int], _Lane] = {}  # per plan call and lane, in its process


def _variants(members: list[Config]) -> list[list[Config]]:
    """A set of degrees' members by what ``degrees_bound`` cannot take the leanest of: FP8
    caching (less memory, more compute), sequence parallelism and optimizer offload (less
    memory, a slower optimizer step), the context parallelism's communication (the ring's
    buffers against exposed all-to-alls and shorter attention blocks) and ZeRO++'s secondary
    shard (more memory, faster gathers); in order of first appearance."""
    out: dict[tuple[object, ...], list[Config]] = {}
    for c in members:
        key = (c.fp8_cache, c.sequence_parallel, c.optimizer_offload, c.cp_comm_type)
        out.setdefault((*key, c.cp_a2a_size, c.zero_hpz, c.param_offload), []).append(c)
    return list(out.values())


def degrees_key(c: Config) -> tuple[int, ...]:
    """A set of degrees: its degrees and micro-batch, which its configurations' cost tables,
    relaxations and schedule programs depend on."""
    return (c.tp, c.cp, c.pp, c.dp, c.ep, c.etp, c.micro_batch)


def shard_key(c: Config) -> tuple[int, ...]:
    """What a configuration's lane is chosen by: the degrees and micro-batch its blocks' costs
    and recompute options depend on (not pp or dp), so the sets of degrees that share them
    are searched in one lane, whose process builds them once."""
    return (c.tp, c.cp, c.ep, c.etp, c.micro_batch)


def _fill(config: Config) -> float:
    """1 + (pp - 1) / m: 1F1B's step over its busiest rank's work with even stages."""
    return 1 + (config.pp - 1) / config.num_microbatches


def _relaxation_may_prune(config: Config, bound: float, best: float, hidden: float) -> bool:
    """Whether the relaxation could lift ``bound`` to ``best``: it adds at most the
    pipeline's fill and drain, about (stages - 1) of m micro-batches' worth for one chunk
    (taken twice, for safety), and ``hidden``, the communication the cheap bound took as
    hidden behind a paired chunk's compute (DualPipe, the expert all-to-alls' overlap),
    which the relaxation's tasks hold in series where nothing hides it. Only decides what
    is worth computing, never what is proven."""
    if math.isinf(best):
        return config.pp > 1 or hidden > 0
    if config.pp == 1 and hidden == 0:
        return False
    fill = 2 * (config.stages - 1) / config.num_microbatches
    return (bound + hidden) * (1 + fill) >= best


@dataclass(frozen=True)
class LaneSettings:
    quick_budget: float  # each lane's budget for layouts before proofs (``QUICK_SHARE``)
    first_limit: float  # a first-pass solve's limit
    workers: int
    seed: int


@dataclass(frozen=True)
class StepOut:
    spent: float  # charged in the round
    found: list[tuple[float, Config, Layout]]  # layouts found in the round
    busy: bool  # something of the lane's is still below the best


def lane_open(
    token: str,
    lane: int,
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace,
    sets: list[list[Config]],
    settings: LaneSettings,
) -> None:
    _LANE_STATE[(token, lane)] = _Lane(model, cluster, job, space, sets, settings)


def lane_step(
    token: str, lane: int, best: float, round_s: float, share: float, wall_s: float
) -> StepOut:
    return _LANE_STATE[(token, lane)].step(best, round_s, share, wall_s)


def lane_rank(
    token: str, lane: int, configs: list[Config]
) -> tuple[float, list[tuple[float, float]]]:
    """The climb's order of ``configs`` (``planner.solve.neighbours``), in the lane that owns
    their sets: the charge, and each one's (bound, order)."""
    return _LANE_STATE[(token, lane)].rank(configs)


def lane_quick(token: str, lane: int, config: Config) -> tuple[float, tuple[float, Layout] | None]:
    """The climb's quick layout of ``config`` (``first.quick_layout``), in the lane that owns
    its set: the charge, and the layout with its step (None where none fits)."""
    return _LANE_STATE[(token, lane)].quick(config)


def lane_close(token: str, lane: int) -> list[tuple[float, Config]]:
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
        settings: LaneSettings,
    ) -> None:
        self.model, self.cluster, self.job, self.space = model, cluster, job, space
        # A target launcher states one recompute choice for every layer: the relaxation is
        # taken under that rule (``lpbound.lp_bound``).
        self.one_choice = target_rules(space) is not None
        self.cap = memory_cap(cluster, job)
        self.settings = settings
        self.spent = self.round_spent = self.unreported = 0.0
        self.share = 0.0
        self.best = math.inf
        self.found: list[tuple[float, Config, Layout]] = []
        # configurations whose warm start's relaxation (over a mix of choices) was charged
        self.warmed: set[Config] = set()
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
                rep = max(variant, key=lambda c: (c.zero, tie_break(c)))
                bound = degrees_bound(model, cluster, job, rep)
                if bound is not None:
                    bounds.append((bound, rep))
            if bounds:
                bound, rep = min(bounds, key=lambda x: (x[0], tie_break(x[1])))
                rank = (bound + communication_floor(model, cluster, job, rep)) * _fill(rep)
                line.append((rank, (bound, (tie_break(rep), 0), 0, members)))
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

    def step(self, best: float, round_s: float, share: float, wall_s: float) -> StepOut:
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
        return StepOut(spent, found, self.phase != "done")

    def open_entries(self) -> list[tuple[float, Config]]:
        """Every configuration not closed: its bound."""
        out = self.pending + self.stuck
        for bound, _, tier, item in self.line[self.head :] + self.heap:
            out += [(bound, c) for c in item] if tier == 0 else [(bound, item)]
        return out

    def rank(self, configs: list[Config]) -> tuple[float, list[tuple[float, float]]]:
        """``lane_rank``: each configuration's own bound, and its order as the line's (the
        bound plus the communication no schedule hides, times the fill and drain)."""
        out: list[tuple[float, float]] = []
        for c in configs:
            bound = lower_bound(self.model, self.cluster, self.job, c, one_choice=self.one_choice)
            if bound is None:
                out.append((math.inf, math.inf))
                continue
            floor = communication_floor(self.model, self.cluster, self.job, c)
            out.append((bound, (bound + floor) * _fill(c)))
        # Charged as a set's bound: lower_bound builds the configuration's tables where the
        # lane has none yet, as degrees_bound does (0.5-8 ms a configuration measured on
        # DeepSeek-V3 over 2,048 H800, warm and cold)
        return len(configs) * SECONDS_PER_DEGREES_BOUND, out

    def quick(self, config: Config) -> tuple[float, tuple[float, Layout] | None]:
        """``lane_quick``."""
        tally = Budget(math.inf, math.inf)
        even = quick_layout(
            self.model, self.cluster, self.job, self.space, config, tally, self.programs
        )
        return tally.spent, even

    def _below(self, bound: float) -> bool:
        return bound < self.best * (1 - 1e-9)

    def _expand(self, bound: float, members: list[Config]) -> list[Entry]:
        """The tier-1 entries of a set of degrees' members."""
        out: list[Entry] = []
        for config in members:
            self.charge(SECONDS_PER_BOUND)
            cheap = lower_bound(
                self.model, self.cluster, self.job, config, one_choice=self.one_choice
            )
            if cheap is not None:
                out.append((max(bound, cheap), (tie_break(config), 1), 1, config))
        return out

    def _quick(self) -> bool:
        """Layouts early, so bounds prune: the next set of degrees below the best gets its
        members' bounds, and its configuration with the lowest bound of each schedule a
        layout costed (``first.quick_layout``); False when the quick budget or the line is done."""
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
                    even = quick_layout(
                        self.model, self.cluster, self.job, self.space, config, tally, self.programs
                    )
                    self.charge(tally.spent)
                    if even is not None:
                        self.keep(even[0], config, even[1])
            return True
        return False

    def _first(self) -> bool:
        """Tier 1: a configuration's own cheap bound, lifted by the pipeline's fill and
        drain and each rank's memory; tier 2: its relaxation, cheap (the shape's chains);
        tier 3: its relaxation, deep (``lpbound.lp_bound``); then its CP-SAT model,
        briefly. An entry moves to the next tier when it comes to the front of the line,
        with the larger of the bounds. False when the front is not below the
        best."""
        if not self.heap or not self._below(self.heap[0][0]):
            return False
        bound, key, tier, item = heapq.heappop(self.heap)
        if tier == 0:
            for entry in self._expand(bound, item):
                heapq.heappush(self.heap, entry)
        elif tier == 1:
            # The fill and drain over the schedule's chains and the busiest rank under its
            # own memory (cheap once its shape's chains and peaks are known); under one
            # recompute choice, the busiest rank at each choice's own price instead
            # (``one_choice_bound``: never under the one over every option).
            lifted = bound
            short = order_size(item) <= RELAXATION_OPS
            if item.pp > 1 and short:
                shape = shape_key(item)
                self.charge(program_charge(item, self.programs))
                self.charge(drain_charge(item, new_shape=shape not in self.shapes))
                self.shapes.add(shape)
                tables = bound_tables(self.model, self.cluster, self.job, item)
                if tables is not None:
                    lifted = max(lifted, fill_and_drain(tables, item))
                    if not self.one_choice:
                        lifted = max(lifted, crowded_rank(tables, item, self.cap))
            if self.one_choice and short:
                self.charge(choice_charge(item))
                one = one_choice_bound(self.model, self.cluster, self.job, item)
                lifted = max(lifted, math.inf if one is None else one)
            heapq.heappush(self.heap, (lifted, (key[0], 2), 2, item))
        elif tier == 2:
            # Still the lowest: if the bound may still be lifted to the best, the cheap
            # relaxation (the shape's chains and the even partition's).
            # A pair hides at most one chunk's communication behind the other's compute:
            # the cheap bound counted half of it (``communication_floor``)
            hidden = (
                2 * communication_floor(self.model, self.cluster, self.job, item)
                if item.pipeline.paired
                else 0.0
            )
            relax = order_size(item) <= RELAXATION_OPS and _relaxation_may_prune(
                item, bound, self.best, hidden
            )
            lifted = max(bound, self._relaxed(item, deep=False)) if relax else bound
            heapq.heappush(self.heap, (lifted, (key[0], 3), 3 if relax else 4, item))
        elif tier == 3:
            # Still the lowest: the deep relaxation (the rounds of chains at its own points).
            lifted = max(bound, self._relaxed(item, deep=True))
            heapq.heappush(self.heap, (lifted, (key[0], 4), 4, item))
        else:
            again = self._attempt(bound, item, min(self.settings.first_limit, self.share))
            if again is not None:
                self.pending.append(again)
        return True

    def _relaxed(self, config: Config, *, deep: bool) -> float:
        """The relaxation's bound (0 where it has none), its work charged; the best step is
        its cutoff (past it the relaxation stops)."""
        bound, charge = charged_bound(
            self.model,
            self.cluster,
            self.job,
            config,
            one_choice=self.one_choice,
            cutoff=self.best,
            deep=deep,
        )
        self.charge(charge)
        return bound or 0.0

    def _second(self) -> bool:
        """Reopen the unclosed ones in order of bound, with the lane's share of the budget
        left. One that comes back with no better bound is not tried again (its bound stays
        open). False when none is below the best."""
        self.pending.sort(key=lambda x: (x[0], tie_break(x[1])))
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
        if order_size(config) * SECONDS_PER_OP > wall:
            return (bound, config)  # no time left to build its model
        long = long_step(config.pp, config.virtual_stages, config.num_microbatches)
        if long and 2 * long_solve_seconds(config) > wall:
            # A long step's model walks every task of it (the chains, the rank orders, its
            # layouts' timelines), which costing its layouts need not (estimate.extended_run):
            # where the wall clock left is short of twice that walk's estimate (measured
            # walks ran to 1.6 times it), its layouts are the quick ones and its bound stays
            # open.
            return (bound, config)
        self.charge(program_charge(config, self.programs))
        # Its warm start rounds the relaxation over a mix of recompute choices
        # (``refine.solve_config``), once per configuration.
        mixed = self.space.recompute is None and order_size(config) <= RELAXATION_OPS
        if mixed and config not in self.warmed:
            self.warmed.add(config)
            self.charge(charged_bound(self.model, self.cluster, self.job, config)[1])
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
