#!/usr/bin/env bash
# One device call on one H100/H200 (about 9 minutes): transformers models on moekit.
#   1. GPU tests of the transformers integration (fused bf16, fused_fp8) on tiny random models;
#   2. `moekit lm train`: the OLMoE-architecture MoE LM on the standard library's source
#      (LM_MINUTES of training steps, default 4), progress printed;
#   3. `moekit trace record`: prefill and decode routing traces on held-out text, through moekit;
#   4. `moekit trace stats` / `trace report` on both traces (P = 8);
#   5. `moekit lm bench`: generation on moekit (fused, fused_fp8) vs transformers' experts,
#      batch 1 / 16 / 64: tokens/s, the MoE blocks' share of the time, token agreement.
# Everything that comes back is under $OUT (at most 8 files): log.txt, train.json, the two
# traces, trace_report.txt, the lm-e2e JSON record and summary.json. The model (hundreds of MB)
# stays in $MODEL_DIR on the machine.
# Usage (device machine, repo root): MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/lm.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL_DIR=${MODEL_DIR:-/tmp/moekit-lm}
LM_MINUTES=${LM_MINUTES:-4}
LM_PRESET=${LM_PRESET:-default}          # tiny: a CPU smoke run of this script's flow
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
TRACE="$OUT/olmoe-stdlib.npz"
moekit() { python3 -m moekit.cli "$@"; }
declare -A rc
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, remember the exit code
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@"; rc[$name]=$?
  echo "== $name: exit ${rc[$name]}"
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, triton, transformers, tokenizers, safetensors; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "tokenizers", tokenizers.__version__, "safetensors", safetensors.__version__)'
  stage gpu-tests 100 python3 -m pytest tests/gpu/test_hf_integration_gpu.py -p no:cacheprovider -q -s
  stage train $((LM_MINUTES * 60 + 60)) python3 -m moekit.cli lm train --preset "$LM_PRESET" --minutes "$LM_MINUTES" --out "$MODEL_DIR"
  cp "$MODEL_DIR/train.json" "$OUT/train.json" 2>/dev/null
  stage record 60 python3 -m moekit.cli trace record --model "$MODEL_DIR" --prompts "$MODEL_DIR/heldout_prompts.jsonl" \
    --out "$TRACE" --batch-size 8 --prompt-tokens "$PROMPT_TOKENS" --decode-steps 32 --world-size 8 --name olmoe-stdlib
  {
    for f in "$TRACE" "${TRACE%.npz}.decode.npz"; do
      echo "######## moekit trace stats $(basename "$f") --world-size 8"
      python3 -m moekit.cli trace stats "$f" --world-size 8
      echo
      echo "######## moekit trace report $(basename "$f") --world-size 8"
      python3 -m moekit.cli trace report "$f" --world-size 8
      echo
    done
  } > "$OUT/trace_report.txt" 2>&1
  cat "$OUT/trace_report.txt"
  stage bench 110 python3 -m moekit.cli lm bench --model "$MODEL_DIR" --batches 1,16,64 --new-tokens 32 --prompt-tokens 64 \
    --repeats 3 --implementations transformers,fused,fused_fp8 --out-dir "$OUT"
  python3 - "$OUT" "${rc[gpu-tests]:-x}" "${rc[train]:-x}" "${rc[record]:-x}" "${rc[bench]:-x}" <<'EOF'
import json, sys
from pathlib import Path
from moekit.bench.report import environment
out = Path(sys.argv[1])
train = json.loads((out / "train.json").read_text()) if (out / "train.json").exists() else {}
summary = dict(environment=environment(),
               exit_codes=dict(zip(["gpu_tests", "train", "record", "bench"], sys.argv[2:])),
               held_out_loss=train.get("held_out_loss"), held_out_loss_initial=train.get("held_out_loss_initial"),
               train_steps=train.get("steps"), train_seconds=train.get("train_seconds"),
               files=sorted(p.name for p in out.iterdir()))
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
EOF
} 2>&1 | tee "$OUT/log.txt"
