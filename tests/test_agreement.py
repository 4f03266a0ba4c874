"""One closed-form timing semantics: ``evaluate`` and the CP-SAT model give a layout the same
step time, and that step time, and the simulator's, obey what a pipeline must.

On jobs of real size (61 to 126 layers, pipelines up to 16 deep, every schedule, uneven
stages) the closed-form step and the simulated one (``planner.executor``, which runs the
step on its own) are each at least what the stages' compute alone forces (each rank's work,
the first micro-batch's way to it and, for 1F1B and GPipe, the last one's way back), and the
simulator's event-by-event memory peaks are the memory model's; with equal stages and no
communication the step is the published closed form of each schedule that has one, and
the activations each rank holds are its schedule's micro-batches in flight. The solver's
model, with a layout pinned and the chains that layout's timeline reports, gives the
closed-form figure.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import planner
from planner.costs.timing import StageTime
from planner.estimate import step_run
from planner.frameworks import framework
from planner.layout import Layout
from planner.simulate import simulate
from planner.timeline import run

JOBS = {  # catalog model, machine type, GPUs, job
    "deepseek-v3": ("h800", 2048, dict(seq_len=4096, global_batch=15360, compute_dtype="fp8")),
    "llama3-405b": ("h100", 16384, dict(seq_len=8192, global_batch=2048)),
    "llama3-70b": ("h100", 512, dict(seq_len=8192, global_batch=512)),
    "mixtral-8x7b": ("h100", 64, dict(seq_len=4096, global_batch=512)),
    "gpt3-175b": ("a100", 1024, dict(seq_len=2048, global_batch=1536)),
}
SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved", "dualpipe", "dualpipev"]


def _degrees(name: str, pp: int, gpus: int) -> dict[str, int]:
    model = planner.load_model(name)
    tp = 1 if model.num_experts else 8
    dp = gpus // (tp * pp)
    ep = 1
    if model.num_experts:
        ep = max(
            e for e in (1, 2, 4, 8, 16, 32, 64) if (dp * tp) % e == 0 and model.num_experts % e == 0
        )
    return {"tp": tp, "dp": dp, "ep": ep}


CASES = st.fixed_dictionaries(
    {
        "model": st.sampled_from(list(JOBS)),
        "schedule": st.sampled_from(SCHEDULES),
        "pp": st.sampled_from([2, 4, 8, 16]),
        "zero": st.sampled_from([1, 2, 3]),
        "recompute": st.sampled_from(["none", "full", "selective"]),
        "weights": st.lists(st.integers(1, 5), min_size=64, max_size=64),
    }
)


def _layout(
    case: dict[str, Any],
) -> tuple[planner.ModelSpec, planner.ClusterSpec, planner.TrainingJob, Layout]:
    name = case["model"]
    machine, gpus, fields = JOBS[name]
    model = planner.load_model(name)
    cluster = planner.load_cluster(machine, gpus=gpus)
    pp, schedule = case["pp"], case["schedule"]
    v = 2 if schedule in ("interleaved", "dualpipev") else 1
    stages = pp * v
    degrees = _degrees(name, pp, gpus)
    m = max(2 * pp, 4)
    job = planner.TrainingJob(**{**fields, "global_batch": m * degrees["dp"]})
    # Uneven stages: the layers split in proportion to random weights, each stage one at least.
    weights = case["weights"][:stages]
    spare = model.num_layers - stages
    counts = [1 + spare * w // sum(weights) for w in weights]
    counts[-1] += model.num_layers - sum(counts)
    layout = Layout.from_counts(
        model,
        counts=counts,
        pp=pp,
        schedule=schedule,  # type: ignore[arg-type]
        virtual_stages=v,
        zero=case["zero"],
        recompute=case["recompute"],
        **degrees,
    )
    return model, cluster, job, layout


def compute_floor(layout: Layout, times: list[StageTime], optimizer: list[float], m: int) -> float:
    """A floor on the step from each stage's compute per micro-batch alone (a task lasts at
    least its ops' compute; a rank runs one task at a time, then its optimizer step):

    - every micro-batch's work on every stage, spread over the ``pp`` ranks at best;
    - where rank r holds stages r, r + pp, ... (not DualPipe's two directions): the first
      micro-batch's forwards up to stage r, then all of rank r's work;
    - for 1F1B and GPipe, whose backward is one op, then the last micro-batch's backwards
      from stage r - 1 down to stage 0 (each needs the one after it).
    """
    work = [t.fwd + t.bwd_input + t.bwd_weight for t in times]
    p = layout.pp
    floor = m * sum(work) / p + min(optimizer)
    if layout.schedule in ("dualpipe", "dualpipev"):
        return floor
    for r in range(p):
        fill = sum(t.fwd for t in times[:r])
        own = m * sum(work[r::p])
        floor = max(floor, fill + own + optimizer[r])
        if layout.schedule in ("1f1b", "gpipe"):
            drain = sum(t.bwd_input + t.bwd_weight for t in times[:r])
            floor = max(floor, fill + own + drain + optimizer[0])
    return floor


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CASES)
def test_estimate_and_simulation_obey_the_pipeline_on_real_sized_uneven_layouts(
    case: dict[str, Any],
) -> None:
    model, cluster, job, layout = _layout(case)
    est = planner.evaluate(model, cluster, job, layout)
    sim = simulate(model, cluster, job, layout)
    # The simulator's peaks come from its allocations and frees event by event; the memory
    # model's from each schedule's micro-batches in flight.
    assert [s.peak_bytes for s in est.memory] == sim.peak_bytes
    assert sim.step_time_s >= max(sim.busy_s) - 1e-9
    _, times, timeline = step_run(model, cluster, job, layout)
    m = job.global_batch // (layout.dp * layout.micro_batch)
    optimizer = [r.optimizer for r in timeline.ranks]
    floor = compute_floor(layout, times, optimizer, m)
    assert est.step_time_s >= floor * (1 - 1e-9), (est.step_time_s, floor)
    assert sim.step_time_s >= floor * (1 - 1e-9), (sim.step_time_s, floor)
    assert sum(est.breakdown.values()) == pytest.approx(est.step_time_s)
    assert min(est.breakdown.values()) >= -1e-9


@dataclass(frozen=True)
class Shape:
    schedule: str
    pp: int
    virtual_stages: int


def work_only(stage: int, f: float, b: float, w: float) -> StageTime:
    """A stage that computes and communicates nothing."""
    return StageTime.work_only(stage, f, b, w)


F, B, W, OPT = 1.0, 1.5, 0.7, 0.3  # seconds: a rank's forward, input and weight gradients
CLOSED_FORMS = {
    # GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. SC'21 section 2.2.1): m passes and
    # a bubble of p - 1.
    "gpipe": lambda p, m, v: (m + p - 1) * (F + B + W),
    "1f1b": lambda p, m, v: (m + p - 1) * (F + B + W),
    # Interleaved (SC'21 section 2.2.2): the bubble shrinks by the v chunks a rank holds.
    "interleaved": lambda p, m, v: m * (F + B + W) + (p - 1) * (F + B + W) / v,
    # ZB-H1 (Qi et al., ICLR 2024, section 2.1): the deferred W passes fill part of 1F1B's
    # bubble, leaving (p - 1)(F + B - W), B the input gradient alone (a third of 1F1B's
    # bubble when F = B = W).
    "zb-h1": lambda p, m, v: m * (F + B + W) + (p - 1) * (F + B - W),
}


@pytest.mark.parametrize(
    ("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]
)
@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 8), (4, 12), (8, 16)])
def test_equal_stages_without_communication_take_the_published_step(
    schedule: str, v: int, p: int, m: int
) -> None:
    """Each rank's share of the layers split into v equal chunks, nothing sent or reduced:
    the step is the schedule's closed form, plus the optimizer step."""
    times = [work_only(s, F / v, B / v, W / v) for s in range(p * v)]
    overlap = framework("megatron").overlap
    timeline = run(Shape(schedule, p, v), times, [OPT] * p, num_microbatches=m, overlap=overlap)
    assert timeline.step_s == pytest.approx(CLOSED_FORMS[schedule](p, m, v) + OPT, rel=1e-12)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_each_rank_holds_its_schedules_micro_batches_in_flight(recompute: str) -> None:
    """Llama 3 70B on 8 even stages, 16 micro-batches: rank r holds the activations of
    p - r micro-batches under 1F1B (its warm-up forwards), all 16 under GPipe, and p under
    ZB-H1 (whose deferred weight gradients keep theirs; Qi et al. section 2.1). The middle
    ranks hold the same blocks, so each micro-batch more is one stage's saved activations
    more, whatever a recomputed block rebuilds."""
    model = planner.load_model("llama3-70b")
    cluster = planner.load_cluster("h100", gpus=512)
    p, m = 8, 16
    job = planner.TrainingJob(seq_len=8192, global_batch=m * 8)
    held = {}
    for schedule in ("1f1b", "gpipe", "zb-h1"):
        layout = Layout.uniform(
            model,
            pp=p,
            tp=8,
            dp=8,
            schedule=schedule,
            recompute=recompute,  # type: ignore[arg-type]
        )
        est = planner.evaluate(model, cluster, job, layout)
        held[schedule] = [s.buckets["activations"] for s in est.memory]
        assert [s.peak_bytes for s in est.memory] == simulate(
            model, cluster, job, layout
        ).peak_bytes
    middle = range(1, p - 1)
    one = held["1f1b"][1] - held["1f1b"][2]  # one micro-batch of a middle stage
    assert one > 0
    for r in middle:
        assert held["1f1b"][r] - held["1f1b"][p - 2] == (p - 2 - r) * one
        assert held["gpipe"][r] - held["1f1b"][r] == (m - (p - r)) * one
        assert held["zb-h1"][r] - held["1f1b"][r] == r * one


def _pinned_objective(
    model: planner.ModelSpec, cluster: planner.ClusterSpec, job: planner.TrainingJob, layout: Layout
) -> float:
    """The CP-SAT model of the layout's configuration with its stages and recompute pinned
    and the layout's own chains stated: its optimum, in seconds."""
    from planner.costs.comm import Network
    from planner.solve.model import StageModel
    from planner.solve.tables import Config, build

    config = Config.of(layout, job.global_batch // (layout.dp * layout.micro_batch))
    sm = StageModel(build(model, cluster, job, config, Network.of(cluster)), cluster, job)
    counts = [sum(b.block.startswith("layer.") for b in s.blocks) for s in layout.stages]
    sm.fix(counts)
    options = {b.block: b.recompute for s in layout.stages for b in s.blocks}
    sm.pin_recompute(options)
    sm.add_forms(step_run(model, cluster, job, layout)[2].forms)
    sol = sm.solve(time_limit_s=10, workers=1, seed=0)
    assert sol.status == "optimal", sol.status
    return sol.objective_s


PINNED = [
    ("mixtral-8x7b", "1f1b", 4, 1, "none"),
    ("mixtral-8x7b", "dualpipe", 4, 2, "full"),
    ("mixtral-8x7b", "dualpipev", 2, 3, "none"),
    # ZeRO-2: with Megatron-LM's FP32 main gradients, ZeRO-1 does not fit 80 GB at pp 8
    ("deepseek-v3", "dualpipe", 8, 2, "full"),
    ("llama3-70b", "interleaved", 4, 1, "selective"),
    ("llama3-70b", "zb-h1", 8, 3, "full"),
]


@pytest.mark.parametrize(("name", "schedule", "pp", "zero", "recompute"), PINNED)
def test_the_solver_states_the_timeline(
    name: str, schedule: str, pp: int, zero: int, recompute: str
) -> None:
    """Task terms, per-stage quantities, optimizer steps and chains: the solver's objective
    for a pinned layout is that layout's closed-form step (to its 1 us per block rounding)."""
    weights = [1 + (i * 7) % 5 for i in range(64)]
    case = {
        "model": name,
        "schedule": schedule,
        "pp": pp,
        "zero": zero,
        "recompute": recompute,
        "weights": weights,
    }
    model, cluster, job, layout = _layout(case)
    exact = planner.evaluate(model, cluster, job, layout).step_time_s
    assert _pinned_objective(model, cluster, job, layout) == pytest.approx(exact, rel=2e-4)


def test_deepseek_v3_recipe_runs_its_chunks_communication_in_series() -> None:
    """DeepSeek-V3's DualPipe pairs a forward chunk with another micro-batch's backward chunk:
    each chunk's dispatch, experts and combine run in series (report section 3.2.1), so a
    pair lasts at least either chunk's compute plus its own all-to-alls."""
    from planner.costs.overlap import OVERLAPS, task_time, values

    model = planner.load_model("deepseek-v3")
    cluster = planner.load_cluster("h800", gpus=2048)
    job = planner.TrainingJob(seq_len=4096, global_batch=15360, compute_dtype="fp8")
    layout = Layout.uniform(model, pp=16, dp=128, ep=64, schedule="dualpipe", recompute="full")
    _, times, run = step_run(model, cluster, job, layout)
    val = values(times)
    pairs = {t.key for r in run.ranks for t in r.tasks if t.key[0] == "pair"}
    assert pairs
    for key in itertools.islice(sorted(pairs), 20):
        _, f, b, _ = key
        length = task_time(key, val, OVERLAPS[job.framework])
        forward = times[f].fwd + times[f].a2a_fwd.seconds + times[f].p2p.seconds
        backward = times[b].bwd_input + times[b].a2a_bwd.seconds + times[b].p2p_back.seconds
        assert length >= forward - 1e-12 and length >= backward - 1e-12
        assert length >= times[f].fwd + times[b].bwd_input - 1e-12
