"""A torchtitan job config (TOML) for a plan.

Keys are those of torchtitan's ``JobConfig`` (``torchtitan/config/job_config.py``) at tag
v0.2.2 (commit 73a0e697, 2026-02-20), the last release that reads TOML job configs; the
test suite holds the key list and checks every exported key against it.

What maps exactly: tp, cp (``context_parallel_degree``; FSDP2 shards over dp * cp, as the
time model does), pp, ep, etp when it is 1 or tp (``expert_tensor_parallel_degree``, the two
torchtitan allows), ZeRO-3 (FSDP2,
resharding after forward), ZeRO-2 (FSDP2 without resharding), ZeRO-0 (replicated data
parallelism), stages of any size (``module_fqns_per_model_part``, in torchtitan's module
names: ``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``), 1F1B, interleaved 1F1B,
GPipe and DualPipeV schedules, micro-batch (``pipeline_parallel_microbatch_size``) and the
batch sizes, no or full recompute of every layer.

The model: ``[model]`` names the flavor that builds the planned model field for field
(``planner.export.flavors``: llama3 8B/70B/405B, llama4 17bx16e/17bx128e with and without
iRoPE, deepseek_v3 16B/236B/671B); where none does,
the one named after the model (or a placeholder) is written and the export lists what differs,
so a flavor with the model's values must be added to torchtitan first.

What does not: ZeRO-1 (FSDP2 shards gradients too; runs as ZeRO-2), ZB-H1 and DualPipe
(run as 1F1B on the same stages), per-block recompute mixes and Megatron-style module sets
(torchtitan's selective mode saves by op, not by module; the layers are costed with the
nearest single choice), MTP modules (torchtitan's DeepSeek-V3 has none), an EMA, FP8 with
128x128 block scales (torchtitan's Float8 recipes are tensor- or row-wise), and the context
ring's sends (torchtitan rotates keys and values by ``context_parallel_rotate_method``, an
all-gather by default; the time model prices a ring of sends hidden behind attention).
"""

from __future__ import annotations

from typing import Any

from planner.costs.memory import eager_ops
from planner.export import (
    Export,
    finish,
    heaviest_choice,
    inputs,
    settle,
    uniform_recompute,
    without_host_offload,
    without_hpz,
    without_param_offload,
)
from planner.export import with_recompute as _with_recompute
from planner.export.flavors import FLEX_FLAVORS, flavors, mismatches
from planner.frameworks import target
from planner.layout import Layout
from planner.solve.result import Plan
from planner.specs import ModelSpec

COMMIT = "73a0e6979dd10b6b1904098eb3c8f62c18ab87ce"

LAUNCHER = target("torchtitan")
FLAVORS = {  # catalog name -> the torchtitan (model name, flavor) named after it, v0.2.2
    "llama3-8b": ("llama3", "8B"),
    "llama3-70b": ("llama3", "70B"),
    "llama3-405b": ("llama3", "405B"),
    "deepseek-v2": ("deepseek_v3", "236B"),
    "deepseek-v3": ("deepseek_v3", "671B"),
    "llama4-scout": ("llama4", "17bx16e_irope"),
    "llama4-maverick": ("llama4", "17bx128e_irope"),
}


