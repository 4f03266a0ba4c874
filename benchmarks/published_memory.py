"""Predicted per-GPU memory against real training runs published by others, row by row.

Data: ``benchmarks/published_memory.csv``: one row per published measurement (model, GPU,
degrees, micro-batch, sequence, recompute, precision, framework, the measured GiB, whether
the source reports the allocator's peak allocated or peak reserved bytes, and the source).
Each row is costed with ``planner.estimate.stage_memory`` under the row's framework and its
default dtypes (``planner.specs.FRAMEWORK_DTYPES``); nothing is fitted to these rows.

What is compared (column ``kind``): ``oom`` and ``ran`` rows state no figure, only that the
run ran out of memory or trained (an issue thread, a config changed to stop an out-of-memory
error): the heaviest rank's whole predicted peak must be over the planner's cap (usable HBM
less the job's margin) for ``oom`` and within it for ``ran``. Otherwise ``reserved``,
``torch.cuda.max_memory_reserved`` (what torchtitan logs as ``max_reserved_gib``), holds the
allocator's segments, so it is compared with the predicted peak less the CUDA context;
``allocated``, ``max_memory_allocated`` (Megatron-LM's "max allocated" and
``mem-max-allocated-bytes``), with that less the fragmentation too; ``device``, what
nvidia-smi shows for the process, with the whole peak.
The heaviest pipeline rank is compared, as most sources report the maximum over ranks, or
the one in column ``pp_rank`` when the source names it (-1: the last).

What a source leaves unstated is assumed and printed beside the row: micro-batch 1; one
micro-batch per data-parallel rank when the global batch is unstated without pipelining;
2 virtual stages for an interleaved schedule. torchtitan's selective activation
checkpointing (option "op": every other matmul output and the attention outputs kept, norms and
activation functions recomputed) is costed as the planner's ``op`` recompute choice, which
keeps the same tensors. ``torch.compile`` (most torchtitan rows) fuses
elementwise kernels and frees some intermediates earlier; the model sees only its loss: the
``compiled_loss`` column says whether the row's torchtitan compiled the cross-entropy
(``TrainingJob.compiled_loss``): true for runs with compile on at torchtitan commits from
bbb1b616e (2025-04-02, PR #1033) on, false before (at 9dec370, December 2024, train.py left
the loss eager: "compiling loss function causes CUDA errors, turning off for now").

Rows the planner cannot cost yet are listed with the reason and left out of the error.

``--write`` stores each framework's signed errors over ``published_memory.csv``'s rows
(``planner/memory_accuracy.json``): every estimate states, from them, how many published runs
of its framework the model under-predicted by more than the layout's headroom
(``planner.estimate.memory_risk``). The harvested functional tests are left out of that
file: their peaks are 1-4 GiB, where a missing fixed 100 MiB is a 5% error that says
nothing of a plan's risk at 70 GiB.

Run: ``.venv/bin/python benchmarks/published_memory.py [--csv PATH] [--write]``.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from planner.catalog import load_cluster
from planner.costs.cap import usable_peak_bytes
from planner.costs.memory import StageMemory, stage_memory, workspace_bytes
from planner.errors import PlannerError
from planner.fit import layout_from_row
from planner.specs import ModelSpec, TrainingJob

DATA = Path(__file__).resolve().parent / "published_memory.csv"
ACCURACY = Path(__file__).resolve().parents[1] / "planner" / "memory_accuracy.json"
GIB = 2**30
SCHEDULES = {
    "": "1f1b",
    "1f1b": "1f1b",
    "interleaved 1f1b": "interleaved",
    "interleaved": "interleaved",  # the planner's own names (megatron_ci_runs.csv)
    "1f1b-ep-overlap": "1f1b-ep-overlap",
    "interleaved-ep-overlap": "interleaved-ep-overlap",
}
FRAMEWORKS = {"nemo": "megatron", "fsdp": "torch"}  # the planner's name for each stack
TORCHTITAN_SELECTIVE = "op"  # see the module docstring
KINDS = ("allocated", "reserved", "device")  # see the module docstring
OUTCOMES = ("oom", "ran")  # a run that ran out of memory, one that trained (no figure)
SM80 = ("a100", "a800")  # compute capability 8.0
# Why a functional test on an A100 that leaves --attention-backend at auto and runs
# deterministically (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0) does not state its attention: there
# Transformer Engine turns cuDNN's fused attention off for training below compute capability
# 9.0 (get_attention_backend, transformer_engine/pytorch/attention/dot_product_attention/
# utils.py: "Disabling FusedAttention for determinism reasons"), leaving FlashAttention-2
# where flash-attn >= 2.4.1 is installed and the unfused path where it is not. The CI images
# differed: one test case's peak matches its flash twin on one platform and its unfused twin
# (hundreds of MiB of s x s scores more) on another.
AUTO_ATTENTION_SM80 = (
    "attention not stated: on compute capability 8.0 in deterministic mode Transformer "
    "Engine's auto backend is FlashAttention-2 or unfused depending on the image"
)


def predict(row: dict[str, str]) -> tuple[float, str, list[str]]:
    """(predicted GiB, layout text, what was assumed) of one row."""
    kind = row["kind"]
    if kind not in KINDS:
        raise PlannerError(f"kind={kind!r}: not one of {', '.join(KINDS)}")
    heaviest, _, text, assumed = _heaviest(row)
    value = {
        "reserved": heaviest.reserved_bytes,
        "allocated": heaviest.allocated_bytes,
        "device": heaviest.peak_bytes,
    }[kind]
    return value / GIB, text, assumed


def outcome(row: dict[str, str]) -> tuple[float, float, str, list[str]]:
    """(predicted peak GiB, the planner's cap GiB, layout text, what was assumed) of a row
    whose source says only whether the run fit (``kind`` ``oom`` or ``ran``): the heaviest
    rank's whole peak against usable HBM less the job's margin, the line ``plan`` holds
    every layout to (``costs.cap.usable_peak_bytes``)."""
    if row["kind"] not in OUTCOMES:
        raise PlannerError(f"kind={row['kind']!r}: not one of {', '.join(OUTCOMES)}")
    heaviest, job, text, assumed = _heaviest(row)
    cluster = load_cluster(row["gpu"], gpus=int(row["num_gpus"]))
    cap = usable_peak_bytes(cluster, cluster.job_on(job))
    return heaviest.peak_bytes / GIB, cap / GIB, text, assumed


def _heaviest(row: dict[str, str]) -> tuple[StageMemory, TrainingJob, str, list[str]]:
    """The rank a row is compared on, its job, the layout as text and what was assumed."""
    assumed: list[str] = []
    fields = dict(row)
    framework = row["framework"].strip().lower()
    fields["framework"] = FRAMEWORKS.get(framework, framework)
    schedule = row["schedule"].strip().lower()
    if schedule not in SCHEDULES:
        raise PlannerError(f"schedule={row['schedule']!r}: not one this benchmark reads")
    fields["schedule"] = SCHEDULES[schedule]
    if fields["schedule"] == "interleaved" and not row["vp"]:
        fields["vp"] = "2"
        assumed.append("2 virtual stages")
    if not row["micro_batch"]:
        fields["micro_batch"] = "1"
        assumed.append("micro-batch 1")
    if not row["global_batch"]:
        if int(row["pp"]) > 1:
            raise PlannerError("global batch unstated with pipelining: in-flight count unknown")
        fields["global_batch"] = str(int(row["dp"]) * int(fields["micro_batch"]))
    if fields["framework"] == "torchtitan" and row["recompute"] == "selective":
        fields["recompute"] = TORCHTITAN_SELECTIVE
        assumed.append(f"op-level SAC as {TORCHTITAN_SELECTIVE}")
    model, job, layout = layout_from_row(fields, row["id"])
    job = job.model_copy(update={"workspace_bytes": workspaces(row, model, job)})
    m = job.global_batch // (layout.dp * layout.micro_batch)
    ranks = stage_memory(model, job, layout, num_microbatches=m)
    if row.get("pp_rank"):  # the source measured one pipeline rank
        heaviest = ranks[int(row["pp_rank"]) % layout.pp]
    else:
        heaviest = max(ranks, key=lambda r: r.peak_bytes)
    text = (
        f"tp{layout.tp} pp{layout.pp} dp{layout.dp} ep{layout.ep} mb{layout.micro_batch} "
        f"z{layout.zero} {fields['recompute']}"
    )
    return heaviest, job, text, assumed


def workspaces(row: dict[str, str], model: ModelSpec, job: TrainingJob) -> int:
    """The GEMM libraries' workspaces of the row's run (``workspace_bytes``): sizes by the
    GPU's compute capability, and for a harvested functional test what its settings say
    (CUBLAS_WORKSPACE_CONFIG, --transformer-impl local: no Transformer Engine,
    --moe-grouped-gemm: the grouped GEMM's streams)."""
    flags = [f for f in row.get("flags", "").split(";") if f]
    cublas = None
    for f in flags:
        if f.startswith("CUBLAS_WORKSPACE_CONFIG="):  # ":SIZE:COUNT" pairs, KiB
            sizes = f.split("=", 1)[1].strip(":").split(":")
            pairs = zip(sizes[::2], sizes[1::2], strict=True)
            cublas = sum(int(kib) * 1024 * int(count) for kib, count in pairs)
    harvested_row = bool(row.get("platform"))
    return workspace_bytes(
        model,
        job,
        sm90=row["gpu"] not in SM80,
        cublas_bytes=cublas,
        grouped_experts=None if not harvested_row else "moe-grouped-gemm" in flags,
    )


def harvested(row: dict[str, str]) -> dict[str, str]:
    """A row of ``benchmarks/megatron_ci_runs.csv`` (Megatron-LM's functional tests) in this
    file's columns: its ``mem_max_allocated_bytes`` (``allocated_bytes.all.peak`` of
    ``torch.cuda.memory_stats``, the median over the logged steps) as an ``allocated`` figure
    of the last pipeline rank: the figure goes to TensorBoard, whose writer only the last
    global rank holds (``megatron/training/global_vars.py``, ``args.rank == (args.world_size
    - 1)``; ``training_log`` in ``megatron/training/training.py``), and with the pipeline
    the outermost of Megatron-LM's rank orders that rank is on the last stage. Other rows
    as they are."""
    if "measured_gib" in row:
        return row
    if not row.get("mem_max_allocated_bytes"):
        return {**row, "measured_gib": "", "kind": "allocated", "pp_rank": "-1"}
    flags = row.get("flags", "").split(";")
    if (
        row["gpu"] in SM80
        and "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0" in flags
        and row.get("flash_attention") == "true"
        and not any(f.startswith("attention-backend=") for f in flags)
    ):
        return {**row, "unstated": AUTO_ATTENTION_SM80}
    return {
        **row,
        "measured_gib": str(float(row["mem_max_allocated_bytes"]) / GIB),
        "kind": "allocated",
        "pp_rank": "-1",
        # --transformer-impl local: Megatron-LM's own modules (TrainingJob.transformer_engine)
        "transformer_engine": str("transformer-impl=local" not in flags).lower(),
    }


def read_rows(path: Path = DATA) -> list[dict[str, str]]:
    """The rows of a memory CSV (``#`` lines left out), harvested ones in this file's
    columns."""
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(line for line in handle if not line.startswith("#")))
    return [harvested(row) for row in rows]


def framework_of(row: dict[str, str]) -> str:
    """The planner's name for the row's framework."""
    name = row["framework"].strip().lower()
    return FRAMEWORKS.get(name, name)


def costed(
    rows: list[dict[str, str]],
) -> Iterator[tuple[dict[str, str], tuple[float, float, str, list[str]] | str]]:
    """Each row with (measured GiB, predicted GiB, layout text, what was assumed), or why
    it was not costed."""
    for row in rows:
        if row.get("unstated"):
            yield row, row["unstated"]
        elif row.get("kind") in OUTCOMES:
            continue  # no figure: ``outcomes`` checks them against the cap
        elif not row["measured_gib"]:
            yield row, "no measured memory"
        else:
            try:
                predicted, text, assumed = predict(row)
            except PlannerError as exc:
                yield row, str(exc)
            else:
                yield row, (float(row["measured_gib"]), predicted, text, assumed)


def outcomes(
    rows: list[dict[str, str]],
) -> Iterator[tuple[dict[str, str], tuple[float, float, str, list[str]] | str]]:
    """Each ``oom`` or ``ran`` row with (predicted peak GiB, cap GiB, layout text, what was
    assumed), or why it was not costed."""
    for row in rows:
        if row.get("kind") not in OUTCOMES:
            continue
        try:
            yield row, outcome(row)
        except PlannerError as exc:
            yield row, str(exc)


def accuracy_data(signed: dict[str, list[float]]) -> dict[str, object]:
    """What ``--write`` stores (``planner/memory_accuracy.json``): each framework's signed
    errors, sorted."""
    by_framework = {
        name: {
            "rows": len(errors),
            "mape": round(float(np.mean(np.abs(errors))), 4),
            "bias": round(float(np.mean(errors)), 4),
            "errors": sorted(round(e, 4) for e in errors),
        }
        for name, errors in sorted(signed.items())
        if name != "all"
    }
    return {
        "source": "benchmarks/published_memory.py --write over benchmarks/published_memory.csv",
        "error": "predicted / measured peak - 1, each row's own figure (allocated, reserved or "
        "device)",
        "by_framework": by_framework,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=DATA)
    parser.add_argument(
        "--write",
        action="store_true",
        help="store each framework's errors in planner/memory_accuracy.json (default CSV only)",
    )
    args = parser.parse_args()
    if args.write and args.csv != DATA:
        parser.error("--write stores the errors over published_memory.csv: leave out --csv")
    rows = read_rows(args.csv)
    errors: dict[str, list[float]] = defaultdict(list)
    signed: dict[str, list[float]] = defaultdict(list)
    skipped = []
    wide = max(len(row["id"]) for row in rows)
    print(
        f"{'id':{wide}} {'framework':10} {'gpu':5} {'layout':40} {'kind':9} "
        f"{'measured':>9} {'predicted':>9} {'error':>7}"
    )
    for row, result in costed(rows):
        if isinstance(result, str):
            skipped.append((row["id"], result))
            continue
        measured, predicted, text, assumed = result
        error = predicted / measured - 1
        for key in ("all", framework_of(row)):
            errors[key].append(abs(error))
            signed[key].append(error)
        note = f"  [{'; '.join(assumed)}]" if assumed else ""
        print(
            f"{row['id']:{wide}} {row['framework']:10} {row['gpu']:5} {text:40} {row['kind']:9} "
            f"{measured:8.1f}G {predicted:8.1f}G {error:+7.1%}{note}"
        )
    print("\nmean absolute error (signed mean), GiB per GPU:")
    for key in sorted(errors, key=lambda k: (k != "all", k)):
        e, s = errors[key], signed[key]
        within = sum(x <= 0.10 for x in e)
        close = sum(x <= 0.05 for x in e)
        print(
            f"  {key:11} {len(e):3d} rows  {np.mean(e):6.1%} ({np.mean(s):+6.1%})  "
            f"worst {max(e):6.1%}  within 10%: {within}/{len(e)}, within 5%: {close}/{len(e)}"
        )
    told = list(outcomes(rows))
    if told:
        print(
            "\nruns that ran out of memory (oom: must be predicted over the cap) and runs that "
            "trained (ran: must fit), the heaviest rank's whole peak against the cap:"
        )
        right = 0
        for row, result in told:
            if isinstance(result, str):
                skipped.append((row["id"], result))
                continue
            peak, cap, text, assumed = result
            over = peak > cap
            ok = over == (row["kind"] == "oom")
            right += ok
            note = f"  [{'; '.join(assumed)}]" if assumed else ""
            print(
                f"  {row['id']:{wide}} {row['framework']:10} {row['gpu']:5} {text:40} "
                f"{row['kind']:4} predicted {peak:6.1f}G vs cap {cap:5.1f}G: "
                f"{'over' if over else 'fits'} ({'right' if ok else 'WRONG'}){note}"
            )
        print(f"  {right} of {len(told)} on the right side of the cap")
    # Every run with a measured peak trained too: each must fit under the cap as well
    measured = [
        {**row, "kind": "ran"} for row, result in costed(rows) if not isinstance(result, str)
    ]
    trained = [result for _, result in outcomes(measured) if not isinstance(result, str)]
    within = sum(peak <= cap for peak, cap, _, _ in trained)
    print(
        f"  runs with a measured peak (they trained): {within} of {len(trained)} within the cap"
        f" ({len(measured) - len(trained)} on GPUs the catalog lacks)"
    )
    if args.write:
        ACCURACY.write_text(json.dumps(accuracy_data(signed), indent=1) + "\n")
        print(f"\nwrote {ACCURACY}")
    if skipped:
        print(f"\nnot costed ({len(skipped)} rows):")
        reasons: dict[str, int] = defaultdict(int)
        for name, why in skipped:
            reasons[why] += 1
            if reasons[why] <= 3:
                print(f"  {name}: {why}")
        for why, count in reasons.items():
            if count > 3:
                print(f"  ... and {count - 3} more: {why}")


if __name__ == "__main__":
    main()
