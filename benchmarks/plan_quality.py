"""The planner's plans against layouts that experts published for the same jobs.

For each job it prints, with units:

- the plan (``planner.plan``, free search): its simulated step time
  (``planner.simulate(...).step_time_s``), its own estimate (``plan.estimate.step_time_s``) and
  their relative difference, and its memory peak against the cap and HBM;
- each expert layout (a published recipe's, ``planner.load_recipe``, or one derived from it):
  the same figures, from ``planner.simulate`` and ``planner.evaluate``; a layout whose
  predicted peak is over the memory cap is marked as not fitting, and it is still simulated.
  Both sides are framework-true: the plan takes only layouts the job's framework runs, and an
  expert layout with a schedule that framework lacks is priced with the schedule it runs on
  the same stages instead (DeepSeek-V3's DualPipe as 1F1B under Megatron-LM), said in its
  ``assumed`` note;
- the planner's best within that expert's own degrees (``planner.plan`` with ``tp``, ``pp``,
  ``dp``, ``ep`` and the schedule pinned in a ``SearchSpace``: "what is the best I can do with
  my degrees");
- where the source publishes one, the measured step time (a published throughput converted to
  seconds per step, with the conversion printed) and the error of each prediction of that
  layout against it;
- a verdict: is the plan at least as fast as every expert layout that fits, under simulate,
  and do the plan's estimate and its simulation agree within 3%.

A summary at the end counts the jobs that meet each target. Today's planner is expected to
miss some: this measures, it does not tune. Every golden figure (in the recipes and the jobs
table) is typed from the source named next to it (paper and table or section, or a
framework's published file and its path); none comes from this code's output.

Conventions for measured step times. A source that publishes tokens per second gives the step
directly (tokens per step / (tokens/s/GPU x GPUs)). A source that publishes FLOP/s is converted
back with that source's own FLOP count where it states one (Narayanan et al.'s equation (3);
Megatron-LM's ``num_floating_point_operations``), and otherwise with the planner's MFU
convention (``planner.estimate.model_flops_per_token``), as for Llama 3, whose paper does not
state its FLOP count. Where a source leaves a setting out (micro-batch size, virtual stages,
recompute, ZeRO stage), the layout's ``assumed`` note says what was taken.

Jobs (``--only`` takes their names) are data: ``benchmarks/plan_quality_jobs.yaml`` names for
each job the recipes (``models/recipes/<name>.yaml``) it compares with, whose model, cluster
and ``TrainingJob`` it runs, and the converter of each measured figure. Every published expert
layout is a recipe; a reference layout (DeepSeek-V3's recipe on 1024 GPUs, NVIDIA's Llama 3
70B preset weak-scaled to 512) is stated there as a recipe's with the fields it changes.

Run: ``.venv/bin/python benchmarks/plan_quality.py [--time-limit SECONDS] [--only NAME ...]
[--json]`` (one plan() call per job and one per expert layout, each up to ``--time-limit`` seconds).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

import planner
from planner.estimate import model_flops_per_token
from planner.frameworks import launcher

GiB = 2**30
AGREE = 0.03  # estimate vs simulation (planner.executor): the 3% target
SAME = 1e-9  # relative slack for "at least as fast" (float noise only)

# ---------------------------------------------------------------------------------------------
# Measured step times: each conversion returns (seconds per step, the conversion written out).

Converter = Callable[
    [planner.ModelSpec, planner.ClusterSpec, planner.TrainingJob], tuple[float, str]
]


def gpu_hours_per_tokens(gpu_hours: float, tokens: float, text: str) -> Converter:
    """A published cost in GPU hours per ``tokens`` training tokens."""

    def convert(
        model: planner.ModelSpec, cluster: planner.ClusterSpec, job: planner.TrainingJob
    ) -> tuple[float, str]:
        step = gpu_hours * 3600 * job.tokens_per_step / tokens / cluster.num_gpus
        return step, (
            f"{text}: {gpu_hours:,.0f} GPU h x 3600 s/h x {job.tokens_per_step:,} tokens/step "
            f"/ {tokens:.0e} tokens / {cluster.num_gpus:,} GPUs = {step:.2f} s"
        )

    return convert


def tokens_per_s_per_gpu(rate: float, text: str) -> Converter:
    """A published throughput in tokens per second per GPU."""

    def convert(
        model: planner.ModelSpec, cluster: planner.ClusterSpec, job: planner.TrainingJob
    ) -> tuple[float, str]:
        step = job.tokens_per_step / (rate * cluster.num_gpus)
        return step, (
            f"{text}: {job.tokens_per_step:,} tokens/step / ({rate:,.0f} tokens/s/GPU x "
            f"{cluster.num_gpus:,} GPUs) = {step:.2f} s"
        )

    return convert


def tflops_planner_convention(tflops: float, text: str) -> Converter:
    """A published model TFLOP/s per GPU whose source states no FLOP count: converted back with
    the planner's MFU convention (``planner.estimate.model_flops_per_token``)."""

    def convert(
        model: planner.ModelSpec, cluster: planner.ClusterSpec, job: planner.TrainingJob
    ) -> tuple[float, str]:
        per_token = model_flops_per_token(model, job.seq_len)
        step = per_token * job.tokens_per_step / (tflops * 1e12 * cluster.num_gpus)
        return step, (
            f"{text}: {per_token:.4g} FLOP/token (the planner's MFU convention, "
            f"planner.estimate.model_flops_per_token; the source states none) x "
            f"{job.tokens_per_step:,} tokens/step / ({tflops:g} TFLOP/s/GPU x "
            f"{cluster.num_gpus:,} GPUs) = {step:.2f} s"
        )

    return convert


