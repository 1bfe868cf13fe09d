#!/usr/bin/env bash
# transformers MoE models on moekit on one GPU, end to end: the local path's GPU tests, one MoE
# block's experts call on both sides (`moekit bench experts`), and generation eager and compiled
# (`moekit lm bench --preset ...`) against transformers' own experts.
# Stages (LM_E2E_STAGES, comma-separated; default all): tests, kernel-tests (the kernels' GPU tests),
# probe (benchmarks/probes/host_path_probe.py), experts, and one lm:PRESET per model
# (lm:olmoe-1b-7b, lm:qwen3-30b-a3b, lm:mixtral-8x7b, lm:trained = a small LM trained here first).
# Everything lands under $OUT: log.txt and the JSON records.
# Usage (GPU machine, repo root): LM_E2E_STAGES=tests,experts bash benchmarks/gpu/lm_e2e.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${LM_E2E_STAGES:-tests,experts,lm:olmoe-1b-7b,lm:qwen3-30b-a3b,lm:mixtral-8x7b}
LAYERS=${LM_LAYERS:-4}
BATCHES=${LM_BATCHES:-1,16,64,256}
IMPLS=${LM_IMPLEMENTATIONS:-transformers,fused,fused_fp8}
MODES=${LM_MODES:-eager,compiled}
REPEATS=${LM_REPEATS:-3}
EXPERTS_PRESETS=${EXPERTS_PRESETS:-olmoe-1b-7b,qwen3-30b-a3b,mixtral-8x7b}
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@"; echo "== $name: exit $?"
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  echo "commit ${MOEKIT_GIT_COMMIT:-unknown}"
  IFS=, read -ra todo <<< "$STAGES"
  for s in "${todo[@]}"; do
    case "$s" in
      tests) stage gpu-tests 240 python3 -m pytest -p no:cacheprovider -q -s tests/gpu/test_local_path_gpu.py \
               tests/gpu/test_hf_integration_gpu.py tests/gpu/test_bound_launch_gpu.py ;;
      kernel-tests) stage kernel-tests 300 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_fused_moe_gpu.py \
               tests/gpu/test_fused_moe_fp8_gpu.py tests/gpu/test_align_gpu.py tests/gpu/test_pdl_gpu.py \
               tests/gpu/test_ramp_gpu.py ;;
      probe) stage host-path-probe 240 python3 benchmarks/probes/host_path_probe.py ${PROBE_PARTS:-1 2} ;;
      experts) stage experts 240 python3 -m moekit.bench.experts_call --presets "$EXPERTS_PRESETS" --out-dir "$OUT" ;;
      lm:trained)
        stage train 150 python3 -m moekit.cli lm train --preset default --minutes 1 --out /tmp/moekit-lm
        stage lm-trained 400 python3 -m moekit.cli lm bench --model /tmp/moekit-lm --batches "$BATCHES" \
          --implementations "$IMPLS" --modes "$MODES" --repeats "$REPEATS" --out-dir "$OUT" ;;
      lm:*) stage "lm-${s#lm:}" 540 python3 -m moekit.cli lm bench --preset "${s#lm:}" --layers "$LAYERS" \
              --batches "$BATCHES" --implementations "$IMPLS" --modes "$MODES" --repeats "$REPEATS" --out-dir "$OUT" ;;
      *) echo "unknown stage $s" ;;
    esac
  done
} 2>&1 | tee "$OUT/log.txt"
