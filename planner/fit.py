"""Fit a cluster's physical constants to step times measured on it: ``fit_profile``.

A user who has run a few layouts on their own cluster gives the measured seconds per step;
the fit finds the one set of constants (achieved fractions of peak, per-kernel and per-message
overheads) under which ``planner.evaluate`` reproduces those runs best, within physical
bounds, and says how well it predicts runs it did not see (k-fold cross-validation).

The constants fitted (``CONSTANTS``), each as the unit in which a step is linear in it:

- ``achieved.gemm``, ``achieved.attention``, ``achieved.memory_bound``, ``achieved.nvlink``,
  ``achieved.ib``: fractions of the datasheet's peak; a step is linear in their inverses
  (seconds per unit of work scale with 1/fraction). Bounds: no fraction above 1 (line rate),
  GEMMs no higher than the cluster's ``achieved_max["gemm"]`` (the best matmul rate measured
  on that GPU, cited in its catalog file) where it states one; none below
  ``FRACTION_FLOORS`` (under the slowest rate measured for that kind at training shapes);
- ``kernel_overhead_s``, ``host_overhead_s``, ``nvlink_latency_s``, ``ib_latency_s``: seconds,
  at least 1 us each (never free), at most ``SECONDS_CEILINGS`` (above every measured figure).
  The host's time per kernel is fitted once per framework among the runs
  (``constants_for``; written to ``ClusterSpec.framework_host_overhead_s``): it is the
  framework's Python as much as the CPU, so runs of one software stack say nothing of
  another's.
A fitted constant at one of these bounds is reported as such (``FitReport.at_bound``): the
runs ask for a value no kernel or link has, so some mechanism they contain is not modelled.

A constant no run is sensitive to (InfiniBand on single-node runs, attention without flash
attention) keeps the cluster's value and is reported as not informed.

Method: for fixed maxima (which rank is critical, which term of a task binds) a predicted step
is linear in the constants' units, so each round reads the coefficients by forward
differences (1%) at the current point and solves for the units that minimise the mean absolute
percentage error (iteratively reweighted least squares, bounds by an active set); the next
round re-reads the coefficients there. Where the maxima switch, the linear step can overshoot:
a round whose point evaluates worse than the best so far goes back half-way toward that one
instead, and the fit returns the best point it evaluated, never one worse than its start. The
host's time per kernel enters only through a maximum with the GPU's, which hides whichever
side does not bind at the start: the fit runs from the given start and from one with the
host's time at its lower bound, and keeps the better.
Every figure reported is ``evaluate``'s at the final constants, not the linearisation's.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from planner.errors import PlannerError
from planner.frameworks import FRAMEWORK_NAMES, FRAMEWORKS
from planner.layout import Layout
from planner.specs import ClusterSpec, ModelSpec, TrainingJob

MIN_SECONDS = 1e-6  # lower bound of a fitted overhead or latency (s)
# The slowest a fit may make each kind of work, as a fraction of peak: below the slowest rate
# measured or published for that kind at training shapes on any catalog GPU, so a fit that
# reaches one says a mechanism is missing rather than describes a kernel. GEMMs (the BF16
# tile-model fraction): 0.78-0.87 (MAMF: A100 0.869, H100 0.803, B200 0.776; one H200
# measured 0.79-0.805, benchmarks/RESULTS.md 2026-11-26); the GPU's fastest fused attention:
# 0.39-0.58 at 4K-16K tokens and 16-64 heads (cuDNN on an H200, gpu_attention.py), 0.50-0.61
# for FlashAttention-2 on the A100 at 4K-16K (published_kernels.csv); memory-bound kernels:
# 0.67-0.88 (copy, add, RMSNorm on an H200); NVLink and InfiniBand collectives: 0.78-0.96 of
# line rate at large messages (nccl-tests, the catalog's sources).
FRACTION_FLOORS: dict[str, float] = {
    "gemm": 0.6,
    "attention": 0.3,
    "memory_bound": 0.5,
    "nvlink": 0.5,
    "ib": 0.5,
}
# The most a fit may charge per kernel or per message (s), above every measured figure:
# GPU time 1.7-1.8 us per launched kernel on an H200 (planner calibrate --sweep,
# gpu_graph.py), 6.7-23 us per counted kernel of an eager layer (gpu_graph.py), 22 us the
# largest any source fits (vTrain's A100 rows); the host's time per counted kernel 64-70 us
# on eager dense layers, 103-119 us under recompute, 231-243 us on eager MoE layers
# (gpu_host.py on an H200);
# NCCL's latency per step 0.6-4.4 us over NVLink and up to about 10 us over the network
# (its tuner's base latencies by protocol, src/graph/tuning.cc).
SECONDS_CEILINGS: dict[str, float] = {
    "kernel_overhead_s": 25e-6,
    "host_overhead_s": 250e-6,
    "nvlink_latency_s": 10e-6,
    "ib_latency_s": 20e-6,
}
STEP = 0.01  # relative size of the finite differences


@dataclass(frozen=True)
class Run:
    """One measured training run: what ran and how long a step took."""

    model: ModelSpec
    job: TrainingJob
    layout: Layout
    measured_step_s: float
    name: str = ""

    @classmethod
    def of(cls, item: Run | Sequence[Any], index: int = 0) -> Run:
        if isinstance(item, Run):
            return item
        if len(item) != 4:
            raise PlannerError(
                f"runs[{index}]: expected (model, job, layout, measured_step_s), got "
                f"{len(item)} items"
            )
        model, job, layout, seconds = item
        return cls(model, job, layout, float(seconds), name=f"run {index + 1}")


@dataclass(frozen=True)
class Constant:
    """One fitted constant, held as the unit a step is linear in: an achieved fraction of
    peak as its inverse (seconds scale with 1/fraction), an overhead as seconds."""

    key: str  # ClusterSpec.achieved key (a fraction) or ClusterSpec attribute (seconds)
    fraction: bool
    # The host's time per kernel of one framework's jobs (ClusterSpec.framework_host_overhead_s)
    framework: str = ""

    @property
    def name(self) -> str:
        if self.framework:
            return f"{self.key}[{self.framework}]"
        return f"achieved.{self.key}" if self.fraction else self.key

    @property
    def unit(self) -> str:
        """The displayed value's unit."""
        return "of peak" if self.fraction else "us"

    def read(self, cluster: ClusterSpec) -> float:
        if self.fraction:
            return 1.0 / cluster.achieved.get(self.key, 1.0)
        if self.framework:
            return cluster.framework_host_overhead_s.get(self.framework, cluster.host_overhead_s)
        return float(getattr(cluster, self.key))

    def show(self, x: float) -> float:
        """The linear unit ``x`` as displayed: a fraction, or microseconds."""
        return 1.0 / x if self.fraction else x * 1e6

    def unshow(self, shown: float) -> float:
        """``show``'s inverse."""
        return 1.0 / shown if self.fraction else shown * 1e-6


