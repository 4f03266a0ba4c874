"""The caching allocator's recorded traces of real training runs, replayed by
``planner.allocator``: where it put every block, what it reserved, and what the runs needed.

``benchmarks/gpu_alloc_trace.py`` recorded, on one H200, every request, release and segment
of the allocator in each rank's process of ``planner validate``'s one-GPU layouts (a 4-layer
Llama 3 8B at micro-batch 1-8 under three recompute choices, a 2-layer Mixtral 8x7B at 1 and
2), beside the allocated and reserved peaks ``torch.cuda`` reported
(``benchmarks/logs/h200/alloc``). For each run this prints:

- the replay on the recorded requests, each new segment placed where the driver put it: how
  many blocks land at another address than the allocator's, and the reserved peak against
  the one reported;
- the same with the replay's own segment addresses (what a replay of requests written
  without a GPU can do): its reserved peak;
- what the run needs: the smallest memory it runs in, found by replaying it in less and
  less (a reservation that does not fit returns the wholly free cached segments first, as
  the allocator does), over its allocated peak; and the reserved peak over the allocated;
- the runs made again under caps on what the allocator may reserve
  (``benchmarks/gpu_caps.sh``, ``benchmarks/logs/h200/caps/caps.jsonl``): whether each ran
  or ran out of memory, against the replay's prediction for that cap and against two rules
  of thumb, the allocated peak plus 10% (the memory model's default fragmentation) and the
  unconstrained reserved peak;
- the same layouts' requests written without a GPU (``planner.run.requests``: the runtime's
  own code on PyTorch's meta device, every storage followed from its operator to its
  release), replayed: their allocated and reserved peaks against those measured, each row's
  error, and the capped runs predicted from them.

Run: ``.venv/bin/python benchmarks/allocator_replay.py`` (no GPU).
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from planner.allocator import Event, OutOfMemory, Replay, needed, replay, requests_of
from planner.run.validate import layout_name

TRACES = Path(__file__).resolve().parent / "logs" / "h200" / "alloc"


def load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        data: dict[str, Any] = json.load(f)
    return data


def exact(events: list[list[Any]]) -> tuple[Replay, int]:
    """Replay with every new segment where the trace's was; the blocks placed elsewhere."""
    state, where, moved, prev = Replay(), {}, 0, None
    for action, addr, size, _ in events:
        if action == "alloc":
            seg = prev is not None and prev[0] == "segment_alloc" and prev[1] == addr
            mine = state.malloc(size, addr if seg else None)
            moved += mine != addr
            where[addr] = mine
        elif action == "free_completed":
            state.free(where.pop(addr))
        prev = (action, addr)
    return state, moved


def requests(events: list[list[Any]]) -> list[Event]:
    """The trace's requests and releases as ``planner.allocator.replay`` reads them."""
    keys = ("action", "addr", "size", "stream")
    return requests_of([dict(zip(keys, e, strict=True)) for e in events])


