"""Does the time model rank layouts as reality did? Kendall's tau and regret per measured group.

A *group* is one model on one cluster (GPU type and count) at one sequence length, measured
under several layouts by one source. For each group this prints every layout's measured and
predicted time per token (``planner.evaluate`` at the catalog's constants: nothing is fitted
here), then two figures:

- Kendall's tau between the predicted and the measured times (1: the same order; -1: exactly
  backwards; ties in either count as neither);
- the regret: the measured time of the layout the model ranks fastest over the measured
  fastest, minus 1 (0: the model's favourite was the best that ran).

Times are per token (step / tokens per step), so layouts measured at different global
batches on one cluster still compare; within a group of one batch this is the step's order.

Groups come from four files, each costed as its own benchmark costs it (what each assumes of
an unstated setting is printed beside the row there):

- ``moe_ladders.csv`` (``benchmarks/moe_ladders.py``): MoE ladders, one model and cluster
  each, from the MoE Parallel Folding paper and Megatron-MoE-ModelZoo;
- ``published_runs.csv`` (``benchmarks/published_throughput.py``): groups of rows with the same
  model, GPU, GPU count, sequence and precision. Several of these differ in the software
  release rather than the layout (NeMo 24.07 against 25.02 on one layout); they are kept, and
  a group whose layouts are all equal is reported apart, not ranked; the summary says how
  many groups span several publications (one layout from NeMo 24.07, another from
  Megatron-Bridge 25.11), whose order mixes the releases' change with the layouts';
- ``megatron_ci_runs.csv`` where present (``benchmarks/harvest_megatron_ci.py``): Megatron-LM's
  functional tests, grouped the same way and also by the CI platform (``dgx_a100`` and
  ``dgxa100_dracooci`` are different machines), the release (``dev``, ``lts``) and the run's
  settings (its ``flags``: the data pipeline, logging, determinism and overlap switches a test
  case sets), so a group's rows differ in their layout and nothing else. Grouped by model
  and GPU alone, the rows of one layout differ by up to 75% with the test case's settings
  (one row by a factor of 14), more than the layouts do: even a model that knew each
  layout's mean measured time exactly would order the rows of 3 of those 17 groups within
  the targets (``--coarse`` groups them that way and prints that ceiling per group);
- vTrain's 1,440 single-node A100 iterations (``vtrain_fidelity.py``'s data): groups of one
  GPT (hidden size, layers) at one global batch and GPU count, under every tp, dp, pp and
  micro-batch measured.

A layout measured more than once in a group (a second CI run, another release of a published
stack) is one layout: its measured and predicted times are the means of its rows, and tau and
the regret are taken over the group's distinct layouts (repeat measurements are not a ranking).

Targets: every group's tau at least 0.7 and regret at most 3%. The summary counts the groups
that meet each.

``--profile GPU=YAML`` costs a GPU's rows with a fitted cluster YAML instead (e.g. the A100
constants ``vtrain_fidelity.py --out`` fits on vTrain's even rows, with ``--vtrain-half odd``
to rank only the rows that fit never saw).

Run: ``.venv/bin/python benchmarks/rankings.py [--only moe|published|ci|vtrain ...]
[--quiet] [--json] [--profile GPU=YAML] [--vtrain-half all|odd] [--coarse]``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import itertools
import json
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import moe_ladders  # noqa: E402
import published_throughput  # noqa: E402
import vtrain_fidelity  # noqa: E402

import planner  # noqa: E402
from planner.fit import predict  # noqa: E402

CI_RUNS = HERE / "megatron_ci_runs.csv"
TAU_TARGET = 0.7
REGRET_TARGET = 0.03
SOURCES = ("moe", "published", "ci", "vtrain")


@dataclass
class Item:
    group: str
    id: str
    layout: str
    measured_s_per_token: float
    predicted_s_per_token: float
    features: dict[str, object] = field(default_factory=dict)  # what residuals group by

    @property
    def error(self) -> float:
        return self.predicted_s_per_token / self.measured_s_per_token - 1


@dataclass
class Group:
    name: str
    source: str
    items: list[Item]
    tau: float | None = None
    regret: float | None = None
    backwards: int = 0
    pairs: int = 0
    note: str = ""
    settings: str = ""  # a harvested group's run settings (its rows' flags)
    # (tau, regret) of each layout's mean measured time against every row: the most a model
    # of the layout alone can reach where the group measured a layout more than once
    ceiling: tuple[float, float] | None = None


def kendall(measured: list[float], predicted: list[float]) -> tuple[float, int, int]:
    """(tau, pairs ordered backwards, pairs compared): pairs tied in either list count in
    the denominator as neither agreeing nor disagreeing (tau-a)."""
    agree = disagree = 0
    pairs = 0
    for i, j in itertools.combinations(range(len(measured)), 2):
        pairs += 1
        s = (measured[i] - measured[j]) * (predicted[i] - predicted[j])
        if s > 0:
            agree += 1
        elif s < 0:
            disagree += 1
    return ((agree - disagree) / pairs if pairs else 1.0), disagree, pairs


def by_layout(items: list[Item]) -> tuple[list[float], list[float]]:
    """(measured, predicted) seconds per token of each distinct layout of ``items``, in order
    of first appearance: a layout's repeat measurements are averaged, as are its predictions
    (rows of one layout text may differ in what the layout text leaves out)."""
    rows: dict[str, list[Item]] = defaultdict(list)
    for item in items:
        rows[item.layout].append(item)
    return (
        [float(np.mean([i.measured_s_per_token for i in same])) for same in rows.values()],
        [float(np.mean([i.predicted_s_per_token for i in same])) for same in rows.values()],
    )


def layout_ceiling(items: list[Item]) -> tuple[float, float]:
    """(tau, regret) of the best prediction a model of the layout alone can make, each
    layout's mean measured time, against every row of ``items``: tau over the pairs of rows
    of different layouts, the regret of the best mean over the fastest row. Below the
    targets, the rows' spread within one layout (settings the layout does not name)
    outweighs the layouts' differences."""
    rows: dict[str, list[float]] = defaultdict(list)
    for item in items:
        rows[item.layout].append(item.measured_s_per_token)
    means = {layout: float(np.mean(times)) for layout, times in rows.items()}
    agree = disagree = pairs = 0
    for a, b in itertools.combinations(items, 2):
        if a.layout != b.layout:
            pairs += 1
            s = (a.measured_s_per_token - b.measured_s_per_token) * (
                means[a.layout] - means[b.layout]
            )
            agree, disagree = agree + (s > 0), disagree + (s < 0)
    best = min(i.measured_s_per_token for i in items)
    return (agree - disagree) / pairs, min(means.values()) / best - 1


