#!/usr/bin/env bash
# MoELayer with the fused experts, in one nvidia-h200-x2 call: the GPU tests of the layer
# (tests/gpu/test_moe_layer_gpu.py: one and two GPUs) and of the expert-major kernel entry and
# the alignment, then layer_probe.py (the layer end to
# end over the low-latency FP8 wire, by expert compute). Everything comes back as one
# archive, $OUT/layer-<commit>.tgz (the device tool returns at most 8 files).
# Usage (device machine, repo root): MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/layer.sh [probe args...]
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=4  # the float64 references, one process per GPU
TAG=${MOEKIT_GIT_COMMIT:-unknown}; FINAL=${OUT:-/tmp/out}
WORK=/tmp/layer-$TAG; mkdir -p "$WORK" "$FINAL"
pack() { tar -czf "$FINAL/layer-$TAG.tgz" -C "$WORK" .; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$WORK/gpus.txt" 2>&1
timeout 360 python3 -m pytest tests/gpu/test_moe_layer_gpu.py tests/gpu/test_align_gpu.py \
  tests/gpu/test_fused_moe_gpu.py tests/gpu/test_fused_moe_fp8_gpu.py -k "test_fused_experts_on_the_gpu or test_layer_ or expert_major or align" \
  -s -p no:cacheprovider -rs > "$WORK/gpu-tests-$TAG.txt" 2>&1
rc=$?; echo "layer GPU tests rc $rc"; tail -4 "$WORK/gpu-tests-$TAG.txt"
[[ $rc == 0 ]] || { pack; exit 1; }
timeout 420 python3 benchmarks/probes/layer_probe.py --out "$WORK/layer-probe-$TAG.json" "$@" \
  > "$WORK/layer-probe-$TAG.txt" 2>&1
echo "probe rc $?"; tail -8 "$WORK/layer-probe-$TAG.txt"
pack
