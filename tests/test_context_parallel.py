"""Context parallelism: each sequence's tokens split over cp ranks that pass keys and values
around a ring in every attention.

Golden figures come from how Megatron-LM runs it, not from this code's output:
- the batch is cut along the sequence into 2 * cp chunks, rank i holding chunks i and
  2cp-1-i (``get_batch_on_this_cp_rank``), so each rank holds seq_len / cp tokens of every
  activation and does a cp-th of the causal attention's work;
- the ring (Transformer Engine's "p2p" context-parallel communication) sends the rank's own
  keys and values, b * (s / cp) tokens of 2 * kv_heads * head_dim / tp elements, each step;
- gradients are reduced, and the distributed optimizer sharded, over the data-parallel group
  with context parallelism (dp * cp ranks), and the ranks are ordered tp-cp-ep-dp-pp.
"""

from __future__ import annotations

import pytest

import planner
from planner.check import SIM_TOLERANCE
from planner.cli import main
from planner.costs.blocks import block_cost
from planner.costs.comm import Network, group
from planner.costs.memory import shard_of, stage_memory
from planner.costs.timing import TpComm
from planner.errors import PlannerError
from planner.solve.space import context_parallel_degrees, cp_comm_choices

LLAMA = planner.load_model("llama3-8b")
H100 = planner.load_cluster("h100", gpus=16)
JOB = planner.TrainingJob(seq_len=32768, global_batch=16)


def layout(**kw: object) -> planner.Layout:
    return planner.Layout.uniform(LLAMA, **kw)  # type: ignore[arg-type]


def test_world_size_and_rank_groups_follow_megatron_order() -> None:
    lay = layout(tp=2, cp=2, pp=2, dp=2)
    assert lay.world_size == 16
    # tp innermost, then cp, then dp, then pp
    assert group(lay, "tp", 5) == [4, 5]
    assert group(lay, "cp", 5) == [5, 7]
    assert group(lay, "dp", 5) == [1, 3, 5, 7]  # gradients: data and context parallel ranks
    assert group(lay, "pp", 5) == [5, 13]
    lay4 = layout(tp=2, cp=2, pp=4, dp=1)
    assert group(lay4, "pp", 1) == [1, 5, 9, 13]