def tflops_narayanan_eq3(tflops: float, vocab: int, text: str) -> Converter:
    """Narayanan et al. SC'21 (arXiv 2104.04473) section 5.1, equation (3): FLOPs per
    iteration F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), counting the GEMMs of forward,
    backward and the recompute forward pass (the paper's runs recompute activations). The
    paper's TFLOP/s per GPU is F / (iteration time x GPUs), so the step is F / (X x n)."""

    def convert(
        model: planner.ModelSpec, cluster: planner.ClusterSpec, job: planner.TrainingJob
    ) -> tuple[float, str]:
        b, s, layers, h = job.global_batch, job.seq_len, model.num_layers, model.hidden_size
        flops = 96 * b * s * layers * h**2 * (1 + s / (6 * h) + vocab / (16 * layers * h))
        step = flops / (tflops * 1e12 * cluster.num_gpus)
        return step, (
            f"{text}: F = 96 B s l h^2 (1 + s/6h + V/16lh) with B={b} sequences, s={s} "
            f"tokens, l={layers} layers, h={h} elements, V={vocab} tokens (the paper's eq. (3)) "
            f"= {flops:.4g} FLOP/step; / ({tflops:g} "
            f"TFLOP/s/GPU x {cluster.num_gpus:,} GPUs) = {step:.2f} s"
        )

    return convert


def tflops_megatron(tflops: float, padded_vocab: int, text: str) -> Converter:
    """A TFLOP/s figure Megatron-LM reports. Its FLOP count (megatron/training/training.py,
    num_floating_point_operations, tags core_r0.9.0 and core_r0.10.0) per step is
    12 B s L h^2 [ (1 + g/a + s/h) (d a / h) + (f/h) k (3/2 if SwiGLU) + V / (2 L h) ] with g
    query groups, a heads, d the head dim, f the expert (or MLP) width, k experts per token and
    V the padded vocabulary: no causal halving of attention, no recompute."""

    def convert(
        model: planner.ModelSpec, cluster: planner.ClusterSpec, job: planner.TrainingJob
    ) -> tuple[float, str]:
        b, s, layers, h = job.global_batch, job.seq_len, model.num_layers, model.hidden_size
        a, g, d = model.num_attention_heads, model.num_kv_heads, model.head_dim
        f = model.moe_ffn_hidden_size or model.ffn_hidden_size
        k = model.experts_per_token or 1
        glu = 1.5 if model.mlp == "swiglu" else 1.0
        bracket = (
            (1 + g / a + s / h) * (d * a / h) + (f / h) * k * glu + padded_vocab / (2 * layers * h)
        )
        flops = 12 * b * s * layers * h * h * bracket
        step = flops / (tflops * 1e12 * cluster.num_gpus)
        return step, (
            f"{text}: Megatron-LM's count 12 B s L h^2 [(1 + g/a + s/h) da/h + (f/h) k 3/2 + "
            f"V/2Lh] with B={b} sequences, s={s} tokens, L={layers} layers, h={h} elements, "
            f"a={a} heads, g={g} query groups, d={d} elements, f={f} elements, k={k} experts, "
            f"V={padded_vocab} tokens = {flops:.4g} FLOP/step; / ({tflops:g} TFLOP/s/GPU x "
            f"{cluster.num_gpus:,} GPUs) = {step:.2f} s"
        )

    return convert


