"""Capacity calibration from traces and the buffer bounds of the fixed-buffer dispatchers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moekit.ep.capacity import (
    calibrate_capacity,
    expert_capacity,
    max_counts_capacity,
    overflow_fractions,
    pair_bound,
    spill_capacity,
    trace_peer_counts,
)
from moekit.routing import RoutingTrace, mixtral_capspill_trace, trace_stats


def hand_trace() -> RoutingTrace:
    """2 ranks x 2 tokens each, top-1, 2 experts (one per rank): counts we can write down."""
    ids = np.array([
        [[[0], [0], [0], [1]]],  # step 0: rank 0 sends 2 to rank 0; rank 1 sends 1 to 0, 1 to 1
        [[[1], [1], [1], [1]]],  # step 1: rank 0 sends 2 to rank 1; rank 1 sends 2 to 1
        [[[0], [-1], [-1], [-1]]],  # step 2: one pair
    ], dtype=np.int64)
    return RoutingTrace(ids, num_experts=2)


def test_counts_and_calibration_by_hand():
    counts = trace_peer_counts(hand_trace(), 2)
    assert counts.reshape(3, 4).tolist() == [[2, 0, 1, 1], [0, 2, 0, 2], [1, 0, 0, 0]]
    flat = counts.reshape(-1)  # 12 counts: 0 x6, 1 x3, 2 x3
    cal = calibrate_capacity(hand_trace(), 0.5, 2)
    assert cal.capacity == int(np.ceil(np.quantile(flat, 0.5))) == 1
    assert cal.max_count == 2 and cal.max_tokens == 2 and cal.top_k == 1
    assert cal.mean_count == pytest.approx(9 / 12)
    # counts over C=1: the three 2s, in sends (step 0 rank 0), (step 1 rank 0), (step 1 rank 1)
    assert cal.overflow_slice_fraction == pytest.approx(3 / 12)
    assert cal.overflow_send_fraction == pytest.approx(3 / 6)
    assert cal.overflow_token_fraction == pytest.approx(3 / 9)
    assert cal.spill_capacity == spill_capacity(2, 1, 1) == 1
    top = max_counts_capacity(hand_trace(), 2)
    assert top.capacity == 2 and top.quantile == 1.0 and top.overflow_send_fraction == 0.0
    assert cal.to_dict()["spill_capacity"] == 1


def test_matches_trace_stats_and_the_seed_on_the_mixtral_preset():
    trace = mixtral_capspill_trace(steps=300, layers=8, seed=1)
    cal = calibrate_capacity(trace, 0.99, 8)
    stats = trace_stats(trace, 8)
    assert cal.capacity == stats.capacity  # both ceil(Q99)
    assert cal.overflow_send_fraction == pytest.approx(stats.overflow_send_fraction)
    assert cal.overflow_slice_fraction == pytest.approx(stats.overflow_slice_fraction)
    assert cal.overflow_token_fraction == pytest.approx(stats.overflow_token_fraction)
    assert cal.max_tokens == 43 and cal.top_k == 2
    assert 14 <= cal.capacity <= 18  # the paper's Q99 is 16


def test_bad_arguments():
    with pytest.raises(ValueError, match="quantile"):
        calibrate_capacity(hand_trace(), 1.5, 2)
    with pytest.raises(ValueError, match="quantile"):
        calibrate_capacity(hand_trace(), True, 2)
    with pytest.raises(ValueError, match="world_size"):
        calibrate_capacity(hand_trace(), 0.9, 0)
    with pytest.raises(ValueError, match="world_size"):
        calibrate_capacity(hand_trace(), 0.9, 3)  # 3 does not divide 2 experts
    with pytest.raises(ValueError, match="trace"):
        calibrate_capacity("trace.npz", 0.9, 2)
    with pytest.raises(ValueError, match="observations"):
        calibrate_capacity(RoutingTrace(np.zeros((0, 1, 4, 1), dtype=np.int64), num_experts=2), 0.9, 2)
    with pytest.raises(ValueError, match="capacity"):
        spill_capacity(4, 2, -1)
    with pytest.raises(ValueError, match="top_k"):
        pair_bound(4, 0)


def test_bounds_formulas():
    assert pair_bound(43, 2) == 86
    assert spill_capacity(43, 2, 16) == 70 and spill_capacity(43, 2, 100) == 0 and spill_capacity(43, 2, 0) == 86
    assert expert_capacity(8, 43, 2, 16 + 70) == 8 * 86
    assert expert_capacity(8, 43, 2, 43) == 8 * 43  # MaxCounts: a pair delivers at most C_max rows
    assert overflow_fractions(np.zeros((0, 2, 2), dtype=np.int64), 3)["overflow_token_fraction"] == 0.0


@settings(max_examples=80, deadline=None)
@given(T=st.integers(0, 6), K=st.integers(1, 3), E_local=st.integers(1, 3), P=st.integers(1, 4),
       C=st.integers(0, 20), seed=st.integers(0, 2**16))
def test_spill_bound_holds_for_every_routing_and_is_reached(T, K, E_local, P, C, seed):
    """Per pair and per rank, overflow <= S = max(T*K - C, 0); all pairs to one peer overflow by exactly S."""
    E = E_local * P
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, E, (T, K), generator=g)  # repeats allowed
    routed = ids[ids >= 0]
    per_peer = torch.bincount(routed // E_local, minlength=P)
    overflow = (per_peer - C).clamp(min=0)
    S = spill_capacity(T, K, C)
    assert int(overflow.max()) <= S and int(overflow.sum()) <= S
    all_to_one = torch.bincount(torch.zeros(T * K, dtype=torch.int64), minlength=P)
    assert int((all_to_one - C).clamp(min=0).max()) == S
    # one source sends one expert at most min(C + S, T * K) rows, so P sources fit the expert capacity
    per_expert = torch.bincount(routed, minlength=E)
    assert int(per_expert.max()) * P <= expert_capacity(P, T, K, C + S)


def test_token_counts_count_one_copy_per_destination_rank():
    """count="tokens": a token whose slots share a rank counts once there (pairs count each)."""
    # 2 ranks x 2 tokens, top-2, 4 experts (2 per rank)
    ids = np.array([[[[0, 1], [0, 2], [3, -1], [-1, -1]]]], dtype=np.int64)
    trace = RoutingTrace(ids, num_experts=4)
    assert trace_peer_counts(trace, 2).reshape(4).tolist() == [3, 1, 0, 1]
    assert trace_peer_counts(trace, 2, "tokens").reshape(4).tolist() == [2, 1, 0, 1]
    cal = calibrate_capacity(trace, 1.0, 2, count="tokens")
    assert cal.capacity == cal.max_count == 2 and cal.count == "tokens"
    with pytest.raises(ValueError, match="count must be one of"):
        calibrate_capacity(trace, 0.5, 2, count="rows")


def test_token_counts_against_a_loop():
    g = np.random.default_rng(3)
    E, P, T, K = 16, 4, 12, 3
    ids = g.integers(-1, E, size=(3, 2, T, K))
    got = trace_peer_counts(RoutingTrace(ids, num_experts=E), P, "tokens")
    for s in range(3):
        for layer in range(2):
            want = np.zeros((P, P), dtype=np.int64)
            for t in range(T):
                for d in {int(e) // (E // P) for e in ids[s, layer, t] if e >= 0}:
                    want[t // (T // P), d] += 1
            assert got[s, layer].tolist() == want.tolist()
