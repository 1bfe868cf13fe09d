#!/usr/bin/env bash
# Serving on several GPUs (`moekit lm serve-bench`): OLMoE-1B-7B (16 layers) and Qwen3-30B-A3B
# (48 layers) at real dimensions, random weights, moekit's expert parallelism (bf16 and FP8 experts)
# against transformers' tensor parallelism, its expert parallelism and device_map splitting, and
# both on one GPU where the model fits -- in the same run, on the same GPUs.
# Needs a machine with 4 GPUs for the 4-GPU stages (nvidia-h100-x4); the 2-GPU stages use GPUs 0,1.
# Stages (SERVE_STAGES, comma-separated, run in order; default: the four below, about 8 minutes):
#   olmoe:N     OLMoE full depth, batches 1,16,64,256 per GPU, eager, every implementation
#   qwen3:N     Qwen3-30B-A3B full depth, batches 64,256 per GPU, eager, moekit EP/1 GPU + transformers TP/EP
#   compiled:N  OLMoE batch 64, compiled (CUDA graphs; moekit EP: torch.compile without full graph)
#   tests       the 2-GPU test of build_expert_parallel (tests/gpu/test_expert_parallel_lm_gpu.py, ~1 min)
# N = GPUs. Each stage has a time limit; the record is rewritten after every implementation, so a stage
# cut short keeps its rows. The transformers options load a checkpoint written once under
# $SERVE_CKPT (default /tmp/moekit-serve-checkpoints: OLMoE 14 GB, Qwen3 61 GB), reused by later stages.
# Records: $OUT/lm-serve-<device>-<N>x/lm-serve-*.json; log: $OUT/lm_serve_log.txt.
# Usage (GPU machine, repo root): bash benchmarks/gpu/lm_serve.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${SERVE_STAGES:-olmoe:2,qwen3:2,olmoe:4,qwen3:4}
CKPT=${SERVE_CKPT:-/tmp/moekit-serve-checkpoints}
LIMIT_OLMOE=${SERVE_LIMIT_OLMOE:-120}
LIMIT_QWEN3=${SERVE_LIMIT_QWEN3:-120}
LIMIT_COMPILED=${SERVE_LIMIT_COMPILED:-150}
COMMON=(--new-tokens 16 --prompt-tokens 64 --prefill-tokens 2048 --prefill-batch 1 --repeats 2
        --checkpoint-dir "$CKPT" --out-dir "$OUT" --timeout 600)
gpus_list() { seq -s, 0 $(($1 - 1)); }
stage() {  # stage NAME GPUS SECONDS ARGS...
  local name=$1 n=$2 limit=$3; shift 3
  echo "== $name on $n GPUs ($(date +%T), limit ${limit}s)"
  CUDA_VISIBLE_DEVICES=$(gpus_list "$n") timeout -k 20 "$limit" \
    python3 -m moekit.cli lm serve-bench --gpus "$n" "${COMMON[@]}" "$@"
  echo "== $name: exit $? ($(date +%T))"
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  python3 -c 'import accelerate; print("accelerate", accelerate.__version__)' 2>/dev/null || echo "accelerate: not installed"
  echo "commit ${MOEKIT_GIT_COMMIT:-unknown}"
  df -h /tmp | tail -1
  IFS=, read -ra todo <<< "$STAGES"
  for s in "${todo[@]}"; do
    n=${s#*:}
    case "$s" in
      olmoe:*) impls=moekit-1gpu,transformers-1gpu,moekit-ep,transformers-tp,transformers-ep,transformers-device-map
               # transformers on one GPU is the same at every N: measured in the first OLMoE stage only.
               [ "$s" != "${todo[0]}" ] && impls=${impls/transformers-1gpu,/}
               stage "$s" "$n" "$LIMIT_OLMOE" --models olmoe-1b-7b --batches 1,16,64,256 --modes eager \
                 --experts fused,fused_fp8 --implementations "$impls" ;;
      qwen3:*) stage "$s" "$n" "$LIMIT_QWEN3" --models qwen3-30b-a3b --batches 64,256 --modes eager \
                 --experts fused,fused_fp8 --prefill-batch 0 \
                 --implementations moekit-ep,moekit-1gpu,transformers-tp,transformers-ep ;;
      tests) echo "== tests ($(date +%T))"; CUDA_VISIBLE_DEVICES=0,1 timeout -k 20 180 python3 -m pytest \
               -p no:cacheprovider -q tests/gpu/test_expert_parallel_lm_gpu.py; echo "== tests: exit $?" ;;
      compiled:*) stage "$s" "$n" "$LIMIT_COMPILED" --models olmoe-1b-7b --batches 64 --modes compiled \
                 --experts fused --prefill-batch 0 --implementations moekit-ep,moekit-1gpu,transformers-tp ;;
      *) echo "unknown stage $s" ;;
    esac
  done
  ls -l "$OUT"/lm-serve-*/ 2>/dev/null
} 2>&1 | tee "$OUT/lm_serve_log.txt"
