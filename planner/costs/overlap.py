"""What runs beside what: how long each task of a rank takes, stated once for every consumer.

A *task* is what one rank's compute stream runs as one unit of its schedule's op order: a
forward (``F``), an input-gradient backward (``B``), a weight-gradient backward (``W``), a
fused backward (``BW``), or a DualPipe pair (``("pair", f, b, kind)``: the forward of stage
``f`` for one micro-batch beside the backward of stage ``b`` for another). Its length is the
largest of a few *terms*, each a sum of per-stage quantities (``Prim``) with coefficients:

- compute and the communication the task waits for, in series: forward/backward work plus
  the expert all-to-alls and pipeline sends of the same chunk (dispatch, experts and combine
  run one after another inside a chunk), plus the SMs that overlapped collectives take from
  the compute (``nccl_share`` of their duration: NCCL's CTAs do not share an SM with
  compute, and on a DGX-class node with 8 NICs it runs 16 of them, NVIDIA/nccl#689);
- each overlapped collective (ZeRO-3 gathers, ZeRO-2/3 reduce-scatters, prefetched as
  Megatron-LM, FSDP2 and DeepSpeed do) on its own;
- each link's budget: every transfer the task has in flight on the GPU's InfiniBand share
  (or its NVLink ports) adds up, overlapped or not;
- for a DualPipe pair (DeepSeek-V3 report section 3.2.1, Figure 4): the two chunks' compute
  together, slowed while the communication kernels hold 20 of the GPU's SMs
  (``paired_share``, section 3.2.2) for the communication's duration, and each chunk's
  own compute and communication in series: one chunk's all-to-alls and sends hide behind
  the other chunk's compute, never behind its own.

When the framework does not overlap ZeRO communication (``Framework.overlap``) it joins the
series.
The terms are data (``Term``): ``planner.timeline`` evaluates them on a layout's numbers and
``planner.solve.model`` states them over its variables, so both price a task alike.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from planner.costs.quantities import LINKS, PARTS, Part, Prim, Quantity, name
from planner.costs.timing import StageTime
from planner.frameworks import FRAMEWORKS, Overlap, framework
from planner.specs import ClusterSpec, TrainingJob

# DeepSeek-V3 report section 3.2.2: 20 of the H800's 132 SMs run the all-to-all (and
# pipeline sends) while DualPipe's paired chunks compute; those SMs are lost to compute.
PAIRED_COMM_SMS = 20
# NCCL occupies whole SMs with its CTAs, 16 on a DGX-class node with 8 NICs (NVIDIA/nccl#689,
# maintainer's answer).
NCCL_SMS = 16
# Their shares come from each GPU's SM count (``overlap_of``: H100 132, A100 108, B200 148).

# A communication kernel beside compute moves its bytes at a share of the rate its thread
# blocks reach alone: its blocks get SMs only as the compute's blocks leave them. Measured on
# one H200 with a stand-in, a grid-stride copy on a second stream beside a Llama 3 8B layer's
# forward and backward at 4,096 tokens (benchmarks/gpu_overlap.py --layers,
# benchmarks/logs/h200/overlap/): with 256-thread blocks, 16 to 132 of them kept 0.29-0.31 of
# their rate alone in either launch order (layers.jsonl); with 512-thread blocks, NCCL's
# default thread count (NCCL_NTHREADS on recent GPUs), 16 and 32 kept 0.48-0.52
# (layers-warps16.jsonl); beside back-to-back GEMMs alone 0.20-0.38 (16 and 32 blocks),
# beside an MoE layer's loop of small expert GEMMs 0.48-0.56. Within that measured range,
# fitted on the published corpus with each source held out (benchmarks/beside_fit.py,
# simulated steps): every source takes the range's low end, 0.29 (mean error 12.20% held
# out, 12.54% at 0.52); the corpus, predicted 10% fast on average, wants all the slowing the
# range allows, so this end of it may also stand for slowings the model lacks.
BESIDE_COMPUTE = 0.30
# What one such block moves alone: 16-18 GB/s of payload (32-36 GB/s read and written, 1 to
# 32 blocks of 256 or 512 threads).
BLOCK_PAYLOAD_BPS = 17e9

TaskKey = tuple[Any, ...]  # ("F"|"B"|"W"|"BW", stage) or ("pair", f, b, "B"|"BW")
Q = Quantity


# What each framework runs beside compute: its registry entry's ``Framework.overlap``
# (``planner.frameworks``, with the sources), by name, on a 132-SM GPU.
OVERLAPS: dict[str, Overlap] = {name: f.overlap for name, f in FRAMEWORKS.items()}


def overlap_of(job: TrainingJob, cluster: ClusterSpec, schedule: str | None = None) -> Overlap:
    """What ``job``'s framework runs beside compute on ``cluster``'s GPUs, under
    ``schedule`` (whether its pipeline sends are asynchronous), with its gradient reduction
    after the last backward where the job asks (``TrainingJob.exposed_grad_reduce``)."""
    base = framework(job.framework).overlap
    exposed = job.exposed_grad_reduce  # nothing of the reduction, nor the gather after it
    return dataclasses.replace(
        base,
        sm_count=cluster.sm_count or base.sm_count,
        async_sends=schedule in base.async_send_schedules,
        grad_sync=base.grad_sync and not exposed,
        param_gather=base.param_gather and not exposed,
    )


def nccl_share(overlap: Overlap) -> float:
    """The share of the compute NCCL's CTAs take while a collective overlaps it."""
    return NCCL_SMS / overlap.sm_count


