"""Developer probe: where the persistent decode kernel's time goes, from timestamps its programs
write (``LaunchPlan.stamps``), and the call's time under other launch plans in the same process
(not the dataset).

Per (shape, M, beta) point, for each case of CASES (a precision, a decode-schedule config and a
launch plan of SETTINGS):

* the call's median µs as the bench times it (CUDA-graph replay, 256 MB L2 flush before each,
  median of ``--iters``; two interleaved rounds, the lower kept);
* the timeline of a stamped build of the same call, replayed as timed: per replay, from the
  first program's start, the last program's start, the median program's routing done, phase 1
  done (median, last), the barrier left (first, last), the end (last), and the epilogue of each
  program's last phase-1 unit (median, longest); medians over replays;
  plus one replay's per-program stamps (``raw``) for the first case of each precision.

Each FP8 case's output is compared with the first FP8 case's (relative Frobenius error; the
settings change the float32 summation order where they change the reduction's shares).

    PYTHONPATH=src:benchmarks/probes python3 benchmarks/probes/decode_timeline.py [--out F]
"""

from __future__ import annotations

import statistics
import time

import torch
from probe_common import (ceilings_and_flusher, compile_in_pool, config_of, expert_weights, median_us, point_inputs,
                          probe_parser, warm_error, warm_routing, write_result)

FP8 = torch.float8_e4m3fn
POINTS = (("qwen3-30b-a3b", 1, 1.0), ("qwen3-30b-a3b", 4, 0.25), ("qwen3-30b-a3b", 16, 0.25),
          ("qwen3-30b-a3b", 16, 1.0), ("deepseek-v3-tp8", 1, 1.0), ("deepseek-v3-tp8", 16, 0.25),
          ("olmoe-1b-7b", 4, 0.5), ("olmoe-1b-7b", 16, 0.25), ("deepseek-v3-ep32", 16, 0.25))
# The decode-schedule config of the bf16 dataset's winners at these points (b7236b5).
BF16_CONFIG = "T-bm16-bn32-bk256-w4-s3-g1-k1"
# LaunchPlan fields per case (moekit.kernels.plan). ``last``: a split FP8 phase-1 tile summed by
# the share that arrives last instead of by every share. Measured and dropped at earlier commits
# (kernel-history.md, the decode timeline): the barrier polling with an acquire load,
# 1/3/4 CTAs per SM, 2 or 4 scale groups per FP8 phase-1 step, persistent_max_splits = 4, the
# wider GEMM2 chunk for bf16, the narrower FP8 chunk, phase 1 as stream-K, the 16-bit decode dots
# cut into shorter independent chains, the shared fix-up for 16-bit tiles and with 8 row blocks.
# To compare two versions of the kernels, run this probe once per version (PYTHONPATH) in one
# device call.
SETTINGS = ("base", "last")
# (label, precision, config, setting)
CASES = [("bf16", "bf16", BF16_CONFIG, "base")]
CASES += [(f"fp8 s{s}{'-x' if x else ''}", "fp8", f"T-bm16-bn128-bk128-w4-s{s}-g1-k1{'-x' if x else ''}", "base")
          for s, x in ((2, False), (3, False), (2, True), (3, True))]
CASES += [("fp8 s3-x last", "fp8", "T-bm16-bn128-bk128-w4-s3-g1-k1-x", "last")]
STAMP_ROWS = 8 * 1024  # programs the stamp buffer has room for


def plan_of(setting: str, stamps: torch.Tensor | None = None):
    """The LaunchPlan of a setting of SETTINGS, with the stamp buffer (None: no stamps)."""
    from moekit.kernels import FixupPlan, LaunchPlan

    fields = {"base": {}, "last": {"fixup_fp8": FixupPlan(shared=False, row_blocks=4)}}[setting]
    return LaunchPlan(**fields, stamps=stamps)


def _inputs(shape, M: int, beta: float, dev):
    """x, routing (the probes' draws), bf16 weights and their FP8 version of one point."""
    from moekit.fp8 import quantize_blocks

    w13, w2 = expert_weights(shape, dev)
    (q13, s13), (q2, s2) = quantize_blocks(w13, 128), quantize_blocks(w2, 128)
    x, ids, tw = point_inputs(shape, {"M": M, "beta": beta}, dev)
    return x, ids, tw, (w13, w2, {}), (q13, q2, dict(w13_scale=s13, w2_scale=s2))


def _warm(task) -> str | None:
    """Compile one case with and without stamps, in a pool worker."""
    shape_name, cid, fp8, setting = task

    def launch():
        from dataclasses import replace

        from moekit.bench.kernel import bench_shape
        from moekit.kernels import fused_moe

        shape = bench_shape(shape_name)
        small = replace(shape, num_experts=2 * shape.top_k, routed_experts=2 * shape.top_k)
        x, _, _, bf16, q = _inputs(small, 1, 1.0, torch.device("cuda"))
        w13, w2, kw = q if fp8 else bf16
        ids, w = warm_routing(small.top_k, 1)
        stamps = torch.zeros(STAMP_ROWS * 8, dtype=torch.int64, device="cuda")
        for st in (None, stamps):
            fused_moe(x, w13, w2, ids, w, config_of(cid), **kw, plan=plan_of(setting, st))
    return warm_error(f"{shape_name} {cid} fp8={fp8} {setting}", launch)


