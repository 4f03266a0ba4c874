"""Pictures as standalone SVG files (no plotting library needed).

- ``memory_svg``: per pipeline rank, its memory buckets stacked against the GPU's HBM line.
- ``time_svg``: the step time's breakdown as one stacked bar with its parts labelled.
- ``sweep_svg``: step time, MFU and tokens/s against GPU count (log scale), one line per
  model and machine type.

The pipeline timeline is the simulator's Perfetto trace (``Simulation.to_chrome_trace``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from html import escape
from pathlib import Path
from typing import Any

from planner.costs.memory import BUCKETS
from planner.estimate import Estimate
from planner.timeline import PARTS as BREAKDOWN_KEYS

GiB = 2**30
COLOURS = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)
FONT = 'font-family="sans-serif"'


class _Svg:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.parts: list[str] = []

    def rect(self, x: float, y: float, w: float, h: float, fill: str, tip: str = "") -> None:
        title = f"<title>{escape(tip)}</title>" if tip else ""
        self.parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{max(h, 0):.1f}" '
            f'fill="{fill}">{title}</rect>'
        )

    def line(self, x1: float, y1: float, x2: float, y2: float, **style: str) -> None:
        attrs = " ".join(f'{k.replace("_", "-")}="{v}"' for k, v in style.items())
        self.parts.append(
            f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" {attrs}/>'
        )

    def polyline(self, points: Sequence[tuple[float, float]], colour: str) -> None:
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        self.parts.append(
            f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="2"/>'
        )
        for x, y in points:
            self.parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>')

    def text(self, x: float, y: float, s: str, anchor: str = "start", **extra: str) -> None:
        extra = {"font_size": "12", **extra}
        attrs = " ".join(f'{k.replace("_", "-")}="{v}"' for k, v in extra.items())
        head = f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" {FONT} {attrs}>'
        self.parts.append(f"{head}{escape(s)}</text>")

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        body = "\n".join(self.parts)
        path.write_text(
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" '
            f'height="{self.height}" viewBox="0 0 {self.width} {self.height}">\n'
            f'<rect width="100%" height="100%" fill="white"/>\n{body}\n</svg>\n'
        )
        return path


def memory_svg(est: Estimate, path: str | Path, *, title: str = "") -> Path:
    """Stacked memory buckets (GiB) per pipeline rank against usable HBM and the cap (usable
    HBM less the margin for the memory model's error)."""
    ranks = est.memory
    left, top, plot_h = 70, 40, 320
    bar_w = max(8, min(48, 900 // max(1, len(ranks))))
    gap = max(2, bar_w // 4)
    width = left + len(ranks) * (bar_w + gap) + 300
    svg = _Svg(width, top + plot_h + 60)
    scale_max = max([est.usable_hbm_bytes, *(m.peak_bytes for m in ranks)]) * 1.05
    y = _linear(0, scale_max, top + plot_h, top)
    svg.text(
        left,
        20,
        title or "memory per pipeline rank (GiB) against usable HBM and the cap",
        **{"font-weight": "bold"},
    )
    for tick in _ticks(0, scale_max / GiB):
        svg.line(
            left - 4, y(tick * GiB), left + len(ranks) * (bar_w + gap), y(tick * GiB), stroke="#eee"
        )
        svg.text(left - 8, y(tick * GiB) + 4, f"{tick:g}", anchor="end")
    for i, m in enumerate(ranks):
        x = left + i * (bar_w + gap)
        base = 0
        for colour, bucket in zip(COLOURS, BUCKETS, strict=False):
            size = m.buckets.get(bucket, 0)
            if size:
                tip = f"rank {m.stage} {bucket}: {size / GiB:.2f} GiB"
                svg.rect(x, y(base + size), bar_w, y(base) - y(base + size), colour, tip)
            base += size
        svg.text(x + bar_w / 2, top + plot_h + 16, str(m.stage), anchor="middle")
    svg.text(
        left + len(ranks) * (bar_w + gap) / 2, top + plot_h + 36, "pipeline rank", anchor="middle"
    )
    right = left + len(ranks) * (bar_w + gap)
    usable, cap = y(est.usable_hbm_bytes), y(est.cap_bytes)
    svg.line(left, usable, right, usable, stroke="black", stroke_dasharray="6,3")
    svg.text(right + 4, usable - 2, f"usable HBM {est.usable_hbm_bytes / GiB:.2f} GiB")
    svg.line(left, cap, right, cap, stroke="#c00", stroke_dasharray="2,2")
    svg.text(right + 4, cap + 12, f"cap {est.cap_bytes / GiB:.2f} GiB")
    _legend(svg, left + len(ranks) * (bar_w + gap) + 150, top + 20, list(BUCKETS))
    return svg.write(path)


def time_svg(est: Estimate, path: str | Path, *, title: str = "") -> Path:
    """The step time's parts (seconds) as one stacked horizontal bar."""
    left, width = 20, 760
    svg = _Svg(width + 2 * left, 150)
    total = sum(est.breakdown.values()) or 1.0
    svg.text(left, 20, title or f"step time {est.step_time_s:.3f} s", **{"font-weight": "bold"})
    x = float(left)
    keys = [k for k in BREAKDOWN_KEYS if est.breakdown.get(k, 0.0) > 0]
    for colour, key in zip(COLOURS, BREAKDOWN_KEYS, strict=False):
        seconds = est.breakdown.get(key, 0.0)
        if seconds <= 0:
            continue
        w = width * seconds / total
        svg.rect(x, 40, w, 36, colour, f"{key}: {seconds:.3f} s ({seconds / total:.1%})")
        if w > 60:
            svg.text(x + w / 2, 63, f"{seconds:.2f} s", anchor="middle", fill="white")
        x += w
    legend = [f"{k} {est.breakdown[k]:.3f} s" for k in keys]
    colours = [c for c, k in zip(COLOURS, BREAKDOWN_KEYS, strict=False) if k in keys]
    for i, (label, colour) in enumerate(zip(legend, colours, strict=True)):
        lx = left + (i % 4) * 190
        ly = 100 + (i // 4) * 18
        svg.rect(lx, ly - 10, 12, 12, colour)
        svg.text(lx + 16, ly, label)
    return svg.write(path)


METRICS = (
    ("step_time_s", "step time (s)"),
    ("mfu", "MFU (% of BF16 peak)"),
    ("tokens_per_s", "tokens/s (millions)"),
)


def sweep_svg(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Step time, MFU and tokens/s against GPU count (log 2 axis), a line per model and
    machine type; cases without a layout are left out of their line."""
    rows = [r for r in rows if r.get("step_time_s") is not None]
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault(f"{r['model']} on {r['gpu']}", []).append(r)
    panel_w, panel_h, left, top = 300, 220, 60, 40
    svg = _Svg(3 * (panel_w + left) + 40, top + panel_h + 60 + 18 * max(1, len(series)))
    gpus = sorted({r["gpus"] for r in rows}) or [1]
    x = _log2(gpus[0], gpus[-1], 0, panel_w)
    for p, (metric, label) in enumerate(METRICS):
        ox = 20 + p * (panel_w + left) + left
        values = [_metric(r, metric) for r in rows] or [0.0, 1.0]
        lo, hi = 0.0, max(values) * 1.1 or 1.0
        y = _linear(lo, hi, top + panel_h, top)
        svg.text(ox + panel_w / 2, top - 12, label, anchor="middle", **{"font-weight": "bold"})
        for tick in _ticks(lo, hi):
            svg.line(ox, y(tick), ox + panel_w, y(tick), stroke="#eee")
            svg.text(ox - 6, y(tick) + 4, f"{tick:g}", anchor="end")
        shown = -1e9
        for g in gpus:  # labels at least 34 px apart
            if x(g) - shown >= 34:
                svg.text(ox + x(g), top + panel_h + 16, f"{g}", anchor="middle", font_size="9")
                shown = x(g)
        svg.text(ox + panel_w / 2, top + panel_h + 34, "GPUs (log scale)", anchor="middle")
        for colour, (_, rs) in zip(COLOURS, sorted(series.items()), strict=False):
            pts = sorted((r["gpus"], _metric(r, metric)) for r in rs)
            svg.polyline([(ox + x(g), y(v)) for g, v in pts], colour)
    _legend(svg, 20 + left, top + panel_h + 56, sorted(series))
    return svg.write(path)


def _metric(row: dict[str, Any], metric: str) -> float:
    v = float(row[metric])
    return v * 100 if metric == "mfu" else v / 1e6 if metric == "tokens_per_s" else v


def _legend(svg: _Svg, x: float, y: float, labels: Sequence[str]) -> None:
    for i, (colour, label) in enumerate(zip(COLOURS, labels, strict=False)):
        svg.rect(x, y + i * 18 - 10, 12, 12, colour)
        svg.text(x + 16, y + i * 18, label)


def _linear(lo: float, hi: float, out_lo: float, out_hi: float):  # type: ignore[no-untyped-def]
    span = (hi - lo) or 1.0
    return lambda v: out_lo + (v - lo) / span * (out_hi - out_lo)


def _log2(lo: float, hi: float, out_lo: float, out_hi: float):  # type: ignore[no-untyped-def]
    a, b = math.log2(lo), math.log2(hi)
    span = (b - a) or 1.0
    return lambda v: out_lo + (math.log2(v) - a) / span * (out_hi - out_lo)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * step:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step) + 1)]
