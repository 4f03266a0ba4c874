"""What each framework keeps: default dtypes, FP8 copies of linear inputs, FP8 caching of
activation inputs, where MoE routing probabilities are applied, torchtitan's per-op
selective checkpointing and its pipeline-parallel FSDP2, the loss's logits, and the
DeepSeek-V3 recipe that fits 80 GB as it did in reality."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from test_export import plan_of

import planner
from planner.costs.blocks import FP8_SAVED_BYTES, block_cost
from planner.costs.memory import shard_of, stage_memory, workspace_bytes
from planner.costs.state import state_bytes
from planner.export import megatron
from planner.fit import gpt_model
from planner.layout import parse_recompute
from planner.solve.space import enumerate_configs

LLAMA8 = planner.load_model("llama3-8b")
MIXTRAL = planner.load_model("mixtral-8x7b")


def _layer(model: planner.ModelSpec, job: planner.TrainingJob, **fields: object):  # type: ignore[no-untyped-def]
    layout = planner.Layout.uniform(model, **fields)  # type: ignore[arg-type]
    return block_cost(model, "layer.1", shard_of(job, layout))


def _group(cost, name: str) -> int:  # type: ignore[no-untyped-def]
    return sum(g.bytes for g in cost.saved if g.name == name)


def test_default_dtypes_are_each_frameworks() -> None:
    # Megatron-LM: --bf16 accumulates and reduces gradients in FP32 unless
    # --grad-reduce-in-bf16 (megatron/training/arguments.py); FSDP2 in torchtitan keeps FP32
    # parameters as the master copy and reduces in FP32.
    megatron = planner.TrainingJob(seq_len=1024, global_batch=8)
    assert (megatron.weight_dtype, megatron.grad_dtype, megatron.master_dtype) == (
        "bf16",
        "fp32",
        "fp32",
    )
    titan = planner.TrainingJob(seq_len=1024, global_batch=8, framework="torchtitan")
    assert (titan.weight_dtype, titan.grad_dtype, titan.master_dtype) == ("fp32", "fp32", None)
    assert titan.working_weight_dtype == "bf16"
    # A dtype the user gave stays when the framework changes; the others follow it.
    given = planner.TrainingJob(seq_len=1024, global_batch=8, grad_dtype="bf16")
    moved = given.with_framework("torchtitan")
    assert (moved.grad_dtype, moved.weight_dtype, moved.master_dtype) == ("bf16", "fp32", None)
    assert megatron.with_framework("torchtitan") == titan


def test_optimizer_state_per_parameter_follows_the_framework() -> None:
    """16 bytes per parameter under torchtitan's FSDP2 (FP32 parameter, gradient and two
    moments), 18 under Megatron-LM (BF16 weights, FP32 main gradient, master and moments)."""
    layout = planner.Layout.uniform(LLAMA8, zero=0)
    params = block_cost(
        LLAMA8, "layer.0", shard_of(planner.TrainingJob(seq_len=8, global_batch=1), layout)
    ).params
    n = sum(p.numel for p in params)
    for framework, per_param in (("megatron", 18), ("torchtitan", 16)):
        job = planner.TrainingJob(seq_len=8, global_batch=1, framework=framework)
        state = state_bytes(params, job=job, layout=layout, ema_on_gpu=True)
        assert state["weights"] + state["grads"] + state["optimizer"] == per_param * n


def test_megatron_keeps_narrow_moments_only_through_its_distributed_optimizer() -> None:
    # --exp-avg-dtype bf16 takes effect on the precision-aware optimizer, which needs
    # --use-distributed-optimizer (ZeRO-1): at ZeRO-0 and ZeRO-2 the moments are FP32 and
    # the export asks for none, so the plan and the launched job hold the same bytes.
    n = sum(
        p.numel
        for p in block_cost(
            LLAMA8,
            "layer.0",
            shard_of(
                planner.TrainingJob(seq_len=8, global_batch=1), planner.Layout.uniform(LLAMA8)
            ),
        ).params
    )
    for framework, zero, per_param in (
        ("megatron", 1, 4 + 2 + 2),  # FP32 master, BF16 moments (dp 1: nothing sharded)
        ("megatron", 0, 4 + 4 + 4),
        ("megatron", 2, 4 + 4 + 4),
        ("torch", 2, 4 + 2 + 2),  # no such rule
    ):
        layout = planner.Layout.uniform(LLAMA8, zero=zero)
        job = planner.TrainingJob(
            seq_len=8, global_batch=1, framework=framework, master_dtype="fp32", moment_dtype="bf16"
        )
        params = block_cost(LLAMA8, "layer.0", shard_of(job, layout)).params
        state = state_bytes(params, job=job, layout=layout, ema_on_gpu=True)
        assert state["optimizer"] == per_param * n, (framework, zero)


def test_megatron_export_asks_for_narrow_moments_only_where_they_were_costed() -> None:
    cluster = planner.load_cluster("h100", gpus=8)
    job = planner.TrainingJob(seq_len=4096, global_batch=64, moment_dtype="bf16")
    for zero, stated in ((1, True), (2, False)):
        layout = planner.Layout.uniform(LLAMA8, dp=8, zero=zero, recompute="full")
        out = megatron(plan_of(LLAMA8, cluster, job, layout))
        assert ("--exp-avg-dtype" in out.args) == stated
        assert not any("moments" in d for d in out.differences)


def test_fp8_linears_keep_fp8_inputs_where_the_framework_does() -> None:
    """Transformer Engine's linears (Megatron-LM) keep the FP8 copy of their input, 1 byte
    plus a 1/32-byte share of the scales; torchao's (torchtitan) keep the BF16 input."""
    tokens, heads, d = 4096, LLAMA8.num_attention_heads, LLAMA8.head_dim
    for framework, per_element in (("megatron", FP8_SAVED_BYTES), ("torchtitan", 2)):
        job = planner.TrainingJob(
            seq_len=tokens, global_batch=8, compute_dtype="fp8", framework=framework
        )
        cost = _layer(LLAMA8, job)
        assert _group(cost, "attn_proj_in") == round(tokens * heads * d * per_element)
        act = round(tokens * LLAMA8.ffn_hidden_size * per_element)
        assert _group(cost, "mlp_act") == act


