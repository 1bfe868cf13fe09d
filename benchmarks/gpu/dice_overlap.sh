#!/usr/bin/env bash
# DICE with real overlap: the stale (fixed-capacity, no host read) exchange on a side stream,
# eagerly and with steady steps replayed from CUDA graphs, against the eager all-to-all and the
# low-latency layer. One part per run:
#
#   bash benchmarks/gpu/dice_overlap.sh 4    # 4 GPUs, about 8-9 minutes (hard limits: xl 170 + 200 s, g 180 s)
#   DICE_XL_BATCHES=8,32 bash benchmarks/gpu/dice_overlap.sh 4   # shorter: those xl batches, g at 8 (limits 200 + 120 s)
#   bash benchmarks/gpu/dice_overlap.sh 2    # 2 GPUs, about 8 minutes (hard limits: tests 220 s, xl 190 s, g 130 s)
#   bash benchmarks/gpu/dice_overlap.sh sms  # 4 GPUs, about 6 minutes: the stale exchange's SM budget
#
# Part 4 and 2: `moekit dice step` at dit-moe-xl (local batch 4, 8, 16, 32; over alltoall,
# lowlatency, stale and stale-graph) and dit-moe-g (8 and 32 on 4 GPUs, 8 on 2; alltoall,
# lowlatency, stale-graph),
# schedules sync / displaced / interweaved / dice (each launch has its own hard limit and record):
# ms per step, speedup over sync on the same dispatcher, the best dispatcher of each schedule with
# its speedup over the fastest sync and its peak memory per rank, and the share of the exchange
# hidden (profiled: dit-moe-xl batch 8 over the stale exchange, every schedule), then the goals
# (DICE >= 1.2x the fastest sync at batch 8-32 on 4 GPUs; >= 60 % of the exchange hidden) as
# met / NOT met / not measured. Part 2 first runs tests/gpu/test_dice_overlap_gpu.py.
# Part sms: dit-moe-xl batch 8 and 32, stale, sync and dice, with --comm-sms 4, 8, 16, 32 and
# NCCL's own choice (each its own launch: the budget is fixed when the group is made).
#
# Files under $OUT: log.txt, results/dice-step-*.json, traces.tar.gz (rank 0's Perfetto traces).
# DICE_STALE_PACKING=torch (or triton) picks the stale exchange's packing phases; DICE_STEPS and
# DICE_WARMUP the timed and warm-up steps per run (default 6 and 5).
set -uo pipefail
PART=${1:-4}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
STEPS=${DICE_STEPS:-6}
WARMUP=${DICE_WARMUP:-5}  # the graphed runs capture their cycle inside the warm-up
TRACE=/tmp/dice-overlap-traces  # large: they come back packed
rm -rf "$TRACE"
SCHEDULES=sync,displaced,interweaved,dice
DISPATCHERS=alltoall,lowlatency,stale,stale-graph
log="$OUT/log.txt"

step() {  # step <limit seconds> <world size> <args...>
  local limit=$1 world=$2; shift 2
  timeout -k 10 "$limit" python3 -m moekit.cli dice step --world-size "$world" --device cuda \
    --schedules "$SCHEDULES" --steps "$STEPS" --warmup "$WARMUP" --timeout "$((limit - 20))" \
    --out-dir "$OUT/results" ${DICE_STALE_PACKING:+--stale-packing "$DICE_STALE_PACKING"} "$@"
  echo "(exit $?)"
}

{
  date -u +"start %Y-%m-%dT%H:%M:%SZ part $PART"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
  echo "commit ${MOEKIT_GIT_COMMIT:-unknown}"
  case "$PART" in
    4)
      if [ -n "${DICE_XL_BATCHES:-}" ]; then  # a shorter run: these dit-moe-xl batches, dit-moe-g at batch 8
        echo "== dit-moe-xl on 4 GPUs: batch $DICE_XL_BATCHES, $DISPATCHERS; traces of batch 8 over stale"
        step 200 4 --models dit-moe-xl --batches "$DICE_XL_BATCHES" --dispatchers "$DISPATCHERS" \
          --trace "$TRACE" --trace-steps 2 --trace-schedules "$SCHEDULES"
        echo "== dit-moe-g on 4 GPUs: batch 8, alltoall, lowlatency, stale-graph"
        step 120 4 --models dit-moe-g --batches 8 --dispatchers alltoall,lowlatency,stale-graph --steps 4
      else
        echo "== dit-moe-xl on 4 GPUs: batch 4 and 8, $DISPATCHERS; traces of batch 8 over stale"
        step 170 4 --models dit-moe-xl --batches 4,8 --dispatchers "$DISPATCHERS" \
          --trace "$TRACE" --trace-steps 2 --trace-schedules "$SCHEDULES"
        echo "== dit-moe-xl on 4 GPUs: batch 16 and 32, $DISPATCHERS"
        step 200 4 --models dit-moe-xl --batches 16,32 --dispatchers "$DISPATCHERS"
        echo "== dit-moe-g on 4 GPUs: batch 8 and 32, alltoall, lowlatency, stale-graph"
        step 180 4 --models dit-moe-g --batches 8,32 --dispatchers alltoall,lowlatency,stale-graph --steps 4
      fi ;;
    2)
      echo "== tests/gpu/test_dice_overlap_gpu.py"
      timeout -k 10 220 python3 -m pytest tests/gpu/test_dice_overlap_gpu.py -q -p no:cacheprovider -rs -x
      echo "(exit $?)"
      echo "== dit-moe-xl on 2 GPUs: batch 4-32, $DISPATCHERS; traces of batch 8 over stale"
      step 190 2 --models dit-moe-xl --batches 4,8,16,32 --dispatchers "$DISPATCHERS" \
        --trace "$TRACE" --trace-steps 2 --trace-schedules "$SCHEDULES"
      echo "== dit-moe-g on 2 GPUs: batch 8, alltoall, lowlatency, stale-graph"
      step 130 2 --models dit-moe-g --batches 8 --dispatchers alltoall,lowlatency,stale-graph --steps 4 ;;
    sms)
      SCHEDULES=sync,dice
      for sms in 4 8 16 32 default; do
        echo "== dit-moe-xl on 4 GPUs, stale, comm SMs: $sms"
        extra=(); [ "$sms" = default ] || extra=(--comm-sms "$sms")
        step 75 4 --models dit-moe-xl --batches 8,32 --dispatchers stale "${extra[@]}"
      done ;;
    *) echo "unknown part $PART (4, 2 or sms)"; exit 2 ;;
  esac
  if [ "$PART" != sms ]; then
    echo "== the goals over every record of this part"
    python3 -m moekit.dice.verdicts "$OUT"/results/dice-step-*.json
  fi
  if [ -d "$TRACE" ]; then  # rank 0's traces only: a returned file holds at most 16 MiB
    ls -l "$TRACE"
    (cd "$TRACE" && tar -czf "$OUT/traces.tar.gz" ./*rank0.json) && ls -l "$OUT/traces.tar.gz"
  fi
  date -u +"end %Y-%m-%dT%H:%M:%SZ"
} 2>&1 | tee "$log"
