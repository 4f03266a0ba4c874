"""Where real runs run: ``Device`` says, once, what differs between the CPU and a CUDA GPU.

Everything else in ``planner.run`` is written against it, so the same code measures a CPU
(gloo between worker processes, FP32, wall-clock timers, the live tensor bytes that
``planner.run.track.Tracker`` follows) and one or several CUDA GPUs (NCCL, BF16, CUDA event
timers, the caching allocator's own peak counters). A worker process on CUDA binds to
``cuda:<local_rank>``.

Memory on CUDA is the caching allocator's: ``max_memory_allocated`` (bytes in live tensors,
rounded up to the allocator's 512-byte blocks: ``kMinBlockSize`` in PyTorch's
c10/cuda/CUDACachingAllocator.cpp) and ``max_memory_reserved`` (what the allocator
holds from the driver: allocated plus its cached free blocks, i.e. the fragmentation), both
since ``reset_peak_memory_stats``. On CPU there is no caching allocator between tensors and
the system: the allocated figure is the tracker's live tensor bytes, and reserved is not
measured (``None``).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from planner.errors import PlannerError

KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Device:
    """A CPU, or CUDA GPU number ``index`` (a worker's local rank once bound)."""

    kind: Literal["cpu", "cuda"] = "cpu"
    index: int = 0

    @classmethod
    def of(cls, kind: str) -> Device:
        """The device ``kind`` names; a one-line ``PlannerError`` if this machine has none."""
        if kind not in KINDS:
            raise PlannerError(f"--device={kind!r}: must be one of {', '.join(KINDS)}")
        if kind == "cuda" and not torch.cuda.is_available():
            raise PlannerError(
                "--device=cuda: torch.cuda.is_available() is False here (no CUDA GPU, or a "
                "CPU-only PyTorch build); use --device cpu"
            )
        return cls("cuda") if kind == "cuda" else cls("cpu")

    # -- what differs --------------------------------------------------------------------
    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def backend(self) -> str:
        """The process-group backend: NCCL between GPUs, gloo between CPU processes."""
        return "nccl" if self.is_cuda else "gloo"

    @property
    def dtype_name(self) -> str:
        """The measurements' dtype: BF16 on a GPU (its tensor cores' training type); FP32 on
        a CPU (no BF16 matrix units on most; BF16 there runs slower than FP32)."""
        return "bf16" if self.is_cuda else "fp32"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.is_cuda else torch.float32

    @property
    def torch_device(self) -> torch.device:
        return torch.device(f"cuda:{self.index}") if self.is_cuda else torch.device("cpu")

    def count(self) -> int:
        """GPUs visible (CUDA), or cores (CPU): how many worker processes can each have one."""
        return torch.cuda.device_count() if self.is_cuda else os.cpu_count() or 1

    def name(self) -> str:
        if self.is_cuda:
            return str(torch.cuda.get_device_name(self.index))
        return f"{platform.machine()} CPU, {os.cpu_count()} cores"

    def sm_count(self) -> int | None:
        """Streaming multiprocessors of the GPU (None on CPU: no tiles, no waves)."""
        if not self.is_cuda:
            return None
        return int(torch.cuda.get_device_properties(self.index).multi_processor_count)

    def total_memory(self) -> int:
        """Bytes a process can allocate: the GPU's total as the CUDA runtime reports it, or
        the host's RAM."""
        if self.is_cuda:
            return int(torch.cuda.get_device_properties(self.index).total_memory)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def bind(self, local_rank: int) -> Device:
        """This worker's device: ``cuda:<local_rank>`` (made current), or the CPU."""
        if not self.is_cuda:
            return self
        if local_rank >= torch.cuda.device_count():
            raise PlannerError(
                f"local rank {local_rank}: --device=cuda needs a GPU per worker process; "
                f"{torch.cuda.device_count()} visible"
            )
        torch.cuda.set_device(local_rank)
        return replace(self, index=local_rank)

    def check_workers(self, workers: int, what: str) -> None:
        """One GPU per worker process on CUDA (NCCL refuses two ranks on one GPU)."""
        if self.is_cuda and workers > torch.cuda.device_count():
            raise PlannerError(
                f"{what}={workers}: --device=cuda needs one GPU per rank; "
                f"{torch.cuda.device_count()} visible"
            )

    # -- time ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.index)

    def timer(self) -> Timer:
        """A stopwatch: ``start()`` then ``stop()`` gives the seconds between (on CUDA, the
        GPU's time between two events on the current stream)."""
        return _CudaTimer() if self.is_cuda else Timer()

    def median_time(
        self, fn: Callable[[], object], *, repeat: int, inner: int = 1, warmup: int = 2
    ) -> float:
        """Median seconds of one call of ``fn`` (``inner`` calls per timing, after
        ``warmup`` calls)."""
        for _ in range(warmup):
            fn()
        self.synchronize()
        timer, times = self.timer(), []
        for _ in range(repeat):
            timer.start()
            for _ in range(inner):
                fn()
            times.append(timer.stop() / inner)
        return statistics.median(times)

    def median_time_after(
        self, setup: Callable[[], Any], fn: Callable[[Any], object], *, repeat: int
    ) -> float:
        """Median seconds of ``fn(setup())``, the timer started after ``setup`` (a forward,
        say, whose backward ``fn`` runs), after two untimed rounds."""
        for _ in range(2):
            fn(setup())
        timer, times = self.timer(), []
        for _ in range(repeat):
            arg = setup()
            self.synchronize()
            timer.start()
            fn(arg)
            times.append(timer.stop())
        return statistics.median(times)

    # -- memory --------------------------------------------------------------------------
    def memory(self, tracker: Any = None) -> MemoryWatch:
        """Memory readings over a ``with`` block (see ``MemoryWatch``); on CPU they come
        from ``tracker`` (a ``planner.run.track.Tracker`` the caller runs) or from one the
        watch runs itself."""
        return MemoryWatch(self, tracker)


class Timer:
    """Wall-clock stopwatch (``time.perf_counter``)."""

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        return time.perf_counter() - self._t0


class _CudaTimer(Timer):
    """GPU time between two CUDA events; ``stop`` waits for the second."""

    def start(self) -> None:
        self._a = torch.cuda.Event(enable_timing=True)
        self._b = torch.cuda.Event(enable_timing=True)
        self._a.record()

    def stop(self) -> float:
        self._b.record()
        self._b.synchronize()
        return float(self._a.elapsed_time(self._b)) / 1e3  # elapsed_time is in ms


class MemoryWatch:
    """Allocated (and on CUDA reserved) bytes over a ``with`` block.

    ``base`` is the allocated level when the block starts; ``allocated()`` the level now and
    ``peak_allocated()`` the highest since the start, both in the same terms as ``base``.
    On CUDA these are whole-process levels from the caching allocator; on CPU, the live
    bytes of the storages the tracker follows (those made inside the block, and any the
    caller claims), so ``base`` is 0 with a tracker of the watch's own."""

    def __init__(self, device: Device, tracker: Any = None) -> None:
        self.device = device
        self._own = tracker is None and not device.is_cuda
        if self._own:
            from planner.run.track import Tracker

            tracker = Tracker()
        self.tracker = tracker
        self.base = 0

    def __enter__(self) -> MemoryWatch:
        if self.device.is_cuda:
            torch.cuda.synchronize(self.device.index)
            torch.cuda.reset_peak_memory_stats(self.device.index)
            self.base = int(torch.cuda.memory_allocated(self.device.index))
        elif self._own:
            self.tracker.__enter__()
        else:
            self.tracker.reset_peak()
            self.base = int(self.tracker.total)
        return self

    def __exit__(self, *args: Any) -> None:
        if self.device.is_cuda:
            torch.cuda.synchronize(self.device.index)
        elif self._own:
            self.tracker.__exit__(*args)

    def include(self, *tensors: Any) -> None:
        """Tensors that existed before the block (nested lists allowed): part of ``base``.
        On CUDA the allocator counts them already; on CPU the tracker would otherwise take
        the first operator that touches one (a view of a weight) for its allocation."""
        if not self.device.is_cuda:
            self.tracker.claim("other", *tensors)
            self.tracker.reset_peak()
            self.base = int(self.tracker.total)

    def allocated(self) -> int:
        if self.device.is_cuda:
            torch.cuda.synchronize(self.device.index)
            return int(torch.cuda.memory_allocated(self.device.index))
        return int(self.tracker.total)

    def peak_allocated(self) -> int:
        if self.device.is_cuda:
            torch.cuda.synchronize(self.device.index)
            return int(torch.cuda.max_memory_allocated(self.device.index))
        return int(self.tracker.peak)

    def peak_reserved(self) -> int | None:
        """The caching allocator's reserved peak on CUDA; None (not measured) on CPU."""
        if self.device.is_cuda:
            torch.cuda.synchronize(self.device.index)
            return int(torch.cuda.max_memory_reserved(self.device.index))
        return None
