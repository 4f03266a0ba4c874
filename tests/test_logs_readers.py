"""``planner.logs.torchtitan`` and ``planner.logs.deepspeed``: training logs as measured runs.

Each log here is built line by line in its framework's own format; the comment above each
builder names the source file and line that writes it. The expected figures are worked out
by hand from the numbers put in, not read back from the reader.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from planner.errors import PlannerError
from planner.logs import deepspeed, torchtitan

GIB = 2**30

# ================================ torchtitan ==================================================

# torchtitan/tools/utils.py Color (b5bcd76c:263-274): the step line is coloured
RED, GREEN, ORANGE = "\033[31m", "\033[32m", "\033[38;2;180;60;0m"
TURQUOISE, BLUE, CYAN = "\033[38;2;54;234;195m", "\033[34m", "\033[36m"
MAGENTA, RESET = "\033[35m", "\033[39m"


def titan(message: str, second: int = 0) -> str:
    """torchtitan/tools/logging.py:21 (v0.2.2): "[titan] %(asctime)s - %(name)s -
    %(levelname)s - %(message)s" (the root logger)."""
    return (
        f"[titan] 2025-03-01 10:{second // 60:02d}:{second % 60:02d},123 - root - INFO - {message}"
    )


def step_line(step: int, tps: float, gib: float, *, loss: float = 3.25) -> str:
    """components/metrics.py:461-470 (v0.2.2), the per-step line (capacity 79.11 GiB)."""
    return titan(
        f"{RED}step: {step:2}  "
        f"{GREEN}loss: {loss:8.5f}  "
        f"{ORANGE}grad_norm: {0.8123:7.4f}  "
        f"{TURQUOISE}memory: {gib:5.2f}GiB"
        f"({100 * gib / 79.11:.2f}%)  "
        f"{BLUE}tps: {round(tps):,}  "
        f"{CYAN}tflops: {412.37:,.2f}  "
        f"{MAGENTA}mfu: {41.70:.2f}%{RESET}",
        step,
    )


