"""Pictures drawn with matplotlib (its Agg canvas: no display needed), as PNG, SVG or PDF
chosen by the file's suffix.

- ``plot_memory``: per pipeline rank, its memory buckets stacked against the GPU's usable
  HBM and the cap.
- ``plot_step_time``: the step time's parts, one row each, laid end to end (a waterfall
  whose last bar ends at the step time).
- ``plot_sweep``: step time, MFU and tokens/s against GPU count (log2 axis), one line per
  model, machine type and job; a case with no layout is marked at the bottom of each panel.

The pipeline timeline is the simulator's Perfetto trace (``Simulation.to_chrome_trace``).
matplotlib is imported inside the functions, so ``import planner`` does not pay for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.costs.memory import BUCKETS
from planner.errors import PlannerError
from planner.estimate import Estimate
from planner.timeline import PARTS as BREAKDOWN_KEYS

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

GiB = 2**30
FORMATS = ("png", "svg", "pdf")
DPI = 150  # PNG resolution: 150 dots per inch keeps 9-point tick labels legible
# A y axis goes to log scale when its largest value is more than this many times its smallest.
LOG_SPAN = 10.0
# Sweep panels: (row key, axis label with unit, factor from the row's unit to the axis's).
METRICS = (
    ("step_time_s", "step time (s)", 1.0),
    ("mfu", "MFU (% of dense BF16 peak)", 100.0),
    ("tokens_per_s", "throughput (tokens/s)", 1.0),
)


def picture_format(path: str | Path, *, option: str = "path") -> str:
    """The format a picture file's suffix asks for: png, svg or pdf; any other suffix (or
    none) is a one-line error naming ``option``."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise PlannerError(f"{option}={str(path)!r}: the suffix must be .png, .svg or .pdf")
    return suffix


def picture_paths(prefix: str | Path, *, option: str = "path") -> tuple[Path, Path]:
    """``PREFIX-memory.EXT`` and ``PREFIX-time.EXT``: a .png, .svg or .pdf suffix on the
    prefix picks the format, no suffix means SVG, any other suffix is an error."""
    prefix = Path(prefix)
    if not prefix.suffix:
        prefix = prefix.with_name(prefix.name + ".svg")
    ext = picture_format(prefix, option=option)
    stem = prefix.with_suffix("")
    return (
        stem.with_name(f"{stem.name}-memory.{ext}"),
        stem.with_name(f"{stem.name}-time.{ext}"),
    )


def plot_memory(est: Estimate, path: str | Path, *, title: str = "") -> Path:
    """Stacked memory buckets (GiB) per pipeline rank against usable HBM and the cap (usable
    HBM less the margin for the memory model's error)."""
    fmt = picture_format(path)
    ranks = est.memory
    fig = _figure(max(6.0, min(16.0, 3.0 + 0.25 * len(ranks))), 4.8)
    ax = fig.add_subplot()
    xs = list(range(len(ranks)))
    base = [0.0] * len(ranks)
    bars: list[Any] = []
    for i, bucket in enumerate(BUCKETS):
        sizes = [m.buckets.get(bucket, 0) / GiB for m in ranks]
        if any(sizes):
            bars.append(ax.bar(xs, sizes, bottom=base, width=0.8, color=f"C{i}", label=bucket))
            base = [b + s for b, s in zip(base, sizes, strict=True)]
    usable, cap = est.usable_hbm_bytes / GiB, est.cap_bytes / GiB
    lines = [
        ax.axhline(usable, color="black", linestyle="--", label=f"usable HBM {usable:.2f} GiB"),
        ax.axhline(cap, color="#c00000", linestyle=":", label=f"cap {cap:.2f} GiB"),
    ]
    step = math.ceil(len(ranks) / 32) or 1  # at most 32 rank labels
    ax.set_xticks(xs[::step], [str(m.stage) for m in ranks][::step])
    ax.set_xlabel("pipeline rank (index)")
    ax.set_ylabel("memory per rank (GiB)")
    ax.set_ylim(0, max(usable, *base) * 1.08)
    ax.set_title(title or "memory per pipeline rank against usable HBM and the cap")
    ax.legend(  # the two lines, then the buckets top to bottom as they are stacked
        handles=[*lines, *reversed(bars)], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9
    )
    return _save(fig, path, fmt)


