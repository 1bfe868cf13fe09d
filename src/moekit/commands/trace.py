"""`moekit trace ...`: routing traces."""

from __future__ import annotations

from moekit.commands import SEED_MAX, check_int

# `trace generate`: the largest trace, in (step, layer) pairs (10 x the default 1000 x 32). Each pair is
# 344 tokens x top-2 ids; the generator takes about a minute per 32,000 pairs on a small CPU.
MAX_GENERATE_PAIRS = 320_000


def run_stats(args) -> int:
    from moekit.bench.report import format_table
    from moekit.integrations.trace_report import LAYER_COLUMNS, layer_table
    from moekit.routing import RoutingTrace, format_stats, trace_stats
    from moekit.routing.stats import MAX_CAPACITY

    check_int("--capacity", args.capacity, 0, MAX_CAPACITY)
    trace = RoutingTrace.load(args.file)
    stats = trace_stats(trace, args.world_size, capacity=args.capacity)
    layers = layer_table(trace, args.world_size)
    if args.json:
        import json

        print(json.dumps(stats.to_dict() | {"layers": layers}, indent=2))
    else:
        print(format_stats(stats))
        print(f"\nPer layer (beta = normalized entropy of the expert load, 1 = uniform; active = share of experts "
              f"with a token in a step; per-peer count on P = {args.world_size}):")
        print(format_table(layers, LAYER_COLUMNS, floatfmt=".3f"))
    return 0


def run_generate(args) -> int:
    from moekit.outputs import check_output_file

    check_int("--steps", args.steps, 1)
    check_int("--layers", args.layers, 1)
    if args.steps * args.layers > MAX_GENERATE_PAIRS:
        raise ValueError(f"--steps x --layers must be at most {MAX_GENERATE_PAIRS:,} (step, layer) pairs, got "
                         f"{args.steps} x {args.layers}")
    check_int("--seed", args.seed, 0, SEED_MAX)
    check_output_file(args.out, "OUT")
    from moekit.routing import mixtral_capspill_trace

    trace = mixtral_capspill_trace(steps=args.steps, layers=args.layers, seed=args.seed)
    trace.save(args.out)
    print(f"wrote {args.out}: {trace.topk_ids.shape[0]} steps x {trace.topk_ids.shape[1]} layers x "
          f"{trace.topk_ids.shape[2]} tokens x top-{trace.topk_ids.shape[3]}")
    return 0