# models/llama3/model/args.py (v0.2.2) TransformerModelArgs for the 8B flavor
# (models/llama3/__init__.py llama3_args["8B"]), as dataclasses.asdict gives it, after
# update_from_config set max_seq_len to training.seq_len.
LLAMA3_8B_ARGS: dict[str, Any] = {
    "_enforced": "This field is used to enforce all fields have defaults.",
    "dim": 4096,
    "n_layers": 32,
    "n_heads": 32,
    "n_kv_heads": 8,
    "vocab_size": 128256,
    "multiple_of": 1024,
    "ffn_dim_multiplier": 1.3,
    "norm_eps": 1e-05,
    "rope_theta": 500000,
    "rope_scaling_args": {
        "scaling_factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_seq_len": 8192,
    "depth_init": True,
    "attn_type": "sdpa",
    "attn_mask_type": "causal",
    "eos_id": 0,
}


def titan_setup(*, model: bool = True, ac: str = "full") -> list[str]:
    """The lines torchtitan v0.2.2 logs before training (16 GPUs: dp_shard 4 x tp 4)."""
    lines = [
        titan("Starting job: Llama 3 8B training"),  # train.py:81
        # distributed/parallel_dims.py:130-134
        titan(
            "Building device mesh with parallelism: pp=1, dp_replicate=1, dp_shard=4, cp=1, "
            "tp=4, ep=1, etp=1"
        ),
    ]
    if model:
        # train.py:143-146: f"Building {name} {flavor}" f"with {json.dumps(asdict(args), indent=2)}"
        lines.append(titan("Building llama3 8B" + "with " + json.dumps(LLAMA3_8B_ARGS, indent=2)))
        # train.py:174-177
        lines.append(
            titan(f"{BLUE}Model llama3 8B {RED}size: 8,030,261,248 total parameters{RESET}")
        )
    lines += [
        titan("Applied Tensor Parallelism to the model"),  # llama3/infra/parallelize.py:250-253
        # distributed/activation_checkpoint.py:249
        titan(f"Applied {ac} activation checkpointing to the model"),
        titan("Applied FSDP to the model"),  # llama3/infra/parallelize.py:144
        titan("Peak FLOPS used for computing MFU: 9.890e+14"),  # train.py:266
        # train.py:354-362
        titan(
            "Trainer is initialized with local batch size 2, global batch size 16, gradient "
            "accumulation steps 2, sequence length 8192, total steps 1000 (warmup 200)"
        ),
    ]
    return lines


def text_of(lines: list[str]) -> str:
    """The log file: each logged record's lines (a JSON dump spans several), newline-ended."""
    out = [row for record in lines for row in record.split("\n")]
    return "".join(row + "\n" for row in out)


# tokens per step = global batch 16 x seq 8192 = 131072 over world size 16: step seconds
# = 8192 / tps. Step lines every 10 steps (metrics.log_freq 10, and step 1).
TITAN_STEPS = [  # (step, tps, reserved GiB)
    (1, 512, 40.00),  # warm-up: the start's first line
    (10, 3900, 60.12),  # warm-up: averages over steps 2-10
    (20, 4096, 61.50),  # 2.0 s
    (30, 4000, 61.02),  # 2.048 s
    (40, 3200, 60.00),  # 2.56 s
    (50, 4096, 60.50),  # 2.0 s
]
TITAN_MEDIAN = statistics.median([2.0, 2.048, 2.56, 2.0])  # 2.024 s


def titan_run() -> list[str]:
    """A v0.2.2 run from step 1 to 50, logging every 10 steps."""
    return [
        *titan_setup(),
        titan("Training starts at step 1"),  # train.py:655
        *(step_line(s, tps, gib) for s, tps, gib in TITAN_STEPS),
        titan("Training completed"),  # train.py:710
    ]


def test_torchtitan_normal_run() -> None:
    text = text_of(titan_run())
    assert torchtitan.recognises(text)
    assert not deepspeed.recognises(text)
    run = torchtitan.read(text, "titan.log")
    assert run.framework == "torchtitan" and run.job.framework == "torchtitan"
    assert (run.model.hidden_size, run.model.num_layers, run.model.num_kv_heads) == (4096, 32, 8)
    assert run.model.ffn_hidden_size == 14336  # 1024 * ceil(1.3 * int(8 * 4096 / 3) / 1024)
    assert run.model.num_params() == 8_030_261_248
    layout = run.layout
    assert (layout.tp, layout.pp, layout.dp, layout.cp, layout.ep) == (4, 1, 4, 1, 1)
    assert layout.zero == 3  # FSDP2 resharding after forward (no pipeline)
    assert layout.micro_batch == 2
    assert {
        b.recompute for s in layout.stages for b in s.blocks if b.block.startswith("layer.")
    } == {"full"}
    assert (run.job.global_batch, run.job.seq_len) == (16, 8192)
    assert run.job.compute_dtype == "bf16" and not run.job.compiled_loss
    assert not run.job.compiled_model  # no "Compiling each TransformerBlock" line
    assert run.step_s == pytest.approx(TITAN_MEDIAN)
    assert run.iterations == 4
    assert run.reserved_peak_bytes == round(61.50 * GIB)
    assert run.allocated_peak_bytes is None  # torchtitan logs only the reserved peak
    notes = " | ".join(run.notes)
    assert "step line(s) 1, 10" in notes
    assert "fsdp_reshard_after_forward: not stated" in notes


def test_torchtitan_log_cut_mid_line() -> None:
    text = text_of(titan_run()) + step_line(60, 100, 79.0)[:70]  # no newline: cut off
    run = torchtitan.read(text, "titan.log")
    assert run.step_s == pytest.approx(TITAN_MEDIAN)
    assert run.iterations == 4
    assert any("stops mid-line" in note for note in run.notes)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        # srun --label "<task>: " on two nodes, torchrun --role rank --tee 3 (run_train.sh:45 at
        # v0.2.2) "[rank<local rank>]:" (torch/distributed/elastic/multiprocessing/tail_log.py:130)
        ("0: [rank0]:", "1: [rank0]:"),
        # one node, torchrun's default role: "[default<local rank>]:"
        ("[default0]:", "[default4]:"),
    ],
)
def test_torchtitan_mixed_ranks(first: str, second: str) -> None:
    rank0 = [first + row for rec in titan_run() for row in rec.split("\n")]
    slow = {s: tps for s, tps, _ in TITAN_STEPS}
    slow[30] = 2048  # the other rank measured step 30 at 4.0 s
    other_records = [
        *titan_setup(),
        titan("Training starts at step 1"),
        *(step_line(s, slow[s], gib + 0.5) for s, _, gib in TITAN_STEPS),
    ]
    other = [second + row for rec in other_records for row in rec.split("\n")]
    mixed = [row for pair in zip(rank0, other, strict=False) for row in pair]
    mixed += rank0[len(other) :] + other[len(rank0) :]
    run = torchtitan.read("\n".join(mixed) + "\n", "ranks.log")
    # per step the slower rank: 2.0, 4.0, 2.56, 2.0
    assert run.step_s == pytest.approx(statistics.median([2.0, 4.0, 2.56, 2.0]))
    assert run.iterations == 4
    assert run.reserved_peak_bytes == round(62.00 * GIB)
    assert run.model.num_layers == 32


