"""Lower bounds on a configuration's step time, and memory floors that rule it out.

Each bound holds for every layout of the configuration under the timeline's step time
(see ``lower_bound``); the search uses them to order configurations and to stop.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from planner.costs.cap import memory_cap
from planner.costs.comm import Network
from planner.costs.quantities import (
    COLLECTIVE_BYTES,
    Bytes,
    Quantity,
    Row,
    a2a_backward,
    a2a_forward,
    rates,
    stage_quantities,
)
from planner.costs.state import gpu_state_bytes
from planner.costs.timing import optimizer_seconds
from planner.errors import PlannerError
from planner.frameworks import Overlap
from planner.memo import Memo
from planner.schedules import DEFAULT_SCHEDULE
from planner.solve.tables import Config, Option, Tables, build, layer_choices, prototype
from planner.specs import ClusterSpec, ModelSpec, TrainingJob


def lower_bound(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    config: Config,
    *,
    one_choice: bool = False,
) -> float | None:
    """A step time no layout of ``config`` beats, or None if no layout of it can fit.

    Some rank's tasks take at least the mean rank's: summed over ranks the work is m times
    every stage's forward and backward (each stage runs every micro-batch once), at least
    every block's cheapest option (and the recompute memory forces on them), plus the
    all-to-alls and sends every schedule but DualPipe leaves in series with the compute; a
    DualPipe pair lasts at least its two chunks' compute, and half its communication. Then the
    mean rank's optimizer step. And at least one micro-batch's forward and backward through
    every stage, one task after another (with fewer micro-batches than ranks, more than
    the mean rank's share). The wait for other ranks is left out: it is what
    ``planner.solve.lpbound`` adds, at a higher price.

    ``one_choice``: only layouts whose layers all take one recompute choice count (a target
    launcher's rule): the least, over the choices whose layers' saved bytes fit the budget
    the memory leaves them (``_forced_recompute``), of the bound with every layer at it."""
    if one_choice:
        each = choice_bounds(model, cluster, job, config)
        return min(each.values()) if each else None
    t = _fitting_tables(model, cluster, job, config)
    if t is None:
        return None
    count = Counter(t.layer_kinds + t.first_fixed + t.last_fixed)
    opts = {b: t.kinds[b].options for b in count}
    forced = _forced_recompute(model, t, cluster, job, config)
    if forced is None:
        return None  # even recomputing everything leaves too many activations
    return _mean_rank(t, config, count, opts, forced, _Shared.of(t, config))


def choice_bounds(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> dict[str, float]:
    """``lower_bound`` with every layer at each recompute choice every layer kind has, for
    the choices whose layers' saved bytes fit the budget the memory leaves them
    (``_forced_recompute``); empty when none does."""
    t = _fitting_tables(model, cluster, job, config)
    if t is None:
        return {}
    count = Counter(t.layer_kinds + t.first_fixed + t.last_fixed)
    opts = {b: t.kinds[b].options for b in count}
    shared = _Shared.of(t, config)
    budget = _activation_budget(model, t, cluster, job, config)
    kinds = Counter(t.layer_kinds)
    out: dict[str, float] = {}
    for choice in layer_choices(t):
        # Every layer at the choice: its own recompute is in its rows; it fits or it does not.
        at = {k: [o for o in opts[k] if o.name == choice] for k in kinds}
        if sum(n * at[k][0].saved for k, n in kinds.items()) <= budget:
            out[choice] = _mean_rank(t, config, count, opts | at, 0.0, shared)
    return out


def one_choice_bound(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> float | None:
    """A step no layout of ``config`` whose layers all take one recompute choice beats
    (``math.inf`` where no choice fits every rank's memory), or None where no choice fits
    the mean rank's (as ``lower_bound`` with ``one_choice``).

    With every layer at one choice, each layer's time and saved bytes are known: the least,
    over the choices, of the larger of its mean-rank bound (``choice_bounds``) and its
    crowded rank (``crowded_rank`` with every layer at that choice: each rank's own memory
    must hold its layers' state and saved activations at their peak). ``crowded_rank`` over
    every option lets each rank take the recompute its memory forces, which its launcher
    may not state, and ``lower_bound`` with ``one_choice`` counts the mean rank's memory
    alone. The fill and drain (``fill_and_drain``) is left at each layer's fastest option:
    taken per choice it lifted few bounds and cost up to ten times as much."""
    means = choice_bounds(model, cluster, job, config)
    t = bound_tables(model, cluster, job, config)
    if not means or t is None:
        return None
    cap = memory_cap(cluster, job)
    best = math.inf
    for choice, mean in sorted(means.items(), key=lambda kv: (kv[1], kv[0])):
        if mean >= best:
            break  # the rest are no lower
        best = min(best, max(mean, crowded_rank(at_choice(t, choice), config, cap)))
    return best


def at_choice(t: Tables, choice: str) -> Tables:
    """The tables with every layer kind's options narrowed to ``choice`` (the fixed
    blocks keep theirs)."""
    kinds = dict(t.kinds)
    for k in set(t.layer_kinds):
        kinds[k] = dataclasses.replace(
            t.kinds[k], options=[o for o in t.kinds[k].options if o.name == choice]
        )
    return dataclasses.replace(t, kinds=kinds)


def _fitting_tables(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> Tables | None:
    """The configuration's tables, or None where its state alone cannot fit (HBM, or host
    RAM where it keeps state there)."""
    t = bound_tables(model, cluster, job, config)
    if t is None or any(not k.options for k in t.kinds.values()):
        return None
    if not state_fits(t, cluster, job, config):
        return None
    layers = [t.kinds[k].state for k in t.layer_kinds]
    on_host = config.ema == "host" or config.optimizer_offload > 0
    if on_host and not host_fits(layers, t.fixed_state, cluster, config):
        return None
    return t


@dataclass(frozen=True)
class _Shared:
    """What ``lower_bound`` takes whatever the blocks' options: the communication in series,
    the ZeRO collectives' floors, the optimizer step's, and the busiest rank's whole layers."""

    comm: tuple[float, float, float, float, float]
    gather: float
    reduce: float
    tail: float
    busiest: float

    @classmethod
    def of(cls, t: Tables, config: Config) -> _Shared:
        return cls(
            _communication(t),
            _collective(t, Q.ZERO_GATHER, low=True),
            _collective(t, Q.ZERO_REDUCE, low=True),
            _optimizer_floor(t, config),
            busiest_rank(t, config),
        )


def _mean_rank(
    t: Tables,
    config: Config,
    count: Counter[str],
    opts: dict[str, list[Option]],
    forced: float,
    shared: _Shared,
) -> float:
    """``lower_bound`` over each block's ``opts`` (``count`` of each), with ``forced``
    seconds of recompute per micro-batch on top of their cheapest."""
    m, p = config.num_microbatches, config.pp

    def total(per_kind: Callable[[list[Option]], float]) -> float:
        return sum(n * per_kind(opts[b]) for b, n in count.items())

    moe, a2a_f, a2a_b, p2p, back = shared.comm
    dual = config.pipeline.paired
    sends_f = 0.0 if dual else moe * a2a_f + p2p
    sends_b = 0.0 if dual else moe * a2a_b + back
    fwd = total(lambda os: min(o.row.fwd for o in os))
    bin_lo = total(lambda os: min(o.row.bwd_input for o in os)) + forced
    bw = total(lambda os: os[0].row.bwd_weight)  # recompute does not change it
    g_lo, r_lo, tail = shared.gather, shared.reduce, shared.tail
    # Sums over stages of each op's time: at least its work (+ the sends in series) and at
    # least its ZeRO collectives.
    f_lo = max(fwd + sends_f, g_lo)
    b_lo = max(bin_lo + sends_b, g_lo)
    w_lo = max(bw, r_lo)
    bw_lo = max(bin_lo + bw + sends_b, g_lo + r_lo)
    # One micro-batch passes every stage forward and then back, one task after another, so
    # the step is at least that chain: above the mean rank's share where a rank has fewer
    # micro-batches than there are ranks. A weight gradient its schedule may defer is left
    # out, and DualPipe's pairs, whose tasks hold two micro-batches, are left to the rest.
    chain = 0.0
    if not dual:
        weight = 0.0 if config.pipeline.separate_weight_grad else bw
        chain = fwd + sends_f + bin_lo + weight + sends_b
    if config.pipeline.separate_weight_grad:
        mean = m * (f_lo + b_lo + w_lo) / p + tail
        return max(mean, shared.busiest, chain)
    busy = m * (f_lo + bw_lo) / p
    if dual:
        # A DualPipe pair overlaps one chunk's compute with the other's ZeRO collectives:
        # it lasts at least the larger of its compute and its collectives, not their sum.
        busy = m * max(fwd + bin_lo + bw, 2 * g_lo + r_lo) / p
        # A DualPipe pair lasts at least each chunk's own communication (in series with its
        # compute), so at least half of the two; an unpaired op all of its own.
        comm = moe * (a2a_f + a2a_b) + p2p + back
        busy = max(busy, m * comm / (2 * p))
    return max(busy + tail, shared.busiest, chain)


def _rank_groups(
    t: Tables, config: Config
) -> tuple[dict[frozenset[int], list[int]], int, list[float], Callable[[Option], float]] | None:
    """The ranks grouped by the stages they hold (DualPipe's two copies of a pair of stages
    are one group), the forwards each stage runs per rank, each group's fixed seconds (its
    optimizer step for the embedding, MTP and head state, their work at their cheapest and,
    unless DualPipe pairs the chunks, the sends), and a block option's seconds per
    micro-batch (its compute and, unless paired, its all-to-alls); None when groups share a
    stage."""
    from planner.layout import chunks_of

    pp, v, m = config.pp, config.virtual_stages, config.num_microbatches
    groups: dict[frozenset[int], list[int]] = {}
    for r in range(pp):
        groups.setdefault(frozenset(chunks_of(config.schedule, pp, v, r)), []).append(r)
    held = [s for stages in groups for s in stages]
    if len(held) != len(set(held)):
        return None
    # Every stage runs every micro-batch once; DualPipe's two copies of a stage half each.
    count = m // config.copies
    dual = config.pipeline.paired
    a2a_f, a2a_b = _a2a_per_layer(t)

    def work(option: Option) -> float:
        row = option.row
        comm = 0.0 if dual else row.moe_layers * (a2a_f + a2a_b)
        return row.fwd + row.bwd_input + row.bwd_weight + comm

    fixed: list[float] = []
    for stages, ranks in groups.items():
        seconds = max(optimizer_seconds(t.fixed_state[r], t.step) for r in ranks)
        for stage in stages:
            names = _fixed_blocks(t, stage, config.stages)
            seconds += count * sum(min(work(o) for o in t.kinds[b].options) for b in names)
            if not dual and not t.overlap.async_sends:
                seconds += count * (t.comm[stage].p2p.seconds + t.comm[stage].p2p_back.seconds)
        fixed.append(seconds)
    return groups, count, fixed, work


def busiest_rank(t: Tables, config: Config) -> float:
    """The least, over every way to give the ranks whole layers, of the busiest rank's
    tasks back to back plus its optimizer step.

    A rank's end is at least its own tasks' sum and then its optimizer step
    (``planner.timeline``). Each task lasts at least its first term (its compute and, but for
    DualPipe pairs, the sends and all-to-alls in series), each block at its cheapest option,
    the embedding, MTP and head on the ranks that hold the first and last stage. What is
    left free is how many layers each rank holds (each stage between the first and the last
    holds one at least). Ranks that hold the same stages (DualPipe's two copies) share their
    count and are taken as one. Filling the ranks one layer at a time, each to the rank that
    would end earliest, gives the least busiest rank when every layer costs the same, so the
    layers are priced at the cheapest kind's cost; and again, for each costlier kind, only
    the layers of that kind or costlier, each at that kind's cost (the others taken as
    free). The mean rank (``lower_bound``'s other term) spreads the head's work and a
    fraction of a layer over every rank; this does not. 0.0 when the schedule's ranks do
    not split the stages into such groups."""
    ranks = _rank_groups(t, config)
    if ranks is None:
        return 0.0
    groups, count, fixed, work = ranks
    last = config.stages - 1
    least = [sum(1 for stage in stages if 0 < stage < last) for stages in groups]
    unit = {
        k: count * min(work(o) for o in t.kinds[k].options)
        + optimizer_seconds(t.kinds[k].state, t.step)
        for k in set(t.layer_kinds)
    }
    best = 0.0
    cheapest = min(unit.values())
    for u in sorted(set(unit.values())):
        layers = sum(1 for x in t.layer_kinds if unit[x] >= u)
        best = max(best, _fill(fixed, u, layers, least if u == cheapest else [0] * len(fixed)))
    return best


def crowded_rank(t: Tables, config: Config, cap: float) -> float:
    """The least, over every way to give the ranks whole layers, of the busiest rank's
    tasks back to back plus its optimizer step, where each rank's layers take the recompute
    that its own memory forces.

    ``busiest_rank`` prices every layer at its fastest option; but a rank holds its layers'
    state and, at its peak, their saved activations times the micro-batches in flight, and
    what does not fit within ``cap`` (allocated bytes: ``memory_cap``) must be recomputed.
    For a rank with n layers, the least recompute is the fractional knapsack over the
    options' convex hull of (saved bytes, seconds) with every layer at the same point (the
    hull is convex, so spreading the saving evenly is cheapest); the bytes a rank may keep
    are its cap less its fixed blocks' state, the buffers and its layers' state, over the
    fewest micro-batches its op order can keep in flight at its peak, whatever the split of
    its layers between its chunks (``_in_flight_floor``). Each rank's time is then
    increasing in its layer count, so filling the ranks one layer at a time, each to the
    rank that would end earliest, gives the least busiest rank. Each kind of layer is taken
    alone (the others left out: they would only add time and bytes). ``math.inf`` when some
    kind's layers cannot fit on the ranks at all; 0.0 when DualPipe-like copies or a shape
    this does not cover leave it nothing to say. The embedding's, MTP's and head's saved
    activations, recompute's rebuilt tensors and ZeRO-3's gathered copies are left out."""
    ranks = _rank_groups(t, config)
    if ranks is None:
        return 0.0
    groups, count, rank_time, work = ranks
    pp, v, m = config.pp, config.virtual_stages, config.num_microbatches
    crowd = [_in_flight_floor(config.schedule, pp, m, v, r) for r in range(pp)]
    rank_bytes = [
        max(gpu_state_bytes(t.fixed_state[r]) for r in rs) + t.buffers for rs in groups.values()
    ]
    rank_crowd = [max(crowd[r] for r in rs) for rs in groups.values()]
    best = 0.0
    for kind in sorted(set(t.layer_kinds)):
        k = t.kinds[kind]
        per_layer = _Crowd(
            hull=_hull(k.options),
            state=gpu_state_bytes(k.state),
            comm=work(k.options[0]) - k.options[0].time,  # the all-to-alls in series, if any
            optimizer=optimizer_seconds(k.state, t.step),
            runs=count,
            cap=cap,
        )
        groups_ = list(zip(rank_time, rank_bytes, rank_crowd, strict=True))
        layers = sum(1 for x in t.layer_kinds if x == kind)
        best = max(best, per_layer.busiest(groups_, layers))
    return best


@dataclass(frozen=True)
class _Crowd:
    """One kind of layer in ``crowded_rank``: what a layer costs a group of ranks."""

    hull: list[tuple[float, float]]  # (saved bytes, seconds per micro-batch), fastest first
    state: float  # bytes of state per layer
    comm: float  # seconds per micro-batch in series with it
    optimizer: float  # optimizer seconds per layer
    runs: int  # forwards per stage
    cap: float

    def end(self, group: tuple[float, float, float], n: int) -> float:
        """A group's end with n layers (group: fixed seconds, fixed bytes, micro-batches
        in flight at its peak); inf when they cannot fit."""
        seconds, fixed, crowd = group
        if n == 0:
            return seconds
        room = self.cap - fixed - n * self.state
        if room < 0:
            return math.inf
        keep = room / (n * crowd) if crowd > 0 else math.inf
        per_layer = _along(self.hull, keep)
        return seconds + self.runs * n * (per_layer + self.comm) + n * self.optimizer

    def busiest(self, groups: list[tuple[float, float, float]], layers: int) -> float:
        """The least busiest group, filling the groups a layer at a time, each to the group
        that would end earliest (optimal, each group's end rising with its layers)."""
        held = [0] * len(groups)
        heap = [(self.end(g, 1), i) for i, g in enumerate(groups)]
        heapq.heapify(heap)
        for _ in range(layers):
            value, i = heapq.heappop(heap)
            if math.isinf(value):
                return math.inf
            held[i] += 1
            heapq.heappush(heap, (self.end(groups[i], held[i] + 1), i))
        return max(self.end(g, n) for g, n in zip(groups, held, strict=True))


def _along(hull: list[tuple[float, float]], keep: float) -> float:
    """Seconds per micro-batch of a layer keeping at most ``keep`` saved bytes: the
    cheapest point of the (saved, seconds) hull at or under it (inf under the leanest)."""
    if keep >= hull[0][0]:
        return hull[0][1]
    if keep < hull[-1][0]:
        return math.inf
    for (s0, t0), (s1, t1) in itertools.pairwise(hull):
        if s1 <= keep <= s0:
            return t0 + (t1 - t0) * (s0 - keep) / (s0 - s1) if s0 > s1 else t1
    return hull[-1][1]


@functools.lru_cache(maxsize=4096)
def _in_flight_floor(schedule: str, pp: int, m: int, v: int, rank: int) -> float:
    """The fewest micro-batches' saved activations a rank can hold at its peak, over every
    split of its layers between its chunks: min over fractions x of max over the levels its
    op order passes through of sum_c count_c x_c (bounded by ``_dual_bound``)."""
    from planner.costs.activations import activation_levels
    from planner.layout import chunks_of

    chunks = list(dict.fromkeys(chunks_of(schedule, pp, v, rank)))
    levels = np.array(
        [counts for counts, _ in activation_levels(schedule, pp, m, v, rank, chunks)], dtype=float
    )
    if levels.size == 0:
        return 0.0
    return _dual_bound(levels, np.zeros(len(levels)), np.zeros(len(chunks)), 1.0)


def fill_and_drain(t: Tables, config: Config) -> float:
    """A step no layout of ``config`` beats, with the pipeline's fill and drain: the least,
    over every split of the layers between stages, of the longest of the schedule's chains
    of tasks that ``planner.timeline.shape_forms`` lists (each rank's own tasks back to
    back, and the chains that set each rank's end with even stages and with heavy ones).

    Each chain is a path through the step's tasks, so whatever the stages cost the step is
    at least its length (``planner.timeline``). A task lasts at least its compute and, in
    series with it, its sends and all-to-alls (its first term, ``planner.costs.overlap``;
    the ZeRO collectives and gradient reductions taken as nothing), a layer at the cheapest
    kind's cheapest option of each, the embedding, MTP and head where they sit; a rank's
    optimizer step at least its layers' at the cheapest kind's. Each chain is then linear
    in the stages' layer counts, and the least longest over the counts is bounded by weak
    duality (``_dual_bound``). The mean rank's and the busiest rank's bounds leave the
    fill and drain out: with few micro-batches on a deep pipeline they are most of the
    step. 0.0 when the relaxation says nothing (no layer to split)."""
    S, pp = config.stages, config.pp
    weights, optimizer, held = _chains(
        config.schedule, pp, config.num_microbatches, config.virtual_stages, t.overlap
    )
    lowest: dict[str, np.ndarray] = {}
    fixed: dict[str, np.ndarray] = {}
    kinds = sorted(set(t.layer_kinds))
    blocks = set(kinds) | {b for s in range(S) for b in _fixed_blocks(t, s, S)}
    least = {(b, s): _cheapest(t, b, s) for b in blocks for s in range(S)}
    for name in _CHAIN_PRIMS:
        lowest[name] = np.array([min(least[k, s][name] for k in kinds) for s in range(S)])
        fixed[name] = np.array(
            [sum(least[b, s][name] for b in _fixed_blocks(t, s, S)) for s in range(S)]
        )
    fixed[Q.P2P] = np.array([c.p2p.seconds for c in t.comm])
    fixed[Q.P2P_BACK] = np.array([c.p2p_back.seconds for c in t.comm])
    per_layer = np.stack([lowest.get(n, np.zeros(S)) for n in _ALL_PRIMS])  # [prim, stage]
    per_stage = np.stack([fixed[n] for n in _ALL_PRIMS])
    coef = np.einsum("fps,ps->fs", weights, per_layer)
    const = np.einsum("fps,ps->f", weights, per_stage)
    layer_opt = min(optimizer_seconds(t.kinds[k].state, t.step) for k in kinds)
    fixed_opt = np.array([optimizer_seconds(t.fixed_state[r], t.step) for r in range(pp)])
    coef += layer_opt * (optimizer @ held)
    const += optimizer @ fixed_opt
    lo = np.array([1.0 if 0 < s < S - 1 else 0.0 for s in range(S)])
    free = len(t.layer_kinds) - lo.sum()
    if free < 0:
        return 0.0
    return _dual_bound(coef, const, lo, free)


Q = Quantity
# per layer, and of the fixed blocks; the sends are the stage's alone
_CHAIN_PRIMS: tuple[str, ...] = (Q.FWD, Q.BWD_INPUT, Q.BWD_WEIGHT, Q.A2A_FWD, Q.A2A_BWD)
_ALL_PRIMS: tuple[str, ...] = (*_CHAIN_PRIMS, Q.P2P, Q.P2P_BACK)


class _Least:
    """The domain of a block's quantities at their least over its options
    (``costs.quantities.Domain``), each quantity on its own: the compute and the
    all-to-alls it brings, without the stage's sends and collectives (``const``,
    ``over_bytes`` and ``if_expert`` are nothing)."""

    def __init__(self, rows: Sequence[Row]) -> None:
        self.rows = rows

    def blocks(self, seconds: Callable[[Row], float]) -> float:
        return min(seconds(r) for r in self.rows)

    def count(self, number: Callable[[Row], int]) -> float:
        return float(min(number(r) for r in self.rows))

    def per(self, count: float, seconds: float) -> float:
        return count * seconds

    def const(self, seconds: float) -> float:
        return 0.0

    def over_bytes(self, kind: Bytes, per_byte: float) -> float:
        return 0.0

    def if_expert(self, seconds: float) -> float:
        return 0.0

    def add(self, a: float, b: float) -> float:
        return a + b


def _cheapest(t: Tables, block: str, stage: int) -> dict[str, float]:
    """A block's quantities at ``stage`` at their least over its options (seconds per
    micro-batch)."""
    return stage_quantities(_Least([o.row for o in t.kinds[block].options]), t.comm[stage])


def _a2a_per_layer(t: Tables) -> tuple[float, float]:
    """One MoE layer's all-to-alls per micro-batch, forward and backward (without a re-run),
    each at the stage where it is cheapest."""
    d = _Least(())
    forward = min(a2a_forward(d, 1.0, c.forward_pair.seconds) for c in t.comm)
    backward = min(
        a2a_backward(d, 1.0, 0.0, c.forward_pair.seconds, c.combine.seconds) for c in t.comm
    )
    return forward, backward


def _fixed_blocks(t: Tables, stage: int, stages: int) -> list[str]:
    return (t.first_fixed if stage == 0 else []) + (t.last_fixed if stage == stages - 1 else [])


@functools.lru_cache(maxsize=512)
def _chains(
    schedule: str, pp: int, m: int, v: int, first: Overlap
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The shape's chains as weights: [chain, quantity, stage] on ``_ALL_PRIMS`` (each
    task at its first term under ``first``), [chain, rank] on the ranks' optimizer steps,
    and which stages each rank holds [rank, stage] (cached: they depend on the shape and
    the SMs communication takes alone)."""
    from planner.costs.overlap import task_terms
    from planner.layout import chunks_of
    from planner.timeline import shape_forms

    S = pp * v
    forms = shape_forms(schedule, pp, m, v)
    index = {name: i for i, name in enumerate(_ALL_PRIMS)}
    weights = np.zeros((len(forms), len(_ALL_PRIMS), S))
    optimizer = np.zeros((len(forms), pp))
    for f, form in enumerate(forms):
        for key, c in form.items():
            if key[0] == "opt":
                optimizer[f, key[1]] += c
                continue
            terms = task_terms(key[1], first)[0].coeffs if key[0] == "task" else ((key[1], 1.0),)
            for (name, stage), k in terms:
                if name in index:
                    weights[f, index[name], stage] += c * k
    held = np.zeros((pp, S))
    for r in range(pp):
        held[r, chunks_of(schedule, pp, v, r)] = 1.0
    return weights, optimizer, held


def _dual_bound(coef: np.ndarray, const: np.ndarray, lo: np.ndarray, free: float) -> float:
    """A lower bound on min over n >= lo, sum(n) = sum(lo) + free of max over rows r of
    ``const[r] + coef[r] @ n``: for weights w >= 0 summing to 1 the minimum is at least
    ``w @ const + c @ lo + free * min(c)`` with ``c = w @ coef`` (weak duality), so any w
    gives a bound. The weights are the soft maximum of the rows' values at points that a
    Frank-Wolfe descent of that soft maximum visits (60 steps, the layers moved toward the
    stage the weights price lowest); the best bound seen is returned. Where the fill and drain
    matter (few micro-batches a stage) it comes close to the min-max's optimum; with many it
    can fall far below it (Llama 3 70B on 64 H100, tp4 pp4 1F1B at 32 micro-batches: 3.66 s
    against an optimum of 9.28 s, the soft maximum weighting the fill and drain chains where
    the ranks' own chains are the binding ones), and the mean and busiest rank's bounds hold
    there instead. Solving the program exactly (GLOP's duals) was tried: 3 to 6 times the
    time, and at 10 and 60 s limits no search's final bound rose (``plan_speed.py``)."""
    _, stages = coef.shape
    n = lo + free / stages
    best, scale = -math.inf, 0.0
    for step in range(DUAL_STEPS):
        values = const + coef @ n
        top = float(values.max())
        scale = scale or max(top, 1e-12)
        weight = np.exp(DUAL_SHARPNESS * (values - top) / scale)
        weight /= weight.sum()
        per_stage = weight @ coef
        best = max(best, float(weight @ const + per_stage @ lo + free * per_stage.min()))
        toward = lo.copy()
        toward[int(np.argmin(per_stage))] += free
        n += (2.0 / (step + 2.0)) * (toward - n)
    return max(0.0, best)


DUAL_STEPS = 60
DUAL_SHARPNESS = 30.0  # soft maximum's sharpness, relative to the first point's maximum


def _fill(fixed: list[float], unit: float, layers: int, least: list[int]) -> float:
    """The least busiest rank when rank r starts at ``fixed[r]`` with ``least[r]`` layers
    and ``layers`` layers of ``unit`` seconds each are shared out (none left over)."""
    held = list(least)
    left = layers - sum(held)
    if left < 0:
        return 0.0  # more layers required than there are: no layout, no bound from here
    heap = [(fixed[r] + (held[r] + 1) * unit, r) for r in range(len(fixed))]
    heapq.heapify(heap)
    for _ in range(left):
        _, r = heapq.heappop(heap)
        held[r] += 1
        heapq.heappush(heap, (fixed[r] + (held[r] + 1) * unit, r))
    return max(fixed[r] + held[r] * unit for r in range(len(fixed)))


def degrees_bound(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> float | None:
    """A step time no configuration with ``config``'s degrees and micro-batch beats,
    whatever its ZeRO stage, schedule or EMA placement: the mean rank's share of every
    block's cheapest compute, with no communication in series (DualPipe could hide it) and
    the optimizer step of the most sharded state (``config`` should be the one with the
    highest ZeRO stage). None when the degrees do not divide the model, or when even that
    most sharded state is over the cap. Cheaper than ``lower_bound`` and never above it for
    any configuration it stands for."""
    t = bound_tables(model, cluster, job, config)
    if t is None or any(not k.options for k in t.kinds.values()):
        return None
    # The leanest of the configurations: one copy of the model (no DualPipe), the EMA off the
    # GPU. If even its state is over the cap, none of them fits.
    lean = dataclasses.replace(config, schedule=DEFAULT_SCHEDULE, virtual_stages=1, ema="host")
    lean_tables = bound_tables(model, cluster, job, lean)
    if lean_tables is not None and not state_fits(lean_tables, cluster, job, lean):
        return None
    count = Counter(t.layer_kinds + t.first_fixed + t.last_fixed)
    opts = {b: t.kinds[b].options for b in count}
    work = sum(
        n * (min(o.row.fwd for o in opts[b]) + min(o.row.bwd_input for o in opts[b]))
        + n * opts[b][0].row.bwd_weight
        for b, n in count.items()
    )
    floor = dataclasses.replace(config, schedule=DEFAULT_SCHEDULE, virtual_stages=1)
    return config.num_microbatches * work / config.pp + _optimizer_floor(t, floor)


def communication_floor(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> float:
    """The mean rank's share of the expert all-to-alls and pipeline sends over a step, at
    least half of which no schedule hides (a DualPipe pair hides one chunk's communication
    behind the other's compute; see ``lower_bound``): seconds, 0 when ``config`` does not
    divide the model. An order for the search, cheap, since ``degrees_bound`` leaves
    communication out."""
    t = bound_tables(model, cluster, job, config)
    if t is None:
        return 0.0
    moe, a2a_f, a2a_b, p2p, back = _communication(t)
    return config.num_microbatches * (moe * (a2a_f + a2a_b) + p2p + back) / (2 * config.pp)


def _communication(t: Tables) -> tuple[int, float, float, float, float]:
    """Per micro-batch, summed over stages: the MoE layers, one MoE layer's forward and
    backward all-to-alls at the cheapest stage (``_a2a_per_layer``), and all forward and
    backward sends."""
    count = Counter(t.layer_kinds + t.first_fixed + t.last_fixed)
    moe = sum(n * t.kinds[b].cost.moe_layers for b, n in count.items())
    a2a_f, a2a_b = _a2a_per_layer(t)
    # Asynchronous sends (``Overlap.async_sends``) are not in series with any task.
    waits = 0.0 if t.overlap.async_sends else 1.0
    p2p = waits * sum(c.p2p.seconds for c in t.comm)
    back = waits * sum(c.p2p_back.seconds for c in t.comm)
    return moe, a2a_f, a2a_b, p2p, back


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
    budget = _activation_budget(model, t, cluster, job, config)
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


def _activation_budget(
    model: ModelSpec, t: Tables, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> float:
    """The layers' saved bytes (per micro-batch, all layers) the ranks' memory leaves room
    for together (``_forced_recompute``)."""
    from planner.schedules import in_flight

    usable = memory_cap(cluster, job)
    copies = config.copies
    state = copies * sum(gpu_state_bytes(t.kinds[k].state) for k in t.layer_kinds)
    state += sum(gpu_state_bytes(s) for s in t.fixed_state) + config.pp * t.buffers
    proto = prototype(model, config)
    weight = [0.0] * config.stages
    for r in range(config.pp):
        for stage, count in in_flight(proto, r, config.num_microbatches).items():
            weight[stage] += count
    w = min(weight)
    fixed = t.first_fixed + t.last_fixed
    fixed_saved = sum(min(o.saved for o in t.kinds[b].options) for b in fixed)
    return (config.pp * usable - state) / w - fixed_saved


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
    copies = config.copies
    total = copies * sum(optimizer_seconds(t.kinds[k].state, t.step) for k in t.layer_kinds)
    total += sum(optimizer_seconds(s, t.step) for s in t.fixed_state)
    return total / config.pp


def _collective(t: Tables, quantity: Quantity, *, low: bool) -> float:
    """ZeRO reduce-scatters (``ZERO_REDUCE``) or all-gathers (``ZERO_GATHER``) summed over
    stages, at the cheapest (``low``) or costliest stage's rate: all the bytes, plus every
    stage's latency (an expert latency only counts once at the low end: one stage may hold
    every expert)."""
    dense_kind, expert_kind = COLLECTIVE_BYTES[quantity]
    dense = sum(t.kinds[k].nbytes[dense_kind] for k in t.layer_kinds)
    expert = sum(t.kinds[k].nbytes[expert_kind] for k in t.layer_kinds)
    for fixed in t.fixed_bytes:
        dense, expert = dense + fixed[dense_kind], expert + fixed[expert_kind]
    pairs = [rates(c, quantity) for c in t.comm]
    pick = min if low else max
    a_d = pick(d.per_byte.seconds for d, _ in pairs)
    a_e = pick(e.per_byte.seconds for _, e in pairs)
    c_d = pick(d.latency.seconds for d, _ in pairs)
    c_e = pick(e.latency.seconds for _, e in pairs)
    stages = len(pairs)
    expert_latency = (c_e if expert else 0.0) * (1 if low else stages)
    return a_d * dense + a_e * expert + stages * c_d + expert_latency


def state_fits(tables: Tables, cluster: ClusterSpec, job: TrainingJob, config: Config) -> bool:
    """Every rank holds its share of the model state: if the average share alone is over
    the usable HBM, no partition fits."""
    usable = memory_cap(cluster, job)
    # Pigeonhole: some rank holds at least ceil(layer copies / pp) layers.
    copies = config.copies
    most = -(-copies * len(tables.layer_kinds) // config.pp)
    lightest = min(gpu_state_bytes(tables.kinds[k].state) for k in set(tables.layer_kinds))
    heaviest_rank = most * lightest + tables.buffers
    return max(memory_floor(tables, config), heaviest_rank) <= usable


def host_fits(
    layers: Sequence[Mapping[str, float]],
    fixed: Sequence[Mapping[str, float]],
    cluster: ClusterSpec,
    config: Config,
) -> bool:
    """The average rank's host RAM (an EMA kept there, an offloaded optimizer), times the GPUs
    of a node, within the node's RAM
    (``layers``: each transformer layer's state; ``fixed``: each rank's fixed blocks', as
    ``tables.states`` gives them)."""
    copies = config.copies
    host = copies * sum(s["host"] for s in layers) + sum(s["host"] for s in fixed)
    per_node = min(cluster.gpus_per_node, cluster.num_gpus)
    return host / config.pp * per_node <= cluster.host_ram_bytes


def memory_floor(tables: Tables, config: Config) -> float:
    """The average rank's model state and buffers (bytes): some rank needs at least this."""
    state = sum(gpu_state_bytes(tables.kinds[k].state) for k in tables.layer_kinds)
    copies = config.copies
    fixed = sum(gpu_state_bytes(s) for s in tables.fixed_state)
    return (copies * state + fixed) / config.pp + tables.buffers


_TABLES: Memo[Tables | None] = Memo("bounds.tables", limit=50_000)


def bound_tables(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> Tables | None:
    """The tables of ``config`` without the rank orders (None: its degrees do not divide
    the model)."""

    def make() -> Tables | None:
        try:
            return build(model, cluster, job, config, Network.of(cluster), light=True)
        except PlannerError:
            return None

    return _TABLES.get((model, cluster.model_dump_json(), job, config.key()), make)
