"""The harvest of Megatron-LM's functional-test step times (benchmarks/harvest_megatron_ci.py)
reads a case's config and golden values as Megatron-LM ran them, its committed CSV is read by
the planner, and the GPT spec's MoE keys count the parameters an MoE model has."""

from __future__ import annotations

import csv
import functools
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import planner
from planner.fit import gpt_model, layout_from_row

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@functools.cache
def harvest() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "harvest_megatron_ci", BENCH / "harvest_megatron_ci.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


DENSE = """
ENV_VARS:
  NCCL_ALGO: Ring
  N_REPEATS: 5
MODEL_ARGS:
  --num-layers: 12
  --hidden-size: 512
  --num-attention-heads: 8
  --swiglu: true
  --micro-batch-size: 4
  --global-batch-size: 32
  --seq-length: 1024
  --max-position-embeddings: 1024
  --tensor-model-parallel-size: 2
  --pipeline-model-parallel-size: 2
  --num-layers-per-virtual-pipeline-stage: 2
  --sequence-parallel: true
  --use-distributed-optimizer: true
  --log-params-norm: true
  --deterministic-mode: true
  --vocab-file: ${DATA_PATH}/vocab.json
  --lr: 0.00015
  --bf16: true
TEST_TYPE: regular
"""

MOE = """
MODEL_ARGS:
  --num-layers: 4
  --hidden-size: 256
  --num-attention-heads: 4
  --group-query-attention: true
  --num-query-groups: 2
  --disable-bias-linear: true
  --untie-embeddings-and-output-weights: true
  --normalization: RMSNorm
  --position-embedding-type: rope
  --hidden-dropout: 0.0
  --attention-dropout: 0.0
  --micro-batch-size: 1
  --global-batch-size: 16
  --seq-length: 2048
  --max-position-embeddings: 2048
  --expert-model-parallel-size: 4
  --num-experts: 8
  --moe-router-topk: 2
  --moe-ffn-hidden-size: 128
  --moe-shared-expert-intermediate-size: 256
  --moe-layer-freq: ([0]*1+[1]*3)
  --moe-token-dispatcher-type: alltoall
  --moe-grouped-gemm: true
  --recompute-granularity: selective
  --recompute-modules: "[moe_act layernorm]"
  --tokenizer-type: NullTokenizer
  --vocab-size: 1000
  --make-vocab-size-divisible-by: 64
  --fp8-format: hybrid
  --fp8-recipe: tensorwise
  --bf16: true
TEST_TYPE: ckpt-resume
"""

# Logged: 1, 3, 4, 5, 6, 7, 9 ('nan' at 2 and 8); the first three logged (1, 3, 4) are left out.
GOLDEN = json.dumps(
    {
        "iteration-time": {
            "start_step": 1,
            "end_step": 9,
            "step_interval": 1,
            "values": {
                "1": 5.0,
                "2": "nan",
                "3": 0.9,
                "4": 0.5,
                "5": 0.2,
                "6": 0.21,
                "7": 0.25,
                "8": "nan",
                "9": 0.22,
            },
        },
        "mem-allocated-bytes": {"values": {"1": 10.0, "4": 10.0, "5": 30.0, "9": 50.0}},
        "mem-max-allocated-bytes": {"values": {"1": 99.0, "5": 70.0, "6": 80.0, "9": 90.0}},
    }
)


def row(config: str, gpus: int = 8, name: str = "golden_values_dev_dgx_h100.json") -> Any:
    h = harvest()
    return h.build_row(
        "gpt",
        "case",
        h.read_config(config),
        h.golden_name(name),
        h.measure(GOLDEN),
        gpus,
        f"{gpus} GPUs",
        "https://example/golden.json",
    )


def test_median_leaves_out_the_first_three_logged_values() -> None:
    m = harvest().measure(GOLDEN)
    assert m.step_s == pytest.approx((0.21 + 0.22) / 2)  # median of 0.2, 0.21, 0.25, 0.22
    assert (m.iterations, m.first) == (4, 5)
    assert m.mem_allocated == 40.0  # median of 30 and 50 (iterations 5 and 9)
    assert m.mem_max_allocated == 80.0  # median of 70, 80 and 90


