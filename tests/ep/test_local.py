"""LocalDispatcher: the one-process dispatcher's checks, its FP8 wire and the layout contract
between a dispatcher and the experts (:func:`moekit.ep.dispatcher.run_experts`)."""

from __future__ import annotations

import pytest
import torch

from moekit.ep.dispatcher import EXPERT_MAJOR, TOKEN_MAJOR, Dispatched, run_experts
from moekit.ep.local import LocalDispatcher
from moekit.fp8 import quantize_groups
from moekit.moe import SwiGLUExperts


def _routing(T=6, H=128, E=4, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    w = torch.rand(T, K, generator=g)
    return x, ids, w


def test_bad_inputs_raise_every_time():
    d = LocalDispatcher(4, hidden=128, top_k=2, max_tokens=8)
    x, ids, w = _routing()
    d.dispatch(x, ids, w)
    with pytest.raises(ValueError, match="H=128"):
        d.dispatch(x[:, :64], ids, w)
    with pytest.raises(ValueError, match="K=2"):
        d.dispatch(x, ids[:, :1], w[:, :1])
    with pytest.raises(ValueError, match=r"T in \[0, 8\]"):
        d.dispatch(torch.randn(9, 128), torch.zeros(9, 2, dtype=torch.int64), torch.ones(9, 2))
    with pytest.raises(ValueError, match="int32 or int64"):
        d.dispatch(x, ids.float(), w)
    d.dispatch(x, ids, w)  # a good signature still passes after the bad ones
    with pytest.raises(ValueError, match="shape of topk_ids"):
        d.dispatch(x, ids, w[:, :1])  # checked again although x and ids were seen before


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_experts=0), "num_experts"), (dict(num_experts=4, top_k=0), "top_k"),
    (dict(num_experts=4, fp8="yes"), "fp8"), (dict(num_experts=4, hidden=100, fp8=True), "multiple of 128"),
    (dict(num_experts=4, combine_order="any"), "combine_order"),
])
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LocalDispatcher(**kwargs)


def test_fp8_wire_quantizes_like_quantize_groups():
    x, ids, w = _routing(seed=3)
    got = LocalDispatcher(4, fp8=True).dispatch(x, ids, w)
    q, s = quantize_groups(x, 128)
    assert got.layout == TOKEN_MAJOR and torch.equal(got.tokens.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got.scales, s)


def test_combine_rejects_other_shapes_and_layouts():
    d = LocalDispatcher(4)
    x, ids, w = _routing()
    got = d.dispatch(x, ids, w)
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        d.combine(torch.zeros(6, 3, 128), got)
    expert_major = Dispatched(torch.zeros(4, 2, 128), torch.zeros(4, dtype=torch.int64), None)
    with pytest.raises(ValueError, match="token-major"):
        d.combine(torch.zeros(4, 2, 128), expert_major)


class _ExpertMajorOnly(torch.nn.Module):
    def forward(self, tokens, counts, scales=None):
        return tokens


def test_run_experts_follows_the_layout():
    g = torch.Generator().manual_seed(5)
    experts = SwiGLUExperts(torch.randn(4, 16, 128, generator=g), torch.randn(4, 128, 8, generator=g))
    x, ids, w = _routing(seed=6)
    token_major = LocalDispatcher(4).dispatch(x, ids, w)
    assert run_experts(experts, token_major).shape == (6, 2, 128)
    tokens = torch.randn(4, 3, 128, generator=g)
    expert_major = Dispatched(tokens, torch.tensor([3, 0, 1, 2]), None)
    assert expert_major.layout == EXPERT_MAJOR
    assert torch.equal(run_experts(experts, expert_major), experts(tokens, expert_major.counts))
    with pytest.raises(ValueError, match="_ExpertMajorOnly takes the layouts"):
        run_experts(_ExpertMajorOnly(), token_major)
