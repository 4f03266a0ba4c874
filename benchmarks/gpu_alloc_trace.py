"""The CUDA caching allocator's every request, release and segment on the project's own real
runs, for replaying an allocator model on them.

``planner validate --set one-gpu`` (and ``one-gpu-moe``) measure each layout's allocated and
reserved peaks; the memory model predicts the first and adds a fraction of it for the second,
and that fraction misses the default allocator's reserved peaks by 5-10% held out. This runs
the same layouts (``planner.run.validate.one_gpu_set``, the same worker, ``compare``) with
``torch.cuda.memory._record_memory_history`` on in each rank's process from its first
allocation, and writes, per layout, the allocator's trace as gzipped JSON (``events``: action,
address, bytes, stream; no stacks) beside the peaks ``compare`` measured. What the traces are
for: a model of the allocator (its rounding, segment sizes and best-fit reuse) replayed on a
real request sequence must land on the measured reserved peak before it is replayed on a
sequence the planner writes itself.

With ``--caps``, each case runs instead once per cap, the allocator allowed to reserve no more
(``torch.cuda.set_per_process_memory_fraction``), and ``caps.jsonl`` says whether it ran or
ran out of memory: what the replay's ``planner.allocator.needed`` predicts.

Run on a CUDA machine: ``python benchmarks/gpu_alloc_trace.py OUTDIR [--moe
[--force-balance]] [--only 3 6] [--caps GIB ...]``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from planner.run import execute

_ORIGINAL = execute._worker
_DIR = "PLANNER_ALLOC_TRACE_DIR"  # read by the ranks' processes, set before the first starts


def traced_worker(rank: int, model: Any, job: Any, layout: Any, *rest: Any) -> None:
    """``planner.run.execute``'s worker with the allocator's history recorded."""
    from planner.run.validate import describe, layout_name

    cuda = torch.cuda.is_available()
    cap_file = Path(os.environ[_DIR]) / "cap.json"
    cap = json.loads(cap_file.read_text())["cap_bytes"] if cap_file.exists() else None
    if cuda and cap:  # the allocator may reserve at most this much (then: out of memory)
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total)
    if cuda and not cap:
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python")
    _ORIGINAL(rank, model, job, layout, *rest)
    if cap:
        return
    trace = (
        torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()] if cuda else []
    )
    name = f"{model.name} {layout_name(describe(layout))} r{rank}".replace(" ", "_")
    with gzip.open(Path(os.environ[_DIR]) / f"{name}.json.gz", "wt") as f:
        json.dump(
            {
                "model": model.name,
                "layout": describe(layout),
                "rank": rank,
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                "events": [
                    [e["action"], e.get("addr", 0), e["size"], e.get("stream", 0)] for e in trace
                ],
            },
            f,
        )


def main(argv: list[str] | None = None) -> int:
    from planner.run.device import Device
    from planner.run.validate import compare, describe, layout_name, one_gpu_set

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--moe", action="store_true", help="the one-gpu-moe set")
    p.add_argument(
        "--force-balance",
        action="store_true",
        help="route by random logits drawn on the CPU (TrainingJob.moe_force_balance): "
        "the tokens per expert planner.run.requests writes without a GPU",
    )
    p.add_argument("--only", type=int, nargs="*", help="cases by number, from 1")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cuda", help="cpu: a dry run, no trace")
    p.add_argument(
        "--caps",
        type=float,
        nargs="*",
        help="instead of tracing, run each case once per cap (GiB the allocator may reserve, "
        "torch.cuda.set_per_process_memory_fraction) and say whether it ran out of memory",
    )
    args = p.parse_args(argv)
    device = Device.of(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ[_DIR] = str(args.out.resolve())
    execute._worker = traced_worker  # type: ignore[assignment]
    job, cases = one_gpu_set(moe=args.moe)
    if args.force_balance:
        job = job.model_copy(update={"moe_force_balance": True})
        print(json.dumps({"moe_force_balance": True}), flush=True)
    cap_file = args.out / "cap.json"
    for i, (model, layout) in enumerate(cases, 1):
        if args.only and i not in args.only:
            continue
        for cap in args.caps or [None]:
            row: dict[str, Any] = {
                "case": i,
                "model": model.name,
                "layout": layout_name(describe(layout)),
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            }
            if cap is None:
                cap_file.unlink(missing_ok=True)
            else:
                row["cap_bytes"] = round(cap * 2**30)
                cap_file.write_text(json.dumps(row))
            try:
                entries = compare(model, job, layout, steps=args.steps, device=device)
            except Exception as exc:  # the rank's process ended: out of memory, as a rule
                row["outcome"] = f"failed: {type(exc).__name__}: {str(exc)[-300:]}"
                entries = []
            rows = [
                {
                    **row,
                    "rank": e.rank,
                    "allocated_peak_bytes": e.allocated_peak_bytes,
                    "reserved_peak_bytes": e.reserved_peak_bytes,
                    **({"outcome": "ran"} if cap is not None else {}),
                }
                for e in entries
            ] or [row]
            for r in rows:
                print(json.dumps(r), flush=True)
                with open(args.out / ("caps.jsonl" if args.caps else "peaks.jsonl"), "a") as f:
                    f.write(json.dumps(r) + "\n")
    cap_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    # The ranks' processes find the worker by this module's name, not as __main__.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_alloc_trace

    sys.exit(gpu_alloc_trace.main())
