"""Predicted step time against real training runs published by others, row by row.

Data: ``benchmarks/published_runs.csv``: one row per published run (model, GPU, degrees,
micro and global batch, sequence, schedule, recompute, precision, framework, the measured
figure and its source). Each row is costed with ``planner.evaluate`` at the catalog's
constants for its GPU (``hardware/<gpu>.yaml``): nothing is fitted here, and no constant is
chosen per row. The catalog's constants come from datasheets, nccl-tests figures and the
best-shape matmul table (see each YAML's ``sources``); none of them is taken from these runs.
Overlap between the constants' sources and these rows: the H800's SM count (132) is read
from the DeepSeek-V3 report, the source of the deepseek-v3-report row, but it is a hardware
count, not a timing; the MAMF GEMM fractions come from stas00/ml-engineering's matmul table
and the attention shape constants from FlashAttention-2's kernel table (see
``benchmarks/kernel_fidelity.py``), neither from any run here; the 1.04 expert load
imbalance is from Wang et al. 2024; the GB200 rows' NVLink domains (64 GPUs per rack at 64,
128 and 256 GPUs) follow the Slurm segments NVIDIA's performance scripts ask for
(``hardware/gb200.yaml``, ``nvlink_domain_gpus``), a placement, not a timing.

A measured figure becomes seconds per step:

- ``step_s``: as is;
- ``tokens_per_s_per_gpu``: global batch x sequence / (figure x GPUs);
- ``tflops_per_gpu`` and ``mfu``: by the source's own FLOP count per token. Megatron-LM's
  SC'21 paper counts 96 B s l h^2 (1 + s/6h + V/16lh) per step, with the recomputed forward
  (its eq. 3); Megatron-LM's README table counts 72 B s l h^2 (1 + s/6h) + 6 B s h V (no
  recompute, the full s x s score matrix); Megatron-LM's MoE recipes log Megatron-Core's
  count (``megatron_core_flops_per_token``); other sources count the forward and backward
  only, which is the planner's ``model_flops_per_token`` (6 x active matmul parameters +
  causal attention), and MFU is against the dense BF16 peak.

What a source leaves unstated is assumed and printed beside the row: 1F1B where the schedule
is unstated; 2 virtual stages for interleaving; where the micro-batch or the recompute is
unstated, the fastest choice under which the layout fits HBM in the model, as a team that
tuned the run would have picked (micro-batches dividing each data-parallel rank's share of
the batch, up to 8; the recompute its framework can state, ``recompute_choices``:
Megatron-LM's module combinations, torchtitan's none, op and full, DeepSpeed's none and
full); in-house
stacks (Llama 3, DeepSeek-V3) overlap as Megatron-LM does; rows whose
``tp_comm_overlap`` is false (Megatron-LM before ``--tp-comm-overlap`` existed or without it,
torchtitan without async TP) leave the tensor-parallel collectives exposed
(``TrainingJob.tp_comm_overlap``); a blank one has the framework's overlap on; an MoE
row without a dispatcher runs NCCL all-to-all (Megatron-LM's default). Data
parallelism is ZeRO-1 (Megatron-LM's distributed optimizer) except where the row says FSDP
(ZeRO-3), for torchtitan (FSDP2, ZeRO-3) and for Megatron-LM of 2021 (``megatron-2021``: no
distributed optimizer yet, ZeRO 0).

Rows the planner cannot cost yet are listed with the reason (machines without a catalog
entry, architectures it does not read, a FLOP count not reproduced) and
left out of the error. ``--fit`` also fits each GPU's constants to its own rows
(``planner.fit_runs``) and prints the 5-fold held-out error; ``--write`` stores the per-GPU
errors that every estimate quotes (``planner/accuracy.json``).

Run: ``.venv/bin/python benchmarks/published_throughput.py [--csv PATH] [--fit] [--write]``.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import planner
from planner.costs.blocks import shared_width
from planner.errors import PlannerError
from planner.estimate import ACCURACY, mfu_class, model_flops_per_token
from planner.export.megatron_model import hf_repo
from planner.fit import Run, fit_runs, gpt_model, run_from_row
from planner.frameworks import framework as framework_of
from planner.layout import model_modules
from planner.schedules import schedule_of

DATA = Path(__file__).resolve().parent / "published_runs.csv"
SCHEDULES = {"1f1b": "1f1b", "interleaved": "interleaved", "dualpipe": "dualpipe", "zb": "zb-h1"}
# What each framework's data parallelism shards where the row does not say fsdp (which is
# ZeRO-3 in every framework): Megatron-LM's distributed optimizer is ZeRO-1 (it had none in
# 2021: megatron-2021 is ZeRO 0), torchtitan always runs FSDP2 (ZeRO-3), DeepSpeed is taken
# as ZeRO-1.
ZERO = {"megatron": 1, "megatron-2021": 0, "torchtitan": 3, "deepspeed": 1, "deepspeed-2021": 1}
MODULES = {"rmsnorm": "layernorm"}  # the sources' names for this planner's recompute modules
PROFILES: dict[str, Path] = {}  # --profile: a GPU's cluster YAML instead of the catalog's


@dataclass(frozen=True)
class Costed:
    fits: bool  # within the planner's cap (usable HBM less its margin)
    moe: bool
    assumed: list[str]
    run: Run
    measured_mfu: float = 0.0  # model FLOPs (the planner's count) over BF16 peak, measured
    run_over_hbm: bool = False  # the predicted peak exceeds usable HBM itself


def ceiling_key(row: dict[str, str]) -> str:
    """The class of a row's measured MFU (``planner.estimate.mfu_class``)."""
    return mfu_class(row["gpu"], row["precision"])


