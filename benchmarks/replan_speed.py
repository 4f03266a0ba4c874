"""Re-planning speed: ``planner plan --from plan.json --gpus N`` for a neighbouring GPU count.

Plans Llama 3 70B on 64 H100 (sequence 8,192, batch 128) at a 10 s limit and saves it, then
re-plans it for other GPU counts (a node lost, a cluster grown) at ``--time-limit 1``, each
as its own process, as a user runs it: the wall time printed is the whole command's
(interpreter start and imports included), beside the step it finds and the step a fresh
search finds at the same limit. Issue 32's target is a re-plan in under 2 s.

Run: ``.venv/bin/python benchmarks/replan_speed.py [--gpus N ...] [--limit S]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLANNER = str(Path(sys.executable).parent / "planner")
JOB = ["--model", "llama3-70b", "--cluster", "h100", "--seq-len", "8192", "--global-batch", "128"]


def timed(args: list[str]) -> tuple[float, dict[str, object]]:
    """Wall seconds of one ``planner`` command and its JSON plan."""
    started = time.perf_counter()
    done = subprocess.run([PLANNER, *args, "--json"], capture_output=True, text=True, check=True)
    return time.perf_counter() - started, json.loads(done.stdout)


def step(plan: dict[str, object]) -> float:
    estimate = plan.get("estimate")
    return float(estimate["step_time_s"]) if isinstance(estimate, dict) else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[56, 72, 128])
    parser.add_argument("--limit", type=float, default=1.0, help="each re-plan's limit (s)")
    args = parser.parse_args()
    started = time.perf_counter()
    imports = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; t = time.perf_counter(); import planner.cli; "
            "print(time.perf_counter() - t)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    print(f"importing planner.cli: {float(imports.stdout):.2f} s")
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "p64.json"
        wall, first = timed(["plan", *JOB, "--gpus", "64", "--time-limit", "10"])
        saved.write_text(json.dumps(first))
        print(f"plan on 64 GPUs at 10 s: {step(first):.3f} s per step ({wall:.1f} s wall)")
        limit = f"{args.limit:g}"
        for n in args.gpus:
            wall, again = timed(
                ["plan", "--from", str(saved), "--gpus", str(n), "--time-limit", limit]
            )
            _, fresh = timed(["plan", *JOB, "--gpus", str(n), "--time-limit", limit])
            print(
                f"re-plan for {n:4d} GPUs at {limit} s: {wall:.2f} s wall, {step(again):.3f} s "
                f"per step (a fresh search at {limit} s: {step(fresh):.3f} s)"
            )
    print(f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