def test_fp8_cache_stores_the_activation_input_in_fp8() -> None:
    job = planner.TrainingJob(seq_len=4096, global_batch=8, compute_dtype="fp8")
    plain, cached = (_layer(LLAMA8, job, fp8_cache=c) for c in (False, True))
    elements = 4096 * 2 * LLAMA8.ffn_hidden_size  # gate and up outputs
    assert _group(plain, "mlp_fc1_out") == elements * 2
    assert _group(cached, "mlp_fc1_out") == round(elements * FP8_SAVED_BYTES)
    assert cached.fwd.memory > plain.fwd.memory  # it quantises the copy it keeps
    bf16 = planner.TrainingJob(seq_len=4096, global_batch=8)
    with pytest.raises(planner.PlannerError, match="fp8_cache=True: needs compute_dtype='fp8'"):
        _layer(LLAMA8, bf16, fp8_cache=True)


def test_search_offers_fp8_caching_where_asked_and_where_it_exists() -> None:
    cluster = planner.load_cluster("h100", gpus=8)
    small = LLAMA8.model_copy(update={"num_layers": 2})
    both = [False, True]
    fp8 = planner.TrainingJob(seq_len=1024, global_batch=8, compute_dtype="fp8")

    def caches(job: planner.TrainingJob, asked: list[bool] | None) -> set[bool]:
        zero = [0] if job.framework == "torchtitan" else [1]  # torchtitan has no ZeRO-1
        space = planner.SearchSpace(tp=[1], pp=[1], zero=zero, micro_batch=[1], fp8_cache=asked)
        return {c.fp8_cache for c in enumerate_configs(small, cluster, job, space)}

    assert caches(fp8, None) == {False}  # off unless asked: it doubles the configurations
    assert caches(fp8, both) == {False, True}
    titan = planner.TrainingJob(
        seq_len=1024, global_batch=8, compute_dtype="fp8", framework="torchtitan"
    )
    with pytest.raises(planner.PlannerError, match=r"SearchSpace\.fp8_cache"):
        caches(titan, both)
    bf16 = planner.TrainingJob(seq_len=1024, global_batch=8)
    with pytest.raises(planner.PlannerError, match="needs compute_dtype='fp8'"):
        caches(bf16, both)


def test_megatron_experts_weight_by_probability_before_their_second_linear() -> None:
    """Megatron-Core's grouped experts multiply the routing probabilities into the activation
    (weighted SwiGLU), so the combine keeps nothing for their gradient; a weighted sum after
    the combine (planner.run, eager PyTorch) keeps every expert output."""
    tokens, k, h = 4096, MIXTRAL.experts_per_token, MIXTRAL.hidden_size
    megatron = _layer(MIXTRAL, planner.TrainingJob(seq_len=tokens, global_batch=8))
    torch = _layer(MIXTRAL, planner.TrainingJob(seq_len=tokens, global_batch=8, framework="torch"))
    assert _group(megatron, "moe_expert_out") == 0
    assert _group(megatron, "moe_probs") == tokens * k * 4
    assert _group(torch, "moe_expert_out") == tokens * k * h * 2


def test_per_op_checkpointing_keeps_what_torchtitans_policy_keeps() -> None:
    """torchtitan's "op" policy keeps every other matmul output (wq, wv, w1, w2 of wq, wk,
    wv, wo, w1, w3, w2) and the fused attention's output and statistics, besides the
    block's input: for a Llama block of T tokens, T x (h + nq*d + nkv*d + nq*d + ffn + h)
    BF16 elements and T x nq FP32 statistics."""
    t = 8192
    job = planner.TrainingJob(seq_len=t, global_batch=8, framework="torchtitan")
    cost = _layer(LLAMA8, job, dp=8, zero=3)
    m = LLAMA8
    nq, nkv, d, h, f = (
        m.num_attention_heads,
        m.num_kv_heads,
        m.head_dim,
        m.hidden_size,
        m.ffn_hidden_size,
    )
    expected = t * (h + nq * d + nkv * d + nq * d + f + h) * 2 + t * nq * 4
    assert cost.saved_bytes(parse_recompute("op")) == expected
    # It re-runs wk, wo and w3: 2 T h (nkv d + nq d + ffn) FLOPs, besides memory-bound ops.
    assert cost.recompute_work(parse_recompute("op")).gemm == pytest.approx(
        2 * t * h * (nkv * d + nq * d + f)
    )
    # Megatron-LM has no such policy: not on its menu.
    assert parse_recompute("op") in cost.menu()
    megatron = _layer(LLAMA8, planner.TrainingJob(seq_len=t, global_batch=8))
    assert parse_recompute("op") not in megatron.menu()


