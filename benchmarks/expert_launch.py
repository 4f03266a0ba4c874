"""Routed experts launched one GEMM at a time: what each launch costs the step.

Megatron-LM runs a rank's routed experts (``--moe-grouped-gemm``, the default
``TEGroupedMLP``) through Transformer Engine's ``GroupedLinear``, which issues one cuBLAS GEMM
per local expert, round-robin over four streams (``nvte_multi_stream_cublas_gemm``,
``num_streams = 4`` in TE's ``gemm.h``), each with its own cuBLASLt descriptors and heuristic
query on the host; the expert layer needs the tokens per expert on the host first
(``tokens_per_expert.tolist()``; the all-to-all dispatcher synchronises before the EP
all-to-all for its split sizes), so the GPU's queue is empty when those launches begin: the
experts' GEMMs take the longer of their GPU time and the host's launches. A layout with many
local experts per rank (ep small against the expert count), each with few tokens, is bound
by its launches; one with few local experts is not. The model prices this with
``Framework.expert_gemm_launch_s``, the host seconds per expert GEMM (two per expert forward,
four backward, the forward two again under recompute).

The constant is fitted here, on the measured MoE ladders (``benchmarks/moe_ladders.csv``: one
model on one cluster, several layouts, one team): on the ratios between a ladder's layouts,
not their absolute times, so the model's bias common to every row of a source (about -12%,
dense rows too) cannot pull it. For each value on a 2 us grid from 0 to 60 us (a bare CUDA
launch is a few us; one through TE's Python and C++ with cuBLASLt's descriptors and
heuristic query per call, and Megatron-LM's per-parameter gradient hooks, tens), each
ladder pair's error is |log(predicted ratio / measured ratio)|; the fit minimises their
mean. Two sources hold ladders (the MoE Parallel Folding paper, arXiv
2504.14960, 16 ladders; Megatron-MoE-ModelZoo's Qwen3-235B table, one): each is held out in
turn (fitted on the other, judged on it), and within the paper each table in turn.

Printed: the pair error and the ladders ordered exactly as measured for each value; the
fitted values; every ladder row's error at 0 and at the registry's value; the published MoE
rows run by Megatron-LM at both.

Run: ``.venv/bin/python benchmarks/expert_launch.py`` (about 2 minutes).
"""

from __future__ import annotations

import csv
import itertools
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_ladders
import published_throughput
from rankings import source_key

from planner import frameworks

GRID_US = tuple(range(0, 61, 2))


@dataclass(frozen=True)
class Costed:
    ladder: str
    source: str
    id: str
    layout: str
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def ladder_rows(seconds: float) -> list[Costed]:
    """Every costed ladder row with Megatron-LM's launch cost at ``seconds``."""
    with moe_ladders.LADDERS.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    out = []
    with frameworks.replaced("megatron", expert_gemm_launch_s=seconds):
        for r in rows:
            row = moe_ladders.cost(r)
            if row.skipped or row.measured_step_s is None or row.predicted_step_s is None:
                continue
            out.append(
                Costed(
                    r["ladder"],
                    source_key(r["source"]),
                    r["id"],
                    row.layout,
                    row.measured_step_s,
                    row.predicted_step_s,
                )
            )
    return out


def published_moe_rows(seconds: float) -> list[Costed]:
    """The published MoE rows priced as Megatron-LM runs them, at ``seconds``."""
    rows = published_throughput.read_rows()
    with frameworks.replaced("megatron", expert_gemm_launch_s=seconds):
        return [
            Costed("published", source_key(r["source"]), r["id"], "", measured, predicted)
            for r, measured, predicted, costed in published_throughput.costed_rows(rows)
            if costed.moe and costed.run.job.framework == "megatron"
        ]


def pair_errors(rows: list[Costed]) -> dict[str, list[float]]:
    """Per ladder, |log(predicted ratio / measured ratio)| of each pair of its layouts."""
    by: dict[str, list[Costed]] = defaultdict(list)
    for r in rows:
        by[r.ladder].append(r)
    out: dict[str, list[float]] = {}
    for ladder, items in by.items():
        out[ladder] = [
            abs(math.log((a.predicted_s / b.predicted_s) / (a.measured_s / b.measured_s)))
            for a, b in itertools.combinations(items, 2)
        ]
    return out


