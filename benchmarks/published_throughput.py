"""Predicted step time and MFU against figures the model builders published for their own runs.

- DeepSeek-V3 technical report (arXiv 2412.19437), section 1: "each trillion tokens requires
  only 180K H800 GPU hours, i.e., 3.7 days on our cluster with 2048 H800 GPUs"; section 3.2:
  16-way pipeline parallelism with DualPipe, 64-way expert parallelism over 8 nodes, ZeRO-1
  data parallelism, no tensor parallelism; FP8 GEMMs (section 3.3); sequence 4096, batch
  15360 (section 4.2). Recompute of RMSNorm and MLA up-projections (section 3.2.3).
- Llama 3 (Dubey et al., arXiv 2407.21783), Table 4: 405B on 8,192 and 16,384 H100s, TP 8,
  PP 16, DP 64 / 128, sequence 8192, 16M tokens per batch: 430 / 400 TFLOP/s per GPU, BF16
  MFU 43% / 41%.

The published runs differ from the model in ways it does not capture (DeepSeek's FP8
quantisation kernels, FP8 activation caching and expert load imbalance; Llama 3's tuned
interleaving and overlapped communication), so this is a sanity check of scale, not a fit:
nothing here is tuned to it.

Run: ``.venv/bin/python benchmarks/published_throughput.py``.
"""

from __future__ import annotations

import time

import planner
from planner.layout import Layout


def deepseek() -> None:
    model = planner.load_model("deepseek-v3")
    cluster = planner.load_cluster("h800", gpus=2048)
    job = planner.TrainingJob(
        seq_len=4096, global_batch=15360, moment_dtype="bf16", compute_dtype="fp8"
    )
    layout = Layout.uniform(
        model, pp=16, dp=128, ep=64, schedule="dualpipe", recompute="layernorm+mla_up_proj"
    )
    est = planner.evaluate(model, cluster, job, layout)
    published = 180e3 * 3600 / 1e12 * job.tokens_per_step / cluster.num_gpus
    print(
        f"DeepSeek-V3, 2048 H800, DualPipe pp16 ep64 FP8: predicted {est.step_time_s:.1f} s per "
        f"step, published {published:.1f} s (180K GPU hours per trillion tokens): "
        f"{est.step_time_s / published - 1:+.0%}; MFU {est.mfu:.1%}; exposed all-to-all "
        f"{est.breakdown['expert_all_to_all']:.1f} s"
    )


def llama(gpus: int, dp: int, tflops: float, mfu: float) -> None:
    model = planner.load_model("llama3-405b")
    cluster = planner.load_cluster("h100", gpus=gpus)
    job = planner.TrainingJob(seq_len=8192, global_batch=2048)
    layout = Layout.uniform(
        model, pp=16, tp=8, dp=dp, schedule="interleaved", virtual_stages=2, recompute="none"
    )
    est = planner.evaluate(model, cluster, job, layout)
    print(
        f"Llama 3 405B, {gpus} H100, tp8 pp16 dp{dp} interleaved: predicted "
        f"{est.tflops_per_gpu:.0f} TFLOP/s per GPU, MFU {est.mfu:.1%}; published {tflops:.0f}, "
        f"{mfu:.0%}: {est.tflops_per_gpu / tflops - 1:+.0%} (step {est.step_time_s:.1f} s)"
    )


def main() -> None:
    started = time.perf_counter()
    deepseek()
    llama(8192, 64, 430, 0.43)
    llama(16384, 128, 400, 0.41)
    print(f"wall time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
