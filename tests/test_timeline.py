"""The timeline: every task starts at the longest chain to it, and every chain it reports
bounds every layout of the same shape.

The longest path is recomputed here with networkx over dependencies stated again from the
schedules' op orders (a forward needs the previous stage's forward of its micro-batch, a
backward its own forward and the next stage's backward, a weight-gradient op its
input-gradient op), so a mistake in ``planner.timeline``'s own bookkeeping shows.
"""

from __future__ import annotations

import itertools
from typing import Any

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import planner
from planner.costs.activations import LONG_STEP, activation_peak, level_points, long_step
from planner.costs.overlap import overlap_of, task_time, values
from planner.costs.timing import optimizer_time
from planner.estimate import extended_run, step_run
from planner.layout import Layout
from planner.schedules import op_order

H100 = planner.load_cluster("h100", gpus=16)
SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved", "dualpipe", "dualpipev"]


def _layout(
    model: planner.ModelSpec, schedule: str, pp: int, counts: list[int], **kw: Any
) -> Layout:
    v = 2 if schedule in ("interleaved", "dualpipev") else 1
    return Layout.from_counts(
        model,
        counts=counts,
        pp=pp,
        schedule=schedule,
        virtual_stages=v,
        **kw,  # type: ignore[arg-type]
    )


def _longest_path_starts(
    layout: Layout, m: int, lengths: dict[Any, float], sends: dict[Any, float] | None = None
) -> dict[Any, float]:
    """Start of every (rank, index) task by an independent longest-path computation;
    ``sends``: seconds of each (kind, stage) result's asynchronous send to another rank,
    which the receiving task waits for (none when the framework sends in series)."""
    graph: nx.DiGraph[Any] = nx.DiGraph()
    owner: dict[tuple[str, int, int, int], tuple[int, int]] = {}
    tasks: dict[tuple[int, int], tuple[Any, ...]] = {}
    for r in range(layout.pp):
        order = op_order(
            layout.schedule,
            pp=layout.pp,
            num_microbatches=m,
            rank=r,
            virtual_stages=layout.virtual_stages,
        )
        i = n = 0
        while i < len(order):
            group = order[i : i + 2] if order[i].paired else order[i : i + 1]
            tasks[(r, n)] = tuple(group)
            for op in group:
                kind = "B" if op.kind in ("B", "BW") else op.kind
                owner[(kind, op.microbatch, op.stage, op.direction)] = (r, n)
            i += len(group)
            n += 1
    last = len(layout.stages) - 1
    for (r, n), group in tasks.items():
        graph.add_node((r, n))
        if n:
            graph.add_edge((r, n - 1), (r, n))
        for op in group:
            s, mb, d = op.stage, op.microbatch, op.direction
            needs = []
            if op.kind == "F" and s > 0:
                needs.append(("F", mb, s - 1, d))
            if op.kind == "W":
                needs.append(("B", mb, s, d))
            if op.kind in ("B", "BW"):
                needs.append(("F", mb, s, d))
                if s < last:
                    needs.append(("B", mb, s + 1, d))
            for need in needs:
                if owner[need] != (r, n):
                    lag = 0.0
                    if sends is not None and owner[need][0] != r:
                        lag = sends[(need[0], need[2])]
                    if graph.has_edge(owner[need], (r, n)):
                        lag = max(lag, graph.edges[owner[need], (r, n)].get("lag", 0.0))
                    graph.add_edge(owner[need], (r, n), lag=lag)
    starts: dict[Any, float] = {}
    for node in nx.topological_sort(graph):
        starts[node] = max(
            (
                starts[p] + lengths[p] + graph.edges[p, node].get("lag", 0.0)
                for p in graph.predecessors(node)
            ),
            default=0.0,
        )
    return starts


CASES = st.fixed_dictionaries(
    {
        "schedule": st.sampled_from(SCHEDULES),
        "pp": st.sampled_from([2, 4]),
        "rounds": st.integers(1, 3),
        "cuts": st.lists(st.integers(0, 100), min_size=8, max_size=8),
        "model": st.sampled_from(["llama3-8b", "mixtral-8x7b"]),
    }
)