def test_per_op_checkpointing_keeps_the_expert_all_to_alls() -> None:
    """torchtitan's "op" save list holds _c10d_functional.all_to_all_single: under expert
    parallelism each MoE layer keeps its dispatched tokens and the combined expert outputs,
    T x k x h BF16 elements each (times the load imbalance), and recomputes the rest of the
    layer from them; with no all-to-all (ep 1) the layer keeps nothing of its experts."""
    lite = planner.load_model("deepseek-v2-lite")
    t, k, h = 4096, lite.experts_per_token, lite.hidden_size
    job = planner.TrainingJob(seq_len=t, global_batch=8, framework="torchtitan")
    op = parse_recompute("op")
    ep8 = _layer(lite, job, dp=8, ep=8, zero=3)
    ep1 = _layer(lite, job, dp=8, ep=1, zero=3)
    # the busiest rank's tokens: T x k copies times the job's load imbalance
    busiest = t * k * shard_of(job, planner.Layout.uniform(lite, dp=8, ep=8)).moe_load_imbalance
    assert ep8.kept_bytes("moe_dispatched", op) == round(busiest * h * 2)
    assert ep8.kept_bytes("moe_combined", op) == round(busiest * h * 2)
    assert ep8.saved_bytes(op) - ep1.saved_bytes(op) == 2 * round(busiest * h * 2)
    assert ep1.kept_bytes("moe_dispatched", op) == 0
    assert not any(g.name == "moe_combined" for g in ep1.saved)
    # Without per-op checkpointing the combined outputs are not held (the weighted sum keeps
    # the experts' outputs instead).
    assert ep8.kept_bytes("moe_combined", frozenset()) == 0


def test_published_out_of_memory_runs_are_over_the_cap() -> None:
    """benchmarks/published_memory.csv's ``oom`` rows are predicted over the planner's cap
    and its ``ran`` rows within it: torchtitan's DeepSeek-V3 16B default config ran out of
    memory on 8 H100 80GB at local batch 8 (torchtitan issue #1789) and was changed to 4 to
    fit (PR #1792); seven Qwen3 32B layouts of torchtitan PR #1690 ran out of memory on H100
    96GB. Without the all-to-alls that per-op checkpointing keeps, the model put DeepSeek's
    batch-8 run at 66.9 GiB, under the 75.2 GiB cap."""
    import test_accuracy

    bench = test_accuracy._memory_bench()
    told = list(bench.outcomes(bench.read_rows()))
    assert {row["kind"] for row, _ in told} == {"oom", "ran"}
    for row, result in told:
        assert not isinstance(result, str), (row["id"], result)
        peak, cap, _, _ = result
        assert (peak > cap) == (row["kind"] == "oom"), (row["id"], peak, cap)
    assert sum(row["kind"] == "oom" for row, _ in told) >= 8
    # Every run with a measured peak trained: each fits under the cap too
    rows = bench.read_rows()
    measured = [{**r, "kind": "ran"} for r, res in bench.costed(rows) if not isinstance(res, str)]
    fitted = [res for _, res in bench.outcomes(measured) if not isinstance(res, str)]
    assert len(fitted) >= 35
    assert all(peak <= cap for peak, cap, _, _ in fitted)


def test_torchtitan_pipelines_hold_unsharded_parameters_and_gradients() -> None:
    """With PP, torchtitan keeps FSDP2's unsharded BF16 parameters from the first forward to
    the last backward and accumulates unsharded FP32 gradients: 6 bytes per local parameter
    on top of the 16/dp of the shards."""
    job = planner.TrainingJob(seq_len=1024, global_batch=64, framework="torchtitan")
    small = LLAMA8.model_copy(update={"num_layers": 4})
    flat = planner.Layout.uniform(small, pp=1, dp=8, zero=3)
    piped = planner.Layout.uniform(small, pp=2, dp=4, zero=3)
    params = block_cost(small, "layer.0", shard_of(job, piped)).params
    n = sum(p.numel for p in params)
    held = state_bytes(params, job=job, layout=piped, ema_on_gpu=True)
    assert held["weights"] == pytest.approx(n * (4 / 4 + 2))
    assert held["grads"] == pytest.approx(n * (4 / 4 + 4))
    sharded = state_bytes(params, job=job, layout=flat, ema_on_gpu=True)
    assert sharded["weights"] == pytest.approx(n * 4 / 8)


