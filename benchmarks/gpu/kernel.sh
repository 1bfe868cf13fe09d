#!/usr/bin/env bash
# `moekit bench kernel` on nvidia-h200 (one GPU), split over device calls of <= 10 minutes.
#
# Usage (device machine, repo root):
#   MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/kernel.sh PART [extra bench options]
# PART (one shape or a slice of one per call; each part prints its real rate). With the
# 317-config space (51b074d) one call holds: olmoe + qwen3 up to qwen3's M = 256 (521 s);
# qwen3 M = 1024, 4096 plus part 3 (~500 s); deepseek-v3-ep32 M <= 1024 (273 s); part 5
# (440 s); deepseek-v3-ep32 M = 4096 (142 s); mixtral's M = 4096 needs two calls
# (--config-stride 2 --config-offset 0|1). See docs/kernel.md.
#   1      olmoe-1b-7b
#   2      qwen3-30b-a3b
#   3      deepseek-v3-tp8
#   4      deepseek-v3-ep32
#   5      mixtral-8x7b, M <= 1024
#   6      mixtral-8x7b, M = 4096
#   custom only the extra options (e.g. `custom --models deepseek-v3-ep32 --m 4096`)
# The GPU tests of the kernels and of this bench are benchmarks/gpu/kernel_tests.sh.
# Each part stops starting new (shape, M) groups at --deadline-s (default 540 s after the
# bench starts) and writes what it measured; the groups it skipped are listed as NOT
# MEASURED at the end of the log: rerun those with `custom`. Afterwards, on any machine:
#   python3 -m moekit.bench.kernel --merge part*/kernel-*-table.json.gz --out-dir benchmarks/results/kernel-nvidia-h200
# Files under $OUT (at most 6): log.txt, the summary JSON, the -table.json.gz, two PNGs.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
part=${1:-1}; shift || true
deadline=${KERNEL_DEADLINE_S:-540}
case "$part" in
  1) args=(--models olmoe-1b-7b) ;;
  2) args=(--models qwen3-30b-a3b) ;;
  3) args=(--models deepseek-v3-tp8) ;;
  4) args=(--models deepseek-v3-ep32) ;;
  5) args=(--models mixtral-8x7b --m 1 4 16 64 256 1024) ;;
  6) args=(--models mixtral-8x7b --m 4096) ;;
  custom) args=() ;;
  *) echo "unknown part $part (1-6 or custom)"; exit 2 ;;
esac
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "sm", torch.cuda.get_device_capability())'
  echo "== moekit bench kernel, part $part"
  python3 -m moekit.cli bench kernel "${args[@]}" --deadline-s "$deadline" --out-dir "$OUT" "$@"
} 2>&1 | tee "$OUT/log.txt"
