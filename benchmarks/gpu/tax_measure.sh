#!/usr/bin/env bash
# One device call on nvidia-h200 (a single GPU): the MoE-tax model's measured
# check. Times the MoE FFN block (router + fused Triton experts + shared experts), DenseFA
# and DensePA at m = 1..4096 for mixtral-8x7b and qwen2-moe, uniform routing and beta = 0.8,
# with the HBM-copy and 8192^3-matmul ceilings measured in the same run, and writes
# $OUT/results/tax-measure-*.json, its -tau.png and -hardware.json, and $OUT/log.txt (4 files).
# Expected: ~3-4 minutes on an H200 (about 2 of them Triton compiles); the run prints its
# own estimate first and one progress line per block and batch size.
# Usage (device machine, repo root): MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/tax_measure.sh
#   TAX_MEASURE_ARGS="--configs 10" adds options (see `moekit tax --help`).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
{
  python3 -c 'import torch, triton; p = torch.cuda.get_device_properties(0); print("torch", torch.__version__, "triton", triton.__version__, "|", p.name, f"{p.total_memory / 2**30:.0f} GiB", "L2", getattr(p, "L2_cache_size", "?"))'
  start=$SECONDS
  echo "== pipeline test (tests/bench/test_tax_measure.py, tiny shapes on this GPU)"
  python3 -m pytest tests/bench/test_tax_measure.py -p no:cacheprovider -x
  echo "== moekit tax --measure (mixtral-8x7b, qwen2-moe)"
  python3 -m moekit.cli tax --measure --model mixtral-8x7b,qwen2-moe --beta 0.8 \
    --out-dir "$OUT/results" ${TAX_MEASURE_ARGS:-}
  echo "rc=$? after $((SECONDS - start)) s"
} 2>&1 | tee "$OUT/log.txt"
