"""`moekit bench dispatch`: dispatch and combine latency of a dispatcher across ranks.

Each rank holds ``tokens_per_rank`` tokens of the chosen shape and a pool of routings
(synthetic, balancedness ``beta``; rotated per iteration so no two consecutive iterations
reuse one). Three things are timed, all ranks aligned before every iteration, the
slowest rank's time taken per iteration (``moekit.bench.timing.time_distributed``):

* dispatch alone;
* combine alone (of an earlier dispatch of the same routing; identity experts);
* the round trip dispatch -> combine.

``combine_order`` picks the dispatcher's combine order: ``"slot"``, ``"rank"`` (series
named ``"... [rank]"``), or ``"both"`` (both timed in one run). The record also holds the
rows and bytes each rank's combine sends in each order (the rank order returns one row per
(token, rank) instead of one per slot).

The floor: the same ranks also time a bare ``dist.all_to_all_single`` of the same bytes with
the same splits, in both directions (the dispatch's rows out, the combine's rows back),
aligned and taken per iteration the same way. ``results["nccl_floor"]`` holds it (``median``
of the two back to back, in µs, and each direction's summary; ``"nccl_floor [rank]"`` for the
rank order, whose combine sends fewer rows), and ``results["vs_floor"]`` the ratio of our
dispatch + combine median to it: how far the dispatcher is from the wire. Our rows carry 16
bytes of metadata more than the floor's (token, slot, group, weight), under 0.2% at H = 7168.

Bandwidth: the bytes each rank sends in dispatch plus those it sends back in combine over
the dispatch + combine median, in GB/s per rank (``results["gbps_per_rank"]``), printed
beside DeepEP's normal-mode figures (:data:`DEEPEP_NORMAL_GBPS`).

The JSON record (``moekit.bench.report.write_record``) holds the environment (device,
GPU count, versions, commit), the parameters, and the summary of every series.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, replace
from itertools import cycle

import torch
import torch.distributed as dist

from moekit.bench.report import DEFAULT_OUT_DIR, format_table, write_record
from moekit.bench.stats import summarize
from moekit.bench.timing import time_distributed
from moekit.ep import AllToAllDispatcher, current_device, default_backend, launch
from moekit.routing import synthetic_routing
from moekit.shapes import get_shape

DISPATCHERS = {"alltoall": AllToAllDispatcher}

# DeepEP's normal (high-throughput) kernels, intranode, 8 ranks over NVLink on H800, as its
# README's "Normal kernels with NVLink and RDMA forwarding" table gives them (bandwidth per
# rank, the bottleneck link's): dispatch 153 GB/s (FP8 rows), combine 158 GB/s (BF16 rows).
# A reference point to read ours against, not a measurement of this machine.
DEEPEP_NORMAL_GBPS = {"dispatch": 153.0, "combine": 158.0,
                      "source": "DeepEP README, normal kernels, intranode EP=8, H800 NVLink"}
FLOOR_PHASES = ("dispatch", "combine", "dispatch+combine")
COMBINE_ORDER_CHOICES = ("slot", "rank", "both")
PHASES = ("dispatch", "combine", "dispatch+combine")


def series_key(phase: str, order: str) -> str:
    """``dispatch`` (slot order) or ``dispatch [rank]``."""
    return phase if order == "slot" else f"{phase} [{order}]"


# Timed iterations and warm-up by device: on the CPU (gloo) one deepseek-v3 dispatch takes
# about 0.1 s, so the GPU's counts would run for minutes.
GPU_DEFAULTS = {"iters": 1000, "warmup": 100}
CPU_DEFAULTS = {"iters": 10, "warmup": 2}


@dataclass(frozen=True)
class DispatchBenchConfig:
    shape: str = "deepseek-v3"
    tokens_per_rank: int = 128
    world_size: int = 2
    dispatcher: str = "alltoall"
    hidden: int | None = None  # override the preset's
    top_k: int | None = None
    num_experts: int | None = None
    beta: float = 1.0
    iters: int | None = None  # default: GPU_DEFAULTS / CPU_DEFAULTS
    warmup: int | None = None
    pool: int = 16  # routings rotated through
    seed: int = 0
    dtype: str | None = None  # default: bfloat16 on GPU, float32 on CPU
    combine_order: str = "slot"  # slot, rank, or both

    @property
    def orders(self) -> tuple[str, ...]:
        return ("slot", "rank") if self.combine_order == "both" else (self.combine_order,)

    def resolved_shape(self):
        s = get_shape(self.shape)
        return s.scaled(hidden=self.hidden or s.hidden, top_k=self.top_k or s.top_k,
                        num_experts=self.num_experts or s.num_experts)

    @property
    def shape_label(self) -> str:
        """The preset's name, or what the shape is when its sizes were changed."""
        changed = [n for n in ("hidden", "top_k", "num_experts") if getattr(self, n) is not None]
        return self.shape if not changed else f"{self.shape} with {', '.join(changed)} changed"

    def for_device(self, on_gpu: bool) -> "DispatchBenchConfig":
        """A copy with the unset counts taken from the device's defaults."""
        defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})


