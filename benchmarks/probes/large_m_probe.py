"""Developer probe of the fused MoE kernel at large M (one GPU; not the dataset).

At M = 4096 the best configs run two GEMMs of bm = 128 tiles (``two_launch``); the dataset's
one point below the torch baseline is mixtral-8x7b M = 4096 beta = 1 (best 0.985x). This
probe times, interleaved in one process (A B C ... per round, so clock drift cancels):

* the whole call of a few large-tile configs with this tree's ``fused_moe``, each also with
  GEMM2's tile widened (``bn2``);
* the ``torch._grouped_mm`` baseline the bench compares with;

then the per-kernel GPU time of each variant from the CUDA profiler (GEMM1, GEMM2, the
alignment, zeroing and cast), and the relative error of every variant against the baseline.
Timing as the bench: CUDA-graph replay, L2 flushed before each replay, median of --iters,
then the median over --rounds.

To tell a code change from machine variation, run it once per checkout in one device call.

Usage (device machine, repo root):
    PYTHONPATH=src:benchmarks/probes python3 benchmarks/probes/large_m_probe.py --out $OUT/large-m.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import torch
from probe_common import ceilings_and_flusher, expert_weights, median_us, write_result

from moekit.bench.kernel import bench_shape, config_id, point_routing, point_work
from moekit.bench.kernel_baseline import make_torch_moe
from moekit.kernels import KernelConfig, fused_moe

BASES = (
    KernelConfig(bm=128, bn=128, bk=64, num_warps=8, num_stages=4, group_m=8, form="two_launch"),
    KernelConfig(bm=128, bn=128, bk=64, num_warps=8, num_stages=3, group_m=8, form="two_launch"),
)
POINTS = (("mixtral-8x7b", 4096, 1.0), ("mixtral-8x7b", 4096, 0.25), ("qwen3-30b-a3b", 4096, 1.0))


def kernel_times(fn, calls: int = 5) -> dict[str, float]:
    """Mean µs per call of each CUDA kernel ``fn`` launches (profiler), by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "device_time_total", 0) > 0:
            total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if total > 0:
                out[e.key[:80]] = total / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bn2", type=int, nargs="+", default=[256])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="large-m.json")
    args = p.parse_args()
    t0 = time.perf_counter()
    dev = torch.device("cuda", 0)
    ceilings, flusher = ceilings_and_flusher(dev)
    rows, last = [], None
    for name, M, beta in POINTS:
        s = bench_shape(name)
        if name != last:
            w13 = w2 = None
            torch.cuda.empty_cache()
            w13, w2 = expert_weights(s, dev)
            last = name
        r = point_routing(s, M, beta, 1000 + M)
        ids, tw = r.ids.to(dev), r.weights.to(dev)
        x = torch.randn(M, s.hidden, device=dev, dtype=torch.bfloat16)
        base_fn, impl = make_torch_moe(x, w13, w2, ids, tw, "auto")
        ref = base_fn().float()
        variants = {f"torch-{impl}": base_fn}
        for c in BASES:
            variants[config_id(c)] = lambda c=c: fused_moe(x, w13, w2, ids, tw, c)
            for bn2 in args.bn2:
                c2 = replace(c, bn2=bn2)
                if c2.fits():
                    variants[f"{config_id(c)}-n{bn2}"] = lambda c2=c2: fused_moe(x, w13, w2, ids, tw, c2)
        work = point_work(s, r.ids, 2)
        row = {"shape": name, "M": M, "beta": beta, **work, "rel_err": {}, "us": {}, "rounds_us": {}, "kernels": {}}
        for v, fn in variants.items():
            y = fn().float()
            row["rel_err"][v] = float((y - ref).norm() / ref.norm())
        for _ in range(args.rounds):
            for v, fn in variants.items():
                row["rounds_us"].setdefault(v, []).append(median_us(fn, flusher, args.iters))
        for v in variants:
            row["us"][v] = statistics.median(row["rounds_us"][v])
            row["kernels"][v] = kernel_times(variants[v])
        base_us = row["us"][f"torch-{impl}"]
        for v, us in row["us"].items():
            tflops = work["flops"] / (us * 1e-6) / 1e12
            print(f"{name:14s} M={M} b={beta:4.2f} {v:42s} {us:8.1f} us {tflops:6.1f} TFLOP/s "
                  f"({tflops / ceilings['matmul_tflops'] * 100:5.1f} %) baseline/this {base_us / us:5.3f} "
                  f"rel_err {row['rel_err'][v]:.1e}", flush=True)
            top = ", ".join(f"{k[:40]} {t:.0f}" for k, t in list(row["kernels"][v].items())[:4])
            print(f"    kernels (µs): {top}", flush=True)
        rows.append(row)
    write_result(args.out, ceilings, rows, [], t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
