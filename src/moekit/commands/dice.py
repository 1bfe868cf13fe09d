"""`moekit dice sample | quality | bench | step`: DICE schedules for diffusion MoE models (DiT-MoE)."""

from __future__ import annotations

import sys

from moekit.commands import SEED_MAX, check_float, check_int
from moekit.outputs import DEFAULT_OUT_DIR, check_output_dir, check_output_file

MAX_SAMPLE_STEPS = 1000  # `dice sample --steps`: the DiT-MoE release samples with 50 (its diffusion schedule: 1000)
MAX_SAMPLE_BATCH = 4096  # `dice sample --batch`: images in all

# The schedule presets (moekit.dice.schedules.PRESET_NAMES), named here so that `moekit --help` does not import
# moekit.dice (and torch).
PRESET_NAMES = ("sync", "displaced", "displaced+sync", "interweaved", "interweaved+sync", "dice", "dice+sync",
                "dice-deep", "dice-interleaved", "interweaved+cond", "interweaved+latest")

# The 2 x H200 all-to-all and low-latency records this repository keeps.
DEFAULT_COMM = ("benchmarks/results/lowlatency-nvidia-h200-x2", "benchmarks/results/dispatch-nvidia-h200-x2")


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{name} must list integers >= 1, got {text!r}")
    return values


# ------------------------------------------------------------------------------------ sample


def _model_from_spec(spec: dict):
    from moekit.dice import DiTMoE, digits_config, get_config

    if spec["checkpoint"]:
        from moekit.dice.train import load_checkpoint

        model, _ = load_checkpoint(spec["checkpoint"])
        return model
    config = digits_config(hidden=32, depth=4, num_heads=2) if spec["model"] == "digits" else get_config(spec["model"])
    # Untrained: random modulation (not adaLN-Zero), so that every MoE layer shapes the output.
    return DiTMoE(config, seed=spec["seed"], adaln_zero=False)


def _sample_worker(rank: int, world_size: int, spec: dict) -> dict:
    import time

    import torch

    from moekit.dice import ScheduledMoE, make_executor, preset, sample
    from moekit.ep import AllToAllDispatcher, EPLowLatencyAllToAll, current_device

    device = current_device()
    if device.type == "cpu":
        torch.set_num_threads(1)
    model = _model_from_spec(spec).to(device)
    model.set_batch_invariant(spec["check"])
    cfg = model.config
    shape = cfg.moe_shape
    sizes = spec["sizes"]
    first = sum(sizes[:rank])
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    noise = torch.randn(sum(sizes), cfg.in_channels, cfg.input_size, cfg.input_size, generator=g)
    labels = torch.randint(0, cfg.num_classes, (sum(sizes),), generator=g)
    noise, labels = noise[first:first + sizes[rank]].to(device), labels[first:first + sizes[rank]].to(device)
    owned = []
    if spec["dispatcher"] == "alltoall":
        dispatcher = AllToAllDispatcher(shape.num_experts, hidden=shape.hidden, top_k=1)
    else:
        max_m = max(2 * s * cfg.tokens_per_image * shape.top_k for s in sizes)
        pool = {(layer, parity): EPLowLatencyAllToAll(max_m, shape.hidden, 1, shape.num_experts, dtype=torch.float32,
                                                      online_fp8=False, device=device)
                for layer in range(cfg.depth) for parity in range(2)}
        owned = list(pool.values())
        dispatcher = lambda layer, parity: pool[(layer, parity)]  # noqa: E731
    schedule = preset(spec["schedule"], spec["steps"])
    runner = ScheduledMoE(model.moe_weights(), shape, schedule, spec["steps"], dispatcher=dispatcher,
                          executor=make_executor(spec["executor"], device),
                          experts="rowwise" if spec["check"] else "torch", batch_invariant=spec["check"])
    start = time.perf_counter()
    z = sample(model, noise, labels, steps=spec["steps"], cfg_scale=spec["cfg"], moe=runner)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    runner.close()
    for layer in owned:
        layer.finalize()
    return dict(z=z.cpu(), stats=runner.stats(), seconds=seconds, labels=labels.cpu())