CONSTANTS: tuple[Constant, ...] = (
    *(Constant(k, True) for k in ("gemm", "attention", "memory_bound", "nvlink", "ib")),
    *(
        Constant(k, False)
        for k in ("kernel_overhead_s", "host_overhead_s", "nvlink_latency_s", "ib_latency_s")
    ),
)


def constants_for(runs: Sequence[Run]) -> tuple[Constant, ...]:
    """The constants a fit to ``runs`` sets: ``CONSTANTS``, with the host's time per kernel
    one per framework among the runs (it is the framework's Python as much as the CPU: a
    source run by one stack says nothing of another's)."""
    frameworks = sorted({r.job.framework for r in runs})
    out: list[Constant] = []
    for c in CONSTANTS:
        if c.key == "host_overhead_s":
            out += [Constant(c.key, False, framework=f) for f in frameworks]
        else:
            out.append(c)
    return tuple(out)


def with_constants(
    cluster: ClusterSpec, x: np.ndarray, constants: Sequence[Constant] = CONSTANTS
) -> ClusterSpec:
    """``cluster`` with ``constants`` set to the linear units ``x``."""
    update: dict[str, Any] = {}
    achieved = dict(cluster.achieved)
    by_framework = dict(cluster.framework_host_overhead_s)
    for c, value in zip(constants, x, strict=True):
        if c.framework:
            by_framework[c.framework] = float(value)
        elif c.fraction:
            # FP8 GEMMs and FlashAttention-2 keep their measured ratios to what is fitted
            for kind, same in (("gemm", "gemm_fp8"), ("attention", "attention_fa2")):
                if c.key == kind and same in achieved:
                    achieved[same] *= 1.0 / float(value) / achieved[kind]
            achieved[c.key] = 1.0 / float(value)
        else:
            update[c.key] = float(value)
    update["achieved"] = achieved
    update["framework_host_overhead_s"] = by_framework
    return cluster.model_copy(update=update)


def predict(cluster: ClusterSpec, runs: Sequence[Run]) -> np.ndarray:
    """Predicted seconds per step of each run on ``cluster`` (its GPU count set per run)."""
    from planner.estimate import evaluate

    out = np.empty(len(runs))
    for i, run in enumerate(runs):
        sized = cluster.model_copy(update={"num_gpus": run.layout.world_size})
        try:
            out[i] = evaluate(run.model, sized, run.job, run.layout).step_time_s
        except PlannerError as exc:
            raise PlannerError(f"{run.name or f'run {i + 1}'}: {exc}") from None
    return out


