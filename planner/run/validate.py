"""``validate``: run a set of layouts of a small model for real and set what was measured
beside what the cost model predicts, per rank and bucket.

The model is a scaled-down Mixtral (4 layers: GQA attention, 4 experts, top-2 softmax
router; vocabulary 2048, hidden 256), and a variant with a tied embedding and head. The job
keeps everything in FP32 with plain AdamW (what CPU training holds) and no CUDA context,
communication buffers or fragmentation (there are none on CPU).

What is compared, per rank:
- the step's peak of live tensor bytes, against the predicted peak;
- weights, gradients, optimizer state and activations: each bucket's own highest level in
  the step (``planner.run.track``) against the predicted bucket;
- ``other`` (everything else live: pipeline buffers, ZeRO-3's gathered weights, the reduce
  bucket, gradients in flight in backward) against the predicted ``buffers``.

The prediction is ``costs.memory.stage_memory`` with ``runtime="torch"``: it holds tensors
as PyTorch's pipelining does (stage outputs until their backward, receive buffers per
micro-batch, input gradients until the step ends).
Step times are measured (median of the timed steps) and predicted by
``planner.estimate.evaluate`` with a calibrated profile of this machine
(``planner.run.calibrate``) of as many workers as the layout has ranks. ``ranking`` sets the
predicted order of layouts by step time beside the measured one, for the layouts this
machine can stand for (see there).
"""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from planner.catalog import load_model
from planner.costs.memory import stage_memory
from planner.estimate import evaluate
from planner.layout import Layout
from planner.logs.megatron import WARMUP, write_log
from planner.run.device import Device
from planner.specs import ClusterSpec, ModelSpec, TrainingJob

COMPARED = ("weights", "grads", "optimizer", "activations")
# Warm-up steps of a logged run: the log reader's (planner.logs.megatron.WARMUP), so that the
# median it reads is over the same timed steps as the run's own
LOG_WARMUP = WARMUP
TOLERANCE = 0.05  # relative, on the peak and on each bucket
FLOOR_BYTES = 2**20  # a bucket within 1 MiB agrees however small it is


def small_model(*, tied: bool = False) -> ModelSpec:
    """The validation model: Mixtral's block kinds at a size a 2-core CPU trains in
    seconds."""
    return load_model("mixtral-8x7b").model_copy(
        update={
            "name": "mixtral-tiny-tied" if tied else "mixtral-tiny",
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 64,
            "ffn_hidden_size": 512,
            "moe_ffn_hidden_size": 256,
            "num_experts": 4,
            "experts_per_token": 2,
            "num_layers": 4,
            "vocab_size": 2048,
            "tie_word_embeddings": tied,
        }
    )


def small_job(seq_len: int = 256, global_batch: int = 8, *, dtype: str = "fp32") -> TrainingJob:
    """Weights, gradients, AdamW moments and activations all in ``dtype`` (FP32 on CPU, the
    device's measurement dtype, BF16, on CUDA); no CUDA context, communication buffers or
    fragmentation in the prediction (the CUDA context and NCCL's buffers lie outside the
    caching allocator the measurement reads; fragmentation is its reserved peak, reported
    beside), and on the CPU (FP32) no cuBLAS workspace; the eager ``torch`` runtime, which
    runs each collective in turn with the compute, as ``run_layout`` does."""
    return TrainingJob(
        seq_len=seq_len,
        global_batch=global_batch,
        framework="torch",
        weight_dtype=dtype,
        grad_dtype=dtype,
        master_dtype=None,
        moment_dtype=dtype,
        activation_dtype=dtype,
        cuda_context_bytes=0,
        comm_buffer_bytes=0,
        workspace_bytes=0 if dtype == "fp32" else None,
        fragmentation=0.0,
    )


