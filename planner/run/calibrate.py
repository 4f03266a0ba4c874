"""``calibrate``: measure the machine at hand and write a cluster profile for it.

A "GPU" here is one worker process: on CPU (``--device cpu``) gloo between processes of one
thread each; on CUDA (``--device cuda``) NCCL between processes bound to one GPU each
(``planner.run.device``). All workers measure at the same time, so on CPU the rates include
their contention for the cores, as a real run of that many ranks would see. What is
measured, per worker (the profile takes the median over workers):

- GEMM rate: matrix products of the small validation model's shapes in the device's
  measurement dtype (FP32 on CPU, BF16 on CUDA) (FLOP/s);
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
"InfiniBand" is the same link as "NVLink" (there is one host).

``planner calibrate --sweep`` measures one device at real model widths instead
(``planner.run.bench``).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from planner.errors import PlannerError
from planner.run.device import Device
from planner.run.processes import run_ranks

MiB = 2**20
_CPU = Device()


def _median_time(
    fn: Callable[[], object], *, repeat: int, inner: int = 1, dev: Device = _CPU
) -> float:
    """Median seconds of one call of ``fn`` (``inner`` calls per timing, after a warm-up)."""
    return dev.median_time(fn, repeat=repeat, inner=inner)


def _gemm_rate(shapes: list[tuple[int, int, int]], dev: Device = _CPU) -> float:
    flops = seconds = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=dev.dtype, device=dev.torch_device)
        b = torch.randn(k, n, dtype=dev.dtype, device=dev.torch_device)
        seconds += _median_time(partial(torch.mm, a, b), repeat=31, dev=dev)
        flops += 2.0 * m * k * n
    return flops / seconds


def _attention_rate(heads: int, seq: int, dim: int, dev: Device = _CPU) -> float:
    q, k, v = (
        torch.randn(
            1, heads, seq, dim, dtype=dev.dtype, device=dev.torch_device, requires_grad=True
        )
        for _ in range(3)
    )

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    seconds = _median_time(step, repeat=15, dev=dev)
    # Forward 2 GEMMs (QK^T, PV), backward 4 (dQ, dK, dP, dV) + a forward rerun in flash
    # backward: the cost model counts 2 + 5 of them over half the causal score matrix.
    flops = 7 * 2.0 * seq * seq * heads * dim * 0.5
    return flops / seconds


def _memory_rate(dev: Device = _CPU) -> float:
    src = torch.ones(16 * MiB, device=dev.torch_device)  # 64 MiB each (FP32)
    dst = torch.empty(16 * MiB, device=dev.torch_device)
    seconds = _median_time(lambda: dst.copy_(src), repeat=15, dev=dev)
    return 2 * src.numel() * 4 / seconds


def _host_to_device_rate(dev: Device) -> float:
    """Bytes per second of a 64 MiB copy from pinned host memory to the GPU."""
    src = torch.ones(16 * MiB, pin_memory=True)
    dst = torch.empty(16 * MiB, device=dev.torch_device)
    seconds = _median_time(lambda: dst.copy_(src, non_blocking=True), repeat=11, dev=dev)
    return src.numel() * 4 / seconds


def _ping_pong(rank: int, world: int, nbytes: int, dev: Device = _CPU) -> float:
    """One-way seconds for ``nbytes`` between partners 2i and 2i+1 (NaN for an odd one out)."""
    buf = torch.zeros(max(1, nbytes // 4), device=dev.torch_device)
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

    seconds = _median_time(once, repeat=11, dev=dev) / 2
    dist.barrier()
    return seconds


def _all_reduce(nbytes: int, dev: Device = _CPU) -> float:
    """Seconds of one all-reduce of ``nbytes`` over every worker."""
    buf = torch.zeros(max(1, nbytes // 4), device=dev.torch_device)
    seconds = _median_time(lambda: dist.all_reduce(buf), repeat=11, dev=dev)
    dist.barrier()
    return seconds


def _block_times(model: Any, job: Any, dev: Device = _CPU) -> dict[str, dict[str, float]]:
    """Measured forward and backward seconds of each kind of block, one micro-batch; for
    the layer, also the backward under full recompute (its extra is the recompute)."""
    from planner.run.model import DenseLayer, Embedding, Head

    torch.manual_seed(0)
    dtype = dev.dtype
    with torch.device(dev.torch_device):  # parameters and inputs made on the device
        tokens = torch.randint(model.vocab_size, (1, job.seq_len))
        hidden = torch.randn(1, job.seq_len, model.hidden_size, dtype=dtype)
        layer = DenseLayer(model, dtype, moe=model.is_moe_layer(0))
        blocks: dict[str, tuple[torch.nn.Module, torch.Tensor]] = {
            "embedding": (Embedding(model, dtype), tokens),
            "layer.0": (layer, hidden),
            "head": (Head(model, dtype), hidden),
        }
    out: dict[str, dict[str, float]] = {}
    for name, (block, x) in blocks.items():
        inp = x if name == "embedding" else x.clone().requires_grad_(True)
        fwd = _median_time(partial(block, inp), repeat=21, dev=dev)

        def both(
            choice: str = "none", block: torch.nn.Module = block, inp: torch.Tensor = inp
        ) -> None:
            y = block(inp, choice)
            y.backward(torch.ones_like(y))

        total = _median_time(both, repeat=21, dev=dev)
        out[name] = {"fwd_s": fwd, "bwd_s": max(total - fwd, 0.0)}
        if name.startswith("layer."):
            full = _median_time(lambda: both("full"), repeat=21, dev=dev)
            out[name]["recompute_s"] = max(full - total, 0.0)
    return out


def _worker(
    rank: int, world: int, port: int, folder: str, model: Any, job: Any, device: Device = _CPU
) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = device.bind(rank)  # one node: the local rank is the rank
    dist.init_process_group(dev.backend, rank=rank, world_size=world)
    try:
        h, t = model.hidden_size, job.seq_len
        shapes = [(t, h, h), (t, h, 2 * h), (2 * t, h, model.moe_ffn_hidden_size or h)]
        shapes.append((t, h, model.vocab_size))
        dist.barrier()
        found = {
            "gemm_flops": _gemm_rate(shapes, dev),
            "attention_flops": _attention_rate(
                model.num_attention_heads, t, model.head_dim or h // model.num_attention_heads, dev
            ),
            "memory_Bps": _memory_rate(dev),
        }
        if dev.is_cuda:
            found["pcie_Bps"] = _host_to_device_rate(dev)
        dist.barrier()
        found["p2p_big_s"] = _ping_pong(rank, world, 8 * MiB, dev)
        found["p2p_small_s"] = _ping_pong(rank, world, 4, dev)
        found["all_reduce_big_s"] = _all_reduce(8 * MiB, dev)
        found["all_reduce_small_s"] = _all_reduce(4, dev)
        dist.barrier()
        blocks = _block_times(model, job, dev)
        torch.save({"rates": found, "blocks": blocks}, os.path.join(folder, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _median(values: list[float]) -> float:
    real = [v for v in values if v == v]
    return statistics.median(real) if real else float("nan")


def small_job_for(dev: Device) -> Any:
    """The validation job in the device's measurement dtype (``small_job``)."""
    from planner.run.validate import small_job

    return small_job(dtype=dev.dtype_name)


