"""``calibrate``: measure the machine at hand and write a cluster profile for it.

A "GPU" here is one worker process (gloo on CPU; each process gets one thread). All
workers measure at the same time, so the rates include their contention for the cores, as
a real run of that many ranks would see. What is measured, per worker (the profile takes the
median over workers):

- GEMM rate: FP32 matrix products of the small validation model's shapes (FLOP/s);
- attention rate: causal scaled-dot-product attention, forward and backward (FLOP/s, the
  cost model's count: half the score matrix);
- memory rate: copying a 64 MiB tensor (bytes read + written per second);
- collectives: all-reduce over all workers, 8 MiB (bus bandwidth) and 4 bytes (latency),
  and ping-pong between pairs of workers (reported beside it);
- each block kind of the small model (embedding, a MoE layer, head), forward and backward
  of one micro-batch, and the layer's backward under full recompute.

The rates above become the profile's peaks, with every achieved fraction 1 (they are
achieved rates). The one remaining constant, the time per operator beyond its work (the
eager framework's dispatch and autograd bookkeeping, ``kernel_overhead_us``), is fitted by
least squares to the block timings: what the measured block times leave over the work at
the measured rates, per operator the cost model counts. ``checks`` in the profile sets each
block time beside the prediction.

The profile is a cluster YAML (``hardware/*.yaml`` format), usable as ``--cluster FILE``
by ``plan``, ``evaluate``, ``simulate`` and ``validate``: one node of ``processes`` GPUs;
"InfiniBand" is the same loopback as "NVLink" (there is one host).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.multiprocessing.spawn import spawn

from planner.errors import PlannerError
from planner.run.state import _free_port

MiB = 2**20


def _median_time(fn: Callable[[], object], *, repeat: int, inner: int = 1) -> float:
    """Median seconds of one call of ``fn`` (``inner`` calls per timing, after a warm-up)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def _gemm_rate(shapes: list[tuple[int, int, int]]) -> float:
    flops = seconds = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        seconds += _median_time(partial(torch.mm, a, b), repeat=31)
        flops += 2.0 * m * k * n
    return flops / seconds


def _attention_rate(heads: int, seq: int, dim: int) -> float:
    q, k, v = (torch.randn(1, heads, seq, dim, requires_grad=True) for _ in range(3))

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    seconds = _median_time(step, repeat=15)
    # Forward 2 GEMMs (QK^T, PV), backward 4 (dQ, dK, dP, dV) + a forward rerun in flash
    # backward: the cost model counts 2 + 5 of them over half the causal score matrix.
    flops = 7 * 2.0 * seq * seq * heads * dim * 0.5
    return flops / seconds


def _memory_rate() -> float:
    src, dst = torch.ones(16 * MiB), torch.empty(16 * MiB)  # 64 MiB each
    seconds = _median_time(lambda: dst.copy_(src), repeat=15)
    return 2 * src.numel() * 4 / seconds


