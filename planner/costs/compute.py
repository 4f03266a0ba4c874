"""Compute time on one GPU: a roofline per kind of work, at achieved (not peak) rates.

Each kind of work in ``planner.costs.work.Work`` runs at its own rate:

- dense GEMMs at ``peak x achieved["gemm"]``, where peak is the FP8 tensor-core rate when the
  job computes in FP8 and the GPU has it (DeepSeek-V3 ran forward, input-gradient and
  weight-gradient GEMMs in FP8, report section 3.3), else the BF16 rate;
- fused attention at ``bf16 peak x achieved["attention"]`` (attention stays in BF16 in FP8
  training too);
- the routed experts' grouped GEMMs at the GEMM rate times ``expert_efficiency``: tensor cores
  work on 128-row tiles, so an expert with m tokens pays for ceil(m/128)*128 rows, and with few
  tokens the GEMM is bound by reading the expert's weights (roofline: m tokens give 2m FLOPs
  per weight element read);
- memory-bound kernels at ``HBM bandwidth x achieved["memory_bound"]``;
- plus ``cluster.kernel_overhead_s`` per kernel on the GPU: launch latency and the tail of
  under-filled waves, what makes small GEMMs slow.

The host issues the kernels, ``cluster.host_overhead_s`` each (framework dispatch and the CUDA
launch call), asynchronously: a phase of work takes the longer of the GPU's time and the
host's. Small models at high tensor parallelism are host-bound this way (in the vTrain
measurements a micro-batch of 2 sequences takes as long as one of 1), large ones are not.

The achieved fractions and the overhead come from the hardware catalog (each with its source)
or from a calibration; ``benchmarks/vtrain_fidelity.py`` fits the A100's on measured runs.
Ignored: clock throttling, interference between concurrent kernels, and the communication
kernels' use of SMs (communication time is in ``planner.costs.comm``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.costs.blocks import BlockCost
from planner.costs.work import Work
from planner.errors import PlannerError
from planner.specs import DTYPE_BYTES, ClusterSpec, TrainingJob

TILE_ROWS = 128  # rows of a tensor-core GEMM tile (CUTLASS/cuBLAS grouped-GEMM tiles)


@dataclass(frozen=True)
class Rates:
    """Achieved rates of one GPU for one job."""

    gemm_flops: float  # FLOP/s
    attention_flops: float  # FLOP/s
    memory_Bps: float  # bytes/s
    kernel_s: float  # GPU seconds per kernel
    host_s: float  # host seconds per kernel
    weight_bytes: int  # bytes per weight element read by a GEMM

    @classmethod
    def of(cls, cluster: ClusterSpec, job: TrainingJob) -> Rates:
        achieved = cluster.achieved
        peak = cluster.bf16_flops
        if job.compute_dtype == "fp8":
            if cluster.fp8_flops is None:
                raise PlannerError(
                    f"TrainingJob.compute_dtype='fp8': {cluster.name} has no FP8 tensor cores; "
                    "use bf16"
                )
            peak = cluster.fp8_flops
        return cls(
            gemm_flops=peak * achieved.get("gemm", 1.0),
            attention_flops=cluster.bf16_flops * achieved.get("attention", 1.0),
            memory_Bps=cluster.hbm_bandwidth_Bps * achieved.get("memory_bound", 1.0),
            kernel_s=cluster.kernel_overhead_s,
            host_s=cluster.host_overhead_s,
            weight_bytes=1 if job.compute_dtype == "fp8" else DTYPE_BYTES[job.weight_dtype],
        )


def expert_efficiency(tokens_per_expert: float, rates: Rates) -> float:
    """Fraction of the GEMM rate a grouped expert GEMM reaches with ``tokens_per_expert``
    tokens per expert: tile padding times the weight-read roofline (1 for large batches)."""
    if tokens_per_expert <= 0:
        return 1.0
    padded = math.ceil(tokens_per_expert / TILE_ROWS) * TILE_ROWS
    intensity = 2.0 * tokens_per_expert / rates.weight_bytes  # FLOPs per weight byte read
    roofline = min(1.0, intensity * rates.memory_Bps / rates.gemm_flops)
    return tokens_per_expert / padded * roofline


def work_time(work: Work, rates: Rates, *, tokens_per_expert: float = 0.0) -> float:
    """Seconds ``work`` takes: its kernels run one after another on one stream, and the host
    must have issued them (see the module docstring)."""
    expert_rate = rates.gemm_flops * expert_efficiency(tokens_per_expert, rates)
    gpu = (
        work.gemm / rates.gemm_flops
        + work.attention / rates.attention_flops
        + (work.expert / expert_rate if work.expert else 0.0)
        + work.memory / rates.memory_Bps
        + work.kernels * rates.kernel_s
    )
    return max(gpu, work.kernels * rates.host_s)


@dataclass(frozen=True)
class BlockTime:
    """Seconds of one block's phases for one micro-batch on one rank (no communication)."""

    fwd: float
    bwd_input: float
    bwd_weight: float
    recompute: float  # forward work repeated before the backward under the chosen recompute


def block_time(cost: BlockCost, rates: Rates, dropped: frozenset[str] | str) -> BlockTime:
    """Phase times of ``cost`` with recompute choice ``dropped`` (a module set or "full")."""
    m = cost.tokens_per_expert
    return BlockTime(
        fwd=work_time(cost.fwd, rates, tokens_per_expert=m),
        bwd_input=work_time(cost.bwd_input, rates, tokens_per_expert=m),
        bwd_weight=work_time(cost.bwd_weight, rates, tokens_per_expert=m),
        recompute=work_time(cost.recompute_work(dropped), rates, tokens_per_expert=m),
    )
