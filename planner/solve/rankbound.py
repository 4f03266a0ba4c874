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

import dataclasses
import functools
import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from planner.costs.timing import OVERLAP_SM_SHARE
from planner.solve.bounds import _hull, _optimizer_floor, bound_tables, gpu_state
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
    gather: float = 0.0  # ZeRO-3 all-gather at the cheapest stage's rate
    reduce: float = 0.0  # ZeRO-2/3 reduce-scatter at the cheapest stage's rate
    a2a: bool = False  # its ops surely communicate (MoE all-to-alls)


def heaviest_rank_bound(
    model: ModelSpec, cluster: ClusterSpec, job: TrainingJob, config: Config
) -> float | None:
    """A step time no layout of ``config`` beats (see the module docstring): ``math.inf``
    when no dealing of the layers fits every rank's memory, None when the configuration has
    no tables (its degrees do not divide the model)."""
    terms = _rank_terms(model, cluster, job, config)
    if terms is None:
        return None
    tables, need, tail = terms
    return _least_threshold(tables, need) + tail


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
    tables, need, _ = terms
    orders = rank_orders(config.schedule, config.pp, config.num_microbatches, config.virtual_stages)
    S = config.stages
    # Every stage but the first and last holds a layer. Costs: the most common kind's.
    held = [sum(1 for c in o.chunks if 0 < c < S - 1) for o in orders]
    rows = [table[0] for table in tables]
    if sum(held) > sum(need) or any(h >= len(row) for h, row in zip(held, rows, strict=True)):
        return None

    def next_cost(r: int) -> float:
        n = held[r] + 1
        return float(rows[r][n]) if n < len(rows[r]) else math.inf

    heap = [(next_cost(r), r) for r in range(len(orders))]
    heapq.heapify(heap)
    for _ in range(sum(need) - sum(held)):
        _, r = heapq.heappop(heap)
        held[r] += 1
        heapq.heappush(heap, (next_cost(r), r))
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
) -> tuple[list[np.ndarray], list[int], float] | None:
    """Per rank, its term's lower bound for every count of each layer kind it might hold
    (a table indexed [fewer kind][more common kind]; ``inf`` where they cannot fit its
    memory); the layers of each kind to deal (every copy, fewer kind first); the optimizer
    floor."""
    t = bound_tables(model, cluster, job, config)
    if t is None or any(not k.options for k in t.kinds.values()):
        return None
    orders = rank_orders(config.schedule, config.pp, config.num_microbatches, config.virtual_stages)
    dual = config.schedule in ("dualpipe", "dualpipev")
    layer_count = Counter(t.layer_kinds)
    raw = {k: _block(t, k, dual) for k in t.kinds}
    lam_f, lam_b = _pieces(raw, max(layer_count, key=lambda k: (layer_count[k], k)))
    blocks = {k: _weighted(b, lam_f, lam_b) for k, b in raw.items()}
    S = config.stages
    fixed_at = (
        {0: t.first_fixed, S - 1: t.last_fixed} if S > 1 else {0: t.first_fixed + t.last_fixed}
    )
    kinds = sorted(layer_count, key=lambda k: (layer_count[k], k))  # fewest first: the DP state
    copies = 2 if config.schedule == "dualpipe" else 1

    # Every stage's ops summed (each stage once, also under DualPipe's two copies), at their
    # lowest and highest: the wait sums them over the stages a rank does not hold.
    def total(attr: str) -> float:
        layers = sum(n * _get(blocks[k], attr) for k, n in layer_count.items())
        fixed = sum(_get(blocks[b], attr) for bs in fixed_at.values() for b in bs)
        consts = (
            _stage_lo(t, s, dual, lam_f, lam_b) if attr in "fbw" else _stage_hi(t, s)
            for s in range(S)
        )
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
    need = [copies * layer_count[k] for k in kinds]
    if len(kinds) == 1:
        need = [0, *need]
    usable = (cluster.hbm_bytes - job.cuda_context_bytes) / (1 + job.fragmentation)
    hulls = {k: _hull(t.kinds[k].options) for k in kinds}
    tables: list[np.ndarray] = []
    for r, order in enumerate(orders):
        per_chunk = _chunk_coefficients(order.tasks, t, dual)
        rank_const = wait / n_o
        row = dict.fromkeys(layer_count, math.inf)
        b_mult = math.inf  # what a second more of one layer's backward adds to the term
        for c in order.chunks:
            counts = per_chunk[c]

            def term(lo: _Block | dict[str, float], hi: _Block | dict[str, float]) -> float:
                return _term(counts, lo, hi, lin, n_o, dual=dual, zero=zero)  # noqa: B023

            fixed = fixed_at.get(c, [])
            rank_const += sum(term(blocks[b], blocks[b]) for b in fixed)
            rank_const += term(_stage_lo(t, c, dual, lam_f, lam_b), _stage_hi(t, c))
            for k in layer_count:
                # A chunk with an MoE layer makes every pair it is in communicate.
                sure = _surely_slowed(counts) if blocks[k].a2a else counts
                value = _term(sure, blocks[k], blocks[k], lin, n_o, dual=dual, zero=zero)
                row[k] = min(row[k], value)
            b_only = _Block(0.0, 1.0, 0.0, 0.0, 0.0, 0.0)  # a backward of 1 s, nothing else
            b_mult = min(b_mult, _term(counts, b_only, b_only, lin, n_o, dual=dual, zero=zero))
        b_mult *= lam_b  # recompute lengthens the work, not the communication
        # Memory: besides its state and buffers, the rank holds at some moment at least
        # ``w`` micro-batches' worth of whatever its chunks save (see ``_in_flight``).
        w = _in_flight(
            config.schedule, config.pp, config.num_microbatches, config.virtual_stages, r
        )
        fixed = [b for c in order.chunks for b in fixed_at.get(c, [])]
        fixed_saved = sum(min(o.saved for o in t.kinds[b].options) for b in fixed)
        room = usable - gpu_state(t.fixed_state[r]) - t.buffers - w * fixed_saved
        kinds2 = kinds if len(kinds) == 2 else [None, kinds[0]]
        tables.append(
            _term_table(
                rank_const,
                [row[k] if k else 0.0 for k in kinds2],
                need,
                [gpu_state(t.kinds[k].state) if k else 0.0 for k in kinds2],
                [hulls[k] if k else [(0.0, 0.0)] for k in kinds2],
                w,
                room,
                b_mult,
            )
        )
    return tables, need, _optimizer_floor(t, config)


