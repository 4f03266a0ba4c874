"""The plan checker catches each kind of bad plan; the exhaustive search finds a true optimum."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from bruteforce import best_layout, count_layouts
from conftest import CheckedPlans

import planner
import planner.check
import planner.cli
from planner.check import check_plan
from planner.layout import Layout
from planner.simulate import SIM_TOLERANCE, simulated_step
from planner.solve import search
from planner.solve.result import Explanation, Plan, SimulatedStep
from planner.specs import SearchSpace

MODEL = planner.load_model("llama3-8b").model_copy(update={"num_layers": 8})
CLUSTER = planner.load_cluster("h100", gpus=16)
JOB = planner.TrainingJob(seq_len=2048, global_batch=32)
LAYOUT = Layout.uniform(MODEL, pp=2, tp=2, dp=4, recompute="selective")


def plan_of(
    layout: Layout,
    *,
    model: planner.ModelSpec = MODEL,
    cluster: planner.ClusterSpec = CLUSTER,
    job: planner.TrainingJob = JOB,
    simulated: bool = True,
    **fields: object,
) -> Plan:
    """A plan of ``layout`` as the planner states one: its estimate and (``simulated``) its
    simulated step beside it."""
    estimate = planner.evaluate(model, cluster, job, layout)
    simulation = None
    if simulated:
        step = simulated_step(model, cluster, job, layout)
        simulation = SimulatedStep(
            step_time_s=step,
            difference=step / estimate.step_time_s - 1,
            tolerance=SIM_TOLERANCE,
        )
    return Plan(
        status="feasible",
        layout=layout,
        estimate=estimate,
        simulation=simulation,
        solve_time_s=0.0,
        **fields,
    )


def test_a_uniform_layout_checks_out() -> None:
    space = SearchSpace(pp=[1, 2], tp=[2], recompute=["none", "selective"], schedules=["1f1b"])
    assert check_plan(MODEL, CLUSTER, JOB, plan_of(LAYOUT), space=space) == []


def test_an_optimal_plan_with_zero_gap_checks_out() -> None:
    plan = plan_of(LAYOUT).model_copy(update={"status": "optimal", "gap": 0.0})
    assert check_plan(MODEL, CLUSTER, JOB, plan) == []


def test_an_estimate_of_another_layout_is_caught() -> None:
    other = Layout.uniform(MODEL, pp=4, tp=2, dp=2, recompute="full")
    plan = plan_of(LAYOUT).model_copy(
        update={"estimate": planner.evaluate(MODEL, CLUSTER, JOB, other)}
    )
    problems = check_plan(MODEL, CLUSTER, JOB, plan)
    assert any(p.startswith("estimate step time") for p in problems), problems
    assert any(p.startswith("estimate peak") for p in problems), problems


def test_a_layout_over_hbm_is_caught() -> None:
    """Llama-3-70B on one node of H100s, no recompute, no ZeRO: about 170 GiB per GPU."""
    big = planner.load_model("llama3-70b")
    node = planner.load_cluster("h100", gpus=8)
    job = planner.TrainingJob(seq_len=8192, global_batch=8)
    layout = Layout.uniform(big, tp=8, dp=1, zero=0)
    plan = plan_of(layout, model=big, cluster=node, job=job)
    problems = check_plan(big, node, job, plan)
    assert any(
        p.startswith("rank 0 peak") and "exceeds the cap 75.19 GiB (usable HBM 79.15 GiB" in p
        for p in problems
    ), problems
    assert any(p.startswith("simulated rank 0 peak") for p in problems), problems


def test_a_peak_between_the_cap_and_usable_hbm_is_caught() -> None:
    """The checker holds a plan to the cap (usable HBM less the margin), not to HBM: a peak
    1 byte under usable HBM is over the cap, by the estimate and by the simulator."""
    peak = planner.evaluate(MODEL, CLUSTER, JOB, LAYOUT).peak_bytes
    fields = {**CLUSTER.model_dump(), "hbm_reserved_bytes": CLUSTER.hbm_bytes - peak - 1}
    tight = planner.ClusterSpec(**fields)
    problems = check_plan(MODEL, tight, JOB, plan_of(LAYOUT, cluster=tight))
    cap = f"exceeds the cap {(peak + 1) * 0.95 / 2**30:.2f} GiB"
    assert any(p.startswith("rank ") and cap in p for p in problems), problems
    assert any(p.startswith("simulated rank ") and cap in p for p in problems), problems


@pytest.mark.parametrize(
    ("status", "gap", "message"),
    [
        ("optimal", 0.3, "status optimal but gap=0.3 (must be 0)"),
        ("optimal", None, "status optimal but gap=None (must be 0)"),
        ("feasible", 1.5, "gap=1.5 is outside [0, 1]"),
        ("feasible", -0.1, "gap=-0.1 is outside [0, 1]"),
    ],
)
def test_a_gap_that_contradicts_the_status_is_caught(
    status: str, gap: float | None, message: str
) -> None:
    plan = plan_of(LAYOUT).model_copy(update={"status": status, "gap": gap})
    assert check_plan(MODEL, CLUSTER, JOB, plan) == [message]


def test_a_decision_outside_the_space_is_caught() -> None:
    layout = Layout.uniform(MODEL, pp=4, tp=2, dp=2, recompute="full")
    space = SearchSpace(pp=[2], recompute=["none", "selective"])
    problems = check_plan(MODEL, CLUSTER, JOB, plan_of(layout), space=space)
    assert "pp=4 is not in the search space [2]" in problems
    assert "layer.0 recompute='full' is not in the search space ['none', 'selective']" in problems
    assert len(problems) == MODEL.num_layers + 1  # pp, then every layer's recompute


def test_recompute_choices_compare_as_module_sets() -> None:
    layout = Layout.uniform(MODEL, pp=2, tp=2, dp=4, recompute="mlp+layernorm")
    space = SearchSpace(recompute=["layernorm+mlp"])  # embedding and head may stay "none"
    assert check_plan(MODEL, CLUSTER, JOB, plan_of(layout), space=space) == []


def test_a_host_ema_over_host_ram_is_caught() -> None:
    """An fp32 EMA of 4 of 8 layers over tp 2 is 0.65 GiB per GPU: 5.2 GiB for 8 GPUs."""
    job = JOB.model_copy(update={"ema": "fp32"})
    small = CLUSTER.model_copy(update={"host_ram_bytes": 2 * 2**30})
    layout = Layout.uniform(MODEL, pp=2, tp=2, dp=4, ema="host")
    assert check_plan(MODEL, CLUSTER, job, plan_of(layout, job=job)) == []
    problems = check_plan(MODEL, small, job, plan_of(layout, job=job))
    need = "host-side state (EMA, offloaded optimizer and activations) needs 5.2 GiB"
    assert len(problems) == 1 and problems[0].startswith(need), problems


def test_degrees_that_do_not_divide_are_named() -> None:
    """Six kv heads over tp 4: the cost model rejects the layout; the checker says why."""
    odd = MODEL.model_copy(update={"num_attention_heads": 24, "num_kv_heads": 6})
    layout = Layout.uniform(MODEL, pp=1, tp=4, dp=4)
    problems = check_plan(odd, CLUSTER, JOB, plan_of(layout))
    assert problems[0] == "tp=4 does not divide 6 kv heads"
    assert problems[-1].startswith("layout cannot be evaluated")


def test_a_wrong_world_size_is_caught() -> None:
    problems = check_plan(MODEL, CLUSTER.model_copy(update={"num_gpus": 32}), JOB, plan_of(LAYOUT))
    assert problems[0] == "world size tp*cp*pp*dp=16 != cluster GPUs 32"


def test_a_simulation_that_differs_from_the_estimate_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The simulator runs the step on its own (``planner.executor``): on a real plan it is
    within the default tolerance of the estimate, and with none the difference is reported.
    A simulation that differs more is stood in for the checker's: beyond the tolerance it is
    reported with both figures and the difference, within it not."""
    layout = Layout.from_counts(MODEL, counts=[1, 7], tp=2, dp=4)  # unbalanced stages
    plan = plan_of(layout, simulated=False)  # the checker simulates it itself
    assert check_plan(MODEL, CLUSTER, JOB, plan) == []
    real = planner.simulate(MODEL, CLUSTER, JOB, layout)
    assert plan.estimate is not None
    if real.step_time_s != plan.estimate.step_time_s:
        assert check_plan(MODEL, CLUSTER, JOB, plan, sim_tolerance=0.0)[0].startswith(
            f"simulated step {real.step_time_s:.4g} s differs from the estimate"
        )
    step = plan.estimate.step_time_s

    def simulated(factor: float) -> None:
        slower = dataclasses.replace(real, step_time_s=step * factor)
        monkeypatch.setattr(planner.check, "simulate", lambda *args: slower)

    simulated(1.10)
    assert check_plan(MODEL, CLUSTER, JOB, plan) == [
        f"simulated step {step * 1.10:.4g} s differs from the estimate {step:.4g} s by +10.0% "
        "(tolerance 3%)"
    ]
    simulated(0.98)
    assert check_plan(MODEL, CLUSTER, JOB, plan) == []
    assert check_plan(MODEL, CLUSTER, JOB, plan, sim_tolerance=0.01) == [
        f"simulated step {step * 0.98:.4g} s differs from the estimate {step:.4g} s by -2.0% "
        "(tolerance 1%)"
    ]


