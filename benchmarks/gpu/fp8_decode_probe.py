"""Developer probe: the FP8 decode schedule with and without two changes, in the same process
(not the dataset).

The changes, each a setting of ``moekit.kernels.fused_moe`` that this probe toggles:

* ``wide``: the decode GEMM2 takes chunks of several 128-wide scale groups (``_decode_gemm2_plan``
  widens FP8 chunks by whole groups, since 539b99b towards DECODE_W2_CHUNK_BYTES_FP8) instead of one;
* ``splits``: the persistent kernel's GEMM1 reduction is split into up to 16 shares
  (``PERSISTENT_MAX_SPLITS``) instead of 8.

Per shape and (M, beta) point, timed as the bench times (CUDA-graph replay, 256 MB L2 flush
before each, median of ``--iters``): every FP8 config with bm < 64 of the space (both
``swap_ab`` ways; ``--decode-only``: only the split_k = 1 two_launch ones) with both changes on
("new"); the decode-schedule ones (split_k = 1 two_launch at M <= bm: the only calls the
changes touch) with both off ("old"); on the best "new" decode config, each change off in
turn; and, as a same-run bf16 reference, the bf16 config that won the point in the 51b074d
dataset. Outputs old vs new must agree within 1e-2 (relative). ``--profile`` adds the
per-kernel GPU µs of the best decode config, old and new. The JSON is rewritten after every
point, so a call stopped by its time limit keeps what it measured.

(A third change, the persistent kernel quantizing x as it read it instead of a quantization
launch, was measured by this probe at 988f7e1 and dropped: 4-40 µs slower; docs/kernel.md.)

    PYTHONPATH=src:benchmarks/gpu python3 benchmarks/gpu/fp8_decode_probe.py [--shapes ...] [--out F]
"""

from __future__ import annotations

import contextlib
import importlib
import time
from dataclasses import replace

import torch
from probe_common import (ceilings_and_flusher, compile_in_pool, expert_weights, kernel_breakdown, median_us,
                          probe_parser, warm_error, warm_routing, write_result)

FP8 = torch.float8_e4m3fn
POINTS = ((1, 1.0), (4, 1.0), (4, 0.25), (16, 1.0), (16, 0.25))
SHAPES = ("qwen3-30b-a3b", "deepseek-v3-tp8", "olmoe-1b-7b", "deepseek-v3-ep32")
CHANGES = ("wide", "splits")
# The bf16 winner of each point in benchmarks/results/h200-kernel-51b074d (ids as config_id).
BF16_WINNERS = {
    ("olmoe-1b-7b", 1): "F-bm16-bn64-bk128-w4-s4-g8-k1", ("olmoe-1b-7b", 4): "T-bm16-bn32-bk128-w4-s3-g1-k1",
    ("olmoe-1b-7b", 16): "T-bm16-bn32-bk256-w4-s3-g1-k1", ("qwen3-30b-a3b", 1): "F-bm16-bn64-bk128-w4-s4-g1-k1",
    ("qwen3-30b-a3b", 4): "F-bm16-bn32-bk256-w4-s3-g1-k1", ("qwen3-30b-a3b", 16): "T-bm16-bn32-bk256-w4-s3-g1-k1",
    ("deepseek-v3-tp8", 1): "T-bm16-bn32-bk256-w4-s3-g1-k1", ("deepseek-v3-tp8", 4): "T-bm16-bn32-bk256-w4-s3-g1-k1",
    ("deepseek-v3-tp8", 16): "T-bm16-bn32-bk256-w4-s3-g1-k1", ("deepseek-v3-ep32", 1): "T-bm16-bn32-bk128-w4-s4-g1-k1",
    ("deepseek-v3-ep32", 4): "T-bm16-bn64-bk128-w4-s3-g1-k1", ("deepseek-v3-ep32", 16): "T-bm16-bn32-bk128-w4-s4-g1-k1",
}
# (the beta = 1 winners at M = 4 and 16 are fused or split-K configs with many experts touched;
# the table above has the small-beta / decode-schedule ones, where FP8 has lost so far)


def _module():
    return importlib.import_module("moekit.kernels.fused_moe")  # (moekit.kernels.fused_moe is the function)