@dataclass(frozen=True)
class FitReport:
    """What ``fit_runs`` found: the fitted cluster and how well it predicts."""

    cluster: ClusterSpec
    runs: tuple[Run, ...]
    measured_s: np.ndarray
    before_s: np.ndarray  # predictions with the cluster's constants as given
    fitted_s: np.ndarray  # predictions with the fitted constants
    heldout_s: np.ndarray | None  # each run predicted by the fold that did not see it
    folds: int
    informed: tuple[str, ...]  # constants some run is sensitive to (the others are kept)
    values: dict[str, float] = field(default_factory=dict)  # displayed values, by name
    at_bound: tuple[str, ...] = ()  # informed constants the fit left at a bound of ``bounds``
    constants: tuple[Constant, ...] = CONSTANTS  # what was fitted (``constants_for``)

    @staticmethod
    def mape(predicted: np.ndarray, measured: np.ndarray) -> float:
        return float(np.mean(np.abs(predicted / measured - 1)))

    @property
    def before_mape(self) -> float:
        return self.mape(self.before_s, self.measured_s)

    @property
    def fit_mape(self) -> float:
        return self.mape(self.fitted_s, self.measured_s)

    @property
    def heldout_mape(self) -> float | None:
        return None if self.heldout_s is None else self.mape(self.heldout_s, self.measured_s)

    def fitted_text(self) -> str:
        """The informed constants' fitted values, with units: ``gemm 0.869, ... 22.9 us``."""
        return ", ".join(
            f"{c.name.removeprefix('achieved.')} {self.values[c.name]:.3g}"
            + ("" if c.fraction else " us")
            + (" (at its bound)" if c.name in self.at_bound else "")
            for c in self.constants
            if c.name in self.informed
        )


def fit_runs(
    cluster: ClusterSpec,
    runs: Iterable[Run | Sequence[Any]],
    *,
    folds: int = 5,
    rounds: int = 3,
    start: dict[str, float] | None = None,
    progress: Callable[[str], None] | None = None,
) -> FitReport:
    """Fit the constants of ``cluster`` (``constants_for(runs)``: ``CONSTANTS`` with the
    host's time per kernel one per framework) to ``runs`` (``Run`` or ``(model, job, layout,
    measured_step_s)`` tuples) and cross-validate over ``folds`` folds (runs i, i+k, ...;
    0 or 1: no cross-validation). ``start`` sets where named constants start (displayed
    units: a fraction, or microseconds; ``host_overhead_s`` names every framework's), else at
    the cluster's values; the fit also starts once from the host's time per kernel at its
    lower bound (``_fit``)."""
    items = tuple(Run.of(r, i) for i, r in enumerate(runs))
    if not items:
        raise PlannerError("runs: need at least one measured run")
    for i, r in enumerate(items):
        if not (math.isfinite(r.measured_step_s) and r.measured_step_s > 0):
            raise PlannerError(
                f"runs[{i}].measured_step_s={r.measured_step_s}: must be a positive number of "
                "seconds"
            )
    if folds < 0 or folds > len(items):
        raise PlannerError(f"folds={folds}: must be between 0 and the number of runs {len(items)}")
    say = progress or (lambda _: None)
    measured = np.array([r.measured_step_s for r in items])
    consts = constants_for(items)
    begin = cluster
    if start:
        known = {c.name for c in consts} | {c.key for c in consts if c.framework}
        unknown = sorted(set(start) - known)
        if unknown:
            raise PlannerError(
                f"start: unknown constant {unknown[0]!r}; known: {', '.join(sorted(known))}"
            )
        x0 = np.array([c.read(cluster) for c in consts])
        for i, c in enumerate(consts):
            named = c.key if c.framework and c.name not in start else c.name
            if named in start:
                x0[i] = c.unshow(start[named])
        begin = with_constants(cluster, x0, consts)
    start_x = np.array([c.read(begin) for c in consts])
    say(f"costing {len(items)} runs with the given constants")
    before = predict(cluster, items)
    x, informed = _fit(cluster, items, measured, start_x, rounds, say, "all runs", consts)
    fitted_cluster = with_constants(cluster, x, consts)
    fitted = predict(fitted_cluster, items)
    heldout = None
    if folds >= 2:
        heldout = np.empty(len(items))
        for f in range(folds):
            train = [i for i in range(len(items)) if i % folds != f]
            test = [i for i in range(len(items)) if i % folds == f]
            xf, _ = _fit(
                cluster,
                [items[i] for i in train],
                measured[train],
                start_x,
                rounds,
                say,
                f"fold {f + 1}/{folds}",
                consts,
            )
            fold = with_constants(cluster, xf, consts)
            heldout[test] = predict(fold, [items[i] for i in test])
    return FitReport(
        cluster=fitted_cluster,
        runs=items,
        measured_s=measured,
        before_s=before,
        fitted_s=fitted,
        heldout_s=heldout,
        folds=folds if folds >= 2 else 0,
        informed=tuple(consts[i].name for i in informed),
        values={c.name: c.show(v) for c, v in zip(consts, x, strict=True)},
        at_bound=_at_bound(cluster, x, informed, consts),
        constants=consts,
    )


def _at_bound(
    cluster: ClusterSpec, x: np.ndarray, informed: Sequence[int], consts: Sequence[Constant]
) -> tuple[str, ...]:
    """The informed constants ``x`` holds at a bound (within 0.1%)."""
    lo, hi = bounds(cluster, consts)
    return tuple(
        consts[i].name
        for i in informed
        if math.isclose(x[i], lo[i], rel_tol=1e-3) or math.isclose(x[i], hi[i], rel_tol=1e-3)
    )


