"""GEMM rates by precision and the cost of launching routed experts one GEMM at a time, on
one CUDA GPU, beside the cost model's figures for the catalog machine named (``--cluster``).

Two questions of the cost model's constants:

- FP8 GEMMs. ``planner.costs.compute`` prices them at the FP8 tensor-core peak times
  ``achieved["gemm_fp8"]`` (which this script's figures set for Hopper), else the BF16
  fraction. Measured: the BF16 rate (``F.linear``) and the FP8 rate (``torch._scaled_mm``,
  E4M3 inputs, BF16 output; per-tensor scales with and without fast accumulation, per-row
  scales, DeepSeek-V3's 1 x 128 / 128 x 128 blocks) at the forward GEMM shapes of one layer
  of Llama 3 70B and of DeepSeek-V3 (``planner.run.bench.gemm_shapes``: one sequence, tp 1
  and 8), and at 8192 x 8192 x 8192.
- Routed experts. ``Framework.expert_gemm_launch_s`` (Megatron-LM with Transformer Engine's
  GroupedLinear: one cuBLAS GEMM per local expert, issued after the host has read the tokens
  per expert) is fitted to measured MoE ladders, not measured. Measured here: one MoE
  layer's expert MLP forward (fc1, SiLU-gated, fc2) over E local experts, (a) as one grouped
  kernel per GEMM (``torch._grouped_mm``) and (b) as PyTorch's eager per-expert loop after
  ``tokens_per_expert.tolist()`` (the host waits for the GPU, then issues 3 kernels an
  expert), wall-clock per forward; the difference per launched GEMM is the host's price of
  the loop on this machine's CPU. Transformer Engine is not installed here, so its own
  descriptor and heuristic work per GEMM is not in the figure: it is a lower bound on the
  fitted constant's mechanism, not a measurement of it.

Run on a CUDA machine: ``python benchmarks/gpu_kernels.py --cluster h200 --out gpu.json``.
Prints one table per question and writes every row as JSON. Without CUDA it says so and
exits 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - depends on the install
    torch = None

from planner.catalog import load_cluster, load_model
from planner.costs.compute import Rates, gemm_seconds
from planner.costs.work import Gemm
from planner.run.bench import gemm_shapes
from planner.run.benchrows import SEQ
from planner.specs import TrainingJob

E4M3_MAX = 448.0


def _events_time(fn: Any, *, inner: int, repeat: int = 7) -> float:
    """Median GPU seconds per call of ``fn``, ``inner`` calls between two events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / inner)
    return statistics.median(times)


