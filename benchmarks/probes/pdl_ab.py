"""Developer probe: the fused MoE calls with and without programmatic dependent launch
(``moekit.kernels.pdl``), in the same process, interleaved (off, on, off, on, ...).

``--variants`` names the launch modes compared, each a ``LaunchPlan``: ``off`` (PDL off), ``on``
(PDL with the library's ``pdl.EARLY`` table), ``on-ROLE[+ROLE...]`` (PDL, those roles' kernels
not letting their dependents launch at their start) and ``on+ROLE[+ROLE...]`` (PDL, only those
roles early).
The first variant is the reference the others are compared and checked against.

* bf16 (``--bf16``): every M <= 16 point of the bf16 dataset (``--table``, by default
  benchmarks/results/kernel-nvidia-h200) with its routing, x and weights drawn as the bench
  draws them, and the ``--top`` configs that were fastest there (or ``--configs``). Per point:
  the best µs of each variant and its % of the measured HBM copy rate over the bytes the call
  must move (the dataset's "hbm%"), so the count of points at >= 70 % (the decode goal) can be
  read.
* FP8 (``--fp8``): FP8 decode points with the FP8 decode configs that won them (docs/kernel.md).
* large M (``--large``): the token path at M = 256 and 2048 (uniform routing) with the config
  ``fused_moe`` picks itself, bf16 and FP8: its kernel grids span several waves.
* expert-major (``--em``): ``fused_moe_expert_major``'s default config at the loads of
  expert_major_probe.py (one rank of two), bf16 and FP8.

Each (point, config) is timed as the bench times it (CUDA-graph replay, 256 MB L2 flush before
each replay, median of ``--iters``), ``--rounds`` times each way; the result is the median of
the rounds. Where the call is deterministic (the decode schedule, the expert-major kernels) the
outputs of every variant must equal the first's bit for bit; elsewhere (float32 atomics) within
1e-2. ``--profile`` adds the per-kernel GPU µs of each point's best config under each variant.

    PYTHONPATH=src:benchmarks/probes python3 benchmarks/probes/pdl_ab.py --bf16 --fp8 --em \
        [--variants off on on-gemm1] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from probe_common import (ceilings_and_flusher, compile_in_pool, config_of, decode_plan, expert_weights,
                          kernel_breakdown, median_us, point_inputs, warm_error, warm_routing, write_result)

TABLE = "benchmarks/results/kernel-nvidia-h200/kernel-nvidia-h200-1x-20261123T053014Z-table.json.gz"
FP8 = torch.float8_e4m3fn
FP8_POINTS = ((1, 1.0), (16, 1.0), (16, 0.25))
FP8_SHAPES = ("qwen3-30b-a3b", "deepseek-v3-tp8", "olmoe-1b-7b", "deepseek-v3-ep32")
FP8_CONFIGS = ("T-bm16-bn128-bk128-w4-s2-g1-k1", "T-bm16-bn128-bk128-w4-s3-g1-k1-x",
               "T-bm16-bn128-bk128-w4-s4-g1-k1-x")
LARGE_SHAPES = ("qwen3-30b-a3b", "deepseek-v3-tp8")
LARGE_M = (256, 2048)
EM_SHAPES = ("qwen3-30b-a3b", "deepseek-v3")  # model shapes (moekit.shapes), one rank of two


def deterministic(c) -> bool:
    """The decode schedule (two_launch, split_k 1, direct addressing at M <= bm): fixed order."""
    return c.form == "two_launch" and c.split_k == 1


def variant_plan(variant: str):
    """The LaunchPlan of a launch mode of ``--variants``."""
    from moekit.kernels import LaunchPlan, pdl

    early = {role for role, on in pdl.EARLY.items() if on}
    if variant.startswith("on-"):
        roles = set(variant[3:].split("+"))
        early -= roles
    elif variant.startswith("on+"):
        roles = set(variant[3:].split("+"))
        early = roles
    elif variant in ("on", "off"):
        roles = set()
    else:
        raise ValueError(f"unknown variant {variant!r}")
    unknown = roles - set(pdl.EARLY)
    if unknown:
        raise ValueError(f"unknown kernel roles {sorted(unknown)} (pdl.EARLY has {sorted(pdl.EARLY)})")
    return LaunchPlan(pdl=variant != "off", pdl_early=early)


def _fp8_weights(w13, w2):
    from moekit.fp8 import quantize_blocks

    (q13, s13), (q2, s2) = quantize_blocks(w13, 128), quantize_blocks(w2, 128)
    return q13, q2, dict(w13_scale=s13, w2_scale=s2)


def warm_config(task) -> str | None:
    """Compile one token-path config in every variant (a pool worker), at a small expert count."""
    shape_name, cid, fp8, variants = task

    def launch():
        from dataclasses import replace

        from moekit.bench.kernel import bench_shape
        from moekit.kernels import fused_moe

        s = bench_shape(shape_name)
        s = replace(s, num_experts=2 * s.top_k, routed_experts=2 * s.top_k)
        w13, w2 = expert_weights(s, torch.device("cuda"))
        x = torch.randn(16, s.hidden, device="cuda", dtype=torch.bfloat16)
        ids, w = warm_routing(s.top_k, 16)
        args, kw = ((w13, w2), {}) if not fp8 else (_fp8_weights(w13, w2)[:2], _fp8_weights(w13, w2)[2])
        for v in variants:
            for m in (1, 16):
                fused_moe(x[:m], *args, ids[:m], w[:m], config_of(cid), **kw, plan=variant_plan(v))
    return warm_error(f"{shape_name} {cid}", launch)


def ab(call, flusher, variants: list[str], rounds: int, iters: int, exact: bool, defined=None) -> dict:
    """Medians of ``call(plan)`` in each variant, interleaved over ``rounds``, and the check of each
    variant's output (``defined(output)``: its specified part, by default all of it) against the
    first's (bitwise where ``exact``, else relative error < 1e-2)."""
    out = {}
    plans = {v: variant_plan(v) for v in variants}
    for v in variants:
        y = call(plans[v])
        out[v] = (defined(y) if defined else y).clone()
    ref = out[variants[0]].float()
    checks = {}
    for v in variants[1:]:
        rel = float((out[v].float() - ref).norm() / ref.norm().clamp_min(1e-30))
        checks[v] = torch.equal(out[v], out[variants[0]]) if exact else rel < 1e-2
    samples = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            samples[v].append(median_us(lambda plan=plans[v]: call(plan), flusher, iters))
    return {"us": {v: statistics.median(t) for v, t in samples.items()}, "rounds": samples,
            "check": "ok" if all(checks.values()) else "MISMATCH " + " ".join(v for v, ok in checks.items() if not ok)}