def test_every_activation_is_split_by_sequence_and_attention_work_by_cp() -> None:
    """Megatron-LM's load-balanced split: a cp-th of the tokens and of the causal work."""
    for cp in (2, 4):
        one = block_cost(LLAMA, "layer.3", shard_of(JOB, layout(tp=2)))
        split = block_cost(LLAMA, "layer.3", shard_of(JOB, layout(tp=2, cp=cp)))
        assert split.saved_bytes(frozenset()) * cp == one.saved_bytes(frozenset())
        assert split.saved_bytes("full") * cp == one.saved_bytes("full")
        b, s, d = 1, JOB.seq_len, LLAMA.head_dim
        heads = LLAMA.num_attention_heads / 2
        # causal QK^T and PV: 2 * 2 b s^2 heads d, half of it under the mask, over cp ranks
        assert split.attention_fwd.attention == pytest.approx(2 * b * s * s * heads * d / cp)
        kv = 2 * b * (s // cp) * LLAMA.num_kv_heads * d * 2 / 2  # K and V, bf16, over tp 2
        assert split.cp_kv_bytes == pytest.approx(kv)


def test_state_is_sharded_over_data_and_context_parallel_ranks() -> None:
    """ZeRO-1 shards the optimizer over dp * cp: cp 2 x dp 2 holds what dp 4 holds."""
    job = planner.TrainingJob(seq_len=8192, global_batch=16)
    a = stage_memory(LLAMA, job, layout(tp=4, cp=2, dp=2), num_microbatches=8)[0]
    b = stage_memory(LLAMA, job, layout(tp=4, cp=1, dp=4), num_microbatches=4)[0]
    for bucket in ("weights", "grads", "optimizer"):
        assert a.buckets[bucket] == pytest.approx(b.buckets[bucket])
    assert a.buckets["activations"] < b.buckets["activations"]
    # The ring's receive buffers: K and V of a rank's 4,096 tokens over tp 4, and their
    # gradients, each in use and arriving: 4 x 2 x 4096 x kv_heads x head_dim x 2 B / 4.
    ring = 4 * 2 * 4096 * LLAMA.num_kv_heads * LLAMA.head_dim * 2 / 4
    assert a.buckets["buffers"] - b.buckets["buffers"] == pytest.approx(ring)


def test_the_ring_costs_time_only_where_attention_cannot_hide_it() -> None:
    """Each of cp - 1 sends hides behind a cp-th of the attention: at 32K tokens a ring of 2
    inside a node is almost free, one that leaves the node (tp 8 x cp 2) costs more, and
    a longer ring over the same tokens costs more still."""
    times = {}
    for tp, cp in ((4, 1), (4, 2), (8, 2), (4, 4)):
        lay = layout(tp=tp, cp=cp, dp=16 // (tp * cp), recompute="full")
        est = planner.evaluate(LLAMA, H100, JOB, lay)
        times[(tp, cp)] = est.breakdown.get("cp_comm", 0.0)
        assert est.step_time_s == pytest.approx(
            planner.simulate(LLAMA, H100, JOB, lay).step_time_s, rel=SIM_TOLERANCE
        )
    assert times[(4, 1)] == 0.0
    assert 0.0 < times[(4, 2)] < times[(8, 2)]
    assert times[(4, 2)] < times[(4, 4)]


def test_bad_context_parallel_layouts_are_one_line_errors() -> None:
    with pytest.raises(PlannerError, match=r"Layout.cp=3: .*2\*cp=6"):
        six = planner.load_cluster("h100", gpus=6)
        planner.evaluate(LLAMA, six, JOB, layout(tp=2, cp=3))
    mixtral = planner.load_model("mixtral-8x7b")
    with pytest.raises(PlannerError, match=r"Layout.ep=8: .*dp\*cp\*tp=4"):
        planner.Layout.uniform(mixtral, tp=2, cp=2, dp=1, ep=8)
    eager = planner.TrainingJob(seq_len=8192, global_batch=16, flash_attention=False)
    with pytest.raises(PlannerError, match="flash"):
        planner.evaluate(LLAMA, H100, eager, layout(tp=8, cp=2))


def test_default_context_parallel_degrees_keep_4096_tokens_a_rank() -> None:
    assert context_parallel_degrees(4096, 1024) == [1]
    assert context_parallel_degrees(8192, 1024) == [1, 2]  # MLPerf's Llama 3.1 405B: CP2
    assert context_parallel_degrees(131072, 16384) == [1, 2, 4, 8, 16, 32]
    assert context_parallel_degrees(131072, 8) == [1, 2, 4, 8]


def test_the_search_chooses_context_parallelism_and_exports_it() -> None:
    cluster = planner.load_cluster("h100", gpus=8)
    model = LLAMA.model_copy(update={"num_layers": 4})
    job = planner.TrainingJob(seq_len=65536, global_batch=2)
    space = planner.SearchSpace(tp=[4], pp=[1], cp=[1, 2])
    plan = planner.plan(model, cluster, job, space, time_limit_s=5)
    assert plan.layout is not None and plan.estimate is not None
    assert plan.layout.cp in (1, 2)
    pinned = planner.plan(model, cluster, job, space.model_copy(update={"cp": [2]}), time_limit_s=5)
    assert pinned.layout is not None and pinned.layout.cp == 2
    megatron = planner.export.megatron(pinned)
    assert "--context-parallel-size 2" in megatron.files["megatron.sh"]
    assert "--cp-comm-type p2p" in megatron.files["megatron.sh"]
    titan = planner.export.torchtitan(pinned)
    assert "context_parallel_degree = 2" in titan.files["torchtitan.toml"]
    with pytest.raises(PlannerError, match=r"Layout\.cp=2: DeepSpeed"):
        planner.export.deepspeed(pinned)
    # DeepSpeed's sequence parallelism is Ulysses, beside ZeRO alone
    lean = planner.plan(
        model, cluster, job, planner.SearchSpace(target="deepspeed"), time_limit_s=5
    )
    assert lean.layout is not None
    if lean.layout.cp > 1:
        assert (lean.layout.cp_comm_type, lean.layout.tp, lean.layout.pp) == ("a2a", 1, 1)
    ulysses = planner.plan(
        model, cluster, job, planner.SearchSpace(target="deepspeed", cp=[4]), time_limit_s=5
    )
    assert ulysses.layout is not None and ulysses.layout.cp_comm_type == "a2a"
    export = planner.export.deepspeed(ulysses)
    assert '"sequence_parallel_size": 4' in export.files["ds_config.json"]
    assert "UlyssesSPAttentionHF.register_with_transformers" in export.files["pipeline.py"]
    assert "sequence_parallel_size=4" in export.files["pipeline.py"]


@pytest.mark.slow
def test_a_long_context_job_gets_a_context_parallel_plan_that_fits() -> None:
    """Llama 3 405B at 131,072 tokens on 16,384 H100 (Meta's long-context stage ran CP16):
    the degrees pinned near Meta's so the search is small; without context parallelism
    the same space has one micro-batch per pipeline and no layout near as fast."""
    model = planner.load_model("llama3-405b")
    cluster = planner.load_cluster("h100", gpus=16384)
    job = planner.TrainingJob(seq_len=131072, global_batch=128)
    space = planner.SearchSpace(tp=[8], pp=[16], cp=[1, 16], micro_batch=[1], zero=[1])
    plan = planner.plan(model, cluster, job, space, time_limit_s=5)
    assert plan.layout is not None and plan.estimate is not None
    assert plan.layout.cp == 16 and plan.estimate.fits


# -- all-to-all context parallelism (Layout.cp_comm_type "a2a") ------------------------------------
# Transformer Engine's AttnFuncWithCPAndQKVOA2A (Megatron-LM --cp-comm-type a2a; DeepSpeed's
# Ulysses does the same): before each attention three all-to-alls over the cp group turn the
# rank's q, k and v of s / cp tokens and all its heads into s tokens and a cp-th of the heads,
# and one turns the output back; backward runs the four on their gradients. Each moves a
# tensor the size of the rank's own, none runs beside compute, and what attention saves is the
# same size as without context parallelism. It asserts that the rank's query and key/value
# heads divide by cp.


def test_all_to_all_context_parallelism_moves_the_heads_and_keeps_no_ring() -> None:
    cp, tp = 4, 2
    ring = layout(tp=tp, cp=cp, dp=2)
    a2a = layout(tp=tp, cp=cp, dp=2, cp_comm_type="a2a")
    one = block_cost(LLAMA, "layer.3", shard_of(JOB, ring))
    other = block_cost(LLAMA, "layer.3", shard_of(JOB, a2a))
    b, s, d = 1, JOB.seq_len, LLAMA.head_dim
    q, kv = LLAMA.num_attention_heads, LLAMA.num_kv_heads
    moved = b * (s // cp) * (q + 2 * kv + q) * d * 2 / tp  # q, k, v in and the output back
    assert other.cp_a2a_bytes == pytest.approx(moved)
    assert other.cp_kv_bytes == 0.0 and one.cp_a2a_bytes == 0.0
    assert other.saved_bytes(frozenset()) == one.saved_bytes(frozenset())
    assert other.attention_fwd.attention == pytest.approx(one.attention_fwd.attention)
    # no ring: the receive buffers are gone, nothing else changes
    mine = stage_memory(LLAMA, JOB, a2a, num_microbatches=8)[0]
    theirs = stage_memory(LLAMA, JOB, ring, num_microbatches=8)[0]
    assert theirs.buckets["buffers"] - mine.buckets["buffers"] == pytest.approx(4 * one.cp_kv_bytes)
    assert mine.buckets["activations"] == theirs.buckets["activations"]


def test_all_to_all_context_parallelism_costs_its_collectives_exposed() -> None:
    """Four all-to-alls a pass each way, nothing hidden: on one node each takes the NVLink
    latency and its bytes' (cp - 1) / cp share at the NVLink bus bandwidth."""
    cp, tp = 4, 2
    lay = layout(tp=tp, cp=cp, dp=2, cp_comm_type="a2a")
    est = planner.evaluate(LLAMA, H100, JOB, lay)
    net = Network.of(H100)
    moved = block_cost(LLAMA, "layer.3", shard_of(JOB, lay)).cp_a2a_bytes
    one_pass = 4 * net.nvlink_latency_s + moved * (cp - 1) / cp / net.nvlink_bus_Bps
    passes = 2 * LLAMA.num_layers * est.num_microbatches  # forward and backward, no recompute
    assert est.breakdown["cp_comm"] == pytest.approx(passes * one_pass, rel=1e-9)
    assert est.step_time_s == pytest.approx(
        planner.simulate(LLAMA, H100, JOB, lay).step_time_s, rel=SIM_TOLERANCE
    )


def test_all_to_all_context_parallelism_needs_the_heads_to_divide(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Llama 3 8B has 8 key/value heads: over tp 2 x cp 8 a rank would hold half of one
    with pytest.raises(
        PlannerError, match=r"Layout.cp_comm_type='a2a': .*tp\*8=16 must divide num_kv_heads=8"
    ):
        planner.evaluate(LLAMA, H100, JOB, layout(tp=2, cp=8, cp_comm_type="a2a"))
    args = ["evaluate", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "16"]
    args += ["--seq-len", "32768", "--global-batch", "16", "--tp", "2", "--cp", "8"]
    assert main([*args, "--cp-comm-type", "a2a"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_kv_heads=8" in err and "Traceback" not in err
    assert main([*args, "--cp-comm-type", "p2p"]) == 0


def test_the_search_takes_the_better_of_the_ring_and_the_all_to_all() -> None:
    cluster = planner.load_cluster("h100", gpus=8)
    model = LLAMA.model_copy(update={"num_layers": 4})
    job = planner.TrainingJob(seq_len=65536, global_batch=2)
    space = planner.SearchSpace(tp=[1, 2], pp=[1], cp=[4, 8], micro_batch=[1], zero=[1])
    plans = {
        str(comm): planner.plan(
            model, cluster, job, space.model_copy(update={"cp_comm_type": comm}), time_limit_s=5
        )
        for comm in (["p2p"], ["a2a"], None)
    }
    for p in plans.values():
        assert p.layout is not None and p.estimate is not None and p.status == "optimal"
    best = min(plans["['p2p']"].estimate.step_time_s, plans["['a2a']"].estimate.step_time_s)
    both = plans["None"]
    assert both.estimate.step_time_s == pytest.approx(best, rel=1e-9)
    pinned = plans["['a2a']"]
    assert pinned.layout.cp_comm_type == "a2a"
    assert "--cp-comm-type a2a" in planner.export.megatron(pinned).files["megatron.sh"]
    titan = planner.export.torchtitan(pinned)
    assert any("all-to-all" in d or "a2a" in d for d in titan.differences)
    torchtitan = planner.plan(
        model,
        cluster,
        job,
        space.model_copy(update={"framework": "torchtitan", "zero": [2]}),
        time_limit_s=5,
    )
    assert torchtitan.layout is not None and torchtitan.layout.cp_comm_type == "p2p"


# -- both: all-to-all within a node, the ring across (Layout.cp_comm_type "a2a+p2p") ----------
# Transformer Engine's hierarchical context parallelism (cp_comm_type "a2a+p2p" with
# Megatron-LM's --hierarchical-context-parallel-sizes a r, a * r = cp): the heads split by
# all-to-all over a consecutive cp ranks (create_hierarchical_groups: level 0 consecutive,
# level 1 strided by a), then the keys and values of a-times-longer, a-times-narrower blocks
# go around a ring of r ranks: as many bytes a step as the plain ring's.


def test_hierarchical_context_parallelism_splits_the_heads_in_a_node_and_rings_across() -> None:
    cluster = planner.load_cluster("h100", gpus=32)
    job = planner.TrainingJob(seq_len=131072, global_batch=16)
    cp, tp, a2a = 16, 2, 4
    both = layout(tp=tp, cp=cp, cp_comm_type="a2a+p2p", cp_a2a_size=a2a)
    assert both.degrees() == "tp=2 cp=16(a2a4+p2p) pp=1 dp=1 ep=1"
    cost = block_cost(LLAMA, "layer.3", shard_of(job, both))
    ring = block_cost(LLAMA, "layer.3", shard_of(job, layout(tp=tp, cp=cp)))
    b, s, d = 1, job.seq_len, LLAMA.head_dim
    q, kv = LLAMA.num_attention_heads, LLAMA.num_kv_heads
    assert cost.cp_a2a_bytes == pytest.approx(b * (s // cp) * (2 * q + 2 * kv) * d * 2 / tp)
    assert cost.cp_kv_bytes == pytest.approx(ring.cp_kv_bytes)
    assert cost.saved_bytes(frozenset()) == ring.saved_bytes(frozenset())
    # the all-to-all stays on a node (NVLink), the ring of 4 crosses the nodes (InfiniBand)
    net = Network.of(cluster)
    comm = TpComm.of(LLAMA, job, both, net, shard_of(job, both), sm_count=cluster.sm_count)
    assert comm.cp == cp // a2a and comm.ring_latency == net.ib_latency_s
    assert comm.a2a_s_per_byte == pytest.approx((a2a - 1) / a2a / net.nvlink_bus_Bps)
    assert comm.a2a_latency == pytest.approx(net.nvlink_latency_s)
    args = planner.export.megatron(
        planner.plan(
            LLAMA,
            cluster,
            job,
            planner.SearchSpace(
                tp=[tp], cp=[cp], pp=[1], zero=[1], micro_batch=[1], cp_comm_type=["a2a+p2p"]
            ),
            time_limit_s=5,
        )
    ).files["megatron.sh"]
    assert "--cp-comm-type a2a+p2p" in args
    assert "--hierarchical-context-parallel-sizes 4 4" in args


def test_hierarchical_context_parallelism_is_searched_where_cp_leaves_the_node() -> None:
    cluster = planner.load_cluster("h100", gpus=32)
    space = planner.SearchSpace()
    # tp 2 leaves 4 cp ranks on a node of 8: a2a over those 4, a ring of cp / 4
    assert cp_comm_choices(LLAMA, cluster, space, 2, 16) == [
        ("p2p", None),
        ("a2a+p2p", 4),
    ]  # plain a2a over 16: 8 kv heads over tp 2 x 16 do not split
    assert cp_comm_choices(LLAMA, cluster, space, 1, 4) == [("p2p", None), ("a2a", None)]
    assert cp_comm_choices(LLAMA, cluster, space, 2, 1) == [("p2p", None)]


def test_bad_hierarchical_context_parallel_layouts_are_one_line_errors() -> None:
    with pytest.raises(PlannerError, match=r"Layout.cp_a2a_size=None: .*a2a\+p2p"):
        layout(tp=2, cp=8, cp_comm_type="a2a+p2p")
    with pytest.raises(PlannerError, match=r"Layout.cp_a2a_size=3: .*dividing"):
        layout(tp=2, cp=8, cp_comm_type="a2a+p2p", cp_a2a_size=3)
    with pytest.raises(PlannerError, match=r"Layout.cp_a2a_size=2: only with"):
        layout(tp=2, cp=8, cp_a2a_size=2)
