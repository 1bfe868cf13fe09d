"""`moekit lm ...`: a small MoE language model trained here, and it generating on moekit."""

from __future__ import annotations


def run_train(args) -> int:
    from moekit.integrations.lm.train import config_with, train

    cfg = config_with(args.preset, layers=args.layers, hidden=args.hidden, experts=args.experts, top_k=args.top_k,
                      vocab_size=args.vocab_size, seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps,
                      minutes=args.minutes, lr=args.lr, seed=args.seed)
    record = train(cfg, args.out, device=args.device, experts_impl=args.experts_impl, corpus_root=args.corpus)
    print(f"held-out loss {record['held_out_loss']:.3f} nats/token (before training "
          f"{record['held_out_loss_initial']:.3f}); model in {args.out}")
    return 0


def run_bench(args) -> int:
    from moekit.bench.report import format_table, write_record
    from moekit.integrations.lm.bench import bench_generation

    batches = _positive_ints("--batches", args.batches)
    result = bench_generation(args.model, preset=args.preset, layers=args.layers, prompts_file=args.prompts,
                              batches=batches, new_tokens=args.new_tokens, prompt_tokens=args.prompt_tokens,
                              repeats=args.repeats, implementations=tuple(args.implementations.split(",")),
                              modes=tuple(args.modes.split(",")))
    print(format_table(result["rows"], ["mode", "implementation", "batch", "tokens_per_s", "speedup_vs_transformers",
                                        "moe_share", "prefix_share", "identical_sequences"], floatfmt=".3f"))
    path = write_record("lm-e2e", result["params"], {"rows": result["rows"]}, out_dir=args.out_dir)
    print(f"record: {path}")
    return 0


def run_serve_bench(args) -> int:
    from moekit.bench.report import format_table
    from moekit.integrations.lm.serve import serve_args_to_spec, serve_bench

    spec, gpus = serve_args_to_spec(args)
    if spec.smoke:
        print("smoke run on the CPU at toy size (tiny presets, gloo ranks): it checks the code path; "
              "its numbers say nothing about serving on GPUs")
    rows = serve_bench(spec, gpus, timeout=args.timeout)
    if rows:
        print(format_table(rows, ["model", "phase", "mode", "implementation", "batch", "status", "tokens_per_s",
                                  "vs_best_transformers", "ttft_s", "peak_mem_gib", "prefix_share"], floatfmt=".3f"))
    return 0


