#!/usr/bin/env bash
# One CUDA GPU measured against the cost model, in one short call: the one-device sweep
# (fitted rates, then the catalog machine's), FP8 and BF16 GEMM rates and the routed experts'
# per-GEMM launch cost (gpu_kernels.py), fused attention at training shapes
# (gpu_attention.py), the host's time per eager layer and per kernel (gpu_host.py), the
# GPU's own time per kernel with the host taken out (gpu_graph.py), sustained GEMM clocks and
# a step's fixed costs (gpu_step.py), the allocator's reserved-over-allocated ratio on
# training steps under both allocator settings (gpu_memory.py), the same over a grid of
# vocabularies, sequences, depths and recompute, two processes at a time (memgrid), a
# collective's stand-in beside GEMMs (gpu_overlap.py) and beside a dense and an MoE layer's
# forward and backward (overlap-layers), the allocator's every request on the project's own
# real runs (gpu_alloc_trace.py, alloctrace), and the GPU-only tests. Every
# step has its own time limit, so one that fails or runs long leaves the others' figures.
# Usage: benchmarks/gpu_ground_truth.sh OUTDIR [CATALOG_MACHINE [STEP ...]], steps among
# sweep kernels attention host graph training memory memgrid overlap overlap-layers
# alloctrace tests catalog (default: all but memgrid, overlap, overlap-layers and alloctrace).
# Needs
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
# model layers micro-batch sequence recompute allocator-setting (- for the default) [loss
# [eager]] (eager: the optimizer's moments made before the first step);
# MEMGRID_CONFIGS replaces the list.
memgrid_configs=${MEMGRID_CONFIGS:-"llama3-8b 4 1 8192 none -
llama3-8b 4 1 8192 selective -
llama3-8b 4 1 8192 full -
llama3-8b 8 1 8192 full -
llama3-8b 4 1 4096 none -
llama3-8b 4 1 4096 full -
llama3-8b 4 1 16384 none -
llama3-8b 4 1 16384 full -
llama3-8b 4 2 4096 full -
mistral-7b 4 1 8192 none -
mistral-7b 4 1 8192 full -
mistral-7b 4 1 16384 full -
llama3-70b 2 1 8192 none -
llama3-70b 2 1 8192 full -
qwen3-32b 2 1 8192 full -
llama3-8b 4 1 8192 full expandable_segments:True
llama3-8b 8 1 8192 full expandable_segments:True
mistral-7b 4 1 8192 full expandable_segments:True"}
memgrid_one() {
  set -- $1
  local conf=$6; [[ $conf == - ]] && conf=
  PYTORCH_CUDA_ALLOC_CONF=$conf python3 benchmarks/gpu_memory.py --model "$1" --layers "$2" \
    --micro-batch "$3" --seq "$4" --recompute "$5" --loss "${7:-eager}" --steps 3 \
    ${8:+--eager-state} || echo "failed: $*"
}
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
export -f memory memgrid_one
step 150 memory bash -c memory
export memgrid_configs
step 300 memgrid bash -c 'echo "$memgrid_configs" | xargs -P 2 -I{} bash -c "memgrid_one \"{}\""'
step 120 overlap python3 benchmarks/gpu_overlap.py
step 120 overlap-layers python3 benchmarks/gpu_overlap.py --shapes "" --blocks 1,2,4,16,32,132 \
  --layers dense:llama3-8b,moe:qwen3-235b-a22b:16
alloctrace() {  # the traces packed as each set ends, so a set cut short leaves the other's
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 180 python3 benchmarks/gpu_alloc_trace.py "$out/alloc-dense"
  tar -czf "$out/alloc-dense.tgz" -C "$out" alloc-dense && rm -r "$out/alloc-dense"
  PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 100 python3 benchmarks/gpu_alloc_trace.py "$out/alloc-moe" --moe
  tar -czf "$out/alloc-moe.tgz" -C "$out" alloc-moe && rm -r "$out/alloc-moe"
}
export -f alloctrace
export out
step 300 alloctrace bash -c alloctrace
step 60 tests python3 -m pytest -o addopts= -q -p no:cacheprovider tests/test_device_path.py -k cuda
step 150 catalog python3 -m planner.cli calibrate --sweep --device cuda --cluster "$machine" \
  --out "$out/sweep-catalog.json"
