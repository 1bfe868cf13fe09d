#!/usr/bin/env bash
# One device call on nvidia-h200-x2: all GPU tests (Cap-and-Spill graphs included), the
# Cap-and-Spill benchmark on 2 ranks, and the eager all-to-all baseline for deepseek-v3.
# Usage (device machine, repo root): MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/capspill.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
{
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  echo "== GPU tests"
  python3 -m pytest tests/gpu -p no:cacheprovider
  echo "== dispatch baseline (deepseek-v3, 128 and 256 tokens per rank)"
  for t in 1 128; do
    python3 -m moekit.cli bench dispatch --shape deepseek-v3 --tokens "$t" --world-size 2 \
      --iters 1000 --warmup 100 --out-dir "$OUT/results"
  done
  echo "== Cap-and-Spill"
  python3 -m moekit.cli bench capspill --world-size 2 ${CAPSPILL_ARGS:-} --out-dir "$OUT/results"
} 2>&1 | tee "$OUT/log.txt"