def test_dense_row_states_what_megatron_ran() -> None:
    r = row(DENSE)
    # GPT-2 BPE's 50257 tokens padded to a multiple of 128 x tp 2 = 256: 197 x 256
    # SwiGLU's default width: int(4 x 512 x 2/3 / 64) x 64 = 21 x 64
    assert (
        r["model"] == "gpt:hidden=512;layers=12;heads=8;vocab=50432;ffn=1344;swiglu=1;dropout=0.1"
    )
    assert (r["tp"], r["pp"], r["cp"], r["dp"]) == ("2", "2", "1", "2")  # dp = 8 / (2 x 2)
    assert (r["vp"], r["schedule"]) == ("3", "interleaved")  # 12 layers / pp 2 / 2 per stage
    assert (r["micro_batch"], r["global_batch"], r["seq_len"]) == ("4", "32", "1024")
    assert (r["precision"], r["recompute"], r["zero"]) == ("bf16", "none", "1")
    assert (r["sequence_parallel"], r["tp_comm_overlap"], r["flash_attention"]) == (
        "true",
        "false",
        "true",
    )
    assert (r["ep"], r["dispatcher"]) == ("1", "")
    assert (r["metric"], float(r["value"]), r["iterations"]) == ("step_s", 0.215, "4")
    assert (r["gpu"], r["platform"], r["environment"]) == ("h100", "dgx_h100", "dev")
    assert r["id"] == "mcore-ci-dgx_h100-dev-gpt-case"
    flags = r["flags"].split(";")
    assert {"deterministic-mode", "log-params-norm", "NCCL_ALGO=Ring"} <= set(flags)
    assert "overlap-grad-reduce=off" in flags
    assert not any(f.startswith(("lr", "vocab-file", "N_REPEATS", "bf16")) for f in flags)
    assert "hidden-dropout 0.1" in r["notes"]  # Megatron-LM's default, said so
    assert list(r) == harvest().COLUMNS


def test_moe_row_states_the_experts() -> None:
    r = row(MOE)
    # NullTokenizer's 1000 tokens padded to a multiple of 64 x tp 1: 16 x 64
    assert r["model"] == (
        "gpt:hidden=256;layers=4;heads=4;vocab=1024;kv=2;rmsnorm=1;rope=1;bias=0;tied=0;"
        "experts=8;topk=2;moeffn=128;shared=256;dense=1"
    )
    assert (r["ep"], r["dp"], r["dispatcher"]) == ("4", "8", "alltoall")
    assert (r["precision"], r["recompute"], r["zero"]) == (
        "fp8",
        "selective(moe_act+layernorm)",
        "0",
    )
    assert {"moe-grouped-gemm", "fp8-recipe=tensorwise", "test-type=ckpt-resume"} <= set(
        r["flags"].split(";")
    )
    model = gpt_model(r["model"])
    assert [model.is_moe_layer(i) for i in range(4)] == [False, True, True, True]


def test_what_the_planner_cannot_state_is_skipped() -> None:
    h = harvest()
    # Megatron-LM's expert tensor parallelism defaults to tp; ep * etp must divide the plane
    tp2 = "--expert-model-parallel-size: 4\n  --tensor-model-parallel-size: 2"
    assert row(MOE.replace("--expert-model-parallel-size: 4", tp2))["etp"] == "2"
    ep8 = "--expert-model-parallel-size: 8\n  --tensor-model-parallel-size: 2"
    with pytest.raises(h.Skip, match="ep \\* etp does not divide"):  # 8 x 2 experts' ranks
        row(MOE.replace("--expert-model-parallel-size: 4", ep8))
    with pytest.raises(h.Skip, match="multi-latent"):
        row(MOE.replace("MODEL_ARGS:", "MODEL_ARGS:\n  --multi-latent-attention: true"))
    with pytest.raises(h.Skip, match="inference"):
        row(DENSE + "MODE: inference\n")
    with pytest.raises(h.Skip, match="no platform"):
        h.golden_name("golden_values_lts.json")
    second = h.golden_name("golden_values_lts_dgxa100_dracooci_2nd.json")
    assert (second.environment, second.platform, second.second) == ("lts", "dgxa100_dracooci", True)
    assert h.gpu_of(second.platform) == "a100"