def beside_rate(transfer_seconds: float, payload_bytes: float, sms: int) -> float:
    """The share of its rate alone a collective's kernel keeps while compute runs beside it
    on its GPU: its ``sms`` blocks reach at most ``BESIDE_COMPUTE`` of what they move alone,
    and they move alone at least the transfer's own rate (``payload_bytes`` over its
    ``transfer_seconds``: the links' measured rates were reached with the library's own
    blocks), so a transfer whose link is far slower than its blocks (InfiniBand) keeps its
    rate, and one its blocks just saturate (NVLink) drops to ``BESIDE_COMPUTE``."""
    if transfer_seconds <= 0 or payload_bytes <= 0 or sms <= 0:
        return 1.0
    own = payload_bytes / transfer_seconds
    return min(1.0, BESIDE_COMPUTE * max(own, sms * BLOCK_PAYLOAD_BPS) / own)


def paired_share(overlap: Overlap) -> float:
    """The share of the compute a DualPipe pair's communication kernels take."""
    return PAIRED_COMM_SMS / overlap.sm_count


@dataclass(frozen=True)
class Term:
    """``sum(coeff * prim)`` seconds."""

    coeffs: tuple[tuple[Prim, float], ...]


def prims(st: StageTime) -> dict[str, float]:
    """A stage's quantities by ``costs.quantities.name`` (seconds per micro-batch;
    ``grad_sync`` per step)."""
    out = {name(Q.FWD): st.fwd, name(Q.BWD_INPUT): st.bwd_input, name(Q.BWD_WEIGHT): st.bwd_weight}
    for quantity, t in (
        (Q.A2A_FWD, st.a2a_fwd),
        (Q.A2A_BWD, st.a2a_bwd),
        (Q.P2P, st.p2p),
        (Q.P2P_BACK, st.p2p_back),
        (Q.ZERO_GATHER, st.zero_gather),
        (Q.ZERO_REDUCE, st.zero_reduce),
        (Q.GRAD_SYNC, st.grad_sync),
        (Q.PARAM_GATHER, st.param_gather),
    ):
        for part in PARTS:
            out[name(quantity, part)] = part.of(t)
    return out


def values(times: list[StageTime]) -> dict[Prim, float]:
    """Every stage's quantities, keyed as the terms name them."""
    return {(k, st.stage): v for st in times for k, v in prims(st).items()}


