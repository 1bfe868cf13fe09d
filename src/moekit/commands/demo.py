"""`moekit demo`: a distributed MoE layer on local ranks, checked against the reference."""

from __future__ import annotations

from moekit.commands import check_int

DEMO_EXPERTS = 8  # the demo's scaled-down Mixtral: the world size must divide its experts
MAX_DEMO_TOKENS = 16384  # tokens per rank: beyond a real batch, the float64 reference check only takes long


def _default_world_size() -> int:
    """4 CPU ranks, or the GPUs when there are at least two (2 or 4 of them: they must divide 8 experts)."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return 4 if n >= 4 or n < 2 else 2


def run(args) -> int:
    from moekit.demo import DemoConfig, demo_json, format_demo, run_demo

    if args.world_size is not None and args.world_size < 1:  # (a size that does not divide 8: run_demo says so)
        raise ValueError(f"--world-size must be 1, 2, 4 or 8 (ranks sharing the demo's {DEMO_EXPERTS} experts), "
                         f"got {args.world_size}")
    check_int("--tokens", args.tokens, 1, MAX_DEMO_TOKENS)
    check_int("--steps", args.steps, 1)
    if not 0.0 < args.beta <= 1.0:
        raise ValueError(f"--beta must be in (0, 1], got {args.beta}")
    world_size = args.world_size if args.world_size is not None else _default_world_size()
    cfg = DemoConfig(world_size=world_size, tokens_per_rank=args.tokens, steps=args.steps, beta=args.beta,
                     seed=args.seed)
    # The header at once and a line per step as it ends (stderr with --json, which keeps stdout JSON).
    report = run_demo(cfg, progress="stderr" if args.json else "stdout")
    print(demo_json(report) if args.json else format_demo(report, header=False))
    return 0 if report["checks"]["passed"] else 1


def register(sub) -> None:
    d = sub.add_parser("demo", help="run a distributed MoE layer on local ranks and check it against the reference")
    d.add_argument("--world-size", type=int, default=None,
                   help="ranks: 1, 2, 4 or 8 (they share 8 experts; default: 4 on CPU, the GPUs if >= 2)")
    d.add_argument("--tokens", type=int, default=128,
                   help=f"tokens per rank, in [1, {MAX_DEMO_TOKENS}] (default 128)")
    d.add_argument("--steps", type=int, default=5, help="forward steps, each with new routing, >= 1 (default 5)")
    d.add_argument("--beta", type=float, default=0.9,
                   help="routing balancedness target in (0, 1]; 1 = even (default 0.9)")
    d.add_argument("--seed", type=int, default=0, help="seed of the weights, inputs and routing (default 0)")
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.set_defaults(func=run)
