"""The memory cap: usable HBM less the job's margin, stated once (``costs.memory``) and used
by ``Estimate.fits``; the expert load imbalance only where experts are split over ranks."""

from __future__ import annotations

import math

import pytest

import planner
from planner.costs.cap import memory_cap, usable_hbm, usable_peak_bytes
from planner.costs.memory import stage_memory

GiB = 2**30
H100 = planner.load_cluster("h100", gpus=8)
JOB = planner.TrainingJob(seq_len=2048, global_batch=8)


def test_memory_cap_arithmetic() -> None:
    """H100, default job: (79.15 GiB x 0.95 - 0.75 GiB of CUDA context) / 1.10 of
    fragmentation = 67.675 GiB of allocated bytes; the peak may reach 79.15 x 0.95 =
    75.1925 GiB."""
    assert JOB.memory_margin == 0.05
    assert JOB.cuda_context_bytes == 0.75 * GiB and JOB.fragmentation == 0.10
    usable = round(79.15 * GiB)
    assert usable_hbm(H100) == usable
    assert memory_cap(H100, JOB) == pytest.approx(67.675 * GiB, rel=1e-9)
    assert usable_peak_bytes(H100, JOB) == math.floor(usable * 0.95)
    # The allocated cap plus context and fragmentation is the peak cap.
    cap = memory_cap(H100, JOB)
    assert cap * 1.10 + JOB.cuda_context_bytes == pytest.approx(usable * 0.95, rel=1e-12)
    # Nothing held back: the cap is usable HBM itself.
    bare = JOB.model_copy(update={"memory_margin": 0.0, "fragmentation": 0.0})
    bare = bare.model_copy(update={"cuda_context_bytes": 0})
    assert memory_cap(H100, bare) == usable_peak_bytes(H100, bare) == usable


@pytest.mark.parametrize("margin", [-0.01, 0.5, 0.9])
def test_memory_margin_must_be_in_range(margin: float) -> None:
    with pytest.raises(planner.PlannerError, match=r"^TrainingJob.memory_margin="):
        planner.TrainingJob(seq_len=2048, global_batch=8, memory_margin=margin)


def test_a_peak_between_the_cap_and_usable_hbm_does_not_fit() -> None:
    """The cap, not usable HBM, decides: a peak 1 byte under usable HBM is over the cap."""
    model = planner.load_model("llama3-8b").model_copy(update={"num_layers": 4})
    layout = planner.Layout.uniform(model, dp=8)
    peak = planner.evaluate(model, H100, JOB, layout).peak_bytes
    fields = H100.model_dump()
    over = planner.ClusterSpec(**{**fields, "hbm_reserved_bytes": H100.hbm_bytes - peak - 1})
    est = planner.evaluate(model, over, JOB, layout)
    assert est.cap_bytes < est.peak_bytes < est.usable_hbm_bytes < est.hbm_bytes
    assert not est.fits
    assert 0 < est.headroom < JOB.memory_margin
    roomy = planner.ClusterSpec(
        **{**fields, "hbm_reserved_bytes": H100.hbm_bytes - math.ceil(peak / 0.95) - 1}
    )
    est = planner.evaluate(model, roomy, JOB, layout)
    assert est.peak_bytes <= est.cap_bytes and est.fits
    assert est.headroom == pytest.approx(1 - est.peak_bytes / est.usable_hbm_bytes)
    assert est.headroom >= JOB.memory_margin


def test_moe_load_imbalance_applies_only_across_expert_ranks() -> None:
    """With ep = 1 a rank holds every expert and receives exactly its tokens' copies; with
    ep > 1 the busiest rank receives moe_load_imbalance times the balanced share."""
    assert planner.TrainingJob(seq_len=1, global_batch=1).moe_load_imbalance == 1.04
    model = planner.load_model("mixtral-8x7b").model_copy(update={"num_layers": 2})
    balanced = JOB.model_copy(update={"moe_load_imbalance": 1.0})
    skewed = JOB.model_copy(update={"moe_load_imbalance": 1.5})

    def activations(job: planner.TrainingJob, ep: int) -> int:
        layout = planner.Layout.uniform(model, dp=2, ep=ep)
        return stage_memory(model, job, layout, num_microbatches=4)[0].buckets["activations"]

    assert activations(skewed, ep=1) == activations(balanced, ep=1)
    assert activations(skewed, ep=2) > activations(balanced, ep=2)
