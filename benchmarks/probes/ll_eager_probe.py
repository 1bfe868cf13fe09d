"""The low-latency layer's eager (ungraphed) forward against the same forward replayed as a CUDA
graph, at T = 1..128 tokens per rank, on 2 or 4 GPUs of one node.

One forward = ``dispatch`` + ``combine`` of a fixed expert output (no expert compute: the
probe times the layer), through the layer's public API, bf16 on the wire (``--fp8`` for online FP8). For
each T: the median over ``--iters`` forwards of the GPU time between CUDA events around the
eager call, of the host time of the eager call (``perf_counter``; the host runs ahead of the
GPU, so the larger of the two is what a model waits for), and of one graph replay (events).
Then a cProfile of ``--profile-calls`` eager forwards at T = 8 on rank 0 (top entries by own
time): where the host time goes. ``--layers N`` builds N layers (shared buffer) and cycles
through them, as a model does.

Usage (GPU machine, repo root):
  PYTHONPATH=src:benchmarks/probes python3 benchmarks/probes/ll_eager_probe.py --world-size 2 \
      --out "$OUT/ll_eager_probe_w2.json"
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, "src")

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)


def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else None


def _worker(rank: int, world: int, cfg: dict) -> dict:
    from moekit.bench.timing import capture_graph
    from moekit.ep import EPLowLatencyAllToAll, current_device

    device = current_device()
    H, K, E, M = cfg["hidden"], cfg["topk"], cfg["experts"], max(cfg["tokens"])
    layers = [EPLowLatencyAllToAll(M, H, K, E, dtype=torch.bfloat16, online_fp8=cfg["fp8"])
              for _ in range(cfg["layers"])]
    g = torch.Generator(device=device).manual_seed(rank)
    L = layers[0].layout
    expert_out = torch.randn(L.experts_per_rank, L.capacity, H, device=device, generator=g).to(torch.bfloat16)
    out = dict(rank=rank, world_size=world, points=[])
    which = [0]

    def forward(x, ids, w):
        layer = layers[which[0] % len(layers)]
        which[0] += 1
        d = layer.dispatch(x, ids, w)
        return layer.combine(expert_out, d)

    for T in cfg["tokens"]:
        x = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16)
        ids = torch.rand(T, E, device=device, generator=g).argsort(dim=1)[:, :K]
        w = torch.rand(T, K, device=device, generator=g)
        for _ in range(cfg["warmup"]):
            forward(x, ids, w)
        torch.cuda.synchronize()
        gpu, host = [], []
        for _ in range(cfg["iters"]):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start.record()
            forward(x, ids, w)
            end.record()
            host.append((time.perf_counter() - t0) * 1e6)
            end.synchronize()
            gpu.append(start.elapsed_time(end) * 1e3)
        torch.cuda.synchronize()
        graph = capture_graph(lambda: forward(x, ids, w))
        replay = []
        for _ in range(cfg["iters"]):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            replay.append(start.elapsed_time(end) * 1e3)
        del graph
        out["points"].append(dict(T=T, eager_gpu_us=_median(gpu), eager_host_us=_median(host),
                                  graph_us=_median(replay)))
    # every rank makes the same calls; rank 0 profiles its host time
    T = 8
    x = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, E, device=device, generator=g).argsort(dim=1)[:, :K]
    w = torch.rand(T, K, device=device, generator=g)
    pr = cProfile.Profile() if rank == 0 else None
    if pr:
        pr.enable()
    for _ in range(cfg["profile_calls"]):
        forward(x, ids, w)
    torch.cuda.synchronize()
    if pr:
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        out["profile"] = s.getvalue()
    for layer in layers:
        layer.finalize()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, choices=(2, 4, 8))
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--profile-calls", type=int, default=300)
    p.add_argument("--out", default="ll_eager_probe.json")
    args = p.parse_args()
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)
    from moekit.ep import launch

    cfg = dict(hidden=args.hidden, topk=args.topk, experts=args.experts, tokens=sorted(args.tokens),
               layers=args.layers, fp8=args.fp8, iters=args.iters, warmup=args.warmup,
               profile_calls=args.profile_calls)
    results = launch(_worker, args.world_size, cfg, backend="nccl")
    record = dict(probe="ll_eager_probe", config=cfg, world_size=args.world_size,
                  device=torch.cuda.get_device_name(0), ranks=results)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"{'T':>5} {'eager GPU us':>13} {'eager host us':>14} {'graph us':>9}   (rank 0, medians)")
    for pt in results[0]["points"]:
        print(f"{pt['T']:>5} {pt['eager_gpu_us']:>13.1f} {pt['eager_host_us']:>14.1f} {pt['graph_us']:>9.1f}")
    if results[0].get("profile"):
        print(results[0]["profile"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
