"""Does every default plan run in its own framework exactly as planned?

For each job (the README's DeepSeek-V3 job, Llama 3 70B on 512 H100, Mixtral 8x7B on 64
H100) and each framework with a launcher that can train it, this plans the job under that
framework (``TrainingJob.framework``; the search then takes only layouts that framework runs)
at the CLI's default time limit, exports the plan to the same framework, and prints whether
the export states it exactly, what differs if not, and the plan's step time and gap. It also
runs ``SearchSpace(framework="any")`` once per job: the best plan of each framework, side by
side.

Run: ``.venv/bin/python benchmarks/framework_exports.py [--time-limit SECONDS] [--only NAME]``.
"""

from __future__ import annotations

import argparse
import time

import planner
from planner import export

JOBS = {
    "deepseek-v3-2048-h800": (
        "deepseek-v3",
        ("h800", 2048),
        {"seq_len": 4096, "global_batch": 15360, "compute_dtype": "fp8", "moment_dtype": "bf16"},
    ),
    "llama3-70b-512-h100": ("llama3-70b", ("h100", 512), {"seq_len": 8192, "global_batch": 512}),
    "mixtral-8x7b-64-h100": ("mixtral-8x7b", ("h100", 64), {"seq_len": 4096, "global_batch": 256}),
}
FRAMEWORKS = ("megatron", "torchtitan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per plan")
    parser.add_argument("--only", nargs="+", default=None, help="job names")
    args = parser.parse_args()
    exact = total = layouts = 0
    for name, (model_name, (gpu, gpus), fields) in JOBS.items():
        if args.only and name not in args.only:
            continue
        model = planner.load_model(model_name)
        cluster = planner.load_cluster(gpu, gpus=gpus)
        print(f"\n{name}")
        for fw in FRAMEWORKS:
            job = planner.TrainingJob(**fields, framework=fw)
            started = time.perf_counter()
            plan = planner.plan(model, cluster, job, time_limit_s=args.time_limit)
            took = time.perf_counter() - started
            if plan.layout is None or plan.estimate is None:
                print(f"  {fw:10s} {plan.status} after {took:.1f} s")
                continue
            out = export.EXPORTERS[fw](plan)
            total += 1
            exact += out.exact
            # The layout runs as planned when the launcher runs this very layout at the
            # planned step time; what else differs is the model or the precision recipe.
            same = out.layout == plan.layout and out.exported_step_s == out.planned_step_s
            layouts += same
            lay = plan.layout
            verdict = (
                "exact"
                if out.exact
                else ("layout exact; " if same else "NOT exact: ") + "; ".join(out.differences)
            )
            print(
                f"  {fw:10s} {plan.estimate.step_time_s:8.3f} s/step, gap {plan.gap or 0:.1%} "
                f"({took:.1f} s): {lay.degrees()} ZeRO-{lay.zero} {lay.schedule}"
                f" v{lay.virtual_stages} mb{lay.micro_batch}; export {verdict[:400]}"
            )
        job = planner.TrainingJob(**fields)
        started = time.perf_counter()
        both = planner.plan(
            model,
            cluster,
            job,
            planner.SearchSpace(framework=list(FRAMEWORKS)),
            time_limit_s=args.time_limit * len(FRAMEWORKS),
        )
        took = time.perf_counter() - started
        each = ", ".join(
            f"{b.framework} {b.step_time_s:.3f} s" if b.step_time_s else f"{b.framework} none"
            for b in both.frameworks
        )
        runs = both.job.framework if both.job else "none"
        print(f"  both       fastest: {runs} ({each}; {took:.1f} s)")
    print(
        f"\n{exact} of {total} default plans export exactly to their own framework; "
        f"{layouts} of {total} run their planned layout unchanged (the rest of the "
        "differences are the model or the precision recipe the framework builds)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
