"""The eager MoE module's time per step when the tokens each expert gets change from call to
call (as routing makes them) against when they repeat: the cost of a new GEMM shape.

``planner.run.model.MoE`` (what ``planner validate`` runs) loops over its experts, three
GEMMs each forward and six backward, after reading the tokens per expert on the host. Each
timed call runs the module's forward and backward on one micro-batch and synchronises: with
fresh random inputs (new row counts per expert every call) and with one input repeated (the
same row counts, so every GEMM shape was seen before). The difference per GEMM is what a new
shape costs the host beyond a known one (cuBLAS's heuristic query and descriptors).

Usage: ``python benchmarks/gpu_expert_host.py [--device cpu] [--small]``. Prints one line
per micro-batch: wall ms per call both ways, and the difference per expert GEMM in us.
"""

from __future__ import annotations

import sys
import time

import torch

from planner.catalog import load_model
from planner.run.model import MoE

CALLS = 12
WARMUP = 3


def main() -> None:
    device = "cpu" if "--device" in sys.argv and "cpu" in sys.argv else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = load_model("mixtral-8x7b")
    if "--small" in sys.argv:
        model = model.model_copy(update={"hidden_size": 256, "moe_ffn_hidden_size": 512})
    torch.manual_seed(0)
    moe = MoE(model, dtype).to(device)
    gemms = 9 * model.num_experts  # 3 forward and 6 backward GEMMs an expert
    for mb in (1, 2):
        shape = (mb, 4096, model.hidden_size)
        fixed = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)

        def call(x: torch.Tensor) -> float:
            start = time.perf_counter()
            moe(x).sum().backward()
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        times: dict[str, float] = {}
        for name in ("varying", "repeated"):
            walls = []
            for _ in range(WARMUP + CALLS):
                x = fixed
                if name == "varying":
                    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
                walls.append(call(x))
            times[name] = sorted(walls[WARMUP:])[CALLS // 2]
        extra = (times["varying"] - times["repeated"]) / gemms
        print(
            f"micro-batch {mb}: {times['varying'] * 1e3:.2f} ms a call with new row counts, "
            f"{times['repeated'] * 1e3:.2f} ms with repeated ones; {extra * 1e6:+.1f} us per "
            f"expert GEMM ({gemms} a call)",
            flush=True,
        )


if __name__ == "__main__":
    main()
