"""``default_dispatcher`` and ``MoELayer``'s default on two GPUs of one node (NCCL).

With NVLink peers the capability check says yes on both ranks, so a layer given ``max_tokens``
gets the low-latency layer (its symmetric-memory transport), one without it or with a shape
outside the low-latency limits gets the eager all-to-all; naming a dispatcher still wins. The
default layer's output matches the same layer over a named all-to-all within bf16 rounding
(the experts run on differently shaped batches, so not bitwise) and the float64 reference.
The CPU twin (gloo, capability faked) is tests/ep/lowlatency/test_lowlatency_default.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from moekit.ep import AllToAllDispatcher, current_device, launch

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _worker(rank: int, world_size: int) -> dict:
    from moekit.ep.lowlatency.select import lowlatency_available
    from moekit.moe.experts import MoEWeights
    from moekit.moe.layer import MoELayer, default_dispatcher
    from moekit.moe.reference import reference_moe
    from moekit.shapes import MoEShape

    device = current_device()
    shape = MoEShape("default-gpu", num_experts=4 * world_size, top_k=2, hidden=256, intermediate=128)
    E, H, K = shape.num_experts, shape.hidden, shape.top_k
    kinds = dict(available=lowlatency_available())
    kinds["default"] = type(default_dispatcher(E, hidden=H, top_k=K, max_tokens=16, dtype=torch.bfloat16)).__name__
    kinds["no_max_tokens"] = type(default_dispatcher(E, hidden=H, top_k=K, dtype=torch.bfloat16)).__name__
    kinds["float64"] = type(default_dispatcher(E, hidden=H, top_k=K, max_tokens=16, dtype=torch.float64)).__name__
    weights = MoEWeights.random(shape, seed=3, dtype=torch.bfloat16, device=device)
    cpu = weights.to(torch.float64, "cpu")
    layer = MoELayer(shape, weights, max_tokens=16)
    named = MoELayer(shape, weights, dispatcher=AllToAllDispatcher(E, hidden=H, top_k=K))
    kinds["moe_layer"] = type(layer.dispatcher).__name__
    kinds["named"] = type(named.dispatcher).__name__
    g = torch.Generator().manual_seed(10 + rank)
    errors = []
    for T in (1, 7, 16):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
        ids, w = layer.router(x)
        with torch.no_grad():
            y, y_named = layer(x, ids, w).float().cpu(), named(x, ids, w).float().cpu()
        want = reference_moe(x.double().cpu(), cpu, ids.cpu(), w.double().cpu())
        scale = want.abs().max().item()
        errors.append(dict(T=T, vs_named=(y - y_named).abs().max().item() / scale,
                           vs_float64=(y - want).abs().max().item() / scale))
    layer.dispatcher.finalize()
    return dict(kinds=kinds, errors=errors)


@needs_two_gpus
def test_two_gpus_get_the_low_latency_layer_where_it_applies():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (inherited by the ranks)
    results = launch(_worker, 2, backend="nccl", timeout=300)
    for rank, r in enumerate(results):
        k = r["kinds"]
        print(f"rank {rank}: {k}; {r['errors']}")
        assert k["available"] is True, k
        assert k["default"] == "EPLowLatencyAllToAll" and k["moe_layer"] == "EPLowLatencyAllToAll", k
        assert k["no_max_tokens"] == "AllToAllDispatcher" and k["float64"] == "AllToAllDispatcher", k
        assert k["named"] == "AllToAllDispatcher", k
        for e in r["errors"]:
            assert e["vs_named"] < 2e-2 and e["vs_float64"] < 2e-2, e
