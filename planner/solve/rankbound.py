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

import functools
import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
from ortools.linear_solver import pywraplp

from planner.costs.timing import OVERLAP_SM_SHARE
from planner.solve.bounds import _hull, _optimizer_floor, bound_tables, gpu_state
from planner.solve.tables import Affine, Config, Tables, rank_orders
from planner.specs import ClusterSpec, ModelSpec, TrainingJob

SLOW = 1 / (1 - OVERLAP_SM_SHARE)


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
    layers are split evenly over its chunks. A starting point for the solver. DualPipe's
    rank r holds the same two stages as rank pp-1-r, so only the first half are dealt."""
    terms = _rank_terms(model, cluster, job, config)
    if terms is None:
        return None
    tables, _, _ = terms
    orders = rank_orders(config.schedule, config.pp, config.num_microbatches, config.virtual_stages)
    if config.schedule == "dualpipe":
        orders = orders[: config.pp // 2]
    S = config.stages
    # Every stage but the first and last holds a layer. Costs: the most common kind's.
    held = [sum(1 for c in o.chunks if 0 < c < S - 1) for o in orders]
    rows = [table[0] for table in tables]
    if sum(held) > model.num_layers or any(
        h >= len(row) for h, row in zip(held, rows, strict=False)
    ):
        return None

    def next_cost(r: int) -> float:
        n = held[r] + 1
        return float(rows[r][n]) if n < len(rows[r]) else math.inf

    heap = [(next_cost(r), r) for r in range(len(orders))]
    heapq.heapify(heap)
    for _ in range(model.num_layers - sum(held)):
        _, r = heapq.heappop(heap)
        held[r] += 1
        heapq.heappush(heap, (next_cost(r), r))
    counts = [0] * S
    for r, o in enumerate(orders):
        # Over its chunks in the shares that keep its activation peak lowest, every inner
        # chunk keeping a layer.
        _, share = _in_flight_split(
            config.schedule, config.pp, config.num_microbatches, config.virtual_stages, r
        )
        chunks = sorted(o.chunks)
        floor = {c: 1 if 0 < c < S - 1 else 0 for c in chunks}
        want = {c: max(floor[c], round(share[c] * held[r])) for c in chunks}
        while sum(want.values()) > held[r]:  # trim the largest above its floor
            c = max((c for c in chunks if want[c] > floor[c]), key=lambda c: want[c])
            want[c] -= 1
        while sum(want.values()) < held[r]:  # grow the one furthest below its share
            c = max(chunks, key=lambda c: share[c] * held[r] - want[c])
            want[c] += 1
        for c in chunks:
            counts[c] = want[c]
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
    blocks = {k: _block(t, k) for k in t.kinds}
    dominant = max(layer_count, key=lambda k: (layer_count[k], k))
    lam = _pieces([blocks[dominant]])
    S = config.stages
    fixed_at = (
        {0: t.first_fixed, S - 1: t.last_fixed} if S > 1 else {0: t.first_fixed + t.last_fixed}
    )
    kinds = sorted(layer_count, key=lambda k: (layer_count[k], k))  # fewest first: the DP state
    copies = 2 if config.schedule == "dualpipe" else 1
    stage = [_stage_block(t, s) for s in range(S)]

    # Every stage's ops summed (each stage once, also under DualPipe's two copies), at their
    # lowest and highest: the wait sums them over the stages a rank does not hold.
    every = [blocks[k] for k in t.layer_kinds]
    every += [blocks[b] for bs in fixed_at.values() for b in bs] + stage
    low = {op: sum(_op_lo(b, op, lam) for b in every) for op in ("f", "b", "w", "fb")}
    high = {op: sum(_op_hi(b, op) for b in every) for op in ("f", "b", "w")}
    lin, n_o, zero = t.idle_linear, t.others, config.zero
    # The wait is lin * (the others' ops) / n_o = lin * (every stage's - own) / n_o: every
    # stage's at its lowest (highest where lin < 0), and own subtracted as ``_term`` does.
    wait = sum(c * (low[op] if c > 0 else high[op]) for op, c in lin.items() if op != "fb")
    wait += lin["fb"] * low["fb"]
    if t.idle_k is not None:
        wait -= high["f"]  # DualPipe's correction is at least minus the others' F
    need = [copies * layer_count[k] for k in kinds]
    if len(kinds) == 1:
        need = [0, *need]
    usable = (cluster.hbm_bytes - job.cuda_context_bytes) / (1 + job.fragmentation)
    kinds2: list[str | None] = list(kinds) if len(kinds) == 2 else [None, kinds[0]]
    hulls = {k: _hull(t.kinds[k].options) for k in kinds}
    recompute = _Block(b=1.0)  # a backward one second longer, nothing else

    def rank_table(r: int, lams: dict[int, dict[str, float]]) -> np.ndarray:
        """Rank r's table, each chunk's ops weighted by its ``lams`` (else the layers')."""
        order = orders[r]
        per_chunk = _chunk_counts(order.tasks, t)
        rank_const = wait / n_o
        row = dict.fromkeys(layer_count, math.inf)
        b_mult = math.inf  # what a second more of one layer's backward adds to the term
        for c in order.chunks:
            counts, weights = per_chunk[c], lams.get(c, lam)

            def term(
                block: _Block,
                slowed: bool = False,
                counts: dict[str, Any] = counts,
                weights: dict[str, float] = weights,
            ) -> float:
                return _term(counts, block, weights, lin, n_o, dual=dual, zero=zero, slowed=slowed)

            rank_const += sum(term(blocks[b]) for b in fixed_at.get(c, [])) + term(stage[c])
            for k in layer_count:
                # A chunk with an MoE layer makes every pair it is in communicate.
                row[k] = min(row[k], term(blocks[k], slowed=blocks[k].a2a))
            b_mult = min(b_mult, term(recompute))
        # Memory: besides its state and buffers, the rank holds at some moment at least
        # ``w`` micro-batches' worth of whatever its chunks save (see ``_in_flight``).
        w = _in_flight(
            config.schedule, config.pp, config.num_microbatches, config.virtual_stages, r
        )
        fixed = [b for c in order.chunks for b in fixed_at.get(c, [])]
        fixed_saved = sum(min(o.saved for o in t.kinds[b].options) for b in fixed)
        room = usable - gpu_state(t.fixed_state[r]) - t.buffers - w * fixed_saved
        return _term_table(
            rank_const,
            [row[k] if k else 0.0 for k in kinds2],
            need,
            [gpu_state(t.kinds[k].state) if k else 0.0 for k in kinds2],
            [hulls[k] if k else [(0.0, 0.0)] for k in kinds2],
            w,
            room,
            b_mult,
        )

    # The embedding's and head's ops may be communication-bound where the layers' are not
    # (ZeRO-2 reduces the embedding's gradients every micro-batch): a rank holding them
    # also takes its term with their chunks weighted their way; both tables bound it.
    ends = {c: _pieces([blocks[b] for b in bs]) for c, bs in fixed_at.items()}
    tables: list[np.ndarray] = []
    for r, order in enumerate(orders):
        table = rank_table(r, {})
        mine = {c: weights for c, weights in ends.items() if c in order.chunks}
        if any(weights != lam for weights in mine.values()):
            table = np.maximum(table, rank_table(r, mine))
        tables.append(table)
    return tables, need, _optimizer_floor(t, config)


@dataclass(frozen=True)
class _Block:
    """Per micro-batch seconds of one block's (or a stage's constant) parts of its ops.

    Lowest over its options: ``f``, ``b``, ``w`` work; ``a2a_f``, ``a2a_b`` all-to-alls
    (exposed when the op is not paired); ``gather``, ``reduce`` ZeRO communication at the
    cheapest stage's rate. Highest: ``f_hi``, ``b_hi``, ``w_hi`` (dearest option, every
    communication added). ``paired``: whether a DualPipe pair runs this part (a stage's
    sends are hidden there); ``a2a``: whether the block's own all-to-alls make every pair it
    is in communicate."""

    f: float = 0.0
    b: float = 0.0
    w: float = 0.0
    a2a_f: float = 0.0
    a2a_b: float = 0.0
    gather: float = 0.0
    reduce: float = 0.0
    f_hi: float = 0.0
    b_hi: float = 0.0
    w_hi: float = 0.0
    paired: bool = True
    a2a: bool = False


def _block(t: Tables, kind: str) -> _Block:
    k = t.kinds[kind]
    rows = [o.row for o in k.options]
    moe = k.cost.moe_layers
    hi_f = moe * max(t.forward_pair, default=0.0)
    hi_b = moe * (2 * max(t.combine, default=0.0) + max(t.forward_pair, default=0.0))
    gather_hi = _max_a(t.gather_dense) * k.dense_weight + _max_a(t.gather_expert) * k.expert_weight
    reduce_hi = _max_a(t.reduce_dense) * k.dense_grad + _max_a(t.reduce_expert) * k.expert_grad
    w = rows[0].bwd_weight  # recompute does not change it
    return _Block(
        f=min(r.fwd for r in rows),
        b=min(r.bwd_input for r in rows),
        w=w,
        a2a_f=moe * min(t.forward_pair, default=0.0),
        a2a_b=moe * 2 * min(t.combine, default=0.0),
        gather=_min_a(t.gather_dense) * k.dense_weight + _min_a(t.gather_expert) * k.expert_weight,
        reduce=_min_a(t.reduce_dense) * k.dense_grad + _min_a(t.reduce_expert) * k.expert_grad,
        f_hi=max(r.fwd for r in rows) + hi_f + gather_hi,
        b_hi=max(r.bwd_input for r in rows) + hi_b + gather_hi,
        w_hi=w + reduce_hi,
        a2a=moe > 0 and min(t.forward_pair, default=0.0) > 0,
    )


def _stage_block(t: Tables, s: int) -> _Block:
    """A stage's own part of its ops: its sends (hidden in pairs) and, at the most, every
    collective's latency."""
    gather = t.gather_dense[s].c + t.gather_expert[s].c
    return _Block(
        f=t.p2p[s],
        b=t.p2p_back[s],
        f_hi=t.p2p[s] + gather,
        b_hi=t.p2p_back[s] + gather,
        w_hi=t.reduce_dense[s].c + t.reduce_expert[s].c,
        paired=False,
    )


# Op categories: unpaired F, B, W and fused BW; F, B and BW inside a DualPipe pair.
_CATEGORIES = ("F", "B", "W", "BW", "pF", "pB", "pBW")


def _piece_values(x: _Block, cat: str) -> tuple[float, float]:
    """(work, ZeRO communication) of one category's op for this block: an op lasts the
    longer of the two (a paired op's all-to-alls are the pair's, not its own)."""
    paired = cat.startswith("p")
    if paired and not x.paired:
        return 0.0, 0.0
    a2a_f = 0.0 if paired else x.a2a_f
    a2a_b = 0.0 if paired else x.a2a_b
    base = cat.removeprefix("p")
    if base == "F":
        return x.f + a2a_f, x.gather
    if base == "B":
        return x.b + a2a_b, x.gather
    if base == "W":
        return x.w, x.reduce
    return x.b + x.w + a2a_b, x.gather + x.reduce


def _pieces(blocks: list[_Block]) -> dict[str, float]:
    """An op lasts max(its work, its ZeRO communication), so at least any weighted mean of
    the two: per category, weight 1 on the work where these blocks' work is the larger,
    else 1 on the communication (one weight per op: its blocks share it)."""
    out = {}
    for cat in _CATEGORIES:
        work = sum(_piece_values(b, cat)[0] for b in blocks)
        comm = sum(_piece_values(b, cat)[1] for b in blocks)
        out[cat] = float(work >= comm)
    return out


def _piece(x: _Block, cat: str, lam: dict[str, float]) -> float:
    work, comm = _piece_values(x, cat)
    return lam[cat] * work + (1 - lam[cat]) * comm


def _op_lo(x: _Block, op: str, lam: dict[str, float]) -> float:
    """A lower bound on this block's share of an unpaired op (the wait counts unpaired ops
    and a stage's pair with itself)."""
    if op == "fb":
        return _piece(x, "pF", lam) + _piece(x, "pBW", lam)
    return _piece(x, op.upper(), lam)


def _op_hi(x: _Block, op: str) -> float:
    return float(getattr(x, op + "_hi"))


def _term(
    counts: dict[str, Any],
    x: _Block,
    lam: dict[str, float],
    lin: dict[str, float],
    n_o: int,
    *,
    dual: bool,
    zero: int,
    slowed: bool,
) -> float:
    """What holding ``x`` in a chunk whose ops run ``counts`` times adds to its rank's term:
    its share of the rank's ops (a pair's work slowed by the communication's SMs where the
    pair surely communicates: a pipeline send, or ``slowed``: x's own all-to-alls), less
    what it takes off the rank's wait on the others (``order_idle`` over the stages it does
    not hold: lin/n_o of each of their ops)."""
    boost = counts["slow_all" if slowed else "slow_sure"]
    busy = {
        cat: counts[cat] * _piece(x, cat, lam) * (1 + boost[cat] if cat.startswith("p") else 1)
        for cat in _CATEGORIES
    }
    out = float(sum(busy.values()))
    # Where every op of a kind the rank runs is the very op the wait counts, the two net
    # out: unpaired F, B and W (or fused BW when no ZeRO communication makes B + W differ
    # from it). Elsewhere the wait loses the op at its highest.
    fused_exact = zero <= 1
    for op in ("f", "b", "w"):
        share = lin[op] / n_o
        if not share:
            continue
        cat = op.upper()
        same = not dual and (counts["BW"] == 0 or fused_exact or op == "f")
        lo = _piece(x, cat, lam) if counts["BW"] == 0 or op == "f" else _split_lo(x, op)
        if same and share > 0 and counts[cat] + (counts["BW"] if op != "f" else 0) >= share:
            out -= share * lo
        elif share > 0:
            out -= share * _op_hi(x, op)
        else:
            out -= share * _piece(x, cat, lam)  # share < 0: the wait gains at least this
    if lin["fb"]:
        pair_hi = (_op_hi(x, "f") + _op_hi(x, "b") + _op_hi(x, "w")) * SLOW
        out -= lin["fb"] / n_o * pair_hi
    return out


def _in_flight(schedule: str, pp: int, m: int, v: int, rank: int) -> float:
    """The least w such that, however a rank's saved bytes X split over its chunks, some
    activation level of its op order holds at least w X (see ``_in_flight_split``)."""
    return _in_flight_split(schedule, pp, m, v, rank)[0]


@functools.lru_cache(maxsize=4096)
def _in_flight_split(
    schedule: str, pp: int, m: int, v: int, rank: int
) -> tuple[float, dict[int, float]]:
    """The value of the game min over splits x of max over levels l of
    sum_c count[l][c] x[c] (a small LP), and the split that attains it (chunk -> share):
    the split of a rank's activations over its chunks that keeps its peak lowest."""
    order = rank_orders(schedule, pp, m, v)[rank]
    levels = [counts for counts, _ in order.levels]
    plain = float(max(min(c) for c in levels))
    even = {c: 1 / len(order.chunks) for c in order.chunks}
    if len(levels[0]) == 1:
        return float(max(c[0] for c in levels)), even
    solver = pywraplp.Solver.CreateSolver("GLOP")
    x = [solver.NumVar(0.0, 1.0, f"x{c}") for c in range(len(levels[0]))]
    z = solver.NumVar(0.0, solver.infinity(), "z")
    solver.Add(sum(x) == 1)
    for counts in levels:
        solver.Add(sum(n * xc for n, xc in zip(counts, x, strict=True)) <= z)
    solver.Minimize(z)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return plain, even
    split = {c: float(xc.solution_value()) for c, xc in zip(order.chunks, x, strict=True)}
    # Never above the exact answer: GLOP's tolerance taken off, and at least the plain bound.
    return max(plain, float(z.solution_value()) * (1 - 1e-7)), split


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


def _chunk_counts(tasks: Counter[tuple[object, ...]], t: Tables) -> dict[int, dict[str, Any]]:
    """Per chunk: how many ops of each category (``_CATEGORIES``) the rank runs of it, and
    per paired category the extra share of work a pair's slowdown adds on average: over
    the pairs that surely communicate (``slow_sure``: a pipeline send is part of them) or
    over all (``slow_all``: for a block whose own all-to-alls make them communicate)."""
    out: dict[int, dict[str, Any]] = {}
    sure: Counter[tuple[int, str]] = Counter()

    def row(s: object) -> dict[str, Any]:
        assert isinstance(s, int)
        return out.setdefault(s, dict.fromkeys(_CATEGORIES, 0.0))

    for task, n in tasks.items():
        if task[0] == "pair":
            f, b, kind = task[1], task[2], task[3]
            assert isinstance(f, int) and isinstance(b, int)
            row(f)["pF"] += n
            row(b)["p" + str(kind)] += n
            if t.p2p[f] > 0 or t.p2p_back[b] > 0:
                sure[f, "pF"] += n
                sure[b, "p" + str(kind)] += n
        else:
            row(task[1])[str(task[0])] += n
    for s, counts in out.items():
        paired = ("pF", "pB", "pBW")
        counts["slow_all"] = dict.fromkeys(paired, SLOW - 1)
        counts["slow_sure"] = {
            cat: (SLOW - 1) * sure[s, cat] / counts[cat] if counts[cat] else 0.0 for cat in paired
        }
    return out


def _split_lo(x: _Block, op: str) -> float:
    """x's part of an unpaired B (or W) op when no ZeRO communication runs: its work."""
    return x.b + x.a2a_b if op == "b" else x.w


def _min_a(affines: list[Affine]) -> float:
    return min((a.a for a in affines), default=0.0)


def _max_a(affines: list[Affine]) -> float:
    return max((a.a for a in affines), default=0.0)


def _least_threshold(tables: list[np.ndarray], need: list[int]) -> float:
    """The least T such that whole layers (``need``: of the first kind, of the second) can
    be dealt to the ranks with every rank's term at most T; ``inf`` when no dealing fits.
    T is one of the table entries (the heaviest rank's term), so bisect over them."""
    lo = max(float(table[0, 0]) for table in tables)
    if not math.isfinite(lo):
        return math.inf
    values = np.unique(np.concatenate([table[np.isfinite(table)] for table in tables]))
    values = values[values >= lo]
    if not values.size or not _deal(float(values[-1]), tables, need):
        return math.inf
    first, last = 0, values.size - 1  # values[last] deals; find the first that does
    while first < last:
        mid = (first + last) // 2
        if _deal(float(values[mid]), tables, need):
            last = mid
        else:
            first = mid + 1
    return float(values[last])


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
        for d in np.nonzero(take >= 0)[0]:
            shifted = np.where(best[: few + 1 - d] >= 0, best[: few + 1 - d] + take[d], -1)
            new[d:] = np.maximum(new[d:], shifted)
        best = new
        if best[few] >= many:
            return True
    return bool(best[few] >= many)
