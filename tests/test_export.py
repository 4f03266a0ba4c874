"""``planner.export``: launch configs that state the plan, checked against the targets' own
vocabularies and against layouts their publishers stated.

Sources of the expected values:
- Megatron-LM's flag names: its parser at commit d98e8a64 (2026-08-22), every action
  listed (``tests/data/megatron_flags.txt``); its layout grammar from
  ``PipelineParallelLayerLayout.parse_str_to_list`` (re-implemented below from its two
  regular expressions).
- DeepSeek-V3's layout ``Et*3|(tt|)*29,m|L`` with pp 16: Megatron-LM's
  docs/user-guide/features/pipeline_parallel_layout.md.
- Llama 3 405B: "the first model chunk on the first stage has only the embedding, and the
  last model chunk on the last stage has only output projection and loss calculation",
  126 layers, pp 16 (Llama 3 paper, arXiv 2407.21783, section 3.3.2 and Table 4).
- torchtitan's keys: ``JobConfig`` at tag v0.2.2 (commit 73a0e697); DeepSpeed's batch rule:
  ``deepspeed/runtime/config.py`` ``_batch_assertion``.
- The architecture flags' values: the published Hugging Face ``config.json`` files of the
  catalog (``models/<name>.json``, sources in ``models/index.yaml``), read here directly.
- torchtitan's flavors: ``torchtitan/models/llama3/__init__.py`` and
  ``torchtitan/models/deepseek_v3/__init__.py`` (with their ``model/args.py``) at v0.2.2.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import planner
from planner.layout import BlockPlacement, Layout, Stage
from planner.solve.result import Plan

DATA = Path(__file__).parent / "data"
MEGATRON_FLAGS = {
    line.strip()
    for line in (DATA / "megatron_flags.txt").read_text().splitlines()
    if line.startswith("--")
}

# torchtitan v0.2.2 JobConfig: the sections and keys an export may use.
TORCHTITAN_KEYS = {
    "model": {
        "name",
        "flavor",
        "hf_assets_path",
        "tokenizer_path",
        "converters",
        "print_after_conversion",
    },
    "training": {
        "dataset",
        "dataset_path",
        "local_batch_size",
        "global_batch_size",
        "seq_len",
        "max_norm",
        "steps",
        "enable_cpu_offload",
        "dtype",
        "mixed_precision_param",
        "mixed_precision_reduce",
        "gc_freq",
        "gc_debug",
    },
    "parallelism": {
        "data_parallel_replicate_degree",
        "data_parallel_shard_degree",
        "fsdp_reshard_after_forward",
        "tensor_parallel_degree",
        "disable_loss_parallel",
        "enable_async_tensor_parallel",
        "pipeline_parallel_degree",
        "module_fqns_per_model_part",
        "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers",
        "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule",
        "pipeline_parallel_schedule_csv",
        "pipeline_parallel_microbatch_size",
        "pipeline_parallel_expert_parallel_overlap",
        "context_parallel_degree",
        "context_parallel_load_balancer",
        "context_parallel_rotate_method",
        "expert_parallel_degree",
        "expert_tensor_parallel_degree",
        "expert_parallel_comm_backend",
    },
    "activation_checkpoint": {
        "mode",
        "selective_ac_option",
        "per_op_sac_force_recompute_mm_shapes_by_fqns",
        "early_stop",
        "memory_budget",
        "visualize_memory_budget_pareto",
        "preserve_rng_state",
        "determinism_check",
        "debug",
    },
    "compile": {"enable", "components", "backend"},
}
TORCHTITAN_SCHEDULES = {
    "1F1B",
    "Interleaved1F1B",
    "GPipe",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
}


def expand(layout: str) -> list[str]:
    """Megatron-LM's layout grammar: commas dropped, ``(...)*n`` then ``x*n`` unrolled,
    stages split on ``|``."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