def torchtitan(plan: Plan) -> Export:
    """A torchtitan TOML job config for ``plan`` (see the module docstring)."""
    model, _, job, planned = inputs(plan)
    differences: list[str] = []
    runs = planned
    if runs.etp not in (1, runs.tp):
        differences.append(
            f"expert tensor parallelism {runs.etp}: torchtitan splits experts over 1 or all tp "
            "ranks; runs 1"
        )
        runs = runs.model_copy(update={"etp": 1})
    if runs.tp > 1 and not runs.sequence_parallel:
        differences.append(
            "sequence parallelism off: torchtitan's tensor parallelism shards the norms by "
            "sequence; runs with it"
        )
        runs = runs.model_copy(update={"sequence_parallel": True})
    if runs.optimizer_offload:
        differences.append(
            "optimizer offload: torchtitan has none on its own (training.enable_cpu_offload "
            "moves weights and gradients to the host too); runs without"
        )
        runs = runs.model_copy(update={"optimizer_offload": 0.0})
    if runs.cp > 1 and runs.cp_comm_type != "p2p":
        differences.append(
            f"context parallelism by {runs.cp_comm_type}: torchtitan's passes keys and values "
            "around a ring; runs the ring"
        )
        runs = runs.model_copy(update={"cp_comm_type": "p2p", "cp_a2a_size": None})
    if runs.fp8_cache:
        differences.append("FP8 caching of activation inputs: torchtitan has none; costed without")
        runs = runs.model_copy(update={"fp8_cache": False})
    if runs.schedule not in LAUNCHER.schedules:
        differences.append(
            f"schedule {runs.schedule}: torchtitan has no such schedule; runs 1F1B on the same "
            "stages"
        )
        runs = runs.model_copy(update={"schedule": LAUNCHER.runs_instead(runs.schedule)})
    if runs.zero == 1:
        differences.append("ZeRO-1: torchtitan's FSDP2 shards gradients too; runs ZeRO-2")
        runs = runs.model_copy(update={"zero": 2})
    runs = without_host_offload(runs, "torchtitan", differences)
    runs = without_hpz(runs, "torchtitan", differences)
    runs = without_param_offload(runs, "torchtitan", differences)
    choice = uniform_recompute(runs)
    if choice is None or choice not in ("none", "full"):
        nearest = heaviest_choice(runs) if choice is None else choice
        differences.append(
            f"recompute {choice or 'per layer'}: torchtitan states none, full or op-level "
            f"selective; costed as {nearest} on every layer"
        )
        runs = _with_recompute(runs, nearest)
        choice = nearest
    if model.num_mtp_layers:
        differences.append(
            f"MTP ({model.num_mtp_layers} module(s)): torchtitan's model has none; its part "
            "lists leave them out"
        )
    if job.ema:
        differences.append("EMA: torchtitan keeps none; the training script must")
    if job.compute_dtype == "fp8":
        differences.append("FP8: torchtitan's Float8 recipes are row-wise, not 128x128 blocks")
    runs = settle(plan, runs, differences)
    name, flavor, unmatched = model_flavor(model, job.seq_len)
    if unmatched:
        differences.append(unmatched)
    if runs.cp > 1 and (name, flavor) in FLEX_FLAVORS:
        differences.append(
            f"context parallelism {runs.cp}: torchtitan runs it on SDPA only and {name} "
            f"{flavor} runs FlexAttention (its model/args.py refuses the pair); runs cp 1, "
            "those ranks data parallel"
        )
        runs = runs.model_copy(update={"cp": 1, "dp": runs.dp * runs.cp})
    m = job.global_batch // (runs.dp * runs.micro_batch)
    local = runs.micro_batch * m if runs.pp > 1 else runs.micro_batch
    sections: dict[str, dict[str, Any]] = {
        "model": {"name": name, "flavor": flavor},
        "training": {
            "local_batch_size": local,
            "global_batch_size": job.global_batch,
            "seq_len": job.seq_len,
            "mixed_precision_param": "bfloat16",
        },
        "parallelism": _parallelism(runs),
        "activation_checkpoint": {
            "mode": "none" if choice == "none" else "full" if choice == "full" else "selective"
        },
    }
    if sections["activation_checkpoint"]["mode"] == "selective":
        sections["activation_checkpoint"]["selective_ac_option"] = "op"
    if job.compute_dtype == "fp8":
        sections["model"]["converters"] = ["quantize.linear.float8"]
    if job.loss_chunks > 1:
        differences.append(
            f"the loss in {job.loss_chunks} chunks (ChunkedCELoss): v0.2.2's TOML has no "
            "chunked loss; torchtitan's Python configs since 786e26f8 (2026-04-27) state "
            f"loss=ChunkedCELoss.Config(num_chunks={job.loss_chunks}), else the whole logits "
            "are held"
        )
    if job.eager_norm and eager_ops(job, planned) == "torchtitan":  # as it was costed
        differences.append(
            "the model's own eager RMSNorm (torchtitan before April 2025, norm_type "
            "'rmsnorm'): v0.2.2 builds nn.RMSNorm, one fused kernel, so it runs faster than "
            "costed"
        )
    if job.compiled_loss:  # the loss compiled as costed (and the model: one switch)
        sections["compile"] = {"enable": True, "components": ["model", "loss"]}
    elif job.compiled_model:  # the layers compiled as costed (costs.memory.model_compiled)
        sections["compile"] = {"enable": True, "components": ["model"]}
    if runs.tp > 1 and job.tp_comm_overlap:
        # The time model hides tensor-parallel collectives as async TP does; torchtitan runs
        # it only under torch.compile of the model.
        sections["parallelism"]["enable_async_tensor_parallel"] = True
        sections.setdefault("compile", {"enable": True, "components": ["model"]})
    text = (
        f"# {model.name}: {runs.world_size} GPUs (torchtitan job config, keys as "
        f"of {COMMIT[:8]}, v0.2.2)\n" + dumps(sections)
    )
    notes = []
    if job.moe_dispatcher == "deepep":
        notes.append(
            "DeepEP is chosen in the model's config, not in this TOML: moe_comm_backend="
            "'deepep' (torchtitan's model config registries)"
        )
    return finish("torchtitan", plan, runs, {"torchtitan.toml": text}, differences, notes=notes)