def test_the_loss_holds_its_logits_for_a_moment() -> None:
    """BF16 logits live while the loss forms the FP32 softmax: in place (Megatron-LM's fused
    cross-entropy) 2 bytes per logit above the 4 kept; torchtitan's cross-entropy on
    logits.float() holds two FP32 gradients beside the log-softmax it keeps in backward, 8:
    measured on one H200 (benchmarks/RESULTS.md, 2026-11-26, `gpu_memory.py --loss eager`:
    8.00 bytes a logit above the kept 4.06 for Llama 3 8B, 70B and Qwen3 32B widths)."""
    small = LLAMA8.model_copy(update={"num_layers": 1})
    layout = planner.Layout.uniform(small)
    logits = 2048 * small.vocab_size
    for framework, moment in (("megatron", 2), ("torchtitan", 8)):
        job = planner.TrainingJob(seq_len=2048, global_batch=1, framework=framework)
        head = block_cost(small, "head", shard_of(job, layout))
        assert head.transient == logits * moment
        assert head.rebuilt_bytes(frozenset()) == logits * moment
    fp32 = planner.TrainingJob(seq_len=2048, global_batch=1, activation_dtype="fp32")
    assert block_cost(small, "head", shard_of(fp32, layout)).transient == 0
    # FP32 logits: .float() is no copy, but the backward's two FP32 gradients still live.
    titan32 = fp32.with_framework("torchtitan")
    assert block_cost(small, "head", shard_of(titan32, layout)).transient == logits * 8
    # tp > 1: DTensor's loss-parallel log-softmax holds the FP32 copy, the shifted copy and
    # its exponential at once, each over the vocabulary shard: 2 + 4 + 4 above the 4 kept;
    # its backward three FP32 tensors beside the kept one (measured: 10.00 and 12.00).
    titan = planner.TrainingJob(seq_len=2048, global_batch=1, framework="torchtitan")
    tp8 = planner.Layout.uniform(small, tp=8)
    head = block_cost(small, "head", shard_of(titan, tp8))
    assert head.transient == logits // 8 * 3 * 4


def test_the_loss_holds_what_it_held_on_a_gpu() -> None:
    """The loss's bytes a logit as measured on one H200 (benchmarks/gpu_memory_runs.jsonl,
    `gpu_memory.py`): kept after the forward, and the backward's peak above that, on the runs
    whose vocabulary (128K-152K) makes the loss the backward's largest moment. eager:
    cross-entropy on logits.float() (torchtitan's at tp 1); parallel: the same under DTensor's
    loss_parallel (torchtitan's with tp > 1); compiled: the eager loss under torch.compile;
    fused: in place over one FP32 copy (Megatron-LM's vocab-parallel cross-entropy)."""
    runs = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_memory_runs.jsonl"
    exact = {"eager": 0, "parallel": 0}
    for line in runs.read_text().splitlines():
        r = json.loads(line)
        model = planner.load_model(r["model"])
        if model.vocab_size < 100_000 or r["alloc_conf"]:
            continue
        last = max(int(x.get("step", 0)) for x in r["phases"])
        ph = {x["phase"]: x for x in r["phases"] if int(x.get("step", 0)) == last}
        logits = r["micro_batch"] * r["seq"] * model.vocab_size / 2**20  # MiB a byte a logit
        # What the loss keeps beside the final norm's BF16 output, which the head keeps too.
        norm = 2 * model.hidden_size / model.vocab_size
        kept = (ph["loss"]["allocated_MiB"] - ph["forward"]["allocated_MiB"]) / logits - norm
        above = (ph["backward"]["peak_allocated_MiB"] - ph["loss"]["allocated_MiB"]) / logits
        job = planner.TrainingJob(
            seq_len=r["seq"],
            global_batch=1,
            framework="megatron" if r["loss"] == "fused" else "torchtitan",
            compiled_loss=r["loss"] == "compiled",
        )
        tp = 2 if r["loss"] == "parallel" else 1  # one rank of a tensor-parallel group
        layout = planner.Layout.uniform(model, micro_batch=r["micro_batch"], tp=tp)
        head = block_cost(model, "head", shard_of(job, layout))
        n = r["micro_batch"] * r["seq"] * model.vocab_size / tp
        assert _group(head, "logits") / n == pytest.approx(kept, rel=0.01)
        # The layers' backward can peak above the loss's (recompute of a wide layer): the
        # model's transient is then below the phase's peak, never above it.
        assert head.transient / n <= above * 1.01
        if r["loss"] in exact:
            assert head.transient / n == pytest.approx(above, rel=0.01)
            exact[r["loss"]] += 1
    assert exact["eager"] >= 10 and exact["parallel"] >= 3


def test_megatrons_fused_cross_entropy_holds_what_each_implementation_holds() -> None:
    """--cross-entropy-loss-fusion (megatron/core/fusions/fused_cross_entropy.py at
    d98e8a64): the vocab-parallel cross-entropy's steps under torch.compile, one FP32 copy
    of the logits more while they run; --cross-entropy-fusion-impl te (Transformer Engine's
    parallel_cross_entropy) writes the gradient over the BF16 logits it keeps and allocates
    nothing beside them."""
    small = LLAMA8.model_copy(update={"num_layers": 1})
    layout = planner.Layout.uniform(small, tp=2)
    logits = 2048 * small.vocab_size // 2
    for fusion, kept, above in (("none", 4, 2), ("native", 4, 2 + 4), ("te", 2, 0)):
        job = planner.TrainingJob(seq_len=2048, global_batch=1, loss_fusion=fusion)
        head = block_cost(small, "head", shard_of(job, layout))
        assert (_group(head, "logits"), head.transient) == (logits * kept, logits * above)
    with pytest.raises(planner.PlannerError, match=r"loss_fusion='te'.*offers none"):
        planner.TrainingJob(seq_len=8, global_batch=1, framework="torchtitan", loss_fusion="te")
    fused = planner.TrainingJob(seq_len=8, global_batch=1, loss_fusion="native")
    assert fused.with_framework("torchtitan").loss_fusion == "none"
    assert fused.with_framework("megatron").loss_fusion == "native"


