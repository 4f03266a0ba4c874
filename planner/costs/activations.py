"""A rank's saved activations, in bytes: the levels its op order passes through, what a
recomputing backward rebuilds above them, and what goes to the host.

Each forward adds its chunk's saved bytes for one micro-batch and the backward that consumes
them removes them; while a backward runs, the block it recomputes holds its rebuilt tensors
too. Activation offload (Megatron-LM's layer and fine-grained offload) keeps a block's saved
tensors on the host instead.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from planner.costs.blocks import OFFLOAD, OFFLOAD_TAG, BlockCost, Shard
from planner.costs.state import shards
from planner.frameworks import framework, names_with
from planner.layout import Layout
from planner.schedules import memory_order, op_order, steady_lengths
from planner.specs import DTYPE_BYTES, ModelSpec, TrainingJob


def activation_peak(
    layout: Layout,
    rank: int,
    num_microbatches: int,
    per_chunk: dict[int, float],
    rebuild: dict[int, float],
    kept: tuple[dict[int, float], dict[int, float]] | None = None,
) -> float:
    """Highest activation level on ``rank`` as its op order runs: each forward adds its
    chunk's saved bytes for one micro-batch and the backward that consumes them (the
    weight-gradient op when the schedule splits it off) removes them; while a backward runs,
    the block it recomputes holds its rebuilt tensors too (``rebuild``: see ``rebuild_peak``).
    ``kept``: bytes each forward and each backward of a chunk leave until the step ends
    (tensors a runtime holds on to, see ``stage_memory``). ``schedules.in_flight`` gives the
    same counts in closed form where chunks save equal bytes and nothing is kept.

    The level at any point of the order is a sum over chunks of counts times those bytes;
    ``level_points`` lists the counts at the points that can be highest, once per schedule
    shape, so each call costs the points, not the order's length."""
    return max(activation_peaks(layout, rank, num_microbatches, per_chunk, rebuild, kept))


def activation_peaks(
    layout: Layout,
    rank: int,
    num_microbatches: int,
    per_chunk: dict[int, float],
    rebuild: dict[int, float],
    kept: tuple[dict[int, float], dict[int, float]] | None = None,
) -> tuple[float, float]:
    """``activation_peak`` in two parts: the highest level before the rank's first backward
    is done (its rebuild included), and the highest from then on. A runtime that frees the
    gradients after each step makes them during that first backward, so only the second
    part is reached with them allocated (``costs.memory``)."""
    after_forward, after_backward = kept or ({}, {})
    lengths = long_step(layout.pp, layout.virtual_stages, num_microbatches)
    if lengths and not any(after_forward.values()) and not any(after_backward.values()):
        # A long step's level at its highest points is that of a shorter step's, or grows by
        # the same bytes per micro-batch (every micro-batch in flight, as GPipe holds them).
        a, b = (activation_peaks(layout, rank, n, per_chunk, rebuild) for n in lengths)
        first, rest = (extended(x, y, lengths, num_microbatches) for x, y in zip(a, b, strict=True))
        return first, rest
    first = rest = 0.0
    points = level_points(layout.schedule, layout.pp, num_microbatches, layout.virtual_stages, rank)
    for flight, rebuilt, forwards, backwards in points:
        level = sum(n * per_chunk[c] for c, n in flight)
        level += sum(n * after_forward.get(c, 0.0) for c, n in forwards)
        level += sum(n * after_backward.get(c, 0.0) for c, n in backwards)
        if rebuilt >= 0:
            level += rebuild[rebuilt]
        if backwards:
            rest = max(rest, level)
        else:
            first = max(first, level)
    return first, rest


# Beyond this many micro-batches, a step's timeline (``estimate.extended_run``) and its
# activation peaks are worked out at two shorter lengths (``schedules.steady_lengths``) and
# extended: exact to rounding (tests/test_timeline.py). A step of 100,000 micro-batches then
# costs as one of a few hundred.
LONG_STEP = 4096


def long_step(pp: int, virtual_stages: int, num_microbatches: int) -> tuple[int, int] | None:
    """The two lengths a step of ``num_microbatches`` is worked out at, or None where it is
    run whole: up to ``LONG_STEP`` micro-batches, or on a pipeline too deep for both lengths
    to be shorter."""
    lengths = steady_lengths(pp, virtual_stages)
    if num_microbatches <= LONG_STEP or lengths[1] > LONG_STEP:
        return None
    return lengths


