"""The ``planner`` command: end to end in real processes with real exit codes, and its
refusals of bad input in-process (``main`` called directly), each one line and exit 2."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import planner
from planner.cli import COMMANDS, main

PLANNER = shutil.which("planner", path=str(Path(sys.executable).parent)) or "planner"
DEMO = [
    "memory",
    "--model",
    "deepseek-v3",
    "--cluster",
    "h800",
    "--gpus",
    "2048",
    "--seq-len",
    "4096",
    "--global-batch",
    "15360",
    "--pp",
    "16",
    "--ep",
    "64",
    "--schedule",
    "dualpipe",
    "--recompute",
    "full",
    "--moment-dtype",
    "bf16",
    "--ema",
    "fp32",
    "--ema-on-host",
]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PLANNER, *args], capture_output=True, text=True, timeout=120)


def test_readme_demo_prints_the_memory_table() -> None:
    out = run(*DEMO)
    assert out.returncode == 0, out.stderr
    assert "per-rank memory (GiB)" in out.stdout
    assert "E L0-3 | L58-60 mtp.0 head" in out.stdout  # DualPipe: rank 0 holds both ends
    text = " ".join(out.stdout.split())  # rich wraps the summary
    assert "usable HBM 79.15 GiB (of 80 GiB), cap 75.19 GiB after the 5% margin" in text


def test_memory_summary_states_the_cap_and_the_headroom() -> None:
    """The summary line: peak against usable HBM and the cap, and the share of usable HBM the
    heaviest rank leaves free, figures as the library computes them."""
    import planner

    out = run(*DEMO)
    assert out.returncode == 0, out.stderr
    est = planner.evaluate(
        planner.load_model("deepseek-v3"),
        planner.load_cluster("h800", gpus=2048),
        planner.TrainingJob(seq_len=4096, global_batch=15360, moment_dtype="bf16", ema="fp32"),
        planner.Layout(**json.loads(run(*DEMO, "--json").stdout)["layout"]),
    )
    assert est.fits
    free = (est.usable_hbm_bytes - est.peak_bytes) / 2**30
    top = max(est.memory, key=lambda s: s.peak_bytes)
    expected = (
        f"Peak {est.peak_bytes / 2**30:.2f} GiB per GPU (allocated "
        f"{top.allocated_bytes / 2**30:.2f} GiB in tensors, reserved "
        f"{top.reserved_bytes / 2**30:.2f} GiB by the caching allocator, plus 0.75 GiB of CUDA "
        "context and 1.00 GiB of NCCL buffers); usable HBM 79.15 GiB (of 80 GiB), "
        "cap 75.19 GiB after the 5% margin for the memory model's error: fits, the heaviest "
        f"rank leaves {est.headroom:.1%} of usable HBM ({free:.2f} GiB) free."
    )
    assert expected in " ".join(out.stdout.split())


def test_json_output_matches_the_library() -> None:
    import planner

    out = run(*DEMO, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    layout = planner.Layout(**data["layout"])
    est = planner.evaluate(
        planner.load_model("deepseek-v3"),
        planner.load_cluster("h800", gpus=2048),
        planner.TrainingJob(seq_len=4096, global_batch=15360, moment_dtype="bf16", ema="fp32"),
        layout,
    )
    assert data["estimate"]["peak_bytes"] == est.peak_bytes
    assert data["estimate"]["cap_bytes"] == est.cap_bytes == math.floor(round(79.15 * 2**30) * 0.95)
    assert data["estimate"]["usable_hbm_bytes"] == est.usable_hbm_bytes
    assert len(data["estimate"]["memory"]) == 16


def test_catalog_listings() -> None:
    assert "deepseek-v3" in run("models").stdout.split()
    assert "h800" in run("clusters").stdout.split()


def test_evaluate_prints_memory_and_step_time() -> None:
    out = run("evaluate", *DEMO[1:], "--compute-dtype", "fp8")
    assert out.returncode == 0, out.stderr
    assert "per-rank memory (GiB)" in out.stdout and "step time:" in out.stdout
    for part in ("compute", "bubble", "expert_all_to_all", "grad_sync", "optimizer"):
        assert part in out.stdout
    assert "tokens/s" in out.stdout and "MFU" in out.stdout


def test_simulate_writes_a_trace_and_agrees_with_the_library(tmp_path: Path) -> None:
    import planner

    trace = tmp_path / "trace.json"
    out = run("simulate", *DEMO[1:], "--trace", str(trace), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert json.loads(trace.read_text())["traceEvents"]
    model = planner.load_model("deepseek-v3")
    layout = planner.Layout.uniform(
        model, pp=16, dp=128, ep=64, schedule="dualpipe", recompute="full", ema="host"
    )
    job = planner.TrainingJob(seq_len=4096, global_batch=15360, moment_dtype="bf16", ema="fp32")
    sim = planner.simulate(model, planner.load_cluster("h800", gpus=2048), job, layout)
    assert data["step_time_s"] == pytest.approx(sim.step_time_s)
    assert data["peak_bytes"] == sim.peak_bytes


PLAN = [
    "plan",
    "--model",
    "llama3-8b",
    "--cluster",
    "h100",
    "--gpus",
    "16",
    "--seq-len",
    "2048",
    "--global-batch",
    "64",
    "--time-limit",
    "3",
]


def test_plan_json_is_a_plan_that_checks_out() -> None:
    import planner
    from planner.check import check_plan

    out = run(*PLAN, "--json")
    assert out.returncode == 0, out.stderr
    plan = planner.Plan.model_validate_json(out.stdout)
    assert plan.status in ("optimal", "feasible") and plan.layout is not None
    model = planner.load_model("llama3-8b")
    cluster = planner.load_cluster("h100", gpus=16)
    job = planner.TrainingJob(seq_len=2048, global_batch=64)
    assert check_plan(model, cluster, job, plan) == []
    # the runners-up: other degrees or schedules, none faster than the plan, each evaluated
    assert plan.alternatives and plan.estimate is not None

    def shape(lay: planner.Layout) -> tuple[str, str, int]:
        return lay.degrees(), lay.schedule, lay.virtual_stages

    seen = {shape(plan.layout)}
    for alt in plan.alternatives:
        assert shape(alt.layout) not in seen
        seen.add(shape(alt.layout))
        assert alt.step_time_s >= plan.estimate.step_time_s * (1 - 1e-9)
        again = planner.evaluate(model, cluster, job, alt.layout)
        assert again.step_time_s == pytest.approx(alt.step_time_s, rel=1e-9)


def test_plan_prints_layout_memory_time_and_proof() -> None:
    out = run(*PLAN, "--pp", "2", "--schedule", "1f1b")
    assert out.returncode == 0, out.stderr
    assert "per-rank memory (GiB)" in out.stdout and "step time:" in out.stdout
    assert "pp=2" in out.stdout and ("proven optimal" in out.stdout or "gap" in out.stdout)
    # each decision said: each stage's blocks and recompute, the headroom, the runners-up
    assert "decisions per stage: blocks and their recompute" in out.stdout
    assert "Headroom kept: 5% of usable HBM" in out.stdout
    assert "runners-up" in out.stdout and "vs plan" in out.stdout


def test_plan_under_several_frameworks_prints_the_best_of_each() -> None:
    out = run(*PLAN, "--pp", "1", "--target", "megatron", "torchtitan")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "megatron: " in text and "torchtitan: " in text and "s per step" in text
    runs = text.split("Run by ")[1].split(":")[0]
    assert runs in ("megatron", "torchtitan")
    alone = run(*PLAN, "--target", "any", "megatron")
    assert alone.returncode == 2 and "'any' stands alone" in alone.stderr


def test_the_moe_dispatcher_is_a_job_flag_a_recipe_sets_itself() -> None:
    flags = ["--model", "mixtral-8x7b", "--cluster", "h100", "--gpus", "16"]
    job = ["--seq-len", "2048", "--global-batch", "64", "--time-limit", "2"]
    out = run("plan", *flags, *job, "--moe-dispatcher", "deepep", "--framework", "deepspeed")
    assert out.returncode == 2
    assert out.stderr.strip().endswith(
        "TrainingJob.moe_dispatcher='deepep': framework='deepspeed' runs alltoall"
    )
    out = run("plan", "--recipe", "mixtral-8x7b-megatron", "--moe-dispatcher", "deepep")
    assert out.returncode == 2 and "--moe-dispatcher: --recipe=mixtral-8x7b-megatron" in out.stderr


def test_infeasible_plan_is_explained_not_a_traceback() -> None:
    args = list(PLAN)
    args[args.index("--model") + 1] = "llama3-70b"
    args[args.index("--gpus") + 1] = "8"
    out = run(*args)
    assert out.returncode == 3, out.stderr  # infeasible, explained: exit 3, no traceback
    assert "infeasible" in out.stdout and "binds: memory" in out.stdout
    assert "GPUs: fits" in out.stdout
    assert "fix: the optimizer state on the host (--optimizer-offload 0 1): fits" in out.stdout
    assert "SearchSpace." not in out.stdout  # fixes in the CLI's own flags


def test_an_export_of_a_plan_that_does_not_fit_is_refused_unless_forced(tmp_path: Path) -> None:
    layout = tmp_path / "plan.json"
    args = list(PLAN)
    args[args.index("--gpus") + 1] = "8"
    planned = run(*args, "--pp", "1", "--tp", "1", "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    plan["estimate"]["cap_bytes"] = plan["estimate"]["peak_bytes"] - 1  # 1 byte over its cap
    layout.write_text(json.dumps(plan))
    refused = run("export", "--plan", str(layout), "--target", "megatron")
    assert refused.returncode == 3 and refused.stdout == ""
    assert "does not fit HBM" in refused.stderr and refused.stderr.count("\n") == 1
    forced = run("export", "--plan", str(layout), "--target", "megatron", "--force")
    assert forced.returncode == 0 and "--tensor-model-parallel-size" in forced.stdout


def test_pinned_degree_that_cannot_divide_is_explained_with_the_pin_to_free() -> None:
    out = run(*PLAN, "--tp", "3")
    assert out.returncode == 3, out.stderr  # infeasible: the explanation, exit 3
    assert "binds: degrees" in out.stdout
    assert "fix: any tensor-parallel degree (drop --tp): fits" in out.stdout  # the CLI's flag


def test_pictures_are_written_and_hold_the_figures(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ds")
    out = run(*DEMO[:1], *DEMO[1:], "--plot", prefix)
    assert out.returncode == 0, out.stderr
    memory = ET.parse(f"{prefix}-memory.svg").getroot()
    texts = {"".join(t.itertext()) for t in memory.iter("{http://www.w3.org/2000/svg}text")}
    assert {str(rank) for rank in range(16)} <= texts  # a bar per pipeline rank
    assert {"usable HBM 79.15 GiB", "cap 75.19 GiB", "memory per rank (GiB)"} <= texts
    evaluated = run("evaluate", *DEMO[1:], "--plot", f"{prefix}.png")
    assert evaluated.returncode == 0, evaluated.stderr
    assert Path(f"{prefix}-time.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    step = Path(f"{prefix}-time.svg").read_text()
    assert "compute" in step and "bubble" in step and " s (" in step


def test_catalog_json() -> None:
    models = json.loads(run("models", "--json").stdout)
    v3 = next(m for m in models if m["name"] == "deepseek-v3")
    assert v3["layers"] == 61 and v3["experts"] == 256
    clusters = json.loads(run("clusters", "--json").stdout)
    assert {c["name"] for c in clusters} >= {"h100", "h800", "a100"}


def test_evaluate_costs_a_saved_plan_or_layout_file(tmp_path: Path) -> None:
    job = ["--model", "llama3-8b", "--cluster", "h100", "--gpus", "16"]
    job += ["--seq-len", "2048", "--global-batch", "64"]
    planned = run("plan", *job, "--time-limit", "5", "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    (tmp_path / "plan.json").write_text(planned.stdout)
    (tmp_path / "layout.json").write_text(json.dumps(plan["layout"]))
    for name in ("plan.json", "layout.json"):
        out = run("evaluate", *job, "--layout", str(tmp_path / name), "--json")
        assert out.returncode == 0, out.stderr
        step = json.loads(out.stdout)["estimate"]["step_time_s"]
        assert step == pytest.approx(plan["estimate"]["step_time_s"])


# Bad input, in-process: ``main`` returns 2 for a PlannerError and argparse's own errors leave
# through SystemExit(2); either way one line on stderr, nothing on stdout, no traceback.

LLAMA = ["--model", "llama3-8b", "--cluster", "h100", "--gpus", "8"]
LLAMA += ["--seq-len", "4096", "--global-batch", "64"]


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``planner ARGV`` in this process on input it must refuse; its one stderr line."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    assert code == 2, out.out
    assert out.out == ""
    assert out.err.startswith("planner: ") and out.err.count("\n") == 1, out.err
    assert out.err.endswith("\n") and "Traceback" not in out.err
    return out.err


def says(err: str, message: str) -> bool:
    """A whole line (``message`` ends in a newline) must be the error; a fragment must be in it."""
    return err == message if message.endswith("\n") else message in err


def changed(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced, or the flag added."""
    if flag not in args:
        return [*args, flag, value]
    i = args.index(flag)
    return [*args[: i + 1], value, *args[i + 2 :]]


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--tp", "0", "planner: --tp=0: must be a positive degree\n"),
        ("--pp", "0", "planner: --pp=0: must be a positive degree\n"),
        ("--etp", "-1", "planner: --etp=-1: must be a positive degree\n"),
        (
            "--virtual-stages",
            "0",
            "planner: --virtual-stages=0: must be a positive number of chunks per rank\n",
        ),
        ("--tp", "3", "planner: --gpus=8: must be a multiple of tp*cp*pp=3\n"),
        ("--offload-layers", "32", "--offload-layers=32: must be between 1 and 31"),
        ("--micro-batch", "0", "Layout.micro_batch=0"),
        ("--optimizer-offload", "2", "Layout.optimizer_offload=2.0"),
        ("--recompute", "attn", "unknown module 'attn'"),
        ("--model", "gpt-5", "model='gpt-5': unknown model name"),
        ("--cluster", "tpu", "unknown cluster name"),
        ("--gpus", "0", "gpus=0: must be a whole number of GPUs from 1 to 16,777,216"),
        ("--gpus", "100000000", "gpus=100000000: must be a whole number of GPUs from 1"),
        ("--gpus", "many", "planner: argument --gpus: invalid int value: 'many'\n"),
        ("--zero", "5", "argument --zero: invalid choice: 5"),
        ("--schedule", "zigzag", "argument --schedule: invalid choice: 'zigzag'"),
    ],
)
def test_a_bad_layout_flag_is_named_in_one_line(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    err = refused(capsys, "evaluate", *changed(LLAMA, flag, value))
    assert says(err, message)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--gpus", "2052", "above one node it must be a whole number of nodes"),
        ("--ep", "48", "ep=48 must divide dp*cp*tp=128"),
        ("--global-batch", "15232", "Layout.num_microbatches=119"),  # DualPipe needs even m
    ],
)
def test_rules_of_a_large_layout_are_one_line_errors(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    assert message in refused(capsys, *changed(DEMO, flag, value))


def test_fp8_on_a_machine_without_it_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = changed(["evaluate", *LLAMA, "--compute-dtype", "fp8"], "--cluster", "a100")
    assert "compute_dtype='fp8': a100 has no FP8" in refused(capsys, *args)


def test_a_missing_job_flag_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    args = [a for a in LLAMA if a not in ("--seq-len", "4096")]
    err = refused(capsys, "memory", *args)
    assert err == "planner: --seq-len: required (or --recipe NAME; see planner recipes)\n"


def test_a_recipe_with_a_job_flag_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "evaluate", "--recipe", "mixtral-8x7b-megatron", "--gpus", "8")
    assert err.startswith("planner: --gpus: --recipe=mixtral-8x7b-megatron sets the model")
    assert "recipe='nope': unknown recipe name" in refused(capsys, "memory", "--recipe", "nope")


