#!/usr/bin/env bash
# Cap-and-Spill on GPUs: its GPU tests, then `moekit bench capspill` (Tables 1-2, Figures 2-3 of
# the paper, per-phase breakdown) on each world size of WORLD_SIZES, once per packing of
# PACKINGS ("auto": the one-kernel phases of moekit.ep.capspill_pack; "torch": the torch phases,
# their baseline). Needs max(WORLD_SIZES) GPUs of one host (nvidia-h100-x4 for "2 4").
# Usage (device machine, repo root):
#   MOEKIT_GIT_COMMIT=<sha> WORLD_SIZES="2 4" PACKINGS="auto torch" bash benchmarks/gpu/capspill.sh
# SKIP_TESTS=1 skips the tests; CAPSPILL_ARGS adds bench arguments (e.g. "--steps 50");
# WITH_DISPATCH_BASELINE=1 also runs the eager all-to-all baseline for deepseek-v3 on 2 ranks.
# Output: $OUT/log.txt, records and figures in $OUT/results/.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
{
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  if [ -z "${SKIP_TESTS:-}" ]; then
    echo "== Cap-and-Spill GPU tests"
    python3 -m pytest -p no:cacheprovider -q tests/gpu/test_capspill_pack_gpu.py tests/gpu/test_capspill_graph.py
  fi
  if [ -n "${WITH_DISPATCH_BASELINE:-}" ]; then
    echo "== dispatch baseline (deepseek-v3, 1 and 128 tokens per rank)"
    for t in 1 128; do
      python3 -m moekit.cli bench dispatch --shape deepseek-v3 --tokens "$t" --world-size 2 \
        --iters 1000 --warmup 100 --out-dir "$OUT/results"
    done
  fi
  for p in ${WORLD_SIZES:-2}; do
    for packing in ${PACKINGS:-auto}; do
      echo "== Cap-and-Spill, $p ranks, packing $packing"
      python3 -m moekit.cli bench capspill --world-size "$p" --packing "$packing" ${CAPSPILL_ARGS:-} \
        --out-dir "$OUT/results"
    done
  done
} 2>&1 | tee "$OUT/log.txt"