def regret(measured: list[float], predicted: list[float]) -> float:
    """Measured time of the predicted fastest over the measured fastest, minus 1."""
    chosen = min(range(len(predicted)), key=lambda i: predicted[i])
    return measured[chosen] / min(measured) - 1


def source_key(source: str) -> str:
    """The publication a row comes from (a paper, a repository, a table): what
    leave-one-source-out holds out together."""
    text = source.split()[0] if source.strip() else "unstated"
    if "github.com/" in text:
        parts = text.split("github.com/")[1].split("/")
        return "github:" + "/".join(parts[:2])
    if "arxiv.org/" in text:
        return "arxiv:" + text.rstrip("/").split("/")[-1].split("v")[0]
    return text[:60]


def _features(
    gpu: str,
    gpus: int,
    framework: str,
    precision: str,
    shape: dict[str, int],
    schedule: str,
    model: planner.ModelSpec,
    seq: int,
    source: str,
) -> dict[str, object]:
    return {
        "gpu": gpu,
        "gpus": gpus,
        "framework": framework,
        "precision": precision,
        "schedule": schedule,
        "moe": bool(model.num_experts),
        "hidden": model.hidden_size,
        "layers": model.num_layers,
        "params_b": model.num_params() / 1e9,
        "seq": seq,
        "source": source_key(source),
        **shape,
    }