def measure(processes: int = 2, device: Device = _CPU) -> dict[str, Any]:
    """Run the measurements on ``processes`` workers at once; medians over workers."""
    from planner.run.validate import small_model

    if processes < 2:
        raise PlannerError(f"processes={processes}: needs at least 2 (point-to-point pairs)")
    device.check_workers(processes, "--processes")
    model, job = small_model(), small_job_for(device)
    with tempfile.TemporaryDirectory() as folder:
        run_ranks(_worker, lambda port: (processes, port, folder, model, job, device), processes)
        parts = [torch.load(Path(folder) / f"{r}.pt") for r in range(processes)]
    rates = {k: _median([p["rates"][k] for p in parts]) for k in parts[0]["rates"]}
    blocks = {
        name: {k: _median([p["blocks"][name][k] for p in parts]) for k in phases}
        for name, phases in parts[0]["blocks"].items()
    }
    found = {"processes": processes, "rates": rates, "blocks": blocks}
    if device.is_cuda:  # a CPU measurement stays as it was: its profile reads the defaults
        found |= {"device": device.kind, "dtype": device.dtype_name, "gpu": device.name()}
        found["hbm_bytes"] = device.total_memory()
    return found


_PHASES = {"fwd_s": "fwd", "bwd_s": "bwd", "recompute_s": "recompute"}


def _phase_work(name: str, phase: str, dtype: str = "fp32") -> tuple[Any, Any]:
    """The cost model's block and its work in one phase (``fwd``, ``bwd``, ``recompute``
    under full recompute) for the small model, one micro-batch, in ``dtype``."""
    from planner.costs.blocks import block_cost
    from planner.costs.memory import shard_of
    from planner.layout import Layout
    from planner.run.validate import small_job, small_model

    model, job = small_model(), small_job(dtype=dtype)
    cost = block_cost(model, name, shard_of(job, Layout.uniform(model, micro_batch=1)))
    if phase == "fwd":
        return cost, cost.fwd
    if phase == "bwd":
        return cost, cost.bwd_input + cost.bwd_weight
    return cost, cost.recompute_work("full")


def _rates(rates: dict[str, float], kernel_s: float, dtype: str = "fp32") -> Any:
    from planner.costs.compute import Rates
    from planner.specs import DTYPE_BYTES

    return Rates(
        gemm_flops=rates["gemm_flops"],
        attention_flops=rates["attention_flops"],
        memory_Bps=rates["memory_Bps"],
        kernel_s=kernel_s,
        host_s=0.0,
        weight_bytes=DTYPE_BYTES[dtype],
    )