def _series(kind: str, s: int) -> tuple[dict[Quantity, int], list[Quantity]]:
    """A single op's compute and the communication it waits for (the stage's quantities),
    and the collectives it overlaps."""
    if kind == "F":
        return {Q.FWD: 1, Q.A2A_FWD: 1, Q.P2P: 1}, [Q.ZERO_GATHER]
    if kind == "B":
        return {Q.BWD_INPUT: 1, Q.A2A_BWD: 1, Q.P2P_BACK: 1}, [Q.ZERO_GATHER]
    if kind == "W":
        return {Q.BWD_WEIGHT: 1}, [Q.ZERO_REDUCE]
    series = {Q.BWD_INPUT: 1, Q.BWD_WEIGHT: 1, Q.A2A_BWD: 1, Q.P2P_BACK: 1}
    return series, [Q.ZERO_GATHER, Q.ZERO_REDUCE]


_COMM = (Q.A2A_FWD, Q.A2A_BWD, Q.P2P, Q.P2P_BACK)
_SENDS = (Q.P2P, Q.P2P_BACK)


def _waited(quantity: Quantity, overlap: Overlap) -> bool:
    """Whether the compute stream waits for ``quantity`` in series: all but asynchronous
    sends (``Overlap.async_sends``; they still cross the links)."""
    return not (overlap.async_sends and quantity in _SENDS)


@functools.lru_cache(maxsize=65536)
def task_terms(key: TaskKey, overlap: Overlap) -> list[Term]:
    """The terms whose largest is the task's length (see the module docstring); the first
    is the compute and what runs in series with it (cached: callers must not change it)."""
    if key[0] == "pair":
        return _pair_terms(key[1], key[2], key[3], overlap)
    kind, s = key
    series, over = _series(kind, s)
    # Asynchronous sends leave the compute stream's series (the receiver waits for them,
    # ``planner.timeline``); they still cross the links.
    main: dict[Prim, float] = {
        (name(n), s): float(c) for n, c in series.items() if _waited(n, overlap)
    }
    terms = []
    if overlap.zero:
        for n in over:
            main[(name(n), s)] = nccl_share(overlap)
        terms.append(Term(tuple(((name(n), s), 1.0) for n in over)))
        for link in LINKS:
            comm = [n for n in series if n in _COMM] + over
            terms.append(Term(tuple(((name(n, link), s), 1.0) for n in comm)))
    else:
        for n in over:
            main[(name(n), s)] = 1.0
    return [Term(tuple(main.items())), *terms]


def _pair_terms(f: int, b: int, kind: str, overlap: Overlap) -> list[Term]:
    fwd, _ = _series("F", f)
    bwd, _ = _series(kind, b)
    over = [(Q.ZERO_GATHER, f), (Q.ZERO_GATHER, b)] + ([(Q.ZERO_REDUCE, b)] if kind == "BW" else [])
    sent = [(n, f) for n in fwd if n in _COMM] + [(n, b) for n in bwd if n in _COMM]
    comp_f = {(name(Q.FWD), f): 1.0}
    comp_b = {(name(n), b): 1.0 for n in bwd if n not in _COMM}
    comm_f = {(name(n), f): 1.0 for n in fwd if n in _COMM and _waited(n, overlap)}
    comm_b = {(name(n), b): 1.0 for n in bwd if n in _COMM and _waited(n, overlap)}
    # The two chunks' compute, slowed while their communication holds SMs, and the ZeRO
    # collectives' SMs (or their whole length, when not overlapped).
    compute = comp_f | comp_b
    # The part hidden holds SMs for its duration; the rest runs in series with the compute.
    hidden = overlap.pair_hidden
    compute |= {p: hidden * paired_share(overlap) + (1 - hidden) for p in comm_f | comm_b}
    compute |= {(name(n), s): nccl_share(overlap) if overlap.zero else 1.0 for n, s in over}
    terms = [
        Term(tuple(compute.items())),  # the first term: see ``task_terms``
        Term(tuple((comp_f | comm_f).items())),  # each chunk in series with its own
        Term(tuple((comp_b | comm_b).items())),
    ]
    if overlap.zero:
        terms.append(Term(tuple(((name(n), s), 1.0) for n, s in over)))
    for link in LINKS:
        comm = [(name(n, link), s) for n, s in [*sent, *over]]
        terms.append(Term(tuple((p, 1.0) for p in comm)))
    return terms


