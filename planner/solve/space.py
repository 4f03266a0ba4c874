"""The outer decisions a search enumerates: degrees, ZeRO stage, micro-batch, schedule.

Every combination the ``SearchSpace`` allows and the model, cluster and job divide (tp within
a node and dividing the heads, ep dividing the experts and dp*tp, the micro-batches each
schedule's reference implementation accepts). The dominance rules the search relies on
(ZeRO-0 and GPipe never better; the EMA on the host when it fits) are stated in
``planner.solve.search``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from planner.costs.blocks import Shard, a2a_rule, block_cost
from planner.costs.state import optimizer_offload_rule
from planner.errors import PlannerError
from planner.estimate import MAX_MICROBATCHES, ep_overlap_unmet
from planner.frameworks import (
    ZERO3_EXTRAS,
    Launcher,
    framework,
    launcher,
    launchers_with,
    names_with,
)
from planner.layout import parse_recompute
from planner.schedules import SCHEDULES
from planner.solve.tables import Config, choice_name
from planner.specs import ClusterSpec, ModelSpec, SearchSpace, TrainingJob

DEFAULT_SCHEDULES = tuple(name for name, s in SCHEDULES.items() if s.searched)
DEFAULT_MICRO_BATCHES = (1, 2, 4, 8)
DEFAULT_VIRTUAL = (2, 4)


def for_target(space: SearchSpace, job: TrainingJob) -> SearchSpace:
    """``space`` narrowed to what its one target launcher can state (``Framework.launcher``;
    the job's framework's when the space names none): schedules, ZeRO stages, recompute
    choices (one for every layer), context parallelism and sequence parallelism. Its
    ``framework`` is then that name (None: a framework without a launcher, whose
    layouts are not narrowed)."""
    names = space.frameworks_for(job)
    if len(names) != 1:
        raise PlannerError(
            f"SearchSpace.framework={space.framework!r}: one framework at a time here; "
            f"planner.plan searches each of {names} in turn"
        )
    reason = framework(names[0] or job.framework).costing_only
    if reason:
        raise PlannerError(
            f"framework={names[0] or job.framework!r}: costs given layouts only ({reason}); "
            "plan with megatron, torchtitan or deepspeed, and cost that layout with it"
        )
    space = space.model_copy(update={"framework": names[0]})
    rules = target_rules(space)
    if rules is None:
        return space
    update: dict[str, object] = {}
    pairs: tuple[tuple[str, tuple[object, ...] | None], ...] = (
        ("schedules", rules.schedules),
        ("zero", rules.zero),
        ("recompute", rules.recompute),
        ("cp", rules.cp),
        ("cp_comm_type", rules.cp_comm_type),
        ("sequence_parallel", rules.sequence_parallel),
    )
    for field, values in pairs:
        if values is not None:
            allowed = list(values)
            mine = getattr(space, field)
            update[field] = [v for v in (mine or allowed) if v in allowed]
            if not update[field]:
                raise PlannerError(
                    f"SearchSpace.{field}={mine}: {space.framework} runs none of them (it runs "
                    f"{allowed})"
                )
    return space.model_copy(update=update)


def target_rules(space: SearchSpace) -> Launcher | None:
    """What the space's one target launcher can state (None: no launcher, any layout)."""
    if isinstance(space.framework, list) or space.framework == "any":
        raise PlannerError(f"SearchSpace.framework={space.framework!r}: resolve it with for_target")
    return launcher(space.framework) if space.framework is not None else None


