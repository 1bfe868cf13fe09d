#!/usr/bin/env bash
# A change to the low-latency GPU transport, checked and measured in one nvidia-h200-x2 call:
# the transport tests on this tree, then ll_probe.py's A/B of an earlier cuda.py against this
# one (same processes, interleaved), then, only if this tree is not slower at T = 128,
# lowlatency.sh all (the API GPU tests and the benchmark). Everything comes back as one
# archive, $OUT/ll-ab-<tag>.tgz (the device tool returns at most 8 files).
# Usage (device machine, repo root):
#   git show <sha>:src/moekit/ep/lowlatency/cuda.py > benchmarks/probes/old_cuda_<sha>.py   # here, untracked
#   bash benchmarks/gpu/ll_ab.sh benchmarks/probes/old_cuda_<sha>.py <tag> [<commit of this tree>]
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OLD=$1; TAG=$2; FINAL=${OUT:-/tmp/out}
export OUT=/tmp/ll-ab-$TAG; mkdir -p "$OUT" "$FINAL"
pack() { tar -czf "$FINAL/ll-ab-$TAG.tgz" -C "$OUT" .; }
timeout 200 python3 -m pytest tests/gpu/test_lowlatency_transport_gpu.py -x -p no:cacheprovider -rs \
  > "$OUT/transport-tests.txt" 2>&1
rc=$?; echo "transport tests rc $rc"; tail -3 "$OUT/transport-tests.txt"
[[ $rc == 0 ]] || { pack; exit 1; }
timeout 240 python3 benchmarks/probes/ll_probe.py --old "$OLD" --parts layer phases --variants old split-d8-c4 \
  --tokens 1 8 128 256 --rounds 3 --out "$OUT/probe.json" > "$OUT/probe.txt" 2>&1
echo "probe rc $?"; grep -E "^layer|^phases" "$OUT/probe.txt"
if python3 - "$OUT/probe.json" <<'PY'; then
import json, sys
r = json.load(open(sys.argv[1]))["ranks"][0]["layer"]
old, new = r["old"]["128"]["total"], r["split-d8-c4"]["128"]["total"]
print("T=128 total: old", round(old, 1), "this tree", round(new, 1))
sys.exit(0 if new <= old else 1)
PY
  MOEKIT_GIT_COMMIT=${3:-} bash benchmarks/gpu/lowlatency.sh all > /dev/null 2>&1
  tail -32 "$OUT/log-all.txt"
else
  echo "this tree is not faster at T = 128: no benchmark run"
fi
pack
