"""Expert tensor parallelism (``Layout.etp``) with Megatron-Core's MoE parallel folding: the
experts are laid over the same tp * cp * dp ranks attention uses, ordered etp-ep-edp; each
routed expert's matrices are split over etp ranks, which all-gather the tokens dispatched to
it and reduce-scatter its output; expert state is sharded over ep * etp and ZeRO-sharded
over the rest (Megatron-LM's ``--expert-tensor-parallel-size``, default the attention's tp)."""

from __future__ import annotations

import pytest

import planner
from planner.check import SIM_TOLERANCE
from planner.costs.blocks import block_cost
from planner.costs.comm import group
from planner.costs.memory import shard_of, stage_memory
from planner.costs.state import shards
from planner.errors import PlannerError
from planner.solve.space import enumerate_configs

MIXTRAL = planner.load_model("mixtral-8x7b")
CLUSTER = planner.load_cluster("h100", gpus=64)
JOB = planner.TrainingJob(seq_len=4096, global_batch=256)


def layout(etp: int, **kw: object) -> planner.Layout:
    fields: dict[str, object] = {"tp": 4, "dp": 16, "ep": 8, "recompute": "selective"}
    return planner.Layout.uniform(MIXTRAL, etp=etp, **(fields | kw))  # type: ignore[arg-type]


def test_groups_fold_experts_etp_first() -> None:
    lay = planner.Layout.uniform(MIXTRAL, tp=4, dp=4, ep=4, etp=2)  # a plane of 16 ranks
    assert group(lay, "etp", 5) == [4, 5]
    assert group(lay, "ep", 5) == [1, 3, 5, 7]
    assert group(lay, "edp", 5) == [5, 13]


def test_expert_state_is_split_over_ep_times_etp() -> None:
    """Per rank and layer, E * 3 * h * f / (ep * etp) expert weights (SwiGLU: three
    matrices), ZeRO-1 moments sharded over the other dp*cp*tp / (ep * etp) ranks."""
    h, f, e = MIXTRAL.hidden_size, MIXTRAL.moe_ffn_hidden_size, MIXTRAL.num_experts
    for etp in (1, 2, 4):
        lay = layout(etp)
        cost = block_cost(MIXTRAL, "layer.0", shard_of(JOB, lay))
        [experts] = [p for p in cost.params if p.expert]
        assert experts.numel == e * 3 * h * f
        assert shards(experts, lay) == 8 * etp
    one, four = (stage_memory(MIXTRAL, JOB, layout(k), num_microbatches=4)[0] for k in (1, 4))
    assert four.buckets["weights"] < one.buckets["weights"]
    assert four.buckets["optimizer"] == pytest.approx(one.buckets["optimizer"], rel=1e-9)


def test_expert_work_is_conserved_and_the_gemms_change_shape() -> None:
    """Each rank computes a 1/etp slice of its experts' width for etp times the tokens."""
    one = block_cost(MIXTRAL, "layer.0", shard_of(JOB, layout(1)))
    two = block_cost(MIXTRAL, "layer.0", shard_of(JOB, layout(2)))
    assert two.fwd.expert == pytest.approx(one.fwd.expert, rel=1e-12)
    assert two.tokens_per_expert == pytest.approx(2 * one.tokens_per_expert)


def test_it_trades_memory_for_the_gather_and_the_reduce_scatter() -> None:
    one = planner.evaluate(MIXTRAL, CLUSTER, JOB, layout(1))
    two = planner.evaluate(MIXTRAL, CLUSTER, JOB, layout(2))
    assert two.peak_bytes < one.peak_bytes
    assert two.breakdown["expert_all_to_all"] > one.breakdown["expert_all_to_all"]
    simulated = planner.simulate(MIXTRAL, CLUSTER, JOB, layout(2)).step_time_s
    assert two.step_time_s == pytest.approx(simulated, rel=SIM_TOLERANCE)


def test_bad_expert_tensor_parallel_degrees_are_one_line_errors() -> None:
    with pytest.raises(PlannerError, match=r"Layout.etp=16: ep\*etp=128 must divide"):
        layout(16)
    odd = MIXTRAL.model_copy(update={"moe_ffn_hidden_size": 14335})
    lay = planner.Layout.uniform(odd, tp=4, dp=16, ep=8, etp=2)
    with pytest.raises(PlannerError, match=r"Layout\.etp=2: .*moe_ffn_hidden_size=14335"):
        planner.evaluate(odd, CLUSTER, JOB, lay)


def test_it_is_searched_and_exported() -> None:
    small = MIXTRAL.model_copy(update={"num_layers": 2})
    cluster = planner.load_cluster("h100", gpus=8)
    job = planner.TrainingJob(seq_len=2048, global_batch=16)
    default = {(c.tp, c.etp) for c in enumerate_configs(small, cluster, job, planner.SearchSpace())}
    assert {(4, 1), (4, 4), (2, 2), (1, 1)} <= default and (4, 2) not in default
    space = planner.SearchSpace(tp=[4], pp=[1], ep=[2], etp=[2])
    plan = planner.plan(small, cluster, job, space, time_limit_s=3)
    assert plan.layout is not None and plan.layout.etp == 2
    megatron = planner.export.megatron(plan).args
    at = megatron.index("--expert-tensor-parallel-size")
    assert megatron[at + 1] == "2"
    titan = planner.export.torchtitan(plan)
    assert any("expert tensor parallelism 2" in d for d in titan.differences)
    assert "expert_tensor_parallel_degree = 1" in titan.files["torchtitan.toml"]