def validation_set() -> list[tuple[ModelSpec, Layout]]:
    """Layouts covering ZeRO 0-3, recompute none / selective (the MoE module) / full,
    pp 1, 2 and 4, 1F1B and interleaved, ep 1 and 2, and a tied embedding and head; the
    last two, single-rank recompute, also widen the spread of step times to rank."""
    model, tied = small_model(), small_model(tied=True)
    cases: list[tuple[ModelSpec, dict[str, Any]]] = [
        (model, {"dp": 2, "zero": 0}),
        (model, {"dp": 2, "zero": 1, "recompute": "moe"}),
        (model, {"dp": 2, "zero": 2, "recompute": "full"}),
        (model, {"dp": 2, "zero": 3}),
        (model, {"pp": 2, "dp": 2, "zero": 1, "recompute": "moe"}),
        (model, {"pp": 4, "zero": 0}),
        (model, {"pp": 2, "zero": 0, "schedule": "interleaved"}),
        (model, {"dp": 2, "ep": 2, "zero": 1}),
        (tied, {"zero": 1}),
        (model, {"zero": 0, "recompute": "moe"}),
        (model, {"zero": 0, "recompute": "full"}),
    ]
    return [(m, Layout.uniform(m, micro_batch=1, **kw)) for m, kw in cases]


def one_gpu_set(
    dtype: str = "bf16", *, moe: bool = False
) -> tuple[TrainingJob, list[tuple[ModelSpec, Layout]]]:
    """A job at real widths that one GPU runs in several layouts, sequence 4,096, 8 sequences
    a step. Dense: Llama 3 8B's layer (hidden 4,096, GQA 32/8 heads, SwiGLU 14,336,
    vocabulary 128,256) four layers deep, at micro-batch 1, 2, 4 and 8, each with no recompute,
    Megatron-LM's selective recompute (core attention) and full recompute. ``moe``:
    Mixtral 8x7B's layer (8 experts of 14,336, top-2; vocabulary 32,000) two layers deep, at
    micro-batch 1 and 2, each with no recompute, the MoE module's and full recompute. The
    layouts of one job, whose step times spread with the micro-batch's GEMM shapes and the
    recomputed work, and whose memory spreads with the activations kept."""
    name, layers = ("mixtral-8x7b", 2) if moe else ("llama3-8b", 4)
    choices = ("none", "moe", "full") if moe else ("none", "selective", "full")
    batches: tuple[int, ...] = (1, 2) if moe else (1, 2, 4, 8)
    model = load_model(name).model_copy(update={"name": f"{name}-{layers}l", "num_layers": layers})
    job = small_job(seq_len=4096, global_batch=8, dtype=dtype)
    cases = [
        (model, Layout.uniform(model, micro_batch=mb, recompute=choice))
        for mb in batches
        for choice in choices
    ]
    return job, cases


class Bucket(BaseModel):
    predicted_bytes: int = Field(description="Cost model (bytes).")
    measured_bytes: int = Field(description="Measured: the bucket's highest level (bytes).")
    error: float = Field(description="predicted / measured - 1.")
    agrees: bool = Field(description="Within 5% or 1 MiB.")


class Entry(BaseModel):
    """One rank of one layout: predicted against measured."""

    model: str
    layout: dict[str, Any] = Field(description="Degrees, schedule, ZeRO stage, recompute.")
    rank: int
    pp_rank: int
    predicted_peak_bytes: int
    measured_peak_bytes: int = Field(description="Peak of live tensor bytes in the step.")
    peak_error: float = Field(description="predicted / measured - 1.")
    allocated_peak_bytes: int = Field(
        default=0,
        description="Allocator's allocated peak (CUDA max_memory_allocated); on CPU the live "
        "tensor bytes' peak.",
    )
    reserved_peak_bytes: int | None = Field(
        default=None, description="CUDA caching allocator's reserved peak; None on CPU."
    )
    buckets: dict[str, Bucket]
    predicted_step_s: float | None = Field(
        description="Cost model with a calibrated profile (s); null without one."
    )
    measured_step_s: float = Field(description="Median wall time of the timed steps (s).")
    losses: list[float] = Field(description="Loss of each step on a last-stage rank.")


def describe(layout: Layout) -> dict[str, Any]:
    """The parts of a layout a reader compares runs by."""
    choices = sorted({p.recompute for s in layout.stages for p in s.blocks if p.block != "head"})
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "dp": layout.dp,
        "ep": layout.ep,
        "zero": layout.zero,
        "schedule": layout.schedule,
        "virtual_stages": layout.virtual_stages,
        "micro_batch": layout.micro_batch,
        "recompute": "+".join(c for c in choices if c != "none") or "none",
    }


