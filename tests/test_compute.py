"""Compute time per kind of work: the roofline's rules, each against the catalog's figures."""

from __future__ import annotations

import pytest

import planner
from planner.costs.compute import OUT_BYTES, TILE, Rates, gemm_seconds, work_time
from planner.costs.work import Gemm, Work
from planner.errors import PlannerError

H800 = planner.load_cluster("h800", gpus=8)
A100 = planner.load_cluster("a100", gpus=8)
JOB = planner.TrainingJob(seq_len=4096, global_batch=8)


def gemm_efficiency(g: Gemm, rates: Rates) -> float:
    """Fraction of the achieved GEMM rate shape ``g`` reaches."""
    return g.flops / rates.gemm_flops / gemm_seconds(g, rates)


FP8 = JOB.model_copy(update={"compute_dtype": "fp8"})


def test_gemm_runs_at_the_achieved_share_of_peak() -> None:
    rates = Rates.of(H800, JOB, sustained=False)
    seconds = work_time(Work(gemm=1e15), rates)
    assert seconds == pytest.approx(1e15 / (H800.bf16_flops * H800.achieved["gemm"]))


def test_a_training_run_slows_tensor_core_work_alone_to_its_sustained_rate() -> None:
    """At the power limit the SM clock drops under tensor-core load: GEMMs (BF16 and FP8) and
    attention run at ``sustained_tensor_rate`` of a short timing's rate, memory-bound kernels
    and launches as before; a GPU with no measurement is not slowed."""
    assert H800.sustained_tensor_rate < 1  # measured on the same die (h800.yaml's source)
    for job in (JOB, FP8):
        short, run = Rates.of(H800, job, sustained=False), Rates.of(H800, job)
        for work in (Work(gemm=1e15), Work(attention=1e15)):
            assert work_time(work, run) == pytest.approx(
                work_time(work, short) / H800.sustained_tensor_rate
            )
        for work in (Work(memory=1e12), Work(kernels=100)):
            assert work_time(work, run) == pytest.approx(work_time(work, short))
    assert A100.sustained_tensor_rate == 1
    assert Rates.of(A100, JOB) == Rates.of(A100, JOB, sustained=False)


def test_fp8_gemms_use_the_fp8_peak_at_their_own_fraction_and_attention_stays_bf16() -> None:
    bf16, fp8 = Rates.of(H800, JOB), Rates.of(H800, FP8)
    gemm = Work(gemm=1e15)
    assert work_time(gemm, bf16) / work_time(gemm, fp8) == pytest.approx(
        H800.fp8_flops * H800.achieved["gemm_fp8"] / (H800.bf16_flops * H800.achieved["gemm"])  # type: ignore[operator]
    )
    # measured on Hopper: per-tensor-scaled FP8 GEMMs keep less of their peak than BF16's
    assert H800.achieved["gemm_fp8"] < H800.achieved["gemm"]
    attention = Work(attention=1e15)
    assert work_time(attention, fp8) == pytest.approx(work_time(attention, bf16))


def test_fp8_gemms_fall_back_to_the_bf16_fraction_where_none_was_measured() -> None:
    achieved = {k: v for k, v in H800.achieved.items() if k != "gemm_fp8"}
    cluster = H800.model_copy(update={"achieved": achieved})
    gemm = Work(gemm=1e15)
    assert work_time(gemm, Rates.of(cluster, JOB)) / work_time(
        gemm, Rates.of(cluster, FP8)
    ) == pytest.approx(H800.fp8_flops / H800.bf16_flops)  # type: ignore[operator]


def test_fp8_on_a_gpu_without_fp8_is_a_user_error() -> None:
    with pytest.raises(PlannerError, match=r"compute_dtype='fp8'.*a100 has no FP8"):
        Rates.of(A100, FP8)


def test_memory_bound_work_runs_at_hbm_bandwidth() -> None:
    rates = Rates.of(H800, JOB)
    expected = 1e12 / (H800.hbm_bandwidth_Bps * H800.achieved["memory_bound"])
    assert work_time(Work(memory=1e12), rates) == pytest.approx(expected)


