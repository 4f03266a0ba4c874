"""What a training step does that one-kernel benchmarks do not show, on one CUDA GPU.

- ``sustained``: the GEMM rate over ``--seconds`` of back-to-back 8192^3 GEMMs (BF16, then FP8
  E4M3 with per-tensor scales and fast accumulation), in windows of about 0.5 s, beside the SM
  clock, power draw and temperature nvidia-smi samples every 250 ms. The catalog's GEMM
  fractions come from short runs of each shape (MAMF, ``gpu_kernels.py``: 20 ms of work per
  timing); a training step keeps the GPU busy for minutes, under its power limit.
- ``training``: the same over ``--seconds`` of training steps of a Llama 3 8B-wide stack
  (``gpu_memory.Stack``: 4 layers, embedding, output layer and loss, one sequence of 8,192
  tokens, forward, backward and AdamW): whether a step's mix of GEMMs, attention and
  memory-bound kernels draws the power that throttles the clocks as GEMMs alone do.
- ``step``: a step's fixed costs, on a GPT of the size Megatron-LM's functional tests train
  (hidden 512, 12 layers, 8 heads, vocabulary 50,304, sequence 1,024, dropout 0.1, tied
  embeddings, micro-batch 4), eager PyTorch under BF16 autocast with FP32 parameters:
  forward plus backward at 1, 2 and 4 micro-batches per step (the per-micro-batch and the
  fixed part, by least squares); then, each on its own: AdamW fused and foreach, gradient
  clipping (foreach norm, one host sync), the per-gradient zero count of Megatron-LM's
  ``--log-num-zeros-in-grad`` (``count_zeros_fp32``: numel minus ``count_nonzero``, per
  tensor), the parameter norm of ``--log-params-norm`` (one foreach norm and a host sync).
  Each: wall time, CUDA kernels launched, wall time per kernel.
- ``optimizer``: the optimizer's memory-bound rate, fused AdamW over ``--params`` FP32
  parameters in 64 tensors: 28 bytes moved per parameter (parameter, gradient and two moments
  read; parameter and moments written) per second, against the GPU's HBM bandwidth.

Prints a table per part and one JSON line with everything. Run on a CUDA machine:
``python benchmarks/gpu_step.py [--parts sustained step optimizer]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

N = 8192
SMI_FIELDS = "clocks.sm,power.draw,temperature.gpu"


def _kernels(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _wall(fn: Callable[[], object], repeat: int, warmup: int = 3) -> float:
    """Median wall seconds of ``fn`` with the GPU drained before and after."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    walls = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


# -- sustained ------------------------------------------------------------------------------


