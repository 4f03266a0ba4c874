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


def test_tensor_parallel_across_nodes_is_costed_over_infiniband() -> None:
    """Teams have run TP16 on 8-GPU nodes (vTrain's multi-node set): evaluate costs it, its
    collectives crossing InfiniBand, so each costs more than within a node's NVLink."""
    gpt = planner.load_model("gpt3-175b")  # 96 heads: tp16 divides them (Llama's 8 KV do not)
    job = planner.TrainingJob(seq_len=2048, global_batch=64, framework="deepspeed")
    cluster = planner.load_cluster("h100", gpus=64)

    def per_microbatch(tp: int, dp: int) -> float:
        est = planner.evaluate(gpt, cluster, job, Layout.uniform(gpt, tp=tp, pp=4, dp=dp))
        assert est.breakdown["tp_comm"] > 0
        return est.breakdown["tp_comm"] / est.num_microbatches

    # the same layers per rank and the same activations per collective: across two nodes
    # each collective crosses InfiniBand, so it takes longer than within one over NVLink
    assert per_microbatch(16, 1) > 1.5 * per_microbatch(8, 2)


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
    assert t0[0].p2p.seconds == pytest.approx(hop) and t0[1].p2p_back.seconds == pytest.approx(hop)
    assert t0[1].p2p.seconds == 0 and t0[0].p2p_back.seconds == 0
    # Ranks 0 and 32 sit on different nodes: the send keeps the InfiniBand share busy.
    assert t0[0].p2p.ib == pytest.approx(hop) and t0[0].p2p.nvlink == 0
    t1 = stage_times(LLAMA, H100, JOB, layout.model_copy(update={"zero": 1}), net)
    # dp=32 spans 4 nodes: hierarchical, and an all-reduce moves the bytes of two
    # reduce-scatters; the reduce-scatter alone runs as a ring, whose latency per step makes
    # it a little longer than half the all-reduce (a tree across nodes).
    assert t0[0].grad_sync.seconds == pytest.approx(2 * t1[0].grad_sync.seconds, rel=1e-3)
    assert t1[0].grad_sync.seconds > t0[0].grad_sync.seconds / 2
    assert t1[0].grad_sync.ib > 0 and t1[0].grad_sync.nvlink > 0

    mixtral = planner.load_model("mixtral-8x7b")
    moe = Layout.uniform(mixtral, pp=2, dp=32, ep=8)
    (st,) = stage_times(mixtral, H100, JOB, moe, net)[:1]
    one = net.all_to_all_time(moe_dispatch_bytes(mixtral, shard_of(JOB, moe)), group(moe, "ep", 0))
    layers = mixtral.num_layers // 2
    assert st.a2a_fwd.seconds == pytest.approx(2 * layers * one)
    assert st.a2a_bwd.seconds == pytest.approx(2 * layers * one)
    full = Layout.uniform(mixtral, pp=2, dp=32, ep=8, recompute="full")
    (rerun,) = stage_times(mixtral, H100, JOB, full, net)[:1]
    assert rerun.a2a_bwd.seconds == pytest.approx(4 * layers * one)


def test_pipeline_sends_are_exposed_on_the_critical_rank() -> None:
    """1F1B sends block (Megatron-LM waits for each send-receive pair): with two stages the
    critical rank sends one tensor per micro-batch, its output or its input gradient."""
    from planner.costs.comm import Network

    layout = Layout.uniform(LLAMA, pp=2, dp=32)
    est = step(layout)
    hop = Network.of(H100).p2p_time(4096 * LLAMA.hidden_size * 2, 0, 32)
    assert est.breakdown["pipeline_p2p"] == pytest.approx(est.num_microbatches * hop)


def test_ops_carry_their_sends_in_series() -> None:
    """A forward's length includes the send of its output, a backward's the send of its
    input gradient; a weight-gradient op sends nothing."""
    from planner.costs.comm import Network
    from planner.costs.overlap import OVERLAPS, task_parts, task_time, values
    from planner.costs.timing import stage_times

    layout = Layout.uniform(LLAMA, pp=4, dp=16, tp=1)
    times = stage_times(LLAMA, H100, JOB, layout, Network.of(H100))
    mid, val, over = times[1], values(times), OVERLAPS["megatron"]
    assert mid.p2p.seconds > 0 and mid.p2p_back.seconds > 0
    assert task_time(("F", 1), val, over) == pytest.approx(mid.fwd + mid.p2p.seconds)
    assert task_time(("B", 1), val, over) == pytest.approx(mid.bwd_input + mid.p2p_back.seconds)
    assert task_time(("W", 1), val, over) == pytest.approx(mid.bwd_weight)
    parts = task_parts(("BW", 1), times, task_time(("BW", 1), val, over))
    assert parts.p2p == pytest.approx(mid.p2p_back.seconds)


def test_full_recompute_repeats_the_whole_forward_with_its_tp_collectives() -> None:
    from planner.costs.comm import Network
    from planner.costs.timing import stage_times

    layout = Layout.uniform(LLAMA, pp=4, dp=2, tp=8, recompute="full")
    st = stage_times(LLAMA, H100, JOB, layout, Network.of(H100))[1]  # layers only
    assert st.tp_fwd > 0
    assert st.recompute == pytest.approx(st.fwd)


