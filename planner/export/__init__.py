"""Launch configs from a plan: Megatron-LM arguments, a torchtitan TOML, a DeepSpeed config.

Each exporter states the plan's layout in its target's own terms. Where the target cannot
state it exactly (a schedule it lacks, per-block recompute mixes, a ZeRO stage it has no
switch for), the export runs the nearest layout the target can state, lists each
difference, and gives that layout's predicted step time and memory next to the plan's (both
from ``planner.evaluate``), so the cost of the difference is a number, not a guess.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from planner.errors import PlannerError
from planner.estimate import evaluate
from planner.layout import Layout
from planner.solve.result import Plan
from planner.specs import ClusterSpec, ModelSpec, TrainingJob


class Export(BaseModel):
    """A launch config for one target, and how far it is from the plan."""

    model_config = ConfigDict(frozen=True)

    target: str = Field(description="megatron | torchtitan | deepspeed")
    files: dict[str, str] = Field(description="File name -> content (a command line, TOML, JSON).")
    args: list[str] = Field(default_factory=list, description="Megatron-LM argv, one per item.")
    layout: Layout = Field(description="The layout the target runs (the plan's, or the nearest).")
    differences: list[str] = Field(
        default_factory=list, description="What the target cannot state exactly, and what runs."
    )
    planned_step_s: float = Field(description="The plan's predicted step time (seconds).")
    exported_step_s: float = Field(description="Predicted step time of what runs (seconds).")
    exported_peak_bytes: int = Field(description="Its largest per-rank memory peak (bytes).")
    fits: bool = Field(
        description="Whether what runs keeps every rank within the memory cap (usable HBM less "
        "the job's margin; Estimate.fits)."
    )

    @property
    def exact(self) -> bool:
        return not self.differences

    def summary(self) -> str:
        """One paragraph for a person: exact, or what differs and what it costs."""
        if self.exact:
            return f"{self.target}: states the plan exactly ({self.planned_step_s:.3f} s/step)."
        change = self.exported_step_s / self.planned_step_s - 1
        fit = "fits" if self.fits else "DOES NOT FIT the memory cap"
        return (
            f"{self.target}: {len(self.differences)} difference(s); predicted "
            f"{self.exported_step_s:.3f} s/step vs {self.planned_step_s:.3f} planned "
            f"({change:+.1%}), {fit}: " + "; ".join(self.differences)
        )


def inputs(plan: Plan) -> tuple[ModelSpec, ClusterSpec, TrainingJob, Layout]:
    """The plan's model, cluster, job and layout (an infeasible plan has nothing to export)."""
    if plan.layout is None:
        raise PlannerError("export: the plan is infeasible; there is no layout to export")
    if plan.model is None or plan.cluster is None or plan.job is None:
        raise PlannerError(
            "export: the plan does not carry its model, cluster and job (make it with "
            "planner.plan, or pass them)"
        )
    return plan.model, plan.cluster, plan.job, plan.layout


def finish(
    target: str,
    plan: Plan,
    runs: Layout,
    files: dict[str, str],
    differences: list[str],
    args: list[str] | None = None,
) -> Export:
    model, cluster, job, layout = inputs(plan)
    planned = evaluate(model, cluster, job, layout)
    # The exported layout runs under the target's software: what it overlaps (time) is the
    # target's, whatever framework the plan was made for.
    target_job = job.with_framework(target)
    exported = (
        planned
        if (runs, target_job) == (layout, job)
        else evaluate(model, cluster, target_job, runs)
    )
    if target_job != job:
        retimed = evaluate(model, cluster, target_job, layout)
        if abs(retimed.step_time_s - planned.step_time_s) > 1e-9 * planned.step_time_s:
            differences.append(
                f"planned for {job.framework}, run by {target}: what {target} overlaps makes "
                f"the planned layout {retimed.step_time_s:.3f} s per step, not "
                f"{planned.step_time_s:.3f} s"
            )
    return Export(
        target=target,
        files=files,
        args=args or [],
        layout=runs,
        differences=differences,
        planned_step_s=planned.step_time_s,
        exported_step_s=exported.step_time_s,
        exported_peak_bytes=exported.peak_bytes,
        fits=exported.fits,
    )


def settle(plan: Plan, runs: Layout, differences: list[str]) -> Layout:
    """``runs``, or when it breaks a schedule's rule (interleaving needs the micro-batches
    to be a multiple of pp, say) the same degrees on even stages under 1F1B, the reason
    added to ``differences``."""
    model, cluster, job, _ = inputs(plan)
    try:
        evaluate(model, cluster, job, runs)
    except PlannerError as exc:
        differences.append(f"{exc}; runs 1F1B on even stages instead")
        return uniform_1f1b(model, runs)
    return runs


def uniform_1f1b(model: ModelSpec, layout: Layout) -> Layout:
    """The layout's degrees on even stages under 1F1B, one recompute choice for all."""
    return Layout.uniform(
        model,
        pp=layout.pp,
        tp=layout.tp,
        cp=layout.cp,
        dp=layout.dp,
        ep=layout.ep,
        etp=layout.etp,
        zero=layout.zero,
        micro_batch=layout.micro_batch,
        schedule="1f1b",
        recompute=heaviest_choice(layout),
        ema=layout.ema,
        fp8_cache=layout.fp8_cache,
        sequence_parallel=layout.sequence_parallel,
    )


def uniform_recompute(layout: Layout) -> str | None:
    """The one recompute choice every transformer layer takes, or None when they differ."""
    choices = {b.recompute for s in layout.stages for b in s.blocks if b.block.startswith("layer")}
    return choices.pop() if len(choices) == 1 else None


def with_recompute(layout: Layout, choice: str) -> Layout:
    """The layout with every transformer layer (and MTP module) taking ``choice``."""
    stages = [
        s.model_copy(
            update={
                "blocks": [
                    b.model_copy(update={"recompute": choice})
                    if b.block.startswith(("layer.", "mtp."))
                    else b
                    for b in s.blocks
                ]
            }
        )
        for s in layout.stages
    ]
    return layout.model_copy(update={"stages": stages})


def heaviest_choice(layout: Layout) -> str:
    """A single recompute choice that saves no more than any layer's own: ``full`` if any
    layer recomputes fully, else the union of the modules recomputed anywhere."""
    choices = {b.recompute for s in layout.stages for b in s.blocks if b.block.startswith("layer")}
    if "full" in choices:
        return "full"
    modules: set[str] = set()
    for c in choices:
        if c == "selective":
            modules.add("core_attn")
        elif c != "none":
            modules.update(c.split("+"))
    return "+".join(sorted(modules)) if modules else "none"


from planner.export.deepspeed import deepspeed  # noqa: E402
from planner.export.megatron import megatron  # noqa: E402
from planner.export.torchtitan import torchtitan  # noqa: E402

__all__ = ["Export", "deepspeed", "megatron", "torchtitan"]
