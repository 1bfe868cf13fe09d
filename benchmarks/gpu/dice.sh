#!/usr/bin/env bash
# DICE on one GPU (nvidia-h100-x1 or nvidia-h200), one device call of about 5-6 minutes (hard
# limits per part: tests 150 s, quality 300 s, bench 100 s):
#   1. the DICE GPU tests (tests/gpu/test_dice_gpu.py: the async executor's overlap, the
#      schedules against the simulator on the GPU, the fused experts under a schedule);
#   2. the quality recipe: train the class-conditional DiT-MoE on scikit-learn's bundled
#      8 x 8 digits (DICE_TRAIN_S seconds, default 150) and the feature classifier, sample
#      with every schedule from the same noise (DICE_PER_CLASS per class, DICE_SAMPLE_STEPS
#      Euler steps), write the quality table and one PNG grid per schedule;
#   3. the model's parts per step at dit-moe-xl and dit-moe-g shapes, local batch 4-32, bf16,
#      and the speedup / memory model fed with them and the 2 x H200 all-to-all records.
# Usage (device machine, repo root): MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/dice.sh
# Files under $OUT: log.txt, quality/{quality.json,quality.md,*.png}, results/dice-bench-*.json.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/quality" "$OUT/results"
TRAIN_S=${DICE_TRAIN_S:-150}
PER_CLASS=${DICE_PER_CLASS:-100}
SAMPLE_STEPS=${DICE_SAMPLE_STEPS:-50}
log="$OUT/log.txt"
{
  date -u +"start %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, triton, sklearn; print("torch", torch.__version__, "triton", triton.__version__, "scikit-learn", sklearn.__version__, "gpus", torch.cuda.device_count())'
  echo "commit ${MOEKIT_GIT_COMMIT:-unknown}"

  echo "== 1. DICE GPU tests"
  timeout 150 python3 -m pytest tests/gpu/test_dice_gpu.py -q -p no:cacheprovider -rs

  echo "== 2. quality: train ${TRAIN_S} s, ${PER_CLASS} samples per class, ${SAMPLE_STEPS} steps, every schedule"
  timeout 300 python3 -m moekit.cli dice quality --out-dir "$OUT/quality" \
    --hidden 128 --depth 6 --heads 4 --experts 8 --train-steps 100000 --train-batch 256 --lr 5e-4 \
    --time-budget "$TRAIN_S" --log-every 500 --per-class "$PER_CLASS" --sample-steps "$SAMPLE_STEPS" \
    --cfg 1.5 --classifier-epochs 60
  # The trained weights (tens of MB) stay on the machine, out of what comes back.
  mv "$OUT/quality/dit-moe-digits.pt" /tmp/ 2>/dev/null || true

  echo "== 3. parts per step at dit-moe-xl / dit-moe-g shapes, and the speedup / memory model"
  timeout 100 python3 -m moekit.cli dice bench --models dit-moe-xl,dit-moe-g --batches 4,8,16,32 \
    --world-size 2 --dtype bf16 --iters 20 --warmup 3 --steps 50 --out-dir "$OUT/results"
  date -u +"end %Y-%m-%dT%H:%M:%SZ"
} 2>&1 | tee "$log"