def test_the_fused_cross_entropy_costs_what_megatrons_tests_measured() -> None:
    """Megatron-LM's functional tests run gpt3_mcore_te_tp2_pp2 with and without
    --cross-entropy-loss-fusion on the same machines (benchmarks/megatron_ci_runs.csv, golden
    values at d98e8a64): the fused run's peak exceeds the other's by 85-99% of the FP32 copy
    the model adds for the fusion (334-391 MiB against 394), on each platform where both ran
    the same attention: the model's figure is never below the measured one."""
    from planner.fit import layout_from_row

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "megatron_ci_runs.csv"
    rows = list(csv.DictReader(path.open(newline="")))
    base = "gpt/gpt3_mcore_te_tp2_pp2_resume_torch_dist"
    pairs = 0
    # First runs only: a resumed run ("-2nd") loads a checkpoint first, and one of them
    # (H100) peaks 185 MiB above its own first run.
    rows = [r for r in rows if not r["id"].endswith("-2nd")]
    for fused in (r for r in rows if r["test_case"] == base + "_cross_entropy_loss_fusion"):
        if fused["platform"] not in ("dgx_h100", "dgx_gb200") and fused["environment"] != "lts":
            continue  # A100 dev: its attention (auto, deterministic) is not stated
        if fused["platform"].startswith("dgxa100_dracooci"):
            continue  # the same
        plain = next(
            r
            for r in rows
            if r["test_case"] == base
            and (r["platform"], r["environment"]) == (fused["platform"], fused["environment"])
        )
        measured = int(fused["mem_max_allocated_bytes"]) - int(plain["mem_max_allocated_bytes"])
        peaks = []
        for row in (fused, plain):  # the last pipeline rank, as Megatron-LM logs it
            model, job, layout = layout_from_row(row, row["id"])
            m = job.global_batch // (layout.dp * layout.micro_batch)
            peaks.append(stage_memory(model, job, layout, num_microbatches=m)[-1].allocated_bytes)
        assert measured <= peaks[0] - peaks[1] <= 1.2 * measured, fused["id"]
        pairs += 1
    assert pairs >= 3


def test_a_compiled_loss_keeps_bf16_logits_and_no_fp32_copy() -> None:
    """torchtitan compiles its loss since April 2025 (PR #1033): one fused kernel reads the
    BF16 logits and writes their BF16 gradient, 2 + 2 bytes per logit against the eager
    loss's 4 kept + 8 held for a moment. Only the stacks that compile the loss take it."""
    small = LLAMA8.model_copy(update={"num_layers": 1})
    layout = planner.Layout.uniform(small)
    logits = 2048 * small.vocab_size
    # Two micro-batches: the second forward runs with the gradients made, so the rank's peak
    # holds the activations' whole peak whatever torchtitan frees between steps.
    eager = planner.TrainingJob(seq_len=2048, global_batch=2, framework="torchtitan")
    job = eager.model_copy(update={"compiled_loss": True})
    head = block_cost(small, "head", shard_of(job, layout))
    assert _group(head, "logits") == logits * 2
    assert head.rebuilt_bytes(frozenset()) == logits * 2
    before = stage_memory(small, eager, layout, num_microbatches=2)[0].buckets["activations"]
    after = stage_memory(small, job, layout, num_microbatches=2)[0].buckets["activations"]
    assert before - after == logits * (4 + 8 - 2 - 2)
    with pytest.raises(planner.PlannerError, match="compiled_loss"):
        planner.TrainingJob(seq_len=8, global_batch=1, compiled_loss=True)
    titan = planner.TrainingJob(
        seq_len=8, global_batch=1, framework="torchtitan", compiled_loss=True
    )
    assert not titan.with_framework("megatron").compiled_loss


