"""The analytic step time and memory against the simulated executor.

Homogeneous stages (a Llama-3-8B-shaped model with a 256-token vocabulary, so the embedding
and head weigh almost nothing): step times agree within 2% and per-rank peaks are equal.
Heterogeneous stages (real vocabularies, DeepSeek-V3's dense first layers and MTP): the
simulator is the reference; the difference is printed and bounded.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import planner
from planner.layout import Layout
from planner.simulate import simulate

EVEN = planner.load_model("llama3-8b").model_copy(update={"vocab_size": 256})
H100 = planner.load_cluster("h100", gpus=64)

CASES = [
    ("gpipe", 4, 1, 16),
    ("1f1b", 4, 1, 16),
    ("1f1b", 8, 1, 8),
    ("1f1b", 8, 1, 32),
    ("zb-h1", 4, 1, 16),
    ("zb-h1", 8, 1, 16),
    ("interleaved", 4, 2, 16),
    ("interleaved", 8, 2, 16),
    ("dualpipe", 4, 1, 16),
    ("dualpipe", 8, 1, 32),
    ("dualpipev", 4, 2, 16),
    ("dualpipev", 8, 2, 32),
]


def run(
    model: planner.ModelSpec, cluster: planner.ClusterSpec, job: planner.TrainingJob, layout: Layout
) -> tuple[Any, Any]:
    return planner.evaluate(model, cluster, job, layout), simulate(model, cluster, job, layout)


@pytest.mark.parametrize(("schedule", "pp", "v", "m"), CASES)
def test_homogeneous_stages_agree(schedule: str, pp: int, v: int, m: int) -> None:
    dp = 64 // pp
    job = planner.TrainingJob(seq_len=4096, global_batch=m * dp)
    layout = Layout.uniform(
        EVEN,
        pp=pp,
        dp=dp,
        schedule=schedule,
        virtual_stages=v if v > 1 else None,  # type: ignore[arg-type]
        recompute="selective",
    )
    est, sim = run(EVEN, H100, job, layout)
    assert est.step_time_s == pytest.approx(sim.step_time_s, rel=0.02)
    assert [s.peak_bytes for s in est.memory] == sim.peak_bytes


def test_breakdown_sums_to_the_step_time() -> None:
    job = planner.TrainingJob(seq_len=4096, global_batch=128)
    layout = Layout.uniform(EVEN, pp=8, dp=8, schedule="zb-h1", recompute="full")
    est = planner.evaluate(EVEN, H100, job, layout)
    assert sum(est.breakdown.values()) == pytest.approx(est.step_time_s)
    assert est.breakdown["recompute"] > 0 and est.breakdown["bubble"] > 0


def test_deepseek_v3_on_2048_h800s() -> None:
    """Heterogeneous stages: embedding and dense layers first, MTP and head last."""
    model = planner.load_model("deepseek-v3")
    cluster = planner.load_cluster("h800", gpus=2048)
    job = planner.TrainingJob(
        seq_len=4096, global_batch=15360, moment_dtype="bf16", compute_dtype="fp8"
    )
    layout = Layout.uniform(model, pp=16, dp=128, ep=64, schedule="dualpipe", recompute="full")
    est, sim = run(model, cluster, job, layout)
    diff = est.step_time_s / sim.step_time_s - 1
    print(f"DeepSeek-V3 DualPipe: analytic {est.step_time_s:.2f} s, simulated", end=" ")
    print(f"{sim.step_time_s:.2f} s ({diff:+.1%})")
    assert abs(diff) < 0.05
    assert [s.peak_bytes for s in est.memory] == sim.peak_bytes


LAYOUTS = st.fixed_dictionaries(
    {
        "schedule": st.sampled_from(
            ["gpipe", "1f1b", "zb-h1", "interleaved", "dualpipe", "dualpipev"]
        ),
        "pp": st.sampled_from([2, 4]),
        "tp": st.sampled_from([1, 2]),
        "micro_batch": st.sampled_from([1, 2]),
        "rounds": st.integers(2, 4),
        "recompute": st.sampled_from(["none", "selective", "full", "mlp+layernorm"]),
        "zero": st.sampled_from([0, 1, 2, 3]),
        "model": st.sampled_from(["llama3-8b", "mixtral-8x7b"]),
    }
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(LAYOUTS)
def test_random_layouts_agree_with_the_simulator(case: dict[str, Any]) -> None:
    """Any layout: equal per-rank peaks, a simulated step no shorter than its busiest rank's
    work, and the analytic estimate within 8% of the simulator. Stages are heterogeneous
    here (embedding and head): over all 4,608 layouts of this space the mean difference is
    0.8% and the worst 7.0% (interleaved, ZeRO-3, two equally loaded end ranks)."""
    model = planner.load_model(case["model"]).model_copy(update={"num_layers": 16})
    pp, tp, schedule = case["pp"], case["tp"], case["schedule"]
    v = 2 if schedule in ("interleaved", "dualpipev") else 1
    dp = 16 // (pp * tp)
    ep = 2 if model.num_experts else 1
    m = 2 * pp * case["rounds"]  # valid for every schedule (even, >= 2pp, multiple of pp)
    cluster = planner.load_cluster("h100", gpus=16)
    job = planner.TrainingJob(seq_len=1024, global_batch=m * dp * case["micro_batch"])
    layout = Layout.uniform(
        model,
        pp=pp,
        tp=tp,
        dp=dp,
        ep=ep,
        zero=case["zero"],
        micro_batch=case["micro_batch"],
        schedule=schedule,
        virtual_stages=v if v > 1 else None,
        recompute=case["recompute"],
    )
    est, sim = run(model, cluster, job, layout)
    assert [s.peak_bytes for s in est.memory] == sim.peak_bytes
    assert sim.step_time_s >= max(sim.busy_s) - 1e-9
    assert sum(est.breakdown.values()) == pytest.approx(est.step_time_s)
    assert est.step_time_s == pytest.approx(sim.step_time_s, rel=0.08)


def test_ranks_that_drain_early_hide_their_gradient_reduction() -> None:
    """1F1B drains from the last rank to the first: a heavy last stage (here 8 of 15 layers)
    reduces its large gradients while earlier ranks still run backward. Slow InfiniBand makes
    the reduction long enough to show; the analytic estimate must credit that slack."""
    model = EVEN.model_copy(update={"num_layers": 15, "vocab_size": 128256})
    slow = H100.model_copy(update={"nic_Bps": H100.nic_Bps / 50})
    job = planner.TrainingJob(seq_len=4096, global_batch=64)
    layout = Layout.from_counts(model, counts=[1, 2, 4, 8], dp=16, zero=0, schedule="1f1b")
    est, sim = run(model, slow, job, layout)
    assert est.breakdown["grad_sync"] > 0.1 * est.step_time_s
    assert est.step_time_s == pytest.approx(sim.step_time_s, rel=0.01)
