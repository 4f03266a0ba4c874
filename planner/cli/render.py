"""Text the commands share: the per-rank memory table and its summary, the step-time table, a
plan's decisions and runners-up, where each parallel group runs (NVLink or the network), an
explanation's fixes in the CLI's own flags, short layout and catalog cells, and the memory and
step-time pictures (--plot)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from planner.cli.arguments import SPACE_FLAGS
from planner.costs.comm import placements
from planner.costs.memory import BUCKETS, eager_ops
from planner.errors import PlannerError
from planner.estimate import Estimate
from planner.layout import Layout
from planner.plots import picture_paths
from planner.solve.result import Plan
from planner.specs import ClusterSpec, TrainingJob

GiB = 2**30
SHORT = {"optimizer": "optim", "activations": "activ", "fragmentation": "frag", "context": "ctx"}


def print_memory(name: str, layout: Layout, est: Estimate, margin: float) -> None:
    """Each pipeline rank's memory by bucket, the peak against the cap, and host RAM used."""
    console = Console(width=max(Console().width, 132))
    title = (
        f"{name}: per-rank memory (GiB) - {layout.degrees()} "
        f"zero={layout.zero} micro_batch={layout.micro_batch} "
        f"x{est.num_microbatches} {layout.schedule}"
    )
    table = Table(title=title)
    table.add_column("rank", justify="right")
    table.add_column("blocks", no_wrap=True)
    for bucket in BUCKETS:
        table.add_column(SHORT.get(bucket, bucket), justify="right")
    table.add_column("peak", justify="right")
    table.add_column("of usable", justify="right")
    for s in est.memory:
        blocks = _summarise(layout, s.chunks)
        cells = [f"{s.buckets[b] / GiB:.2f}" for b in BUCKETS]
        share = s.peak_bytes / est.usable_hbm_bytes
        style = "red" if s.peak_bytes > est.cap_bytes else ""
        table.add_row(
            str(s.stage), blocks, *cells, f"{s.peak_bytes / GiB:.2f}", f"{share:.0%}", style=style
        )
    console.print(table)
    console.print(
        f"{_memory_summary(est, margin)} Includes weights, gradients, optimizer state, EMA, "
        "saved activations of the schedule's in-flight micro-batches, communication buffers "
        "and GEMM workspaces, CUDA context and fragmentation; ignores optimizer-step "
        "temporaries."
    )
    freed = max((s.step_grad_bytes for s in est.memory if not s.buckets["grads"]), default=0)
    if freed:
        console.print(
            f"Gradients: {freed / GiB:.2f} GiB per rank are freed after each step and made "
            "again in its first backward; the peak comes before that backward, so they are "
            "not in it."
        )
    if est.memory_risk:
        console.print(f"Risk of running out of memory: {est.memory_risk}.")
    host = max(s.host_bytes for s in est.memory)
    if host:
        held = []
        if layout.optimizer_offload:
            held.append(f"{layout.optimizer_offload:.0%} of the optimizer state")
        if layout.param_offload:
            held.append("the ZeRO-3 weight shards")
        if layout.ema == "host":
            held.append("the EMA")
        offloaded = sum("offload" in b.recompute for s in layout.stages for b in s.blocks)
        if offloaded:  # whole layers (offload) or module inputs (offload:<module>)
            held.append(f"activations offloaded from {offloaded} layers")
        console.print(
            f"Host RAM: up to {host / GiB:.2f} GiB per rank for {' and '.join(held)} (not in "
            "HBM; checked against the node's RAM with every GPU of the node at that figure)."
        )


def _memory_summary(est: Estimate, margin: float) -> str:
    """The peak against usable HBM and the cap, and the headroom the heaviest rank keeps."""
    usable, cap = est.usable_hbm_bytes / GiB, est.cap_bytes / GiB
    top = max(est.memory, key=lambda s: s.peak_bytes)
    head = (
        f"Peak {est.peak_bytes / GiB:.2f} GiB per GPU (allocated {top.allocated_bytes / GiB:.2f}"
        f" GiB in tensors, reserved {top.reserved_bytes / GiB:.2f} GiB by the caching "
        f"allocator, plus {top.buckets['context'] / GiB:.2f} GiB of CUDA context and "
        f"{top.nccl_bytes / GiB:.2f} GiB of NCCL buffers); usable "
        f"HBM {usable:.2f} GiB (of "
        f"{est.hbm_bytes / GiB:.4g} GiB), cap {cap:.2f} GiB after the {margin * 100:g}% margin for "
        "the memory model's error:"
    )
    if est.fits:
        return (
            f"{head} fits, the heaviest rank leaves {est.headroom:.1%} of usable HBM "
            f"({usable - est.peak_bytes / GiB:.2f} GiB) free."
        )
    return (
        f"{head} does NOT fit, the heaviest rank is {est.peak_bytes / GiB - cap:.2f} GiB over "
        f"the cap ({est.headroom:.1%} of usable HBM left free)."
    )