def test_a_chunked_loss_holds_one_chunk_of_logits_and_an_fp32_input_gradient() -> None:
    """torchtitan's ChunkedCELoss (torchtitan/components/loss.py at b5bcd76c; its recipes'
    loss since 2026-04-27, num_chunks 8): each chunk's output layer and loss run with their
    backward at once, so an n-th of the logits' peak lives at a time (eager: the kept 4 and
    the 8 above them a logit, measured on an H200), and an FP32 buffer of the output layer's
    input gradient (GradAccumulator, dtype float32, every token) is kept to the layers'
    backward instead of the log-softmax."""
    small = LLAMA8.model_copy(update={"num_layers": 1})
    layout = planner.Layout.uniform(small)
    tokens, logits = 2048, 2048 * small.vocab_size
    # two micro-batches, as above: the peak holds the activations' whole peak
    whole = planner.TrainingJob(seq_len=2048, global_batch=2, framework="torchtitan")
    for n in (2, 8):
        job = planner.TrainingJob(
            seq_len=2048, global_batch=2, framework="torchtitan", loss_chunks=n
        )
        head = block_cost(small, "head", shard_of(job, layout))
        assert head.transient == round(logits * (4 + 8) / n)
        assert _group(head, "loss_input_grad") == tokens * small.hidden_size * 4
        assert _group(head, "logits") == 0
        before = stage_memory(small, whole, layout, num_microbatches=2)[0].buckets["activations"]
        after = stage_memory(small, job, layout, num_microbatches=2)[0].buckets["activations"]
        grad = tokens * small.hidden_size * 4
        assert before - after == pytest.approx(logits * (4 + 8) - logits * 12 / n - grad, abs=1)
    with pytest.raises(planner.PlannerError, match=r"TrainingJob.loss_chunks=8: .*megatron"):
        planner.TrainingJob(seq_len=8, global_batch=1, loss_chunks=8)
    titan = planner.TrainingJob(seq_len=8, global_batch=1, framework="torchtitan", loss_chunks=8)
    assert titan.with_framework("megatron").loss_chunks == 1
    # torchtitan's v0.2.2 TOML cannot state it: the export says so
    one = planner.load_cluster("h100", gpus=1)
    out = planner.export.torchtitan(plan_of(small, one, job, layout))
    assert any("ChunkedCELoss.Config(num_chunks=8)" in d for d in out.differences)


def test_deepseek_v3_recipe_fits_80_gb_as_it_did() -> None:
    """DeepSeek-V3 trained with this layout on 80 GB H800s (report section 3.2): FP8 linear
    inputs, SwiGLU inputs cached in FP8 with the output recomputed, RMSNorm and MLA
    up-projections recomputed (section 3.3), FP32 gradients (3.3.3)."""
    r = planner.load_recipe("deepseek-v3-pretraining")
    assert r.layout.fp8_cache and r.job.grad_dtype == "fp32"
    est = planner.evaluate(r.model, r.cluster, r.job, r.layout)
    assert est.fits
    # DeepSeek's own figure of what the FP8 cache saves is not given; without it, or without
    # recomputing the SwiGLU output, the same layout does not fit.
    for fp8_cache, recompute in (
        (False, "layernorm+mla_up_proj+moe_act"),
        (True, "layernorm+mla_up_proj"),
    ):
        other = planner.Layout.from_counts(
            r.model,
            counts=[sum(b.block.startswith("layer.") for b in s.blocks) for s in r.layout.stages],
            pp=16,
            dp=128,
            ep=64,
            zero=1,
            schedule="dualpipe",
            recompute=recompute,
            fp8_cache=fp8_cache,
        )
        assert not planner.evaluate(r.model, r.cluster, r.job, other).fits, (fp8_cache, recompute)


def test_megatron_export_states_gradient_precision_and_fp8_cache() -> None:
    r = planner.load_recipe("deepseek-v3-pretraining")
    plan = plan_of(r.model, r.cluster, r.job, r.layout)
    out = megatron(plan)
    text = "\n".join(out.files.values())
    assert "--grad-reduce-in-bf16" not in text
    assert any("activation_func_fp8_input_store" in d for d in out.differences)
    bf16 = plan.model_copy(update={"job": r.job.model_copy(update={"grad_dtype": "bf16"})})
    assert "--grad-reduce-in-bf16" in "\n".join(megatron(bf16).files.values())


def test_stage_memory_reports_allocated_and_reserved() -> None:
    job = planner.TrainingJob(seq_len=2048, global_batch=8)
    layout = planner.Layout.uniform(LLAMA8.model_copy(update={"num_layers": 2}))
    (rank,) = stage_memory(
        LLAMA8.model_copy(update={"num_layers": 2}), job, layout, num_microbatches=8
    )
    b = rank.buckets
    assert rank.reserved_bytes == rank.allocated_bytes + b["fragmentation"]
    # NCCL allocates its own buffers outside PyTorch's caching allocator: in the device's
    # use (peak_bytes), in neither of the allocator's figures
    assert rank.nccl_bytes == job.comm_buffer_bytes <= b["buffers"]
    assert rank.peak_bytes == rank.reserved_bytes + b["context"] + rank.nccl_bytes


def test_deepspeed_buffers_are_its_bucket_sizes() -> None:
    """DeepSpeed's ZeRO allocates its gradient bucket at reduce_bucket_size (5e8 elements)
    whatever the model's size, twice with overlap_comm in stages 1-2; stage 3 keeps up to
    stage3_max_live_parameters (1e9) gathered parameters (deepspeed/runtime/zero/config.py)."""
    small = LLAMA8.model_copy(update={"num_layers": 8, "vocab_size": 32_000})
    job = planner.TrainingJob(seq_len=1024, global_batch=8, framework="deepspeed")

    def buffers(**fields: object) -> int:
        layout = planner.Layout.uniform(small, dp=8, **fields)  # type: ignore[arg-type]
        return stage_memory(small, job, layout, num_microbatches=1)[0].buckets["buffers"]

    comm = job.comm_buffer_bytes + workspace_bytes(small, job)  # NCCL's, PyTorch's cuBLAS
    # DeepSpeed runs no Transformer Engine: PyTorch's cuBLAS workspace, one per GEMM thread
    assert workspace_bytes(small, job) == 2 * 32 * 2**20
    assert buffers(zero=0) == comm
    assert buffers(zero=2) == comm + 2 * 500_000_000 * 2  # two BF16 buckets
    resident = sum(
        p.numel
        for name in ["embedding", *(f"layer.{i}" for i in range(8)), "head"]
        for p in block_cost(small, name, shard_of(job, planner.Layout.uniform(small))).params
    )
    assert resident > 1e9  # so the live-parameter limit binds
    assert buffers(zero=3) == comm + 500_000_000 * 2 + 1_000_000_000 * 2


