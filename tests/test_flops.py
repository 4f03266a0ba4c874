"""FLOPs against Narayanan et al. SC'21 ("Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM"), section 5.1: a GPT layer costs 24*B*s*h^2 forward in its
GEMMs and 4*B*s^2*h in attention; with full recomputation an iteration is
96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)). Their attention term is for the full s x s score
matrix, which is what unfused attention executes; flash attention skips the masked half of a
causal matrix (``CAUSAL``)."""

from __future__ import annotations

import pytest

import planner
from planner.costs.blocks import CAUSAL, Shard, block_cost

GPT3 = planner.load_model("gpt3-175b")
S, B, H, V, L = 2048, 2, GPT3.hidden_size, GPT3.vocab_size, GPT3.num_layers


def test_layer_forward() -> None:
    cost = block_cost(GPT3, "layer.0", Shard(seq_len=S, micro_batch=B, flash_attention=False))
    assert cost.fwd_flops == pytest.approx(24 * B * S * H**2 + 4 * B * S**2 * H)
    assert cost.bwd_input_flops == pytest.approx(cost.fwd_flops * 2 - cost.bwd_weight_flops)
    assert cost.bwd_weight_flops == pytest.approx(24 * B * S * H**2)  # one dW GEMM per GEMM


def test_full_recompute_iteration() -> None:
    shard = Shard(seq_len=S, micro_batch=B, flash_attention=False)
    total = 0.0
    for name in planner.costs.blocks.block_names(GPT3):
        cost = block_cost(GPT3, name, shard)
        total += cost.fwd_flops + cost.bwd_flops
        if name.startswith("layer."):
            total += cost.recompute_flops("full")
    expected = 96 * B * S * L * H**2 * (1 + S / (6 * H) + V / (16 * L * H))
    assert total == pytest.approx(expected, rel=1e-9)


def test_flash_attention_computes_half_of_a_causal_score_matrix() -> None:
    unfused = block_cost(GPT3, "layer.0", Shard(seq_len=S, flash_attention=False)).fwd
    flash = block_cost(GPT3, "layer.0", Shard(seq_len=S)).fwd
    assert unfused.gemm - flash.gemm == pytest.approx(4 * S**2 * H)
    assert flash.attention == pytest.approx(CAUSAL * 4 * S**2 * H)
    assert flash.flops == pytest.approx(24 * S * H**2 + CAUSAL * 4 * S**2 * H)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_tensor_parallel_divides_the_work(tp: int) -> None:
    one = block_cost(GPT3, "layer.0", Shard(seq_len=S))
    split = block_cost(GPT3, "layer.0", Shard(seq_len=S, tp=tp))
    assert split.fwd_flops == pytest.approx(one.fwd_flops / tp)


def test_moe_layer_counts_only_routed_tokens() -> None:
    """A DeepSeek-V3 MoE layer's expert GEMMs: each token visits 8 routed experts and the
    shared one, 3 matrices of 7168 x 2048 each: 2 * 9 * 3 * 7168 * 2048 FLOPs per token."""
    ds = planner.load_model("deepseek-v3")
    t = 4096
    moe = block_cost(ds, "layer.3", Shard(seq_len=t))
    dense = block_cost(ds, "layer.0", Shard(seq_len=t))
    expert_flops = 2 * 9 * 3 * 7168 * 2048 * t + 2 * t * 7168 * 256  # + router
    mlp_flops = 2 * 3 * 7168 * 18432 * t
    assert moe.fwd_flops - dense.fwd_flops == pytest.approx(expert_flops - mlp_flops)


def test_recompute_menu_offers_each_module_the_block_has() -> None:
    ds = planner.load_model("deepseek-v3")
    menu = block_cost(ds, "layer.3", Shard(seq_len=4096)).menu()
    modules = {next(iter(c)) for c in menu if isinstance(c, frozenset) and c}
    assert modules == {"core_attn", "layernorm", "mla_up_proj", "moe", "moe_act", "shared_experts"}
    assert menu[0] == frozenset() and menu[-1] == "full"
    dense = block_cost(planner.load_model("llama3-8b"), "layer.0", Shard(seq_len=4096)).menu()
    assert {next(iter(c)) for c in dense if isinstance(c, frozenset) and c} == {
        "core_attn",
        "layernorm",
        "mlp",
    }