def _ping_pong(rank: int, world: int, nbytes: int) -> float:
    """One-way seconds for ``nbytes`` between partners 2i and 2i+1 (NaN for an odd one out)."""
    buf = torch.zeros(max(1, nbytes // 4))
    partner = rank ^ 1
    if partner >= world:
        dist.barrier()
        return float("nan")

    def once() -> None:
        if rank % 2 == 0:
            dist.send(buf, partner)
            dist.recv(buf, partner)
        else:
            dist.recv(buf, partner)
            dist.send(buf, partner)

    seconds = _median_time(once, repeat=11) / 2
    dist.barrier()
    return seconds


def _all_reduce(nbytes: int) -> float:
    """Seconds of one all-reduce of ``nbytes`` over every worker."""
    buf = torch.zeros(max(1, nbytes // 4))
    seconds = _median_time(lambda: dist.all_reduce(buf), repeat=11)
    dist.barrier()
    return seconds


def _block_times(model: Any, job: Any) -> dict[str, dict[str, float]]:
    """Measured forward and backward seconds of each kind of block, one micro-batch; for
    the layer, also the backward under full recompute (its extra is the recompute)."""
    from planner.run.model import DenseLayer, Embedding, Head

    torch.manual_seed(0)
    tokens = torch.randint(model.vocab_size, (1, job.seq_len))
    hidden = torch.randn(1, job.seq_len, model.hidden_size)
    layer = DenseLayer(model, torch.float32, moe=model.is_moe_layer(0))
    blocks: dict[str, tuple[torch.nn.Module, torch.Tensor]] = {
        "embedding": (Embedding(model, torch.float32), tokens),
        "layer.0": (layer, hidden),
        "head": (Head(model, torch.float32), hidden),
    }
    out: dict[str, dict[str, float]] = {}
    for name, (block, x) in blocks.items():
        inp = x if name == "embedding" else x.clone().requires_grad_(True)
        fwd = _median_time(partial(block, inp), repeat=21)

        def both(
            choice: str = "none", block: torch.nn.Module = block, inp: torch.Tensor = inp
        ) -> None:
            y = block(inp, choice)
            y.backward(torch.ones_like(y))

        total = _median_time(both, repeat=21)
        out[name] = {"fwd_s": fwd, "bwd_s": max(total - fwd, 0.0)}
        if name.startswith("layer."):
            full = _median_time(lambda: both("full"), repeat=21)
            out[name]["recompute_s"] = max(full - total, 0.0)
    return out


def _worker(rank: int, world: int, port: int, folder: str, model: Any, job: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        h, t = model.hidden_size, job.seq_len
        shapes = [(t, h, h), (t, h, 2 * h), (2 * t, h, model.moe_ffn_hidden_size or h)]
        shapes.append((t, h, model.vocab_size))
        dist.barrier()
        found = {
            "gemm_flops": _gemm_rate(shapes),
            "attention_flops": _attention_rate(
                model.num_attention_heads, t, model.head_dim or h // model.num_attention_heads
            ),
            "memory_Bps": _memory_rate(),
        }
        dist.barrier()
        found["p2p_big_s"] = _ping_pong(rank, world, 8 * MiB)
        found["p2p_small_s"] = _ping_pong(rank, world, 4)
        found["all_reduce_big_s"] = _all_reduce(8 * MiB)
        found["all_reduce_small_s"] = _all_reduce(4)
        dist.barrier()
        blocks = _block_times(model, job)
        torch.save({"rates": found, "blocks": blocks}, os.path.join(folder, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _median(values: list[float]) -> float:
    real = [v for v in values if v == v]
    return statistics.median(real) if real else float("nan")


def measure(processes: int = 2) -> dict[str, Any]:
    """Run the measurements on ``processes`` workers at once; medians over workers."""
    from planner.run.validate import small_job, small_model

    if processes < 2:
        raise PlannerError(f"processes={processes}: needs at least 2 (point-to-point pairs)")
    model, job = small_model(), small_job()
    with tempfile.TemporaryDirectory() as folder:
        spawn(_worker, args=(processes, _free_port(), folder, model, job), nprocs=processes)
        parts = [torch.load(Path(folder) / f"{r}.pt") for r in range(processes)]
    rates = {k: _median([p["rates"][k] for p in parts]) for k in parts[0]["rates"]}
    blocks = {
        name: {k: _median([p["blocks"][name][k] for p in parts]) for k in phases}
        for name, phases in parts[0]["blocks"].items()
    }
    return {"processes": processes, "rates": rates, "blocks": blocks}


_PHASES = {"fwd_s": "fwd", "bwd_s": "bwd", "recompute_s": "recompute"}


def _phase_work(name: str, phase: str) -> tuple[Any, Any]:
    """The cost model's block and its work in one phase (``fwd``, ``bwd``, ``recompute``
    under full recompute) for the small model, one micro-batch."""
    from planner.costs.blocks import block_cost
    from planner.costs.memory import shard_of
    from planner.layout import Layout
    from planner.run.validate import small_job, small_model

    model, job = small_model(), small_job()
    cost = block_cost(model, name, shard_of(job, Layout.uniform(model, micro_batch=1)))
    if phase == "fwd":
        return cost, cost.fwd
    if phase == "bwd":
        return cost, cost.bwd_input + cost.bwd_weight
    return cost, cost.recompute_work("full")


def _rates(rates: dict[str, float], kernel_s: float) -> Any:
    from planner.costs.compute import Rates

    return Rates(
        gemm_flops=rates["gemm_flops"],
        attention_flops=rates["attention_flops"],
        memory_Bps=rates["memory_Bps"],
        kernel_s=kernel_s,
        host_s=0.0,
        weight_bytes=4,
    )


def _predicted(name: str, phase: str, rates: Any) -> float:
    from planner.costs.compute import work_time

    _, work = _phase_work(name, phase)
    return work_time(work, rates)


def fit_overhead(found: dict[str, Any]) -> float:
    """Seconds per operator that best explain the block timings beyond their work at the
    measured rates (least squares over every block phase, never below 0)."""
    bare = _rates(found["rates"], 0.0)
    num = den = 0.0
    for name, phases in found["blocks"].items():
        for key, seconds in phases.items():
            phase = _PHASES[key]
            kernels = _phase_work(name, phase)[1].kernels
            num += kernels * (seconds - _predicted(name, phase, bare))
            den += kernels * kernels
    return max(num / den, 0.0) if den else 0.0


def block_checks(found: dict[str, Any], kernel_s: float) -> list[dict[str, Any]]:
    """Measured vs predicted seconds of each block phase, with the profile's rates."""
    rates = _rates(found["rates"], kernel_s)
    out = []
    for name, phases in found["blocks"].items():
        for key, seconds in phases.items():
            predicted = _predicted(name, _PHASES[key], rates)
            out.append(
                {
                    "block": name,
                    "phase": _PHASES[key],
                    "measured_s": seconds,
                    "predicted_s": predicted,
                    "error": predicted / seconds - 1 if seconds > 0 else None,
                }
            )
    return out


def profile(found: dict[str, Any], *, name: str = "cpu") -> dict[str, Any]:
    """The cluster YAML (as a dict) of a measurement from ``measure``."""
    r, n = found["rates"], found["processes"]
    p2p_bw = 8 * MiB / max(r["p2p_big_s"] - r["p2p_small_s"], 1e-9)
    # The cost model prices collectives at a bus bandwidth (a ring all-reduce moves 2(n-1)/n
    # of the buffer) with one latency per ring step; point-to-point sends at the same link.
    # Gloo's all-reduce on CPU is far slower than its sends (the reduction runs on the
    # cores), and gradient reductions dominate, so the link is the all-reduce's.
    steps = 2 * (n - 1)
    bus_bw = steps / n * 8 * MiB / max(r["all_reduce_big_s"] - r["all_reduce_small_s"], 1e-9)
    latency_s = r["all_reduce_small_s"] / steps
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    how = f"measured by planner calibrate on {platform.node()} ({n} workers), {when}"
    gemm_t = r["gemm_flops"] / 1e12
    kernel_s = fit_overhead(found)
    return {
        "name": name,
        "description": f"{n} CPU worker processes (gloo), one thread each, measured together",
        "gpus_per_node": n,
        "hbm_GiB": round(ram / n, 3),
        "usable_hbm_GiB": round(ram / n, 3),
        "hbm_bandwidth_GBps": round(r["memory_Bps"] / 1e9, 3),
        "bf16_dense_tflops": round(gemm_t, 6),
        "fp8_dense_tflops": None,
        "fp32_tflops": round(gemm_t, 6),
        "nvlink_GBps_per_direction": round(bus_bw / 1e9, 4),
        "nics_per_node": 1,
        "nic_Gbps": round(bus_bw * 8 / 1e9, 4),
        "host_ram_GiB": round(ram, 3),
        "pcie_GBps_per_direction": round(r["memory_Bps"] / 1e9, 3),
        "nvlink_latency_us": round(latency_s * 1e6, 2),
        "ib_latency_us": round(latency_s * 1e6, 2),
        "kernel_overhead_us": round(kernel_s * 1e6, 3),
        "host_overhead_us": 0.0,
        "achieved": {
            "gemm": 1.0,
            "attention": round(min(1.0, r["attention_flops"] / r["gemm_flops"]), 4),
            "memory_bound": 1.0,
            "nvlink": 1.0,
            "ib": 1.0,
        },
        "sources": {
            "bf16_dense_tflops": f"{how}: FP32 GEMMs of the validation model's shapes "
            "(CPUs have no BF16 tensor cores; the job computes in FP32)",
            "hbm_bandwidth_GBps": f"{how}: 64 MiB tensor copy, bytes read + written",
            "nvlink_GBps_per_direction": f"{how}: gloo all-reduce bus bandwidth, 8 MiB less "
            f"4 B (point-to-point sends reach {p2p_bw / 1e9:.2f} GB/s, "
            f"{r['p2p_small_s'] * 1e6:.0f} us one way)",
            "nvlink_latency_us": f"{how}: gloo all-reduce of 4 bytes per ring step",
            "kernel_overhead_us": f"{how}: least-squares fit to the block timings in checks",
            "achieved.attention": f"{how}: causal SDPA forward+backward rate over GEMM rate",
            "hbm_GiB": "host RAM shared equally by the workers",
            "usable_hbm_GiB": "as hbm_GiB: no driver keeps any of host RAM from the workers",
        },
        "checks": block_checks(found, kernel_s),
    }


def write_profile(found: dict[str, Any], path: Path, *, name: str = "cpu") -> dict[str, Any]:
    """Write the profile of ``found`` as YAML at ``path``; the profile."""
    import yaml

    data = profile(found, name=name)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return data


def calibrated_cluster(processes: int, folder: Path) -> Any:
    """Measure with ``processes`` workers, write ``folder/cpu-<processes>.yaml`` and load it
    as a ``ClusterSpec`` of ``processes`` GPUs."""
    from planner.catalog import load_cluster

    path = folder / f"cpu-{processes}.yaml"
    write_profile(measure(processes), path, name=f"cpu-{processes}")
    return load_cluster(path, gpus=processes)
