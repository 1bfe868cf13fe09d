"""`moekit trace ...`: routing traces."""

from __future__ import annotations

from moekit.commands import check_int


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

    check_int("--steps", args.steps, 1)
    check_int("--layers", args.layers, 1)
    check_int("--seed", args.seed, 0)
    trace = mixtral_capspill_trace(steps=args.steps, layers=args.layers, seed=args.seed)
    trace.save(args.out)
    print(f"wrote {args.out}: {trace.topk_ids.shape[0]} steps x {trace.topk_ids.shape[1]} layers x "
          f"{trace.topk_ids.shape[2]} tokens x top-{trace.topk_ids.shape[3]}")
    return 0


def register(sub) -> None:
    t = sub.add_parser("trace", help="routing traces").add_subparsers(dest="trace_command", required=True)
    ts = t.add_parser("stats", help="print the statistics of a routing trace (.npz)")
    ts.add_argument("file", help="a routing trace (.npz, as `moekit trace generate` or RoutingTrace.save write)")
    ts.add_argument("--world-size", type=int, default=8,
                    help="ranks for per-peer counts, >= 1, dividing the trace's experts and token rows (default 8)")
    ts.add_argument("--capacity", type=int, default=None,
                    help="report the overflow at this per-peer capacity C, >= 0 (default: none)")
    ts.add_argument("--json", action="store_true", help="print the statistics as JSON")
    ts.set_defaults(func=run_stats)
    tg = t.add_parser("generate", help="write the synthetic Mixtral-8x7B trace that matches the Cap-and-Spill paper")
    tg.add_argument("out", help="the file to write (.npz)")
    tg.add_argument("--steps", type=int, default=1000, help="sequences (forward steps), >= 1 (default 1000)")
    tg.add_argument("--layers", type=int, default=32, help="MoE layers per step, >= 1 (default 32)")
    tg.add_argument("--seed", type=int, default=0, help="random seed, >= 0 (default 0)")
    tg.set_defaults(func=run_generate)