@contextlib.contextmanager
def changes(on: tuple[str, ...]):
    """The module with exactly the changes in ``on`` applied (restored on exit)."""
    fm = _module()
    saved = fm.PERSISTENT_MAX_SPLITS, fm._decode_gemm2_plan
    plan = saved[1]

    def narrow(H, N, bm, bk, stages, elem_bytes, max_blocks, device):  # FP8: one scale group per chunk
        tile, chunk, splits = plan(H, N, bm, bk, stages, elem_bytes, max_blocks, device)
        return tile, (bk if elem_bytes == 1 else chunk), splits

    fm.PERSISTENT_MAX_SPLITS = 16 if "splits" in on else 8
    fm._decode_gemm2_plan = plan if "wide" in on else narrow
    try:
        yield
    finally:
        fm.PERSISTENT_MAX_SPLITS, fm._decode_gemm2_plan = saved


def _is_decode(c) -> bool:
    return c.form == "two_launch" and c.split_k == 1


def _configs(shape, decode_only: bool):
    """Every bm < 64 FP8 config of the space (both swap ways; only the split_k = 1 two_launch
    ones if ``decode_only``), without the GROUP_M duplicates of those (the decode schedule has
    no swizzle)."""
    from moekit.kernels import config_space

    out = []
    for c in config_space(shape.moe_shape, torch.device("cuda"), dtype=FP8):
        if c.bm < 64 and (_is_decode(c) or not decode_only) and not (_is_decode(c) and c.group_m != 1):
            out.append(c)
    return out


def bf16_config(cid: str):
    """KernelConfig from a bf16 ``config_id`` such as T-bm16-bn32-bk256-w4-s3-g1-k1."""
    from moekit.kernels import KernelConfig

    form, *parts = cid.split("-")
    v = {}
    for p in parts:
        key = next(k for k in ("bm", "bn", "bk", "w", "s", "g", "k") if p.startswith(k))
        v[key] = int(p[len(key):])
    return KernelConfig(bm=v["bm"], bn=v["bn"], bk=v["bk"], num_warps=v["w"], num_stages=v["s"], group_m=v["g"],
                        split_k=v["k"], form="fused" if form == "F" else "two_launch")


def _inputs(shape, dev):
    """bf16 weights, their FP8 version (128 x 128 block scales), and a bf16 x for the largest M."""
    from moekit.fp8 import quantize_blocks

    w13, w2 = expert_weights(shape, dev)
    (q13, s13), (q2, s2) = quantize_blocks(w13, 128), quantize_blocks(w2, 128)
    x = torch.randn(max(m for m, _ in POINTS), shape.hidden, device=dev, dtype=torch.bfloat16)
    return x, (w13, w2), (q13, q2, dict(w13_scale=s13, w2_scale=s2))


def _warm(task) -> str | None:
    """Compile one config (new; and old where the changes touch it) in a pool worker."""
    shape_name, cfg = task

    def launch():
        from moekit.bench.kernel import bench_shape
        from moekit.kernels import fused_moe

        shape = bench_shape(shape_name)
        small = replace(shape, num_experts=2 * shape.top_k, routed_experts=2 * shape.top_k)
        x, _, (q13, q2, kw) = _inputs(small, torch.device("cuda"))
        ids, w = warm_routing(small.top_k, x.shape[0])
        variants = [CHANGES, ()] if _is_decode(cfg) else [CHANGES]
        for on in variants:
            with changes(on):
                for m in (1, x.shape[0]):
                    fused_moe(x[:m], q13, q2, ids[:m], w[:m], cfg, **kw)
    return warm_error(f"{shape_name} {cfg}", launch)