def model_flavor(model: ModelSpec, seq_len: int) -> tuple[str, str, str | None]:
    """torchtitan's (model name, flavor) that builds ``model`` at ``seq_len``, or the one
    named after it (else a placeholder) with what differs."""
    known = flavors(seq_len)
    for (name, flavor), built in known.items():
        if not mismatches(model, built):
            return name, flavor, None
    if model.name in FLAVORS:
        name, flavor = FLAVORS[model.name]
        return (
            name,
            flavor,
            (
                f"model: torchtitan's {name} {flavor} builds another model ("
                + "; ".join(mismatches(model, known[name, flavor]))
                + f"); add a flavor with the model's values to torchtitan/models/{name}/__init__.py"
            ),
        )
    code = {"mla": "deepseek_v3"}.get(model.attention, "" if model.num_experts else "llama3")
    where = f"a flavor to torchtitan/models/{code}/__init__.py" if code else "a torchtitan model"
    return (
        model.name,
        "<flavor>",
        (
            f"model {model.name}: no torchtitan v0.2.2 flavor builds it; add {where} (where its "
            "code can build this model) and set [model]"
        ),
    )


def _parallelism(layout: Layout) -> dict[str, Any]:
    out: dict[str, Any] = {
        "data_parallel_replicate_degree": layout.dp if layout.zero == 0 else 1,
        "data_parallel_shard_degree": 1 if layout.zero == 0 else layout.dp,
        "fsdp_reshard_after_forward": "never" if layout.zero == 2 else "default",
        "tensor_parallel_degree": layout.tp,
        "pipeline_parallel_degree": layout.pp,
        "expert_parallel_degree": layout.ep,
        "expert_tensor_parallel_degree": layout.etp,
        "context_parallel_degree": layout.cp,
    }
    if layout.cp > 1:  # the sends the time model prices (torchtitan's default gathers)
        out["context_parallel_rotate_method"] = "alltoall"
    if layout.pp > 1:
        out["pipeline_parallel_schedule"] = LAUNCHER.own_name(layout.schedule)
        out["pipeline_parallel_microbatch_size"] = layout.micro_batch
        out["module_fqns_per_model_part"] = [_part(s.blocks) for s in layout.stages]
    return out


def _part(blocks: list[Any]) -> list[str]:
    """torchtitan's module names of one stage (the final norm goes with the head)."""
    names: list[str] = []
    for b in blocks:
        if b.block == "embedding":
            names.append("tok_embeddings")
        elif b.block == "head":
            names += ["norm", "output"]
        elif b.block.startswith("layer."):
            names.append(b.block.replace("layer.", "layers."))
    return names


def dumps(sections: dict[str, dict[str, Any]]) -> str:
    """TOML for flat tables of strings, numbers, booleans and (nested) lists of them."""
    lines: list[str] = []
    for name, table in sections.items():
        lines.append(f"\n[{name}]")
        for key, value in table.items():
            lines.append(f"{key} = {_value(value)}")
    return "\n".join(lines).lstrip("\n") + "\n"


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")
