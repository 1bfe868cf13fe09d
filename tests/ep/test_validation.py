"""Bad input raises ValueError naming the argument."""

from __future__ import annotations

import pytest
import torch

from moekit.ep import AllToAllDispatcher, ExpertPlacement
from moekit.shapes import get_shape


def _inputs(T=5, H=8, K=2, E=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    w = torch.rand(T, K, generator=g)
    return x, ids, w


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda x, i, w: (x, torch.where(i == i.max(), torch.full_like(i, 4), i), w), "topk_ids"),
        (lambda x, i, w: (x, torch.where(i == i.max(), torch.full_like(i, -2), i), w), "topk_ids"),
        (lambda x, i, w: (x, i, w[:, :1]), "topk_weights"),
        (lambda x, i, w: (x, i, w[:-1]), "topk_weights"),
        (lambda x, i, w: (x.unsqueeze(0), i, w), "x must be a 2-D"),
        (lambda x, i, w: (x[0], i, w), "x must be a 2-D"),
        (lambda x, i, w: (x.to(torch.int32), i, w), "x must be a floating"),
        (lambda x, i, w: (x, i.float(), w), "topk_ids must be int"),
        (lambda x, i, w: (x, i[:-1], w), "topk_ids"),
        (lambda x, i, w: (x, i, w.to(torch.int64)), "topk_weights must be floating"),
        (lambda x, i, w: (x, i.to("meta"), w), "topk_ids is on meta"),
        (lambda x, i, w: (x, i, w.to("meta")), "topk_weights is on meta"),
    ],
)
def test_bad_input_raises(mutate, match):
    x, ids, w = _inputs()
    with pytest.raises(ValueError, match=match):
        AllToAllDispatcher(4).dispatch(*mutate(x, ids, w))


def test_hidden_topk_and_max_tokens_limits():
    x, ids, w = _inputs()
    with pytest.raises(ValueError, match="hidden size H=16"):
        AllToAllDispatcher(4, hidden=16).dispatch(x, ids, w)
    with pytest.raises(ValueError, match="K=3"):
        AllToAllDispatcher(4, top_k=3).dispatch(x, ids, w)
    with pytest.raises(ValueError, match=r"T in \[0, 4\]"):
        AllToAllDispatcher(4, max_tokens=4).dispatch(x, ids, w)


def test_experts_not_divisible_by_ranks():
    with pytest.raises(ValueError, match="num_experts=6 must be a positive multiple of world_size=4"):
        ExpertPlacement(6, 4)
    with pytest.raises(ValueError, match="world_size must divide num_experts=8"):
        get_shape("mixtral-8x7b").experts_per_rank(3)


def test_combine_rejects_wrong_shape():
    x, ids, w = _inputs()
    d = AllToAllDispatcher(4)
    dispatched = d.dispatch(x, ids, w)
    with pytest.raises(ValueError, match="expert_out"):
        d.combine(dispatched.tokens[:, :-1], dispatched)
