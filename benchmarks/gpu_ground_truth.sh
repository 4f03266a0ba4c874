#!/usr/bin/env bash
# One CUDA GPU measured against the cost model, in one short call: the one-device sweep
# (fitted rates, then the catalog machine's), FP8 and BF16 GEMM rates and the routed experts'
# per-GEMM launch cost (gpu_kernels.py), fused attention at training shapes
# (gpu_attention.py), the host's time per eager layer and per kernel (gpu_host.py), the
# GPU's own time per kernel with the host taken out (gpu_graph.py), sustained GEMM clocks and
# a step's fixed costs (gpu_step.py), the allocator's reserved-over-allocated ratio on
# training steps under both allocator settings (gpu_memory.py), and the GPU-only tests. Every
# step has its own time limit, so one that fails or runs long leaves the others' figures.
# Usage: benchmarks/gpu_ground_truth.sh OUTDIR [CATALOG_MACHINE [STEP ...]], steps among
# sweep kernels attention host graph training memory tests catalog (default: all). Needs
# python3 with torch (CUDA) and the project's dependencies importable (PYTHONPATH).
out=${1:?usage: gpu_ground_truth.sh OUTDIR [CATALOG_MACHINE [STEP ...]]}
machine=${2:-h200}
shift $(( $# > 2 ? 2 : $# ))
steps=" ${*:-sweep kernels attention host graph training memory tests catalog} "
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,memory.total,driver_version \
  --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, ortools, pydantic, planner; print('torch', torch.__version__)"
step() { local limit=$1 name=$2; shift 2; [[ $steps == *" $name "* ]] || return 0
  echo "== $name"; local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1; echo "== $name: exit $?, $((SECONDS - t0)) s"
  tail -n 60 "$out/$name.log"; }
memory() {
  local conf cfg
  for conf in "" "expandable_segments:True"; do
    for cfg in "1 none" "1 full" "2 none" "2 full"; do
      set -- $cfg
      PYTORCH_CUDA_ALLOC_CONF=$conf python3 benchmarks/gpu_memory.py --layers 8 \
        --micro-batch "$1" --recompute "$2" || echo "failed: conf=$conf $cfg"
    done
  done
}
step 170 sweep python3 -m planner.cli calibrate --sweep --device cuda --out "$out/sweep.json"
step 120 kernels python3 benchmarks/gpu_kernels.py --cluster "$machine" --out "$out/kernels.json"
step 120 attention python3 benchmarks/gpu_attention.py --cluster "$machine"
step 60 host python3 benchmarks/gpu_host.py
step 60 graph python3 benchmarks/gpu_graph.py --cluster "$machine"
step 150 training python3 benchmarks/gpu_step.py
export -f memory
step 150 memory bash -c memory
step 60 tests python3 -m pytest -o addopts= -q -p no:cacheprovider tests/test_device_path.py -k cuda
step 150 catalog python3 -m planner.cli calibrate --sweep --device cuda --cluster "$machine" \
  --out "$out/sweep-catalog.json"
