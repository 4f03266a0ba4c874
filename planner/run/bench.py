"""``planner calibrate --sweep``: one device measured at the widths of real models, each
figure set beside the cost model's.

Four kinds of rows, all on one device (``planner.run.device``: BF16 on CUDA, FP32 on CPU):

- GEMMs: the forward GEMMs of one layer of Llama 3 8B, Llama 3 70B and DeepSeek-V3 (its
  MoE layer: MLA projections, router, routed and shared experts) at tensor-parallel degree
  1, 2, 4 and 8 (column-parallel GEMMs split their outputs, row-parallel ones their
  reduction; routed experts split their width, expert tensor parallelism), for one
  sequence (tokens = micro-batch 1 x the model's training sequence length);
- attention: causal ``scaled_dot_product_attention`` forward and backward of Llama 3 8B's
  heads by sequence length, FLOPs counted as the cost model counts them
  (``planner.costs.blocks``: half the score matrix; backward 2.5x forward);
- memory-bound kernels: copy, elementwise add, RMSNorm, in bytes moved per second;
- blocks: one real-width layer (``planner.run.model.DenseLayer``) of each model, by
  micro-batch size and recompute choice, forward and backward time and the bytes it keeps
  for backward, beside ``planner.costs.compute.block_time`` and the saved bytes of
  ``planner.costs.blocks`` (the block costs ``planner.costs.memory`` sums).

The cost model prices every row with rates fitted to this run (``fit_rates``: each kind's
rate makes the model's total time of that kind's rows equal the measured total; the time
per kernel is measured on a one-element kernel), or with a catalog machine's rates
(``reference``). On CPU the same code runs with every width and length multiplied by
``scale`` (rounded to multiples of 8); head dimensions stay (they are a kernel's shape).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from planner.catalog import load_model
from planner.costs.blocks import block_cost
from planner.costs.compute import Rates, work_time
from planner.costs.memory import shard_of
from planner.costs.work import Gemm, Work
from planner.layout import Layout
from planner.run.benchblocks import BLOCKS, block_rows, job_for, not_run
from planner.run.benchrows import (
    SEQ,
    AttentionRow,
    GemmRow,
    MemoryRow,
    Sweep,
    dim,
    scaled_model,
)
from planner.run.device import Device
from planner.specs import DTYPE_BYTES, ModelSpec

# DeepSeek-V3 trained with 64-way expert parallelism (its report, arXiv 2412.19437, section
# 3.2: "64-way Expert Parallelism (EP) spanning 8 nodes"): a rank holds
# 256 / 64 = 4 routed experts and receives tokens x top-8 x 64 / 256 rows for each.
DEEPSEEK_EP = 64
TP_DEGREES = (1, 2, 4, 8)
ATTENTION_SEQ = (1024, 2048, 4096, 8192, 16384)
# 256 MiB of BF16 per tensor, five times an H100's 50 MB L2 cache (NVIDIA H100 Tensor Core
# GPU Architecture whitepaper): the kernels stream from HBM
MEMORY_ELEMENTS = 2**27
NORM_WIDTH = 4096  # Llama 3 8B's hidden size: the rows RMSNorm normalises
CPU_SCALE = 1 / 32  # default scale on CPU: the whole sweep in a few seconds on one core


def gemm_shapes(model: ModelSpec, tp: int, tokens: int) -> list[tuple[str, Gemm]]:
    """The forward GEMMs of one layer of ``model`` at tensor-parallel degree ``tp`` (an MoE
    layer where the model has them): (tokens x k) @ (k x n) as ``Gemm(m, n, k)``."""
    h, t = model.hidden_size, tokens
    out: list[tuple[str, Gemm]] = []
    if model.attention == "mla":
        n, dq = model.num_attention_heads, model.qk_nope_head_dim + model.qk_rope_head_dim
        dc, dv = model.kv_lora_rank, model.v_head_dim
        if model.q_lora_rank:  # down projections are replicated, up projections split
            out.append(("q_down", Gemm(t, model.q_lora_rank, h)))
            out.append(("q_up", Gemm(t, n * dq / tp, model.q_lora_rank)))
        out.append(("kv_down", Gemm(t, dc + model.qk_rope_head_dim, h)))
        out.append(("kv_up", Gemm(t, n * (model.qk_nope_head_dim + dv) / tp, dc)))
        out.append(("o_proj", Gemm(t, h, n * dv / tp)))
    else:
        d, nq, nkv = model.head_dim, model.num_attention_heads, model.num_kv_heads
        out.append(("qkv", Gemm(t, (nq + 2 * nkv) * d / tp, h)))
        out.append(("o_proj", Gemm(t, h, nq * d / tp)))
    if not model.num_experts:
        out.append(("fc1 (gate+up)", Gemm(t, 2 * model.ffn_hidden_size / tp, h)))
        out.append(("fc2 (down)", Gemm(t, h, model.ffn_hidden_size / tp)))
        return out
    e, k, w = model.num_experts, model.experts_per_token, model.moe_ffn_hidden_size
    rows, groups = t * k * DEEPSEEK_EP / e, e // DEEPSEEK_EP
    out.append(("router", Gemm(t, e, h)))
    out.append(("experts fc1", Gemm(rows, 2 * w / tp, h, groups)))
    out.append(("experts fc2", Gemm(rows, h, w / tp, groups)))
    if model.num_shared_experts:
        shared = model.num_shared_experts * (model.shared_expert_ffn_hidden_size or w)
        out.append(("shared fc1", Gemm(t, 2 * shared / tp, h)))
        out.append(("shared fc2", Gemm(t, h, shared / tp)))
    return out


# -- measurements ----------------------------------------------------------------------------


def _gemm_seconds(g: Gemm, dev: Device, repeat: int) -> float:
    m, n, k, groups = int(g.m), int(g.n), int(g.k), int(g.groups)
    with torch.device(dev.torch_device):
        x = torch.randn(groups, m, k, dtype=dev.dtype)
        w = torch.randn(groups, n, k, dtype=dev.dtype)  # as nn.Linear keeps it: out x in
    if groups == 1:
        return dev.median_time(lambda: F.linear(x[0], w[0]), repeat=repeat)
    wt = w.transpose(1, 2)
    return dev.median_time(lambda: torch.bmm(x, wt), repeat=repeat)


def _attention_seconds(
    heads: int, kv: int, d: int, seq: int, dev: Device, repeat: int
) -> tuple[float, float]:
    with torch.device(dev.torch_device):
        q = torch.randn(1, heads, seq, d, dtype=dev.dtype, requires_grad=True)
        k, v = (torch.randn(1, kv, seq, d, dtype=dev.dtype, requires_grad=True) for _ in "kv")
        grad = torch.randn(1, heads, seq, d, dtype=dev.dtype)

    def fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)

    forward = dev.median_time(fwd, repeat=repeat)
    backward = dev.median_time_after(fwd, lambda out: out.backward(grad), repeat=repeat)
    return forward, backward


def _memory_kernels(elements: int, dev: Device) -> dict[str, tuple[Callable[[], object], int]]:
    """Each kernel and the bytes it reads and writes."""
    e = DTYPE_BYTES[dev.dtype_name]
    with torch.device(dev.torch_device):
        a, b, c = (torch.randn(elements, dtype=dev.dtype) for _ in "abc")
        rows = a.view(-1, NORM_WIDTH)
        weight = torch.ones(NORM_WIDTH, dtype=dev.dtype)
    return {
        "copy": (lambda: c.copy_(a), 2 * elements * e),
        "add": (lambda: torch.add(a, b, out=c), 3 * elements * e),
        "rmsnorm": (lambda: F.rms_norm(rows, (NORM_WIDTH,), weight), 2 * elements * e),
    }


def kernel_overhead(dev: Device) -> tuple[float, float]:
    """(device seconds, host seconds) per kernel, from a one-element add. On CUDA the GPU
    is first held busy (``torch.cuda._sleep``) so the adds queue up and run back to back:
    their GPU time is per-kernel time alone, the host's is the launch cost. On CPU the
    host runs the kernel: all of it is device time."""
    tiny = torch.zeros(1, device=dev.torch_device)
    count = 200
    if not dev.is_cuda:
        return dev.median_time(lambda: tiny.add_(1), repeat=5, inner=count), 0.0
    import time

    for _ in range(10):
        tiny.add_(1)
    dev.synchronize()
    torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz: the host runs ahead of the GPU
    timer = dev.timer()
    timer.start()
    t0 = time.perf_counter()
    for _ in range(count):
        tiny.add_(1)
    host = (time.perf_counter() - t0) / count
    return timer.stop() / count, host


# -- the cost model's rates ----------------------------------------------------------------


def _solve(total: Callable[[float], float], target: float) -> float:
    """The rate r at which the decreasing ``total(r)`` meets ``target`` (log bisection)."""
    lo, hi = 1e3, 1e18
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if total(mid) > target else (lo, mid)
        if hi / lo < 1 + 1e-9:
            break
    return math.sqrt(lo * hi)


def fit_rates(
    dev: Device,
    gemms: list[tuple[Gemm, float]],
    attention: list[tuple[Work, float]],
    memory: list[tuple[Work, float]],
) -> Rates:
    """Rates at which the cost model's total time of each kind of row equals the measured
    total, the time per kernel measured (``kernel_overhead``)."""
    kernel_s, host_s = kernel_overhead(dev)
    base = Rates(1.0, 1.0, 1.0, kernel_s, host_s, DTYPE_BYTES[dev.dtype_name], dev.sm_count())

    def with_(**kw: Any) -> Rates:
        return replace(base, **kw)

    mem = _solve(
        lambda r: sum(work_time(w, with_(memory_Bps=r)) for w, _ in memory),
        sum(s for _, s in memory),
    )
    att = _solve(
        lambda r: sum(work_time(w, with_(attention_flops=r)) for w, _ in attention),
        sum(s for _, s in attention),
    )
    gemm = _solve(
        lambda r: sum(
            work_time(_gemm_work(g), with_(gemm_flops=r, memory_Bps=mem)) for g, _ in gemms
        ),
        sum(s for _, s in gemms),
    )
    return with_(gemm_flops=gemm, attention_flops=att, memory_Bps=mem)


def _gemm_work(g: Gemm) -> Work:
    return Work(gemm=g.flops, kernels=1, shapes=((g, 1.0),))


# -- the sweep -----------------------------------------------------------------------------


def sweep(
    device: Device,
    *,
    scale: float | None = None,
    repeat: int = 5,
    reference: Any = None,
    progress: Callable[[str], None] | None = None,
) -> Sweep:
    """Measure every row on ``device`` at ``scale`` (default: 1 on CUDA, ``CPU_SCALE`` on
    CPU), ``repeat`` timings each (the median); price them with rates fitted to the run, or
    with ``reference``'s (a ``ClusterSpec``). On CPU the device is one core (one thread,
    as each of ``planner calibrate``'s workers)."""
    from planner.errors import PlannerError

    scale = scale if scale is not None else (1.0 if device.is_cuda else CPU_SCALE)
    if not 0 < scale <= 1:
        raise PlannerError(f"--scale={scale}: must be in (0, 1] (a fraction of real widths)")
    if repeat < 1:
        raise PlannerError(f"repeat={repeat}: needs at least 1 timing")
    threads = torch.get_num_threads()
    if not device.is_cuda:
        torch.set_num_threads(1)
    try:
        return _sweep(device, scale, repeat, reference, progress or (lambda _: None))
    finally:
        torch.set_num_threads(threads)


