#!/usr/bin/env bash
# RaMP on one GPU (nvidia-h200 or nvidia-h100-x1), one shape in two device calls of <= 9.5 minutes:
# the profile in the first, the held-out evaluation in the second. Each stage resumes.
#
# Usage (device machine, repo root):
#   MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/ramp.sh profile [SHAPE] [DTYPE] [FAMILY]
#   MOEKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/ramp.sh eval    [SHAPE] [DTYPE] [FAMILY] [extra bench options]
#     SHAPE   qwen3-30b-a3b (default) | olmoe-1b-7b | deepseek-v3-tp8 | deepseek-v3-ep32 | mixtral-8x7b
#     DTYPE   bf16 (default) | fp8
#     FAMILY  token (default: fused_moe after a router) | expert_major (after a dispatcher)
#
# Between the calls: the state is build/ramp/ (git-ignored; it stays on a machine that is still
# warm). The machine goes back 30 s after a call, so carry it: copy the profile call's files
# (the model file and profile-*-timings.json.gz, also in $OUT) into build/ramp/ here and run
# the next call with carry=["build/ramp"]. A profile call that hit its deadline is run again
# the same way: it keeps the token counts it completed (moekit ramp profile --resume) and times
# the rest. The eval call refuses a profile that is not complete. RAMP_WORK moves the state
# folder; RAMP_GPU (h100 | h200) overrides the GPU key read from the device.
#
# Time, from this project's H100 run (qwen3-30b-a3b bf16, 317 configs, 10 timed replays; the
# 51b074d H200 dataset's logs agree within ~20 %):
#   profile call: compile 84 s (16 processes) + M=1 87 s (the group that loads all 317 binaries
#     into the timing process) + M=16 22 s + M=64 39 s + M=256 24 s + M=2048 ~30 s (M=1024
#     measured 51 configs in 3.2 s; a call is ~1.2 ms at 2048) + fit and files ~10 s
#     = ~300 s. Deadline RAMP_PROFILE_DEADLINE_S = 480 s: no new config starts after it, so
#     the call ends by ~490 s + Python's start, under 9.5 minutes with room for the slower
#     shapes (mixtral-8x7b's M = 2048 group about twice qwen3's). What it did not reach, the
#     next profile call times (--resume).
#   FP8 (qwen3-30b-a3b, 186 configs): compile 64-92 s, and the first token count timed in a call
#     98-142 s (first launches of the FP8 binaries), M = 64 another 87 s: ~400 s in all. Give it
#     the default deadline in one call: a resumed call pays compile and loading again.
#   With --shortlist FILE --shortlist-factor 1.1 (extra options go to the profile): deepseek-v3-tp8
#     149 of 317 configs in 254 s, mixtral-8x7b 180 in 362 s, deepseek-v3-ep32 234 in 240 s.
#   FP8 of the other presets from the qwen3 and olmoe FP8 profiles (99 of 186 configs, ~250 s):
#     --shortlist benchmarks/results/ramp-nvidia-h100/qwen3-30b-a3b-fp8/profile-*-timings.json.gz
#     --shortlist benchmarks/results/ramp-nvidia-h100/olmoe-1b-7b-fp8/profile-*-timings.json.gz --shortlist-any-shape
#   eval call (a fresh machine compiles again): compile ~85 s + loading ~65 s + 5 token counts
#     x 6 routings (4, 32, 128, 512, 4096; betas 1.0 .. 0.45 + Zipf 1.2; olmoe-1b-7b adds 10
#     recorded calls of benchmarks/traces/, about a third more timing) ~150 s + the selector
#     10 s + the CUDA-graph section 40 s + one fallback shape 45 s = ~400 s; deadline
#     RAMP_DEADLINE_S = 520 s (its timing stops early enough for the later sections, which are
#     skipped, and listed, when even that is gone). The profiled token counts 16 and 256 at new
#     betas are left out of the GPU evaluation: leaving one beta out of the profile
#     (`moekit ramp fit --held-out`, CPU) measures that.
#
# Files under $OUT: profile: log-profile.txt, the model file (<gpu>-<dtype>-<family>-E..-K..-H..-N...json),
# profile-...-timings.json.gz, the profile record; eval: log-eval.txt, the evaluation record
# (.json, .txt report, .png figure), eval-...-timings.json.gz. Afterwards, offline:
#   moekit ramp fit PROFILE-TIMINGS --gpu h100|h200 --held-out --report heldout.json
#   moekit bench ramp --from-timings EVAL-TIMINGS --profile-timings PROFILE-TIMINGS --model MODEL --out-dir ...
# A model file is shipped (src/moekit/ramp/models/) only from a complete profile.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/build/triton-cache}  # kept while the machine is warm
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=${RAMP_WORK:-$PWD/build/ramp}; mkdir -p "$WORK"
stage=${1:-}; shift || true
shape=${1:-qwen3-30b-a3b}; shift || true
dtype=${1:-bf16}; shift || true
family=${1:-token}; shift || true
case "$stage" in profile|eval) ;; *) echo "usage: ramp.sh profile|eval [SHAPE] [DTYPE] [FAMILY] [options]" >&2; exit 2;; esac
dt=$([ "$dtype" = fp8 ] && echo float8_e4m3fn || echo bfloat16)
gpu=${RAMP_GPU:-$(python3 -c 'import torch; from moekit.ramp.regions import hardware_for; print(hardware_for().key)')}
timings="$WORK/profile-$gpu-$shape-$dt-$family-timings.json.gz"
model="$WORK/$(python3 -c 'import sys; from moekit.ramp.modelfile import model_filename; from moekit.bench.ramp_profile import resolve_shape
print(model_filename(sys.argv[1], resolve_shape(sys.argv[2])[0], sys.argv[3], sys.argv[4]))' "$gpu" "$shape" "$dt" "$family")"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "sm", torch.cuda.get_device_capability())'
  echo "== RaMP $stage: $shape $dtype $family on $gpu (state: $WORK)"
  if [ "$stage" = profile ]; then
    resume=()
    [ -f "$timings" ] && resume=(--resume "$timings")
    python3 -m moekit.cli ramp profile --shape "$shape" --dtype "$dtype" --family "$family" \
        --deadline-s "${RAMP_PROFILE_DEADLINE_S:-480}" --out-dir "$OUT" "${resume[@]}" "$@" || exit 1
    cp "$OUT/$(basename "$timings")" "$OUT/$(basename "$model")" "$WORK"/
  else
    if [ ! -f "$model" ] || [ ! -f "$timings" ]; then
      echo "ramp.sh eval: no profile of $shape $dtype $family on $gpu in $WORK: run the profile stage first (carry build/ramp)" >&2
      exit 1
    fi
    missing=$(python3 -c 'import sys; from moekit.bench.ramp_profile import complete_token_counts, load_timings
t, meta = load_timings(sys.argv[1]); done = set(complete_token_counts(t, meta))
print(" ".join(str(m) for m in sorted({p.M for p in t.points} - done)))' "$timings") || exit 1
    if [ -n "$missing" ]; then
      echo "ramp.sh eval: the profile is not complete (token counts $missing): run the profile stage again, it resumes" >&2
      exit 1
    fi
    fallback=()
    # Large-expert shapes outside the presets (where default_config is weakest at M = 128).
    [ "$family" = token ] && fallback=(--fallback-shape 8,2,6144,16384 --fallback-m 16 128)
    # Recorded routing (the OLMoE-architecture LM's prefill and decode traces: top-8 of 64 experts).
    traces=()
    [ "$shape" = olmoe-1b-7b ] && traces=(--trace benchmarks/traces/olmoe-stdlib.npz benchmarks/traces/olmoe-stdlib.decode.npz)
    python3 -m moekit.cli bench ramp --shape "$shape" --dtype "$dtype" --family "$family" --model "$model" \
        --profile-timings "$timings" --eval-m 4 32 128 512 4096 --deadline-s "${RAMP_DEADLINE_S:-520}" \
        --out-dir "$OUT" "${fallback[@]}" "${traces[@]}" "$@"
  fi
} 2>&1 | tee "$OUT/log-$stage.txt"
exit "${PIPESTATUS[0]}"
