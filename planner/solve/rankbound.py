"""A lower bound from the heaviest rank: whole layers cannot be split between ranks.

``bounds.lower_bound`` spreads the work perfectly over the ranks. Layers are indivisible, so
some rank carries more than the mean (126 Llama-3 layers on 16 ranks: some rank runs 8, not
7.875), and every rank's own term in the objective, its work plus its wait on the others,
grows with what it holds far faster than the wait shrinks. This bound takes, for every rank,
a linear lower bound on that term in the rank's count of each layer kind (its fixed blocks,
sends and pipeline wait as a constant), and finds the least T such that whole layers can be
dealt to the ranks with every rank's term at most T: a relaxation (stage order, recompute
choices and ZeRO communication are dropped; each op takes its cheapest option), so T plus
the optimizer floor is a lower bound on every layout of the configuration.

Per rank r and layer kind k the coefficient is the smallest over r's chunks of that chunk's
per-layer work in the rank's op order (a forward per F, an input backward per B, a weight
backward per W, a DualPipe pair's work slowed by the communication's SM share where the pair
surely communicates), less what the layer takes off r's wait: ``order_idle`` over the other
stages, each other stage's op at most its dearest option plus its communication.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass

from planner.costs.timing import OVERLAP_SM_SHARE
from planner.solve.bounds import _optimizer_floor, bound_tables
from planner.solve.tables import Config, Tables, rank_orders
from planner.specs import ClusterSpec, ModelSpec, TrainingJob

SLOW = 1 / (1 - OVERLAP_SM_SHARE)


@dataclass(frozen=True)
class _Block:
    """Per micro-batch op times of one block: lowest and highest over its options."""

    f: float
    b: float
    w: float
    f_hi: float
    b_hi: float
    w_hi: float


def heaviest_rank_bound(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> float | None:
    """A step time no layout of ``config`` beats (see the module docstring), or None when
    the configuration has no tables (its degrees do not divide the model)."""
    terms = _rank_terms(model, cluster, job, config)
    if terms is None:
        return None
    const, coef, need, tail = terms
    return _least_threshold(const, coef, need) + tail


def rank_balanced_counts(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> list[int] | None:
    """Layers per stage that make the ranks' terms (see the module docstring) as even as
    whole layers allow: each layer goes to the rank it raises least, then each rank's
    layers are split evenly over its chunks. A starting point for the solver (None for
    DualPipe, whose two copies of a stage must hold the same layers)."""
    terms = _rank_terms(model, cluster, job, config)
    if terms is None or config.schedule == "dualpipe":
        return None
    const, coef, need, _ = terms
    orders = rank_orders(config.schedule, config.pp, config.num_microbatches, config.virtual_stages)
    S = config.stages
    # Every stage but the first and last holds a layer.
    held = [sum(1 for c in o.chunks if 0 < c < S - 1) for o in orders]
    per_layer = [row[-1] for row in coef]  # the most common kind's cost
    if sum(held) > sum(need):
        return None
    heap = [(const[r] + (held[r] + 1) * per_layer[r], r) for r in range(len(orders))]
    heapq.heapify(heap)
    for _ in range(sum(need) - sum(held)):
        _, r = heapq.heappop(heap)
        held[r] += 1
        heapq.heappush(heap, (const[r] + (held[r] + 1) * per_layer[r], r))
    counts = [0] * S
    for r, o in enumerate(orders):
        chunks = sorted(o.chunks)
        n = held[r]
        inner = [c for c in chunks if 0 < c < S - 1]
        for c in inner:  # one each, then the rest as evenly as possible over all chunks
            counts[c] = 1
        n -= len(inner)
        for i in range(n):
            counts[chunks[i % len(chunks)]] += 1
    return counts if sum(counts) == model.num_layers else None


def _rank_terms(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> tuple[list[float], list[list[float]], list[int], float] | None:
    """Per rank: the constant and per-layer coefficients (one per layer kind, fewest kind
    first) of its term's lower bound; the layers of each kind to deal (every copy); the
    optimizer floor."""
    t = bound_tables(model, cluster, job, config)
    if t is None or any(not k.options for k in t.kinds.values()):
        return None
    orders = rank_orders(config.schedule, config.pp, config.num_microbatches, config.virtual_stages)
    dual = config.schedule in ("dualpipe", "dualpipev")
    blocks = {k: _block(t, k, dual) for k in t.kinds}
    S = config.stages
    fixed_at = (
        {0: t.first_fixed, S - 1: t.last_fixed} if S > 1 else {0: t.first_fixed + t.last_fixed}
    )
    layer_count = Counter(t.layer_kinds)
    kinds = sorted(layer_count, key=lambda k: (layer_count[k], k))  # fewest first: the DP state
    copies = 2 if config.schedule == "dualpipe" else 1

    # Every stage's ops summed (each stage once, also under DualPipe's two copies), at their
    # lowest and highest: the wait sums them over the stages a rank does not hold.
    def total(attr: str) -> float:
        layers = sum(n * _get(blocks[k], attr) for k, n in layer_count.items())
        fixed = sum(_get(blocks[b], attr) for bs in fixed_at.values() for b in bs)
        consts = (_stage_lo(t, s, dual) if attr in "fbw" else _stage_hi(t, s) for s in range(S))
        return layers + fixed + sum(c.get(attr, 0.0) for c in consts)

    lin, n_o, zero = t.idle_linear, t.others, config.zero
    totals = {a: total(a) for a in ("f", "b", "w", "f_hi", "b_hi", "w_hi")}
    # The wait is lin * (the others' ops) / n_o = lin * (every stage's - own) / n_o: every
    # stage's at its lowest (highest where lin < 0), and own subtracted as below.
    wait = sum(c * totals[key if c > 0 else key + "_hi"] for key, c in lin.items() if key != "fb")
    if lin["fb"]:
        wait += lin["fb"] * (totals["f"] + totals["b"] + totals["w"])
    if t.idle_k is not None:
        wait -= totals["f_hi"]  # DualPipe's correction is at least minus the others' F
    const: list[float] = []
    coef: list[dict[str, float]] = []
    for order in orders:
        per_chunk = _chunk_coefficients(order.tasks, t, dual)
        rank_const = wait / n_o
        row = dict.fromkeys(layer_count, math.inf)
        for c in order.chunks:
            counts = per_chunk[c]

            def term(lo: _Block | dict[str, float], hi: _Block | dict[str, float]) -> float:
                return _term(counts, lo, hi, lin, n_o, dual=dual, zero=zero)  # noqa: B023

            fixed = fixed_at.get(c, [])
            rank_const += sum(term(blocks[b], blocks[b]) for b in fixed)
            rank_const += term(_stage_lo(t, c, dual), _stage_hi(t, c))
            for k in layer_count:
                row[k] = min(row[k], term(blocks[k], blocks[k]))
        const.append(rank_const)
        coef.append(row)
    need = [copies * layer_count[k] for k in kinds]
    return const, [[row[k] for k in kinds] for row in coef], need, _optimizer_floor(t, config)


def _block(t: Tables, kind: str, dual: bool) -> _Block:
    k = t.kinds[kind]
    rows = [o.row for o in k.options]
    moe = k.cost.moe_layers
    # Exposed all-to-alls (every schedule but DualPipe's pairs): the cheapest stage's rate.
    a2a_f = 0.0 if dual else moe * min(t.forward_pair, default=0.0)
    a2a_b = 0.0 if dual else moe * 2 * min(t.combine, default=0.0)
    hi_f = moe * max(t.forward_pair, default=0.0)
    hi_b = moe * (2 * max(t.combine, default=0.0) + max(t.forward_pair, default=0.0))
    gather = _max_a(t.gather_dense) * k.dense_weight + _max_a(t.gather_expert) * k.expert_weight
    reduce = _max_a(t.reduce_dense) * k.dense_grad + _max_a(t.reduce_expert) * k.expert_grad
    w = rows[0].bwd_weight  # recompute does not change it
    return _Block(
        f=min(r.fwd for r in rows) + a2a_f,
        b=min(r.bwd_input for r in rows) + a2a_b,
        w=w,
        f_hi=max(r.fwd for r in rows) + hi_f + gather,
        b_hi=max(r.bwd_input for r in rows) + hi_b + gather,
        w_hi=w + reduce,
    )


def _max_a(affines: list) -> float:  # type: ignore[type-arg]
    return max((a.a for a in affines), default=0.0)


def _term(
    counts: dict[str, float],
    lo: _Block | dict[str, float],
    hi: _Block | dict[str, float],
    lin: dict[str, float],
    n_o: int,
    *,
    dual: bool,
    zero: int,
) -> float:
    """What holding something with these op times (lowest ``lo``, highest ``hi``) in a chunk
    run ``counts`` times adds to its rank's term: its ops' work, less what they take off
    the rank's wait on the others."""
    out = 0.0
    for op in ("f", "b", "w"):
        x_lo, x_hi = _get(lo, op), _get(hi, op + "_hi")
        runs = counts[op.upper()] + counts["s" + op.upper()]
        share = lin[op] / n_o  # what one op of its takes off the wait
        # The wait counts the op the rank runs, unless a fused BW runs instead and ZeRO
        # communication may make the split ops differ from it.
        same = op == "f" or zero <= 1 or not counts["BW"]
        if not dual and same and runs - share >= 0:
            out += (runs - share) * x_lo  # one op time, net of the wait
        else:
            out += runs * x_lo - share * (x_hi if share > 0 else x_lo)
    if lin["fb"]:
        pair_hi = sum(_get(hi, a) for a in ("f_hi", "b_hi", "w_hi")) * SLOW
        out -= lin["fb"] / n_o * pair_hi
    return out


