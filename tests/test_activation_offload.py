"""Activation offload (``recompute="offload"``), as Megatron-LM runs it with Transformer
Engine's CPU offload (--cpu-offloading-num-layers N; megatron/core/transformer/
transformer_config.py and TE's cpu_offload.py, docs/features/other_optimizations/
cpu_offloading): the first N transformer layers' saved tensors go to the host as their
forward saves them and come back, prefetched, for their backward; N below the layer count,
no pipeline parallelism, no activation recompute anywhere."""

from __future__ import annotations

import pytest

import planner
from planner.costs.blocks import block_cost
from planner.costs.compute import Rates, block_time
from planner.costs.memory import shard_of
from planner.errors import PlannerError
from planner.solve.result import Plan

MODEL = planner.load_model("llama3-8b").model_copy(update={"num_layers": 8})
CLUSTER = planner.load_cluster("h100", gpus=8)
JOB = planner.TrainingJob(seq_len=32768, global_batch=16)


def plan_of(model: planner.ModelSpec, job: planner.TrainingJob, lay: planner.Layout) -> Plan:
    """A plan of a stated layout, as the exporters take it."""
    estimate = planner.evaluate(model, CLUSTER, job, lay)
    return Plan(
        status="feasible",
        layout=lay,
        estimate=estimate,
        solve_time_s=0.0,
        model=model,
        cluster=CLUSTER,
        job=job,
    )


def layout(n: int, rest: str = "none", dp: int = 8, **kw: object) -> planner.Layout:
    choice = {f"layer.{i}": "offload" if i < n else rest for i in range(MODEL.num_layers)}
    return planner.Layout.uniform(MODEL, dp=dp, zero=3, recompute=choice, **kw)  # type: ignore[arg-type]


def test_offloaded_layers_leave_hbm_for_the_host() -> None:
    kept, moved = (
        planner.evaluate(MODEL, CLUSTER, JOB, layout(0)),
        planner.evaluate(MODEL, CLUSTER, JOB, layout(3)),
    )
    saved = block_cost(MODEL, "layer.1", shard_of(JOB, layout(0))).saved_bytes(frozenset())
    assert moved.memory[0].host_bytes == 3 * saved  # one micro-batch of 3 layers
    assert kept.memory[0].host_bytes == 0
    drop = kept.memory[0].buckets["activations"] - moved.memory[0].buckets["activations"]
    # three layers' tensors leave; one comes back at a time for its backward
    assert 2 * saved <= drop <= 3 * saved
    for bucket in ("weights", "grads", "optimizer"):
        assert moved.memory[0].buckets[bucket] == kept.memory[0].buckets[bucket]


def test_the_copies_cost_what_one_layer_of_compute_does_not_hide() -> None:
    """Each offloaded layer's copy runs beside one layer's compute each way, at the
    catalog's PCIe rate (64 GB/s each way at 0.86): what it needs beyond that is exposed,
    per micro-batch."""
    cost = block_cost(MODEL, "layer.1", shard_of(JOB, layout(0)))
    t = block_time(cost, Rates.of(CLUSTER, JOB), frozenset())
    copy = cost.saved_bytes(frozenset()) / (64e9 * 0.86)
    assert copy > t.fwd  # the copy outlasts the forward it hides behind: some is exposed
    per_layer = max(0.0, copy - t.fwd) + max(0.0, copy - t.bwd_input - t.bwd_weight)
    est = planner.evaluate(MODEL, CLUSTER, JOB, layout(3))
    assert est.breakdown["offload_copy"] == pytest.approx(
        3 * per_layer * est.num_microbatches, rel=1e-9
    )
    base = planner.evaluate(MODEL, CLUSTER, JOB, layout(0))
    assert est.step_time_s == pytest.approx(base.step_time_s + 3 * per_layer * 2, rel=1e-6)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (
            lambda: layout(2, pp=2, dp=4),
            "without pipeline parallelism only (pp=2, virtual_stages=1)",
        ),
        (lambda: layout(2, rest="full"), "with no activation recompute, not with ['full']"),
        (lambda: layout(8), "8 of 8 layers offloaded"),
    ],
)
def test_what_megatron_cannot_run_is_one_line(make: object, words: str) -> None:
    with pytest.raises(PlannerError) as err:
        planner.evaluate(MODEL, CLUSTER, JOB, make())  # type: ignore[operator]
    text = str(err.value)
    assert text.startswith("recompute='offload': ") and words in text and "\n" not in text
    titan = JOB.model_copy(update={"framework": "torchtitan"})
    with pytest.raises(PlannerError, match="activation offload runs under megatron only"):
        planner.evaluate(MODEL, CLUSTER, titan, layout(2))


