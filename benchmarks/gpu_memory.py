"""What the CUDA caching allocator reserves beyond what a training step allocates, on one GPU.

The memory model adds ``TrainingJob.fragmentation`` (default 0.10 of allocated bytes, from
seed 001's 5-30%) to a rank's allocated peak to get what ``torch.cuda.max_memory_reserved``
reports. This measures that ratio on real training steps instead: a Llama 3 8B-wide stack
(``planner.run.model.DenseLayer``, the embedding, the final norm, the output layer and a
cross-entropy loss over FP32 logits), BF16 parameters and per-parameter gradients, AdamW
(foreach) with BF16 moments, ``--steps`` steps of one micro-batch, at the sequence length and
recompute given. Run it once per allocator setting (``PYTORCH_CUDA_ALLOC_CONF``:
unset, or ``expandable_segments:True``, which torchtitan's launch script sets), each in a
fresh process: the figures are per process.

Prints one JSON line: the peaks after each step, and (reserved - allocated) / allocated at
the end. Ignores: pipeline and data-parallel buffers (one GPU, no communication), FP32 master
weights and gradient buffers (Megatron-LM's contiguous buffers fragment less).

Run on a CUDA machine: ``python benchmarks/gpu_memory.py --layers 8 --micro-batch 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from planner.catalog import load_model
from planner.run.model import DenseLayer, RMSNorm


class Stack(nn.Module):
    def __init__(self, name: str, layers: int) -> None:
        super().__init__()
        model = load_model(name)
        h, dtype = model.hidden_size, torch.bfloat16
        self.embed = nn.Embedding(model.vocab_size, h, dtype=dtype)
        self.layers = nn.ModuleList(DenseLayer(model, dtype) for _ in range(layers))
        self.norm = RMSNorm(h, dtype)
        self.head = nn.Linear(h, model.vocab_size, bias=False, dtype=dtype)

    def forward(self, tokens: torch.Tensor, recompute: str) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, recompute)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), tokens.view(-1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--recompute", default="none", choices=("none", "selective", "mlp", "full"))
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_memory: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    torch.manual_seed(0)
    with torch.device("cuda"):
        stack = Stack(args.model, args.layers)
    opt = torch.optim.AdamW(stack.parameters(), lr=1e-5, foreach=True)
    vocab = stack.head.out_features
    steps = []
    for _ in range(args.steps):
        tokens = torch.randint(0, vocab, (args.micro_batch, args.seq), device="cuda")
        stack(tokens, args.recompute).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        steps.append(
            {
                "max_allocated_MiB": torch.cuda.max_memory_allocated() / 2**20,
                "max_reserved_MiB": torch.cuda.max_memory_reserved() / 2**20,
            }
        )
    last = steps[-1]
    print(
        json.dumps(
            {
                "model": args.model,
                "layers": args.layers,
                "micro_batch": args.micro_batch,
                "seq": args.seq,
                "recompute": args.recompute,
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                "steps": steps,
                "reserved_over_allocated": last["max_reserved_MiB"] / last["max_allocated_MiB"] - 1,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