@functools.lru_cache(maxsize=4096)
def _in_flight(schedule: str, pp: int, m: int, v: int, rank: int) -> float:
    """The least w such that, however a rank's saved bytes X split over its chunks, some
    activation level of its op order holds at least w X: the value of the game min over
    splits x of max over levels l of sum_c count[l][c] x[c] (a small LP)."""
    levels = [counts for counts, _ in rank_orders(schedule, pp, m, v)[rank].levels]
    if len(levels[0]) == 1:
        return float(max(c[0] for c in levels))
    solver = pywraplp.Solver.CreateSolver("GLOP")
    x = [solver.NumVar(0.0, 1.0, f"x{c}") for c in range(len(levels[0]))]
    z = solver.NumVar(0.0, solver.infinity(), "z")
    solver.Add(sum(x) == 1)
    for counts in levels:
        solver.Add(sum(n * xc for n, xc in zip(counts, x, strict=True)) <= z)
    solver.Minimize(z)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return float(max(min(c) for c in levels))
    # Never above the exact answer: GLOP's tolerance taken off, and at least the plain bound.
    return max(float(max(min(c) for c in levels)), float(z.solution_value()) * (1 - 1e-7))


def _term_table(
    const: float,
    coef: list[float],
    need: list[int],
    state: list[float],
    hulls: list[list[tuple[float, float]]],
    w: float,
    room: float,
    b_mult: float,
) -> np.ndarray:
    """A rank's term for d layers of the first kind and e of the second: its constant, its
    per-layer work, and the least recompute that brings w micro-batches of its layers'
    activations and their state within ``room`` bytes (the fractional multiple-choice
    knapsack over each kind's convex hull of options: cheapest seconds per byte first)."""
    d = np.arange(need[0] + 1, dtype=float)[:, None]
    e = np.arange(need[1] + 1, dtype=float)[None, :]
    n = (d, e)
    term = const + coef[0] * d + coef[1] * e
    # Bytes to shed beyond room with every layer at its fastest (most memory) option.
    excess = w * (hulls[0][0][0] * d + hulls[1][0][0] * e) + state[0] * d + state[1] * e - room
    excess = np.maximum(excess, 0.0) + 0.0 * term
    steps = []  # (seconds per byte, kind, bytes per layer)
    for k, hull in enumerate(hulls if w else []):
        for (s0, t0), (s1, t1) in itertools.pairwise(hull):
            steps.append((b_mult * (t1 - t0) / (w * (s0 - s1)), k, w * (s0 - s1)))
    extra = np.zeros_like(term)
    for rate, k, per_layer in sorted(steps):
        take = np.minimum(excess, per_layer * n[k])
        extra += rate * take
        excess -= take
    term = term + extra
    term[excess > 1e-6 * max(room, 1.0)] = math.inf
    return term


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
        gather=_min_a(t.gather_dense) * k.dense_weight + _min_a(t.gather_expert) * k.expert_weight,
        reduce=_min_a(t.reduce_dense) * k.dense_grad + _min_a(t.reduce_expert) * k.expert_grad,
        a2a=moe > 0 and min(t.forward_pair, default=0.0) > 0,
    )