def test_each_kernel_costs_its_overhead_and_the_host_can_bind() -> None:
    cluster = H800.model_copy(update={"kernel_overhead_s": 5e-6, "host_overhead_s": 20e-6})
    rates = Rates.of(cluster, JOB)
    no_host = H800.model_copy(update={"kernel_overhead_s": 5e-6, "host_overhead_s": 0.0})
    assert work_time(Work(kernels=10), Rates.of(no_host, JOB)) == pytest.approx(5e-5)
    small = Work(gemm=1e6, kernels=10)  # microseconds of GPU work: the host's 200 us bind
    assert work_time(small, rates) == pytest.approx(10 * 20e-6)
    big = Work(gemm=1e14, kernels=10)  # the GPU's work dominates; the host hides behind it
    assert work_time(big, rates) == pytest.approx(1e14 / rates.gemm_flops + 10 * 5e-6)


def test_a_large_aligned_gemm_runs_at_the_achieved_rate_but_for_its_epilogue() -> None:
    """132 x 8 tiles of 128 x 128, k deep: 8 full waves, each tile's k-loop at an SM's share of
    the rate, then its output tile written at an SM's share of the memory-bound rate."""
    rates = Rates.of(H800, JOB)
    k = 8192
    g = Gemm(TILE * 132, TILE * 8, k)
    main = 2 * TILE * TILE * k / rates.gemm_flops
    epilogue = TILE * TILE * OUT_BYTES / rates.memory_Bps
    assert gemm_seconds(g, rates) == pytest.approx(8 * 132 * (main + epilogue))
    assert gemm_efficiency(g, rates) == pytest.approx(main / (main + epilogue))
    assert 0.9 < gemm_efficiency(g, rates) < 1.0


def test_tiles_and_waves_quantise() -> None:
    rates = Rates.of(H800, JOB)
    k = 16384  # deep enough that the tiles' k-loops, not reading the inputs, set the time
    one_wave = gemm_seconds(Gemm(TILE * 12, TILE * 11, k), rates)  # 132 tiles on 132 SMs
    # one more row is a row of 11 tiles more, and 143 tiles over 132 SMs take a second wave
    assert gemm_seconds(Gemm(TILE * 12 + 1, TILE * 11, k), rates) == pytest.approx(2 * one_wave)
    # without an SM count (a CPU profile): the FLOPs at the rate, no tiles, no waves
    flat = Rates.of(H800.model_copy(update={"sm_count": None}), JOB)
    g = Gemm(TILE * 12 + 1, TILE * 11, k)
    assert gemm_seconds(g, flat) == pytest.approx(g.flops / flat.gemm_flops)


def test_few_tokens_per_expert_are_bound_by_reading_the_weights() -> None:
    """With m tokens an expert GEMM does 2m FLOPs per weight element it reads: below the
    ridge point its time is reading the weights at the memory-bound rate, whatever m is."""
    rates = Rates.of(H800, JOB)
    n, k, experts = 4096, 7168, 8
    few = Gemm(16, n, k, experts)
    weights = experts * n * k * rates.weight_bytes
    assert gemm_seconds(few, rates) == pytest.approx(
        (weights + experts * 16 * (k + n) * 2) / rates.memory_Bps, rel=0.01
    )
    values = [gemm_efficiency(Gemm(m, n, k, experts), rates) for m in (16, 64, 256, 1024, 4096)]
    assert values == sorted(values)  # more tokens per expert never lowers the efficiency


def test_work_prices_each_shape_and_the_rest_flat() -> None:
    rates = Rates.of(A100, JOB)
    g = Gemm(1000, 3000, 500)
    shaped = Work(gemm=g.flops + 1e12, kernels=1, shapes=((g, 1.0),))
    expected = gemm_seconds(g, rates) + 1e12 / rates.gemm_flops + rates.kernel_s
    assert work_time(shaped, rates) == pytest.approx(expected)
    assert (shaped + shaped).shapes == ((g, 2.0),)


def test_fused_attention_slows_with_short_causal_sequences_and_small_heads() -> None:
    from planner.costs.work import flash_overhead

    assert flash_overhead(1 << 20, 128, causal=False) == pytest.approx(0.0, abs=1e-3)
    for s in (512, 2048, 8192):
        assert flash_overhead(s, 128, causal=True) > flash_overhead(s, 128, causal=False)
        assert flash_overhead(s, 64, causal=True) > flash_overhead(s, 128, causal=True)
    assert flash_overhead(512, 128, causal=True) > flash_overhead(8192, 128, causal=True)


