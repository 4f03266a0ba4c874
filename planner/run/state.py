"""Model state per rank (weights, gradients, optimizer state) under data parallelism and a
ZeRO stage, measured from PyTorch's own sharding machinery in real processes (gloo on CPU).

ZeRO-0 keeps everything on every rank; ZeRO-1 is ``ZeroRedundancyOptimizer`` (each rank
holds the optimizer state of a share of the parameters, whole tensors each); ZeRO-3 is
FSDP2's ``fully_shard`` (every parameter, its gradient and its optimizer state split in
even pieces over the ranks). Measured after one real optimizer step, from the tensors each
rank holds: its (local) parameters, their gradients, and the tensors in the optimizer's
state. The job's dtypes are FP32 weights, gradients and AdamW moments (no separate master
copy): what plain PyTorch training keeps.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.errors import PlannerError
from planner.run.model import DenseLayer
from planner.run.processes import run_ranks
from planner.specs import ModelSpec


def measure_state(
    model: ModelSpec, *, dp: int, zero: int, seq_len: int = 64
) -> list[dict[str, int]]:
    """Bytes of each bucket on each of ``dp`` ranks after a training step of ``model``'s
    transformer layers (all of them, dense or MoE as the model has them)."""
    if zero not in (0, 1, 3):
        raise PlannerError(f"zero={zero}: real runs cover ZeRO-0, 1 and 3 (FSDP2) so far")
    with tempfile.TemporaryDirectory() as folder:
        run_ranks(_worker, lambda port: (model, dp, zero, seq_len, port, folder), dp)
        return [torch.load(os.path.join(folder, f"{r}.pt")) for r in range(dp)]


def _worker(
    rank: int, model: ModelSpec, dp: int, zero: int, seq_len: int, port: int, folder: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=dp)
    try:
        torch.manual_seed(0)
        layers = _Stack(
            DenseLayer(model, torch.float32, moe=model.is_moe_layer(i))
            for i in range(model.num_layers)
        )
        optimizer: Any
        if zero == 3:
            from torch.distributed.fsdp import fully_shard

            for layer in layers.layers:
                fully_shard(layer)
            fully_shard(layers)
            optimizer = torch.optim.AdamW(layers.parameters(), lr=1e-3)
        elif zero == 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(
                layers.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3
            )
        else:
            optimizer = torch.optim.AdamW(layers.parameters(), lr=1e-3)
        x = torch.randn(1, seq_len, model.hidden_size, requires_grad=True)
        layers(x).square().mean().backward()
        if zero != 3:  # data parallelism: average the gradients (FSDP2 reduce-scatters them)
            for p in layers.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
        optimizer.step()
        local = _local_state(layers, optimizer)
        torch.save(local, os.path.join(folder, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


class _Stack(nn.Module):
    def __init__(self, layers: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _local_state(layers: nn.Module, optimizer: Any) -> dict[str, int]:
    weights = sum(_bytes(_local(p)) for p in layers.parameters())
    grads = sum(_bytes(_local(p.grad)) for p in layers.parameters() if p.grad is not None)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local share
    state = sum(
        _bytes(_local(v))
        for per_param in inner.state.values()
        for key, v in per_param.items()
        if isinstance(v, torch.Tensor) and key != "step"
    )
    return {"weights": weights, "grads": grads, "optimizer": state}


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