def exact(rows: list[Costed]) -> tuple[int, int, list[str]]:
    """(ladders ordered exactly as measured, ladders, those that are not)."""
    by: dict[str, list[Costed]] = defaultdict(list)
    for r in rows:
        by[r.ladder].append(r)
    wrong = [
        name
        for name, items in by.items()
        if any(
            (a.measured_s - b.measured_s) * (a.predicted_s - b.predicted_s) <= 0
            for a, b in itertools.combinations(items, 2)
            if a.measured_s != b.measured_s
        )
    ]
    return len(by) - len(wrong), len(by), wrong


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main() -> int:
    started = time.perf_counter()
    shipped = frameworks.framework("megatron").expert_gemm_launch_s
    curves = {us: ladder_rows(us * 1e-6) for us in GRID_US}
    sources = sorted({r.source for r in curves[0]})
    source_of = {r.ladder: r.source for r in curves[0]}
    pairs = {us: pair_errors(rows) for us, rows in curves.items()}

    def loss(us: int, ladders: set[str]) -> float:
        return mean([e for name, errs in pairs[us].items() if name in ladders for e in errs])

    every = set(source_of)
    print("Megatron-LM's routed-expert GEMM launches, host seconds each:")
    print(f"  {'us':>4} {'pair |log ratio error|':>24} {'ladders exact':>14} {'mean |error|':>13}")
    for us in (0, 4, 10, 16, 20, 30, 40, 50, 60):
        n, total, _ = exact(curves[us])
        abs_err = mean([abs(r.error) for r in curves[us]])
        print(f"  {us:>4} {loss(us, every):>24.4f} {n:>8} of {total:<3} {abs_err:>13.1%}")
    best = min(GRID_US, key=lambda us: loss(us, every))
    print(f"  fitted on every ladder: {best} us (pair error {loss(best, every):.4f})")

    print("\nEach source held out (fitted on the other ladders, judged on its own):")
    for held in sources:
        own = {name for name, s in source_of.items() if s == held}
        rest = every - own
        fitted = min(GRID_US, key=lambda us: loss(us, rest))
        n0, _, _ = exact([r for r in curves[0] if r.ladder in own])
        n1, t1, _ = exact([r for r in curves[fitted] if r.ladder in own])
        print(
            f"  {held} ({len(own)} ladders): fitted on the others {fitted} us; its pair error "
            f"{loss(0, own):.4f} at 0 -> {loss(fitted, own):.4f}; exact {n0} -> {n1} of {t1}"
        )
    tables = sorted({name.split("-")[1] for name in every if name.startswith("mpf-")})
    print("Each table of arXiv 2504.14960 held out:")
    for table in tables:
        own = {name for name in every if name.startswith(f"mpf-{table}-")}
        rest = every - own
        fitted = min(GRID_US, key=lambda us: loss(us, rest))
        print(
            f"  {table} ({len(own)} ladders): fitted on the rest {fitted} us; its pair error "
            f"{loss(0, own):.4f} at 0 -> {loss(fitted, own):.4f}"
        )

    registry_us = round(shipped * 1e6)
    if registry_us not in curves:
        curves[registry_us] = ladder_rows(shipped)
    print(f"\nEvery ladder row at 0 and at the registry's {shipped * 1e6:.0f} us:")
    after = {r.id: r for r in curves[registry_us]}
    for r in curves[0]:
        a = after[r.id]
        print(
            f"  {r.ladder:38} {r.layout:52} measured {r.measured_s:8.2f} s  "
            f"{r.error:+7.1%} -> {a.error:+7.1%}"
        )
    for us in (0, registry_us):
        n, total, wrong = exact(curves[us])
        print(f"  at {us} us: {n} of {total} ladders exact; not: {', '.join(wrong) or 'none'}")

    before, now = published_moe_rows(0.0), published_moe_rows(shipped)
    print(f"\nPublished MoE rows priced as Megatron-LM runs them ({len(now)}):")
    for b, a in zip(before, now, strict=True):
        print(f"  {b.id:58} measured {b.measured_s:8.2f} s  {b.error:+7.1%} -> {a.error:+7.1%}")
    print(
        f"  mean |error| {mean([abs(r.error) for r in before]):.1%} -> "
        f"{mean([abs(r.error) for r in now]):.1%}"
    )
    print(f"wall time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