def _wall_time(fn: Any, *, repeat: int = 15) -> float:
    """Median wall seconds of one call of ``fn``, the GPU idle before and synchronised after."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _inner(flops: float) -> int:
    """Calls per timing: about 20 ms of work at 500 TFLOP/s, between 3 and 200 calls."""
    return max(3, min(200, round(20e-3 * 500e12 / max(flops, 1.0))))


def _fp8(x: Any, dim: int | None) -> tuple[Any, Any]:
    """E4M3 copy of ``x`` and its float32 scale (per tensor, or per slice along ``dim``)."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = amax.float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def _fp8_operands(x: Any, w: Any) -> list[tuple[str, tuple[Any, Any, Any, Any], bool | None]]:
    """(scaling, (a, scale_a, b, scale_b), fast accumulation) for ``x @ w.T`` in FP8:
    per-tensor scales (Transformer Engine's delayed and current scaling, torchao's default),
    with and without Hopper's fast accumulation (TE and torchao use it in forward GEMMs
    only); per-row scales; DeepSeek-V3's blocks (1 x 128 for activations, 128 x 128 for
    weights, report section 3.3.2), where the shape divides."""
    out = []
    xq, xs = _fp8(x, None)
    wq, ws = _fp8(w, None)
    for fast in (False, True):
        out.append(("tensor", (xq, xs, wq.t(), ws), fast))
    xq, xs = _fp8(x, 1)
    wq, ws = _fp8(w, 1)
    out.append(("row", (xq, xs, wq.t(), ws.t()), False))
    (m, k), n = x.shape, w.shape[0]
    if k % 128 == 0 and n % 128 == 0:
        xb = x.view(m, k // 128, 128)
        xs = xb.abs().amax(-1).float().clamp(min=1e-12) / E4M3_MAX  # (m, k/128)
        xq = (xb.float() / xs[..., None]).to(torch.float8_e4m3fn).view(m, k)
        wb = w.view(n // 128, 128, k // 128, 128)
        ws = wb.abs().amax(dim=(1, 3)).float().clamp(min=1e-12) / E4M3_MAX  # (n/128, k/128)
        wq = (wb.float() / ws[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
        # cuBLAS reads the scales outer-dimension-major: the same values, transposed strides
        xs_t = xs.t().contiguous().t()
        # both scale tensors outer-dimension-major (stride 1 along m and along k / 128), and
        # the weights' scales contiguous instead: which one cuBLAS takes is not documented
        out.append(("block", (xq, xs_t, wq.t(), ws.t()), False))
        out.append(("block2", (xq, xs_t, wq.t(), ws.t().contiguous()), False))
        out.append(("block_v2", (xq, xs_t, wq.t(), ws.t()), None))  # F.scaled_mm
    return out


def _scaled(a: Any, sa: Any, b: Any, sb: Any, fast: bool | None) -> Any:
    if fast is None:  # the recipe-explicit API (PyTorch 2.10 and later)
        kind = F.ScalingType  # type: ignore[attr-defined]
        return F.scaled_mm(  # type: ignore[attr-defined]
            a, b, sa, kind.BlockWise1x128, sb, kind.BlockWise128x128, output_dtype=torch.bfloat16
        )
    return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)


def gemm_rows(cluster_name: str) -> list[dict[str, Any]]:
    cluster = load_cluster(cluster_name, gpus=8)
    bf16 = Rates.of(cluster, TrainingJob(seq_len=4096, global_batch=8), sustained=False)
    fp8 = Rates.of(
        cluster, TrainingJob(seq_len=4096, global_batch=8, compute_dtype="fp8"), sustained=False
    )
    shapes = [("square", "8192^3", 1, Gemm(8192, 8192, 8192))]
    for model in ("llama3-70b", "deepseek-v3"):
        for tp in (1, 8):
            for what, g in gemm_shapes(load_model(model), tp, SEQ[model]):
                if g.groups == 1 and g.n >= 128:
                    shapes.append((model, what, tp, g))
    rows = [_gemm_row(*shape, bf16, fp8) for shape in shapes]
    torch.cuda.empty_cache()
    return rows


def _gemm_row(model: str, what: str, tp: int, g: Gemm, bf16: Rates, fp8: Rates) -> dict[str, Any]:
    m, n, k = int(g.m), int(g.n), int(g.k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    inner = _inner(g.flops)
    row: dict[str, Any] = {"model": model, "gemm": what, "tp": tp, "m": m, "n": n, "k": k}
    row["bf16_s"] = _events_time(lambda: F.linear(x, w), inner=inner)
    row["bf16_model_s"] = gemm_seconds(g, bf16)
    for scaling, (a, sa, b, sb), fast in _fp8_operands(x, w):
        name = f"fp8_{scaling}{'_fast' if fast else ''}_s"
        try:
            row[name] = _events_time(functools.partial(_scaled, a, sa, b, sb, fast), inner=inner)
        except (RuntimeError, TypeError, ValueError, AttributeError) as err:  # not all builds
            row[name] = None
            row[name.replace("_s", "_error")] = str(err).splitlines()[0][:160]
    row["fp8_model_s"] = gemm_seconds(g, fp8)
    return row


def expert_rows(hidden: int, width: int, tokens: int) -> list[dict[str, Any]]:
    """One expert-MLP forward of ``tokens`` rows per expert over E local experts."""
    rows = [_expert_row(hidden, width, tokens, e) for e in (1, 2, 4, 8, 16, 32)]
    torch.cuda.empty_cache()
    return rows


def _expert_row(hidden: int, width: int, tokens: int, experts: int) -> dict[str, Any]:
    counts = torch.full((experts,), tokens, device="cuda", dtype=torch.int64)
    x = torch.randn(experts * tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(experts, 2 * width, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, width, device="cuda", dtype=torch.bfloat16) * 0.02

    def loop() -> Any:
        outs = []
        for e, part in enumerate(torch.split(x, counts.tolist())):  # the host waits here
            gate, up = F.linear(part, w1[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, w2[e]))
        return torch.cat(outs)

    offs = torch.cumsum(counts, 0).to(torch.int32)
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)  # (E, k, n) views, column-major

    def grouped() -> Any:
        h = torch._grouped_mm(x, w1t, offs=offs)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm((F.silu(gate) * up).contiguous(), w2t, offs=offs)

    row: dict[str, Any] = {
        "experts": experts,
        "tokens_per_expert": tokens,
        "hidden": hidden,
        "width": width,
        "gemms_in_loop": 2 * experts,
        "loop_wall_s": _wall_time(loop),
        "loop_gpu_s": _events_time(loop, inner=5),
    }
    try:
        ref = loop()
        got = grouped()
        row["grouped_rel_err"] = float((got - ref).float().norm() / ref.float().norm())
        row["grouped_wall_s"] = _wall_time(grouped)
        row["grouped_gpu_s"] = _events_time(grouped, inner=20)
    except (RuntimeError, TypeError, AttributeError) as err:
        row["grouped_error"] = str(err).splitlines()[0][:160]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", default="h200", help="catalog machine whose rates price rows")
    p.add_argument("--out", default=None, help="write every row as JSON here")
    args = p.parse_args(argv)
    if torch is None or not torch.cuda.is_available():
        print("gpu_kernels: needs PyTorch with a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    gemms = gemm_rows(args.cluster)
    print(f"\nGEMMs (TFLOP/s; model: catalog {args.cluster}, its gemm and gemm_fp8 fractions)")
    cols = ("bf16_s", "bf16_model_s", "fp8_tensor_s", "fp8_tensor_fast_s", "fp8_row_s")
    cols += ("fp8_block_s", "fp8_block2_s", "fp8_block_v2_s", "fp8_model_s")
    print(
        f"{'shape':40} {'bf16':>6} {'model':>6} {'fp8/t':>6} {'t+fast':>6} {'row':>6} "
        f"{'block':>6} {'block2':>6} {'model':>6}"
    )
    for r in gemms:
        f = 2 * r["m"] * r["n"] * r["k"]
        name = f"{r['model']} {r['gemm']} tp{r['tp']} {r['m']}x{r['n']}x{r['k']}"
        rates = [f"{f / r[c] / 1e12:6.0f}" if r.get(c) else "     -" for c in cols]
        print(f"{name[:40]:40} {' '.join(rates)}")
    for key in sorted({k for r in gemms for k in r if k.endswith("_error")}):
        print(f"{key}: {next(r[key] for r in gemms if key in r)}")
    experts = []
    for hidden, width, tokens in ((7168, 2048, 128), (7168, 2048, 1024), (3584, 2560, 512)):
        experts += expert_rows(hidden, width, tokens)
    print("\nExpert MLP forward, per layer (ms): eager per-expert loop vs grouped kernels")
    print(
        f"{'h x w, tokens/expert':24} {'E':>3} {'loop wall':>9} {'loop gpu':>9} "
        f"{'grp wall':>9} {'grp gpu':>9} {'us/GEMM':>8}"
    )
    for r in experts:
        extra = ""
        if "grouped_wall_s" in r:
            per = (r["loop_wall_s"] - r["grouped_wall_s"]) / r["gemms_in_loop"] * 1e6
            extra = f"{r['grouped_wall_s'] * 1e3:9.3f} {r['grouped_gpu_s'] * 1e3:9.3f} {per:8.1f}"
        else:
            extra = r.get("grouped_error", "")
        name = f"{r['hidden']}x{r['width']}, {r['tokens_per_expert']}"
        print(
            f"{name:24} {r['experts']:3d} {r['loop_wall_s'] * 1e3:9.3f} "
            f"{r['loop_gpu_s'] * 1e3:9.3f} {extra}"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "device": props.name,
                    "torch": str(torch.__version__),
                    "cluster": args.cluster,
                    "gemm": gemms,
                    "experts": experts,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
