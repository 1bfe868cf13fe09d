"""Helpers shared by the developer probes of the fused MoE kernel (kernel_probe.py, ab_kernel.py,
decode_probe.py, expert_major_probe.py): timing as the bench does, the probes' expert weights,
the compile pool, the per-kernel profile and the result file. Not part of the package; the probes run from the repo root with
PYTHONPATH=src, so this directory is on sys.path as the script's own."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from collections import defaultdict
from dataclasses import fields

import torch

from moekit.bench.report import environment
from moekit.bench.stats import summarize
from moekit.bench.timing import time_cold


def probe_parser(doc: str, shapes, out: str) -> argparse.ArgumentParser:
    """The options every FP8 probe takes: shapes, timed replays, compile workers, result file."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(shapes))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--out", default=out)
    return parser


def config_of(record_or_id):
    """KernelConfig from a dataset config record, or from a ``config_id`` string."""
    from moekit.kernels import KernelConfig

    if isinstance(record_or_id, dict):
        return KernelConfig(**{f.name: record_or_id[f.name] for f in fields(KernelConfig)})
    form, *parts = record_or_id.split("-")
    v = {"bn2": 0, "swap_ab": False}
    keys = {"bm": "bm", "bn": "bn", "bk": "bk", "w": "num_warps", "s": "num_stages", "g": "group_m", "k": "split_k",
            "n": "bn2"}
    for p in parts:
        if p == "x":
            v["swap_ab"] = True
            continue
        key = next(k for k in sorted(keys, key=len, reverse=True) if p.startswith(k) and p[len(k):].isdigit())
        v[keys[key]] = int(p[len(key):])
    return KernelConfig(form="fused" if form == "F" else "two_launch", **v)


def decode_plan(table_path: str, shapes, top: int, configs=None) -> tuple[list, dict]:
    """The M <= 16 points of a bf16 dataset table that touch weights, among ``shapes``, and per
    point (keyed by ``id(point)``) the ``top`` configs that were fastest there, or ``configs``,
    each with its µs in the table (None where it was not timed): ``(points, plan)``."""
    from moekit.bench.kernel_report import load_table

    table = load_table(table_path)
    cfgs = table["configs"]
    points = [p for p in table["points"] if p["M"] <= 16 and p["weight_bytes"] > 0 and p["shape"] in shapes]
    plan = {}
    for p in points:
        idx = table["shapes"][p["shape"]]["configs"]
        timed = {cfgs[i]["id"]: t for i, t in zip(idx, p["median_us"]) if t is not None}
        plan[id(p)] = [(cid, timed.get(cid)) for cid in (configs or sorted(timed, key=timed.get)[:top])]
    return points, plan


def point_inputs(s, point: dict, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, H] bf16, topk ids and weights of a table point of bench shape ``s``, drawn as the
    probes always draw them (x from seed 7 M + 1, the routing from seed M), on ``dev``."""
    from moekit.bench.kernel import point_routing

    M = point["M"]
    g = torch.Generator(device=dev).manual_seed(7 * M + 1)
    x = torch.randn(M, s.hidden, generator=g, device=dev, dtype=torch.bfloat16)
    r = point_routing(s, M, point["beta"], M)
    return x, r.ids.to(dev), r.weights.to(dev)


def warm_routing(top_k: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing for a compile-warming call: every row to experts 0..top_k-1, weight 0.5 (CUDA)."""
    ids = torch.arange(top_k, device="cuda").repeat(rows, 1)
    return ids, torch.full(ids.shape, 0.5, device="cuda")


def median_us(fn, flusher, iters: int) -> float:
    """Median µs of ``fn`` as the bench times it: graph replay, ``flusher`` before each."""
    return summarize(time_cold(fn, iters=iters, warmup=3, capture=True, flush_bytes=0, flusher=flusher))["median"]


def ceilings_and_flusher(dev: torch.device) -> tuple[dict, object]:
    """The bench's measured ceilings (1 GiB copy, 8192^3 bf16 matmul), printed, and the 256 MB
    L2 flusher the probes time with."""
    from moekit.bench.kernel import measure_ceilings
    from moekit.bench.timing import L2Flusher

    ceilings = measure_ceilings(dev, torch.bfloat16, 1 << 30, 8192)
    print(f"ceilings: HBM copy {ceilings['hbm_gbps']:.0f} GB/s, matmul {ceilings['matmul_tflops']:.0f} TFLOP/s",
          flush=True)
    return ceilings, L2Flusher(256 << 20, dev)


def expert_weights(s, dev: torch.device, seed: int = 17) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 w13 [E, 2N, H] and w2 [E, H, N] of bench shape ``s``, drawn on the device."""
    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = torch.randn(s.num_experts, 2 * s.intermediate, s.hidden, generator=g, device=dev,
                      dtype=torch.bfloat16).mul_(s.hidden ** -0.5)
    w2 = torch.randn(s.num_experts, s.hidden, s.intermediate, generator=g, device=dev,
                     dtype=torch.bfloat16).mul_(s.intermediate ** -0.5)
    return w13, w2


def compile_in_pool(warm, tasks: list, workers: int) -> list[str]:
    """Run ``warm(task)`` (one compile-and-launch, returning an error line or None) over
    ``tasks`` in spawned processes, filling Triton's disk cache; print and return the errors."""
    t0 = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        errors = [e for e in pool.imap_unordered(warm, tasks) if e]
    print(f"compiled {len(tasks)} variants in {time.perf_counter() - t0:.0f} s, {len(errors)} failed", flush=True)
    for e in errors:
        print("  ", e)
    return errors


def warm_error(label: str, launch) -> str | None:
    """Run ``launch`` (compile-and-launch calls, in a pool worker) to the end of its GPU work:
    None, or ``label`` and the error on one line (reported; the probe goes on)."""
    try:
        launch()
        torch.cuda.synchronize()
        return None
    except Exception as error:  # noqa: BLE001
        return f"{label}: {type(error).__name__}: {str(error).splitlines()[0][:200]}"


def write_result(path: str, ceilings: dict, rows: list, errors: list, t0: float) -> None:
    with open(path, "w") as f:
        json.dump({"environment": environment(), "ceilings": ceilings, "rows": rows, "compile_errors": errors,
                   "seconds": time.perf_counter() - t0}, f, indent=1)
    print(f"done in {time.perf_counter() - t0:.0f} s -> {path}")


def kernel_breakdown(fn, flusher, iters: int = 20) -> dict[str, float]:
    """Mean GPU µs per call of each kernel ``fn`` launches (eager, one flush before each)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            if flusher is not None:
                flusher()
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name[:60]] += e.time_range.elapsed_us()
    return {k: v / iters for k, v in total.items() if "reduce_kernel" not in k}  # (the flush's sum)
