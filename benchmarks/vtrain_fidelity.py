"""Step-time fidelity against 1,440 measured Megatron-DeepSpeed iterations on 8 A100s (vTrain).

Data: ``vtrain/ground_truth_single.csv`` of the shared data folder (vTrain, MICRO 2024; see its
README): GPT models (hidden 1024 or 2048, 16 heads, 12-24 layers, sequence 1024, vocabulary
50,257) on one DGX A100 node, 1F1B, full recompute, fp16 mixed precision with Adam.

Protocol: rows 0, 2, 4, ... of the file (file order) fit the A100's constants with
``planner.fit.fit_runs`` (what ``planner calibrate --runs`` does); rows 1, 3, 5, ... are held
out and only predicted. The run has no fused attention (attention runs as GEMMs plus a
memory-bound softmax) and no InfiniBand, so the fit is informed about the GEMM and
memory-bound fractions, the per-kernel GPU and host overheads, and NVLink's bus fraction and
latency; the rest keep the catalog's values. Every figure printed is ``planner.evaluate``'s at
the final constants.

Run: ``.venv/bin/python benchmarks/vtrain_fidelity.py [--data PATH]``.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np
import yaml

import planner
from planner.catalog import cluster_yaml
from planner.fit import Run, fit_runs, gpt_model, predict
from planner.layout import Layout
from planner.specs import ModelSpec, TrainingJob

DATA = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "vtrain" / "ground_truth_single.csv"
)
VOCAB = 50257
# Where the host-overhead fit starts (us per kernel): the host-bound floor the data shows (a
# micro-batch of 2 sequences as long as one of 1: about 70 ms for 24 layers x ~55 kernels per
# layer). A maximum's losing term has no slope, so the fit must start where it binds.
START_HOST_US = 50.0


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
    # Megatron-LM's GPT with its default dropout of 0.1 (planner.fit.gpt_model)
    model = gpt_model(
        f"gpt:hidden={row['hidden']};layers={row['layers']};heads={row['heads']};"
        f"vocab={VOCAB};seq={row['seq']};dropout=0.1"
    )
    job = TrainingJob(
        seq_len=int(row["seq"]),
        global_batch=int(row["global_batch"]),
        weight_dtype="fp16",
        grad_dtype="fp16",
        activation_dtype="fp16",
        flash_attention=False,
        framework="deepspeed",  # Megatron-DeepSpeed: tensor-parallel comm not overlapped
    )
    layout = Layout.uniform(
        model,
        pp=int(row["pp"]),
        tp=int(row["tp"]),
        dp=int(row["dp"]),
        micro_batch=int(row["micro_batch"]),
        recompute="full",
        sequence_parallel=False,
    )
    return model, job, layout, int(row["gpus"])


def runs(rows: list[dict[str, int | float]]) -> list[Run]:
    out = []
    for row in rows:
        model, job, layout, _ = case(row)
        out.append(Run(model, job, layout, float(row["ms"]) / 1e3))
    return out


def report(name: str, rows: list[dict[str, int | float]], predicted_s: np.ndarray) -> None:
    measured = np.array([r["ms"] for r in rows])
    predicted = predicted_s * 1e3
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
    parser.add_argument(
        "--out", type=Path, default=None, help="write the fitted A100 profile (cluster YAML) here"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    rows = read_rows(args.data)
    fit_rows, held_out = rows[0::2], rows[1::2]
    base = planner.load_cluster("a100", gpus=8)
    print(f"vTrain single-node A100 set: {len(rows)} rows; fit on even rows, test on odd rows")
    report("held-out, catalog constants (before fitting)", held_out, predict(base, runs(held_out)))
    found = fit_runs(
        base,
        runs(fit_rows),
        folds=0,
        rounds=args.rounds,
        start={"host_overhead_s": START_HOST_US},
        progress=lambda line: print(f"  {line}", flush=True),
    )
    shown = found.fitted_text()
    print(f"fitted ({', '.join(found.informed)} informed; the rest kept): {shown}")
    report("fit half", fit_rows, found.fitted_s)
    report("held-out half", held_out, predict(found.cluster, runs(held_out)))
    if args.out:
        note = f"fitted by benchmarks/vtrain_fidelity.py on the even rows of {args.data.name}"
        args.out.write_text(yaml.safe_dump(cluster_yaml(found.cluster, sources={"fit": note})))
        print(f"wrote {args.out}")
    print(f"wall time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
