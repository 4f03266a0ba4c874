"""``evaluate``: cost a given layout of a model on a cluster for a job.

It checks the layout against the model, the cluster and the job (every block placed once, in
order; degrees that divide; the world size; micro-batching that adds up to the global batch),
then returns an ``Estimate``: per-rank memory (``planner.costs.memory``) and the analytic step
time: the step run task by task (``planner.timeline``); ``simulate`` reaches it another way.

MFU convention (PaLM, Chowdhery et al. 2022, appendix B, with attention's causal half): model
FLOPs per token = 6 x (parameters a token passes through in matrix multiplies: routed experts
count k of E, the embedding lookup not at all, the output head and MTP modules fully)
+ 6 x layers x heads x (d_qk + d_v) x seq_len x 1/2; MFU divides the model FLOPs per second
by the GPUs' dense BF16 peak (also for FP8 runs, so FP8's gain shows as MFU above BF16's).
Recompute is not model FLOPs: it lowers MFU.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from planner.costs.activations import extended, long_step
from planner.costs.blocks import block_names
from planner.costs.cap import usable_hbm, usable_peak_bytes
from planner.costs.comm import Network
from planner.costs.memory import StageMemory, stage_memory
from planner.costs.timing import StageTime, optimizer_time, stage_times
from planner.data import package_file
from planner.errors import PlannerError
from planner.frameworks import LAYOUT_EXTRAS, ZERO3_EXTRAS, framework, launchers_with
from planner.layout import Layout, model_lacks, parse_recompute
from planner.schedules import ep_overlap_forbids, schedule_of
from planner.specs import ClusterSpec, ModelSpec, TrainingJob

if TYPE_CHECKING:
    from planner.timeline import Timeline


class Estimate(BaseModel):
    """What a layout costs: per-rank memory (bytes) and step time (seconds)."""

    model_config = ConfigDict(frozen=True)

    memory: list[StageMemory] = Field(description="One entry per pipeline position.")
    peak_bytes: int = Field(description="Largest per-rank peak over all pipeline positions.")
    hbm_bytes: int = Field(description="Nominal HBM capacity per GPU (bytes), for comparison.")
    usable_hbm_bytes: int = Field(
        description="HBM a process can allocate per GPU (bytes): the CUDA runtime's device total."
    )
    cap_bytes: int = Field(
        description="The most a rank's peak may be (bytes): usable HBM less the job's margin "
        "for the memory model's error (costs.cap.usable_peak_bytes)."
    )
    num_microbatches: int = Field(description="Micro-batches per step per pipeline.")
    step_time_s: float = Field(description="Predicted seconds per optimizer step.")
    breakdown: dict[str, float] = Field(
        description="Seconds per part of the step (they sum to step_time_s): compute "
        "(with the host's launches of routed-expert GEMMs a framework issues one at a time, "
        "Framework.expert_gemm_launch_s), recompute, tp_comm, cp_comm, offload_copy "
        "(activation copies to and from the host the compute waits for), expert_all_to_all, "
        "zero_comm, bubble, pipeline_p2p, grad_sync, optimizer; the parts of the critical "
        "(busiest) pipeline rank."
    )
    critical_rank: int = Field(description="Pipeline rank whose work sets the step time.")
    mfu: float = Field(description="Model FLOPs utilisation (see the module docstring).")
    tflops_per_gpu: float = Field(description="Model TFLOP/s per GPU (10^12 FLOP/s).")
    tokens_per_s: float = Field(description="Training tokens per second, whole cluster.")
    expected_error: str = Field(
        default="",
        description="How far the step time is expected to be off: the mean absolute error of "
        "the same model over published runs on this GPU (planner/accuracy.json, written by "
        "benchmarks/published_throughput.py --write), or that none were compared.",
    )
    memory_risk: str = Field(
        default="",
        description="How likely the heaviest rank is to run out of memory: of the published "
        "runs of the job's framework whose memory the model was checked against "
        "(planner/memory_accuracy.json, written by benchmarks/published_memory.py --write), "
        "how many it under-predicted by more than this layout's headroom.",
    )
    mfu_note: str = Field(
        default="",
        description="Set when the predicted MFU exceeds every MFU measured on this GPU and "
        "precision at this scale or larger in the validation corpus (planner/accuracy.json): "
        "the step time is then likely optimistic.",
    )

    @property
    def fits(self) -> bool:
        """Whether every rank's predicted peak is within the cap: usable HBM less the margin
        kept for the memory model's own error (``cap_bytes``)."""
        return self.peak_bytes <= self.cap_bytes

    @property
    def headroom(self) -> float:
        """Fraction of usable HBM the heaviest rank leaves free (negative when it is over)."""
        return 1 - self.peak_bytes / self.usable_hbm_bytes


