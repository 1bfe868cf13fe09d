#!/usr/bin/env bash
# The 8-GPU runs on nvidia-h200-x8 (8 GPUs of one host), one mode per device call (<= 10 min):
#   lowlatency: moekit bench lowlatency --world-size 8 (deepseek-v3, 1..256 tokens per rank; the
#               layer, the AllToAllDispatcher and all_to_all_vdev_2d at 32 experts, byte floor)
#   capspill:   moekit bench capspill --world-size 8 (Mixtral-8x7B-like trace, H = 4096)
#   dispatch:   moekit bench dispatch --world-size 8, the eager AllToAllDispatcher (deepseek-v3
#               and mixtral-8x7b shapes, 1..256 tokens per rank)
# Usage (device machine, repo root): MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/x8.sh MODE
# Files under $OUT: log-<mode>.txt, results/*.json and *.png (lowlatency: ll_traces/*.json too).
# The same runs at small sizes on CPU (8 gloo ranks) are what CI's 8-rank tests exercise.
set -uo pipefail
MODE=${1:?"usage: x8.sh lowlatency|capspill|dispatch"}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Never NVLink multicast (see KINDS.md): NCCL, torch symmetric memory and NVSHMEM alike.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results" "$OUT/ll_traces"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  case "$MODE" in
    lowlatency)
      timeout 540 python3 -m moekit.cli bench lowlatency --world-size 8 --out-dir "$OUT/results" \
        --trace-dir "$OUT/ll_traces" ${LOWLATENCY_ARGS:-}
      echo "bench exit code: $?" ;;
    capspill)
      timeout 540 python3 -m moekit.cli bench capspill --world-size 8 --hidden 4096 ${CAPSPILL_ARGS:-} \
        --out-dir "$OUT/results"
      echo "bench exit code: $?" ;;
    dispatch)
      for shape in deepseek-v3 mixtral-8x7b; do
        for t in 1 8 32 128 256; do
          timeout 100 python3 -m moekit.cli bench dispatch --dispatcher alltoall --shape "$shape" --tokens "$t" \
            --world-size 8 --iters 1000 --warmup 100 --out-dir "$OUT/results"
          echo "$shape T=$t exit code: $?"
        done
      done ;;
    *) echo "unknown mode $MODE (lowlatency, capspill or dispatch)"; exit 2 ;;
  esac
} 2>&1 | tee "$OUT/log-$MODE.txt"
