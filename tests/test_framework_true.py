"""Plans a framework runs, priced as that framework runs them: the search's target, the MoE
dispatcher, Megatron-LM's expert all-to-all overlap and ZeRO-1/2's weight all-gather."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

import planner
from planner.costs.comm import Network, group
from planner.costs.memory import block_costs, shard_of
from planner.costs.quantities import Bytes
from planner.costs.timing import stage_bytes, stage_times
from planner.estimate import mfu_note
from planner.export import EXPORTERS
from planner.frameworks import FRAMEWORKS, LAUNCHERS
from planner.schedules import SCHEDULES, op_order
from planner.solve.space import enumerate_configs

MIXTRAL = planner.load_model("mixtral-8x7b").model_copy(update={"num_layers": 4})
H100x16 = planner.load_cluster("h100", gpus=16)
JOB = planner.TrainingJob(seq_len=2048, global_batch=64)


def test_the_search_takes_only_what_the_jobs_framework_runs() -> None:
    """No target given: the job's framework's launcher decides (Megatron-LM by default)."""
    for name in LAUNCHERS:
        job = JOB.with_framework(name)
        runs = FRAMEWORKS[name].launcher
        assert runs is not None
        configs = list(enumerate_configs(MIXTRAL, H100x16, job, planner.SearchSpace()))
        assert configs
        assert {c.schedule for c in configs} <= set(runs.schedules)
        if runs.zero is not None:
            assert {c.zero for c in configs} <= set(runs.zero)
    # The eager runtime has no launcher: every schedule is open.
    torch = JOB.with_framework("torch")
    schedules = {
        c.schedule for c in enumerate_configs(MIXTRAL, H100x16, torch, planner.SearchSpace())
    }
    assert "dualpipev" in schedules


def test_several_targets_give_the_best_of_each() -> None:
    model = planner.load_model("llama3-8b").model_copy(update={"num_layers": 4})
    cluster = planner.load_cluster("h100", gpus=8)
    job = planner.TrainingJob(seq_len=2048, global_batch=16)
    space = planner.SearchSpace(framework=["megatron", "torchtitan"], tp=[1, 2], pp=[1, 2])
    plan = planner.plan(model, cluster, job, space, time_limit_s=4)
    assert [b.framework for b in plan.frameworks] == ["megatron", "torchtitan"]
    best = min(b.step_time_s for b in plan.frameworks if b.step_time_s is not None)
    assert plan.estimate is not None and plan.job is not None
    assert plan.estimate.step_time_s == pytest.approx(best)
    assert plan.job.framework in ("megatron", "torchtitan")
    # An explicit framework and several targets contradict each other.
    with pytest.raises(planner.PlannerError, match="leave the framework out"):
        planner.plan(model, cluster, job.with_framework("deepspeed"), space, time_limit_s=1)
    with pytest.raises(planner.PlannerError, match=r"SearchSpace.framework=\[\]"):
        planner.SearchSpace(framework=[])
    # target= is the same setting under the word exports use
    assert planner.SearchSpace(target="deepspeed").framework == "deepspeed"
    with pytest.raises(planner.PlannerError, match="the same setting; give one"):
        planner.SearchSpace(target="deepspeed", framework="megatron")


def test_a_dispatcher_the_framework_lacks_is_refused() -> None:
    with pytest.raises(
        planner.PlannerError, match="moe_dispatcher='deepep': framework='deepspeed'"
    ):
        planner.TrainingJob(
            seq_len=2048, global_batch=8, framework="deepspeed", moe_dispatcher="deepep"
        )
    planner.TrainingJob(
        seq_len=2048, global_batch=8, framework="torchtitan", moe_dispatcher="deepep"
    )


def test_expert_overlap_pairs_the_steady_forwards_with_the_backwards() -> None:
    """Megatron-LM's combined 1F1B (combined_1f1b.py): the interleaved order with one more
    warm-up forward, every later forward beside the backward after it."""
    plain = op_order("interleaved", pp=2, num_microbatches=4, rank=0, virtual_stages=2)
    combined = op_order(
        "interleaved-ep-overlap", pp=2, num_microbatches=4, rank=0, virtual_stages=2
    )
    warm = next(i for i, op in enumerate(plain) if op.kind == "BW")
    assert [op.kind for op in combined[: warm + 1]] == ["F"] * (warm + 1)
    pairs = [(a, b) for a, b in itertools.pairwise(combined) if a.paired]
    assert pairs and all(a.kind == "F" and b.kind == "BW" for a, b in pairs)
    assert sorted((o.kind, o.microbatch, o.stage) for o in plain) == sorted(
        (o.kind, o.microbatch, o.stage) for o in combined
    )
    one = op_order("1f1b-ep-overlap", pp=1, num_microbatches=3, rank=0)
    assert [(o.kind, o.microbatch, o.paired) for o in one] == [
        ("F", 0, False),
        ("F", 1, True),
        ("BW", 0, False),
        ("F", 2, True),
        ("BW", 1, False),
        ("BW", 2, False),
    ]
    assert SCHEDULES["1f1b-ep-overlap"].max_pp == 1  # Megatron-LM needs VPP with pp > 1


def test_expert_overlap_hides_all_to_alls_and_holds_no_more() -> None:
    cluster = planner.load_cluster("h100", gpus=16)
    job = planner.TrainingJob(seq_len=4096, global_batch=64)
    est = {}
    for schedule in ("1f1b", "1f1b-ep-overlap"):
        layout = planner.Layout.uniform(
            MIXTRAL, dp=16, ep=8, schedule=schedule, recompute="selective"
        )
        est[schedule] = planner.evaluate(MIXTRAL, cluster, job, layout)
        sim = planner.simulate(MIXTRAL, cluster, job, layout)
        assert sim.peak_bytes == [s.peak_bytes for s in est[schedule].memory]
    plain, paired = est["1f1b"], est["1f1b-ep-overlap"]
    assert paired.step_time_s < plain.step_time_s
    assert paired.breakdown["expert_all_to_all"] < plain.breakdown["expert_all_to_all"]
    assert paired.peak_bytes == plain.peak_bytes


@pytest.mark.parametrize(
    ("model", "ep", "job", "recompute", "message"),
    [
        (
            planner.load_model("llama3-8b").model_copy(update={"num_layers": 4}),
            1,
            JOB,
            "none",
            "needs an MoE model with ep > 1",
        ),
        (MIXTRAL, 1, JOB, "none", "needs an MoE model with ep > 1"),
        (MIXTRAL, 8, JOB.model_copy(update={"moe_dispatcher": "allgather"}), "none", "runs none"),
        (MIXTRAL, 8, JOB, "full", "no full and no 'moe' recompute"),
        (MIXTRAL, 8, JOB, "moe", "no full and no 'moe' recompute"),
    ],
)
def test_expert_overlap_refuses_what_megatron_refuses(
    model: planner.ModelSpec, ep: int, job: planner.TrainingJob, recompute: str, message: str
) -> None:
    layout = planner.Layout.uniform(
        model, dp=16, ep=ep, schedule="1f1b-ep-overlap", recompute=recompute
    )
    with pytest.raises(planner.PlannerError, match=message):
        planner.evaluate(model, H100x16, job, layout)


def test_expert_overlap_is_searched_only_where_it_runs_and_exports_its_flag() -> None:
    space = planner.SearchSpace(pp=[1], tp=[1], zero=[1], micro_batch=[1])
    configs = list(enumerate_configs(MIXTRAL, H100x16, JOB, space))
    assert {c.schedule for c in configs if c.ep > 1} == {"1f1b", "1f1b-ep-overlap"}
    assert {c.schedule for c in configs if c.ep == 1} == {"1f1b"}
    gathered = JOB.model_copy(update={"moe_dispatcher": "allgather"})
    assert {c.schedule for c in enumerate_configs(MIXTRAL, H100x16, gathered, space)} == {"1f1b"}
    pinned = space.model_copy(update={"ep": [8], "schedules": ["1f1b-ep-overlap"]})
    plan = planner.plan(MIXTRAL, H100x16, JOB, pinned, time_limit_s=3)
    assert plan.layout is not None and plan.layout.schedule == "1f1b-ep-overlap"
    assert all(b.recompute not in ("full", "moe") for s in plan.layout.stages for b in s.blocks)
    out = EXPORTERS["megatron"](plan)
    assert "--overlap-moe-expert-parallel-comm" in out.args
    assert out.exact, out.differences


@pytest.mark.parametrize(
    ("dispatcher", "flags"),
    [
        ("alltoall", ["--moe-token-dispatcher-type", "alltoall"]),
        ("allgather", ["--moe-token-dispatcher-type", "allgather"]),
        (
            "deepep",
            ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"],
        ),
    ],
)
def test_megatron_export_states_the_dispatcher(dispatcher: str, flags: list[str]) -> None:
    job = JOB.model_copy(update={"moe_dispatcher": dispatcher})
    space = planner.SearchSpace(
        pp=[1], tp=[1], ep=[8], zero=[1], micro_batch=[1], schedules=["1f1b"]
    )
    plan = planner.plan(MIXTRAL, H100x16, job, space, time_limit_s=2)
    args = EXPORTERS["megatron"](plan).args
    at = args.index("--moe-token-dispatcher-type")
    assert args[at : at + len(flags)] == flags


@pytest.mark.parametrize("framework", ["megatron", "torchtitan"])
def test_tensor_parallel_overlap_is_a_switch_the_export_states(framework: str) -> None:
    """Megatron-LM hides tensor-parallel collectives only under --tp-comm-overlap, torchtitan
    only with async TP (under torch.compile): off, every collective is exposed and the
    export leaves the switch out."""
    model = planner.load_model("llama3-8b").model_copy(update={"num_layers": 4})
    cluster = planner.load_cluster("h100", gpus=8)
    layout = planner.Layout.uniform(model, tp=8, zero=1 if framework == "megatron" else 3)
    on = planner.TrainingJob(seq_len=4096, global_batch=8, framework=framework)
    off = on.model_copy(update={"tp_comm_overlap": False})
    [hidden] = stage_times(model, cluster, on, layout, Network.of(cluster))
    [exposed] = stage_times(model, cluster, off, layout, Network.of(cluster))
    # the same collectives; off, all of their time is in the step, on, only part of it
    assert exposed.tp_fwd > hidden.tp_fwd > 0 and exposed.fwd > hidden.fwd
    texts = {}
    for job in (on, off):
        plan = planner.plan(model, cluster, job, planner.SearchSpace(tp=[8]), time_limit_s=2)
        assert plan.layout.tp == 8
        out = EXPORTERS[framework](plan)
        texts[job.tp_comm_overlap] = (
            "\n".join(out.args) if framework == "megatron" else "\n".join(out.files.values())
        )
    switch = "--tp-comm-overlap" if framework == "megatron" else "enable_async_tensor_parallel"
    assert switch in texts[True] and switch not in texts[False]
    if framework == "torchtitan":  # async TP runs only under torch.compile
        assert "[compile]\nenable = true" in texts[True]


def test_async_tp_hides_its_fitted_share_of_what_it_could() -> None:
    """torchtitan's async TP hides Framework.tp_overlap_hidden of what a perfect overlap
    would: the collectives less one step in tp, at most the phase's compute."""
    from planner.costs.timing import TpComm, tp_exposed

    share = FRAMEWORKS["torchtitan"].tp_overlap_hidden
    assert 0 < share < 1
    tp = TpComm(seconds=1.0, mode="async", tp=8, hidden=share)
    # 8 ms of collectives beside 20 ms of compute: all but one step (1 ms) could hide
    assert tp_exposed(8.0, 20.0, tp)[0] == pytest.approx(8.0 - share * 7.0)
    # beside 3 ms of compute only 3 ms could hide
    assert tp_exposed(8.0, 3.0, tp)[0] == pytest.approx(8.0 - share * 3.0)
    full = TpComm(seconds=1.0, mode="async", tp=8, hidden=1.0)
    assert tp_exposed(8.0, 20.0, full)[0] == pytest.approx(1.0)


