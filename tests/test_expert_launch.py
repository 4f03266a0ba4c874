"""Routed experts whose GEMMs the framework launches one by one
(``Framework.expert_gemm_launch_s``): the launches are counted from the model's shapes and
each costs its host time in series with the step."""

from __future__ import annotations

import pytest
from test_export import plan_of

import planner
from planner import frameworks
from planner.costs.blocks import Shard, block_cost


def launching(seconds: float):
    """Megatron-LM with ``seconds`` per expert GEMM launch, while the block runs."""
    return frameworks.replaced("megatron", expert_gemm_launch_s=seconds)


@pytest.mark.parametrize(
    ("name", "ep", "etp", "local"),
    [
        ("mixtral-8x7b", 1, 1, 8),  # 8 experts (config.json num_local_experts)
        ("mixtral-8x7b", 4, 1, 2),
        ("qwen2-57b-a14b", 4, 4, 16),  # 64 experts (config.json num_experts)
        ("deepseek-v3", 8, 1, 32),  # 256 routed experts (config.json n_routed_experts)
    ],
)
def test_two_expert_gemms_per_local_expert_per_phase(name, ep, etp, local):
    # fc1 (gate and up fused) and fc2 forward; each one's input and weight gradient backward
    model = planner.load_model(name)
    index = next(i for i in range(model.num_layers) if model.is_moe_layer(i))
    cost = block_cost(model, f"layer.{index}", Shard(seq_len=4096, tp=etp, ep=ep, etp=etp))
    assert cost.fwd.expert_gemms == pytest.approx(2 * local)
    assert cost.bwd_input.expert_gemms == pytest.approx(2 * local)
    assert cost.bwd_weight.expert_gemms == pytest.approx(2 * local)


def test_dense_layers_launch_no_expert_gemms():
    model = planner.load_model("llama3-8b")
    cost = block_cost(model, "layer.0", Shard(seq_len=4096))
    assert cost.fwd.expert_gemms == cost.bwd_input.expert_gemms == 0


def _mixtral_step(recompute: str) -> float:
    # One GPU, nothing to communicate: the step is its micro-batches' compute in series.
    model = planner.load_model("mixtral-8x7b")
    cluster = planner.load_cluster("h100", gpus=1)
    job = planner.TrainingJob(seq_len=4096, global_batch=2, framework="megatron")
    layout = planner.Layout.uniform(model, tp=1, pp=1, dp=1, recompute=recompute)
    return planner.evaluate(model, cluster, job, layout).step_time_s


@pytest.mark.parametrize(("recompute", "per_expert"), [("none", 6), ("full", 8)])
def test_launch_bound_experts_take_their_launches(recompute, per_expert):
    # Launch-bound (1 and 2 ms a launch against GEMMs of 0.15-0.3 ms), the experts' GEMMs
    # take their launches, so a millisecond more per launch adds launches x 1 ms (full
    # recompute re-runs the two forward GEMMs of each expert).
    with launching(1e-3):
        slower = _mixtral_step(recompute)
    with launching(2e-3):
        slowest = _mixtral_step(recompute)
    model = planner.load_model("mixtral-8x7b")
    launches = per_expert * model.num_experts * model.num_layers * 2  # 2 micro-batches
    assert slowest - slower == pytest.approx(launches * 1e-3, rel=1e-9)


def test_launches_hide_behind_experts_with_many_tokens():
    # 1,024 tokens per expert (4,096 x top-2 / 8): each GEMM takes far longer than a launch
    with launching(0.0):
        base = _mixtral_step("none")
    assert frameworks.framework("megatron").expert_gemm_launch_s > 0
    assert _mixtral_step("none") == base


def test_grouped_kernel_frameworks_pay_nothing_per_expert():
    # torchtitan runs a rank's experts as one grouped GEMM (torch._grouped_mm)
    assert frameworks.framework("torchtitan").expert_gemm_launch_s == 0
    assert frameworks.framework("megatron").expert_gemm_launch_s > 0


def test_launches_slow_layouts_with_many_local_experts_more():
    # Qwen2-57B-A14B on 64 H100 (arXiv 2504.14960 Table 4): TP4 EP4 ETP4 (16 experts per
    # rank) was measured at 22.4% MFU, FSDP + EP8 (8 experts per rank) at 26.3%: the same
    # job, so the first's step is 26.3 / 22.4 - 1 = 17.4% longer. Without the launches the
    # model puts it less far behind than measured; the launches bring it nearer.
    model = planner.load_model("qwen2-57b-a14b")
    cluster = planner.load_cluster("h100", gpus=64)
    job = planner.TrainingJob(seq_len=4096, global_batch=1024, framework="megatron")
    tp_ep = planner.Layout.uniform(model, tp=4, pp=1, dp=16, ep=4, etp=4, zero=1)
    fsdp_ep = planner.Layout.uniform(model, tp=1, pp=1, dp=64, ep=8, zero=3)

    def gap() -> float:
        slow = planner.evaluate(model, cluster, job, tp_ep).step_time_s
        fast = planner.evaluate(model, cluster, job, fsdp_ep).step_time_s
        return slow / fast - 1

    measured = 26.3 / 22.4 - 1
    with launching(0.0):
        without = gap()
    with_launches = gap()
    assert 0 <= without < measured
    assert abs(with_launches - measured) < abs(without - measured)


def test_grouped_tensor_removes_the_launches_and_is_exported():
    # --moe-use-grouped-tensor: one grouped kernel, no host launch per expert
    shipped = frameworks.framework("megatron").expert_gemm_launch_s
    model = planner.load_model("qwen2-57b-a14b")
    cluster = planner.load_cluster("h100", gpus=64)
    job = planner.TrainingJob(seq_len=4096, global_batch=1024, framework="megatron")
    grouped = job.model_copy(update={"moe_grouped_tensor": True})
    layout = planner.Layout.uniform(model, tp=4, pp=1, dp=16, ep=4, etp=4, zero=1)
    with launching(0.0):
        none = planner.evaluate(model, cluster, job, layout).step_time_s
    assert shipped > 0
    assert planner.evaluate(model, cluster, grouped, layout).step_time_s == none
    assert planner.evaluate(model, cluster, job, layout).step_time_s > none

    def args(j: planner.TrainingJob) -> list[str]:
        return planner.export.megatron(plan_of(model, cluster, j, layout)).args

    assert "--moe-use-grouped-tensor" in args(grouped)
    assert "--moe-use-grouped-tensor" not in args(job)


def test_grouped_tensor_is_megatrons_switch():
    with pytest.raises(planner.PlannerError, match="moe_grouped_tensor"):
        planner.TrainingJob(
            seq_len=4096, global_batch=8, framework="torchtitan", moe_grouped_tensor=True
        )
    job = planner.TrainingJob(seq_len=4096, global_batch=8, moe_grouped_tensor=True)
    assert not job.with_framework("torchtitan").moe_grouped_tensor