def moe_items() -> Iterator[Item]:
    with moe_ladders.LADDERS.open(newline="") as handle:
        for r in csv.DictReader(handle):
            row = moe_ladders.cost(r)
            if row.skipped or row.measured_step_s is None or row.predicted_step_s is None:
                continue
            tokens = int(r["global_batch"]) * int(r["seq_len"])
            # the layout as moe_ladders costed it: "tp2 pp8 dp16 ep32 etp1 cp1 v4 z1 sched"
            *degrees, schedule = row.layout.split()
            shape = {
                m[1]: int(m[2]) for m in (re.fullmatch(r"([a-z]+)(\d+)", d) for d in degrees) if m
            }
            yield Item(
                row.ladder,
                row.id,
                row.layout,
                row.measured_step_s / tokens,
                row.predicted_step_s / tokens,
                _features(
                    r["gpu"],
                    int(r["num_gpus"]),
                    "megatron",
                    r["precision"],
                    shape,
                    schedule,
                    planner.load_model(r["model"]),
                    int(r["seq_len"]),
                    r["source"],
                ),
            )


def _runs_items(path: Path, prefix: str, split_settings: bool = True) -> Iterator[Item]:
    rows = published_throughput.read_rows(path)
    for r, measured, predicted, costed in published_throughput.costed_rows(rows):
        tokens = costed.run.job.tokens_per_step
        lay = costed.run.layout
        text = (
            f"tp{lay.tp} cp{lay.cp} pp{lay.pp} dp{lay.dp} ep{lay.ep} v{lay.virtual_stages} "
            f"mb{lay.micro_batch} z{lay.zero} {lay.schedule} {r['framework']} gb{r['global_batch']}"
            + (" tp-overlap" if r.get("tp_comm_overlap") == "true" else "")
            + (
                f" recompute={r['recompute']}"
                if r.get("recompute", "unstated") != "unstated"
                else ""
            )
        )
        group = f"{prefix}:{r['model']} {r['gpu']}x{r['num_gpus']} seq{r['seq_len']} "
        group += r["precision"]
        if split_settings and r.get("platform"):  # harvested: its machine, release, settings
            digest = hashlib.sha1(r.get("flags", "").encode()).hexdigest()[:6]
            group += f" {r['platform']} {r['environment']} settings-{digest}"
        shape = {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "cp": lay.cp}
        shape |= {"v": lay.virtual_stages, "mb": lay.micro_batch, "z": lay.zero}
        features = _features(
            r["gpu"],
            int(r["num_gpus"]),
            r["framework"],
            r["precision"],
            shape,
            lay.schedule,
            costed.run.model,
            int(r["seq_len"]),
            r["source"],
        )
        if r.get("flags"):  # the run settings a harvested row lists (megatron_ci_runs.csv)
            # a setting with a short value keeps it (overlap-grad-reduce=on against =off)
            features["flags"] = tuple(
                f if len(f) <= 40 else f.split("=")[0] for f in r["flags"].split(";") if f
            )
        features["microbatches"] = costed.run.job.global_batch // (lay.dp * lay.micro_batch)
        yield Item(group, r["id"], text, measured / tokens, predicted / tokens, features)


