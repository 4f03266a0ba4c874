"""The caching allocator's requests of a real run, written on the meta device
(``planner.run.requests``) and replayed (``planner.allocator``), against the peaks the same
layout measured on an H200 (``benchmarks/logs/h200/alloc/peaks.jsonl``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from planner.allocator import replay
from planner.errors import PlannerError
from planner.layout import Layout
from planner.run.validate import describe, layout_name, one_gpu_set, small_job

torch = pytest.importorskip("torch")
requests_mod = pytest.importorskip("planner.run.requests")

PEAKS = (
    Path(__file__).resolve().parents[1] / "benchmarks" / "logs" / "h200" / "alloc" / "peaks.jsonl"
)


def _measured(model: str, layout: str) -> dict[str, int]:
    for line in PEAKS.read_text().splitlines():
        row = json.loads(line)
        if row["model"] == model and row["layout"] == layout:
            return row  # type: ignore[no-any-return]
    raise KeyError((model, layout))


def test_a_dense_layout_replays_to_its_measured_peaks() -> None:
    """A 4-layer Llama 3 8B, micro-batch 8, selective recompute: measured on one H200 at
    51.797 GiB allocated and 62.342 GiB reserved (peaks.jsonl, case 11). Written without a
    GPU and replayed, the allocated peak lands within 0.1% (the meta device's math-path
    attention alone would build 16 GiB score matrices) and the reserved within 1%."""
    job, cases = one_gpu_set()
    model, layout = next(
        (m, lay)
        for m, lay in cases
        if lay.micro_batch == 8 and "selective" in layout_name(describe(lay))
    )
    measured = _measured(model.name, layout_name(describe(layout)))
    state = replay(requests_mod.requests(model, job, layout))
    assert state.peak_allocated == pytest.approx(measured["allocated_peak_bytes"], rel=1e-3)
    assert state.peak_reserved == pytest.approx(measured["reserved_peak_bytes"], rel=1e-2)


def test_the_flash_backward_workspace_is_the_traced_request() -> None:
    """At micro-batch 8, 32 query and 8 key/value heads of 128, sequence 4,096, BF16, the
    real runs' traces hold one request of 1,077,936,384 bytes inside each attention backward:
    the FP32 sums and query-gradient accumulator, and the key and value gradients at every
    query head; the trace's request is 256 bytes more (one 512-byte block when rounded)."""
    q = torch.empty(8, 32, 4096, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(8, 8, 4096, 128, dtype=torch.bfloat16, device="meta")
    assert 0 < 1_077_936_384 - requests_mod.flash_backward_workspace(q, k) <= 512
    # without grouped-query attention, no expanded key and value gradients
    assert requests_mod.flash_backward_workspace(q, q) == 8 * 32 * 4096 * (4 + 4 * 128)


def test_every_storage_is_released_that_the_step_does_not_keep() -> None:
    """A small MoE model (routing through the meta device's even split): the requests end
    with only the state a run keeps between steps live: weights, gradients left by the last
    step's backward (None after zero_grad), AdamW's moments and cuBLAS's two workspaces."""
    from planner.catalog import load_model

    model = load_model("mixtral-8x7b").model_copy(
        update={
            "name": "tiny-moe",
            "num_layers": 1,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_ffn_hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 256,
        }
    )
    job = small_job(seq_len=32, global_batch=2, dtype="bf16")
    events = requests_mod.requests(model, job, Layout.uniform(model, micro_batch=1), steps=2)
    made = [e for e in events if e[0] == "malloc"]
    freed = {e[1] for e in events if e[0] == "free"}
    live = sum(made[i][1] for i in range(len(made)) if i not in freed)
    params = 2 * (model.vocab_size * model.hidden_size) + sum(
        p.numel() for p in _layer(model).parameters()
    )
    # weights and two moments (BF16: 2 bytes each), the workspaces, a few norm weights
    assert live == pytest.approx(3 * 2 * params + 2 * requests_mod.CUBLAS_WORKSPACE, rel=0.02)


def _layer(model: object) -> torch.nn.Module:
    from planner.run.model import DenseLayer

    with torch.device("meta"):
        return DenseLayer(model, torch.bfloat16, moe=True)  # type: ignore[arg-type]


def test_layouts_of_several_ranks_are_refused_in_one_line() -> None:
    job, cases = one_gpu_set()
    model, layout = cases[0]
    two = layout.model_copy(update={"dp": 2})
    with pytest.raises(PlannerError, match=r"^Layout.world_size=2: .*one-GPU layouts only$"):
        requests_mod.requests(model, job, two)


def test_an_own_runs_log_is_set_against_its_replayed_requests() -> None:
    """``planner calibrate --log`` on ``planner validate``'s own logs: the log states the
    model, job and layout, and its reserved peak (62,342 MiB logged at micro-batch 8 with
    selective recompute on one H200) is within 1% of the replayed requests' reserved peak."""
    from planner.cli.calibrate_logs import replayable, replayed_reserved
    from planner.logs import runs_from_logs

    logs = PEAKS.parents[1] / "one-gpu"
    (run,) = runs_from_logs([str(logs / "11-pp1-dp1-ep1-z1-mb8-1f1b-selective.log")])
    assert replayable(run)
    reserved = replayed_reserved(run)
    assert reserved == pytest.approx(run.reserved_peak_bytes, rel=1e-2)
    # a Megatron-LM run's log is its own framework's requests, not this runtime's
    assert not replayable(dataclasses.replace(run, framework="megatron"))


def test_a_log_the_runtime_cannot_replay_is_said_not_fatal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A log's layout the runtime does not run (here an EMA, which real runs leave out) gets
    its reason in the replay's table; the other logs are still replayed."""
    from planner.cli.calibrate_logs import _print_replayed
    from planner.logs import runs_from_logs

    logs = PEAKS.parents[1] / "one-gpu"
    (run,) = runs_from_logs([str(logs / "12-pp1-dp1-ep1-z1-mb8-1f1b-full.log")])
    ema = dataclasses.replace(run, path="ema.log", job=run.job.model_copy(update={"ema": True}))
    _print_replayed([ema, run])
    out = capsys.readouterr().out
    assert "not replayed" in out and "plain AdamW" in out
    assert "over 1 logs" in out


def test_a_process_group_of_several_ranks_is_refused_not_waited_on() -> None:
    """Inside a job's process group of several ranks, the rank's own groups would wait on the
    others: refused in one line."""
    import torch.distributed as dist

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    job, cases = one_gpu_set()
    model, layout = cases[-1]
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(PlannerError, match=r"^requests: a process group of 2 ranks is up"):
            requests_mod.requests(model, job, layout)
    finally:
        dist.destroy_process_group()


def test_forced_balance_routes_the_same_tokens_on_the_meta_device() -> None:
    """Routing by random logits (TrainingJob.moe_force_balance, Megatron-LM's
    --moe-router-force-load-balancing) draws them on the CPU: the meta device, which cannot
    count tokens per expert from a router, gets the very counts a real run gets, where
    the router's own routing is taken as even; a checkpointed recompute draws the same
    logits again, so its tensors match the forward's."""
    from torch.utils.checkpoint import checkpoint

    from planner.catalog import load_model
    from planner.run.model import MoE

    model = load_model("mixtral-8x7b").model_copy(
        update={"name": "tiny-moe", "hidden_size": 32, "moe_ffn_hidden_size": 16}
    )
    counts = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        with torch.device(device):
            moe = MoE(model, torch.float32)
            x = torch.randn(4, 64, 32, requires_grad=True)
        moe.force_balance()
        # the CPU generator in one state on both (on a GPU the runtime's weights draw from
        # CUDA's generator and leave the CPU's as its seeding left it)
        torch.manual_seed(1)
        out = checkpoint(moe, x, use_reentrant=False)
        first = list(moe.counts)
        if device == "cpu":
            out.sum().backward()  # the recompute's shapes must match the forward's
            assert moe.counts == first
        counts[device] = first
    assert counts["cpu"] == counts["meta"]
    assert sum(counts["cpu"]) == 4 * 64 * model.experts_per_token
    assert len(set(counts["cpu"])) > 1  # random, not an even split