def _sweep(
    dev: Device, scale: float, repeat: int, reference: Any, say: Callable[[str], None]
) -> Sweep:
    dtype = dev.dtype_name
    say("GEMMs")
    gemms = []
    for name, tokens in SEQ.items():
        for tp in TP_DEGREES:
            for what, g in gemm_shapes(load_model(name), tp, tokens):
                shape = Gemm(dim(g.m, scale), dim(g.n, scale), dim(g.k, scale), g.groups)
                gemms.append((name, what, tp, shape, _gemm_seconds(shape, dev, repeat)))
    say("attention")
    attn_model = scaled_model(load_model("llama3-8b"), scale)
    attention = []
    for seq in ATTENTION_SEQ:
        s = dim(seq, scale)
        shard = shard_of(job_for(s, dtype), Layout.uniform(attn_model))
        cost = block_cost(attn_model, "layer.0", shard)
        m = attn_model
        fwd_s, bwd_s = _attention_seconds(
            m.num_attention_heads, m.num_kv_heads, m.head_dim, s, dev, repeat
        )
        attention += [(s, "fwd", cost.attention_fwd, fwd_s), (s, "bwd", cost.attention_bwd, bwd_s)]
    say("memory-bound kernels")
    elements = max(NORM_WIDTH, round(MEMORY_ELEMENTS * scale / NORM_WIDTH) * NORM_WIDTH)
    memory = [
        (kernel, Work(memory=nbytes, kernels=1), dev.median_time(fn, repeat=repeat))
        for kernel, (fn, nbytes) in _memory_kernels(elements, dev).items()
    ]
    if reference is None:
        rates = fit_rates(
            dev,
            [(g, t) for *_, g, t in gemms],
            [(w, t) for *_, w, t in attention],
            [(w, t) for _, w, t in memory],
        )
        whose = "fitted to this run; time per kernel measured on a one-element add"
    else:
        rates = Rates.of(reference, job_for(1024, dtype), sustained=False)
        whose = f"catalog machine {reference.name}"
    blocks = []
    for name, block, micro_batches in BLOCKS:
        say(f"{name} {block}")
        blocks += block_rows(
            name, block, micro_batches, dev=dev, scale=scale, rates=rates, repeat=repeat
        )
    return Sweep(
        device=dev.kind,
        device_name=dev.name() if dev.is_cuda else f"{dev.name()}, measured on one thread",
        dtype=dtype,
        scale=scale,
        when=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        torch=str(torch.__version__),
        reference=whose,
        rates={
            "gemm_flops": rates.gemm_flops,
            "attention_flops": rates.attention_flops,
            "memory_Bps": rates.memory_Bps,
            "kernel_s": rates.kernel_s,
            "host_s": rates.host_s,
            "sm_count": rates.sms,
        },
        gemm=[_gemm_row(*row, rates) for row in gemms],
        attention=[_attention_row(*row, attn_model, rates) for row in attention],
        memory=[_memory_row(*row, rates) for row in memory],
        blocks=blocks,
        not_run=not_run(scale),
    )


