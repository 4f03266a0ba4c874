"""Launch configs from a plan: Megatron-LM arguments, a torchtitan TOML, a DeepSpeed config.

Each exporter states the plan's layout in its target's own terms. Where the target cannot
state it exactly (a schedule it lacks, per-block recompute mixes, a ZeRO stage it has no
switch for), the export runs the nearest layout the target can state, lists each
difference, and gives that layout's predicted step time and memory next to the plan's (both
from ``planner.evaluate``), so the cost of the difference is a number, not a guess.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from planner.errors import PlannerError
from planner.estimate import Estimate, evaluate
from planner.layout import Layout
from planner.schedules import DEFAULT_SCHEDULE
from planner.solve.result import Plan
from planner.specs import ClusterSpec, ModelSpec, TrainingJob


class Export(BaseModel):
    """A launch config for one target, and how far it is from the plan."""

    model_config = ConfigDict(frozen=True)

    target: str = Field(description="megatron | torchtitan | deepspeed")
    files: dict[str, str] = Field(description="File name -> content (a command line, TOML, JSON).")
    args: list[str] = Field(default_factory=list, description="Megatron-LM argv, one per item.")
    layout: Layout = Field(description="The layout the target runs (the plan's, or the nearest).")
    differences: list[str] = Field(
        default_factory=list,
        description="What the target cannot state exactly (layout or model), and what runs.",
    )
    notes: list[str] = Field(
        default_factory=list,
        description="What the user must bring that the launch config does not state and that "
        "does not change what runs (DeepSpeed's model code).",
    )
    planned_step_s: float = Field(description="The plan's predicted step time (seconds).")
    exported_step_s: float = Field(description="Predicted step time of what runs (seconds).")
    exported_peak_bytes: int = Field(description="Its largest per-rank memory peak (bytes).")
    fits: bool = Field(
        description="Whether what runs keeps every rank within the memory cap (usable HBM less "
        "the job's margin; Estimate.fits)."
    )

    @property
    def exact(self) -> bool:
        return not self.differences

    def summary(self) -> str:
        """One paragraph for a person: exact, or what differs and what it costs."""
        notes = "".join(f" Note: {n}." for n in self.notes)
        if self.exact:
            return (
                f"{self.target}: states the plan exactly ({self.planned_step_s:.3f} s/step)."
                + notes
            )
        change = self.exported_step_s / self.planned_step_s - 1
        fit = "fits" if self.fits else "DOES NOT FIT the memory cap"
        return (
            f"{self.target}: {len(self.differences)} difference(s); predicted "
            f"{self.exported_step_s:.3f} s/step vs {self.planned_step_s:.3f} planned "
            f"({change:+.1%}), {fit}: " + "; ".join(self.differences) + "." + notes
        )


def inputs(plan: Plan) -> tuple[ModelSpec, ClusterSpec, TrainingJob, Layout]:
    """The plan's model, cluster, job and layout (an infeasible plan has nothing to export)."""
    if plan.layout is None:
        raise PlannerError("export: the plan is infeasible; there is no layout to export")
    if plan.model is None or plan.cluster is None or plan.job is None:
        raise PlannerError(
            "export: the plan does not carry its model, cluster and job (make it with "
            "planner.plan, or pass them)"
        )
    return plan.model, plan.cluster, plan.job, plan.layout


def finish(
    target: str,
    plan: Plan,
    runs: Layout,
    files: dict[str, str],
    differences: list[str],
    args: list[str] | None = None,
    notes: list[str] | None = None,
) -> Export:
    model, cluster, job, layout = inputs(plan)
    planned = evaluate(model, cluster, job, layout)
    # The exported layout runs under the target's software: what it overlaps (time) is the
    # target's, whatever framework the plan was made for.
    target_job = job.with_framework(target)
    exported = (
        planned
        if (runs, target_job) == (layout, job)
        else evaluate(model, cluster, target_job, runs)
    )
    if target_job != job:
        try:
            retimed: Estimate | None = evaluate(model, cluster, target_job, layout)
        except PlannerError:  # a decision the target cannot run: a difference says which
            retimed = None
        if retimed and abs(retimed.step_time_s - planned.step_time_s) > 1e-9 * planned.step_time_s:
            differences.append(
                f"planned for {job.framework}, run by {target}: what {target} overlaps makes "
                f"the planned layout {retimed.step_time_s:.3f} s per step, not "
                f"{planned.step_time_s:.3f} s"
            )
    return Export(
        target=target,
        files=files,
        args=args or [],
        layout=runs,
        differences=differences,
        notes=notes or [],
        planned_step_s=planned.step_time_s,
        exported_step_s=exported.step_time_s,
        exported_peak_bytes=exported.peak_bytes,
        fits=exported.fits,
    )