def vtrain_items(rows_taken: slice = slice(None)) -> Iterator[Item]:
    """vTrain's rows (``rows_taken`` of them, in file order), costed."""
    rows = vtrain_fidelity.read_rows(vtrain_fidelity.DATA)[rows_taken]
    runs = vtrain_fidelity.runs(rows)
    base = planner.load_cluster(published_throughput.PROFILES.get("a100", "a100"), gpus=8)
    predicted = predict(base, runs)
    for i, (row, run, p) in enumerate(zip(rows, runs, predicted, strict=True)):
        tokens = run.job.tokens_per_step
        lay = run.layout
        group = (
            f"vtrain:h{row['hidden']} l{row['layers']} a100x{row['gpus']} gb{row['global_batch']}"
        )
        text = f"tp{lay.tp} pp{lay.pp} dp{lay.dp} mb{lay.micro_batch}"
        shape = {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "mb": lay.micro_batch}
        features = _features(
            "a100",
            int(row["gpus"]),
            "megatron-deepspeed",
            "fp16",
            shape,
            lay.schedule,
            run.model,
            int(row["seq"]),
            "vTrain (MICRO 2024) ground_truth_single.csv",
        )
        yield Item(
            group, f"vtrain-{i}", text, run.measured_step_s / tokens, float(p) / tokens, features
        )


def costed_items(
    sources: list[str], vtrain_rows: slice = slice(None), coarse: bool = False
) -> Iterator[tuple[str, Item]]:
    """Every costed row of ``sources`` (``SOURCES``; of vTrain, ``vtrain_rows``), with its
    source's name; ``coarse``: harvested rows grouped by model and GPU only."""
    feeds = {
        "moe": moe_items,
        "published": lambda: _runs_items(published_throughput.DATA, "published"),
        "ci": lambda: _runs_items(CI_RUNS, "ci", not coarse) if CI_RUNS.exists() else iter(()),
        "vtrain": lambda: vtrain_items(vtrain_rows),
    }
    for source in sources:
        for item in feeds[source]():
            yield source, item


def groups(
    sources: list[str], vtrain_rows: slice = slice(None), coarse: bool = False
) -> list[Group]:
    found: dict[tuple[str, str], list[Item]] = defaultdict(list)
    for source, item in costed_items(sources, vtrain_rows, coarse):
        found[(source, item.group)].append(item)
    return [
        ranked(name, source, items) for (source, name), items in found.items() if len(items) > 1
    ]


def ranked(name: str, source: str, items: list[Item]) -> Group:
    """The group of ``items`` with its figures: tau and regret over its distinct layouts
    (repeats at their means), and where a layout repeats, what a layout-only model reaches."""
    g = Group(name, source, items)
    flags = {str(i.features.get("flags", "")) for i in items}
    if len(flags) == 1 and flags != {""}:
        g.settings = ";".join(items[0].features["flags"])  # type: ignore[arg-type]
    if len({i.layout for i in items}) < 2:
        g.note = "one layout, measured under several releases or settings: not a ranking"
        return g
    measured, predicted = by_layout(items)
    g.tau, g.backwards, g.pairs = kendall(measured, predicted)
    g.regret = regret(measured, predicted)
    if len(measured) < len(items):  # repeats: how far a layout-only model could get
        g.ceiling = layout_ceiling(items)
    return g


def print_group(g: Group) -> None:
    head = f"{g.name}: "
    if g.tau is None:
        print(head + g.note)
    else:
        assert g.regret is not None
        ceiling = ""
        if g.ceiling:
            ceiling = (
                f"; a layout's mean measured time, against every row: tau "
                f"{g.ceiling[0]:+.2f}, regret {g.ceiling[1]:.1%}"
            )
        print(
            head + f"tau {g.tau:+.2f} ({g.backwards} of {g.pairs} pairs of distinct layouts "
            f"backwards), regret {g.regret:.1%}{ceiling}"
        )
    if g.settings:
        print(f"  settings: {g.settings}")
    best = min(i.measured_s_per_token for i in g.items)
    for i in sorted(g.items, key=lambda i: i.measured_s_per_token):
        print(
            f"  {i.layout:60} measured {1e6 * i.measured_s_per_token:9.3f} us/token "
            f"(+{i.measured_s_per_token / best - 1:6.1%})  predicted "
            f"{1e6 * i.predicted_s_per_token:9.3f} ({i.error:+6.1%})"
        )


