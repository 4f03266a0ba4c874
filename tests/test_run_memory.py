"""What real PyTorch layers keep for backward against what the cost model says they keep:
dense GQA/MHA, MoE (softmax and sigmoid routers, shared experts) and MLA layers.

The layer (``planner.run.model.DenseLayer``) is written the way fused training kernels save
tensors; the measurement counts every tensor autograd saves, once per storage. The cost
model's per-block tables must agree within 1% (the layer's own extra: RMSNorm's per-token
FP32 inverse RMS, 4 bytes a token against thousands)."""

from __future__ import annotations

import pytest

import planner
from planner.costs.blocks import Shard, block_cost

torch = pytest.importorskip("torch")

from planner.run.measure import saved_bytes  # noqa: E402
from planner.run.model import DenseLayer  # noqa: E402

SMALL = planner.load_model("llama3-8b").model_copy(
    update={
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 64,
        "ffn_hidden_size": 1408,
        "num_layers": 2,
    }
)
CHOICES = {"none": frozenset(), "mlp": frozenset({"mlp"}), "full": "full"}


# Every pair of values of the three choices meets once (shape x recompute, recompute x
# kv heads, shape x kv heads): half the runs of the full grid.
@pytest.mark.parametrize(
    ("micro_batch", "seq_len", "recompute", "kv_heads"),
    [
        (1, 256, "none", 2),
        (1, 256, "mlp", 8),
        (1, 256, "full", 2),
        (2, 512, "none", 8),
        (2, 512, "mlp", 2),
        (2, 512, "full", 8),
    ],
)
def test_saved_activations_match_the_cost_model(
    micro_batch: int, seq_len: int, recompute: str, kv_heads: int
) -> None:
    model = SMALL.model_copy(update={"num_kv_heads": kv_heads})
    torch.manual_seed(0)
    layer = DenseLayer(model)
    x = torch.randn(micro_batch, seq_len, model.hidden_size, dtype=torch.bfloat16)
    x.requires_grad_()
    measured = saved_bytes(layer, lambda: layer(x, recompute))
    predicted = block_cost(model, "layer.0", Shard(seq_len=seq_len, micro_batch=micro_batch))
    expected = predicted.saved_bytes(CHOICES[recompute])
    assert measured == pytest.approx(expected, rel=0.01)
    assert measured >= expected  # what the model leaves out is the small inverse RMS


MOE = {
    # Mixtral-like: softmax router, 8 experts, top 2, no shared expert.
    "mixtral-8x7b": {"moe_ffn_hidden_size": 512},
    # Qwen2-MoE-like: 64 experts, top 8, a shared expert (its gate left out here).
    "qwen2-57b-a14b": {
        "moe_ffn_hidden_size": 256,
        "shared_expert_ffn_hidden_size": 512,
        "shared_expert_gate": False,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "moe", "full"])
@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_layers_keep_what_the_cost_model_says(name: str, recompute: str) -> None:
    model = planner.load_model(name).model_copy(
        update={
            "hidden_size": 1024,
            "num_attention_heads": 8,
            "num_kv_heads": 2,
            "head_dim": 128,
            "num_layers": 2,
            "ffn_hidden_size": 2048,
            **MOE[name],
        }
    )
    torch.manual_seed(0)
    layer = DenseLayer(model, moe=True)
    # 128 tokens: what the model leaves out is per token, so the tolerance means the same at
    # any length, and eager BF16 attention on a CPU takes 4x as long at 512
    x = torch.randn(1, 128, model.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    measured = saved_bytes(layer, lambda: layer(x, recompute))
    choice = {"none": frozenset(), "moe": frozenset({"moe"}), "full": "full"}[recompute]
    expected = block_cost(model, "layer.0", Shard(seq_len=128)).saved_bytes(choice)
    # Left out by the model: the inverse RMS per token and the int32 token row map.
    assert expected <= measured <= expected * 1.01


DEEPSEEK_SMALL = planner.load_model("deepseek-v3").model_copy(
    update={
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "q_lora_rank": 256,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "num_layers": 2,
        "first_dense_layers": 1,
        "ffn_hidden_size": 2048,
        "num_experts": 16,
        "experts_per_token": 4,
        "moe_ffn_hidden_size": 256,
        "shared_expert_ffn_hidden_size": 256,
        "num_mtp_layers": 0,
        "expert_groups": 1,
        "groups_per_token": 1,
    }
)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "ffn", "full"])
@pytest.mark.parametrize("block", ["layer.0", "layer.1"])  # dense, then MoE (sigmoid router)
def test_mla_layers_keep_what_the_cost_model_says(block: str, recompute: str) -> None:
    moe = block == "layer.1"
    torch.manual_seed(0)
    layer = DenseLayer(DEEPSEEK_SMALL, moe=moe)
    x = torch.randn(1, 128, 1024, dtype=torch.bfloat16, requires_grad=True)  # see above
    module = "moe" if moe else "mlp"
    name = module if recompute == "ffn" else recompute
    measured = saved_bytes(layer, lambda: layer(x, name))
    choice = {"none": frozenset(), "ffn": frozenset({module}), "full": "full"}[recompute]
    expected = block_cost(DEEPSEEK_SMALL, block, Shard(seq_len=128)).saved_bytes(choice)
    assert expected <= measured <= expected * 1.01


