"""The device path of ``planner calibrate`` and ``planner validate``: one ``Device`` for CPU
and CUDA, and the one-device sweep (``planner calibrate --sweep``) run on CPU at a tiny
scale. GPU-only checks run where ``torch.cuda.is_available()``."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from planner.catalog import load_model  # noqa: E402
from planner.cli import main  # noqa: E402
from planner.costs.compute import Rates, work_time  # noqa: E402
from planner.costs.work import Gemm, Work  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.run.bench import _solve, gemm_shapes, sweep  # noqa: E402
from planner.run.device import Device  # noqa: E402

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _fa2_flops(seq: int, heads: int, head_dim: int, phase: str) -> float:
    """FlashAttention-2's own count (Dao-AILab/flash-attention,
    benchmarks/benchmark_flash_attention.py, ``flops``): 4 * seqlen^2 * nheads * headdim
    forward, halved when causal; backward 2.5x forward."""
    fwd = 4 * seq**2 * heads * head_dim / 2
    return fwd if phase == "fwd" else 2.5 * fwd


@pytest.fixture(scope="module")
def cpu_sweep():  # type: ignore[no-untyped-def]
    return sweep(Device.of("cpu"), scale=1 / 256, repeat=1)


def test_cpu_sweep_rows_have_rates_and_errors(cpu_sweep) -> None:  # type: ignore[no-untyped-def]
    s = cpu_sweep
    assert (s.device, s.dtype, s.scale) == ("cpu", "fp32", 1 / 256)
    assert {g.tp for g in s.gemm} == {1, 2, 4, 8}
    assert {g.model for g in s.gemm} == {"llama3-8b", "llama3-70b", "deepseek-v3"}
    for row in (*s.gemm, *s.attention):
        assert row.flops_per_s > 0 and math.isfinite(row.error)
    assert all(m.bytes_per_s > 0 and math.isfinite(m.error) for m in s.memory)
    for a in s.attention:
        assert a.flops == pytest.approx(_fa2_flops(a.seq_len, a.heads, a.head_dim, a.phase))
    assert len(s.blocks) == 4 * (2 + 2 + 1)  # 4 recompute choices x micro-batch sizes
    for b in s.blocks:
        assert b.fwd_s > 0 and b.bwd_s > 0 and b.reserved_bytes is None
        assert math.isfinite(b.fwd_error) and math.isfinite(b.bwd_error)
        # What the cost model leaves out is per token (RMSNorm's inverse RMS, the MoE row
        # map): the real layer keeps a little more, never less.
        assert -0.03 < b.kept_error <= 0
        assert b.peak_bytes >= b.kept_bytes
        if b.recompute == "full":  # only the output is left: the size of the kept input
            assert b.kept_bytes == b.predicted_kept_bytes
    kept = {(b.model, b.micro_batch, b.recompute): b.kept_bytes for b in s.blocks}
    for model, mb, ffn in (("llama3-8b", 1, "mlp"), ("deepseek-v3", 1, "moe")):
        order = [kept[(model, mb, c)] for c in ("none", "selective", ffn, "full")]
        assert order == sorted(order, reverse=True) and order[0] > order[-1]
    assert "layernorm" in s.not_run["llama3-8b layer.0"]
    assert s.model_validate_json(s.model_dump_json()) == s


def test_gemm_shapes_split_the_tensor_parallel_dimension() -> None:
    """Llama 3 8B's config.json (hidden 4096, 32 heads of 128, 8 KV heads, FFN 14336) and
    DeepSeek-V3's (256 experts of 2048, top 8) at tp 2, 8192 and 4096 tokens."""
    shapes = dict(gemm_shapes(load_model("llama3-8b"), 2, 8192))
    assert shapes["qkv"] == Gemm(8192, (32 + 2 * 8) * 128 / 2, 4096)
    assert shapes["o_proj"] == Gemm(8192, 4096, 32 * 128 / 2)
    assert shapes["fc1 (gate+up)"] == Gemm(8192, 14336, 4096)
    assert shapes["fc2 (down)"] == Gemm(8192, 4096, 7168)
    experts = dict(gemm_shapes(load_model("deepseek-v3"), 2, 4096))["experts fc1"]
    # 64-way expert parallelism: 4 experts per rank, 4096 x 8 x 64 / 256 rows each
    assert experts == Gemm(8192, 2048, 7168, 4)


def test_rate_fit_recovers_the_rate_that_made_the_times() -> None:
    rates = Rates(5e10, 2e10, 1e10, 2e-6, 0.0, 4)
    works = [Work(gemm=g.flops, kernels=1, shapes=((g, 1.0),)) for g in (Gemm(64, 96, 32),)]
    works.append(Work(gemm=Gemm(512, 256, 128).flops, kernels=1))

    def total(r: float) -> float:
        return sum(work_time(w, replace(rates, gemm_flops=r)) for w in works)

    assert _solve(total, total(5e10)) == pytest.approx(5e10, rel=1e-6)


def test_cuda_without_a_gpu_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PlannerError) as err:
        Device.of("cuda")
    assert str(err.value).startswith("--device=cuda:") and "\n" not in str(err.value)
    with pytest.raises(PlannerError, match="--device='tpu'"):
        Device.of("tpu")


@pytest.mark.parametrize(
    "argv",
    [
        ["calibrate", "--device", "cuda"],
        ["calibrate", "--sweep", "--device", "cuda"],
        ["validate", "--device", "cuda", "--only", "9"],
    ],
)
def test_cli_device_cuda_without_a_gpu_exits_2(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("planner: --device=cuda") and "\n" not in err


def test_cpu_memory_watch_reads_live_bytes_and_no_reserved() -> None:
    cpu = Device.of("cpu")
    assert (cpu.backend, cpu.dtype) == ("gloo", torch.float32)
    before = torch.ones(1000)
    with cpu.memory() as watch:
        watch.include(before)
        a = torch.empty(2000)
        b = torch.empty(500)
        del b
        assert watch.allocated() - watch.base == 8000
    assert watch.peak_allocated() - watch.base == 10000
    assert watch.peak_reserved() is None
    del a


@GPU
def test_cuda_sweep_reads_allocated_and_reserved() -> None:
    s = sweep(Device.of("cuda"), scale=1 / 16, repeat=2)
    assert s.dtype == "bf16" and s.rates["sm_count"]
    for b in s.blocks:
        assert b.reserved_bytes is not None and b.reserved_bytes >= b.peak_bytes > 0
        assert abs(b.kept_error) < 0.05


@GPU
def test_cuda_validate_runs_one_rank_on_nccl() -> None:
    from planner.run.validate import compare, small_job, validation_set

    model, layout = validation_set()[9]  # one rank, MoE recompute
    (entry,) = compare(model, small_job(dtype="bf16"), layout, steps=1, device=Device.of("cuda"))
    assert entry.reserved_peak_bytes is not None
    assert entry.reserved_peak_bytes >= entry.allocated_peak_bytes >= entry.measured_peak_bytes
    assert abs(entry.peak_error) < 0.05