def line(row: dict, variants: list[str]) -> str:
    """The variants' medians, each after the first with its difference from the first."""
    us = row["us"]
    ref = us[variants[0]]
    return " ".join([f"{variants[0]} {ref:6.1f}"] + [f"{v} {us[v]:6.1f} ({us[v] - ref:+.1f})" for v in variants[1:]])


def run_bf16(args, dev, ceilings, flusher, rows: list) -> None:
    from moekit.bench.kernel import bench_shape
    from moekit.kernels import fused_moe

    points, plan = decode_plan(args.table, args.shapes, args.top, args.configs)
    V = args.variants
    compile_in_pool(warm_config, sorted({(p["shape"], c, False, tuple(V)) for p in points for c, _ in plan[id(p)]}),
                    args.workers)
    hbm = ceilings["hbm_gbps"]
    for name in args.shapes:
        s = bench_shape(name)
        w13, w2 = expert_weights(s, dev)  # the bench's draw (seed 17, w13 then w2)
        for p in (q for q in points if q["shape"] == name):
            M = p["M"]
            x, ids, tw = point_inputs(s, p, dev)
            best = {}
            for cid, dataset_us in plan[id(p)]:
                c = config_of(cid)
                row = {"part": "bf16", "shape": name, "M": M, "beta": p["beta"], "config": cid,
                       "dataset_us": dataset_us, "bytes": p["bytes"],
                       **ab(lambda plan, c=c: fused_moe(x, w13, w2, ids, tw, c, plan=plan), flusher, V,
                            args.rounds, args.iters, deterministic(c))}
                rows.append(row)
                for v in V:
                    if v not in best or row["us"][v] < best[v][0]:
                        best[v] = (row["us"][v], cid)
                print(f"{name:17s} M={M:2d} b={p['beta']:4.2f} {cid:32s} {line(row, V)} us {row['check']}",
                      flush=True)
            pct = {v: 100 * p["bytes"] / (best[v][0] * 1e-6) / 1e9 / hbm for v in V}
            rows.append({"part": "bf16-point", "shape": name, "M": M, "beta": p["beta"],
                         "best_us": {v: best[v][0] for v in V}, "best": {v: best[v][1] for v in V}, "hbm%": pct})
            print("  point best: " + ", ".join(f"{v} {best[v][0]:6.1f} us ({pct[v]:.1f} %)" for v in V), flush=True)
            if args.profile:
                c = config_of(best[V[-1]][1])
                for v in V:
                    k = kernel_breakdown(lambda c=c, v=v: fused_moe(x, w13, w2, ids, tw, c, plan=variant_plan(v)),
                                         flusher)
                    print(f"    kernels {v}: " + ", ".join(f"{n} {us:.1f}" for n, us in k.items()))
    summary = [r for r in rows if r["part"] == "bf16-point"]
    for v in V:
        n = sum(r["hbm%"][v] >= 70 for r in summary)
        print(f"bf16 M <= 16 points at >= 70 % of the copy rate, {v}: {n} of {len(summary)}")