def test_a_malformed_model_config_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 4096}')
    assert "missing key" in refused(capsys, "memory", *changed(LLAMA, "--model", str(bad)))


def test_a_layout_file_that_cannot_be_used_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import planner

    def layout_error(content: str | None) -> str:
        path = tmp_path / "layout.json"
        path.unlink(missing_ok=True)
        if content is not None:
            path.write_text(content)
        return refused(capsys, "evaluate", *LLAMA, "--layout", str(path))

    where = f"planner: --layout='{tmp_path / 'layout.json'}'"
    assert layout_error(None) == f"{where}: cannot read (No such file or directory)\n"
    assert layout_error("{not json").startswith(f"{where}: not JSON")
    assert layout_error("[1, 2]") == f"{where}: expected a JSON object (a layout or a plan)\n"
    infeasible = json.dumps({"status": "infeasible", "layout": None})
    assert layout_error(infeasible) == f"{where}: the plan is infeasible; it has no layout\n"
    sixteen = planner.Layout.uniform(planner.load_model("llama3-8b"), dp=16)
    err = layout_error(sixteen.model_dump_json())
    assert err == f"{where}: its tp*cp*pp*dp=16 must equal --gpus=8\n"


def test_plot_paths_are_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    gif = "planner: --plot='x.gif': the suffix must be .png, .svg or .pdf\n"
    assert refused(capsys, "plan", *LLAMA, "--plot", "x.gif") == gif  # before the search
    missing = str(tmp_path / "missing" / "x")
    err = refused(capsys, "memory", *LLAMA, "--plot", missing)
    assert err.startswith(f"planner: --plot='{missing}-memory.svg': cannot write")


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--time-limit", "0", "planner: --time-limit=0: must be a positive number of seconds\n"),
        ("--time-limit", "-2", "planner: --time-limit=-2: must be a positive number of seconds\n"),
        (
            "--time-limit",
            "inf",
            "planner: --time-limit=inf: must be a positive number of seconds\n",
        ),
        (
            "--time-limit",
            "nan",
            "planner: --time-limit=nan: must be a positive number of seconds\n",
        ),
        ("--global-batch", "1000000000000", "every layout on 8 GPUs holds at least"),
        ("--tp", "0", "SearchSpace.tp=[0]: needs positive values"),
        ("--optimizer-offload", "2", "SearchSpace.optimizer_offload=[2.0]"),
        ("--model", "gpt-5", "model='gpt-5': unknown model name"),
        ("--gpus", "0", "gpus=0: must be a whole number of GPUs from 1 to 16,777,216"),
        ("--gpus", "100000000", "gpus=100000000: must be a whole number of GPUs from 1"),
        ("--cluster", "tpu", "unknown cluster name"),
        ("--target", "jax", "argument --target: invalid choice: 'jax'"),
    ],
)
def test_plan_bad_input_is_named_in_one_line(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    err = refused(capsys, "plan", *changed(LLAMA, flag, value))
    assert says(err, message)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--time-limit", "0", "planner: --time-limit=0: must be a positive number of seconds\n"),
        ("--workers", "0", "planner: --workers=0: must be a positive process count\n"),
        ("--plot", "x.gif", "planner: --plot='x.gif': the suffix must be .png, .svg or .pdf\n"),
    ],
)
def test_sweep_bad_input_is_refused_before_it_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, value: str, message: str
) -> None:
    db = tmp_path / "sweep.sqlite"
    args = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "4096", "--global-batch", "64"]
    assert refused(capsys, "sweep", *args, "--db", str(db), flag, value) == message
    assert not db.exists()