def _case(case: dict[str, Any]) -> tuple[planner.ModelSpec, planner.TrainingJob, Layout]:
    """A layout with uneven stages (the cuts split 24 layers), ZeRO-1, dp over the rest."""
    model = planner.load_model(case["model"]).model_copy(update={"num_layers": 24})
    schedule, pp = case["schedule"], case["pp"]
    v = 2 if schedule in ("interleaved", "dualpipev") else 1
    stages = pp * v
    cuts = sorted({1 + c % 23 for c in case["cuts"]})
    cuts = (cuts + list(range(1, 24)))[: stages - 1]
    cuts = sorted(set(cuts))
    while len(cuts) < stages - 1:
        cuts.append(next(x for x in range(1, 24) if x not in cuts))
        cuts.sort()
    counts = [b - a for a, b in itertools.pairwise([0, *cuts, 24])]
    dp = 16 // pp
    m = 2 * pp * case["rounds"]
    job = planner.TrainingJob(seq_len=1024, global_batch=m * dp)
    ep = 2 if model.num_experts else 1
    return model, job, _layout(model, schedule, pp, counts, dp=dp, ep=ep)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CASES)
def test_every_task_starts_at_the_longest_chain_to_it(case: dict[str, Any]) -> None:
    model, job, layout = _case(case)
    _, times, run = step_run(model, H100, job, layout)
    lengths = {
        (r, n): t.duration for r, rank in enumerate(run.ranks) for n, t in enumerate(rank.tasks)
    }
    sends = None
    if overlap_of(job, H100, layout.schedule).async_sends:  # Megatron-LM's interleaved sends
        sends = {("F", t.stage): t.p2p.seconds for t in times}
        sends |= {("B", t.stage): t.p2p_back.seconds for t in times}
    starts = _longest_path_starts(layout, run.num_microbatches, lengths, sends)
    for r, rank in enumerate(run.ranks):
        for n, t in enumerate(rank.tasks):
            assert t.start == pytest.approx(starts[(r, n)], abs=1e-12), (r, n, t.name)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CASES, CASES)
def test_every_chain_bounds_every_layout_of_the_shape(a: dict[str, Any], b: dict[str, Any]) -> None:
    """A chain reported for one layout, priced with another layout's numbers, is never longer
    than that layout's step: what lets the solver state the step as the largest of the chains
    it has met and still prove a bound. Each rank's own chain prices to its end exactly."""
    b = {**b, "schedule": a["schedule"], "pp": a["pp"], "rounds": a["rounds"], "model": a["model"]}
    model, job, first = _case(a)
    _, _, other_layout = _case(b)
    _, times_a, run_a = step_run(model, H100, job, first)
    _, times_b, run_b = step_run(model, H100, job, other_layout)
    overlap = overlap_of(job, H100, first.schedule)  # the schedule's: its sends may not wait

    def price(times: Any, run: Any) -> Any:
        val = values(times)
        opt = {r: rank.optimizer for r, rank in enumerate(run.ranks)}

        def length(key: Any) -> float:
            return task_time(key, val, overlap)

        def value(form: Any) -> float:
            total = 0.0
            for key, c in form.items():
                if key[0] == "opt":
                    total += c * opt[key[1]]
                else:
                    total += c * (length(key[1]) if key[0] == "task" else val[key[1]])
            return total

        return value

    own = price(times_a, run_a)
    for rank in run_a.ranks:
        assert own(rank.form) == pytest.approx(rank.end, rel=1e-9)
    other = price(times_b, run_b)
    for form in run_a.forms:
        assert other(form) <= run_b.step_s * (1 + 1e-9)


