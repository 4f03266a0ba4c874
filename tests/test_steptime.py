"""Step time and MFU: conventions against published figures, and the directions every layout
change must move the estimate."""

from __future__ import annotations

import pytest

import planner
from planner.estimate import model_flops_per_token
from planner.layout import Layout

LLAMA = planner.load_model("llama3-8b")
H100 = planner.load_cluster("h100", gpus=64)
JOB = planner.TrainingJob(seq_len=4096, global_batch=256)


def step(layout: Layout, job: planner.TrainingJob = JOB) -> planner.Estimate:
    return planner.evaluate(LLAMA, H100, job, layout)


def test_matmul_flops_match_llama3_405b_training_compute() -> None:
    """Llama 3 (arXiv 2407.21783) section 3.2: 405B parameters on 15.6T tokens take
    3.8e25 FLOPs, i.e. 6 N D. Our count: 6 x the matmul parameters (the embedding lookup is no
    matmul) plus causal attention; the 6 N part must match to the paper's two digits."""
    model = planner.load_model("llama3-405b")
    attention = 6 * model.num_layers * model.num_attention_heads * 2 * model.head_dim * 8192 / 2
    matmul = model_flops_per_token(model, 8192) - attention
    assert matmul * 15.6e12 == pytest.approx(3.8e25, rel=0.01)


def test_recompute_costs_time() -> None:
    times = [
        step(Layout.uniform(LLAMA, pp=4, dp=16, recompute=r)).step_time_s
        for r in ("none", "selective", "full")
    ]
    assert times[0] < times[1] < times[2]


def test_fp8_is_faster_on_a_gpu_with_fp8() -> None:
    layout = Layout.uniform(LLAMA, pp=4, dp=16)
    fp8 = JOB.model_copy(update={"compute_dtype": "fp8"})
    assert step(layout, fp8).step_time_s < step(layout).step_time_s


def test_zero_bubble_beats_1f1b_and_more_micro_batches_shrink_the_bubble_share() -> None:
    one = step(Layout.uniform(LLAMA, pp=8, dp=8, schedule="1f1b"))
    zb = step(Layout.uniform(LLAMA, pp=8, dp=8, schedule="zb-h1"))
    assert zb.step_time_s < one.step_time_s
    big = step(Layout.uniform(LLAMA, pp=8, dp=8), JOB.model_copy(update={"global_batch": 1024}))
    assert big.breakdown["bubble"] / big.step_time_s < one.breakdown["bubble"] / one.step_time_s


def test_tensor_parallel_across_nodes_is_impossible_and_within_a_node_costs_comm() -> None:
    with pytest.raises(planner.PlannerError, match="within a node"):
        step(Layout.uniform(LLAMA, tp=16, dp=4))
    est = step(Layout.uniform(LLAMA, tp=8, dp=8))
    assert est.breakdown["tp_comm"] > 0


def test_throughput_figures_are_consistent() -> None:
    est = step(Layout.uniform(LLAMA, pp=2, dp=32))
    assert est.tokens_per_s == pytest.approx(JOB.tokens_per_step / est.step_time_s)
    per_gpu = model_flops_per_token(LLAMA, 4096) * est.tokens_per_s / H100.num_gpus
    assert est.tflops_per_gpu == pytest.approx(per_gpu / 1e12)
    assert est.mfu == pytest.approx(per_gpu / H100.bf16_flops)
    assert 0 < est.mfu < 1


