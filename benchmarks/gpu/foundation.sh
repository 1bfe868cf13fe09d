#!/usr/bin/env bash
# One device call for the foundation on nvidia-h200-x2: GPU tests, the demo on
# the GPUs, and the eager all-to-all baseline for deepseek-v3. Usage (device machine, repo
# root): MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/foundation.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off on these machines (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
log="$OUT/log.txt"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  echo "== GPU tests"
  python3 -m pytest tests/gpu -p no:cacheprovider "$@"
  echo "== demo on the GPUs"
  python3 -m moekit.cli demo
  echo "== dispatch baseline"
  for t in 1 8 32 128 256; do
    python3 -m moekit.cli bench dispatch --dispatcher alltoall --shape deepseek-v3 --tokens "$t" \
      --world-size 2 --iters 1000 --warmup 100 --out-dir "$OUT/results"
  done
} 2>&1 | tee "$log"
