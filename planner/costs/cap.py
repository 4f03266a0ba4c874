"""The memory cap: how many bytes a rank may hold, stated once for every consumer.

Usable HBM (what the CUDA runtime reports as the device's total, not the nominal capacity),
less the job's margin for the memory model's own error; the allocated bytes' share of that
after the CUDA context and the allocator's fragmentation.
"""

from __future__ import annotations

import math

from planner.specs import ClusterSpec, TrainingJob


def usable_hbm(cluster: ClusterSpec) -> int:
    """Usable HBM per GPU (bytes): what the CUDA runtime reports as the device's total."""
    return cluster.usable_hbm_bytes


def usable_peak_bytes(cluster: ClusterSpec, job: TrainingJob) -> int:
    """The most a rank's predicted peak (``StageMemory.peak_bytes``, which already holds the
    CUDA context and fragmentation) may be: usable HBM less the job's margin for the memory
    model's own error, ``floor(usable_hbm_bytes * (1 - memory_margin))``.

    Usable, not nominal, HBM (``usable_hbm``): what the CUDA runtime reports as the device's
    total is what a process can allocate (79.15 GiB of an H100's 80). The margin is
    ``TrainingJob.memory_margin`` (see there for the measured error it covers)."""
    return math.floor(usable_hbm(cluster) * (1 - job.memory_margin))


def memory_cap(cluster: ClusterSpec, job: TrainingJob) -> float:
    """The bytes a rank's ALLOCATED memory may reach: weights + grads + optimizer + ema +
    activations + buffers, i.e. before the CUDA context and fragmentation are added.

    ``(usable_hbm_bytes * (1 - memory_margin) - cuda_context_bytes) / (1 + fragmentation)``:
    usable HBM (what the CUDA runtime reports as the device's total, not the nominal
    capacity), less the margin kept free for the memory model's own error, less the CUDA
    context (allocated inside usable HBM), divided by the allocator's fragmentation factor
    (fragmentation is a fraction of the allocated bytes). A rank whose allocated bytes stay
    within this has ``peak_bytes <= usable_peak_bytes(cluster, job)`` (up to rounding of each
    bucket to whole bytes). This and ``usable_peak_bytes`` are the one definition of the cap
    for every consumer (the solver's memory constraint, its bounds and explanations,
    ``Estimate.fits``, ``check_plan``, exports, sweeps): none computes it by hand."""
    usable = usable_hbm(cluster) * (1 - job.memory_margin)
    return (usable - job.cuda_context_bytes) / (1 + job.fragmentation)
