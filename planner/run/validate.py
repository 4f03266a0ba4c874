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
Step times are measured (median of the timed steps); a predicted step time needs a
calibrated profile of this machine, which is not built yet, so it is reported as null.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel, Field

from planner.catalog import load_model
from planner.costs.memory import stage_memory
from planner.layout import Layout
from planner.specs import ModelSpec, TrainingJob

COMPARED = ("weights", "grads", "optimizer", "activations")
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


def small_job(seq_len: int = 256, global_batch: int = 8) -> TrainingJob:
    """FP32 weights, gradients, AdamW moments and activations; nothing GPU-specific."""
    return TrainingJob(
        seq_len=seq_len,
        global_batch=global_batch,
        weight_dtype="fp32",
        grad_dtype="fp32",
        master_dtype=None,
        moment_dtype="fp32",
        activation_dtype="fp32",
        cuda_context_bytes=0,
        comm_buffer_bytes=0,
        fragmentation=0.0,
    )


def validation_set() -> list[tuple[ModelSpec, Layout]]:
    """Layouts covering ZeRO 0-3, recompute none / selective (the MoE module) / full,
    pp 1, 2 and 4, 1F1B and interleaved, ep 1 and 2, and a tied embedding and head."""
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
    ]
    return [(m, Layout.uniform(m, micro_batch=1, **kw)) for m, kw in cases]


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
    measured_peak_bytes: int
    peak_error: float = Field(description="predicted / measured - 1.")
    buckets: dict[str, Bucket]
    predicted_step_s: float | None = Field(description="Needs a calibrated profile.")
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


def compare(model: ModelSpec, job: TrainingJob, layout: Layout, *, steps: int = 3) -> list[Entry]:
    """Run ``layout`` and compare every rank with the cost model."""
    from planner.run.execute import check_runnable, run_layout

    m = check_runnable(model, job, layout)
    predicted = stage_memory(model, job, layout, num_microbatches=m, runtime="torch")
    out = []
    for run in run_layout(model, job, layout, steps=steps):
        p = predicted[run.pp_rank]
        buckets = {k: _bucket(p.buckets[k], run.bucket_peaks[k]) for k in COMPARED}
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
                buckets=buckets,
                predicted_step_s=None,
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
    progress: Callable[[int, int], None] | None = None,
) -> list[Entry]:
    """Run every case (default: ``validation_set()``) and compare; ``progress(done,
    total)`` after each."""
    todo = list(cases if cases is not None else validation_set())
    job = job or small_job()
    entries: list[Entry] = []
    for i, (model, layout) in enumerate(todo):
        entries += compare(model, job, layout, steps=steps)
        if progress is not None:
            progress(i + 1, len(todo))
    return entries
