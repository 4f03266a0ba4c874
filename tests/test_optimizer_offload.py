"""Optimizer state offloaded to the host (``Layout.optimizer_offload``).

What each framework keeps and moves per offloaded element (the expected values below):
- Megatron-LM's HybridDeviceOptimizer (megatron/core/optimizer/cpu_offloading/
  hybrid_optimizer.py, NVIDIA/Megatron-LM d98e8a64): the host holds an FP32 master copy, an
  FP32 copy of the gradient and torch.optim.AdamW's two FP32 moments: 16 bytes; the gradient
  comes over as FP32 and the FP32 master goes back: 4 bytes each way. It offloads through
  the distributed optimizer (--use-precision-aware-optimizer needs it), so ZeRO-1 only.
- DeepSpeed ZeRO-Offload (deepspeed/runtime/zero/stage_1_and_2.py, deepspeedai/DeepSpeed
  edaa7221): FP32 master and moments, the FP32 gradient partition and a 16-bit copy of the
  updated weights: 18 bytes; FP32 gradients down, 16-bit weights up (2 bytes); all or none.
"""

from __future__ import annotations

import json

import pytest

import planner
from planner.costs.memory import StageMemory, stage_memory
from planner.costs.timing import StepRates, optimizer_time
from planner.errors import PlannerError
from planner.solve.result import Plan

MODEL = planner.load_model("llama3-8b").model_copy(update={"num_layers": 4})
CLUSTER = planner.load_cluster("h100", gpus=8)
JOB = planner.TrainingJob(seq_len=2048, global_batch=8)


def memory(fraction: float, framework: str = "megatron", **kw: object) -> StageMemory:
    job = JOB.model_copy(update={"framework": framework})
    layout = planner.Layout.uniform(MODEL, tp=8, dp=1, optimizer_offload=fraction, **kw)  # type: ignore[arg-type]
    return stage_memory(MODEL, job, layout, num_microbatches=1)[0]


@pytest.mark.parametrize(
    ("framework", "host_b", "h2d_b"), [("megatron", 16, 4), ("deepspeed", 18, 2)]
)
def test_the_host_holds_and_the_links_carry_what_the_framework_keeps(
    framework: str, host_b: int, h2d_b: int
) -> None:
    whole, moved = memory(0.0, framework), memory(1.0, framework)
    n = whole.params  # dp = 1: the rank steps every parameter it holds
    assert moved.host_bytes == pytest.approx(host_b * n, rel=1e-9)
    assert moved.step_bytes["step_d2h"] == pytest.approx(4 * n, rel=1e-9)
    assert moved.step_bytes["step_h2d"] == pytest.approx(h2d_b * n, rel=1e-9)
    # host memory per element: the gradient read, FP32 master and moments read and written
    # (2 x 12 B), DeepSpeed's 16-bit weight copy written (2 B), the two copies' own bytes
    assert moved.step_bytes["step_host"] == pytest.approx((4 + 24 + host_b - 16 + 4 + h2d_b) * n)
    assert moved.buckets["optimizer"] == 0 and whole.buckets["optimizer"] == 12 * n
    for bucket in ("weights", "grads", "activations"):  # the GPU keeps its working copies
        assert moved.buckets[bucket] == whole.buckets[bucket]
    assert whole.host_bytes == 0 and whole.step_bytes["step_host"] == 0


def test_a_fraction_moves_that_share_of_the_state() -> None:
    whole, half = memory(0.0), memory(0.5)
    assert half.buckets["optimizer"] == pytest.approx(whole.buckets["optimizer"] / 2, abs=1)
    assert half.host_bytes == pytest.approx(memory(1.0).host_bytes / 2, abs=1)


def test_the_host_step_is_the_slowest_of_its_pipeline() -> None:
    """Megatron-LM with --overlap-cpu-optimizer-d2h-h2d pipelines the copies and the host
    step per tensor: the slowest of the three. Here the host's memory binds: the step reads
    the gradient copy (4 B), reads and writes master and moments (2 x 12 B), and the two
    copies land in and leave host memory (4 + 4 B): 36 B per element, at the GPU's share of
    the node's host memory bandwidth (563.2 GB/s over 8 GPUs, at the catalog's 0.5)."""
    whole, moved = memory(0.0), memory(1.0)
    n = whole.params
    host_rate = 563.2e9 / 8 * 0.5
    pcie = 64e9 * 0.86
    assert 36 * n / host_rate > 4 * n / pcie  # the host binds, not PCIe
    rates = StepRates.of(CLUSTER)
    gpu_before = whole.step_bytes["step_hbm"] / rates.hbm
    # the GPU no longer steps the state: only its gradient reads and weight writes go too
    gpu_after = moved.step_bytes["step_hbm"] / rates.hbm
    assert gpu_after == pytest.approx(0.0, abs=1e-12)
    assert optimizer_time(moved, CLUSTER) == pytest.approx(36 * n / host_rate, rel=1e-6)
    assert optimizer_time(whole, CLUSTER) == pytest.approx(gpu_before, rel=1e-12)


