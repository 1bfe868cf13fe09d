"""Developer probe: a decode call timed alone (as the bench times it) and in a stream of calls.

The kernel bench times each call as one CUDA-graph replay between two events, after an L2
flush. At decode sizes that includes a fixed cost that a model's own graph does not pay for
every layer: the replay's start and the events. A graph of a 1-CTA kernel measures about
3.5 µs this way (docs/kernel.md, "Decode: the fixed cost"). This probe times every M <= 16
point of a bf16 dataset table, with its ``--top`` fastest configs, two ways, interleaved over
``--rounds``:

* ``alone``: as the bench does (``median_us``: graph of one call, 256 MB L2 flush before each
  replay, median of ``--iters``);
* ``stream``: a graph of ``--calls`` consecutive calls, each on its own copy of the expert
  weights (so no call finds another's weights in L2: R copies are far more bytes than the
  L2), flushed before each replay, the median divided by R. This is the cost per call of
  back-to-back MoE calls, as inside a model's graph, where the next call's launch overlaps
  the end of the one before.

It does the same for a trivial one-kernel call (``harness``). It reports, per point, the best µs
of each way and its % of the measured HBM copy rate over the bytes the call must move (the
dataset's "hbm%", the decode goal of >= 70 % at M <= 16), and the count of points at >= 70 %
each way. It reports and does not redefine: the dataset's number is ``alone``.

    PYTHONPATH=src:benchmarks/probes python3 benchmarks/probes/stream_probe.py [--table T] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from pdl_ab import warm_config
from probe_common import (ceilings_and_flusher, compile_in_pool, config_of, decode_plan, expert_weights,
                          median_us, point_inputs, write_result)

TABLE = "benchmarks/results/kernel-decode-nvidia-h200/kernel-nvidia-h200-1x-20261124T165106Z-table.json.gz"
SHAPES = ("olmoe-1b-7b", "qwen3-30b-a3b", "deepseek-v3-tp8", "deepseek-v3-ep32", "mixtral-8x7b")


def alone_and_stream(calls, flusher, rounds: int, iters: int) -> dict:
    """Median µs of ``calls[0]()`` alone and per call of ``calls`` run back to back, interleaved
    over ``rounds``; each way is the median of its round medians."""
    def stream():
        for call in calls:
            call()

    alone, per_call = [], []
    for _ in range(rounds):
        alone.append(median_us(calls[0], flusher, iters))
        per_call.append(median_us(stream, flusher, iters) / len(calls))
    return {"alone": statistics.median(alone), "stream": statistics.median(per_call),
            "rounds": {"alone": alone, "stream": per_call}}


def main() -> int:
    from moekit.bench.kernel import bench_shape
    from moekit.kernels import fused_moe

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", default=TABLE)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--top", type=int, default=2, help="configs per point: the fastest in the table")
    p.add_argument("--calls", type=int, default=8, help="calls per stream (R), each on its own weights")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--workers", type=int, default=14)
    p.add_argument("--out", default="stream-probe.json")
    args = p.parse_args()
    if args.calls < 2:
        p.error("--calls must be at least 2")
    t0 = time.perf_counter()
    dev = torch.device("cuda", 0)
    ways = ("alone", "stream")

    points, plan = decode_plan(args.table, args.shapes, args.top)
    compile_in_pool(warm_config, sorted({(q["shape"], c, False, ("on",)) for q in points for c, _ in plan[id(q)]}),
                    args.workers)
    ceilings, flusher = ceilings_and_flusher(dev)
    hbm = ceilings["hbm_gbps"]

    rows = []
    one = torch.zeros(1, device=dev)
    harness = alone_and_stream([lambda: one.add_(1)] * args.calls, flusher, args.rounds, args.iters)
    rows.append({"part": "harness", **harness})
    print(f"harness (one 1-element add): alone {harness['alone']:.1f} us, stream {harness['stream']:.1f} us per call",
          flush=True)
    for name in args.shapes:
        s = bench_shape(name)
        # Copy 0 is the bench's draw (seed 17); the others only have to be other memory.
        weights = [expert_weights(s, dev, seed=17 + r) for r in range(args.calls)]
        for q in (q for q in points if q["shape"] == name):
            M = q["M"]
            x, ids, tw = point_inputs(s, q, dev)
            best = {}
            for cid, _ in plan[id(q)]:
                c = config_of(cid)
                calls = [lambda w=w, c=c: fused_moe(x, *w, ids, tw, c) for w in weights]
                row = {"part": "config", "shape": name, "M": M, "beta": q["beta"], "config": cid,
                       **alone_and_stream(calls, flusher, args.rounds, args.iters)}
                rows.append(row)
                for way in ways:
                    if way not in best or row[way] < best[way][0]:
                        best[way] = (row[way], cid)
                print(f"{name:17s} M={M:2d} b={q['beta']:4.2f} {cid:32s} alone {row['alone']:6.1f} us  "
                      f"stream {row['stream']:6.1f} us per call", flush=True)
            pct = {way: 100 * q["bytes"] / (best[way][0] * 1e-6) / 1e9 / hbm for way in ways}
            rows.append({"part": "point", "shape": name, "M": M, "beta": q["beta"], "bytes": q["bytes"],
                         "best_us": {way: best[way][0] for way in ways}, "best": {way: best[way][1] for way in ways},
                         "hbm%": pct})
            print("  point best: " + ", ".join(f"{way} {best[way][0]:6.1f} us ({pct[way]:.1f} %)" for way in ways),
                  flush=True)
        del weights
        torch.cuda.empty_cache()
    summary = [r for r in rows if r["part"] == "point"]
    for way in ways:
        n = sum(r["hbm%"][way] >= 70 for r in summary)
        low = min(summary, key=lambda r: r["hbm%"][way])
        print(f"M <= 16 points at >= 70 % of the copy rate, {way}: {n} of {len(summary)} "
              f"(lowest {low['hbm%'][way]:.1f} %, {low['shape']} M={low['M']} beta={low['beta']})")
    write_result(args.out, ceilings, rows, [], t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
