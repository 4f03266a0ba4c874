"""In-flight micro-batches per rank, against the schedules' sources.

- 1F1B: Narayanan et al. SC'21 section 2.2.1: rank r (0-based) of p runs p - r warm-up
  forwards, so the first rank holds p micro-batches' activations and the last one 1.
- Interleaved 1F1B (same paper, section 2.2.2; Megatron-LM's schedule): rank r runs
  (p - r - 1) * 2 + (v - 1) * p warm-up forward chunks before the first backward; the first
  rank's peak is p * (1 + (p - 1) / (p * v)) stage-activations, as the paper states.
- DualPipe: DeepSeek-V3 report Table 2: PP + 1 micro-batches of activations and 2x parameters.
"""

from __future__ import annotations

import pytest

import planner
from planner.schedules import in_flight

LLAMA = planner.load_model("llama3-70b")  # 80 layers


@pytest.mark.parametrize("p", [2, 4, 8])
def test_one_f_one_b(p: int) -> None:
    layout = planner.Layout.uniform(LLAMA, pp=p)
    counts = [sum(in_flight(layout, r, 64).values()) for r in range(p)]
    assert counts == [p - r for r in range(p)]
    assert sum(in_flight(layout, 0, 2).values()) == min(p, 2)  # fewer micro-batches than p


@pytest.mark.parametrize(("p", "v"), [(4, 2), (8, 2), (4, 4)])
def test_interleaved_first_rank(p: int, v: int) -> None:
    layout = planner.Layout.uniform(LLAMA, pp=p, schedule="interleaved", virtual_stages=v)
    held_chunks = sum(in_flight(layout, 0, 64).values())
    # Each chunk is 1/v of the rank's layers: in stage-activation units the paper's figure.
    assert held_chunks / v == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_dualpipe_holds_pp_plus_one() -> None:
    """DeepSeek-V3 report Table 2: PP + 1 micro-batches of a stage's activations per rank."""
    p = 8
    layout = planner.Layout.uniform(LLAMA, pp=p, schedule="dualpipe")
    for r in range(p):
        assert sum(in_flight(layout, r, 64).values()) == p + 1


def test_dualpipev_holds_two_pp_plus_one_chunks() -> None:
    """DualPipeV puts 2pp stages (chunks of half a rank's share) on pp ranks; the reference
    order (deepseek-ai/DualPipe, steps 1-2 and the first forward of step 4) keeps 2pp + 1
    chunk activations, the README's "PP+1" with PP = 2pp stages counted in chunks."""
    p = 8
    layout = planner.Layout.uniform(LLAMA, pp=p, schedule="dualpipev")
    for r in range(p):
        assert sum(in_flight(layout, r, 64).values()) == 2 * p + 1


def test_dualpipe_stores_parameters_twice() -> None:
    cluster = planner.load_cluster("h100", gpus=8)
    job = planner.TrainingJob(seq_len=4096, global_batch=64)
    one = planner.Layout.uniform(LLAMA, pp=8, schedule="1f1b")
    two = planner.Layout.uniform(LLAMA, pp=8, schedule="dualpipe")
    p1 = sum(r.params for r in planner.evaluate(LLAMA, cluster, job, one).memory)
    p2 = sum(r.params for r in planner.evaluate(LLAMA, cluster, job, two).memory)
    assert p2 == 2 * p1 == 2 * LLAMA.num_params()


def test_dualpipe_with_fewer_micro_batches_than_ranks() -> None:
    """Each direction gets half of the micro-batches, so a rank never holds more than that;
    a single micro-batch still leaves its activations somewhere."""
    layout = planner.Layout.uniform(LLAMA, pp=8, schedule="dualpipe")
    assert [sum(in_flight(layout, r, 1).values()) for r in range(8)] == [1] * 8
    assert max(sum(in_flight(layout, r, 4).values()) for r in range(8)) == 4


@pytest.mark.parametrize("schedule", ["1f1b-ep-overlap", "interleaved-ep-overlap"])
def test_the_overlapped_schedules_peak_is_the_fills_however_long_the_step(schedule: str) -> None:
    """Past 16 * pp * v micro-batches the paired schedules' resident counts at their peak
    come from a step of that length (``_combined_peak``): the same as walking every op of
    the longer step."""
    from planner.schedules import _combined_counts, schedule_of

    entry = schedule_of(schedule)
    v = 2 if schedule.startswith("interleaved") else 1
    for p in (2, 4):
        filled = 16 * p * v
        for m in (filled + 2 * p, filled + 2 * p * 9 + (0 if v == 2 else 3)):
            for rank in range(p):
                walked = dict(_combined_counts(p, m, rank, v))
                chunks = sorted(walked)
                got = entry.peak(p, m, v, rank, chunks)
                assert got == {c: walked.get(c, 0.0) for c in chunks}, (p, m, rank)
                assert sum(got.values()) > 0
