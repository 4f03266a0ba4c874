"""One process per rank, started the way that costs least: forked from a server process that
has imported PyTorch and the worker's module once (``forkserver``), where the platform has
it, rather than each rank importing them afresh (``spawn``: about 4 s a process on a small
CPU, more than a small run's training). The server holds no thread pool, CUDA context or
process group, so each forked rank starts as clean as a spawned one.

The rendezvous port is chosen free just before the start; if another program takes it
before the ranks bind it, the start is tried again on a new port (three tries)."""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Callable
from typing import Any

from torch.multiprocessing.spawn import ProcessExitedException, start_processes

TRIES = 3
# What a rank may import late (ZeRO's optimizer, FSDP2, the pipeline schedules, functional
# collectives): imported by the server once, not by every rank.
PRELOAD = (
    "torch.distributed.optim",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed._functional_collectives",
    "torch.utils.checkpoint",
)


def free_port() -> int:
    """A TCP port on the loopback interface that no program holds at this moment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_method() -> str:
    """``forkserver`` where the platform offers it, else ``spawn``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def run_ranks(worker: Callable[..., None], args: Callable[[int], tuple[Any, ...]], n: int) -> None:
    """Run ``worker(rank, *args(port))`` for ``rank`` in ``range(n)`` and wait for all of
    them; a rank's failure raises here with its traceback."""
    method = start_method()
    if method == "forkserver":  # read when the server starts: the first call of a process
        multiprocessing.set_forkserver_preload([worker.__module__, *PRELOAD])
    for attempt in range(TRIES):
        try:
            start_processes(worker, args=args(free_port()), nprocs=n, start_method=method)
            return
        except ProcessExitedException:  # killed, e.g. by a port taken before it was bound
            if attempt == TRIES - 1:
                raise