def _sampler() -> subprocess.Popen[str] | None:
    try:
        return subprocess.Popen(
            [
                "nvidia-smi",
                f"--query-gpu={SMI_FIELDS}",
                "--format=csv,noheader,nounits",
                "-lms",
                "250",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    except OSError:
        return None


def _samples(proc: subprocess.Popen[str] | None) -> list[tuple[float, float, float]]:
    if proc is None:
        return []
    proc.terminate()
    out, _ = proc.communicate(timeout=10)
    rows = []
    for line in out.splitlines():
        try:
            clock, power, temp = (float(x) for x in line.split(","))
        except ValueError:
            continue
        rows.append((clock, power, temp))
    return rows


def _gemm(kind: str) -> tuple[Callable[[], object], float]:
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    if kind == "bf16":
        out = torch.empty(N, N, device="cuda", dtype=torch.bfloat16)
        return (lambda: torch.mm(a, b, out=out)), 2.0 * N**3
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major, as cuBLAS wants it
    one = torch.ones((), device="cuda", dtype=torch.float32)
    return (
        lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)
    ), 2.0 * N**3


def _windows(
    fn: Callable[[], object], calls: int, seconds: float
) -> tuple[list[tuple[float, float]], dict[str, Any]]:
    """Run ``calls`` calls of ``fn`` per window for ``seconds``: each window's (seconds since
    the start, GPU seconds per call), and what nvidia-smi saw meanwhile."""
    smi = _sampler()
    time.sleep(0.3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    windows: list[tuple[float, float]] = []
    begin = time.perf_counter()
    while time.perf_counter() - begin < seconds:
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        windows.append((time.perf_counter() - begin, start.elapsed_time(end) / 1e3 / calls))
    samples = _samples(smi)
    clocks, powers = [c for c, _, _ in samples], [p for _, p, _ in samples]
    half = len(samples) // 2
    seen = {
        "smi_samples": len(samples),
        "clock_mhz_first": statistics.median(clocks[:4]) if clocks else None,
        "clock_mhz_second_half": statistics.median(clocks[half:]) if clocks else None,
        "clock_mhz_min": min(clocks) if clocks else None,
        "power_w_second_half": statistics.median(powers[half:]) if powers else None,
        "power_w_max": max(powers) if powers else None,
        "temp_c_max": max(t for _, _, t in samples) if samples else None,
    }
    return windows, seen


def _first_and_tail(windows: list[tuple[float, float]], seconds: float) -> tuple[float, float]:
    """Median seconds per call over the first second and over the second half."""
    first = [w for t, w in windows if t <= 1.0] or [windows[0][1]]
    tail = [w for t, w in windows if t >= seconds / 2] or [windows[-1][1]]
    return statistics.median(first), statistics.median(tail)


def _trace(
    windows: list[tuple[float, float]], shown: Callable[[float], float]
) -> list[tuple[float, float]]:
    """About 40 windows: (seconds since the start, ``shown`` of the seconds per call)."""
    return [(round(t, 2), round(shown(w), 2)) for t, w in windows[:: max(1, len(windows) // 40)]]


def sustained(kind: str, seconds: float) -> dict[str, Any]:
    fn, flops = _gemm(kind)
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per_window = max(1, int(0.5 / ((time.perf_counter() - t0) / 20)))
    windows, seen = _windows(fn, per_window, seconds)
    first, tail = _first_and_tail(windows, seconds)
    return {
        "kind": kind,
        "seconds": seconds,
        "windows": len(windows),
        "gemms_per_window": per_window,
        "first_s_tflops": flops / first / 1e12,
        "second_half_tflops": flops / tail / 1e12,
        "max_tflops": flops / min(w for _, w in windows) / 1e12,
        "min_tflops": flops / max(w for _, w in windows) / 1e12,
        "tail_over_first": first / tail,
        **seen,
        "trace": _trace(windows, lambda w: flops / w / 1e12),
    }


def sustained_training(seconds: float) -> dict[str, Any]:
    from gpu_memory import Stack

    torch.manual_seed(0)
    with torch.device("cuda"):
        stack = Stack("llama3-8b", 4)
    opt = torch.optim.AdamW(stack.parameters(), lr=1e-5, fused=True)
    tokens = torch.randint(0, stack.head.out_features, (1, 8192), device="cuda")

    def step() -> None:
        stack(tokens, "none").backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    windows, seen = _windows(step, 5, seconds)
    first, tail = _first_and_tail(windows, seconds)
    return {
        "kind": "training steps, llama3-8b width, 4 layers, 8192 tokens",
        "seconds": seconds,
        "steps": 5 * len(windows),
        "first_s_step_s": first,
        "second_half_step_s": tail,
        "first_over_tail": first / tail,
        **seen,
        "trace": _trace(windows, lambda w: w * 1e3),
    }


def _clocks(d: dict[str, Any]) -> str:
    return (
        f"SM clock {d['clock_mhz_first']} -> {d['clock_mhz_second_half']} MHz (min "
        f"{d['clock_mhz_min']}), power {d['power_w_second_half']} W (max {d['power_w_max']}), "
        f"{d['temp_c_max']} C max"
    )


# -- step -----------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, h: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, s, h)), self.p)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p)


class GPT(nn.Module):
    def __init__(self, h: int, layers: int, heads: int, vocab: int, seq: int, p: float) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads, p) for _ in range(layers))
        self.ln = nn.LayerNorm(h)
        self.p = p

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = F.dropout(self.embed(tokens) + self.pos(pos), self.p)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln(x), self.embed.weight).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), tokens.view(-1))


