"""The caching allocator's replay (``planner.allocator``): its rules one by one, and a real
run's recorded trace, every block of which it must place where PyTorch's allocator did."""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

import pytest

from planner.allocator import (
    LARGE_BUFFER,
    OutOfMemory,
    Replay,
    needed,
    replay,
    requests_of,
    rounded,
    segment_size,
)

MIB = 2**20
TRACES = Path(__file__).resolve().parents[1] / "benchmarks" / "logs" / "h200" / "alloc"
# The allocator's own trace of a real run: a 4-layer Llama 3 8B at micro-batch 8 with full
# recompute, on an H200 (``benchmarks/gpu_alloc_trace.py``): [action, address, bytes, stream]
RUN = TRACES / "llama3-8b-4l_pp1_dp1_ep1_z1_mb8_1f1b_full_r0.json.gz"


@functools.cache
def _events() -> list[list[int | str]]:
    with gzip.open(RUN, "rt") as f:
        events: list[list[int | str]] = json.load(f)["events"]
    return events


def _entries(events: list[list[int | str]]) -> list[dict[str, int | str]]:
    """Trace entries as ``torch.cuda.memory._snapshot()`` holds them."""
    return [dict(zip(("action", "addr", "size", "stream"), e, strict=True)) for e in events]


def test_requests_round_to_512_bytes_and_reserve_by_pool() -> None:
    assert rounded(1) == rounded(512) == 512
    assert rounded(513) == 1024
    assert segment_size(1 * MIB) == 2 * MIB  # the small pool's segment
    assert segment_size(1 * MIB + 512) == LARGE_BUFFER  # a large request under 10 MiB
    assert segment_size(10 * MIB) == 10 * MIB
    assert segment_size(10 * MIB + 1) == 12 * MIB  # rounded up to 2 MiB


def test_a_block_splits_and_merges_back_within_its_segment() -> None:
    r = Replay()
    a = r.malloc(4 * MIB)  # a 20 MiB segment: 4 MiB taken, 16 MiB left cached
    b = r.malloc(8 * MIB)  # from the cached rest, no new segment
    assert r.segments == [LARGE_BUFFER] and b == a + 4 * MIB
    r.free(a)
    r.free(b)  # merges with a and the rest: one free 20 MiB block again
    assert r.malloc(18 * MIB) == a and r.segments == [LARGE_BUFFER]
    # a large pool's rest of 1 MiB or less is not split off: the request takes it all
    s = Replay()
    s.malloc(19 * MIB)
    assert s.allocated == LARGE_BUFFER


def test_the_smallest_cached_block_that_fits_is_taken() -> None:
    r = Replay()
    big, small = r.malloc(64 * MIB), r.malloc(32 * MIB)
    r.malloc(2 * MIB)  # keeps the two from merging with anything
    r.free(big)
    r.free(small)
    assert r.malloc(30 * MIB) == small  # the 32 MiB block, not the 64 MiB one
    assert r.malloc(60 * MIB) == big


def test_a_capacity_returns_free_segments_before_running_out() -> None:
    """Two 100 MiB tensors one after the other: unconstrained, the second's request of 150
    MiB finds the first's segment too small and reserves 250 MiB in all; in 160 MiB the
    allocator returns the free 100 MiB segment and fits; in 140 MiB it cannot."""
    events = [("malloc", 100 * MIB), ("free", 0), ("malloc", 150 * MIB), ("free", 1)]
    assert replay(events).peak_reserved == 250 * MIB
    constrained = replay(events, capacity=160 * MIB)
    assert constrained.released == 1 and constrained.peak_reserved == 150 * MIB
    with pytest.raises(OutOfMemory):
        replay(events, capacity=140 * MIB)
    assert needed(events) == 150 * MIB


def test_a_recorded_training_run_replays_block_for_block() -> None:
    """The allocator's own trace of a real run (4-layer Llama 3 8B, micro-batch 8, full
    recompute, on an H200; ``benchmarks/gpu_alloc_trace.py``): each new segment placed
    where the driver put it, every block lands at the address PyTorch gave it, and the
    reserved peak is the one torch.cuda reported (benchmarks/logs/h200/alloc/peaks.jsonl:
    52,846,133,248 bytes)."""
    events = _events()
    state, where, prev = Replay(), {}, None
    for action, addr, size, _ in events:
        if action == "alloc":
            seg = prev is not None and prev == ("segment_alloc", addr)
            mine = state.malloc(size, addr if seg else None)
            assert mine == addr
            where[addr] = mine
        elif action == "free_completed":
            state.free(where.pop(addr))
        prev = (action, addr)
    assert state.peak_reserved == 52_846_133_248
    assert len(state.segments) == sum(e[0] == "segment_alloc" for e in events)


def test_the_replay_predicts_which_capped_runs_ran_out_of_memory() -> None:
    """The same run made again under caps on what the allocator may reserve
    (``benchmarks/gpu_caps.sh``: 40, 47 and 49 GiB; torch.cuda reported out of memory under
    the first two). Replayed on the first run's requests, it runs out under the same caps and
    runs under the third, which is below the 49.2 GiB it reserved with no cap; the allocated
    peak plus 10% (39.4 GiB) would have let it run in all three."""
    reqs = requests_of(_entries(_events()))
    rows = [json.loads(line) for line in (TRACES.parent / "caps" / "caps.jsonl").open()]
    capped = [r for r in rows if r["layout"] == "pp1 dp1 ep1 z1 mb8 1f1b full"]
    assert [r.get("outcome") == "ran" for r in capped] == [False, False, True]
    for row in capped:
        ran = row.get("outcome") == "ran"
        if ran:
            assert replay(reqs, row["cap_bytes"]).peak_allocated == replay(reqs).peak_allocated
        else:
            with pytest.raises(OutOfMemory):
                replay(reqs, row["cap_bytes"])


def _snapshot(tmp_path: Path, events: list[list[int | str]]) -> Path:
    """A file as torch.cuda.memory._dump_snapshot writes it, holding ``events``."""
    import pickle

    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [_entries(events)]}))
    return path


def test_planner_allocator_says_where_a_recorded_run_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recorded run as a user's snapshot: out of memory in 40 GiB (exit 3), runs in 49
    GiB; a capacity that is not a positive number, a trace that starts after the run did,
    and a file that names a class, are refused in one line (exit 2)."""
    from planner.cli import main

    events = _events()
    snap = _snapshot(tmp_path, events)
    assert main(["allocator", str(snap), "--capacity", "40", "49"]) == 3
    out = capsys.readouterr().out
    assert "in 40.00 GiB: out of memory" in out and "in 49.00 GiB: runs" in out
    assert main(["allocator", str(snap), "--capacity", "49", "--json"]) == 0
    # torch.cuda's allocated peak for that run (benchmarks/logs/h200/alloc/peaks.jsonl)
    assert json.loads(capsys.readouterr().out)["allocated_peak_bytes"] == 38_435_382_784
    for bad_cap in ("nan", "inf", "-5", "0"):
        assert main(["allocator", str(snap), "--capacity", bad_cap]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--capacity=" in err and "positive" in err
    late = _snapshot(tmp_path, events[len(events) // 2 :])
    assert main(["allocator", str(late)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "never allocated" in err
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"cos\nsystem\n(S'true'\ntR.")  # a pickle that would run a command
    assert main(["allocator", str(bad)]) == 2
    assert "os.system" in capsys.readouterr().err