def extended(a: float, b: float, lengths: tuple[int, int], num_microbatches: int) -> float:
    """What a step of ``num_microbatches`` costs, from ``a`` and ``b`` at ``lengths``: the
    same amount more per micro-batch past the longer."""
    shorter, longer = lengths
    return b + (b - a) * (num_microbatches - longer) / (longer - shorter)


Counts = tuple[tuple[int, int], ...]  # (chunk, count) pairs, by chunk


@functools.lru_cache(maxsize=1024)
def level_points(
    schedule: str, pp: int, num_microbatches: int, virtual_stages: int, rank: int
) -> tuple[tuple[Counts, int, Counts, Counts], ...]:
    """The points of ``rank``'s op order where its activation level can peak, as counts:
    (micro-batches in flight per chunk, the chunk whose backward is rebuilding or -1,
    forwards done per chunk, backwards done per chunk); the level there is each count times
    the chunk's bytes (``activation_peak``). Points after a forward and after a backward,
    and at each backward's start with its rebuild. Bytes are never negative, so of two
    points with the same in-flight counts and rebuild the later one is at least as high
    (the done counts only grow): only the last of each is kept."""
    order = memory_order(
        schedule,
        op_order(
            schedule,
            pp=pp,
            num_microbatches=num_microbatches,
            rank=rank,
            virtual_stages=virtual_stages,
        ),
    )
    chunks = sorted({op.stage for op in order})
    at = {c: i for i, c in enumerate(chunks)}
    flight = [0] * len(chunks)
    forwards = [0] * len(chunks)
    backwards = [0] * len(chunks)
    last: dict[tuple[tuple[int, ...], int], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for op in order:
        i = at[op.stage]
        if op.kind == "F":
            flight[i] += 1
            forwards[i] += 1
            last[(tuple(flight), -1)] = (tuple(forwards), tuple(backwards))
        if op.kind in ("B", "BW"):
            last[(tuple(flight), op.stage)] = (tuple(forwards), tuple(backwards))
        if op.kind in ("BW", "W"):
            flight[i] -= 1
        if op.kind in ("B", "BW"):
            backwards[i] += 1
            last[(tuple(flight), -1)] = (tuple(forwards), tuple(backwards))

    def pairs(counts: tuple[int, ...]) -> Counts:
        return tuple((c, n) for c, n in zip(chunks, counts, strict=True) if n)

    return tuple(
        (pairs(flight_), rebuilt, pairs(f), pairs(b)) for (flight_, rebuilt), (f, b) in last.items()
    )


Level = tuple[tuple[int, ...], int | None]  # micro-batches in flight per chunk, rebuilding chunk


def activation_levels(
    schedule: str,
    pp: int,
    num_microbatches: int,
    virtual_stages: int,
    rank: int,
    chunks: Sequence[int],
) -> list[Level]:
    """The levels of ``rank``'s op order that can be its highest, each as micro-batches in
    flight per chunk (in the order of ``chunks``) and the chunk whose backward is rebuilding
    then (None: none): the points of ``level_points`` without those another implies (one
    with as many of every chunk and the same rebuild, or for a level without a rebuild, any
    rebuild), whatever each chunk's bytes. The solver states its memory over these."""
    at = {c: i for i, c in enumerate(chunks)}
    seen: set[Level] = set()
    for flight, rebuilt, _, _ in level_points(schedule, pp, num_microbatches, virtual_stages, rank):
        counts = [0] * len(chunks)
        for c, n in flight:
            counts[at[c]] = n
        seen.add((tuple(counts), None if rebuilt < 0 else rebuilt))
    keep: list[Level] = []
    # Largest first: a level can only be implied by one at least as large in total.
    for x in sorted(seen, key=lambda x: (-sum(x[0]), x[1] is None, x)):
        implied = any(
            (x[1] is None or y[1] == x[1]) and all(a >= b for a, b in zip(y[0], x[0], strict=True))
            for y in keep
        )
        if not implied:
            keep.append(x)
    return sorted(keep, key=lambda x: (x[0], -1 if x[1] is None else x[1]))


def rebuild_peak(
    blocks: Sequence[tuple[BlockCost, frozenset[str] | str]], kept: float = 0.0
) -> float:
    """Most bytes a chunk's backward holds above its saved level for one micro-batch, from
    recomputation: backward runs the chunk's blocks last to first, each freeing its saved
    tensors when done, so when block k rebuilds, the blocks after it have already freed
    theirs: max over k of (rebuilt(k) - saved by the blocks after k), and never below 0.
    (Measured with real runs: a head's saved logits, freed before the last layer rebuilds,
    hide that layer's rebuild entirely.) ``kept``: bytes of the last block's saved tensors
    that stay until the chunk's whole backward is done (a stage output the runtime holds)."""
    peak, after = 0.0, 0.0
    for cost, choice in reversed(blocks):
        peak = max(peak, cost.rebuilt_bytes(choice) - after)
        after += cost.saved_bytes(choice) - kept
        kept = 0.0
    return peak


def first_backward_peak(
    blocks: Sequence[tuple[BlockCost, frozenset[str] | str]],
    grads: Sequence[float],
    kept: float = 0.0,
) -> tuple[float, float]:
    """A chunk's backward as the step's first, when the runtime makes the gradients there
    (they were freed after the last step): its highest level relative to its saved level,
    and the gradient bytes made by then. Block k's gradients (``grads``, in block order) are
    made at the end of its backward, once its rebuilt tensors are gone: while block k runs,
    the blocks after it have freed their saved tensors (``rebuild_peak``) and made theirs;
    the walk ends with the chunk's saved tensors all freed and every gradient made."""
    peak, at_peak, made, after = -math.inf, 0.0, 0.0, 0.0
    for (cost, choice), g in zip(reversed(blocks), reversed(grads), strict=True):
        level = cost.rebuilt_bytes(choice) - after + made
        if level > peak:
            peak, at_peak = level, made
        after += cost.saved_bytes(choice) - kept
        kept = 0.0
        made += g
    if made - after > peak:
        peak, at_peak = made - after, made
    return peak, at_peak


def backward_temporaries(
    cost: BlockCost, job: TrainingJob, layout: Layout, shard: Shard, model: ModelSpec
) -> float:
    """What an eager PyTorch backward of the block holds besides saved tensors: the gradient
    flowing back (one micro-batch's hidden states) and, below ZeRO-2, one parameter's fresh
    gradient before it is added into the accumulated one (its largest); ZeRO-2/3 count fresh
    gradients as their reduce bucket. Megatron-LM's fused weight-gradient accumulation and
    in-place gradient buffers avoid most of both, so the default runtime leaves them out."""
    flowing = shard.sp_tokens * model.hidden_size * shard.act_bytes
    if layout.zero >= 2:
        return flowing
    fresh = max((p.numel / shards(p, layout) for p in cost.params if p.trainable), default=0.0)
    return flowing + fresh * DTYPE_BYTES[job.grad_dtype]


def offloaded_blocks(layout: Layout) -> list[str]:
    """The blocks whose activations go to the host whole (``recompute="offload"``)."""
    return [b.block for s in layout.stages for b in s.blocks if b.recompute == OFFLOAD]


def offloads_activations(layout: Layout) -> bool:
    """Whether any block sends activations to the host (layer or fine-grained offload)."""
    return any(OFFLOAD in b.recompute for s in layout.stages for b in s.blocks)


def activation_offload_rule(model: ModelSpec, job: TrainingJob, layout: Layout) -> str:
    """Why the layout's activation offload cannot run, or "" (also when it has none). As
    Megatron-LM runs it (--cpu-offloading-num-layers N; megatron/core/transformer/
    transformer_config.py at d98e8a64): Transformer Engine's CPU offload of the first N
    transformer layers, N below the layer count, without pipeline parallelism and without
    activation recompute anywhere."""
    fine = any(OFFLOAD_TAG in b.recompute for s in layout.stages for b in s.blocks)
    offloaded = offloaded_blocks(layout)
    able = framework(job.framework).activation_offload
    where = names_with(lambda f: f.activation_offload)
    if fine and not able:
        return f"fine-grained activation offload runs under {where} only, not {job.framework!r}"
    if fine and offloaded:
        return (
            "Megatron-LM runs fine-grained (offload:<module>) and layer offload (offload) "
            "one at a time"
        )
    if not offloaded:
        return ""
    if not able:
        return f"activation offload runs under {where} only, not {job.framework!r}"
    if layout.pp > 1 or layout.virtual_stages > 1:
        return (
            "Megatron-LM offloads activations without pipeline parallelism only "
            f"(pp={layout.pp}, virtual_stages={layout.virtual_stages})"
        )
    if any(not name.startswith("layer.") for name in offloaded):
        return "only transformer layers offload their activations"
    others = {b.recompute for s in layout.stages for b in s.blocks} - {OFFLOAD, "none"}
    if others:
        return f"Megatron-LM offloads with no activation recompute, not with {sorted(others)}"
    if len(offloaded) >= model.num_layers:
        return (
            f"{len(offloaded)} of {model.num_layers} layers offloaded: Megatron-LM keeps at "
            "least one in HBM"
        )
    return ""
