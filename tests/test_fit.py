"""``planner.fit``: fitting a cluster's constants to measured step times.

The runs here are "measured" on a cluster whose constants are known (the catalog's H100 with
other achieved fractions and overheads), so a correct fit must find those constants again and
reproduce every run; nothing is compared with the fit's own earlier output.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml

import planner
from planner.catalog import load_cluster
from planner.cli import main
from planner.fit import fit_profile, fit_runs, gpt_model, predict, read_runs
from planner.layout import Layout

TRUE = {  # the "real" machine
    "achieved": {"gemm": 0.62, "attention": 0.41, "memory_bound": 0.71, "nvlink": 0.66},
    "kernel_overhead_s": 9e-6,
    "host_overhead_s": 1e-6,  # a host that never binds here (the catalog's 70 us does)
    "nvlink_latency_s": 6e-6,
}


def _true(base: planner.ClusterSpec) -> planner.ClusterSpec:
    achieved = {**base.achieved, **TRUE["achieved"]}
    return base.model_copy(update={**TRUE, "achieved": achieved})


def _runs(truth: planner.ClusterSpec) -> list[planner.Run]:
    model = planner.load_model("llama3-8b").model_copy(update={"num_layers": 4})
    out = []
    for i, (tp, pp, dp, mb, seq, rc) in enumerate(
        [
            (1, 1, 8, 1, 4096, "full"),
            (2, 1, 4, 1, 4096, "none"),
            (4, 2, 1, 1, 2048, "none"),
            (8, 1, 1, 2, 8192, "selective"),
            (1, 2, 4, 2, 1024, "none"),
            (2, 2, 2, 4, 512, "none"),
            (8, 1, 1, 1, 256, "none"),
            (1, 1, 8, 8, 128, "full"),
        ]
    ):
        job = planner.TrainingJob(seq_len=seq, global_batch=dp * mb * 4)
        layout = Layout.uniform(model, pp=pp, tp=tp, dp=dp, micro_batch=mb, recompute=rc)
        step = predict(truth, [planner.Run(model, job, layout, 1.0)])[0]
        out.append(planner.Run(model, job, layout, float(step), name=f"case {i}"))
    return out


def test_fit_recovers_the_constants_that_made_the_runs() -> None:
    base = load_cluster("h100", gpus=8)
    runs = _runs(_true(base))
    report = fit_runs(base, runs, folds=4, rounds=3)
    assert report.before_mape > 0.10  # the catalog's constants are far from this machine's
    assert report.fit_mape < 0.005
    assert report.heldout_mape is not None and report.heldout_mape < 0.02
    fitted = report.cluster
    for key in ("gemm", "memory_bound"):
        assert fitted.achieved[key] == pytest.approx(TRUE["achieved"][key], rel=0.03), key
    # InfiniBand: single-node runs say nothing about it, so it keeps the catalog's value
    assert "achieved.ib" not in report.informed
    assert fitted.achieved["ib"] == pytest.approx(base.achieved["ib"])
    assert fitted.ib_latency_s == pytest.approx(base.ib_latency_s)


def test_the_fit_finds_a_host_that_binds_and_one_that_does_not() -> None:
    # From the catalog's host time (70 us per counted kernel, binding on the small runs) the
    # fit must reach a machine whose host never binds (TRUE) and one whose host binds as the
    # catalog's does: a maximum hides the constants behind whichever term binds at the start.
    base = load_cluster("h100", gpus=8)
    binding = _true(base).model_copy(update={"host_overhead_s": base.host_overhead_s})
    for truth in (_true(base), binding):
        report = fit_runs(base, _runs(truth), folds=0, rounds=3)
        assert report.fit_mape < 0.005
        assert report.cluster.achieved["gemm"] == pytest.approx(TRUE["achieved"]["gemm"], rel=0.03)
        # the runs are Megatron-LM's: the fit sets that framework's host time
        host = report.cluster.framework_host_overhead_s["megatron"]
        assert host == pytest.approx(truth.host_overhead_s, rel=0.05)


def test_fit_stays_within_physical_bounds() -> None:
    base = load_cluster("h100", gpus=8)
    truth = _true(base)
    runs = [
        planner.Run(r.model, r.job, r.layout, r.measured_step_s * 0.3, r.name)
        for r in _runs(truth)  # faster than any GPU could run them
    ]
    fitted = fit_profile(base, runs, rounds=2)
    assert fitted.achieved["gemm"] <= base.achieved_max["gemm"] + 1e-9
    for key in ("attention", "memory_bound", "nvlink"):
        assert fitted.achieved[key] <= 1.0 + 1e-9
    assert fitted.kernel_overhead_s >= 1e-6


def test_runs_slower_than_any_kernel_hit_the_floors_and_say_so() -> None:
    # Three times slower than the machine that made them: no kernel or link is that slow,
    # so the fit stops at the floors and ceilings and reports which constants sit there.
    from planner.fit import FRACTION_FLOORS, SECONDS_CEILINGS

    base = load_cluster("h100", gpus=8)
    runs = [
        planner.Run(r.model, r.job, r.layout, r.measured_step_s * 3.0, r.name)
        for r in _runs(_true(base))
    ]
    report = fit_runs(base, runs, folds=0, rounds=2)
    fitted = report.cluster
    for key, floor in FRACTION_FLOORS.items():
        assert fitted.achieved[key] >= floor * (1 - 1e-9), key
    for key, ceiling in SECONDS_CEILINGS.items():
        assert getattr(fitted, key) <= ceiling * (1 + 1e-9), key
    assert report.at_bound
    assert set(report.at_bound) <= set(report.informed)
    assert "(at its bound)" in report.fitted_text()


def test_a_step_that_overshoots_is_taken_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a maximum switches terms, the linear solve can land far from the optimum; the fit
    must then return a point no worse than its start (here every solve is made to land a
    thousand times too far: every rate a thousandth, every overhead a thousandfold)."""
    from planner import fit as fitting

    base = load_cluster("h100", gpus=8)
    runs = _runs(_true(base))

    def overshoot(a: np.ndarray, b: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return 1000.0 * np.maximum(np.linalg.lstsq(a, b, rcond=None)[0], lo)

    monkeypatch.setattr(fitting, "_bounded_lstsq", overshoot)
    report = fit_runs(base, runs, folds=0, rounds=3)
    assert report.fit_mape <= report.before_mape + 1e-12


def test_tuple_runs_and_bad_input() -> None:
    base = load_cluster("h100", gpus=8)
    r = _runs(_true(base))[0]
    fitted = fit_profile(base, [(r.model, r.job, r.layout, r.measured_step_s)], rounds=1)
    assert isinstance(fitted, planner.ClusterSpec)
    with pytest.raises(planner.PlannerError, match="measured_step_s=-1"):
        fit_runs(base, [(r.model, r.job, r.layout, -1.0)])
    with pytest.raises(planner.PlannerError, match=r"expected \(model, job, layout"):
        fit_runs(base, [(r.model, r.job)])
    with pytest.raises(planner.PlannerError, match="at least one"):
        fit_runs(base, [])


def test_gpt_shape_counts_like_megatron() -> None:
    # Narayanan et al. 2021 (arXiv 2104.04473), Table 1: hidden 12288, 96 layers, 96 heads is
    # the 175B row ("175.0" billion parameters at vocabulary 51,200).
    model = gpt_model("gpt:hidden=12288;layers=96;heads=96;vocab=51200")
    layout = Layout.uniform(model, tp=8, pp=8, dp=1)
    from planner.costs.blocks import Shard, block_cost

    total = sum(
        p.numel
        for b in layout.stages
        for pl in b.blocks
        for p in block_cost(model, pl.block, Shard(seq_len=2048, tp=1)).params
        if not p.key.startswith("pos")
    )
    assert total / 1e9 == pytest.approx(175.0, rel=0.01)


CSV = """id,model,tp,pp,dp,micro_batch,global_batch,seq_len,recompute,metric,value
{rows}
"""


def _write(tmp_path: Path, runs: list[planner.Run]) -> Path:
    lines = []
    for r in runs:
        lay = r.layout
        recompute = r.layout.stages[0].blocks[1].recompute
        rc = recompute if isinstance(recompute, str) else "none"
        lines.append(
            f"{r.name},llama3-8b,{lay.tp},{lay.pp},{lay.dp},{lay.micro_batch},"
            f"{r.job.global_batch},{r.job.seq_len},{rc},step_s,{r.measured_step_s}"
        )
    path = tmp_path / "runs.csv"
    path.write_text(CSV.format(rows="\n".join(lines)))
    return path


def test_read_runs_rejects_bad_rows(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("id,model,tp,pp,dp,micro_batch,global_batch\nx,llama3-8b,1,1,8,1,8\n")
    with pytest.raises(planner.PlannerError, match=r"missing column.*seq_len"):
        read_runs(path)
    path.write_text(
        "id,model,tp,pp,dp,micro_batch,global_batch,seq_len,gpu,step_s\n"
        "x,llama3-8b,1,1,8,1,8,4096,a100,1.5\n"
    )
    with pytest.raises(planner.PlannerError, match="gpu=a100 but the cluster is h100"):
        read_runs(path, gpu="h100")
    path.write_text(
        "id,model,tp,pp,dp,micro_batch,global_batch,seq_len,metric,value\n"
        "x,llama3-8b,1,1,8,1,8,4096,mfu,0.4\n"
    )
    with pytest.raises(planner.PlannerError, match="metric='mfu'"):
        read_runs(path)
    path.write_text(
        "id,model,tp,pp,dp,micro_batch,global_batch,seq_len,metric,value\n"
        "x,llama3-8b,1,1,8,1,8,4096,tokens_per_s_per_gpu,4096\n"
    )
    (run,) = read_runs(path)
    assert run.measured_step_s == pytest.approx(8 * 4096 / (4096 * 8))
    assert run.job.flash_attention
    path.write_text(
        "id,model,tp,pp,dp,micro_batch,global_batch,seq_len,flash_attention,step_s\n"
        "x,gpt:hidden=1024;layers=2;heads=16;vocab=1000;dropout=0.1,1,1,8,1,8,2048,false,1\n"
    )
    (run,) = read_runs(path)
    assert not run.job.flash_attention
    assert run.model.hidden_dropout == run.model.attention_dropout == 0.1
    assert run.model.learned_positions == 2048


def test_cli_writes_a_profile_evaluate_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = load_cluster("h100", gpus=8)
    model = planner.load_model("llama3-8b")
    truth = _true(base)
    runs = []
    for i, (tp, dp) in enumerate([(1, 8), (2, 4), (4, 2), (8, 1)]):
        job = planner.TrainingJob(seq_len=2048, global_batch=16)
        layout = Layout.uniform(model, tp=tp, dp=dp, recompute="full")
        runs.append(
            planner.Run(
                model,
                job,
                layout,
                float(predict(truth, [planner.Run(model, job, layout, 1)])[0]),
                f"r{i}",
            )
        )
    csv_path = _write(tmp_path, runs)
    out = tmp_path / "fitted.yaml"
    code = main(
        [
            "calibrate",
            "--runs",
            str(csv_path),
            "--cluster",
            "h100",
            "--out",
            str(out),
            "--folds",
            "2",
            "--rounds",
            "2",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "held-out" in text and "MAPE" in text
    assert "at its physical bound" in text  # four tp-only layouts push fractions to a floor
    # and what data would tell them apart (the note's cell may wrap: read it across lines)
    assert "runs that pin it:" in re.sub(r"[│┃\s]+", " ", text)
    data = yaml.safe_load(out.read_text())
    assert "fit" in data["sources"]
    cluster = load_cluster(out, gpus=8)
    est = planner.evaluate(model, cluster, runs[0].job, runs[0].layout)
    # Four layouts that differ only in tp cannot tell the compute fractions apart; within the
    # fit's physical bounds the profile reproduces them to a few percent, not exactly.
    assert est.step_time_s == pytest.approx(runs[0].measured_step_s, rel=0.05)
    before = planner.evaluate(model, base, runs[0].job, runs[0].layout).step_time_s
    assert abs(before / runs[0].measured_step_s - 1) > 0.1  # the catalog's constants do not
    assert np.isfinite(est.step_time_s)
    assert main(["calibrate", "--runs", str(csv_path)]) == 2
    assert "needs --cluster" in capsys.readouterr().err


def test_gpt_spec_states_a_llama_shape_exactly() -> None:
    # Llama 2 7B (meta-llama/Llama-2-7b-hf config.json: hidden 4096, 32 layers, 32 heads,
    # intermediate 11008, vocab 32000, RMSNorm, SwiGLU, RoPE, no biases, untied): 6,738,415,616
    # parameters, the count its model card's checkpoint holds.
    spec = "gpt:hidden=4096;layers=32;heads=32;ffn=11008;swiglu=1;rmsnorm=1;rope=1;bias=0;tied=0"
    model = gpt_model(spec + ";vocab=32000")
    assert model.num_params() == 6_738_415_616
    assert (model.attention, model.learned_positions) == ("mha", 0)
    assert gpt_model(spec + ";vocab=32000;kv=8").attention == "gqa"
    with pytest.raises(planner.PlannerError, match="'window' is not one of"):
        gpt_model(spec + ";vocab=32000;window=4096")


@pytest.mark.parametrize(("kind", "same"), [("gemm", "gemm_fp8"), ("attention", "attention_fa2")])
def test_a_fitted_fraction_carries_its_sibling_at_the_measured_ratio(kind: str, same: str) -> None:
    # FP8 GEMMs and FlashAttention-2 keep their measured ratio to the fitted fraction
    from planner.fit import CONSTANTS, with_constants

    base = load_cluster("h100", gpus=8)
    ratio = base.achieved[same] / base.achieved[kind]
    x = np.array([c.read(_true(base)) for c in CONSTANTS])
    fitted = with_constants(base, x)
    assert fitted.achieved[kind] == pytest.approx(TRUE["achieved"][kind])
    assert fitted.achieved[same] == pytest.approx(TRUE["achieved"][kind] * ratio)


def test_the_host_time_is_fitted_per_framework() -> None:
    # One machine, two software stacks: the host's time per kernel is each stack's own
    base = load_cluster("h100", gpus=8)
    truth = _true(base).model_copy(
        update={"framework_host_overhead_s": {"megatron": 150e-6, "deepspeed": 40e-6}}
    )
    megatron = _runs(truth)
    deepspeed = []
    for r in megatron:
        job = r.job.with_framework("deepspeed")
        step = predict(truth, [planner.Run(r.model, job, r.layout, 1.0)])[0]
        deepspeed.append(planner.Run(r.model, job, r.layout, float(step), r.name + " ds"))
    report = fit_runs(base, megatron + deepspeed, folds=0, rounds=3)
    fitted = report.cluster.framework_host_overhead_s
    assert fitted["megatron"] == pytest.approx(150e-6, rel=0.05)
    assert fitted["deepspeed"] == pytest.approx(40e-6, rel=0.05)
    assert {"host_overhead_s[megatron]", "host_overhead_s[deepspeed]"} <= set(report.informed)
    # Runs of one framework say nothing of another's: the other keeps the cluster's value
    alone = fit_runs(base, megatron, folds=0, rounds=3).cluster
    assert "deepspeed" not in alone.framework_host_overhead_s
