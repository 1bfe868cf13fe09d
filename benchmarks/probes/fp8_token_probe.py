"""Developer probe: the token path's FP8 kernels at decode sizes with the swapped dots on and off
(``KernelConfig.swap_ab``), in the same process (not the dataset).

For each shape and (M, beta) point, every FP8 config with token blocks under 64 rows (the ones
that come both ways: two_launch with and without split-K, under direct addressing the decode
schedule, and fused) is timed as the bench times (CUDA-graph replay, a 256 MB L2 flush before
each, median), once with the swap and once without, one right after the other. Printed per
point: the best config and its µs each way, the default config's µs each way, the weight bytes
of the touched experts over the best time, and the largest relative difference between the
two outputs over the configs (the price in accuracy of the warpgroup MMA's reduced-precision
FP8 sums; tests/kernels/test_kernels_fp8.py bounds it against float64 references).
``--profile`` adds the profiler's per-kernel GPU µs of the default config each way.

    PYTHONPATH=src:benchmarks/probes python3 benchmarks/probes/fp8_token_probe.py [--shapes ...] [--out F]
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from probe_common import (ceilings_and_flusher, compile_in_pool, expert_weights, kernel_breakdown, median_us,
                          probe_parser, warm_error, warm_routing, write_result)

FP8 = torch.float8_e4m3fn
POINTS = ((1, 1.0), (4, 1.0), (4, 0.25), (16, 1.0), (16, 0.25))
SHAPES = ("qwen3-30b-a3b", "deepseek-v3-tp8", "olmoe-1b-7b")


def _configs(shape):
    """The unswapped bm < 64 FP8 configs of the space (each is timed both ways)."""
    from moekit.kernels import config_space

    return [c for c in config_space(shape.moe_shape, torch.device("cuda"), dtype=FP8) if c.bm < 64 and not c.swap_ab]


def _inputs(shape, dev):
    """FP8 weights (128 x 128 block scales) of ``shape`` and a bf16 x for the largest M."""
    from moekit.fp8 import quantize_blocks

    w13, w2 = expert_weights(shape, dev)
    (q13, s13), (q2, s2) = quantize_blocks(w13, 128), quantize_blocks(w2, 128)
    x = torch.randn(max(m for m, _ in POINTS), shape.hidden, device=dev, dtype=torch.bfloat16)
    return x, q13, q2, dict(w13_scale=s13, w2_scale=s2)


def _warm(task) -> str | None:
    """Compile one config both ways (tiny calls of the real H and N) in a pool worker."""
    shape_name, cfg = task

    def launch():
        from moekit.bench.kernel import bench_shape
        from moekit.kernels import fused_moe

        shape = bench_shape(shape_name)
        small = replace(shape, num_experts=2 * shape.top_k, routed_experts=2 * shape.top_k)
        x, q13, q2, kw = _inputs(small, torch.device("cuda"))
        ids, w = warm_routing(small.top_k, x.shape[0])
        for swap in (True, False):
            for m in (1, x.shape[0]):  # direct addressing (M <= bm at every point)
                fused_moe(x[:m], q13, q2, ids[:m], w[:m], replace(cfg, swap_ab=swap), **kw)
    return warm_error(f"{shape_name} {cfg}", launch)


def main() -> None:
    parser = probe_parser(__doc__, SHAPES, "fp8-token-probe.json")
    parser.add_argument("--profile", action="store_true", help="per-kernel GPU µs of the default config")
    args = parser.parse_args()
    from moekit.bench.kernel import bench_shape, config_id, point_routing, point_work
    from moekit.kernels import default_config, fused_moe

    t0 = time.perf_counter()
    dev = torch.device("cuda")
    shapes = {name: bench_shape(name) for name in args.shapes}
    configs = {name: _configs(s) for name, s in shapes.items()}
    errors = compile_in_pool(_warm, [(n, c) for n, cs in configs.items() for c in cs], args.workers)
    ceilings, flusher = ceilings_and_flusher(dev)
    rows = []
    for name, shape in shapes.items():
        x, q13, q2, kw = _inputs(shape, dev)
        for M, beta in POINTS:
            r = point_routing(shape, M, beta, seed=M)
            ids, w = r.ids.to(dev), r.weights.to(dev)
            work = point_work(shape, r.ids, 1)
            default = default_config(M, shape.moe_shape, dtype=FP8)
            times = {True: {}, False: {}}
            worst_diff = 0.0
            for base in configs[name] + [default]:
                cid = "default" if base is default else config_id(base)
                out = {}
                for swap in (True, False):
                    cfg = replace(base, swap_ab=swap)
                    try:
                        times[swap][cid] = median_us(lambda: fused_moe(x[:M], q13, q2, ids, w, cfg, **kw), flusher,
                                                     args.iters)
                        out[swap] = fused_moe(x[:M], q13, q2, ids, w, cfg, **kw).double()
                    except Exception as error:  # noqa: BLE001
                        errors.append(f"{name} M={M} {cid} swap={swap}: {type(error).__name__}: {str(error)[:200]}")
                if len(out) == 2:
                    worst_diff = max(worst_diff, ((out[True] - out[False]).norm() / out[False].norm()).item())
            best = {s: min((us, c) for c, us in t.items() if c != "default") for s, t in times.items()}
            kernels = {}
            if args.profile:
                for swap in (True, False):
                    cfg = replace(default, swap_ab=swap)
                    kernels[f"swap={swap}"] = kernel_breakdown(lambda: fused_moe(x[:M], q13, q2, ids, w, cfg, **kw),
                                                               flusher)
            gbps = {s: work["weight_bytes"] / (b[0] * 1e3) for s, b in best.items()}
            rows.append(dict(shape=name, M=M, beta=beta, touched=work["touched_experts"],
                             weight_bytes=work["weight_bytes"], default=config_id(default),
                             swapped=times[True], unswapped=times[False], worst_rel_diff=worst_diff, kernels=kernels))
            pct = {s: 100 * gbps[s] / ceilings["hbm_gbps"] for s in gbps}
            dflt = {s: times[s].get("default", float("nan")) for s in times}
            print(f"{name:16s} M={M:3d} beta={beta:4.2f} experts {work['touched_experts']:3d}: "
                  f"best swapped {best[True][1]} {best[True][0]:7.1f} us ({pct[True]:4.1f} %), "
                  f"unswapped {best[False][1]} {best[False][0]:7.1f} us ({pct[False]:4.1f} %); "
                  f"default {dflt[True]:7.1f} / {dflt[False]:7.1f}; worst rel diff {worst_diff:.2e}", flush=True)
            for label, per_kernel in kernels.items():
                print(f"    {label} kernels: " + ", ".join(f"{k} {v:.1f}" for k, v in per_kernel.items()), flush=True)
    write_result(args.out, ceilings, rows, errors, t0)


if __name__ == "__main__":
    main()
