"""``Work``: what one piece of computation asks of a GPU, split by the kind of kernel that does it.

The time model (``planner.costs.compute``) prices each kind at its own achieved rate, so the
block builders record work by kind rather than as one FLOP total:

- ``gemm``: FLOPs of dense matrix multiplies (linear layers; without flash attention also the
  batched QK^T and PV products), run by cuBLAS at a large fraction of tensor-core peak;
- ``attention``: FLOPs of fused (flash) attention kernels, which reach a lower fraction;
- ``expert``: FLOPs of the routed experts' grouped GEMMs;
- ``memory``: bytes moved to and from HBM by memory-bound kernels (norms, activation
  functions, residual adds, dropout, softmax and cross-entropy, MoE permutes);
- ``kernels``: kernel launches, each with a fixed cost that dominates small shapes;
- ``shapes``: the shape of each GEMM behind ``gemm`` and ``expert`` (``Gemm``), so the time
  model can price tile and wave quantisation and the memory roofline of small GEMMs; FLOPs
  without a shape are priced at the flat rate.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Gemm:
    """One GEMM's shape: ``groups`` independent (m x k) @ (k x n) products in one kernel
    (a grouped or batched GEMM; 1 for a plain one)."""

    m: float  # rows of the output (tokens); fractional when an average over experts
    n: float  # columns of the output (a tensor-parallel shard's share of the features)
    k: float  # the reduction
    groups: float = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.groups

    def backward(self) -> tuple[Gemm, Gemm]:
        """The input-gradient and weight-gradient GEMMs of ``self`` as a forward product
        (m tokens x k in) @ (k x n out): dX = dY @ W^T is m x n -> k, dW = X^T @ dY is
        k x m -> n, its reduction over the tokens."""
        return Gemm(self.m, self.k, self.n, self.groups), Gemm(self.k, self.n, self.m, self.groups)


@dataclass(frozen=True)
class Work:
    """Work of one computation on one rank; adds and scales like a vector."""

    gemm: float = 0.0
    attention: float = 0.0
    expert: float = 0.0
    memory: float = 0.0
    kernels: float = 0.0
    shapes: tuple[tuple[Gemm, float], ...] = ()  # (shape, times it runs), sorted by shape

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
            _merge(self.shapes, other.shapes, 1.0),
        )

    def scale(self, factor: float) -> Work:
        return Work(
            self.gemm * factor,
            self.attention * factor,
            self.expert * factor,
            self.memory * factor,
            self.kernels * factor,
            tuple((g, n * factor) for g, n in self.shapes),
        )


def _merge(
    a: tuple[tuple[Gemm, float], ...], b: tuple[tuple[Gemm, float], ...], factor: float
) -> tuple[tuple[Gemm, float], ...]:
    if not b:
        return a
    if not a:
        return b
    counts: dict[Gemm, float] = dict(a)
    for g, n in b:
        counts[g] = counts.get(g, 0.0) + n * factor
    return tuple(sorted(counts.items()))


ZERO = Work()
