"""Pipeline schedules: the order of work on each rank, the bubble each source states, and how
many micro-batches' activations each rank holds at its peak.

- :func:`op_order` lists, for one pipeline rank, the forward (F), backward (BW, or its
  input-gradient half B and weight-gradient half W) passes it runs, in the order the
  schedule's reference implementation runs them.
- :func:`stage_rank` says which rank holds a stage (and, for DualPipe, a direction).
- :func:`bubble_formula` is the idle time per rank as each schedule's paper states it.
- :func:`in_flight` feeds the memory model: micro-batches per chunk resident at the peak.
- ``SCHEDULES`` is the registry: one frozen ``Schedule`` per schedule, with what it holds
  (chunks per rank, copies of a stage), what it pairs, the micro-batch counts its reference
  implementation accepts, and the functions above. Every other module asks the entry
  (``schedule(name)``) instead of comparing names.

Stages are indices into ``Layout.stages`` (model order); data flows from stage s to s + 1 in
forward. Sources are cited with each schedule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from planner.errors import PlannerError

if TYPE_CHECKING:
    from planner.layout import Layout

OpKind = Literal["F", "B", "W", "BW"]


@dataclass(frozen=True)
class Op:
    """One pass of one micro-batch through one stage.

    ``kind``: F forward, B input-gradient backward, W weight-gradient backward, BW the full
    backward (B and W fused, for schedules that do not split them). ``paired`` marks an F that
    runs overlapped with the B/BW op right after it on the same rank (DualPipe's F&B chunks).
    """

    kind: OpKind
    microbatch: int
    stage: int
    direction: int = 0
    paired: bool = False


def layout_order(layout: Layout, rank: int, num_microbatches: int) -> list[Op]:
    """``op_order`` of ``rank`` under ``layout``'s schedule and degrees."""
    return op_order(
        layout.schedule,
        pp=layout.pp,
        num_microbatches=num_microbatches,
        rank=rank,
        virtual_stages=layout.virtual_stages,
    )


def stage_rank(schedule: str, pp: int, stage: int, direction: int = 0) -> int:
    """Pipeline rank holding ``stage`` (for DualPipe: the copy serving ``direction``)."""
    return schedule_of(schedule).holder(pp, stage, direction)


def _cyclic_holder(pp: int, stage: int, direction: int) -> int:
    return stage % pp


def _mirror_holder(pp: int, stage: int, direction: int) -> int:
    # Two copies of the model, one per direction; direction 1 enters at the last rank.
    assert 0 <= stage < pp and direction in (0, 1)
    return stage if direction == 0 else pp - 1 - stage


def _v_holder(pp: int, stage: int, direction: int) -> int:
    # V shape: down the ranks for the first pp stages, back up for the last pp.
    assert 0 <= stage < 2 * pp
    return stage if stage < pp else 2 * pp - 1 - stage


def _cyclic_chunks(pp: int, virtual_stages: int, rank: int) -> list[int]:
    return [rank + k * pp for k in range(virtual_stages)]


def _mirror_chunks(pp: int, virtual_stages: int, rank: int) -> list[int]:
    return [rank, pp - 1 - rank]


def _v_chunks(pp: int, virtual_stages: int, rank: int) -> list[int]:
    return [rank, 2 * pp - 1 - rank]


def op_order(
    schedule: str, *, pp: int, num_microbatches: int, rank: int, virtual_stages: int = 1
) -> list[Op]:
    """The ops pipeline rank ``rank`` runs in one training step, in order."""
    entry = check(schedule, pp, num_microbatches, virtual_stages)
    assert 0 <= rank < pp
    return entry.order(pp, num_microbatches, rank, virtual_stages)


def bubble_formula(
    schedule: str,
    *,
    pp: int,
    num_microbatches: int,
    virtual_stages: int,
    f: float,
    b: float,
    w: float,
    fb: float | None = None,
) -> float:
    """Idle time per rank as each source states it (seconds if f/b/w are seconds): f forward
    time of one micro-batch on one stage chunk, b input-grad backward, w weight-grad backward,
    fb time of an overlapped F&B pair (default f+b+w: a forward and a full backward with no
    gain from the overlap; DualPipe's paired backward is the full one, see ``_dualpipe``).

    The sources write B for the full backward of a chunk, here b + w.
    """
    entry = check(schedule, pp, num_microbatches, virtual_stages)
    full_b = b + w
    pair = f + full_b if fb is None else fb
    return entry.bubble(pp, virtual_stages, f, full_b, w, pair)


def _flush_bubble(p: int, v: int, f: float, full_b: float, w: float, pair: float) -> float:
    # (p-1)(F+B): Huang et al. 2019 (GPipe), Narayanan et al. SC'21 section 2.2.1.
    return (p - 1) * (f + full_b)


def _interleaved_bubble(p: int, v: int, f: float, full_b: float, w: float, pair: float) -> float:
    # (p-1)(F+B)/v with F, B a rank's whole share of layers (v chunks): Narayanan et al.
    # SC'21 section 2.2.2.
    return (p - 1) * (v * f + v * full_b) / v


def _zero_bubble(p: int, v: int, f: float, full_b: float, w: float, pair: float) -> float:
    # (p-1)(F+B-2W), B the full backward, as the deepseek-ai/DualPipe README's ZB1P row
    # writes Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2.1 (ZB-H1:
    # a third of 1F1B's bubble when F, B and W passes take equal time).
    return (p - 1) * (f + full_b - 2 * w)


def _dual_bubble(stages: int, f: float, full_b: float, w: float, pair: float) -> float:
    # (PP/2-1)(F&B+B-3W) with PP the number of stages: DeepSeek-V3 technical report
    # (arXiv 2412.19437) Table 2 for DualPipe; the deepseek-ai/DualPipe README states the same
    # for DualPipeV, whose PP stages sit on PP/2 ranks (PP = 2 * pp here).
    return (stages // 2 - 1) * (pair + full_b - 3 * w)


def _dualpipe_bubble(p: int, v: int, f: float, full_b: float, w: float, pair: float) -> float:
    return _dual_bubble(p, f, full_b, w, pair)


def _dualpipev_bubble(p: int, v: int, f: float, full_b: float, w: float, pair: float) -> float:
    return _dual_bubble(2 * p, f, full_b, w, pair)


def order_idle(
    schedule: str,
    *,
    pp: int,
    num_microbatches: int,
    virtual_stages: int,
    f: float,
    b: float,
    w: float,
    fb: float | None = None,
) -> float:
    """Idle time of the most idle rank when ``op_order`` runs with equal stages: the source's
    ``bubble_formula``, which the DualPipe sources state for f = b, plus the reference
    order's exact dependence on f - b. With k = stages/2 - 1, a forward longer than the
    backward adds k(f - b); a shorter one saves min(f, k(b - f)), together
    max(k(f - b), -f) (found by running the order; ``tests/test_schedule_orders.py`` checks
    it over a grid with and without overlap gain). Every other schedule's formula is already
    exact for the orders here."""
    linear, k = idle_terms(
        schedule, pp=pp, num_microbatches=num_microbatches, virtual_stages=virtual_stages
    )
    pair = f + b + w if fb is None else fb
    idle = linear["f"] * f + linear["b"] * b + linear["w"] * w + linear["fb"] * pair
    return idle + max(k * (f - b), -f) if k is not None else idle


def idle_terms(
    schedule: str, *, pp: int, num_microbatches: int, virtual_stages: int
) -> tuple[dict[str, float], int | None]:
    """``order_idle`` as data: the coefficients of f, b, w and fb in its linear part, and for
    DualPipe / DualPipeV the k of its max(k(f - b), -f) term (None for other schedules)."""
    linear = {}
    for key in ("f", "b", "w", "fb"):
        unit = {k: float(k == key) for k in ("f", "b", "w", "fb")}
        linear[key] = bubble_formula(
            schedule,
            pp=pp,
            num_microbatches=num_microbatches,
            virtual_stages=virtual_stages,
            **unit,
        )
    entry = schedule_of(schedule)
    if not entry.paired or entry.ep_overlap:
        return linear, None
    return linear, (entry.depth * pp) // 2 - 1


def in_flight(layout: Layout, rank: int, num_microbatches: int) -> dict[int, float]:
    """Micro-batches resident per stage (chunk index -> count) at ``rank``'s peak.

    A micro-batch is resident on a stage from its F until its BW (or W) is done; the counts
    are taken at the first moment the rank's total peaks in :func:`op_order` (for micro-batch
    counts the reference does not run, the same closed forms, capped at m). Equal totals at
    other moments may split differently between an interleaved rank's chunks.
    """
    entry = schedule_of(layout.schedule)
    chunks = layout.chunks_of_rank(rank)
    return entry.peak(layout.pp, num_microbatches, layout.virtual_stages, rank, chunks)


def _gpipe_peak(p: int, m: int, v: int, rank: int, chunks: list[int]) -> dict[int, float]:
    # All forwards before any backward (Huang et al. 2019).
    return {c: float(m) for c in chunks}


def _one_f_one_b_peak(p: int, m: int, v: int, rank: int, chunks: list[int]) -> dict[int, float]:
    # 1F1B (Narayanan et al. SC'21, section 2.2.1): rank r runs p - r forwards before its
    # first backward.
    return {chunks[0]: float(min(p - rank, m))}


def _zero_bubble_peak(p: int, m: int, v: int, rank: int, chunks: list[int]) -> dict[int, float]:
    # ZB-H1 (Qi et al. ICLR'24, section 2.1) runs 1F1B's p - r forwards, then delays each
    # rank's W passes by r, so every rank, not just the first, holds p micro-batches whose
    # W is not done (W needs most of the saved activations: their Table 1, M_W vs M_B).
    return {chunks[0]: float(min(p, m))}


def _interleaved_peak(p: int, m: int, v: int, rank: int, chunks: list[int]) -> dict[int, float]:
    """Count the chunks of the forwards Megatron-LM's interleaved schedule runs before the
    rank's first backward (see ``_interleaved_order``)."""
    counts = dict.fromkeys(chunks, 0.0)
    for j in range(min(_interleaved_warmup(p, v, m, rank) + 1, m * v)):
        counts[chunks[_interleaved_chunk(j, p, v)]] += 1
    return counts


# DualPipe / DualPipeV peak at step 4's first F (see ``_dualpipe``): on the leg where the
# rank sits early it holds as many as 1F1B would over that leg (pp - r on DualPipe's
# direction 0; 2pp - r on the V's 2pp-stage pipeline), on the other leg r + 1. Totals: pp + 1
# for DualPipe, 2pp + 1 chunks for DualPipeV, both PP + 1 stages in the deepseek-ai/DualPipe
# README's table (PP stages: pp, resp. 2pp). Counts below the reference's minimum of m are
# capped at m; DualPipe feeds each direction half of them (an odd one to the first).
def _dualpipe_peak(p: int, m: int, v: int, rank: int, chunks: list[int]) -> dict[int, float]:
    first, second = (m + 1) // 2, m // 2
    return {chunks[0]: float(min(p - rank, first)), chunks[1]: float(min(rank + 1, second))}


def _dualpipev_peak(p: int, m: int, v: int, rank: int, chunks: list[int]) -> dict[int, float]:
    return {chunks[0]: float(min(2 * p - rank, m)), chunks[1]: float(min(rank + 1, m))}


def check(schedule: str, p: int, m: int, v: int) -> Schedule:
    """The schedule's entry, once the reference implementation's limits on the micro-batch
    count (and Layout's on v) hold."""
    entry = schedule_of(schedule)
    assert p > 0
    expected_v = entry.virtual_stages
    if (v < 2) if expected_v is None else (v != expected_v):
        rule = ">= 2" if expected_v is None else f"= {expected_v}"
        raise PlannerError(f"Layout.virtual_stages={v}: {schedule} needs virtual_stages {rule}")
    if m < 1:
        raise PlannerError(f"Layout.num_microbatches={m}: must be >= 1")
    if entry.even_pp and p % 2:
        raise PlannerError(f"Layout.pp={p}: {schedule} needs an even pp")
    rule = entry.microbatch_rule(p, m)
    if rule:
        raise PlannerError(f"Layout.num_microbatches={m}: {schedule} needs {rule}")
    return entry


def _gpipe(m: int, r: int) -> list[Op]:
    """GPipe (Huang et al. 2019): every forward, then every backward (last in, first out)."""
    return [Op("F", i, r) for i in range(m)] + [Op("BW", i, r) for i in reversed(range(m))]


def _one_f_one_b(p: int, m: int, r: int, *, split: bool) -> list[Op]:
    """1F1B as Megatron-LM runs it (``forward_backward_pipelining_without_interleaving``):
    min(p - r - 1, m) warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards.

    ``split`` gives ZB-H1 (Qi et al. ICLR'24, section 2.1, their Figure 3 top): the same F and B
    order, with each W delayed by r micro-batches on rank r, so the last ranks' B passes reach
    the first ranks sooner and the delayed W passes fill the cool-down bubble.
    """
    warmup = min(p - r - 1, m)
    forwards = [Op("F", i, r) for i in range(m)]
    backwards = [Op("B" if split else "BW", i, r) for i in range(m)]
    order = forwards[:warmup]
    for i in range(m):
        if warmup + i < m:
            order.append(forwards[warmup + i])
        order.append(backwards[i])
        if split and i >= r:
            order.append(Op("W", i - r, r))
    if split:  # the W passes still delayed when the last B is done
        order += [Op("W", i, r) for i in range(max(m - r, 0), m)]
    return order


def _interleaved_warmup(p: int, v: int, m: int, r: int) -> int:
    """Megatron-LM: (p-r-1)*2 + (v-1)*p forwards before the first backward, capped at m*v.
    Since commit 4295be1a6c (2024-11-01, "tunable schedule with overlapping") Megatron-Core
    no longer runs all m*v forwards first when m == p: the last rank then starts its 1F1B
    after (v-1)*p forwards, holding one micro-batch of its last chunk at a time (its CI
    measures that: published_memory.csv, mlm_ci_7b_tp1_pp4_*)."""
    return min((p - r - 1) * 2 + (v - 1) * p, m * v)


def _interleaved_chunk(j: int, p: int, v: int) -> int:
    """Local chunk of the j-th forward: p micro-batches on chunk 0, p on chunk 1, ..."""
    return (j % (p * v)) // p


def _interleaved_order(p: int, v: int, m: int, r: int) -> list[Op]:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. SC'21 section 2.2.2,
    ``forward_backward_pipelining_with_interleaving``): the j-th forward runs micro-batch
    (j // (p*v)) * p + j % p on local chunk (j % (p*v)) // p; the j-th backward the same
    micro-batch on the mirrored chunk v - 1 - that. Warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards."""

    def op(kind: OpKind, j: int) -> Op:
        chunk = _interleaved_chunk(j, p, v)
        if kind == "BW":
            chunk = v - 1 - chunk
        return Op(kind, (j // (p * v)) * p + j % p, r + chunk * p)

    total = m * v
    warmup = _interleaved_warmup(p, v, m, r)
    order = [op("F", j) for j in range(warmup)]
    for j in range(total - warmup):
        order += [op("F", warmup + j), op("BW", j)]
    return order + [op("BW", j) for j in range(total - warmup, total)]


def _dualpipe(p: int, m: int, r: int, v: int) -> list[Op]:
    """DualPipe's order (``_dual``): two copies of the model, one per direction."""
    return _dual(p, m, r, mirrored=True)


def _dualpipev(p: int, m: int, r: int, v: int) -> list[Op]:
    """DualPipeV's order (``_dual``): one model folded into a V over the ranks."""
    return _dual(p, m, r, mirrored=False)


def _dual(p: int, m: int, r: int, *, mirrored: bool) -> list[Op]:
    """DualPipe (DeepSeek-V3 report section 3.2.1) and DualPipeV, following the eight steps of
    ``DualPipe.step`` / ``DualPipeV.step`` in deepseek-ai/DualPipe.

    Each rank has two "phases": phase 0 is the leg where it sits early (position h), phase 1
    the leg where it sits late. For DualPipe, h = min(r, pp-1-r) over n = pp/2 positions per
    half and each direction carries m/2 micro-batches; for DualPipeV, h = r, n = pp and the V's
    two legs carry all m. Within a phase, forwards and backwards go in micro-batch order.
    Backwards are full (BW) unless the reference enables its zero-bubble split for them
    (``enable_zb``): then a B, and its W later in first-in first-out order.
    """
    if mirrored:
        n, h, per_leg = p // 2, min(r, p - 1 - r), m // 2
        # Phase 0 is direction 0 on the first half of the ranks, direction 1 on the second.
        dirs = (0, 1) if r < n else (1, 0)
        stage = {0: r, 1: p - 1 - r}
        legs = [(stage[d], d, d * per_leg) for d in dirs]  # (stage, direction, first id)
    else:
        n, h, per_leg = p, r, m
        legs = [(r, 0, 0), (2 * p - 1 - r, 0, 0)]
    done_f, done_b = [0, 0], [0, 0]
    pending_w: list[Op] = []
    order: list[Op] = []

    def fwd(phase: int, paired: bool = False) -> None:
        s, d, first = legs[phase]
        order.append(Op("F", first + done_f[phase], s, d, paired))
        done_f[phase] += 1

    def bwd(phase: int, zb: bool = False) -> None:
        s, d, first = legs[phase]
        order.append(Op("B" if zb else "BW", first + done_b[phase], s, d))
        if zb:
            pending_w.append(Op("W", first + done_b[phase], s, d))
        done_b[phase] += 1

    def weight() -> None:
        order.append(pending_w.pop(0))

    def pair(f_phase: int, b_phase: int) -> None:
        fwd(f_phase, paired=True)
        bwd(b_phase)

    for _ in range(2 * (n - h - 1)):  # step 1: forwards on the early leg
        fwd(0)
    for _ in range(h + 1):  # step 2: both legs
        fwd(0)
        fwd(1)
    for _ in range(n - h - 1):  # step 3: B, W, F on the late leg
        bwd(1, zb=True)
        weight()
        fwd(1)
    for i in range(per_leg - 2 * n + h + 1):  # step 4 (main): F&B pairs on both legs
        if i == 0 and h == n - 1:
            # The middle ranks (DualPipe) / the V's turn (DualPipeV) run this pair unoverlapped
            # "to further reduce bubble size" (reference comment).
            fwd(0)
            bwd(1)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(n - h - 1):  # step 5
        bwd(1)
        pair(1, 0)
    zb = False
    for i in range(h + 1):  # step 6: both legs; the later half split, W in steps 7-8
        zb = zb or (i == (h + 1) // 2 and h % 2 == 1)
        bwd(1, zb)
        zb = zb or (i == (h + 1) // 2 and h % 2 == 0)
        bwd(0, zb)
    for _ in range(n - h - 1):  # step 7
        weight()
        bwd(0, zb=True)
    for _ in range(h + 1):  # step 8: the remaining W passes
        weight()
    assert not pending_w
    return order


def _gpipe_order(p: int, m: int, r: int, v: int) -> list[Op]:
    return _gpipe(m, r)


def _one_f_one_b_order(p: int, m: int, r: int, v: int) -> list[Op]:
    return _one_f_one_b(p, m, r, split=False)


def _zero_bubble_order(p: int, m: int, r: int, v: int) -> list[Op]:
    return _one_f_one_b(p, m, r, split=True)


def _interleaved_ops(p: int, m: int, r: int, v: int) -> list[Op]:
    return _interleaved_order(p, v, m, r)


def _combined_order(p: int, m: int, r: int, v: int) -> list[Op]:
    """Megatron-LM's expert-parallel all-to-all overlap (``--overlap-moe-expert-parallel-
    comm``, megatron/core/pipeline_parallel/combined_1f1b.py at d98e8a64): the forward of one
    micro-batch merged, layer by layer, with the backward of another, so each one's
    all-to-alls hide behind the other's compute. It runs on the no-pipelining path (p = 1)
    and the interleaved one (schedules.py), whose order it keeps with one more warm-up
    forward (schedules.py:966-970): then every steady forward runs beside the backward after
    it, as a pair."""
    total = m * v

    def op(kind: OpKind, j: int, paired: bool = False) -> Op:
        chunk = _interleaved_chunk(j, p, v)
        if kind == "BW":
            chunk = v - 1 - chunk
        return Op(kind, (j // (p * v)) * p + j % p, r + chunk * p, paired=paired)

    warmup = min(_interleaved_warmup(p, v, m, r) + 1 if p > 1 else 1, total)
    order = [op("F", j) for j in range(warmup)]
    for j in range(total - warmup):
        order += [op("F", warmup + j, paired=True), op("BW", j)]
    return order + [op("BW", j) for j in range(total - warmup, total)]


def memory_order(schedule: str, order: list[Op]) -> list[Op]:
    """``order`` as its activations come and go: under the expert all-to-all overlap a
    paired forward runs layer by layer beside the backward (combined_1f1b.py merges them
    per layer, forward layers up while backward layers go down), so the backward's
    activations leave as the forward's arrive: the backward is taken first. (What the pair
    holds beyond the moment before it, one layer's activations in flight, is left out.)
    DualPipe's pairs keep their order: its README counts the paired forward's chunk
    whole (PP + 1 stages)."""
    return _backward_first(order) if schedule_of(schedule).ep_overlap else order


def _backward_first(order: list[Op]) -> list[Op]:
    """``order`` with each paired forward after the backward beside it."""
    out: list[Op] = []
    i = 0
    while i < len(order):
        if order[i].paired:
            out += [order[i + 1], order[i]]
            i += 2
        else:
            out.append(order[i])
            i += 1
    return out


@functools.lru_cache(maxsize=4096)
def _combined_counts(p: int, m: int, r: int, v: int) -> tuple[tuple[int, float], ...]:
    """Micro-batches resident per stage at the first moment the combined order on rank r
    holds the most: from a forward until its backward is done, in ``memory_order``."""
    held: dict[int, float] = {}
    best: dict[int, float] = {}
    for op in _backward_first(_combined_order(p, m, r, v)):
        if op.kind == "F":
            held[op.stage] = held.get(op.stage, 0.0) + 1
            if sum(held.values()) > sum(best.values()):
                best = dict(held)
        elif op.kind in ("BW", "W"):
            held[op.stage] -= 1
    return tuple(sorted(best.items()))


def steady_lengths(pp: int, virtual_stages: int) -> tuple[int, int]:
    """Two step lengths well past a schedule's fill and drain, 8 and 16 times pp * v
    micro-batches (multiples of 2 * pp, which every schedule's rule accepts): with every
    micro-batch alike, a longer step only repeats the steady state between them, so what
    it costs grows by the same amount per micro-batch (``costs.activations.long_step``)."""
    shorter = 8 * pp * virtual_stages
    return shorter, 2 * shorter


def _combined_peak(p: int, m: int, v: int, rank: int, chunks: list[int]) -> dict[int, float]:
    # The counts are those of the fill: past the steady lengths more micro-batches change
    # nothing, so a long step's are read off a step of that length instead of a walk of
    # every op (tests/test_schedules.py).
    filled = min(m, steady_lengths(p, v)[1])
    return dict.fromkeys(chunks, 0.0) | dict(_combined_counts(p, filled, rank, v))


# -- the registry -------------------------------------------------------------------------

Order = Callable[[int, int, int, int], list[Op]]  # (pp, m, rank, virtual_stages) -> ops
Chunks = Callable[[int, int, int], list[int]]  # (pp, virtual_stages, rank) -> stages held
Holder = Callable[[int, int, int], int]  # (pp, stage, direction) -> rank
Peak = Callable[[int, int, int, int, list[int]], dict[int, float]]  # see ``in_flight``
Bubble = Callable[[int, int, float, float, float, float], float]  # see ``bubble_formula``


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule: what each rank holds and runs, and the limits its reference
    implementation puts on the micro-batch count."""

    name: str
    order: Order
    chunks: Chunks
    holder: Holder
    peak: Peak
    bubble: Bubble
    virtual_stages: int | None = 1  # chunks per rank it runs (None: any >= 2)
    copies: int = 1  # ranks that hold each stage (DualPipe: one per direction)
    paired: bool = False  # a forward runs beside another micro-batch's backward
    depth: int = 1  # stages of one pipeline per rank, for a paired schedule's bubble
    separate_weight_grad: bool = False  # every backward's weight half is its own op
    min_pp: int = 1  # the search's least pipeline degree for it
    even_pp: bool = False
    multiple_of_pp: bool = False  # micro-batches a multiple of pp
    min_microbatches_per_rank: int = 0  # micro-batches at least this times pp
    even_microbatches: bool = False
    max_pp: int | None = None  # the largest pipeline degree it runs (None: any)
    # It pairs the steady forwards and backwards to hide the expert all-to-alls: it needs
    # an MoE model with ep > 1, a dispatcher that runs all-to-alls (not all-gathers), and
    # no recompute of the full layer or of the MoE layer (Megatron-LM's
    # transformer_config.py:3002-3071 at d98e8a64).
    ep_overlap: bool = False
    searched: bool = True  # in the search's default list
    leanness: int = 0  # rank by micro-batches held at the peak (the first layouts' order)
    # torch.distributed.pipelining's class for it (planner.run), and whether that class is a
    # _PipelineScheduleRuntime (which takes every stage of the rank, and waits on its sends
    # only when the step ends) rather than a single-stage schedule.
    torch_class: str | None = None
    torch_holds_sends: bool = False

    @property
    def default_virtual_stages(self) -> int:
        """Chunks per rank a layout of it takes when none are given."""
        return self.virtual_stages if self.virtual_stages is not None else 2

    def microbatch_rule(self, pp: int, m: int) -> str:
        """What the reference implementation needs of ``m`` micro-batches at ``pp`` ranks
        that ``m`` breaks, or ""."""
        # Megatron-LM's interleaved schedule asserts a multiple of pp (schedules.py, "number
        # of microbatches is not divisible by pipeline-model-parallel-size"); deepseek-ai/
        # DualPipe asserts num_chunks >= 2 * num_ranks (both), and an even count for
        # DualPipe, which splits it between its two directions.
        if self.multiple_of_pp and m % pp:
            return f"a multiple of pp={pp}"
        least = self.min_microbatches_per_rank * pp
        if m < least or (self.even_microbatches and m % 2):
            even = "an even number " if self.even_microbatches else ""
            return f"{even}>= 2*pp={least}"
        return ""

    def runs(self, pp: int, m: int, v: int) -> bool:
        """Whether the search may run it at ``pp`` ranks, ``m`` micro-batches and ``v``
        chunks per rank."""
        if pp < self.min_pp or (self.even_pp and pp % 2):
            return False
        if self.max_pp is not None and pp > self.max_pp:
            return False
        return not self.microbatch_rule(pp, m)


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule(
            "gpipe",
            _gpipe_order,
            _cyclic_chunks,
            _cyclic_holder,
            _gpipe_peak,
            _flush_bubble,
            searched=False,
            leanness=5,
            torch_class="ScheduleGPipe",
        ),
        Schedule(
            "1f1b",
            _one_f_one_b_order,
            _cyclic_chunks,
            _cyclic_holder,
            _one_f_one_b_peak,
            _flush_bubble,
            leanness=0,
            torch_class="Schedule1F1B",
        ),
        Schedule(
            "interleaved",
            _interleaved_ops,
            _cyclic_chunks,
            _cyclic_holder,
            _interleaved_peak,
            _interleaved_bubble,
            virtual_stages=None,
            min_pp=2,
            multiple_of_pp=True,
            leanness=1,
            torch_class="ScheduleInterleaved1F1B",
            torch_holds_sends=True,
        ),
        Schedule(
            "1f1b-ep-overlap",
            _combined_order,
            _cyclic_chunks,
            _cyclic_holder,
            _combined_peak,
            _flush_bubble,
            paired=True,
            max_pp=1,
            ep_overlap=True,
            leanness=0,
        ),
        Schedule(
            "interleaved-ep-overlap",
            _combined_order,
            _cyclic_chunks,
            _cyclic_holder,
            _combined_peak,
            _interleaved_bubble,
            virtual_stages=None,
            paired=True,
            min_pp=2,
            multiple_of_pp=True,
            ep_overlap=True,
            leanness=1,
        ),
        Schedule(
            "zb-h1",
            _zero_bubble_order,
            _cyclic_chunks,
            _cyclic_holder,
            _zero_bubble_peak,
            _zero_bubble,
            separate_weight_grad=True,
            leanness=2,
            torch_class="ScheduleInterleavedZeroBubble",
            torch_holds_sends=True,
        ),
        Schedule(
            "dualpipe",
            _dualpipe,
            _mirror_chunks,
            _mirror_holder,
            _dualpipe_peak,
            _dualpipe_bubble,
            copies=2,
            paired=True,
            even_pp=True,
            min_microbatches_per_rank=2,
            even_microbatches=True,
            leanness=4,
        ),
        Schedule(
            "dualpipev",
            _dualpipev,
            _v_chunks,
            _v_holder,
            _dualpipev_peak,
            _dualpipev_bubble,
            virtual_stages=2,
            paired=True,
            depth=2,
            even_pp=True,
            min_microbatches_per_rank=2,
            leanness=3,
            torch_class="ScheduleDualPipeV",
            torch_holds_sends=True,
        ),
    )
}
SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULES)
# What a layout that names no schedule runs: one copy of each stage, one chunk per rank.
DEFAULT_SCHEDULE = "1f1b"


# The recompute choices Megatron-LM refuses with its expert all-to-all overlap
# (transformer_config.py:3002-3071 at d98e8a64: no full recompute, no "moe" module).
EP_OVERLAP_FORBIDS = frozenset({"full", "moe"})


def ep_overlap_forbids(choice: frozenset[str] | str) -> bool:
    """Whether a block's recompute ``choice`` is one the all-to-all overlap refuses."""
    if isinstance(choice, str):
        return choice in EP_OVERLAP_FORBIDS
    return bool(choice & EP_OVERLAP_FORBIDS)


def schedule_of(name: str) -> Schedule:
    """The registry entry of ``name`` (a one-line error naming the known ones otherwise)."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise PlannerError(
            f"Layout.schedule={name!r}: use one of {', '.join(SCHEDULE_NAMES)}"
        ) from None
