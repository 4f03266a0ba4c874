"""Each per-stage quantity of a step, named once and stated once, over any numeric domain.

A stage (one chunk of a layout) runs, per micro-batch, its blocks' forward, input-gradient and
weight-gradient work, its MoE layers' all-to-alls and its pipeline sends; per step, its
gradient reduction and (ZeRO-1/2) the all-gather of its updated weights; and under ZeRO-2/3,
per micro-batch, its gathers and reduce-scatters (``planner.costs.timing`` says what each
holds). ``Quantity`` names them, one vocabulary
for every consumer; ``Part`` says which figure of a transfer: its seconds, or how long it
keeps the GPU's InfiniBand share or its NVLink ports busy.

``stage_quantities`` states every quantity of a stage once, over a ``Domain``: how the
stage's blocks add up and how a count times seconds is written. The domains are

- ``FloatStage`` (``evaluate``, the simulator): a layout's own blocks, in seconds;
- the CP-SAT model's (``planner.solve.model``): counts of layers per option as integer
  variables, seconds as whole time units, each coefficient rounded where it is written;
- the linear relaxation's (``planner.solve.lpbound``): fractional counts, and what it does
  not know (whether a stage holds routed experts) relaxed away;
- the bounds' (``planner.solve.bounds``): a block kind at its cheapest option.

A collective of x bytes takes ``per_byte * x + latency`` seconds, the latency only when x > 0
(``Rate``): every collective the cost model prices is affine in the bytes for a given group
(ring steps times bytes over bandwidth, plus latencies), so the rate fitted from two sizes is
the collective itself. A framework that runs ZeRO-3 one collective per parameter tensor
(``Framework.zero3_slice_s``) pays the latency and its host copies per tensor instead
(``StageComm.gather_per_tensor``), times the stage's tensors (``Row.zero_tensors``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from planner.costs.comm import NO_TRANSFER, Transfer


class Quantity(enum.StrEnum):
    """A stage's quantity (seconds per micro-batch; ``GRAD_SYNC`` and ``PARAM_GATHER`` per
    step)."""

    FWD = "fwd"  # forward work, with the exposed tensor- and context-parallel communication
    BWD_INPUT = "bwd_input"  # input-gradient work, with the recompute before it
    BWD_WEIGHT = "bwd_weight"  # weight-gradient work
    A2A_FWD = "a2a_fwd"  # expert dispatch and combine
    A2A_BWD = "a2a_bwd"  # their transposes (and the forward pair again under recompute)
    P2P = "p2p"  # the send of the stage's output to the next stage
    P2P_BACK = "p2p_back"  # the send of its input gradient to the previous stage
    ZERO_GATHER = "zero_gather"  # ZeRO-3's parameter all-gather
    ZERO_REDUCE = "zero_reduce"  # ZeRO-2/3's gradient reduce-scatter
    GRAD_SYNC = "grad_sync"  # the data-parallel gradient reduction, once per step
    PARAM_GATHER = "param_gather"  # ZeRO-1/2's all-gather of the updated weights, per step


class Part(enum.StrEnum):
    """Which figure of a transfer: its seconds, or a link's busy seconds."""

    SECONDS = "seconds"
    IB = "ib"
    NVLINK = "nvl"

    def of(self, transfer: Transfer) -> float:
        """This part of ``transfer``."""
        if self is Part.SECONDS:
            return transfer.seconds
        return transfer.ib if self is Part.IB else transfer.nvlink


LINKS = (Part.IB, Part.NVLINK)
Prim = tuple[str, int]  # (``name(quantity, part)``, stage)

_NAMES = {(q, p): str(q) if p is Part.SECONDS else f"{q}.{p}" for q in Quantity for p in Part}


def name(quantity: Quantity, part: Part = Part.SECONDS) -> str:
    """The key of a quantity's part in a stage's values (``Prim``): the quantity itself for
    its seconds, ``"<quantity>.<link>"`` for a link's busy seconds."""
    return _NAMES[(quantity, part)]


class Bytes(enum.StrEnum):
    """Which of a stage's bytes a collective moves: unsharded gradients (the reduction,
    ZeRO-2/3's reduce-scatter) or working weights (ZeRO-3's gather), of the dense
    parameters or of the routed experts (their groups differ)."""

    DENSE_GRAD = "dense_grad"
    EXPERT_GRAD = "expert_grad"
    DENSE_WEIGHT = "dense_weight"
    EXPERT_WEIGHT = "expert_weight"


