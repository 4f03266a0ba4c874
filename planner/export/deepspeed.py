"""A DeepSpeed config (``ds_config.json``), its launcher line and pipeline settings for a plan.

Keys are those of DeepSpeed's config parser (``deepspeed/runtime/config.py``,
``deepspeed/runtime/zero/config.py``; deepspeedai/DeepSpeed commit edaa7221, checked against
release 0.19.8). DeepSpeed's rule is train_batch_size = micro-batch x gradient accumulation
steps x data-parallel size, and with pipeline parallelism the micro-batches per step are the
gradient accumulation steps.

What maps exactly: ZeRO 0-3 without pipeline or tensor parallelism, ZeRO 0-1 with pipeline
parallelism, ZeRO 0-2 with tensor parallelism (``tensor_parallel.autotp_size``), micro-batch
and batch sizes, the 1F1B schedule with equal stages
(``PipelineModule(partition_method="uniform")``), no or full recompute of every layer
(``deepspeed.checkpointing``), context parallelism by all-to-all without tensor or pipeline
parallelism (Ulysses: ``sequence_parallel_size``, and ``train.py`` registers
``UlyssesSPAttentionHF`` with the Hugging Face model, as ``pipeline.py`` shows).

What does not: the context ring (runs as Ulysses where the heads divide), context
parallelism beside tensor or pipeline parallelism or on multi-latent attention (refused),
ZeRO-2/3 with pipeline parallelism (DeepSpeed's pipeline engine refuses them;
runs ZeRO-1), ZeRO-3 with tensor parallelism (AutoTP asserts stage <= 2; runs ZeRO-2), every
schedule but 1F1B and stages of unequal size (DeepSpeed runs its own 1F1B on ``uniform``
stages), selective recompute (DeepSpeed checkpoints whole layers), an EMA.
Expert parallelism is set in the model code (``deepspeed.moe.layer.MoE(ep_size=...)``).

The model: a DeepSpeed config builds none. The user's ``train.py`` brings the model code; the
export's notes (and ``pipeline.py``) say which architecture it must build, and ``exact`` refers
to the layout alone.
"""

from __future__ import annotations

import json

from planner.costs.blocks import a2a_rule
from planner.costs.memory import DEEPSPEED_REDUCE_BUCKET_ELEMENTS
from planner.errors import PlannerError
from planner.export import (
    Export,
    describe,
    finish,
    inputs,
    settle,
    uniform_1f1b,
    uniform_recompute,
    with_recompute,
    without_host_offload,
)
from planner.frameworks import framework, target
from planner.layout import Layout
from planner.solve.result import Plan
from planner.specs import ModelSpec

COMMIT = "edaa7221267243c7be7fb49c5d5f5c4fb97b4641"
# What a layout drops with ZeRO-3 (ZeRO++'s secondary shard, the weights on the host)
ZERO3_ONLY = {"zero_hpz": 1, "param_offload": False}


