#!/usr/bin/env bash
# One device call (nvidia-h200, ~8 minutes): the decode-schedule GPU tests, then the decode
# probe comparing the persistent decode kernel with the two-kernel schedule (same process).
# Usage (device machine, repo root): MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/persistent_check.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD/benchmarks/gpu${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
commit=${MOEKIT_GIT_COMMIT:-unknown}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${TEST_TIMEOUT_S:-200}" python3 -m pytest -q -rf -p no:cacheprovider --tb=short tests/gpu/test_fused_moe_gpu.py tests/gpu/test_fused_moe_fp8_gpu.py \
  -k "decode or graph" > "$OUT/decode-tests-$commit.txt" 2>&1
echo "tests rc=$?: $(tail -n 1 "$OUT/decode-tests-$commit.txt")"
timeout "${PROBE_TIMEOUT_S:-340}" python3 benchmarks/gpu/decode_probe.py --two-kernel ${PROBE_ARGS:-} \
  --out "$OUT/decode-probe-$commit.json" > "$OUT/decode-probe-$commit.txt" 2>&1
echo "probe rc=$?"
grep -E "^[a-z]|two-kernel|kernels of" "$OUT/decode-probe-$commit.txt" | head -80