def _gemm_row(model: str, what: str, tp: int, g: Gemm, seconds: float, rates: Rates) -> GemmRow:
    predicted = work_time(_gemm_work(g), rates)
    return GemmRow(
        model=model,
        name=what,
        tp=tp,
        m=int(g.m),
        n=int(g.n),
        k=int(g.k),
        groups=int(g.groups),
        measured_s=seconds,
        flops_per_s=g.flops / seconds,
        predicted_s=predicted,
        error=predicted / seconds - 1,
    )


def _attention_row(
    seq: int, phase: str, work: Work, seconds: float, model: ModelSpec, rates: Rates
) -> AttentionRow:
    predicted = work_time(work, rates)
    return AttentionRow(
        seq_len=seq,
        heads=model.num_attention_heads,
        kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        phase=phase,
        flops=work.attention,
        measured_s=seconds,
        flops_per_s=work.attention / seconds,
        predicted_s=predicted,
        error=predicted / seconds - 1,
    )


def _memory_row(kernel: str, work: Work, seconds: float, rates: Rates) -> MemoryRow:
    predicted = work_time(work, rates)
    return MemoryRow(
        kernel=kernel,
        bytes=int(work.memory),
        measured_s=seconds,
        bytes_per_s=work.memory / seconds,
        predicted_s=predicted,
        error=predicted / seconds - 1,
    )