def evaluate_term(term: Term, val: dict[Prim, float]) -> float:
    """A term's seconds."""
    return sum(c * val[p] for p, c in term.coeffs)


def task_time(key: TaskKey, val: dict[Prim, float], overlap: Overlap) -> float:
    """Seconds of one task (the largest of its terms)."""
    return max(evaluate_term(t, val) for t in task_terms(key, overlap))


@functools.lru_cache(maxsize=65536)
def link_use(key: TaskKey, link: str) -> dict[Prim, float]:
    """Seconds the task keeps ``link`` ("ib" or "nvl") busy, as coefficients of quantities
    (cached: callers must not change it)."""
    if key[0] == "pair":
        f, b, kind = key[1], key[2], key[3]
        names = [(Q.A2A_FWD, f), (Q.P2P, f), (Q.A2A_BWD, b), (Q.P2P_BACK, b)]
        names += [(Q.ZERO_GATHER, f), (Q.ZERO_GATHER, b)]
        names += [(Q.ZERO_REDUCE, b)] if kind == "BW" else []
    else:
        series, over = _series(key[0], key[1])
        names = [(n, key[1]) for n in [*series, *over] if n in _COMM or n in over]
    return {(name(n, Part(link)), s): 1.0 for n, s in names}


@dataclass(frozen=True)
class Parts:
    """Seconds of one task by what they are spent on (they add up to its length)."""

    compute: float = 0.0  # forward / backward work (communication and recompute apart)
    recompute: float = 0.0
    tp: float = 0.0
    a2a: float = 0.0  # expert all-to-all the compute waits for
    p2p: float = 0.0  # pipeline sends the compute waits for
    zero: float = 0.0  # ZeRO collectives: their SM share, or what they take beyond the work
    cp: float = 0.0  # the context-parallel ring's exposed sends
    offload: float = 0.0  # activation copies to and from the host the compute waits for

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.recompute
            + self.tp
            + self.a2a
            + self.p2p
            + self.zero
            + self.cp
            + self.offload
        )

    def __add__(self, other: Parts) -> Parts:
        return Parts(
            self.compute + other.compute,
            self.recompute + other.recompute,
            self.tp + other.tp,
            self.a2a + other.a2a,
            self.p2p + other.p2p,
            self.zero + other.zero,
            self.cp + other.cp,
            self.offload + other.offload,
        )


def task_parts(
    key: TaskKey, times: list[StageTime], duration: float, *, async_sends: bool = False
) -> Parts:
    """``duration`` of a task split into ``Parts``: its compute, recompute and exposed
    tensor-parallel communication; then, for a single op, the all-to-alls and sends it
    waits for (asynchronous sends none) and the rest as ZeRO; for a pair, the rest as
    communication."""
    waits = 0.0 if async_sends else 1.0
    ops = [("F", key[1]), (key[3], key[2])] if key[0] == "pair" else [key]
    compute = recompute = tp = a2a = p2p = cp = off = 0.0
    for kind, s in ops:
        st = times[s]
        if kind == "F":
            compute += st.fwd - st.tp_fwd - st.cp_fwd - st.offload_fwd
            tp += st.tp_fwd
            cp += st.cp_fwd
            off += st.offload_fwd
            a2a += st.a2a_fwd.seconds
            p2p += waits * st.p2p.seconds
        else:
            if kind in ("B", "BW"):
                compute += st.bwd_input - st.recompute - st.tp_bwd - st.cp_bwd - st.offload_bwd
                recompute += st.recompute
                tp += st.tp_bwd
                cp += st.cp_bwd
                off += st.offload_bwd
                a2a += st.a2a_bwd.seconds
                p2p += waits * st.p2p_back.seconds
            if kind in ("W", "BW"):
                compute += st.bwd_weight
    work = compute + recompute + tp + cp + off
    if key[0] != "pair":
        zero = max(0.0, duration - work - a2a - p2p)
        return Parts(compute, recompute, tp, a2a, p2p, zero, cp, off)
    comm = a2a + p2p
    excess = max(0.0, duration - work)
    share = a2a / comm if comm > 0 else 0.0
    return Parts(compute, recompute, tp, excess * share, excess * (1 - share), 0.0, cp, off)