def _bucket(predicted: float, measured: int) -> Bucket:
    error = predicted / measured - 1 if measured else 0.0
    agrees = abs(predicted - measured) <= max(TOLERANCE * measured, FLOOR_BYTES)
    return Bucket(
        predicted_bytes=round(predicted), measured_bytes=measured, error=error, agrees=agrees
    )


def compare(
    model: ModelSpec,
    job: TrainingJob,
    layout: Layout,
    *,
    steps: int = 3,
    cluster: ClusterSpec | None = None,
    device: Device | None = None,
    log: Path | None = None,
) -> list[Entry]:
    """Run ``layout`` on ``device`` (default the CPU) and compare every rank with the cost
    model (step time too, with a calibrated ``cluster`` of ``layout.world_size`` GPUs).
    With ``log``, the run also goes to that file in Megatron-LM's log format
    (``planner.logs.megatron.write_log``; appended as a further start where it exists): every
    step, ``LOG_WARMUP`` warm-up steps first, each the slowest rank's time."""
    from planner.run.execute import check_runnable, run_layout

    m = check_runnable(model, job, layout)
    predicted = stage_memory(model, job, layout, num_microbatches=m, runtime="torch")
    step_s = evaluate(model, cluster, job, layout).step_time_s if cluster else None
    warmup = LOG_WARMUP if log is not None else 1
    runs = run_layout(model, job, layout, steps=steps, warmup=warmup, device=device)
    if log is not None:
        times = [max(col) for col in zip(*(r.warmup_s + r.step_s for r in runs), strict=True)]
        memory = [(r.rank, r.allocated_peak_bytes, r.reserved_peak_bytes) for r in runs]
        losses = next((r.losses for r in reversed(runs) if r.losses), None)
        write_log(log, model, job, layout, times, memory, losses, append=log.exists())
    out = []
    for run in runs:
        p = predicted[run.pp_rank]
        # each bucket at its own highest level: gradients freed each step (not live at a
        # peak before the first backward) reach theirs after it
        highest = {**p.buckets, "grads": max(p.buckets["grads"], p.step_grad_bytes)}
        buckets = {k: _bucket(highest[k], run.bucket_peaks[k]) for k in COMPARED}
        buckets["other"] = _bucket(p.buckets["buffers"], run.bucket_peaks["other"])
        out.append(
            Entry(
                model=model.name,
                layout=describe(layout),
                rank=run.rank,
                pp_rank=run.pp_rank,
                predicted_peak_bytes=p.peak_bytes,
                measured_peak_bytes=run.peak_bytes,
                peak_error=p.peak_bytes / run.peak_bytes - 1,
                allocated_peak_bytes=run.allocated_peak_bytes,
                reserved_peak_bytes=run.reserved_peak_bytes,
                buckets=buckets,
                predicted_step_s=step_s,
                measured_step_s=run.median_step_s,
                losses=run.losses,
            )
        )
    return out