def test_torchtitan_restart_is_its_own_warm_up() -> None:
    lines = titan_run()
    lines += [
        titan("Starting job: Llama 3 8B training"),
        *titan_setup()[1:],
        titan("Training starts at step 51"),  # resumed from the step-50 checkpoint
        step_line(60, 1024, 70.0),  # warm-up of the second start (steps 51-60)
        step_line(70, 2048, 59.0),  # 4.0 s
        step_line(80, 2048, 59.0),  # 4.0 s
    ]
    run = torchtitan.read(text_of(lines), "restart.log")
    assert run.iterations == 6
    assert run.step_s == pytest.approx(statistics.median([2.0, 2.048, 2.56, 2.0, 4.0, 4.0]))
    assert run.reserved_peak_bytes == round(61.50 * GIB)  # the 70 GiB warm-up line is dropped
    assert any("start 2: step line(s) 60" in note for note in run.notes)


def test_torchtitan_log_without_model_is_refused_in_one_line() -> None:
    lines = [*titan_setup(model=False), *(step_line(s, t, g) for s, t, g in TITAN_STEPS)]
    with pytest.raises(PlannerError) as info:
        torchtitan.read(text_of(lines), "run.txt")
    message = str(info.value)
    assert "\n" not in message
    assert message == (
        "log='run.txt': torchtitan log states no model (no 'Building ... with ...' line)"
    )


def test_torchtitan_without_steady_steps_is_refused() -> None:
    lines = [*titan_setup(), step_line(1, 512, 40.0)]
    with pytest.raises(PlannerError, match=r"^log='short.log': .*no steady-state step lines"):
        torchtitan.read(text_of(lines), "short.log")
    # a start whose every line averages over one of its first 3 steps keeps all but its first
    lines.append(step_line(10, 4096, 60.0))
    run = torchtitan.read(text_of(lines), "short.log")
    assert (run.iterations, run.step_s) == (1, pytest.approx(2.0))
    assert any("kept all but the first" in note for note in run.notes)


def test_torchtitan_trainer_of_b5bcd76c_names_only_the_flavor() -> None:
    # trainer.py:354 f"Building {name} {flavor}"; trainer.py:621-629 the token-based batch line;
    # parallel_dims.py:274-278 the mesh line without etp; activation_checkpoint.py:161-163.
    lines = [
        titan(
            "Building device mesh with parallelism: pp=1, dp_replicate=1, dp_shard=8, cp=1, "
            "tp=1, ep=1"
        ),
        titan("Building llama3 8B"),
        titan(f"{BLUE}Model llama3 8B {RED}size: 8,030,261,248 total parameters{RESET}"),
        titan("Applied SelectiveAC activation checkpointing to the model"),
        titan("Compiling each TransformerBlock with torch.compile"),  # distributed/compile.py:72
        titan("Compiling the loss function with torch.compile"),  # components/loss.py:251
        titan(
            "Trainer is initialized with 16384 tokens per DP rank, 131072 tokens per train "
            "step, gradient accumulation steps 1, maximum context length 8192, total steps 100 "
            "(warmup 10)"
        ),
        titan("Training starts at step 1"),  # trainer.py:1022
        # metrics.py:527-536: mfu "N/A" under quantization, else as before
        *(step_line(s, tps, gib) for s, tps, gib in TITAN_STEPS),
    ]
    run = torchtitan.read(text_of(lines), "head.log")
    assert run.model.num_params() == 8_030_261_248
    assert (run.job.global_batch, run.job.seq_len, run.layout.micro_batch) == (16, 8192, 2)
    assert (run.layout.dp, run.layout.tp, run.layout.zero) == (8, 1, 3)
    assert run.job.compiled_loss and run.job.compiled_model
    assert {b.recompute for b in run.layout.stages[0].blocks if b.block.startswith("layer.")} == {
        "op"
    }
    # 131072 tokens per step / (tps x 8 GPUs): twice the 16-GPU times
    assert run.step_s == pytest.approx(2 * TITAN_MEDIAN)
    assert any("without its args" in note for note in run.notes)


