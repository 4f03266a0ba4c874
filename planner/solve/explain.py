"""Why a job has no layout that fits, and which changes would make one fit.

The binding constraint is named with its size: the smallest per-rank memory any configuration
of the space could need (its share of the model state and buffers, with nothing saved for
backward) against the usable HBM, or, when no combination of degrees divides the job, that.
Fixes are found by re-solving, not by guessing: the same job on 2x and 4x the GPUs (when
memory binds), and the space with each pinned decision (a degree, the micro-batch, the
schedule, the ZeRO stage, recompute, EMA placement, context parallelism) freed in turn, and
the optimizer state and (without pipeline parallelism) activations offloaded to the host
where the framework can.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.costs.cap import memory_cap
from planner.costs.state import optimizer_offload_rule
from planner.estimate import Estimate
from planner.frameworks import framework
from planner.layout import Layout
from planner.solve.result import Binding, Explanation, Plan
from planner.specs import ClusterSpec, ModelSpec, SearchSpace, TrainingJob

GiB = 2**30
Replan = Callable[[ModelSpec, ClusterSpec, TrainingJob, SearchSpace, float], Plan | None]


def explain(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace,
    *,
    lightest: tuple[float, str] | None,
    replan: Replan,
    time_limit_s: float,
) -> Explanation:
    """``lightest``: (bytes, description) of the configuration with the smallest memory
    floor, or None when no combination of degrees divides the job at all."""
    usable = memory_cap(cluster, job)  # for allocations: usable HBM less margin and context
    binding = []
    if lightest is None:
        binding.append(
            Binding(
                family="degrees",
                where="every combination",
                excess=f"no tp*cp*pp*dp = {cluster.num_gpus} divides the job within the space",
            )
        )
        summary = (
            f"No combination of tensor, pipeline and data parallel degrees in the search "
            f"space divides {cluster.num_gpus} GPUs, {model.num_layers} layers and a global "
            f"batch of {job.global_batch} sequences."
        )
    else:
        need, where = lightest
        excess = need - usable
        binding.append(
            Binding(
                family="memory",
                where=where,
                excess=f"{need / GiB:.1f} GiB needed at least vs {usable / GiB:.1f} GiB allowed"
                + (f" ({excess / GiB:+.1f} GiB)" if excess > 0 else ""),
            )
        )
        summary = (
            f"No layout of {model.name} fits {cluster.num_gpus} x {cluster.name}: the lightest "
            f"configuration ({where}) needs at least {need / GiB:.1f} GiB per GPU for its "
            f"share of the model state and buffers alone"
            + (
                f", over the {usable / GiB:.1f} GiB a rank may allocate (usable HBM less the "
                f"{job.memory_margin:.0%} margin and the CUDA context)."
                if excess > 0
                else f"; with activations no layout fits the {usable / GiB:.1f} GiB a rank may "
                "allocate."
            )
        )
    fixes = []
    per = max(2.0, time_limit_s / 4)
    # More GPUs relieve memory; they cannot mend degrees that do not divide.
    for factor in (2, 4) if lightest is not None else ():
        bigger = cluster.model_copy(update={"num_gpus": cluster.num_gpus * factor})
        found = replan(model, bigger, job, space, per)
        if found is None:
            fixes.append(
                f"{bigger.num_gpus} GPUs: not settled within {per:.0f} s of solving (it may fit)"
            )
        elif fit := _fitting(found):
            lay, est = fit
            fixes.append(
                f"{bigger.num_gpus} GPUs: fits (tp={lay.tp} cp={lay.cp} pp={lay.pp} "
                f"dp={lay.dp}, {est.step_time_s:.2f} s per step)"
            )
            break
    for field, label in (
        ("tp", "any tensor-parallel degree"),
        ("cp", "any context-parallel degree"),
        ("pp", "any pipeline degree"),
        ("dp", "any data-parallel degree"),
        ("ep", "any expert-parallel degree"),
        ("etp", "any expert tensor-parallel degree"),
        ("micro_batch", "any micro-batch"),
        ("schedules", "any schedule"),
        ("virtual_stages", "any virtual stages"),
        ("zero", "any ZeRO stage"),
        ("recompute", "any recompute"),
        ("ema", "EMA anywhere"),
    ):
        if getattr(space, field) is None:
            continue
        freed = space.model_copy(update={field: None})
        if fit := _fitting(replan(model, cluster, job, freed, per)):
            seconds = fit[1].step_time_s
            fixes.append(f"{label} (free SearchSpace.{field}): fits, {seconds:.2f} s per step")
    if (
        lightest is not None
        and not optimizer_offload_rule(job, 1.0)
        and (space.optimizer_offload is None or set(space.optimizer_offload) == {0})
    ):
        # The optimizer state to the host: memory for a host step and PCIe copies per step.
        zeros = space.zero if space.zero is None or 1 in space.zero else [*space.zero, 1]
        offload = space.model_copy(update={"optimizer_offload": [0.0, 1.0], "zero": zeros})
        if fit := _fitting(replan(model, cluster, job, offload, per)):
            seconds = fit[1].step_time_s
            fixes.append(
                "the optimizer state on the host (SearchSpace.optimizer_offload=[0, 1]): fits, "
                f"{seconds:.2f} s per step"
            )
    if (
        lightest is not None
        and framework(job.framework).activation_offload
        and "offload" not in (space.recompute or [])
    ):
        # Activation offload, as Megatron-LM runs it: pp 1, the other layers not recomputed.
        offload = space.model_copy(
            update={"recompute": ["none", "offload"], "pp": [1], "virtual_stages": None}
        )
        if fit := _fitting(replan(model, cluster, job, offload, per)):
            lay, est = fit
            n = sum(b.recompute == "offload" for s in lay.stages for b in s.blocks)
            fixes.append(
                f"the first {n} layers' activations on the host (SearchSpace.recompute=[none, "
                f"offload], pp=1): fits, {est.step_time_s:.2f} s per step"
            )
    if not any(": fits" in f for f in fixes):
        unsettled = any("not settled" in f for f in fixes)
        fixes.append(
            "no change tried was shown to fit"
            + ("; those not settled may fit with a longer time limit" if unsettled else "")
        )
    return Explanation(summary=summary, binding=binding, fixes=fixes)


def _fitting(found: Plan | None) -> tuple[Layout, Estimate] | None:
    """A replan's layout and its estimate, when it came back with one that fits."""
    if found is None or found.layout is None or found.estimate is None:
        return None
    return found.layout, found.estimate