def source_flops_per_token(row: dict[str, str], model: planner.ModelSpec, seq: int) -> float:
    """FLOPs per token by the source's own count (see the module docstring)."""
    h, layers, vocab = model.hidden_size, model.num_layers, model.vocab_size
    if row["id"].startswith("megatron-sc21"):  # eq. 3: with the recomputed forward
        return 96 * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))
    if row["id"].startswith("megatron-readme"):  # Megatron-LM: no recompute, full s x s
        return 72 * layers * h * h * (1 + seq / (6 * h)) + 6 * h * vocab
    if row["id"].startswith("megatron-moerecipe"):
        return megatron_core_flops_per_token(model, seq, tp=int(row["tp"]))
    return model_flops_per_token(model, seq)


def megatron_core_flops_per_token(model: planner.ModelSpec, seq: int, *, tp: int) -> float:
    """Megatron-Core's own count, as its training loop logs TFLOP/s
    (``num_floating_point_operations``, ``transformer_flops``, in megatron/training/
    training.py of NVIDIA/Megatron-LM at 001b00c2): 3 (forward, two backward GEMMs) x 2 (FMA)
    per weight a token passes through, with every routed expert it visits and the shared
    experts in each MoE layer, the MTP layers counted as layers of the last layer's kind;
    MLA's projections as its q and kv ranks give them (each rank + 1 for its norm) and the
    core attention over half the s x s scores; the MTP modules' norms (3h) and projection
    (2h^2); the output layer over the padded vocabulary once per MTP module and for the main
    model. The vocabulary is padded to a multiple of 128 x tp (Megatron-LM's
    --make-vocab-size-divisible-by default)."""
    h, mtp = model.hidden_size, model.num_mtp_layers
    kinds = [model.is_moe_layer(i) for i in range(model.num_layers)]
    moe_layers = sum(kinds) + (mtp if kinds[-1] else 0)
    dense_layers = model.num_layers + mtp - moe_layers
    glu = 3 if model.gated_mlp else 2
    shared = shared_width(model)
    routed = model.moe_ffn_hidden_size * model.experts_per_token
    mlp = h * glu * (model.ffn_hidden_size * dense_layers + (routed + shared) * moe_layers)
    n, layers = model.num_attention_heads, model.num_layers + mtp
    if model.attention == "mla":
        dq, dr, dv = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
        rank = model.q_lora_rank
        q = rank * (h + n * (dq + dr) + 1) if rank else h * n * (dq + dr)
        kv = model.kv_lora_rank * (h + n * (dq + dv) + 1) + h * dr
        attention = q + kv + n * dv * h + seq * n * (dq + dr) / 2 + seq * n * dv / 2
    else:
        d, g = model.head_dim, model.num_kv_heads
        attention = h * (n * d + 2 * g * d) + n * d * seq / 2 * 2 + n * d * h
    padded = -(-model.vocab_size // (128 * tp)) * 128 * tp
    return 6 * (mlp + layers * attention + mtp * (3 * h + 2 * h * h) + h * padded * (mtp + 1))


def measured_step(row: dict[str, str], model: planner.ModelSpec, peak: float) -> float:
    gpus = int(row["num_gpus"])
    tokens = int(row["global_batch"]) * int(row["seq_len"])
    value = float(row["value"])
    metric = row["metric"]
    if metric == "step_s":
        return value
    if metric == "tokens_per_s_per_gpu":
        return tokens / (value * gpus)
    flops = source_flops_per_token(row, model, int(row["seq_len"])) * tokens
    if metric == "tflops_per_gpu":
        return flops / (value * 1e12 * gpus)
    if metric == "mfu":
        return flops / (value * peak * gpus)
    raise PlannerError(f"row {row['id']}: metric {metric!r} unknown")


def recompute_choices(model: planner.ModelSpec, framework: str) -> list[str]:
    """The recompute choices a run of ``model`` under ``framework`` could have used where its
    source does not state one: what the framework's launcher can state, none first and full
    last. Megatron-LM's --recompute-modules take any combination of the modules the model has
    (``selective`` is core_attn alone); torchtitan's none, per-op and full; DeepSpeed's none
    and full (its 2021 releases, which have no launcher here, too: whole layers or none)."""
    fw = framework_of(framework)
    stated = fw.launcher.recompute if fw.launcher else ("none", "full")
    if stated is not None:
        return ["none", *(["op"] if fw.op_sac else []), "full"]
    modules = model_modules(model)
    combos = [
        "+".join(c) for n in range(1, len(modules) + 1) for c in itertools.combinations(modules, n)
    ]
    return ["none", *combos, "full"]


def fastest_fitting(
    choices: list[str], estimate: Callable[[str], planner.Estimate]
) -> tuple[str, planner.Estimate]:
    """Of the recompute ``choices``, the one whose layout fits HBM in the model (headroom >= 0,
    not the planner's cap under its margin: the run trained) at the shortest predicted step;
    where none fits, the one of least peak memory. Recompute only adds work, so a choice
    whose modules hold all of a fitting choice's is not tried (``none`` fitting ends the
    search). A choice the layout refuses (``PlannerError``) is passed over; where every one
    is, the last refusal is raised."""
    best: tuple[tuple[int, float], str, planner.Estimate] | None = None
    fitting: list[frozenset[str]] = []
    refused: PlannerError | None = None
    for choice in choices:
        modules = frozenset() if choice == "none" else frozenset(choice.split("+"))
        if any(f <= modules for f in fitting):
            continue
        try:
            est = estimate(choice)
        except PlannerError as exc:
            refused = exc
            continue
        fits = est.headroom >= 0
        key = (0, est.step_time_s) if fits else (1, float(est.peak_bytes))
        if best is None or key < best[0]:
            best = (key, choice, est)
        if fits:
            fitting.append(modules)
    if best is None:
        assert refused is not None
        raise refused
    return best[1], best[2]


def cost(row: dict[str, str]) -> tuple[float, float, Costed]:
    """(measured, predicted) seconds per step of one row, and what was assumed."""
    gpu = row["gpu"]
    if gpu not in planner.cluster_names():
        raise PlannerError(f"gpu={gpu}: no catalog entry")
    if row["model"].startswith("hf:"):  # a catalog model whose config came from that repo
        by_repo = {hf_repo(name): name for name in planner.model_names()}
        name = by_repo.get(row["model"].removeprefix("hf:"))
        if name is None:
            raise PlannerError(f"model={row['model']}: architecture not in the catalog")
        row = {**row, "model": name}
    assumed = []
    fields = dict(row)
    framework = row["framework"]
    if framework not in ZERO:
        assumed.append(f"{framework} stack overlaps as megatron")
        framework = "megatron"
    if row.get("tp_comm_overlap") == "false" and int(row["tp"]) > 1:
        assumed.append("tensor-parallel collectives exposed (tp_comm_overlap false)")
    fields["framework"] = framework
    # A row that states its ZeRO stage (column zero) keeps it; sequence_parallel passes as is
    fields["zero"] = row.get("zero") or ("3" if row["schedule"] == "fsdp" else str(ZERO[framework]))
    pp = int(row["pp"])
    schedule = row["schedule"]
    if schedule == "fsdp":
        schedule = "1f1b"
    elif schedule == "unstated":
        schedule = "1f1b"
        if pp > 1:
            assumed.append("schedule 1f1b")
    fields["schedule"] = SCHEDULES.get(schedule, schedule)
    micro_batches = [row["micro_batch"]]
    if not row["micro_batch"]:
        # as the recompute below: the fastest micro-batch that fits, of those dividing each
        # data-parallel rank's share of the batch (up to 8)
        share = int(row["global_batch"]) // int(row["dp"])  # cp splits sequences, not the batch
        micro_batches = [str(b) for b in range(1, 9) if share % b == 0] or ["1"]
    interleaved = schedule_of(fields["schedule"]).virtual_stages is None  # any >= 2 chunks
    if not interleaved or not row["vp"]:
        fields["vp"] = "" if interleaved else "1"
        if interleaved and not row["vp"]:
            assumed.append("2 virtual stages")
    model = (
        gpt_model(row["model"])
        if row["model"].startswith("gpt:")
        else planner.load_model(row["model"])
    )
    if model.num_experts and not row.get("dispatcher", "").strip():
        assumed.append("NCCL all-to-all dispatcher")
    cluster = planner.load_cluster(PROFILES.get(gpu, gpu), gpus=int(row["num_gpus"]))
    measured = measured_step(row, model, cluster.bf16_flops)
    fields["metric"], fields["value"] = "step_s", str(measured)
    recompute = row["recompute"]
    if framework == "torchtitan" and recompute == "selective":
        # torchtitan's selective checkpointing in its Llama 3 configs is per-op ("op"),
        # costed as the planner's op recompute (as benchmarks/published_memory.py does)
        recompute = "op"
        assumed.append("torchtitan selective checkpointing as op")
    if recompute.startswith("selective("):
        modules = recompute.removeprefix("selective(").removesuffix(")").split("+")
        recompute = "+".join(MODULES.get(m, m) for m in modules)
    elif "+" in recompute:
        recompute = "+".join(MODULES.get(m, m) for m in recompute.split("+"))
    choices = [recompute]
    if recompute == "unstated":
        choices = recompute_choices(model, framework)

    best: tuple[tuple[int, float], str, str, planner.Estimate] | None = None
    refused: PlannerError | None = None
    for micro in micro_batches:

        def estimate(choice: str, micro: str = micro) -> planner.Estimate:
            run = run_from_row({**fields, "micro_batch": micro, "recompute": choice}, row["id"])
            return planner.evaluate(run.model, cluster, run.job, run.layout)

        try:
            choice, est = fastest_fitting(choices, estimate)
        except PlannerError as exc:
            refused = exc
            continue
        key = (0, est.step_time_s) if est.headroom >= 0 else (1, float(est.peak_bytes))
        if best is None or key < best[0]:
            best = (key, micro, choice, est)
    if best is None:
        assert refused is not None
        raise refused
    _, fields["micro_batch"], fields["recompute"], est = best
    run = run_from_row(fields, row["id"])
    if not row["micro_batch"]:
        assumed.append(f"micro-batch {fields['micro_batch']} (fastest that fits)")
    if recompute == "unstated":
        assumed.append(f"recompute {fields['recompute']} (fastest that fits)")
    measured_run = Run(run.model, run.job, run.layout, measured, row["id"])
    tokens = run.job.tokens_per_step
    flops = model_flops_per_token(run.model, run.job.seq_len) * tokens
    mfu = flops / (measured * int(row["num_gpus"]) * cluster.bf16_flops)
    return (
        measured,
        est.step_time_s,
        Costed(est.fits, bool(run.model.num_experts), assumed, measured_run, mfu, est.headroom < 0),
    )


def read_rows(path: Path = DATA) -> list[dict[str, str]]:
    """The runs of a runs CSV (``published_runs.csv`` by default), blank lines left out."""
    with path.open(newline="") as handle:
        return [r for r in csv.DictReader(handle) if r.get("id")]


def costed_rows(
    rows: Iterable[dict[str, str]],
) -> Iterator[tuple[dict[str, str], float, float, Costed]]:
    """Each of ``rows`` the planner can cost, with its measured and predicted seconds per step
    and what was assumed (``cost``); the others are passed over (``main`` lists each with its
    reason)."""
    for row in rows:
        try:
            measured, predicted, costed = cost(row)
        except PlannerError:
            continue
        yield row, measured, predicted, costed


def summary(
    errors: dict[str, list[float]],
    signed: dict[str, list[float]],
    ceilings: dict[str, list[tuple[int, float, str]]],
) -> dict[str, Any]:
    """Per-GPU and overall mean absolute and mean signed error, and each GPU and
    precision's measured MFUs by GPU count (what --write stores: ``estimate.mfu_note``
    compares a prediction with the best of them at its scale)."""

    def figures(key: str) -> dict[str, Any]:
        return {
            "mape": round(float(np.mean(errors[key])), 4),
            "bias": round(float(np.mean(signed[key])), 4),
            "rows": len(errors[key]),
        }

    gpus = sorted(k for k in errors if k not in ("all", "moe", "dense"))
    return {
        "source": "benchmarks/published_throughput.py --write over benchmarks/published_runs.csv",
        "all": figures("all"),
        "by_gpu": {g: figures(g) for g in gpus},
        "measured_mfu": {
            key: [[n, round(m, 4), name] for n, m, name in sorted(ceilings[key])]
            for key in sorted(ceilings)
        },
    }


def add_profile_argument(parser: argparse.ArgumentParser) -> None:
    """``--profile GPU=YAML``: a GPU's rows costed with a fitted cluster YAML (``PROFILES``)."""
    parser.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="GPU=YAML",
        help="cost that GPU's rows with this cluster YAML instead of the catalog's (e.g. "
        "a100=a100-vtrain.yaml from vtrain_fidelity.py --out): a fit on other data, checked "
        "on these rows",
    )


