"""What a communication-like kernel running beside a GEMM (or a layer) costs each, on one GPU.

A collective overlapped with compute is not free: its kernel holds streaming multiprocessors
(NCCL runs one thread block per channel) and moves bytes through HBM while the GEMM runs.
This measures both effects with a stand-in for the collective's kernel: a grid-stride copy
(Triton) of ``--copy-mib`` MiB launched with ``k`` thread blocks, so that it holds at most
``k`` SMs and reads and writes HBM at the rate ``k`` blocks reach. For each GEMM shape and
each ``k``:

- each kernel alone: the GEMM's time, and the copy's bandwidth (bytes read plus written);
- both at once, on two streams, in each launch order (the copy first, so its blocks hold SMs
  when the GEMM's waves start, and the GEMM first, so the copy's blocks wait for SMs the
  GEMM frees between waves): the GEMM's time against its time alone, and the copy's
  bandwidth while the GEMM ran against its bandwidth alone.

``--layers`` runs the same beside whole layers instead of GEMMs alone (``dense:MODEL``: one
layer of a catalog model, forward and backward; ``moe:MODEL:E``: its MoE layer cut to the E
experts an expert-parallel rank holds), whose attention, norms and elementwise kernels leave
the copy other gaps than back-to-back GEMMs do.

Prints one JSON line per measurement. What it leaves out: a real collective also waits on
its peers and on the links (NVLink, the NIC), and reduces as it copies; the copy stands for
its use of SMs and HBM only.

Run on a CUDA machine: ``python benchmarks/gpu_overlap.py [--shapes "" --layers
dense:llama3-8b,moe:qwen3-235b-a22b:16]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import Any

import torch


def _copy_kernel():  # Triton is imported only on a CUDA machine
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        start = tl.program_id(0) * BLOCK
        step = tl.num_programs(0) * BLOCK
        for off in range(start, n, step):
            idx = off + tl.arange(0, BLOCK)
            mask = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)

    return copy


def _elapsed_ms(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    return float(start.elapsed_time(end))


def _gemm_work(shape: str) -> tuple[str, Callable[[], None], float]:
    m, n, k = (int(x) for x in shape.split("x"))
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)

    def once() -> None:
        a @ b

    return shape, once, 2.0 * m * n * k


def _layer_work(spec: str, tokens: int) -> tuple[str, Callable[[], None], float]:
    """``dense:MODEL``: one layer of the catalog model (``planner.run.model.DenseLayer``),
    forward and backward over ``tokens`` tokens; ``moe:MODEL:E``: the same layer with its
    routed experts cut to the ``E`` an expert-parallel rank holds, each expert then getting
    ``tokens * k / E`` rows, its experts run as a loop of GEMMs with the host reading the
    counts, as ``planner.run``'s MoE does."""
    from planner.catalog import load_model
    from planner.run.model import DenseLayer

    kind, _, rest = spec.partition(":")
    name, _, local = rest.partition(":")
    model = load_model(name)
    if kind == "moe":
        model = model.model_copy(update={"num_experts": int(local or model.num_experts)})
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = DenseLayer(model, torch.bfloat16, moe=kind == "moe")
    x = torch.randn(1, tokens, model.hidden_size, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    grad = torch.randn_like(x)

    def once() -> None:
        layer(x).backward(grad)

    return spec, once, 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copy-mib", type=int, default=256)
    p.add_argument("--blocks", default="1,2,4,8,16,24,32,66,132,528")
    p.add_argument(
        "--shapes",
        default="8192x8192x8192,8192x28672x4096,8192x4096x14336",
        help="GEMMs as MxNxK (BF16); empty for none",
    )
    p.add_argument("--gemms", type=int, default=40, help="GEMMs per timing")
    p.add_argument(
        "--layers",
        default="",
        help="comma-separated layers, each dense:MODEL or moe:MODEL:LOCAL_EXPERTS, run "
        "forward and backward beside the copy (e.g. dense:llama3-8b,moe:qwen3-235b-a22b:16)",
    )
    p.add_argument("--tokens", type=int, default=4096, help="tokens a layer runs on")
    p.add_argument("--passes", type=int, default=8, help="layer passes per timing")
    p.add_argument(
        "--warps",
        type=int,
        default=8,
        help="warps per block of the copy (NCCL_NTHREADS' default on recent GPUs, 512 threads, "
        "is 16)",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_overlap: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    copy = _copy_kernel()
    block = 4096
    n = args.copy_mib * 2**20 // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    moved = 2 * n * 2  # bytes read and written per pass
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    s_gemm, s_copy = torch.cuda.Stream(), torch.cuda.Stream()

    def launch_copy(k: int) -> None:
        copy[(k,)](src, dst, n, BLOCK=block, num_warps=args.warps)

    def copy_alone(k: int) -> float:
        launch_copy(k)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 3
        e0.record()
        for _ in range(reps):
            launch_copy(k)
        e1.record()
        torch.cuda.synchronize()
        return moved * reps / (_elapsed_ms(e0, e1) / 1e3) / 1e9

    works = [(w, args.gemms) for w in (_gemm_work(s) for s in args.shapes.split(",") if s)]
    works += [
        (w, args.passes) for w in (_layer_work(s, args.tokens) for s in args.layers.split(",") if s)
    ]
    for (name, once, flops), count in works:

        def run(count: int = count, once: Callable[[], None] = once) -> None:
            for _ in range(count):
                once()

        with torch.cuda.stream(s_gemm):
            run(3)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s_gemm):
            e0.record()
            run()
            e1.record()
        torch.cuda.synchronize()
        work_ms = _elapsed_ms(e0, e1) / count
        head: dict[str, Any] = {"work": name, "alone_ms": round(work_ms, 4), "sms": sms}
        if flops:
            head["tflops"] = round(flops / (work_ms / 1e3) / 1e12, 1)
        print(json.dumps(head), flush=True)
        for k in (int(x) for x in args.blocks.split(",")):
            bw_alone = copy_alone(k)
            pass_ms = moved / (bw_alone * 1e9) * 1e3
            window = work_ms * count
            for order in ("copy_first", "work_first"):
                reps = max(2, math.ceil(1.5 * window / pass_ms) + 1)
                start = torch.cuda.Event()
                g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                c0 = torch.cuda.Event(enable_timing=True)
                ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
                torch.cuda.synchronize()
                start.record()
                first, second = (s_copy, s_gemm) if order == "copy_first" else (s_gemm, s_copy)
                for stream in (first, second):
                    stream.wait_event(start)
                    if stream is s_copy:
                        with torch.cuda.stream(s_copy):
                            c0.record()
                            for e in ends:
                                launch_copy(k)
                                e.record()
                    else:
                        with torch.cuda.stream(s_gemm):
                            g0.record()
                            run()
                            g1.record()
                torch.cuda.synchronize()
                together = _elapsed_ms(g0, g1) / count
                # The copy's passes that ended inside the work's window, from the later start.
                t_start = max(0.0, _elapsed_ms(c0, g0))
                t_end = _elapsed_ms(c0, g1)
                done = [_elapsed_ms(c0, e) for e in ends]
                inside = [t for t in done if t_start < t <= t_end]
                bw = None
                if len(inside) >= 2:
                    bw = moved * (len(inside) - 1) / ((inside[-1] - inside[0]) / 1e3) / 1e9
                print(
                    json.dumps(
                        {
                            "work": name,
                            "blocks": k,
                            "warps": args.warps,
                            "order": order,
                            "work_slowdown": round(together / work_ms, 4),
                            "copy_alone_GBps": round(bw_alone, 1),
                            "copy_beside_GBps": None if bw is None else round(bw, 1),
                            "copy_outlasted_work": done[-1] > t_end,
                        }
                    ),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
