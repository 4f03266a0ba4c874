"""Pipeline schedules: how many micro-batches' activations each rank holds at its peak.

The memory model needs, for each pipeline rank, the number of micro-batches whose saved
activations are resident at the moment of the rank's peak, per model chunk the rank holds.
Sources of each closed form are given with it.
"""

from __future__ import annotations

from planner.layout import Layout


def in_flight(layout: Layout, rank: int, num_microbatches: int) -> dict[int, float]:
    """Micro-batches resident per stage (chunk index -> count) at ``rank``'s peak."""
    p, m, v = layout.pp, num_microbatches, layout.virtual_stages
    chunks = layout.chunks_of_rank(rank)
    schedule = layout.schedule
    if schedule == "gpipe":
        # All forwards before any backward (Huang et al. 2019).
        return {c: float(m) for c in chunks}
    if schedule in ("1f1b", "zb-h1"):
        # 1F1B (Narayanan et al. SC'21, section 2.2): rank r runs p - r warm-up forwards
        # before its first backward. ZB-H1 (Qi et al. ICLR'24, section 3.1) defers weight
        # gradients but keeps 1F1B's peak of p in-flight micro-batches on the first rank.
        return {chunks[0]: float(min(p - rank, m))}
    if schedule == "interleaved":
        return _interleaved(p, v, m, rank, chunks)
    # DualPipe / DualPipeV: DeepSeek-V3 report Table 2 gives PP+1 micro-batches of
    # activations per rank (1F1B: PP). Rank r is at position r of one direction (or of the
    # V's descending leg), holding pp - r like 1F1B, and at position pp-1-r of the other
    # (the ascending leg), holding r + 1: together pp + 1. DualPipe feeds each direction
    # half of the micro-batches (the odd one out goes to the first direction).
    first, second = ((m + 1) // 2, m // 2) if schedule == "dualpipe" else (m, m)
    return {chunks[0]: float(min(p - rank, first)), chunks[1]: float(min(rank + 1, second))}


def _interleaved(p: int, v: int, m: int, rank: int, chunks: list[int]) -> dict[int, float]:
    """Megatron-LM's interleaved 1F1B: rank r runs (p - r - 1) * 2 + (v - 1) * p warm-up
    forwards, then one more before its first backward; forwards walk chunk 0 for p
    micro-batches, then chunk 1, ... (Narayanan et al. SC'21 section 2.2, and Megatron-LM's
    ``get_pp_rank_microbatches``). Count the chunks of those forwards."""
    warmup = min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v)
    counts = dict.fromkeys(chunks, 0.0)
    for j in range(warmup):
        counts[chunks[(j // p) % v]] += 1
    return counts