def _summarise(layout: Layout, chunks: list[int]) -> str:
    """``E L0-3 | L58-60 mtp.0 head``: each chunk's blocks, layer runs shortened."""
    out = []
    for c in chunks:
        names = [b.block for b in layout.stages[c].blocks]
        layers = [int(n.split(".")[1]) for n in names if n.startswith("layer.")]
        parts = ["E"] if names[0] == "embedding" else []
        if layers:
            parts.append(f"L{layers[0]}-{layers[-1]}" if len(layers) > 1 else f"L{layers[0]}")
        parts += [n for n in names if n.startswith("mtp.") or n == "head"]
        out.append(" ".join(parts))
    return " | ".join(out)


def print_time(
    est: Estimate,
    job: TrainingJob,
    layout: Layout | None = None,
    cluster: ClusterSpec | None = None,
) -> None:
    """The step time by part on the critical rank, throughput and MFU, and what is priced."""
    framework = job.framework
    kernel = " (attention as FlashAttention-2)" if job.attention_kernel == "fa2" else ""
    if cluster is not None:
        kernel += (
            f", GEMMs and attention at {cluster.sustained_tensor_rate:.3g} of a short timing's "
            f"rate (the SM clock a run sustains at {cluster.name}'s power limit)"
            if cluster.sustained_tensor_rate < 1
            else f", GEMMs and attention at a short timing's rate ({cluster.name}'s slowing at "
            "its power limit not measured)"
        )
    if layout is not None and eager_ops(job, layout) == "torchtitan":
        norm = ", its own RMSNorm class (--eager-norm)" if job.eager_norm else ""
        kernel += (
            f" and torchtitan's model code uncompiled, its SwiGLU, rotary embedding{norm} and "
            "loss a kernel per op (--compiled-model where compile.enable holds the model)"
        )
    reduction = (
        "the whole gradient reduction, after the last backward (--exposed-grad-reduce)"
        if job.exposed_grad_reduce
        else "exposed gradient reduction"
    )
    console = Console(width=max(Console().width, 100))
    table = Table(title=f"step time: {est.step_time_s:.3f} s")
    table.add_column("part")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for part, seconds in est.breakdown.items():
        table.add_row(part, f"{seconds:.3f}", f"{seconds / est.step_time_s:.1%}")
    console.print(table)
    console.print(
        f"Parts of the critical pipeline rank {est.critical_rank}. "
        f"{est.tokens_per_s:,.0f} tokens/s, {est.tflops_per_gpu:.0f} model TFLOP/s per GPU, MFU "
        f"{est.mfu:.1%} (6 x active matmul parameters + causal attention per token, against "
        f"the dense BF16 peak). Includes compute at the machine catalog's efficiencies{kernel}, "
        f"the host's time per kernel where it binds, recompute, "
        f"the tensor-parallel and expert all-to-all communication {framework} leaves exposed, "
        f"the context-parallel ring's sends attention does not hide and its all-to-alls, "
        f"pipeline sends and bubble, links and SMs shared by overlapped collectives, "
        f"{reduction}, ZeRO-1/2's weight all-gather and the optimizer step; ignores "
        f"stragglers, failures, data loading and checkpointing. Expected error: "
        f"{est.expected_error}."
    )
    if est.mfu_note:
        console.print(f"[bold yellow]Warning[/]: {est.mfu_note}.")


def groups_line(layout: Layout, cluster: ClusterSpec) -> str:
    """Where each parallel group of ``layout`` runs: inside one NVLink domain (NVLink) or
    across domains (InfiniBand), e.g. ``ep 64: inside one NVLink domain of 64 GPUs``."""
    domain, node = cluster.domain_gpus, cluster.gpus_per_node
    if domain == node:
        where = f"NVLink domain: one node of {min(node, cluster.num_gpus)} GPUs"
    else:
        where = (
            f"NVLink domain: {domain} GPUs as placed, {domain // node} nodes of {node} (the "
            f"machine's domain holds {cluster.nvlink_domain_gpus})"
        )
    parts = "; ".join(p.describe(domain) for p in placements(layout, cluster))
    return f"Groups ({where}): {parts}."


def print_groups(layout: Layout, cluster: ClusterSpec) -> None:
    """``groups_line``, printed."""
    Console(width=max(Console().width, 132)).print(groups_line(layout, cluster))


