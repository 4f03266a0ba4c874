"""PyTorch's CUDA caching allocator, replayed on a sequence of requests and releases.

What ``torch.cuda.max_memory_reserved`` reports is not the allocated peak times a constant:
it is whatever segments the allocator had to ask the driver for, and that follows from the
order and sizes of the requests. This replays the allocator's policy under its default
setting (``PYTORCH_CUDA_ALLOC_CONF`` unset), from ``c10/cuda/CUDACachingAllocator.cpp`` and
the constants of ``c10/core/AllocatorConfig.h``:

- a request is rounded up to a multiple of 512 bytes;
- one of at most 1 MiB is served from the small pool, any larger from the large pool;
- the pool's smallest cached free block that fits is taken (ties: the lowest address);
  with none, a segment is reserved: 2 MiB for a small request, 20 MiB for a large one
  under 10 MiB, else the request rounded up to 2 MiB;
- the block is split when what is left is at least 512 bytes (small pool) or more than
  1 MiB (large pool); the request takes its start, the rest returns to the pool;
- a released block merges with the free blocks beside it in its segment.

With a ``capacity`` (the bytes the driver can give), a reservation that would exceed it first
returns every cached segment that is wholly free to the driver and tries again (the
allocator's ``release_cached_blocks``); if it still does not fit, the run is out of memory
(``OutOfMemory``). So a run needs less than the reserved peak it reports where nothing
constrains it: what it needs is the smallest capacity it runs in (``needed``). Each stream
has its own pools, as the allocator keeps them (a block is reused only by its own stream).
No ``max_split_size_mb`` (under which the allocator first frees only as many cached blocks
as the request needs), no ``expandable_segments`` (under which reserved memory stays within
a few percent of the allocated peak, ``benchmarks/RESULTS.md``).
``benchmarks/allocator_replay.py`` replays the allocator's own recorded traces of real
training runs: it finds every block where the allocator put it, and the reserved peak they
reported. ``from_snapshot`` reads the trace a user records with
``torch.cuda.memory._record_memory_history`` and saves with ``_dump_snapshot``
(``planner allocator``)."""

from __future__ import annotations

import bisect
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import PlannerError

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool's segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a segment for a large request under kMinLargeAlloc
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge


def rounded(size: int) -> int:
    """A request's size as the allocator books it."""
    return MIN_BLOCK if size < MIN_BLOCK else -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """The segment reserved for a (rounded) request no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class OutOfMemory(Exception):
    """A reservation did not fit in the capacity, even with the wholly free segments
    returned."""


@dataclass
class _Block:
    addr: int
    size: int
    small: bool
    stream: int = 0
    free: bool = True
    prev: _Block | None = field(default=None, repr=False)
    next: _Block | None = field(default=None, repr=False)


@dataclass
class Replay:
    """The allocator's state after a sequence of ``malloc`` and ``free``: the bytes
    allocated and reserved now and at their peaks, and each segment reserved."""

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    segments: list[int] = field(default_factory=list)
    _pools: dict[tuple[int, bool], list[tuple[int, int]]] = field(
        default_factory=dict, repr=False
    )  # by (stream, small pool): sorted (size, addr) of free blocks
    _blocks: dict[int, _Block] = field(default_factory=dict, repr=False)  # by address
    _top: int = 0  # where the next segment starts (addresses are this replay's own)
    capacity: int | None = None  # bytes the driver can give; None: no limit
    released: int = 0  # segments returned to the driver to make room

    def malloc(self, size: int, key: int | None = None, stream: int = 0) -> int:
        """Serve a request of ``size`` bytes on ``stream``; its block's address (``key``: an
        address to give a new segment instead of this replay's own)."""
        size = rounded(size)
        small = size <= SMALL_SIZE
        pool = self._pools.setdefault((stream, small), [])
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            _, addr = pool.pop(i)
            block = self._blocks[addr]
        else:
            seg = segment_size(size)
            if self.capacity is not None and self.reserved + seg > self.capacity:
                self._release_free_segments()
                if self.reserved + seg > self.capacity:
                    raise OutOfMemory(
                        f"{seg} bytes more with {self.reserved} reserved, "
                        f"{self.allocated} allocated, of {self.capacity}"
                    )
            addr = self._top if key is None else key
            self._top = max(self._top, addr) + seg
            block = _Block(addr, seg, small, stream)
            self._blocks[addr] = block
            self.segments.append(seg)
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = _Block(block.addr + size, rest, small, stream, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._blocks[tail.addr] = tail
            bisect.insort(pool, (tail.size, tail.addr))
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.addr

    def _release_free_segments(self) -> None:
        """Return every segment that is one free block to the driver."""
        for pool in self._pools.values():
            keep = []
            for size, addr in pool:
                block = self._blocks[addr]
                if block.prev is None and block.next is None:
                    del self._blocks[addr]
                    self.reserved -= size
                    self.released += 1
                else:
                    keep.append((size, addr))
            pool[:] = keep

    def free(self, addr: int) -> None:
        """Release the block at ``addr``; it merges with free neighbours in its segment."""
        block = self._blocks[addr]
        if block.free:
            raise ValueError(f"free of address {addr}: not allocated")
        self.allocated -= block.size
        block.free = True
        pool = self._pools[(block.stream, block.small)]
        for other in (block.prev, block.next):
            if other is not None and other.free:
                pool.pop(bisect.bisect_left(pool, (other.size, other.addr)))
                first, second = (other, block) if other is block.prev else (block, other)
                first.size += second.size
                first.next = second.next
                if second.next is not None:
                    second.next.prev = first
                del self._blocks[second.addr]
                block = first
        bisect.insort(pool, (block.size, block.addr))


Event = tuple[str, int] | tuple[str, int, int]


def replay(events: Iterable[Event], capacity: int | None = None) -> Replay:
    """Replay ``("malloc", bytes[, stream])`` and ``("free", index)`` events, ``index``
    counting the mallocs from 0, in ``capacity`` bytes (None: no limit); ``OutOfMemory`` if
    they do not fit."""
    state = Replay(capacity=capacity)
    addrs: list[int] = []
    for event in events:
        if event[0] == "malloc":
            addrs.append(state.malloc(event[1], stream=event[2] if len(event) > 2 else 0))
        else:
            state.free(addrs[event[1]])
    return state


def needed(events: Sequence[Event], *, step: int = ROUND_LARGE) -> int:
    """The smallest capacity, to ``step`` bytes, in which ``events`` run without running
    out of memory: at least their allocated peak, at most their unconstrained reserved
    peak."""
    free_run = replay(events)
    low, high = free_run.peak_allocated // step, -(-free_run.peak_reserved // step)
    while low < high:  # the capacity high * step fits; find the least that does
        mid = (low + high) // 2
        try:
            replay(events, mid * step)
        except OutOfMemory:
            low = mid + 1
        else:
            high = mid
    return high * step


class _Plain(pickle.Unpickler):
    """Builtin containers and numbers only: a snapshot holds nothing else, and a file that
    names a class is refused rather than run."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a snapshot does not")


def requests_of(trace: Sequence[dict[str, Any]], where: str = "the trace") -> list[Event]:
    """A device's trace entries (``torch.cuda.memory._snapshot()["device_traces"][i]``) as
    ``replay`` events: each ``alloc`` a malloc on its stream, each ``free_completed`` its
    release (the block is reusable then, not at ``free_requested``). A trace that releases
    a block it never allocated did not start before the run's first allocation (or its
    ``max_entries`` dropped the start): refused, since its earlier state is unknown; so is
    one with ``segment_map`` entries (``expandable_segments``, not replayed)."""
    out: list[Event] = []
    index: dict[int, int] = {}
    made = 0
    for entry in trace:
        action = entry.get("action")
        if action in ("segment_map", "segment_unmap"):
            raise PlannerError(
                f"{where}: expandable segments ({action}); only the default allocator "
                "(PYTORCH_CUDA_ALLOC_CONF without expandable_segments) is replayed"
            )
        if action == "alloc":
            index[entry["addr"]] = made
            made += 1
            out.append(("malloc", int(entry["size"]), int(entry.get("stream", 0))))
        elif action == "free_completed":
            if entry["addr"] not in index:
                raise PlannerError(
                    f"{where}: frees a block it never allocated: the recording started after "
                    "the run's first allocation, or max_entries dropped its start; record "
                    "with torch.cuda.memory._record_memory_history(max_entries=N) before "
                    "any CUDA tensor is made, N above the run's allocations and releases"
                )
            out.append(("free", index.pop(entry["addr"])))
    if not made:
        raise PlannerError(f"{where}: no allocation recorded")
    return out


def from_snapshot(path: str | Path, device: int | None = None) -> tuple[int, list[Event]]:
    """The device and its ``replay`` events from a snapshot that
    ``torch.cuda.memory._dump_snapshot`` wrote (a pickle of ``_snapshot()``); the device
    with a trace if ``device`` is None and only one has one."""
    try:
        with open(path, "rb") as f:
            snap = _Plain(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
        raise PlannerError(
            f"{path}: not a memory snapshot (torch.cuda.memory._dump_snapshot): {exc}"
        ) from None
    traces = snap.get("device_traces") if isinstance(snap, dict) else None
    if not isinstance(traces, list):
        raise PlannerError(f"{path}: a snapshot holds 'device_traces'; this has none")
    recorded = [i for i, t in enumerate(traces) if t]
    if device is None:
        if len(recorded) != 1:
            raise PlannerError(
                f"{path}: traces on devices {recorded or 'none'}; name one with --device"
            )
        device = recorded[0]
    if not 0 <= device < len(traces) or not traces[device]:
        raise PlannerError(f"--device={device}: {path} has traces on devices {recorded}")
    return device, requests_of(traces[device], str(path))