# ---------------------------------------------------------------------------------------------
# The jobs and their expert layouts: plan_quality_jobs.yaml names, for each job, the published
# recipes (models/recipes) it compares with and how each one's measured figure converts.

JOBS_FILE = Path(__file__).with_name("plan_quality_jobs.yaml")
CONVERTERS: dict[str, Callable[..., Converter]] = {
    f.__name__: f
    for f in (
        gpu_hours_per_tokens,
        tokens_per_s_per_gpu,
        tflops_planner_convention,
        tflops_narayanan_eq3,
        tflops_megatron,
    )
}
JOB_KEYS = ("name", "source", "note", "gpus", "job", "experts")
EXPERT_KEYS = ("recipe", "name", "source", "assumed", "layout", "measured", "pin_virtual_stages")


@dataclass(frozen=True)
class Expert:
    """One expert layout: what it is, where it comes from, what it measured."""

    name: str
    source: str
    layout: planner.Layout
    kind: str = "published"  # "published": a run the source reports; "reference": derived
    assumed: str = ""  # settings the source leaves out, and what was taken
    measured: Converter | None = None
    pin_virtual_stages: bool = False  # the source states the virtual stages: keep them pinned


@dataclass(frozen=True)
class Job:
    name: str
    model: planner.ModelSpec
    cluster: planner.ClusterSpec
    job: planner.TrainingJob
    source: str
    experts: list[Expert]
    note: str = ""


def load_jobs(path: Path = JOBS_FILE) -> list[Job]:
    """The jobs of ``path``; a table that names an unknown key, converter or recipe, or whose
    recipes for one job disagree on what that job runs, fails here, before any job runs."""
    data = yaml.safe_load(path.read_text())
    try:
        return [_job(entry, f"{path.name}: job {entry.get('name')!r}") for entry in data["jobs"]]
    except KeyError as exc:
        raise planner.PlannerError(f"{path.name}: missing key {exc.args[0]!r}") from None


def _known(entry: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(entry) - set(keys))
    if unknown:
        raise planner.PlannerError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(keys)}")


def _job(entry: dict[str, Any], where: str) -> Job:
    """One job: the model, cluster and TrainingJob its recipes ran (with the GPU count and job
    fields a reference job changes), and its expert layouts."""
    _known(entry, JOB_KEYS, where)
    recipes = [planner.load_recipe(e["recipe"]) for e in entry["experts"]]
    first = recipes[0]
    for other in recipes[1:]:
        for what, a, b in (
            ("model", first.model, other.model),
            ("cluster", first.cluster, other.cluster),
            ("job", first.job, other.job),
        ):
            if a.model_dump() != b.model_dump():
                raise planner.PlannerError(
                    f"{where}: recipe {other.name!r} runs another {what} than recipe "
                    f"{first.name!r}: the experts of one job must share model, cluster and job"
                )
    cluster, job = first.cluster, first.job
    if "gpus" in entry:
        cluster = planner.load_cluster(cluster.name, gpus=entry["gpus"])
    if entry.get("job"):
        job = planner.TrainingJob(**{**job.model_dump(exclude_unset=True), **entry["job"]})
    derived = "gpus" in entry or bool(entry.get("job"))
    experts = [
        _expert(spec, recipe, cluster, derived=derived, where=f"{where}, recipe {recipe.name!r}")
        for spec, recipe in zip(entry["experts"], recipes, strict=True)
    ]
    return Job(
        name=entry["name"],
        model=first.model,
        cluster=cluster,
        job=job,
        source=entry.get("source", "{source}").replace("{source}", first.source),
        experts=experts,
        note=entry.get("note", ""),
    )