@pytest.mark.parametrize(
    ("framework", "fraction", "zero", "words"),
    [
        ("torchtitan", 1.0, 1, "framework 'torchtitan' has no optimizer-only offload"),
        ("megatron", 1.0, 2, "Megatron-LM offloads through its distributed optimizer"),
        ("deepspeed", 0.5, 1, "DeepSpeed offloads all of the optimizer state or none"),
    ],
)
def test_what_a_framework_cannot_offload_is_one_line(
    framework: str, fraction: float, zero: int, words: str
) -> None:
    with pytest.raises(PlannerError) as err:
        memory(fraction, framework, zero=zero)
    text = str(err.value)
    assert text.startswith(f"Layout.optimizer_offload={fraction:g}: ") and words in text
    assert "\n" not in text


def test_a_fraction_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(PlannerError, match=r"SearchSpace.optimizer_offload=\[1.5\]"):
        planner.SearchSpace(optimizer_offload=[1.5])
    with pytest.raises(PlannerError, match=r"^Layout.optimizer_offload=-0.1: "):
        planner.Layout.uniform(MODEL, tp=8, optimizer_offload=-0.1)


def test_a_cluster_without_host_bandwidth_cannot_offload() -> None:
    bare = CLUSTER.model_copy(update={"host_memory_Bps": None})
    with pytest.raises(PlannerError, match=r"^ClusterSpec.host_memory_Bps=None: "):
        optimizer_time(memory(1.0), bare)


def test_offload_makes_a_job_fit_that_did_not_and_the_plan_says_so() -> None:
    """Llama 3 8B on one H100 needs 18 bytes a parameter for weights, gradients and
    optimizer state (144 GB) before any activation; without the 12 optimizer bytes it fits."""
    model = planner.load_model("llama3-8b")
    one = planner.load_cluster("h100", gpus=1)
    job = planner.TrainingJob(seq_len=2048, global_batch=4)
    space = planner.SearchSpace(micro_batch=[1], recompute=["full"])
    assert planner.plan(model, one, job, space, time_limit_s=2).layout is None
    offload = space.model_copy(update={"optimizer_offload": [0, 1]})
    found = planner.plan(model, one, job, offload, time_limit_s=2)
    assert found.layout is not None and found.estimate is not None
    assert found.layout.optimizer_offload == 1 and found.estimate.fits
    again = planner.evaluate(model, one, job, found.layout)
    assert again.step_time_s == pytest.approx(found.estimate.step_time_s, rel=1e-9)


def _exported(target: str, fraction: float, framework: str | None = None) -> planner.export.Export:
    job = JOB.model_copy(update={"framework": framework or target})
    layout = planner.Layout.uniform(MODEL, tp=8, dp=1, optimizer_offload=fraction)
    estimate = planner.evaluate(MODEL, CLUSTER, job, layout)
    plan = Plan(
        status="feasible",
        layout=layout,
        estimate=estimate,
        solve_time_s=0.0,
        model=MODEL,
        cluster=CLUSTER,
        job=job,
    )
    return getattr(planner.export, target)(plan)


def test_each_launcher_states_the_offload_in_its_own_terms() -> None:
    """Megatron-LM's flags (arguments.py at d98e8a64; each in its parser's list, which
    tests/test_export.py checks for every export); DeepSpeed's offload_optimizer block
    (deepspeed/runtime/zero/offload_config.py); torchtitan has no optimizer-only offload."""
    args = _exported("megatron", 0.5).files["megatron.sh"].split()
    for flag in ("--optimizer-cpu-offload", "--use-precision-aware-optimizer"):
        assert flag in args
    assert args[args.index("--optimizer-offload-fraction") + 1] == "0.5"
    assert "--overlap-cpu-optimizer-d2h-h2d" in args  # the overlap the time model assumes
    config = json.loads(_exported("deepspeed", 1.0).files["ds_config.json"])
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    titan = _exported("torchtitan", 1.0, framework="megatron")  # planned for Megatron-LM
    assert titan.layout.optimizer_offload == 0
    assert any(d.startswith("optimizer offload: torchtitan has none") for d in titan.differences)
