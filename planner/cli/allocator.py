"""``planner allocator``: a memory snapshot replayed through PyTorch's caching allocator: the
run's allocated and reserved peaks, the least memory it runs in, and whether it runs in
memories the user names."""

from __future__ import annotations

import argparse
import json
import math

from planner.allocator import OutOfMemory, from_snapshot, needed, replay
from planner.errors import PlannerError

GIB = 2**30
ASSUMES = (
    "Replays PyTorch's caching allocator under its default settings (no expandable_segments, "
    "no max_split_size_mb) on the recorded requests; what it does not hold is not counted: "
    "the CUDA context, NCCL's own buffers, and memory other processes take."
)


def allocator_command(args: argparse.Namespace) -> bool:
    """Replay the snapshot; False (exit 3) when it runs out in a ``--capacity`` given."""
    for cap in args.capacity or []:
        if not (math.isfinite(cap) and cap > 0):
            raise PlannerError(f"--capacity={cap:g}: must be a positive number of GiB")
    device, events = from_snapshot(args.snapshot, args.device)
    free = replay(events)
    need = needed(events)
    requests = sum(e[0] == "malloc" for e in events)
    verdicts = {}
    for cap in args.capacity or []:
        try:
            replay(events, round(cap * GIB))
            verdicts[cap] = "runs"
        except OutOfMemory:
            verdicts[cap] = "out of memory"
    if args.json:
        print(
            json.dumps(
                {
                    "snapshot": str(args.snapshot),
                    "device": device,
                    "requests": requests,
                    "allocated_peak_bytes": free.peak_allocated,
                    "reserved_peak_bytes": free.peak_reserved,
                    "needed_bytes": need,
                    "capacities_gib": verdicts,
                    "assumes": ASSUMES,
                },
                indent=2,
            )
        )
    else:
        print(f"{args.snapshot}, device {device}: {requests:,} requests")
        print(
            f"  allocated peak {free.peak_allocated / GIB:9.2f} GiB  (live tensors at their "
            "highest: torch.cuda.max_memory_allocated)"
        )
        print(
            f"  reserved peak  {free.peak_reserved / GIB:9.2f} GiB  (the segments it holds with "
            "nothing in its way: torch.cuda.max_memory_reserved)"
        )
        print(
            f"  needs          {need / GIB:9.2f} GiB  (the least its reservations fit in, to "
            "2 MiB: cached segments wholly free are returned before a reservation fails)"
        )
        for cap, verdict in verdicts.items():
            print(f"  in {cap:.2f} GiB: {verdict}")
        print(ASSUMES)
    return all(v == "runs" for v in verdicts.values())