def test_an_infeasible_plan_needs_an_explanation() -> None:
    bare = Plan(status="infeasible", solve_time_s=0.0)
    assert check_plan(MODEL, CLUSTER, JOB, bare) == [
        "status infeasible: an explanation is required"
    ]
    explained = bare.model_copy(update={"explanation": Explanation(summary="Nothing fits.")})
    assert check_plan(MODEL, CLUSTER, JOB, explained) == []
    with_layout = plan_of(LAYOUT).model_copy(
        update={"status": "infeasible", "explanation": Explanation(summary="Nothing fits.")}
    )
    assert check_plan(MODEL, CLUSTER, JOB, with_layout) == [
        "status infeasible: layout must be None",
        "status infeasible: estimate must be None",
    ]


def test_a_feasible_plan_without_a_layout_is_caught() -> None:
    plan = Plan(status="feasible", solve_time_s=0.0)
    assert len(check_plan(MODEL, CLUSTER, JOB, plan)) == 1


def test_every_plan_a_test_makes_is_checked(
    monkeypatch: pytest.MonkeyPatch, plan_checked: CheckedPlans
) -> None:
    """The ``plan_checked`` fixture (tests/conftest.py) stands in for ``planner.plan`` under
    each name it is called by, and fails the test that made a plan the checker rejects,
    with the checker's words; a plan that checks out is handed back as it came."""
    assert planner.plan is planner.solve.plan is planner.cli.plan
    good = plan_of(LAYOUT)
    other = planner.evaluate(MODEL, CLUSTER, JOB, Layout.uniform(MODEL, pp=4, tp=2, dp=2))
    bad = good.model_copy(update={"estimate": other})
    monkeypatch.setattr(search, "plan", lambda *args, **kwargs: bad)
    with pytest.raises(pytest.fail.Exception, match=r"estimate step time .* != evaluated"):
        planner.plan(MODEL, CLUSTER, JOB, time_limit_s=1)
    # The space a plan was searched in is checked too.
    monkeypatch.setattr(search, "plan", lambda *args, **kwargs: good)
    with pytest.raises(pytest.fail.Exception, match=r"pp=2 is not in the search space \[4\]"):
        planner.solve.plan(MODEL, CLUSTER, JOB, SearchSpace(pp=[4]))
    assert planner.cli.plan(MODEL, CLUSTER, JOB, SearchSpace(pp=[2])) is good
    assert plan_checked.plans == [good]


