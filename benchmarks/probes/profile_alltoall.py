"""Where the eager all-to-all dispatcher's time goes (deepseek-v3, 128 tokens/rank, bf16).

Prints, per rank count: the bare NCCL all_to_all_single of the same bytes (the floor of this
path), the counts exchange with its host read, the dispatcher's dispatch and combine (slowest
rank, median µs), then on rank 0: a torch.profiler table of dispatch and of combine (host time
per op, kernel launches per call) and a cProfile of each (Python time per function, the host
read's wait included). Writes the chrome traces to ``--trace-dir`` when given.
Run: PYTHONPATH=src:. python3 benchmarks/probes/profile_alltoall.py --world-size 4
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
import torch.distributed as dist

from moekit.bench.stats import summarize
from moekit.bench.timing import time_distributed
from moekit.ep import AllToAllDispatcher, current_device, launch
from moekit.routing import synthetic_routing
from moekit.shapes import get_shape

CALLS = 20


def _profiled(fn, trace: str | None) -> str:
    """A torch.profiler table of ``CALLS`` calls of ``fn`` (host and device time per op)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def _python_profile(fn) -> str:
    """cProfile of ``CALLS`` calls of ``fn``: where the Python time goes, waits included."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def _rank(rank, world_size, trace_dir):
    dev, s, T = current_device(), get_shape("deepseek-v3"), 128
    ids, w = synthetic_routing(world_size * T, s.num_experts, s.top_k, seed=1)
    ids, w = ids[rank * T:(rank + 1) * T].to(dev), w[rank * T:(rank + 1) * T].to(dev)
    x = torch.randn(T, s.hidden, device=dev, dtype=torch.bfloat16)
    d = AllToAllDispatcher(s.num_experts, hidden=s.hidden, top_k=s.top_k)
    rows = T * s.top_k
    send, recv = torch.randn(rows, s.hidden, device=dev, dtype=torch.bfloat16), torch.empty(rows, s.hidden, device=dev, dtype=torch.bfloat16)
    out = {}
    out["nccl a2a, same bytes, equal splits"] = time_distributed(
        lambda: dist.all_to_all_single(recv, send), iters=300, warmup=30).max_us
    counts = torch.zeros(world_size, dtype=torch.int64, device=dev)
    out["nccl a2a of the counts + host read"] = time_distributed(
        lambda: (dist.all_to_all_single(torch.empty_like(counts), counts), counts.tolist()), iters=300, warmup=30).max_us
    out["dispatch"] = time_distributed(lambda: d.dispatch(x, ids, w), iters=300, warmup=30).max_us
    dd = d.dispatch(x, ids, w)
    out["combine"] = time_distributed(lambda: d.combine(dd.tokens, dd), iters=300, warmup=30).max_us
    res = {k: summarize(v)["median"] for k, v in out.items()}
    for name, fn in (("dispatch", lambda: d.dispatch(x, ids, w)), ("combine", lambda: d.combine(dd.tokens, dd))):
        trace = f"{trace_dir}/alltoall-{name}-{world_size}r-rank{rank}.json" if trace_dir and rank == 0 else None
        table = _profiled(fn, trace)
        python = _python_profile(fn)
        if rank == 0:
            res[f"{name} ops"], res[f"{name} python"] = table, python
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--trace-dir", default=None)
    args = ap.parse_args()
    res = launch(_rank, args.world_size, args.trace_dir)
    print(f"all-to-all dispatcher, {args.world_size} ranks, deepseek-v3, 128 tokens/rank, bf16 "
          f"(slowest rank, median µs; profiles of {CALLS} calls on rank 0)")
    for k, v in res[0].items():
        if isinstance(v, float):
            print(f"{k:40s} median {v:8.1f} us")
    for k, v in res[0].items():
        if isinstance(v, str):
            print(f"== {k}\n{v}")


if __name__ == "__main__":
    main()
