#!/usr/bin/env bash
# MoELayer end to end on the two-GPU machine (nvidia-h100-x2 or nvidia-h200-x2), in one device
# call of about 3 minutes, 4.5 at most (each step under its own `timeout`, so the logs always
# come back; Triton compiles take most of it):
#   1. `moekit bench layer`: qwen3-30b-a3b at 1, 16, 128 tokens per rank; the low-latency layer
#      (FP8 dispatch, bf16 combine) with the fused FP8 experts, RaMP's choice (auto) and the static
#      default, each captured in a CUDA graph, the same two eagerly (where auto chooses per forward
#      from the routing), and the eager all-to-all with the same experts; every variant checked
#      against the float64 block on every rank (exit 1 if one is off);
#   2. the layer's GPU tests, tests/gpu/test_moe_layer_gpu.py (one GPU and two; the bench's own
#      test included). The expert-major kernel and alignment tests are in kernel_tests.sh.
# Files under $OUT (5): gpus.txt, bench-layer-<commit>.txt, the record layer-<device>-2x-<time>.json
# and its .png, gpu-tests-layer-<commit>.txt.
# Usage (device machine, repo root): MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/layer.sh [bench args...]
# (extra arguments go to `moekit bench layer`, after the ones below, e.g. --iters 1000).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# Never NVLink multicast (see KINDS.md): NCCL, torch symmetric memory and NVSHMEM alike.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}  # the random weights and references, one process per GPU
TAG=${MOEKIT_GIT_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpus.txt" 2>&1

echo "== moekit bench layer"
timeout 150 python3 -m moekit.cli bench layer --shape qwen3-30b-a3b --tokens 1 16 128 --world-size 2 \
  --variants ll-fp8+fused_fp8+auto ll-fp8+fused_fp8+static alltoall+fused_fp8+static \
             ll-fp8+fused_fp8+auto@eager ll-fp8+fused_fp8+static@eager \
  --iters 500 --warmup 50 --out-dir "$OUT" "$@" > "$OUT/bench-layer-$TAG.txt" 2>&1
bench_rc=$?
echo "bench rc $bench_rc"; tail -22 "$OUT/bench-layer-$TAG.txt"

echo "== tests/gpu/test_moe_layer_gpu.py"
timeout 120 python3 -m pytest tests/gpu/test_moe_layer_gpu.py -s -p no:cacheprovider -rs \
  > "$OUT/gpu-tests-layer-$TAG.txt" 2>&1
tests_rc=$?
echo "tests rc $tests_rc"; tail -4 "$OUT/gpu-tests-layer-$TAG.txt"
[[ $bench_rc == 0 && $tests_rc == 0 ]]
