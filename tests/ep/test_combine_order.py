"""``combine_order="rank"``: the defining reference, what it saves on the wire, and the
dispatchers on 8 gloo ranks (2 and 4 ranks, every adversarial routing and both orders, are
in test_dispatcher_contract.py).

The reference (``moekit.ep.dispatcher.weighted_rank_sum``) is checked against the contract
spelled out token by token (``moekit.moe.reference.reference_rank_sum``); its relation to
the slot order is checked both ways: bitwise the same when all of a token's slots sit on one
rank, different (by about one rounding) when they do not.
"""

from __future__ import annotations

import pytest
import torch

from moekit.ep import (AllToAllDispatcher, CapAndSpillDispatcher, EPLowLatencyAllToAll, MaxCountsDispatcher,
                       weighted_rank_sum, weighted_slot_sum)
from moekit.moe.reference import reference_rank_sum
from tests.ep.cases import build_case
from tests.ep.test_dispatcher_contract import case_dtype, check_step, dispatchers


def _random_slots(T: int, K: int, E: int, H: int, dtype, seed: int):
    """Slot outputs (NaN in masked slots: the sum must never read them), ids with masked
    slots and repeated experts, normalized weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[::3, 0] = ids[::3, -1]  # repeated experts
    ids = torch.where(torch.rand(T, K, generator=g) < 0.2, torch.full_like(ids, -1), ids)
    slot_out = (torch.randn(T, K, H, generator=g) * 4).to(dtype)
    slot_out = torch.where((ids < 0).unsqueeze(2), torch.full_like(slot_out, float("nan")), slot_out)
    w = torch.rand(T, K, generator=g) + 0.05
    return slot_out, ids, w / w.sum(1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_reference_matches_the_contract_token_by_token(dtype, world_size):
    E, K = 16, 4
    slot_out, ids, w = _random_slots(40, K, E, 12, dtype, seed=world_size)
    got = weighted_rank_sum(slot_out, ids, w, dtype, num_experts=E, world_size=world_size)
    assert got.dtype == dtype and not got.isnan().any()
    assert torch.equal(got, reference_rank_sum(slot_out, ids, w, dtype, E, world_size))


def test_one_rank_per_token_is_the_slot_order_bitwise():
    """All slots of every token on one rank (a different rank per token): one partial, and
    rounding it to bf16 and back is exact, so the two orders agree bit for bit."""
    E, K, P, T, H = 32, 6, 4, 64, 16
    g = torch.Generator().manual_seed(3)
    home = torch.randint(0, P, (T, 1), generator=g)
    ids = home * (E // P) + torch.rand(T, E // P, generator=g).argsort(1)[:, :K]
    slot_out = torch.randn(T, K, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, K, generator=g)
    rank = weighted_rank_sum(slot_out, ids, w, torch.bfloat16, num_experts=E, world_size=P)
    assert torch.equal(rank, weighted_slot_sum(slot_out, ids, w, torch.bfloat16))


def test_orders_differ_by_the_extra_rounding():
    """Slots spread over ranks: the rank order rounds each partial to bf16, so some results
    differ from the slot order's; both stay within a few bf16 roundings of float64."""
    E, K, P, T, H = 64, 8, 8, 128, 64
    slot_out, ids, w = _random_slots(T, K, E, H, torch.bfloat16, seed=5)
    ids = ids.clamp(min=0)  # no masked slots here
    slot_out = torch.where(slot_out.isnan(), torch.zeros_like(slot_out), slot_out)
    slot = weighted_slot_sum(slot_out, ids, w, torch.bfloat16)
    rank = weighted_rank_sum(slot_out, ids, w, torch.bfloat16, num_experts=E, world_size=P)
    exact = (slot_out.double() * w.double().unsqueeze(2)).sum(1)
    assert not torch.equal(slot, rank)
    for y in (slot, rank):
        rel = ((y.double() - exact).abs() / exact.abs().clamp(min=1e-3)).median()
        assert rel < 2 ** -7, rel  # bf16 has 8 significant bits


@pytest.mark.parametrize("make", [
    lambda order: AllToAllDispatcher(8, combine_order=order),
    lambda order: MaxCountsDispatcher(8, 4, 4, top_k=2, combine_order=order),
    lambda order: CapAndSpillDispatcher(8, 1, 4, top_k=2, combine_order=order),
    lambda order: EPLowLatencyAllToAll(4, 32, 2, 8, online_fp8=False, combine_order=order),
], ids=["alltoall", "maxcounts", "capspill", "lowlatency"])
def test_bad_combine_order_raises(make):
    for bad in ("token", "RANK", None, 1):
        with pytest.raises(ValueError, match="combine_order must be one of"):
            make(bad)
    assert make("rank").combine_order == "rank"


