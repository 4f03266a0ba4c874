"""Megatron-LM training logs as measured runs (planner/logs/megatron.py), the logs planner
validate writes in that format, and ``planner calibrate --log`` on them.

The log under tests/data/logs is built line by line in the formats of Megatron-LM's source at
commit d98e8a64: the argument block of ``_print_args`` (megatron/training/arguments.py:1990),
the padded vocabulary of ``vocab_size_with_padding``
(megatron/core/tokenizers/utils/build_tokenizer.py:141), the iteration lines of
``training_log`` (megatron/training/training.py:3567-3575) and the memory lines of
``report_memory`` (megatron/training/utils/common_utils.py:313), with torchrun's
``[defaultN]:`` prefixes from several ranks.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from planner.costs.memory import stage_memory
from planner.errors import PlannerError
from planner.logs import read_log, runs_from_logs
from planner.logs.calibrate import fit_memory
from planner.logs.megatron import WARMUP, read, write_log
from planner.run.validate import small_job, validation_set
from planner.specs import TrainingJob

LOGS = Path(__file__).parent / "data" / "logs"
MIB = 2**20


def _log() -> str:
    return (LOGS / "megatron-gpt-tp2-pp2-vp2.log").read_text()


def test_a_megatron_log_states_its_model_layout_job_and_measurements() -> None:
    run = read_log(LOGS / "megatron-gpt-tp2-pp2-vp2.log")
    assert run.framework == "megatron"
    m = run.model
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.num_kv_heads) == (2048, 8, 16, 4)
    assert (m.ffn_hidden_size, m.vocab_size, m.tie_word_embeddings) == (5632, 32000, False)
    lay = run.layout
    assert (lay.tp, lay.pp, lay.dp, lay.virtual_stages, lay.schedule) == (2, 2, 2, 2, "interleaved")
    assert (lay.micro_batch, lay.zero) == (2, 1)
    # --recompute-granularity selective --recompute-modules core_attn
    layers = {b.recompute for s in lay.stages for b in s.blocks if b.block.startswith("layer")}
    assert layers == {"core_attn"}
    assert (run.job.seq_len, run.job.global_batch) == (4096, 16)
    assert run.job.transformer_engine is True  # transformer_impl transformer_engine
    assert run.layout.optimizer_instances == 1
    name = "num_distributed_optimizer_instances"
    partial = read(
        _log().replace(
            "  add_bias_linear ", f"  {name} {'.' * (48 - len(name))} 2\n  add_bias_linear ", 1
        ),
        "partial.log",
    )
    assert partial.layout.optimizer_instances == 2
    # --transformer-impl local: Megatron-LM's own modules, its core attention unfused
    local = read(
        _log().replace(
            "transformer_impl ................................ transformer_engine",
            "transformer_impl ................................ local",
        ),
        "local.log",
    )
    assert local.job.transformer_engine is False and not local.job.flash_attention
    # iterations 1-3 are the start's warm-up; the median of 1001, 1003, 999, 1010, 1002 ms
    assert run.step_s == pytest.approx(1.002)
    assert run.iterations == 5
    # the largest max allocated / max reserved any rank reports, in MiB
    assert run.allocated_peak_bytes == round(31512.50 * MIB)
    assert run.reserved_peak_bytes == round(34500.00 * MIB)


def test_a_restart_is_a_start_of_its_own_and_a_cut_last_line_is_left_out() -> None:
    text = _log()
    block = text[text.index("------------------------ arguments") : text.index(" > padded")]
    resumed = [
        f" [2026-11-20 11:00:{i:02d}.000000] iteration {i:8d}/{20:8d} | consumed samples: "
        f"{i * 16:12d} | elapsed time per iteration (ms): {ms:.1f} | global batch size:    16 |"
        for i, ms in zip(range(9, 15), (4000.0, 1500.0, 1400.0, 980.0, 990.0, 985.0), strict=True)
    ]
    cut = " [2026-11-20 11:00:15.000000] iteration       15/      20 | consumed samples: 240 | ela"
    run = read(text + block + "\n".join(resumed) + "\n" + cut, "restart.log")
    # first start: 1001, 1003, 999, 1010, 1002; second: iterations 12-14 (9-11 its warm-up)
    kept = [1001, 1003, 999, 1010, 1002, 980, 990, 985]
    assert run.step_s == pytest.approx(statistics.median(kept) / 1e3)
    assert run.iterations == len(kept)
    assert any("cut off" in n for n in run.notes)


def test_a_log_that_does_not_state_its_run_is_refused_in_one_line(tmp_path: Path) -> None:
    text = _log()
    no_args = "\n".join(line for line in text.splitlines() if " ....." not in line) + "\n"
    with pytest.raises(PlannerError, match=r"log='a.log': .*world_size") as err:
        read(no_args, "a.log")
    assert "\n" not in str(err.value)
    only_iterations = "\n".join(line for line in text.splitlines() if "iteration " in line)
    with pytest.raises(PlannerError, match="no argument block"):
        read(only_iterations + "\n", "b.log")
    lines = text.splitlines()
    third = next(i for i, line in enumerate(lines) if "iteration        3/" in line)
    warmup_only = "\n".join(lines[: third + 1]) + "\n"
    with pytest.raises(PlannerError, match="warm-up"):
        read(warmup_only, "c.log")
    dots = "." * (48 - len("micro_batch_size"))
    other = text.replace(f"micro_batch_size {dots} 2", f"micro_batch_size {dots} 4")
    assert other != text
    with pytest.raises(PlannerError, match="micro_batch"):
        read(text + other, "d.log")
    # a setting the planner cannot state is named, not costed as if off
    name = "defer_embedding_wgrad_compute"
    line = f"  {name} {'.' * (48 - len(name))} True"
    stated = text.replace("  add_bias_linear ", line + "\n  add_bias_linear ", 1)
    with pytest.raises(PlannerError, match="deferred to the flush") as err:
        read(stated, "e.log")
    assert "\n" not in str(err.value)
    (tmp_path / "notes.txt").write_text("step 1 done\nstep 2 done\n")
    with pytest.raises(PlannerError, match="not a training log"):
        read_log(tmp_path / "notes.txt")


@pytest.mark.parametrize("case", range(len(validation_set())))
def test_validate_logs_read_back_as_the_runs_they_record(tmp_path: Path, case: int) -> None:
    model, layout = validation_set()[case]
    job = small_job()
    steps = [0.9, 0.5, 0.45, 0.31, 0.30, 0.32]
    path = tmp_path / "run.log"
    write_log(path, model, job, layout, steps, [(0, 123 * MIB, None)], [7.0] * len(steps))
    run = read_log(path)
    assert run.job == job
    assert run.layout.model_copy(update={"sequence_parallel": True}) == layout
    assert run.step_s == pytest.approx(statistics.median(steps[WARMUP:]))
    assert run.allocated_peak_bytes == run.reserved_peak_bytes == 123 * MIB
    # the model read back is the model run: the same memory to the byte
    m = job.global_batch // (layout.dp * layout.micro_batch)
    for a, b in zip(
        stage_memory(model, job, layout, num_microbatches=m, runtime="torch"),
        stage_memory(run.model, run.job, run.layout, num_microbatches=m, runtime="torch"),
        strict=True,
    ):
        assert a.buckets == b.buckets


def test_the_memory_fit_finds_the_constants_the_peaks_were_made_with(tmp_path: Path) -> None:
    cases = [validation_set()[i] for i in (0, 4, 5, 9, 10)]
    share, frag = 0.4, 0.085
    paths = []
    for i, (model, layout) in enumerate(cases):
        job = TrainingJob(**{**small_job().model_dump(), "buffers_at_peak": share})
        m = job.global_batch // (layout.dp * layout.micro_batch)
        stages = stage_memory(model, job, layout, num_microbatches=m, runtime="torch")
        peak = max(s.allocated_bytes for s in stages)
        path = tmp_path / f"{i}.log"
        write_log(
            path, model, small_job(), layout, [1.0] * 5, [(0, peak, round(peak * (1 + frag)))]
        )
        paths.append(path)
    report = fit_memory(runs_from_logs(paths))
    assert report.fitted["torch"] == pytest.approx((share, frag), abs=0.0051)
    assert report.mape(report.heldout_allocated, report.measured_allocated) < 0.01
    assert report.mape(report.fitted_reserved, report.measured_reserved) < 0.01
    assert report.mape(report.heldout_reserved, report.measured_reserved) < 0.01
    assert report.mape(report.before_allocated, report.measured_allocated) > 0.01


def test_run_log_calibrate_plan_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two real single-rank runs on this machine, logged by validate in Megatron-LM's format,
    calibrated from the logs, and the logs' job planned with the profile written."""
    pytest.importorskip("torch")
    import yaml

    from planner.cli import main
    from planner.run.validate import validate

    cases = [validation_set()[i] for i in (9, 10)]  # recompute moe / full, one rank each
    entries = validate(cases, steps=1, log_dir=tmp_path)
    logs = sorted(tmp_path.glob("*.log"))
    assert len(logs) == 2
    for entry, log in zip(entries, logs, strict=True):
        run = read_log(log)
        assert run.step_s == pytest.approx(entry.measured_step_s, abs=1e-4)  # 0.1 ms printed
        assert run.allocated_peak_bytes == pytest.approx(entry.allocated_peak_bytes, abs=MIB / 100)
    profile = tmp_path / "fitted.yaml"
    # the machine's constants are only where the fit starts: any catalog machine will do
    args = ["calibrate", "--log", *map(str, logs), "--cluster", "h100"]
    main([*args, "--out", str(profile), "--plan-limit", "2", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "held-out error" in out and "buffers_at_peak" in out
    assert "planned for 2 s each" in out
    fitted = yaml.safe_load(profile.read_text())
    assert set(fitted["framework_fragmentation"]) == {"torch"}
    assert 0 <= fitted["framework_buffers_at_peak"]["torch"] <= 1


def test_a_machine_s_measured_memory_applies_where_the_job_sets_none() -> None:
    """ClusterSpec.job_on: a calibrated machine's per-framework figures fill the job fields it
    leaves unset; a job's own setting wins; other frameworks keep theirs; bounds as the
    job's fields have them."""
    import planner

    base = planner.load_cluster("h100", gpus=8)
    machine = planner.ClusterSpec(
        **{
            **base.model_dump(),
            "framework_fragmentation": {"torch": 0.2},
            "framework_buffers_at_peak": {"torch": 0.5},
        }
    )
    job = TrainingJob(seq_len=4096, global_batch=8, framework="torch")
    on = machine.job_on(job)
    assert (on.fragmentation, on.buffers_at_peak) == (0.2, 0.5)
    own = TrainingJob(seq_len=4096, global_batch=8, framework="torch", fragmentation=0.05)
    assert machine.job_on(own).fragmentation == 0.05
    other = TrainingJob(seq_len=4096, global_batch=8, framework="megatron")
    assert machine.job_on(other) == other
    with pytest.raises(
        PlannerError, match=r"framework_fragmentation.torch=1.0: must be in \[0, 1\)"
    ):
        planner.ClusterSpec(**{**base.model_dump(), "framework_fragmentation": {"torch": 1.0}})


def test_the_eager_runtime_s_passes_are_priced_for_it_alone() -> None:
    """A dense layer under the eager runtime (framework torch) moves, beyond the fused
    kernels' traffic, its two RMSNorms', rotary embedding's and SwiGLU's eager passes
    (costs.blocks.eager_bytes) and, per micro-batch, its gradients added into the buffer
    (3 x 2 bytes an element, BF16); no other framework's layer moves them."""
    from planner.catalog import load_model
    from planner.costs.blocks import block_cost, eager_bytes
    from planner.costs.memory import shard_of
    from planner.layout import Layout

    model = load_model("llama3-8b")
    layout = Layout.uniform(model)
    traffic = {}
    for fw in ("torch", "megatron"):
        job = TrainingJob(
            seq_len=1024,
            global_batch=8,
            framework=fw,
            weight_dtype="bf16",
            grad_dtype="bf16",
            activation_dtype="bf16",
        )
        cost = block_cost(model, "layer.0", shard_of(job, layout))
        traffic[fw] = (cost.fwd.memory, cost.bwd_input.memory + cost.bwd_weight.memory)
    tokens, h, f = 1024, model.hidden_size, model.ffn_hidden_size
    qk = (model.num_attention_heads + model.num_kv_heads) * model.head_dim
    parts = [("rmsnorm", 2 * tokens * h), ("rotary", tokens * qk), ("swiglu", tokens * f)]
    fwd = sum(eager_bytes(op, 2)[0] * n for op, n in parts)
    bwd = sum(eager_bytes(op, 2)[1] * n for op, n in parts)
    q, kv = model.num_attention_heads * model.head_dim, model.num_kv_heads * model.head_dim
    params = 2 * h * q + 2 * h * kv + 3 * h * f + 2 * h  # q and o, k and v, the MLP, two norms
    assert traffic["torch"][0] - traffic["megatron"][0] == pytest.approx(fwd)
    assert traffic["torch"][1] - traffic["megatron"][1] == pytest.approx(bwd + 3 * 2 * params)
    # the RMSNorm at BF16: 40 bytes an element forward and 94 backward in all, 4 and 8 fused
    assert eager_bytes("rmsnorm", 2)[:2] == (40 - 4, 94 - 8)


def test_torchtitan_uncompiled_runs_its_model_code_s_eager_ops() -> None:
    """torchtitan's Llama 3 layer without torch.compile runs its SwiGLU as F.silu and a
    multiply (5a bytes forward, 9a backward against the fused kernel's 3a and 6a) and its
    rotary embedding as separate ops (10a each way against 2a and 4a); its nn.RMSNorm is one
    kernel. Compiled, or with async tensor parallelism (which runs only compiled), it moves
    what Megatron-LM's fused kernels move; a compiled model is torchtitan's alone."""
    from planner.catalog import load_model
    from planner.costs.blocks import block_cost
    from planner.costs.memory import eager_ops, shard_of
    from planner.errors import PlannerError
    from planner.layout import Layout

    model = load_model("llama3-8b")
    layout = Layout.uniform(model)
    base = {"seq_len": 1024, "global_batch": 8, "activation_dtype": "bf16"}
    eager = TrainingJob(**base, framework="torchtitan")
    compiled = eager.model_copy(update={"compiled_model": True})
    megatron = TrainingJob(**base, framework="megatron")

    def traffic(job: TrainingJob, lay: Layout = layout) -> tuple[float, float]:
        cost = block_cost(model, "layer.0", shard_of(job, lay))
        return cost.fwd.memory, cost.bwd_input.memory + cost.bwd_weight.memory

    tokens, f = 1024, model.ffn_hidden_size
    qk = (model.num_attention_heads + model.num_kv_heads) * model.head_dim
    fwd = tokens * f * 2 * 2 + tokens * qk * 8 * 2  # SwiGLU 2a more, rotary 8a, at BF16
    bwd = tokens * f * 3 * 2 + tokens * qk * 6 * 2
    assert eager_ops(eager, layout) == "torchtitan" and eager_ops(compiled, layout) == ""
    (ef, eb), (cf, cb) = traffic(eager), traffic(compiled)
    assert (ef - cf, eb - cb) == (pytest.approx(fwd), pytest.approx(bwd))
    tp2 = Layout.uniform(model, tp=2)
    assert eager_ops(eager, tp2) == ""  # async TP compiles the model
    assert eager_ops(eager.model_copy(update={"tp_comm_overlap": False}), tp2) == "torchtitan"
    assert eager_ops(eager.model_copy(update={"compiled_loss": True}), layout) == ""
    assert eager_ops(megatron, layout) == ""
    with pytest.raises(PlannerError, match="compiled_model=True: framework='megatron'"):
        TrainingJob(**base, framework="megatron", compiled_model=True)


def test_torchtitan_uncompiled_copies_each_sequence_parallel_gather_and_reduce_scatter() -> None:
    """torchtitan's activations are [batch, sequence, hidden] and sequence parallelism
    shards dim 1, while PyTorch's functional collectives gather and reduce-scatter dim 0:
    uncompiled, each all-gather's output and each reduce-scatter's input is rearranged by a
    copy that reads and writes the whole region (two pairs a layer, each way). Not at
    micro-batch 1 (a view in recent PyTorch), not without sequence parallelism, not
    compiled, not under Megatron-LM (sequence first)."""
    from planner.catalog import load_model
    from planner.costs.blocks import block_cost
    from planner.costs.memory import shard_of
    from planner.layout import Layout

    model = load_model("llama3-8b")
    base = {"seq_len": 1024, "global_batch": 8, "tp_comm_overlap": False}
    eager = TrainingJob(**base, framework="torchtitan")
    compiled = eager.model_copy(update={"compiled_model": True})

    def traffic(job: TrainingJob, lay: Layout) -> tuple[float, float]:
        cost = block_cost(model, "layer.0", shard_of(job, lay))
        return cost.fwd.memory, cost.bwd_input.memory

    def copies(job: TrainingJob, **degrees: object) -> tuple[float, float]:
        """A tp 2 layer's bytes each way beyond the same layer compiled."""
        on = Layout.uniform(model, tp=2, **degrees)  # type: ignore[arg-type]
        (f, b), (cf, cb) = traffic(job, on), traffic(compiled, on)
        return f - cf, b - cb

    two = copies(eager, micro_batch=2)
    one = copies(eager, micro_batch=1)
    # the eager SwiGLU and rotary passes are the same at both; the copies come on top
    region = 2 * 1024 * model.hidden_size * 2  # two sequences of 1,024 tokens, BF16
    assert two[0] - 2 * one[0] == pytest.approx(2 * 4 * region)
    assert two[1] - 2 * one[1] == pytest.approx(2 * 4 * region)
    no_sp = copies(eager, micro_batch=2, sequence_parallel=False)
    assert no_sp[0] == pytest.approx(2 * one[0])
    megatron = TrainingJob(**base, framework="megatron")
    lay = Layout.uniform(model, tp=2, micro_batch=2)
    assert traffic(megatron, lay)[0] == pytest.approx(traffic(compiled, lay)[0])


def test_torchtitan_s_older_eager_rmsnorm_is_priced_where_the_model_runs_uncompiled() -> None:
    """torchtitan before April 2025 built its own RMSNorm class (x.float(), pow, mean, rsqrt,
    type_as, * weight): TrainingJob.eager_norm prices each of a layer's two norms with the
    passes of those ops (the project's runtime runs the same ones) and keeps the FP32 copy
    of the input; compiled, the norm is fused and nothing changes; only torchtitan had it."""
    from planner.catalog import load_model
    from planner.costs.blocks import BlockCost, block_cost, eager_bytes
    from planner.costs.memory import shard_of
    from planner.errors import PlannerError
    from planner.layout import Layout

    model = load_model("llama3-8b")
    layout = Layout.uniform(model)
    base = {"seq_len": 1024, "global_batch": 8, "framework": "torchtitan"}
    plain = TrainingJob(**base)
    older = TrainingJob(**base, eager_norm=True)

    def cost(job: TrainingJob) -> BlockCost:
        return block_cost(model, "layer.0", shard_of(job, layout))

    fwd, bwd, *_ = eager_bytes("rmsnorm", 2)  # at BF16, beyond the fused kernel's passes
    elements = 2 * 1024 * model.hidden_size  # two norms a layer, one sequence of 1,024
    a, b = cost(plain), cost(older)
    assert b.fwd.memory - a.fwd.memory == pytest.approx(elements * fwd)
    assert b.bwd_input.memory - a.bwd_input.memory == pytest.approx(elements * bwd)
    assert b.saved_bytes() - a.saved_bytes() == pytest.approx(elements * 4)
    compiled = {"compiled_model": True}
    assert cost(older.model_copy(update=compiled)).fwd.memory == pytest.approx(
        cost(plain.model_copy(update=compiled)).fwd.memory
    )
    with pytest.raises(PlannerError, match="eager_norm=True: framework='megatron'"):
        TrainingJob(seq_len=1024, global_batch=8, framework="megatron", eager_norm=True)


def test_layouts_that_differ_only_in_micro_batch_have_names_of_their_own() -> None:
    """validate ranks layouts by name: the one-GPU set's twelve must stay twelve."""
    from planner.run.validate import describe, layout_name, one_gpu_set

    _, cases = one_gpu_set()
    assert len({layout_name(describe(layout), model.name) for model, layout in cases}) == 12
