"""Developer probe: the fused MoE call of two versions of ``fused_moe.py`` on the same GPU, in
the same process, interleaved (A B A B ...) so that clock and machine drift cancel.

Made to tell a code change from machine-to-machine variation: the bench's datasets come from
different device calls, which differ by a few percent. The baseline version is any copy of
the module's file (e.g. ``git show ce5bc32:src/moekit/kernels/fused_moe.py > old.py``); it is
imported under another name and uses the same ``moekit.kernels.align``/``configs``, so it must
be a version whose helpers those still provide.

Usage (device machine, repo root):
    PYTHONPATH=src python3 benchmarks/gpu/ab_kernel.py --baseline-file old.py --out $OUT/ab.json
    # or against this version with a module's switch off:
    PYTHONPATH=src python3 benchmarks/gpu/ab_kernel.py --baseline-off moekit.kernels.pdl.ENABLED \
        --points atomics --out $OUT/ab-pdl.json
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from dataclasses import replace

import torch
from probe_common import config_of, expert_weights, median_us, write_result

from moekit.bench.kernel import bench_shape, config_id, point_routing, point_work
from moekit.bench.timing import L2Flusher
from moekit.kernels import KernelConfig, fused_moe

# (shape, M, beta, config): decode points of the dataset and the config that won them.
DECODE = KernelConfig(bm=16, bn=32, bk=256, num_warps=4, num_stages=4, split_k=1, form="two_launch")
OLMOE = KernelConfig(bm=16, bn=32, bk=128, num_warps=4, num_stages=3, split_k=1, form="two_launch")
POINTS = (
    ("deepseek-v3-tp8", 1, 1.0, DECODE),
    ("deepseek-v3-tp8", 4, 0.25, DECODE),
    ("deepseek-v3-tp8", 16, 0.25, DECODE),
    ("deepseek-v3-ep32", 16, 0.25, DECODE),
    ("deepseek-v3-ep32", 1, 1.0, KernelConfig(bm=16, bn=64, bk=128, num_warps=4, num_stages=4, split_k=1,
                                              form="two_launch")),
    ("olmoe-1b-7b", 16, 0.25, OLMOE),
    ("qwen3-30b-a3b", 16, 0.25, KernelConfig(bm=16, bn=32, bk=128, num_warps=4, num_stages=4, split_k=1,
                                             form="two_launch")),
)

# The fused form at the decode points where it wins (direct addressing).
FUSED = KernelConfig(bm=16, bn=64, bk=128, num_warps=4, num_stages=4, split_k=1, form="fused")
FUSED_POINTS = (
    ("olmoe-1b-7b", 1, 1.0, FUSED),
    ("qwen3-30b-a3b", 1, 1.0, FUSED),
    ("olmoe-1b-7b", 16, 1.0, FUSED),
    ("qwen3-30b-a3b", 16, 1.0, FUSED),
    ("deepseek-v3-tp8", 16, 1.0, replace(FUSED, num_stages=3)),
    ("deepseek-v3-ep32", 16, 1.0, FUSED),
)

# The kernels that add into the output with float32 atomics: the fused form at decode points
# (its best configs in the dataset), then the token path's GEMM2 at larger M.
ATOMIC_POINTS = tuple((shape, M, beta, config_of(cid)) for shape, M, beta, cid in (
    ("olmoe-1b-7b", 1, 1.0, "F-bm16-bn64-bk128-w4-s4-g1-k1"),
    ("olmoe-1b-7b", 4, 0.25, "F-bm16-bn64-bk128-w4-s4-g1-k1"),
    ("olmoe-1b-7b", 4, 0.25, "F-bm32-bn64-bk128-w4-s4-g1-k1"),
    ("olmoe-1b-7b", 16, 0.25, "F-bm16-bn64-bk128-w4-s4-g1-k1"),
    ("olmoe-1b-7b", 16, 0.25, "F-bm32-bn64-bk128-w4-s4-g1-k1"),
    ("olmoe-1b-7b", 16, 1.0, "F-bm16-bn128-bk64-w4-s4-g8-k1"),
    ("qwen3-30b-a3b", 1, 0.25, "F-bm16-bn64-bk128-w4-s4-g8-k1"),
    ("qwen3-30b-a3b", 4, 0.25, "F-bm32-bn64-bk128-w4-s4-g8-k1"),
    ("qwen3-30b-a3b", 16, 0.25, "F-bm32-bn64-bk128-w4-s4-g1-k1"),
    ("qwen3-30b-a3b", 16, 1.0, "F-bm16-bn64-bk128-w4-s4-g1-k1"),
    ("deepseek-v3-tp8", 1, 1.0, "F-bm16-bn32-bk256-w4-s4-g1-k1"),
    ("deepseek-v3-tp8", 16, 1.0, "F-bm16-bn64-bk128-w4-s4-g1-k1"),
    ("deepseek-v3-ep32", 16, 1.0, "F-bm16-bn64-bk128-w4-s3-g8-k1"),
    ("olmoe-1b-7b", 64, 1.0, "T-bm16-bn64-bk128-w4-s3-g8-k1"),
    ("olmoe-1b-7b", 256, 1.0, "T-bm64-bn128-bk64-w4-s3-g8-k1"),
    ("qwen3-30b-a3b", 256, 1.0, "T-bm64-bn128-bk64-w4-s3-g8-k1"),
    ("qwen3-30b-a3b", 1024, 1.0, "T-bm64-bn128-bk64-w4-s3-g8-k1"),
    ("mixtral-8x7b", 4096, 1.0, "T-bm128-bn128-bk64-w8-s4-g8-k1"),
))
POINT_SETS = {"decode": POINTS, "fused": FUSED_POINTS, "atomics": ATOMIC_POINTS}


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("moekit.kernels._ab_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.fused_moe


def switched_off(module_name: str, attr: str):
    """fused_moe with ``module_name.attr`` set to False for the call (and its graph capture):
    the baseline when two versions differ by a switch rather than by a file."""
    module = importlib.import_module(module_name)

    def call(*args, **kwargs):
        saved = getattr(module, attr)
        setattr(module, attr, False)
        try:
            return fused_moe(*args, **kwargs)
        finally:
            setattr(module, attr, saved)
    return call


def main() -> int:
    p = argparse.ArgumentParser()
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--baseline-file")
    src.add_argument("--baseline-off", metavar="MODULE.ATTR",
                     help="the baseline is this version with a module's switch off, "
                          "e.g. moekit.kernels.pdl.ENABLED")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default="ab.json")
    p.add_argument("--points", choices=sorted(POINT_SETS), default="decode")
    args = p.parse_args()
    t0 = time.perf_counter()
    dev = torch.device("cuda", 0)
    baseline = (load_baseline(args.baseline_file) if args.baseline_file
                else switched_off(*args.baseline_off.rsplit(".", 1)))
    versions = {"baseline": baseline, "current": fused_moe}
    flusher = L2Flusher(256 << 20, dev)
    rows, last = [], None
    for name, M, beta, cfg in POINT_SETS[args.points]:
        s = bench_shape(name)
        if name != last:
            w13, w2 = expert_weights(s, dev)
            last = name
        r = point_routing(s, M, beta, 1000 + M)
        ids, tw = r.ids.to(dev), r.weights.to(dev)
        x = torch.randn(M, s.hidden, device=dev, dtype=torch.bfloat16)
        ref = fused_moe(x, w13, w2, ids, tw, KernelConfig(bm=16, bn=64, bk=64, split_k=4)).float()
        row = {"shape": name, "M": M, "beta": beta, "config": config_id(cfg), **point_work(s, r.ids, 2)}
        for v, fn in versions.items():
            y = fn(x, w13, w2, ids, tw, cfg).float()
            row[f"{v}_rel_err"] = float((y - ref).norm() / ref.norm())
        samples = {v: [] for v in versions}
        for _ in range(args.rounds):
            for v, fn in versions.items():
                samples[v].append(median_us(lambda fn=fn: fn(x, w13, w2, ids, tw, cfg), flusher, args.iters))
        for v in versions:
            row[f"{v}_us"] = statistics.median(samples[v])
            row[f"{v}_rounds_us"] = samples[v]
        rows.append(row)
        print(f"{name:17s} M={M:3d} b={beta:4.2f} {config_id(cfg):32s} baseline {row['baseline_us']:7.1f} us"
              f"  current {row['current_us']:7.1f} us  ({row['current_us'] / row['baseline_us']:.3f}x)", flush=True)
    write_result(args.out, {}, rows, [], t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