def test_torchtitan_parameter_count_must_match_the_model() -> None:
    lines = titan_run()
    lines = [row.replace("8,030,261,248", "8,030,261,249") for row in lines]
    with pytest.raises(PlannerError, match=r"states 8,030,261,249 parameters"):
        torchtitan.read(text_of(lines), "params.log")


def test_torchtitan_pipeline_stages_and_layer_sac() -> None:
    # A v0.2.0 log: the model args repr (train.py:147), the N-D mesh line (parallel_dims.py:107),
    # the pipeline lines (pipeline_parallel.py:207-210 and :468-471), layer-SAC (default option
    # "2", config/job_config.py:591; activation_checkpoint.py:37-39) and train.py:363-370, :568.
    args = ", ".join(
        f"{k}={v!r}"
        for k, v in {**LLAMA3_8B_ARGS, "n_layers": 8}.items()
        if not isinstance(v, dict)
    )
    stages = [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "layers.4"],
        ["layers.5", "layers.6", "layers.7", "norm", "output"],
    ]
    lines = [
        titan("Building 3-D device mesh with ['pp', 'dp_shard', 'tp'], [3, 2, 2]"),
        titan(f"Building llama3 8B with TransformerModelArgs({args})"),
        titan("Applied selective activation checkpointing to the model"),
        *(
            titan(f"PP rank {i} is building stage_idx {i} with modules {mods}")
            for i, mods in enumerate(stages)
        ),
        titan("Using pipeline schedule 1F1B with 4 microbatches and 3 stages."),
        titan(
            "Trainer is initialized with local batch size 8, global batch size 16, gradient "
            "accumulation steps 1, sequence length 4096, total steps 100 (warmup 10)"
        ),
        titan("Training starts at step 1"),
        *(step_line(s, tps, gib) for s, tps, gib in TITAN_STEPS),
    ]
    run = torchtitan.read(text_of(lines), "pp.log")
    layout = run.layout
    assert (layout.pp, layout.dp, layout.tp, layout.schedule) == (3, 2, 2, "1f1b")
    assert layout.micro_batch == 2  # local batch 8 over 4 microbatches
    assert layout.zero == 2  # FSDP2 keeps the gathered weights between forward and backward
    counts = [sum(b.block.startswith("layer.") for b in s.blocks) for s in layout.stages]
    assert counts == [2, 3, 3]
    # each pipeline rank checkpoints its 2nd, 4th, ... block whole (default option "2")
    full = sorted(b.block for s in layout.stages for b in s.blocks if b.recompute == "full")
    assert full == ["layer.1", "layer.3", "layer.6"]
    assert any("selective_ac_option: not stated" in note for note in run.notes)
    assert not run.job.eager_norm  # v0.2.0's model args name no norm type: nn.RMSNorm
    # 16 x 4096 tokens over 12 GPUs
    assert run.step_s == pytest.approx(
        statistics.median([65536 / (t * 12) for t in (4096, 4000, 3200, 4096)])
    )


def test_torchtitan_of_2024_names_its_own_eager_rmsnorm() -> None:
    """torchtitan before April 2025 copied job_config.model.norm_type into ModelArgs, which
    its "Building ... with ModelArgs(...)" line prints; "rmsnorm" was its own eager RMSNorm
    class (torchtitan/models/norms.py at 9dec370), priced as such uncompiled."""
    args = ", ".join(
        f"{k}={v!r}"
        for k, v in {**LLAMA3_8B_ARGS, "norm_type": "rmsnorm"}.items()
        if not isinstance(v, dict)
    )
    lines = titan_run()
    at = next(i for i, line in enumerate(lines) if "Building llama3 8B" in line)
    lines[at] = titan(f"Building llama3 8B with ModelArgs({args})")
    from planner.costs.memory import shard_of

    run = torchtitan.read(text_of(lines), "old.log")
    assert run.job.eager_norm and not run.job.compiled_model
    assert shard_of(run.job, run.layout).eager_norm  # uncompiled: priced
    fused = [*lines[:at], lines[at].replace("'rmsnorm'", "'fused_rmsnorm'"), *lines[at + 1 :]]
    assert not torchtitan.read(text_of(fused), "fused.log").job.eager_norm


def test_torchtitan_hsdp_is_refused() -> None:
    lines = [
        row.replace("dp_replicate=1, dp_shard=4", "dp_replicate=2, dp_shard=2")
        for row in titan_run()
    ]
    with pytest.raises(PlannerError, match=r"^log='hsdp.log': dp_replicate=2 .*HSDP"):
        torchtitan.read(text_of(lines), "hsdp.log")