def fit_profile(
    cluster: ClusterSpec, runs: Iterable[Run | Sequence[Any]], **options: Any
) -> ClusterSpec:
    """``cluster`` with its constants fitted to ``runs``: a list of ``(model, job, layout,
    measured_step_s)`` tuples (or ``Run``). Options as ``fit_runs``; for the fit and held-out
    errors call ``fit_runs``."""
    options.setdefault("folds", 0)
    return fit_runs(cluster, runs, **options).cluster


def bounds(
    cluster: ClusterSpec, consts: Sequence[Constant] = CONSTANTS
) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper limits of each constant's linear unit (see the module docstring)."""
    lo, hi = [], []
    for c in consts:
        if c.fraction:
            lo.append(1.0 / min(1.0, cluster.achieved_max.get(c.key, 1.0)))
            hi.append(1.0 / FRACTION_FLOORS[c.key])
        else:
            lo.append(MIN_SECONDS)
            hi.append(SECONDS_CEILINGS[c.key])
    return np.array(lo), np.array(hi)


def _fit(
    cluster: ClusterSpec,
    runs: Sequence[Run],
    measured: np.ndarray,
    start: np.ndarray,
    rounds: int,
    say: Callable[[str], None],
    what: str,
    consts: Sequence[Constant] = CONSTANTS,
) -> tuple[np.ndarray, list[int]]:
    """The fit from ``start`` and from ``start`` with the host's time per kernel at its
    lower bound, whichever reproduces ``runs`` better. The host's time enters a step only
    through a maximum with the GPU's: where it binds at the start, the runs it binds say
    nothing of the GPU's constants, and where it does not, nothing of it, so one start can
    settle in the other's blind spot."""
    lo, _ = bounds(cluster, consts)
    present = {r.job.framework for r in runs}
    hosts = [
        i
        for i, c in enumerate(consts)
        if c.key == "host_overhead_s" and (not c.framework or c.framework in present)
    ]
    starts = [start]
    if any(start[h] > lo[h] for h in hosts):
        starts.append(start.copy())
        starts[-1][hosts] = lo[hosts]
    best: tuple[float, np.ndarray, list[int]] | None = None
    for i, x0 in enumerate(starts):
        label = what if len(starts) == 1 else f"{what}, start {i + 1}/{len(starts)}"
        x, informed = _fit_from(cluster, runs, measured, x0, rounds, say, label, consts)
        if i:  # the runs say a host never binds: that is news
            informed = sorted({*informed, *hosts})
        error = _mape(predict(with_constants(cluster, x, consts), runs), measured)
        if best is None or error < best[0]:
            best = (error, x, informed)
    assert best is not None
    return best[1], best[2]


def _fit_from(
    cluster: ClusterSpec,
    runs: Sequence[Run],
    measured: np.ndarray,
    start: np.ndarray,
    rounds: int,
    say: Callable[[str], None],
    what: str,
    consts: Sequence[Constant] = CONSTANTS,
) -> tuple[np.ndarray, list[int]]:
    lo, hi = bounds(cluster, consts)
    x = np.clip(start, lo, hi)
    informed: list[int] = []
    best: tuple[float, np.ndarray] | None = None  # the lowest error evaluated, and where
    for r in range(rounds):
        say(f"{what}: round {r + 1}/{rounds}, {len(runs) * (len(consts) + 1)} costings")
        base, slopes = _coefficients(cluster, runs, x, consts)
        error = _mape(base, measured)
        if best is not None and error > best[0]:
            # The linearisation overshot (a max switched terms): back half-way and re-read.
            x = best[1] + 0.5 * (x - best[1])
            continue
        best = (error, x.copy())
        a = slopes / measured[:, None]
        informed = [i for i in range(a.shape[1]) if np.abs(a[:, i]).max() * x[i] > 1e-6]
        sub = a[:, informed]
        # What the informed constants must account for: the measured step less the rest of
        # the prediction (kept constants, and terms no constant scales, such as PCIe).
        rest = np.ones(len(runs)) - (base / measured - sub @ x[informed])
        weights = np.ones(len(runs))
        sol = x[informed]
        for _ in range(30):  # IRLS: weights 1/sqrt|r| turn squared error into absolute error
            sol = _bounded_lstsq(sub * weights[:, None], rest * weights, lo[informed], hi[informed])
            weights = 1 / np.sqrt(np.maximum(np.abs(sub @ sol - rest), 1e-3))
        x = x.copy()
        x[informed] = sol
    last = _mape(predict(with_constants(cluster, x, consts), runs), measured)
    if best is not None and last > best[0]:
        x = best[1]  # the last step made it worse: keep the best point evaluated
    kept = [i for i in range(len(x)) if i not in informed]
    x[kept] = start[kept]  # what no run informs stays as given, even outside the fit's bounds
    return x, informed


