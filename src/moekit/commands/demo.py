"""`moekit demo`: a distributed MoE layer on local ranks, checked against the reference."""

from __future__ import annotations

import torch


def _default_world_size() -> int:
    """4 CPU ranks, or the GPUs when there are at least two (2 or 4 of them: they must divide 8 experts)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return 4 if n >= 4 or n < 2 else 2


def run(args) -> int:
    from moekit.demo import DemoConfig, demo_json, format_demo, run_demo

    cfg = DemoConfig(world_size=args.world_size or _default_world_size(), tokens_per_rank=args.tokens,
                     steps=args.steps, beta=args.beta, seed=args.seed)
    report = run_demo(cfg)
    print(demo_json(report) if args.json else format_demo(report))
    return 0 if report["checks"]["passed"] else 1


def register(sub) -> None:
    d = sub.add_parser("demo", help="run a distributed MoE layer on local ranks and check it against the reference")
    d.add_argument("--world-size", type=int, default=None, help="ranks (default: 4 on CPU, the GPUs if >= 2)")
    d.add_argument("--tokens", type=int, default=128, help="tokens per rank (default 128)")
    d.add_argument("--steps", type=int, default=5)
    d.add_argument("--beta", type=float, default=0.9, help="routing balancedness target in (0, 1]")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.set_defaults(func=run)
