"""Developer probe: one MoE layer end to end on 2 GPUs, by expert compute (not the dataset).

``MoELayer`` over the low-latency layer (FP8 wire, bf16 combine) for a model shape, at a few
tokens per rank, with each expert compute: ``torch`` (batched matmuls over the whole
receive buffer), ``fused`` (the Triton kernel, bf16 weights) and ``fused_fp8`` (W8A8, the
FP8 tokens taken as they arrive). Also the layer's communication alone: dispatch and combine
with a stand-in expert output (a fixed bf16 buffer), so the difference is the experts' time.

Each variant's forward (routing given, uniform, new per T) is captured in one CUDA graph;
its replays are timed with ``moekit.bench.timing.time_distributed`` (ranks aligned before each
iteration, CUDA events, the slowest rank per iteration), median and p95 of ``--iters``.

    PYTHONPATH=src:. python3 benchmarks/gpu/layer_probe.py [--shape qwen3-30b-a3b] [--tokens 1 16 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

KINDS = ("comm-only", "torch", "fused", "fused_fp8")


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    from moekit.bench.timing import capture_graph, time_distributed
    from moekit.ep import EPLowLatencyAllToAll, current_device
    from moekit.moe import MoELayer, MoEWeights
    from moekit.routing.generate import synthetic_routing
    from moekit.shapes import get_shape

    device = current_device()
    shape = get_shape(args.shape)
    max_m = max(args.tokens)
    weights = MoEWeights.random(shape, seed=0, dtype=torch.bfloat16, device=device)
    ll = EPLowLatencyAllToAll(max_m, shape.hidden, shape.top_k, shape.num_experts, dtype=torch.bfloat16,
                              online_fp8=True)
    layers = {kind: MoELayer(shape, weights, dispatcher=ll, experts=kind) for kind in KINDS[1:]}
    stand_in = torch.randn(ll.experts_per_rank, ll.capacity, shape.hidden, device=device, dtype=torch.bfloat16)
    rows = []
    for T in args.tokens:
        x = torch.randn(T, shape.hidden, device=device, dtype=torch.bfloat16)
        ids, w = synthetic_routing(T, shape.num_experts, shape.top_k, seed=100 * T + rank)
        ids, w = ids.to(device), w.to(device)
        for kind in KINDS:
            if kind == "comm-only":
                def step():
                    return ll.combine(stand_in, ll.dispatch(x, ids, w))
            else:
                def step(layer=layers[kind]):
                    return layer(x, ids, w)
            graph = capture_graph(step, warmup=3)
            times = time_distributed(graph.replay, iters=args.iters, warmup=args.warmup).max_us
            times.sort()
            row = dict(T=T, kind=kind, median_us=statistics.median(times), p95_us=times[int(0.95 * (len(times) - 1))])
            rows.append(row)
            if rank == 0:
                print(f"T={T:4d} {kind:10s} median {row['median_us']:8.1f} us  p95 {row['p95_us']:8.1f} us", flush=True)
            del graph
    ll.finalize()
    return dict(rows=rows, device=torch.cuda.get_device_name(device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        os.environ.setdefault(key, value)  # never NVLink multicast (inherited by the ranks)
    from moekit.ep import launch

    result = launch(_worker, 2, args, backend="nccl", timeout_s=1200)[0]
    record = dict(shape=args.shape, world_size=2, commit=os.environ.get("MOEKIT_GIT_COMMIT", "unknown"),
                  torch=torch.__version__, iters=args.iters, **result)
    print(f"\n{args.shape}, 2 ranks, {result['device']}: MoELayer forward over the low-latency layer "
          f"(FP8 wire), one CUDA graph, slowest rank, µs")
    print(f"{'T':>5} " + " ".join(f"{k:>12}" for k in KINDS))
    for T in args.tokens:
        cells = {r["kind"]: r["median_us"] for r in result["rows"] if r["T"] == T}
        print(f"{T:>5} " + " ".join(f"{cells[k]:12.1f}" for k in KINDS))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