def _expert(
    spec: dict[str, Any],
    recipe: planner.Recipe,
    cluster: planner.ClusterSpec,
    *,
    derived: bool,
    where: str,
) -> Expert:
    """The recipe's layout (with the fields a reference layout changes) and its measured
    figure's conversion; a layout derived from the recipe's run has no measured figure."""
    _known(spec, EXPERT_KEYS, where)
    layout = recipe.layout
    if spec.get("layout"):
        layout = planner.Layout(**{**layout.model_dump(), **spec["layout"]})
        derived = True
    if layout.world_size != cluster.num_gpus:
        raise planner.PlannerError(
            f"{where}: layout tp*pp*dp={layout.world_size} must equal the job's "
            f"{cluster.num_gpus} GPUs"
        )
    if derived and "measured" in spec:
        raise planner.PlannerError(
            f"{where}: measured: a layout or job derived from the recipe's has no measured figure "
            "(its source measured another run)"
        )
    return Expert(
        name=spec["name"],
        source=spec.get("source", "{source}").replace("{source}", recipe.source),
        layout=layout,
        kind="reference" if derived else "published",
        assumed=spec.get("assumed", recipe.assumed),
        measured=_converter(spec["measured"], where) if "measured" in spec else None,
        pin_virtual_stages=bool(spec.get("pin_virtual_stages", False)),
    )


def _converter(spec: dict[str, Any], where: str) -> Converter:
    """``spec``'s converter (``convert``: its name) bound to the other keys as its arguments."""
    args = dict(spec)
    name = args.pop("convert")
    if name not in CONVERTERS:
        raise planner.PlannerError(
            f"{where}: measured.convert={name!r}: unknown; known: {', '.join(CONVERTERS)}"
        )
    make = CONVERTERS[name]
    try:
        inspect.signature(make).bind(**args)
    except TypeError:
        raise planner.PlannerError(
            f"{where}: measured: {name} takes {', '.join(inspect.signature(make).parameters)}, "
            f"not {', '.join(args)}"
        ) from None
    return make(**args)


JOBS: list[Job] = load_jobs()

# ---------------------------------------------------------------------------------------------
# Running one job.


def describe(layout: planner.Layout) -> str:
    """Degrees, schedule, stage sizes and recompute in one line."""
    layers = []
    recompute: Counter[str] = Counter()
    for stage in layout.stages:
        count = 0
        for block in stage.blocks:
            if block.block.startswith("layer."):
                count += 1
                recompute[block.recompute] += 1
        layers.append(count)
    total = sum(recompute.values())
    rec = ", ".join(f"{k} on {n}/{total} layers" for k, n in recompute.most_common())
    low, high = min(layers), max(layers)
    split = f"{low} layers per chunk" if low == high else f"{low}-{high} layers per chunk"
    v = f" v{layout.virtual_stages}" if layout.virtual_stages > 1 else ""
    return (
        f"tp{layout.tp} pp{layout.pp} dp{layout.dp} ep{layout.ep} ZeRO-{layout.zero} "
        f"mb{layout.micro_batch} {layout.schedule}{v}, {split}, recompute {rec}"
    )


def cap_bytes(est: planner.Estimate) -> int:
    """The planner's memory cap for a rank's peak (usable HBM less its margin where the
    estimate states one, else nominal HBM)."""
    return int(getattr(est, "cap_bytes", est.hbm_bytes))


def cost(
    model: planner.ModelSpec,
    cluster: planner.ClusterSpec,
    job: planner.TrainingJob,
    layout: planner.Layout,
    estimate: planner.Estimate | None = None,
) -> dict[str, Any]:
    """Simulate and evaluate one layout: step times (s), their difference, memory (GiB)."""
    est = estimate if estimate is not None else planner.evaluate(model, cluster, job, layout)
    sim = planner.simulate(model, cluster, job, layout)
    sim_peak = max(sim.peak_bytes)
    cap = cap_bytes(est)
    return {
        "layout": describe(layout),
        "simulate_s": sim.step_time_s,
        "estimate_s": est.step_time_s,
        "estimate_vs_simulate": est.step_time_s / sim.step_time_s - 1,
        "peak_gib": est.peak_bytes / GiB,
        "simulate_peak_gib": sim_peak / GiB,
        "cap_gib": cap / GiB,
        "hbm_gib": est.hbm_bytes / GiB,
        "fits": bool(est.fits) and sim_peak <= cap,
        "mfu": est.mfu,
    }


