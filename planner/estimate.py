"""``evaluate``: cost a given layout of a model on a cluster for a job.

It checks the layout against the model, the cluster and the job (every block placed once, in
order; degrees that divide; the world size; micro-batching that adds up to the global batch),
then returns an ``Estimate``. Memory is modelled (``planner.costs.memory``); step time is not
yet, and its fields stay ``None`` until the time model lands.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from planner.costs.blocks import block_names
from planner.costs.memory import StageMemory, stage_memory
from planner.errors import PlannerError
from planner.layout import Layout
from planner.specs import ClusterSpec, ModelSpec, TrainingJob


class Estimate(BaseModel):
    """What a layout costs: per-rank memory (bytes) and, once modelled, step time (seconds)."""

    model_config = ConfigDict(frozen=True)

    memory: list[StageMemory] = Field(description="One entry per pipeline position.")
    peak_bytes: int = Field(description="Largest per-rank peak over all pipeline positions.")
    hbm_bytes: int = Field(description="HBM capacity per GPU (bytes), for comparison.")
    num_microbatches: int = Field(description="Micro-batches per step per pipeline.")
    step_time_s: float | None = Field(default=None, description="Not modelled yet: None.")
    breakdown: dict[str, float] = Field(default_factory=dict, description="Seconds per part.")
    mfu: float | None = Field(default=None, description="Not modelled yet: None.")
    tflops_per_gpu: float | None = Field(default=None, description="Not modelled yet: None.")
    tokens_per_s: float | None = Field(default=None, description="Not modelled yet: None.")

    @property
    def fits(self) -> bool:
        """Whether every rank's predicted peak is within its GPU's HBM."""
        return self.peak_bytes <= self.hbm_bytes


def evaluate(model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, layout: Layout) -> Estimate:
    """Cost ``layout``: per-rank memory now, step time when the time model lands."""
    m = check_layout(model, cluster, job, layout)
    memory = stage_memory(model, job, layout, num_microbatches=m)
    return Estimate(
        memory=memory,
        peak_bytes=max(s.peak_bytes for s in memory),
        hbm_bytes=cluster.hbm_bytes,
        num_microbatches=m,
    )


def check_layout(model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, layout: Layout) -> int:
    """Raise a one-line ``PlannerError`` for a layout that cannot run; return the number of
    micro-batches per step."""
    if layout.world_size != cluster.num_gpus:
        raise PlannerError(
            f"Layout: tp*pp*dp={layout.tp}*{layout.pp}*{layout.dp}={layout.world_size} must "
            f"equal the cluster's GPU count {cluster.num_gpus}"
        )
    if layout.tp > cluster.gpus_per_node:
        raise PlannerError(
            f"Layout.tp={layout.tp}: tensor parallelism must stay within a node of "
            f"{cluster.gpus_per_node} GPUs"
        )
    per_step = layout.dp * layout.micro_batch
    if job.global_batch % per_step:
        raise PlannerError(
            f"TrainingJob.global_batch={job.global_batch}: must be a multiple of "
            f"dp*micro_batch={per_step}"
        )
    m = job.global_batch // per_step
    if layout.num_microbatches is not None and layout.num_microbatches != m:
        raise PlannerError(
            f"Layout.num_microbatches={layout.num_microbatches}: global_batch/(dp*micro_batch)"
            f" is {m}"
        )
    placed = [b.block for stage in layout.stages for b in stage.blocks]
    expected = block_names(model)
    if placed != expected:
        missing = sorted(set(expected) - set(placed))
        extra = [b for b in placed if b not in expected]
        detail = (
            f"missing {missing[0]}"
            if missing
            else f"unknown {extra[0]}"
            if extra
            else "out of order"
        )
        raise PlannerError(
            f"Layout.stages: every block of {model.name} must appear once, in model order "
            f"(embedding, layer.0..layer.{model.num_layers - 1}, mtp.*, head): {detail}"
        )
    return m