_MLP_NAMES = {"swiglu": "SwiGLU", "geglu": "GeGLU", "gelu": "GeLU", "relu2": "squared-ReLU"}


def describe(model: ModelSpec) -> str:
    """The model's architecture in one line: what model code must build."""
    if model.attention == "mla":
        attention = (
            f"MLA ({model.num_attention_heads} heads, q rank {model.q_lora_rank or 'none'}, "
            f"kv rank {model.kv_lora_rank}, q/k {model.qk_nope_head_dim}+{model.qk_rope_head_dim}"
            f", v {model.v_head_dim})"
        )
    else:
        attention = (
            f"{model.attention.upper()} ({model.num_attention_heads} heads, "
            f"{model.num_kv_heads} key/value heads of {model.head_dim})"
        )
    parts = [
        f"{model.num_layers} layers",
        f"hidden {model.hidden_size}",
        attention,
        f"{_MLP_NAMES[model.mlp]} MLP of {model.ffn_hidden_size}",
        f"{'RMSNorm' if model.norm == 'rmsnorm' else 'LayerNorm'} (epsilon {model.norm_eps})",
    ]
    if model.num_experts:
        shared = f" + {model.num_shared_experts} shared" if model.num_shared_experts else ""
        parts.append(
            f"{model.num_experts} experts of {model.moe_ffn_hidden_size}{shared}, top "
            f"{model.experts_per_token} by {model.router_score} (after {model.first_dense_layers} "
            "dense layers)"
        )
    if model.learned_positions:
        parts.append(f"{model.learned_positions} learned positions")
    else:
        scaling = dict(model.rope_scaling).get("rope_type")
        parts.append(f"RoPE base {model.rope_theta}" + (f" ({scaling} scaling)" if scaling else ""))
    biases = {
        "q/k/v": model.qkv_bias,
        "attention output": model.linear_bias or model.o_proj_bias,
        "MLP": model.linear_bias or model.mlp_bias,
        "router": model.router_bias,
    }
    parts.append("biases on " + (", ".join(b for b, on in biases.items() if on) or "none"))
    if model.qk_norm:
        parts.append("per-head q/k norms")
    if model.attention_sinks:
        parts.append("attention sinks")
    if model.sliding_window:
        parts.append(f"{model.sliding_window}-token windows")
    if model.attention_chunk_size:
        parts.append(f"{model.attention_chunk_size}-token attention chunks")
    if model.nope_layers:
        parts.append(f"{len(model.nope_layers)} layers without RoPE")
    if model.post_norms:
        parts.append("norms after the attention and the MLP")
    if model.final_logit_softcap:
        parts.append(f"logits soft-capped at {model.final_logit_softcap}")
    parts.append(f"vocabulary {model.vocab_size}")
    parts.append("tied embeddings" if model.tie_word_embeddings else "untied embeddings")
    if model.num_mtp_layers:
        parts.append(f"{model.num_mtp_layers} MTP module(s)")
    return f"{model.name}: " + ", ".join(parts)


def settle(plan: Plan, runs: Layout, differences: list[str]) -> Layout:
    """``runs``, or when it breaks a schedule's rule (interleaving needs the micro-batches
    to be a multiple of pp, say) the same degrees on even stages under 1F1B, the reason
    added to ``differences``."""
    model, cluster, job, _ = inputs(plan)
    try:
        evaluate(model, cluster, job, runs)
    except PlannerError as exc:
        differences.append(f"{exc}; runs 1F1B on even stages instead")
        return uniform_1f1b(model, runs)
    return runs