def test_torchtitan_deepseek_args_must_match_the_flavor() -> None:
    # models/deepseek_v3/model/args.py DeepSeekV3ModelArgs (v0.2.2) of the 16B flavor
    # (models/deepseek_v3/__init__.py), its MoEArgs nested (models/moe/moe.py), as asdict gives
    args: dict[str, Any] = {
        "_enforced": "This field is used to enforce all fields have defaults.",
        "max_batch_size": 8,
        "max_seq_len": 4096,
        "vocab_size": 102400,
        "dim": 2048,
        "inter_dim": 10944,
        "moe_inter_dim": 1408,
        "n_layers": 27,
        "n_dense_layers": 1,
        "n_heads": 16,
        "norm_eps": 1e-05,
        "moe_args": {
            "num_experts": 64,
            "num_shared_experts": 2,
            "score_func": "softmax",
            "route_norm": False,
            "route_scale": 1.0,
            "gate_bias": False,
            "score_before_experts": True,
            "top_k": 6,
            "num_expert_groups": None,
            "num_limited_groups": None,
            "use_grouped_mm": True,
            "load_balance_coeff": 0.001,
            "_debug_force_load_balance": False,
        },
        "expert_parallel_comm_backend": "standard",
        "q_lora_rank": 0,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "attn_type": "sdpa",
        "attn_mask_type": "causal",
        "original_seq_len": 4096,
        "rope_theta": 10000.0,
        "rope_factor": 40,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.7,
    }

    def log(model_args: dict[str, Any]) -> str:
        return text_of(
            [
                titan(
                    "Building device mesh with parallelism: pp=1, dp_replicate=1, dp_shard=8, "
                    "cp=1, tp=1, ep=8, etp=1"
                ),
                titan("Building deepseek_v3 16B" + "with " + json.dumps(model_args, indent=2)),
                titan(
                    "Trainer is initialized with local batch size 4, global batch size 32, "
                    "gradient accumulation steps 1, sequence length 4096, total steps 100 "
                    "(warmup 10)"
                ),
                *(step_line(s, tps, gib) for s, tps, gib in TITAN_STEPS),
            ]
        )

    run = torchtitan.read(log(args), "dsv3.log")
    assert (run.model.num_experts, run.model.experts_per_token, run.model.attention) == (
        64,
        6,
        "mla",
    )
    assert (run.layout.dp, run.layout.ep, run.layout.zero) == (8, 8, 3)
    # 32 x 4096 tokens over 8 GPUs: 16384 / tps
    assert run.step_s == pytest.approx(
        statistics.median([16384 / t for t in (4096, 4000, 3200, 4096)])
    )
    args["moe_args"]["top_k"] = 8
    with pytest.raises(PlannerError, match=r"^log='dsv3.log': .*differ .*: top_k=8 \(flavor 6\)$"):
        torchtitan.read(log(args), "dsv3.log")


# ================================ DeepSpeed ===================================================


def ds(message: str, where: str = "config.py:1013:print") -> str:
    """deepspeed/utils/logging.py:39-40: "[%(asctime)s] [%(levelname)s]
    [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"."""
    return f"[2025-03-01 10:00:00,456] [INFO] [{where}] {message}"


def hf(message: str, where: str = "configuration_utils.py:800") -> str:
    """transformers utils/logging.py enable_explicit_format:
    "[%(levelname)s|%(filename)s:%(lineno)s] %(asctime)s >> %(message)s"."""
    return f"[INFO|{where}] 2025-03-01 10:00:00,111 >> {message}"


def ds_json(value: Any, level: int = 0) -> str:
    """deepspeed/runtime/config_utils.py:156-173 ScientificNotationEncoder.iterencode (indent 4):
    numbers above 1e3 in scientific notation, ", " between items, each on its own line."""
    prefix_close, prefix = " " * level * 4, " " * (level + 1) * 4
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return f"{value:e}" if value > 1e3 else f"{value}"
    if isinstance(value, dict):
        items = [f'\n{prefix}"{k}": {ds_json(v, level + 1)}' for k, v in value.items()]
        return "{" + ", ".join(items) + f"\n{prefix_close}" + "}"
    if isinstance(value, list):
        return f"[{', '.join(ds_json(v) for v in value)}]"
    return json.dumps(value)


