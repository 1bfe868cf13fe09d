"""The distributed MoELayer against the float64 single-process reference.

Tolerance: the layer runs in float32 (matmuls over H and N of a few hundred, SwiGLU, a
K-term weighted sum); float32 rounding then gives a relative error of order 1e-7 * sqrt(H),
well under 1e-5, while any routing or placement mistake gives an error of order 1. The
bound is 1e-5 in relative Frobenius norm.
"""

from __future__ import annotations

import pytest
import torch

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


# The launches of this file are shared with the other multi-rank tests (tests/rank_pool.py).
@pytest.mark.ranks(lambda world_size, shape: (_layer_worker, shape, [17, 0, 9, 30][:world_size]))
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_layer_matches_float64_reference(world_size, shape, pooled_launch):
    results = pooled_launch()
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


# -- a quantizing dispatcher: FP8 tokens reach the experts with their scales ------------------

FP8_SHAPE = MoEShape("tiny-fp8-wire", num_experts=8, top_k=3, hidden=64, intermediate=48)
FP8_GROUP, FP8_MAX_M = 16, 12


def _fp8_wire_worker(rank, world_size, tokens_per_rank):
    from moekit.ep import EPLowLatencyAllToAll

    shape = FP8_SHAPE
    weights = MoEWeights.random(shape, seed=12)
    ll = EPLowLatencyAllToAll(FP8_MAX_M, shape.hidden, shape.top_k, shape.num_experts, fp8_group_size=FP8_GROUP,
                              dtype=torch.float32, online_fp8=True)
    layer = MoELayer(shape, weights, dispatcher=ll)
    x = torch.randn(tokens_per_rank[rank], shape.hidden, generator=torch.Generator().manual_seed(200 + rank)) * 3
    ids, w = layer.router(x)
    y = layer(x, ids, w)
    ll.finalize()
    return dict(x=x, y=y, ids=ids, w=w)


@pytest.mark.ranks(lambda: (_fp8_wire_worker, [FP8_MAX_M, 7]), world_size=2)
def test_layer_with_an_fp8_dispatcher_dequantizes_the_tokens(pooled_launch):
    """The low-latency layer sends e4m3 tokens + group scales; the torch experts must apply the
    scales. Reference: the float64 block on the tokens as quantized by the wire."""
    from moekit.fp8 import dequantize_groups, quantize_groups

    results = pooled_launch()
    weights = MoEWeights.random(FP8_SHAPE, seed=12).to(torch.float64)
    for r in results:
        xq = dequantize_groups(*quantize_groups(r["x"], FP8_GROUP))
        assert not torch.equal(xq, r["x"])  # the wire really rounds
        ref = reference_moe(xq, weights, r["ids"], r["w"])
        err = ((r["y"].double() - ref).norm() / ref.norm()).item()
        assert err < REL_TOL, err


def test_layer_rejects_an_unknown_expert_kind():
    shape = SHAPES[0]
    with pytest.raises(ValueError, match="experts must be one of"):
        MoELayer(shape, MoEWeights.random(shape, seed=1), experts="cutlass")
    with pytest.raises(ValueError, match="kernel_config is for the fused experts"):
        MoELayer(shape, MoEWeights.random(shape, seed=1), kernel_config=object())


# -- the combine order --------------------------------------------------------------------

BF16_SHAPE = MoEShape("tiny-bf16", num_experts=8, top_k=4, hidden=64, intermediate=48)


def _order_worker(rank, world_size, tokens_per_rank):
    """The layer in both orders (bf16 weights, so the extra rounding of the rank order
    shows), and the rank-order step done by hand through the dispatcher protocol."""
    from moekit.ep import AllToAllDispatcher

    shape = BF16_SHAPE
    weights = MoEWeights.random(shape, seed=13, dtype=torch.bfloat16)
    by_slot = MoELayer(shape, weights)
    by_rank = MoELayer(shape, weights, combine_order="rank")
    x = torch.randn(tokens_per_rank[rank], shape.hidden, generator=torch.Generator().manual_seed(300 + rank))
    x = x.to(torch.bfloat16)
    ids, w = by_rank.router(x)
    d = by_rank.dispatcher.dispatch(x, ids, w)
    by_hand = by_rank.dispatcher.combine(by_rank.experts(d.tokens, d.counts, d.scales), d)
    out = dict(x=x, ids=ids, w=w, slot=by_slot(x, ids, w), rank=by_rank(x, ids, w), by_hand=by_hand,
               order=by_rank.dispatcher.combine_order)
    for bad in (lambda: MoELayer(shape, weights, combine_order="rank", dispatcher=AllToAllDispatcher(8)),
                lambda: MoELayer(shape, weights, combine_order="tokens")):
        try:
            bad()
            out.setdefault("errors", []).append("no error")
        except ValueError as error:
            out.setdefault("errors", []).append(str(error))
    return out


@pytest.mark.ranks(lambda world_size: (_order_worker, [23, 0, 17, 30][:world_size]))
@pytest.mark.parametrize("world_size", [2, 4])
def test_layer_in_both_combine_orders(world_size, pooled_launch):
    results = pooled_launch()
    weights = MoEWeights.random(BF16_SHAPE, seed=13, dtype=torch.bfloat16).to(torch.float64)
    differ = 0
    for r in results:
        assert r["order"] == "rank"
        assert torch.equal(r["rank"], r["by_hand"])  # the layer combines through its dispatcher's rank order
        if r["x"].shape[0]:
            ref = reference_moe(r["x"], weights, r["ids"], r["w"])
            for y in (r["slot"], r["rank"]):  # both within bf16 rounding of the float64 block
                assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
        differ += int(not torch.equal(r["slot"], r["rank"]))
        assert "combine_order='rank' but the dispatcher combines in the 'slot' order" in r["errors"][0]
        assert "combine_order must be one of" in r["errors"][1]
    assert differ  # the option changes the result: one more rounding per rank
