"""Moves around the best layout found (``Climb``): the sets of degrees next to the incumbent's,
each costed by its quick layout (``first.quick_layout``), a faster one taken, until none of
the incumbent's neighbours can be faster or the moves' share of the budget is spent.

The lanes (``planner.solve.lanesearch``) take the sets of degrees in order of a bound, which
says what a set cannot beat, not what it reaches: on DeepSeek-V3 over 2,048 H800 the set of
the best layout a 30 s search finds ranks 44th of 1,070, and a 10 s search's quick layouts
stop near the 15th. Fast layouts sit next to each other (one more pipeline stage for half
the expert-parallel degree, ZeRO-1 where ZeRO-2 was), so a climb from the incumbent reaches
them in tens of layouts where the line would take hundreds.

A neighbour differs from the incumbent's configuration in one or two of its choices
(``MOVES``): tensor, context, pipeline, expert and expert-tensor parallel degree, micro-batch
(each doubled or halved; the data-parallel degree takes what the GPUs leave), virtual
stages, ZeRO stage and schedule (any other value). Of a neighbouring set's variants the one
that keeps the incumbent's other options (EMA placement, FP8 cache, sequence parallelism, the
context parallelism's communication, ZeRO++ and offloads) is taken. A neighbour whose own
bound (``bounds.lower_bound``) is not below the incumbent's step cannot be faster and is
passed over; the others are taken in the order the lanes take sets in (the bound plus the
communication no schedule hides, times the pipeline's fill and drain with even stages).

Each batch costs, side by side, the best-ordered neighbour of each lane (the lane that owns
its set, where its cost tables are cached: ``Lanes``); the fastest of the batch that beats
the incumbent becomes the incumbent. The batches, and so the climb, depend on the incumbent
and the budget only, never on the machine or the number of processes.

The moves change what the search finds, never what it proves: every bound stays the lanes'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from planner.layout import Layout
from planner.solve.budget import Budget
from planner.solve.tables import Config, tie_break

# The choices a move changes; the data-parallel degree follows the GPUs.
MOVES = ("tp", "cp", "pp", "ep", "etp", "micro_batch", "virtual_stages", "zero", "schedule")
DOUBLED = frozenset({"tp", "cp", "pp", "ep", "etp", "micro_batch"})  # moved by a factor of 2
# The options a neighbouring set's variant keeps from the incumbent where it can.
KEPT = (
    "ema",
    "fp8_cache",
    "sequence_parallel",
    "cp_comm_type",
    "cp_a2a_size",
    "zero_hpz",
    "param_offload",
    "optimizer_offload",
)
MOVE_SHARE = 0.35  # of the search's budget, at most, for the moves
# Batches in a row with no faster neighbour after which a climb leaves an incumbent: on the
# 11 jobs of benchmarks/plan_speed.py at 10 s every move the climb made came within the first
# four batches from its incumbent, and the batches after them found nothing.
PATIENCE = 4


@dataclass(frozen=True)
class Lanes:
    """Where the climb's work runs: each configuration's ``owner`` lane; ``rank`` gives, for
    each lane's configurations, the charge and each one's (bound, order) (``math.inf`` where
    none of its layouts fits); ``quick`` gives, for one configuration per lane, the charge
    and each one's quick layout with its step (None where none fits). Both run the lanes
    side by side and return their answers in the order asked."""

    owner: Callable[[Config], int]
    rank: Callable[[dict[int, list[Config]]], list[tuple[float, list[tuple[float, float]]]]]
    quick: Callable[[dict[int, Config]], list[tuple[float, tuple[float, Layout] | None]]]


def _key(c: Config) -> tuple[object, ...]:
    return tuple(getattr(c, f) for f in MOVES)


def _step(field: str, a: object, b: object) -> bool:
    """Whether ``a`` to ``b`` is one move of ``field``."""
    if a == b:
        return False
    if field in DOUBLED:
        assert isinstance(a, int) and isinstance(b, int)
        return a == 2 * b or b == 2 * a
    return True


class Climb:
    """The climb's state over one search: the configurations by set of choices, those whose
    quick layout was costed (here or by the lanes), those ranked, and the budget the moves
    have spent."""

    def __init__(self, configs: Sequence[Config], share: float, lanes: Lanes) -> None:
        self.share = share
        self.lanes = lanes
        self.spent = 0.0
        self.sets: dict[tuple[object, ...], list[Config]] = {}
        for c in configs:
            self.sets.setdefault(_key(c), []).append(c)
        self.costed: dict[Config, float] = {}  # quick layout's step (inf: none fits)
        self.ranked: dict[Config, tuple[float, float]] = {}  # (bound, order)
        # Left: no neighbour that could be faster is left, or PATIENCE batches found none
        self.exhausted: set[Config] = set()

    def seen(self, step: float, config: Config) -> None:
        """A layout of ``config`` found elsewhere (a lane, a hint): not costed again here."""
        self.costed[config] = min(step, self.costed.get(config, math.inf))

    def neighbours(self, config: Config) -> Iterator[Config]:
        """``config``'s neighbouring configurations (see the module docstring), one-choice
        moves first, each set's variant nearest ``config``'s other options."""
        own = _key(config)
        moves: list[tuple[int, tuple[tuple[str, str], ...], tuple[object, ...]]] = []
        for key in self.sets:
            changed = [i for i, (a, b) in enumerate(zip(key, own, strict=True)) if a != b]
            if 1 <= len(changed) <= 2 and all(_step(MOVES[i], key[i], own[i]) for i in changed):
                moves.append((len(changed), tuple((MOVES[i], str(key[i])) for i in changed), key))
        moves.sort(key=lambda m: (m[0], m[1]))
        for _, _, key in moves:
            yield min(
                self.sets[key],
                key=lambda c: (
                    sum(getattr(c, f) != getattr(config, f) for f in KEPT),
                    tie_break(c),
                ),
            )

    def _charge(self, seconds: float, budget: Budget) -> None:
        self.spent += seconds
        budget.charge(seconds)

    def _promising(self, config: Config, step: float, budget: Budget) -> list[Config]:
        """``config``'s neighbours not yet costed whose bound is below ``step``, in order."""
        fresh = [c for c in self.neighbours(config) if c not in self.costed]
        by_lane: dict[int, list[Config]] = {}
        for c in fresh:
            if c not in self.ranked:
                by_lane.setdefault(self.lanes.owner(c), []).append(c)
        if by_lane:
            for (charge, ranks), asked in zip(
                self.lanes.rank(by_lane), by_lane.values(), strict=True
            ):
                self._charge(charge, budget)
                self.ranked.update(zip(asked, ranks, strict=True))
        out = [c for c in fresh if self.ranked[c][0] < step * (1 - 1e-9)]
        return sorted(out, key=lambda c: (self.ranked[c][1], tie_break(c)))

    def climb(
        self, best: tuple[float, Config], budget: Budget
    ) -> list[tuple[float, Config, Layout]]:
        """From ``best`` (the incumbent's step and configuration), batch after batch, until
        no neighbour of the incumbent could be faster, ``PATIENCE`` batches in a row found
        none, the moves' share is spent or the budget is; every layout costed."""
        step, config = best
        found: list[tuple[float, Config, Layout]] = []
        idle = 0  # batches since the last move
        while config not in self.exhausted and self.spent < self.share and budget.left() > 0:
            if idle >= PATIENCE:
                self.exhausted.add(config)
                break
            batch: dict[int, Config] = {}
            for c in self._promising(config, step, budget):
                batch.setdefault(self.lanes.owner(c), c)
            if not batch:
                self.exhausted.add(config)
                break
            moved: tuple[float, Config] | None = None
            for (charge, quick), other in zip(self.lanes.quick(batch), batch.values(), strict=True):
                self._charge(charge, budget)
                self.costed[other] = math.inf if quick is None else quick[0]
                if quick is None:
                    continue
                found.append((quick[0], other, quick[1]))
                if quick[0] < step * (1 - 1e-9) and (
                    moved is None or (quick[0], tie_break(other)) < (moved[0], tie_break(moved[1]))
                ):
                    moved = (quick[0], other)
            if moved is not None:
                step, config = moved
                idle = 0
            else:
                idle += 1
        return found