def test_torchtitan_zero2_keeps_the_gathered_copy_from_forward_to_backward() -> None:
    """FSDP2 shards the FP32 parameters in every mode; without resharding after forward
    (torchtitan's fsdp_reshard_after_forward "never", the planner's ZeRO-2) each block's BF16
    working copy stays gathered until its backward: 4/dp + 2 bytes per parameter."""
    job = planner.TrainingJob(seq_len=1024, global_batch=8, framework="torchtitan")
    layout = planner.Layout.uniform(LLAMA8, dp=8, zero=2)
    params = block_cost(LLAMA8, "layer.0", shard_of(job, layout)).params
    n = sum(p.numel for p in params)
    held = state_bytes(params, job=job, layout=layout, ema_on_gpu=True)
    assert held["weights"] == pytest.approx(n * (4 / 8 + 2))
    assert held["grads"] == pytest.approx(n * 4 / 8)


def test_gemm_workspaces_are_the_libraries_sizes() -> None:
    """PyTorch's cuBLAS workspace (CublasHandlePool.cpp: 4096 KiB x 8 at compute capability
    9.0 and up, 2 x 4096 KiB + 8 x 16 KiB below), one per thread that runs GEMMs (the
    training loop's and autograd's: two in every recorded H200 trace), and Transformer
    Engine's (module/base.py: 32 MiB + 256 B, or 4 MiB; four more for grouped GEMMs' streams)
    stay allocated all run."""
    mib = 2**20
    torch_ws = 2 * 32 * mib
    dense = LLAMA8.model_copy(update={"num_layers": 2})
    moe = planner.load_model("mixtral-8x7b")
    megatron = planner.TrainingJob(seq_len=1024, global_batch=8, framework="megatron")
    titan = megatron.model_copy(update={"framework": "torchtitan"})
    te = 32 * mib + 256
    assert workspace_bytes(dense, megatron) == torch_ws + te
    assert workspace_bytes(moe, megatron) == torch_ws + 5 * te
    assert workspace_bytes(moe, megatron, grouped_experts=False) == torch_ws + te
    assert workspace_bytes(dense, megatron, sm90=False) == 2 * (8 * mib + 128 * 1024) + 4 * mib
    assert workspace_bytes(dense, titan) == torch_ws
    assert workspace_bytes(dense, megatron, cublas_bytes=0, transformer_engine=False) == 0
    stated = megatron.model_copy(update={"workspace_bytes": 5})
    assert workspace_bytes(moe, stated) == 5
    # they sit in the buffers bucket, inside the allocator's figures
    layout = planner.Layout.uniform(dense, dp=8)
    none = stated.model_copy(update={"workspace_bytes": 0})
    with_ws, without = (
        stage_memory(dense, j, layout, num_microbatches=1)[0] for j in (megatron, none)
    )
    assert with_ws.allocated_bytes - without.allocated_bytes == torch_ws + te


