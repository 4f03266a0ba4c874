"""The eager PyTorch runtime (``framework="torch"``, what ``planner validate`` runs) as its
real runs hold memory and spend time: gradients freed after every step, PyTorch's
single-tensor AdamW; checked against the H200 runs kept as logs in benchmarks/logs/h200
(``benchmarks/gpu_validate_logs.sh``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner import evaluate, runs_from_logs, simulate
from planner.catalog import load_cluster, load_model
from planner.costs.memory import stage_memory
from planner.costs.state import SINGLE_TENSOR_ADAMW
from planner.costs.timing import optimizer_time
from planner.layout import Layout, parse_recompute
from planner.logs import LoggedRun
from planner.run.validate import one_gpu_set
from planner.specs import TrainingJob

LOGS = Path(__file__).resolve().parents[1] / "benchmarks" / "logs" / "h200"


def _runs(kind: str) -> list[LoggedRun]:
    return runs_from_logs(sorted((LOGS / kind).glob("*.log")))


def _predicted_allocated(run: LoggedRun, share: float) -> float:
    job = TrainingJob(**{**run.job.model_dump(), "buffers_at_peak": share})
    m = run.job.global_batch // (run.layout.dp * run.layout.micro_batch)
    return max(
        s.allocated_bytes
        for s in stage_memory(run.model, job, run.layout, num_microbatches=m, runtime="torch")
    )


def test_the_h200_logs_are_the_one_gpu_sets_as_they_ran() -> None:
    job, cases = one_gpu_set()
    runs = _runs("one-gpu")

    def said(layout: Layout) -> tuple[int, list[frozenset[str] | str]]:
        return layout.micro_batch, [
            parse_recompute(b.recompute) for s in layout.stages for b in s.blocks
        ]

    assert [said(r.layout) for r in runs] == [said(layout) for _, layout in cases]
    assert all(r.framework == "torch" and r.job.seq_len == job.seq_len for r in runs)
    assert len(_runs("one-gpu-moe")) == 6 and len(_runs("one-gpu-expandable")) == 6


def test_a_forward_peak_before_the_first_backward_holds_no_gradients() -> None:
    """Measured on one H200 (benchmarks/logs/h200/one-gpu): the allocator's peak is the
    forward's end, weights + optimizer state + activations, and with a single micro-batch a
    step (micro-batch 8 of 8 sequences) the gradients freed by the last step's zero_grad are
    not yet made again: 51.81 GiB allocated where holding them would make 55.4. Every layout
    is predicted within 0.5% with none of the backward's transients live at the peak."""
    for run in _runs("one-gpu"):
        predicted = _predicted_allocated(run, share=0.0)
        assert run.allocated_peak_bytes is not None
        assert abs(predicted / run.allocated_peak_bytes - 1) < 0.005, run.name


def test_gradients_are_made_in_the_first_backward_only_where_the_runtime_frees_them() -> None:
    model = load_model("llama3-8b").model_copy(update={"num_layers": 2})
    job = TrainingJob(seq_len=4096, global_batch=4, framework="torch", fragmentation=0.0)
    one = Layout.uniform(model, micro_batch=4)  # one micro-batch a step
    two = Layout.uniform(model, micro_batch=2)  # the second forward runs with gradients
    (first,) = stage_memory(model, job, one, num_microbatches=1, runtime="torch")
    assert first.buckets["grads"] == 0 and first.step_grad_bytes > 0
    (second,) = stage_memory(model, job, two, num_microbatches=2, runtime="torch")
    assert second.buckets["grads"] == second.step_grad_bytes == first.step_grad_bytes
    # torchtitan's train_step opens with zero_grad() (set_to_none) up to its CUDA-graph trainer
    titan = job.model_copy(update={"framework": "torchtitan"})
    (fsdp,) = stage_memory(model, titan, Layout.uniform(model, micro_batch=4), num_microbatches=1)
    assert fsdp.step_grad_bytes > 0
    # Megatron-LM keeps its gradient buffer from step to step
    megatron = job.model_copy(update={"framework": "megatron"})
    (kept,) = stage_memory(model, megatron, one, num_microbatches=1)
    assert kept.buckets["grads"] > 0 and kept.step_grad_bytes == 0
    # planner.run keeps a data-parallel group's gradients in one flat buffer below ZeRO-2
    dp = Layout.uniform(model, micro_batch=4, dp=2, zero=1)
    (bucketed,) = stage_memory(model, job, dp, num_microbatches=1, runtime="torch")
    assert bucketed.buckets["grads"] > 0 and bucketed.step_grad_bytes == 0
    # the simulator makes them at the same point: its peaks are the closed form's
    cluster = load_cluster("h200", gpus=1)
    for layout in (one, two):
        closed = [m.peak_bytes for m in evaluate(model, cluster, job, layout).memory]
        assert simulate(model, cluster, job, layout).peak_bytes == closed