PARTS = tuple(Part)
BYTES = tuple(Bytes)


@dataclass(frozen=True)
class Rate:
    """A collective over one group as a function of its bytes: ``per_byte * x + latency``
    (each ``Part`` alike), the latency only when x > 0."""

    per_byte: Transfer
    latency: Transfer

    @classmethod
    def fit(cls, collective: Callable[[float, Any], Transfer], ranks: Any) -> Rate:
        """The rate of ``collective`` (a ``Network`` method) over ``ranks``, from two sizes."""
        one, two = collective(_GIB, ranks), collective(2 * _GIB, ranks)
        per_byte = (two - one) * (1 / _GIB)
        return cls(per_byte, one - per_byte * _GIB)

    def at(self, nbytes: float) -> Transfer:
        """The collective of ``nbytes``."""
        return self.per_byte * nbytes + self.latency if nbytes > 0 else NO_TRANSFER


OFF = Rate(NO_TRANSFER, NO_TRANSFER)
_GIB = float(2**30)


@dataclass(frozen=True)
class StageComm:
    """What a stage's transfers cost at its pipeline position, whatever blocks it holds:
    one MoE layer's forward all-to-alls (dispatch and combine) and its combine per
    micro-batch, the two sends, and the rates of the gradient reduction, ZeRO-1/2's gather
    of the updated weights, the ZeRO-3 gather and the ZeRO-2/3 reduce-scatter over the dense
    and the expert groups (``OFF`` where the ZeRO stage has none)."""

    forward_pair: Transfer
    combine: Transfer
    p2p: Transfer
    p2p_back: Transfer
    grad_sync: tuple[Rate, Rate]
    param_gather: tuple[Rate, Rate]
    zero_gather: tuple[Rate, Rate]
    zero_reduce: tuple[Rate, Rate]
    # What each parameter tensor adds to the ZeRO-3 gather and the ZeRO-2/3 reduce-scatter
    # where the framework runs one collective per tensor (``Framework.zero3_slice_s``): the
    # collective's latency and the host's copy of every rank's slice; none otherwise.
    gather_per_tensor: Transfer = NO_TRANSFER
    reduce_per_tensor: Transfer = NO_TRANSFER


X = TypeVar("X")


class Row(Protocol):
    """What a block contributes to its stage (``costs.timing.BlockRow``)."""

    @property
    def fwd(self) -> float: ...
    @property
    def bwd_input(self) -> float: ...
    @property
    def bwd_weight(self) -> float: ...
    @property
    def moe_layers(self) -> int: ...
    @property
    def moe_rerun(self) -> int: ...
    @property
    def zero_tensors(self) -> int: ...


class Domain(Protocol, Generic[X]):
    """How one stage's sums are written in a numeric domain."""

    def blocks(self, seconds: Callable[[Row], float]) -> X:
        """The sum over the stage's blocks of a block's ``seconds``."""
        ...

    def count(self, number: Callable[[Row], int]) -> X:
        """The sum over the stage's blocks of a block's ``number``."""
        ...

    def per(self, count: X, seconds: float) -> X:
        """``count`` times ``seconds``."""
        ...

    def const(self, seconds: float) -> X:
        """``seconds`` whatever the blocks."""
        ...

    def over_bytes(self, kind: Bytes, per_byte: float) -> X:
        """``per_byte`` times the stage's bytes of ``kind``."""
        ...

    def if_expert(self, seconds: float) -> X:
        """``seconds`` if the stage holds routed experts, else nothing."""
        ...

    def add(self, a: X, b: X) -> X: ...


# Each collective quantity: the bytes it moves of the dense and of the expert parameters.
COLLECTIVE_BYTES = {
    Quantity.GRAD_SYNC: (Bytes.DENSE_GRAD, Bytes.EXPERT_GRAD),
    Quantity.PARAM_GATHER: (Bytes.DENSE_WEIGHT, Bytes.EXPERT_WEIGHT),
    Quantity.ZERO_GATHER: (Bytes.DENSE_WEIGHT, Bytes.EXPERT_WEIGHT),
    Quantity.ZERO_REDUCE: (Bytes.DENSE_GRAD, Bytes.EXPERT_GRAD),
}


def rates(comm: StageComm, quantity: Quantity) -> tuple[Rate, Rate]:
    """The (dense, expert) rates of a collective quantity."""
    if quantity is Quantity.GRAD_SYNC:
        return comm.grad_sync
    if quantity is Quantity.PARAM_GATHER:
        return comm.param_gather
    if quantity is Quantity.ZERO_GATHER:
        return comm.zero_gather
    return comm.zero_reduce


