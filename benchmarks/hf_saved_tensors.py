"""What Hugging Face Transformers' Llama keeps for backward, against the planner's
``hf-deepspeed`` entry.

Builds ``transformers.LlamaForCausalLM`` from a Llama-shaped config at 1 and 2 layers (BF16,
SDPA attention, no gradient checkpointing), runs one forward with the labels (the model's
own loss, ForCausalLMLoss) and records, with ``torch.autograd.graph.saved_tensors_hooks``,
every tensor autograd keeps (each storage once, parameters left out). The two depths'
difference is one decoder layer's; the 1-layer total less one layer is the embedding, the
final norm, the head and the loss. On a CUDA machine it also reads
``torch.cuda.memory_allocated`` after the forward, beside the hooks' figure.

Prints, per configuration: the saved bytes a token of one layer, measured and as
``planner.costs.blocks`` holds them for ``framework="hf-deepspeed"``, and the saved shapes
that make up the layer's.

Needs ``transformers`` (not a dependency of the planner):
``python benchmarks/hf_saved_tensors.py [--device cuda] [--seq 4096]``.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch

import planner
from planner.costs.blocks import block_cost
from planner.costs.memory import shard_of
from planner.fit import gpt_model

# hidden, ffn, heads, kv heads, vocabulary: reduced widths of Llama 2 7B (MHA) and Llama 3
# 8B (GQA), and the two at full width (run those on a GPU or with patience).
SHAPES = {
    "llama2-shape-512": (512, 1376, 8, 8, 32000),
    "llama3-shape-512": (512, 1792, 8, 2, 32000),
    "llama2-7b": (4096, 11008, 32, 32, 32000),
    "llama3-8b": (4096, 14336, 32, 8, 128256),
}


def saved(shape: tuple[int, ...], layers: int, seq: int, device: str) -> tuple[Counter, float]:
    """Bytes autograd keeps, by (shape, dtype), and what the allocator holds after the
    forward beyond the parameters (CUDA only, else 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    h, f, heads, kv, vocab = shape
    config = LlamaConfig(
        hidden_size=h,
        intermediate_size=f,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=max(seq, 4096),
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, tuple[int, ...], str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = (storage.nbytes(), tuple(t.shape), str(t.dtype).removeprefix("torch."))
        return t

    ids = torch.randint(0, vocab, (1, seq), device=device)
    cuda = device == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    held = (torch.cuda.memory_allocated() - before) if cuda else 0.0
    del out
    by: Counter = Counter()
    for nbytes, dims, dtype in seen.values():
        by[(dims, dtype)] += nbytes
    return by, float(held)


def planned(shape: tuple[int, ...], seq: int) -> float:
    """The planner's saved bytes of one layer (``hf-deepspeed``), a token."""
    h, f, heads, kv, vocab = shape
    model = gpt_model(
        f"gpt:hidden={h};layers=2;heads={heads};kv={kv};ffn={f};swiglu=1;rmsnorm=1;rope=1;"
        f"bias=0;tied=0;vocab={vocab};seq={seq}"
    )
    job = planner.TrainingJob(seq_len=seq, global_batch=1, framework="hf-deepspeed")
    cost = block_cost(model, "layer.1", shard_of(job, planner.Layout.uniform(model)))
    return sum(g.bytes for g in cost.saved) / seq


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--shapes", default="llama2-shape-512,llama3-shape-512")
    args = p.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("hf_saved_tensors: needs transformers (pip install transformers)")
        return 2
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {args.device}")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        one, held1 = saved(shape, 1, args.seq, args.device)
        two, held2 = saved(shape, 2, args.seq, args.device)
        layer = {k: two[k] - one[k] for k in set(one) | set(two) if two[k] != one[k]}
        measured = sum(layer.values()) / args.seq
        model = planned(shape, args.seq)
        held = (held2 - held1) / args.seq
        line = f"{name} (seq {args.seq}): one layer keeps {measured:,.0f} B a token"
        if args.device == "cuda":
            line += f" (allocated after the forward: {held:,.0f})"
        print(
            f"{line}; the planner's hf-deepspeed layer {model:,.0f} ({model / measured - 1:+.2%})"
        )
        for (dims, dtype), nbytes in sorted(layer.items(), key=lambda kv: -kv[1]):
            print(f"    {dtype:9} {dims!s:22} {nbytes / args.seq:9,.0f} B a token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
