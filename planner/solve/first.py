"""The search's first layouts, before any proof: a layout that fits (``first_fit``), the
layouts a caller hints (``hinted_layouts``), a configuration's quick layouts (``quick_layout``:
even stages, each rank at the fastest recompute its memory fits), and activation offload,
searched on its own (``offloaded_layouts``). Each is costed exactly (``evaluate``) and charged
to the budget (``planner.solve.budget``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from planner.costs.activations import offloads_activations
from planner.costs.cap import usable_peak_bytes
from planner.costs.memory import stage_memory
from planner.errors import PlannerError
from planner.estimate import Estimate, evaluate
from planner.frameworks import Launcher, framework, names_with
from planner.layout import Layout, Stage, parse_recompute
from planner.solve.bounds import bound_tables, state_fits
from planner.solve.budget import (
    SECONDS_PER_BOUND,
    SECONDS_PER_MEMORY_BLOCK,
    Budget,
    costing_charge,
    program_charge,
)
from planner.solve.space import DEFAULT_VIRTUAL, enumerate_configs, target_rules
from planner.solve.tables import Config, Option, Tables, choice_name, even_counts, tie_break
from planner.solve.warm import balanced
from planner.specs import ClusterSpec, ModelSpec, SearchSpace, TrainingJob


def first_fit(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace,
    configs: list[Config],
    budget: Budget,
) -> tuple[float, Config, Layout] | None:
    """A first layout that fits, before any bound is worked out: even stages, every layer
    with the leanest recompute the space allows (full, unless it says otherwise), for the
    configurations that hold the least per rank first (the most ZeRO sharding, the fewest
    micro-batches in flight, the smallest micro-batch), the fewest model-parallel ranks
    (tp * pp) among those, one per set of degrees. It goes on until one fits or every set
    was tried, whatever the budget: a user always gets an answer when such a layout exists
    (each costing is charged all the same)."""
    allowed = space.recompute or ["full"]
    lean = "full" if "full" in allowed else allowed[-1]

    def order(c: Config) -> tuple[object, ...]:
        return (-c.zero, c.micro_batch, c.pipeline.leanness, c.tp * c.cp * c.pp, tie_break(c))

    seen: set[tuple[object, ...]] = set()
    programs: set[tuple[str, int, int, int]] = set()
    for config in sorted(configs, key=order):
        if config.pipeline.ep_overlap and "full" in allowed:
            continue  # it refuses full recompute: the plain schedule of the same degrees
        shape = (config.tp, config.cp, config.pp, config.dp, config.ep, config.etp)
        if shape in seen:  # one try per degrees: the leanest of them
            continue
        seen.add(shape)
        # Sets whose share of the model state alone is over the cap are passed over before
        # any layout is costed (an infeasible job's thousands of micro-batches make each
        # costing long).
        budget.charge(SECONDS_PER_BOUND)
        tables = bound_tables(model, cluster, job, config)
        if tables is None or not state_fits(tables, cluster, job, config):
            continue
        budget.charge(
            costing_charge(model, config, extended=True)
            + program_charge(config, programs, extended=True)
        )
        try:
            layout = config.layout(model, even_counts(model, config), _uniform(model, lean))
            est = evaluate(model, cluster, job, layout)
        except PlannerError:
            continue
        if est.fits and host_ok(job, cluster, layout, est):
            return est.step_time_s, config, layout
    return None


def without_offload(space: SearchSpace) -> SearchSpace:
    """``space`` without activation offload among its recompute choices (layers it does not
    offload run without recompute: "offload" alone leaves "none")."""
    if not space.recompute or "offload" not in space.recompute:
        return space
    rest = [r for r in space.recompute if r != "offload"]
    return space.model_copy(update={"recompute": rest or ["none"]})


OFFLOAD_SHARE = 0.25  # of the budget the activation-offload search may take


def offloaded_layouts(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace,
    configs: list[Config],
    budget: Budget,
) -> list[tuple[float, Config, Layout]]:
    """Layouts with activation offload ("offload" in the space's recompute list), as
    Megatron-LM runs it: the first n transformer layers of a layout without pipeline
    parallelism offloaded, the others without recompute (``costs.memory.
    activation_offload_rule``). Each layer offloaded holds less and adds its copies' exposed
    time, so a configuration's fastest is the fewest layers that fit: found exactly, by
    bisection over n, for each configuration until its share of the budget is spent."""
    if not space.recompute or "offload" not in space.recompute:
        return []
    if not framework(job.framework).activation_offload:
        able = names_with(lambda f: f.activation_offload)
        raise PlannerError(
            f"SearchSpace.recompute={space.recompute}: activation offload runs under "
            f"{able} only, not {job.framework!r}"
        )
    stop = budget.spent + OFFLOAD_SHARE * max(0.0, budget.limit - budget.spent)
    out = []
    for config in sorted(configs, key=tie_break):
        if config.pp != 1 or config.virtual_stages != 1 or budget.spent > stop:
            continue
        tables = bound_tables(model, cluster, job, config)
        if tables is None or not state_fits(tables, cluster, job, config):
            continue
        tried: dict[int, tuple[Estimate, Layout] | None] = {}

        def run(
            n: int,
            config: Config = config,
            tried: dict[int, tuple[Estimate, Layout] | None] = tried,
        ) -> tuple[Estimate, Layout] | None:
            if n not in tried:
                budget.charge(costing_charge(model, config, extended=True))
                offload = {f"layer.{i}": "offload" for i in range(n)}
                try:
                    layout = config.layout(model, [model.num_layers], offload)
                    est = evaluate(model, cluster, job, layout)
                except PlannerError:
                    tried[n] = None
                else:
                    ok = est.fits and host_ok(job, cluster, layout, est)
                    tried[n] = (est, layout) if ok else None
            return tried[n]

        low, high = 1, model.num_layers - 1
        if high < low or run(high) is None:
            continue
        while low < high:
            mid = (low + high) // 2
            if run(mid) is not None:
                high = mid
            else:
                low = mid + 1
        fit = run(high)
        if fit is not None:
            out.append((fit[0].step_time_s, config, fit[1]))
    return out


# What a hint does not fix of a configuration: its expert-parallel degree and micro-batch
# (the nearest that divide are taken) and what follows from them; where the EMA lives and
# whether FP8 inputs are cached, which the job and the space decide (a published layout
# states neither for this job).
_HINT_FREE = frozenset(
    {"ep", "micro_batch", "num_microbatches", "recompute_extra", "ema", "fp8_cache"}
)


def hint_configs(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace,
    configs: list[Config],
    hints: Sequence[Layout],
) -> list[Config]:
    """Configurations for the ``hints`` whose virtual stages the space's default menu leaves
    out (Megatron-LM's Mixtral reference runs 8 chunks a rank; the menu is
    ``space.DEFAULT_VIRTUAL``): where the space does not state its virtual stages, each
    such hint's degrees are searched with its own count too, so a published layout is
    always in the search. The new ones only (none where the space states its own)."""
    if space.virtual_stages:
        return []
    have = set(configs)
    counts = sorted(
        {h.virtual_stages for h in hints if h.virtual_stages not in DEFAULT_VIRTUAL} - {1}
    )
    if not counts:
        return []
    wanted = set()
    for hint in hints:
        if hint.virtual_stages in counts and hint.tp * hint.cp * hint.pp <= cluster.num_gpus:
            dp = cluster.num_gpus // (hint.tp * hint.cp * hint.pp)
            wanted.add(dataclasses.replace(Config.of(hint, 1), dp=dp).key(ignoring=_HINT_FREE))
    wider = space.model_copy(update={"virtual_stages": [*DEFAULT_VIRTUAL, *counts]})
    return [
        c
        for c in enumerate_configs(model, cluster, job, wider)
        if c not in have and c.key(ignoring=_HINT_FREE) in wanted
    ]


def hinted_layouts(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    configs: list[Config],
    hints: Sequence[Layout],
    budget: Budget,
    space: SearchSpace | None = None,
) -> list[tuple[float, Config, Layout]]:
    """The ``hints`` that fit this job, each with its step time: a hint keeps its tensor and
    pipeline degrees, stages, recompute, ZeRO stage, schedule and micro-batch and takes the
    data-parallel degree this job's GPU count leaves (and the micro-batches per step that
    gives); its micro-batch, when the batch no longer divides, the largest smaller one that
    does, and its expert-parallel degree the nearest that divides. A hint whose degrees fall
    outside the space is passed over. Where the space's target launcher states one
    recompute choice for every layer, a hint whose layers take several is restated with
    every layer at each of its own choices the launcher runs, the fastest that fits kept; a
    hint with uneven stages is passed over where the launcher runs even ones only."""
    rules = target_rules(space) if space is not None else None
    out: list[tuple[float, Config, Layout]] = []
    programs: set[tuple[str, int, int, int]] = set()
    for given in hints:
        layers = [b.block for s in given.stages for b in s.blocks if b.block.startswith("layer.")]
        if len(layers) != model.num_layers:
            continue  # another model's layout
        dp = cluster.num_gpus // (given.tp * given.cp * given.pp)
        for hint in (given, *one_chunk(given)):
            wanted = dataclasses.replace(Config.of(hint, 1), dp=dp).key(ignoring=_HINT_FREE)
            same = [c for c in configs if c.key(ignoring=_HINT_FREE) == wanted]
            if same:
                break
        else:
            continue

        def near(c: Config, hint: Layout = hint) -> tuple[object, ...]:
            # The hint's micro-batch, else the largest smaller one (it holds less), then the
            # nearest expert-parallel degree, the larger of two as near (it holds less), then
            # the hint's EMA placement and FP8 cache where the space has them.
            mb = c.micro_batch
            return (
                mb != hint.micro_batch,
                mb > hint.micro_batch,
                -mb,
                abs(math.log(c.ep / hint.ep)),
                -c.ep,
                c.ema != hint.ema,
                c.fp8_cache != hint.fp8_cache,
            )

        config = min(same, key=near)
        if rules is not None and rules.even_stages:
            counts = [sum(b.block.startswith("layer.") for b in s.blocks) for s in hint.stages]
            if counts != even_counts(model, config):
                continue
        fitting: list[tuple[float, Config, Layout]] = []
        for stated in _one_choice(hint, rules):
            budget.charge(
                costing_charge(model, config, extended=True)
                + program_charge(config, programs, extended=True)
            )
            try:
                layout = Layout(
                    **{
                        **stated.model_dump(),
                        "dp": config.dp,
                        "ep": config.ep,
                        "micro_batch": config.micro_batch,
                        "num_microbatches": None,
                        "ema": config.ema,
                        "fp8_cache": config.fp8_cache,
                    }
                )
                est = evaluate(model, cluster, job, layout)
            except PlannerError:
                continue
            if est.fits and host_ok(job, cluster, layout, est):
                fitting.append((est.step_time_s, config, layout))
        if fitting:
            out.append(min(fitting, key=lambda x: x[0]))
    return out


def _one_choice(hint: Layout, rules: Launcher | None) -> list[Layout]:
    """``hint`` as the launcher states it: itself where its layers take one recompute choice
    the launcher runs (or there is no launcher); else one layout per choice of its layers
    that the launcher runs, every layer at that choice."""
    layers = hint.layer_recompute()
    if rules is None:
        return [hint]
    allowed = rules.recompute
    choices = [c for c in dict.fromkeys(layers) if allowed is None or c in allowed]
    if len(set(layers)) == 1:
        return [hint] if choices else []
    out = []
    for choice in choices:
        stages = [
            Stage(
                blocks=[
                    b.model_copy(update={"recompute": choice})
                    if b.block.startswith("layer.")
                    else b
                    for b in s.blocks
                ]
            )
            for s in hint.stages
        ]
        out.append(hint.model_copy(update={"stages": stages}))
    return out


# The schedule of one chunk a rank that runs as an interleaved one does, on the same ranks
# (Megatron-LM merges a forward and a backward only on the interleaved path when pp > 1).
ONE_CHUNK = {"interleaved": "1f1b", "interleaved-ep-overlap": "1f1b"}


def one_chunk(hint: Layout) -> list[Layout]:
    """An interleaved ``hint`` as its one-chunk counterpart (each v consecutive chunks one
    stage, the same blocks and recompute), for a job whose micro-batches the interleaved
    schedule cannot take (Megatron-LM's needs a multiple of pp); none otherwise."""
    schedule = ONE_CHUNK.get(hint.schedule)
    v = hint.virtual_stages
    if schedule is None or v < 2 or len(hint.stages) != hint.pp * v:
        return []
    stages = [
        Stage(blocks=[b for part in hint.stages[i : i + v] for b in part.blocks])
        for i in range(0, len(hint.stages), v)
    ]
    update = {"schedule": schedule, "virtual_stages": 1, "stages": stages}
    try:
        return [Layout(**{**dict(hint), **update})]
    except PlannerError:
        return []


def quick_layout(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace,
    config: Config,
    budget: Budget,
    programs: set[tuple[str, int, int, int]],
) -> tuple[float, Layout] | None:
    """The faster of two layouts of ``config`` (even layer counts; stages even in time),
    each rank's layers at the fastest choice of ``_ladder`` (a recompute option per kind of
    layer, in the space) that its memory fits, and its step time; None when none fits."""
    t = bound_tables(model, cluster, job, config)
    if t is None:
        return None
    allowed = {choice_name(parse_recompute(r)) for r in space.recompute or []}
    ordered = _ladder(t, allowed)
    rules = target_rules(space)
    if rules is not None:  # a launcher states one choice for every layer
        ordered = [c for c in ordered if len({c[k] for k in set(t.layer_kinds)}) == 1]
    # Two partitions: even layer counts, and stages even in time with the embedding's and
    # head's own work counted (``warm.balanced``), unless the target launcher runs even
    # layer counts only.
    partitions = [even_counts(model, config)]
    if rules is None or not rules.even_stages:
        partitions.append(balanced(t, lambda o: o.time))
    cap = usable_peak_bytes(cluster, job)
    blocks = model.num_layers + model.num_mtp_layers + 2
    budget.charge(program_charge(config, programs, extended=True))
    holders = _holders(config)

    def peaks(counts: list[int], choice: dict[str, str]) -> list[float]:
        """Each rank's peak with ``choice`` for every layer (by kind)."""
        budget.charge(blocks * SECONDS_PER_MEMORY_BLOCK)
        layout = config.layout(model, counts, _by_kind(model, t, choice))
        memory = stage_memory(model, job, layout, num_microbatches=config.num_microbatches)
        return [s.peak_bytes for s in memory]

    best: tuple[float, Layout] | None = None
    for counts in dict.fromkeys(map(tuple, partitions)):
        try:
            if not ordered or max(peaks(list(counts), ordered[-1])) > cap:
                continue  # the leanest choice does not fit: no choice does
            # Each rank at the fastest choice its own memory fits (a rank's memory depends
            # on its own blocks alone; the ladder's bytes fall as its time rises, so a
            # rank's fitting choices are a tail of it, found by bisection, all ranks at
            # once); a stage two ranks hold (DualPipe) at the leaner of their choices.
            low = [0] * config.pp
            high = [len(ordered) - 1] * config.pp
            while any(lo < hi for lo, hi in zip(low, high, strict=True)):
                middle = sorted(
                    {(lo + hi) // 2 for lo, hi in zip(low, high, strict=True) if lo < hi}
                )
                at = {i: peaks(list(counts), ordered[i]) for i in middle}
                for r in range(config.pp):
                    mid = (low[r] + high[r]) // 2
                    if low[r] < high[r] and mid in at:
                        if at[mid][r] <= cap:
                            high[r] = mid
                        else:
                            low[r] = mid + 1
            if rules is not None:  # one choice for every layer: the leanest any rank needs
                high = [max(high)] * config.pp
            stage_choice = [ordered[max(high[r] for r in holders[c])] for c in range(config.stages)]
            layout = config.layout(model, list(counts), _by_stage(t, list(counts), stage_choice))
            budget.charge(costing_charge(model, config, extended=True))
            est = evaluate(model, cluster, job, layout)
            good = est.fits and host_ok(job, cluster, layout, est)
            if good and (best is None or est.step_time_s < best[0]):
                best = (est.step_time_s, layout)
        except PlannerError:
            continue
    return best


def _holders(config: Config) -> list[list[int]]:
    """The ranks that hold each stage."""
    from planner.layout import chunks_of

    out: list[list[int]] = [[] for _ in range(config.stages)]
    for r in range(config.pp):
        for c in chunks_of(config.schedule, config.pp, config.virtual_stages, r):
            out[c].append(r)
    return out


def _by_stage(t: Tables, counts: list[int], choices: list[dict[str, str]]) -> dict[str, str]:
    """Each layer's recompute from its stage's choice by kind; the embedding's and the first
    stage's fixed blocks from the first stage's, MTP modules from the last stage's."""
    out: dict[str, str] = {}
    i = 0
    for c, n in enumerate(counts):
        for layer in range(i, i + n):
            out[f"layer.{layer}"] = choices[c][t.layer_kinds[layer]]
        i += n
    out |= {n: choices[0][n] for n in t.first_fixed if n in choices[0]}
    out |= {n: choices[-1][n] for n in t.last_fixed if n in choices[-1]}
    return out


def _ladder(t: Tables, allowed: set[str]) -> list[dict[str, str]]:
    """Recompute choices for the quick layouts, fastest first: each name every kind has, for
    all of them; and, for each option of the layer kind with the most layers, every other
    layer kind and MTP module at its fastest option that keeps no larger a share of its
    most saved bytes (kinds have different menus: DeepSeek-V3's dense and MoE layers share
    only five of their options, and the best of its MoE layers' is not one of them).
    Options outside the space's recompute list are left out (MTP modules may stay as they
    are)."""
    kinds = sorted(set(t.layer_kinds))
    main = max(kinds, key=lambda k: (t.layer_kinds.count(k), k))
    mtp = [n for n in t.first_fixed + t.last_fixed if n.startswith("mtp.")]
    weight = {k: t.layer_kinds.count(k) for k in kinds} | dict.fromkeys(mtp, 1)

    def menu(k: str) -> list[Option]:
        options = t.kinds[k].options
        keep = [o for o in options if not allowed or o.name in allowed or k in mtp]
        return keep or options

    most = {k: max(o.saved for o in menu(k)) or 1.0 for k in weight}
    ladder: dict[tuple[tuple[str, str], ...], float] = {}
    # The names every kind has, as one choice for all.
    shared = set.intersection(*({o.name for o in menu(k)} for k in weight))
    for name in shared:
        same = {k: next(o for o in menu(k) if o.name == name) for k in weight}
        key = tuple(sorted((k, o.name) for k, o in same.items()))
        ladder[key] = sum(weight[k] * o.time for k, o in same.items())
    for lead in menu(main):
        share = lead.saved / most[main]
        choice = {main: lead}
        for k in weight:
            if k == main:
                continue
            under = [o for o in menu(k) if o.saved <= share * most[k] * (1 + 1e-9)]
            choice[k] = (
                min(under, key=lambda o: (o.time, o.name))
                if under
                else min(menu(k), key=lambda o: (o.saved, o.time))
            )
        key = tuple(sorted((k, o.name) for k, o in choice.items()))
        ladder[key] = sum(weight[k] * o.time for k, o in choice.items())
    # Each choice slower than the one before keeps fewer bytes (the others lose to it), so
    # what fits is a tail of the list (``quick_layout`` bisects it).
    saved = {(k, o.name): o.saved for k in weight for o in menu(k)}
    out: list[dict[str, str]] = []
    least = math.inf
    for key, _ in sorted(ladder.items(), key=lambda kv: (kv[1], kv[0])):
        kept = sum(weight[k] * saved[(k, name)] for k, name in key)
        if kept < least:
            least = kept
            out.append(dict(key))
    return out


def _by_kind(model: ModelSpec, t: Tables, choice: dict[str, str]) -> dict[str, str]:
    """Each layer's and MTP module's recompute from its kind's choice."""
    out = {f"layer.{i}": choice[k] for i, k in enumerate(t.layer_kinds)}
    out |= {n: choice[n] for n in t.first_fixed + t.last_fixed if n in choice}
    return out


def _uniform(model: ModelSpec, choice: str) -> dict[str, str]:
    from planner.costs.blocks import block_names

    return {n: choice for n in block_names(model) if n.startswith(("layer.", "mtp."))}


def host_ok(job: TrainingJob, cluster: ClusterSpec, layout: Layout, est: Estimate) -> bool:
    on_host = layout.ema == "host" and job.ema is not None
    if not (on_host or layout.optimizer_offload or offloads_activations(layout)):
        return True
    gpus = min(cluster.gpus_per_node, cluster.num_gpus)
    return max(s.host_bytes for s in est.memory) * gpus <= cluster.host_ram_bytes