def a2a_forward(d: Domain[X], moe: X, pair: float) -> X:
    """The forward all-to-alls of ``moe`` MoE layers: a dispatch and a combine each
    (``pair`` seconds, or a part of them, per layer)."""
    return d.per(moe, pair)


def a2a_backward(d: Domain[X], moe: X, rerun: X, pair: float, combine: float) -> X:
    """The backward all-to-alls of ``moe`` MoE layers: the two transposes of each layer's
    dispatch and combine, each combine-sized, and the forward pair again for the ``rerun``
    layers whose forward recompute repeats."""
    return d.add(d.per(moe, 2 * combine), d.per(rerun, pair))


def stage_quantities(d: Domain[X], comm: StageComm) -> dict[str, X]:
    """Every quantity of one stage, each part, keyed by ``name``: the one statement of what
    a stage's time is made of (see the module docstring)."""
    out: dict[str, X] = {
        name(Quantity.FWD): d.blocks(lambda r: r.fwd),
        name(Quantity.BWD_INPUT): d.blocks(lambda r: r.bwd_input),
        name(Quantity.BWD_WEIGHT): d.blocks(lambda r: r.bwd_weight),
    }
    moe = d.count(lambda r: r.moe_layers)
    rerun = d.count(lambda r: r.moe_rerun)  # MoE layers whose forward recompute repeats
    collectives = [(q, dense, expert, *rates(comm, q)) for q, (dense, expert) in _COLLECTIVES]
    per_tensor = {
        Quantity.ZERO_GATHER: comm.gather_per_tensor,
        Quantity.ZERO_REDUCE: comm.reduce_per_tensor,
    }
    tensors = (
        d.count(lambda r: r.zero_tensors) if any(t.seconds for t in per_tensor.values()) else None
    )
    for part in PARTS:
        key, of = _KEYS[part], part.of
        pair, combine = of(comm.forward_pair), of(comm.combine)
        out[key[Quantity.A2A_FWD]] = a2a_forward(d, moe, pair)
        out[key[Quantity.A2A_BWD]] = a2a_backward(d, moe, rerun, pair, combine)
        out[key[Quantity.P2P]] = d.const(of(comm.p2p))
        out[key[Quantity.P2P_BACK]] = d.const(of(comm.p2p_back))
        for quantity, dense, expert, on_dense, on_expert in collectives:
            total = d.add(d.over_bytes(dense, of(on_dense.per_byte)), d.const(of(on_dense.latency)))
            total = d.add(total, d.over_bytes(expert, of(on_expert.per_byte)))
            total = d.add(total, d.if_expert(of(on_expert.latency)))
            each = of(per_tensor.get(quantity, NO_TRANSFER))
            if tensors is not None and each:
                total = d.add(total, d.per(tensors, each))
            out[key[quantity]] = total
    return out


_COLLECTIVES = tuple(COLLECTIVE_BYTES.items())
_KEYS = {part: {q: name(q, part) for q in Quantity} for part in PARTS}


class FloatStage:
    """The domain of a layout's own stage: its blocks' rows and its bytes, in seconds."""

    def __init__(self, rows: Sequence[Row], nbytes: dict[Bytes, float]) -> None:
        self.rows, self.nbytes = rows, nbytes

    def blocks(self, seconds: Callable[[Row], float]) -> float:
        return sum((seconds(r) for r in self.rows), 0.0)

    def count(self, number: Callable[[Row], int]) -> float:
        return float(sum(number(r) for r in self.rows))

    def per(self, count: float, seconds: float) -> float:
        return count * seconds

    def const(self, seconds: float) -> float:
        return seconds

    def over_bytes(self, kind: Bytes, per_byte: float) -> float:
        return per_byte * self.nbytes[kind]

    def if_expert(self, seconds: float) -> float:
        return seconds if self.nbytes[Bytes.EXPERT_GRAD] > 0 else 0.0

    def add(self, a: float, b: float) -> float:
        return a + b


def transfer(values: dict[str, float], quantity: Quantity) -> Transfer:
    """A transfer quantity's three parts from a stage's values, as one ``Transfer``."""
    return Transfer(
        values[name(quantity, Part.SECONDS)],
        values[name(quantity, Part.IB)],
        values[name(quantity, Part.NVLINK)],
    )