# transformers' LlamaConfig for Llama-3.2-1B as to_json_string(use_diff=True) gives it
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.0",
    "use_cache": True,
    "vocab_size": 128256,
}

# the user's DeepSpeed config after the Trainer filled its "auto" values
DS_CONFIG: dict[str, Any] = {
    "bf16": {"enabled": True},
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "wall_clock_breakdown": False,
    "zero_optimization": {
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "reduce_bucket_size": 16777216,
        "stage": 3,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def ds_engine_dump(config: dict[str, Any], **changes: str) -> list[str]:
    """runtime/config.py:1008-1016 print("DeepSpeedEngine configuration") (called from
    runtime/engine.py:469): "  {arg} {dots} {value}" with 29 - len(arg) dots, then the user's
    json (config.py:998-1006). A representative slice of the attributes, sorted as printed."""
    values = {
        "amp_enabled": "False",
        "bfloat16_config": "enabled=True immediate_grad_update=True check_grad_overflow=False",
        "float16_config": "enabled=False auto_cast=False loss_scale=0.0 initial_scale_power=16",
        "gradient_accumulation_steps": str(config["gradient_accumulation_steps"]),
        "steps_per_print": "10",
        "train_batch_size": str(config["train_batch_size"]),
        "train_micro_batch_size_per_gpu": str(config["train_micro_batch_size_per_gpu"]),
        "wall_clock_breakdown": "False",
        "world_size": "8",
        "zero_enabled": "True",
        "zero_optimization_stage": str(config["zero_optimization"]["stage"]),
        **changes,
    }
    lines = [ds("DeepSpeedEngine configuration:", "config.py:1009:print")]
    lines += [ds(f"  {k} {'.' * (29 - len(k))} {v}") for k, v in sorted(values.items())]
    lines.append(ds(f"  json = {ds_json(config)}", "config.py:999:print_user_config"))
    return lines


def script(message: str) -> str:
    """A training script's own logger, as the alignment-handbook's scripts/run_sft.py sets it up:
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
    datefmt="%Y-%m-%d %H:%M:%S")."""
    return f"2025-03-01 10:00:00 - INFO - __main__ - {message}"


def dump(cls: str, fields: dict[str, str]) -> str:
    """transformers training_args.py TrainingArguments.__str__ (the handbook's argument classes
    share it): f"{cls}(\n" then f"{k}={v},\n" per field, sorted, then ")"."""
    return f"{cls}(\n" + "".join(f"{k}={v},\n" for k, v in sorted(fields.items())) + ")"


def trainer_args(**changes: str) -> list[str]:
    """run_sft.py's logger.info(f"Data parameters {data_args}") and
    logger.info(f"Training/evaluation parameters {training_args}") of a TRL SFTConfig."""
    fields = {
        "_n_gpu": "1",
        "bf16": "True",
        "deepspeed": "ds_zero3.json",
        "gradient_accumulation_steps": "2",
        "gradient_checkpointing": "True",
        "learning_rate": "2e-05",
        "max_length": "4096",
        "packing": "True",
        "per_device_train_batch_size": "4",
        **changes,
    }
    data = {"dataset_mixer": "{'HuggingFaceH4/ultrachat_200k': 1.0}", "max_train_samples": "None"}
    return [
        script("Data parameters " + dump("DataArguments", data)),
        script("Training/evaluation parameters " + dump("SFTConfig", fields)),
    ]


def tput(step: int, rate: float, max_gib: float) -> str:
    """deepspeed/utils/timer.py:264-273 (ThroughputTimer.stop, rank 0)."""
    return ds(
        f"epoch=0/micro_step={2 * step}/global_step={step}, RunningAvgSamplesPerSec={rate * 0.97}, "
        f"CurrSamplesPerSec={rate}, MemAllocated={round(max_gib - 4.5, 2)}GB, "
        f"MaxMemAllocated={max_gib}GB",
        "timer.py:264:stop",
    )


# train_batch_size 64: a step takes 64 / CurrSamplesPerSec seconds
DS_STEPS = [  # (global_step, CurrSamplesPerSec, MaxMemAllocated GiB)
    (10, 20.0, 30.50),  # warm-up: the engine's first line (3.2 s)
    (20, 32.0, 31.25),  # 2.0 s
    (30, 25.6, 31.25),  # 2.5 s
    (40, 32.0, 31.00),  # 2.0 s
    (50, 40.0, 31.50),  # 1.6 s
    (60, 16.0, 31.50),  # 4.0 s
]


def ds_run(*, model: bool = True, args: list[str] | None = None) -> list[str]:
    lines = trainer_args() if args is None else list(args)
    if model:
        # transformers configuration_utils.py from_dict: logger.info(f"Model config {config}")
        # (__repr__: class name and to_json_string(), json.dumps(indent=2, sort_keys=True) + "\n")
        body = json.dumps(LLAMA_1B, indent=2, sort_keys=True) + "\n"
        lines.append(hf(f"Model config LlamaConfig {body}"))
    lines += [
        # deepspeed/__init__.py:158 log_dist(..., ranks=[0]): "[Rank 0] " (utils/logging.py:108)
        ds(
            "[Rank 0] DeepSpeed info: version=0.17.1, git-hash=unknown, git-branch=unknown",
            "logging.py:123:log_dist",
        ),
        *ds_engine_dump(DS_CONFIG),
        *(tput(s, r, g) for s, r, g in DS_STEPS),
    ]
    return lines


def test_deepspeed_normal_run() -> None:
    text = text_of(ds_run())
    assert deepspeed.recognises(text)
    assert not torchtitan.recognises(text)
    run = deepspeed.read(text, "hf.log")
    # Hugging Face model code under DeepSpeed: the registry's Trainer-with-DeepSpeed entry
    assert run.framework == "hf-deepspeed" and run.job.framework == "hf-deepspeed"
    assert (run.model.hidden_size, run.model.num_layers, run.model.vocab_size) == (2048, 16, 128256)
    assert run.model.tie_word_embeddings
    layout = run.layout
    assert (layout.tp, layout.pp, layout.dp, layout.cp) == (1, 1, 8, 1)  # 64 / (4 x 2)
    assert layout.zero == 3 and layout.micro_batch == 4
    assert layout.optimizer_offload == 1.0 and not layout.param_offload
    assert {b.recompute for b in layout.stages[0].blocks if b.block.startswith("layer.")} == {
        "full"
    }
    assert (run.job.global_batch, run.job.seq_len) == (64, 4096)
    assert run.job.activation_dtype == "bf16"
    assert run.step_s == pytest.approx(statistics.median([2.0, 2.5, 2.0, 1.6, 4.0]))  # 2.0
    assert run.iterations == 5
    assert run.allocated_peak_bytes == round(31.50 * GIB)
    assert run.reserved_peak_bytes is None
    assert any("global_step 10" in note for note in run.notes)


def test_deepspeed_log_cut_mid_line() -> None:
    text = text_of(ds_run()) + tput(70, 64.0, 40.0)[:90]
    run = deepspeed.read(text, "hf.log")
    assert run.iterations == 5 and run.step_s == pytest.approx(2.0)
    assert any("stops mid-line" in note for note in run.notes)


def test_deepspeed_mixed_ranks_and_json_blocks() -> None:
    # pdsh (DeepSpeed's multi-node runner) prefixes "<host>: "; rank 0 writes the engine dump
    # and the timer lines, every rank the Trainer's and transformers' lines.
    rank0 = ["node-0: " + row for rec in ds_run() for row in rec.split("\n")]
    other = ["node-1: " + row for rec in ds_run()[:3] for row in rec.split("\n")]
    mixed = [row for pair in zip(rank0, other, strict=False) for row in pair] + rank0[len(other) :]
    run = deepspeed.read("\n".join(mixed) + "\n", "pdsh.log")
    assert run.model.num_layers == 16 and run.layout.dp == 8
    assert run.step_s == pytest.approx(2.0) and run.iterations == 5


def test_deepspeed_restart_is_its_own_warm_up() -> None:
    lines = ds_run()
    lines += [
        *ds_engine_dump(DS_CONFIG),  # a new engine: the timer counts from 1 again
        tput(10, 12.8, 33.0),  # warm-up of the second start (5.0 s)
        tput(20, 16.0, 31.75),  # 4.0 s
        tput(30, 16.0, 31.75),  # 4.0 s
    ]
    run = deepspeed.read(text_of(lines), "restart.log")
    assert run.iterations == 7
    assert run.step_s == pytest.approx(statistics.median([2.0, 2.5, 2.0, 1.6, 4.0, 4.0, 4.0]))
    assert run.allocated_peak_bytes == round(31.75 * GIB)
    assert any("engine start 2" in note for note in run.notes)


def test_deepspeed_restart_with_another_batch_is_refused() -> None:
    changed = {**DS_CONFIG, "train_batch_size": 128, "gradient_accumulation_steps": 4}
    lines = [*ds_run(), *ds_engine_dump(changed), *(tput(s, r, g) for s, r, g in DS_STEPS)]
    with pytest.raises(PlannerError) as info:
        deepspeed.read(text_of(lines), "two.log")
    message = str(info.value)
    assert "\n" not in message and message.startswith("log='two.log': line ")
    assert "gradient_accumulation_steps" in message and "one run's settings" in message


def test_deepspeed_without_throughput_lines_is_refused() -> None:
    lines = [row for row in ds_run() if "CurrSamplesPerSec" not in row]
    with pytest.raises(PlannerError, match=r"^log='quiet.log': .*no ThroughputTimer line"):
        deepspeed.read(text_of(lines), "quiet.log")
    lines.append(tput(10, 32.0, 30.0))  # one line: its engine's first, warm-up
    with pytest.raises(PlannerError, match=r"^log='quiet.log': .*no steady-state"):
        deepspeed.read(text_of(lines), "quiet.log")


def test_deepspeed_log_without_model_is_refused_in_one_line() -> None:
    with pytest.raises(PlannerError) as info:
        deepspeed.read(text_of(ds_run(model=False)), "run.txt")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("log='run.txt': DeepSpeed log states no model")


def test_deepspeed_without_sequence_length_is_refused() -> None:
    no_packing = trainer_args(packing="False")
    with pytest.raises(PlannerError, match=r"^log='pad.log': max_length=4096 without packing"):
        deepspeed.read(text_of(ds_run(args=no_packing)), "pad.log")
    lines = ds_run()[2:]  # no argument dumps
    with pytest.raises(PlannerError, match=r"^log='bare.log': DeepSpeed log states no sequence"):
        deepspeed.read(text_of(lines), "bare.log")


def test_deepspeed_ulysses_fp16_and_param_offload() -> None:
    config = {
        **DS_CONFIG,
        "fp16": {"enabled": True},
        "sequence_parallel_size": 2,
        "train_batch_size": 32,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        },
    }
    del config["bf16"]
    lines = [
        *trainer_args(gradient_checkpointing="False"),
        hf("Model config LlamaConfig " + json.dumps(LLAMA_1B, indent=2, sort_keys=True)),
        *ds_engine_dump(
            config,
            bfloat16_config="enabled=False immediate_grad_update=True check_grad_overflow=False",
            float16_config="enabled=True auto_cast=False loss_scale=0.0 initial_scale_power=16",
            world_size="4",  # the data-parallel world: 8 GPUs / sequence_parallel_size 2
        ),
        *(tput(s, r / 2, g) for s, r, g in DS_STEPS),
    ]
    run = deepspeed.read(text_of(lines), "sp.log")
    layout = run.layout
    assert (layout.dp, layout.cp, layout.cp_comm_type) == (4, 2, "a2a")
    assert layout.param_offload and layout.optimizer_offload == 1.0
    assert run.job.activation_dtype == "fp16" and run.job.weight_dtype == "fp16"
    assert {b.recompute for b in layout.stages[0].blocks} == {"none"}
    assert run.step_s == pytest.approx(2.0)  # 32 samples at half the rate


# ================================ dispatch ====================================================


def test_read_log_dispatches_each_format(tmp_path: Path) -> None:
    from planner.logs import read_log

    titan_file = tmp_path / "titan.log"
    titan_file.write_text(text_of(titan_run()))
    ds_file = tmp_path / "ds.log"
    ds_file.write_text(text_of(ds_run()))
    assert read_log(titan_file).framework == "torchtitan"
    assert read_log(ds_file).framework == "hf-deepspeed"
    assert read_log(ds_file).name == "ds.log"


def test_every_refusal_names_the_log_once() -> None:
    """The torchtitan and DeepSpeed readers' refusals from deeper down (a model or layout the
    planner refuses) are named with the file, and those that name it already are not twice."""
    from planner.errors import PlannerError
    from planner.logs.text import naming_the_log

    def deep(where: str) -> None:
        raise PlannerError("Layout.tp=3: must divide the 32 heads")

    def named(where: str) -> None:
        raise PlannerError(f"{where}: no step lines")

    for body, said in ((deep, "log='a.log': Layout.tp=3"), (named, "log='a.log': no step")):
        with pytest.raises(PlannerError) as refused:
            naming_the_log("a.log", body)
        assert str(refused.value).startswith(said) and str(refused.value).count("a.log") == 1