def plot_step_time(est: Estimate, path: str | Path, *, title: str = "") -> Path:
    """The step time's parts (seconds), one row each, each starting where the one above
    ends, so the last ends at the step time."""
    fmt = picture_format(path)
    keys = [k for k in BREAKDOWN_KEYS if est.breakdown.get(k, 0.0) > 0]
    keys += sorted(k for k, v in est.breakdown.items() if v > 0 and k not in BREAKDOWN_KEYS)
    total = sum(est.breakdown[k] for k in keys) or 1.0
    fig = _figure(9.0, 1.6 + 0.4 * max(1, len(keys)))
    ax = fig.add_subplot()
    start = 0.0
    for row, key in enumerate(keys):
        seconds = est.breakdown[key]
        colour = f"C{BREAKDOWN_KEYS.index(key) if key in BREAKDOWN_KEYS else row}"
        ax.broken_barh([(start, seconds)], (row - 0.4, 0.8), facecolors=colour)
        ax.annotate(
            f"{_duration(seconds)} ({seconds / total:.1%})",
            (start + seconds, row),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=9,
        )
        start += seconds
    ax.axvline(est.step_time_s, color="black", linestyle="--", linewidth=1)
    trans = ax.get_xaxis_transform()  # x in seconds, y in axes coordinates
    ax.text(est.step_time_s, 0.02, "end of step ", transform=trans, ha="right", fontsize=8)
    ax.set_yticks(range(len(keys)), keys)
    ax.invert_yaxis()  # first part on top
    ax.set_xlim(0, total * 1.3)  # room for the last row's label
    ax.set_xlabel("time into the optimizer step (s)")
    ax.set_ylabel("part of the step")
    ax.set_title(title or f"step time {est.step_time_s:.3f} s")
    return _save(fig, path, fmt)