def print_decisions(layout: Layout, est: Estimate, job: TrainingJob) -> None:
    """Each stage's blocks and recompute, where the EMA lives, and why a stage holds no
    transformer layer."""
    console = Console(width=max(Console().width, 132))
    table = Table(title="decisions per stage: blocks and their recompute")
    for col in ("stage", "rank", "blocks", "layers", "recompute (layers)"):
        left = col in ("blocks", "recompute (layers)")
        table.add_column(col, justify="left" if left else "right")
    ranks = {c: s.stage for s in est.memory for c in s.chunks}
    empty = []
    for i, stage in enumerate(layout.stages):
        kinds: dict[str, int] = {}
        for b in stage.blocks:
            if b.block.startswith(("layer.", "mtp.")):
                kinds[b.recompute] = kinds.get(b.recompute, 0) + 1
        n = sum(b.block.startswith("layer.") for b in stage.blocks)
        if n == 0:
            empty.append(i)
        table.add_row(
            str(i),
            str(ranks.get(i, "")),
            _summarise(layout, [i]),
            str(n),
            ", ".join(f"{k} x{v}" for k, v in kinds.items()) or "-",
        )
    console.print(table)
    notes = []
    if job.ema:
        where = "host RAM" if layout.ema == "host" else "HBM (the ema bucket)"
        notes.append(f"EMA ({job.ema}) kept in {where}.")
    notes.append(
        f"Headroom kept: {job.memory_margin:.0%} of usable HBM below the cap for the memory "
        f"model's error; the heaviest rank leaves {est.headroom:.1%} free."
    )
    for i in empty:
        notes.append(
            f"Stage {i} holds no transformer layer, only {_summarise(layout, [i])}: its "
            "embedding or head work (and MTP) is that stage's share of each micro-batch; the "
            "search found no faster layout that gives it a layer."
        )
    console.print(" ".join(notes))


def print_runners_up(result: Plan) -> None:
    """The next layouts the search found, with what each costs against the plan."""
    if not result.alternatives or result.estimate is None:
        return
    console = Console(width=max(Console().width, 132))
    base = result.estimate.step_time_s
    table = Table(title="runners-up (other degrees or schedules the search found)")
    simulated = any(alt.simulated_step_s is not None for alt in result.alternatives)
    columns = ("layout", "step s", "vs plan", "peak GiB") + (("simulated s",) if simulated else ())
    for col in columns:
        table.add_column(col, justify="left" if col == "layout" else "right")
    for alt in result.alternatives:
        sim = alt.simulated_step_s
        table.add_row(
            alt.layout.shape(),
            f"{alt.step_time_s:.3f}",
            f"{alt.step_time_s / base - 1:+.1%}",
            f"{alt.peak_bytes / GiB:.2f}",
            *((f"{sim:.3f}" if sim is not None else "-",) if simulated else ()),
        )
    console.print(table)


def cli_words(text: str) -> str:
    """An explanation's fix in the CLI's own flags: "free SearchSpace.tp" becomes "drop
    --tp", "SearchSpace.optimizer_offload=[0, 1]" becomes "--optimizer-offload 0 1"."""
    text = text.replace("SearchSpace.optimizer_offload=[0, 1]", "--optimizer-offload 0 1")
    text = text.replace(
        "SearchSpace.recompute=[none, offload], pp=1", "--recompute none offload --pp 1"
    )
    for field, flag in SPACE_FLAGS.items():
        text = text.replace(f"free SearchSpace.{field})", f"drop {flag})")
    return text


def degrees(layout: Layout) -> str:
    """``tp8 pp16 dp64 ep1 ZeRO-2 mb1 interleaved v8 recompute none``."""
    recompute = sorted(set(layout.layer_recompute()))
    return (
        f"{layout.degrees('')} ZeRO-{layout.zero} mb{layout.micro_batch} {layout.schedule} "
        f"v{layout.virtual_stages} "
        f"recompute {'/'.join(recompute)}"
    )


def catalog_cell(key: str, value: object) -> str:
    """A ``models`` or ``clusters`` table cell: parameters in billions, HBM to its digits."""
    if key == "mtp_params" and value == 0:
        return "-"
    if key in ("params", "active_params", "mtp_params") and isinstance(value, int):
        return f"{value / 1e9:,.1f}"
    if key == "usable_hbm_gib" and isinstance(value, float):
        return f"{value:.2f}"
    return f"{value:.0f}" if isinstance(value, float) else str(value)


def plot_estimate(prefix: str, est: Estimate, name: str) -> None:
    """Write the memory and step-time pictures of ``--plot PREFIX``; name them on stderr."""
    from planner.plots import plot_memory, plot_step_time

    memory_path, time_path = picture_paths(prefix, option="--plot")
    memory = writable(memory_path, plot_memory, est, title=f"{name}: memory per pipeline rank")
    title = f"{name}: step time {est.step_time_s:.3f} s by part"
    step = writable(time_path, plot_step_time, est, title=title)
    print(f"pictures: {memory}, {step}", file=sys.stderr)


def writable(path: str | Path, draw: Any, *args: Any, **kwargs: Any) -> str:
    """Draw a picture to ``path``; a path that cannot be written is a --plot error."""
    try:
        return str(draw(*args, path, **kwargs))
    except OSError as exc:
        raise PlannerError(f"--plot={str(path)!r}: cannot write ({exc.strerror})") from None