def test_stage_table_prices_each_communication() -> None:
    """The per-stage table against the collectives priced directly: pipeline sends, the
    gradient all-reduce (ZeRO-0) vs reduce-scatter (ZeRO-1), and MoE all-to-alls (4 per MoE
    layer per micro-batch, and 2 more when recompute re-runs the layer)."""
    from planner.costs.comm import Network, group, moe_dispatch_bytes
    from planner.costs.memory import shard_of
    from planner.costs.timing import stage_times

    net = Network.of(H100)
    layout = Layout.uniform(LLAMA, pp=2, dp=32, zero=0)
    t0 = stage_times(LLAMA, H100, JOB, layout, net)
    hop = net.p2p_time(4096 * LLAMA.hidden_size * 2, 0, 32)  # stage 0 on rank 0, stage 1 on 32
    assert t0[0].p2p == pytest.approx(hop) and t0[1].p2p_back == pytest.approx(hop)
    assert t0[1].p2p == 0 and t0[0].p2p_back == 0
    t1 = stage_times(LLAMA, H100, JOB, layout.model_copy(update={"zero": 1}), net)
    # dp=32 spans 4 nodes: hierarchical, and still an all-reduce is two reduce-scatters.
    assert t0[0].grad_sync == pytest.approx(2 * t1[0].grad_sync)

    mixtral = planner.load_model("mixtral-8x7b")
    moe = Layout.uniform(mixtral, pp=2, dp=32, ep=8)
    (st,) = stage_times(mixtral, H100, JOB, moe, net)[:1]
    one = net.all_to_all_time(moe_dispatch_bytes(mixtral, shard_of(JOB, moe)), group(moe, "ep", 0))
    layers = mixtral.num_layers // 2
    assert st.a2a_fwd == pytest.approx(2 * layers * one)
    assert st.a2a_bwd == pytest.approx(2 * layers * one)
    full = Layout.uniform(mixtral, pp=2, dp=32, ep=8, recompute="full")
    (rerun,) = stage_times(mixtral, H100, JOB, full, net)[:1]
    assert rerun.a2a_bwd == pytest.approx(4 * layers * one)


def test_pipeline_sends_are_exposed_on_the_critical_rank() -> None:
    """1F1B sends block (Megatron-LM waits for each send-receive pair): with two stages the
    critical rank sends one tensor per micro-batch, its output or its input gradient."""
    from planner.costs.comm import Network

    layout = Layout.uniform(LLAMA, pp=2, dp=32)
    est = step(layout)
    hop = Network.of(H100).p2p_time(4096 * LLAMA.hidden_size * 2, 0, 32)
    assert est.breakdown["pipeline_p2p"] == pytest.approx(est.num_microbatches * hop)


def test_ops_carry_their_sends_unless_overlapped() -> None:
    from planner.costs.comm import Network
    from planner.costs.timing import op_parts, stage_times

    layout = Layout.uniform(LLAMA, pp=4, dp=16, tp=1)
    mid = stage_times(LLAMA, H100, JOB, layout, Network.of(H100))[1]
    assert op_parts(mid, "F").p2p == pytest.approx(mid.p2p) and mid.p2p > 0
    assert op_parts(mid, "BW").p2p == pytest.approx(mid.p2p_back) and mid.p2p_back > 0
    assert op_parts(mid, "B").p2p == pytest.approx(mid.p2p_back)
    assert op_parts(mid, "W").p2p == 0
    assert op_parts(mid, "F", overlapped=True).p2p == 0


def test_full_recompute_repeats_the_whole_forward_with_its_tp_collectives() -> None:
    from planner.costs.comm import Network
    from planner.costs.timing import stage_times

    layout = Layout.uniform(LLAMA, pp=4, dp=2, tp=8, recompute="full")
    st = stage_times(LLAMA, H100, JOB, layout, Network.of(H100))[1]  # layers only
    assert st.tp_fwd > 0
    assert st.recompute == pytest.approx(st.fwd)


def test_overlapped_pairs_lose_the_communication_sms() -> None:
    """A DualPipe pair hides its all-to-alls, but the communication kernels hold 20 of the
    132 SMs meanwhile (DeepSeek-V3 report section 3.2.2): compute-bound pairs take
    work / (1 - 20/132); communication-bound pairs take the communication time."""
    from dataclasses import replace

    from planner.costs.comm import Network
    from planner.costs.timing import op_parts, pair_parts, stage_times

    mixtral = planner.load_model("mixtral-8x7b")
    layout = Layout.uniform(mixtral, pp=4, dp=16, ep=8, schedule="dualpipe")
    st = stage_times(mixtral, H100, JOB, layout, Network.of(H100))[1]
    work = op_parts(st, "F", overlapped=True).total + op_parts(st, "BW", overlapped=True).total
    light = replace(st, a2a_fwd=1e-6, a2a_bwd=1e-6, p2p=0.0, p2p_back=0.0)
    assert pair_parts(light, light, "BW").total == pytest.approx(work / (1 - 20 / 132))
    heavy = replace(st, a2a_fwd=work, a2a_bwd=work, p2p=0.0, p2p_back=0.0)
    assert pair_parts(heavy, heavy, "BW").total == pytest.approx(2 * work)
    assert pair_parts(heavy, heavy, "BW").a2a == pytest.approx(work)