def _bench_rank(rank: int, world_size: int, cfg: DispatchBenchConfig) -> dict:
    device = current_device()
    shape = cfg.resolved_shape()
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    T = cfg.tokens_per_rank
    gen = torch.Generator().manual_seed(cfg.seed * 131 + rank)
    pool = []
    for i in range(cfg.pool):
        # Routing of all ranks' tokens from one seed, so the pool is consistent across ranks.
        ids, w = synthetic_routing(world_size * T, shape.num_experts, shape.top_k, beta=cfg.beta,
                                   seed=cfg.seed * 10_000 + i)
        x = torch.randn(T, shape.hidden, generator=gen).to(device=device, dtype=dtype)
        pool.append((x, ids[rank * T:(rank + 1) * T].to(device), w[rank * T:(rank + 1) * T].to(device)))
    out = {}
    for order in cfg.orders:
        dispatcher = DISPATCHERS[cfg.dispatcher](shape.num_experts, hidden=shape.hidden, top_k=shape.top_k,
                                                 combine_order=order)
        dispatched = [dispatcher.dispatch(*p) for p in pool]
        inputs, pairs = cycle(pool), cycle(dispatched)
        series = {
            "dispatch": lambda: dispatcher.dispatch(*next(inputs)),
            "combine": lambda: (lambda d: dispatcher.combine(d.tokens, d))(next(pairs)),
            "dispatch+combine": lambda: (lambda d: dispatcher.combine(d.tokens, d))(
                dispatcher.dispatch(*next(inputs))),
        }
        for phase, fn in series.items():
            name = series_key(phase, order)
            start = time.perf_counter()
            times = time_distributed(fn, iters=cfg.iters, warmup=cfg.warmup)
            out[name] = times.max_us
            if rank == 0:
                print(f"[bench dispatch] {name}: {cfg.iters} iterations after {cfg.warmup} warm-up, "
                      f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        combine_rows = [d.handle.state["combine_rows"] for d in dispatched]
        out[series_key("combine_rows_mean", order)] = sum(combine_rows) / len(combine_rows)
        for phase, times in _time_floor(dispatched, order, shape.hidden, dtype, device, cfg).items():
            out[series_key(f"floor {phase}", order)] = times
            if rank == 0:
                print(f"[bench dispatch] bare all-to-all, {series_key(phase, order)}: done", file=sys.stderr,
                      flush=True)
    rows_sent = [sum(d.handle.state["send_splits"]) for d in dispatched]
    rows_remote = [sum(d.handle.state["send_splits"]) - d.handle.state["send_splits"][rank] for d in dispatched]
    out["rows_sent_mean"] = sum(rows_sent) / len(rows_sent)
    out["rows_remote_mean"] = sum(rows_remote) / len(rows_remote)
    out["bytes_per_row"] = shape.hidden * torch.empty((), dtype=dtype).element_size()
    out["device"] = str(device)
    out["dtype"] = str(dtype).removeprefix("torch.")
    return out


def _time_floor(dispatched: list, order: str, hidden: int, dtype: torch.dtype, device: torch.device,
                cfg: DispatchBenchConfig) -> dict[str, list[float]]:
    """The bare ``all_to_all_single`` of each pooled step's rows, with its splits: dispatch's
    (rows out), combine's (rows back: one per (token, slot), or per (token, rank) in the rank
    order), and the two back to back; samples of the slowest rank, µs."""
    steps = []
    for d in dispatched:
        st = d.handle.state
        send, recv = st["send_splits"], st["recv_splits"]
        back_out, back_in = (st["partial_splits"], st["return_splits"]) if order == "rank" else (recv, send)

        def rows(n):
            return torch.randn(sum(n), hidden, device=device).to(dtype)

        steps.append(((rows(recv), rows(send), recv, send), (rows(back_in), rows(back_out), back_in, back_out)))
    pool = cycle(steps)

    def exchange(out, inp, out_splits, in_splits):
        dist.all_to_all_single(out, inp, out_splits, in_splits)

    def both():
        go, back = next(pool)
        exchange(*go)
        exchange(*back)

    fns = {"dispatch": lambda: exchange(*next(pool)[0]), "combine": lambda: exchange(*next(pool)[1]),
           "dispatch+combine": both}
    return {phase: time_distributed(fn, iters=cfg.iters, warmup=cfg.warmup).max_us for phase, fn in fns.items()}


def floor_summary(ours: dict, floor: dict, dispatch_bytes: float, combine_bytes: float) -> dict:
    """``nccl_floor``: the bare all-to-all's dispatch + combine summary (``median`` etc., µs),
    each direction's, the bytes, and the bandwidth it reaches per rank."""
    both = floor["dispatch+combine"]
    total = dispatch_bytes + combine_bytes
    return dict(both, dispatch=floor["dispatch"], combine=floor["combine"], bytes_per_rank=total,
                gbps_per_rank=total / both["median"] / 1e3 if both["median"] > 0 else float("nan"),
                what="dist.all_to_all_single of the same rows with the same splits, dispatch then combine")


def run_dispatch_bench(cfg: DispatchBenchConfig, *, out_dir: str | None = DEFAULT_OUT_DIR) -> dict:
    """Run the benchmark on ``cfg.world_size`` local ranks; write and return the record."""
    if cfg.dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher must be one of {sorted(DISPATCHERS)}, got {cfg.dispatcher!r}")
    backend = default_backend(cfg.world_size) if isinstance(cfg.world_size, int) and cfg.world_size >= 1 else None
    cfg = cfg.for_device(backend == "nccl")
    for name, low in (("world_size", 1), ("tokens_per_rank", 0), ("iters", 1), ("warmup", 0), ("pool", 1),
                      ("seed", 0)):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    shape = cfg.resolved_shape()
    shape.experts_per_rank(cfg.world_size)  # raises when P does not divide E
    if not 0 < cfg.beta <= 1:
        raise ValueError(f"beta must be in (0, 1], got {cfg.beta}")
    if cfg.dtype not in (None, "bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {cfg.dtype!r}")
    if cfg.combine_order not in COMBINE_ORDER_CHOICES:
        raise ValueError(f"combine_order must be one of {list(COMBINE_ORDER_CHOICES)}, got {cfg.combine_order!r}")
    print(f"[bench dispatch] {cfg.dispatcher} on {cfg.world_size} ranks ({backend}), {cfg.shape_label}, "
          f"{cfg.tokens_per_rank} tokens/rank: {3 * len(cfg.orders)} series of {cfg.iters} iterations", file=sys.stderr,
          flush=True)
    ranks = launch(_bench_rank, cfg.world_size, cfg, backend=backend)
    first = ranks[0]
    results = {series_key(phase, order): summarize(first[series_key(phase, order)])
               for order in cfg.orders for phase in PHASES}
    for order in cfg.orders:  # what combine sends back, per rank (the rank order: one row per (token, rank))
        rows = sum(r[series_key("combine_rows_mean", order)] for r in ranks) / len(ranks)
        results[series_key("combine_rows_per_rank_mean", order)] = rows
        results[series_key("combine_bytes_per_rank_mean", order)] = rows * first["bytes_per_row"]
    results["rows_sent_per_rank_mean"] = sum(r["rows_sent_mean"] for r in ranks) / len(ranks)
    dispatch_bytes = results["rows_sent_per_rank_mean"] * first["bytes_per_row"]
    for order in cfg.orders:  # the bare all-to-all of the same bytes, and how far we are from it
        floor = {phase: summarize(first[series_key(f"floor {phase}", order)]) for phase in FLOOR_PHASES}
        combine_bytes = results[series_key("combine_bytes_per_rank_mean", order)]
        results[series_key("nccl_floor", order)] = floor_summary(results, floor, dispatch_bytes, combine_bytes)
        ours = results[series_key("dispatch+combine", order)]["median"]
        results[series_key("vs_floor", order)] = ours / floor["dispatch+combine"]["median"]
        results[series_key("gbps_per_rank", order)] = (dispatch_bytes + combine_bytes) / ours / 1e3
    results["deepep_normal_gbps_reference"] = DEEPEP_NORMAL_GBPS
    results["bytes_sent_per_rank_mean"] = results["rows_sent_per_rank_mean"] * first["bytes_per_row"]
    # Rows a rank sends to itself never cross the link: the bytes that do are these.
    results["bytes_to_other_ranks_mean"] = (sum(r["rows_remote_mean"] for r in ranks) / len(ranks)
                                            * first["bytes_per_row"])
    params = asdict(cfg) | {"shape_label": cfg.shape_label, "shape_resolved": asdict(shape), "backend": backend,
                            "dtype": first["dtype"],
                            "timing": "slowest rank per iteration; ranks aligned before each iteration"}
    record = {"params": params, "results": results}
    if out_dir is not None:
        record["path"] = str(write_record("dispatch", params, results, out_dir=out_dir))
    return record


def format_dispatch_bench(record: dict) -> str:
    p, r = record["params"], record["results"]
    s = p["shape_resolved"]
    head = (f"{p['dispatcher']} dispatcher, {p['world_size']} ranks ({p['backend']}), "
            f"{p.get('shape_label', p['shape'])}: "
            f"E={s['num_experts']} top-{s['top_k']} H={s['hidden']}, {p['tokens_per_rank']} tokens/rank, "
            f"{p['dtype']}, {p['iters']} iterations after {p['warmup']} warm-up\n"
            f"rows sent per rank (mean): {r['rows_sent_per_rank_mean']:.0f} "
            f"({r['bytes_sent_per_rank_mean'] / 1e6:.2f} MB, of which "
            f"{r.get('bytes_to_other_ranks_mean', float('nan')) / 1e6:.2f} MB to other ranks)\n")
    orders = ("slot", "rank") if p.get("combine_order") == "both" else (p.get("combine_order", "slot"),)
    for order in orders:
        key = series_key("combine_bytes_per_rank_mean", order)
        if key in r:
            head += (f"combine, {order} order: {r[series_key('combine_rows_per_rank_mean', order)]:.0f} rows per rank "
                     f"({r[key] / 1e6:.2f} MB)\n")
    rows = [{"phase": series_key(k, order), **{c: r[series_key(k, order)][c]
                                               for c in ("median", "p95", "p99", "mean", "min")}}
            for order in orders for k in PHASES]
    for order in orders:
        floor = r.get(series_key("nccl_floor", order))
        if floor is None:
            continue
        rows += [{"phase": series_key(f"bare all-to-all {k}", order), **{c: (floor if k == "dispatch+combine"
                                                                             else floor[k])[c]
                                                                         for c in ("median", "p95", "p99", "mean",
                                                                                   "min")}}
                 for k in FLOOR_PHASES]
    table = format_table(rows, ["phase", "median", "p95", "p99", "mean", "min"])
    for order in orders:
        floor = r.get(series_key("nccl_floor", order))
        if floor is None:
            continue
        ref = r.get("deepep_normal_gbps_reference", DEEPEP_NORMAL_GBPS)
        table += (f"\n{order} order: dispatch+combine {r[series_key('dispatch+combine', order)]['median']:.1f} µs vs "
                  f"the bare all-to-all of the same bytes {floor['median']:.1f} µs: "
                  f"{r[series_key('vs_floor', order)]:.2f}x the floor (goal: at most 3x); "
                  f"{r[series_key('gbps_per_rank', order)]:.2f} GB/s per rank (floor {floor['gbps_per_rank']:.2f}; "
                  f"DeepEP normal mode {ref['dispatch']:.0f}/{ref['combine']:.0f} GB/s dispatch/combine, "
                  f"{ref['source']})")
    tail = f"\n(µs, slowest rank per iteration){chr(10) + 'record: ' + record['path'] if 'path' in record else ''}"
    return head + table + tail
