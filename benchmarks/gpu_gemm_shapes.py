"""BF16 GEMM rates at the shapes of ``planner validate --set one-gpu`` (Llama 3 8B's layer
and output layer, sequence 4,096, micro-batch 1-8), each of a linear's three GEMMs
(forward Y = X W^T, input gradient dX = dY W, weight gradient dW = dY^T X), as cuBLAS runs
them through ``torch.matmul``: median of 10 timed calls after 3 warm-ups (CUDA events), on
random data. The rate per shape is what a GEMM-rate model by shape would be checked
against; the cost model's is one fraction of peak for every shape (``achieved.gemm``).

Usage: ``python benchmarks/gpu_gemm_shapes.py [--peak TFLOPS]`` (default 989, an H100/H200
SXM's dense BF16). Needs a CUDA GPU.
"""

from __future__ import annotations

import statistics
import sys

import torch

# (name, in features, out features) of Llama 3 8B's linears (GQA: q 4,096 + k and v 1,024)
LINEARS = (
    ("qkv", 4096, 6144),
    ("attention out", 4096, 4096),
    ("gate or up", 4096, 14336),
    ("down", 14336, 4096),
    ("output layer", 4096, 128256),
)


def _time(a: torch.Tensor, b: torch.Tensor) -> float:
    """Median seconds of ``a @ b``."""
    for _ in range(3):
        torch.matmul(a, b)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    peak = float(sys.argv[sys.argv.index("--peak") + 1]) if "--peak" in sys.argv else 989.0
    dev, dt = "cuda", torch.bfloat16
    print(f"{'linear':14s} {'mb':>3s} {'M':>6s} {'fwd TF/s':>9s} {'dX TF/s':>9s} {'dW TF/s':>9s}")
    for name, k, n in LINEARS:
        w = torch.randn(n, k, device=dev, dtype=dt)
        for mb in (1, 2, 4, 8):
            m = 4096 * mb
            x = torch.randn(m, k, device=dev, dtype=dt)
            dy = torch.randn(m, n, device=dev, dtype=dt)
            flops = 2.0 * m * n * k
            rates = [flops / _time(a, b) / 1e12 for a, b in ((x, w.t()), (dy, w), (dy.t(), x))]
            cells = " ".join(f"{r:9.0f}" for r in rates)
            share = " ".join(f"{r / peak:.3f}" for r in rates)
            print(f"{name:14s} {mb:3d} {m:6d} {cells}   of peak {share}", flush=True)
            del x, dy
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