def caps(peaks: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Each capped run: what it did, what the replay and the two rules predicted."""
    path = TRACES.parent / "caps" / "caps.jsonl"
    gib = 2**30
    print(
        f"\nunder a cap on what the allocator may reserve ({path.relative_to(TRACES.parents[2])})"
    )
    print(
        f"{'run':44s} {'cap':>7s} {'measured':>8s} {'replay':>7s} {'alloc+10%':>9s} "
        f"{'reserved':>8s}"
    )
    right = {"replay": 0, "alloc+10%": 0, "reserved": 0}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        name = f"{row['model']}_{row['layout'].replace(' ', '_')}_r0.json.gz"
        reqs = requests(load(TRACES / name)["events"])
        cap = row["cap_bytes"]
        try:
            replay(reqs, cap)
            replayed = "runs"
        except OutOfMemory:
            replayed = "OOM"
        free = peaks[(row["model"], row["layout"])]
        rules = {
            "replay": replayed,
            "alloc+10%": "runs" if free["allocated_peak_bytes"] * 1.10 <= cap else "OOM",
            "reserved": "runs" if free["reserved_peak_bytes"] <= cap else "OOM",
        }
        measured = "runs" if row.get("outcome") == "ran" else "OOM"
        for k, v in rules.items():
            right[k] += v == measured
        print(
            f"{row['model'] + ' ' + row['layout']:44s} {cap / gib:6.1f}G {measured:>8s} "
            f"{rules['replay']:>7s} {rules['alloc+10%']:>9s} {rules['reserved']:>8s}"
        )
    print("  right: " + ", ".join(f"{k} {v} of {len(rows)}" for k, v in right.items()))


def written(peaks: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Each one-GPU layout's requests written on the meta device, replayed, against its
    measured peaks; then the capped runs predicted from them."""
    from planner.run.requests import requests as written_requests
    from planner.run.validate import describe, one_gpu_set

    gib = 2**30
    print(
        "\nrequests written without a GPU (planner.run.requests), replayed, against the "
        "measured peaks"
    )
    print(
        f"{'run':44s} {'allocated':>9s} {'measured':>9s} {'error':>7s} {'reserved':>9s} "
        f"{'measured':>9s} {'error':>7s}"
    )
    errors: dict[str, list[tuple[float, float]]] = {}
    streams: dict[tuple[str, str], list[Event]] = {}
    for moe in (False, True):
        job, cases = one_gpu_set(moe=moe)
        for model, layout in cases:
            name = layout_name(describe(layout))
            events = written_requests(model, job, layout)
            streams[(model.name, name)] = events
            state = replay(events)
            row = peaks[(model.name, name)]
            alloc, reserved = row["allocated_peak_bytes"], row["reserved_peak_bytes"]
            e_alloc = state.peak_allocated / alloc - 1
            e_resv = state.peak_reserved / reserved - 1
            errors.setdefault("MoE" if moe else "dense", []).append((e_alloc, e_resv))
            print(
                f"{model.name + ' ' + name:44s} {state.peak_allocated / gib:8.3f}G "
                f"{alloc / gib:8.3f}G {e_alloc:+7.2%} {state.peak_reserved / gib:8.3f}G "
                f"{reserved / gib:8.3f}G {e_resv:+7.2%}"
            )
    for kind, pairs in errors.items():
        a = [abs(x) for x, _ in pairs]
        r = [abs(y) for _, y in pairs]
        print(
            f"  {kind}: {len(pairs)} layouts; allocated mean |error| {statistics.mean(a):.2%} "
            f"(max {max(a):.2%}); reserved mean |error| {statistics.mean(r):.2%} "
            f"(max {max(r):.2%}), within 5%: {sum(x <= 0.05 for x in r)} of {len(r)}"
        )
    path = TRACES.parent / "caps" / "caps.jsonl"
    right = 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        try:
            replay(streams[(row["model"], row["layout"])], row["cap_bytes"])
            predicted = "runs"
        except OutOfMemory:
            predicted = "OOM"
        right += predicted == ("runs" if row.get("outcome") == "ran" else "OOM")
    print(f"  the capped runs predicted from the written requests: {right} of {len(rows)} right")


def main() -> int:
    peaks = {}
    for line in (TRACES / "peaks.jsonl").read_text().splitlines():
        row = json.loads(line)
        peaks[(row["model"], row["layout"])] = row
    gib = 2**30
    print(
        f"{'run':44s} {'reported':>9s} {'replayed':>9s} {'moved':>5s} {'own':>9s} "
        f"{'allocated':>9s} {'needed':>9s} {'need/alloc':>10s} {'resv/alloc':>10s}"
    )
    over_alloc, over_need = [], []
    for path in sorted(TRACES.glob("*.json.gz")):
        trace = load(path)
        name = layout_name(trace["layout"])
        row = peaks[(trace["model"], name)]
        state, moved = exact(trace["events"])
        reqs = requests(trace["events"])
        own = replay(reqs)
        need = needed(reqs)
        alloc = row["allocated_peak_bytes"]
        reserved = row["reserved_peak_bytes"]
        over_alloc.append(reserved / alloc - 1)
        over_need.append(need / alloc - 1)
        print(
            f"{trace['model'] + ' ' + name:44s} {reserved / gib:8.3f}G "
            f"{state.peak_reserved / gib:8.3f}G {moved:5d} {own.peak_reserved / gib:8.3f}G "
            f"{alloc / gib:8.3f}G {need / gib:8.3f}G "
            f"{need / alloc - 1:+10.1%} {reserved / alloc - 1:+10.1%}"
        )
    caps(peaks)
    print(
        f"\nover the allocated peak, {len(over_need)} runs: reserved median "
        f"{statistics.median(over_alloc):+.1%}, max {max(over_alloc):+.1%}; needed median "
        f"{statistics.median(over_need):+.1%}, max {max(over_need):+.1%}"
    )
    written(peaks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