def test_the_search_offloads_the_fewest_layers_that_fit() -> None:
    space = planner.SearchSpace(recompute=["none", "offload"], tp=[1], cp=[1], pp=[1], zero=[3])
    found = planner.plan(MODEL, CLUSTER, JOB, space, time_limit_s=2)
    assert found.layout is not None and found.estimate is not None
    n = sum(b.recompute == "offload" for s in found.layout.stages for b in s.blocks)
    assert 0 < n < MODEL.num_layers and found.estimate.fits
    fewer = planner.evaluate(
        MODEL, CLUSTER, JOB, layout(n - 1, micro_batch=found.layout.micro_batch)
    )
    assert not fewer.fits  # one layer fewer does not fit: n is the least
    plain = planner.plan(
        MODEL, CLUSTER, JOB, space.model_copy(update={"recompute": ["none"]}), time_limit_s=2
    )
    assert plain.layout is None  # without offload nothing fits


def test_megatron_states_it_and_the_others_say_they_cannot() -> None:
    plan = plan_of(MODEL, JOB, layout(3))
    args = planner.export.megatron(plan).args
    assert args[args.index("--cpu-offloading-num-layers") + 1] == "3"
    assert "--recompute-granularity" not in args
    ds = planner.export.deepspeed(plan)
    assert any(d.startswith("activation offload: DeepSpeed has none") for d in ds.differences)
    assert all(b.recompute == "none" for s in ds.layout.stages for b in s.blocks)


# -- fine-grained offload: offload:<module> beside recompute modules ----------------------

MIXTRAL = planner.load_model("mixtral-8x7b").model_copy(update={"num_layers": 4})
MOE_JOB = planner.TrainingJob(seq_len=4096, global_batch=16)


def moe_layout(choice: str, pp: int = 1) -> planner.Layout:
    return planner.Layout.uniform(MIXTRAL, pp=pp, dp=8 // pp, zero=1, recompute=choice)


def test_expert_fc1_sends_the_dispatched_tokens_to_the_host() -> None:
    """Megatron-LM's docs: each listed module's input goes to the host. expert_fc1's input
    is the tokens dispatched to the rank's experts: sequence x top-k copies x hidden in
    BF16, 4096 x 2 x 4096 x 2 B = 64 MiB for a Mixtral layer without expert parallelism."""
    cost = block_cost(MIXTRAL, "layer.1", shard_of(MOE_JOB, moe_layout("none")))
    choice = frozenset({"offload:expert_fc1"})
    assert cost.offloaded_bytes(choice) == 4096 * 2 * 4096 * 2
    assert cost.saved_bytes(choice) == cost.saved_bytes(frozenset()) - 4096 * 2 * 4096 * 2
    assert cost.recompute_work(choice).flops == 0  # nothing recomputed
    # a module the recompute already drops is not sent: "moe" re-runs the whole MoE layer
    assert cost.offloaded_bytes(frozenset({"moe", "offload:expert_fc1"})) == 0


def test_the_host_holds_what_the_schedule_keeps_in_flight() -> None:
    """Under 1F1B pipeline rank r holds pp - r micro-batches' activations at once (Narayanan
    et al. 2021, section 2.2): rank 0 of 2 keeps two micro-batches' offloaded inputs on the
    host, rank 1 one."""
    lay = moe_layout("offload:expert_fc1", pp=2)
    est = planner.evaluate(MIXTRAL, CLUSTER, MOE_JOB, lay)
    per_layer = 4096 * 2 * 4096 * 2
    assert [s.host_bytes for s in est.memory] == [2 * 2 * per_layer, 1 * 2 * per_layer]


def test_megatron_states_the_modules_and_the_others_run_without() -> None:
    lay = moe_layout("moe_act+offload:expert_fc1")
    plan = plan_of(MIXTRAL, MOE_JOB, lay)
    args = planner.export.megatron(plan).args
    at = args.index("--offload-modules")
    assert "--fine-grained-activation-offloading" in args and args[at + 1] == "expert_fc1"
    assert args[args.index("--recompute-modules") + 1] == "moe_act"
    titan = planner.export.torchtitan(plan)
    assert any(d.startswith("activation offload: torchtitan has none") for d in titan.differences)
    with pytest.raises(PlannerError, match="fine-grained activation offload runs under megatron"):
        planner.evaluate(
            MIXTRAL, CLUSTER, MOE_JOB.model_copy(update={"framework": "deepspeed"}), lay
        )


def test_a_plan_never_offloads_more_than_the_host_holds() -> None:
    """Four Mixtral layers each send 64 MiB a micro-batch (expert_fc1): at least 256 MiB a
    GPU, 2 GiB for a node of 8, over a 1 GiB host."""
    space = planner.SearchSpace(recompute=["offload:expert_fc1"], pp=[1], tp=[1], cp=[1])
    roomy = planner.plan(MIXTRAL, CLUSTER, MOE_JOB, space, time_limit_s=2)
    assert roomy.layout is not None  # the same space fits with the catalog's 2 TiB host
    small = CLUSTER.model_copy(update={"host_ram_bytes": 2**30})
    with pytest.raises(PlannerError, match=r"than a node's host RAM \(1 GiB\); offload fewer"):
        planner.plan(MIXTRAL, small, MOE_JOB, space, time_limit_s=2)
