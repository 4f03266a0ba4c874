"""Lower bounds on a configuration's step time, and memory floors that rule it out.

Each bound holds for every layout of the configuration under ``planner.steptime``'s formula
(see ``lower_bound``); the search uses them to order configurations and to stop.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

from planner.costs.comm import Network
from planner.errors import PlannerError
from planner.solve.tables import Config, Option, Tables, build, prototype
from planner.specs import ClusterSpec, ModelSpec, TrainingJob


def lower_bound(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> float | None:
    """A step time no layout of ``config`` beats, or None if no layout of it can fit.

    The step is at least the mean over ranks of (own work + own wait). Summed over ranks the
    work is m times every stage's forward and backward (each stage runs every micro-batch
    once), at least every block's cheapest option plus what every schedule but DualPipe
    exposes (all-to-alls, pipeline sends). The mean of the waits is ``order_idle`` at the
    overall mean op times (each stage is among the "others" of equally many ranks; DualPipe's
    correction is convex, so its mean is at least its value at the mean), with each mean
    taken at its lower end where the formula adds it and its upper end where it subtracts."""
    t = bound_tables(model, cluster, job, config)
    if t is None or any(not k.options for k in t.kinds.values()):
        return None
    if not _fits_at_all(t, cluster, job, config):
        return None
    if config.ema == "host" and not host_fits(t, cluster, config):
        return None
    S, m, p = config.stages, config.num_microbatches, config.pp
    blocks = t.layer_kinds + t.first_fixed + t.last_fixed
    count = Counter(blocks)
    opts = {b: t.kinds[b].options for b in count}

    def total(per_kind: Callable[[list[Option]], float]) -> float:
        return sum(n * per_kind(opts[b]) for b, n in count.items())

    forced = _forced_recompute(model, t, cluster, job, config)
    if forced is None:
        return None  # even recomputing everything leaves too many activations
    moe = sum(n * t.kinds[b].cost.moe_layers for b, n in count.items())
    dual = config.schedule in ("dualpipe", "dualpipev")
    fpair, comb = min(t.forward_pair), min(t.combine)
    sends_f = 0.0 if dual else moe * fpair + sum(t.p2p)
    sends_b = 0.0 if dual else moe * 2 * comb + sum(t.p2p_back)
    fwd = total(lambda os: min(o.row.fwd for o in os))
    bin_lo = total(lambda os: min(o.row.bwd_input for o in os)) + forced
    bin_hi = total(lambda os: max(o.row.bwd_input for o in os))
    bw = total(lambda os: os[0].row.bwd_weight)  # recompute does not change it
    g_lo, g_hi = _collective(t, "gather", low=True), _collective(t, "gather", low=False)
    r_lo, r_hi = _collective(t, "reduce", low=True), _collective(t, "reduce", low=False)
    # Sums over stages of each op's time: a max of work (+ exposed sends) and ZeRO comm.
    f_lo = max(fwd + sends_f, g_lo)
    b_lo = max(bin_lo + sends_b, g_lo)
    w_lo, w_hi = max(bw, r_lo), bw + r_hi
    bw_lo = max(bin_lo + bw + sends_b, g_lo + r_lo)
    f_hi = fwd + moe * fpair + sum(t.p2p) + g_hi
    b_hi = bin_hi + moe * (2 * comb + fpair) + sum(t.p2p_back) + g_hi
    lin, k = t.idle_linear, t.idle_k
    tail = _optimizer_floor(t, config)
    if config.schedule == "zb-h1":
        # F, B and W each run m times on their stage and enter the wait with (p-1)(F+B-W):
        # W's net coefficient is m/p - (p-1)/S.
        net = m / p - lin["f"] / S
        return (m / p + lin["f"] / S) * (f_lo + b_lo) + net * (w_lo if net >= 0 else w_hi) + tail
    busy = m * (f_lo + bw_lo) / p
    if dual:
        # Every task lasts at least its communication too (a pair: max(compute, comm)).
        comm = moe * (fpair + 2 * comb) + sum(t.p2p) + sum(t.p2p_back)
        busy = max(busy, m * comm / p)
    if not dual:
        return busy + (lin["f"] * f_lo + lin["b"] * b_lo + lin["w"] * w_lo) / S + tail
    # DualPipe: k'(FB + B - 2W), with FB >= F + BW (a pair holds a forward and a full
    # backward) >= F + B + W and >= F + W: at least k'(F + 2B - W_hi) or k'(F + B - W_hi)...
    # the first needs only FB >= F + B + W, the second also W <= BW; take the larger.
    k1 = lin["fb"]
    idle = k1 * max(f_lo + 2 * b_lo + w_lo - 2 * w_hi, f_lo + b_lo - w_hi) / S
    assert k is not None
    idle += max(k * (f_lo - b_hi), -f_hi) / S
    return busy + idle + tail


def _forced_recompute(
    model: ModelSpec, t: Tables, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> float | None:
    """The least recompute time (seconds per micro-batch, all layers) that makes the ranks'
    activations fit together, or None if none does.

    Summed over ranks, the memory peaks hold every rank's state and buffers plus, at the
    least, each stage's saved bytes times the micro-batches its holders keep in flight
    (``schedules.in_flight``), at least ``w`` (the smallest such count) per stage. So the
    layers' saved bytes may total at most (ranks x usable - state) / w; the cheapest way
    there is the fractional multiple-choice knapsack over the recompute options (convex
    hull, cheapest seconds per byte first), a bound on any integral choice."""
    from planner.schedules import in_flight

    usable = (cluster.hbm_bytes - job.cuda_context_bytes) / (1 + job.fragmentation)
    copies = 2 if config.schedule == "dualpipe" else 1
    state = copies * sum(gpu_state(t.kinds[k].state) for k in t.layer_kinds)
    state += sum(gpu_state(s) for s in t.fixed_state) + config.pp * t.buffers
    proto = prototype(model, config)
    weight = [0.0] * config.stages
    for r in range(config.pp):
        for stage, count in in_flight(proto, r, config.num_microbatches).items():
            weight[stage] += count
    w = min(weight)
    fixed = t.first_fixed + t.last_fixed
    fixed_saved = sum(min(o.saved for o in t.kinds[b].options) for b in fixed)
    budget = (config.pp * usable - state) / w - fixed_saved
    kinds: dict[str, int] = {}
    for k in t.layer_kinds:
        kinds[k] = kinds.get(k, 0) + 1
    hulls = {k: _hull(t.kinds[k].options) for k in kinds}
    saved = sum(n * hulls[k][0][0] for k, n in kinds.items())
    if saved <= budget:
        return 0.0
    steps = []  # (seconds per byte saved, bytes saved, seconds) for every layer of a kind
    for k, n in kinds.items():
        h = hulls[k]
        for (s0, t0), (s1, t1) in itertools.pairwise(h):
            steps.append(((t1 - t0) / (s0 - s1), n * (s0 - s1), n * (t1 - t0)))
    extra = 0.0
    for _rate, gain, cost in sorted(steps):  # cheapest seconds per byte first
        need = saved - budget
        if need <= 0:
            break
        take = min(1.0, need / gain)
        saved -= take * gain
        extra += take * cost
    return extra if saved <= budget * (1 + 1e-12) else None


def _hull(options: list[Option]) -> list[tuple[float, float]]:
    """(saved bytes, seconds) of the options on the lower convex hull of the time each saved
    budget costs, fastest (most bytes) first."""
    efficient: list[tuple[float, float]] = []
    for saved, seconds in sorted({(o.saved, o.time) for o in options}):
        if not efficient or seconds < efficient[-1][1]:  # less time than anything leaner
            efficient.append((saved, seconds))
    hull: list[tuple[float, float]] = []
    for pt in efficient:  # ascending bytes, descending time: keep the convex lower chain
        while len(hull) >= 2:
            (s0, t0), (s1, t1) = hull[-2], hull[-1]
            if (t1 - t0) * (pt[0] - s0) >= (pt[1] - t0) * (s1 - s0):
                hull.pop()  # hull[-1] lies on or above the chord from hull[-2] to pt
            else:
                break
        hull.append(pt)
    return hull[::-1]


def _optimizer_floor(t: Tables, config: Config) -> float:
    """The mean rank's optimizer step: the tail is at least the largest rank's."""
    copies = 2 if config.schedule == "dualpipe" else 1

    def traffic(state: dict[str, float]) -> float:
        return 2 * state["optimizer"] + state["grads"] + state["weights"] + 2 * state["ema"]

    total = copies * sum(traffic(t.kinds[k].state) for k in t.layer_kinds)
    total += sum(traffic(s) for s in t.fixed_state)
    return total / config.pp / t.opt_Bps


def _collective(t: Tables, kind: str, *, low: bool) -> float:
    """ZeRO reduce-scatters ("reduce") or all-gathers ("gather") summed over stages, at the
    cheapest (``low``) or costliest stage's rate: all the bytes, plus every stage's latency
    (an expert latency only counts once at the low end: one stage may hold every expert)."""
    reduce = kind == "reduce"
    dense = sum(t.kinds[k].dense_grad if reduce else t.kinds[k].dense_weight for k in t.layer_kinds)
    expert = sum(
        t.kinds[k].expert_grad if reduce else t.kinds[k].expert_weight for k in t.layer_kinds
    )
    for d, e in t.fixed_grad if reduce else t.fixed_weight:
        dense, expert = dense + d, expert + e
    pairs = list(
        zip(
            t.reduce_dense if reduce else t.gather_dense,
            t.reduce_expert if reduce else t.gather_expert,
            strict=True,
        )
    )
    pick = min if low else max
    a_d, a_e = pick(d.a for d, _ in pairs), pick(e.a for _, e in pairs)
    c_d, c_e = pick(d.c for d, _ in pairs), pick(e.c for _, e in pairs)
    stages = len(pairs)
    expert_latency = (c_e if expert else 0.0) * (1 if low else stages)
    return a_d * dense + a_e * expert + stages * c_d + expert_latency


def _fits_at_all(tables: Tables, cluster: ClusterSpec, job: TrainingJob, config: Config) -> bool:
    """Every rank holds its share of the model state: if the average share alone is over
    the usable HBM, no partition fits."""
    usable = (cluster.hbm_bytes - job.cuda_context_bytes) / (1 + job.fragmentation)
    # Pigeonhole: some rank holds at least ceil(layer copies / pp) layers.
    copies = 2 if config.schedule == "dualpipe" else 1
    most = -(-copies * len(tables.layer_kinds) // config.pp)
    lightest = min(gpu_state(tables.kinds[k].state) for k in set(tables.layer_kinds))
    heaviest_rank = most * lightest + tables.buffers
    return max(memory_floor(tables, config), heaviest_rank) <= usable


def host_fits(tables: Tables, cluster: ClusterSpec, config: Config) -> bool:
    """The average rank's host-RAM EMA, times the GPUs of a node, within the node's RAM."""
    copies = 2 if config.schedule == "dualpipe" else 1
    host = copies * sum(tables.kinds[k].state["host"] for k in tables.layer_kinds)
    host += sum(s["host"] for s in tables.fixed_state)
    per_node = min(cluster.gpus_per_node, cluster.num_gpus)
    return host / config.pp * per_node <= cluster.host_ram_bytes


def memory_floor(tables: Tables, config: Config) -> float:
    """The average rank's model state and buffers (bytes): some rank needs at least this."""
    state = sum(gpu_state(tables.kinds[k].state) for k in tables.layer_kinds)
    copies = 2 if config.schedule == "dualpipe" else 1  # DualPipe keeps two copies
    fixed = sum(gpu_state(s) for s in tables.fixed_state)
    return (copies * state + fixed) / config.pp + tables.buffers


def gpu_state(s: dict[str, float]) -> float:
    return s["weights"] + s["grads"] + s["optimizer"] + s["ema"]


_TABLES: dict[tuple[object, ...], Tables | None] = {}


def bound_tables(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> Tables | None:
    key = (model, cluster.model_dump_json(), job, config)
    if key not in _TABLES:
        if len(_TABLES) > 50_000:  # a long sweep must not grow without bound
            _TABLES.clear()
        try:
            _TABLES[key] = build(model, cluster, job, config, Network.of(cluster), light=True)
        except PlannerError:
            _TABLES[key] = None
    return _TABLES[key]