@pytest.mark.parametrize("hidden", [1.0, 0.49, 0.0])
def test_a_dualpipe_pair_hides_each_chunks_communication_behind_the_other_only(
    hidden: float,
) -> None:
    """A DualPipe pair runs one micro-batch's forward chunk beside another's backward chunk
    (DeepSeek-V3 report section 3.2.1): with little communication the pair takes the two
    chunks' compute, slowed while the communication kernels hold 20 of the 132 SMs (section
    3.2.2), and the share of the communication the runtime does not hide
    (``Overlap.pair_hidden``: all of it where the pair's halves run in turn); with much,
    each chunk's own communication stays in series with its own compute, so the pair lasts
    at least the longer chunk-plus-its-communication."""
    from dataclasses import replace

    from planner.costs.comm import Network, Transfer
    from planner.costs.overlap import OVERLAPS, task_time, values
    from planner.costs.timing import stage_times

    mixtral = planner.load_model("mixtral-8x7b")
    layout = Layout.uniform(mixtral, pp=4, dp=16, ep=8, schedule="dualpipe")
    times = stage_times(mixtral, H100, JOB, layout, Network.of(H100))
    st = times[1]
    none = Transfer(0.0, 0.0, 0.0)

    def pair(fwd_comm: float, bwd_comm: float) -> float:
        t = replace(
            st,
            a2a_fwd=Transfer(fwd_comm, fwd_comm, 0.0),
            a2a_bwd=Transfer(bwd_comm, 0.0, bwd_comm),
            p2p=none,
            p2p_back=none,
        )
        changed = [t if x.stage == 1 else x for x in times]
        runtime = replace(OVERLAPS["megatron"], pair_hidden=hidden)
        return task_time(("pair", 1, 1, "BW"), values(changed), runtime)

    compute = st.fwd + st.bwd_input + st.bwd_weight
    light = 1e-4
    # DeepSeek-V3 report section 3.2.2: the communication kernels hold 20 of the H800's 132
    # SMs (the H100 here has as many) while the paired chunks compute.
    exposed = hidden * 20 / 132 + (1 - hidden)
    assert pair(light, light) == pytest.approx(compute + exposed * 2 * light)
    heavy = 2 * compute
    if hidden == 1.0:
        # Each chunk waits for its own all-to-alls: the forward chunk's, the longer, binds.
        assert pair(heavy, light) == pytest.approx(st.fwd + heavy)
        assert pair(light, heavy) == pytest.approx(st.bwd_input + st.bwd_weight + heavy)
    if hidden == 0.0:  # the halves in turn: everything in series
        assert pair(heavy, light) == pytest.approx(compute + heavy + light)


def test_tensor_parallel_overlap_follows_the_framework() -> None:
    """Megatron-LM's --tp-comm-overlap and torchtitan's async TP hide tensor-parallel
    collectives behind the GEMMs, except one step of tp (the ring exchange) or one of four
    splits (the pipelined reduce-scatter); DeepSpeed and eager PyTorch leave them exposed.
    torchtitan's async TP hides only its fitted share of that (Framework.tp_overlap_hidden)."""
    from planner import frameworks

    layout = Layout.uniform(LLAMA, tp=8, dp=8)
    exposed = {
        f: step(layout, JOB.model_copy(update={"framework": f})).breakdown["tp_comm"]
        for f in ("megatron", "torchtitan", "deepspeed", "torch")
    }
    assert exposed["deepspeed"] == pytest.approx(exposed["torch"])
    assert exposed["megatron"] < exposed["torchtitan"] < exposed["deepspeed"]
    # With all of it hidden: one step in 8 at least; more only where a block has less
    # compute than communication (the embedding's lookup reduction hides behind nothing).
    entry = frameworks.framework("torchtitan")
    with frameworks.replaced("torchtitan", tp_overlap_hidden=1.0):
        job = JOB.model_copy(update={"framework": "torchtitan"})
        full = step(layout, job).breakdown["tp_comm"]
    assert exposed["deepspeed"] / 8 <= full < exposed["deepspeed"] / 4
    assert full < exposed["megatron"]
    # the share hidden: what full hiding would hide, times the registry's share
    hidden = entry.tp_overlap_hidden
    assert exposed["torchtitan"] == pytest.approx(
        exposed["deepspeed"] - hidden * (exposed["deepspeed"] - full), rel=1e-6
    )
    no_sp = layout.model_copy(update={"sequence_parallel": False})
    # Megatron-LM overlaps only with sequence parallelism.
    megatron = JOB.model_copy(update={"framework": "megatron"})
    assert step(no_sp, megatron).breakdown["tp_comm"] > exposed["megatron"]


def test_overlapped_communication_takes_a_share_of_the_gpus_own_sms() -> None:
    """NCCL's 16 CTAs (NVIDIA/nccl#689) and DualPipe's 20 communication SMs (DeepSeek-V3
    report section 3.2.2) are whole SMs: a share of 132 on an H100, of 108 on an A100
    (A100 whitepaper: 108 SMs on the SXM4 part)."""
    from planner.costs.overlap import nccl_share, overlap_of, paired_share

    job = planner.TrainingJob(seq_len=4096, global_batch=64)
    h100 = overlap_of(job, planner.load_cluster("h100", gpus=8))
    a100 = overlap_of(job, planner.load_cluster("a100", gpus=8))
    assert nccl_share(h100) == pytest.approx(16 / 132)
    assert paired_share(h100) == pytest.approx(20 / 132)
    assert nccl_share(a100) == pytest.approx(16 / 108)
    assert paired_share(a100) == pytest.approx(20 / 108)