def test_export_of_a_file_that_is_not_a_plan_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "plan.json"
    err = refused(capsys, "export", "--plan", str(path), "--target", "megatron")
    assert err == f"planner: --plan='{path}': cannot read (No such file or directory)\n"
    path.write_text('{"layout": 3}')
    err = refused(capsys, "export", "--plan", str(path), "--target", "megatron")
    assert err.startswith(f"planner: --plan='{path}': not a plan JSON")
    err = refused(capsys, "export", "--plan", "-", "--target", "jax")
    assert "argument --target: invalid choice: 'jax'" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cluster", "h100"], "planner: --cluster: only with --runs or --sweep"),
        (["--runs", "runs.csv"], "planner: --runs: needs --cluster"),
        (["--runs", "runs.csv", "--cluster", "h100", "--rounds", "0"], "--rounds=0: must be"),
        (["--log", "a.log"], "planner: --log: needs --cluster"),
        (["--log", "a.log", "--runs", "r.csv"], "planner: --runs and --log: give one"),
        (["--log", "nowhere.log", "--cluster", "h100"], "log='nowhere.log': no such file"),
        (["--log", "a.log", "--cluster", "h100", "--plan-limit", "-1"], "--plan-limit=-1: must"),
    ],
)
def test_calibrate_flags_that_do_not_go_together_are_named(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert message in refused(capsys, "calibrate", *args)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "planner: --steps=0: needs at least 1 timed step\n"),
        (["--rounds", "0"], "planner: --rounds=0: needs at least 1 round\n"),
        (["--cap", "0"], "planner: --cap=0.0: must be a positive number of MiB\n"),
    ],
)
def test_validate_bad_counts_are_named_before_anything_runs(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    pytest.importorskip("torch")
    assert refused(capsys, "validate", *args) == message


def test_no_command_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert "required: command" in refused(capsys)
    assert "required: command" in refused(capsys, "--bogus")


def test_every_command_the_parser_offers_is_dispatched(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out
    offered = usage[usage.index("{") + 1 : usage.index("}")].split(",")
    assert sorted(offered) == sorted(COMMANDS)


# The installed command itself: the two ways bad input leaves it (a PlannerError that main
# returns as 2, and argparse's own error raised as SystemExit), and ``python -m planner.cli``.


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("--pp", "0"), "planner: --pp=0: must be a positive degree\n"),
        (("--gpus", "many"), "planner: argument --gpus: invalid int value: 'many'\n"),
    ],
)
def test_the_installed_command_refuses_bad_input_in_one_line(
    change: tuple[str, str], message: str
) -> None:
    out = run(*changed(DEMO, *change))
    assert out.returncode == 2
    assert out.stderr == message and out.stdout == ""