def test_attention_shape_against_held_out_flashattention2_h100() -> None:
    """FlashAttention-2 README, H100 80GB SXM5 forward+backward, head dim 128, causal (rows the
    shape constants were not fitted on): 163 TFLOP/s at sequence 512, 328 at 16k: the
    short sequence runs at 0.497 of the long one's rate."""
    from planner.costs.work import flash_overhead

    ratio = (1 + flash_overhead(16384, 128, causal=True)) / (
        1 + flash_overhead(512, 128, causal=True)
    )
    assert ratio == pytest.approx(163 / 328, rel=0.10)


def test_fp8_linears_pay_their_casts_and_the_router_and_head_do_not() -> None:
    """Each FP8 linear casts its input (forward) and output gradient (backward) to FP8 in
    both layouts: 4 bytes moved per element (read BF16, write FP8 twice); BF16 jobs do not."""
    from planner.costs.blocks import FP8_CAST_BYTES, Shard, block_cost

    model = planner.load_model("llama3-8b")
    bf16 = block_cost(model, "layer.0", Shard(seq_len=1024))
    fp8 = block_cost(model, "layer.0", Shard(seq_len=1024, fp8=True))
    h, tokens = model.hidden_size, 1024
    # inputs of q, k, v, o, gate+up and down: h, h, h, heads*d, h, ffn wide
    width = model.num_attention_heads * model.head_dim
    inputs = tokens * (3 * h + width + h + model.ffn_hidden_size)
    assert fp8.fwd.memory - bf16.fwd.memory == pytest.approx(FP8_CAST_BYTES * inputs)
    assert fp8.fwd.gemm == bf16.fwd.gemm
    head_bf16 = block_cost(model, "head", Shard(seq_len=1024))
    head_fp8 = block_cost(model, "head", Shard(seq_len=1024, fp8=True))
    assert head_fp8.fwd == head_bf16.fwd


def test_flash_attention_2_runs_at_its_own_fraction_on_hopper_and_at_the_best_elsewhere() -> None:
    # Hopper's FlashAttention-2 reaches a measured fraction well below cuDNN's and FA3's
    fa2 = JOB.model_copy(update={"attention_kernel": "fa2"})
    attention, gemm = Work(attention=1e15), Work(gemm=1e15)
    ratio = work_time(attention, Rates.of(H800, fa2)) / work_time(attention, Rates.of(H800, JOB))
    assert H800.achieved["attention_fa2"] < H800.achieved["attention"]
    assert ratio == pytest.approx(H800.achieved["attention"] / H800.achieved["attention_fa2"])
    assert work_time(gemm, Rates.of(H800, fa2)) == work_time(gemm, Rates.of(H800, JOB))
    # On the A100 FlashAttention-2 is the fastest kernel: no figure of its own, no change
    assert "attention_fa2" not in A100.achieved
    assert work_time(attention, Rates.of(A100, fa2)) == work_time(attention, Rates.of(A100, JOB))


def test_an_unknown_attention_kernel_is_one_line() -> None:
    with pytest.raises(PlannerError, match="attention_kernel='fa3'"):
        planner.TrainingJob(seq_len=4096, global_batch=8, attention_kernel="fa3")


def test_the_plan_says_when_attention_is_priced_as_flash_attention_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from planner.cli import main

    args = ["evaluate", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8"]
    args += ["--seq-len", "4096", "--global-batch", "8", "--tp", "1", "--zero", "3"]
    assert main([*args, "--attention-kernel", "fa2"]) == 0
    assert "(attention as FlashAttention-2)" in capsys.readouterr().out.replace("\n", " ")
    assert main(args) == 0
    assert "FlashAttention-2" not in capsys.readouterr().out


def test_evaluate_says_which_tensor_rate_and_which_norm_it_priced(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The time's text names the sustained tensor rate where the GPU has one measured (and
    says when it has none), and torchtitan's own eager RMSNorm where the job runs it."""
    from planner.cli import main

    args = ["evaluate", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "4096"]
    args += ["--global-batch", "8", "--tp", "1", "--zero", "3"]
    assert main([*args, "--cluster", "h100"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "GEMMs and attention at 0.891 of a short timing's rate" in text
    assert main([*args, "--cluster", "a100"]) == 0
    other = " ".join(capsys.readouterr().out.split())
    assert "a100's slowing at its power limit not measured" in other
    titan = [*args, "--cluster", "h100", "--framework", "torchtitan"]
    assert main([*titan, "--eager-norm"]) == 0
    assert "rotary embedding, its own RMSNorm class (--eager-norm)" in " ".join(
        capsys.readouterr().out.split()
    )