def test_the_first_backward_can_peak_with_part_of_the_gradients_made() -> None:
    """Full recompute at a long sequence: little is saved, but each layer's backward
    rebuilds its activations while the later layers' gradients are already made. The peak
    is inside the first backward, above both the forward's peak and all the gradients."""
    model = load_model("mixtral-8x7b").model_copy(update={"num_layers": 4})
    job = TrainingJob(seq_len=32768, global_batch=1, framework="torch", fragmentation=0.0)
    layout = Layout.uniform(model, recompute="full")
    (rank,) = stage_memory(model, job, layout, num_microbatches=1, runtime="torch")
    made, live = rank.step_grad_bytes, rank.buckets["grads"]
    assert 0 < live < made < live + rank.buckets["activations"]
    # a short sequence: the gradients outweigh one micro-batch's activations, and the peak
    # is that backward's end, every gradient made and nothing saved left
    short = job.model_copy(update={"seq_len": 256})
    (end,) = stage_memory(model, short, layout, num_microbatches=1, runtime="torch")
    assert end.buckets["grads"] == end.step_grad_bytes and end.buckets["activations"] == 0


def test_single_tensor_adamw_moves_forty_bytes_an_element_at_bf16() -> None:
    """torch.optim.AdamW(foreach=False): 8 kernels, 20 element passes of BF16 (counted from
    torch/optim/adam.py); the H200 profile of the MoE set's micro-batch-2 step measured
    31.2 ms of AdamW kernels for 3.08 billion parameters (benchmarks/RESULTS.md)."""
    assert sum(SINGLE_TENSOR_ADAMW.values()) == 20
    job, cases = one_gpu_set(moe=True)
    model, layout = cases[3]
    (rank,) = stage_memory(model, job, layout, num_microbatches=4, runtime="torch")
    assert rank.step_bytes["step_hbm"] == pytest.approx(40 * rank.params, rel=1e-9)
    seconds = optimizer_time(rank, load_cluster("h200", gpus=1))
    assert seconds == pytest.approx(31.2e-3, rel=0.1)
    fused = job.model_copy(update={"framework": "megatron", "master_dtype": None})
    (megatron,) = stage_memory(model, fused, layout, num_microbatches=4)
    assert megatron.step_bytes["step_hbm"] < 0.35 * rank.step_bytes["step_hbm"]


def test_the_memory_table_says_where_the_gradients_went(capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli.render import print_memory

    model = load_model("llama3-8b").model_copy(update={"num_layers": 2})
    job = TrainingJob(seq_len=4096, global_batch=4, framework="torch")
    cluster = load_cluster("h200", gpus=1)
    for micro_batch, said in ((4, True), (2, False)):
        layout = Layout.uniform(model, micro_batch=micro_batch)
        print_memory("job", layout, evaluate(model, cluster, job, layout), 0.05)
        out = " ".join(capsys.readouterr().out.split())
        assert ("freed after each step and made again in its first backward" in out) is said