def deepspeed(plan: Plan) -> Export:
    """``ds_config.json``, the launcher line and the pipeline settings for ``plan``."""
    model, cluster, job, planned = inputs(plan)
    differences: list[str] = []
    runs = planned
    if runs.cp > 1:
        runs = _ulysses(model, runs, differences)
    if runs.tp > 1 and runs.sequence_parallel:
        differences.append(
            "sequence parallelism: DeepSpeed's AutoTP all-reduces whole activations; runs without"
        )
        runs = runs.model_copy(update={"sequence_parallel": False})
    if runs.fp8_cache:
        differences.append("FP8 caching of activation inputs: DeepSpeed has none; costed without")
        runs = runs.model_copy(update={"fp8_cache": False})
    if runs.pp > 1 and (runs.schedule not in target("deepspeed").schedules or not _even(runs)):
        counts = _layer_counts(runs)
        differences.append(
            f"pipeline {runs.schedule} with layers per stage {counts}: DeepSpeed runs 1F1B on "
            "stages of equal layer counts (partition_method 'uniform')"
        )
        runs = uniform_1f1b(model, runs)
    if runs.pp > 1 and runs.zero >= 2:
        differences.append(
            f"ZeRO-{runs.zero} with pipeline parallelism: DeepSpeed allows ZeRO-0/1 only; runs "
            "ZeRO-1"
        )
        runs = runs.model_copy(update={"zero": 1, **ZERO3_ONLY})
    if runs.tp > 1 and runs.zero == 3:
        differences.append(
            "ZeRO-3 with tensor parallelism: DeepSpeed's AutoTP asserts ZeRO stage <= 2 "
            "(deepspeed/runtime/engine.py); runs ZeRO-2"
        )
        runs = runs.model_copy(update={"zero": 2, **ZERO3_ONLY})
    runs = without_host_offload(runs, "DeepSpeed", differences)
    choice = uniform_recompute(runs)
    if choice not in ("none", "full"):
        differences.append(
            f"recompute {choice or 'per layer'}: DeepSpeed checkpoints whole layers; runs full "
            "recompute"
        )
        runs = with_recompute(runs, "full")
        choice = "full"
    if job.ema:
        differences.append("EMA: DeepSpeed keeps none; the training script must")
    runs = settle(plan, runs, differences)
    m = job.global_batch // (runs.dp * runs.micro_batch)
    config: dict[str, object] = {
        "train_batch_size": job.global_batch,
        "train_micro_batch_size_per_gpu": runs.micro_batch,
        "gradient_accumulation_steps": m,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": runs.zero,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            # the buffers planner.costs.memory prices (DeepSpeed's defaults, stated)
            "reduce_bucket_size": DEEPSPEED_REDUCE_BUCKET_ELEMENTS,
            **(
                {"stage3_max_live_parameters": framework("deepspeed").max_live_parameters}
                if runs.zero == 3
                else {}
            ),
            # ZeRO++'s secondary shard over consecutive ranks (deepspeed/runtime/zero/
            # config.py:309, utils/groups.py:878-886 at edaa7221)
            **({"zero_hpz_partition_size": runs.zero_hpz} if runs.zero_hpz > 1 else {}),
            # ZeRO-3's weight shards in pinned host memory (runtime/zero/offload_config.py)
            **(
                {"offload_param": {"device": "cpu", "pin_memory": True}}
                if runs.param_offload
                else {}
            ),
            # ZeRO-Offload: the optimizer state and its step on the host, all of it
            # (deepspeed/runtime/zero/offload_config.py: valid with stages 1, 2 and 3)
            **(
                {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
                if runs.optimizer_offload
                else {}
            ),
        },
    }
    if runs.tp > 1:
        config["tensor_parallel"] = {"autotp_size": runs.tp}
    if runs.cp > 1:
        config["sequence_parallel_size"] = runs.cp
    if choice == "full":
        config["activation_checkpointing"] = {
            "partition_activations": runs.tp > 1,
            "contiguous_memory_optimization": False,
        }
    world = runs.world_size
    per_node = min(cluster.gpus_per_node, world)
    launch = (
        f"# {model.name}: {world} GPUs (DeepSpeed config keys as of {COMMIT[:8]})\n"
        f"deepspeed --num_nodes {max(1, world // per_node)} --num_gpus {per_node} train.py "
        "--deepspeed --deepspeed_config ds_config.json\n"
    )
    pipeline = (
        "# In train.py: the model as a PipelineModule (and the MoE layers' expert parallelism)\n"
        f"model = deepspeed.pipe.PipelineModule(layers=layers, num_stages={runs.pp}, "
        'partition_method="uniform", activation_checkpoint_interval='
        f"{1 if choice == 'full' else 0})\n"
        if runs.cp == 1
        else _ULYSSES.format(cp=runs.cp, mb=runs.micro_batch, seq=job.seq_len)
    ) + (
        f"# MoE layers: deepspeed.moe.layer.MoE(..., num_experts={model.num_experts}, "
        f"ep_size={runs.ep}, k={model.experts_per_token})\n"
        if model.num_experts
        else ""
    )
    files = {
        "ds_config.json": json.dumps(config, indent=2) + "\n",
        "launch.sh": launch,
        "pipeline.py": "# Build: " + describe(model) + "\n" + pipeline,
    }
    notes = [
        "DeepSpeed's config builds no model: train.py must bring model code that builds "
        f"{describe(model)} (e.g. the Hugging Face transformers class of its config.json); "
        "'exact' here is the layout's"
    ]
    return finish("deepspeed", plan, runs, files, differences, notes=notes)


# DeepSpeed's Ulysses for a Hugging Face model (deepspeed/runtime/sequence_parallel/
# ulysses_sp.py and docs/_tutorials/ulysses-alst-sequence-parallelism.md at edaa7221).
_ULYSSES = (
    "# In train.py, before from_pretrained: Ulysses sequence parallelism over {cp} ranks\n"
    "from deepspeed.runtime.sequence_parallel.ulysses_sp import (\n"
    "    UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter)\n"
    "mpu = UlyssesSPAttentionHF.register_with_transformers(\n"
    '    model_name_or_path=MODEL, core_attn_implementation="flash_attention_2",\n'
    "    sequence_parallel_size={cp}, micro_batch_size={mb}, seq_length={seq},\n"
    "    seq_length_is_variable=False)\n"
    "# then deepspeed.initialize(..., mpu=mpu), and the dataloader wrapped in\n"
    "# UlyssesSPDataLoaderAdapter(dl, sp_rank=..., sp_group=..., sp_world_size={cp}, ...)\n"
)


def _ulysses(model: ModelSpec, runs: Layout, differences: list[str]) -> Layout:
    """``runs`` as DeepSpeed's Ulysses runs its context parallelism: the heads split by
    all-to-all, beside ZeRO alone (no AutoTP, no pipeline), not on multi-latent attention."""
    why = ""
    if runs.tp > 1 or runs.pp > 1:
        why = f"with tp={runs.tp} and pp={runs.pp} (it runs beside ZeRO alone: tp = pp = 1)"
    elif model.attention == "mla":
        why = "on multi-latent attention (its all-to-all needs k and v of one shape)"
    elif a2a_rule(model, runs.tp, runs.cp):
        why = f"here: {a2a_rule(model, runs.tp, runs.cp)}"
    if why:
        raise PlannerError(
            f"Layout.cp={runs.cp}: DeepSpeed's sequence parallelism (Ulysses) does not run "
            f"{why}; plan with SearchSpace(framework='deepspeed') for a layout it can state"
        )
    if runs.cp_comm_type != "a2a":
        differences.append(
            f"context parallelism by {runs.cp_comm_type}: DeepSpeed's is Ulysses, the heads split "
            "by all-to-all; runs that"
        )
        runs = runs.model_copy(update={"cp_comm_type": "a2a", "cp_a2a_size": None})
    return runs


def _layer_counts(layout: Layout) -> list[int]:
    return [sum(b.block.startswith("layer.") for b in s.blocks) for s in layout.stages]


def _even(layout: Layout) -> bool:
    counts = _layer_counts(layout)
    return max(counts) - min(counts) <= 1 and layout.virtual_stages == 1
