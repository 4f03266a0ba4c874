"""The expected error every estimate quotes is what the validation corpus gives now.

``planner/accuracy.json`` is written by ``benchmarks/published_throughput.py --write``; this
test recosts every row of ``benchmarks/published_runs.csv`` and checks the stored figures
are today's, so a change to the time model cannot leave estimates quoting a stale error.
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import planner
from planner.errors import PlannerError
from planner.estimate import ACCURACY, MEMORY_ACCURACY, expected_error, memory_risk

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "published_throughput.py"


@functools.cache
def _bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("published_throughput", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_megatron_core_flop_count_term_by_term() -> None:
    """Megatron-Core's count (num_floating_point_operations), its terms worked by hand.

    Llama 3 8B at 8,192 tokens: a layer's q, k, v (4096 x (4096 + 2 x 1024)), the scores and
    values over half the sequence (4096 x 8192), o (4096^2): 75,497,472; its SwiGLU 4096 x 3
    x 14336 = 176,160,768; 32 layers and the head 4096 x 128,256: 8,578,400,256, six times.

    DeepSeek-V3 at 4,096 tokens: q 1536 x (7168 + 128 x 192 + 1) = 48,760,320; kv 512 x
    (7168 + 128 x 256 + 1) + 7168 x 64 = 20,906,496; o 128 x 128 x 7168 = 117,440,512; core
    4096 x 128 x (192 + 128) / 2 = 83,886,080; 62 layers (the MTP layer among them):
    16,801,591,296. MLP 7168 x 3 x (18432 x 3 + (2048 x 8 + 2048) x 59) = 24,574,427,136;
    MTP 3 x 7168 + 2 x 7168^2 = 102,781,952; logits 7168 x 129,280 x 2 = 1,853,358,080."""
    bench = _bench()
    llama = planner.load_model("llama3-8b")
    assert bench.megatron_core_flops_per_token(llama, 8192, tp=1) == 6 * 8_578_400_256
    v3 = planner.load_model("deepseek-v3")
    total = 16_801_591_296 + 24_574_427_136 + 102_781_952 + 1_853_358_080
    assert bench.megatron_core_flops_per_token(v3, 4096, tp=1) == 6 * total


@pytest.mark.slow
def test_stored_errors_are_todays() -> None:
    bench = _bench()
    with bench.DATA.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) >= 25
    errors: dict[str, list[float]] = defaultdict(list)
    signed: dict[str, list[float]] = defaultdict(list)
    ceilings: dict[str, list[tuple[int, float, str]]] = defaultdict(list)
    for row in rows:
        try:
            measured, predicted, costed = bench.cost(row)
        except PlannerError:
            continue
        e = predicted / measured - 1
        for key in ("all", row["gpu"], "moe" if costed.moe else "dense"):
            errors[key].append(abs(e))
            signed[key].append(e)
        ceilings[bench.ceiling_key(row)].append(
            (int(row["num_gpus"]), costed.measured_mfu, row["id"])
        )
    stored = json.loads(ACCURACY.read_text())
    assert stored == bench.summary(errors, signed, ceilings)


def test_estimates_quote_the_error_for_their_gpu() -> None:
    stored = json.loads(ACCURACY.read_text())
    gpu = next(iter(stored["by_gpu"]))
    text = expected_error(gpu)
    figures = stored["by_gpu"][gpu]
    assert f"{figures['mape']:.0%}" in text and f"{figures['rows']} published" in text
    assert "no published" in expected_error("not-a-gpu")
    model = planner.load_model("llama3-8b")
    cluster = planner.load_cluster(gpu, gpus=8)
    job = planner.TrainingJob(seq_len=4096, global_batch=8)
    est = planner.evaluate(model, cluster, job, planner.Layout.uniform(model, dp=8))
    assert est.expected_error == text


@pytest.mark.parametrize("metric", ["step_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu"])
def test_measured_figures_convert_to_seconds_per_step(metric: str) -> None:
    bench = _bench()
    model = planner.load_model("llama3-8b")
    row = {"id": "x", "num_gpus": "8", "global_batch": "16", "seq_len": "4096", "notes": ""}
    tokens = 16 * 4096
    flops = bench.source_flops_per_token(row, model, 4096) * tokens
    step = 2.0
    value = {
        "step_s": step,
        "tokens_per_s_per_gpu": tokens / step / 8,
        "tflops_per_gpu": flops / step / 8 / 1e12,
        "mfu": flops / step / 8 / 989.4e12,
    }[metric]
    row |= {"metric": metric, "value": str(value)}
    assert bench.measured_step(row, model, 989.4e12) == pytest.approx(step)


def test_unstated_recompute_is_the_fastest_choice_that_fits_and_skips_refused_ones() -> None:
    from types import SimpleNamespace

    bench = _bench()
    # (headroom, step seconds, peak bytes) per choice; "mlp" is refused by the layout
    made = {"none": (-1, 1.0, 9), "mlp": None, "layernorm": (0, 1.2, 7), "full": (0, 1.5, 5)}
    asked: list[str] = []

    def estimate(choice: str) -> Any:
        asked.append(choice)
        if made[choice] is None:
            raise PlannerError(f"recompute={choice!r}: refused")
        h, t, p = made[choice]
        return SimpleNamespace(headroom=h, step_time_s=t, peak_bytes=p)

    choice, _ = bench.fastest_fitting(
        ["none", "mlp", "layernorm", "layernorm+mlp", "full"], estimate
    )
    assert choice == "layernorm"
    assert "layernorm+mlp" not in asked  # holds a fitting choice's modules: only slower
    with pytest.raises(PlannerError, match="refused"):
        bench.fastest_fitting(["mlp"], estimate)


@functools.cache
def _memory_bench():  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "published_memory.py"
    spec = importlib.util.spec_from_file_location("published_memory", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stored_memory_errors_are_todays() -> None:
    bench = _memory_bench()
    signed: dict[str, list[float]] = defaultdict(list)
    for row, result in bench.costed(bench.read_rows()):
        if not isinstance(result, str):
            measured, predicted, _, _ = result
            signed[bench.framework_of(row)].append(predicted / measured - 1)
    assert sum(map(len, signed.values())) >= 25
    assert json.loads(MEMORY_ACCURACY.read_text()) == bench.accuracy_data(signed)


def test_memory_risk_counts_the_runs_under_predicted_beyond_the_headroom(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import planner.estimate as estimate

    errors = [-0.30, -0.08, -0.02, 0.01, 0.20]  # predicted / measured - 1
    monkeypatch.setattr(
        estimate, "_memory_accuracy", lambda: {"by_framework": {"torchtitan": {"errors": errors}}}
    )
    # a real peak is the predicted one over (1 + error): it passes usable HBM when the error
    # is below -headroom
    assert memory_risk("torchtitan", 0.10).startswith("on 1 of 5 published torchtitan runs")
    assert memory_risk("torchtitan", 0.05).startswith("on 2 of 5")
    assert memory_risk("torchtitan", 0.01).startswith("on 3 of 5")
    assert "largest shortfall 30.0%" in memory_risk("torchtitan", 0.1)
    # over usable HBM by 1%: it runs only if the model over-predicted it by 1% or more
    assert "runs out unless the model over-predicts it by more, as it did on 2 of 5" in (
        memory_risk("torchtitan", -0.01)
    )
    assert memory_risk("deepspeed", 0.1).startswith("no published DeepSpeed memory")


def test_estimates_state_their_memory_risk() -> None:
    model = planner.load_model("llama3-8b")
    cluster = planner.load_cluster("h100", gpus=8)
    job = planner.TrainingJob(seq_len=4096, global_batch=8, framework="megatron")
    est = planner.evaluate(model, cluster, job, planner.Layout.uniform(model, dp=8, zero=3))
    assert est.headroom > 0
    stored = json.loads(MEMORY_ACCURACY.read_text())["by_framework"]["megatron"]
    assert f"of {stored['rows']} published Megatron-LM runs" in est.memory_risk
    assert f"{est.headroom:.1%} of usable HBM" in est.memory_risk


def test_a_functional_test_row_is_read_as_megatron_logs_it() -> None:
    """Megatron-LM logs mem-max-allocated-bytes from the last global rank (its TensorBoard
    writer, global_vars.py), on the last pipeline stage; an A100 row run deterministically with
    the attention backend at auto does not state its attention; CUBLAS_WORKSPACE_CONFIG
    :4096:8 is 8 x 4096 KiB of cuBLAS workspace (PyTorch's CublasHandlePool.cpp)."""
    bench = _memory_bench()
    row = {
        "gpu": "h100",
        "flash_attention": "true",
        "mem_max_allocated_bytes": str(2**30),
        "flags": "deterministic-mode;NVTE_ALLOW_NONDETERMINISTIC_ALGO=0;"
        "CUBLAS_WORKSPACE_CONFIG=:4096:8;transformer-impl=local",
        "platform": "dgx_h100",
    }
    read = bench.harvested(row)
    assert (read["measured_gib"], read["kind"], read["pp_rank"]) == ("1.0", "allocated", "-1")
    assert "unstated" not in read
    assert bench.harvested({**row, "gpu": "a100"})["unstated"] == bench.AUTO_ATTENTION_SM80
    stated = {**row, "gpu": "a100", "flags": row["flags"] + ";attention-backend=flash"}
    assert "unstated" not in bench.harvested(stated)
    model = planner.load_model("llama3-8b")
    # no Transformer Engine under --transformer-impl local: PyTorch's 32 MiB alone, once for
    # each thread that runs GEMMs (the training loop's and autograd's)
    assert read["transformer_engine"] == "false"
    job = planner.TrainingJob(seq_len=1024, global_batch=8, transformer_engine=False)
    assert bench.workspaces(row, model, job) == 2 * 32 * 2**20
