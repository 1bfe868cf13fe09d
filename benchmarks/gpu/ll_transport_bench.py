"""Quick latency probe of the symmetric-memory transport alone (2 GPUs, CUDA-graph replay).

Times dispatch (put + receive kernels), combine (put + reduce) and the round trip at the
deepseek-v3 shape for a few token counts, and prints the in-kernel phase stamps of one
profiled step. The full benchmark with baselines is `moekit bench lowlatency`; this is the
developer's probe for tuning the kernels.

    PYTHONPATH=src:. python3 benchmarks/gpu/ll_transport_bench.py [tokens ...]
"""

from __future__ import annotations

import os
import sys

import torch


def _rank(rank, world_size, tokens_list):
    import torch.distributed as dist

    from moekit.bench.timing import capture_graph
    from moekit.ep import current_device
    from moekit.ep.lowlatency.cuda import SymmMemTransport
    from moekit.ep.lowlatency.layout import LowLatencyLayout

    device = current_device()
    rows = []
    for fp8 in (True, False):
        for T in tokens_list:
            layout = LowLatencyLayout(max_m=max(T, 1), hidden=7168, topk=8, num_experts=256, rank=rank,
                                      world_size=world_size, local_world_size=world_size, online_fp8=fp8)
            tr = SymmMemTransport(layout, dist.group.WORLD, device)
            x = torch.randn(T, 7168, device=device, dtype=torch.bfloat16)
            ids = torch.rand(T, 256, device=device).argsort(1)[:, :8].to(torch.int32).contiguous()
            w = torch.rand(T, 8, device=device)
            eo = torch.randn(layout.experts_per_rank, layout.capacity, 7168, device=device, dtype=torch.bfloat16)
            hold = {}

            def disp():
                recv = tr.dispatch(x, ids, None)
                hold["meta"] = tr.postprocess(recv)

            def comb():
                tr.combine(eo, hold["meta"], None)
                hold["y"] = tr.topk_reduce(None, ids, w, torch.bfloat16)

            def both():
                disp()
                comb()

            result = dict(tokens=T, fp8=fp8)
            for name, fn in (("dispatch", disp), ("combine", comb), ("round_trip", both)):
                g = capture_graph(fn)
                for _ in range(20):
                    g.replay()
                torch.cuda.synchronize()
                dist.barrier()
                n = 200
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
                ev[0].record()
                for i in range(n):
                    g.replay()
                    ev[i + 1].record()
                torch.cuda.synchronize()
                times = sorted(ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(n))
                result[name] = dict(median=times[n // 2], p95=times[int(n * 0.95)], min=times[0])
            # one profiled step (eager): phases in µs relative to the first stamp
            st_d = torch.full((4, 2), -1, dtype=torch.int64, device=device)
            st_c = torch.full((3, 2), -1, dtype=torch.int64, device=device)
            recv = tr.dispatch(x, ids, st_d)
            meta = tr.postprocess(recv)
            tr.combine(eo, meta, st_c)
            tr.topk_reduce(None, ids, w, torch.bfloat16)
            torch.cuda.synchronize()
            t0 = int(st_d[0, 0])
            result["phases"] = {n_: ((int(a) - t0) / 1e3, (int(b) - t0) / 1e3) for n_, (a, b) in
                                zip(("quant_and_put", "count_put", "wait", "postprocess", "copy_and_put", "recv_wait",
                                     "topk_reduce"), torch.cat([st_d, st_c]).tolist())}
            tr.close()
            rows.append(result)
    return rows


def main() -> None:
    from moekit.ep import launch

    for var, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(var, val)
    tokens = [int(a) for a in sys.argv[1:]] or [1, 8, 32, 128, 256]
    results = launch(_rank, 2, tokens, backend="nccl")
    for r in results[0]:
        print(f"T={r['tokens']:4d} fp8={r['fp8']!s:5}  " + "  ".join(
            f"{k} {r[k]['median']:7.1f} (p95 {r[k]['p95']:7.1f})" for k in ("dispatch", "combine", "round_trip")))
        print("    phases (µs from start):", {k: (round(a, 1), round(b, 1)) for k, (a, b) in r["phases"].items()})


if __name__ == "__main__":
    main()