def use_profiles(items: list[str]) -> None:
    """Take ``--profile`` values (``GPU=YAML``) into ``PROFILES``."""
    for item in items:
        gpu, _, path = item.partition("=")
        PROFILES[gpu] = Path(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=DATA)
    parser.add_argument(
        "--write",
        action="store_true",
        help=f"store the per-GPU errors in {ACCURACY.relative_to(ACCURACY.parents[1])}, which "
        "every estimate quotes as its expected error",
    )
    parser.add_argument(
        "--fit",
        action="store_true",
        help="also fit each GPU's constants to its rows (planner.fit_runs) and print the "
        "5-fold held-out error: how much of the error the constants explain",
    )
    add_profile_argument(parser)
    args = parser.parse_args()
    if args.write and args.profile:
        parser.error("--write stores the catalog constants' errors: leave out --profile")
    use_profiles(args.profile)
    started = time.perf_counter()
    with args.csv.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    errors: dict[str, list[float]] = defaultdict(list)
    signed: dict[str, list[float]] = defaultdict(list)
    ceilings: dict[str, list[tuple[int, float, str]]] = defaultdict(list)
    skipped = []
    by_gpu: dict[str, list[Run]] = defaultdict(list)
    print(f"{'id':42} {'gpu':5} {'layout':34} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    for row in rows:
        try:
            measured, predicted, est = cost(row)
        except PlannerError as exc:
            skipped.append((row["id"], str(exc)))
            continue
        error = predicted / measured - 1
        moe = "moe" if est.moe else "dense"
        for key in ("all", row["gpu"], moe):
            errors[key].append(abs(error))
            signed[key].append(error)
        by_gpu[row["gpu"]].append(est.run)
        ceilings[ceiling_key(row)].append((int(row["num_gpus"]), est.measured_mfu, row["id"]))
        layout = (
            f"tp{row['tp']} pp{row['pp']} dp{row['dp']} ep{row['ep']} vp{row['vp']} "
            f"mb{row['micro_batch']} {row['schedule']}"
        )
        flag = "" if est.fits else " (over the planner's memory cap)"
        if est.run_over_hbm:
            flag = " (does not fit HBM in the model)"
        if est.assumed:
            flag += f" [assumed: {', '.join(est.assumed)}]"
        print(
            f"{row['id'][:42]:42} {row['gpu']:5} {layout[:34]:34} {measured:10.3f} "
            f"{predicted:11.3f} {error:+7.1%}{flag}"
        )
    print()
    for key in ["all", *sorted(k for k in errors if k not in ("all",))]:
        e = errors[key]
        print(
            f"MAPE {key:6}: {100 * np.mean(e):5.1f}% over {len(e)} rows "
            f"(median {100 * np.median(e):.1f}%, worst {100 * max(e):.1f}%)"
        )
    for name, why in skipped:
        print(f"not costed: {name}: {why}")
    if args.fit:
        print("\nconstants fitted per GPU to its own rows (planner.fit_runs), 5-fold held out:")
        for gpu, runs in sorted(by_gpu.items()):
            if len(runs) < 5:
                print(f"  {gpu}: {len(runs)} rows, too few to cross-validate")
                continue
            found = fit_runs(planner.load_cluster(gpu, gpus=8), runs, folds=5, rounds=2)
            shown = found.fitted_text()
            print(
                f"  {gpu}: {len(runs)} rows, MAPE {found.before_mape:.1%} catalog, "
                f"{found.fit_mape:.1%} fitted, {found.heldout_mape:.1%} held out ({shown})"
            )
    if args.write:
        ACCURACY.write_text(json.dumps(summary(errors, signed, ceilings), indent=1) + "\n")
        print(f"wrote {ACCURACY}")
    print(f"wall time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