def run_fp8(args, dev, flusher, rows: list) -> None:
    from moekit.bench.kernel import bench_shape, point_routing
    from moekit.kernels import fused_moe

    shapes = [n for n in FP8_SHAPES if n in args.shapes]
    V = args.variants
    compile_in_pool(warm_config, [(n, c, True, tuple(V)) for n in shapes for c in FP8_CONFIGS], args.workers)
    for name in shapes:
        s = bench_shape(name)
        q13, q2, kw = _fp8_weights(*expert_weights(s, dev))
        for M, beta in FP8_POINTS:
            x = torch.randn(M, s.hidden, device=dev, dtype=torch.bfloat16)
            r = point_routing(s, M, beta, M)
            ids, tw = r.ids.to(dev), r.weights.to(dev)
            for cid in FP8_CONFIGS:
                c = config_of(cid)
                row = {"part": "fp8", "shape": name, "M": M, "beta": beta, "config": cid,
                       **ab(lambda plan, c=c: fused_moe(x, q13, q2, ids, tw, c, **kw, plan=plan), flusher, V,
                            args.rounds, args.iters, deterministic(c))}
                rows.append(row)
                print(f"fp8 {name:17s} M={M:2d} b={beta:4.2f} {cid:34s} {line(row, V)} us {row['check']}",
                      flush=True)


def run_large(args, dev, flusher, rows: list) -> None:
    from moekit.bench.kernel import bench_shape, point_routing
    from moekit.kernels import fused_moe

    for name in LARGE_SHAPES:
        s = bench_shape(name)
        w13, w2 = expert_weights(s, dev)
        q13, q2, kw = _fp8_weights(w13, w2)
        for M in LARGE_M:
            x = torch.randn(M, s.hidden, device=dev, dtype=torch.bfloat16)
            r = point_routing(s, M, 1.0, M)
            ids, tw = r.ids.to(dev), r.weights.to(dev)
            for precision, call in (("bf16", lambda plan: fused_moe(x, w13, w2, ids, tw, plan=plan)),
                                    ("fp8", lambda plan: fused_moe(x, q13, q2, ids, tw, **kw, plan=plan))):
                row = {"part": "large", "shape": name, "M": M, "precision": precision,
                       **ab(call, flusher, args.variants, args.rounds, args.iters, False)}
                rows.append(row)
                print(f"large {name:17s} M={M:4d} {precision} {line(row, args.variants)} us {row['check']}",
                      flush=True)


def run_em(args, dev, flusher, rows: list) -> None:
    from expert_major_probe import LOADS, _counts, _inputs

    from moekit.kernels import fused_moe_expert_major
    from moekit.shapes import get_shape

    for name in EM_SHAPES:
        shape = get_shape(name)
        for precision in ("bf16", "fp8"):
            inp = _inputs(shape, dev, precision)
            for label, T, zipf in LOADS:
                counts = _counts(shape, T, zipf, seed=T).to(dev)
                n = counts.tolist()

                def valid(y, n=n):  # rows past counts[e] are unspecified (fused_moe_expert_major)
                    return torch.cat([y[e, :ne] for e, ne in enumerate(n)])
                row = {"part": "em", "shape": name, "precision": precision, "load": label,
                       **ab(lambda plan: fused_moe_expert_major(inp["tokens"], counts, inp["w13"], inp["w2"], None,
                                                                **inp["kw"], plan=plan), flusher, args.variants,
                            args.rounds, args.iters, True, valid)}
                rows.append(row)
                print(f"em {name:17s} {precision} {label:13s} {line(row, args.variants)} us {row['check']}",
                      flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--large", action="store_true")
    p.add_argument("--em", action="store_true")
    p.add_argument("--table", default=TABLE)
    p.add_argument("--shapes", nargs="+", default=["olmoe-1b-7b", "qwen3-30b-a3b", "deepseek-v3-tp8",
                                                   "deepseek-v3-ep32", "mixtral-8x7b"])
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--configs", nargs="+", help="config ids to time at every bf16 point instead of the --top")
    p.add_argument("--variants", nargs="+", default=["off", "on"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--workers", type=int, default=14)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default="pdl-ab.json")
    args = p.parse_args()
    for v in args.variants:
        variant_plan(v)  # unknown variants fail here, before any compile
    t0 = time.perf_counter()
    dev = torch.device("cuda", 0)
    ceilings, flusher = ceilings_and_flusher(dev)
    rows: list = []
    try:
        if args.bf16:
            run_bf16(args, dev, ceilings, flusher, rows)
        if args.fp8:
            run_fp8(args, dev, flusher, rows)
        if args.large:
            run_large(args, dev, flusher, rows)
        if args.em:
            run_em(args, dev, flusher, rows)
    finally:
        write_result(args.out, ceilings, rows, [], t0)


if __name__ == "__main__":
    main()