def _get(values: _Block | dict[str, float], attr: str) -> float:
    return float(getattr(values, attr)) if isinstance(values, _Block) else values.get(attr, 0.0)


def _stage_lo(t: Tables, s: int, dual: bool) -> dict[str, float]:
    """A stage's own constants in its ops, at the least: its sends, exposed unless DualPipe
    pairs them."""
    return {} if dual else {"f": t.p2p[s], "b": t.p2p_back[s]}


def _stage_hi(t: Tables, s: int) -> dict[str, float]:
    """... and at the most: sends and every collective's latency."""
    gather = t.gather_dense[s].c + t.gather_expert[s].c
    return {
        "f_hi": t.p2p[s] + gather,
        "b_hi": t.p2p_back[s] + gather,
        "w_hi": t.reduce_dense[s].c + t.reduce_expert[s].c,
    }


def _chunk_coefficients(
    tasks: Counter[tuple[object, ...]], t: Tables, dual: bool
) -> dict[int, dict[str, float]]:
    """Per chunk: how many times its F, B and W work runs on the rank, the extra share of
    that work slowed in pairs that surely communicate (a pipeline send is part of them)."""
    out: dict[int, dict[str, float]] = {}

    def row(s: object) -> dict[str, float]:
        assert isinstance(s, int)
        return out.setdefault(s, dict.fromkeys(("F", "B", "W", "BW", "sF", "sB", "sW"), 0.0))

    for task, n in tasks.items():
        kind = task[0]
        if kind == "pair":
            f, b, bkind = task[1], task[2], task[3]
            assert isinstance(f, int) and isinstance(b, int)
            sure = t.p2p[f] > 0 or t.p2p_back[b] > 0
            extra = (SLOW - 1) * n if sure else 0.0
            row(f)["F"] += n
            row(f)["sF"] += extra
            row(b)["B"] += n
            row(b)["sB"] += extra
            if bkind == "BW":
                row(b)["W"] += n
                row(b)["sW"] += extra
            continue
        s = task[1]
        assert isinstance(s, int)
        r = row(s)
        if kind == "F":
            r["F"] += n
        if kind in ("B", "BW"):
            r["B"] += n
        if kind in ("W", "BW"):
            r["W"] += n
        if kind == "BW":
            r["BW"] += n
    return out


