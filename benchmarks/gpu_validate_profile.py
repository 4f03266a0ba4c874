"""Where one step of a ``planner validate --set one-gpu`` layout goes on one GPU: the step's
wall time beside the GPU's kernel time (torch.profiler), and the kernels that take it.

Usage: ``python benchmarks/gpu_validate_profile.py [CASE] [--moe]`` (CASE numbered as
``planner validate --set one-gpu[-moe]`` numbers its layouts; default 1). Needs a CUDA GPU.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from planner.run.device import Device
from planner.run.execute import _Rank
from planner.run.validate import one_gpu_set


def main() -> None:
    numbers = [a for a in sys.argv[1:] if a.isdigit()]
    case = int(numbers[0]) if numbers else 1
    job, cases = one_gpu_set("bf16", moe="--moe" in sys.argv)
    model, layout = cases[case - 1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dev = Device.of("cuda").bind(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev.torch_device)
    run = _Rank(0, model, job, layout, dev)
    for _ in range(3):
        run.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    run.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
    print(
        f"{model.name} mb{layout.micro_batch} {layout.stages[0].blocks[1].recompute}: "
        f"step wall {wall:.4f} s, GPU kernel time {kernels:.4f} s in the profiled step"
    )
    print(events.table(sort_by="self_device_time_total", row_limit=28, max_name_column_width=70))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
