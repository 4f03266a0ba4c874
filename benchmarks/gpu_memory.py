"""What the CUDA caching allocator reserves beyond what a training step allocates, on one GPU.

The memory model adds ``TrainingJob.fragmentation`` (default 0.10 of allocated bytes, from
seed 001's 5-30%) to a rank's allocated peak to get what ``torch.cuda.max_memory_reserved``
reports. This measures that ratio on real training steps instead: a Llama 3 8B-wide stack
(``planner.run.model.DenseLayer``, the embedding, the final norm, the output layer and a
cross-entropy loss over FP32 logits, ``--loss``), BF16 parameters and per-parameter gradients, AdamW
(foreach) with BF16 moments, ``--steps`` steps of one micro-batch, at the sequence length and
recompute given. Run it once per allocator setting (``PYTORCH_CUDA_ALLOC_CONF``:
unset, or ``expandable_segments:True``, which torchtitan's launch script sets), each in a
fresh process: the figures are per process.

Prints one JSON line: the peaks after each step, and (reserved - allocated) / allocated at
the end; for every step, the peaks of each phase (forward through the layers, the output
layer and loss, backward, optimizer step; the peak statistics are reset at each phase's
start), and the segments the allocator holds at the end (count, largest, total), so that
where the reserved bytes grow can be read off. Ignores: pipeline and data-parallel buffers
(one GPU, no communication), FP32 master weights and gradient buffers (Megatron-LM's
contiguous buffers fragment less).

Run on a CUDA machine: ``python benchmarks/gpu_memory.py --layers 8 --micro-batch 1``.
``python benchmarks/gpu_memory.py --compare benchmarks/gpu_memory_runs.jsonl`` (no GPU) sets
runs made so against the memory model: the loss's bytes per logit (kept after the forward,
above that in the forward and in the backward), as measured and as ``planner.costs.blocks``
holds them for the loss that stack ran (``eager``: torchtitan's; ``fused``: Megatron-LM's),
and the allocator's reserved bytes beyond the allocated peak, in all and in FP32 logits.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from planner.catalog import load_model
from planner.run.model import DenseLayer, RMSNorm, loss_fn


class Stack(nn.Module):
    def __init__(self, name: str, layers: int) -> None:
        super().__init__()
        model = load_model(name)
        h, dtype = model.hidden_size, torch.bfloat16
        self.embed = nn.Embedding(model.vocab_size, h, dtype=dtype)
        self.layers = nn.ModuleList(DenseLayer(model, dtype) for _ in range(layers))
        self.norm = RMSNorm(h, dtype)
        self.head = nn.Linear(h, model.vocab_size, bias=False, dtype=dtype)

    def forward(
        self,
        tokens: torch.Tensor,
        recompute: str,
        mark: Callable[[str], None] | None = None,
        loss: str = "eager",
    ) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, recompute)
        if mark is not None:
            mark("forward")
        logits = self.head(self.norm(x))
        if loss == "fused":
            return loss_fn(logits, tokens)
        if loss == "parallel":
            return _loss_parallel(logits, tokens)
        if loss == "compiled":
            return _compiled_loss()(logits, tokens)
        return _eager_loss(logits, tokens)


def _eager_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten(0, 1))


@functools.cache
def _compiled_loss() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The eager loss under torch.compile, as torchtitan compiles its loss (compile.enable)."""
    return torch.compile(_eager_loss)  # type: ignore[return-value]


