"""Where is the time model wrong? Each measured row's error, grouped by what the row is.

Every row that ``benchmarks/rankings.py`` costs (the MoE ladders, the published runs,
Megatron-LM's functional tests where harvested, vTrain's single-node A100 iterations) is
costed at the catalog's constants (``planner.evaluate``; nothing fitted, no constant per row),
and its error (predicted / measured time per step, minus 1) is printed, then grouped by
each feature of the row: GPU, GPU count, framework, precision, schedule, dense or MoE, hidden
size, parameter count, sequence, tp, pp, dp, ep, cp, micro-batch, micro-batches per step, the
source, and for harvested runs each setting in their ``flags`` (rows with it against rows
without). For each
group: the rows, the mean signed error (the bias) and the mean absolute error. A bias that
moves with a feature, on rows from several sources, points at a mechanism the model lacks or
misprices; one confined to a single source may be that source's own conditions.

vTrain's 1,440 rows (one source, one machine, small GPTs) would outweigh the rest, so they are
grouped apart from the others.

Run: ``.venv/bin/python benchmarks/residuals.py [--only moe|published|ci|vtrain ...]
[--rows] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import rankings

# Numeric features are grouped into ranges: (feature, upper bounds of the ranges).
RANGES: dict[str, tuple[float, ...]] = {
    "gpus": (8, 64, 512, 4096, float("inf")),
    "hidden": (2048, 4096, 8192, float("inf")),
    "params_b": (3, 30, 100, 300, float("inf")),
    "seq": (2048, 4096, 8192, float("inf")),
    "dp": (1, 8, 64, 512, float("inf")),
    "microbatches": (1, 4, 16, 64, float("inf")),
}
FEATURES = (
    "source", "gpu", "gpus", "framework", "precision", "schedule", "moe", "hidden", "params_b",
    "seq", "tp", "pp", "dp", "ep", "cp", "mb", "microbatches", "flags",
)  # fmt: skip


def bucket(feature: str, value: object) -> str:
    """The group a row's ``value`` of ``feature`` falls in."""
    bounds = RANGES.get(feature)
    if bounds is None or not isinstance(value, int | float):
        return str(value)
    low = 0.0
    for high in bounds:
        if value <= high:
            if high == float("inf"):
                return f"> {low:g}"
            return f"({low:g}, {high:g}]" if low else f"<= {high:g}"
        low = high
    return str(value)


def table(rows: list[rankings.Item], feature: str) -> list[dict[str, object]]:
    """One line per group of ``rows`` by ``feature``: rows, bias, mean |error|. A row's
    ``flags`` (the settings a harvested run lists) put it in one group per flag, against
    the rows without that flag."""
    by: dict[str, list[float]] = defaultdict(list)
    if feature == "flags":
        flagged = [i for i in rows if "flags" in i.features]
        names = sorted({f for i in flagged for f in i.features["flags"]})  # type: ignore[attr-defined]
        for name in names:
            for item in flagged:
                has = name in item.features["flags"]  # type: ignore[operator]
                by[f"{name}: {'with' if has else 'without'}"].append(item.error)
        return _lines(feature, by, order=lambda kv: kv[0])
    for item in rows:
        if feature in item.features:
            by[bucket(feature, item.features[feature])].append(item.error)
    return _lines(feature, by, order=lambda kv: -len(kv[1]))


def _lines(
    feature: str, by: dict[str, list[float]], order: Callable[[tuple[str, list[float]]], Any]
) -> list[dict[str, object]]:
    out = []
    for value, errors in sorted(by.items(), key=order):
        e = np.array(errors)
        out.append(
            {
                "feature": feature,
                "value": value,
                "rows": len(e),
                "bias": round(float(e.mean()), 4),
                "mape": round(float(np.abs(e).mean()), 4),
            }
        )
    return out


def print_tables(name: str, rows: list[rankings.Item]) -> list[dict[str, object]]:
    e = np.array([i.error for i in rows])
    print(
        f"\n== {name}: {len(rows)} rows, bias {e.mean():+.1%}, mean |error| "
        f"{np.abs(e).mean():.1%}, median |error| {np.median(np.abs(e)):.1%}, within 10%: "
        f"{int(np.sum(np.abs(e) <= 0.10))}"
    )
    lines = []
    for feature in FEATURES:
        found = table(rows, feature)
        if len(found) < 2:
            continue
        print(f"  by {feature}:")
        for line in found:
            print(
                f"    {str(line['value'])[:44]:44} {line['rows']:5} rows  bias "
                f"{line['bias']:+7.1%}  |error| {line['mape']:6.1%}"
            )
        lines.extend(found)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=rankings.SOURCES, default=rankings.SOURCES)
    parser.add_argument("--rows", action="store_true", help="print every row's error first")
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    found = list(rankings.costed_items(list(args.only)))
    if args.rows and not args.json:
        for source, item in found:
            print(
                f"{source:9} {item.id[:50]:50} {item.layout[:44]:44} measured "
                f"{1e6 * item.measured_s_per_token:9.3f} us/token, error {item.error:+7.1%}"
            )
    pooled = [item for source, item in found if source != "vtrain"]
    vtrain = [item for source, item in found if source == "vtrain"]
    out: dict[str, list[dict[str, object]]] = {}
    for name, rows in (("published, ladders and CI runs", pooled), ("vTrain", vtrain)):
        if rows and args.json:
            out[name] = [line for f in FEATURES for line in table(rows, f)]
        elif rows:
            out[name] = print_tables(name, rows)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"wall time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
