"""Developer probe: where the fixed ~11 µs of a decode call goes (one GPU).

At M <= 16 with 8 small experts touched, every best config of the dataset takes about 11 µs
more than the touched weights need at the measured HBM rate, whatever the shape (qwen3,
olmoe, deepseek-v3-tp8: 75-100 MB) and even at 264 MB (deepseek-v3-ep32, M = 1). This probe
times, as the bench does (CUDA-graph replay, L2 flushed before each, median):

* ``tiny``: a graph of one 1-CTA kernel (what the harness itself costs), and ``memset+tiny``;
* ``stream``: a Triton kernel that only reads the touched bytes (one contiguous buffer of the
  same size) with the persistent kernel's grid and with one CTA per 16 KB block: what
  streaming these bytes costs from a cold L2, start and tail included;
* for each point's config: the whole call, the persistent kernel with only phase 1 (GEMM1)
  and with only phase 2 (the decode GEMM2, on whatever the intermediate holds), and the
  profiler's kernel times of the eager call.

Usage (device machine, repo root):
    PYTHONPATH=src python3 benchmarks/gpu/decode_overhead.py --out $OUT/decode-overhead.json
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import torch
import triton
import triton.language as tl
from decode_probe import kernel_breakdown
from probe_common import ceilings_and_flusher, expert_weights, median_us, write_result

from moekit.bench.kernel import bench_shape, point_routing, point_work
from moekit.kernels import KernelConfig, fused_moe

fm_module = importlib.import_module("moekit.kernels.fused_moe")

# (shape, M, beta, config) at the hardest points: the dataset's best config at 5f2bd78.
POINTS = (
    ("qwen3-30b-a3b", 16, 0.25, KernelConfig(bm=16, bn=32, bk=256, num_warps=4, num_stages=3)),
    ("qwen3-30b-a3b", 1, 0.25, KernelConfig(form="fused", bm=16, bn=64, bk=128, num_warps=4, num_stages=4)),
    ("olmoe-1b-7b", 16, 0.25, KernelConfig(bm=16, bn=32, bk=128, num_warps=4, num_stages=4)),
    ("deepseek-v3-tp8", 16, 0.25, KernelConfig(bm=16, bn=32, bk=256, num_warps=4, num_stages=3)),
    ("deepseek-v3-ep32", 1, 0.25, KernelConfig(bm=16, bn=32, bk=256, num_warps=4, num_stages=3)),
)

@triton.jit
def _tiny_kernel(out_ptr):
    tl.store(out_ptr, 1.0)


@triton.jit
def _stream_kernel(src_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    """Each program sums blocks pid, pid + grid, ... of ``src`` (so every byte is read once)."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for b in range(pid, tl.cdiv(numel, BLOCK), grid):
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


class _OnePhase:
    """Stands in for ``_persistent_decode_kernel``: launches it with PHASES = ``phases`` (and
    without the cooperative barrier where only one phase runs)."""

    def __init__(self, kernel, phases: int):
        self.kernel, self.phases = kernel, phases

    def warmup(self, *args, **kwargs):
        return self.kernel.warmup(*args, **kwargs)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kwargs["PHASES"] = self.phases
            return self.kernel[grid](*args, **kwargs)
        return launch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="decode-overhead.json")
    args = p.parse_args()
    t0 = time.perf_counter()
    dev = torch.device("cuda", 0)
    ceil, flusher = ceilings_and_flusher(dev)
    hbm = ceil["hbm_gbps"]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    one = torch.empty(max(4 * sms, 1 << 16), dtype=torch.float32, device=dev)
    sync = torch.empty(300, dtype=torch.int32, device=dev)
    harness = {
        "tiny": median_us(lambda: _tiny_kernel[(1,)](one), flusher, args.iters),
        "memset+tiny": median_us(lambda: (sync.zero_(), _tiny_kernel[(1,)](one)), flusher, args.iters),
    }
    print("harness:", {k: round(v, 2) for k, v in harness.items()}, flush=True)
    rows = []
    real = fm_module._persistent_decode_kernel
    for name, M, beta, cfg in POINTS:
        s = bench_shape(name)
        w13, w2 = expert_weights(s, dev)
        r = point_routing(s, M, beta, 1000 + M)
        work = point_work(s, r.ids, 2)
        x = torch.randn(M, s.hidden, device=dev, dtype=torch.bfloat16)
        ids, tw = r.ids.to(dev), r.weights.to(dev)
        roof = work["bytes"] / hbm / 1e3
        row = {"shape": name, "M": M, "beta": beta, "config": str(cfg), **work, "roofline_us": roof, "us": {}}
        call = lambda: fused_moe(x, w13, w2, ids, tw, cfg)  # noqa: E731
        row["us"]["call"] = median_us(call, flusher, args.iters)
        if cfg.form == "two_launch":
            for phases in (1, 2):
                fm_module._persistent_decode_kernel = _OnePhase(real, phases)
                try:
                    row["us"][f"phase{phases}"] = median_us(call, flusher, args.iters)
                finally:
                    fm_module._persistent_decode_kernel = real
        numel = work["bytes"] // 2
        src = torch.randn(numel, device=dev, dtype=torch.bfloat16)
        grid = max(fm_module._RESIDENT_GRIDS.values(), default=2 * sms)  # the persistent kernel's
        for block, g in ((8192, grid), (8192, triton.cdiv(numel, 8192)), (4096, grid)):
            key = f"stream-b{block}-g{g}"
            row["us"][key] = median_us(lambda: _stream_kernel[(g,)](src, one, numel, BLOCK=block, num_warps=4),
                                       flusher, args.iters)
        row["kernels"] = kernel_breakdown(call, flusher)
        src = w13 = w2 = None  # (freed before the next shape)
        torch.cuda.empty_cache()
        rows.append(row)
        print(f"{name:16s} M={M:3d} b={beta:4.2f} {str(cfg)[:60]}\n    roofline {roof:6.1f} us; "
              + ", ".join(f"{k} {v:.1f}" for k, v in row["us"].items())
              + "\n    kernels: " + ", ".join(f"{k.split('(')[0][:32]} {v:.1f}" for k, v in row["kernels"].items()),
              flush=True)
    write_result(args.out, {**ceil, "harness_us": harness}, rows, [], t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
