"""Where the eager all-to-all dispatcher's time goes on 2 GPUs (deepseek-v3, 128 tokens/rank).

Prints: bare NCCL all_to_all_single of the same bytes (the floor of this path), the
dispatcher's dispatch and combine, and a torch.profiler table of one rank's dispatch.
Run: PYTHONPATH=src:. python3 benchmarks/probes/profile_alltoall.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.bench.stats import summarize
from moekit.bench.timing import time_distributed
from moekit.ep import AllToAllDispatcher, current_device, launch
from moekit.routing import synthetic_routing
from moekit.shapes import get_shape


def _rank(rank, world_size):
    dev, s, T = current_device(), get_shape("deepseek-v3"), 128
    ids, w = synthetic_routing(world_size * T, s.num_experts, s.top_k, seed=1)
    ids, w = ids[rank * T:(rank + 1) * T].to(dev), w[rank * T:(rank + 1) * T].to(dev)
    x = torch.randn(T, s.hidden, device=dev, dtype=torch.bfloat16)
    d = AllToAllDispatcher(s.num_experts)
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
    table = ""
    if rank == 0:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                d.dispatch(x, ids, w)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    else:
        for _ in range(20):
            d.dispatch(x, ids, w)
    return {k: summarize(v)["median"] for k, v in out.items()} | {"table": table}


if __name__ == "__main__":
    res = launch(_rank, 2)
    for k, v in res[0].items():
        if k != "table":
            print(f"{k:40s} median {v:8.1f} us")
    print(res[0]["table"])
