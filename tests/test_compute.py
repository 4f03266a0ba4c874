"""Compute time per kind of work: the roofline's rules, each against the catalog's figures."""

from __future__ import annotations

import pytest

import planner
from planner.costs.compute import TILE_ROWS, Rates, expert_efficiency, work_time
from planner.costs.work import Work
from planner.errors import PlannerError

H800 = planner.load_cluster("h800", gpus=8)
A100 = planner.load_cluster("a100", gpus=8)
JOB = planner.TrainingJob(seq_len=4096, global_batch=8)
FP8 = JOB.model_copy(update={"compute_dtype": "fp8"})


def test_gemm_runs_at_the_achieved_share_of_peak() -> None:
    rates = Rates.of(H800, JOB)
    seconds = work_time(Work(gemm=1e15), rates)
    assert seconds == pytest.approx(1e15 / (H800.bf16_flops * H800.achieved["gemm"]))


def test_fp8_gemms_use_the_fp8_peak_and_attention_stays_bf16() -> None:
    bf16, fp8 = Rates.of(H800, JOB), Rates.of(H800, FP8)
    gemm = Work(gemm=1e15)
    assert work_time(gemm, bf16) / work_time(gemm, fp8) == pytest.approx(
        H800.fp8_flops / H800.bf16_flops  # type: ignore[operator]
    )
    attention = Work(attention=1e15)
    assert work_time(attention, fp8) == pytest.approx(work_time(attention, bf16))


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
    assert work_time(
        Work(kernels=10), Rates.of(H800.model_copy(update={"kernel_overhead_s": 5e-6}), JOB)
    ) == pytest.approx(5e-5)
    small = Work(gemm=1e6, kernels=10)  # microseconds of GPU work: the host's 200 us bind
    assert work_time(small, rates) == pytest.approx(10 * 20e-6)
    big = Work(gemm=1e14, kernels=10)  # the GPU's work dominates; the host hides behind it
    assert work_time(big, rates) == pytest.approx(1e14 / rates.gemm_flops + 10 * 5e-6)


def test_expert_gemms_pay_for_whole_tiles() -> None:
    rates = Rates.of(H800, JOB)
    full = expert_efficiency(8 * TILE_ROWS, rates)
    assert full == pytest.approx(1.0)
    # Half a tile of tokens computes a whole tile: half the efficiency (if not weight-bound).
    half = expert_efficiency(TILE_ROWS / 2, rates)
    roofline = min(1.0, 2 * TILE_ROWS / 2 / 2 * rates.memory_Bps / rates.gemm_flops)
    assert half == pytest.approx(0.5 * roofline)


def test_few_tokens_per_expert_are_bound_by_reading_the_weights() -> None:
    """With m tokens an expert GEMM does 2m FLOPs per weight element it reads (BF16: 2 bytes):
    below the ridge point its rate is m x HBM bandwidth, not the tensor-core peak."""
    rates = Rates.of(H800, JOB)
    m = TILE_ROWS  # a full tile, so only the roofline limits it
    assert expert_efficiency(m, rates) == pytest.approx(m * rates.memory_Bps / rates.gemm_flops)
    values = [expert_efficiency(k * TILE_ROWS, rates) for k in range(1, 40)]
    assert values == sorted(values)  # more tokens per expert never lowers the efficiency
