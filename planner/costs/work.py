"""``Work``: what one piece of computation asks of a GPU, split by the kind of kernel that does it.

The time model (``planner.costs.compute``) prices each kind at its own achieved rate, so the
block builders record work by kind rather than as one FLOP total:

- ``gemm``: FLOPs of dense matrix multiplies (linear layers; without flash attention also the
  batched QK^T and PV products), run by cuBLAS at a large fraction of tensor-core peak;
- ``attention``: FLOPs of fused (flash) attention kernels, which reach a lower fraction;
- ``attention_overhead``: what the fused kernels spend beyond those FLOPs at a given shape,
  in FLOP-equivalents (``flash_overhead``);
- ``expert``: FLOPs of the routed experts' grouped GEMMs;
- ``memory``: bytes moved to and from HBM by memory-bound kernels (norms, activation
  functions, residual adds, dropout, softmax and cross-entropy, MoE permutes);
- ``kernels``: kernel launches, each with a fixed cost that dominates small shapes;
- ``shapes``: the shape of each GEMM behind ``gemm`` and ``expert`` (``Gemm``), so the time
  model can price tile and wave quantisation and the memory roofline of small GEMMs; FLOPs
  without a shape are priced at the flat rate.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Gemm:
    """One GEMM's shape: ``groups`` independent (m x k) @ (k x n) products in one kernel
    (a grouped or batched GEMM; 1 for a plain one); ``expert``: the routed experts' grouped
    GEMM, one product per local expert."""

    m: float  # rows of the output (tokens); fractional when an average over experts
    n: float  # columns of the output (a tensor-parallel shard's share of the features)
    k: float  # the reduction
    groups: float = 1
    expert: bool = False

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.groups

    def backward(self) -> tuple[Gemm, Gemm]:
        """The input-gradient and weight-gradient GEMMs of ``self`` as a forward product
        (m tokens x k in) @ (k x n out): dX = dY @ W^T is m x n -> k, dW = X^T @ dY is
        k x m -> n, its reduction over the tokens."""
        return (
            Gemm(self.m, self.k, self.n, self.groups, self.expert),
            Gemm(self.k, self.n, self.m, self.groups, self.expert),
        )


@dataclass(frozen=True)
class Work:
    """Work of one computation on one rank; adds and scales like a vector."""

    gemm: float = 0.0
    attention: float = 0.0
    expert: float = 0.0
    memory: float = 0.0
    kernels: float = 0.0
    shapes: tuple[tuple[Gemm, float], ...] = ()  # (shape, times it runs), sorted by shape
    attention_overhead: float = 0.0  # FLOP-equivalents beyond ``attention`` (flash_overhead)

    @property
    def expert_gemms(self) -> float:
        """The routed experts' GEMMs, one per local expert of each grouped GEMM: what a
        framework that launches one GEMM per expert issues one by one
        (``Framework.expert_gemm_launch_s``)."""
        return sum(g.groups * times for g, times in self.shapes if g.expert)

    @property
    def flops(self) -> float:
        """Arithmetic FLOPs (memory-bound kernels' arithmetic is not counted)."""
        return self.gemm + self.attention + self.expert

    def __add__(self, other: Work) -> Work:
        return Work(
            self.gemm + other.gemm,
            self.attention + other.attention,
            self.expert + other.expert,
            self.memory + other.memory,
            self.kernels + other.kernels,
            _merge(self.shapes, other.shapes),
            self.attention_overhead + other.attention_overhead,
        )

    def scale(self, factor: float) -> Work:
        return Work(
            self.gemm * factor,
            self.attention * factor,
            self.expert * factor,
            self.memory * factor,
            self.kernels * factor,
            tuple((g, n * factor) for g, n in self.shapes),
            self.attention_overhead * factor,
        )


# Fused attention by shape. A kernel block (CTA) takes 128 queries of one head and loops over
# the keys in blocks of 128: per key block it does 4*128*128*d FLOPs of matmul and 128*128
# exponentials; per query block it also loads Q, writes O and its softmax statistics. With
# n = seq/128 key blocks, a non-causal head costs n^2 key blocks + n query-block overheads of
# ATTENTION_BLOCK_OVERHEAD key blocks each; a causal one computes n(n+1)/2 key blocks (the
# diagonal ones in full) for n^2/2 blocks' worth of FLOPs, with the same n overheads. The
# exponentials cost ATTENTION_EXP_FLOPS matmul FLOPs each, against 4d matmul FLOPs per score.
# Both constants were fitted by least squares to the 21 A100 FlashAttention-2 forward+backward
# rows of benchmarks/published_kernels.csv (shape dependence only: each family's own scale)
# and checked on held-out families: H100 FlashAttention-2 forward+backward (24 rows) 2.1%
# mean error against 13.8% without them, H100 FlashAttention-3 / cuDNN forward 10.6% / 10.4%
# against 22.5% / 18.4% (benchmarks/kernel_fidelity.py prints each row). The catalog's
# achieved["attention"] is the rate at head dimension 128 and long non-causal sequences.
ATTENTION_BLOCK = 128
ATTENTION_BLOCK_OVERHEAD = 1.5  # key blocks' time per query block (load Q, write O)
ATTENTION_EXP_FLOPS = 70.0  # matmul FLOPs one exponential costs
ATTENTION_REFERENCE_DIM = 128


def flash_overhead(
    seq_len: int, head_dim: float, *, causal: bool, window: int | None = None
) -> float:
    """Time of a fused attention kernel at this shape over its FLOPs' time at the reference
    shape, less 1: the FLOP-equivalents it spends beyond its FLOPs, per FLOP.

    With a causal sliding ``window`` shorter than the sequence (m = window/128 key blocks),
    query block i touches min(i+1, m+1) key blocks, n(m+1) - m(m+1)/2 in all, for
    n*m - m^2/2 blocks' worth of FLOPs (``blocks.attended_share``), with the same n
    overheads; at m = n this is the causal count above."""
    n = seq_len / ATTENTION_BLOCK
    c = ATTENTION_BLOCK_OVERHEAD
    if causal and window is not None and window < seq_len:
        m = window / ATTENTION_BLOCK
        blocks = (n * (m + 1) - m * (m + 1) / 2 + n * c) / (n * m - m * m / 2)
    else:
        blocks = (n + 1 + 2 * c) / n if causal else (n + c) / n
    exp = ATTENTION_EXP_FLOPS
    ref = 4 * ATTENTION_REFERENCE_DIM
    dims = (4 * head_dim + exp) / (4 * head_dim) / ((ref + exp) / ref)
    return blocks * dims - 1


def _merge(
    a: tuple[tuple[Gemm, float], ...], b: tuple[tuple[Gemm, float], ...]
) -> tuple[tuple[Gemm, float], ...]:
    """The shapes of two works together, each shape once with its counts added."""
    if not b:
        return a
    if not a:
        return b
    counts: dict[Gemm, float] = dict(a)
    for g, n in b:
        counts[g] = counts.get(g, 0.0) + n
    return tuple(sorted(counts.items()))


def work_sum(works: Iterable[Work]) -> Work:
    """``works`` added in order, as ``ZERO + w1 + w2 + ...`` adds them (the same sums in the
    same order), with the shapes merged once rather than at every addition."""
    parts = list(works)
    counts: dict[Gemm, float] = {}
    for w in parts:
        for g, n in w.shapes:
            counts[g] = counts.get(g, 0.0) + n
    return Work(
        sum((w.gemm for w in parts), 0.0),
        sum((w.attention for w in parts), 0.0),
        sum((w.expert for w in parts), 0.0),
        sum((w.memory for w in parts), 0.0),
        sum((w.kernels for w in parts), 0.0),
        tuple(sorted(counts.items())),
        sum((w.attention_overhead for w in parts), 0.0),
    )


ZERO = Work()