def step_costs(repeat: int) -> dict[str, Any]:
    h, layers, heads, vocab, seq, mb = 512, 12, 8, 50304, 1024, 4
    torch.manual_seed(0)
    model = GPT(h, layers, heads, vocab, seq, 0.1).cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    tokens = torch.randint(0, vocab, (mb, seq), device="cuda")

    def fb(m: int) -> Callable[[], None]:
        def run() -> None:
            for p in params:
                p.grad = None
            for _ in range(m):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(tokens)
                loss.backward()

        return run

    rows: dict[str, dict[str, float]] = {}
    for m in (1, 2, 4):
        fn = fb(m)
        rows[f"fwd+bwd x{m}"] = {"wall_s": _wall(fn, repeat), "kernels": _kernels(fn)}
    fb(1)()
    fused = torch.optim.AdamW(params, lr=1e-4, fused=True)
    foreach = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def clip() -> None:
        float(torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True))

    def count_zeros() -> None:  # Megatron-LM's count_zeros_fp32, one tensor at a time
        total = torch.zeros(1, device="cuda")
        for p in params:
            total = (p.grad.numel() - torch.count_nonzero(p.grad)) + total
        float(total)

    def params_norm() -> None:
        float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(params))))

    def whole() -> None:
        fb(1)()
        clip()
        fused.step()

    for name, fn in (
        ("adamw fused", fused.step),
        ("adamw foreach", foreach.step),
        ("clip grad norm", clip),
        ("count zeros (per tensor)", count_zeros),
        ("params norm", params_norm),
        ("fwd+bwd x1 + clip + adamw fused", whole),
    ):
        rows[name] = {"wall_s": _wall(fn, repeat), "kernels": _kernels(fn)}
    for r in rows.values():
        r["wall_per_kernel_s"] = r["wall_s"] / max(1, r["kernels"])
    ms = [1, 2, 4]
    walls = [rows[f"fwd+bwd x{m}"]["wall_s"] for m in ms]
    mean_m, mean_w = statistics.mean(ms), statistics.mean(walls)
    slope = sum((m - mean_m) * (w - mean_w) for m, w in zip(ms, walls, strict=True)) / sum(
        (m - mean_m) ** 2 for m in ms
    )
    return {
        "model": f"gpt hidden {h}, {layers} layers, {heads} heads, vocab {vocab}, seq {seq}, "
        f"micro-batch {mb}, dropout 0.1, tied",
        "parameters": sum(p.numel() for p in params),
        "parameter_tensors": len(params),
        "per_micro_batch_s": slope,
        "fixed_s": mean_w - slope * mean_m,
        "rows": rows,
    }


# -- optimizer ------------------------------------------------------------------------------


def optimizer_rate(n_params: float, repeat: int) -> dict[str, Any]:
    per = int(n_params // 64)
    params = [torch.zeros(per, device="cuda", requires_grad=True) for _ in range(64)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    wall = _wall(opt.step, repeat, warmup=2)
    moved = 28.0 * per * 64
    props = torch.cuda.get_device_properties(0)
    return {
        "parameters": per * 64,
        "step_s": wall,
        "bytes_moved": moved,
        "GBps": moved / wall / 1e9,
        "device": props.name,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["sustained", "training", "step", "optimizer"])
    p.add_argument("--seconds", type=float, default=40.0, help="BF16 sustained run (FP8: half)")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--params", type=float, default=1e9)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_step: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    found: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if "sustained" in args.parts:
        found["sustained"] = [sustained("bf16", args.seconds), sustained("fp8", args.seconds / 2)]
        for s in found["sustained"]:
            print(
                f"sustained {s['kind']}: {s['first_s_tflops']:.0f} TFLOP/s in the first second, "
                f"{s['second_half_tflops']:.0f} over the second half "
                f"({s['tail_over_first']:.3f}x); {_clocks(s)}"
            )
    if "training" in args.parts:
        t = found["training"] = sustained_training(args.seconds)
        print(
            f"sustained {t['kind']}: {t['first_s_step_s'] * 1e3:.2f} ms per step in the first "
            f"second, {t['second_half_step_s'] * 1e3:.2f} over the second half (rate "
            f"{t['first_over_tail']:.3f}x); {_clocks(t)}"
        )
    if "step" in args.parts:
        s = found["step"] = step_costs(args.repeat)
        print(
            f"step: {s['model']}; {s['parameters']:,} parameters, {s['parameter_tensors']} tensors"
        )
        print(f"{'':34} {'ms':>8} {'kernels':>8} {'us/kernel':>9}")
        for name, r in s["rows"].items():
            print(
                f"{name:34} {r['wall_s'] * 1e3:8.2f} {r['kernels']:8.0f} "
                f"{r['wall_per_kernel_s'] * 1e6:9.1f}"
            )
        mb, fixed = s["per_micro_batch_s"] * 1e3, s["fixed_s"] * 1e3
        print(f"per micro-batch {mb:.2f} ms, fixed {fixed:.2f} ms")
    if "optimizer" in args.parts:
        o = found["optimizer"] = optimizer_rate(args.params, max(3, args.repeat // 4))
        print(
            f"optimizer: fused AdamW over {o['parameters']:,} FP32 parameters: "
            f"{o['step_s'] * 1e3:.1f} ms, {o['GBps']:.0f} GB/s at 28 bytes per parameter"
        )
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