def test_custom_backward_passes_are_exact() -> None:
    """The kernels written to keep what fused kernels keep still differentiate correctly."""
    from planner.run import model as m

    def double(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    x, w = double(3, 5, 8), double(8)
    assert torch.autograd.gradcheck(lambda a, b: m._RMSNorm.apply(a, b, 1e-6), (x, w))
    g, u = double(4, 6), double(4, 6)
    assert torch.autograd.gradcheck(m._SwiGLU.apply, (g, u))
    cos, sin = torch.rand(5, 1, 8, dtype=torch.float64), torch.rand(5, 1, 8, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a: m._Rotary.apply(a, cos, sin), (double(2, 5, 3, 8),))
    rows = torch.tensor([2, 0, 1, 2, 0], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda a: m._Permute.apply(a, rows), (double(3, 4),))
    assert torch.autograd.gradcheck(lambda a: m._Unpermute.apply(a, rows, 3), (double(5, 4),))
    q, k, v = double(1, 2, 5, 6), double(1, 2, 5, 6), double(1, 2, 5, 4)
    assert torch.autograd.gradcheck(m._Attention.apply, (q, k, v))
    logits = double(6, 5)
    for sigmoid in (False, True):
        assert torch.autograd.gradcheck(
            lambda a, s=sigmoid: m._Router.apply(a, 2, s, None)[0], (logits,)
        )


def test_the_measurement_sees_a_tensor_kept_twice_once() -> None:
    """Storage-level counting: a view of a saved tensor adds nothing, a copy adds its bytes."""
    weight = torch.nn.Parameter(torch.ones(64, 64))
    module = torch.nn.Module()
    module.weight = weight
    x = torch.randn(8, 64, requires_grad=True)

    def view_twice() -> torch.Tensor:
        y = x * 2.0
        return (y @ weight).sum() + (y.view(8, 64) @ weight).sum()

    def copy_twice() -> torch.Tensor:
        y = x * 2.0
        return (y @ weight).sum() + (y.clone() @ weight).sum()

    one = 8 * 64 * 4
    assert saved_bytes(module, view_twice) == one
    assert saved_bytes(module, copy_twice) == 2 * one


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_state_per_rank_under_zero_matches_pytorchs_sharding(zero: int) -> None:
    """Two gloo processes train a small Mixtral-shaped model one step: DDP-style (ZeRO-0),
    ZeroRedundancyOptimizer (ZeRO-1) or FSDP2 (ZeRO-3). Each rank's weights, gradients and
    AdamW state, read from the tensors PyTorch holds, against ``costs.state.state_bytes``
    (FP32 weights, gradients and moments, no master copy: plain PyTorch training)."""
    from planner.costs.state import state_bytes
    from planner.run.state import measure_state

    model = planner.load_model("mixtral-8x7b").model_copy(
        update={
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 64,
            "num_layers": 2,
            "ffn_hidden_size": 512,
            "moe_ffn_hidden_size": 256,
        }
    )
    job = planner.TrainingJob(
        seq_len=64,
        global_batch=8,
        weight_dtype="fp32",
        grad_dtype="fp32",
        master_dtype=None,
        moment_dtype="fp32",
    )
    ranks = measure_state(model, dp=2, zero=zero)
    layout = planner.Layout.uniform(model, dp=2, zero=zero)
    params = [
        p
        for i in range(model.num_layers)
        for p in block_cost(model, f"layer.{i}", Shard(seq_len=64)).params
    ]
    predicted = state_bytes(params, job=job, layout=layout, ema_on_gpu=True)
    for measured in ranks:
        for bucket in ("weights", "grads", "optimizer"):
            assert measured[bucket] == pytest.approx(predicted[bucket], rel=0.05), bucket
