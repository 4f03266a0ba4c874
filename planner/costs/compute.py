"""Compute time on one GPU: a roofline per kind of work, at achieved (not peak) rates.

Each kind of work in ``planner.costs.work.Work`` runs at its own rate:

- GEMMs (dense, and the routed experts' grouped GEMMs) by their shapes (``gemm_seconds``):
  the output is cut into 128 x 128 tiles, one per SM at a time, run in waves of the GPU's SM
  count (tile and wave quantisation: a GEMM of 133 tiles on 132 SMs takes two waves); each
  tile streams its k-deep reduction at the SM's share of ``peak x achieved["gemm"]`` and then
  writes its output tile at the SM's share of the memory-bound rate (the epilogue, not
  overlapped with the next tile's main loop); and the whole GEMM takes at least the time to
  read its inputs and write its output at the memory-bound rate (what bounds small-m GEMMs,
  such as experts with few tokens: their weights must be read whatever m is). Without an SM
  count (``ClusterSpec.sm_count``; a CPU profile) there are no tiles. The peak is the
  FP8 tensor-core rate when the job computes in FP8 and the GPU has it (DeepSeek-V3 ran
  forward, input-gradient and weight-gradient GEMMs in FP8, report section 3.3), else BF16;
  FP8 GEMMs reach their own fraction of it, ``achieved["gemm_fp8"]`` where the catalog
  measured one (on Hopper, cuBLAS's per-tensor-scaled FP8 GEMMs keep about 0.9 of the BF16
  GEMMs' fraction at training shapes: ``benchmarks/gpu_kernels.py``), else ``achieved["gemm"]``.
  ``benchmarks/kernel_fidelity.py`` sets this against published GEMM throughputs by shape
  (DeepGEMM's H800 tables, the best-shape matmul rates of five GPUs);
- fused attention at ``bf16 peak x achieved["attention"]`` (attention stays in BF16 in FP8
  training too; FlashAttention-2, ``TrainingJob.attention_kernel="fa2"``, at
  ``achieved["attention_fa2"]`` where the GPU has one: Hopper), that rate being the one at
  head dimension 128 and long sequences; shorter
  sequences, causal masks and smaller heads pay ``Work.attention_overhead``
  (``planner.costs.work.flash_overhead``);
- in a training run, GEMMs and attention at ``ClusterSpec.sustained_tensor_rate`` of those
  rates: the fractions are short timings (a few to tens of milliseconds, as MAMF's and
  FlashAttention's tables are), while a run of hours holds the GPU at its power limit, whose
  SM clock is lower under tensor-core load (one H200 SXM at 700 W: back-to-back 8192^3 BF16
  GEMMs at 752 TFLOP/s timed over 60 ms, 670 TFLOP/s over the second half of 40 s at
  1,470 MHz, ``benchmarks/gpu_step.py``; 0.891). Memory-bound kernels keep their rate (HBM's
  clock is not the SMs');
- memory-bound kernels at ``HBM bandwidth x achieved["memory_bound"]``;
- plus ``cluster.kernel_overhead_s`` per kernel on the GPU: launch latency.

The host issues the kernels, ``cluster.host_overhead_s`` per kernel the model counts (or the
job's framework's own, ``cluster.framework_host_overhead_s``, where a fit to its runs set one; the
framework's Python, autograd and the CUDA launch), asynchronously: a phase of work takes the
longer of the GPU's time and the host's. The model counts a fused stack's kernels (13 forward
and 19 backward for a Llama layer), fewer than an eager stack launches, so the figure is per
counted kernel: 70 us, measured on an eager PyTorch layer on an H200 machine's host
(``benchmarks/gpu_host.py``). Small models at high tensor parallelism or small micro-batches
are host-bound this way (in the vTrain measurements a micro-batch of 4 sequences takes as long
as one of 1), large ones are not.
A framework that launches the routed experts' GEMMs one per expert, after a host-device
synchronisation that empties the GPU's queue, spends ``Framework.expert_gemm_launch_s`` of
host time on each (``Work.expert_gemms``, counted from the expert shapes): those GEMMs then
take the longer of their GPU time and their launches (Megatron-LM with Transformer Engine's
GroupedLinear; ``benchmarks/expert_launch.py`` fits the time per launch to the measured MoE
ladders). On the GPU they are still priced as one grouped kernel (their tiles share the
waves: TE runs them over four streams).

The achieved fractions and the overheads come from the hardware catalog (each with its
source) or from a fit to measured runs (``planner.fit``). Ignored: split-K and stream-K
kernels (which fill the SMs on GEMMs of few tiles), the power limit's slowing on GPUs that
have no measurement of it (``sustained_tensor_rate`` 1), its variation with the mix of work
(an eager step of 30% MFU on the H200 held 1,695 MHz, GEMMs alone 1,470), interference between
concurrent kernels, and the communication kernels' use of SMs (``planner.costs.overlap``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from planner.costs.blocks import BlockCost
from planner.costs.work import Gemm, Work
from planner.errors import PlannerError
from planner.frameworks import framework
from planner.specs import DTYPE_BYTES, ClusterSpec, TrainingJob

TILE = 128  # rows and columns of a GEMM's output tile per SM (DeepGEMM's 128 x 128 blocks)
OUT_BYTES = 2  # GEMM outputs are written in BF16 (FP8 GEMMs too: DeepSeek-V3 section 3.3)


@dataclass(frozen=True)
class Rates:
    """Achieved rates of one GPU for one job."""

    gemm_flops: float  # FLOP/s
    attention_flops: float  # FLOP/s
    memory_Bps: float  # bytes/s
    kernel_s: float  # GPU seconds per kernel
    host_s: float  # host seconds per kernel
    weight_bytes: int  # bytes per GEMM input element read (FP8: 1)
    sms: int | None = None  # SMs per GPU: tiles run in waves of this many
    pcie_Bps: float = math.inf  # GPU-host copies, each way (activation offload)
    # Host seconds per routed-expert GEMM the framework launches one by one, with the GPU's
    # queue empty (``Framework.expert_gemm_launch_s``; 0: one grouped kernel).
    expert_gemm_s: float = 0.0

    @classmethod
    def of(cls, cluster: ClusterSpec, job: TrainingJob, *, sustained: bool = True) -> Rates:
        """The rates of ``job`` on one GPU of ``cluster``; ``sustained``: as a training run
        sustains them at the power limit (``ClusterSpec.sustained_tensor_rate``), else as a
        short timing of single kernels measures them (what the catalog's fractions are)."""
        achieved = cluster.achieved
        peak, gemm = cluster.bf16_flops, achieved.get("gemm", 1.0)
        if job.compute_dtype == "fp8":
            if cluster.fp8_flops is None:
                raise PlannerError(
                    f"TrainingJob.compute_dtype='fp8': {cluster.name} has no FP8 tensor cores; "
                    "use bf16"
                )
            peak, gemm = cluster.fp8_flops, achieved.get("gemm_fp8", gemm)
        attention = achieved.get("attention", 1.0)
        if job.attention_kernel == "fa2":  # where the GPU has no FA2 figure, FA2 is its best
            attention = achieved.get("attention_fa2", attention)
        tensor = cluster.sustained_tensor_rate if sustained else 1.0
        return cls(
            gemm_flops=peak * gemm * tensor,
            attention_flops=cluster.bf16_flops * attention * tensor,
            memory_Bps=cluster.hbm_bandwidth_Bps * achieved.get("memory_bound", 1.0),
            kernel_s=cluster.kernel_overhead_s,
            host_s=cluster.framework_host_overhead_s.get(job.framework, cluster.host_overhead_s),
            weight_bytes=1 if job.compute_dtype == "fp8" else DTYPE_BYTES[job.working_weight_dtype],
            sms=cluster.sm_count,
            pcie_Bps=cluster.pcie_Bps * achieved.get("pcie", 1.0),
            expert_gemm_s=(
                0.0 if job.moe_grouped_tensor else framework(job.framework).expert_gemm_launch_s
            ),
        )


@functools.lru_cache(maxsize=65536)
def gemm_seconds(g: Gemm, rates: Rates) -> float:
    """Seconds of one (grouped) GEMM of shape ``g`` (see the module docstring)."""
    if g.flops <= 0:
        return 0.0
    if rates.sms:
        tiles = math.ceil(g.groups * math.ceil(g.m / TILE) * math.ceil(g.n / TILE) - 1e-9)
        main = 2.0 * TILE * TILE * g.k / rates.gemm_flops  # one tile at all SMs' rate
        epilogue = TILE * TILE * OUT_BYTES / rates.memory_Bps
        compute = math.ceil(tiles / rates.sms) * rates.sms * (main + epilogue)
    else:  # not a GPU of known SMs (a calibrated CPU profile): no tiles, no waves
        compute = g.flops / rates.gemm_flops
    traffic = g.groups * ((g.m + g.n) * g.k * rates.weight_bytes + g.m * g.n * OUT_BYTES)
    return max(compute, traffic / rates.memory_Bps)


def work_time(work: Work, rates: Rates) -> float:
    """Seconds ``work`` takes: its kernels run one after another on one stream, and the host
    must have issued them (see the module docstring)."""
    shaped = 0.0
    seconds = 0.0
    routed = 0.0  # of which the routed experts' GEMMs
    for g, times in work.shapes:
        shaped += g.flops * times
        each = gemm_seconds(g, rates) * times
        seconds += each
        if g.expert:
            routed += each
    unshaped = max(0.0, work.gemm + work.expert - shaped)  # GEMM FLOPs stated without a shape
    gpu = (
        seconds
        + unshaped / rates.gemm_flops
        + (work.attention + work.attention_overhead) / rates.attention_flops
        + work.memory / rates.memory_Bps
        + work.kernels * rates.kernel_s
    )
    # Launched one by one after a synchronisation, the experts' GEMMs take the longer of
    # their GPU time and the host's launches (each launch overlaps the GEMMs before it).
    launches = work.expert_gemms * rates.expert_gemm_s
    return max(gpu, work.kernels * rates.host_s) + max(0.0, launches - routed)


@dataclass(frozen=True)
class BlockTime:
    """Seconds of one block's phases for one micro-batch on one rank (no communication)."""

    fwd: float
    bwd_input: float
    bwd_weight: float
    recompute: float  # forward work repeated before the backward under the chosen recompute


def block_time(cost: BlockCost, rates: Rates, dropped: frozenset[str] | str) -> BlockTime:
    """Phase times of ``cost`` with recompute choice ``dropped`` (a module set or "full")."""
    fwd, bwd_input, bwd_weight = _phase_times(cost, rates)
    return BlockTime(
        fwd=fwd,
        bwd_input=bwd_input,
        bwd_weight=bwd_weight,
        recompute=work_time(cost.recompute_work(dropped), rates),
    )


@functools.lru_cache(maxsize=65536)
def _phase_times(cost: BlockCost, rates: Rates) -> tuple[float, float, float]:
    """A block's forward, input-gradient and weight-gradient seconds, whatever it recomputes:
    priced once for all its recompute choices (a ``BlockCost`` is hashed by identity, and
    ``block_cost`` hands out one per block and shard)."""
    return (
        work_time(cost.fwd, rates),
        work_time(cost.bwd_input, rates),
        work_time(cost.bwd_weight, rates),
    )