def stages_of(letters: list[str], model: planner.ModelSpec) -> list[Stage]:
    """Stages from Megatron letter strings, layers numbered in order."""
    out, layer, mtp = [], 0, 0
    for stage in letters:
        blocks = []
        for ch in stage:
            if ch == "E":
                blocks.append("embedding")
            elif ch == "L":
                blocks.append("head")
            elif ch == "m":
                blocks.append(f"mtp.{mtp}")
                mtp += 1
            else:
                blocks.append(f"layer.{layer}")
                layer += 1
        out.append(Stage(blocks=[BlockPlacement(block=b, recompute="none") for b in blocks]))
    assert layer == model.num_layers and mtp == model.num_mtp_layers
    return out


def plan_of(
    model: planner.ModelSpec,
    cluster: planner.ClusterSpec,
    job: planner.TrainingJob,
    layout: Layout,
) -> Plan:
    est = planner.evaluate(model, cluster, job, layout)
    return Plan(
        status="feasible",
        layout=layout,
        estimate=est,
        solve_time_s=0.0,
        model=model,
        cluster=cluster,
        job=job,
    )


DEEPSEEK = planner.load_model("deepseek-v3")
H800 = planner.load_cluster("h800", gpus=2048)
DS_JOB = planner.TrainingJob(seq_len=4096, global_batch=15360, moment_dtype="bf16")
LLAMA405 = planner.load_model("llama3-405b")
H100_16K = planner.load_cluster("h100", gpus=16384)
LLAMA_JOB = planner.TrainingJob(seq_len=8192, global_batch=2048)


def test_deepseek_v3_megatron_layout_is_the_published_one() -> None:
    published = "Et*3|(tt|)*29,m|L"  # Megatron-LM docs, pp 16 x vpp 2
    layout = Layout(
        pp=16,
        dp=64,
        ep=64,
        schedule="interleaved",
        virtual_stages=2,
        stages=stages_of(expand(published), DEEPSEEK),
    )  # 1,024 GPUs: 240 micro-batches, a multiple of pp as interleaving needs
    cluster = H800.model_copy(update={"num_gpus": 1024})
    out = planner.export.megatron(plan_of(DEEPSEEK, cluster, DS_JOB, layout))
    args = out.args
    stated = args[args.index("--pipeline-model-parallel-layout") + 1]
    assert expand(stated) == expand(published)
    assert stated == published  # folded the way the documentation writes it
    assert args[args.index("--pipeline-model-parallel-size") + 1] == "16"
    assert args[args.index("--expert-model-parallel-size") + 1] == "64"
    assert out.exact and out.exported_step_s == out.planned_step_s


def test_llama3_405b_megatron_layout_is_the_papers() -> None:
    # Embedding alone in the first chunk, output and loss alone in the last: 128 chunks of
    # one block each over pp 16 (8 per rank).
    letters = ["E"] + ["t"] * 126 + ["L"]
    layout = Layout(
        tp=8,
        pp=16,
        dp=128,
        schedule="interleaved",
        virtual_stages=8,
        stages=stages_of(letters, LLAMA405),
    )
    out = planner.export.megatron(plan_of(LLAMA405, H100_16K, LLAMA_JOB, layout))
    stated = out.args[out.args.index("--pipeline-model-parallel-layout") + 1]
    assert expand(stated) == letters
    assert "--sequence-parallel" in out.args
    assert out.args[out.args.index("--tensor-model-parallel-size") + 1] == "8"


