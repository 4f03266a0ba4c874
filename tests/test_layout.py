"""Layout constructors and the one-line errors of bad layouts."""

from __future__ import annotations

import pytest

import planner
from planner import Layout, PlannerError

DSV3 = planner.load_model("deepseek-v3")
LLAMA = planner.load_model("llama3-8b")


def test_uniform_splits_evenly_with_embedding_first_and_head_last() -> None:
    layout = Layout.uniform(DSV3, pp=16, dp=128, ep=64)
    counts = [sum(b.block.startswith("layer.") for b in s.blocks) for s in layout.stages]
    assert counts == [4] * 13 + [3] * 3
    assert layout.stages[0].blocks[0].block == "embedding"
    assert [b.block for b in layout.stages[-1].blocks][-2:] == ["mtp.0", "head"]


def test_from_counts_and_recompute_mapping() -> None:
    layout = Layout.from_counts(
        LLAMA, counts=[10, 12, 10], recompute={"layer.3": "full", "layer.4": "selective"}
    )
    assert layout.pp == 3
    choices = {b.block: b.recompute for s in layout.stages for b in s.blocks}
    assert choices["layer.3"] == "full" and choices["layer.4"] == "selective"
    assert choices["layer.5"] == "none"


def test_interleaved_places_chunks_round_robin() -> None:
    layout = Layout.uniform(LLAMA, pp=4, schedule="interleaved", virtual_stages=2)
    assert len(layout.stages) == 8
    assert layout.chunks_of_rank(1) == [1, 5]


def test_dualpipev_places_chunks_in_a_v() -> None:
    layout = Layout.uniform(LLAMA, pp=4, schedule="dualpipev")
    assert layout.chunks_of_rank(0) == [0, 7]
    assert layout.chunks_of_rank(3) == [3, 4]


def test_ep_must_divide_dp_times_cp_times_tp() -> None:
    with pytest.raises(PlannerError, match=r"ep=48 must divide dp\*cp\*tp=128") as info:
        Layout.uniform(DSV3, pp=16, dp=128, ep=48)
    assert "\n" not in str(info.value)


def test_tp_must_divide_heads() -> None:
    layout = Layout.uniform(LLAMA, pp=1, tp=3, dp=1)
    job = planner.TrainingJob(seq_len=4096, global_batch=8)
    with pytest.raises(PlannerError, match="tp=3: tensor parallel degree must divide"):
        planner.evaluate(LLAMA, planner.load_cluster("h100", gpus=3), job, layout)


def test_ep_must_divide_experts() -> None:
    mixtral = planner.load_model("mixtral-8x7b")
    layout = Layout.uniform(mixtral, pp=1, dp=16, ep=16)
    job = planner.TrainingJob(seq_len=4096, global_batch=16)
    with pytest.raises(PlannerError, match="ep=16: expert parallel degree must divide"):
        planner.evaluate(mixtral, planner.load_cluster("h100", gpus=16), job, layout)


def test_world_size_must_match_the_cluster() -> None:
    layout = Layout.uniform(LLAMA, pp=2, dp=2)
    job = planner.TrainingJob(seq_len=4096, global_batch=8)
    with pytest.raises(PlannerError, match=r"tp\*cp\*pp\*dp=1\*1\*2\*2=4 must equal"):
        planner.evaluate(LLAMA, planner.load_cluster("h100", gpus=8), job, layout)


def test_batch_must_divide() -> None:
    layout = Layout.uniform(LLAMA, pp=1, dp=8, micro_batch=2)
    job = planner.TrainingJob(seq_len=4096, global_batch=24)
    with pytest.raises(PlannerError, match=r"global_batch=24: must be a multiple of dp\*micro"):
        planner.evaluate(LLAMA, planner.load_cluster("h100", gpus=8), job, layout)


def test_the_search_keeps_tp_within_a_node_though_evaluate_costs_it_across() -> None:
    from planner.check import check_degrees

    gpt = planner.load_model("gpt3-175b")
    layout = Layout.uniform(gpt, pp=1, tp=16, dp=1, recompute="full")
    job = planner.TrainingJob(seq_len=2048, global_batch=8)
    cluster = planner.load_cluster("h100", gpus=16)
    assert any("spans more than a node" in p for p in check_degrees(gpt, cluster, job, layout))
    assert planner.evaluate(gpt, cluster, job, layout).step_time_s > 0


def test_blocks_must_cover_the_model_in_order() -> None:
    good = Layout.uniform(LLAMA, pp=2, dp=1)
    stages = [s.model_dump() for s in good.stages]
    stages[1]["blocks"] = stages[1]["blocks"][1:]  # drop a layer
    bad = Layout(pp=2, stages=stages)
    job = planner.TrainingJob(seq_len=4096, global_batch=8)
    with pytest.raises(PlannerError, match=r"missing layer\.16"):
        planner.evaluate(LLAMA, planner.load_cluster("h100", gpus=2), job, bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, r"Layout.tp=0: Input should be greater than 0"),
        ({"zero": 4}, r"Layout.zero=4"),
        ({"schedule": "pipedream"}, r"Layout.schedule='pipedream'"),
        ({"recompute": "attention"}, r"unknown module 'attention'"),
    ],
)
def test_bad_fields_name_field_value_and_rule(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlannerError, match=message) as info:
        Layout.uniform(LLAMA, pp=1, **kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_misspelled_field_is_an_error() -> None:
    with pytest.raises(PlannerError, match=r"seqlen.*unknown field"):
        planner.TrainingJob(seqlen=4096, global_batch=8)  # type: ignore[call-arg]


def test_recompute_modules_are_those_the_model_has() -> None:
    """Llama 3 is dense with plain attention; Mixtral routes every layer's MLP to experts
    (no dense MLP, no shared expert); DeepSeek-V3 has latent attention, 3 dense layers, routed
    and shared experts (their model cards)."""
    from planner.layout import model_modules

    names = {n: model_modules(planner.load_model(n)) for n in ("llama3-8b", "mixtral-8x7b")}
    assert names["llama3-8b"] == ["core_attn", "layernorm", "mlp"]
    assert names["mixtral-8x7b"] == ["core_attn", "layernorm", "moe", "moe_act"]
    assert model_modules(planner.load_model("deepseek-v3")) == list(
        planner.layout.RECOMPUTE_MODULES
    )
    mixtral = planner.load_model("mixtral-8x7b")
    layout = planner.Layout.uniform(mixtral, dp=8, ep=8, recompute="mlp")
    job = planner.TrainingJob(seq_len=4096, global_batch=64)
    with pytest.raises(planner.PlannerError, match=r"^recompute='mlp': mixtral-8x7b has no mlp"):
        planner.evaluate(mixtral, planner.load_cluster("h100", gpus=8), job, layout)
