"""Properties of the memory model over random layouts (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import planner
from planner.costs.activations import rebuild_peak
from planner.costs.blocks import BlockCost
from planner.costs.memory import BUCKETS, block_costs, reduce_bucket_bytes, shard_of
from planner.layout import parse_recompute

MODELS = {n: planner.load_model(n) for n in ("llama3-8b", "mixtral-8x7b", "deepseek-v2")}
RECOMPUTE_ORDER = ["none", "selective", "full"]


@st.composite
def cases(draw: st.DrawFn) -> tuple[planner.ModelSpec, planner.Layout, planner.TrainingJob]:
    model = MODELS[draw(st.sampled_from(sorted(MODELS)))]
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 4]))
    dp = draw(st.sampled_from([1, 2, 4, 8]))
    eps = [e for e in (1, 2, 4, 8) if (dp * tp) % e == 0 and (model.num_experts or 8) % e == 0]
    ep = draw(st.sampled_from(eps)) if model.num_experts else 1
    schedule = draw(st.sampled_from(["1f1b", "gpipe", "zb-h1", "interleaved"]))
    layout = planner.Layout.uniform(
        model,
        pp=pp,
        tp=tp,
        dp=dp,
        ep=ep,
        zero=draw(st.sampled_from([0, 1, 2, 3])),
        micro_batch=draw(st.sampled_from([1, 2])),
        schedule=schedule,
        recompute=draw(st.sampled_from(RECOMPUTE_ORDER)),
    )
    job = planner.TrainingJob(
        seq_len=draw(st.sampled_from([1024, 4096])),
        global_batch=dp * 2 * draw(st.sampled_from([4, 8])),
        ema=draw(st.sampled_from([None, "fp32"])),
    )
    return model, layout, job


def evaluate(model: planner.ModelSpec, layout: planner.Layout, job: planner.TrainingJob):  # type: ignore[no-untyped-def]
    cluster = planner.load_cluster("h100", gpus=layout.world_size)
    return planner.evaluate(model, cluster, job, layout)


@settings(max_examples=40, deadline=None)
@given(cases())
def test_buckets_add_up_and_are_non_negative(case) -> None:  # type: ignore[no-untyped-def]
    est = evaluate(*case)
    for rank in est.memory:
        assert set(rank.buckets) == set(BUCKETS)
        assert all(v >= 0 for v in rank.buckets.values())
        assert sum(rank.buckets.values()) == rank.peak_bytes
    assert est.peak_bytes == max(r.peak_bytes for r in est.memory)


@settings(max_examples=30, deadline=None)
@given(cases())
def test_more_recompute_never_keeps_more(case) -> None:  # type: ignore[no-untyped-def]
    model, layout, job = case
    saved = []
    for choice in RECOMPUTE_ORDER:
        relaid = planner.Layout.uniform(
            model, **_degrees(layout), recompute=choice, schedule=layout.schedule
        )
        saved.append([r.buckets["activations"] for r in evaluate(model, relaid, job).memory])
    for less, more in itertools.pairwise(saved):
        assert all(b <= a for a, b in zip(less, more, strict=True))


@settings(max_examples=30, deadline=None)
@given(cases())
def test_higher_zero_stage_never_uses_more(case) -> None:  # type: ignore[no-untyped-def]
    """ZeRO-1 never uses more than ZeRO-0; ZeRO-2 never more than ZeRO-1 beyond its reduce
    bucket (the whole gradients of one block before they are reduce-scattered), which it
    repays once the sharded gradients save more than a block's."""
    model, layout, job = case
    peaks = []
    for zero in (0, 1, 2):  # ZeRO-3 trades state for gather buffers; compared separately
        relaid = layout.model_copy(update={"zero": zero})
        peaks.append([r.peak_bytes for r in evaluate(model, relaid, job).memory])
    bucket = reduce_bucket_bytes(model, job, layout.model_copy(update={"zero": 2}))
    allowance = (1 + job.fragmentation) * bucket + 1
    assert all(h <= lo for lo, h in zip(peaks[0], peaks[1], strict=True))
    assert all(h <= lo + allowance for lo, h in zip(peaks[1], peaks[2], strict=True))


@settings(max_examples=30, deadline=None)
@given(cases())
def test_memory_grows_with_micro_batch(case) -> None:  # type: ignore[no-untyped-def]
    model, layout, job = case
    small = layout.model_copy(update={"micro_batch": 1})
    big = layout.model_copy(update={"micro_batch": 2})
    a = [r.buckets["activations"] for r in evaluate(model, small, job).memory]
    b = [r.buckets["activations"] for r in evaluate(model, big, job).memory]
    # Twice the tokens per micro-batch, half the micro-batches: in-flight counts may fall,
    # but never below what one micro-batch of twice the size holds. Each saved group is
    # whole bytes, and with a fractional expert load imbalance (1.04 by default) its exact
    # size is not: a byte per group and micro-batch in flight may round either way.
    costs = block_costs(model, small, shard_of(job, small))
    slack = sum(len(c.saved) for c in costs.values()) * job.global_batch  # bytes
    assert all(y >= x - slack for x, y in zip(a, b, strict=True))


