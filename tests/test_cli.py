"""The ``planner`` command end to end: real processes, real exit codes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert "against 80.00 GiB HBM" in out.stdout


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
    assert len(data["estimate"]["memory"]) == 16


def test_catalog_listings() -> None:
    assert "deepseek-v3" in run("models").stdout.split()
    assert "h800" in run("clusters").stdout.split()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("--model", "gpt-5"), "unknown model name"),
        (("--cluster", "tpu"), "unknown cluster name"),
        (("--gpus", "0"), "must be a positive whole number"),
        (("--gpus", "2052"), "above one node it must be a whole number of nodes"),
        (("--ep", "48"), "ep=48 must divide dp*tp=128"),
        (("--recompute", "attn"), "unknown module 'attn'"),
        (("--gpus", "many"), "invalid int value"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(change: tuple[str, str], message: str) -> None:
    args = list(DEMO)
    args[args.index(change[0]) + 1] = change[1]
    out = run(*args)
    assert out.returncode == 2
    assert message in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_malformed_config_file(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 4096}')
    args = list(DEMO)
    args[args.index("--model") + 1] = str(bad)
    out = run(*args)
    assert out.returncode == 2
    assert "missing key" in out.stderr and out.stderr.count("\n") == 1
