"""Developer probe of the low-latency layer's fixed costs (2 GPUs; not the dataset).

Times, the way `moekit bench lowlatency` does (CUDA-graph replay, steady state, iterations
queued ahead of the GPU, slowest rank, median):

* floors: a graph of one 1-program kernel per half (the harness), and a cooperative "ping"
  kernel of G programs that does only what a layer kernel does around its data (every program
  fences and takes a ticket, the last one raises the peer's counter, the waiters spin, the last
  program advances the epoch), for a few G;
* the layer (deepseek-v3 shape, FP8) at a few T for several variants of the GPU transport:
  ``old`` is a copy of an earlier ``cuda.py`` (``--old FILE``, e.g. ``git show
  2383bcf:src/moekit/ep/lowlatency/cuda.py > old.py``), the others this tree's transport with
  its module knobs set (the put splits); variants are interleaved over ``--rounds``;
* the in-kernel phase stamps of the current transport at T = 1 and 128 (medians).

    PYTHONPATH=src:. python3 benchmarks/probes/ll_probe.py [--old old.py] [--out probe.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile

import torch

VARIANTS = {  # name: the transport module's knobs (None: the --old module as it is)
    "old": None,
    "no-split": dict(MAX_DISPATCH_PUT_SPLIT=1, MAX_COMBINE_PUT_SPLIT=1),
    "split-d4-c2": dict(MAX_DISPATCH_PUT_SPLIT=4, MAX_COMBINE_PUT_SPLIT=2),
    "split-d8-c4": dict(MAX_DISPATCH_PUT_SPLIT=8, MAX_COMBINE_PUT_SPLIT=4),
}
SHAPE = dict(hidden=7168, topk=8, num_experts=256)


def _load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ping_kernel_factory():
    import triton
    import triton.language as tl

    from moekit.ep.lowlatency.cuda import _last_program_advances, _signal_arrival, _wait_all_sources

    @triton.jit
    def ping(own_ptr, state_ptr, P0, P1, P2, P3, P4, P5, P6, P7, OFF_CNT, RANK: tl.constexpr, W: tl.constexpr,
             WAITERS: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        epoch = tl.load(state_ptr + 0)
        phase = epoch & 1
        _signal_arrival(state_ptr, phase, OFF_CNT, P0, P1, P2, P3, P4, P5, P6, P7, 4, RANK, W, nprog)
        if pid < WAITERS:
            _wait_all_sources(own_ptr, OFF_CNT, phase, epoch, W)
        _last_program_advances(state_ptr, epoch, 0, 2, nprog)

    @triton.jit
    def empty(state_ptr):
        tl.store(state_ptr + 7, tl.load(state_ptr + 7) + 1)

    return ping, empty


def _time(d_fn, c_fn, bank, iters, warmup):
    from moekit.bench.lowlatency import _graphed, _time_pair

    d_run = _graphed(d_fn, True)
    d_run()
    c_run = _graphed(c_fn, True)
    s = _time_pair(d_run, c_run, bank, iters, warmup, True)
    return {k: statistics.median(v) for k, v in s.items()}


def _floors(rank, world, iters, warmup):
    import torch.distributed as dist

    from moekit.bench.lowlatency import _Bank
    from moekit.ep import current_device
    from moekit.ep.lowlatency.cuda import SymmMemTransport
    from moekit.ep.lowlatency.layout import LowLatencyLayout

    device = current_device()
    ping, empty = _ping_kernel_factory()
    layout = LowLatencyLayout(max_m=1, hidden=128, topk=2, num_experts=2 * world, rank=rank, world_size=world,
                              local_world_size=world)
    tr = SymmMemTransport(layout, dist.group.WORLD, device)
    bank = _Bank(1, 128, 2, 2 * world, 4, rank, device)
    out = {}
    state = torch.zeros(8, dtype=torch.int64, device=device)
    one = lambda: empty[(1,)](state)  # noqa: E731
    out["harness (1-program kernel)"] = _time(one, one, bank, iters, warmup)
    for grid, waiters, warps in ((1, 1, 4), (128, 128, 8), (264, 128, 8), (512, 7, 4), (512, 512, 4)):
        def run(grid=grid, waiters=waiters, warps=warps):
            ping[(grid,)](tr._buf, tr._state, *tr._peer_args, tr.off_dcnt, RANK=rank, W=world, WAITERS=waiters,
                          num_warps=warps, launch_cooperative_grid=True)
        out[f"ping G={grid} w{warps} waiters={waiters}"] = _time(run, run, bank, iters, warmup)
    torch.cuda.synchronize()
    tr.close()
    return out


def _layer_times(rank, world, variants, tokens, rounds, iters, warmup, old_path):
    import torch.distributed as dist

    import moekit.ep.lowlatency.cuda as cur
    from moekit.bench.lowlatency import _Bank
    from moekit.ep import EPLowLatencyAllToAll, current_device
    from moekit.ep.lowlatency.layout import LowLatencyLayout

    device = current_device()
    old = _load_module(old_path, "moekit_ll_probe_old_cuda") if old_path else None
    saved = {k: getattr(cur, k) for k in ("MAX_DISPATCH_PUT_SPLIT", "MAX_COMBINE_PUT_SPLIT")}
    max_m = max(tokens)
    times: dict = {}
    for r in range(rounds):
        for T in tokens:
            for name in variants:
                knobs = VARIANTS[name]
                if knobs is None and old is None:
                    continue
                module = old if knobs is None else cur
                for k, v in (knobs or {}).items():
                    setattr(cur, k, v)
                layout = LowLatencyLayout(max_m=max_m, rank=rank, world_size=world, local_world_size=world, **SHAPE)
                transport = module.SymmMemTransport(layout, dist.group.WORLD, device)
                layer = EPLowLatencyAllToAll(max_m, transport=transport, **SHAPE)
                bank = _Bank(T, SHAPE["hidden"], SHAPE["topk"], SHAPE["num_experts"], 32, rank, device)
                eo = torch.randn(layer.experts_per_rank, layer.capacity, SHAPE["hidden"], device=device).to(
                    torch.bfloat16)
                held = {}

                def d(layer=layer, bank=bank, held=held):
                    held["d"] = layer.dispatch(bank.x, bank.ids, bank.w)

                def c(layer=layer, eo=eo, held=held):
                    held["y"] = layer.combine(eo, held["d"])

                med = _time(d, c, bank, iters, warmup)
                times.setdefault(name, {}).setdefault(T, []).append(med)
                layer.finalize()
                del layer, eo, held
                for k, v in saved.items():
                    setattr(cur, k, v)
                if rank == 0:
                    print(f"[probe] round {r} T={T} {name}: " + " ".join(f"{k} {v:.1f}" for k, v in med.items()),
                          flush=True)
    # per variant and T: the median over rounds of each series
    return {name: {T: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for T, ms in by_t.items()}
            for name, by_t in times.items()}


def _phases(rank, world, tokens):
    from types import SimpleNamespace

    from moekit.bench.lowlatency import _profiled_run
    from moekit.ep import current_device

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for T in tokens:
            cfg = SimpleNamespace(trace_dir=tmp, max_m=max(tokens), online_fp8=True, routings=32, seed=0)
            prof = _profiled_run(rank, cfg, current_device(), SHAPE["hidden"], SHAPE["topk"], SHAPE["num_experts"],
                                 tokens=T)
            out[T] = prof["phases"]
    return out


def _rank(rank, world, args):
    out = {"floors": {}, "layer": {}, "phases": {}}
    if "floors" in args.parts:
        out["floors"] = _floors(rank, world, args.iters, args.warmup)
    if "layer" in args.parts:
        out["layer"] = _layer_times(rank, world, args.variants, args.tokens, args.rounds, args.iters, args.warmup,
                                    args.old)
    if "phases" in args.parts:
        out["phases"] = _phases(rank, world, (1, 128))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", default=None, help="an earlier cuda.py, measured as variant 'old'")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 128, 256])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--parts", nargs="+", default=["floors", "layer", "phases"], choices=["floors", "layer", "phases"])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    for var, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        os.environ.setdefault(var, val)
    from moekit.bench.report import environment
    from moekit.ep import launch

    results = launch(_rank, 2, args, backend="nccl", timeout_s=900)
    record = dict(environment=environment(), args=vars(args), ranks=results)
    r0 = results[0]
    for name, v in r0["floors"].items():
        print(f"floor  {name:48s} " + " ".join(f"{k} {x:6.1f}" for k, x in v.items()))
    for name, by_t in r0["layer"].items():
        for T, v in by_t.items():
            print(f"layer  {name:12s} T={T:4d} " + " ".join(f"{k} {x:6.1f}" for k, x in v.items()))
    for rank, res in enumerate(results):
        for T, ph in res["phases"].items():
            print(f"phases rank {rank} T={T}: " + ", ".join(f"{k} {v:.1f}" for k, v in ph.items()
                                                            if isinstance(v, float)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
