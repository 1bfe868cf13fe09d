"""`moekit trace ...`: routing traces."""

from __future__ import annotations


def run_stats(args) -> int:
    from moekit.routing import RoutingTrace, format_stats, trace_stats

    stats = trace_stats(RoutingTrace.load(args.file), args.world_size, capacity=args.capacity)
    if args.json:
        import json

        print(json.dumps(stats.to_dict(), indent=2))
    else:
        print(format_stats(stats))
    return 0


def run_generate(args) -> int:
    from moekit.routing import mixtral_capspill_trace

    trace = mixtral_capspill_trace(steps=args.steps, layers=args.layers, seed=args.seed)
    trace.save(args.out)
    print(f"wrote {args.out}: {trace.topk_ids.shape[0]} steps x {trace.topk_ids.shape[1]} layers x "
          f"{trace.topk_ids.shape[2]} tokens x top-{trace.topk_ids.shape[3]}")
    return 0


def register(sub) -> None:
    t = sub.add_parser("trace", help="routing traces").add_subparsers(dest="trace_command", required=True)
    ts = t.add_parser("stats", help="print the statistics of a routing trace (.npz)")
    ts.add_argument("file")
    ts.add_argument("--world-size", type=int, default=8, help="ranks for per-peer counts (default 8)")
    ts.add_argument("--capacity", type=int, default=None, help="report the overflow at this per-peer capacity C")
    ts.add_argument("--json", action="store_true")
    ts.set_defaults(func=run_stats)
    tg = t.add_parser("generate", help="write the synthetic Mixtral-8x7B trace that matches the Cap-and-Spill paper")
    tg.add_argument("out")
    tg.add_argument("--steps", type=int, default=1000)
    tg.add_argument("--layers", type=int, default=32)
    tg.add_argument("--seed", type=int, default=0)
    tg.set_defaults(func=run_generate)