def record(args) -> int:
    """`moekit trace record`: routing traces of a saved transformers MoE model, through moekit."""
    from pathlib import Path

    import torch

    from moekit.integrations.recording import load_model, read_prompts, record_traces

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.model, device)
    prompts = read_prompts(args.prompts)
    name = args.name or Path(args.model).resolve().name
    metadata = {"model": name, "architecture": type(model).__name__, "prompts_file": Path(args.prompts).name,
                "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
    prefill, decode = record_traces(model, tokenizer, prompts, batch_size=args.batch_size,
                                    prompt_tokens=args.prompt_tokens, decode_steps=args.decode_steps,
                                    max_batches=args.max_batches, experts=args.experts, pad_multiple=args.world_size,
                                    weights=args.weights, name=name, metadata=metadata)
    prefill.save(args.out)
    print(f"wrote {args.out}: {prefill!r}")
    if decode is not None:
        decode_out = args.decode_out or str(Path(args.out).with_suffix("")) + ".decode.npz"
        decode.save(decode_out)
        print(f"wrote {decode_out}: {decode!r}")
    return 0


def run_report(args) -> int:
    from moekit.integrations.trace_report import format_report, trace_report
    from moekit.routing import RoutingTrace

    check_int("--world-size", args.world_size, 1)
    check_int("--block-size", args.block_size, 1)
    trace = RoutingTrace.load(args.file)
    E = trace.num_experts
    # The library reads 0 as "not given"; here 0 is refused. Slots: all E experts must fit on the GPUs, and a
    # GPU holds each expert at most once (more slots would only hold duplicates, and take long to place).
    check_int("--gpus", args.gpus, 1, E)
    gpus = args.gpus or args.world_size
    check_int("--slots-per-gpu", args.slots_per_gpu, -(-E // gpus), E)
    report = trace_report(trace, args.world_size, num_gpus=args.gpus, slots_per_gpu=args.slots_per_gpu,
                          block_size=args.block_size)
    if args.json:
        import json

        print(json.dumps(report, indent=2, default=float))
    else:
        print(format_report(report))
    return 0


def _register_record_and_report(t) -> None:
    tr = t.add_parser("record", help="record prefill and decode routing traces of a saved transformers MoE "
                      "model through moekit (needs the hf extra)")
    tr.add_argument("--model", required=True, help="saved model folder (config.json, weights, tokenizer)")
    tr.add_argument("--prompts", required=True, help="prompts: .jsonl (strings or {\"text\": ...}) or one per line")
    tr.add_argument("--out", required=True, help="prefill trace (.npz)")
    tr.add_argument("--decode-out", default=None, help="decode trace (default: OUT with .decode.npz)")
    tr.add_argument("--batch-size", type=int, default=8, help="prompts per batch; a multiple of --world-size "
                    "keeps decode steps free of padding rows (default 8)")
    tr.add_argument("--prompt-tokens", type=int, default=128, help="prompts are cut to this many tokens")
    tr.add_argument("--decode-steps", type=int, default=32, help="generated tokens recorded per batch (0: none)")
    tr.add_argument("--max-batches", type=int, default=None, help="stop after this many prefill batches (default: all prompts)")
    tr.add_argument("--experts", default="torch", help="moekit experts during recording: torch, fused, fused_fp8")
    tr.add_argument("--world-size", type=int, default=8, help="token rows are padded to a multiple of this")
    tr.add_argument("--weights", action="store_true", help="keep the routing weights too (larger files)")
    tr.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    tr.add_argument("--name", default=None, help="the name stored in the trace (default: the model directory's)")
    tr.set_defaults(func=record)
    rp = t.add_parser("report", help="per-layer skew, the Cap-and-Spill quantile table and EPLB vs the "
                      "padding-aware balancer for a trace (.npz)")
    rp.add_argument("file")
    rp.add_argument("--world-size", type=int, default=8, help="ranks P for per-peer counts (default 8)")
    rp.add_argument("--gpus", type=int, default=None,
                    help="GPUs for the balancers, in [1, E], dividing E (default: the world size)")
    rp.add_argument("--slots-per-gpu", type=int, default=None,
                    help="expert slots per GPU, in [ceil(E / GPUs), E] (default: E/GPUs plus a quarter more)")
    rp.add_argument("--block-size", type=int, default=64, help="kernel block rows for padded work, >= 1 (default 64)")
    rp.add_argument("--json", action="store_true", help="print the report as JSON")
    rp.set_defaults(func=run_report)


def register(sub) -> None:
    t = sub.add_parser("trace", help="routing traces").add_subparsers(dest="trace_command", required=True)
    ts = t.add_parser("stats", help="print the statistics of a routing trace (.npz)")
    ts.add_argument("file", help="a routing trace (.npz, as `moekit trace generate` or RoutingTrace.save write)")
    ts.add_argument("--world-size", type=int, default=8,
                    help="ranks for per-peer counts, >= 1, dividing the trace's experts and token rows (default 8)")
    ts.add_argument("--capacity", type=int, default=None,
                    help="report the overflow at this per-peer capacity C, in [0, 2^31 - 1] (default: ceil(Q99) "
                         "of the counts)")
    ts.add_argument("--json", action="store_true", help="print the statistics as JSON")
    ts.set_defaults(func=run_stats)
    tg = t.add_parser("generate", help="write the synthetic Mixtral-8x7B trace that matches the Cap-and-Spill paper")
    tg.add_argument("out", help="the file to write (.npz); it must not exist yet")
    tg.add_argument("--steps", type=int, default=1000,
                    help=f"sequences (forward steps), >= 1; steps x layers <= {MAX_GENERATE_PAIRS:,} (default 1000)")
    tg.add_argument("--layers", type=int, default=32, help="MoE layers per step, >= 1 (default 32)")
    tg.add_argument("--seed", type=int, default=0, help=f"random seed, in [0, {SEED_MAX}] (default 0)")
    tg.set_defaults(func=run_generate)
    _register_record_and_report(t)
