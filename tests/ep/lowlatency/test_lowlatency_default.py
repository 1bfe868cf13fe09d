"""``default_dispatcher`` picks the low-latency layer where it applies (moekit.ep.lowlatency.select).

On gloo ranks (CPU) the capability check says no on every rank and the eager all-to-all is
picked; with a fake check that says yes, the same call builds the low-latency layer (its
gloo transport), whose MoELayer output equals the all-to-all's bitwise; a shape outside its
limits or no ``max_tokens`` falls back to the all-to-all; one process gets the local
dispatcher. Naming a dispatcher explicitly still wins.
"""

from __future__ import annotations

import pytest
import torch

from moekit.ep import AllToAllDispatcher, EPLowLatencyAllToAll
from moekit.ep.local import LocalDispatcher
from moekit.ep.lowlatency.select import MAX_PEERS, lowlatency_available, lowlatency_limits
from moekit.moe.experts import MoEWeights
from moekit.moe.layer import MoELayer, default_dispatcher
from moekit.shapes import MoEShape
from tests.ep.deadline import run_ranks


def _shape(world_size: int) -> MoEShape:
    return MoEShape("default-test", num_experts=2 * world_size, top_k=2, hidden=32, intermediate=16)


def _worker(rank: int, world_size: int) -> dict:
    shape = _shape(world_size)
    E, H, K = shape.num_experts, shape.hidden, shape.top_k
    kinds = {}
    kinds["gloo"] = type(default_dispatcher(E, hidden=H, top_k=K, max_tokens=8, dtype=torch.float32)).__name__
    kinds["available"] = lowlatency_available()
    yes = lambda: True  # noqa: E731 (a capability check that says yes)
    chosen = default_dispatcher(E, hidden=H, top_k=K, max_tokens=8, dtype=torch.float32, available=yes)
    kinds["fake_yes"] = type(chosen).__name__
    kinds["no_max_tokens"] = type(default_dispatcher(E, hidden=H, top_k=K, dtype=torch.float32,
                                                     available=yes)).__name__
    kinds["bad_dtype"] = type(default_dispatcher(E, hidden=H, top_k=K, max_tokens=8, dtype=torch.float64,
                                                 available=yes)).__name__
    kinds["rank_order"] = getattr(default_dispatcher(E, hidden=H, top_k=K, max_tokens=8, dtype=torch.float32,
                                                     combine_order="rank", available=yes), "combine_order", None)
    # MoELayer: the default on gloo is the all-to-all; the low-latency layer named explicitly
    # gives the same output bits (both combine in the slot order, exactly).
    weights = MoEWeights.random(shape, seed=3)
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(6, H, generator=g)
    default_layer = MoELayer(shape, weights, max_tokens=8)
    kinds["moe_layer"] = type(default_layer.dispatcher).__name__
    named = MoELayer(shape, weights, dispatcher=chosen)
    same = torch.equal(default_layer(x), named(x))
    chosen.finalize()
    return dict(kinds=kinds, same=same)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_ranks_get_the_all_to_all(world_size):
    results, _ = run_ranks(_worker, world_size)
    for rank, r in enumerate(results):
        k = r["kinds"]
        assert k["gloo"] == AllToAllDispatcher.__name__, k
        assert k["available"] is False
        assert k["fake_yes"] == EPLowLatencyAllToAll.__name__, k
        assert k["no_max_tokens"] == AllToAllDispatcher.__name__
        assert k["bad_dtype"] == AllToAllDispatcher.__name__
        assert k["rank_order"] == "rank"
        assert k["moe_layer"] == AllToAllDispatcher.__name__
        assert r["same"], f"rank {rank}: MoELayer with the low-latency layer differs from the all-to-all"


def test_one_process_gets_the_local_dispatcher():
    called = []
    d = default_dispatcher(8, hidden=32, top_k=2, max_tokens=8, dtype=torch.float32,
                           available=lambda: called.append(1) or True)
    assert isinstance(d, LocalDispatcher) and called == []  # no group: the check is not even asked


def test_limits():
    ok = dict(world_size=4, num_experts=16, hidden=64, top_k=2, max_tokens=128, dtype=torch.bfloat16)
    assert lowlatency_limits(**ok) is None
    for change, words in ((dict(max_tokens=None), "max_tokens"), (dict(max_tokens=0), "max_tokens"),
                          (dict(top_k=33), "top_k"), (dict(dtype=torch.float64), "dtype"),
                          (dict(world_size=MAX_PEERS + 1, num_experts=16 * (MAX_PEERS + 1)), "world_size"),
                          (dict(num_experts=18), "multiple"), (dict(hidden=None), "hidden")):
        why = lowlatency_limits(**{**ok, **change})
        assert why is not None and words in why, (change, why)
