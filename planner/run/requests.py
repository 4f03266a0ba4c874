"""What a real run asks the CUDA caching allocator for, written without a GPU.

``planner.allocator`` replays the allocator on a sequence of requests and releases; this
writes that sequence for a layout of ``planner.run`` before it runs: the runtime's own code
(``planner.run.execute``, the same model, optimizer and step) runs on PyTorch's ``meta``
device, where every operator makes its outputs' shapes and storages but computes nothing,
and every storage is followed from the operator that makes it to the moment PyTorch frees
it (``planner.run.track``'s ``Tracker``: a weak reference to the storage, and its resizes).
Each storage is one request of its bytes, released when it dies: what the caching allocator
sees on CUDA, where every tensor's storage is one ``malloc`` of the allocator.

Where the meta device differs from CUDA, the run is made to take CUDA's path or the request
is added from what CUDA's kernels allocate:

- attention: ``scaled_dot_product_attention`` takes its flash kernel
  (``aten._scaled_dot_product_flash_attention``: output, FP32 log-sum-exp per query and
  head, RNG seed and offset), as CUDA picks it for BF16 causal attention; the meta device
  alone would take the math path and build the score matrix;
- the flash kernel's backward asks for one workspace while it runs
  (``flash_backward_workspace``): per query row and head, an FP32 softmax sum and an FP32
  accumulator of the query gradient, and, where key/value heads are fewer than query heads,
  the key and value gradients expanded to every query head before they are summed;
- cuBLAS keeps one workspace per handle and stream (``CUBLAS_WORKSPACE``), taken from the
  caching allocator by the first GEMM of each thread that runs GEMMs (the training loop's
  and autograd's backward thread) and never released;
- autograd sums two gradients of one tensor in place where it holds the only reference to
  one of them (``InputBuffer::accumulate``), but out of place whenever a dispatch mode is
  on (it then takes every tensor for a subclass): the sums autograd's engine asks for are
  made in place here, as on CUDA without a mode (where one gradient is also held elsewhere
  CUDA sums out of place; not told apart);
- a router's tokens per expert, which the meta device cannot count, are taken even (the
  real counts follow the routing of the step), and its routing map (tokens x experts) holds
  as many picks as each token's experts.

What it leaves out: the scratch buffers of CUDA's reductions and other kernels that ask the
allocator for memory inside an operator (freed before it returns), and requests under a few
bytes (RNG state, scalars). ``benchmarks/allocator_replay.py`` sets the replay of these
sequences against the allocator's peaks on real runs.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from planner.allocator import Event
from planner.costs.memory import TORCH_CUBLAS_WORKSPACE
from planner.errors import PlannerError
from planner.layout import Layout
from planner.run.track import Tracker
from planner.specs import ModelSpec, TrainingJob

# cuBLAS's workspace per handle and stream at compute capability 9.0 and up (the memory
# model's, costs.memory): the two 32 MiB requests no real run's trace releases
# (benchmarks/logs/h200/alloc), one per thread that runs GEMMs.
CUBLAS_WORKSPACE = TORCH_CUBLAS_WORKSPACE[True]

_GEMMS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.baddbmm.default,
    }
)


_MASKED = frozenset(
    {
        torch.ops.aten.index.Tensor,
        torch.ops.aten.index_put.default,
        torch.ops.aten.index_put_.default,
        torch.ops.aten._index_put_impl_.default,
    }
)


def flash_backward_workspace(q: torch.Tensor, k: torch.Tensor) -> int:
    """Bytes the flash attention backward asks for while it runs, for queries ``q`` and keys
    ``k`` laid out [batch, heads, sequence, head dim]: an FP32 sum and an FP32 query-gradient
    accumulator per query row and head (4 + 4 d bytes), and under grouped-query attention the
    key and value gradients at every query head in ``q``'s dtype (2 x d x element bytes).
    On the real runs' traces (one H200, torch 2.11) this is one request of these bytes (and
    256 more) per layer and micro-batch."""
    b, hq, s, d = q.shape
    per_row = 4 + 4 * d
    if k.shape[1] != hq:
        per_row += 2 * d * q.element_size()
    return b * hq * s * per_row


class _Requests(Tracker):
    """Follows every meta storage an operator makes, as ``Tracker`` follows storages (their
    resizes too): a request when it appears, a release when it dies, and a resize as the
    release of the old bytes and a request of the new (see the module docstring)."""

    def __init__(self, model: ModelSpec) -> None:
        super().__init__()
        self._experts, self._picks = model.num_experts, model.experts_per_token
        self._made = itertools.count()
        self._index: dict[int, int] = {}  # a live storage's request
        self.events: list[Event] = []
        self._threads: set[bool] = set()

    def _picked(self, mask: torch.Tensor) -> int:
        """True entries of a routing map (tokens x experts): each token's picks."""
        if mask.dtype != torch.bool or mask.shape[-1] != self._experts:
            raise PlannerError(
                f"a mask of shape {tuple(mask.shape)}: the meta device counts routing maps only"
            )
        return mask.numel() // self._experts * self._picks

    def _malloc(self, nbytes: int) -> int:
        self.events.append(("malloc", nbytes))
        return next(self._made)

    def _set(self, sid: int, nbytes: int) -> None:
        if nbytes != self.live.get(sid, 0):  # made, freed or resized: release, then request
            if sid in self._index:
                self.events.append(("free", self._index.pop(sid)))
            if nbytes:
                self._index[sid] = self._malloc(nbytes)
        super()._set(sid, nbytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is not None and first.device.type == "meta":
            if func is torch.ops.aten._local_scalar_dense.default:  # a value read on the host
                return 0.0 if first.is_floating_point() else 0
            if func is torch.ops.aten.bincount.default:  # tokens per expert
                n = max(int(args[2] if len(args) > 2 else kwargs.get("minlength", 0)), 1)
                picks = first.numel()
                return torch.tensor([picks // n + (i < picks % n) for i in range(n)])
            if func is torch.ops.aten.nonzero.default:  # a routing map's picks
                picks = self._picked(first)
                return first.new_empty((picks, first.dim()), dtype=torch.long)
            if func in _MASKED and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
            ):  # indexed by a routing map: by the positions of its picks
                (mask,) = args[1]
                where = [mask.new_empty(self._picked(mask), dtype=torch.long)] * mask.dim()
                args = (first, where, *args[2:])
            # On CUDA the backward runs on autograd's own thread, with its own cuBLAS handle
            backward = torch._C._current_graph_task_id() >= 0
            if func in _GEMMS and backward not in self._threads:
                self._threads.add(backward)
                self._malloc(CUBLAS_WORKSPACE)  # kept for the process's life
            if func is torch.ops.aten.add.Tensor and backward and _from_engine():
                return args[0].add_(args[1])  # the engine's sum of two gradients
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                self._follow(t.untyped_storage())  # new storages only: not views
        if func is torch.ops.aten._scaled_dot_product_flash_attention_backward.default:
            q, k = args[1], args[2]
            index = self._malloc(flash_backward_workspace(q, k))
            self.events.append(("free", index))
        return out


def _wrapper(path: str) -> bool:
    """Whether a frame is one of PyTorch's own wrappers around ``__torch_dispatch__``."""
    return "/torch/_dynamo/" in path or path.endswith(
        ("/torch/_compile.py", "/torch/utils/_python_dispatch.py")
    )


def _from_engine() -> bool:
    """Whether the operator running was called by autograd's engine itself (summing the
    gradients a tensor receives), not by a backward function's Python code."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and _wrapper(frame.f_code.co_filename):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "_engine_run_backward"


def _flash_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` as CUDA runs it in BF16: the flash kernel (which
    takes fewer key/value heads than query heads as they are)."""
    if attn_mask is not None:
        raise PlannerError("attention with a mask: the flash path takes none")
    out: torch.Tensor = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, False, scale=scale
    )[0]
    return out


@dataclass(frozen=True)
class _Meta:
    """The device ``planner.run.execute``'s rank is built on (all it reads of one)."""

    @property
    def torch_device(self) -> torch.device:
        return torch.device("meta")


@contextmanager
def _one_process_group() -> Iterator[None]:
    """A gloo group of this process alone, unless one of this process alone is up."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:  # the rank's groups would wait on the other ranks
            raise PlannerError(
                f"requests: a process group of {dist.get_world_size()} ranks is up; write "
                "requests from a process outside it"
            )
        yield
        return
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def _flash_attention() -> Iterator[None]:
    saved = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _flash_sdpa  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = saved


def requests(
    model: ModelSpec,
    job: TrainingJob,
    layout: Layout,
    *,
    steps: int = 3,
) -> list[Event]:
    """The caching allocator's requests and releases (``planner.allocator.replay``'s events)
    of building ``layout``'s one rank and running ``steps`` optimizer steps on it, as
    ``planner.run.execute`` does on a CUDA GPU (see the module docstring). One-GPU layouts
    only: the others' ranks wait on each other's collectives."""
    from planner.run.execute import _Rank, check_runnable

    check_runnable(model, job, layout)
    if layout.world_size != 1:
        raise PlannerError(
            f"Layout.world_size={layout.world_size}: requests are written for one-GPU layouts only"
        )
    if steps < 1:
        raise PlannerError(f"steps={steps}: must be at least 1")
    recorder = _Requests(model)
    with _one_process_group(), _flash_attention(), recorder:
        rank = _Rank(0, model, job, layout, _Meta())  # type: ignore[arg-type]
        for _ in range(steps):
            rank.step()
        del rank
    return recorder.events
