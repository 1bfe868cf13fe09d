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
        (lambda x, i, w: (x, torch.where(i == i.max(), torch.full_like(i, 4), i), w), r"topk_ids must be in \[-1, 3\]"),
        (lambda x, i, w: (x, torch.where(i == i.max(), torch.full_like(i, -2), i), w), r"topk_ids must be in \[-1, 3\]"),
        (lambda x, i, w: (x, i, w[:, :1]), "topk_weights must have the shape"),
        (lambda x, i, w: (x, i, w[:-1]), "topk_weights must have the shape"),
        (lambda x, i, w: (x.unsqueeze(0), i, w), "x must be a 2-D"),
        (lambda x, i, w: (x[0], i, w), "x must be a 2-D"),
        (lambda x, i, w: (x.to(torch.int32), i, w), "x must be a floating"),
        (lambda x, i, w: (x, i.float(), w), "topk_ids must be int"),
        (lambda x, i, w: (x, i[:-1], w), r"topk_ids must be a 2-D tensor \[T=5, K\]"),
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


def _bad_input_worker(rank, world_size, problem):
    g = torch.Generator().manual_seed(rank)
    E, T = 8, 6
    x = torch.randn(T + (problem == "tokens" and rank == 1), 16, generator=g)
    ids = torch.rand(x.shape[0], E, generator=g).argsort(1)[:, :2]
    if problem == "ids" and rank == 1:
        ids[0, 1] = E  # one bad id, on one rank only
    d = AllToAllDispatcher(E, max_tokens=T)
    try:
        d.dispatch(x, ids, torch.rand(ids.shape, generator=g))
    except ValueError as e:
        message = str(e)
    else:
        message = None
    # The group is still usable afterwards: nobody is stuck in a collective.
    ok = d.dispatch(x[:T], ids[:T].clamp(max=E - 1), torch.rand(T, 2, generator=g))
    return message, int(ok.counts.sum())


# One launch, shared with the other multi-rank tests (tests/rank_pool.py).
@pytest.mark.ranks(lambda problem: (_bad_input_worker, problem), world_size=2)
@pytest.mark.parametrize("problem, match", [("ids", r"rank 1: topk_ids must be in \[-1, 7\]"),
                                            ("tokens", r"rank 1: x has T=7 tokens; this dispatcher allows T in \[0, 6\]")])
def test_bad_input_on_one_rank_raises_on_every_rank(problem, match, pooled_launch):
    import re

    for message, received in pooled_launch():
        assert message is not None and re.search(match, message), message
        assert received > 0


# -- constructors and non-tensor inputs, every dispatcher (one process) -----------------------

def _make(kind, **kw):
    from moekit.ep import CapAndSpillDispatcher, EPLowLatencyAllToAll, MaxCountsDispatcher

    args = dict(num_experts=4, max_tokens=5, top_k=2, hidden=8) | kw
    E, T, K, H = args.pop("num_experts"), args.pop("max_tokens"), args.pop("top_k"), args.pop("hidden")
    if kind == "alltoall":
        return AllToAllDispatcher(E, max_tokens=T, top_k=K, hidden=H, **args)
    if kind == "maxcounts":
        return MaxCountsDispatcher(E, 10, T, top_k=K, hidden=H, **args)
    if kind == "capspill":
        return CapAndSpillDispatcher(E, 1, T, top_k=K, hidden=H, **args)
    if kind == "capspill-cond":
        return CapAndSpillDispatcher(E, 1, T, top_k=K, hidden=H, conditional=True, **args)
    return EPLowLatencyAllToAll(T, H, K, E, online_fp8=False, **({"dtype": torch.float32} | args))


DISPATCHER_KINDS = ["alltoall", "maxcounts", "capspill", "capspill-cond", "lowlatency"]


@pytest.mark.parametrize("kind", DISPATCHER_KINDS)
@pytest.mark.parametrize("bad, name", [
    (dict(num_experts=8.0), "num_experts"), (dict(num_experts=0), "num_experts"), (dict(num_experts=True), "num_experts"),
    (dict(max_tokens=-1), "max_tokens|max_m"), (dict(max_tokens=2.5), "max_tokens|max_m"),
    (dict(top_k=0), "top_k|topk"), (dict(hidden=0), "hidden"), (dict(timeout=-1), "timeout"),
    (dict(timeout="5"), "timeout"), (dict(dtype="float32"), "dtype"),
])
def test_constructors_reject_bad_arguments_by_name(kind, bad, name):
    with pytest.raises(ValueError, match=name):
        _make(kind, **bad)


@pytest.mark.parametrize("kind", DISPATCHER_KINDS)
@pytest.mark.parametrize("x", [[[1.0] * 8], None, 3.0, "x"])
def test_non_tensor_x_is_the_validation_error(kind, x):
    """The ValueError of validate_routing, not an AttributeError from poking at x."""
    d = _make(kind)
    ids, w = torch.tensor([[0, 1]]), torch.rand(1, 2)
    with pytest.raises(ValueError, match=r"x must be a 2-D tensor \[T, H\], got"):
        d.dispatch(x, ids, w)
    assert d.dispatch(torch.randn(1, 8), ids, w).counts.sum() == 2  # still usable


def test_fixed_buffer_check_replay_after_an_eager_step_finds_nothing():
    d = _make("maxcounts")
    x, ids, w = _inputs(T=5, H=8, K=2, E=4)
    d.check_replay(d.dispatch(x, ids, w))


def test_lowlatency_check_replay_raises_for_ids_masked_in_a_capture(monkeypatch):
    from moekit.ep.lowlatency import api

    layer = _make("lowlatency")
    x, ids, w = _inputs(T=5, H=8, K=2, E=4)
    monkeypatch.setattr(api, "_capturing", lambda t: True)
    bad = ids.clone()
    bad[0, 0] = 9
    with pytest.raises(ValueError, match=r"this rank: topk_ids held ids outside \[-1, 3\]"):
        layer.check_replay(layer.dispatch(x, bad, w))
    layer.check_replay(layer.dispatch(x, ids, w))
