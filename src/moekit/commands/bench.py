"""`moekit bench ...`: one benchmark per capability."""

from __future__ import annotations

import argparse

from moekit.commands import check_int
from moekit.outputs import DEFAULT_OUT_DIR, check_output_dir

DISPATCHERS = ("alltoall",)  # the dispatchers `bench dispatch` can time (moekit.bench.dispatch.DISPATCHERS)


def run_dispatch(args) -> int:
    from moekit.bench.dispatch import DispatchBenchConfig, format_dispatch_bench, run_dispatch_bench

    for flag, value, low in (("--tokens", args.tokens, 1), ("--world-size", args.world_size, 1),
                             ("--hidden", args.hidden, 1), ("--top-k", args.top_k, 1),
                             ("--num-experts", args.num_experts, 1), ("--iters", args.iters, 1),
                             ("--warmup", args.warmup, 0), ("--seed", args.seed, 0)):
        check_int(flag, value, low)
    if not 0.0 < args.beta <= 1.0:
        raise ValueError(f"--beta must be in (0, 1], got {args.beta}")
    if not args.no_record:
        check_output_dir(args.out_dir, "--out-dir")
    cfg = DispatchBenchConfig(shape=args.shape, tokens_per_rank=args.tokens, world_size=args.world_size,
                              dispatcher=args.dispatcher, hidden=args.hidden, top_k=args.top_k,
                              num_experts=args.num_experts, beta=args.beta, iters=args.iters,
                              warmup=args.warmup, seed=args.seed, dtype=args.dtype,
                              combine_order=args.combine_order)
    record = run_dispatch_bench(cfg, out_dir=None if args.no_record else args.out_dir)
    print(format_dispatch_bench(record))
    return 0


def run_capspill(args) -> int:
    from moekit.bench.capspill import main as capspill_main

    return capspill_main(args.extra)


def run_kernel(args) -> int:
    from moekit.bench.kernel import main as kernel_main

    return kernel_main(args.extra)


def run_lowlatency(args) -> int:
    from moekit.bench.lowlatency import main as lowlatency_main

    return lowlatency_main(args.extra)


def run_combine_order(args) -> int:
    from moekit.bench.combine_order import main as combine_order_main

    return combine_order_main(args.extra)


def run_ramp(args) -> int:
    from moekit.bench.ramp import main as ramp_main

    return ramp_main(args.extra)


def run_layer(args) -> int:
    from moekit.bench.layer import main_from_args

    if not args.no_record:
        check_output_dir(args.out_dir, "--out-dir")
    return main_from_args(args)


# Benchmarks with a parser of their own: the top-level parser hands them the rest of argv.
def run_experts(args) -> int:
    from moekit.bench.experts_call import main as experts_main

    return experts_main(args.extra)


PASS_THROUGH = (run_capspill, run_combine_order, run_experts, run_kernel, run_lowlatency, run_ramp)


def register(sub) -> None:
    from moekit.shapes import PRESETS

    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    bd = b.add_parser("dispatch", help="dispatch/combine latency across local ranks, against the bare all-to-all",
                      description="Time the dispatcher's dispatch, combine and both on local ranks, and the bare "
                                  "all_to_all_single of the same bytes with the same splits (the floor, both "
                                  "directions): prints ours vs the floor and GB/s per rank beside DeepEP's "
                                  "normal-mode figures; the record holds results.nccl_floor.")
    bd.add_argument("--dispatcher", default="alltoall", choices=DISPATCHERS,
                    help="the dispatcher to time: %(choices)s (default %(default)s)")
    bd.add_argument("--shape", default="deepseek-v3", choices=sorted(PRESETS), metavar="SHAPE",
                    help="model shape preset: %(choices)s (default %(default)s)")
    bd.add_argument("--tokens", type=int, default=128, help="tokens per rank, >= 1 (default 128)")
    bd.add_argument("--world-size", type=int, default=2,
                    help="local ranks, >= 1, dividing the shape's experts (default 2)")
    bd.add_argument("--hidden", type=int, default=None, help="replace the shape's hidden size H, >= 1")
    bd.add_argument("--top-k", type=int, default=None, help="replace the shape's experts per token K, >= 1")
    bd.add_argument("--num-experts", type=int, default=None, help="replace the shape's expert count E, >= 1")
    bd.add_argument("--beta", type=float, default=1.0,
                    help="routing balancedness target in (0, 1]; 1 = even (default 1.0)")
    bd.add_argument("--iters", type=int, default=None,
                    help="timed iterations per series, >= 1 (default: 1000 on GPUs, 10 on the CPU)")
    bd.add_argument("--warmup", type=int, default=None,
                    help="untimed iterations first, >= 0 (default: 100 on GPUs, 2 on the CPU)")
    bd.add_argument("--seed", type=int, default=0, help="seed of the inputs and routing, >= 0 (default 0)")
    bd.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="bfloat16 / float16 / float32 (default: bf16 on GPU, fp32 on CPU)")
    bd.add_argument("--combine-order", default="slot", choices=["slot", "rank", "both"],
                    help="the dispatcher's combine order: slot, rank (one row per (token, rank) comes back), or "
                         "both, timed in one run (default %(default)s)")
    bd.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where the JSON record goes (default %(default)s)")
    bd.add_argument("--no-record", action="store_true", help="do not write a JSON record")
    bd.set_defaults(func=run_dispatch)
    _register_layer(b, PRESETS)
    bc = b.add_parser("capspill", add_help=False,
                      help="MaxCounts vs Eager vs Cap-and-Spill on the Mixtral trace (options: --help)")
    bc.set_defaults(func=run_capspill)
    bo = b.add_parser("combine-order", add_help=False,
                      help="the slot and rank combine orders against a float64 combine (CPU; options: --help)")
    bo.set_defaults(func=run_combine_order)
    be = b.add_parser("experts", add_help=False,
                      help="one MoE block's experts call as a transformers model makes it, moekit against "
                           "transformers (one GPU; options: --help)")
    be.set_defaults(func=run_experts)
    bk = b.add_parser("kernel", add_help=False,
                      help="time every fused-MoE kernel config over M and routing skew (options: --help)")
    bk.set_defaults(func=run_kernel)
    bl = b.add_parser("lowlatency", add_help=False,
                      help="low-latency EP layer vs all-to-all vs all_to_all_vdev_2d (options: --help)")
    bl.set_defaults(func=run_lowlatency)
    br = b.add_parser("ramp", add_help=False,
                      help="RaMP's evaluation: routing-aware choice vs exhaustive, static and default (options: --help)")
    br.set_defaults(func=run_ramp)