def main() -> None:
    parser = probe_parser(__doc__, SHAPES, "fp8-decode-probe.json")
    parser.add_argument("--profile", action="store_true", help="per-kernel GPU µs of the best decode config")
    parser.add_argument("--decode-only", action="store_true", help="only the split_k = 1 two_launch configs")
    args = parser.parse_args()
    from moekit.bench.kernel import bench_shape, config_id, point_routing, point_work
    from moekit.kernels import fused_moe

    t0 = time.perf_counter()
    dev = torch.device("cuda")
    shapes = {name: bench_shape(name) for name in args.shapes}
    configs = {name: _configs(s, args.decode_only) for name, s in shapes.items()}
    errors = compile_in_pool(_warm, [(n, c) for n, cs in configs.items() for c in cs], args.workers)
    print(f"compiled in {time.perf_counter() - t0:.0f} s, {len(errors)} failed", flush=True)
    ceilings, flusher = ceilings_and_flusher(dev)
    rows = []
    for name, shape in shapes.items():
        x, (w13, w2), (q13, q2, kw) = _inputs(shape, dev)
        for M, beta in POINTS:
            r = point_routing(shape, M, beta, seed=M)
            ids, w = r.ids.to(dev), r.weights.to(dev)
            work = point_work(shape, r.ids, 1)

            def timed(cfg, on, fp8=True):
                run = ((lambda: fused_moe(x[:M], q13, q2, ids, w, cfg, **kw)) if fp8
                       else (lambda: fused_moe(x[:M], w13, w2, ids, w, cfg)))
                with changes(on):
                    try:
                        return median_us(run, flusher, args.iters), run()
                    except Exception as error:  # noqa: BLE001
                        errors.append(f"{name} M={M} {config_id(cfg)} {on}: {type(error).__name__}: {str(error)[:200]}")
                        return None, None

            new, old, unequal = {}, {}, []
            for cfg in configs[name]:
                cid = config_id(cfg)
                new[cid], y_new = timed(cfg, CHANGES)
                if _is_decode(cfg) and M <= cfg.bm:
                    old[cid], y_old = timed(cfg, ())
                    if y_new is not None and y_old is not None:
                        rel = ((y_new.double() - y_old.double()).norm() / y_old.double().norm()).item()
                        if rel > 1e-2:
                            unequal.append(f"{cid}: {rel:.1e}")
            best_new = min((us, c) for c, us in new.items() if us is not None)
            # Configs the changes do not touch run the same code old and new.
            old_all = {c: old.get(c, us) for c, us in new.items()}
            best_old = min((us, c) for c, us in old_all.items() if us is not None)
            decode_new = {c: us for c, us in new.items() if c in old and us is not None}
            ablation = {}
            if decode_new:
                us, cid = min((us, c) for c, us in decode_new.items())
                cfg = next(c for c in configs[name] if config_id(c) == cid)
                ablation = {"best_decode": cid, "all": us, "none": old[cid]}
                for change in CHANGES:
                    ablation[f"without {change}"] = timed(cfg, tuple(c for c in CHANGES if c != change))[0]
                if args.profile:
                    for label, on in (("new", CHANGES), ("old", ())):
                        with changes(on):
                            ablation[f"kernels {label}"] = kernel_breakdown(
                                lambda: fused_moe(x[:M], q13, q2, ids, w, cfg, **kw), flusher)
            bf16_id = BF16_WINNERS.get((name, M))
            bf16_us = timed(bf16_config(bf16_id), (), fp8=False)[0] if bf16_id else None
            rows.append(dict(shape=name, M=M, beta=beta, touched=work["touched_experts"],
                             weight_bytes_fp8=work["weight_bytes"], new=new, old=old, ablation=ablation,
                             bf16_config=bf16_id, bf16_us=bf16_us, unequal=unequal))
            gbps = work["weight_bytes"] / (best_new[0] * 1e3)
            print(f"{name:16s} M={M:3d} beta={beta:4.2f} experts {work['touched_experts']:3d}: "
                  f"FP8 best new {best_new[1]} {best_new[0]:6.1f} us ({100 * gbps / ceilings['hbm_gbps']:4.1f} % "
                  f"of copy over fp8 weights), old {best_old[1]} {best_old[0]:6.1f}; bf16 {bf16_id} "
                  f"{bf16_us if bf16_us is None else round(bf16_us, 1)}", flush=True)
            if ablation:
                print("    decode " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in ablation.items() if not k.startswith("kernels")), flush=True)
                for k, v in ablation.items():
                    if k.startswith("kernels"):
                        print(f"    {k}: " + ", ".join(f"{n} {t:.1f}" for n, t in v.items()), flush=True)
            if unequal:
                print(f"    OUTPUTS DIFFER old vs new: {unequal}", flush=True)
            write_result(args.out, ceilings, rows, errors, t0)


if __name__ == "__main__":
    main()
