"""The host's time per transformer layer and per kernel when the GPU waits for it, on one CUDA
GPU, beside the kernel count the cost model charges for the same layer.

``planner.costs.compute.work_time`` takes the longer of a phase's GPU time and
``kernels x host_overhead_s``; the catalog sets no host time (0), and small models at small
micro-batches (vTrain's A100 rows, Megatron-LM's CI rows) run slower than their GPU work.
This measures the host side of an eager PyTorch layer (``planner.run.model.DenseLayer``: by
default a Llama 3 8B layer, with ``--model`` any catalog model's first MoE layer, DeepSeek-V3's
cut to 16 experts; at 1/32 of the width and 256 tokens, so every kernel is short):

- wall seconds per layer, forward plus backward, over a stack of ``--layers`` layers and
  ``--repeat`` steps, by recompute choice (full recompute runs the forward twice);
- CUDA kernels launched per layer (``torch.profiler``, one step);
- the host's seconds per kernel: the first over the second;
- the kernels ``planner.costs.blocks`` counts for that layer (``Work.kernels``, forward,
  backward and recompute), and the host seconds per counted kernel that would reproduce the
  measured wall time.

Also the bare launch: one-element adds in a loop (what ``planner calibrate --sweep`` reports
as "host per kernel"). Prints a table and one JSON line.

Run on a CUDA machine: ``python benchmarks/gpu_host.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from planner.costs.blocks import block_cost
from planner.costs.memory import shard_of
from planner.layout import Layout, parse_recompute
from planner.run.benchblocks import block_model, job_for
from planner.run.benchrows import scaled_model
from planner.run.model import DenseLayer

SCALE = 1 / 32
SEQ = 256


def _model_kernels(model: Any, block: str, recompute: str) -> dict[str, int]:
    """Kernels the cost model counts for one layer, forward / backward / recompute."""
    shard = shard_of(job_for(SEQ, "bf16"), Layout.uniform(model))
    cost = block_cost(model, block, shard)
    dropped = "full" if recompute == "full" else parse_recompute(recompute)
    bwd = cost.bwd_input + cost.bwd_weight
    return {
        "fwd": int(cost.fwd.kernels),
        "bwd": int(bwd.kernels),
        "recompute": int(cost.recompute_work(dropped).kernels),
    }


def _kernels_launched(fn: Any) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", help="catalog model (MoE: its first MoE layer)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_host: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    model = scaled_model(block_model(args.model), SCALE)
    index = next((i for i in range(model.num_layers) if model.is_moe_layer(i)), 0)
    block, moe = f"layer.{index}", model.is_moe_layer(index)
    torch.manual_seed(0)
    with torch.device("cuda"):
        layers = [DenseLayer(model, torch.bfloat16, moe=moe) for _ in range(args.layers)]
        x0 = torch.randn(1, SEQ, model.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    tiny = torch.zeros(1, device="cuda")

    def adds() -> None:
        for _ in range(1000):
            tiny.add_(1)

    rows: list[dict[str, Any]] = []
    ffn = "moe" if moe else "mlp"
    for recompute in ("none", "selective", ffn, "full"):

        def step(recompute: str = recompute) -> None:
            x = x0
            for layer in layers:
                x = layer(x, recompute)
            x.sum().backward()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        walls = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        per_layer = statistics.median(walls) / args.layers
        kernels = _kernels_launched(step) / args.layers
        counted = _model_kernels(model, block, recompute)
        total = sum(counted.values())
        rows.append(
            {
                "recompute": recompute,
                "wall_per_layer_s": per_layer,
                "kernels_per_layer": kernels,
                "host_per_kernel_s": per_layer / kernels,
                "model_kernels": counted,
                "host_per_model_kernel_s": per_layer / total,
            }
        )
    adds()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    adds()
    bare = (time.perf_counter() - t0) / 1000
    torch.cuda.synchronize()
    name = torch.cuda.get_device_name(0)
    print(
        f"{name}, torch {torch.__version__}; {args.model} {block} at {SCALE:.4f} of its width "
        f"({model.hidden_size} wide), {SEQ} tokens"
    )
    print(f"bare launch (one-element add): {bare * 1e6:.2f} us per kernel")
    print(
        f"{'recompute':10} {'ms/layer':>9} {'kernels':>8} {'us/kernel':>9} "
        f"{'model k':>8} {'us/model k':>10}"
    )
    for r in rows:
        print(
            f"{r['recompute']:10} {r['wall_per_layer_s'] * 1e3:9.3f} "
            f"{r['kernels_per_layer']:8.0f} {r['host_per_kernel_s'] * 1e6:9.2f} "
            f"{sum(r['model_kernels'].values()):8d} {r['host_per_model_kernel_s'] * 1e6:10.2f}"
        )
    print(
        json.dumps(
            {"device": name, "torch": str(torch.__version__), "bare_launch_s": bare, "rows": rows}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
