#!/usr/bin/env bash
# One device call on one GPU (whichever comes: H100 or H200): calibrate the MoE-tax model on this
# GPU (`moekit tax calibrate`), then the measured check of every preset MoE shape (qwen3-30b-a3b,
# olmoe-1b-7b, deepseek-v3 TP8 shard, mixtral-8x7b, qwen2-moe; uniform and beta = 0.8 routing;
# m = 1..4096) against the calibrated model and the 100 %-peak model side by side.
#
# Expected: ~5 min on an H200, a little more on an H100 (calibration ~1.5-2 min, of which ~30 s
# filling Triton's cache; the check ~3 min, of which ~40 s filling the cache; see docs/tax.md).
# Hard limit: TAX_BUDGET_S (default 560 s = 9 min 20 s) for everything. Every stage has its own
# limit and the measure writes its record after each model, so what finished always comes back.
#
# Writes under $OUT (5 files):
#   log.txt           everything printed, with a progress line per timed point
#   env.txt           GPU, driver, torch / Triton versions
#   calibration.json  the calibration file (a copy of the one in the tarball)
#   summary.md        per shape: tau measured vs calibrated vs 100 %-peak per point, and the table
#                     "largest error per shape and GPU" for both models
#   results.tar.gz    calibration/ (the calibration file) and measure/ (the tax-measure record,
#                     its -tau.png and -hardware.json)
# Usage (device machine, repo root): bash benchmarks/gpu/tax_calibrate.sh
#   TAX_MEASURE_ARGS="--iters 50" adds options to the check (see `moekit tax --help`).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
mkdir -p "$WORK/calibration" "$WORK/measure"
BUDGET=${TAX_BUDGET_S:-560}
CALIBRATE_LIMIT=${TAX_CALIBRATE_LIMIT_S:-200}
SUMMARY_RESERVE=40   # seconds kept for the summary and the tarball
start=$SECONDS
left() { echo $(( BUDGET - (SECONDS - start) )); }
# RaMP model files of this GPU (shipped in src/moekit/ramp/models/, or MOEKIT_RAMP_MODELS) price the expert kernel.

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  python3 -c 'import torch, triton; p = torch.cuda.get_device_properties(0); print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "|", p.name, f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs, L2", getattr(p, "L2_cache_size", "?"))' 2>&1
  git rev-parse --short HEAD 2>/dev/null || echo "commit: ${MOEKIT_GIT_COMMIT:-unknown}"
} > "$OUT/env.txt"

{
  cat "$OUT/env.txt"
  echo "== 1/3 moekit tax calibrate (limit ${CALIBRATE_LIMIT} s; the expert-kernel stage stops at $((CALIBRATE_LIMIT - 45)) s)"
  timeout -k 10 "$CALIBRATE_LIMIT" python3 -m moekit.cli tax calibrate --out-dir "$WORK/calibration" \
    --deadline $((CALIBRATE_LIMIT - 45))
  echo "rc=$? after $((SECONDS - start)) s"
  CAL=$(ls -t "$WORK"/calibration/tax-calibration-*.json 2>/dev/null | head -1)
  if [ -n "$CAL" ]; then cp "$CAL" "$OUT/calibration.json"; else echo "no calibration file: the check runs without it"; fi

  limit=$(( $(left) - SUMMARY_RESERVE ))
  # No further model is begun once less than ~100 s (the longest model on an H100) are left.
  deadline=$(( limit - 100 ))
  echo "== 2/3 moekit tax --measure --model all --beta 0.8 (limit ${limit} s; no model begun after ${deadline} s)"
  if [ "$deadline" -gt 30 ]; then
    timeout -k 10 "$limit" python3 -m moekit.cli tax --measure --model all --beta 0.8 \
      ${CAL:+--hardware-file "$CAL"} --deadline "$deadline" --out-dir "$WORK/measure" ${TAX_MEASURE_ARGS:-}
    echo "rc=$? after $((SECONDS - start)) s"
  else
    echo "not enough time left for the check"
  fi

  echo "== 3/3 summary (calibrated vs 100 %-peak per point, largest error per shape)"
  timeout -k 5 30 python3 - "$WORK/measure" > "$OUT/summary.md" <<'EOF'
import glob, sys
from moekit.bench.report import load_record
from moekit.bench.tax_report import error_table, format_measure
files = sorted(f for f in glob.glob(sys.argv[1] + "/tax-measure-*.json") if not f.endswith("-hardware.json"))
records = [load_record(f, kind="tax-measure") for f in files]
for f, r in zip(files, records):
    print(f"## {f.split('/')[-1]}\n\n```text\n{format_measure(r)}\n```\n")
print("## Largest error per shape and GPU\n")
print(error_table(records) if records else "no record")
EOF
  echo "rc=$? after $((SECONDS - start)) s"
  cat "$OUT/summary.md" | tail -12
} 2>&1 | tee "$OUT/log.txt"

tar czf "$OUT/results.tar.gz" -C "$WORK" calibration measure
echo "wrote $(ls "$OUT" | tr '\n' ' ') in $((SECONDS - start)) s" | tee -a "$OUT/log.txt"
