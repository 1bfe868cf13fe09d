"""Developer probe: ``fused_moe_expert_major`` over its configs at the loads a dispatcher hands a
rank (not the dataset).

A rank of a 2-rank low-latency layer (``max_m`` 128 tokens per rank) holds half of the shape's
experts and receives them as ``[E_local, 2 * max_m, H]`` + counts. For a few loads (T tokens on
each of the 2 ranks, uniform or skewed routing; the counts are those of this rank's experts),
every two_launch config with split_k = 1 (the form whose cost follows the valid rows; the
others add into a zeroed float32 copy of the whole layout) is timed as the bench times
(CUDA-graph replay, a 256 MB L2 flush before each, median), in bf16 (bf16 tokens and
weights) and in FP8 W8A8 (e4m3 tokens + group scales, as the FP8 wire delivers them). Printed
per (load, precision): the best configs, the default's time and the weight bytes of the
touched experts over the best time. (For the A/B of a schedule change, run it once per
checkout in one device call.) ``--unswapped`` times the default again with FP8's swapped dots off
(``swap_ab = False``: ``default-unswapped``); ``--profile`` adds the profiler's
per-kernel GPU µs of the default calls; ``--only-default`` skips the sweep over the space.

    PYTHONPATH=src:benchmarks/probes python3 benchmarks/probes/expert_major_probe.py [--shape qwen3-30b-a3b]
        [--unswapped] [--profile] [--only-default]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from probe_common import (ceilings_and_flusher, compile_in_pool, expert_weights, kernel_breakdown, median_us,
                          warm_error, write_result)

LOADS = (("T1", 1, None), ("T16", 16, None), ("T128", 128, None), ("T128-zipf1.2", 128, 1.2))
MAX_M, WORLD = 128, 2
FP8 = torch.float8_e4m3fn


def _configs(shape, dtype):
    from moekit.kernels import config_space

    return [c for c in config_space(shape, torch.device("cuda"), dtype=dtype)
            if c.form == "two_launch" and c.split_k == 1]


def _counts(shape, T: int, zipf, seed: int) -> torch.Tensor:
    """Rows per local expert of rank 0: the pairs of both ranks' T tokens routed to experts
    0 .. E/2 - 1."""
    from moekit.routing.generate import synthetic_routing

    e_local = shape.num_experts // WORLD
    ids = torch.cat([synthetic_routing(T, shape.num_experts, shape.top_k, zipf=zipf, seed=seed + r)[0]
                     for r in range(WORLD)])
    return torch.bincount(ids[(ids >= 0) & (ids < e_local)], minlength=e_local)


def _inputs(shape, dev, precision: str):
    from moekit.fp8 import quantize_blocks, quantize_groups

    e_local, cap = shape.num_experts // WORLD, WORLD * MAX_M
    w13, w2 = expert_weights(shape, dev)
    w13, w2 = w13[:e_local].contiguous(), w2[:e_local].contiguous()
    tokens = torch.randn(e_local, cap, shape.hidden, device=dev, dtype=torch.bfloat16)
    if precision == "bf16":
        return dict(tokens=tokens, w13=w13, w2=w2, kw={})
    (q13, s13), (q2, s2) = quantize_blocks(w13, 128), quantize_blocks(w2, 128)
    tq, ts = quantize_groups(tokens, 128)
    return dict(tokens=tq, w13=q13, w2=q2, kw=dict(w13_scale=s13, w2_scale=s2, token_scales=ts))


def _warm(task) -> str | None:
    """Compile one config (a tiny call of the real shape) in a pool worker."""
    shape_name, precision, cfg = task

    def launch():
        from moekit.kernels import fused_moe_expert_major
        from moekit.shapes import get_shape

        shape = get_shape(shape_name)
        small = shape.scaled(num_experts=2 * shape.top_k)  # E_local = top_k experts
        inp = _inputs(small, torch.device("cuda"), precision)
        counts = torch.arange(small.num_experts // WORLD, device="cuda") % 3
        fused_moe_expert_major(inp["tokens"], counts, inp["w13"], inp["w2"], cfg, **inp["kw"])
    return warm_error(f"{precision} {cfg}", launch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--out", default="expert-major-probe.json")
    parser.add_argument("--unswapped", action="store_true", help="time the default with swap_ab = False too")
    parser.add_argument("--profile", action="store_true", help="per-kernel GPU µs of the default calls")
    parser.add_argument("--only-default", action="store_true", help="time the default only")
    args = parser.parse_args()
    from moekit.bench.kernel import config_id
    from moekit.kernels import expert_major, fused_moe_expert_major
    from moekit.shapes import get_shape

    t0 = time.perf_counter()
    dev = torch.device("cuda")
    shape = get_shape(args.shape)
    configs = {p: [] if args.only_default else _configs(shape, dt) for p, dt in (("bf16", torch.bfloat16), ("fp8", FP8))}
    errors = compile_in_pool(_warm, [(args.shape, p, c) for p, cs in configs.items() for c in cs], args.workers)
    ceilings, flusher = ceilings_and_flusher(dev)
    elem = {"bf16": 2, "fp8": 1}
    per_expert = 3 * shape.hidden * shape.intermediate
    rows = []
    for precision, cfgs in configs.items():
        inp = _inputs(shape, dev, precision)
        for name, T, zipf in LOADS:
            counts = _counts(shape, T, zipf, seed=T).to(dev)
            touched = int((counts > 0).sum())
            times = {}
            for cfg in [None] + cfgs:
                def call(cfg=cfg):
                    return fused_moe_expert_major(inp["tokens"], counts, inp["w13"], inp["w2"], cfg, **inp["kw"])
                try:
                    times["default" if cfg is None else config_id(cfg)] = median_us(call, flusher, args.iters)
                except Exception as error:  # noqa: BLE001
                    errors.append(f"{precision} {name} {cfg}: {type(error).__name__}: {str(error)[:200]}")
            def default_call():
                return fused_moe_expert_major(inp["tokens"], counts, inp["w13"], inp["w2"], None, **inp["kw"])
            calls = {"default": default_call}
            if args.unswapped and precision == "fp8":
                unswapped = replace(expert_major.expert_major_default(WORLD * MAX_M, True), swap_ab=False)
                times["default-unswapped"] = median_us(
                    lambda: fused_moe_expert_major(inp["tokens"], counts, inp["w13"], inp["w2"], unswapped,
                                                   **inp["kw"]), flusher, args.iters)
            kernels = {label: kernel_breakdown(fn, flusher) for label, fn in calls.items()} if args.profile else {}
            ranked = sorted((us, cid) for cid, us in times.items() if not cid.startswith("default"))
            best_us, best = ranked[0] if ranked else (times["default"], "default")
            gbps = touched * per_expert * elem[precision] / (best_us * 1e3)
            rows.append(dict(load=name, T=T, zipf=zipf, precision=precision, rows=int(counts.sum()),
                             max_rows=int(counts.max()), touched=touched, times=times, kernels=kernels))
            print(f"{precision:4s} {name:13s} rows {int(counts.sum()):5d} (max {int(counts.max()):3d}) "
                  f"experts {touched:3d}: best {best} {best_us:7.1f} us ({gbps:6.0f} GB/s = "
                  f"{100 * gbps / ceilings['hbm_gbps']:4.1f} % of copy), default {times.get('default', float('nan')):7.1f} us; "
                  f"next: " + ", ".join(f"{c} {u:.1f}" for u, c in ranked[1:4]), flush=True)
            if "default-unswapped" in times:
                print(f"    default with swap_ab = False: {times['default-unswapped']:7.1f} us")
            for label, per_kernel in kernels.items():
                print(f"    {label} kernels: " + ", ".join(f"{k} {v:.1f}" for k, v in per_kernel.items()), flush=True)
    write_result(args.out, ceilings, rows, errors, t0)


if __name__ == "__main__":
    main()