def _predicted(name: str, phase: str, rates: Any, dtype: str = "fp32") -> float:
    from planner.costs.compute import work_time

    _, work = _phase_work(name, phase, dtype)
    return work_time(work, rates)


def fit_overhead(found: dict[str, Any]) -> float:
    """Seconds per operator that best explain the block timings beyond their work at the
    measured rates (least squares over every block phase, never below 0)."""
    dtype = found.get("dtype", "fp32")
    bare = _rates(found["rates"], 0.0, dtype)
    num = den = 0.0
    for name, phases in found["blocks"].items():
        for key, seconds in phases.items():
            phase = _PHASES[key]
            kernels = _phase_work(name, phase, dtype)[1].kernels
            num += kernels * (seconds - _predicted(name, phase, bare, dtype))
            den += kernels * kernels
    return max(num / den, 0.0) if den else 0.0


def block_checks(found: dict[str, Any], kernel_s: float) -> list[dict[str, Any]]:
    """Measured vs predicted seconds of each block phase, with the profile's rates."""
    dtype = found.get("dtype", "fp32")
    rates = _rates(found["rates"], kernel_s, dtype)
    out = []
    for name, phases in found["blocks"].items():
        for key, seconds in phases.items():
            predicted = _predicted(name, _PHASES[key], rates, dtype)
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
    gpu = found.get("device") == "cuda"
    hbm = found["hbm_bytes"] / 2**30 if gpu else ram / n
    pcie = r.get("pcie_Bps", r["memory_Bps"]) if gpu else r["memory_Bps"]
    backend, dtype = ("NCCL", "BF16") if gpu else ("gloo", "FP32")
    return {
        "name": name,
        "description": f"{n} {found['gpu']} GPUs (NCCL), one process each, measured together"
        if gpu
        else f"{n} CPU worker processes (gloo), one thread each, measured together",
        "gpus_per_node": n,
        "hbm_GiB": round(hbm, 3),
        "usable_hbm_GiB": round(hbm, 3),
        "hbm_bandwidth_GBps": round(r["memory_Bps"] / 1e9, 3),
        "bf16_dense_tflops": round(gemm_t, 6),
        "fp8_dense_tflops": None,
        "fp32_tflops": round(gemm_t, 6),
        "nvlink_GBps_per_direction": round(bus_bw / 1e9, 4),
        "nics_per_node": 1,
        "nic_Gbps": round(bus_bw * 8 / 1e9, 4),
        "host_ram_GiB": round(ram, 3),
        "pcie_GBps_per_direction": round(pcie / 1e9, 3),
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
            "bf16_dense_tflops": f"{how}: BF16 GEMMs of the validation model's shapes "
            "(fp32_tflops: not measured, the BF16 rate stands in; the job computes in BF16)"
            if gpu
            else f"{how}: FP32 GEMMs of the validation model's shapes "
            "(CPUs have no BF16 tensor cores; the job computes in FP32)",
            "hbm_bandwidth_GBps": f"{how}: 64 MiB tensor copy, bytes read + written",
            "nvlink_GBps_per_direction": f"{how}: {backend} all-reduce bus bandwidth, 8 MiB "
            f"less 4 B (point-to-point sends reach {p2p_bw / 1e9:.2f} GB/s, "
            f"{r['p2p_small_s'] * 1e6:.0f} us one way)",
            "nvlink_latency_us": f"{how}: {backend} all-reduce of 4 bytes per ring step",
            "kernel_overhead_us": f"{how}: least-squares fit to the block timings in checks",
            "achieved.attention": f"{how}: causal SDPA forward+backward rate over GEMM rate "
            f"({dtype})",
            "hbm_GiB": "the GPU's total as the CUDA runtime reports it "
            "(torch.cuda.get_device_properties().total_memory)"
            if gpu
            else "host RAM shared equally by the workers",
            "usable_hbm_GiB": "as hbm_GiB: what a process can allocate"
            if gpu
            else "as hbm_GiB: no driver keeps any of host RAM from the workers",
            "pcie_GBps_per_direction": f"{how}: 64 MiB pinned host-to-device copy"
            if gpu
            else f"{how}: as hbm_bandwidth_GBps (host and 'device' memory are one)",
        },
        "checks": block_checks(found, kernel_s),
    }


def write_profile(found: dict[str, Any], path: Path, *, name: str = "cpu") -> dict[str, Any]:
    """Write the profile of ``found`` as YAML at ``path``; the profile."""
    import yaml

    data = profile(found, name=name)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return data


def calibrated_cluster(processes: int, folder: Path, device: Device = _CPU) -> Any:
    """Measure with ``processes`` workers, write ``folder/<device>-<processes>.yaml`` and
    load it as a ``ClusterSpec`` of ``processes`` GPUs."""
    from planner.catalog import load_cluster

    name = f"{device.kind}-{processes}"
    path = folder / f"{name}.yaml"
    write_profile(measure(processes, device), path, name=name)
    return load_cluster(path, gpus=processes)