@pytest.mark.unchecked_plans("a plan the checker rejects, to see the marker let it through")
def test_a_test_marked_unchecked_plans_gets_its_plans_as_made(
    monkeypatch: pytest.MonkeyPatch, plan_checked: CheckedPlans
) -> None:
    bad = plan_of(LAYOUT).model_copy(update={"status": "optimal", "gap": 0.5})
    assert check_plan(MODEL, CLUSTER, JOB, bad) != []
    monkeypatch.setattr(search, "plan", lambda *args, **kwargs: bad)
    assert planner.plan(MODEL, CLUSTER, JOB) is bad
    assert plan_checked.plans == [bad]


# -- the exhaustive search ---------------------------------------------------------------

TINY = planner.load_model("llama3-8b").model_copy(update={"num_layers": 4})
FOUR = planner.load_cluster("h100", gpus=4)
TINY_JOB = planner.TrainingJob(seq_len=1024, global_batch=16)
TINY_SPACE = SearchSpace(
    tp=[1, 2],
    pp=[1, 2],
    ep=[1],
    zero=[1],
    micro_batch=[1],
    schedules=["1f1b"],
    virtual_stages=[1],
    recompute=["none", "full"],
)


def test_bruteforce_counts_every_layout() -> None:
    """(tp, pp) in {1, 2}^2 on 4 GPUs: dp = 4 / (tp*pp), always whole.
    pp = 1: one stage of 4 layers; multisets of 4 from {none, full}: C(5, 4) = 5.
    pp = 2: splits (0,4) (1,3) (2,2) (3,1) (4,0), each stage of k layers C(k+1, k) = k+1
    multisets: 1*5 + 2*4 + 3*3 + 4*2 + 5*1 = 35.
    Per tp: 5 + 35 = 40; two values of tp: 80."""
    n = count_layouts(TINY, FOUR, TINY_JOB, TINY_SPACE)
    print(f"bruteforce evaluated {n} layouts")
    assert n == 2 * (5 + 35)