def run_plan(
    model: planner.ModelSpec,
    cluster: planner.ClusterSpec,
    job: planner.TrainingJob,
    space: planner.SearchSpace | None,
    time_limit: float,
    *,
    explain: bool,
) -> dict[str, Any]:
    """plan(), then simulate its layout; a PlannerError or an infeasible answer is reported."""
    started = time.perf_counter()
    try:
        plan = planner.plan(
            model, cluster, job, space, time_limit_s=time_limit, explain_infeasible=explain
        )
    except planner.PlannerError as exc:
        return {"status": "error", "error": str(exc), "wall_s": time.perf_counter() - started}
    wall = time.perf_counter() - started
    out: dict[str, Any] = {"status": plan.status, "gap": plan.gap, "wall_s": wall}
    if plan.status == "infeasible" or plan.layout is None or plan.estimate is None:
        out["status"] = "infeasible"
        if plan.explanation is not None:
            out["error"] = plan.explanation.summary
        return out
    out.update(cost(model, cluster, job, plan.layout, plan.estimate))
    return out


def pinned_space(layout: planner.Layout, expert: Expert) -> planner.SearchSpace:
    """The expert's own degrees and schedule; ZeRO, micro-batch, recompute (and virtual stages
    the source leaves unstated) are the planner's to choose."""
    return planner.SearchSpace(
        tp=[layout.tp],
        cp=[layout.cp],
        pp=[layout.pp],
        dp=[layout.dp],
        ep=[layout.ep],
        etp=[layout.etp],
        schedules=[layout.schedule],
        virtual_stages=[layout.virtual_stages] if expert.pin_virtual_stages else None,
        # the expert's FP8 cache is open to the search within its degrees
        fp8_cache=[False, True] if layout.fp8_cache else None,
    )


def run_job(spec: Job, time_limit: float) -> dict[str, Any]:
    model, cluster, job = spec.model, spec.cluster, spec.job
    result: dict[str, Any] = {
        "name": spec.name,
        "model": model.name,
        "cluster": f"{cluster.num_gpus} x {cluster.name}",
        "job": {
            "seq_len": job.seq_len,
            "global_batch": job.global_batch,
            "tokens_per_step": job.tokens_per_step,
            "compute_dtype": job.compute_dtype,
            "moment_dtype": job.moment_dtype,
        },
        "source": spec.source,
        "note": spec.note,
        "plan": run_plan(model, cluster, job, None, time_limit, explain=True),
        "experts": [],
    }
    for expert in spec.experts:
        row: dict[str, Any] = {
            "name": expert.name,
            "kind": expert.kind,
            "source": expert.source,
            "assumed": expert.assumed,
        }
        layout = expert.layout
        # Framework-true: the expert's layout as the job's framework runs it (a schedule it
        # lacks becomes the one it runs on the same stages, Launcher.runs_instead).
        runs = launcher(job.framework)
        if runs is not None and layout.schedule not in runs.schedules:
            instead = runs.runs_instead(layout.schedule)
            row["assumed"] = (
                f"{row['assumed']}; " if row["assumed"] else ""
            ) + f"{job.framework} runs {instead} in place of {layout.schedule}"
            layout = layout.model_copy(update={"schedule": instead})
        try:
            row.update(cost(model, cluster, job, layout))
        except planner.PlannerError as exc:
            row["error"] = str(exc)
            result["experts"].append(row)
            continue
        if expert.measured is not None:
            step, how = expert.measured(model, cluster, job)
            row["measured_s"] = step
            row["measured_how"] = how
            row["estimate_error"] = row["estimate_s"] / step - 1
            row["simulate_error"] = row["simulate_s"] / step - 1
        try:
            space = pinned_space(layout, expert)
        except planner.PlannerError as exc:
            row["best_within_degrees"] = {"status": "error", "error": str(exc), "wall_s": 0.0}
        else:
            row["best_within_degrees"] = run_plan(
                model, cluster, job, space, time_limit, explain=False
            )
        result["experts"].append(row)
    result["verdict"] = verdict(result)
    return result


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    plan = result["plan"]
    fitting = [e for e in result["experts"] if e.get("fits")]
    has_plan = "simulate_s" in plan
    out: dict[str, Any] = {"expert_layouts": len(result["experts"]), "fitting": len(fitting)}
    if not has_plan:
        out["at_least_as_fast"] = False
        out["agrees"] = False
        out["why"] = f"no plan ({plan['status']})"
        return out
    if fitting:
        fastest = min(e["simulate_s"] for e in fitting)
        out["fastest_fitting_expert_s"] = fastest
        out["at_least_as_fast"] = plan["simulate_s"] <= fastest * (1 + SAME)
        out["plan_vs_fastest_expert"] = plan["simulate_s"] / fastest - 1
    else:
        out["at_least_as_fast"] = None  # nothing to compare with
    every = [e for e in result["experts"] if "simulate_s" in e]
    if every:
        out["plan_vs_fastest_expert_any"] = (
            plan["simulate_s"] / min(e["simulate_s"] for e in every) - 1
        )
    out["agrees"] = abs(plan["estimate_vs_simulate"]) <= AGREE
    return out


