"""Saved activations against Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models" (MLSys 2023, arXiv 2205.05198), Table 2: activation memory per
transformer layer in bytes, 16-bit activations, 1-byte dropout masks, no flash attention:

    no parallelism                      s*b*h*(34 + 5*a*s/h)
    tensor parallel (t)                 s*b*h*(10 + 24/t + 5*a*s/(h*t))
    tensor + sequence parallel          s*b*h/t*(34 + 5*a*s/h)
    tensor parallel + selective         s*b*h*(10 + 24/t)
    tensor + sequence + selective       s*b*h/t*34
    full recomputation                  s*b*h*2

on a GPT layer (layernorm, MHA, GeLU MLP of 4h, dropout), here GPT-3 175B's shape.
"""

from __future__ import annotations

import pytest

import planner
from planner.costs.blocks import Shard, block_cost
from planner.layout import parse_recompute

GPT3 = planner.load_model("gpt3-175b")
S, B, H, A = 2048, 1, GPT3.hidden_size, GPT3.num_attention_heads


def saved(*, tp: int, sp: bool, recompute: str) -> int:
    shard = Shard(seq_len=S, micro_batch=B, tp=tp, sequence_parallel=sp, flash_attention=False)
    return block_cost(GPT3, "layer.0", shard).saved_bytes(parse_recompute(recompute))


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_tensor_parallel_without_sequence_parallel(tp: int) -> None:
    expected = S * B * H * (10 + 24 / tp + 5 * A * S / (H * tp))
    assert saved(tp=tp, sp=False, recompute="none") == pytest.approx(expected, rel=1e-12)


def test_no_parallelism() -> None:
    assert saved(tp=1, sp=False, recompute="none") == S * B * H * 34 + 5 * A * S * S * B


@pytest.mark.parametrize("tp", [2, 8])
def test_tensor_and_sequence_parallel(tp: int) -> None:
    expected = S * B * H / tp * (34 + 5 * A * S / H)
    assert saved(tp=tp, sp=True, recompute="none") == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("tp", [2, 8])
def test_selective_recompute(tp: int) -> None:
    # Korthikanti's selective recomputation drops exactly the s^2 attention-core tensors,
    # which is Megatron-LM's default --recompute-modules core_attn.
    assert saved(tp=tp, sp=False, recompute="selective") == pytest.approx(
        S * B * H * (10 + 24 / tp), rel=1e-12
    )
    assert saved(tp=tp, sp=True, recompute="selective") == pytest.approx(
        S * B * H / tp * 34, rel=1e-12
    )


def test_full_recompute_keeps_only_the_layer_input() -> None:
    assert saved(tp=1, sp=False, recompute="full") == S * B * H * 2


def test_flash_attention_removes_every_s_squared_term() -> None:
    # Doubling the sequence exactly doubles the saved bytes when no s^2 tensor is kept.
    def flash(seq: int) -> int:
        return block_cost(GPT3, "layer.0", Shard(seq_len=seq)).saved_bytes()

    assert flash(2 * S) == 2 * flash(S)