def evaluate(model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, layout: Layout) -> Estimate:
    """Cost ``layout``: per-rank memory and the step time with its breakdown (the job takes
    the machine's measured memory figures where it sets none: ``ClusterSpec.job_on``)."""
    job = cluster.job_on(job)
    memory, _, step = step_run(model, cluster, job, layout, extend_long=True)
    tokens_per_s = job.tokens_per_step / step.step_s
    flops_per_s = model_flops_per_token(model, job.seq_len) * tokens_per_s / cluster.num_gpus
    return Estimate(
        memory=memory,
        peak_bytes=max(s.peak_bytes for s in memory),
        hbm_bytes=cluster.hbm_bytes,
        usable_hbm_bytes=usable_hbm(cluster),
        cap_bytes=usable_peak_bytes(cluster, job),
        num_microbatches=step.num_microbatches,
        step_time_s=step.step_s,
        breakdown=step.breakdown,
        critical_rank=step.critical_rank,
        mfu=flops_per_s / cluster.bf16_flops,
        tflops_per_gpu=flops_per_s / 1e12,
        tokens_per_s=tokens_per_s,
        expected_error=expected_error(cluster.name),
        memory_risk=memory_risk(
            job.framework, 1 - max(s.peak_bytes for s in memory) / usable_hbm(cluster)
        ),
        mfu_note=mfu_note(
            cluster.name, job.compute_dtype, cluster.num_gpus, flops_per_s / cluster.bf16_flops
        ),
    )


ACCURACY = package_file("accuracy.json")  # shipped in the wheel as package data
MEMORY_ACCURACY = package_file("memory_accuracy.json")  # likewise


@functools.lru_cache(maxsize=2)
def _table(path: Path) -> dict[str, Any]:
    """A shipped accuracy table (empty where it cannot be read: estimates then say so)."""
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def _accuracy() -> dict[str, Any]:
    return _table(ACCURACY)


def _memory_accuracy() -> dict[str, Any]:
    return _table(MEMORY_ACCURACY)


def expected_error(gpu: str) -> str:
    """The step time's expected error on ``gpu`` from the validation corpus, in words."""
    data = _accuracy()
    row = data.get("by_gpu", {}).get(gpu)
    if not row:
        overall = data.get("all")
        tail = (
            f"; over all {overall['rows']} costed runs the mean error is "
            f"{overall['mape']:.0%} (predictions {overall['bias']:+.0%} on average)"
            if overall
            else ""
        )
        return f"no published {gpu} runs in the validation corpus{tail}"
    return (
        f"±{row['mape']:.0%}: mean absolute error over {row['rows']} published {gpu} runs "
        f"(predicted step {row['bias']:+.0%} on average; benchmarks/published_runs.csv)"
    )


def memory_risk(framework_name: str, headroom: float) -> str:
    """The risk, in words, that a rank whose predicted peak leaves ``headroom`` (a fraction
    of usable HBM) free runs out of memory: how many of the published ``framework_name``
    runs the model under-predicted by more than that. A run's real peak is the predicted
    one over (1 + error), so it exceeds usable HBM when the error is below -headroom."""
    from planner.frameworks import framework

    label = framework(framework_name).label
    row = _memory_accuracy().get("by_framework", {}).get(framework_name)
    if not row or not row.get("errors"):
        return f"no published {label} memory measurements to judge the risk of running out by"
    errors = row["errors"]
    worst = -min(min(errors), 0.0)
    where = f"published {label} runs"
    if headroom < 0:  # its real peak stays within usable HBM only if over-predicted by more
        saved = sum(e >= -headroom for e in errors)
        return (
            f"the predicted peak is {-headroom:.1%} of usable HBM over it: it runs out unless "
            f"the model over-predicts it by more, as it did on {saved} of {len(errors)} "
            f"{where} (benchmarks/published_memory.csv)"
        )
    short = sum(e < -headroom for e in errors)
    return (
        f"on {short} of {len(errors)} {where} the model's peak fell short of the measured one "
        f"by more than the {headroom:.1%} of usable HBM this layout leaves free (largest "
        f"shortfall {worst:.1%}; benchmarks/published_memory.csv)"
    )