def _register_layer(b, presets) -> None:
    """`bench layer`: its defaults are the library's (moekit.bench.layer, imported only to run)."""
    bl = b.add_parser("layer", help="one MoELayer end to end on several ranks: wire x experts x kernel choice",
                      description="Time one MoELayer forward (dispatch, experts, combine) on local ranks for each "
                                  "variant and tokens per rank, each checked once against the float64 block. "
                                  "On the CPU (gloo, Triton's interpreter, a tiny float32 shape) it checks the "
                                  "command, not numbers.")
    bl.add_argument("--shape", default=None, choices=sorted(presets) + ["tiny-layer"], metavar="SHAPE",
                    help="MoE shape, one of %(choices)s: a preset, or tiny-layer (E=4, top-2, H=N=128) "
                         "(default: qwen3-30b-a3b on GPUs, tiny-layer on the CPU)")
    bl.add_argument("--tokens", type=int, nargs="+", default=None,
                    help="tokens per rank, each >= 1 (default: 1 16 128 on GPUs, 1 4 on the CPU)")
    bl.add_argument("--world-size", type=int, default=2,
                    help="local ranks (one GPU each under NCCL), >= 1, dividing the experts (default 2)")
    bl.add_argument("--variants", nargs="+", default=["ll-fp8+fused_fp8+auto", "ll-fp8+fused_fp8+static",
                                                      "alltoall+fused_fp8+static"], metavar="VARIANT",
                    help="what to time, each WIRE+EXPERTS[+CONFIG][@eager]: WIRE ll-fp8 (low-latency layer, FP8 "
                         "dispatch, bf16 combine), ll-bf16, alltoall (eager all-to-all); EXPERTS torch, fused, "
                         "fused_fp8; CONFIG auto (RaMP) or static (the kernel's default), for fused experts; "
                         "@eager: no CUDA graph for this one. The first is the ratios' base (default: "
                         "ll-fp8+fused_fp8+auto ll-fp8+fused_fp8+static alltoall+fused_fp8+static)")
    bl.add_argument("--iters", type=int, default=None,
                    help="timed iterations per point, >= 1 (default: 200 on GPUs, 3 on the CPU)")
    bl.add_argument("--warmup", type=int, default=None,
                    help="untimed iterations first, >= 0 (default: 20 on GPUs, 1 on the CPU)")
    bl.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None,
                    help="capture each variant's forward in a CUDA graph where its dispatcher allows (the eager "
                         "all-to-all never; it is timed eagerly) (default: on GPUs; the CPU has no graphs)")
    bl.add_argument("--routings", type=int, default=8,
                    help="random routings per rank and T, cycled through, >= 1; keep --warmup at least this, so "
                         "every kernel config auto picks is compiled before the timed loop (default %(default)s)")
    bl.add_argument("--seed", type=int, default=0, help="seed of the weights, tokens and routings, >= 0 "
                                                        "(default %(default)s)")
    bl.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                    help="where the JSON record and the figure go (default %(default)s)")
    bl.add_argument("--no-record", action="store_true", help="write no record or figure")
    bl.set_defaults(func=run_layer)
