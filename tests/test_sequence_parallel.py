"""Sequence parallelism as a layout decision (``Layout.sequence_parallel``).

Korthikanti et al. 2022 (arXiv 2205.05198), Table 2: with tensor parallelism alone a layer
keeps s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes of activations, with sequence parallelism
s*b*h*(34/t + 5*a*s/(h*t)): the 10*s*b*h of norms and dropout split over t. The bytes moved
are the same (an all-gather and a reduce-scatter instead of an all-reduce), so the search
never gives it up unless asked.
"""

from __future__ import annotations

import pytest

import planner
from planner.errors import PlannerError
from planner.solve.space import enumerate_configs

MODEL = planner.load_model("llama3-8b").model_copy(update={"num_layers": 4})
CLUSTER = planner.load_cluster("h100", gpus=8)
JOB = planner.TrainingJob(seq_len=4096, global_batch=8)


def layout(sp: bool, tp: int = 4, **kw: object) -> planner.Layout:
    return planner.Layout.uniform(MODEL, tp=tp, dp=8 // tp, sequence_parallel=sp, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("framework", ["megatron", "torchtitan", "deepspeed"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_sequence_parallelism_never_loses(framework: str, recompute: str) -> None:
    job = JOB.model_copy(update={"framework": framework})
    on = planner.evaluate(MODEL, CLUSTER, job, layout(True, recompute=recompute))
    off = planner.evaluate(MODEL, CLUSTER, job, layout(False, recompute=recompute))
    assert on.step_time_s <= off.step_time_s * (1 + 1e-12)
    assert on.peak_bytes < off.peak_bytes


def test_what_it_saves_is_the_norms_and_dropout_split_over_tp() -> None:
    """Korthikanti et al. section 4.2.2: of the 10 s*b*h bytes tensor parallelism leaves
    whole, a block without dropout (Llama) keeps 8: the two norms' inputs (4 s*b*h) and
    their outputs, the QKV and first MLP linears' inputs (4 s*b*h), which sequence
    parallelism keeps sharded and gathers again in backward. All of it split over t."""
    from planner.costs.blocks import block_cost
    from planner.costs.memory import shard_of

    s, h, t = JOB.seq_len, MODEL.hidden_size, 4
    on = block_cost(MODEL, "layer.1", shard_of(JOB, layout(True)))
    off = block_cost(MODEL, "layer.1", shard_of(JOB, layout(False)))
    whole = 8 * s * h  # 8 s*b*h bytes, b = 1
    assert off.saved_bytes(frozenset()) - on.saved_bytes(frozenset()) == pytest.approx(
        whole * (1 - 1 / t), rel=1e-9
    )


def test_it_is_searched_only_where_asked() -> None:
    default = {
        c.sequence_parallel for c in enumerate_configs(MODEL, CLUSTER, JOB, planner.SearchSpace())
    }
    assert default == {True}
    both = planner.SearchSpace(sequence_parallel=[False, True])
    seen = {(c.tp > 1, c.sequence_parallel) for c in enumerate_configs(MODEL, CLUSTER, JOB, both)}
    assert seen == {(True, False), (True, True), (False, False)}
    ds = planner.plan(
        MODEL, CLUSTER, JOB, planner.SearchSpace(target="deepspeed", tp=[4]), time_limit_s=3
    )
    assert ds.layout is not None and not ds.layout.sequence_parallel


def test_the_job_field_moved_and_exports_follow_the_layout() -> None:
    with pytest.raises(PlannerError, match=r"TrainingJob.sequence_parallel=False: .*Layout"):
        planner.TrainingJob(seq_len=4096, global_batch=8, sequence_parallel=False)
    space = planner.SearchSpace(tp=[4], pp=[1], sequence_parallel=[False])
    plan = planner.plan(MODEL, CLUSTER, JOB, space, time_limit_s=3)
    assert plan.layout is not None and not plan.layout.sequence_parallel
    assert "--sequence-parallel" not in planner.export.megatron(plan).args
    titan = planner.export.torchtitan(plan)
    assert any("sequence parallelism off" in d for d in titan.differences)
    on = planner.plan(
        MODEL, CLUSTER, JOB, space.model_copy(update={"sequence_parallel": [True]}), time_limit_s=3
    )
    assert "--sequence-parallel" in planner.export.megatron(on).args
    assert any("sequence parallelism" in d for d in planner.export.deepspeed(on).differences)