def test_layer_patterns() -> None:
    from planner.logs.megatron import Unstated, layer_pattern

    assert layer_pattern(2, 8) == (0, 2)
    assert layer_pattern("([0]*3+[1]*11)", 14) == (3, 1)
    assert layer_pattern("[1,0]*2", 4) == (0, 2)
    with pytest.raises(Unstated):
        layer_pattern("([1]*2+[0]*2)", 4)
    assert harvest().Skip is Unstated  # the harvest counts what the mapping refuses


def test_gpu_count_from_the_recipes() -> None:
    h = harvest()
    recipe = """
spec: {model: gpt, nodes: 2, gpus: 4, platforms: dgx_gb200}
products:
  - test_case: [listed]
    products:
      - environment: [dev]
        platforms: [dgx_gb200]
"""
    entries = h.recipe_entries("gb200/gpt.yaml", recipe)
    defaults = {("gb200", "gpt"): 8, ("h100", "gpt"): 8}
    dev = h.golden_name("golden_values_dev_dgx_gb200.json")
    assert h.gpu_count(entries, defaults, "gpt", "listed", dev)[0] == 8  # 2 nodes x 4
    count, note = h.gpu_count(entries, defaults, "gpt", "unlisted", dev)
    assert count == 8 and "no recipe lists" in note
    with pytest.raises(h.Skip):
        h.gpu_count(entries, {}, "mixtral", "unlisted", dev)


def test_every_committed_row_is_read_by_the_planner() -> None:
    with (BENCH / "megatron_ci_runs.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) > 100 and list(rows[0]) == harvest().COLUMNS
    known = set(planner.cluster_names())
    for r in rows:
        if r["gpu"] not in known:  # gb200: no catalog entry
            continue
        fields = dict(r)
        stated = fields["recompute"]  # Megatron-LM's selective(a+b): the modules a+b
        if stated.startswith("selective("):
            fields["recompute"] = stated.removeprefix("selective(").removesuffix(")")
        _, job, layout = layout_from_row(fields, r["id"])
        assert layout.world_size == int(r["num_gpus"])
        assert job.tokens_per_step == int(r["global_batch"]) * int(r["seq_len"])


def test_moe_keys_count_the_parameters_by_hand() -> None:
    spec = (
        "gpt:hidden=8;layers=2;heads=2;vocab=16;swiglu=1;rmsnorm=1;rope=1;bias=0;tied=0;"
        "ffn=12;experts=4;topk=2;moeffn=6;shared=10;dense=1"
    )
    model = gpt_model(spec)
    h, vocab = 8, 16
    attention = h * 3 * h + h * h  # q, k, v (2 heads of 4) and the output projection
    norms = 2 * h  # RMSNorm weights before attention and MLP
    dense_mlp = h * 2 * 12 + 12 * h  # SwiGLU: gate and up, then down
    expert = h * 2 * 6 + 6 * h
    shared = h * 2 * 10 + 10 * h
    router = 4 * h
    layer0 = attention + norms + dense_mlp  # dense=1: the first layer is dense
    layer1 = attention + norms + router + 4 * expert + shared
    total = layer0 + layer1 + vocab * h + vocab * h + h  # untied embedding and head, final norm
    assert model.num_params() == total == 1944
    assert model.num_params(active=True) == total - 2 * expert  # 2 of the 4 experts active
    assert (model.num_experts, model.experts_per_token, model.moe_ffn_hidden_size) == (4, 2, 6)
    assert (model.num_shared_experts, model.shared_expert_ffn_hidden_size) == (1, 10)
    assert model.first_dense_layers == 1 and model.router_score == "softmax"
    with pytest.raises(planner.PlannerError, match="needs experts"):
        gpt_model("gpt:hidden=8;layers=2;heads=2;vocab=16;topk=2")
