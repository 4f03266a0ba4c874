"""Fused causal attention at the shapes training runs give one GPU, against the cost model.

``planner.costs.compute`` prices fused attention at the BF16 peak times
``achieved["attention"]`` (the rate at head dimension 128 and long sequences) plus
``planner.costs.work.flash_overhead`` for shorter ones (fitted on A100 FlashAttention-2
tables). The one-device sweep (``planner calibrate --sweep``) times one sequence of 32 heads,
which leaves SMs idle at short sequences. This times what a rank runs: the query heads left
after tensor parallelism (8 to 64, key/value heads an eighth of them, as Llama 3's GQA),
head dimension 128, one micro-batch of 1 or 2 sequences of 2K to 16K tokens, causal, BF16,
forward and forward plus backward, through each of PyTorch's fused backends (FlashAttention
and cuDNN, the one Transformer Engine runs on Hopper), back to back for about 20 ms a timing.

FLOPs as the model counts them (``planner.costs.blocks``): forward 4 b s^2 h d / 2, backward
2.5 times that (the scores recomputed). Prints a table and one JSON line.

Run on a CUDA machine: ``python benchmarks/gpu_attention.py --cluster h200``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from typing import Any

import torch
import torch.nn.functional as F
from gpu_kernels import _events_time
from torch.nn.attention import SDPBackend, sdpa_kernel

from planner.catalog import load_cluster
from planner.costs.compute import Rates, work_time
from planner.costs.work import Work, flash_overhead
from planner.run.benchblocks import job_for

D = 128
HEADS = ((8, 1), (16, 2), (32, 4), (64, 8))
SEQS = (2048, 4096, 8192, 16384)
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def _time(fn: Any) -> float:
    """Median GPU seconds per call, about 20 ms of calls between two events."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    inner = max(1, int(0.02 / max(start.elapsed_time(stop) / 1e3, 1e-6)))
    return _events_time(fn, inner=inner, repeat=5)


def row(
    backend: str, b: int, heads: int, kv: int, seq: int, rates: Rates, peak: float
) -> dict[str, Any]:
    with torch.device("cuda"):
        q = torch.randn(b, heads, seq, D, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, kv, seq, D, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
        grad = torch.randn(b, heads, seq, D, dtype=torch.bfloat16)

    def fwd() -> torch.Tensor:
        with sdpa_kernel(BACKENDS[backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)

    def both() -> None:
        fwd().backward(grad)

    fwd_flops = 4.0 * b * seq * seq * heads * D * 0.5
    extra = flash_overhead(seq, D, causal=True)
    out: dict[str, Any] = {"backend": backend, "b": b, "heads": heads, "kv": kv, "seq": seq}
    try:
        f = _time(fwd)
        t = _time(both)
    except RuntimeError as exc:  # a backend that refuses the shape
        out["error"] = str(exc).splitlines()[0][:120]
        return out
    for phase, flops, seconds in (("fwd", fwd_flops, f), ("bwd", 2.5 * fwd_flops, t - f)):
        work = Work(attention=flops, kernels=1, attention_overhead=flops * extra)
        predicted = work_time(work, rates)
        out[phase] = {
            "s": seconds,
            "tflops": flops / seconds / 1e12,
            "predicted_s": predicted,
            "error": predicted / seconds - 1,
        }
    total = 3.5 * fwd_flops
    out["fwd+bwd_fraction_of_peak"] = total / t / peak
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", default="h200", help="catalog machine to price against")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_attention: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    cluster = load_cluster(args.cluster, gpus=1)
    rows = []
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; priced as {args.cluster}")
    print(
        f"{'backend':7} {'b':>2} {'heads':>6} {'seq':>6} {'fwd TF/s':>9} {'err':>7} "
        f"{'bwd TF/s':>9} {'err':>7} {'f+b/peak':>8}"
    )
    for backend in BACKENDS:
        for heads, kv in HEADS:
            for seq in SEQS:
                for b in (1, 2) if seq == 4096 else (1,):
                    # GPU time only: the timings run back to back, the host ahead of the GPU
                    rates = Rates.of(cluster, job_for(seq, "bf16", micro_batch=b), sustained=False)
                    rates = dataclasses.replace(rates, host_s=0.0)
                    r = row(backend, b, heads, kv, seq, rates, cluster.bf16_flops)
                    rows.append(r)
                    if "error" in r:
                        print(f"{backend:7} {b:2} {heads:4}/{kv} {seq:6} refused: {r['error']}")
                        continue
                    print(
                        f"{backend:7} {b:2} {heads:4}/{kv} {seq:6} {r['fwd']['tflops']:9.0f} "
                        f"{r['fwd']['error']:+7.1%} {r['bwd']['tflops']:9.0f} "
                        f"{r['bwd']['error']:+7.1%} {r['fwd+bwd_fraction_of_peak']:8.3f}"
                    )
    for backend in BACKENDS:
        errs = [
            abs(r[p]["error"])
            for r in rows
            if r["backend"] == backend and "error" not in r
            for p in ("fwd", "bwd")
        ]
        if errs:
            print(f"{backend}: mean |error| {statistics.mean(errs):.1%} over {len(errs)} timings")
    print(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
