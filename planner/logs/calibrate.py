"""What a team's logs teach the cost model: the time constants and the memory constants of
their machine, fitted to logged runs and judged on runs held out.

Time: ``planner.fit.fit_runs`` on the runs' median step times (each constant within its
physical bounds; held out one run at a time: fit on every other run, predict this one).

Memory, per framework among the runs, two constants with a physical meaning and bounds:

- ``buffers_at_peak`` in [0, 1] (``TrainingJob.buffers_at_peak``): the share of the transient
  buffers (pipeline transfers, reduce buckets, ZeRO-3's gathered weights, the context-parallel
  ring, an eager backward's temporaries) live at the rank's peak, fitted to the logged
  allocated peaks (the allocator's ``max_memory_allocated``);
- ``fragmentation`` in [0, ``MAX_FRAGMENTATION``] (``TrainingJob.fragmentation``): the caching
  allocator's reserved bytes over its allocated bytes, less 1, fitted to the logged reserved
  peaks (``max_memory_reserved``) given the allocated ones the first constant predicts; logs
  whose reserved peak equals their allocated one (no caching allocator) do not inform it.

Each is chosen on a grid (steps of ``GRID``) for the least mean absolute percentage error,
which is deterministic and respects its bounds; a constant at a bound is reported as such (the
runs hold something the model does not price). A predicted peak is the largest over the
pipeline ranks of ``planner.costs.memory.stage_memory``, which is linear in both constants per
rank, so the fit costs each run twice (all buffers live at the peak, none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.logs import LoggedRun

GRID = 0.005  # step of the memory constants' grid
MAX_FRAGMENTATION = 0.5  # seed 001 gives 5-30%; above half the allocator is broken, not busy


@dataclass(frozen=True)
class MemoryReport:
    """The memory constants fitted to logged peaks, and every run's peaks before, after and
    held out (bytes; NaN where the log has no such figure)."""

    frameworks: tuple[str, ...]
    before: dict[str, tuple[float, float]]  # framework -> (buffers_at_peak, fragmentation)
    fitted: dict[str, tuple[float, float]]
    informed: dict[str, tuple[bool, bool]]  # whether any run's peak says something of each
    at_bound: tuple[str, ...]  # "buffers_at_peak[torch]", ...
    measured_allocated: np.ndarray
    measured_reserved: np.ndarray
    before_allocated: np.ndarray
    before_reserved: np.ndarray
    fitted_allocated: np.ndarray
    fitted_reserved: np.ndarray
    heldout_allocated: np.ndarray
    heldout_reserved: np.ndarray

    @staticmethod
    def mape(predicted: np.ndarray, measured: np.ndarray) -> float | None:
        """Mean |predicted / measured - 1| over the runs that measured the figure."""
        have = ~np.isnan(measured) & ~np.isnan(predicted)
        if not have.any():
            return None
        return float(np.mean(np.abs(predicted[have] / measured[have] - 1)))


@dataclass(frozen=True)
class _Peaks:
    """One run's predicted allocated peak per pipeline rank with no transient buffers live at
    the peak (``none``) and with all of them (``all``)."""

    none: np.ndarray
    all: np.ndarray

    def allocated(self, share: float) -> float:
        return float(np.max(self.none + share * (self.all - self.none)))


def _peaks(run: LoggedRun) -> _Peaks:
    from planner.costs.memory import stage_memory
    from planner.frameworks import framework
    from planner.specs import TrainingJob

    layout = run.layout
    m = layout.num_microbatches or run.job.global_batch // (layout.dp * layout.micro_batch)
    runtime = framework(run.job.framework).pipeline_runtime
    out = []
    for share in (0.0, 1.0):
        job = TrainingJob(**{**run.job.model_dump(), "buffers_at_peak": share})
        stages = stage_memory(run.model, job, layout, num_microbatches=m, runtime=runtime)
        out.append(np.array([s.allocated_bytes for s in stages], dtype=float))
    return _Peaks(out[0], out[1])


def _grid(high: float) -> np.ndarray:
    return np.round(np.arange(0.0, high + GRID / 2, GRID), 6)


def _fit_one(
    peaks: Sequence[_Peaks], allocated: np.ndarray, reserved: np.ndarray, start: tuple[float, float]
) -> tuple[float, float, bool, bool]:
    """(buffers_at_peak, fragmentation, informed, informed) for runs of one framework: each
    the grid value with the least mean |predicted / measured - 1|, ties to the larger (the
    more cautious); a constant no run measures keeps ``start``."""
    share, frag = start
    have_a = ~np.isnan(allocated)
    informed_a = bool(have_a.any()) and any(
        p.allocated(1.0) != p.allocated(0.0) for p, h in zip(peaks, have_a, strict=True) if h
    )
    if informed_a:
        errors = [
            np.mean(
                [
                    abs(p.allocated(b) / a - 1)
                    for p, a in zip(peaks, allocated, strict=True)
                    if a == a
                ]
            )
            for b in _grid(1.0)
        ]
        share = float(_grid(1.0)[_last_min(errors)])
    # a log whose reserved peak is its allocated one measured no allocator (planner validate on
    # the CPU writes both figures the same): it says nothing of fragmentation
    have_r = ~np.isnan(reserved) & (reserved != allocated)
    if have_r.any():
        predicted = np.array([p.allocated(share) for p in peaks])
        errors = [
            np.mean(np.abs(predicted[have_r] * (1 + f) / reserved[have_r] - 1))
            for f in _grid(MAX_FRAGMENTATION)
        ]
        frag = float(_grid(MAX_FRAGMENTATION)[_last_min(errors)])
    return share, frag, informed_a, bool(have_r.any())


def _last_min(errors: Sequence[float]) -> int:
    """Index of the smallest error (the last of equal ones, within 1e-12)."""
    best = min(errors)
    return max(i for i, e in enumerate(errors) if e <= best + 1e-12)


def fit_memory(runs: Sequence[LoggedRun]) -> MemoryReport:
    """The memory constants of each framework among ``runs`` fitted to their logged peaks, and
    each run's peaks predicted with the constants its job had, the fitted ones, and ones
    fitted to the framework's other runs alone (held out)."""
    peaks = [_peaks(r) for r in runs]
    nan = float("nan")
    allocated = np.array([r.allocated_peak_bytes or nan for r in runs], dtype=float)
    reserved = np.array([r.reserved_peak_bytes or nan for r in runs], dtype=float)
    frameworks = tuple(dict.fromkeys(r.framework for r in runs))
    before: dict[str, tuple[float, float]] = {}
    fitted: dict[str, tuple[float, float]] = {}
    informed: dict[str, tuple[bool, bool]] = {}
    n = len(runs)
    out = {k: np.full(n, nan) for k in ("ba", "br", "fa", "fr", "ha", "hr")}
    for name in frameworks:
        idx = [i for i, r in enumerate(runs) if r.framework == name]
        first = runs[idx[0]].job
        before[name] = (first.buffers_at_peak, first.fragmentation)
        share, frag, ia, ir = _fit_one(
            [peaks[i] for i in idx], allocated[idx], reserved[idx], before[name]
        )
        fitted[name] = (share, frag)
        informed[name] = (ia, ir)
        for i in idx:
            job = runs[i].job
            a = peaks[i].allocated(job.buffers_at_peak)
            out["ba"][i], out["br"][i] = a, a * (1 + job.fragmentation)
            a = peaks[i].allocated(share)
            out["fa"][i], out["fr"][i] = a, a * (1 + frag)
            rest = [j for j in idx if j != i]
            if rest:
                hs, hf, _, _ = _fit_one(
                    [peaks[j] for j in rest], allocated[rest], reserved[rest], before[name]
                )
                a = peaks[i].allocated(hs)
                out["ha"][i], out["hr"][i] = a, a * (1 + hf)
    at_bound = []
    for name, (share, frag) in fitted.items():
        if informed[name][0] and share in (0.0, 1.0):
            at_bound.append(f"buffers_at_peak[{name}]")
        if informed[name][1] and frag in (0.0, MAX_FRAGMENTATION):
            at_bound.append(f"fragmentation[{name}]")
    return MemoryReport(
        frameworks=frameworks,
        before=before,
        fitted=fitted,
        informed=informed,
        at_bound=tuple(at_bound),
        measured_allocated=allocated,
        measured_reserved=reserved,
        before_allocated=out["ba"],
        before_reserved=out["br"],
        fitted_allocated=out["fa"],
        fitted_reserved=out["fr"],
        heldout_allocated=out["ha"],
        heldout_reserved=out["hr"],
    )
