"""Live tensor memory of one process, bucket by bucket, measured from the runtime.

``Tracker`` is a ``TorchDispatchMode``: every tensor an operator returns is seen as it is
created, and its storage is followed until PyTorch frees it (a weak reference to the storage
object; ``UntypedStorage.resize_``, which FSDP2 uses to free and refill its gathered
weights, is followed too). The sum of live storages is the process's tensor memory (on CPU
there is no caching allocator between tensors and the system, so this is what the step
holds); the peak is taken after every operator.

Buckets are given by what the runtime says a storage is, whenever it says so:
- ``weights``: parameter storages (a ZeRO-3 rank's own shards);
- ``grads``: gradient storages (what autograd accumulates into ``.grad``, or a sharded
  accumulator a ZeRO stage keeps instead);
- ``optimizer``: the optimizer's state tensors;
- ``activations``: tensors autograd saves for backward (``saved_tensors_hooks``), and the
  tensors a recomputed block rebuilds in backward;
- ``other``: everything else live at the moment: pipeline send/receive buffers and stage
  outputs held for backward, ZeRO-3's gathered weights, gradients of activations flowing
  through backward, temporaries of the operator running.

A storage counts once however many views or bucket claims it has; a later claim wins (a
tensor saved for backward is an activation even though an operator made it first). The
peak's split into buckets is taken with the tags storages end up with.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

BUCKETS = ("weights", "grads", "optimizer", "activations", "other")


class Tracker(TorchDispatchMode):
    """Follows every tensor storage created while it is active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        # By identity: storages compare equal by address, and freed ones share address 0.
        self._ids: Any = WeakIdKeyDictionary()
        self._counter = itertools.count()
        self.live: dict[int, int] = {}  # storage id -> bytes
        self.tags: dict[int, str] = {}  # storage id -> bucket (kept after the free)
        self.total = 0
        self.peak = 0
        self.by_bucket = dict.fromkeys(BUCKETS, 0)  # live bytes per bucket now
        self.bucket_peaks = dict.fromkeys(BUCKETS, 0)  # each bucket's own highest level
        self._peak_live: dict[int, int] = {}
        self._default = "other"
        self._orig_resize = torch.UntypedStorage.resize_

    # -- claims ---------------------------------------------------------------------------
    def claim(self, bucket: str, *tensors: Any) -> None:
        """Tag the storages of ``tensors`` (nested in lists, dicts or tuples) as ``bucket``,
        following them from now on if they were made before the tracker started."""
        flat, _ = tree_flatten(tensors)
        for t in flat:
            if isinstance(t, torch.Tensor):
                t = t.to_local() if hasattr(t, "to_local") else t
                self._tag(self._follow(t.untyped_storage()), bucket)

    @contextlib.contextmanager
    def tagging(self, bucket: str) -> Iterator[None]:
        """Tensors created inside the block are ``bucket`` (until claimed otherwise)."""
        before, self._default = self._default, bucket
        try:
            yield
        finally:
            self._default = before

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.total
        self._peak_live = dict(self.live)
        self.bucket_peaks = dict(self.by_bucket)

    def peak_buckets(self) -> dict[str, int]:
        """Bytes per bucket at the peak."""
        out = dict.fromkeys(BUCKETS, 0)
        for sid, nbytes in self._peak_live.items():
            out[self.tags.get(sid, "other")] += nbytes
        return out

    def current_buckets(self) -> dict[str, int]:
        """Bytes per bucket live now."""
        out = dict.fromkeys(BUCKETS, 0)
        for sid, nbytes in self.live.items():
            out[self.tags.get(sid, "other")] += nbytes
        return out

    # -- following storages -----------------------------------------------------------------
    def _follow(self, storage: torch.UntypedStorage, bucket: str | None = None) -> int:
        sid = self._ids.get(storage)
        if sid is None:
            sid = next(self._counter)
            self._ids[storage] = sid
            self.tags[sid] = bucket or self._default
            self._set(sid, storage.nbytes())
            weakref.finalize(storage, self._set, sid, 0)
        return sid

    def _tag(self, sid: int, bucket: str) -> None:
        old = self.tags[sid]
        if old != bucket:
            nbytes = self.live.get(sid, 0)
            self.by_bucket[old] -= nbytes
            self.tags[sid] = bucket
            self._grow(bucket, nbytes)

    def _grow(self, bucket: str, nbytes: int) -> None:
        self.by_bucket[bucket] += nbytes
        if self.by_bucket[bucket] > self.bucket_peaks[bucket]:
            self.bucket_peaks[bucket] = self.by_bucket[bucket]

    def _set(self, sid: int, nbytes: int) -> None:
        change = nbytes - self.live.get(sid, 0)
        self.total += change
        self._grow(self.tags[sid], change)
        if nbytes:
            self.live[sid] = nbytes
        else:
            self.live.pop(sid, None)
        if self.total > self.peak:
            self.peak = self.total
            self._peak_live = dict(self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        # Made with gradients on: a forward's (or, inside backward, a recompute's) tensor.
        made = "activations" if torch.is_grad_enabled() else self._default
        for t in flat:
            if (
                isinstance(t, torch.Tensor)
                and t.device.type != "meta"
                and not is_traceable_wrapper_subclass(t)  # a DTensor: its local op is seen
            ):
                self._follow(t.untyped_storage(), made)  # new storages only: not views
        return out

    def __enter__(self) -> Tracker:
        tracker = self
        orig = self._orig_resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = orig(storage, size)
            sid = tracker._ids.get(storage)
            if sid is not None:
                tracker._set(sid, storage.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        super().__exit__(*args)

    @contextlib.contextmanager
    def saving(self, params: set[int]) -> Iterator[None]:
        """Tag what autograd saves for backward as activations (parameters excepted: their
        storages are in ``params``, by data pointer, and any leaf that requires gradients,
        or a view of one, is a parameter or a received input)."""

        def pack(t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, nn.Parameter) or t.device.type == "meta":
                return t
            if is_traceable_wrapper_subclass(t):  # a wrapper (an async collective's result)
                for name in t.__tensor_flatten__()[0]:
                    pack(getattr(t, name))
                return t
            base = t._base if t._base is not None else t
            if base.is_leaf and base.requires_grad:  # a weight (FSDP2's gathered one too)
                return t  # or a received pipeline input: a buffer, claimed as such
            if t.untyped_storage().data_ptr() not in params:
                self._tag(self._follow(t.untyped_storage()), "activations")
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