def _pieces(blocks: dict[str, _Block], dominant: str) -> tuple[float, float]:
    """An op lasts max(its work, its ZeRO communication), at least any weighted mean of the
    two: weight 1 on the work (0 on the communication) where the most common layer's work is
    the larger. The forward's weight, and the backward's (B and W share one: a fused BW
    lasts max(b + w, gather + reduce))."""
    d = blocks[dominant]
    return float(d.f >= d.gather), float(d.b + d.w >= d.gather + d.reduce)


def _weighted(block: _Block, lam_f: float, lam_b: float) -> _Block:
    return dataclasses.replace(
        block,
        f=lam_f * block.f + (1 - lam_f) * block.gather,
        b=lam_b * block.b + (1 - lam_b) * block.gather,
        w=lam_b * block.w + (1 - lam_b) * block.reduce,
    )


def _min_a(affines: list) -> float:  # type: ignore[type-arg]
    return min((a.a for a in affines), default=0.0)


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


def _stage_lo(t: Tables, s: int, dual: bool, lam_f: float, lam_b: float) -> dict[str, float]:
    """A stage's own constants in its ops, at the least: its sends, exposed unless DualPipe
    pairs them (weighted as the ops' work, see ``_pieces``)."""
    return {} if dual else {"f": lam_f * t.p2p[s], "b": lam_b * t.p2p_back[s]}


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
    that work slowed in pairs that surely communicate (a pipeline send is part of them), and
    in all its pairs (for blocks whose all-to-alls make every pair communicate)."""
    out: dict[int, dict[str, float]] = {}

    def row(s: object) -> dict[str, float]:
        assert isinstance(s, int)
        return out.setdefault(
            s, dict.fromkeys(("F", "B", "W", "BW", "sF", "sB", "sW", "pF", "pB", "pW"), 0.0)
        )

    for task, n in tasks.items():
        kind = task[0]
        if kind == "pair":
            f, b, bkind = task[1], task[2], task[3]
            assert isinstance(f, int) and isinstance(b, int)
            sure = t.p2p[f] > 0 or t.p2p_back[b] > 0
            extra = (SLOW - 1) * n if sure else 0.0
            slowed = (SLOW - 1) * n  # if the pair communicates at all
            row(f)["F"] += n
            row(f)["sF"] += extra
            row(f)["pF"] += slowed
            row(b)["B"] += n
            row(b)["sB"] += extra
            row(b)["pB"] += slowed
            if bkind == "BW":
                row(b)["W"] += n
                row(b)["sW"] += extra
                row(b)["pW"] += slowed
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


def _surely_slowed(counts: dict[str, float]) -> dict[str, float]:
    """``counts`` for a block whose own all-to-alls make each of its pairs communicate."""
    return {**counts, "sF": counts["pF"], "sB": counts["pB"], "sW": counts["pW"]}


def _least_threshold(tables: list[np.ndarray], need: list[int]) -> float:
    """The least T such that whole layers (``need``: of the first kind, of the second) can
    be dealt to the ranks with every rank's term at most T (bisection to 1e-6); ``inf``
    when no dealing fits."""
    lo = max(float(table[0, 0]) for table in tables)
    finite = [table[np.isfinite(table)] for table in tables]
    hi = max(float(f.max()) for f in finite if f.size) if any(f.size for f in finite) else lo
    if not math.isfinite(lo) or not _deal(hi, tables, need):
        return math.inf
    for _ in range(60):
        if hi - lo <= 1e-6 * hi:
            break
        mid = (lo + hi) / 2
        if _deal(mid, tables, need):
            hi = mid
        else:
            lo = mid
    return lo


def _deal(T: float, tables: list[np.ndarray], need: list[int]) -> bool:
    """Can the layers be dealt with every rank's term at most T? A DP over the ranks on how
    many of the first kind are placed, maximising the second kind placed (each rank's table
    grows along the second kind, so it takes as many as stay within T)."""
    few, many = need
    best = np.full(few + 1, -1, dtype=np.int64)
    best[0] = 0
    for table in tables:
        # take[d]: most of the second kind the rank holds with d of the first (-1: none).
        take = (table <= T).sum(axis=1) - 1
        new = np.full(few + 1, -1, dtype=np.int64)
        for j in np.nonzero(best >= 0)[0]:
            room = few - j
            cand = best[j] + take[: room + 1]
            cand[take[: room + 1] < 0] = -1
            new[j : j + room + 1] = np.maximum(new[j : j + room + 1], cand)
        best = new
        if best[few] >= many:
            return True
    return bool(best[few] >= many)