def _least_threshold(const: list[float], coef: list[list[float]], need: list[int]) -> float:
    """The least T such that whole layers (``need[k]`` of kind k) can be dealt to the ranks
    with const[r] + sum_k n[r][k] coef[r][k] <= T on every rank (bisection to 1e-6)."""
    if any(c <= 0 for row in coef for c in row):
        return max(const)  # a layer that costs its rank nothing: no integrality to use
    lo = max(const)
    hi = max(const) + sum(max(row[k] for row in coef) * n for k, n in enumerate(need))
    for _ in range(60):
        if hi - lo <= 1e-6 * hi:
            break
        mid = (lo + hi) / 2
        if _deal(mid, const, coef, need):
            hi = mid
        else:
            lo = mid
    return lo


def _deal(T: float, const: list[float], coef: list[list[float]], need: list[int]) -> bool:
    """Can the layers be dealt with every rank's term at most T? One kind: each rank takes
    as many as fit. Two kinds: a DP over ranks on how many of the fewer kind are placed,
    maximising the other kind placed."""
    if not need:
        return all(c <= T for c in const)
    if len(need) == 1:
        room = 0
        for c, row in zip(const, coef, strict=True):
            if c > T:
                return False
            room += math.floor((T - c) / row[0] + 1e-9)
            if room >= need[0]:
                return True
        return room >= need[0]
    assert len(need) == 2, "layer kinds are dense and MoE"
    few, many = need
    best = [0] + [-1] * few  # best[j]: most of the second kind placed with j of the first
    for c, (a, b) in zip(const, coef, strict=True):
        if c > T:
            return False
        take = [
            math.floor((T - c - d * a) / b + 1e-9) if T - c - d * a >= 0 else -1
            for d in range(few + 1)
        ]
        new = [-1] * (few + 1)
        for j in range(few + 1):
            if best[j] < 0:
                continue
            for d in range(few + 1 - j):
                if take[d] < 0:
                    break
                new[j + d] = max(new[j + d], best[j] + take[d])
        best = new
        if best[few] >= many:
            return True
    return best[few] >= many
