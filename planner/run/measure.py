"""Measurements of real PyTorch work, taken from the runtime itself."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def saved_bytes(module: nn.Module, run: Callable[[], torch.Tensor]) -> int:
    """Bytes ``run`` (a forward through ``module``) keeps for backward: every tensor autograd
    saves, counted once per storage (views and repeats of one tensor share it), parameters
    excluded (they are the module's state, not activations)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    out.float().sum().backward()  # the saved tensors are used: the run is a real step
    return sum(storages.values())
