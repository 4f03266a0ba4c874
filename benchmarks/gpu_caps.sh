#!/usr/bin/env bash
# The replayed allocator's out-of-memory predictions against real runs on one CUDA GPU: four
# one-GPU validation layouts, each run under caps on what the allocator may reserve, below
# and above the capacity `planner.allocator.needed` finds from its recorded trace
# (`python benchmarks/allocator_replay.py`); then the collective's stand-in beside a dense
# layer with NCCL's 512-thread blocks. Usage: benchmarks/gpu_caps.sh OUTDIR. Needs python3
# with torch (CUDA) and the project's dependencies importable (PYTHONPATH).
out=${1:?usage: gpu_caps.sh OUTDIR}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/benchmarks:$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
caps() { timeout 150 python3 benchmarks/gpu_alloc_trace.py "$out/caps" "$@" 2>&1 \
  | grep '^{' | tee -a "$out/caps.log"; }
caps --only 12 --caps 40 47 49
caps --only 9 --caps 33 34.5
caps --moe --only 1 --caps 27.5 28.6
caps --moe --only 4 --caps 31.8 33
timeout 60 python3 benchmarks/gpu_overlap.py --shapes "" --blocks 16,32 --warps 16 \
  --layers dense:llama3-8b 2>&1 | grep '^{' | tee "$out/overlap-warps16.jsonl"
