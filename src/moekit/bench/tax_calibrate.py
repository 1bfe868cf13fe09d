"""``moekit tax calibrate``: time a fixed set of launches on this GPU and fit the MoE-tax model's
efficiency curves (:mod:`moekit.tax.efficiency`); the result is a calibration file that
``moekit tax --hardware-file`` and ``moekit tax --measure --hardware-file`` read.

What is timed, in this order (bf16 on a GPU). None of it is a model the tax model is checked on:
the dense shapes are not any preset's FFN GEMMs and the MoE shapes are synthetic
(``tests/bench/test_tax_calibrate.py`` checks both).

1. **Ceilings** (:func:`moekit.bench.ceilings.measure_ceilings`): a 1 GiB copy and an 8192^3
   matmul. The curves are fractions of these.
2. **Elementwise** launches, ``torch.mul(src, 1.0, out=dst)`` over :data:`STREAM_BYTES` (read +
   write), four per CUDA graph (as the kernels of a block follow each other in its graph).
3. **Dense GEMMs** ``x[M, K] @ w[N, K].T`` (torch, i.e. cuBLAS, the DenseFA / DensePA / shared
   expert path) for :data:`DENSE_SHAPES` x :data:`DENSE_M`: each graph runs the GEMM on enough
   weight copies that together they are at least twice the L2, so every launch streams its
   weights from HBM, as in a block; time per launch = replay / copies.
4. **Router** (moekit's ``route``: float32 gate matmul, softmax, top-k) for
   :data:`ROUTER_SHAPES` x :data:`ROUTER_M`.
5. **The grouped expert kernel** (``moekit.kernels.fused_moe``) on :data:`GROUPED_SHAPES` at
   :data:`GROUPED_M` with near-uniform routing, and at :data:`GROUPED_SKEW_M` with routing of
   balancedness 0.8: at each point the fastest of the static default and ``configs`` sampled
   configs (the selection ``moekit tax --measure`` makes), timed over rotating input sets.
   Triton's cache is filled first by a pool of processes (``compile_workers``).

Each timed launch is a CUDA-graph replay queued ahead of the GPU and timed with CUDA events
(the timer of ``moekit tax --measure``). On the CPU everything runs at tiny sizes with the
host clock (and the expert kernel in Triton's interpreter): that checks the pipeline, not a
device. ``deadline_s`` bounds the run: the expert-kernel stage (the longest) stops where the
time is up and the curves are fitted on what was measured (with no expert-kernel points,
the dense curve stands in for the kernel, and the file says so).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

import numpy as np
import torch

from moekit.bench.ceilings import measure_ceilings
from moekit.bench.report import DEFAULT_OUT_DIR, environment, record_filename, to_jsonable
from moekit.bench.stats import summarize
from moekit.bench.tax_blocks import elem_bytes, make_moe_weights, route, run_device, skew_bias
from moekit.shapes import MoEShape
from moekit.tax.efficiency import (Calibration, LaunchSample, fit_launch, fit_router, fit_stream, gemm_features,
                                   grouped_features, save_calibration)
from moekit.tax.hardware import PRESETS, get_hardware, gpu_key

# --------------------------------------------------------------------------- what is timed

STREAM_BYTES = tuple(2**k for k in range(12, 31, 2))  # 4 KiB .. 1 GiB moved (read + write)
# (N, K) of w[N, K]: 6 MB .. 2 GB of bf16 weights, wide and deep; no preset's FFN GEMM.
DENSE_SHAPES = ((1024, 3072), (3072, 1024), (10240, 2560), (2560, 10240), (40960, 3072), (5120, 24576),
                (98304, 5120), (5120, 98304), (163840, 6144))
DENSE_M = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
ROUTER_SHAPES = ((2560, 16, 2), (4608, 96, 6), (1536, 192, 8), (6144, 48, 4))  # (H, E, K)
ROUTER_M = (1, 4, 16, 64, 256, 1024, 4096)
# Synthetic MoE shapes from coarse (few wide experts) to fine and narrow (many small ones).
GROUPED_SHAPES = (
    MoEShape("cal-coarse", num_experts=16, top_k=2, hidden=3072, intermediate=6144),
    MoEShape("cal-medium", num_experts=48, top_k=6, hidden=2560, intermediate=1536),
    MoEShape("cal-fine", num_experts=160, top_k=8, hidden=1536, intermediate=512),
    MoEShape("cal-narrow", num_experts=160, top_k=8, hidden=6144, intermediate=384),
)
GROUPED_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
GROUPED_SKEW_M = (16, 64, 256, 1024, 4096)
SKEW_BETA = 0.8

# CPU: the same pipeline at sizes the host and Triton's interpreter do in seconds.
TINY_STREAM_BYTES = (2**12, 2**16, 2**20)
TINY_DENSE_SHAPES = ((256, 128), (128, 512))
TINY_DENSE_M = (1, 4, 16, 64)
TINY_ROUTER_SHAPES = ((64, 8, 2), (32, 16, 4))
TINY_ROUTER_M = (1, 16)
TINY_GROUPED_SHAPES = (MoEShape("cal-tiny", num_experts=4, top_k=2, hidden=32, intermediate=32),)
TINY_GROUPED_M = (1, 2, 8, 16)

CHAIN_STREAM = 4  # elementwise launches per graph
MIN_GROUPED_POINTS = 4  # fewer expert-kernel points than this: no grouped curve (the dense one stands in)


@dataclass
class CalibrateConfig:
    """What :func:`run_calibrate` times. None fields take a per-device default (GPU sizes above,
    or the tiny CPU ones). ``hardware``: the preset whose network numbers the file carries
    (None: the preset of this GPU kind if there is one, else H200's). ``configs``: kernel
    configs sampled per expert-kernel shape besides the default. ``grouped``: time the expert
    kernel (needs Triton). ``deadline_s``: seconds from the start after which the expert-kernel
    stage stops."""

    device: str | None = None
    hardware: str | None = None
    configs: int | None = None  # GPU 4, CPU 0 (the interpreter is slow)
    grouped: bool = True
    iters: int | None = None
    warmup: int | None = None
    input_sets: int = 4
    deadline_s: float | None = None
    compile_workers: int | None = None
    seed: int = 0


@dataclass
class _Plan:
    device: torch.device
    dtype: torch.dtype
    on_gpu: bool
    stream_bytes: tuple
    dense_shapes: tuple
    dense_m: tuple
    router_shapes: tuple
    router_m: tuple
    grouped_shapes: tuple
    grouped_m: tuple
    skew_m: tuple
    iters: int
    warmup: int
    copy_bytes: int
    matmul_n: int
    configs: int


def _resolve(cfg: CalibrateConfig) -> _Plan:
    device, on_gpu = run_device(cfg.device)
    configs = cfg.configs if cfg.configs is not None else (4 if on_gpu else 0)
    for name, value, low in (("configs", configs, 0), ("input_sets", cfg.input_sets, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    iters = cfg.iters if cfg.iters is not None else (20 if on_gpu else 3)
    warmup = cfg.warmup if cfg.warmup is not None else (3 if on_gpu else 1)
    for name, value, low in (("iters", iters, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if cfg.deadline_s is not None and not (isinstance(cfg.deadline_s, (int, float)) and cfg.deadline_s > 0):
        raise ValueError(f"deadline_s must be a number > 0, got {cfg.deadline_s!r}")
    if cfg.hardware is not None:
        get_hardware(cfg.hardware)  # a bad name fails before anything is timed
    if on_gpu:
        return _Plan(device, torch.bfloat16, True, STREAM_BYTES, DENSE_SHAPES, DENSE_M, ROUTER_SHAPES, ROUTER_M,
                     GROUPED_SHAPES if cfg.grouped else (), GROUPED_M, GROUPED_SKEW_M, iters, warmup, 2**30, 8192,
                     configs)
    return _Plan(device, torch.float32, False, TINY_STREAM_BYTES, TINY_DENSE_SHAPES, TINY_DENSE_M,
                 TINY_ROUTER_SHAPES, TINY_ROUTER_M, TINY_GROUPED_SHAPES if cfg.grouped else (), TINY_GROUPED_M, (),
                 iters, warmup, 2**24, 256, configs)


# --------------------------------------------------------------------------- timing


def _per_launch_us(timer, fn: Callable[[], object], launches: int, iters: int) -> float:
    """Median µs of one of the ``launches`` launches that ``fn`` makes (one graph replay / launches)."""
    return summarize(timer([fn], iters))["median"] / launches


def _l2_bytes(plan: _Plan) -> int:
    if not plan.on_gpu:
        return 0
    return int(getattr(torch.cuda.get_device_properties(plan.device), "L2_cache_size", 0) or 60 * 2**20)


def time_stream(plan: _Plan, timer, say) -> list[dict]:
    """Elementwise launches: ``CHAIN_STREAM`` multiplies by 1.0 of ``bytes / 2`` per launch (read + write)."""
    elem = elem_bytes(plan.dtype)
    rows = []
    for nbytes in plan.stream_bytes:
        n = max(1, nbytes // (2 * elem))
        src = torch.rand(n, device=plan.device, dtype=torch.float32).to(plan.dtype)
        dst = torch.empty_like(src)

        def chain(src=src, dst=dst):
            for _ in range(CHAIN_STREAM):
                torch.mul(src, 1.0, out=dst)

        us = _per_launch_us(timer, chain, CHAIN_STREAM, plan.iters)
        rows.append({"bytes": 2 * n * elem, "us": us})
        del src, dst
    say(f"  elementwise: {len(rows)} sizes, {rows[0]['us']:.1f} us at {rows[0]['bytes']} B .. "
        f"{rows[-1]['us']:.1f} us at {rows[-1]['bytes'] / 2**20:.0f} MiB")
    return rows


def time_dense(plan: _Plan, timer, say, start: float) -> list[dict]:
    """Dense GEMMs ``x[M, K] @ w[N, K].T`` over enough weight copies to stream from HBM."""
    elem = elem_bytes(plan.dtype)
    l2 = _l2_bytes(plan)
    gen = torch.Generator(device=plan.device).manual_seed(7)
    rows = []
    for n, k in plan.dense_shapes:
        wbytes = n * k * elem
        copies = 1 if not plan.on_gpu else min(32, max(2, math.ceil(2 * l2 / wbytes)))
        ws = [torch.randn(n, k, generator=gen, device=plan.device, dtype=torch.float32).to(plan.dtype)
              for _ in range(copies)]
        t0 = time.perf_counter()
        for m in plan.dense_m:
            x = torch.randn(m, k, generator=gen, device=plan.device, dtype=torch.float32).to(plan.dtype)
            y = torch.empty(m, n, device=plan.device, dtype=plan.dtype)

            def chain(x=x, y=y, ws=ws):
                for w in ws:
                    torch.mm(x, w.t(), out=y)

            # Long launches (the largest shapes at large M) need fewer samples for a stable median.
            iters = plan.iters if 2 * m * n * k < 2e12 else max(5, plan.iters // 2)
            rows.append({"m": m, "n": n, "k": k, "copies": copies, "us": _per_launch_us(timer, chain, copies, iters)})
            del x, y
        say(f"  dense {n} x {k} ({wbytes / 2**20:.0f} MiB, {copies} copies): M = 1 {rows[-len(plan.dense_m)]['us']:.1f}"
            f" us .. M = {plan.dense_m[-1]} {rows[-1]['us']:.1f} us ({time.perf_counter() - t0:.1f} s, "
            f"{time.perf_counter() - start:.0f} s total)")
        del ws
        _free(plan.device)
    return rows


def time_router(plan: _Plan, timer, say) -> list[dict]:
    """moekit's router (float32 gate matmul + softmax + top-k) per (H, E, K) and m."""
    gen = torch.Generator(device=plan.device).manual_seed(11)
    rows = []
    for h, e, k in plan.router_shapes:
        router = torch.randn(e, h, generator=gen, device=plan.device, dtype=torch.float32) * h**-0.5
        bias = torch.zeros(e, device=plan.device, dtype=torch.float32)
        for m in plan.router_m:
            x = torch.randn(m, h, generator=gen, device=plan.device, dtype=torch.float32).to(plan.dtype)
            us = _per_launch_us(timer, lambda x=x: route(x, router, bias, k), 1, plan.iters)
            rows.append({"m": m, "hidden": h, "experts": e, "top_k": k, "us": us})
    say(f"  router: {len(rows)} points, {min(r['us'] for r in rows):.1f} .. {max(r['us'] for r in rows):.1f} us")
    return rows


def time_grouped(plan: _Plan, cfg: CalibrateConfig, timer, say, start: float) -> tuple[list[dict], bool]:
    """The expert kernel at every (shape, m, routing): the fastest candidate config, timed over
    the input sets. Returns (rows, complete)."""
    from moekit.bench.tax_measure import candidate_configs, sample_configs, select_config
    from moekit.bench.triton_kernels import load_kernels

    kernels = load_kernels(plan.device, "moekit tax calibrate")
    points = [(s, m, None) for s in plan.grouped_shapes for m in plan.grouped_m]
    points += [(s, m, SKEW_BETA) for s in plan.grouped_shapes for m in plan.skew_m]
    sampled = {s.name: sample_configs(s, plan.device, plan.dtype, plan.configs, cfg.seed) for s in plan.grouped_shapes}
    if plan.on_gpu:
        _warm(plan, cfg, sampled, say)
    rows, weights, current = [], None, None
    for shape, m, beta in points:
        if cfg.deadline_s is not None and time.perf_counter() - start > cfg.deadline_s:
            say(f"  deadline of {cfg.deadline_s:.0f} s reached: {len(rows)} of {len(points)} expert-kernel points timed")
            return rows, False
        if current != shape.name:
            weights = None
            _free(plan.device)
            weights, current = make_moe_weights(shape, plan.dtype, plan.device, cfg.seed + 5), shape.name
        t0 = time.perf_counter()
        gen = torch.Generator(device=plan.device).manual_seed(cfg.seed * 7919 + m)
        xs = [torch.randn(m, shape.hidden, generator=gen, device=plan.device, dtype=torch.float32).to(plan.dtype)
              for _ in range(cfg.input_sets)]
        logits = [x.to(torch.float32) @ weights.router.t() for x in xs]
        bias, realized = skew_bias(logits, shape.top_k, beta, cfg.seed + m)
        routed = [route(x, weights.router, bias, shape.top_k) for x in xs]
        best, _ = select_config(shape, xs, bias, weights, SimpleNamespace(select_iters=max(2, plan.iters // 2)),
                                timer, kernels,
                                candidate_configs(shape, m, sampled[shape.name]))
        fns = [(lambda x=x, r=r, w=weights, c=best: kernels.fused_moe(x, w.w13, w.w2, r[0], r[1], c))
               for x, r in zip(xs, routed)]
        us = summarize(timer(fns, plan.iters))["median"]
        counts = [np.bincount(r[0].reshape(-1).cpu().numpy(), minlength=shape.num_experts).tolist() for r in routed]
        rows.append({"shape": asdict(shape), "m": m, "beta": beta, "realized_beta": realized,
                     "config": asdict(best), "counts": counts, "us": us})
        say(f"  experts {shape.name:10} m={m:<5} {'uniform' if beta is None else f'beta={beta:g}':9} {us:9.1f} us "
            f"{best.id} ({time.perf_counter() - t0:.1f} s, {time.perf_counter() - start:.0f} s total)")
    del weights
    _free(plan.device)
    return rows, True


def _warm(plan: _Plan, cfg: CalibrateConfig, sampled: dict, say) -> None:
    """Fill Triton's cache for every (shape, candidate config) with a pool of processes."""
    from moekit.bench.kernel import BenchShape, warm_compile_cache
    from moekit.bench.tax_measure import candidate_configs, pool_workers

    workers = cfg.compile_workers if cfg.compile_workers is not None else min(16, os.cpu_count() or 1)
    workers = pool_workers(workers, plan.grouped_shapes, plan.dtype, plan.device)
    if workers <= 0:
        return
    jobs = []
    for s in plan.grouped_shapes:
        configs = list(dict.fromkeys(c for m in plan.grouped_m for c in candidate_configs(s, m, sampled[s.name])))
        jobs.append((BenchShape(s.name, s.num_experts, s.top_k, s.hidden, s.intermediate, s.num_experts), configs))
    t0 = time.perf_counter()
    say(f"  filling the Triton cache: {sum(len(c) for _, c in jobs)} (shape, config) pairs, {workers} processes")
    errors = warm_compile_cache(jobs, plan.grouped_m, plan.dtype, workers, say)
    say(f"  compiled in {time.perf_counter() - t0:.0f} s{f'; {len(errors)} failed' if errors else ''}")


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- the fit


def fit_calibration(ceilings: dict, stream_rows, dense_rows, router_rows, grouped_rows, *, name: str, sms: int,
                    elem: int, network, complete: bool = True) -> tuple[Calibration, dict]:
    """The :class:`Calibration` from timed rows (the ``samples`` a calibration file keeps), and
    the fits' errors on their own samples."""
    bw, peak = float(ceilings["hbm_bw"]), float(ceilings["peak_flops"])
    stream, s_rep = fit_stream([r["bytes"] for r in stream_rows], [r["us"] * 1e-6 for r in stream_rows], bw)
    dense_samples = [LaunchSample([tuple(float(v) for v in gemm_features(r["m"], r["n"], r["k"], elem))],
                                  r["us"] * 1e-6) for r in dense_rows]
    dense, d_rep = fit_launch(dense_samples, bw, peak, sms)
    router = r_rep = None
    if router_rows:
        router, r_rep = fit_router([r["m"] for r in router_rows], [r["hidden"] for r in router_rows],
                                   [r["experts"] for r in router_rows], [r["us"] * 1e-6 for r in router_rows])
    grouped = g_rep = None
    if len(grouped_rows) >= MIN_GROUPED_POINTS:
        grouped, g_rep = fit_launch([grouped_sample(r, stream, bw, elem) for r in grouped_rows], bw, peak, sms)
    reports = {"stream": s_rep.to_dict(), "dense": d_rep.to_dict(), "router": r_rep.to_dict() if r_rep else None,
               "grouped": g_rep.to_dict() if g_rep else None}
    sources = {
        "ceilings": (f"measured in the calibration run ({ceilings.get('copy_bytes', 0) / 2**20:.0f} MiB copy, read + "
                     f"write; {ceilings.get('matmul_n', '?')}^3 {ceilings.get('matmul_dtype', '')} matmul)"),
        "network": f"preset {network.name} ({network.sources.get('net_bw', '?')}; latency "
                   f"{network.sources.get('net_latency', '?')})",
        "dense": f"fitted on {len(dense_rows)} timed dense GEMMs",
        "stream": f"fitted on {len(stream_rows)} timed elementwise launches",
        "router": f"fitted on {len(router_rows)} timed router calls" if router else "not calibrated",
        "grouped": (f"fitted on {len(grouped_rows)} timed expert-kernel calls" if grouped else
                    f"not calibrated ({len(grouped_rows)} points): the dense curve stands in"),
    }
    if not complete:
        sources["grouped"] += " (stage cut short by the deadline)"
    cal = Calibration(name=name, gpu=gpu_key(name), sms=sms, hbm_bw=bw, peak_flops=peak, net_bw=network.net_bw,
                      net_latency=network.net_latency, dense=dense, stream=stream, grouped=grouped, router=router,
                      sources=sources)
    return cal, reports


def grouped_sample(row: dict, stream, bw: float, elem: int) -> LaunchSample:
    """An expert-kernel row as a fit sample: the mean features over its input sets at the chosen
    config's token block, plus the elementwise part of the sorted path (known from ``stream``)."""
    shape, c, m = MoEShape(**row["shape"]), row["config"], row["m"]
    counts = np.asarray(row["counts"], dtype=np.float64)
    active = float(np.mean((counts > 0).sum(axis=1)))
    padded = float(np.mean((np.ceil(counts / c["bm"]) * c["bm"]).sum(axis=1)))
    bn = c["bn"]
    op = tuple(float(v) for v in grouped_features(active, padded, m, shape.hidden, shape.intermediate, c["bm"], bn,
                                                  elem))
    sorted_path = m > c["bm"]
    out = m * shape.hidden
    extra = float(stream.time(4.0 * out, bw) + stream.time((4.0 + elem) * out, bw)) if sorted_path else 0.0
    return LaunchSample([op], row["us"] * 1e-6, extra, sorted_path)


# --------------------------------------------------------------------------- the run


def run_calibrate(cfg: CalibrateConfig | None = None, out_dir: str | None = DEFAULT_OUT_DIR,
                  log: Callable[[str], None] | None = print) -> tuple[Calibration, str | None]:
    """Time everything, fit, write ``tax-calibration-<device>-1x-<time>.json`` to ``out_dir``
    (None: write nothing); return the calibration and the path."""
    from moekit.bench.tax_measure import _Timer

    cfg = cfg or CalibrateConfig()
    plan = _resolve(cfg)
    say = log or (lambda s: None)
    if plan.grouped_shapes:
        # Before any torch op: on the CPU some import Triton, which must see the interpreter switch first.
        from moekit.bench.triton_kernels import load_kernels

        load_kernels(plan.device, "moekit tax calibrate")
    env = environment()
    name = torch.cuda.get_device_name(plan.device) if plan.on_gpu else env["device"]
    sms = torch.cuda.get_device_properties(plan.device).multi_processor_count if plan.on_gpu else 1
    base = cfg.hardware or next((p for p in PRESETS if gpu_key(p) == gpu_key(name)), "H200")
    network = get_hardware(base)
    timer = _Timer(plan.device, plan.warmup)
    start = time.perf_counter()
    say(f"tax calibrate on {name} ({plan.dtype}): {len(plan.stream_bytes)} elementwise sizes, "
        f"{len(plan.dense_shapes) * len(plan.dense_m)} dense GEMMs, {len(plan.router_shapes) * len(plan.router_m)} "
        f"router calls, {len(plan.grouped_shapes) * (len(plan.grouped_m) + len(plan.skew_m))} expert-kernel points"
        + ("" if plan.on_gpu else "; CPU: tiny sizes and the host clock, which checks the pipeline, not a device"))
    ceilings = measure_ceilings(plan.device, plan.dtype, plan.copy_bytes, plan.matmul_n,
                                iters=max(plan.iters, 5), warmup=plan.warmup)
    ceilings = {"hbm_bw": ceilings["hbm_gbps"] * 1e9, "peak_flops": ceilings["matmul_tflops"] * 1e12,
                **{k: v for k, v in ceilings.items() if k not in ("hbm_gbps", "matmul_tflops")}}
    say(f"  ceilings: HBM copy {ceilings['hbm_bw'] / 1e9:.1f} GB/s, {plan.matmul_n}^3 matmul "
        f"{ceilings['peak_flops'] / 1e12:.4g} TFLOP/s")
    stream_rows = time_stream(plan, timer, say)
    dense_rows = time_dense(plan, timer, say, start)
    router_rows = time_router(plan, timer, say)
    grouped_rows, complete = time_grouped(plan, cfg, timer, say, start) if plan.grouped_shapes else ([], True)
    elem = elem_bytes(plan.dtype)
    cal, reports = fit_calibration(ceilings, stream_rows, dense_rows, router_rows, grouped_rows, name=name, sms=sms,
                                   elem=elem, network=network, complete=complete)
    meta = to_jsonable({
        "environment": env, "seconds": time.perf_counter() - start, "complete": complete,
        "params": {"dtype": str(plan.dtype), "iters": plan.iters, "warmup": plan.warmup, "configs": plan.configs,
                   "input_sets": cfg.input_sets, "deadline_s": cfg.deadline_s, "base_hardware": base,
                   "timing": "CUDA-graph replays timed with CUDA events" if plan.on_gpu else "host clock (CPU)"},
        "fit": reports, "ceilings": ceilings,
        "samples": {"stream": stream_rows, "dense": dense_rows, "router": router_rows, "grouped": grouped_rows},
    })
    cal = replace(cal, meta=meta)
    for part, rep in reports.items():
        if rep:
            say(f"  fit {part:7}: {rep['n']} samples, rms error {100 * rep['rms_rel_error']:.1f} %, "
                f"largest {100 * rep['max_abs_rel_error']:.1f} %")
    path = None
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, record_filename("tax-calibration", env))
        save_calibration(cal, path)
        say(f"wrote {path}")
    say(f"done in {time.perf_counter() - start:.0f} s")
    return cal, path


# --------------------------------------------------------------------------- from existing records


RECORD_STREAM = (2e-6, 0.9)  # assumed elementwise launch (s) and fraction of the copy rate (records time none)
KERNEL_TABLE_BETAS = (1.0, 0.75)  # the kernel dataset's routings closest to those the tax check times


def calibration_from_records(tax_record, kernel_table, leave_out: str | None = None,
                             sampled: int = 6, seed: int = 0) -> Calibration:
    """A calibration built from records already measured on one GPU, without a device: a
    development aid (``moekit tax calibrate`` is the real thing; docs/tax.md).

    * ceilings: the tax record's (``moekit tax --measure``);
    * dense curve: its DenseFA and DensePA blocks (two GEMMs and SwiGLU's two elementwise passes
      each), of every model but ``leave_out``;
    * router: its router breakdown, every model but ``leave_out``;
    * grouped curve: a kernel dataset (``moekit bench kernel``, every config at every point) at
      routings of balancedness 1 and 0.75, on the shapes the tax record does not measure, taking
      at each point the fastest of the static default and ``sampled`` other configs (the
      selection ``--measure`` makes);
    * elementwise launches: assumed (:data:`RECORD_STREAM`), as neither record times any.
    """
    from moekit.bench.report import load_record
    from moekit.jsonfile import read_json
    from moekit.tax.efficiency import STREAM_KNOTS, Curve, StreamCost

    rec = load_record(tax_record, kind="tax-measure")
    table = read_json(kernel_table, "kernel table") if isinstance(kernel_table, (str, os.PathLike)) else kernel_table
    if not isinstance(table, dict) or table.get("format") != "moekit-kernel-table":
        raise ValueError(f"{kernel_table}: not a moekit-kernel-table")
    res = rec["results"]
    bw, peak = float(res["hardware"]["hbm_bw"]), float(res["hardware"]["peak_flops"])
    elem = elem_bytes(getattr(torch, rec["params"]["dtype"].removeprefix("torch.")))
    sms = 132 if gpu_key(rec["environment"]["device"]) in ("h100", "h200") else 108
    stream = StreamCost(RECORD_STREAM[0], Curve(STREAM_KNOTS, (RECORD_STREAM[1],) * len(STREAM_KNOTS)))

    dense_samples, r_m, r_h, r_e, r_t = [], [], [], [], []
    for name, mres in res["models"].items():
        if name == leave_out:
            continue
        shape = MoEShape(**mres["shape"])
        for kind in ("densefa", "densepa"):
            width = mres["dense_intermediate"][kind]
            for p in next(iter(mres["routings"].values()))["points"]:
                m = p["m"]
                ops = [tuple(float(v) for v in gemm_features(m, 2 * width, shape.hidden, elem)),
                       tuple(float(v) for v in gemm_features(m, shape.hidden, width, elem))]
                extra = float(stream.time(2 * m * width * elem, bw) + stream.time(3 * m * width * elem, bw))
                dense_samples.append(LaunchSample(ops, p[f"t_{kind}_us"]["median"] * 1e-6, extra))
        for rres in mres["routings"].values():
            for p in rres["points"]:
                if "router" in p.get("breakdown_us", {}):
                    r_m.append(p["m"]), r_h.append(shape.hidden), r_e.append(shape.num_experts)
                    r_t.append(p["breakdown_us"]["router"] * 1e-6)
    if not dense_samples:
        raise ValueError(f"{tax_record}: no model left to fit the dense curve on (leave_out={leave_out!r})")
    dense, d_rep = fit_launch(dense_samples, bw, peak, sms)
    router, r_rep = fit_router(r_m, r_h, r_e, r_t) if r_t else (None, None)

    measured = set(res["models"])
    rng = np.random.default_rng(seed)
    cfgs = table["configs"]
    pick = [0] + list(rng.choice(np.arange(1, len(cfgs)), size=min(sampled, len(cfgs) - 1), replace=False))
    grouped_samples = []
    for p in table["points"]:
        if p["shape"] in measured or p["shape"] == leave_out or p["beta"] not in KERNEL_TABLE_BETAS:
            continue
        s = table["shapes"][p["shape"]]
        times = [np.nan if v is None else float(v) for v in p["median_us"]]
        default = s["default"][str(p["M"])]
        candidates = [default] + [i for i in pick if i != default]
        best = min(candidates, key=lambda i: times[i] if np.isfinite(times[i]) else np.inf)
        if not np.isfinite(times[best]):
            continue
        c = cfgs[best]
        shape = MoEShape(p["shape"], s["num_experts"], s["top_k"], s["hidden"], s["intermediate"])
        row = {"shape": asdict(shape), "m": p["M"], "config": {"bm": c["bm"], "bn": c["bn"]},
               "counts": [p["expert_counts"]], "us": times[best]}
        grouped_samples.append(grouped_sample(row, stream, bw, elem))
    grouped, g_rep = fit_launch(grouped_samples, bw, peak, sms) if grouped_samples else (None, None)
    return Calibration(
        name=rec["environment"]["device"], gpu=gpu_key(rec["environment"]["device"]), sms=sms, hbm_bw=bw,
        peak_flops=peak, net_bw=float(res["hardware"]["net_bw"]), net_latency=float(res["hardware"]["net_latency"]),
        dense=dense, stream=stream, grouped=grouped, router=router,
        sources={"ceilings": f"the tax record's ({os.path.basename(str(tax_record))})",
                 "network": "the tax record's hardware",
                 "dense": f"fitted on {len(dense_samples)} DenseFA / DensePA blocks of the record"
                          f"{f' (not {leave_out})' if leave_out else ''}",
                 "router": f"fitted on {len(r_t)} router timings of the record" if router else "not calibrated",
                 "grouped": f"fitted on {len(grouped_samples)} points of the kernel dataset "
                            f"({os.path.basename(str(kernel_table))})" if grouped else "not calibrated",
                 "stream": f"assumed: {RECORD_STREAM[0] * 1e6:.0f} us + bytes at {100 * RECORD_STREAM[1]:.0f} % "
                           "of the copy rate"},
        meta={"from_records": True, "leave_out": leave_out,
              "fit": {"dense": d_rep.to_dict(), "router": r_rep.to_dict() if r_rep else None,
                      "grouped": g_rep.to_dict() if g_rep else None},
              "environment": rec["environment"]},
    )