def test_the_package_runs_as_a_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "planner.cli", "models", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "deepseek-v3" in {m["name"] for m in json.loads(out.stdout)}


def test_output_files_that_cannot_be_written_are_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = str(tmp_path / "missing" / "t.json")
    err = refused(capsys, "simulate", *LLAMA, "--trace", missing)
    assert err == f"planner: --trace='{missing}': cannot write (no such directory " + (
        f"'{tmp_path / 'missing'}')\n"
    )
    db = tmp_path / "sweep.sqlite"
    sweep = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "4096", "--global-batch", "64"]
    err = refused(capsys, "sweep", *sweep, "--db", str(db), "--out", str(tmp_path))
    assert err == f"planner: --out='{tmp_path}': is a directory; give a file name\n"
    assert not db.exists()  # no case ran


@pytest.mark.parametrize(
    ("raised", "code", "line"),
    [
        (KeyboardInterrupt(), 130, "planner: interrupted\n"),
        (OSError(28, "No space left on device", "rows.csv"), 2, "planner: rows.csv: No space left"),
    ],
)
def test_interrupts_and_file_errors_are_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    raised: BaseException,
    code: int,
    line: str,
) -> None:
    import planner.cli as cli

    def command(args: object) -> None:
        raise raised

    monkeypatch.setitem(cli.COMMANDS, "plan", command)
    assert main(["plan", *LLAMA]) == code
    assert says(capsys.readouterr().err, line)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ep", "8"], "Layout.ep=8: llama3-8b has no routed experts"),
        (["--recompute", "mla_up_proj"], "recompute='mla_up_proj': llama3-8b has no mla_up_proj"),
        (["--recompute", "core_attn+moe_act"], "llama3-8b has no moe_act module"),
    ],
)
def test_settings_the_model_cannot_have_are_refused_by_name(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert says(refused(capsys, "evaluate", *LLAMA, *flags), message)


def test_layout_flags_beside_a_layout_file_or_recipe_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model = planner.load_model("llama3-8b")
    path = tmp_path / "layout.json"
    path.write_text(planner.Layout.uniform(model, dp=8).model_dump_json())
    err = refused(capsys, "evaluate", *LLAMA, "--layout", str(path), "--tp", "8")
    assert err == f"planner: --tp=8: --layout='{path}' states the whole layout; leave the " + (
        "layout flags out\n"
    )
    recipe = ["--recipe", "llama3-70b-megatron-bridge-64"]
    err = refused(capsys, "memory", *recipe, "--recompute", "full")
    assert err.startswith("planner: --recompute=full: --recipe=llama3-70b-megatron-bridge-64")


def test_a_stated_layout_that_does_not_fit_says_why_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    big = ["--model", "llama3-70b", "--cluster", "h100", "--gpus", "8"]
    big += ["--seq-len", "8192", "--global-batch", "8"]
    for command in ("memory", "evaluate"):
        assert main([command, *big]) == 3
        err = capsys.readouterr().err
        assert err.startswith("planner: the layout does not fit: its heaviest rank peaks ")
        assert err.count("\n") == 1
