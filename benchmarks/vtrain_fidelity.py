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

``--per-layer`` fits nothing: it splits each pipeline-free layout's time per micro-batch into
a part per layer and a part per micro-batch (a straight line through its 12-, 16-, 20- and
24-layer rows), measured and predicted: where the per-layer part is off, a layer's kernels or
the host's time per kernel are; where the rest is, the embedding, the output layer and the loss
are (or whatever else a micro-batch costs outside its layers).

Run: ``.venv/bin/python benchmarks/vtrain_fidelity.py [--data PATH] [--per-layer]``.
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


def per_layer(rows: list[dict[str, int | float]], predicted_s: np.ndarray) -> None:
    """Per (hidden, tp, micro-batch) of the pipeline-free rows: ms per layer and ms per
    micro-batch outside the layers, measured and predicted (least squares over the layer
    counts of that shape; each row's time divided by its micro-batches)."""
    shapes: dict[tuple[int, int, int], list[tuple[float, float, float]]] = {}
    for row, p in zip(rows, predicted_s, strict=True):
        if row["pp"] != 1:
            continue
        m = int(row["global_batch"]) // (int(row["dp"]) * int(row["micro_batch"]))
        key = (int(row["hidden"]), int(row["tp"]), int(row["micro_batch"]))
        shapes.setdefault(key, []).append((row["layers"], row["ms"] / m, 1e3 * p / m))
    print("pipeline-free rows, ms per micro-batch = per layer x layers + rest:")
    print(f"  {'hidden tp mb':>14}  {'measured':>17}  {'predicted':>17}  per layer  rest")
    for (h, tp, mb), points in sorted(shapes.items()):
        layers = np.array([x[0] for x in points], dtype=float)
        if len(set(layers)) < 2:
            continue
        sm, im = np.polyfit(layers, [x[1] for x in points], 1)
        sp, ip = np.polyfit(layers, [x[2] for x in points], 1)
        print(
            f"  {h:6} {tp:3} {mb:3}  {sm:6.2f} + {im:6.1f}   {sp:6.2f} + {ip:6.1f}   "
            f"{sp / sm - 1:+7.0%} {ip - im:+6.1f} ms"
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
    parser.add_argument(
        "--per-layer",
        action="store_true",
        help="fit nothing: split each layout's time into a part per layer and the rest",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    rows = read_rows(args.data)
    if args.per_layer:
        per_layer(rows, predict(planner.load_cluster("a100", gpus=8), runs(rows)))
        print(f"wall time {time.perf_counter() - started:.1f} s")
        return
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
