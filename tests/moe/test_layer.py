"""The distributed MoELayer against the float64 single-process reference.

Tolerance: the layer runs in float32 (matmuls over H and N of a few hundred, SwiGLU, a
K-term weighted sum); float32 rounding then gives a relative error of order 1e-7 * sqrt(H),
well under 1e-5, while any routing or placement mistake gives an error of order 1. The
bound is 1e-5 in relative Frobenius norm.
"""

from __future__ import annotations

import pytest
import torch

from moekit.ep import launch
from moekit.moe import MoELayer, MoEWeights, TopKRouter, reference_moe, reference_routing
from moekit.shapes import MoEShape

SHAPES = [
    MoEShape("tiny-mixtral", num_experts=8, top_k=2, hidden=64, intermediate=96),
    MoEShape("tiny-shared", num_experts=8, top_k=3, hidden=48, intermediate=32,
             num_shared_experts=2, shared_intermediate=16),
]
REL_TOL = 1e-5


def _layer_worker(rank, world_size, shape, tokens_per_rank):
    weights = MoEWeights.random(shape, seed=11)
    layer = MoELayer(shape, weights, rank=rank, world_size=world_size)
    x = torch.randn(tokens_per_rank[rank], shape.hidden, generator=torch.Generator().manual_seed(100 + rank))
    ids, w = layer.router(x)
    return dict(x=x, y=layer(x), ids=ids, w=w)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_layer_matches_float64_reference(world_size, shape):
    tokens = [17, 0, 9, 30][:world_size]
    results = launch(_layer_worker, world_size, shape, tokens, backend="gloo")
    weights = MoEWeights.random(shape, seed=11).to(torch.float64)
    for r in results:
        ref = reference_moe(r["x"], weights, r["ids"], r["w"])
        assert r["y"].shape == ref.shape
        if ref.numel():
            err = ((r["y"].double() - ref).norm() / ref.norm()).item()
            assert err < REL_TOL, err


def test_router_matches_float64_routing():
    shape = SHAPES[0]
    weights = MoEWeights.random(shape, seed=3)
    x = torch.randn(200, shape.hidden, generator=torch.Generator().manual_seed(4))
    ids, w = TopKRouter(shape.hidden, shape.num_experts, shape.top_k, weight=weights.router)(x)
    ref_ids, ref_w = reference_routing(x, weights, shape.top_k)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(w.double(), ref_w, rtol=1e-5, atol=1e-6)
    assert torch.allclose(w.sum(1), torch.ones(200))
