#!/usr/bin/env bash
# The low-latency EP layer on nvidia-h200-x2: GPU tests and/or the benchmark.
# Usage (device machine, repo root): MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/lowlatency.sh [tests|bench|all|orders]
#   tests: tests/gpu/test_lowlatency_gpu.py (correctness, 10,000 eager + 10,000 graph-replayed steps in the slot
#          order, the rank order and with a bounded receive buffer,
#          traces), about 7 minutes
#   bench: moekit bench lowlatency (deepseek-v3, 1..256 tokens/rank; the layer vs AllToAllDispatcher
#          vs all_to_all_vdev_2d at 32 experts, byte floor), JSON + PNG + Perfetto traces
#   orders: the rank combine order and the bounded receive buffers, in one call (not part of `all`):
#          tests/gpu/test_combine_order_gpu.py (fixed-buffer dispatchers in the rank order captured
#          in CUDA graphs, the all-to-all's rank order over NCCL, the symmetric-memory kernels' rank
#          order and bounded receive buffers, eager and graph-replayed), then moekit bench lowlatency
#          --combine-order both --recv-capacity 64 at T = 1..256 (the layer, worst-case and bounded,
#          and the all-to-all, in both orders), then moekit bench dispatch --combine-order both at
#          128 tokens/rank. About 6 minutes.
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
    timeout 570 python3 -m pytest tests/gpu/test_lowlatency_gpu.py -p no:cacheprovider -rs
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
  if [[ $MODE == orders ]]; then
    echo "== combine orders and bounded receive buffers: GPU tests"
    timeout 240 python3 -m pytest tests/gpu/test_combine_order_gpu.py -p no:cacheprovider -rs -rx
    echo "tests exit code: $?"
    echo "== moekit bench lowlatency --combine-order both --recv-capacity 64 (T = 1..256)"
    timeout 360 python3 -m moekit.cli bench lowlatency --world-size 2 --combine-order both --recv-capacity 64 \
      --methods lowlatency alltoall --out-dir "$OUT/results" ${LOWLATENCY_ARGS:-}
    echo "bench exit code: $?"
    echo "== moekit bench dispatch --combine-order both (128 tokens/rank)"
    timeout 120 python3 -m moekit.cli bench dispatch --world-size 2 --combine-order both --tokens 128 \
      --iters 300 --warmup 30 --out-dir "$OUT/results"
    echo "bench dispatch exit code: $?"
  fi
} 2>&1 | tee "$OUT/log-$MODE.txt"
