"""Kernel rates of the compute model against published kernel throughputs, row by row.

Data: ``benchmarks/published_kernels.csv``: GEMM and grouped-GEMM TFLOP/s by shape
(DeepGEMM's H800 FP8 tables; the best-shape matmul rates of A100, H100, H200 and B200 from
stas00/ml-engineering) and fused-attention TFLOP/s by sequence length, head dimension and mask
(the FlashAttention-2 and -3 READMEs' figures). Each row cites its source.

The prediction is ``planner.costs.compute``'s at the catalog's constants for that GPU: GEMMs by
their shape (tiles, waves, epilogue, memory roofline; ``gemm_seconds``), attention at the
catalog's achieved fraction with the shape's overhead (``flash_overhead``: sequence length,
head dimension, causal mask). The catalog's one attention fraction per GPU stands for the
framework's kernel (FlashAttention-3 or cuDNN class on Hopper), so FlashAttention-2 rows on
H100 show the gap between implementations, not only the shape model's error. The catalog's
``achieved.gemm`` is the best-shape matmul rate of the same table the MAMF rows come from, so
those rows check only the tile and wave terms; the attention shape constants were fitted on
the A100 FlashAttention-2 rows (see ``planner.costs.work``), so those rows are not a check.

Run: ``.venv/bin/python benchmarks/kernel_fidelity.py``.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import numpy as np

import planner
from planner.costs.compute import Rates, gemm_seconds
from planner.costs.work import Gemm, flash_overhead

DATA = Path(__file__).resolve().parent / "published_kernels.csv"


def predict(row: dict[str, str]) -> float:
    """Predicted TFLOP/s of one row, in the source's FLOP count."""
    cluster = planner.load_cluster(row["gpu"], gpus=8)
    fp8 = row["dtype"] == "fp8"
    # FlashAttention-2's rows at its own fraction (achieved["attention_fa2"] where the GPU has
    # one: Hopper); FlashAttention-3's and cuDNN's at the GPU's fastest
    fa2 = row["kernel"] == "attention" and row["notes"].startswith("FlashAttention-2")
    job = planner.TrainingJob(
        seq_len=4096,
        global_batch=8,
        compute_dtype="fp8" if fp8 else "bf16",
        attention_kernel="fa2" if fa2 else "fused",
    )
    rates = Rates.of(cluster, job, sustained=False)
    if row["kernel"] in ("gemm", "grouped_gemm"):
        g = Gemm(float(row["m"]), float(row["n"]), float(row["k"]), float(row["groups"] or 1))
        return g.flops / gemm_seconds(g, rates) / 1e12
    extra = flash_overhead(
        int(row["seqlen"]), float(row["head_dim"]), causal=row["causal"] == "true"
    )
    return rates.attention_flops / (1 + extra) / 1e12


def main() -> None:
    with DATA.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    groups: dict[str, list[float]] = defaultdict(list)
    print(
        f"{'id':>4} {'gpu':5} {'kernel':12} {'dtype':5} {'shape':44} {'published':>9} "
        f"{'predicted':>9} {'error':>7}"
    )
    for row in rows:
        if row["kernel"] == "attention":
            shape = (
                f"b{row['batch']} s{row['seqlen']} h{row['heads']} d{row['head_dim']} "
                f"{'causal' if row['causal'] == 'true' else 'full'} {row['direction']}"
            )
            implementation = row["notes"].split(";")[0].split(" (")[0]
            key = f"attention {row['gpu']} {row['direction']} {implementation}"
        else:
            shape = f"m{row['m']} n{row['n']} k{row['k']}" + (
                f" x{row['groups']}" if row["groups"] else ""
            )
            key = f"{row['kernel']} {row['gpu']} {row['dtype']}"
        published = float(row["tflops"])
        predicted = predict(row)
        error = predicted / published - 1
        groups[key].append(abs(error))
        print(
            f"{row['id']:>4} {row['gpu']:5} {row['kernel']:12} {row['dtype']:5} {shape:44} "
            f"{published:9.1f} {predicted:9.1f} {error:+7.1%}"
        )
    print("\nmean absolute error by group (TFLOP/s, predicted against published):")
    for key, errs in sorted(groups.items()):
        print(
            f"  {key:32} {len(errs):4} rows  MAPE {100 * np.mean(errs):5.1f}%  "
            f"worst {100 * max(errs):5.1f}%"
        )


if __name__ == "__main__":
    main()