def test_a_reduction_that_overlaps_the_backward_shares_the_nic_and_the_sms() -> None:
    """ZeRO-0 all-reduces of large gradients over slow InfiniBand, overlapped with the last
    backwards (Megatron-LM) versus run after them (the eager torch runtime): overlapping ends
    sooner, but no sooner than the links and the SMs allow."""
    model = planner.load_model("llama3-8b").model_copy(update={"num_layers": 8})
    slow = H100.model_copy(update={"nic_Bps": H100.nic_Bps / 50})
    job = planner.TrainingJob(seq_len=2048, global_batch=64)
    layout = _layout(model, "1f1b", 2, [4, 4], dp=8, zero=0)
    over = planner.evaluate(model, slow, job, layout)
    serial = planner.evaluate(model, slow, job.model_copy(update={"framework": "torch"}), layout)
    assert over.step_time_s < serial.step_time_s
    _, times, run = step_run(model, slow, job, layout)
    for rank in run.ranks:
        ib = sum(times[s.stage].grad_sync.ib for s in rank.syncs)
        assert rank.end >= ib + rank.optimizer - 1e-12
    # Run after the backwards, the reductions are exposed in full.
    _, _, alone = step_run(model, slow, job.model_copy(update={"framework": "torch"}), layout)
    for rank in alone.ranks:
        last = rank.tasks[-1].end
        assert rank.end == pytest.approx(
            last + sum(s.duration for s in rank.syncs) + rank.optimizer
        )


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", [*SCHEDULES, "1f1b-ep-overlap", "interleaved-ep-overlap"])
def test_a_long_step_extended_from_two_shorter_is_the_long_step(schedule: str, pp: int) -> None:
    """Past ``LONG_STEP`` micro-batches ``evaluate`` runs a step at two shorter lengths and
    extends it (``estimate.extended_run``), and the activation peaks likewise: with every
    micro-batch alike the steady state repeats. The extended step time, each part of the
    breakdown and every rank's memory equal those of the whole step run task by task."""
    moe = "ep-overlap" in schedule
    model = planner.load_model("mixtral-8x7b" if moe else "llama3-8b")
    model = model.model_copy(update={"num_layers": 8})
    base = schedule.removesuffix("-ep-overlap")
    v = 2 if base in ("interleaved", "dualpipev") else 1
    layout = Layout.from_counts(
        model,
        counts=[8 // (pp * v)] * (pp * v),
        pp=pp,
        schedule=schedule,
        virtual_stages=v,
        dp=8,
        tp=8 if not moe else 1,
        ep=8 if moe else 1,
        recompute="none" if moe else "selective",
    )
    cluster = planner.load_cluster("h100", gpus=layout.world_size)
    m = LONG_STEP + 2 * pp * 37 + (0 if base in ("interleaved", "dualpipe") else 1)
    job = planner.TrainingJob(seq_len=1024, global_batch=m * 8)
    memory, times, whole = step_run(model, cluster, job, layout)
    optimizer = [optimizer_time(s, cluster) for s in memory]
    overlap = overlap_of(job, cluster, layout.schedule)
    extended = extended_run(layout, times, optimizer, m, overlap)
    assert extended.step_s == pytest.approx(whole.step_s, rel=1e-9)
    assert extended.critical_rank == whole.critical_rank
    for part, seconds in whole.breakdown.items():
        assert extended.breakdown[part] == pytest.approx(seconds, abs=1e-9 * whole.step_s)
    # Memory: the activation peaks extended (stage_memory at m) against a walk of the whole
    # order, which level_points gives at any length.
    assert long_step(pp, v, m)
    for rank in range(pp):
        chunks = dict.fromkeys(layout.chunks_of_rank(rank))
        per_chunk = {c: 1000.0 + 7 * c for c in chunks}
        rebuild = {c: 300.0 + c for c in chunks}
        walked = max(
            sum(n * per_chunk[c] for c, n in flight) + (rebuild[r] if r >= 0 else 0.0)
            for flight, r, _, _ in level_points(schedule, pp, m, v, rank)
        )
        assert activation_peak(layout, rank, m, per_chunk, rebuild) == pytest.approx(walked)