def _mape(predicted: np.ndarray, measured: np.ndarray) -> float:
    return float(np.mean(np.abs(predicted / measured - 1)))


def _coefficients(
    cluster: ClusterSpec, runs: Sequence[Run], x: np.ndarray, consts: Sequence[Constant]
) -> tuple[np.ndarray, np.ndarray]:
    """The predicted steps at ``x``, and d(predicted step)/d(unit) per run and constant by
    forward differences."""
    base = predict(with_constants(cluster, x, consts), runs)
    cols = []
    for i in range(len(x)):
        bumped = x.copy()
        bumped[i] *= 1 + STEP
        bumped_cluster = with_constants(cluster, bumped, consts)
        cols.append((predict(bumped_cluster, runs) - base) / (STEP * x[i]))
    return base, np.column_stack(cols)


def _bounded_lstsq(a: np.ndarray, b: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Least squares with each unknown kept in [lo, hi]: pin the ones that leave the box at
    their bound and re-solve the rest (an active-set loop over a few unknowns)."""
    pinned: dict[int, float] = {}
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    while True:
        free = [i for i in range(a.shape[1]) if i not in pinned]
        out = np.empty(a.shape[1])
        for i, v in pinned.items():
            out[i] = v
        if free:
            rhs = b - sum((a[:, i] * v for i, v in pinned.items()), start=np.zeros_like(b))
            sol, *_ = np.linalg.lstsq(a[:, free] / scale[free], rhs, rcond=None)
            out[free] = sol / scale[free]
        bad = [i for i in free if not lo[i] <= out[i] <= hi[i]]
        if not bad:
            return out
        for i in bad:
            pinned[i] = float(np.clip(out[i], lo[i], hi[i]))


# -- runs from a CSV file ---------------------------------------------------------------------

RUN_COLUMNS = {
    "model": "catalog name, path to a config.json, or gpt:hidden=H;layers=L;heads=A;vocab=V",
    "tp": "tensor-parallel degree",
    "pp": "pipeline stages",
    "dp": "data-parallel degree",
    "micro_batch": "sequences per micro-batch",
    "global_batch": "sequences per step",
    "seq_len": "tokens per sequence",
}
OPTIONAL_COLUMNS = {
    "ep": "expert-parallel degree (default 1)",
    "etp": "expert tensor-parallel degree (default 1)",
    "cp": "context-parallel degree (default 1)",
    "vp": "virtual stages per rank (default 1, 2 for interleaved)",
    "schedule": "1f1b, interleaved, dualpipe, ... (default 1f1b)",
    "recompute": "none, selective, full or a module list (default none)",
    "zero": "ZeRO stage 0-3 (default: the layout default)",
    "precision": "bf16, fp16 or fp8 GEMMs (default bf16)",
    "framework": "a planner.frameworks name, e.g. megatron (default), torchtitan, deepspeed",
    "grad_dtype": "fp32, bf16 or fp16: the gradients' dtype where the run states it "
    "(default: the framework's; Megatron-LM's --grad-reduce-in-bf16 is bf16)",
    "moment_dtype": "fp32, bf16 or fp16: the optimizer moments' dtype where the run states it "
    "(default fp32)",
    "master_dtype": "fp32, bf16 or none: the master weights' dtype where the run states it "
    "(default fp32; bf16 also stands for a BF16 weight's 16-bit remainder, 2 bytes either way)",
    "gpu": "machine type; must match the cluster when given",
    "flash_attention": "true (default) or false: fused attention, or scores in HBM",
    "fp8_cache": "true or false (default): SwiGLU inputs kept in FP8 (Layout.fp8_cache)",
    "sequence_parallel": "true (default) or false: with tp > 1, norm and dropout activations "
    "split over tp",
    "compiled_loss": "true or false (default): the loss under torch.compile "
    "(TrainingJob.compiled_loss; torchtitan or torch)",
    "compiled_model": "true or false (default): the model's layers under torch.compile "
    "(TrainingJob.compiled_model; torchtitan)",
    "eager_norm": "true or false (default): the model code's own eager RMSNorm "
    "(TrainingJob.eager_norm; torchtitan before April 2025)",
    "tp_comm_overlap": "true (default) or false: the framework's tensor-parallel overlap "
    "switched on (TrainingJob.tp_comm_overlap)",
    "exposed_grad_reduce": "true or false (default): the gradient reduction after the last "
    "backward (TrainingJob.exposed_grad_reduce; Megatron-LM without --overlap-grad-reduce)",
    "attention_kernel": "fused (default) or fa2: the fused attention kernel the run used "
    "(TrainingJob.attention_kernel)",
    "loss_fusion": "none (default), native or te: Megatron-LM's fused cross-entropy "
    "(TrainingJob.loss_fusion)",
    "dispatcher": "alltoall (default), allgather or deepep: how MoE tokens reach their "
    "experts (TrainingJob.moe_dispatcher)",
    "qk_norm_gathered": "true or false (default): q and k all-gathered over tp after their "
    "norms (TrainingJob.qk_norm_gathered; torchtitan's Qwen3 before 8c1d1c5f)",
    "optimizer_instances": "ZeRO-1 over this many partial data-parallel domains (default 1; "
    "Layout.optimizer_instances, Megatron-LM's --num-distributed-optimizer-instances)",
    "moe_force_balance": "true or false (default): routing by random logits "
    "(TrainingJob.moe_force_balance; Megatron-LM's --moe-router-force-load-balancing)",
    "transformer_engine": "true or false (default: the framework's own): the run used "
    "Transformer Engine's modules (TrainingJob.transformer_engine; Megatron-LM's "
    "--transformer-impl local is false)",
    "step_s": "measured seconds per step (or metric + value)",
    "metric": "step_s or tokens_per_s_per_gpu, with value",
    "value": "the measured figure in metric's unit",
    "id": "a name for the row",
}


GPT_KEYS = {
    "hidden": "hidden size",
    "layers": "transformer layers",
    "heads": "attention heads",
    "vocab": "vocabulary (as padded by the framework)",
    "kv": "key/value heads (default: heads)",
    "ffn": "MLP hidden size (default 4*hidden)",
    "swiglu": "1: gated SiLU MLP (default 0: GeLU)",
    "relu2": "1: squared-ReLU MLP, up and down projections (Nemotron; default 0: GeLU)",
    "rmsnorm": "1: RMSNorm (default 0: LayerNorm)",
    "rope": "1: rotary positions (default 0: learned)",
    "seq": "rows of the learned position embedding (default 2048; a run's seq_len)",
    "bias": "0: no linear biases (default 1)",
    "tied": "0: untied embedding and head (default 1)",
    "dropout": "hidden and attention dropout (default 0)",
    # Mixture of experts (Megatron-LM's --num-experts and --moe-* arguments)
    "experts": "routed experts per MoE layer (default 0: dense)",
    "topk": "routed experts each token visits (needed with experts)",
    "moeffn": "routed expert width (default ffn)",
    "shared": "width of the shared expert MLP, --moe-shared-expert-intermediate-size "
    "(default 0: none)",
    "sgate": "1: a sigmoid gate scales the shared expert (default 0)",
    "dense": "leading layers with a dense MLP (default 0)",
    "moefreq": "every k-th layer after those is MoE, by layer index (default 1)",
    "sigmoid": "1: sigmoid router scores (default 0: softmax)",
    "ebias": "1: per-expert routing bias, aux-loss-free balancing (default 0)",
    "groups": "groups the routed experts are split into (default 1)",
    "gtopk": "most groups one token's experts come from (default: no limit)",
    "rscale": "factor on the chosen experts' weights (default 1)",
}
MOE_KEYS = tuple(GPT_KEYS)[tuple(GPT_KEYS).index("experts") + 1 :]  # they need experts=N
FLOAT_KEYS = ("dropout", "rscale")


def gpt_model(spec: str) -> ModelSpec:
    """A Megatron-LM GPT from ``gpt:hidden=H;layers=L;heads=A;vocab=V[;key=value...]``
    (``GPT_KEYS``): by default LayerNorm, GeLU MLP of 4h, biases, learned positions, tied
    embeddings and no dropout (Megatron-LM's own default is 0.1 for both dropouts). With
    ``experts`` the MLPs are MoE layers (``MOE_KEYS``), every routed expert and the shared
    expert of the dense MLP's kind (SwiGLU or GeLU), as Megatron-LM builds them."""
    fields_: dict[str, float] = {}
    for part in spec.removeprefix("gpt:").split(";"):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in GPT_KEYS:
            raise PlannerError(
                f"model={spec!r}: {key!r} is not one of {', '.join(GPT_KEYS)} "
                "(gpt:hidden=H;layers=L;heads=A;vocab=V[;key=value...])"
            )
        try:
            fields_[key] = float(value) if key in FLOAT_KEYS else int(value)
        except ValueError:
            raise PlannerError(
                f"model={spec!r}: {part!r} is not key=number (gpt:hidden=H;layers=L;heads=A;"
                "vocab=V[;key=value...])"
            ) from None
    missing = [k for k in ("hidden", "layers", "heads", "vocab") if k not in fields_]
    if missing:
        raise PlannerError(f"model={spec!r}: missing {', '.join(missing)}")
    h, heads = int(fields_["hidden"]), int(fields_["heads"])
    kv = int(fields_.get("kv", heads))
    dropout = fields_.get("dropout", 0.0)
    bias = bool(fields_.get("bias", 1))
    ffn = int(fields_.get("ffn", 4 * h))
    experts = int(fields_.get("experts", 0))
    moe: dict[str, Any] = {}
    if experts:
        if "topk" not in fields_:
            raise PlannerError(f"model={spec!r}: experts={experts} needs topk")
        shared = int(fields_.get("shared", 0))
        moe = {
            "num_experts": experts,
            "experts_per_token": int(fields_["topk"]),
            "moe_ffn_hidden_size": int(fields_.get("moeffn", ffn)),
            # Megatron-LM states the shared experts' total width: one shared expert of it
            "num_shared_experts": 1 if shared else 0,
            "shared_expert_ffn_hidden_size": shared,
            "shared_expert_gate": bool(fields_.get("sgate", 0)),
            "first_dense_layers": int(fields_.get("dense", 0)),
            "moe_layer_freq": int(fields_.get("moefreq", 1)),
            "router_score": "sigmoid" if fields_.get("sigmoid") else "softmax",
            "router_expert_bias": bool(fields_.get("ebias", 0)),
            "expert_groups": int(fields_.get("groups", 1)),
            "groups_per_token": int(fields_["gtopk"]) if "gtopk" in fields_ else None,
            "router_scale": float(fields_.get("rscale", 1.0)),
        }
    else:
        stray = [k for k in MOE_KEYS if k in fields_]
        if stray:
            raise PlannerError(f"model={spec!r}: {', '.join(stray)} needs experts=N")
    layers = int(fields_["layers"])
    return ModelSpec(
        name=f"gpt-h{h}-l{layers}" + (f"-e{experts}" if experts else ""),
        hidden_size=h,
        num_layers=layers,
        vocab_size=int(fields_["vocab"]),
        num_attention_heads=heads,
        num_kv_heads=kv,
        head_dim=h // heads,
        attention="mha" if kv == heads else "gqa",
        mlp="swiglu" if fields_.get("swiglu") else "relu2" if fields_.get("relu2") else "gelu",
        ffn_hidden_size=ffn,
        norm="rmsnorm" if fields_.get("rmsnorm") else "layernorm",
        qkv_bias=bias,
        linear_bias=bias,
        tie_word_embeddings=bool(fields_.get("tied", 1)),
        learned_positions=0 if fields_.get("rope") else int(fields_.get("seq", 2048)),
        hidden_dropout=dropout,
        attention_dropout=dropout,
        **moe,
    )


def run_from_row(row: dict[str, str], where: str, *, gpu: str | None = None) -> Run:
    """One ``Run`` from a CSV row (columns ``RUN_COLUMNS`` and ``OPTIONAL_COLUMNS``)."""
    model, job, layout = layout_from_row(row, where, gpu=gpu)
    seconds = measured_seconds(row, job, layout.world_size, where)
    return Run(model, job, layout, seconds, (row.get("id") or "").strip() or where)


def layout_from_row(
    row: dict[str, str], where: str, *, gpu: str | None = None
) -> tuple[ModelSpec, TrainingJob, Layout]:
    """The model, job and layout a CSV row states (``RUN_COLUMNS``, ``OPTIONAL_COLUMNS``;
    no measured figure needed)."""
    from planner.catalog import load_model

    def text(key: str, default: str = "") -> str:
        return (row.get(key) or "").strip() or default

    def whole(key: str, default: int | None = None) -> int:
        raw = text(key)
        if not raw:
            if default is None:
                raise PlannerError(f"{where}: column {key!r} is empty ({RUN_COLUMNS[key]})")
            return default
        try:
            value = int(raw)
        except ValueError:
            raise PlannerError(f"{where}: {key}={raw!r} must be a whole number") from None
        if value <= 0:
            raise PlannerError(f"{where}: {key}={value} must be positive")
        return value

    if gpu and text("gpu") and text("gpu").lower() != gpu.lower():
        raise PlannerError(
            f"{where}: gpu={text('gpu')} but the cluster is {gpu}; fit one GPU type per file"
        )
    source = text("model")
    if not source:
        raise PlannerError(f"{where}: column 'model' is empty ({RUN_COLUMNS['model']})")
    model = gpt_model(source) if source.startswith("gpt:") else load_model(source)
    seq = whole("seq_len")
    if source.startswith("gpt:") and model.learned_positions:
        model = model.model_copy(update={"learned_positions": seq})
    precision = text("precision", "bf16").lower()
    if precision not in ("bf16", "fp16", "fp8"):
        raise PlannerError(f"{where}: precision={precision!r} must be bf16, fp16 or fp8")
    half = "fp16" if precision == "fp16" else "bf16"

    def flag(key: str, default: bool) -> bool:
        raw = text(key, str(default).lower()).lower()
        if raw not in ("true", "false"):
            raise PlannerError(f"{where}: {key}={raw!r} must be true or false")
        return raw == "true"

    flash = flag("flash_attention", True)
    sequence_parallel = flag("sequence_parallel", True)
    overlap_tp = flag("tp_comm_overlap", True)
    compiled = flag("compiled_loss", False)
    framework = text("framework", "megatron").lower()
    if framework not in FRAMEWORKS:
        raise PlannerError(
            f"{where}: framework={framework!r} must be {', '.join(FRAMEWORK_NAMES[:-1])} or "
            f"{FRAMEWORK_NAMES[-1]}"
        )
    try:
        job = TrainingJob(
            seq_len=seq,
            global_batch=whole("global_batch"),
            # FP16 runs keep FP16 weights and gradients; BF16 ones the framework's defaults
            **({"weight_dtype": "fp16", "grad_dtype": "fp16"} if half == "fp16" else {}),
            activation_dtype=half,
            compute_dtype="fp8" if precision == "fp8" else "bf16",
            framework=framework,
            flash_attention=flash,
            compiled_loss=compiled,
            compiled_model=flag("compiled_model", False),
            eager_norm=flag("eager_norm", False),
            tp_comm_overlap=overlap_tp,
            exposed_grad_reduce=flag("exposed_grad_reduce", False),
            attention_kernel=text("attention_kernel", "fused").lower(),
            loss_fusion=text("loss_fusion", "none").lower(),
            moe_dispatcher=text("dispatcher", "alltoall").lower(),
            qk_norm_gathered=flag("qk_norm_gathered", False),
            moe_force_balance=flag("moe_force_balance", False),
            transformer_engine=flag("transformer_engine", False)
            if text("transformer_engine")
            else None,
            **({"grad_dtype": text("grad_dtype").lower()} if text("grad_dtype") else {}),
            **({"moment_dtype": text("moment_dtype").lower()} if text("moment_dtype") else {}),
            **(
                {"master_dtype": None if master == "none" else master}
                if (master := text("master_dtype").lower())
                else {}
            ),
        )
        schedule = text("schedule", "1f1b").lower()
        fields_: dict[str, Any] = {
            "tp": whole("tp"),
            "cp": whole("cp", 1),
            "dp": whole("dp"),
            "ep": whole("ep", 1),
            "etp": whole("etp", 1),
            "micro_batch": whole("micro_batch"),
            "sequence_parallel": sequence_parallel,
        }
        if text("zero"):
            fields_["zero"] = int(text("zero"))
        fields_["optimizer_instances"] = whole("optimizer_instances", 1)
        fields_["fp8_cache"] = flag("fp8_cache", False)
        layout = Layout.uniform(
            model,
            pp=whole("pp"),
            schedule=schedule,
            virtual_stages=whole("vp", 0) or None,
            recompute=_recompute(text("recompute", "none").lower()),
            **fields_,
        )
    except PlannerError as exc:
        raise PlannerError(f"{where}: {exc}") from None
    except ValueError as exc:  # pydantic's validation error, one line
        first = str(exc).splitlines()
        raise PlannerError(f"{where}: {' '.join(first[:3])}") from None
    gpus = layout.world_size
    if text("num_gpus") and int(text("num_gpus")) != gpus:
        raise PlannerError(f"{where}: num_gpus={text('num_gpus')} but tp*cp*pp*dp={gpus}")
    return model, job, layout


def _recompute(stated: str) -> str:
    """A row's recompute as a ``BlockPlacement.recompute`` value: Megatron-LM's selective
    recompute of listed modules, ``selective(a+b)``, is those modules, ``a+b``."""
    if stated.startswith("selective(") and stated.endswith(")"):
        return stated.removeprefix("selective(").removesuffix(")")
    return stated


def measured_seconds(row: dict[str, str], job: TrainingJob, gpus: int, where: str) -> float:
    """The row's measured seconds per step, from ``step_s`` or ``metric`` + ``value``."""
    metric = (row.get("metric") or "").strip() or ("step_s" if row.get("step_s") else "")
    raw = (row.get("value") or row.get("step_s") or "").strip()
    if not metric or not raw:
        raise PlannerError(
            f"{where}: needs step_s, or metric (step_s or tokens_per_s_per_gpu) and value"
        )
    try:
        value = float(raw)
    except ValueError:
        raise PlannerError(f"{where}: value={raw!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise PlannerError(f"{where}: value={raw} must be positive")
    if metric == "step_s":
        return value
    if metric == "tokens_per_s_per_gpu":
        return job.tokens_per_step / (value * gpus)
    raise PlannerError(
        f"{where}: metric={metric!r}: a fit needs a measured time (step_s or "
        "tokens_per_s_per_gpu); TFLOP/s and MFU depend on the source's FLOP count"
    )


def read_runs(path: str | Path, *, gpu: str | None = None) -> list[Run]:
    """The runs of a CSV file (header names ``RUN_COLUMNS``, optionally ``OPTIONAL_COLUMNS``);
    rows whose ``gpu`` differs from ``gpu`` are an error."""
    file = Path(path)
    if not file.is_file():
        raise PlannerError(f"runs={str(path)!r}: no such file")
    with file.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(
            line for line in handle if line.strip() and not line.lstrip().startswith("#")
        )
        header = set(reader.fieldnames or [])
        missing = [c for c in RUN_COLUMNS if c not in header]
        if missing:
            raise PlannerError(
                f"runs={str(path)!r}: missing column(s) {', '.join(missing)} (needs "
                f"{', '.join(RUN_COLUMNS)}, and step_s or metric + value)"
            )
        return [
            run_from_row(row, f"{file.name} row {i}", gpu=gpu)
            for i, row in enumerate(reader, start=1)
        ]