# ---------------------------------------------------------------------------------------------
# Printing.


def fmt_costed(row: dict[str, Any]) -> str:
    fits = "fits" if row["fits"] else "DOES NOT FIT"
    peak = f"peak {row['peak_gib']:.1f} GiB"
    if abs(row["simulate_peak_gib"] - row["peak_gib"]) > 0.05:
        peak += f" (simulated {row['simulate_peak_gib']:.1f} GiB)"
    return (
        f"simulate {row['simulate_s']:.3f} s, estimate {row['estimate_s']:.3f} s "
        f"({row['estimate_vs_simulate']:+.2%} vs simulate); {peak} vs cap "
        f"{row['cap_gib']:.1f} GiB of {row['hbm_gib']:.0f} GiB HBM: {fits}; MFU {row['mfu']:.1%}"
    )


def fmt_plan(label: str, plan: dict[str, Any], indent: str = "  ") -> list[str]:
    if "simulate_s" not in plan:
        why = f": {plan['error']}" if plan.get("error") else ""
        status = "NO PLAN (PlannerError)" if plan["status"] == "error" else plan["status"].upper()
        return [f"{indent}{label}: {status} after {plan['wall_s']:.1f} s{why}"]
    gap = f", gap {plan['gap']:.1%}" if plan.get("gap") is not None else ""
    return [
        f"{indent}{label} [{plan['status']}{gap}, {plan['wall_s']:.1f} s wall]: {plan['layout']}",
        f"{indent}  {fmt_costed(plan)}",
    ]