def test_bruteforce_beats_every_uniform_layout() -> None:
    found = best_layout(TINY, FOUR, TINY_JOB, TINY_SPACE)
    assert found is not None
    layout, estimate = found
    assert estimate.fits
    plan = plan_of(layout, model=TINY, cluster=FOUR, job=TINY_JOB)
    assert check_plan(TINY, FOUR, TINY_JOB, plan, space=TINY_SPACE) == []
    for tp, pp, recompute in itertools.product([1, 2], [1, 2], ["none", "full"]):
        uniform = Layout.uniform(TINY, tp=tp, pp=pp, dp=4 // (tp * pp), recompute=recompute)
        other = planner.evaluate(TINY, FOUR, TINY_JOB, uniform)
        assert estimate.step_time_s <= other.step_time_s


def test_bruteforce_mixes_recompute_when_memory_is_tight() -> None:
    """With the memory cap between the all-full and the no-recompute peaks, only a mix of
    choices is both fast and within memory: the search must find it, and nothing fits below
    it. The cap is usable HBM less the job's margin, so usable HBM is set above the cap."""
    space = TINY_SPACE.model_copy(update={"tp": [1], "pp": [1]})
    peaks = {
        r: planner.evaluate(
            TINY, FOUR, TINY_JOB, Layout.uniform(TINY, dp=4, recompute=r)
        ).peak_bytes
        for r in ("none", "full")
    }
    usable = math.ceil((peaks["none"] + peaks["full"]) // 2 / (1 - TINY_JOB.memory_margin))
    tight = FOUR.model_copy(update={"hbm_bytes": usable, "hbm_reserved_bytes": 0})
    found = best_layout(TINY, tight, TINY_JOB, space)
    assert found is not None
    layout, estimate = found
    choices = [b.recompute for b in layout.stages[0].blocks if b.block.startswith("layer.")]
    assert set(choices) == {"none", "full"}
    assert peaks["full"] < estimate.cap_bytes < peaks["none"]
    assert estimate.peak_bytes <= estimate.cap_bytes
    below = peaks["full"] - 1  # usable HBM, so the cap is below it too
    too_tight = FOUR.model_copy(update={"hbm_bytes": below, "hbm_reserved_bytes": 0})
    assert best_layout(TINY, too_tight, TINY_JOB, space) is None