def _positive_ints(name: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise ValueError(f"{name} must be comma-separated ints, got {text!r}") from None
    if not values or any(not 1 <= v <= 4096 for v in values):
        raise ValueError(f"{name} must be ints in [1, 4096], got {text!r}")
    return values


IMPLEMENTATIONS_HELP = ("moekit-ep", "moekit-1gpu", "transformers-tp", "transformers-ep", "transformers-device-map",
                        "transformers-1gpu")


def register(sub) -> None:
    from moekit.outputs import DEFAULT_OUT_DIR

    lm = sub.add_parser("lm", help="a small MoE language model: train it, run it on moekit")
    lm_sub = lm.add_subparsers(dest="lm_command", required=True)
    t = lm_sub.add_parser("train", help="train an OLMoE-architecture model on the Python standard library's source")
    t.add_argument("--out", required=True, help="folder for the model, tokenizer, train.json and held-out prompts")
    t.add_argument("--preset", default="tiny", help="default (one GPU, ~5 min) or tiny (CPU, seconds); default tiny")
    t.add_argument("--steps", type=int, default=None, help="train this many steps (default: the preset's; the "
                   "default preset fits its steps to --minutes)")
    t.add_argument("--minutes", type=float, default=None, help="time budget for the training steps")
    for name, kind in (("layers", int), ("hidden", int), ("experts", int), ("top-k", int), ("vocab-size", int),
                       ("seq-len", int), ("batch-size", int), ("lr", float), ("seed", int)):
        t.add_argument(f"--{name}", type=kind, default=None, help="override the preset")
    t.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    t.add_argument("--experts-impl", default="auto", help="transformers experts implementation for training: "
                   "auto (grouped_mm, else eager), grouped_mm, batched_mm, eager")
    t.add_argument("--corpus", default=None, help="folder of .py files (default: this Python's standard library)")
    t.set_defaults(func=run_train)
    b = lm_sub.add_parser("bench", help="generation on moekit vs transformers' experts, eager and compiled (one GPU)")
    which = b.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", default=None, help="a saved model folder (e.g. from `moekit lm train`)")
    which.add_argument("--preset", default=None, help="a model at real dimensions, randomly initialized: "
                       "olmoe-1b-7b, qwen3-30b-a3b, mixtral-8x7b (tiny-olmoe, tiny-qwen3, tiny-mixtral: toy size)")
    b.add_argument("--layers", type=int, default=4, help="decoder layers of a --preset model (default 4)")
    b.add_argument("--prompts", default=None, help="prompts file (.jsonl or one per line; default: the model "
                   "folder's heldout_prompts.jsonl)")
    b.add_argument("--batches", default="1,16,64,256", help="comma-separated batch sizes (default 1,16,64,256)")
    b.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    b.add_argument("--prompt-tokens", type=int, default=64, help="prompt length in tokens")
    b.add_argument("--repeats", type=int, default=3, help="timed generations per batch size (median reported)")
    b.add_argument("--implementations", default="transformers,fused,fused_fp8",
                   help="comma-separated: transformers, torch, fused, fused_fp8; fused:POLICY (e.g. fused:auto) "
                   "picks the kernel-config policy (static, default, ramp, auto)")
    b.add_argument("--modes", default="eager,compiled", help="comma-separated: eager (dynamic cache), compiled "
                   "(static cache + torch.compile(fullgraph=True, mode='reduce-overhead')); default both")
    b.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help=f"where the JSON record goes (default {DEFAULT_OUT_DIR}/)")
    b.set_defaults(func=run_bench)
    s = lm_sub.add_parser("serve-bench", help="serving on several GPUs: moekit's expert parallelism vs "
                          "transformers' tensor/expert parallelism and device_map, same run, same GPUs")
    s.add_argument("--gpus", type=int, default=None, help="ranks (GPUs) to start here (default: all visible GPUs; "
                   "2 gloo ranks on a CPU); under torchrun the world size is torchrun's")
    s.add_argument("--models", default=None, help="comma-separated presets (default olmoe-1b-7b,qwen3-30b-a3b; "
                   "tiny-olmoe,tiny-qwen3 on a CPU)")
    s.add_argument("--layers", type=int, default=None, help="decoder layers (default: each model's real depth)")
    s.add_argument("--batches", default="1,16,64,256", help="decode batch sizes per GPU (default 1,16,64,256)")
    s.add_argument("--model-batches", default=None, help="per-model batches, e.g. 'qwen3-30b-a3b=64,256;"
                   "olmoe-1b-7b=1,16' (overrides --batches for those models)")
    s.add_argument("--implementations", default=",".join(IMPLEMENTATIONS_HELP), help="comma-separated among "
                   + ", ".join(IMPLEMENTATIONS_HELP))
    s.add_argument("--experts", default=None, help="moekit experts kinds: fused (bf16), fused_fp8, torch "
                   "(default fused,fused_fp8 on GPUs, torch on a CPU)")
    s.add_argument("--modes", default=None, help="eager,compiled (default both on GPUs, eager on a CPU)")
    s.add_argument("--compiled-batches", default=None, help="batch sizes that also run compiled (default: all)")
    s.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per sequence (default 16)")
    s.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of the decode rows (default 64)")
    s.add_argument("--prefill-tokens", type=int, default=2048, help="prompt length of the prefill rows (default 2048)")
    s.add_argument("--prefill-batch", type=int, default=1, help="sequences per GPU of the prefill rows (0: none)")
    s.add_argument("--repeats", type=int, default=2, help="timed runs per row (median)")
    s.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default 0)")
    s.add_argument("--checkpoint-dir", default="/tmp/moekit-serve-checkpoints", help="where the transformers "
                   "options' checkpoint is written once and reused (not under --out-dir: it is the model's size)")
    s.add_argument("--cpu", action="store_true", help="run on the CPU (gloo); the default without CUDA")
    s.add_argument("--timeout", type=float, default=1800.0, help="seconds a rank may wait for the others")
    s.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help=f"records go to OUT_DIR/lm-serve-<device>-<n>x/ "
                   f"(default {DEFAULT_OUT_DIR}/)")
    s.set_defaults(func=run_serve_bench)
