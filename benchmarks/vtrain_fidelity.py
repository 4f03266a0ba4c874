"""Step-time fidelity against 1,440 measured Megatron-DeepSpeed iterations on 8 A100s (vTrain).

Data: ``vtrain/ground_truth_single.csv`` of the shared data folder (vTrain, MICRO 2024; see its
README): GPT models (hidden 1024 or 2048, 16 heads, 12-24 layers, sequence 1024, vocabulary
50,257) on one DGX A100 node, 1F1B, full recompute, fp16 mixed precision with Adam.

Protocol: rows 0, 2, 4, ... of the file (file order) fit the A100's constants; rows
1, 3, 5, ... are held out and only predicted. The fitted constants are the achieved GEMM and
memory-bound fractions, the per-kernel overhead, the achieved NVLink bus fraction and the
NVLink per-step latency (the run has no fused attention, so attention runs as GEMMs plus a
memory-bound softmax, and no InfiniBand). Each row's predicted time is, for fixed maxima
(critical rank, bubble), linear in the seconds-per-unit of each constant, so the fit solves a
relative least-squares problem on coefficients read from the model by finite differences,
then re-reads them at the fitted point (twice) and finishes with weighted least squares that
minimises the mean absolute percentage error. Every figure printed is from
``planner.evaluate`` at the final constants, not from the linearisation.

Run: ``.venv/bin/python benchmarks/vtrain_fidelity.py [--data PATH]``.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np

import planner
from planner.layout import Layout
from planner.specs import ClusterSpec, ModelSpec, TrainingJob

DATA = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "vtrain" / "ground_truth_single.csv"
)
VOCAB = 50257
# Where the host-overhead fit starts: the host-bound floor the data shows (a micro-batch of
# 2 sequences as long as one of 1: about 70 ms for 24 layers x ~55 kernels per layer).
START_HOST_S = 50e-6
# (name, how to set it on the cluster from a seconds-per-unit value)
PARAMS = (
    "gemm",
    "memory_bound",
    "kernel_overhead_s",
    "nvlink",
    "nvlink_latency_s",
    "host_overhead_s",
)


def read_rows(path: Path) -> list[dict[str, int | float]]:
    with path.open(encoding="utf-8-sig") as handle:
        rows = list(csv.DictReader(handle))
    keys = {
        "gpus": "# GPUs",
        "global_batch": "global batch",
        "micro_batch": "micro batch",
        "hidden": "hidden size",
        "heads": "attention heads",
        "layers": "# layers",
        "seq": "sequence length",
        "tp": "tensor parallelism",
        "dp": "data parallelism",
        "pp": "pipeline parallelism",
    }
    out: list[dict[str, int | float]] = []
    for row in rows:
        item: dict[str, int | float] = {k: int(row[v]) for k, v in keys.items()}
        item["ms"] = float(row["iteration time (ms)"])
        out.append(item)
    return out


def case(row: dict[str, int | float]) -> tuple[ModelSpec, TrainingJob, Layout, int]:
    """The model, job and layout of one measured row (Megatron-DeepSpeed GPT defaults)."""
    h, heads = int(row["hidden"]), int(row["heads"])
    model = ModelSpec(
        name=f"gpt-h{h}-l{row['layers']}",
        hidden_size=h,
        num_layers=int(row["layers"]),
        vocab_size=VOCAB,
        num_attention_heads=heads,
        num_kv_heads=heads,
        head_dim=h // heads,
        attention="mha",
        mlp="gelu",
        ffn_hidden_size=4 * h,
        norm="layernorm",
        qkv_bias=True,
        linear_bias=True,
        tie_word_embeddings=True,
        learned_positions=int(row["seq"]),
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    job = TrainingJob(
        seq_len=int(row["seq"]),
        global_batch=int(row["global_batch"]),
        weight_dtype="fp16",
        grad_dtype="fp16",
        activation_dtype="fp16",
        flash_attention=False,
        sequence_parallel=False,
        framework="deepspeed",  # Megatron-DeepSpeed: tensor-parallel comm not overlapped
    )
    layout = Layout.uniform(
        model,
        pp=int(row["pp"]),
        tp=int(row["tp"]),
        dp=int(row["dp"]),
        micro_batch=int(row["micro_batch"]),
        recompute="full",
    )
    return model, job, layout, int(row["gpus"])


def unit_seconds(cluster: ClusterSpec) -> np.ndarray:
    """The constants as seconds per unit of work (the model is linear in these)."""
    a = cluster.achieved
    return np.array(
        [
            1 / (cluster.bf16_flops * a["gemm"]),
            1 / (cluster.hbm_bandwidth_Bps * a["memory_bound"]),
            cluster.kernel_overhead_s,
            1 / (cluster.nvlink_Bps * a["nvlink"]),
            cluster.nvlink_latency_s,
            cluster.host_overhead_s,
        ]
    )


def with_units(cluster: ClusterSpec, theta: np.ndarray) -> ClusterSpec:
    achieved = dict(cluster.achieved)
    achieved["gemm"] = 1 / (theta[0] * cluster.bf16_flops)
    achieved["memory_bound"] = 1 / (theta[1] * cluster.hbm_bandwidth_Bps)
    achieved["nvlink"] = 1 / (theta[3] * cluster.nvlink_Bps)
    return cluster.model_copy(
        update={
            "achieved": achieved,
            "kernel_overhead_s": float(theta[2]),
            "nvlink_latency_s": float(theta[4]),
            "host_overhead_s": float(theta[5]),
        }
    )


def predict(rows: list[dict[str, int | float]], base: ClusterSpec, theta: np.ndarray) -> np.ndarray:
    out = []
    for row in rows:
        model, job, layout, gpus = case(row)
        cluster = with_units(base.model_copy(update={"num_gpus": gpus}), theta)
        out.append(planner.evaluate(model, cluster, job, layout).step_time_s * 1e3)
    return np.array(out)


def bounds(base: ClusterSpec) -> tuple[np.ndarray, np.ndarray]:
    """Physical limits in seconds per unit: no achieved fraction above what was measured as
    possible (GEMM: the A100's maximum achievable matmul FLOPS, 0.87 of peak, per the
    catalog's source; memory-bound and NVLink: line rate); a kernel and an NVLink hop cost at
    least 1 us (never free; the finite differences below need them positive)."""
    lo = np.array(
        [
            1 / (base.bf16_flops * 0.87),
            1 / base.hbm_bandwidth_Bps,
            1e-6,
            1 / base.nvlink_Bps,
            1e-6,
            1e-6,
        ]
    )
    return lo, np.full(len(PARAMS), np.inf)


def coefficients(
    rows: list[dict[str, int | float]], base: ClusterSpec, theta: np.ndarray
) -> np.ndarray:
    """d(predicted ms)/d(theta_i) per row, by forward differences of 1%."""
    t0 = predict(rows, base, theta)
    cols = []
    for i in range(len(theta)):
        bumped = theta.copy()
        bumped[i] *= 1.01
        cols.append((predict(rows, base, bumped) - t0) / (0.01 * theta[i]))
    return np.column_stack(cols)


def fit(rows: list[dict[str, int | float]], base: ClusterSpec, *, rounds: int) -> np.ndarray:
    """Minimise the mean absolute percentage error over ``rows`` inside ``bounds``: the
    prediction is linear in ``theta`` for fixed maxima, so solve the linear problem by
    iteratively reweighted least squares, then re-read the coefficients at the solution."""
    measured = np.array([r["ms"] for r in rows])
    theta = unit_seconds(base)
    theta[5] = START_HOST_S
    lo, hi = bounds(base)
    for _ in range(rounds):
        a = coefficients(rows, base, theta) / measured[:, None]
        weights = np.ones(len(rows))
        for _ in range(30):  # IRLS weights 1/sqrt|r| turn squared error into absolute error
            theta = _bounded_lstsq(a * weights[:, None], weights, lo, hi)
            weights = 1 / np.sqrt(np.maximum(np.abs(a @ theta - 1), 1e-3))
    return theta


def _bounded_lstsq(a: np.ndarray, b: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Least squares with each unknown kept in [lo, hi]: pin the ones that leave the box at
    their bound and re-solve the rest (an active-set loop over 5 unknowns)."""
    pinned: dict[int, float] = {}
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    while True:
        free = [i for i in range(a.shape[1]) if i not in pinned]
        rhs = b - sum((a[:, i] * v for i, v in pinned.items()), start=np.zeros_like(b))
        sol, *_ = np.linalg.lstsq(a[:, free] / scale[free], rhs, rcond=None)
        out = np.empty(a.shape[1])
        for i, v in pinned.items():
            out[i] = v
        out[free] = sol / scale[free]
        bad = [i for i in free if not lo[i] <= out[i] <= hi[i]]
        if not bad:
            return out
        for i in bad:
            pinned[i] = float(np.clip(out[i], lo[i], hi[i]))


def report(name: str, rows: list[dict[str, int | float]], predicted: np.ndarray) -> None:
    measured = np.array([r["ms"] for r in rows])
    err = np.abs(predicted / measured - 1)
    worst = int(np.argmax(err))
    w = rows[worst]
    print(
        f"{name}: {len(rows)} rows, MAPE {100 * err.mean():.2f}%, median "
        f"{100 * np.median(err):.2f}%, 90th percentile {100 * np.percentile(err, 90):.2f}%, "
        f"worst {100 * err[worst]:.1f}% (h{w['hidden']} l{w['layers']} tp{w['tp']} dp{w['dp']} "
        f"pp{w['pp']} mb{w['micro_batch']} gb{w['global_batch']}: measured {w['ms']:.1f} ms, "
        f"predicted {predicted[worst]:.1f} ms)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument(
        "--rounds", type=int, default=4, help="times the linear coefficients are re-read"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    rows = read_rows(args.data)
    fit_rows, held_out = rows[0::2], rows[1::2]
    base = planner.load_cluster("a100", gpus=8)
    print(f"vTrain single-node A100 set: {len(rows)} rows; fit on even rows, test on odd rows")
    catalog = unit_seconds(base)
    report(
        "held-out, catalog constants (before fitting)", held_out, predict(held_out, base, catalog)
    )
    theta = fit(fit_rows, base, rounds=args.rounds)
    fitted = with_units(base, theta)
    a = fitted.achieved
    print(
        f"fitted: gemm {a['gemm']:.3f} of peak, memory_bound {a['memory_bound']:.3f} of HBM "
        f"bandwidth, kernel overhead {fitted.kernel_overhead_s * 1e6:.2f} us, nvlink "
        f"{a['nvlink']:.3f} of line rate, nvlink latency {fitted.nvlink_latency_s * 1e6:.2f} us, "
        f"host overhead {fitted.host_overhead_s * 1e6:.2f} us per kernel"
    )
    report("fit half", fit_rows, predict(fit_rows, base, theta))
    report("held-out half", held_out, predict(held_out, base, theta))
    print(f"wall time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
