"""What a real PyTorch layer keeps for backward against what the cost model says it keeps.

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


@pytest.mark.parametrize(("micro_batch", "seq_len"), [(1, 256), (2, 512)])
@pytest.mark.parametrize("recompute", ["none", "mlp", "full"])
@pytest.mark.parametrize("kv_heads", [2, 8])
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