def mfu_class(gpu: str, precision: str) -> str:
    """The class a measured MFU is compared within (``measured_mfu`` in
    ``planner/accuracy.json``): the GPU and its GEMM precision, FP16 with BF16."""
    return f"{gpu}/{'fp8' if precision == 'fp8' else 'bf16'}"


def mfu_note(gpu: str, precision: str, gpus: int, mfu: float) -> str:
    """A warning when ``mfu`` (model FLOPs over the BF16 peak) is above every MFU measured on
    ``gpu`` in ``precision`` at half of ``gpus`` or more (MFU falls with scale, so a smaller
    run's is no ceiling), or ""."""
    runs = [
        r
        for r in _accuracy().get("measured_mfu", {}).get(mfu_class(gpu, precision), [])
        if r[0] * 2 >= gpus
    ]
    if not runs:
        return ""
    n, best, name = max(runs, key=lambda r: r[1])
    if mfu <= best:
        return ""
    return (
        f"predicted MFU {mfu:.1%} exceeds the best measured on {gpu} in {precision} at "
        f">= {gpus // 2} GPUs ({best:.1%}, {name}, {n} GPUs): the step time is likely "
        f"optimistic"
    )


def step_run(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    layout: Layout,
    *,
    extend_long: bool = False,
) -> tuple[list[StageMemory], list[StageTime], Timeline]:
    """The per-rank memory, the per-stage times and the step run task by task
    (``planner.timeline``) of a layout: what ``evaluate`` and the search's
    final choice all read. With ``extend_long`` a long step (``costs.activations.long_step``)
    is run shorter and extended (``extended_run``): its time, critical rank and breakdown are
    the whole step's, its ranks' tasks and chains the shorter run's."""
    from planner.costs.overlap import overlap_of
    from planner.timeline import run

    m = check_layout(model, cluster, job, layout)
    memory = stage_memory(model, job, layout, num_microbatches=m)
    times = stage_times(model, cluster, job, layout, Network.of(cluster))
    optimizer = [optimizer_time(s, cluster) for s in memory]
    overlap = overlap_of(job, cluster, layout.schedule)
    if extend_long:
        return memory, times, extended_run(layout, times, optimizer, m, overlap)
    step = run(layout, times, optimizer, num_microbatches=m, overlap=overlap)
    return memory, times, step