@pytest.mark.parametrize(
    ("schedule", "recompute", "zero"),
    [
        ("1f1b", "full", 1),
        ("interleaved", "selective", 0),
        ("dualpipev", "layernorm+mla_up_proj", 2),
        ("dualpipe", "none", 3),
        ("zb-h1", "mlp", 1),
    ],
)
def test_every_megatron_flag_exists_in_its_parser(schedule: str, recompute: str, zero: int) -> None:
    v = {"interleaved": 2, "dualpipev": 2}.get(schedule)
    layout = Layout.uniform(
        DEEPSEEK,
        pp=8,
        dp=128,  # on 1,024 GPUs: 120 micro-batches, which every schedule here accepts
        ep=64,
        zero=zero,
        schedule=schedule,
        virtual_stages=v,
        recompute=recompute,
    )
    job = DS_JOB.model_copy(update={"compute_dtype": "fp8", "ema": "fp32"})
    cluster = H800.model_copy(update={"num_gpus": 1024})
    out = planner.export.megatron(plan_of(DEEPSEEK, cluster, job, layout))
    flags = [a for a in out.args if a.startswith("--")]
    unknown = [f for f in flags if f not in MEGATRON_FLAGS]
    assert not unknown, unknown
    assert len(flags) == len(set(flags))  # no flag twice


def test_megatron_recompute_and_zero_flags() -> None:
    model, cluster = planner.load_model("llama3-8b"), planner.load_cluster("h100", gpus=64)
    job = planner.TrainingJob(seq_len=4096, global_batch=256)

    def export(**kw: object) -> planner.export.Export:
        layout = Layout.uniform(model, pp=4, dp=16, **kw)  # type: ignore[arg-type]
        return planner.export.megatron(plan_of(model, cluster, job, layout))

    def after(args: list[str], flag: str) -> list[str]:
        i = args.index(flag)
        return args[i + 1 : next(j for j in range(i + 1, len(args)) if args[j][:2] == "--")]

    full = export(recompute="full", zero=1)
    assert after(full.args, "--recompute-granularity") == ["full"]
    assert after(full.args, "--recompute-method") == ["uniform"]
    assert "--use-distributed-optimizer" in full.args and full.exact
    modules = export(recompute="layernorm+mlp", zero=3)
    assert after(modules.args, "--recompute-modules") == ["layernorm", "mlp"]
    assert after(modules.args, "--data-parallel-sharding-strategy") == ["optim_grads_params"]
    assert "--recompute-granularity" not in export(recompute="none").args
    # Full recompute of the first layer of every stage is Megatron's block method.
    per_block = {f"layer.{i}": "full" for i in range(0, 32, 8)}
    block = export(recompute=per_block)
    assert after(block.args, "--recompute-method") == ["block"]
    assert after(block.args, "--recompute-num-layers") == ["1"] and block.exact
    # A mix Megatron cannot state: one choice for all, and what that costs.
    mixed = export(recompute={"layer.0": "full", "layer.1": "core_attn", "layer.9": "mlp"})
    assert not mixed.exact and "recompute" in mixed.differences[0]
    layers = [b for s in mixed.layout.stages for b in s.blocks if b.block.startswith("layer.")]
    assert {b.recompute for b in layers} == {"full"}
    assert mixed.exported_step_s == pytest.approx(
        planner.evaluate(model, cluster, job, mixed.layout).step_time_s
    )
    assert mixed.exported_step_s > mixed.planned_step_s