def summarise(found: list[Group]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for source in [*SOURCES, "all"]:
        ranked = [g for g in found if g.tau is not None and source in (g.source, "all")]
        if not ranked:
            continue
        taus = np.array([g.tau for g in ranked], dtype=float)
        regrets = np.array([g.regret for g in ranked], dtype=float)
        out[source] = {
            "groups": len(ranked),
            "tau_met": int(np.sum(taus >= TAU_TARGET)),
            "regret_met": int(np.sum(regrets <= REGRET_TARGET)),
            "both_met": int(np.sum((taus >= TAU_TARGET) & (regrets <= REGRET_TARGET))),
            "mean_tau": round(float(taus.mean()), 3),
            "median_regret": round(float(np.median(regrets)), 4),
            "worst_regret": round(float(regrets.max()), 4),
        }
        # groups whose rows span publications (a release of one stack against another's):
        # their order mixes the software's change with the layout's
        mixed = [g for g in ranked if len({i.features.get("source") for i in g.items}) > 1]
        if mixed:
            out[source]["mixed"] = len(mixed)
            out[source]["mixed_both_met"] = sum(
                g.tau >= TAU_TARGET and g.regret <= REGRET_TARGET  # type: ignore[operator]
                for g in mixed
            )
        ceilings = [g.ceiling for g in ranked if g.ceiling]
        if ceilings:  # groups with repeats: where a layout-only model could meet both
            out[source]["repeated"] = len(ceilings)
            out[source]["ceiling_met"] = sum(
                t >= TAU_TARGET and r <= REGRET_TARGET for t, r in ceilings
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--quiet", action="store_true", help="print the summary only")
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    published_throughput.add_profile_argument(parser)
    parser.add_argument(
        "--vtrain-half",
        choices=["all", "odd"],
        default="all",
        help="vTrain rows to rank: all, or the odd rows (file order) that vtrain_fidelity.py "
        "holds out of its fit",
    )
    parser.add_argument(
        "--coarse",
        action="store_true",
        help="group the harvested functional tests by model and GPU only, across platforms, "
        "releases and settings (each group then says how far a layout-only model could get)",
    )
    args = parser.parse_args(argv)
    published_throughput.use_profiles(args.profile)
    started = time.perf_counter()
    vtrain_rows = slice(1, None, 2) if args.vtrain_half == "odd" else slice(None)
    found = groups(args.only, vtrain_rows, args.coarse)
    summary = summarise(found)
    if args.json:
        print(
            json.dumps(
                {"groups": [asdict(g) for g in found], "summary": summary}, indent=1, default=str
            )
        )
        return 0
    if not args.quiet:
        for g in found:
            print_group(g)
            print()
    for source, s in summary.items():
        print(
            f"{source:9}: {s['groups']:3} ranked groups; tau >= {TAU_TARGET} in {s['tau_met']}, "
            f"regret <= {REGRET_TARGET:.0%} in {s['regret_met']}, both in {s['both_met']}; "
            f"mean tau {s['mean_tau']:+.2f}, median regret {s['median_regret']:.1%}, worst "
            f"{s['worst_regret']:.1%}"
        )
        if "mixed" in s:
            print(
                f"{'':9}  {s['mixed']} of them span several publications (their order mixes "
                f"releases with layouts); both met in {s['mixed_both_met']} of those, "
                f"{s['both_met'] - s['mixed_both_met']} of the {s['groups'] - s['mixed']} "
                "from one publication each"
            )
        if "repeated" in s:
            print(
                f"{'':9}  {s['repeated']} of them measured a layout more than once; a model of "
                f"the layout alone (its mean measured time) meets both in {s['ceiling_met']}"
            )
    unranked = [g for g in found if g.tau is None]
    if unranked:
        print(f"not ranked (one layout each): {len(unranked)} groups")
    print(f"wall time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