def _loss_parallel(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss with tensor parallelism before 2026 (cross-entropy on the FP32 copy of
    vocabulary-sharded DTensor logits, under torch.distributed.tensor.parallel.loss_parallel),
    on a one-rank mesh: each rank's shard runs these same operations over its share of the
    vocabulary."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(logits.device.type, (1,))
    sharded = DTensor.from_local(logits, mesh, [Shard(-1)])
    # Forward and backward both run inside loss_parallel() (main), as torchtitan's train
    # context holds it around both.
    out: torch.Tensor = F.cross_entropy(sharded.flatten(0, 1).float(), tokens.flatten(0, 1))
    return out


def _loss_context(loss: str) -> contextlib.AbstractContextManager[object]:
    if loss != "parallel":
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _mib(n: float) -> float:
    return round(n / 2**20, 1)


class Phases:
    """The allocator's peaks phase by phase: each mark closes the phase that ran since the last."""

    def __init__(self) -> None:
        self.rows: list[dict[str, object]] = []
        self.step = 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def __call__(self, name: str) -> None:
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        self.rows.append(
            {
                "step": self.step,
                "phase": name,
                "peak_allocated_MiB": _mib(stats["allocated_bytes.all.peak"]),
                "peak_reserved_MiB": _mib(stats["reserved_bytes.all.peak"]),
                "allocated_MiB": _mib(stats["allocated_bytes.all.current"]),
                "reserved_MiB": _mib(stats["reserved_bytes.all.current"]),
                "inactive_split_MiB": _mib(stats["inactive_split_bytes.all.current"]),
                "alloc_retries": stats["num_alloc_retries"],
            }
        )
        torch.cuda.reset_peak_memory_stats()


def _segments() -> dict[str, float]:
    sizes = sorted((s["total_size"] for s in torch.cuda.memory_snapshot()), reverse=True)
    return {
        "count": len(sizes),
        "largest_MiB": _mib(sizes[0]) if sizes else 0.0,
        "largest_5_MiB": [_mib(x) for x in sizes[:5]],
        "total_MiB": _mib(sum(sizes)),
    }


def compare(path: str) -> int:
    """Print measured runs (JSON lines of this script) against the memory model's loss."""
    # Imported here: the measuring path needs only torch and the model's layers.
    import planner
    from planner.costs.blocks import block_cost
    from planner.costs.memory import shard_of

    print(
        f"{'model':11} {'L':>2} {'mb':>2} {'seq':>6} {'recompute':9} {'loss':5} {'alloc':6} | "
        "bytes a logit: kept, above it in forward, in backward (measured / model) | "
        "reserved - allocated: MiB, %, FP32 logits"
    )
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        model = load_model(r["model"])
        logits = r["micro_batch"] * r["seq"] * model.vocab_size
        last = max(int(x.get("step", 0)) for x in r["phases"])
        ph = {x["phase"]: x for x in r["phases"] if int(x.get("step", 0)) == last}
        per = 2**20 / logits
        kept = (ph["loss"]["allocated_MiB"] - ph["forward"]["allocated_MiB"]) * per
        fwd = (ph["loss"]["peak_allocated_MiB"] - ph["loss"]["allocated_MiB"]) * per
        bwd = (ph["backward"]["peak_allocated_MiB"] - ph["loss"]["allocated_MiB"]) * per
        framework = "megatron" if r["loss"] == "fused" else "torchtitan"
        job = planner.TrainingJob(
            seq_len=r["seq"],
            global_batch=1,
            framework=framework,
            compiled_loss=r["loss"] == "compiled",
        )
        # The loss-parallel rows stand for each rank of a tensor-parallel group.
        tp = 2 if r["loss"] == "parallel" else 1
        layout = planner.Layout.uniform(model, micro_batch=r["micro_batch"], tp=tp)
        head = block_cost(model, "head", shard_of(job, layout))
        model_kept = sum(g.bytes for g in head.saved if g.name == "logits") / logits * tp
        above = head.transient / logits * tp
        peak = r["steps"][-1]
        # The allocator setting, and +st where the optimizer's moments were made up front.
        setting = ("exp" if r["alloc_conf"] else "def") + ("+st" if r.get("eager_state") else "")
        gap = peak["max_reserved_MiB"] - peak["max_allocated_MiB"]
        print(
            f"{r['model']:11} {r['layers']:>2} {r['micro_batch']:>2} {r['seq']:>6} "
            f"{r['recompute']:9} {r['loss']:5} "
            f"{setting:6} | "
            f"{kept:5.2f} / {model_kept:4.2f}   {fwd:5.2f} / {above:4.2f}   "
            f"{bwd:5.2f} / {above:4.2f} | "
            f"{gap:7.0f} {gap / peak['max_allocated_MiB']:6.1%} {gap * per / 4:5.2f}"
        )
    print(
        "In backward the measured figure is the phase's peak above the kept bytes: the loss's "
        "own only where\nit exceeds the layers' (a large vocabulary); the model's is the "
        "loss's transient (BlockCost.transient)."
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--recompute", default="none", choices=("none", "selective", "mlp", "full"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument(
        "--loss",
        default="eager",
        choices=("eager", "fused", "parallel", "compiled"),
        help="eager: the logits upcast to FP32 and F.cross_entropy (Hugging Face's causal-LM "
        "loss, torchtitan's uncompiled one); fused: the softmax in place over one FP32 copy "
        "(planner.run.model.loss_fn, as Megatron-LM's vocab-parallel cross-entropy); "
        "parallel: torchtitan's with tensor parallelism, DTensor's loss_parallel (one rank); "
        "compiled: the eager loss under torch.compile (torchtitan with compile on)",
    )
    p.add_argument(
        "--eager-state",
        action="store_true",
        help="make the optimizer's moments before the first step (default: as AdamW does, "
        "at the first step)",
    )
    p.add_argument("--compare", metavar="JSONL", help="set measured runs against the model")
    args = p.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    if not torch.cuda.is_available():
        print("gpu_memory: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    if args.loss == "parallel":  # a process group of one, rendezvous by a file of its own
        torch.distributed.init_process_group(
            "nccl", init_method=f"file:///tmp/gpu_memory_pg_{os.getpid()}", rank=0, world_size=1
        )
    torch.manual_seed(0)
    with torch.device("cuda"):
        stack = Stack(args.model, args.layers)
    opt = torch.optim.AdamW(stack.parameters(), lr=1e-5, foreach=True)
    if args.eager_state:
        # The moments made before the first step, as AdamW's first step would make them
        # (torch/optim/adamw.py, _init_group), so they do not land in the blocks the first
        # step's transients free.
        for param in stack.parameters():
            opt.state[param] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }
    vocab = stack.head.out_features

    # Every step is traced phase by phase (the peak statistics reset at each mark); a step's
    # peaks are the largest of its phases', the run's the largest so far.
    steps: list[dict[str, float]] = []
    phases = Phases()
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (args.micro_batch, args.seq), device="cuda")
        phases.step = step + 1
        with _loss_context(args.loss):
            loss = stack(tokens, args.recompute, phases, args.loss)
            phases("loss")
            loss.backward()
            phases("backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases("optimizer")
        rows = [r for r in phases.rows if r["step"] == step + 1]
        before = steps[-1] if steps else {"max_allocated_MiB": 0.0, "max_reserved_MiB": 0.0}
        steps.append(
            {
                "max_allocated_MiB": max(
                    before["max_allocated_MiB"], *(float(r["peak_allocated_MiB"]) for r in rows)
                ),
                "max_reserved_MiB": max(
                    before["max_reserved_MiB"], *(float(r["peak_reserved_MiB"]) for r in rows)
                ),
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
                "loss": args.loss,
                "eager_state": args.eager_state,
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                "steps": steps,
                "phases": phases.rows,
                "segments": _segments(),
                "reserved_over_allocated": last["max_reserved_MiB"] / last["max_allocated_MiB"] - 1,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