def print_job(res: dict[str, Any]) -> None:
    j = res["job"]
    print(
        f"\n== {res['name']}: {res['model']} on {res['cluster']} (seq {j['seq_len']} tokens, "
        f"global batch {j['global_batch']} sequences = {j['tokens_per_step']:,} tokens, "
        f"{j['compute_dtype']} GEMMs, {j['moment_dtype']} moments) =="
    )
    print(f"  source: {res['source']}")
    if res["note"]:
        print(f"  note: {res['note']}")
    for line in fmt_plan("plan", res["plan"]):
        print(line)
    for e in res["experts"]:
        print(f"  expert [{e['kind']}] {e['name']}")
        print(f"    source: {'as the job' if e['source'] == res['source'] else e['source']}")
        if e["assumed"]:
            print(f"    assumed: {e['assumed']}")
        if "error" in e:
            print(f"    cannot be stated or costed: {e['error']}")
            continue
        print(f"    layout: {e['layout']}")
        print(f"    {fmt_costed(e)}")
        if "measured_s" in e:
            print(f"    measured {e['measured_s']:.3f} s/step ({e['measured_how']})")
            print(
                f"    error against measured: estimate {e['estimate_error']:+.1%}, simulate "
                f"{e['simulate_error']:+.1%}"
            )
        else:
            print("    measured: none published for this job")
        best = e.get("best_within_degrees")
        if best is not None:
            for line in fmt_plan("planner's best within these degrees", best, "    "):
                print(line)
            if "simulate_s" in best:
                print(
                    f"      vs this expert layout under simulate: "
                    f"{best['simulate_s'] / e['simulate_s'] - 1:+.1%}"
                )
    v = res["verdict"]
    plan = res["plan"]
    if "simulate_s" not in plan:
        why = "PlannerError" if plan["status"] == "error" else plan["status"]
        print(f"  VERDICT: no plan ({why}): both targets missed")
        return
    if v["at_least_as_fast"] is None:
        fast = "no expert layout fits, nothing to compare under the target"
    else:
        word = "yes" if v["at_least_as_fast"] else "NO"
        fast = (
            f"{word}, {plan['simulate_s']:.3f} s vs {v['fastest_fitting_expert_s']:.3f} s "
            f"({v['plan_vs_fastest_expert']:+.1%}) over {v['fitting']} of "
            f"{v['expert_layouts']} expert layouts that fit"
        )
    if "plan_vs_fastest_expert_any" in v:
        fast += (
            f"; against every expert layout, fitting or not: {v['plan_vs_fastest_expert_any']:+.1%}"
        )
    agree = "yes" if v["agrees"] else "NO"
    print(f"  VERDICT: plan at least as fast as every fitting expert layout (simulate): {fast}")
    print(
        f"  VERDICT: plan's estimate within {AGREE:.0%} of its simulation: {agree} "
        f"({plan['estimate_vs_simulate']:+.2%})"
    )


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(results)
    with_plan = [r for r in results if "simulate_s" in r["plan"]]
    # Jobs with at least one expert layout that fits: the target applies; no plan is a miss.
    compared = [r for r in results if r["verdict"].get("fitting", 0) > 0]
    fast = [r for r in compared if r["verdict"].get("at_least_as_fast")]
    agree = [r for r in results if r["verdict"].get("agrees")]
    experts = [e for r in results for e in r["experts"] if "simulate_s" in e]
    fitting = [e for e in experts if e["fits"]]
    best_cmp = [e for e in fitting if "simulate_s" in (e.get("best_within_degrees") or {})]
    best_ok = [
        e
        for e in best_cmp
        if e["best_within_degrees"]["simulate_s"] <= e["simulate_s"] * (1 + SAME)
    ]
    measured = [e for e in experts if "measured_s" in e]
    return {
        "jobs": n,
        "jobs_with_plan": len(with_plan),
        "plan_at_least_as_fast": len(fast),
        "jobs_compared": len(compared),
        "jobs_no_fitting_expert": len(results) - len(compared),
        "plan_agrees": len(agree),
        "expert_layouts": len(experts),
        "expert_layouts_fit": len(fitting),
        "experts_agreeing": len([e for e in experts if abs(e["estimate_vs_simulate"]) <= AGREE]),
        "best_within_degrees_compared": len(best_cmp),
        "best_within_degrees_at_least_as_fast": len(best_ok),
        "measured_layouts": len(measured),
        "mean_abs_estimate_error": (
            sum(abs(e["estimate_error"]) for e in measured) / len(measured) if measured else None
        ),
        "mean_abs_simulate_error": (
            sum(abs(e["simulate_error"]) for e in measured) / len(measured) if measured else None
        ),
    }


