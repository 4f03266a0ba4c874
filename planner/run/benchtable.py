"""Tables of a device sweep (``planner.run.bench.Sweep``) for the terminal, every figure with
its unit; error = predicted / measured - 1, red beyond 20%."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from planner.run.benchrows import Sweep

MiB = 2**20
RED = 0.2


def _err(x: float) -> str:
    return f"[red]{x:+.1%}[/red]" if abs(x) > RED else f"{x:+.1%}"


def _rate(flops_per_s: float, unit: tuple[float, str]) -> str:
    return f"{flops_per_s / unit[0]:.1f}"


def _flops(x: float) -> str:
    return f"{x / 1e12:.1f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.1f} GFLOP/s"


def _table(title: str, columns: list[str], rows: list[list[str]], left: int = 1) -> Table:
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i < left else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def print_sweep(sweep: Sweep, console: Console) -> None:
    """Print ``sweep`` as five tables and a list of what the real layers do not run."""
    r = sweep.rates
    big = max((g.flops_per_s for g in sweep.gemm), default=0.0) >= 1e12
    unit = (1e12, "TFLOP/s") if big else (1e9, "GFLOP/s")
    console.print(
        f"{sweep.device_name} ({sweep.device}, {sweep.dtype.upper()}), widths and lengths x "
        f"{sweep.scale:g}, torch {sweep.torch}, {sweep.when}. Cost model rates "
        f"({sweep.reference}): GEMM {_flops(r['gemm_flops'] or 0)}, attention "
        f"{_flops(r['attention_flops'] or 0)}, memory-bound "
        f"{(r['memory_Bps'] or 0) / 1e9:.1f} GB/s, {(r['kernel_s'] or 0) * 1e6:.2f} us per "
        f"kernel, host {(r['host_s'] or 0) * 1e6:.2f} us per kernel"
        + (f", {r['sm_count']:.0f} SMs" if r.get("sm_count") else "")
    )
    gemm = [
        [
            g.model,
            g.name,
            str(g.tp),
            f"{g.m}x{g.n}x{g.k}" + (f" x{g.groups}" if g.groups > 1 else ""),
            f"{g.measured_s * 1e3:.3f}",
            _rate(g.flops_per_s, unit),
            f"{g.predicted_s * 1e3:.3f}",
            _err(g.error),
        ]
        for g in sweep.gemm
    ]
    heads = ["model", "GEMM", "tp", "m x n x k", "ms", unit[1], "model ms", "error"]
    console.print(_table("GEMMs of one layer, forward, by tensor-parallel degree", heads, gemm, 2))
    attn = [
        [
            str(a.seq_len),
            f"{a.heads}/{a.kv_heads}/{a.head_dim}",
            a.phase,
            f"{a.flops / 1e9:.3f}",
            f"{a.measured_s * 1e3:.3f}",
            _rate(a.flops_per_s, unit),
            f"{a.predicted_s * 1e3:.3f}",
            _err(a.error),
        ]
        for a in sweep.attention
    ]
    heads = ["seq", "heads/kv/dim", "phase", "GFLOP", "ms", unit[1], "model ms", "error"]
    title = "causal attention (SDPA), FLOPs as the cost model counts them"
    console.print(_table(title, heads, attn, 0))
    mem = [
        [
            m.kernel,
            f"{m.bytes / MiB:.1f}",
            f"{m.measured_s * 1e3:.3f}",
            f"{m.bytes_per_s / 1e9:.1f}",
            f"{m.predicted_s * 1e3:.3f}",
            _err(m.error),
        ]
        for m in sweep.memory
    ]
    heads = ["kernel", "MiB moved", "ms", "GB/s", "model ms", "error"]
    console.print(_table("memory-bound kernels (bytes read + written)", heads, mem))
    console.print(_blocks(sweep))
    console.print(
        "kept: bytes allocated after the forward (what autograd keeps, and the output, the "
        "size of the input the cost model counts as block_input) against the block's saved "
        "bytes; peak: highest allocated in forward + backward above the start (weights and "
        "gradients excluded); resv: the allocator's reserved peak (whole process)."
    )
    for block, choices in sweep.not_run.items():
        console.print(f"not run (the real layer lacks them): {block}: {', '.join(choices)}")


def _blocks(sweep: Sweep) -> Table:
    rows: list[list[Any]] = []
    for b in sweep.blocks:
        reserved = b.reserved_bytes
        rows.append(
            [
                b.model,
                str(b.micro_batch),
                str(b.seq_len),
                b.recompute,
                f"{b.fwd_s * 1e3:.2f} / {b.predicted_fwd_s * 1e3:.2f}",
                _err(b.fwd_error),
                f"{b.bwd_s * 1e3:.2f} / {b.predicted_bwd_s * 1e3:.2f}",
                _err(b.bwd_error),
                f"{b.kept_bytes / MiB:.2f} / {b.predicted_kept_bytes / MiB:.2f}",
                _err(b.kept_error),
                f"{b.peak_bytes / MiB:.1f}",
                f"{reserved / MiB:.1f}" if reserved is not None else "not measured",
            ]
        )
    heads = ["model", "mb", "seq", "recompute", "fwd ms", "error", "bwd ms", "error"]
    heads += ["kept MiB", "error", "peak MiB", "resv MiB"]
    blocks = ", ".join(sorted({f"{b.model} {b.block}" for b in sweep.blocks}))
    title = f"real-width layers ({blocks}): measured / cost model"
    return _table(title, heads, rows, 1)
