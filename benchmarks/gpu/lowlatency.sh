#!/usr/bin/env bash
# The low-latency EP layer on nvidia-h200-x2: GPU tests and/or the benchmark.
# Usage (device machine, repo root): MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/lowlatency.sh [tests|bench|all]
#   tests: tests/gpu/test_lowlatency_gpu.py (correctness, 10,000 eager + 10,000 graph-replayed steps,
#          traces), about 3 minutes
#   bench: moekit bench lowlatency (deepseek-v3, 1..256 tokens/rank; the layer vs AllToAllDispatcher
#          vs all_to_all_vdev_2d at 32 experts, byte floor), JSON + PNG + Perfetto traces
# Files under $OUT: log-<mode>.txt, results/*.json, results/*.png, ll_traces/*.json (4).
set -uo pipefail
MODE=${1:-all}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Never NVLink multicast (see KINDS.md): NCCL, torch symmetric memory and NVSHMEM alike.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results" "$OUT/ll_traces"
{
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  if [[ $MODE == tests || $MODE == all ]]; then
    echo "== low-latency GPU tests"
    timeout 420 python3 -m pytest tests/gpu/test_lowlatency_gpu.py -p no:cacheprovider -rs
    echo "tests exit code: $?"
  fi
  if [[ $MODE == bench || $MODE == all ]]; then
    echo "== moekit bench lowlatency"
    timeout 480 python3 -m moekit.cli bench lowlatency --world-size 2 --out-dir "$OUT/results" \
      --trace-dir "$OUT/ll_traces" ${LOWLATENCY_ARGS:-}
    code=$?
    echo "bench exit code: $code"
    if [[ $code == 124 ]]; then  # a hang (e.g. in the NVSHMEM op): measure the rest without it
      echo "== timed out; again without vdev2d"
      timeout 300 python3 -m moekit.cli bench lowlatency --world-size 2 --out-dir "$OUT/results" \
        --trace-dir "$OUT/ll_traces" --methods lowlatency alltoall ${LOWLATENCY_ARGS:-}
    fi
  fi
} 2>&1 | tee "$OUT/log-$MODE.txt"
