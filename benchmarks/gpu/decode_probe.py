"""Developer probe of the fused MoE kernel at decode sizes (M <= 16) on one GPU.

Not the dataset (that is `moekit bench kernel`). For the points where the M <= 16 goal is
hardest (few small experts touched), it measures:

1. every bm = 16 config of the space without swizzle or split-K: under direct addressing the
   decode schedule (two_launch) and the fused form; the whole call, CUDA-graph replay with the
   L2 flushed before each (as the bench);
2. for the best decode-schedule config of each point, the decode GEMM2's (column tile,
   reduction chunk, expert splits) overridden over a list of alternatives
   (``fused_moe._decode_gemm2_plan``);
3. for the best config of each form, the per-kernel GPU time from the CUDA profiler (eager
   calls, each after a flush), so the gap between kernels and their sum is visible;
4. with ``--two-kernel``: every decode-schedule config again with
   ``fused_moe.DECODE_PERSISTENT = False`` (GEMM1 and the decode GEMM2 as two launches instead
   of the one persistent kernel), in the same process, so the two are compared on one machine.

Step 2 runs only with ``--gemm2-plans``.

Usage (device machine, repo root):
    PYTHONPATH=src python3 benchmarks/gpu/decode_probe.py --out $OUT/decode-probe.json
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from dataclasses import asdict

import torch
from probe_common import compile_in_pool, expert_weights, kernel_breakdown, median_us, write_result

from moekit.bench.kernel import bench_shape, config_id, measure_ceilings, point_routing, point_work
from moekit.bench.timing import L2Flusher
from moekit.kernels import KernelConfig, config_space, fused_moe

fm_module = importlib.import_module("moekit.kernels.fused_moe")  # (the package exports a function of that name)

POINTS = ((1, 1.0), (4, 0.25), (16, 0.25), (16, 1.0))
SHAPES = ("olmoe-1b-7b", "qwen3-30b-a3b", "deepseek-v3-tp8", "deepseek-v3-ep32", "mixtral-8x7b")
# (column tile, reduction chunk, expert splits) of the decode GEMM2 (the config's pipeline
# depth); None = the default plan. (At 7e34ee8 the GEMM2 had its own depth; 5-6 stages measured
# slower than 3-4.)
GEMM2_PLANS = (None, (16, 256, 1), (16, 512, 1), (16, 256, 2), (16, 512, 2), (16, 128, 4), (16, 256, 4),
               (16, 128, 8), (32, 256, 1), (32, 256, 2), (32, 256, 4), (32, 128, 8), (64, 256, 4))


def decode_configs(name: str, bm: int = 16) -> list[KernelConfig]:
    """bm-row configs without split-K (bm = 16: also without swizzle, one block per expert)."""
    return [c for c in config_space(bench_shape(name).moe_shape, "cuda")
            if c.bm == bm and (c.group_m == 1 or bm > 16) and c.split_k == 1]


def _warm(task) -> str | None:
    name, cfg, persistent = task
    fm_module.DECODE_PERSISTENT = persistent
    s = bench_shape(name)
    dev = torch.device("cuda", 0)
    w13 = torch.empty(s.num_experts, 2 * s.intermediate, s.hidden, device=dev, dtype=torch.bfloat16)
    w2 = torch.empty(s.num_experts, s.hidden, s.intermediate, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, s.hidden, device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, s.num_experts, (1, s.top_k), device=dev)
    try:
        fused_moe(x, w13, w2, ids, torch.rand(1, s.top_k, device=dev), KernelConfig(**cfg))
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - reported, the run goes on
        return f"{name} {cfg}: {type(error).__name__}: {str(error)[:200]}"
    return None



def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--out", default="decode-probe.json")
    p.add_argument("--two-kernel", action="store_true", help="also time the two-kernel decode schedule")
    p.add_argument("--gemm2-plans", action="store_true", help="sweep the decode GEMM2's plan (step 2)")
    p.add_argument("--bm", type=int, default=16, help="the token block of the configs timed")
    p.add_argument("--points", nargs="+", default=None, metavar="M:BETA",
                   help="points to time (default: " + " ".join(f"{m}:{b}" for m, b in POINTS) + ")")
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    t0 = time.perf_counter()
    points = POINTS if args.points is None else [(int(m), float(b)) for m, b in (p.split(":") for p in args.points)]
    tasks = [(n, asdict(c), True) for n in args.shapes for c in decode_configs(n, args.bm)]
    if args.two_kernel:
        tasks += [(n, asdict(c), False) for n in args.shapes for c in decode_configs(n, args.bm)
                  if c.form == "two_launch"]
    errors = compile_in_pool(_warm, tasks, args.workers)
    ceil = measure_ceilings(dev, torch.bfloat16, 1 << 30, 8192)
    hbm = ceil["hbm_gbps"]
    print(f"ceilings: HBM copy {hbm:.0f} GB/s", flush=True)
    flusher = L2Flusher(256 << 20, dev)
    default_plan = fm_module._decode_gemm2_plan
    rows = []
    for name in args.shapes:
        s = bench_shape(name)
        w13, w2 = expert_weights(s, dev)
        configs = decode_configs(name, args.bm)
        for M, beta in points:
            r = point_routing(s, M, beta, 1000 + M)
            work = point_work(s, r.ids, 2)
            x = torch.randn(M, s.hidden, device=dev, dtype=torch.bfloat16)
            ids, tw = r.ids.to(dev), r.weights.to(dev)
            max_blocks = min(s.num_experts, M * s.top_k)  # DirectBlocks.max_blocks
            fl = flusher if work["weight_bytes"] < 4 * (60 << 20) else None

            def pct(us):
                return 100 * work["bytes"] / (us * 1e-6) / 1e9 / hbm

            def call(c):
                return lambda: fused_moe(x, w13, w2, ids, tw, c)

            ref = fused_moe(x, w13, w2, ids, tw, KernelConfig(bm=16, bn=64, bk=64, split_k=4)).float()
            row = {"shape": name, "M": M, "beta": beta, **work, "configs": {}, "two_kernel": {}, "gemm2_tiles": {},
                   "kernels": {}}

            def measure(c, into):
                try:
                    fn = call(c)
                    err = float((fn().float() - ref).norm() / ref.norm())
                    into[config_id(c)] = {"us": median_us(fn, fl, args.iters), "rel_err": err}
                except Exception as error:  # noqa: BLE001
                    into[config_id(c)] = {"error": f"{type(error).__name__}: {str(error)[:150]}"}

            for c in configs:
                measure(c, row["configs"])
            if args.two_kernel:
                fm_module.DECODE_PERSISTENT = False
                for c in configs:
                    if c.form == "two_launch":
                        measure(c, row["two_kernel"])
                two_ok = {c: row["two_kernel"][config_id(c)] for c in configs
                          if "us" in row["two_kernel"].get(config_id(c), {})}
                best_two = min(two_ok, key=lambda c: two_ok[c]["us"], default=None)
                if best_two is not None:
                    row["kernels"]["two-kernel " + config_id(best_two)] = kernel_breakdown(call(best_two), fl)
                fm_module.DECODE_PERSISTENT = True
            ok = {c: row["configs"][config_id(c)] for c in configs if "us" in row["configs"][config_id(c)]}
            by_form = {f: min((c for c in ok if c.form == f), key=lambda c: ok[c]["us"], default=None)
                       for f in ("two_launch", "fused")}
            best_t = by_form["two_launch"]
            if best_t is not None and args.gemm2_plans:
                for plan in GEMM2_PLANS:
                    if plan is None:
                        plan = default_plan(s.hidden, s.intermediate, best_t.bm, best_t.bk, best_t.num_stages, 2,
                                            False, max_blocks, dev)
                        key = f"{plan} (default)"
                    else:
                        key = str(plan)
                    if plan[1] > max(best_t.bk, 1 << (s.intermediate - 1).bit_length()) or plan[2] > max_blocks:
                        continue
                    fm_module._decode_gemm2_plan = lambda *_, p=plan: p
                    try:
                        fn = call(best_t)
                        err = float((fn().float() - ref).norm() / ref.norm())
                        row["gemm2_tiles"][key] = {"us": median_us(fn, fl, args.iters), "rel_err": err}
                    except Exception as error:  # noqa: BLE001
                        row["gemm2_tiles"][key] = {"error": f"{type(error).__name__}: {str(error)[:150]}"}
                    finally:
                        fm_module._decode_gemm2_plan = default_plan
            for f, c in by_form.items():
                if c is not None:
                    row["kernels"][config_id(c)] = kernel_breakdown(call(c), fl)
            rows.append(row)
            print(f"{name:16s} M={M:3d} b={beta:4.2f} experts={work['touched_experts']:3d} "
                  f"roofline {work['bytes'] / hbm / 1e3:6.1f} us", flush=True)
            for c in sorted(ok, key=lambda c: ok[c]["us"])[:8]:
                print(f"      {config_id(c):36s} {ok[c]['us']:8.1f} us  hbm {pct(ok[c]['us']):5.1f}%"
                      f"  err {ok[c]['rel_err']:.1e}")
            if args.two_kernel and best_two is not None:
                print(f"      two-kernel {config_id(best_two):25s} {two_ok[best_two]['us']:8.1f} us"
                      f"  hbm {pct(two_ok[best_two]['us']):5.1f}%  err {two_ok[best_two]['rel_err']:.1e}")
            for k, v in row["gemm2_tiles"].items():
                if "us" in v:
                    print(f"      gemm2 {k:24s} (with {config_id(best_t)}) {v['us']:8.1f} us"
                          f"  hbm {pct(v['us']):5.1f}%  err {v['rel_err']:.1e}")
            for k, ker in row["kernels"].items():
                parts = ", ".join(f"{n.split('(')[0][:28]} {us:.1f}" for n, us in ker.items())
                print(f"      kernels of {k}: {parts} (sum {sum(ker.values()):.1f} us)")
        w13 = w2 = None  # (frees the shape's weights; a del would leave the closures above unbound)
        torch.cuda.empty_cache()
    write_result(args.out, ceil, rows, errors, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
