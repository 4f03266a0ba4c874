"""Tensor and pipeline parallelism against ZeRO-3 on one model and cluster: the ranking that
the Megatron-LM SC'21 paper measured, and where DeepSpeed's 2021 per-tensor costs come from.

Data: ``benchmarks/published_runs.csv``, the rows of arXiv 2104.04473 Table 2: GPT 175B on
384, 768 and 1,536 A100 (batch 1,536) and 530B on 560 or 640, 1,120 and 2,240 A100 (batch
2,240; 2,560 on 640), once with ZeRO-3 and no model parallelism (DeepSpeed, priced as
``deepspeed-2021``) and once with tp 8 and pp 12 or 35 (Megatron-LM). Five GPU counts have
both: five pairs to order.

``deepspeed-2021`` (``planner.frameworks``) gathers no parameter beside compute, and runs a
collective per parameter tensor whose host work copies each rank's slice,
``Framework.zero3_slice_s`` apiece. That host time is fitted here on one model's ZeRO-3 rows
(a 0.1 us grid, least absolute percentage error) and checked on the other model's rows,
both ways; the registry keeps the fit on the 175B rows. The pairs are ranked under the
registry's value, with no slice copies (what the source code alone fixes: gathers in series,
one latency per tensor), and with ZeRO-3 priced as today's DeepSpeed (``deepspeed``: gathers
prefetched beside compute, one collective per bucket).

Run: ``.venv/bin/python benchmarks/ptdp_vs_zero3.py``.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from contextlib import contextmanager

import published_throughput

from planner import frameworks

NAME = "deepspeed-2021"
PREFIXES = ("megatron-sc21-zero3-", "megatron-sc21-ptdp-")


def rows() -> list[dict[str, str]]:
    with published_throughput.DATA.open(newline="") as handle:
        return [r for r in csv.DictReader(handle) if r["id"].startswith(PREFIXES)]


@contextmanager
def slice_time(seconds: float | None, *, today: bool = False) -> Iterator[None]:
    """``deepspeed-2021`` with ``seconds`` per slice copy (or priced as ``deepspeed``)."""
    if today:
        with frameworks.replaced(NAME, frameworks.framework("deepspeed")):
            yield
    else:
        with frameworks.replaced(NAME, zero3_slice_s=seconds):
            yield


def steps(chosen: list[dict[str, str]]) -> dict[str, tuple[float, float]]:
    """(measured, predicted) seconds per step of each row, under the entry in force."""
    out = {}
    for r in chosen:
        measured, predicted, _ = published_throughput.cost(r)
        out[r["id"]] = (measured, predicted)
    return out


def mape(result: dict[str, tuple[float, float]]) -> float:
    return sum(abs(p / m - 1) for m, p in result.values()) / len(result)


def fit(chosen: list[dict[str, str]]) -> float:
    """The slice copy time (s) on a 0.1 us grid up to 20 us that minimises the mean absolute
    percentage error over ``chosen``."""
    best, best_error = 0.0, float("inf")
    for tenth_us in range(0, 201):
        with slice_time(tenth_us * 1e-7):
            error = mape(steps(chosen))
        if error < best_error:
            best, best_error = tenth_us * 1e-7, error
    return best


def pairs(result: dict[str, tuple[float, float]], table: list[dict[str, str]]) -> list[str]:
    """Each GPU count measured both ways: which the model favours, and the regret."""
    lines = []
    by_gpus: dict[tuple[str, str], dict[str, str]] = {}
    for r in table:
        kind = "zero3" if r["id"].startswith(PREFIXES[0]) else "ptdp"
        by_gpus.setdefault((r["model"], r["num_gpus"]), {})[kind] = r["id"]
    for (model, gpus), ids in by_gpus.items():
        if len(ids) < 2:
            continue
        (zm, zp), (tm, tp) = result[ids["zero3"]], result[ids["ptdp"]]
        favoured, other = ("ptdp", "zero3") if tp <= zp else ("zero3", "ptdp")
        measured = {"zero3": zm, "ptdp": tm}
        regret = measured[favoured] / min(zm, tm) - 1
        size = "175B" if "12288" in model else "530B"
        lines.append(
            f"  {size} on {gpus:>4} A100: measured ZeRO-3 {zm:6.1f} s, PTD-P {tm:6.1f} s; "
            f"predicted {zp:6.1f} s, {tp:6.1f} s: favours {favoured} "
            f"({'right' if measured[favoured] <= measured[other] else 'backwards'}, "
            f"regret {regret:.1%})"
        )
    return lines


def main() -> int:
    table = rows()
    zero3 = [r for r in table if r["id"].startswith(PREFIXES[0])]
    small = [r for r in zero3 if "hidden=12288" in r["model"]]
    large = [r for r in zero3 if "hidden=20480" in r["model"]]
    shipped = frameworks.framework(NAME).zero3_slice_s
    print(f"{NAME}: registry slice copy time {shipped * 1e6:.1f} us")
    for fitted_on, held, label in ((small, large, "175B"), (large, small, "530B")):
        value = fit(fitted_on)
        with slice_time(value):
            result = steps(held)
        errors = ", ".join(f"{p / m - 1:+.1%}" for m, p in result.values())
        print(
            f"  fitted on the {label} ZeRO-3 rows: {value * 1e6:.1f} us; the other model's "
            f"rows held out: {errors} (mean |error| {mape(result):.1%})"
        )
    for title, context in (
        ("priced as today's DeepSpeed (deepspeed)", slice_time(None, today=True)),
        (f"priced as {NAME} without the slice copies (0 us)", slice_time(0.0)),
        (f"priced as {NAME} ({shipped * 1e6:.1f} us)", slice_time(shipped)),
    ):
        with context:
            result = steps(table)
        print(f"{title}: mean |error| {mape(result):.1%} over {len(result)} rows")
        for rid, (m, p) in result.items():
            print(f"  {rid:34} measured {m:7.1f} s  predicted {p:7.1f} s  {p / m - 1:+6.1%}")
        print("\n".join(pairs(result, table)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
