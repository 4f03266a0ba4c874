#!/usr/bin/env bash
# The project's own real runs on one CUDA GPU, kept as Megatron-LM-format logs that
# `planner calibrate --log` reads: `planner validate --set one-gpu` (twelve layouts of a
# 4-layer Llama 3 8B), `--set one-gpu-moe` (six of a 2-layer Mixtral 8x7B), and the dense
# set's recompute-heavy and largest layouts again under PYTORCH_CUDA_ALLOC_CONF=
# expandable_segments:True (the allocator setting torchtitan's launcher uses), each set
# packed as OUTDIR/<set>.tgz as soon as it ends, so a set cut short leaves the others.
# Usage: benchmarks/gpu_validate_logs.sh OUTDIR [CATALOG_MACHINE]. Needs python3 with torch
# (CUDA) and the project's dependencies importable.
out=${1:?usage: gpu_validate_logs.sh OUTDIR [CATALOG_MACHINE]}
machine=${2:-h200}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,memory.total,driver_version \
  --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
logs=$(mktemp -d)
run() { local limit=$1 name=$2; shift 2; echo "== $name"; local t0=$SECONDS
  mkdir -p "$logs/$name"
  timeout "$limit" python3 -m planner.cli validate --device cuda --cluster "$machine" \
    --log-dir "$logs/$name" "$@" >"$logs/$name/validate.txt" 2>&1
  echo "== $name: exit $?, $((SECONDS - t0)) s"; tail -n 30 "$logs/$name/validate.txt"
  tar -czf "$out/$name.tgz" -C "$logs" "$name"; }
run 300 one-gpu --set one-gpu
run 170 one-gpu-moe --set one-gpu-moe
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run 120 one-gpu-expandable \
  --set one-gpu --only 3 6 9 12 7 10