def validate(
    cases: Iterable[tuple[ModelSpec, Layout]] | None = None,
    *,
    job: TrainingJob | None = None,
    steps: int = 3,
    rounds: int = 1,
    clusters: Callable[[int], ClusterSpec | None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    device: Device | None = None,
    log_dir: Path | None = None,
) -> list[Entry]:
    """Run every case (default: ``validation_set()``) on ``device`` (default the CPU) and
    compare; ``clusters(ranks)`` gives the calibrated profile for a layout of that many
    ranks (no step-time prediction without it); ``progress(done, total)`` after each run.
    With ``rounds`` > 1 the whole set runs that many times over, one case after another,
    and each rank's step time is the median of its rounds' (a shared machine's slow spells
    then fall on every layout alike); memory is the first round's (it does not change from
    run to run). With ``log_dir``, each case's runs also go to ``<case>-<layout>.log`` there
    in Megatron-LM's log format, one start per round (``compare``)."""
    todo = list(cases if cases is not None else validation_set())
    job = job or small_job(dtype=(device or Device()).dtype_name)
    per_round: list[list[list[Entry]]] = []
    for r in range(rounds):
        runs = []
        for i, (model, layout) in enumerate(todo):
            cluster = clusters(layout.world_size) if clusters else None
            log = log_dir / log_name(i + 1, model, layout) if log_dir is not None else None
            runs.append(
                compare(model, job, layout, steps=steps, cluster=cluster, device=device, log=log)
            )
            if progress is not None:
                progress(r * len(todo) + i + 1, rounds * len(todo))
        per_round.append(runs)
    entries: list[Entry] = []
    for i, first in enumerate(per_round[0]):
        for j, entry in enumerate(first):
            times = [runs[i][j].measured_step_s for runs in per_round]
            entries.append(entry.model_copy(update={"measured_step_s": statistics.median(times)}))
    return entries


def log_name(case: int, model: ModelSpec, layout: Layout) -> str:
    """The log file of a validation case: its number and layout's short name."""
    name = layout_name(describe(layout), model.name)
    return f"{case:02d}-" + re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") + ".log"


class Ranking(BaseModel):
    """Layouts ordered by measured step time, with the predicted times beside them."""

    layouts: list[str] = Field(description="The ranked layouts, in measured order, fastest first.")
    measured_s: list[float] = Field(description="Measured step time of each (s).")
    predicted_s: list[float] = Field(description="Predicted step time of each (s).")
    same_order: bool = Field(description="The predicted order is the measured one.")
    discordant_pairs: int = Field(description="Pairs the prediction orders the other way.")
    mean_abs_error: float = Field(description="Mean of |predicted / measured - 1|.")
    left_out: dict[str, str] = Field(description="Layouts not ranked, with the reason.")


def layout_name(lay: dict[str, Any], model: str = "") -> str:
    """A described layout's short name: degrees, ZeRO stage, schedule, recompute, and the
    micro-batch where it is not 1."""
    mb = f" mb{lay['micro_batch']}" if lay.get("micro_batch", 1) != 1 else ""
    return (
        f"pp{lay['pp']} dp{lay['dp']} ep{lay['ep']} z{lay['zero']}{mb} {lay['schedule']} "
        f"{lay['recompute']}" + (" tied" if model.endswith("tied") else "")
    )


def label(entry: Entry) -> str:
    """The short name of an entry's layout (``layout_name``)."""
    return layout_name(entry.layout, entry.model)


def ranking(entries: list[Entry], *, cores: int | None = None) -> Ranking:
    """The layouts' measured and predicted order by step time (a layout's time: its
    slowest rank's median, as a step ends when every rank is done). Ranked: layouts whose
    run this machine can stand for, i.e. no more ranks than ``cores`` (more share cores
    the profile gives each rank whole, and a pipeline's idle ranks lend theirs). The jobs
    are costed as the ``torch`` framework, which runs data-parallel and ZeRO collectives in
    series with the compute, as gloo does here."""
    cores = cores or os.cpu_count() or 1
    per: dict[str, tuple[float, float]] = {}
    left_out: dict[str, str] = {}
    for e in entries:
        name = label(e)
        ranks = e.layout["pp"] * e.layout["dp"] * e.layout["tp"]
        if e.predicted_step_s is None:
            left_out[name] = "no calibrated profile"
        elif ranks > cores:
            left_out[name] = f"{ranks} ranks on {cores} cores"
        else:
            measured = max(per.get(name, (0.0, 0.0))[0], e.measured_step_s)
            per[name] = (measured, e.predicted_step_s)
    rows = sorted((m, p, n) for n, (m, p) in per.items())
    discordant = sum(
        1 for i, (_, p_i, _) in enumerate(rows) for _, p_j, _ in rows[i + 1 :] if p_j < p_i
    )
    return Ranking(
        layouts=[n for _, _, n in rows],
        measured_s=[m for m, _, _ in rows],
        predicted_s=[p for _, p, _ in rows],
        same_order=discordant == 0,
        discordant_pairs=discordant,
        mean_abs_error=sum(abs(p / m - 1) for m, p, _ in rows) / len(rows) if rows else 0.0,
        left_out=left_out,
    )


class CapRun(BaseModel):
    """One layout of the memory-cap demonstration: the planner's word and the real run's."""

    layout: dict[str, Any] = Field(description="Degrees, schedule, ZeRO stage, recompute.")
    predicted_peak_bytes: int = Field(description="The planner's per-rank peak (bytes).")
    measured_peak_bytes: list[int] = Field(description="Each rank's measured peak (bytes).")
    predicted_step_s: float = Field(description="The planner's step time (s).")


class CapDemo(BaseModel):
    """The planner's fastest layout ignoring memory, which a cap rules out, against the
    fastest layout it finds under the cap, both run for real."""

    cap_bytes: int = Field(
        description="Memory per rank the planner was given (bytes): the capped cluster's usable "
        "HBM."
    )
    margin: float = Field(
        description="Fraction of the cap the planner keeps free for its memory model's error "
        "(TrainingJob.memory_margin): a plan's predicted peak stays within "
        "cap_bytes * (1 - margin)."
    )
    rejected: CapRun = Field(description="Fastest layout without the cap; over it.")
    accepted: CapRun = Field(description="The planner's plan under the cap.")

    @property
    def shown(self) -> bool:
        """The rejected layout really peaks above the cap and the accepted one below."""
        return (
            min(self.rejected.measured_peak_bytes)
            > self.cap_bytes
            >= max(self.accepted.measured_peak_bytes)
        )


def cap_demo(cluster: ClusterSpec, cap_bytes: int, *, margin: float = 0.05) -> CapDemo:
    """Plan the small model on ``cluster`` (its GPU count) without a memory limit and under
    ``cap_bytes`` per rank (the capped cluster's usable HBM), then run both plans. The planner
    keeps ``margin`` of the cap free for its memory model's error (the job's
    ``memory_margin``), so the accepted plan's predicted peak is within
    ``cap_bytes * (1 - margin)``. The job keeps no fragmentation allowance: on CPU there is
    no caching allocator, and the measured peak is live tensor bytes, the same quantity as
    the prediction, so the two compare directly.
    Searched: tp 1, ep 1, micro-batch 1, 1F1B, recompute none / MoE / full (what real runs
    cover here)."""
    from planner.errors import PlannerError
    from planner.run.execute import run_layout
    from planner.solve import plan
    from planner.specs import SearchSpace

    model = small_model()
    job = small_job().model_copy(update={"memory_margin": margin})
    space = SearchSpace(
        tp=[1], ep=[1], micro_batch=[1], schedules=["1f1b"], recompute=["none", "moe", "full"]
    )
    roomy = cluster.model_copy(update={"hbm_bytes": 2**40, "hbm_reserved_bytes": 0})
    capped = cluster.model_copy(update={"hbm_bytes": cap_bytes, "hbm_reserved_bytes": 0})
    plans = []
    for what, machine in (("without the cap", roomy), ("under the cap", capped)):
        chosen = plan(model, machine, job, space, time_limit_s=30)
        if chosen.layout is None or chosen.estimate is None:
            raise PlannerError(
                f"cap={cap_bytes / 2**20:g} MiB: no layout of the small model fits {what}"
            )
        assert chosen.estimate.fits, (
            f"the plan {what} predicts {chosen.estimate.peak_bytes} B, above its cap "
            f"{chosen.estimate.cap_bytes} B: the search must state the cap as "
            "planner.costs.cap.memory_cap does"
        )
        plans.append((chosen.layout, chosen.estimate))
    if plans[0][1].peak_bytes <= cap_bytes:
        raise PlannerError(
            f"cap={cap_bytes / 2**20:g} MiB: the fastest layout already fits "
            f"({plans[0][1].peak_bytes / 2**20:.1f} MiB predicted); give a smaller cap"
        )
    runs = []
    for layout, estimate in plans:
        measured = run_layout(model, small_job(), layout, steps=1, warmup=0)
        runs.append(
            CapRun(
                layout=describe(layout),
                predicted_peak_bytes=estimate.peak_bytes,
                measured_peak_bytes=[r.peak_bytes for r in measured],
                predicted_step_s=estimate.step_time_s,
            )
        )
    return CapDemo(cap_bytes=cap_bytes, margin=margin, rejected=runs[0], accepted=runs[1])