def test_dualpipe_is_reported_with_its_cost() -> None:
    layout = Layout.uniform(DEEPSEEK, pp=16, dp=128, ep=64, schedule="dualpipe", recompute="full")
    out = planner.export.megatron(plan_of(DEEPSEEK, H800, DS_JOB, layout))
    assert any("dualpipe" in d for d in out.differences)
    assert out.layout.schedule == "1f1b"
    assert out.exported_step_s == pytest.approx(
        planner.evaluate(DEEPSEEK, H800, DS_JOB, out.layout).step_time_s
    )
    assert "differences" in out.summary() or "difference" in out.summary()


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "dualpipev", "zb-h1"])
def test_torchtitan_toml_uses_its_keys_and_states_the_stages(schedule: str) -> None:
    v = {"interleaved": 2, "dualpipev": 2}.get(schedule)
    layout = Layout.from_counts(
        LLAMA405,
        counts=[7] + [8] * 14 + [7] if v is None else [3] + [4] * 30 + [3],
        tp=8,
        pp=16,
        dp=64,  # 8,192 GPUs: 32 micro-batches, enough for every schedule here
        zero=3,
        schedule=schedule,  # type: ignore[arg-type]
        virtual_stages=v,
        recompute="full",
    )
    cluster = H100_16K.model_copy(update={"num_gpus": 8192})
    # Planned for torchtitan (what it overlaps), so the export can state the plan exactly.
    # A compiled loss (costed as such) turns torchtitan's compile on, the loss with it.
    compiled = schedule == "1f1b"
    job = LLAMA_JOB.model_copy(update={"framework": "torchtitan", "compiled_loss": compiled})
    out = planner.export.torchtitan(plan_of(LLAMA405, cluster, job, layout))
    config = tomllib.loads(out.files["torchtitan.toml"])
    assert ("loss" in config.get("compile", {}).get("components", [])) == compiled
    for section, table in config.items():
        assert set(table) <= TORCHTITAN_KEYS[section], (section, set(table))
    par = config["parallelism"]
    assert par["pipeline_parallel_schedule"] in TORCHTITAN_SCHEDULES
    dims = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
    assert dims * par["tensor_parallel_degree"] * par["pipeline_parallel_degree"] == 8192
    parts = par["module_fqns_per_model_part"]
    assert len(parts) == len(layout.stages)
    names = [n for part in parts for n in part]
    assert names == ["tok_embeddings", *(f"layers.{i}" for i in range(126)), "norm", "output"]
    micro = config["training"]["local_batch_size"] // par["pipeline_parallel_microbatch_size"]
    assert micro == 2048 // 64  # micro-batches per step
    assert config["model"] == {"name": "llama3", "flavor": "405B"}
    assert out.exact == (schedule != "zb-h1")


def test_deepspeed_config_keeps_its_batch_rule_and_zero_limits() -> None:
    layout = Layout.uniform(LLAMA405, tp=8, pp=16, dp=128, zero=3, recompute="full")
    out = planner.export.deepspeed(plan_of(LLAMA405, H100_16K, LLAMA_JOB, layout))
    config = json.loads(out.files["ds_config.json"])
    micro, steps = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    assert config["train_batch_size"] == micro * steps * 128 == 2048
    assert config["zero_optimization"]["stage"] == 1  # ZeRO-3 with pp: DeepSpeed refuses
    assert any("ZeRO-3" in d for d in out.differences)
    assert config["tensor_parallel"] == {"autotp_size": 8}
    assert "--num_nodes 2048 --num_gpus 8" in out.files["launch.sh"]


def test_deepspeed_autotp_runs_zero_2_at_most() -> None:
    """AutoTP asserts ZeRO stage <= 2 (deepspeed/runtime/engine.py,
    _configure_tensor_parallel_states): a ZeRO-3 plan with tp > 1 exports ZeRO-2 and says so,
    and a search for DeepSpeed never returns one."""
    model = planner.load_model("llama3-8b").model_copy(update={"num_layers": 4})
    cluster = planner.load_cluster("h100", gpus=16)
    job = planner.TrainingJob(seq_len=2048, global_batch=64, framework="deepspeed")
    layout = Layout.uniform(model, tp=2, dp=8, zero=3, sequence_parallel=False)
    out = planner.export.deepspeed(plan_of(model, cluster, job, layout))
    assert json.loads(out.files["ds_config.json"])["zero_optimization"]["stage"] == 2
    assert any(d.startswith("ZeRO-3 with tensor parallelism") for d in out.differences)
    space = planner.SearchSpace(framework="deepspeed", tp=[2], zero=[3])
    result = planner.plan(model, cluster, job, space, time_limit_s=5)
    assert result.status == "infeasible" and result.layout is None
    assert any("ZeRO stage" in fix for fix in result.explanation.fixes)  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["megatron", "torchtitan", "deepspeed"])
