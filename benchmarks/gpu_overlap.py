"""What a communication-like kernel running beside a GEMM costs each of them, on one GPU.

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

Prints one JSON line per measurement. What it leaves out: a real collective also waits on
its peers and on the links (NVLink, the NIC), and reduces as it copies; the copy stands for
its use of SMs and HBM only.

Run on a CUDA machine: ``python benchmarks/gpu_overlap.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copy-mib", type=int, default=256)
    p.add_argument("--blocks", default="1,2,4,8,16,24,32,66,132,528")
    p.add_argument(
        "--shapes",
        default="8192x8192x8192,8192x28672x4096,8192x4096x14336",
        help="GEMMs as MxNxK (BF16)",
    )
    p.add_argument("--gemms", type=int, default=40, help="GEMMs per timing")
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
        copy[(k,)](src, dst, n, BLOCK=block, num_warps=8)

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

    for shape in args.shapes.split(","):
        m, nn_, kk = (int(x) for x in shape.split("x"))
        a = torch.randn(m, kk, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(kk, nn_, device="cuda", dtype=torch.bfloat16)

        def gemms(count: int = args.gemms, a: torch.Tensor = a, b: torch.Tensor = b) -> None:
            for _ in range(count):
                a @ b

        gemms(5)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        gemms()
        e1.record()
        torch.cuda.synchronize()
        gemm_ms = _elapsed_ms(e0, e1) / args.gemms
        tflops = 2 * m * nn_ * kk / (gemm_ms / 1e3) / 1e12
        print(
            json.dumps(
                {
                    "shape": shape,
                    "gemm_alone_ms": round(gemm_ms, 4),
                    "tflops": round(tflops, 1),
                    "sms": sms,
                }
            ),
            flush=True,
        )
        for k in (int(x) for x in args.blocks.split(",")):
            bw_alone = copy_alone(k)
            pass_ms = moved / (bw_alone * 1e9) * 1e3
            window = gemm_ms * args.gemms
            for order in ("copy_first", "gemm_first"):
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
                            gemms()
                            g1.record()
                torch.cuda.synchronize()
                together = _elapsed_ms(g0, g1) / args.gemms
                # The copy's passes that ended inside the GEMMs' window, from the later start.
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
                            "shape": shape,
                            "blocks": k,
                            "order": order,
                            "gemm_slowdown": round(together / gemm_ms, 4),
                            "copy_alone_GBps": round(bw_alone, 1),
                            "copy_beside_GBps": None if bw is None else round(bw, 1),
                            "copy_outlasted_gemms": done[-1] > t_end,
                        }
                    ),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