@pytest.mark.parametrize(("framework", "overlapped"), [("megatron", True), ("deepspeed", False)])
def test_zero1_weight_gather_is_priced_where_the_framework_runs_it(
    framework: str, overlapped: bool
) -> None:
    """ZeRO-1's updated weights are all-gathered over the data-parallel group once per step:
    Megatron-LM overlaps it with the next forward (--overlap-param-gather), DeepSpeed's ZeRO
    optimizer runs it after its step, in series."""
    model = planner.load_model("llama3-8b").model_copy(update={"num_layers": 4})
    cluster = planner.load_cluster("h100", gpus=16)
    job = planner.TrainingJob(seq_len=2048, global_batch=16, framework=framework)
    layout = planner.Layout.uniform(model, dp=16, zero=1)
    network = Network.of(cluster)
    [stage] = stage_times(model, cluster, job, layout, network)
    costs = block_costs(model, layout, shard_of(job, layout))
    params = {p.key: p for c in costs.values() for p in c.params}
    weights = stage_bytes(params, job, layout)[Bytes.DENSE_WEIGHT]
    assert weights == pytest.approx(model.num_params() * 2, rel=1e-6)  # BF16 working weights
    expected = network.all_gather(weights, group(layout, "dp", 0))
    assert stage.param_gather.seconds == pytest.approx(expected.seconds)
    est = planner.evaluate(model, cluster, job, layout)
    if not overlapped:  # after the optimizer step: the gather adds in full
        assert est.breakdown["grad_sync"] >= stage.param_gather.seconds
    zero0 = stage_times(model, cluster, job, layout.model_copy(update={"zero": 0}), network)
    assert zero0[0].param_gather.seconds == 0  # ZeRO-0 steps every weight on every rank


