"""``check_plan``: an independent check of a plan against the cost model and the simulator.

A plan is checked only against what can be recomputed from scratch: the layout's validity
(``planner.estimate.check_layout``), a fresh ``planner.evaluate`` of it, and a fresh
``planner.simulate`` of it. Nothing of the search that produced the plan is reused, so a
mistake in how the search states the costs shows up here as a disagreement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from planner.costs.activations import offloads_activations
from planner.costs.blocks import a2a_rule
from planner.costs.cap import usable_hbm, usable_peak_bytes
from planner.errors import PlannerError
from planner.estimate import Estimate, check_layout, evaluate
from planner.layout import Layout, parse_recompute
from planner.simulate import SIM_TOLERANCE, Simulation, simulate
from planner.specs import ClusterSpec, ModelSpec, SearchSpace, TrainingJob

if TYPE_CHECKING:
    from planner.solve.result import Plan, SimulatedStep

GiB = 2**30


def check_plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    plan: Plan,
    *,
    space: SearchSpace | None = None,
    sim_tolerance: float | None = None,
) -> list[str]:
    """Violations, one readable line each; [] means the plan checks out. The simulated step
    may differ from the estimate by ``sim_tolerance`` (default ``SIM_TOLERANCE``), or by
    more where the plan says so (``Plan.simulation``, which must then be the simulator's)."""
    if plan.status == "infeasible":
        return check_infeasible(plan)
    if plan.layout is None or plan.estimate is None:
        return [f"status {plan.status}: a plan that is not infeasible needs a layout and estimate"]
    layout = plan.layout
    problems = check_degrees(model, cluster, job, layout) + check_gap(plan)
    if space is not None:
        problems += check_space(job, layout, space)
    try:
        check_layout(model, cluster, job, layout)
        fresh = evaluate(model, cluster, job, layout)
        sim = simulate(model, cluster, job, layout)
    except PlannerError as exc:  # nothing below can be recomputed for a layout that cannot run
        return [*problems, f"layout cannot be evaluated: {exc}"]
    problems += check_estimate(plan.estimate, fresh)
    problems += check_memory(fresh, cluster, job)
    problems += check_host_ram(job, cluster, layout, fresh)
    tolerance = SIM_TOLERANCE if sim_tolerance is None else sim_tolerance
    problems += check_simulation(fresh, cluster, job, sim, tolerance, plan.simulation)
    return problems


def check_infeasible(plan: Plan) -> list[str]:
    """An infeasible plan holds no layout and says why nothing fits."""
    problems = []
    if plan.layout is not None:
        problems.append("status infeasible: layout must be None")
    if plan.estimate is not None:
        problems.append("status infeasible: estimate must be None")
    if plan.explanation is None or not plan.explanation.summary.strip():
        problems.append("status infeasible: an explanation is required")
    return problems


def check_degrees(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, layout: Layout
) -> list[str]:
    """Degrees that must divide, world size and batch split, stated directly from the specs."""
    problems = []
    if layout.world_size != cluster.num_gpus:
        problems.append(
            f"world size tp*cp*pp*dp={layout.world_size} != cluster GPUs {cluster.num_gpus}"
        )
    if layout.tp > cluster.domain_gpus:
        where = "a node" if cluster.domain_gpus == cluster.gpus_per_node else "an NVLink domain"
        problems.append(f"tp={layout.tp} spans more than {where} of {cluster.domain_gpus} GPUs")
    if model.num_attention_heads % layout.tp:
        problems.append(f"tp={layout.tp} does not divide {model.num_attention_heads} heads")
    if model.attention != "mla" and model.num_kv_heads % layout.tp:
        problems.append(f"tp={layout.tp} does not divide {model.num_kv_heads} kv heads")
    if model.num_experts and model.num_experts % layout.ep:
        problems.append(f"ep={layout.ep} does not divide {model.num_experts} experts")
    plane = layout.dp * layout.cp * layout.tp
    if plane % layout.ep:
        problems.append(f"ep={layout.ep} does not divide dp*cp*tp={plane}")
    elif plane % (layout.ep * layout.etp):
        problems.append(f"ep*etp={layout.ep * layout.etp} does not divide dp*cp*tp={plane}")
    if layout.cp > 1 and job.seq_len % (2 * layout.cp):
        problems.append(f"cp={layout.cp}: seq_len={job.seq_len} not divisible by 2*cp")
    if layout.cp > 1 and layout.cp_a2a > 1 and a2a_rule(model, layout.tp, layout.cp_a2a):
        problems.append(f"cp_comm_type: {a2a_rule(model, layout.tp, layout.cp_a2a)}")
    if job.global_batch % (layout.dp * layout.micro_batch):
        problems.append(
            f"global_batch={job.global_batch} not divisible by dp*micro_batch="
            f"{layout.dp * layout.micro_batch}"
        )
    return problems


def check_gap(plan: Plan) -> list[str]:
    """The optimality gap is a fraction, and zero when the plan claims optimality."""
    if plan.gap is not None and not 0.0 <= plan.gap <= 1.0:
        return [f"gap={plan.gap} is outside [0, 1]"]
    if plan.status == "optimal" and (plan.gap is None or plan.gap > 1e-6):
        return [f"status optimal but gap={plan.gap} (must be 0)"]
    return []


def check_space(job: TrainingJob, layout: Layout, space: SearchSpace) -> list[str]:
    """Every decision of the layout is one the search space allows."""
    decisions: list[tuple[str, object, Sequence[object] | None]] = [
        ("tp", layout.tp, space.tp),
        ("cp", layout.cp, space.cp),
        ("cp_comm_type", layout.cp_comm_type, space.cp_comm_type if layout.cp > 1 else None),
        ("pp", layout.pp, space.pp),
        ("dp", layout.dp, space.dp),
        ("ep", layout.ep, space.ep),
        ("etp", layout.etp, space.etp),
        ("zero", layout.zero, space.zero),
        ("zero_hpz", layout.zero_hpz, space.zero_hpz if layout.zero == 3 else None),
        ("param_offload", layout.param_offload, space.param_offload if layout.zero == 3 else None),
        ("micro_batch", layout.micro_batch, space.micro_batch),
        ("schedule", layout.schedule, space.schedules),
        ("virtual_stages", layout.virtual_stages, space.virtual_stages),
        ("fp8_cache", layout.fp8_cache, space.fp8_cache),
        ("sequence_parallel", layout.sequence_parallel, space.sequence_parallel),
        ("optimizer_offload", layout.optimizer_offload, space.optimizer_offload),
    ]
    if job.ema is not None:  # without an EMA the placement field means nothing
        decisions.append(("ema", layout.ema, space.ema))
    problems = [
        f"{name}={value!r} is not in the search space {allowed}"
        for name, value, allowed in decisions
        if allowed is not None and value not in allowed
    ]
    if space.recompute is not None:
        # Compare module sets, so "selective" and "core_attn" (or "a+b" and "b+a") are one.
        allowed_sets = {parse_recompute(c) for c in space.recompute}
        for stage in layout.stages:
            for placed in stage.blocks:
                free = placed.block in ("embedding", "head") and placed.recompute == "none"
                if not free and parse_recompute(placed.recompute) not in allowed_sets:
                    problems.append(
                        f"{placed.block} recompute={placed.recompute!r} is not in the search "
                        f"space {space.recompute}"
                    )
    return problems


def check_estimate(claimed: Estimate, fresh: Estimate) -> list[str]:
    """The plan's figures are the cost model's figures for its layout."""
    problems = []
    if abs(claimed.step_time_s - fresh.step_time_s) > 1e-9 * abs(fresh.step_time_s):
        problems.append(
            f"estimate step time {claimed.step_time_s:.6g} s != evaluated {fresh.step_time_s:.6g} s"
        )
    if claimed.peak_bytes != fresh.peak_bytes:
        problems.append(f"estimate peak {claimed.peak_bytes} B != evaluated {fresh.peak_bytes} B")
    claimed_ranks = [s.peak_bytes for s in claimed.memory]
    fresh_ranks = [s.peak_bytes for s in fresh.memory]
    if claimed_ranks != fresh_ranks:
        problems.append(f"estimate per-rank peaks {claimed_ranks} != evaluated {fresh_ranks}")
    return problems


def _cap_text(cluster: ClusterSpec, job: TrainingJob) -> str:
    return (
        f"the cap {usable_peak_bytes(cluster, job) / GiB:.2f} GiB (usable HBM "
        f"{usable_hbm(cluster) / GiB:.2f} GiB less the {job.memory_margin * 100:g}% margin for the "
        "memory model's error)"
    )


def check_memory(fresh: Estimate, cluster: ClusterSpec, job: TrainingJob) -> list[str]:
    """Every pipeline rank's predicted peak is within the memory cap: usable HBM less the
    job's margin (``planner.costs.cap.usable_peak_bytes``), stated from the specs."""
    cap = usable_peak_bytes(cluster, job)
    return [
        f"rank {s.stage} peak {s.peak_bytes / GiB:.2f} GiB exceeds {_cap_text(cluster, job)}"
        for s in fresh.memory
        if s.peak_bytes > cap
    ]


def check_host_ram(
    job: TrainingJob, cluster: ClusterSpec, layout: Layout, fresh: Estimate
) -> list[str]:
    """What a rank keeps on the host (an EMA, an offloaded optimizer) fits in a node's RAM,
    taking the heaviest rank for every GPU on it."""
    on_host = layout.ema == "host" and job.ema is not None
    if not (on_host or layout.optimizer_offload or offloads_activations(layout)):
        return []
    gpus = min(cluster.gpus_per_node, cluster.num_gpus)  # a partial node has only num_gpus
    need = max(s.host_bytes for s in fresh.memory) * gpus
    if need > cluster.host_ram_bytes:
        return [
            f"host-side state (EMA, offloaded optimizer and activations) needs "
            f"{need / GiB:.1f} GiB per node, "
            f"more than host RAM "
            f"{cluster.host_ram_bytes / GiB:.1f} GiB"
        ]
    return []


def check_simulation(
    fresh: Estimate,
    cluster: ClusterSpec,
    job: TrainingJob,
    sim: Simulation,
    tolerance: float,
    stated: SimulatedStep | None = None,
) -> list[str]:
    """The simulator, executing the step op by op on its own, reaches the same peaks (within
    the same memory cap) and a step time within ``tolerance`` of the analytic estimate."""
    cap = usable_peak_bytes(cluster, job)
    problems = [
        f"simulated rank {rank} peak {peak / GiB:.2f} GiB exceeds {_cap_text(cluster, job)}"
        for rank, peak in enumerate(sim.peak_bytes)
        if peak > cap
    ]
    evaluated = [s.peak_bytes for s in fresh.memory]
    if sim.peak_bytes != evaluated:
        problems.append(f"simulated per-rank peaks {sim.peak_bytes} != evaluated {evaluated}")
    # The peaks above differ in derivation (the simulator counts its activations allocation
    # by allocation along the run); the step times in what they model (``SIM_TOLERANCE``).
    diff = sim.step_time_s / fresh.step_time_s - 1
    if stated is not None:  # the plan states the simulated step: it must be the simulator's
        if abs(stated.step_time_s / sim.step_time_s - 1) > 1e-9:
            problems.append(
                f"the plan states a simulated step of {stated.step_time_s:.4g} s; the "
                f"simulator gives {sim.step_time_s:.4g} s"
            )
        elif abs(stated.difference - diff) > 1e-9:
            problems.append(
                f"the plan states the simulation differs by {stated.difference:+.1%}; it "
                f"differs by {diff:+.1%}"
            )
        return problems
    if abs(diff) > tolerance:
        problems.append(
            f"simulated step {sim.step_time_s:.4g} s differs from the estimate "
            f"{fresh.step_time_s:.4g} s by {diff:+.1%} (tolerance {tolerance * 100:g}%)"
        )
    return problems
