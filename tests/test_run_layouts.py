"""Whole layouts run for real (``planner.run.execute``: one gloo process per rank) against
the cost model, and against each other: every layout trains the same model on the same
global batch, so the losses of every step must agree whatever the layout (pipeline
stages, data parallelism with ZeRO 0-3, expert parallelism)."""

from __future__ import annotations

import statistics

import pytest

torch = pytest.importorskip("torch")

from planner.cli import main  # noqa: E402
from planner.costs.memory import stage_memory  # noqa: E402
from planner.layout import Layout  # noqa: E402
from planner.run.execute import check_runnable, run_layout  # noqa: E402
from planner.run.model import loss_fn  # noqa: E402
from planner.run.track import Tracker  # noqa: E402
from planner.run.validate import small_job, small_model  # noqa: E402

MODEL, JOB = small_model(), small_job()
LAYOUTS = {
    "single": {},
    "pp2": {"pp": 2},
    "dp2-zero1": {"dp": 2, "zero": 1, "recompute": "moe"},
    "dp2-zero2": {"dp": 2, "zero": 2},
    "dp2-zero3": {"dp": 2, "zero": 3},
    "dp2-ep2": {"dp": 2, "ep": 2, "zero": 0},
}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[Layout, list]]:  # type: ignore[type-arg]
    out = {}
    for name, kw in LAYOUTS.items():
        layout = Layout.uniform(MODEL, micro_batch=1, **{"zero": 0, **kw})
        out[name] = (layout, run_layout(MODEL, JOB, layout, steps=1, warmup=1))
    return out


def _mean_losses(ranks: list) -> list[float]:  # type: ignore[type-arg]
    per_rank = [r.losses for r in ranks if r.losses]
    return [statistics.fmean(step) for step in zip(*per_rank, strict=True)]


@pytest.mark.slow
def test_every_layout_trains_the_same_model_the_same_way(runs) -> None:  # type: ignore[no-untyped-def]
    reference = _mean_losses(runs["single"][1])
    assert len(reference) == 2 and reference[1] < reference[0]  # it learns
    for name, (_, ranks) in runs.items():
        assert _mean_losses(ranks) == pytest.approx(reference, rel=2e-4), name


@pytest.mark.slow
def test_model_state_per_rank_matches_the_cost_model(runs) -> None:  # type: ignore[no-untyped-def]
    """Weights, gradients (sharded ones for ZeRO-2/3) and AdamW state, measured from the
    tensors each rank holds during the step, within 5% (ZeroRedundancyOptimizer shares
    whole tensors, so its split is uneven by a few percent)."""
    for name, (layout, ranks) in runs.items():
        m = check_runnable(MODEL, JOB, layout)
        predicted = stage_memory(MODEL, JOB, layout, num_microbatches=m, runtime="torch")
        for r in ranks:
            for bucket in ("weights", "grads", "optimizer"):
                expected = predicted[r.pp_rank].buckets[bucket]
                assert r.bucket_peaks[bucket] == pytest.approx(expected, rel=0.05), (name, bucket)


@pytest.mark.slow
def test_peak_per_rank_within_five_percent(runs) -> None:  # type: ignore[no-untyped-def]
    """Every rank's predicted peak is within 5% of the measured one, for the memory model
    of an eager PyTorch runtime (``runtime="torch"``)."""
    for name, (layout, ranks) in runs.items():
        m = check_runnable(MODEL, JOB, layout)
        predicted = stage_memory(MODEL, JOB, layout, num_microbatches=m, runtime="torch")
        for r in ranks:
            assert predicted[r.pp_rank].peak_bytes == pytest.approx(r.peak_bytes, rel=0.05), (
                name,
                r.rank,
            )


@pytest.mark.slow
def test_saved_activations_without_recompute(runs) -> None:  # type: ignore[no-untyped-def]
    layout, ranks = runs["single"]
    m = check_runnable(MODEL, JOB, layout)
    predicted = stage_memory(MODEL, JOB, layout, num_microbatches=m, runtime="torch")
    act = predicted[0].buckets["activations"]
    assert ranks[0].bucket_peaks["activations"] == pytest.approx(act, rel=0.05)


@pytest.mark.slow
def test_moe_recompute_saves_what_the_cost_model_says(runs) -> None:  # type: ignore[no-untyped-def]
    """With one micro-batch in flight, a recomputed MoE layer is rebuilt after the head and
    the later layers have freed their saved tensors, so recompute saves about a fifth; a
    model adding the rebuild on top of the whole level predicts no saving at all."""
    layout, ranks = runs["dp2-zero1"]
    m = check_runnable(MODEL, JOB, layout)
    predicted = stage_memory(MODEL, JOB, layout, num_microbatches=m, runtime="torch")
    for r in ranks:
        act = predicted[r.pp_rank].buckets["activations"]
        assert r.bucket_peaks["activations"] == pytest.approx(act, rel=0.05)


@pytest.mark.slow
def test_zero_stages_shard_as_stated(runs) -> None:  # type: ignore[no-untyped-def]
    full = runs["single"][1][0].bucket_peaks
    for name, sharded in (("dp2-zero1", {"optimizer"}), ("dp2-zero3", {"weights", "grads"})):
        for r in runs[name][1]:
            for bucket in sharded:
                assert r.bucket_peaks[bucket] < 0.55 * full[bucket], (name, bucket)


def test_fused_cross_entropy_matches_pytorch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    target = torch.randint(11, (2, 5))
    ours = loss_fn(logits.clone(), target)
    (g,) = torch.autograd.grad(ours, logits)
    ref = torch.nn.functional.cross_entropy(logits.view(-1, 11), target.view(-1))
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert float(ours.detach()) == pytest.approx(float(ref.detach()))
    assert torch.allclose(g, g_ref)


def test_tracker_follows_allocations_frees_and_buckets() -> None:
    tracker = Tracker()
    weight = torch.zeros(1000)
    tracker.claim("weights", weight)  # made before: followed once claimed
    with tracker:
        tracker.reset_peak()
        with torch.no_grad():
            a = torch.ones(2000)  # made with gradients off: other
        b = torch.ones(500) * 2  # a temporary and the product, made with gradients on
        view = a[:10]  # a view: no new bytes
        del a, view  # frees a
        c = torch.ones(100)
    assert tracker.peak == 4 * (1000 + 2000 + 500 + 500)  # during the product
    assert tracker.peak_buckets() == {
        "weights": 4000,
        "grads": 0,
        "optimizer": 0,
        "activations": 4000,
        "other": 8000,
    }
    assert tracker.total == 4 * (1000 + 500 + 100)
    tracker.claim("grads", c)
    assert tracker.current_buckets()["grads"] == 400
    del b, c, weight
    assert tracker.total == 0


def test_validate_rejects_bad_case_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--only", "42"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("planner: --only=42") and "\n" not in err