def enumerate_configs(model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, space: SearchSpace):  # type: ignore[no-untyped-def]
    n = cluster.num_gpus
    space = for_target(space, job)
    rules = target_rules(space)
    pipeline_zero = rules.pipeline_zero if rules is not None else None
    tensor_zero = rules.tensor_zero if rules is not None else None
    # Tensor parallelism stays inside one NVLink domain: a node's GPUs on an HGX/DGX node, a
    # rack's placed share on GB200 NVL72 (ClusterSpec.domain_gpus).
    domain = cluster.domain_gpus
    tps = space.tp or [t for t in _divisors(domain) if n % t == 0]
    cps = space.cp or context_parallel_degrees(job.seq_len, n)
    for tp, cp in itertools.product(tps, cps):
        if tp > domain or n % (tp * cp) or not _tp_fits(model, tp):
            continue
        if cp > 1 and (job.seq_len % (2 * cp) or not job.flash_attention):
            continue  # the load-balanced split needs 2 * cp chunks, and fused attention
        if cp > 1 and rules is not None and not rules.cp_mla and model.attention == "mla":
            continue
        pps = space.pp or _divisors(n // (tp * cp))
        for pp in pps:
            if (n // (tp * cp)) % pp:
                continue
            if cp > 1 and rules is not None and rules.cp_alone and (tp > 1 or pp > 1):
                continue
            dp = n // (tp * cp * pp)
            if space.dp and dp not in space.dp:
                continue
            plane = dp * cp * tp
            eps = space.ep or (
                [e for e in _divisors(plane) if model.num_experts % e == 0]
                if model.num_experts
                else [1]
            )
            for ep, etp in itertools.product(eps, _etps(model, space, tp)):
                if plane % (ep * etp) or (model.num_experts and model.num_experts % ep):
                    continue
                for config in _per_degrees(model, cluster, job, space, tp, pp, dp, ep, cp, etp):
                    if pp > 1 and pipeline_zero and config.zero not in pipeline_zero:
                        continue
                    if tp > 1 and tensor_zero and config.zero not in tensor_zero:
                        continue
                    yield config


def _etps(model: ModelSpec, space: SearchSpace, tp: int) -> list[int]:
    """Expert tensor-parallel degrees searched: 1 and the attention's tp (Megatron-LM's
    default, ETP = TP), those that divide the experts' width; any the space pins."""
    if not model.num_experts:
        return [1]
    asked = space.etp or list(dict.fromkeys([1, tp]))
    return [e for e in asked if model.moe_ffn_hidden_size % e == 0]


# Context parallelism is searched down to this many tokens of a sequence per rank: below it
# a rank's attention is too short to hide the ring's sends (MLPerf's Llama 3.1 405B runs
# use CP2 at 8,192 tokens; Llama 3 405B's long-context stage CP16 at 131,072, 8,192 a rank).
CP_MIN_TOKENS = 4096


def context_parallel_degrees(seq_len: int, gpus: int) -> list[int]:
    """The context-parallel degrees searched by default: powers of two that leave each rank
    at least ``CP_MIN_TOKENS`` tokens of a sequence (and 1)."""
    out, cp = [1], 2
    while seq_len // cp >= CP_MIN_TOKENS and gpus % cp == 0:
        out.append(cp)
        cp *= 2
    return out


def _per_degrees(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    space: SearchSpace,
    tp: int,
    pp: int,
    dp: int,
    ep: int,
    cp: int = 1,
    etp: int = 1,
) -> Iterator[Config]:
    zeros = space.zero or [1, 2, 3]
    if dp * cp == 1 and (not model.num_experts or tp == ep * etp) and min(zeros) <= 1:
        # Nothing to shard: every state is whole on its one data-parallel rank (the experts'
        # too, their data-parallel group being dp * cp * tp / ep), so ZeRO-2 and 3 hold the same
        # state as ZeRO-1 (or ZeRO-0, where the framework has no ZeRO-1) plus their buckets
        # and gathered copies, and add their collectives.
        zeros = [z for z in zeros if z <= 1]
    mbs = space.micro_batch or list(DEFAULT_MICRO_BATCHES)
    schedules = space.schedules or (
        list(DEFAULT_SCHEDULES) if pp > 1 else ["1f1b", "1f1b-ep-overlap"]
    )
    overlap = not ep_overlap_unmet(model, job, ep)  # all-to-alls to hide
    emas = space.ema or (["host"] if job.ema else ["hbm"])
    caches = fp8_cache_choices(job, space)
    offloads = optimizer_offload_choices(job, space)
    listed = listed_recompute(space)
    # Sequence parallelism never loses where it is allowed (SearchSpace.sequence_parallel):
    # the same bytes cross the links, fewer stay, and Megatron-LM hides TP only with it.
    sps = list(dict.fromkeys(space.sequence_parallel or [True]))
    if tp == 1:  # no effect: one value
        sps = sps[:1]
    comms = cp_comm_choices(model, cluster, space, tp, cp)
    hpzs = zero_hpz_choices(cluster, space, tp * cp * pp, dp)
    params_off = param_offload_choices(space)
    for zero, mb, schedule, ema in itertools.product(zeros, mbs, schedules, emas):
        entry = SCHEDULES.get(schedule)
        if entry is None:
            raise PlannerError(f"SearchSpace.schedules: unknown schedule {schedule!r}")
        if entry.ep_overlap and not overlap:
            continue
        if job.global_batch % (dp * mb):
            continue
        m = job.global_batch // (dp * mb)
        if m > MAX_MICROBATCHES:
            continue
        for v in _virtuals(space, entry.virtual_stages):
            stages = pp * v
            if stages > model.num_layers + 2:
                continue
            if not entry.runs(pp, m, v):
                continue
            for cache, sp, off, (comm, a2a), hpz, params in itertools.product(
                caches, sps, offloads, comms, hpzs if zero == 3 else [1],
                params_off if zero == 3 else [False],
            ):  # fmt: skip
                if optimizer_offload_rule(job, off, zero):
                    continue
                yield Config(
                    tp, pp, dp, ep, zero, mb, schedule, v, ema, m, cache, cp, sp, etp, off, listed,
                    cp_comm_type=comm, cp_a2a_size=a2a, zero_hpz=hpz, param_offload=params,
                )  # fmt: skip


def param_offload_choices(space: SearchSpace) -> list[bool]:
    """The ``Layout.param_offload`` values to search under ZeRO-3: off unless the space asks
    for more (like ``optimizer_offload``: it trades PCIe copies on every gather for the
    weights' HBM, and doubles the configurations), and only where the framework has it."""
    asked = list(dict.fromkeys(space.param_offload or [False]))
    _launched(space, "param_offload", True in asked)
    return asked


def _launched(space: SearchSpace, field: str, asked: bool) -> None:
    """Refuse in one line a ZeRO-3 setting (``frameworks.ZERO3_EXTRAS``) the space asks for
    where its framework's launcher cannot state it."""
    rules = target_rules(space)
    if asked and not (rules is not None and getattr(rules, field)):
        raise PlannerError(
            f"SearchSpace.{field}={getattr(space, field)}: {ZERO3_EXTRAS[field]} needs "
            f"framework={launchers_with(field)}"
        )


def zero_hpz_choices(cluster: ClusterSpec, space: SearchSpace, others: int, dp: int) -> list[int]:
    """The ``Layout.zero_hpz`` values searched under ZeRO-3: off, and where the framework
    has ZeRO++'s hierarchical partitioning, the data parallelism is all there is (``others``
    = tp * cp * pp = 1: DeepSpeed's groups are consecutive global ranks) and it spans
    nodes, a secondary shard over each node's GPUs (DeepSpeed's ZeRO++ tutorial sets it to
    the GPUs a node has); ``SearchSpace.zero_hpz`` pins them."""
    rules = target_rules(space)
    node = cluster.domain_gpus  # the GPUs that reach each other over NVLink
    if space.zero_hpz is not None:
        _launched(space, "zero_hpz", max(space.zero_hpz) > 1)
        return [h for h in dict.fromkeys(space.zero_hpz) if h == 1 or not dp % h]
    if rules is None or not rules.zero_hpz or others > 1 or dp <= node or dp % node:
        return [1]
    return [1, node]


def cp_comm_choices(
    model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, tp: int, cp: int
) -> list[tuple[str, int | None]]:
    """The ``Layout.cp_comm_type`` values (with ``cp_a2a_size``) searched at degrees tp and
    cp: the ring alone without context parallelism; else those the space allows (all three
    by default) where the model's heads split over the all-to-all's ranks
    (``costs.blocks.a2a_rule``). a2a+p2p takes its all-to-all over the cp ranks one node
    holds (NVLink) and its ring across the nodes: it is searched where cp spans nodes."""
    if cp == 1:
        return [("p2p", None)]
    node = min(cp, max(1, cluster.domain_gpus // tp))  # cp ranks of one NVLink domain
    out: list[tuple[str, int | None]] = []
    for comm in dict.fromkeys(space.cp_comm_type or ["p2p", "a2a", "a2a+p2p"]):
        if comm == "p2p":
            out.append(("p2p", None))
        elif comm == "a2a" and not a2a_rule(model, tp, cp):
            out.append(("a2a", None))
        elif (
            comm == "a2a+p2p" and 1 < node < cp and not cp % node and not a2a_rule(model, tp, node)
        ):
            out.append(("a2a+p2p", node))
    return out


def fp8_cache_choices(job: TrainingJob, space: SearchSpace) -> list[bool]:
    """The ``Layout.fp8_cache`` values to search: off unless the space allows it. It is open
    to FP8 jobs of the one framework with a switch for it, and trades a quantise and
    dequantise per MLP for memory. It is not searched unless asked: both values double the
    configurations one time budget has to cover, and on DeepSeek-V3 at 2,048 H800 the
    10-second search then ended 38.3 s (gap 73%) instead of 23.1 s (gap 56%)."""
    allowed = job.compute_dtype == "fp8" and framework(job.framework).fp8_cache
    asked = space.fp8_cache or [False]
    if True in asked and not allowed:
        able = names_with(lambda f: f.fp8_cache, quote=True)
        raise PlannerError(
            f"SearchSpace.fp8_cache={asked}: needs compute_dtype='fp8' and framework={able}; "
            f"the job has compute_dtype={job.compute_dtype!r}, framework={job.framework!r}"
        )
    return list(dict.fromkeys(asked))


def listed_recompute(space: SearchSpace) -> frozenset[str]:
    """The space's recompute choices by name (Config.recompute_extra): what the bound
    tables price beside each block's menu. Activation offload is searched apart."""
    if space.recompute is None:
        return frozenset()
    return frozenset(choice_name(parse_recompute(r)) for r in space.recompute) - {"offload"}


def optimizer_offload_choices(job: TrainingJob, space: SearchSpace) -> list[float]:
    """The ``Layout.optimizer_offload`` fractions to search: 0 unless the space asks for
    more, like ``fp8_cache``. Offload frees HBM at the price of a host step and two PCIe
    copies per step; searching it doubles the configurations. The frameworks' rules are
    ``optimizer_offload_rule``'s."""
    asked = sorted(set(space.optimizer_offload or [0.0]))
    for fraction in asked:
        reason = optimizer_offload_rule(job, fraction)
        if reason:
            raise PlannerError(f"SearchSpace.optimizer_offload={asked}: {reason}")
    return asked


def _virtuals(space: SearchSpace, fixed: int | None) -> list[int]:
    """Chunks per rank to search for a schedule that runs ``fixed`` of them (None: any from
    2, ``Schedule.virtual_stages``)."""
    if fixed is None:
        return [v for v in (space.virtual_stages or DEFAULT_VIRTUAL) if v >= 2]
    return [fixed] if not space.virtual_stages or fixed in space.virtual_stages else []


def _tp_fits(model: ModelSpec, tp: int) -> bool:
    try:
        block_cost(model, "layer.0", Shard(seq_len=1, tp=tp))
    except PlannerError:
        return False
    return True


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (in O(sqrt n))."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def check_step_size(cluster: ClusterSpec, job: TrainingJob, space: SearchSpace) -> None:
    """Refuse, in one line, a job whose every layout would hold more than
    ``MAX_MICROBATCHES`` micro-batches a pipeline per step: no data-parallel degree exceeds
    the GPU count, nor a micro-batch the largest the space allows."""
    largest = max(space.micro_batch or DEFAULT_MICRO_BATCHES)
    fewest = math.ceil(job.global_batch / (cluster.num_gpus * largest))
    if fewest > MAX_MICROBATCHES:
        raise PlannerError(
            f"TrainingJob.global_batch={job.global_batch}: every layout on "
            f"{cluster.num_gpus} GPUs holds at least {fewest:,} micro-batches per pipeline a "
            f"step (micro-batch {largest}); the planner costs steps of at most "
            f"{MAX_MICROBATCHES:,}: use fewer sequences per step, more GPUs or a larger "
            "micro-batch"
        )