# -- on ranks ---------------------------------------------------------------------------------


def _rows_on_the_wire(rank: int, world_size: int) -> dict:
    """Rows each dispatcher's combine sends, in both orders, on the 'skewed' routing; and the
    rank order's missing weights reported on every rank."""
    xs, ids, ws, E = build_case("skewed", world_size, 4)
    out = {}
    for order in ("slot", "rank"):
        d = AllToAllDispatcher(E, combine_order=order)
        dispatched = d.dispatch(xs[rank], ids[rank], ws[rank])
        out[f"alltoall {order}"] = dispatched.handle.state["combine_rows"]
        layer = EPLowLatencyAllToAll(20, 24, ids[rank].shape[1], E, dtype=torch.float32, online_fp8=False,
                                     combine_order=order)
        out[f"lowlatency {order}"] = layer.transport._combine_recv[0].numel() * 4  # bytes of one combine message's rows
    layer = EPLowLatencyAllToAll(20, 24, ids[rank].shape[1], E, dtype=torch.float32, online_fp8=False,
                                 combine_order="rank")
    try:
        layer.dispatch(xs[rank], ids[rank], ws[rank] if rank == 0 else None)
        out["missing weights"] = "no error"
    except ValueError as error:
        out["missing weights"] = str(error)
    return out


# One launch per world size, shared with the other multi-rank tests (tests/rank_pool.py).
@pytest.mark.ranks(lambda: (_rows_on_the_wire,), world_size=2, deadline=300, timeout=60)
def test_rank_order_ships_one_row_per_token_and_rank(pooled_launch):
    P = 2
    results = pooled_launch()
    xs, ids, ws, E = build_case("skewed", P, 4)
    for r, got in enumerate(results):
        # Counted here from the routing of every source: pairs and (token, rank) groups sent back by rank r.
        owner = [torch.where(i >= 0, i // (E // P), -1) for i in ids]
        pairs = sum(int((o == r).sum()) for o in owner)
        groups = sum(int((o == r).any(1).sum()) for o in owner)
        assert got["alltoall slot"] == pairs and got["alltoall rank"] == groups < pairs
        K = ids[0].shape[1]
        assert got["lowlatency slot"] == K * got["lowlatency rank"]
        assert "rank 1: topk_weights: combine_order='rank'" in got["missing weights"]


def _contract_on_8_ranks(rank: int, world_size: int) -> dict:
    """A few routings (K = 2, and K = E, where every token has a partial from all 8 ranks,
    so their order shows) through every dispatcher in the rank order."""
    cases = {2: [("skewed", 0), ("duplicates", 1), ("one_rank_empty", 2)], 4 * world_size: [("k_eq_e", 0)]}
    E = 4 * world_size
    failures, compared = [], 0
    for top_k, steps in cases.items():
        dtypes = sorted({case_dtype(case) for case, _ in steps}, key=str)
        made = dispatchers(E, top_k, dtypes, "rank")
        for case, seed in steps:
            for name, d in made.items():
                if name.startswith("lowlatency") and f"({str(case_dtype(case))[6:]}) [" not in name:
                    continue
                failures += check_step(name, d, rank, case, seed, world_size)
                compared += 1
    return dict(failures=failures, compared=compared)


@pytest.mark.ranks(lambda: (_contract_on_8_ranks,), world_size=8, deadline=600, timeout=60)
def test_every_dispatcher_in_rank_order_on_8_ranks(pooled_launch):
    results = pooled_launch()
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}: {result['failures'][:8]}"
        assert result["compared"] == 4 * (4 + 2)


def test_lowlatency_rank_order_takes_the_weights_of_dispatch():
    """The expert side weighted the outputs with the weights sent at dispatch: the paper's
    combine(expert_out, ids, weights, meta) must pass the same ones (one process)."""
    T, H, K, E = 5, 32, 3, 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    layer = EPLowLatencyAllToAll(T, H, K, E, dtype=torch.float32, online_fp8=False, combine_order="rank")
    d = layer.dispatch(x, ids, w)
    y = layer.combine(d.tokens, ids, w, d.meta)
    assert torch.equal(y, layer.combine(d.tokens, d))
    with pytest.raises(ValueError, match="topk_weights: combine_order='rank' sums the weighted outputs"):
        layer.combine(d.tokens, ids, w * 2, d.meta)
    with pytest.raises(ValueError, match="topk_weights: combine_order='rank' weights the expert outputs"):
        layer.dispatch(x, ids)  # no weights: the expert ranks could not weight the outputs