def uniform_1f1b(model: ModelSpec, layout: Layout) -> Layout:
    """The layout's degrees on even stages under 1F1B, one recompute choice for all."""
    return Layout.uniform(
        model,
        pp=layout.pp,
        tp=layout.tp,
        cp=layout.cp,
        cp_comm_type=layout.cp_comm_type,
        cp_a2a_size=layout.cp_a2a_size,
        zero_hpz=layout.zero_hpz,
        param_offload=layout.param_offload,
        dp=layout.dp,
        ep=layout.ep,
        etp=layout.etp,
        zero=layout.zero,
        micro_batch=layout.micro_batch,
        schedule=DEFAULT_SCHEDULE,
        recompute=heaviest_choice(layout),
        ema=layout.ema,
        fp8_cache=layout.fp8_cache,
        sequence_parallel=layout.sequence_parallel,
        optimizer_offload=layout.optimizer_offload,
    )


def uniform_recompute(layout: Layout) -> str | None:
    """The one recompute choice every transformer layer takes, or None when they differ."""
    choices = set(layout.layer_recompute())
    return choices.pop() if len(choices) == 1 else None


def with_recompute(layout: Layout, choice: str) -> Layout:
    """The layout with every transformer layer (and MTP module) taking ``choice``."""
    stages = [
        s.model_copy(
            update={
                "blocks": [
                    b.model_copy(update={"recompute": choice})
                    if b.block.startswith(("layer.", "mtp."))
                    else b
                    for b in s.blocks
                ]
            }
        )
        for s in layout.stages
    ]
    return layout.model_copy(update={"stages": stages})


def without_host_offload(layout: Layout, target: str, differences: list[str]) -> Layout:
    """The layout with no activation offload (layer or fine-grained), for a target that
    has none: offloaded layers run without recompute, offload:<module> tags are dropped."""
    changed = False

    def keep(choice: str) -> str:
        nonlocal changed
        if choice == "offload":
            changed = True
            return "none"
        parts = [m for m in choice.split("+") if not m.startswith("offload:")]
        changed = changed or len(parts) < len(choice.split("+"))
        return "+".join(parts) or "none"

    stages = [
        s.model_copy(
            update={
                "blocks": [b.model_copy(update={"recompute": keep(b.recompute)}) for b in s.blocks]
            }
        )
        for s in layout.stages
    ]
    if not changed:
        return layout
    differences.append(
        f"activation offload: {target} has none for a layer's saved tensors; runs them in HBM"
    )
    return layout.model_copy(update={"stages": stages})


def without_hpz(layout: Layout, target: str, differences: list[str]) -> Layout:
    """The layout without ZeRO++'s secondary shard (``Layout.zero_hpz``), for a target that
    has none."""
    if layout.zero_hpz == 1:
        return layout
    differences.append(
        f"ZeRO++ hierarchical partitioning over {layout.zero_hpz} ranks: {target} has none; "
        "every parameter gather runs over the whole data-parallel group"
    )
    return layout.model_copy(update={"zero_hpz": 1})


def without_param_offload(layout: Layout, target: str, differences: list[str]) -> Layout:
    """The layout with ZeRO-3's weight shards in HBM, for a target that cannot keep them
    on the host."""
    if not layout.param_offload:
        return layout
    differences.append(f"ZeRO-3 weights on the host: {target} keeps none there; runs them in HBM")
    return layout.model_copy(update={"param_offload": False})


def heaviest_choice(layout: Layout) -> str:
    """A single recompute choice that saves no more than any layer's own: ``full`` if any
    layer recomputes fully, else the union of the modules recomputed anywhere."""
    choices = set(layout.layer_recompute())
    if "full" in choices:
        return "full"
    modules: set[str] = set()
    for c in choices:
        if c == "selective":
            modules.add("core_attn")
        elif c not in ("none", "offload"):  # an offloaded layer recomputes nothing
            modules.update(c.split("+"))
    return "+".join(sorted(modules)) if modules else "none"


from planner.export.deepspeed import deepspeed  # noqa: E402
from planner.export.megatron import megatron  # noqa: E402
from planner.export.torchtitan import torchtitan  # noqa: E402

# The writer of each framework's launch config, by the framework's name (every framework
# with a ``Launcher`` has one: ``planner.frameworks.LAUNCHERS``).
EXPORTERS: dict[str, Callable[[Plan], Export]] = {
    "megatron": megatron,
    "torchtitan": torchtitan,
    "deepspeed": deepspeed,
}

__all__ = ["EXPORTERS", "Export", "deepspeed", "megatron", "torchtitan"]
