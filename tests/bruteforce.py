"""Exhaustive search over a small search space: the reference optimum for tests.

Every layout the space allows is built and costed with ``planner.evaluate``: every choice of
degrees (context parallelism and expert tensor parallelism included), ZeRO stage,
micro-batch, schedule, virtual stages, EMA placement, sequence parallelism, FP8 caching and
optimizer offload fraction, every split of the layers into stages, and every recompute
assignment. A layout fits when every rank is within the HBM cap and what the ranks of a
node keep on the host is within its RAM, as the planner requires. A stage's cost depends only on how
many of its identical blocks take each recompute choice, so per stage (and per kind of
block: dense layer, MoE layer, MTP module) the multisets of choices are enumerated and given
to its blocks in order. Meant for a handful of layers and stages: it is slow by design.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import planner
from planner.errors import PlannerError
from planner.estimate import Estimate
from planner.export import uniform_recompute
from planner.layout import SCHEDULES, Layout, Schedule
from planner.specs import ClusterSpec, ModelSpec, SearchSpace, TrainingJob


def best_layout(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, space: SearchSpace
) -> tuple[Layout, Estimate] | None:
    """The fastest layout in ``space`` that fits (ties: the first found), or None."""
    return _search(model, cluster, job, space)[0]


def best_layouts(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, space: SearchSpace
) -> tuple[tuple[Layout, Estimate] | None, dict[str, tuple[Layout, Estimate]]]:
    """``best_layout``, and per recompute choice the fastest whose transformer layers all
    take it (what a target launcher states), from one enumeration."""
    found = _search(model, cluster, job, space)
    return found[0], found[2]


def count_layouts(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, space: SearchSpace
) -> int:
    """How many valid layouts ``best_layout`` evaluates for this space."""
    return _search(model, cluster, job, space)[1]


def _search(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, space: SearchSpace
) -> tuple[tuple[Layout, Estimate] | None, int, dict[str, tuple[Layout, Estimate]]]:
    best: tuple[Layout, Estimate] | None = None
    uniform: dict[str, tuple[Layout, Estimate]] = {}
    count = 0
    for layout in _layouts(model, cluster, job, space):
        try:
            est = planner.evaluate(model, cluster, job, layout)
        except PlannerError:  # a combination the cost model rejects (e.g. tp vs heads)
            continue
        count += 1
        if not est.fits or not _host_ram_fits(job, cluster, layout, est):
            continue
        if best is None or est.step_time_s < best[1].step_time_s:
            best = (layout, est)
        choice = uniform_recompute(layout)
        if choice is not None and (
            choice not in uniform or est.step_time_s < uniform[choice][1].step_time_s
        ):
            uniform[choice] = (layout, est)
    return best, count, uniform


def _host_ram_fits(job: TrainingJob, cluster: ClusterSpec, layout: Layout, est: Estimate) -> bool:
    """What the heaviest rank keeps on the host, for every GPU of a node, is within the
    node's RAM, wherever the layout keeps anything there: an EMA on the host, an offloaded
    part of the optimizer state, or offloaded activations (a block whose recompute choice
    offloads, alone or beside recomputed modules)."""
    on_host = layout.ema == "host" and job.ema is not None
    offloads = any("offload" in b.recompute for s in layout.stages for b in s.blocks)
    if not (on_host or layout.optimizer_offload or offloads):
        return True
    gpus = min(cluster.gpus_per_node, cluster.num_gpus)  # a partial node has only num_gpus
    return max(s.host_bytes for s in est.memory) * gpus <= cluster.host_ram_bytes


def _required(values: list[int] | list[str] | None, name: str) -> list[int] | list[str]:
    assert values is not None, f"best_layout needs SearchSpace.{name} spelled out"
    return values


def _context_parallel(space: SearchSpace, job: TrainingJob, gpus: int) -> list[int]:
    """As pinned, else what SearchSpace.cp=None means: 1 and the powers of two that leave
    each rank at least 4,096 tokens of a sequence (and divide the GPUs)."""
    if space.cp is not None:
        return space.cp
    out = [1]
    while job.seq_len // (2 * out[-1]) >= 4096 and gpus % (2 * out[-1]) == 0:
        out.append(2 * out[-1])
    return out


def _layouts(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, space: SearchSpace
) -> Iterator[Layout]:
    """Every layout of the space (some invalid ones are dropped on construction, others
    when costed: FP8 caching outside FP8 Megatron-LM jobs, an optimizer offload the
    framework cannot run, context parallelism the sequence cannot split into)."""
    assert space.zero is not None, "best_layout needs SearchSpace.zero spelled out"
    recompute = [str(c) for c in _required(space.recompute, "recompute")]
    emas: list[str] = ["hbm"] if job.ema is None else list(space.ema or ["hbm", "host"])
    caches = space.fp8_cache or [False]
    offloads = space.optimizer_offload or [0.0]
    sps = list(dict.fromkeys(space.sequence_parallel or [True]))
    for tp, cp, pp, ep, zero, mb, schedule, v, ema in itertools.product(
        _required(space.tp, "tp"),
        _context_parallel(space, job, cluster.num_gpus),
        _required(space.pp, "pp"),
        _required(space.ep, "ep"),
        space.zero,
        _required(space.micro_batch, "micro_batch"),
        _required(space.schedules, "schedules"),
        _required(space.virtual_stages, "virtual_stages"),
        emas,
    ):
        assert isinstance(tp, int) and isinstance(pp, int) and isinstance(v, int)
        if cluster.num_gpus % (tp * cp * pp):
            continue
        dp = cluster.num_gpus // (tp * cp * pp)
        if space.dp is not None and dp not in space.dp:
            continue
        # Expert tensor parallelism: as pinned, else what SearchSpace.etp=None means (1 and
        # the tp degree, for MoE models).
        etps = space.etp or ([1, tp] if model.num_experts else [1])
        # Without tensor parallelism, sequence parallelism changes nothing: one value.
        mine = sps if tp > 1 else sps[:1]
        for etp, cache, offload, sp in itertools.product(
            dict.fromkeys(etps), caches, offloads, mine
        ):
            fields = {
                "tp": tp,
                "cp": cp,
                "dp": dp,
                "ep": ep,
                "etp": etp,
                "zero": zero,
                "micro_batch": mb,
                "ema": ema,
                "fp8_cache": cache,
                "optimizer_offload": offload,
                "sequence_parallel": sp,
            }
            yield from _splits(model, pp, v, _schedule(str(schedule)), recompute, fields)


def _splits(
    model: ModelSpec,
    pp: int,
    v: int,
    schedule: Schedule,
    recompute: list[str],
    fields: dict[str, object],
) -> Iterator[Layout]:
    """Every split into stages and recompute assignment for one choice of the rest."""
    for counts in _compositions(model.num_layers, pp * v):
        for choice in _recompute_assignments(model, counts, recompute):
            try:
                layout = Layout.from_counts(
                    model,
                    counts=counts,
                    pp=pp,
                    virtual_stages=v,
                    schedule=schedule,
                    recompute=choice,
                    **fields,
                )
            except PlannerError:
                # Only the degrees and the schedule can be rejected here (ep not dividing
                # dp*tp, virtual stages wrong for the schedule): every split fails alike.
                return
            yield layout


def _schedule(name: str) -> Schedule:
    assert name in SCHEDULES, name
    return name  # type: ignore[return-value]


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Layer counts of ``parts`` stages summing to ``total``: the first and last stage may be
    empty (they hold the embedding and the head), the others need a layer. Every
    non-decreasing sequence of ``parts - 1`` cut points in 0..total is one split."""
    for cuts in itertools.combinations_with_replacement(range(total + 1), parts - 1):
        bounds = (0, *cuts, total)
        counts = tuple(b - a for a, b in itertools.pairwise(bounds))
        if all(c >= 1 for c in counts[1:-1]):
            yield counts


def _recompute_assignments(
    model: ModelSpec, counts: tuple[int, ...], choices: list[str]
) -> Iterator[dict[str, str]]:
    """Block -> recompute choice: per stage and per kind of block, every multiset of
    choices, given to the blocks in order (embedding and head keep "none")."""
    options: list[list[dict[str, str]]] = []
    start = 0
    for i, count in enumerate(counts):
        blocks = [(f"layer.{j}", j) for j in range(start, start + count)]
        start += count
        if i == len(counts) - 1:  # MTP modules sit on the last stage, before the head
            blocks += [(f"mtp.{j}", model.num_layers + j) for j in range(model.num_mtp_layers)]
        kinds: dict[tuple[bool, bool], list[str]] = {}
        for name, index in blocks:
            kind = (name.startswith("mtp."), model.is_moe_layer(index))
            kinds.setdefault(kind, []).append(name)
        for names in kinds.values():
            multisets = itertools.combinations_with_replacement(choices, len(names))
            options.append([dict(zip(names, m, strict=True)) for m in multisets])
    for parts in itertools.product(*options):
        merged: dict[str, str] = {}
        for part in parts:
            merged.update(part)
        yield merged
