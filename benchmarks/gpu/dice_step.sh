#!/usr/bin/env bash
# DICE measured on two GPUs (nvidia-h100-x2 or nvidia-h200-x2), one device call of about 4
# minutes (hard limits per part: tests 150 s, dit-moe-xl 150 s, dit-moe-g 210 s):
#   1. the two-GPU DICE tests (tests/gpu/test_dice_gpu.py: the schedules over NCCL against the
#      simulator, and `moekit dice step` end to end at dit-moe-xl's layer shape, 2 blocks);
#   2. `moekit dice step` at dit-moe-xl: local batch 4, 8, 16, 32 per GPU, the eager all-to-all
#      and the low-latency layer, sync / displaced / interweaved / dice, DICE_STEPS timed steps
#      after DICE_WARMUP warm-up steps per run; plus the Perfetto traces of batch 8, dice and
#      sync, over the eager all-to-all, and their overlap figures;
#   3. the same at dit-moe-g (no trace).
# Usage (device machine, repo root): MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/dice_step.sh
# Files under $OUT: log.txt, results/dice-step-*.json (one per model), traces.tar.gz (rank 0's traces).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
STEPS=${DICE_STEPS:-6}
WARMUP=${DICE_WARMUP:-2}
TRACE=/tmp/dice-step-traces  # the traces are large: they come back packed
rm -rf "$TRACE"
log="$OUT/log.txt"
{
  date -u +"start %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  echo "commit ${MOEKIT_GIT_COMMIT:-unknown}"

  echo "== 1. two-GPU DICE tests"
  timeout -k 10 150 python3 -m pytest tests/gpu/test_dice_gpu.py -q -p no:cacheprovider -rs \
    -k "two_gpus or dice_step"

  echo "== 2. dit-moe-xl: ms per step of each schedule, both dispatchers, batch 4-32 per GPU; traces"
  timeout -k 10 150 python3 -m moekit.cli dice step --world-size 2 --device cuda --models dit-moe-xl \
    --batches 4,8,16,32 --dispatchers alltoall,lowlatency --schedules sync,displaced,interweaved,dice \
    --steps "$STEPS" --warmup "$WARMUP" --trace "$TRACE" --trace-steps 2 --timeout 120 --out-dir "$OUT/results"

  echo "== 3. dit-moe-g: the same, no trace"
  timeout -k 10 210 python3 -m moekit.cli dice step --world-size 2 --device cuda --models dit-moe-g \
    --batches 4,8,16,32 --dispatchers alltoall,lowlatency --schedules sync,displaced,interweaved,dice \
    --steps "$STEPS" --warmup "$WARMUP" --timeout 120 --out-dir "$OUT/results"

  # Rank 0's traces only (each rank's overlap figure is in the record): a returned file holds at most 16 MiB.
  if [ -d "$TRACE" ]; then
    ls -l "$TRACE"
    (cd "$TRACE" && tar -czf "$OUT/traces.tar.gz" ./*rank0.json) && ls -l "$OUT/traces.tar.gz"
  fi
  date -u +"end %Y-%m-%dT%H:%M:%SZ"
} 2>&1 | tee "$log"
