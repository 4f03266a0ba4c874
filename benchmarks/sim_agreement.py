"""The simulator beside the closed form: on measured runs, on published layout ladders, on the
catalog's recipes, and how long a large step takes to simulate.

``planner.evaluate`` prices a step by the closed-form timeline (``planner.timeline``: what
overlaps what is a rule per schedule, ``costs.overlap``); ``planner.simulate`` executes each
rank's kernels and transfers on shared streams, SMs and links (``planner.executor``) from the
same per-block and per-transfer costs. This prints, for every row the planner can cost:

- ``benchmarks/published_runs.csv`` (``published_throughput.cost``: the same assumptions
  for what a source leaves unstated): measured, closed-form and simulated seconds per step,
  each error, and the mean absolute and signed error of each, overall, dense, MoE, and by
  schedule family (DualPipe; Megatron-LM's paired expert all-to-all overlap);
- ``benchmarks/moe_ladders.csv`` (one MoE job measured under several layouts): each layout's
  three figures, and per ladder Kendall's tau and the regret (measured step of the model's
  favourite over the measured best) of each model;
- the project's own real runs on one H200 (``benchmarks/logs/h200``, read with
  ``planner.runs_from_logs``): measured, closed-form and simulated step, each error;
- 40 random layouts of five catalog jobs (every schedule, ZeRO stage and recompute; a fixed
  seed): the distribution of simulated over closed-form step;
- the catalog's recipes: closed form against simulation (no measurement);
- the wall time of ``simulate`` on DeepSeek-V3's own layout on 2,048 H800 (DualPipe, pp 16,
  ep 64).

Nothing is fitted here. Run: ``.venv/bin/python benchmarks/sim_agreement.py [--quiet]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import moe_ladders  # noqa: E402
import published_throughput  # noqa: E402
from rankings import kendall, regret  # noqa: E402

import planner  # noqa: E402
from planner.simulate import SIM_TOLERANCE  # noqa: E402


def _families(layout: planner.Layout, moe: bool) -> list[str]:
    out = ["all", "moe" if moe else "dense"]
    if layout.schedule.startswith("dualpipe"):
        out.append("dualpipe")
    if layout.schedule.endswith("ep-overlap"):
        out.append("ep-overlap pairs")
    return out


def published(quiet: bool) -> None:
    print("== benchmarks/published_runs.csv: measured, closed form, simulated (s per step)")
    errors: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    rows = published_throughput.read_rows()
    for row, measured, closed, costed in published_throughput.costed_rows(rows):
        run = costed.run
        cluster = planner.load_cluster(
            published_throughput.PROFILES.get(row["gpu"], row["gpu"]), gpus=int(row["num_gpus"])
        )
        started = time.perf_counter()
        simulated = planner.simulate(run.model, cluster, run.job, run.layout).step_time_s
        wall = time.perf_counter() - started
        e_closed, e_sim = closed / measured - 1, simulated / measured - 1
        for family in _families(run.layout, costed.moe):
            errors[family]["closed"].append(e_closed)
            errors[family]["sim"].append(e_sim)
        if not quiet:
            print(
                f"  {row['id'][:44]:44s} {row['gpu']:6s} {run.layout.schedule:22s} "
                f"measured {measured:9.3f}  closed {closed:9.3f} ({e_closed:+6.1%})  "
                f"sim {simulated:9.3f} ({e_sim:+6.1%})  sim/closed {simulated / closed - 1:+6.1%}"
                f"  [{wall:4.1f} s]"
            )
    print(
        f"  {'rows':22s} {'n':>4s}  {'closed MAPE':>11s} {'(signed)':>9s}  "
        f"{'sim MAPE':>9s} {'(signed)':>9s}"
    )
    for family, e in sorted(errors.items(), key=lambda kv: -len(kv[1]["closed"])):
        c, s = np.array(e["closed"]), np.array(e["sim"])
        print(
            f"  {family:22s} {len(c):4d}  {np.mean(abs(c)):11.1%} {np.mean(c):+9.1%}  "
            f"{np.mean(abs(s)):9.1%} {np.mean(s):+9.1%}"
        )


def ladders(quiet: bool) -> None:
    print("\n== benchmarks/moe_ladders.csv: each ladder's order, closed form and simulated")
    by: dict[str, list[tuple[str, float, float, float]]] = defaultdict(list)
    import csv

    with moe_ladders.LADDERS.open(newline="") as handle:
        for r in csv.DictReader(handle):
            row = moe_ladders.cost(r)
            if row.skipped or row.measured_step_s is None or row.costed is None:
                continue
            model, cluster, job, layout = row.costed
            simulated = planner.simulate(model, cluster, job, layout).step_time_s
            assert row.predicted_step_s is not None
            by[row.ladder].append(
                (row.layout, row.measured_step_s, row.predicted_step_s, simulated)
            )
    met = {"closed": 0, "sim": 0}
    errors: dict[str, list[float]] = defaultdict(list)
    for name, items in by.items():
        measured = [m for _, m, _, _ in items]
        line = f"  {name[:48]:48s} {len(items):2d} layouts"
        for k, label in ((2, "closed"), (3, "sim")):
            predicted = [it[k] for it in items]
            errors[label] += [p / m - 1 for p, m in zip(predicted, measured, strict=True)]
            if len(items) < 2:
                continue
            tau, _, _ = kendall(measured, predicted)
            loss = regret(measured, predicted)
            met[label] += tau >= 0.7 and loss <= 0.03
            line += f"  {label}: tau {tau:+.2f} regret {loss:5.1%}"
        print(line)
        if not quiet:
            for layout, m, c, s in items:
                print(
                    f"      {layout:44s} measured {m:8.3f}  closed {c:8.3f} ({c / m - 1:+6.1%})"
                    f"  sim {s:8.3f} ({s / m - 1:+6.1%})"
                )
    ladders_n = sum(len(v) > 1 for v in by.values())
    for label in ("closed", "sim"):
        e = np.array(errors[label])
        print(
            f"  {label:6s}: {met[label]} of {ladders_n} ladders with tau >= 0.7 and regret <= 3%;"
            f" rows {len(e)}, MAPE {np.mean(abs(e)):.1%} (signed {np.mean(e):+.1%})"
        )


def own_runs(quiet: bool) -> None:
    print("\n== the project's own real runs (benchmarks/logs/h200), one H200")
    logs = sorted((HERE / "logs" / "h200").glob("*/*.log"))
    cluster = planner.load_cluster("h200", gpus=1)
    errors: dict[str, list[float]] = defaultdict(list)
    for logged in planner.runs_from_logs(logs):
        job = logged.job
        closed = planner.evaluate(logged.model, cluster, job, logged.layout).step_time_s
        simulated = planner.simulate(logged.model, cluster, job, logged.layout).step_time_s
        errors["closed"].append(closed / logged.step_s - 1)
        errors["sim"].append(simulated / logged.step_s - 1)
        if not quiet:
            print(
                f"  {Path(logged.path).parent.name}/{logged.name:28s} measured "
                f"{logged.step_s:7.3f}  closed {closed:7.3f} ({closed / logged.step_s - 1:+6.1%})"
                f"  sim {simulated:7.3f} ({simulated / logged.step_s - 1:+6.1%})"
            )
    for label in ("closed", "sim"):
        e = np.array(errors[label])
        print(f"  {label:6s}: {len(e)} runs, MAPE {np.mean(abs(e)):.1%} (signed {np.mean(e):+.1%})")


JOBS = {  # catalog model, machine, GPUs, job (the real-size jobs of tests/test_agreement.py)
    "deepseek-v3": ("h800", 2048, dict(seq_len=4096, global_batch=15360, compute_dtype="fp8")),
    "llama3-405b": ("h100", 16384, dict(seq_len=8192, global_batch=2048)),
    "llama3-70b": ("h100", 512, dict(seq_len=8192, global_batch=512)),
    "mixtral-8x7b": ("h100", 64, dict(seq_len=4096, global_batch=512)),
    "gpt3-175b": ("a100", 1024, dict(seq_len=2048, global_batch=1536)),
}


def random_layouts(count: int = 40, seed: int = 0) -> None:
    import random

    print(f"\n== {count} random layouts (seed {seed}): simulated over closed-form step")
    rng = random.Random(seed)
    ratios: list[tuple[float, str]] = []
    tries = 0
    while len(ratios) < count and tries < 50 * count:
        tries += 1
        name = rng.choice(sorted(JOBS))
        gpu, gpus, fields = JOBS[name]
        model = planner.load_model(name)
        cluster = planner.load_cluster(gpu, gpus=gpus)
        framework = rng.choice(["megatron", "torchtitan", "deepspeed"])
        job = planner.TrainingJob(**fields, framework=framework)  # type: ignore[arg-type]
        schedule = rng.choice(["1f1b", "interleaved", "zb-h1", "dualpipe", "gpipe"])
        pp = rng.choice([2, 4, 8, 16])
        tp = 1 if model.num_experts else rng.choice([1, 2, 4, 8])
        dp = gpus // (tp * pp)
        ep = 1
        if model.num_experts:
            ep = rng.choice(
                [e for e in (1, 2, 4, 8, 16, 32, 64) if dp % e == 0 and model.num_experts % e == 0]
            )
        v = rng.choice([2, 3, 4]) if schedule == "interleaved" else 1
        try:
            layout = planner.Layout.uniform(
                model,
                pp=pp,
                tp=tp,
                dp=dp,
                ep=ep,
                schedule=schedule,  # type: ignore[arg-type]
                virtual_stages=v,
                zero=rng.choice([0, 1, 2, 3]),  # type: ignore[arg-type]
                recompute=rng.choice(["none", "selective", "full"]),  # type: ignore[arg-type]
                micro_batch=rng.choice([1, 2]),
            )
            closed = planner.evaluate(model, cluster, job, layout).step_time_s
            simulated = planner.simulate(model, cluster, job, layout).step_time_s
        except planner.PlannerError:
            continue
        what = f"{name} {framework} {layout.degrees()} z{layout.zero} {schedule}"
        ratios.append((simulated / closed - 1, what))
    diffs = np.array([r for r, _ in ratios])
    for q in (0, 10, 50, 90, 100):
        print(f"  percentile {q:3d}: {np.percentile(diffs, q):+6.1%}")
    within = [abs(d) <= SIM_TOLERANCE for d in diffs]
    print(
        f"  within the {SIM_TOLERANCE:.0%} tolerance: {sum(within)} of "
        f"{len(diffs)}; mean |difference| {np.mean(abs(diffs)):.1%}"
    )
    for d, what in sorted(ratios)[:3] + sorted(ratios)[-3:]:
        print(f"    {d:+6.1%}  {what}")


def recipes() -> None:
    print("\n== the catalog's recipes: closed form against simulated (s per step)")
    for name in planner.recipe_names():
        r = planner.load_recipe(name)
        closed = planner.evaluate(r.model, r.cluster, r.job, r.layout).step_time_s
        started = time.perf_counter()
        simulated = planner.simulate(r.model, r.cluster, r.job, r.layout).step_time_s
        wall = time.perf_counter() - started
        print(
            f"  {name:36s} {r.layout.schedule:12s} closed {closed:8.3f}  sim {simulated:8.3f}"
            f"  ({simulated / closed - 1:+6.1%})  [{wall:4.1f} s to simulate]"
        )


def speed() -> None:
    r = planner.load_recipe("deepseek-v3-pretraining")
    started = time.perf_counter()
    sim = planner.simulate(r.model, r.cluster, r.job, r.layout)
    wall = time.perf_counter() - started
    print(
        f"\n== simulate, DeepSeek-V3 on {r.cluster.num_gpus} {r.cluster.name} "
        f"({r.layout.schedule}, pp {r.layout.pp}, ep {r.layout.ep}): {wall:.2f} s wall, "
        f"{len(sim.events):,} events, step {sim.step_time_s:.3f} s (target: under 10 s)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quiet", action="store_true", help="summaries only")
    args = parser.parse_args(argv)
    published(args.quiet)
    ladders(args.quiet)
    own_runs(args.quiet)
    random_layouts()
    recipes()
    speed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
