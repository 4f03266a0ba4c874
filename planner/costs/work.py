"""``Work``: what one piece of computation asks of a GPU, split by the kind of kernel that does it.

The time model (``planner.costs.compute``) prices each kind at its own achieved rate, so the
block builders record work by kind rather than as one FLOP total:

- ``gemm``: FLOPs of dense matrix multiplies (linear layers; without flash attention also the
  batched QK^T and PV products), run by cuBLAS at a large fraction of tensor-core peak;
- ``attention``: FLOPs of fused (flash) attention kernels, which reach a lower fraction;
- ``expert``: FLOPs of the routed experts' grouped GEMMs, whose efficiency falls when each
  expert gets few tokens (see ``compute.expert_efficiency``);
- ``memory``: bytes moved to and from HBM by memory-bound kernels (norms, activation
  functions, residual adds, dropout, softmax and cross-entropy, MoE permutes);
- ``kernels``: kernel launches, each with a fixed cost that dominates small shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Work:
    """Work of one computation on one rank; adds and scales like a vector."""

    gemm: float = 0.0
    attention: float = 0.0
    expert: float = 0.0
    memory: float = 0.0
    kernels: float = 0.0

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
        )

    def scale(self, factor: float) -> Work:
        return Work(*(getattr(self, f.name) * factor for f in fields(self)))


ZERO = Work()