def run_sample(args) -> int:
    import torch

    from moekit.bench.report import cpu_smoke_line
    from moekit.dice import SchedulePlan, StalenessSimulator, preset, sample
    from moekit.ep import default_backend, launch

    # Everything is checked here, before any rank starts: a bad value is one error line, not one per rank.
    check_int("--steps", args.steps, 1, MAX_SAMPLE_STEPS)
    check_int("--batch", args.batch, 1, MAX_SAMPLE_BATCH)
    check_int("--seed", args.seed, 0, SEED_MAX)
    check_float("--cfg", args.cfg, 1.0, low_closed=True)
    check_int("--world-size", args.world_size, 1)
    if args.out:
        check_output_file(args.out, "--out")
    schedule = preset(args.schedule, args.steps)  # checks the name and the step count
    spec = dict(model=args.model, checkpoint=args.checkpoint, seed=args.seed, steps=args.steps, cfg=args.cfg,
                schedule=args.schedule, dispatcher=args.dispatcher, executor=args.executor, check=args.check)
    model = _model_from_spec(spec)
    cfg = model.config
    if cfg.num_experts % args.world_size:  # (this also bounds the ranks started)
        raise ValueError(f"--world-size must divide the model's {cfg.num_experts} experts, got {args.world_size}")
    if args.out and cfg.in_channels != 1:
        raise ValueError("--out draws single-channel (digits) samples only")
    sizes = [args.batch // args.world_size + (r < args.batch % args.world_size) for r in range(args.world_size)]
    spec["sizes"] = sizes
    plan = SchedulePlan(schedule, args.steps, cfg.depth)
    print(f"dice sample: {cfg.name} ({cfg.depth} layers, E={cfg.num_experts}, K={cfg.top_k}), "
          f"schedule '{args.schedule}' = {schedule.describe()}, {args.steps} steps, batch {sizes} on "
          f"{args.world_size} rank(s), {args.dispatcher} dispatcher, {args.executor} executor", flush=True)
    if default_backend(args.world_size) == "gloo":
        print(cpu_smoke_line("sampling time"), flush=True)
    results = launch(_sample_worker, args.world_size, spec)
    z = torch.cat([r["z"] for r in results])
    staleness = plan.staleness()
    rows = [sum(r["stats"]["rows_remote"][t] for r in results) for t in range(args.steps)]
    print(f"staleness: mean {staleness['mean']:.2f} steps, max {staleness['max']}, "
          f"asynchronous (step, layer) share {staleness['async_share']:.2f}")
    print(f"(token, slot) rows sent to other ranks per step, all ranks: {rows}")
    print(f"peak buffers held (T x K rows each), rank 0: {results[0]['stats']['peak_buffers']['total']}")
    print(f"sampling time, slowest rank: {max(r['seconds'] for r in results):.2f} s")
    ok = all(r["stats"]["sources"] == plan.source_table for r in results)
    print(f"every (step, layer) used the step the plan says: {'yes' if ok else 'NO'}")
    if args.check:
        torch.set_num_threads(1)
        model.set_batch_invariant(True)
        g = torch.Generator().manual_seed(args.seed + 1)
        noise = torch.randn(sum(sizes), cfg.in_channels, cfg.input_size, cfg.input_size, generator=g)
        labels = torch.randint(0, cfg.num_classes, (sum(sizes),), generator=g)
        sim = StalenessSimulator(model.moe_weights(), cfg.moe_shape, schedule, args.steps, batch_invariant=True,
                                 world_size=args.world_size)
        z_sim = sample(model, noise, labels, steps=args.steps, cfg_scale=args.cfg, moe=sim)
        equal = torch.equal(z, z_sim)
        print(f"bitwise equal to the single-process staleness simulator: {'yes' if equal else 'NO'}")
        ok = ok and equal
    if args.out:
        from moekit.dice.quality import write_grid_png

        print(f"wrote {write_grid_png(z, args.out, nrow=min(8, max(1, z.shape[0])))}")
    return 0 if ok else 1


# ----------------------------------------------------------------------------------- quality


def run_quality(args) -> int:
    from moekit.bench.report import cpu_smoke_line
    from moekit.dice.evaluate import QualityConfig, run_quality as recipe
    from moekit.dice.train import TrainConfig

    for flag, value in (("--hidden", args.hidden), ("--depth", args.depth), ("--heads", args.heads),
                        ("--experts", args.experts), ("--train-steps", args.train_steps),
                        ("--train-batch", args.train_batch), ("--log-every", args.log_every),
                        ("--per-class", args.per_class), ("--sample-steps", args.sample_steps),
                        ("--classifier-epochs", args.classifier_epochs)):
        check_int(flag, value, 1)
    check_int("--seed", args.seed, 0, SEED_MAX)
    check_float("--lr", args.lr, 0.0)
    check_float("--time-budget", args.time_budget, 0.0)
    check_float("--cfg", args.cfg, 1.0, low_closed=True)
    check_output_dir(args.out_dir, "--out-dir")
    schedules = tuple(s.strip() for s in args.schedules.split(",")) if args.schedules else PRESET_NAMES
    train = TrainConfig(hidden=args.hidden, depth=args.depth, num_heads=args.heads, num_experts=args.experts,
                        steps=args.train_steps, batch=args.train_batch, lr=args.lr, time_budget_s=args.time_budget,
                        log_every=args.log_every, seed=args.seed)
    qc = QualityConfig(train=train, checkpoint=args.checkpoint, schedules=schedules, per_class=args.per_class,
                       sample_steps=args.sample_steps, cfg_scale=args.cfg, classifier_epochs=args.classifier_epochs,
                       seed=args.seed, check_simulator=not args.no_check)
    device = args.device or ("cuda" if _cuda() else "cpu")
    if device == "cpu":
        print(cpu_smoke_line("FD, accuracy and PSNR (a model trained for seconds) and its timings"), flush=True)
    try:
        record = recipe(qc, device=device, out_dir=args.out_dir, progress=lambda m: print(m, flush=True))
    except RuntimeError as error:  # e.g. scikit-learn missing
        print(f"moekit: error: {error}", file=sys.stderr)
        return 2
    print((__import__("pathlib").Path(args.out_dir) / "quality.md").read_text())
    print(f"results in {args.out_dir} ({record['results']['seconds']:.0f} s)")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------------------- bench


def run_bench(args) -> int:
    import torch

    from moekit.bench.report import format_table, write_record
    from moekit.dice import accounting, get_config
    from moekit.dice.bench import memory_rows, share_rows, speed_rows, time_parts

    models = [m.strip() for m in args.models.split(",")]
    configs = [get_config(m) for m in models]
    batches = _ints(args.batches, "batches")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(args.dtype)
    if dtype is None:
        raise ValueError(f"--dtype must be one of bf16, fp16, fp32, got {args.dtype!r}")
    check_int("--world-size", args.world_size, 1)
    for config in configs:
        if config.num_experts % args.world_size:
            raise ValueError(f"--world-size must divide {config.name}'s {config.num_experts} experts, "
                             f"got {args.world_size}")
    check_int("--iters", args.iters, 1)
    check_int("--warmup", args.warmup, 0)
    check_int("--steps", args.steps, 1)
    check_output_dir(args.out_dir, "--out-dir")
    device = torch.device(args.device or ("cuda" if _cuda() else "cpu"))
    parts = []
    for config in configs:
        for batch in batches:
            print(f"timing {config.name} batch {batch} on {device} ...", flush=True)
            parts.append(time_parts(config, batch, world_size=args.world_size, dtype=dtype, device=device,
                                    iters=args.iters, warmup=args.warmup))
    part_rows = [dict(model=p["model"], batch=p["batch"], tokens=p["tokens"], **p["per_layer_us"],
                      layer_us=p["layer_us"], step_ms=p["step_compute_us"] / 1e3) for p in parts]
    print("\nper-layer time (µs) of each part, and the step's compute (ms), on", device)
    print(format_table(part_rows, list(part_rows[0]), ".4g"))
    comm = args.comm if args.comm is not None else [p for p in DEFAULT_COMM if __import__("os").path.exists(p)]
    curves = accounting.load_comm_curves(comm) if comm else {}
    speed = speed_rows(parts, curves, steps=args.steps) if curves else []
    if speed:
        print(f"\nmodelled speedup over sync: compute measured here, dispatch + combine from the curves fitted to "
              f"the records in {', '.join(str(c) for c in comm)} (all-to-all share of a sync layer-step in a2a_share):")
        print(format_table(speed, list(speed[0]), ".3g"))
    shares = share_rows({c.name: c.depth for c in configs}, steps=args.steps)
    if shares:
        print("\nmodelled speedup at the DICE paper's all-to-all shares (its Table 5):")
        print(format_table(shares, list(shares[0]), ".3g"))
    memory = memory_rows(parts, steps=args.steps)
    print("\nbuffers held (MiB per rank) and rows sent relative to sync:")
    print(format_table(memory, list(memory[0]), ".3g"))
    params = dict(models=models, batches=batches, world_size=args.world_size, dtype=args.dtype, iters=args.iters,
                  warmup=args.warmup, steps=args.steps, comm=comm,
                  comm_curves={f"{m}/{p}": dict(latency_us=c.latency_us, us_per_byte=c.us_per_byte, source=c.source)
                               for (m, p), c in curves.items()})
    path = write_record("dice-bench", params, dict(parts=parts, speed=speed, paper_shares=shares, memory=memory),
                        out_dir=args.out_dir)
    print(f"\nwrote {path}")
    return 0


# -------------------------------------------------------------------------------------- step


def _names(text: str, name: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    if not names:
        raise ValueError(f"--{name} must list at least one name, got {text!r}")
    return names


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f} %"


def run_step(args) -> int:
    from dataclasses import asdict

    import torch

    from moekit.bench.report import format_table, write_record
    from moekit.dice.measure import (CPU_DEFAULTS, GPU_DEFAULTS, TAIL, StepSpec, resolve_trace_case, run_measure,
                                     table_rows)

    device = args.device or ("cuda" if torch.cuda.device_count() >= max(args.world_size, 1) else "cpu")
    defaults = GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    spec = StepSpec(
        models=_names(args.models, "models") if args.models is not None else defaults["models"],
        batches=tuple(_ints(args.batches, "batches")) if args.batches is not None else defaults["batches"],
        dispatchers=_names(args.dispatchers, "dispatchers"), schedules=_names(args.schedules, "schedules"),
        steps=args.steps if args.steps is not None else defaults["steps"],
        warmup=args.warmup if args.warmup is not None else defaults["warmup"],
        world_size=args.world_size, device=device, dtype=args.dtype or defaults["dtype"],
        experts=args.experts or defaults["experts"], depth=args.depth, cfg=args.cfg, seed=args.seed,
        headroom_gib=args.headroom_gib, trace_dir=args.trace, trace_steps=args.trace_steps, executor=args.executor,
        capacity_factor=None if args.capacity_factor == 0 else args.capacity_factor, comm_sms=args.comm_sms,
        trace_schedules=_names(args.trace_schedules, "trace-schedules") if args.trace_schedules else None,
        stale_packing=args.stale_packing).check()
    spec = resolve_trace_case(spec)
    if not (args.timeout > 0):
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    check_output_dir(args.out_dir, "--out-dir")
    if args.trace is not None:
        check_output_dir(args.trace, "--trace")
    print(f"dice step: {', '.join(spec.models)} x local batch {', '.join(map(str, spec.batches))} x "
          f"{', '.join(spec.dispatchers)} x {', '.join(spec.schedules)} on {spec.world_size} rank(s) ({device}, "
          f"{spec.dtype}, {spec.experts} experts); {spec.warmup} warm-up + {spec.steps} timed steps per run, "
          f"guidance {spec.cfg:g}", flush=True)
    results = run_measure(spec, timeout=args.timeout)
    rows, columns = table_rows(results, spec.schedules)
    print(f"\nms per denoising step (median over {spec.steps} steps, slowest rank per step), speedup over sync "
          "(x, same model / batch / dispatcher) and the all-to-all share of a sync step (an instrumented sync run):")
    print(format_table(rows, columns, ".4g"))
    skipped = [r for r in results["rows"] + results["shares"] + results["models"] if "skipped" in r]
    for r in skipped:
        what = " ".join(str(r[k]) for k in ("model", "batch", "dispatcher", "schedule") if k in r)
        print(f"skipped {what}: {r['skipped']}")
    for t in results["traces"]:
        if "skipped" in t:
            print(f"trace {t['schedule']} rank {t['rank']}: skipped: {t['skipped']}")
            continue
        o = t["overlap"]
        fraction = "-" if o["overlap_fraction"] is None else f"{100 * o['overlap_fraction']:.1f} %"
        streams = "; ".join(f"stream {k}: {v['transfer_ms']:.2f} ms, {_percent(v['overlap_fraction'])}"
                            for k, v in o.get("by_stream", {}).items())
        print(f"trace {t['dispatcher']} {t['schedule']} rank {t['rank']}: {t['file']}: transfers "
              f"{o['transfer_ms']:.2f} ms, {fraction} of it beside compute on the compute stream ({o['kind']})"
              + (f"; per transfer stream: {streams}" if streams else ""))
    from moekit.dice.verdicts import best_rows, format_verdict, hidden_share, verdicts

    best = best_rows(results["rows"], spec.schedules)
    if best:
        print(f"\nbest dispatcher of each schedule (on), its ms, speedup over the fastest sync (x) and peak memory "
              f"per rank (GiB), {spec.world_size} ranks:")
        print(format_table(best, list(dict.fromkeys(k for line in best for k in line)), ".4g"))
    hidden = hidden_share(results["traces"])
    for name, h in hidden.items():
        print(f"hidden: {name} on {h['dispatcher']}: {h['hidden']:.1%} of the exchange ({h['hidden_ms']:.2f} of "
              f"{h['exchange_ms']:.2f} ms over the profiled steps, mean of {h['ranks']} ranks)")
    probes: dict = {}
    for p in results.get("sm_probe", []):
        probes.setdefault(p["model"], []).append(p)
    for model, ps in probes.items():
        mean = {k: sum(p[k] for p in ps) / len(ps) for k in ("compute_ms", "compute_beside_ms", "compute_slowdown",
                                                             "exchange_ms", "exchange_beside_ms", "exchange_slowdown")}
        print(f"comm SMs {spec.comm_sms or 'NCCL default'}, {model}: compute {mean['compute_ms']:.2f} ms alone, "
              f"{mean['compute_beside_ms']:.2f} ms beside the exchange ({mean['compute_slowdown']:.2f}x); exchange "
              f"{mean['exchange_ms']:.2f} ms alone, {mean['exchange_beside_ms']:.2f} ms beside compute "
              f"({mean['exchange_slowdown']:.2f}x); mean of {len(ps)} ranks")
    results["best"], results["hidden"] = best, hidden
    results["verdicts"] = verdicts(results, spec.world_size)
    for v in results["verdicts"]:
        print(format_verdict(v))
    clock = "CUDA events" if device == "cuda" else "wall clock"
    params = dict(asdict(spec), timeout=args.timeout, executors=dict(sync="inline", asynchronous="async"),
                  timing=f"{clock} between steps{' on the sampler stream' if device == 'cuda' else ''}; per step the "
                         f"slowest rank; each run's first warmup and last {TAIL} steps untimed",
                  share_timing=f"{clock} around each dispatch and combine call in an instrumented sync run")
    path = write_record("dice-step", params, results, out_dir=args.out_dir)
    print(f"\nwrote {path}")
    return 0


# ---------------------------------------------------------------------------------- register


def register(sub) -> None:
    d = sub.add_parser("dice", help="DICE: staleness-aware asynchronous expert parallelism for DiT-MoE")
    dsub = d.add_subparsers(dest="dice_command", required=True)

    s = dsub.add_parser("sample", help="sample with a schedule on local ranks (gloo on CPU, NCCL on GPUs)")
    s.add_argument("--model", default="digits", help="digits (a tiny model), dit-moe-s, dit-moe-b, dit-moe-xl, dit-moe-g")
    s.add_argument("--checkpoint", default=None, help="a trained model (moekit dice quality writes one)")
    s.add_argument("--schedule", default="dice", help=f"one of {', '.join(PRESET_NAMES)}")
    s.add_argument("--steps", type=int, default=10,
                   help=f"Euler denoising steps, in [1, {MAX_SAMPLE_STEPS}] (default 10; the release uses 50)")
    s.add_argument("--batch", type=int, default=4,
                   help=f"images in all (split over the ranks), in [1, {MAX_SAMPLE_BATCH}] (default 4)")
    s.add_argument("--world-size", type=int, default=2,
                   help="expert-parallel ranks, dividing the model's experts (default 2)")
    s.add_argument("--dispatcher", choices=("alltoall", "lowlatency"), default="alltoall",
                   help="alltoall (eager) or lowlatency (its gloo transport on CPU)")
    s.add_argument("--executor", choices=("inline", "async"), default="async",
                   help="async: communication on its own thread and stream; inline: in program order")
    s.add_argument("--cfg", type=float, default=1.5, help="classifier-free guidance scale, >= 1 (default 1.5)")
    s.add_argument("--seed", type=int, default=0, help="seed of the noise and the random weights (default 0)")
    s.add_argument("--check", action="store_true",
                   help="batch-invariant arithmetic, and compare with the staleness simulator bitwise")
    s.add_argument("--out", default=None, help="PNG of the samples (digits models); it must not exist yet")
    s.set_defaults(func=run_sample)

    q = dsub.add_parser("quality", help="train the digits DiT-MoE and measure every schedule against sync")
    q.add_argument("--out-dir", default="dice-quality", help="where the table, the PNG grids and the model go")
    q.add_argument("--checkpoint", default=None, help="evaluate this model instead of training one")
    q.add_argument("--hidden", type=int, default=32, help="model width")
    q.add_argument("--depth", type=int, default=2, help="transformer blocks (MoE layers)")
    q.add_argument("--heads", type=int, default=2, help="attention heads")
    q.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    q.add_argument("--train-steps", type=int, default=20, help="optimizer steps")
    q.add_argument("--train-batch", type=int, default=64, help="images per optimizer step")
    q.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    q.add_argument("--time-budget", type=float, default=None, help="stop training after this many seconds")
    q.add_argument("--log-every", type=int, default=10, help="print the loss every this many steps")
    q.add_argument("--per-class", type=int, default=4, help="samples per class and schedule")
    q.add_argument("--sample-steps", type=int, default=10, help="Euler steps (the release's default is 50)")
    q.add_argument("--cfg", type=float, default=1.5, help="classifier-free guidance scale, >= 1 (default 1.5)")
    q.add_argument("--classifier-epochs", type=int, default=20, help="epochs of the feature classifier")
    q.add_argument("--schedules", default=None, help=f"comma-separated, from {', '.join(PRESET_NAMES)}")
    q.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    q.add_argument("--seed", type=int, default=0, help="seed of training, noise and classifier")
    q.add_argument("--no-check", action="store_true", help="skip the simulator cross-check")
    q.set_defaults(func=run_quality)

    b = dsub.add_parser("bench", help="time the model's parts per step; model each schedule's speedup and memory")
    b.add_argument("--models", default="dit-moe-s", help="comma-separated presets (GPU: dit-moe-xl,dit-moe-g)")
    b.add_argument("--batches", default="1", help="local batch sizes (GPU: 4,8,16,32)")
    b.add_argument("--world-size", type=int, default=2, help="expert-parallel ranks the timed rank is one of")
    b.add_argument("--dtype", default="bf16", help="bf16, fp16 or fp32 (bf16 needs a GPU to be fast)")
    b.add_argument("--iters", type=int, default=3, help="timed repetitions per part")
    b.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    b.add_argument("--steps", type=int, default=50, help="denoising steps of the modelled run")
    b.add_argument("--comm", nargs="*", default=None,
                   help="records (or folders) of measured all-to-all / low-latency timings (default: "
                        f"{', '.join(DEFAULT_COMM)}, where present)")
    b.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    b.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where the JSON record goes (default %(default)s)")
    b.set_defaults(func=run_bench)

    t = dsub.add_parser("step", help="measure ms per denoising step of each schedule on real ranks (2 GPUs: NCCL)")
    t.add_argument("--models", default=None,
                   help="comma-separated presets (default: GPU dit-moe-xl,dit-moe-g; CPU digits, a tiny model)")
    t.add_argument("--depth", type=int, default=None, help="use this many blocks of each model (default: its own)")
    t.add_argument("--batches", default=None, help="local batch sizes per rank (default: GPU 4,8,16,32; CPU 1,2)")
    t.add_argument("--dispatchers", default="alltoall,lowlatency",
                   help="from alltoall (eager), lowlatency, stale (fixed capacity, no host read: the overlapping "
                        "one), stale-graph (stale, steady steps replayed from CUDA graphs)")
    t.add_argument("--schedules", default="sync,displaced,interweaved,dice",
                   help=f"comma-separated, must include sync; from {', '.join(PRESET_NAMES)}")
    t.add_argument("--steps", type=int, default=None, help="timed denoising steps per run (default: GPU 10, CPU 3)")
    t.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first, in the same run (default: GPU 2, CPU 1)")
    t.add_argument("--world-size", type=int, default=2, help="expert-parallel ranks (default 2)")
    t.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when there is a GPU per rank, else cpu (gloo)")
    t.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: GPU bf16, CPU fp32)")
    t.add_argument("--experts", default=None, help="torch or fused (the Triton kernel; default on GPUs)")
    t.add_argument("--cfg", type=float, default=1.5, help="classifier-free guidance scale (doubles the batch)")
    t.add_argument("--seed", type=int, default=0, help="seed of the weights and the noise")
    t.add_argument("--headroom-gib", type=float, default=4.0,
                   help="GPU memory to keep free when deciding whether a case fits (default 4)")
    t.add_argument("--trace", default=None, metavar="DIR",
                   help="also profile one case (first model, batch 8, the stale dispatcher if measured, else "
                        "alltoall) into Chrome traces here")
    t.add_argument("--trace-steps", type=int, default=3, help="steps the profiler records (default 3)")
    t.add_argument("--trace-schedules", default=None,
                   help="comma-separated schedules to profile (default: sync and dice, else the first asynchronous)")
    t.add_argument("--executor", choices=("auto", "inline", "stream", "async"), default="auto",
                   help="the asynchronous schedules' executor: stream (side stream, no thread; for the stale "
                        "dispatcher), async (worker thread), inline; auto: stream on stale, else async")
    t.add_argument("--capacity-factor", type=float, default=2.0,
                   help="stale dispatcher: rows per peer as this many times the balanced share (0: the exact "
                        "bound, nothing can overflow; an overflow is reported after the run; default 2)")
    t.add_argument("--stale-packing", choices=("auto", "torch", "triton"), default=None,
                   help="stale dispatcher: its fixed-buffer phases as torch ops or one-launch kernels (same bytes; "
                        "default: the dispatcher's own choice)")
    t.add_argument("--comm-sms", type=int, default=None,
                   help="stale dispatcher: NCCL thread blocks (SMs) each exchange of its side group may use "
                        "(default: NCCL's choice)")
    t.add_argument("--timeout", type=float, default=600.0, help="seconds the ranks may take (default 600)")
    t.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where the JSON record goes (default %(default)s)")
    t.set_defaults(func=run_step)