def extended_run(
    layout: Layout, times: list[StageTime], optimizer: list[float], m: int, overlap: Any
) -> Timeline:
    """One step of ``m`` micro-batches: run whole, or for a long step
    (``costs.activations.long_step``) run at two lengths past the fill and extended to
    ``m``: with every micro-batch alike, a schedule's steady state repeats, so the step time
    and each of its parts grow by the same amount per micro-batch (exact to rounding for
    every schedule, tests/test_timeline.py)."""
    from planner.timeline import Timeline, run

    lengths = long_step(layout.pp, layout.virtual_stages, m)
    if lengths is None:
        return run(layout, times, optimizer, num_microbatches=m, overlap=overlap)
    a, b = (run(layout, times, optimizer, num_microbatches=n, overlap=overlap) for n in lengths)
    breakdown = {
        k: extended(a.breakdown.get(k, 0.0), v, lengths, m) for k, v in b.breakdown.items()
    }
    step = extended(a.step_s, b.step_s, lengths, m)
    return Timeline(b.ranks, step, b.critical_rank, breakdown, m)


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token under the MFU convention of the module docstring."""
    matmul = model.num_params(active=True) - model.vocab_size * model.hidden_size
    if model.tie_word_embeddings:
        matmul += model.vocab_size * model.hidden_size  # the head multiplies by the table
    if model.learned_positions:
        matmul -= model.learned_positions * model.hidden_size
    if model.attention == "mla":
        d_qk, d_v = model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim
    else:
        d_qk = d_v = model.head_dim
    layers = model.num_layers + model.num_mtp_layers
    attention = 6 * layers * model.num_attention_heads * (d_qk + d_v) * seq_len * 0.5
    return 6.0 * matmul + attention


def ep_overlap_unmet(model: ModelSpec, job: TrainingJob, ep: int) -> str:
    """What a schedule that overlaps the expert all-to-alls (``Schedule.ep_overlap``) needs
    of the model, the job and the expert-parallel degree that they lack, or "": all-to-alls
    to hide."""
    if not model.num_experts or ep <= 1:
        return "overlaps the expert all-to-alls, so it needs an MoE model with ep > 1"
    if job.moe_dispatcher == "allgather":
        return "overlaps all-to-alls; TrainingJob.moe_dispatcher='allgather' runs none"
    return ""


def ep_overlap_rule(model: ModelSpec, job: TrainingJob, layout: Layout) -> str:
    """What a schedule that overlaps the expert all-to-alls needs of the model, job and
    layout that they break (``ep_overlap_unmet``, and no full or MoE recompute), or ""."""
    if not schedule_of(layout.schedule).ep_overlap:
        return ""
    unmet = ep_overlap_unmet(model, job, layout.ep)
    if unmet:
        return unmet
    for stage in layout.stages:
        for placed in stage.blocks:
            if ep_overlap_forbids(parse_recompute(placed.recompute)):
                return (
                    f"{placed.block} recomputes {placed.recompute!r}; the all-to-all overlap "
                    f"runs with no full and no 'moe' recompute"
                )
    return ""


# The most micro-batches a pipeline's step may hold to be costed: costing a schedule walks
# its op order, so its time grows with them (a layout of 100,000 takes seconds, and the search
# costs many). Published runs hold up to about 15,000 (DeepSeek-V3's 15,360 sequences a step,
# one a micro-batch, over 8 data-parallel ranks: 1,920).
MAX_MICROBATCHES = 100_000


def check_layout(model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, layout: Layout) -> int:
    """Raise a one-line ``PlannerError`` for a layout that cannot run; return the number of
    micro-batches per step."""
    if layout.world_size != cluster.num_gpus:
        raise PlannerError(
            f"Layout: tp*cp*pp*dp={layout.tp}*{layout.cp}*{layout.pp}*{layout.dp}="
            f"{layout.world_size} must equal the cluster's GPU count {cluster.num_gpus}"
        )
    # Tensor parallelism across nodes is costed (its collectives go hierarchically over
    # NVLink and InfiniBand, planner.costs.comm) though the search keeps it within an NVLink
    # domain (ClusterSpec.domain_gpus):
    # teams have run it (vTrain's multi-node set has TP16 on 8-GPU nodes).
    per_step = layout.dp * layout.micro_batch
    if job.global_batch % per_step:
        raise PlannerError(
            f"TrainingJob.global_batch={job.global_batch}: must be a multiple of "
            f"dp*micro_batch={per_step}"
        )
    m = job.global_batch // per_step
    if m > MAX_MICROBATCHES:
        raise PlannerError(
            f"TrainingJob.global_batch={job.global_batch}: {m:,} micro-batches per pipeline a "
            f"step at dp*micro_batch={per_step}; the planner costs steps of at most "
            f"{MAX_MICROBATCHES:,}: use fewer sequences per step or a larger dp or micro-batch"
        )
    if layout.num_microbatches is not None and layout.num_microbatches != m:
        raise PlannerError(
            f"Layout.num_microbatches={layout.num_microbatches}: global_batch/(dp*micro_batch)"
            f" is {m}"
        )
    runs = framework(job.framework).launcher
    for field, what in {**ZERO3_EXTRAS, **LAYOUT_EXTRAS}.items():
        value = getattr(layout, field)
        if value not in (False, 1) and not (runs and getattr(runs, field)):
            raise PlannerError(
                f"Layout.{field}={value!r}: {what} needs framework={launchers_with(field)}; "
                f"the job has framework={job.framework!r}"
            )
    overlap_rule = ep_overlap_rule(model, job, layout)
    if overlap_rule:
        raise PlannerError(f"Layout.schedule={layout.schedule!r}: {overlap_rule}")
    if not model.num_experts:
        for degree in ("ep", "etp"):
            if getattr(layout, degree) > 1:
                raise PlannerError(
                    f"Layout.{degree}={getattr(layout, degree)}: {model.name} has no routed "
                    "experts; expert parallelism applies to MoE models only"
                )
    for choice in {b.recompute for stage in layout.stages for b in stage.blocks}:
        chosen = parse_recompute(choice)
        for module in sorted(chosen) if isinstance(chosen, frozenset) else ():
            name = module.removeprefix("offload:")
            why = model_lacks(model, name)
            if why:
                raise PlannerError(
                    f"recompute={choice!r}: {model.name} has no {name} module ({why})"
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