def test_megatron_local_attention_keeps_its_score_buffer() -> None:
    """Megatron-LM's own core attention (--transformer-impl local, no flash attention) takes
    its [micro-batch x heads / tp, s, s] score tensor from the global memory buffer, which
    keeps it for the run (megatron/core/transformer/dot_product_attention.py,
    GlobalMemoryBuffer in megatron/core/utils.py): one score matrix in the activation dtype
    on each rank, in the search's tables as in the rank's memory; none under Transformer
    Engine, with flash attention or in another framework."""
    from planner.costs.comm import Network
    from planner.costs.memory import core_attention_buffer_bytes
    from planner.solve.tables import build

    model = gpt_model("gpt:hidden=512;layers=4;heads=8;vocab=50304;dropout=0.1")
    local = planner.TrainingJob(
        seq_len=1024,
        global_batch=32,
        framework="megatron",
        flash_attention=False,
        transformer_engine=False,
        activation_dtype="fp16",
        weight_dtype="fp16",
        grad_dtype="fp16",
    )
    layout = planner.Layout.uniform(model, tp=2, dp=4, micro_batch=4)
    expected = 4 * (8 // 2) * 1024 * 1024 * 2  # 32 MiB
    assert core_attention_buffer_bytes(model, local, tp=2, cp=1, micro_batch=4) == expected
    others = [
        local.model_copy(update={"transformer_engine": None}),  # Megatron-LM's default: TE
        local.model_copy(update={"flash_attention": True}),
        local.model_copy(update={"framework": "torchtitan", "transformer_engine": None}),
    ]
    for job in others:
        assert core_attention_buffer_bytes(model, job, tp=2, cp=1, micro_batch=4) == 0
    with_te = local.model_copy(update={"transformer_engine": True, "workspace_bytes": 0})
    without = local.model_copy(update={"workspace_bytes": 0})
    here, there = (
        stage_memory(model, j, layout, num_microbatches=2)[0] for j in (without, with_te)
    )
    assert here.buckets["buffers"] - there.buckets["buffers"] == expected
    cluster = planner.load_cluster("h100", gpus=8)
    space = planner.SearchSpace(tp=[2], pp=[1], zero=[0], micro_batch=[4], recompute=["none"])
    config = next(iter(enumerate_configs(model, cluster, without, space)))
    network = Network.of(cluster)
    tables, tables_te = (build(model, cluster, j, config, network) for j in (without, with_te))
    assert tables.buffers - tables_te.buffers == expected


def test_hugging_face_llama_keeps_what_it_kept_on_a_gpu() -> None:
    """transformers 5.17.0's LlamaForCausalLM (SDPA, BF16, no checkpointing), one decoder
    layer at 4,096 tokens, every tensor autograd keeps, measured on an H200 with saved-tensor
    hooks (benchmarks/hf_saved_tensors.py; benchmarks/RESULTS.md, 2026-11-26): 186,504 bytes a
    token at Llama 2 7B's shape, 200,840 at Llama 3 8B's. Of those, 8 are the norms' FP32
    reciprocal roots, which the model leaves out; the Megatron-LM entry keeps 54,784 and
    61,440 bytes a token less (fused norms and SwiGLU: 8 hidden + 2 ffn)."""
    shapes = {
        (4096, 11008, 32, 32000): 186_504,
        (4096, 14336, 8, 128256): 200_840,
    }
    for (h, f, kv, vocab), measured in shapes.items():
        model = gpt_model(
            f"gpt:hidden={h};layers=2;heads=32;kv={kv};ffn={f};swiglu=1;rmsnorm=1;rope=1;"
            f"bias=0;tied=0;vocab={vocab};seq=4096"
        )
        layout = planner.Layout.uniform(model)
        per_token = {}
        for name in ("hf-deepspeed", "megatron"):
            job = planner.TrainingJob(seq_len=4096, global_batch=1, framework=name)
            cost = block_cost(model, "layer.1", shard_of(job, layout))
            per_token[name] = sum(g.bytes for g in cost.saved) / 4096
        assert per_token["hf-deepspeed"] == measured - 8
        assert per_token["hf-deepspeed"] - per_token["megatron"] == 8 * h + 2 * f
    # It prices given layouts; the Trainer's layouts are not searched.
    job = planner.TrainingJob(seq_len=4096, global_batch=8, framework="hf-deepspeed")
    cluster = planner.load_cluster("h100", gpus=8)
    with pytest.raises(planner.PlannerError, match="costs given layouts only"):
        next(enumerate_configs(LLAMA8, cluster, job, planner.SearchSpace()))


def test_partial_distributed_optimizer_domains() -> None:
    """ZeRO-1 over N partial data-parallel domains (Megatron-LM's
    --num-distributed-optimizer-instances; Megatron-Bridge's performance guide: gradients
    reduce-scattered within the domain, then all-reduced across domains; weights gathered
    within it): each rank steps N times the elements, and its gradient reduction is the
    domain's reduce-scatter plus the all-reduce of a domain-size-th of the bytes across
    domains, its weight gather the domain's all-gather. Other frameworks cannot state it."""
    from planner.costs.comm import Network
    from planner.costs.quantities import Rate
    from planner.costs.timing import _rates, dp_groups, position_comm

    model = LLAMA8.model_copy(update={"num_layers": 2})
    cluster = planner.load_cluster("h100", gpus=64)
    job = planner.TrainingJob(seq_len=1024, global_batch=64, framework="megatron")
    whole = planner.Layout.uniform(model, tp=2, dp=32)
    partial = whole.model_copy(update={"optimizer_instances": 4})
    (one,), (four,) = (
        stage_memory(model, job, lay, num_microbatches=2) for lay in (whole, partial)
    )
    assert four.buckets["optimizer"] == pytest.approx(4 * one.buckets["optimizer"], rel=1e-6)
    assert four.buckets["weights"] == one.buckets["weights"]
    network = Network.of(cluster)
    shard = shard_of(job, partial)
    comm = position_comm(model, job, partial, network, shard, 0)
    dense, _ = dp_groups(partial, 0)
    inner, across = dense[:8], dense[::8]
    rs = _rates(network, "reduce_scatter", inner, inner)[0]
    ar = _rates(network, "all_reduce", across, across)[0]
    expected = Rate(rs.per_byte + ar.per_byte * (1 / 8), rs.latency + ar.latency)
    assert comm.grad_sync[0].at(2**30).seconds == pytest.approx(expected.at(2**30).seconds)
    gather = _rates(network, "all_gather", inner, inner)[0]
    assert comm.param_gather[0].at(2**30).seconds == pytest.approx(gather.at(2**30).seconds)
    with pytest.raises(planner.PlannerError, match="optimizer_instances=4: partial"):
        whole.model_copy(update={"optimizer_instances": 4, "zero": 3}).model_validate(
            {**whole.model_dump(), "optimizer_instances": 4, "zero": 3}
        )
    titan = job.model_copy(update={"framework": "torchtitan"})
    with pytest.raises(planner.PlannerError, match="num-distributed-optimizer-instances"):
        planner.evaluate(model, cluster, titan, partial)
    planner.evaluate(model, cluster, job, partial)  # Megatron-LM states it
