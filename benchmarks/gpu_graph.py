"""The GPU's own time per kernel beyond its work, on one CUDA GPU, with the host taken out.

``planner.costs.compute.work_time`` charges ``cluster.kernel_overhead_s`` of GPU time per
kernel the model counts (launch latency, the ramp and tail of each kernel's waves); the
catalog sets 4 us, a convention, and fits to small-model runs put it at 20-25 us per counted
kernel (vTrain's A100 rows, the A100 sources of ``source_calibration.py``). This measures it:
a stack of eager Llama 3 8B-shaped layers (``planner.run.model.DenseLayer``) at reduced width
and a few token counts, forward plus backward captured in one CUDA graph and replayed, so the
host's launches cost nothing and the GPU runs the kernels back to back. The model's time for
the same layer without any per-kernel overhead (``work_time`` with ``kernel_s`` = ``host_s`` =
0, the catalog's rates) is subtracted; what remains, divided by the kernels the model counts
and by the kernels the layer launches (``torch.profiler``), is the GPU time per kernel beyond
its work.

Prints a table and one JSON line. Run on a CUDA machine: ``python benchmarks/gpu_graph.py
--cluster h200``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from typing import Any

import torch
from gpu_host import _kernels_launched

from planner.catalog import load_cluster
from planner.costs.blocks import block_cost
from planner.costs.compute import Rates, work_time
from planner.costs.memory import shard_of
from planner.layout import Layout
from planner.run.benchblocks import block_model, job_for
from planner.run.benchrows import scaled_model
from planner.run.model import DenseLayer

SHAPES = ((1 / 32, 256), (1 / 32, 2048), (1 / 8, 256), (1 / 8, 2048), (1 / 4, 1024), (1 / 2, 1024))


def _graphed(fn: Any) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def row(scale: float, tokens: int, layers: int, rates: Rates) -> dict[str, Any]:
    model = scaled_model(block_model("llama3-8b"), scale)
    torch.manual_seed(0)
    with torch.device("cuda"):
        stack = [DenseLayer(model, torch.bfloat16) for _ in range(layers)]
        x0 = torch.randn(1, tokens, model.hidden_size, dtype=torch.bfloat16, requires_grad=True)

    def step() -> None:
        x = x0
        for layer in stack:
            x = layer(x, "none")
        x.sum().backward()

    out: dict[str, Any] = {"hidden": model.hidden_size, "tokens": tokens, "layers": layers}
    try:
        graph = _graphed(step)
    except RuntimeError as exc:  # an op the graph cannot capture
        out["error"] = str(exc).splitlines()[0][:160]
        return out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / 10 / layers)
    measured = statistics.median(times)
    cost = block_cost(model, "layer.0", shard_of(job_for(tokens, "bf16"), Layout.uniform(model)))
    work = cost.fwd + cost.bwd_input + cost.bwd_weight
    bare = dataclasses.replace(rates, kernel_s=0.0, host_s=0.0)
    predicted = work_time(work, bare)
    launched = _kernels_launched(step) / layers
    extra = measured - predicted
    out.update(
        measured_s=measured,
        predicted_work_s=predicted,
        counted_kernels=work.kernels,
        launched_kernels=launched,
        extra_per_counted_kernel_s=extra / work.kernels,
        extra_per_launched_kernel_s=extra / launched,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", default="h200")
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_graph: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    cluster = load_cluster(args.cluster, gpus=1)
    rows = []
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; priced as {args.cluster}")
    print(
        f"{'hidden':>6} {'tokens':>6} {'us/layer':>9} {'model work':>10} {'counted':>7} "
        f"{'launched':>8} {'us/counted':>10} {'us/launched':>11}"
    )
    for scale, tokens in SHAPES:
        rates = Rates.of(cluster, job_for(tokens, "bf16"), sustained=False)
        r = row(scale, tokens, args.layers, rates)
        rows.append(r)
        if "error" in r:
            print(f"{r['hidden']:6} {tokens:6} not captured: {r['error']}")
            continue
        print(
            f"{r['hidden']:6} {tokens:6} {r['measured_s'] * 1e6:9.1f} "
            f"{r['predicted_work_s'] * 1e6:10.1f} {r['counted_kernels']:7.0f} "
            f"{r['launched_kernels']:8.0f} {r['extra_per_counted_kernel_s'] * 1e6:10.2f} "
            f"{r['extra_per_launched_kernel_s'] * 1e6:11.2f}"
        )
    print(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
