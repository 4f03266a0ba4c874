"""The data-parallel reduction after the last backward (``TrainingJob.exposed_grad_reduce``:
Megatron-LM without --overlap-grad-reduce) and Megatron-LM as it ran in 2021
(``megatron-2021``: blocking pipeline sends, no distributed optimizer)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_export import plan_of

import planner
from planner.errors import PlannerError
from planner.fit import gpt_model, layout_from_row
from planner.layout import Layout
from planner.logs import read_log
from planner.logs.megatron import read, write_log
from planner.solve.result import Plan

GPT = gpt_model("gpt:hidden=2048;layers=8;heads=16;vocab=32000")
LOG = Path(__file__).parent / "data" / "logs" / "megatron-gpt-tp2-pp2-vp2.log"
MIB = 2**20


def _jobs(dp: int) -> tuple[planner.ClusterSpec, Layout, list[planner.TrainingJob]]:
    """A layout, and its job with the reduction beside the backward and after it."""
    base = planner.TrainingJob(seq_len=2048, global_batch=4 * dp)
    jobs = [base, base.model_copy(update={"exposed_grad_reduce": True})]
    cluster = planner.load_cluster("a100", gpus=dp)
    return cluster, Layout.uniform(GPT, dp=dp, micro_batch=1, zero=1), jobs


def test_an_exposed_reduction_adds_to_the_step_what_the_backward_hid() -> None:
    """Across two nodes, after the last backward, all of the reduction is on the step, and
    nothing else moves."""
    cluster, layout, jobs = _jobs(16)
    hidden, exposed = (planner.evaluate(GPT, cluster, job, layout) for job in jobs)
    grown = exposed.breakdown["grad_sync"] - hidden.breakdown["grad_sync"]
    assert grown > 0.01
    assert exposed.step_time_s - hidden.step_time_s == pytest.approx(grown, rel=0.05)
    for part in ("compute", "recompute", "optimizer"):
        assert exposed.breakdown[part] == pytest.approx(hidden.breakdown[part])
    # The simulator sees it too: longer, and (nothing left to overlap) the closed form's step.
    sims = [planner.simulate(GPT, cluster, job, layout).step_time_s for job in jobs]
    assert sims[1] > sims[0]
    assert sims[1] == pytest.approx(exposed.step_time_s, rel=0.01)


def test_without_data_parallelism_there_is_nothing_to_expose() -> None:
    cluster, layout, jobs = _jobs(1)
    hidden, exposed = (planner.evaluate(GPT, cluster, job, layout) for job in jobs)
    assert exposed.step_time_s == pytest.approx(hidden.step_time_s)


def test_only_megatron_has_the_switch() -> None:
    with pytest.raises(PlannerError, match="exposed_grad_reduce=True: framework='torchtitan'"):
        planner.TrainingJob(
            seq_len=2048, global_batch=8, framework="torchtitan", exposed_grad_reduce=True
        )
    job = planner.TrainingJob(seq_len=2048, global_batch=8, framework="megatron-2021")
    assert job.model_copy(update={"exposed_grad_reduce": True}).exposed_grad_reduce


def _interleaved(framework: str, schedule: str) -> planner.Estimate:
    """A GPT over 4 nodes of A100s, one pipeline stage per node (sends over InfiniBand)."""
    model = gpt_model("gpt:hidden=4096;layers=16;heads=32;vocab=51200")
    cluster = planner.load_cluster("a100", gpus=32)
    job = planner.TrainingJob(seq_len=2048, global_batch=32, framework=framework)
    virtual = 2 if schedule == "interleaved" else None
    layout = Layout.uniform(
        model, tp=8, pp=4, schedule=schedule, virtual_stages=virtual, micro_batch=1, zero=0
    )
    return planner.evaluate(model, cluster, job, layout)


def test_megatron_of_2021_blocks_on_every_pipeline_send() -> None:
    """Its interleaved schedule waits on each send as its 1F1B does (p2p_communication.py at
    6985e589: batch_isend_irecv, a wait on each request, torch.cuda.synchronize()); today's
    Megatron-LM posts them asynchronously there."""
    now, then = (
        _interleaved("megatron", "interleaved"),
        _interleaved("megatron-2021", "interleaved"),
    )
    assert now.breakdown["pipeline_p2p"] == 0
    assert then.breakdown["pipeline_p2p"] > 0.005
    assert then.step_time_s > now.step_time_s
    # 1F1B's sends block in both (arguments.py forces the overlap off without virtual stages)
    assert _interleaved("megatron-2021", "1f1b").breakdown["pipeline_p2p"] == pytest.approx(
        _interleaved("megatron", "1f1b").breakdown["pipeline_p2p"]
    )


def test_megatron_of_2021_costs_layouts_and_plans_none() -> None:
    job = planner.TrainingJob(seq_len=2048, global_batch=32, framework="megatron-2021")
    with pytest.raises(PlannerError, match=r"megatron-2021.*costs given layouts only"):
        planner.plan(GPT, planner.load_cluster("a100", gpus=8), job, time_limit_s=1)


def _plan(job: planner.TrainingJob) -> Plan:
    model, cluster = planner.load_model("llama3-8b"), planner.load_cluster("h100", gpus=64)
    return plan_of(model, cluster, job, Layout.uniform(model, pp=4, dp=16, zero=1))


def test_the_megatron_export_writes_the_overlap_the_plan_was_costed_with() -> None:
    job = planner.TrainingJob(seq_len=4096, global_batch=256)
    overlapped = planner.export.megatron(_plan(job)).args
    assert "--overlap-grad-reduce" in overlapped and "--overlap-param-gather" in overlapped
    exposed = planner.export.megatron(_plan(job.model_copy(update={"exposed_grad_reduce": True})))
    assert "--use-distributed-optimizer" in exposed.args
    assert "--overlap-grad-reduce" not in exposed.args
    assert "--overlap-param-gather" not in exposed.args  # it needs the reduction's overlap
    assert exposed.exact


def test_a_megatron_log_without_the_overlap_is_read_as_exposed(tmp_path: Path) -> None:
    text = LOG.read_text()
    assert read_log(LOG).job.exposed_grad_reduce is False  # overlap_grad_reduce True
    off = text.replace("overlap_grad_reduce ............................. True", "")
    assert read(off, "off.log").job.exposed_grad_reduce is True  # dp 2, the parser's default
    # planner's own Megatron-format logs state the switch as the export does
    job = planner.TrainingJob(seq_len=1024, global_batch=8, exposed_grad_reduce=True)
    layout = Layout.uniform(GPT, dp=2, micro_batch=1)
    path = tmp_path / "run.log"
    write_log(path, GPT, job, layout, [0.5] * 6, [(0, 100 * MIB, None)])
    assert read_log(path).job.exposed_grad_reduce is True


def test_a_run_row_states_the_switch() -> None:
    row = {
        "model": "gpt:hidden=1024;layers=4;heads=16;vocab=32000",
        "tp": "1",
        "pp": "1",
        "dp": "8",
        "micro_batch": "1",
        "global_batch": "8",
        "seq_len": "1024",
        "exposed_grad_reduce": "true",
    }
    assert layout_from_row(row, "row")[1].exposed_grad_reduce is True
    with pytest.raises(PlannerError, match="exposed_grad_reduce='maybe' must be true or false"):
        layout_from_row({**row, "exposed_grad_reduce": "maybe"}, "row")