def print_summary(results: list[dict[str, Any]], summary: dict[str, Any], wall: float) -> None:
    print("\n== Table (step times in seconds; differences in %) ==")
    print(
        "plan sim / plan est: the plan's simulated and estimated step; est-sim: their difference; "
        "expert sim: each expert layout's simulated step; fits: within the memory cap; measured: "
        "the published step; best@deg: the planner's best within that expert's degrees "
        "(simulated); fast: plan at least as fast as every fitting expert layout; agrees: plan's "
        f"estimate within {AGREE:.0%} of its simulation"
    )
    head = (
        f"{'job':<24} {'plan sim':>9} {'plan est':>9} {'est-sim':>8} {'expert sim':>11} "
        f"{'fits':>5} {'measured':>9} {'best@deg':>9} {'fast':>5} {'agrees':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        p, v = r["plan"], r["verdict"]
        psim = f"{p['simulate_s']:.3f}" if "simulate_s" in p else p["status"][:9]
        pest = f"{p['estimate_s']:.3f}" if "simulate_s" in p else "-"
        diff = f"{p['estimate_vs_simulate']:+.2%}" if "simulate_s" in p else "-"
        fast = {True: "yes", False: "NO", None: "n/a"}[v.get("at_least_as_fast")]
        agree = "yes" if v.get("agrees") else "NO"
        experts = r["experts"] or [{}]
        for i, e in enumerate(experts):
            esim = f"{e['simulate_s']:.3f}" if "simulate_s" in e else "error"
            fits = ("yes" if e.get("fits") else "NO") if "simulate_s" in e else "-"
            meas = f"{e['measured_s']:.3f}" if "measured_s" in e else "-"
            best = e.get("best_within_degrees") or {}
            bsim = (
                f"{best['simulate_s']:.3f}" if "simulate_s" in best else best.get("status", "-")[:9]
            )
            if i == 0:
                print(
                    f"{r['name']:<24} {psim:>9} {pest:>9} {diff:>8} {esim:>11} {fits:>5} "
                    f"{meas:>9} {bsim:>9} {fast:>5} {agree:>6}"
                )
            else:
                print(
                    f"{'':<24} {'':>9} {'':>9} {'':>8} {esim:>11} {fits:>5} {meas:>9} "
                    f"{bsim:>9} {'':>5} {'':>4}"
                )
    s = summary
    print("\n== Summary ==")
    print(
        f"- plan at least as fast as every fitting expert layout (simulate): "
        f"{s['plan_at_least_as_fast']} of {s['jobs_compared']} jobs with a fitting expert layout "
        f"({s['jobs_no_fitting_expert']} jobs have none that fits, so the target does not apply; "
        f"{s['jobs'] - s['jobs_with_plan']} of {s['jobs']} jobs got no plan)"
    )
    print(
        f"- plan's estimate within {AGREE:.0%} of its simulation: {s['plan_agrees']} of "
        f"{s['jobs']} jobs"
    )
    print(
        f"- expert layouts that fit the planner's memory cap: {s['expert_layouts_fit']} of "
        f"{s['expert_layouts']}; their estimate within {AGREE:.0%} of simulation: "
        f"{s['experts_agreeing']} of {s['expert_layouts']}"
    )
    print(
        f"- planner's best within an expert's degrees at least as fast as that (fitting) expert "
        f"layout: {s['best_within_degrees_at_least_as_fast']} of "
        f"{s['best_within_degrees_compared']}"
    )
    if s["measured_layouts"]:
        print(
            f"- against measured step times ({s['measured_layouts']} layouts): mean |error| "
            f"estimate {s['mean_abs_estimate_error']:.1%}, simulate "
            f"{s['mean_abs_simulate_error']:.1%}"
        )
    print(f"- wall time {wall:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--time-limit", type=float, default=10.0, help="seconds per plan() call (default 10)"
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these jobs")
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    args = parser.parse_args(argv)
    names = [j.name for j in JOBS]
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            parser.error(f"unknown job {unknown[0]!r}; jobs: {', '.join(names)}")
    jobs = [j for j in JOBS if not args.only or j.name in args.only]
    started = time.perf_counter()
    results = []
    for spec in jobs:
        try:
            res = run_job(spec, args.time_limit)
        except Exception as exc:  # a benchmark goes on: report the job and the next one runs
            res = {
                "name": spec.name,
                "model": spec.model.name,
                "cluster": f"{spec.cluster.num_gpus} x {spec.cluster.name}",
                "source": spec.source,
                "error": f"{type(exc).__name__}: {exc}",
                "plan": {"status": "error", "error": f"{type(exc).__name__}: {exc}", "wall_s": 0.0},
                "experts": [],
                "verdict": {"at_least_as_fast": False, "agrees": False, "why": "error"},
            }
            if not args.json:
                print(f"\n== {spec.name}: ERROR {res['error']} ==")
        else:
            if not args.json:
                print_job(res)
        if not args.json:
            sys.stdout.flush()
        results.append(res)
    wall = time.perf_counter() - started
    summary = summarise(results)
    if args.json:
        print(json.dumps({"jobs": results, "summary": summary, "wall_s": wall}, indent=1))
    else:
        print_summary(results, summary, wall)
    return 0


if __name__ == "__main__":
    sys.exit(main())