def test_a_plan_searched_for_a_target_exports_exactly(target: str) -> None:
    model = planner.load_model("llama3-8b").model_copy(update={"num_layers": 8})
    cluster = planner.load_cluster("h100", gpus=16)
    job = planner.TrainingJob(seq_len=2048, global_batch=64)
    space = planner.SearchSpace(pp=[2], target=target)  # type: ignore[arg-type]
    result = planner.plan(model, cluster, job, space, time_limit_s=10)
    out = getattr(planner.export, target)(result)
    # The layout is stated exactly everywhere; an 8-layer Llama 3 8B is no torchtitan
    # flavor, so there the model is the one difference.
    assert out.layout == result.layout
    model_differences = [d for d in out.differences if d.startswith("model")]
    assert out.differences == model_differences, out.differences
    assert len(model_differences) == (target == "torchtitan")
    assert out.exported_step_s == pytest.approx(result.estimate.step_time_s)  # type: ignore[union-attr]


@pytest.mark.slow
def test_cli_exports_a_saved_plan(tmp_path: Path) -> None:
    planner_cli = str(Path(sys.executable).parent / "planner")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([planner_cli, *args], capture_output=True, text=True, timeout=300)

    job = ["--seq-len", "2048", "--global-batch", "64", "--time-limit", "5"]
    planned = run(
        "plan", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "16", *job, "--json"
    )
    assert planned.returncode == 0, planned.stderr
    saved = tmp_path / "plan.json"
    saved.write_text(planned.stdout)
    out = run("export", "--plan", str(saved), "--target", "torchtitan", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert tomllib.loads((tmp_path / "torchtitan.toml").read_text())["training"]["seq_len"] == 2048
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    refused = run("export", "--plan", str(bad), "--target", "megatron")
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "--plan" in refused.stderr


def test_torchtitan_loads_the_toml_with_its_own_loader(tmp_path: Path) -> None:
    """Runs where torchtitan 0.2.2 (the last release that reads TOML) is installed."""
    manager = pytest.importorskip("torchtitan.config").ConfigManager
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    layout = Layout.uniform(LLAMA405, tp=8, pp=16, dp=128, schedule="interleaved", virtual_stages=4)
    out = planner.export.torchtitan(plan_of(LLAMA405, H100_16K, LLAMA_JOB, layout))
    path = tmp_path / "job.toml"
    path.write_text(out.files["torchtitan.toml"])
    config = manager().parse_args(["--job.config_file", str(path)])
    assert config.parallelism.pipeline_parallel_degree == 16
    assert len(config.parallelism.module_fqns_per_model_part) == 64
    schedules.get_schedule_class(config.parallelism.pipeline_parallel_schedule)


# Megatron-LM flag -> the published config.json key (models/<name>.json) whose value it carries;
# a tuple is a nested key. Flag semantics: megatron/training/arguments.py at d98e8a64.
COMMON_KEYS: dict[str, str | tuple[str, str]] = {
    "--num-layers": "num_hidden_layers",
    "--hidden-size": "hidden_size",
    "--num-attention-heads": "num_attention_heads",
    "--ffn-hidden-size": "intermediate_size",  # the dense MLP (DeepSeek's first 3 layers)
    "--padded-vocab-size": "vocab_size",
    "--rotary-base": "rope_theta",
    "--norm-epsilon": "rms_norm_eps",
}
MODEL_KEYS: dict[str, dict[str, str | tuple[str, str]]] = {
    "llama3-70b": {
        "--num-query-groups": "num_key_value_heads",
        "--rope-scaling-factor": ("rope_scaling", "factor"),
    },
    "mixtral-8x7b": {
        "--num-query-groups": "num_key_value_heads",
        "--num-experts": "num_local_experts",
        "--moe-router-topk": "num_experts_per_tok",
        "--moe-ffn-hidden-size": "intermediate_size",
    },
    "deepseek-v3": {
        "--q-lora-rank": "q_lora_rank",
        "--kv-lora-rank": "kv_lora_rank",
        "--qk-head-dim": "qk_nope_head_dim",
        "--qk-pos-emb-head-dim": "qk_rope_head_dim",
        "--v-head-dim": "v_head_dim",
        "--rotary-scaling-factor": ("rope_scaling", "factor"),
        "--mscale": ("rope_scaling", "mscale"),
        "--mscale-all-dim": ("rope_scaling", "mscale_all_dim"),
        "--num-experts": "n_routed_experts",
        "--moe-router-topk": "num_experts_per_tok",
        "--moe-ffn-hidden-size": "moe_intermediate_size",
        "--moe-router-score-function": "scoring_func",
        "--moe-router-topk-scaling-factor": "routed_scaling_factor",
        "--moe-router-num-groups": "n_group",
        "--moe-router-group-topk": "topk_group",
        "--mtp-num-layers": "num_nextn_predict_layers",
    },
}
# Switches each model needs (their configs: SiLU-gated MLP, RMSNorm, RoPE, no biases, untied
# head; DeepSeek-V3's latent norms and noaux_tc expert bias) and must not get (Megatron-LM's
# pre-softmax routing leaves the top-k weights unnormalised; both MoE configs renormalise).
SWITCHES = {
    "llama3-70b": {"--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                   "--group-query-attention", "--use-rope-scaling"},
    "mixtral-8x7b": {"--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                     "--group-query-attention"},
    "deepseek-v3": {"--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                    "--multi-latent-attention", "--qk-layernorm",
                    "--moe-router-enable-expert-bias"},
}  # fmt: skip
ABSENT = {"--add-qkv-bias", "--moe-router-pre-softmax", "--moe-shared-expert-gate"}


def _after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _megatron_of(name: str) -> planner.export.Export:
    model = planner.load_model(name)
    if name == "deepseek-v3":
        layout = Layout.uniform(model, pp=16, dp=128, ep=64)
        return planner.export.megatron(plan_of(model, H800, DS_JOB, layout))
    cluster = planner.load_cluster("h100", gpus=256)
    layout = Layout.uniform(model, tp=8, pp=4, dp=8, ep=8 if model.num_experts else 1)
    return planner.export.megatron(plan_of(model, cluster, LLAMA_JOB, layout))


@pytest.mark.parametrize("name", ["llama3-70b", "mixtral-8x7b", "deepseek-v3"])
def test_megatron_builds_the_published_model(name: str) -> None:
    config = json.loads((Path(planner.catalog.MODELS_DIR) / f"{name}.json").read_text())
    out = _megatron_of(name)
    args = out.args
    flags = [a for a in args if a.startswith("--")]
    assert set(flags) <= MEGATRON_FLAGS and len(flags) == len(set(flags))
    for flag, key in {**COMMON_KEYS, **MODEL_KEYS[name]}.items():
        value = config[key[0]][key[1]] if isinstance(key, tuple) else config[key]
        stated = _after(args, flag)
        assert stated == value if isinstance(value, str) else float(stated) == value, flag
    assert SWITCHES[name] <= set(flags) and not ABSENT & set(flags)
    assert _after(args, "--normalization") == "RMSNorm"
    assert _after(args, "--position-embedding-type") == "rope"
    assert _after(args, "--attention-dropout") == _after(args, "--hidden-dropout") == "0.0"
    if name != "deepseek-v3":  # head_dim = hidden / heads in both configs
        heads = config["num_attention_heads"]
        assert int(_after(args, "--kv-channels")) == config["hidden_size"] // heads
    else:
        width = config["n_shared_experts"] * config["moe_intermediate_size"]
        assert int(_after(args, "--moe-shared-expert-intermediate-size")) == width
        dense = config["first_k_dense_replace"]
        runs = re.findall(r"\[([01])\]\*(\d+)", _after(args, "--moe-layer-freq"))
        pattern = [int(f) for f, n in runs for _ in range(int(n))]
        assert pattern == [0] * dense + [1] * (config["num_hidden_layers"] - dense)
        assert _after(args, "--rope-type") == "yarn"
    if name == "mixtral-8x7b":
        assert _after(args, "--moe-router-score-function") == "softmax"
    assert out.exact, out.differences


def test_a_model_megatron_cannot_state_is_not_exact() -> None:
    # DeepSeek-V2 scores an expert group by its best expert (topk_method group_limited_greedy);
    # Megatron-LM sums the best top-k / group-top-k = 6 / 3 = 2 of each group.
    v2 = planner.load_model("deepseek-v2")
    layout = Layout.uniform(v2, pp=4, dp=32, ep=32)
    cluster = planner.load_cluster("h800", gpus=128)
    out = planner.export.megatron(plan_of(v2, cluster, DS_JOB, layout))
    assert not out.exact and "group score" in " ".join(out.differences)
    assert "exactly" not in out.summary()
    # Biases on q/k/v and the attention output but not the MLP (Llama's attention_bias):
    # Megatron-LM biases every linear layer or q/k/v alone.
    llama = planner.load_model("llama3-8b").model_copy(
        update={"qkv_bias": True, "o_proj_bias": True, "norm_eps": None}
    )
    cluster, job = (
        planner.load_cluster("h100", gpus=64),
        planner.TrainingJob(seq_len=4096, global_batch=256),
    )
    out = planner.export.megatron(plan_of(llama, cluster, job, Layout.uniform(llama, pp=4, dp=16)))
    said = " ".join(out.differences)
    assert not out.exact and "biases" in said and "epsilon" in said


def test_torchtitan_names_a_flavor_only_where_it_builds_the_model() -> None:
    # torchtitan v0.2.2 llama3_args "70B": dim 8192, 80 layers, 64 heads, 8 kv heads,
    # ffn_dim_multiplier 1.3, multiple_of 4096 (FFN 28672), rope_theta 500000, and the
    # defaults (vocabulary 128256, norm_eps 1e-5, Llama 3.1 scaling): Llama 3.1 70B's config.
    llama = planner.load_model("llama3-70b")
    cluster = planner.load_cluster("h100", gpus=256)
    job = LLAMA_JOB.model_copy(update={"framework": "torchtitan"})
    layout = Layout.uniform(llama, tp=8, pp=4, dp=8, zero=3, recompute="full")
    out = planner.export.torchtitan(plan_of(llama, cluster, job, layout))
    assert tomllib.loads(out.files["torchtitan.toml"])["model"] == {
        "name": "llama3",
        "flavor": "70B",
    }
    assert out.exact, out.differences
    # deepseekv3_args "671B" keeps DeepSeekV3ModelArgs.norm_eps 1e-5; the config says 1e-6,
    # and torchtitan's model has no MTP module.
    layout = Layout.uniform(DEEPSEEK, pp=16, dp=128, ep=64, zero=3, recompute="full")
    ds_job = DS_JOB.model_copy(update={"framework": "torchtitan"})
    out = planner.export.torchtitan(plan_of(DEEPSEEK, H800, ds_job, layout))
    assert tomllib.loads(out.files["torchtitan.toml"])["model"]["flavor"] == "671B"
    said = " ".join(d for d in out.differences if d.startswith("model"))
    assert "norm_eps" in said and "num_mtp_layers" in said and not out.exact


def test_deepspeed_says_which_model_the_user_brings() -> None:
    model = planner.load_model("mixtral-8x7b")
    cluster = planner.load_cluster("h100", gpus=64)
    job = planner.TrainingJob(seq_len=4096, global_batch=256, framework="deepspeed")
    layout = Layout.uniform(
        model, tp=8, dp=8, ep=8, zero=1, recompute="full", sequence_parallel=False
    )
    out = planner.export.deepspeed(plan_of(model, cluster, job, layout))
    assert out.exact, out.differences  # the layout: DeepSpeed builds no model
    note = " ".join(out.notes)
    assert "train.py" in note and "8 experts" in note and "32 layers" in note
    assert note in out.summary() and "Build" in out.files["pipeline.py"]


def test_flash_attention_2_is_exported_as_megatrons_flash_backend() -> None:
    model = planner.load_model("llama3-8b")
    cluster = planner.load_cluster("h100", gpus=8)
    job = planner.TrainingJob(seq_len=4096, global_batch=8, framework="megatron")
    layout = planner.Layout.uniform(model, tp=1, dp=8)

    def args(j: planner.TrainingJob) -> list[str]:
        return planner.export.megatron(plan_of(model, cluster, j, layout)).args

    fa2 = args(job.model_copy(update={"attention_kernel": "fa2"}))
    assert fa2[fa2.index("--attention-backend") + 1] == "flash"
    assert "--attention-backend" not in args(job)  # auto: Transformer Engine's cuDNN attention


def test_the_fused_cross_entropy_is_exported_as_megatron_runs_it() -> None:
    """native: --cross-entropy-loss-fusion with --cross-entropy-fusion-impl native; te, which
    pretrain_gpt.py refuses (megatron/training/arguments.py at d98e8a64), is a difference."""
    model = planner.load_model("llama3-8b")
    cluster = planner.load_cluster("h100", gpus=8)
    layout = planner.Layout.uniform(model, tp=1, dp=8)

    def export(fusion: str) -> planner.export.Export:
        job = planner.TrainingJob(seq_len=4096, global_batch=8, loss_fusion=fusion)
        return planner.export.megatron(plan_of(model, cluster, job, layout))

    native, te, none = export("native"), export("te"), export("none")
    assert native.exact and "--cross-entropy-loss-fusion" in native.args
    assert native.args[native.args.index("--cross-entropy-fusion-impl") + 1] == "native"
    assert not te.exact and "cross-entropy fusion te" in " ".join(te.differences)
    assert "--cross-entropy-loss-fusion" not in none.args


def test_torchtitan_compiles_the_model_where_it_was_costed_compiled() -> None:
    """A torchtitan plan costed with its layers compiled (TrainingJob.compiled_model) turns
    compile on for the model; one costed uncompiled, with no compiled loss or async tensor
    parallelism, leaves torchtitan's default (compile off) as costed: eager ops."""
    model = planner.load_model("llama3-8b")
    cluster = planner.load_cluster("h100", gpus=8)
    layout = Layout.uniform(model, dp=8, zero=3, recompute="full")
    base = planner.TrainingJob(seq_len=8192, global_batch=16, framework="torchtitan")
    for compiled in (True, False):
        job = base.model_copy(update={"compiled_model": compiled})
        out = planner.export.torchtitan(plan_of(model, cluster, job, layout))
        config = tomllib.loads(out.files["torchtitan.toml"])
        assert config.get("compile") == (
            {"enable": True, "components": ["model"]} if compiled else None
        )


def test_torchtitan_names_the_older_eager_norm_it_cannot_state() -> None:
    """A plan costed with torchtitan's own eager RMSNorm (TrainingJob.eager_norm) exports as
    not exact: v0.2.2 builds nn.RMSNorm. Compiled, the norm was costed fused either way, and
    the export says nothing of it."""
    model = planner.load_model("llama3-8b")
    cluster = planner.load_cluster("h100", gpus=8)
    layout = Layout.uniform(model, dp=8, zero=3, recompute="full")
    job = planner.TrainingJob(
        seq_len=8192, global_batch=16, framework="torchtitan", eager_norm=True
    )
    out = planner.export.torchtitan(plan_of(model, cluster, job, layout))
    assert not out.exact and any("eager RMSNorm" in d for d in out.differences)
    compiled = job.model_copy(update={"compiled_model": True})
    out = planner.export.torchtitan(plan_of(model, cluster, compiled, layout))
    assert not any("RMSNorm" in d for d in out.differences)
