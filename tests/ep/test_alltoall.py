"""AllToAllDispatcher on 2, 4 and 8 gloo ranks: received rows, the handle, the identity round trip
and a combine of position-dependent fake experts, all checked bitwise against loop references.

Every case of ``CASES`` runs at every world size; the seeds (fresh draws of the same case) are
fewer on more ranks, where each one costs the most."""

from __future__ import annotations

import pytest
import torch

from moekit.ep import AllToAllDispatcher
from moekit.ep.reference import expected_dispatch
from moekit.moe.reference import reference_slot_sum
from tests.ep.cases import CASES, build_case, expected_combine, fake_experts

SEEDS = {2: (0, 1, 2), 4: (0, 1), 8: (0,)}  # per world size


def _dispatch_worker(rank, world_size, cases):
    out = {}
    for name, seed, dtype in cases:
        xs, ids, ws, E = build_case(name, world_size, seed, dtype=dtype)
        d = AllToAllDispatcher(E)
        dispatched = d.dispatch(xs[rank], ids[rank], ws[rank])
        y = d.combine(dispatched.tokens.clone(), dispatched)  # identity experts
        y_fake = d.combine(fake_experts(dispatched.tokens, rank), dispatched)
        h = dispatched.handle
        out[(name, seed, str(dtype))] = dict(tokens=dispatched.tokens, counts=dispatched.counts, y_fake=y_fake,
                                             src_rank=h.src_rank, src_token=h.src_token, src_slot=h.src_slot, y=y)
    return out


def _check(world_size, results, cases):
    for name, seed, dtype in cases:
        xs, ids, ws, E = build_case(name, world_size, seed, dtype=dtype)
        want_fake = expected_combine(xs, ids, ws, E, dtype)
        for rank in range(world_size):
            got = results[rank][(name, seed, str(dtype))]
            want = expected_dispatch(xs, ids, E, rank)
            for e, exp in enumerate(want):
                n = int(got["counts"][e])
                assert n == exp["tokens"].shape[0], (name, seed, rank, e)
                assert torch.equal(got["tokens"][e, :n], exp["tokens"]), (name, seed, rank, e)
                for key in ("src_rank", "src_token", "src_slot"):
                    assert torch.equal(got[key][e, :n], exp[key]), (name, seed, rank, e, key)
                    assert bool((got[key][e, n:] == -1).all()), (name, rank, e, key)
            T, K = ids[rank].shape
            slot_x = xs[rank].unsqueeze(1).expand(T, K, xs[rank].shape[1])
            assert torch.equal(got["y"], reference_slot_sum(slot_x, ids[rank], ws[rank], dtype)), (name, seed, rank)
            assert torch.equal(got["y_fake"], want_fake[rank]), (name, seed, rank)


def _cases(world_size):
    cases = [(name, seed, torch.float32) for name in CASES for seed in SEEDS[world_size]]
    return cases + [("uniform", 7, torch.bfloat16), ("masked", 8, torch.bfloat16)]


# One launch per world size, shared with the other multi-rank tests (tests/rank_pool.py).
@pytest.mark.ranks(lambda world_size: (_dispatch_worker, _cases(world_size)))
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_dispatch_combine_bitwise(world_size, pooled_launch):
    _check(world_size, pooled_launch(), _cases(world_size))


def test_single_process_matches_reference():
    xs, ids, ws, E = build_case("skewed", 1, 3)
    d = AllToAllDispatcher(E)
    dispatched = d.dispatch(xs[0], ids[0], ws[0])
    h = dispatched.handle
    for e, exp in enumerate(expected_dispatch(xs, ids, E, 0)):
        n = int(dispatched.counts[e])
        assert torch.equal(dispatched.valid_rows(e), exp["tokens"])
        for key in ("src_rank", "src_token", "src_slot"):
            assert torch.equal(getattr(h, key)[e, :n], exp[key])
    y = d.combine(fake_experts(dispatched.tokens, 0), dispatched)
    assert torch.equal(y, expected_combine(xs, ids, ws, E, torch.float32)[0])
