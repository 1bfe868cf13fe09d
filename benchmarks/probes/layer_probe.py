"""Developer probe: one MoE layer end to end on 2 GPUs, by expert compute (not the dataset).

``MoELayer`` over the low-latency layer (bf16 combine) for a model shape, at a few tokens per
rank: on the FP8 wire with ``torch`` experts (batched matmuls over the whole receive buffer,
after dequantizing it) and ``fused_fp8`` (W8A8, the FP8 tokens taken as they arrive); on the
bf16 wire with ``torch`` and ``fused`` (the Triton kernel, bf16 weights). Also each wire's
communication alone: dispatch and combine with a stand-in expert output (a fixed bf16
buffer), so the difference is the experts' time.

Each variant's forward (routing given, uniform, new per T) is captured in one CUDA graph;
its replays are timed with ``moekit.bench.timing.time_distributed`` (ranks aligned before each
iteration, CUDA events, the slowest rank per iteration), median and p95 of ``--iters``.

    PYTHONPATH=src:. python3 benchmarks/probes/layer_probe.py [--shape qwen3-30b-a3b] [--tokens 1 16 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

VARIANTS = (("fp8", "comm-only"), ("fp8", "torch"), ("fp8", "fused_fp8"),
            ("bf16", "comm-only"), ("bf16", "torch"), ("bf16", "fused"))  # (wire, expert compute)


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
    wires = {wire: EPLowLatencyAllToAll(max_m, shape.hidden, shape.top_k, shape.num_experts,
                                        dtype=torch.bfloat16, online_fp8=wire == "fp8") for wire in ("fp8", "bf16")}
    layers = {(wire, kind): MoELayer(shape, weights, dispatcher=wires[wire], experts=kind)
              for wire, kind in VARIANTS if kind != "comm-only"}
    ll = wires["fp8"]
    stand_in = torch.randn(ll.experts_per_rank, ll.capacity, shape.hidden, device=device, dtype=torch.bfloat16)
    rows = []
    for T in args.tokens:
        x = torch.randn(T, shape.hidden, device=device, dtype=torch.bfloat16)
        ids, w = synthetic_routing(T, shape.num_experts, shape.top_k, seed=100 * T + rank)
        ids, w = ids.to(device), w.to(device)
        for wire, kind in VARIANTS:
            if kind == "comm-only":
                def step(ll=wires[wire]):
                    return ll.combine(stand_in, ll.dispatch(x, ids, w))
            else:
                def step(layer=layers[wire, kind]):
                    return layer(x, ids, w)
            graph = capture_graph(step, warmup=3)
            times = time_distributed(graph.replay, iters=args.iters, warmup=args.warmup).max_us
            times.sort()
            row = dict(T=T, wire=wire, kind=kind, median_us=statistics.median(times),
                       p95_us=times[int(0.95 * (len(times) - 1))])
            rows.append(row)
            if rank == 0:
                print(f"T={T:4d} {wire:4s} wire {kind:10s} median {row['median_us']:8.1f} us  "
                      f"p95 {row['p95_us']:8.1f} us", flush=True)
            del graph
    for ll in wires.values():
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
    print(f"\n{args.shape}, 2 ranks, {result['device']}: MoELayer forward over the low-latency layer, "
          f"one CUDA graph, slowest rank, median µs")
    print(f"{'T':>5} " + " ".join(f"{wire + ':' + kind:>15}" for wire, kind in VARIANTS))
    for T in args.tokens:
        cells = {(r["wire"], r["kind"]): r["median_us"] for r in result["rows"] if r["T"] == T}
        print(f"{T:>5} " + " ".join(f"{cells[v]:15.1f}" for v in VARIANTS))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