def timeline(run, flusher, stamps: torch.Tensor, replays: int) -> dict:
    """Medians over graph replays (L2 flushed before each) of the stamped call's phase times, µs
    from the first program's start."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    keys = ("last_start", "routing_p50", "phase1_p50", "phase1_last", "barrier_first", "barrier_last", "end_last",
            "epilogue_p50", "epilogue_max", "summing_max", "after_sum_max")
    samples = {k: [] for k in keys}
    programs = 0
    for _ in range(replays):
        stamps.zero_()
        flusher()
        graph.replay()
        torch.cuda.synchronize()
        t = stamps.view(-1, 8)
        t = t[t[:, 0] > 0].double()
        programs = t.shape[0]
        rel = (t - t[:, 0].min()) / 1e3
        samples["last_start"].append(rel[:, 0].max().item())
        samples["routing_p50"].append(rel[:, 1].median().item())
        samples["phase1_p50"].append(rel[:, 2].median().item())
        samples["phase1_last"].append(rel[:, 2].max().item())
        samples["barrier_first"].append(rel[:, 3].min().item())
        samples["barrier_last"].append(rel[:, 3].max().item())
        samples["end_last"].append(rel[:, 4].max().item())
        worked = t[:, 5] > 0  # programs with a phase-1 unit: the last one's loop and epilogue
        epilogue = (t[worked, 6] - t[worked, 5]) / 1e3
        samples["epilogue_p50"].append(epilogue.median().item() if worked.any() else 0.0)
        samples["epilogue_max"].append(epilogue.max().item() if worked.any() else 0.0)
        # The shares that summed a split tile: loop end -> partials summed, and summed -> epilogue end.
        summed = worked & (t[:, 7] > 0)
        samples["summing_max"].append(((t[summed, 7] - t[summed, 5]) / 1e3).max().item() if summed.any() else 0.0)
        samples["after_sum_max"].append(((t[summed, 6] - t[summed, 7]) / 1e3).max().item() if summed.any() else 0.0)
    out = {k: round(statistics.median(v), 2) for k, v in samples.items()}
    out["programs"] = programs
    # The last replay, per program: stamps 0-7 in µs from the first start (5-7: None without a unit,
    # 7: None unless the program summed a split tile).
    out["raw"] = [[round(v, 2) for v in row[:5]] + ([round(v, 2) for v in row[5:7]] if ok else [None, None])
                  + [round(row[7], 2) if ok and s7 > 0 else None]
                  for row, ok, s7 in zip(rel.tolist(), worked.tolist(), t[:, 7].tolist())]
    return out


def main() -> None:
    parser = probe_parser(__doc__, sorted({p[0] for p in POINTS}), "decode-timeline.json")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    from moekit.bench.kernel import bench_shape, point_work
    from moekit.kernels import fused_moe

    t0 = time.perf_counter()
    dev = torch.device("cuda")
    points = [p for p in POINTS if p[0] in args.shapes]
    tasks = sorted({(p[0], cid, prec == "fp8", st) for p in points for _, prec, cid, st in CASES})
    errors = compile_in_pool(_warm, tasks, args.workers)
    ceilings, flusher = ceilings_and_flusher(dev)
    stamps = torch.zeros(STAMP_ROWS * 8, dtype=torch.int64, device=dev)
    rows = []
    for name, M, beta in points:
        shape = bench_shape(name)
        x, ids, w, bf16, q = _inputs(shape, M, beta, dev)
        runs, us, reference = {}, {}, {}
        for label, prec, cid, st in CASES:
            w13, w2, kw = q if prec == "fp8" else bf16
            cfg = config_of(cid)

            def call(stamps=None, w13=w13, w2=w2, kw=kw, cfg=cfg, st=st):
                return fused_moe(x, w13, w2, ids, w, cfg, **kw, plan=plan_of(st, stamps))
            runs[label] = call, st
        for _ in range(2):  # two interleaved rounds; the lower median is kept
            for label, (run, st) in runs.items():
                try:
                    t = median_us(run, flusher, args.iters)
                except Exception as error:  # noqa: BLE001
                    errors.append(f"{name} M={M} {label}: {type(error).__name__}: {str(error)[:200]}")
                    continue
                us[label] = round(min(t, us.get(label, t)), 2)
        for label, prec, cid, st in CASES:
            if label not in us:
                continue
            run = runs[label][0]
            work = point_work(shape, ids.cpu(), 1 if prec == "fp8" else 2)
            row = dict(shape=name, M=M, beta=beta, case=label, precision=prec, config=cid, setting=st,
                       touched=work["touched_experts"], weight_bytes=work["weight_bytes"], us=us[label])
            y = run().double()
            if prec not in reference:
                reference[prec] = y
            else:
                row["rel_to_first"] = ((y - reference[prec]).norm() / reference[prec].norm()).item()
            try:
                row["timeline"] = timeline(lambda run=run: run(stamps), flusher, stamps, args.replays)
            except Exception as error:  # noqa: BLE001
                errors.append(f"{name} M={M} {label} stamped: {type(error).__name__}: {str(error)[:200]}")
            if "rel_to_first" in row and "timeline" in row:
                del row["timeline"]["raw"]  # (kept for the first case of each precision)
            rows.append(row)
            floor = work["weight_bytes"] / (ceilings["hbm_gbps"] * 1e3)
            tl_ = row.get("timeline", {})
            print(f"{name:16s} M={M:3d} beta={beta:4.2f} {label:22s} {us[label]:6.1f} us  "
                  f"({work['weight_bytes'] / 1e6:5.1f} MB, floor {floor:5.1f})  "
                  + " ".join(f"{k} {v}" for k, v in tl_.items() if k != "raw")
                  + (f"  rel {row['rel_to_first']:.1e}" if "rel_to_first" in row else ""), flush=True)
        write_result(args.out, ceilings, rows, errors, t0)


if __name__ == "__main__":
    main()
