#!/usr/bin/env bash
# RaMP on one GPU (nvidia-h200 or nvidia-h100-x1): profile ONE shape, fit its model, evaluate it
# on held-out points, in one device call of <= 9 minutes.
#
# Usage (device machine, repo root):
#   MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/ramp.sh [SHAPE] [DTYPE] [FAMILY] [extra bench options]
#     SHAPE   qwen3-30b-a3b (default) | olmoe-1b-7b | deepseek-v3-tp8 | deepseek-v3-ep32 | mixtral-8x7b
#     DTYPE   bf16 (default) | fp8
#     FAMILY  token (default: fused_moe after a router) | expert_major (after a dispatcher)
#   e.g.  bash benchmarks/gpu/ramp.sh qwen3-30b-a3b bf16 token
#         bash benchmarks/gpu/ramp.sh qwen3-30b-a3b fp8
#         bash benchmarks/gpu/ramp.sh qwen3-30b-a3b bf16 expert_major --no-graph
#   One shape per call: the others resume in later calls (each writes its own model file).
#
# What it runs: `moekit bench ramp --profile` = (1) `moekit ramp profile`: every config of the
# space at 5 token counts x 5 balancedness levels (25 points), fit, model file; (2) in the same
# process (the kernels stay compiled and loaded), every config again at the held-out points
# (7 token counts x 5 betas + Zipf) for exhaustive search, the routing-aware / static /
# default / fallback choices, the selector's cost, the CUDA-graph path, the fallback on a shape
# outside the presets (large experts, Mixtral-8x22B-like, at M = 16 and 128). More fallback
# shapes: append `--fallback-shape E,K,H,N ... --fallback-m ...` (~45 s each).
#
# Time (qwen3-30b-a3b bf16, 317 configs, estimated from the 51b074d dataset's logs on an H200:
# compile ~70 s with 16 workers, loading the binaries ~60 s, profile groups ~120 s, evaluation
# ~100-130 s with 10 timed replays, graph ~30 s, selector ~5 s, fallback shape ~45 s): ~450 s.
# Deadlines keep it under the 9 minutes: the profile stops starting token counts at
# RAMP_PROFILE_DEADLINE_S (300 s), the evaluation's timing at RAMP_DEADLINE_S (470 s) minus the
# time its later sections need (~95 s), and those sections are skipped if even that is gone;
# what was measured is written, skipped groups are listed. Mixtral's M = 2048 profile group is the longest (~60 s): if a shape does not fit,
# rerun with `--iters 6` or split the space (`--config-stride 2`, offsets in two calls).
#
# Files under $OUT (at most 8): log.txt, the model file (<gpu>-<dtype>-<family>-E..-K..-H..-N...json:
# copy it to src/moekit/ramp/models/), the profile record and timings, the evaluation record
# (.json, .txt report, .png figure) and timings. Afterwards, offline:
#   moekit bench ramp --from-timings eval-...-timings.json.gz --profile-timings profile-...-timings.json.gz \
#       --model <model file> --out-dir benchmarks/results/ramp-<gpu>-<shape>
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
shape=${1:-qwen3-30b-a3b}; shift || true
dtype=${1:-bf16}; shift || true
family=${1:-token}; shift || true
profile_deadline=${RAMP_PROFILE_DEADLINE_S:-300}
deadline=${RAMP_DEADLINE_S:-470}
fallback=()
if [ "$family" = token ]; then
  # Large-expert shapes outside the presets (where default_config is weakest at M = 128).
  fallback=(--fallback-shape 8,2,6144,16384 --fallback-m 16 128)
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "sm", torch.cuda.get_device_capability())'
  echo "== RaMP: $shape $dtype $family (profile + evaluation)"
  python3 -m moekit.cli bench ramp --shape "$shape" --dtype "$dtype" --family "$family" --profile \
      --profile-deadline-s "$profile_deadline" --deadline-s "$deadline" --out-dir "$OUT" "${fallback[@]}" "$@"
} 2>&1 | tee "$OUT/log.txt"
