"""Developer probe of the fused MoE kernel on one GPU: where the time of a decode call goes,
and how a few large-tile configs compare with the torch baseline at M = 4096.

Not the dataset (that is `moekit bench kernel`): a handful of configs, timed the same way
(CUDA-graph replay, L2 flushed before each replay where the bench flushes, median of --iters).

Part 1, decode (M in --m-small, beta 1.0 and 0.25, every shape): for each candidate config,
the whole `fused_moe` call with the token alignment ("sort") and without it ("direct"); the
alignment alone; the output's memset + cast alone. Percent of the measured HBM copy rate over
the bytes the call must move (touched experts' weights + x rows + y), as the bench reports.

Part 2, large M (M = 4096, beta 1.0, every shape): a few bm = 128 configs and the
`torch._grouped_mm` baseline; TFLOP/s and percent of the measured matmul rate.

Usage (device machine, repo root):
    PYTHONPATH=src python3 benchmarks/probes/kernel_probe.py --out $OUT/probe.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict

import torch
from probe_common import compile_in_pool, expert_weights, median_us, write_result

from moekit.bench.kernel import MODELS, bench_shape, measure_ceilings, point_routing, point_work
from moekit.bench.kernel_baseline import make_torch_moe, resolve_impl
from moekit.bench.timing import L2Flusher
from moekit.kernels import KernelConfig, align_tokens, fused_moe

DECODE_CONFIGS = [  # under "direct", two_launch with split_k = 1 is the decode schedule (no atomics)
    KernelConfig(bm=16, bn=64, bk=128, num_warps=4, num_stages=4, form="fused"),
    KernelConfig(bm=16, bn=32, bk=256, num_warps=4, num_stages=3, form="fused"),
    KernelConfig(bm=16, bn=16, bk=256, num_warps=4, num_stages=4, form="fused"),
    KernelConfig(bm=16, bn=64, bk=128, num_warps=4, num_stages=3, split_k=1, form="two_launch"),
    KernelConfig(bm=16, bn=64, bk=128, num_warps=4, num_stages=4, split_k=1, form="two_launch"),
    KernelConfig(bm=16, bn=32, bk=128, num_warps=4, num_stages=4, split_k=1, form="two_launch"),
    KernelConfig(bm=16, bn=32, bk=256, num_warps=4, num_stages=3, split_k=1, form="two_launch"),
    KernelConfig(bm=16, bn=16, bk=256, num_warps=4, num_stages=4, split_k=1, form="two_launch"),
    KernelConfig(bm=16, bn=16, bk=256, num_warps=4, num_stages=3, split_k=1, form="two_launch"),
    KernelConfig(bm=16, bn=64, bk=128, num_warps=4, num_stages=4, split_k=4, form="two_launch"),
]
LARGE_CONFIGS = [
    KernelConfig(bm=128, bn=128, bk=64, num_warps=8, num_stages=3, group_m=8, form="two_launch"),
    KernelConfig(bm=128, bn=128, bk=64, num_warps=8, num_stages=4, group_m=8, form="two_launch"),
    KernelConfig(bm=128, bn=256, bk=64, num_warps=8, num_stages=3, group_m=8, form="two_launch"),
    KernelConfig(bm=128, bn=256, bk=64, num_warps=8, num_stages=4, group_m=8, form="two_launch"),
    KernelConfig(bm=64, bn=128, bk=64, num_warps=4, num_stages=4, group_m=8, form="two_launch"),
    KernelConfig(bm=128, bn=128, bk=64, num_warps=8, num_stages=3, group_m=8, form="fused"),
]


def cid(c: KernelConfig) -> str:
    return (f"{'F' if c.form == 'fused' else 'T'}-bm{c.bm}-bn{c.bn}-bk{c.bk}-w{c.num_warps}-s{c.num_stages}"
            f"-g{c.group_m}-k{c.split_k}")


def _warm(task) -> str | None:
    """Compile one (shape, config, M, alignment) in a pool process (fills Triton's disk cache)."""
    name, cfg, M, alignment = task
    s = bench_shape(name)
    dev = torch.device("cuda", 0)
    w13 = torch.empty(s.num_experts, 2 * s.intermediate, s.hidden, device=dev, dtype=torch.bfloat16)
    w2 = torch.empty(s.num_experts, s.hidden, s.intermediate, device=dev, dtype=torch.bfloat16)
    x = torch.randn(M, s.hidden, device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, s.num_experts, (M, s.top_k), device=dev)
    try:
        fused_moe(x, w13, w2, ids, torch.rand(M, s.top_k, device=dev), KernelConfig(**cfg), alignment=alignment)
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - reported, the run goes on
        return f"{name} {cfg} M={M} {alignment}: {type(error).__name__}: {str(error)[:200]}"
    return None



def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--m-small", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--m-large", type=int, default=4096, help="0: no large-M part")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--out", default="probe.json")
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    t0 = time.perf_counter()

    tasks = [(n, asdict(c), M, a) for n in args.models for c in DECODE_CONFIGS for M in args.m_small
             for a in ("sort", "direct")]
    if args.m_large:
        tasks += [(n, asdict(c), args.m_large, "sort") for n in args.models for c in LARGE_CONFIGS]
    errors = compile_in_pool(_warm, tasks, args.workers)

    ceil = measure_ceilings(dev, torch.bfloat16, 1 << 30, 8192)
    hbm, tflops = ceil["hbm_gbps"], ceil["matmul_tflops"]
    print(f"ceilings: HBM copy {hbm:.0f} GB/s, matmul {tflops:.1f} TFLOP/s", flush=True)
    flusher = L2Flusher(256 << 20, dev)
    impl = resolve_impl("auto", dev, torch.bfloat16)
    rows = []
    for name in args.models:
        s = bench_shape(name)
        w13, w2 = expert_weights(s, dev)
        for M in [*args.m_small, *([args.m_large] if args.m_large else [])]:
            large = M == args.m_large
            for beta in ((1.0,) if large else (1.0, 0.25)):
                r = point_routing(s, M, beta, 1000 + M)
                work = point_work(s, r.ids, 2)
                x = torch.randn(M, s.hidden, device=dev, dtype=torch.bfloat16)
                ids, tw = r.ids.to(dev), r.weights.to(dev)
                fl = flusher if work["weight_bytes"] < 4 * (60 << 20) else None
                base_fn, _ = make_torch_moe(x, w13, w2, ids, tw, impl)
                ref = base_fn().float()
                row = {"shape": name, "M": M, "beta": beta, **work,
                       "baseline_us": median_us(base_fn, fl, args.iters)}
                if not large:
                    out32 = {}
                    row["memset_cast_us"] = median_us(
                        lambda: out32.__setitem__("y", torch.zeros(M, s.hidden, device=dev).to(torch.bfloat16)),
                        fl, args.iters)
                    row["align_us"] = median_us(lambda: align_tokens(ids, s.num_experts, 16), fl, args.iters)
                configs = LARGE_CONFIGS if large else DECODE_CONFIGS
                row["configs"] = {}
                for c in configs:
                    for alignment in (("sort",) if large else ("sort", "direct")):
                        key = f"{cid(c)}/{alignment}"
                        try:
                            fn = lambda c=c, a=alignment: fused_moe(x, w13, w2, ids, tw, c, alignment=a)  # noqa: E731
                            err = float((fn().float() - ref).norm() / ref.norm())
                            us = median_us(fn, fl, args.iters)
                        except Exception as error:  # noqa: BLE001
                            row["configs"][key] = {"error": f"{type(error).__name__}: {str(error)[:150]}"}
                            continue
                        row["configs"][key] = {"us": us, "rel_err": err,
                                               "hbm_pct": 100 * work["bytes"] / (us * 1e-6) / 1e9 / hbm,
                                               "tc_pct": 100 * work["flops"] / (us * 1e-6) / 1e12 / tflops}
                ok = {k: v for k, v in row["configs"].items() if "us" in v}
                best = min(ok, key=lambda k: ok[k]["us"]) if ok else None
                row["best"] = best
                rows.append(row)
                b = ok.get(best, {})
                extra = (f" memset+cast {row['memset_cast_us']:.1f} align {row['align_us']:.1f}" if not large else "")
                print(f"{name:16s} M={M:5d} b={beta:4.2f} experts={work['touched_experts']:3d} "
                      f"best {best} {b.get('us', float('nan')):8.1f} us hbm {b.get('hbm_pct', 0):5.1f}% "
                      f"tc {b.get('tc_pct', 0):5.1f}% base {row['baseline_us']:8.1f} us "
                      f"x{row['baseline_us'] / b.get('us', float('nan')):.2f}{extra}", flush=True)
                if not large:
                    for k, v in sorted(ok.items(), key=lambda kv: kv[1]["us"]):
                        print(f"      {k:36s} {v['us']:8.1f} us  hbm {v['hbm_pct']:5.1f}%  err {v['rel_err']:.1e}")
                else:
                    for k, v in sorted(ok.items(), key=lambda kv: kv[1]["us"]):
                        print(f"      {k:36s} {v['us']:8.1f} us  tc {v['tc_pct']:5.1f}%  err {v['rel_err']:.1e}")
        w13 = w2 = None  # (frees the shape's weights; a del would leave the closures above unbound)
        torch.cuda.empty_cache()
    write_result(args.out, ceil, rows, errors, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