def plot_sweep(rows: Iterable[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Step time, MFU and tokens/s against GPU count (log2 axis), a line per model, machine
    type and job. A case without a layout is a cross at the bottom of each panel (a triangle
    where its planning failed), never a point on the curve; the line breaks there."""
    from matplotlib.lines import Line2D

    fmt = picture_format(path)
    rows = list(rows)
    jobs = sorted(
        {(r.get("seq_len"), r.get("global_batch")) for r in rows},
        key=lambda j: (j[0] or 0, j[1] or 0),
    )
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        label = f"{r['model']} on {r['gpu']}"
        if len(jobs) > 1:
            label += f", {r.get('seq_len')} tokens x {r.get('global_batch')} sequences"
        series.setdefault(label, []).append(r)
    fig = _figure(15.0, 5.0)
    axes = fig.subplots(1, len(METRICS))
    gpus = sorted({int(r["gpus"]) for r in rows})
    marks = {"infeasible": False, "failed": False}
    for ax, (key, label, factor) in zip(axes, METRICS, strict=True):
        for i, (_, rs) in enumerate(sorted(series.items())):
            colour = f"C{i % 10}"
            rs = sorted(rs, key=lambda r: int(r["gpus"]))
            ys = [_value(r, key, factor) for r in rs]
            ax.plot([r["gpus"] for r in rs], ys, marker="o", color=colour)
            for r, y in zip(rs, ys, strict=True):
                if math.isnan(y):
                    kind = "failed" if r.get("status") == "failed" else "infeasible"
                    marks[kind] = True
                    _bottom_mark(ax, r["gpus"], kind, colour)
        _gpu_axis(ax, gpus)
        values = [v for r in rows if not math.isnan(v := _value(r, key, factor))]
        if key == "mfu":
            ax.set_ylim(0, max(values, default=1.0) * 1.15)
        elif values and max(values) > LOG_SPAN * min(values) > 0:
            _log_y(ax, tokens=key == "tokens_per_s")
        elif key == "tokens_per_s":
            _eng_y(ax)
        ax.set_xlabel("GPUs (log2 scale)")
        ax.set_ylabel(label)
        ax.grid(True, which="major", alpha=0.3)
    handles: list[Any] = [
        Line2D([], [], color=f"C{i % 10}", marker="o", label=name)
        for i, name in enumerate(sorted(series))
    ]
    for kind, text in (
        ("infeasible", "infeasible: no layout found"),
        ("failed", "failed: planning raised an error"),
    ):
        if marks[kind]:
            handles.append(Line2D([], [], **_MARK[kind], color="black", label=text))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(4, len(handles)))
    fig.suptitle(title or _sweep_title(rows, jobs))
    return _save(fig, path, fmt)


# -- helpers ---------------------------------------------------------------------------

_MARK: dict[str, dict[str, Any]] = {
    "infeasible": {"marker": "x", "markersize": 10, "markeredgewidth": 2, "linestyle": "none"},
    "failed": {"marker": "v", "markersize": 8, "linestyle": "none"},
}


def _figure(width: float, height: float) -> Figure:
    """A figure on its own Agg canvas: no pyplot, no global figure list."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str | Path, fmt: str) -> Path:
    """Write ``fig``; SVG keeps its text as text (searchable, and the tests read it) and no
    file carries a date, so the same picture gives the same bytes."""
    import matplotlib

    path = Path(path)
    metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None}, "png": {}}[fmt]
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "planner"}):
        fig.savefig(path, format=fmt, dpi=DPI, metadata=metadata)
    return path


def _duration(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds >= 0.01 else f"{seconds * 1e3:.3g} ms"


def _value(row: dict[str, Any], key: str, factor: float) -> float:
    v = row.get(key)
    return float("nan") if v is None else float(v) * factor


def _bottom_mark(ax: Axes, gpus: int, kind: str, colour: str) -> None:
    """A mark at ``gpus`` on the panel's bottom edge: x in data, y in axes coordinates, so it
    stays off every value scale."""
    trans = ax.get_xaxis_transform()
    ax.plot([gpus], [0.0], transform=trans, clip_on=False, zorder=5, color=colour, **_MARK[kind])


def _gpu_axis(ax: Axes, gpus: Sequence[int]) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullLocator

    ax.set_xscale("log", base=2)
    if gpus and len(gpus) <= 10:
        ax.xaxis.set_major_locator(FixedLocator(list(gpus)))
        ax.xaxis.set_minor_locator(NullLocator())
    else:
        ax.xaxis.set_major_locator(LogLocator(base=2))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    if len(gpus) == 1:
        ax.set_xlim(gpus[0] / 1.5, gpus[0] * 1.5)


def _log_y(ax: Axes, *, tokens: bool) -> None:
    from matplotlib.ticker import EngFormatter, FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_formatter(NullFormatter())
    if tokens:
        ax.yaxis.set_major_formatter(EngFormatter(sep=" "))
    else:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _eng_y(ax: Axes) -> None:
    from matplotlib.ticker import EngFormatter

    ax.yaxis.set_major_formatter(EngFormatter(sep=" "))


def _sweep_title(rows: Sequence[dict[str, Any]], jobs: Sequence[tuple[Any, Any]]) -> str:
    models = sorted({str(r["model"]) for r in rows})
    gpus = sorted({str(r["gpu"]) for r in rows})
    text = f"sweep: {', '.join(models)} on {', '.join(gpus)}"
    if 0 < len(jobs) <= 3:
        text += "; " + ", ".join(f"{s} tokens x {b} sequences per step" for s, b in jobs)
    elif jobs:
        text += f"; {len(jobs)} jobs"
    return text