def _degrees(layout: planner.Layout) -> dict[str, int]:
    return {
        "pp": layout.pp,
        "tp": layout.tp,
        "dp": layout.dp,
        "ep": layout.ep,
        "zero": layout.zero,
        "micro_batch": layout.micro_batch,
    }


def _mixtral_blocks(layout: planner.Layout) -> dict[str, BlockCost]:
    model = MODELS["mixtral-8x7b"]
    job = planner.TrainingJob(seq_len=4096, global_batch=8)
    return block_costs(model, layout, shard_of(job, layout))


def test_a_rebuild_is_counted_above_what_is_still_saved() -> None:
    """Backward runs a chunk's blocks last to first: when a layer rebuilds its MoE, the head
    after it has freed its logits; when the recomputed layer is the chunk's last block,
    nothing has been freed yet."""
    layout = planner.Layout.uniform(MODELS["mixtral-8x7b"], pp=1)
    costs = _mixtral_blocks(layout)
    layer, head = costs["layer.31"], costs["head"]
    moe = frozenset({"moe"})
    rebuilt, head_saved = layer.rebuilt_bytes(moe), head.saved_bytes()
    assert rebuilt > 0 and head_saved > 0
    assert rebuild_peak([(layer, moe)]) == rebuilt
    # The head's own moment (its BF16 logits beside the loss's FP32 softmax) comes first.
    logit_elements = 4096 * MODELS["mixtral-8x7b"].vocab_size
    assert head.transient == logit_elements * 2  # BF16 logits beside the FP32 softmax
    both = [(layer, moe), (head, frozenset())]
    assert rebuild_peak(both) == max(head.transient, rebuilt - head_saved)
    logits = sum(g.bytes for g in head.saved if g.name == "logits")
    held = rebuild_peak(both, kept=logits)
    assert held == max(head.transient, rebuilt - (head_saved - logits))
    # Full recompute of two layers: the first rebuilds after the second freed what it kept.
    first, second = costs["layer.0"], costs["layer.1"]
    full = [(first, "full"), (second, "full")]
    expected = max(
        second.rebuilt_bytes("full"), first.rebuilt_bytes("full") - second.saved_bytes("full")
    )
    assert rebuild_peak(full) == expected


@given(cases())
@settings(max_examples=40, deadline=None)
def test_rebuild_never_exceeds_the_largest_rebuilt_block(case) -> None:  # type: ignore[no-untyped-def]
    model, layout, job = case
    costs = block_costs(model, layout, shard_of(job, layout))
    for stage in layout.stages:
        blocks = [(costs[b.block], parse_recompute(b.recompute)) for b in stage.blocks]
        peak = rebuild_peak(blocks)
        assert 0 <= peak <= max(c.rebuilt_bytes(ch) for c, ch in blocks)
        assert peak >= blocks[-1][0].rebuilt_bytes(blocks[-1][1])


def walked_peak(
    schedule: str,
    pp: int,
    m: int,
    v: int,
    rank: int,
    saved: dict[int, float],
    rebuild: dict[int, float],
    kept: tuple[dict[int, float], dict[int, float]],
) -> float:
    """The activation peak by walking the rank's whole op order, op by op (what
    ``activation_peak`` gets from the few points ``level_points`` keeps)."""
    from planner.schedules import op_order

    after_forward, after_backward = kept
    level = peak = 0.0
    for op in op_order(schedule, pp=pp, num_microbatches=m, rank=rank, virtual_stages=v):
        if op.kind == "F":
            level += saved[op.stage] + after_forward.get(op.stage, 0.0)
            peak = max(peak, level)
        if op.kind in ("B", "BW"):
            peak = max(peak, level + rebuild[op.stage])
        if op.kind in ("BW", "W"):
            level -= saved[op.stage]
        if op.kind in ("B", "BW"):
            level += after_backward.get(op.stage, 0.0)
            peak = max(peak, level)
    return peak


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(
        [
            ("gpipe", 1),
            ("1f1b", 1),
            ("zb-h1", 1),
            ("interleaved", 2),
            ("interleaved", 3),
            ("dualpipev", 2),
            ("dualpipe", 1),
        ]
    ),
    st.sampled_from([2, 4, 6]),
    st.integers(1, 4),
    st.data(),
)
def test_the_kept_points_give_the_walked_peak(schedule_v, pp, mult, data) -> None:  # type: ignore[no-untyped-def]
    """Whatever bytes each chunk saves, rebuilds and keeps, the peak over the points kept
    once per schedule shape is the peak of walking the whole order."""
    from planner.costs.activations import activation_peak

    schedule, v = schedule_v
    m = 2 * pp * mult
    chunks = range(2 * pp if schedule == "dualpipev" else pp * v)
    byte = st.floats(0, 1e9, allow_nan=False)
    saved = {c: data.draw(byte) for c in chunks}
    rebuild = {c: data.draw(byte) for c in chunks}
    kept = ({c: data.draw(byte) for c in chunks}, {c: data.draw(byte) for c in chunks})
    model = MODELS["llama3-8b"]
    layout = planner.Layout.uniform(model, pp=pp, schedule=schedule, virtual_stages=v)
    rank = data.draw(st.integers(0, pp - 1))
    want = walked_peak(schedule, pp, m, v, rank, saved, rebuild, kept)
    got = activation_peak(layout, rank, m, saved, rebuild, kept)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-3)
