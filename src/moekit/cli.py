"""The `moekit` command line: parse, call the library, print."""

from __future__ import annotations

import argparse
import sys

import torch


def _default_world_size() -> int:
    """4 CPU ranks, or the GPUs when there are at least two (2 or 4 of them: they must divide 8 experts)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return 4 if n >= 4 or n < 2 else 2


def cmd_demo(args) -> int:
    from moekit.demo import DemoConfig, demo_json, format_demo, run_demo

    cfg = DemoConfig(world_size=args.world_size or _default_world_size(), tokens_per_rank=args.tokens,
                     steps=args.steps, beta=args.beta, seed=args.seed)
    report = run_demo(cfg)
    print(demo_json(report) if args.json else format_demo(report))
    return 0 if report["checks"]["passed"] else 1


def cmd_trace_stats(args) -> int:
    from moekit.routing import RoutingTrace, format_stats, trace_stats

    stats = trace_stats(RoutingTrace.load(args.file), args.world_size, capacity=args.capacity)
    if args.json:
        import json

        print(json.dumps(stats.to_dict(), indent=2))
    else:
        print(format_stats(stats))
    return 0


def cmd_trace_generate(args) -> int:
    from moekit.routing import mixtral_capspill_trace

    trace = mixtral_capspill_trace(steps=args.steps, layers=args.layers, seed=args.seed)
    trace.save(args.out)
    print(f"wrote {args.out}: {trace.topk_ids.shape[0]} steps x {trace.topk_ids.shape[1]} layers x "
          f"{trace.topk_ids.shape[2]} tokens x top-{trace.topk_ids.shape[3]}")
    return 0


def cmd_bench_dispatch(args) -> int:
    from moekit.bench.dispatch import DispatchBenchConfig, format_dispatch_bench, run_dispatch_bench

    cfg = DispatchBenchConfig(shape=args.shape, tokens_per_rank=args.tokens, world_size=args.world_size,
                              dispatcher=args.dispatcher, hidden=args.hidden, top_k=args.top_k,
                              num_experts=args.num_experts, beta=args.beta, iters=args.iters,
                              warmup=args.warmup, seed=args.seed, dtype=args.dtype)
    record = run_dispatch_bench(cfg, out_dir=None if args.no_record else args.out_dir)
    print(format_dispatch_bench(record))
    return 0


def cmd_bench_capspill(args) -> int:
    from moekit.bench.capspill import main as capspill_main

    return capspill_main(args.extra)


def cmd_bench_kernel(args) -> int:
    from moekit.bench.kernel import main as kernel_main

    return kernel_main(args.extra)


def cmd_bench_lowlatency(args) -> int:
    from moekit.bench.lowlatency import main as lowlatency_main

    return lowlatency_main(args.extra)


def cmd_tax(args) -> int:
    if args.recompare:  # the model side of a saved --measure record, with other hardware numbers
        from moekit.tax.measure import format_recompare, recompare

        print(format_recompare(recompare(args.recompare, hbm_bw=args.hbm_bw and args.hbm_bw * 1e9,
                                         peak_flops=args.peak_tflops and args.peak_tflops * 1e12)))
        return 0
    if args.measure:  # time MoE / DenseFA / DensePA blocks here and check the model (moekit.tax.measure)
        from moekit.tax.measure import MeasureConfig, format_measure, run_measure

        record = run_measure(MeasureConfig(models=args.model, batch_sizes=args.batch_sizes, hardware=args.hardware,
                                           configs=args.configs, configs_from=args.configs_from, beta=args.beta,
                                           iters=args.iters), out_dir=args.out_dir)
        print(format_measure(record))
        return 0 if record["results"]["verified"] else 1
    from moekit.tax.report import tax_report

    print(tax_report(model=args.model, hardware=args.hardware, n_gpus=args.gpus, out_dir=args.figures,
                     as_json=args.json))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moekit", description="Fast expert-parallel MoE inference tools.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run a distributed MoE layer on local ranks and check it against the reference")
    d.add_argument("--world-size", type=int, default=None, help="ranks (default: 4 on CPU, the GPUs if >= 2)")
    d.add_argument("--tokens", type=int, default=128, help="tokens per rank (default 128)")
    d.add_argument("--steps", type=int, default=5)
    d.add_argument("--beta", type=float, default=0.9, help="routing balancedness target in (0, 1]")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("trace", help="routing traces").add_subparsers(dest="trace_command", required=True)
    ts = t.add_parser("stats", help="print the statistics of a routing trace (.npz)")
    ts.add_argument("file")
    ts.add_argument("--world-size", type=int, default=8, help="ranks for per-peer counts (default 8)")
    ts.add_argument("--capacity", type=int, default=None, help="report the overflow at this per-peer capacity C")
    ts.add_argument("--json", action="store_true")
    ts.set_defaults(func=cmd_trace_stats)
    tg = t.add_parser("generate", help="write the synthetic Mixtral-8x7B trace that matches the Cap-and-Spill seed")
    tg.add_argument("out")
    tg.add_argument("--steps", type=int, default=1000)
    tg.add_argument("--layers", type=int, default=32)
    tg.add_argument("--seed", type=int, default=0)
    tg.set_defaults(func=cmd_trace_generate)

    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    bd = b.add_parser("dispatch", help="dispatch/combine latency across local ranks")
    bd.add_argument("--dispatcher", default="alltoall")
    bd.add_argument("--shape", default="deepseek-v3")
    bd.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    bd.add_argument("--world-size", type=int, default=2)
    bd.add_argument("--hidden", type=int, default=None)
    bd.add_argument("--top-k", type=int, default=None)
    bd.add_argument("--num-experts", type=int, default=None)
    bd.add_argument("--beta", type=float, default=1.0)
    bd.add_argument("--iters", type=int, default=1000)
    bd.add_argument("--warmup", type=int, default=100)
    bd.add_argument("--seed", type=int, default=0)
    bd.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="bfloat16 / float16 / float32 (default: bf16 on GPU, fp32 on CPU)")
    bd.add_argument("--out-dir", default="benchmarks/results")
    bd.add_argument("--no-record", action="store_true", help="do not write a JSON record")
    bd.set_defaults(func=cmd_bench_dispatch)
    bc = b.add_parser("capspill", add_help=False,
                      help="MaxCounts vs Eager vs Cap-and-Spill on the Mixtral trace (options: --help)")
    bc.set_defaults(func=cmd_bench_capspill)
    bk = b.add_parser("kernel", add_help=False,
                      help="time every fused-MoE kernel config over M and routing skew (options: --help)")
    bk.set_defaults(func=cmd_bench_kernel)
    bl = b.add_parser("lowlatency", add_help=False,
                      help="low-latency EP layer vs all-to-all vs all_to_all_vdev_2d (options: --help)")
    bl.set_defaults(func=cmd_bench_lowlatency)

    x = sub.add_parser("tax", help="the MoE tax model: tau per batch size, dominant tax source, figures")
    x.add_argument("--model", default="mixtral-8x7b")
    x.add_argument("--hardware", default="H200")
    x.add_argument("--gpus", type=int, default=8)
    x.add_argument("--figures", default=None, help="directory to draw the seed's figures into (PNG)")
    x.add_argument("--json", action="store_true")
    x.add_argument("--measure", action="store_true", help="time the MoE, DenseFA and DensePA blocks on this device "
                   "and compare tau with the model (--model may list several, comma-separated)")
    x.add_argument("--batch-sizes", default=None, help="--measure: comma-separated m (default 1..4096; CPU 1,4,16)")
    x.add_argument("--out-dir", default="benchmarks/results", help="--measure: JSON record, PNG, hardware file go here")
    x.add_argument("--configs", type=int, default=6, help="--measure: kernel configs tried per m besides the default")
    x.add_argument("--configs-from", default=None, help="--measure: JSON of measured best kernel configs per m")
    x.add_argument("--beta", type=float, default=None, help="--measure: also time routing of this balancedness")
    x.add_argument("--iters", type=int, default=None, help="--measure: timed replays per block (GPU 100, CPU 3)")
    x.add_argument("--recompare", default=None, metavar="FILE", help="recompute the model side of a --measure record")
    x.add_argument("--hbm-bw", type=float, default=None, help="--recompare: HBM GB/s (default: the record's)")
    x.add_argument("--peak-tflops", type=float, default=None, help="--recompare: matmul TFLOP/s (default: the record's)")
    x.set_defaults(func=cmd_tax)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # `bench capspill` has its own parser (moekit.bench.capspill): hand it the rest.
    args, extra = parser.parse_known_args(argv)
    if args.func not in (cmd_bench_capspill, cmd_bench_lowlatency, cmd_bench_kernel) and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"moekit: error: {e}", file=sys.stderr)
        return 2
    except torch.multiprocessing.ProcessRaisedException as e:  # a rank failed: its last line
        last = [line for line in str(e).strip().splitlines() if line.strip()][-1]
        print(f"moekit: error in a rank: {last}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
