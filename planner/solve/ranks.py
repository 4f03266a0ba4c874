"""Each pipeline rank's per-step quantities of a configuration, stated once over the solver's
numeric domains: its optimizer step, the state and buffers it holds, and its saved
activations at each level its op order passes through.

``planner.costs.memory`` and ``planner.costs.timing`` state these for one layout; here they
are written over a configuration's tables (``planner.solve.tables``), where how many layers
of each kind a stage holds, and how many of them take each recompute option, are unknowns.
A ``RankDomain`` says how such a sum is written: the CP-SAT model's (integer counts, seconds
as whole time units and bytes as whole KiB, each coefficient rounded where it is written)
and the linear relaxation's (fractional counts, exact). What a domain relaxes beyond that
(the recompute's rebuilt tensors, ZeRO-3's gathered copy) its consumer leaves out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol, TypeVar

from planner.costs.state import gpu_state_bytes
from planner.costs.timing import optimizer_seconds
from planner.solve.tables import Kind, Option, RankOrder, Tables

X = TypeVar("X")


class Unit(enum.Enum):
    """What a sum counts: seconds or bytes (a domain may write each in its own unit)."""

    SECONDS = enum.auto()
    BYTES = enum.auto()


class RankDomain(Protocol[X]):
    """How a rank's sums are written in a numeric domain."""

    def layers(self, stage: int, value: Callable[[Kind], float], unit: Unit) -> X:
        """The sum over ``stage``'s layers of their kind's ``value``."""
        ...

    def blocks(self, stage: int, value: Callable[[Option], float], unit: Unit) -> X:
        """The sum over ``stage``'s blocks (layers and fixed blocks) of their option's
        ``value``."""
        ...

    def const(self, value: float, unit: Unit) -> X: ...

    def add(self, a: X, b: X) -> X: ...

    def scale(self, x: X, n: int) -> X:
        """``n`` times ``x``."""
        ...


def optimizer(d: RankDomain[X], t: Tables, rank: int, order: RankOrder) -> X:
    """Seconds of the rank's optimizer step: its layers' state and its fixed blocks' (each
    rank's step is a sum over what it holds, ``costs.timing.optimizer_seconds``); ``order``
    is the rank's (``Tables.ranks``)."""
    total = d.const(optimizer_seconds(t.fixed_state[rank], t.step), Unit.SECONDS)
    for c in order.chunks:
        layers = d.layers(c, lambda k: optimizer_seconds(k.state, t.step), Unit.SECONDS)
        total = d.add(total, layers)
    return total


def held(d: RankDomain[X], t: Tables, rank: int, order: RankOrder) -> X:
    """Bytes the rank holds whatever its activations: the GPU's share of its layers' and
    fixed blocks' state, and the buffers (communication, pipeline sends, reduce bucket,
    context ring)."""
    total = d.add(
        d.const(gpu_state_bytes(t.fixed_state[rank]), Unit.BYTES),
        d.const(t.buffers, Unit.BYTES),
    )
    for c in order.chunks:
        total = d.add(total, d.layers(c, lambda k: gpu_state_bytes(k.state), Unit.BYTES))
    return total


def host(d: RankDomain[X], t: Tables, rank: int, order: RankOrder) -> X:
    """Host bytes the rank's state keeps there (an EMA on the host, an offloaded
    optimizer)."""
    total = d.const(t.fixed_state[rank]["host"], Unit.BYTES)
    for c in order.chunks:
        total = d.add(total, d.layers(c, lambda k: k.state["host"], Unit.BYTES))
    return total


def levels(d: RankDomain[X], order: RankOrder) -> list[tuple[X, int | None]]:
    """A rank's saved activations at each level its op order passes through (each chunk's
    saved bytes per micro-batch times the micro-batches of it in flight), with the chunk
    whose backward is rebuilding there (None: none)."""
    saved = {c: d.blocks(c, lambda o: o.saved, Unit.BYTES) for c in order.chunks}
    out = []
    for counts, rebuilding in order.levels:
        level = d.const(0.0, Unit.BYTES)
        for n, c in zip(counts, order.chunks, strict=True):
            if n:
                level = d.add(level, d.scale(saved[c], n))
        out.append((level, rebuilding))
    return out