def test_a_predicted_mfu_above_every_measured_one_at_its_scale_says_so() -> None:
    note = mfu_note("h100", "bf16", 8192, 0.60)
    assert "exceeds the best measured" in note and "likely optimistic" in note
    assert mfu_note("h100", "bf16", 8192, 0.20) == ""
    assert mfu_note("not-a-gpu", "bf16", 8, 0.99) == ""


def test_gathered_q_and_k_cost_their_all_gathers_and_an_unsharded_rotary_embedding() -> None:
    """torchtitan's Qwen3 tensor-parallel plan before 8c1d1c5f (PR #1870): q_norm and
    k_norm as NoParallel gather q and k over tp after the norms, so a layer all-gathers
    tokens x (heads + kv heads) x head_dim each pass (half an all-reduce of that many bytes,
    the unit of ``tp_collectives``, whose region is tokens x hidden), and the rotary
    embedding reads and writes every head on every rank: (tp - 1) / tp of it more. Nothing
    changes at tp 1 or for a model without q/k norms."""
    qwen = planner.load_model("qwen3-32b")
    llama = planner.load_model("llama3-8b")
    job = planner.TrainingJob(seq_len=4096, global_batch=64, framework="torchtitan")
    gathered = job.model_copy(update={"qk_norm_gathered": True})

    def layer(model: planner.ModelSpec, j: planner.TrainingJob, tp: int) -> object:
        layout = planner.Layout.uniform(model, tp=tp, dp=8 // tp, zero=3)
        return block_costs(model, layout, shard_of(j, layout))["layer.0"]

    d, nq, nkv, h = qwen.head_dim, qwen.num_attention_heads, qwen.num_kv_heads, qwen.hidden_size
    for tp in (2, 8):
        plain, with_gather = layer(qwen, job, tp), layer(qwen, gathered, tp)
        extra = with_gather.tp_collectives - plain.tp_collectives  # type: ignore[attr-defined]
        assert extra == pytest.approx((nq + nkv) * d / h / 2)
        tokens, a = 4096, 2  # one sequence a micro-batch, BF16
        rotary = 2 * tokens * (nq + nkv) * d * a  # read + write, every head
        more = with_gather.fwd.memory - plain.fwd.memory  # type: ignore[attr-defined]
        assert more == pytest.approx(rotary - rotary / tp)
    for model, tp in ((qwen, 1), (llama, 8)):
        a, b = layer(model, gathered, tp), layer(model, job, tp)
        names = [f.name for f in dataclasses.fields(a) if not f.name.startswith("_")]  # type: ignore[arg-type]
        assert [n for n in names if getattr(a, n) != getattr(b, n)] == [], (model.name, tp)
