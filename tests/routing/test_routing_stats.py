"""Counts, skew and trace statistics, checked against independent brute-force references."""

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moekit.routing import (
    RoutingTrace,
    active_experts,
    balancedness,
    expert_counts,
    format_stats,
    peer_counts,
    trace_stats,
)


def random_ids(rng, shape, num_experts, masked=0.2):
    """Random routing with distinct-or-not experts and a fraction of -1 slots."""
    ids = rng.integers(0, num_experts, size=shape)
    ids[rng.random(shape) < masked] = -1
    return ids


def peer_counts_loop(ids, num_experts, world_size):
    """Reference: walk every slot of a [T, K] routing."""
    T, K = ids.shape
    tokens_per_rank, experts_per_rank = T // world_size, num_experts // world_size
    c = np.zeros((world_size, world_size), dtype=np.int64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e >= 0:
                c[t // tokens_per_rank, e // experts_per_rank] += 1
    return c


def entropy_reference(load):
    total = sum(load)
    if total == 0:
        return math.nan
    if len(load) == 1:
        return 1.0
    return -sum(x / total * math.log2(x / total) for x in load if x) / math.log2(len(load))


# -- peer_counts / expert_counts ----------------------------------------------------------


@pytest.mark.parametrize("E, P, T, K", [(8, 8, 64, 2), (64, 4, 48, 8), (12, 3, 9, 1), (16, 1, 5, 3), (32, 16, 32, 4)])
def test_peer_counts_matches_brute_force(E, P, T, K):
    rng = np.random.default_rng(E * 1000 + P)
    ids = random_ids(rng, (3, 2, T, K), E)
    got = peer_counts(ids, E, P)
    assert got.shape == (3, 2, P, P) and got.dtype == np.int64
    assert got.sum() > 0
    for b in np.ndindex(3, 2):
        assert np.array_equal(got[b], peer_counts_loop(ids[b], E, P))


def test_peer_counts_accepts_torch_and_small_int_dtypes():
    rng = np.random.default_rng(1)
    ids = random_ids(rng, (40, 4), 16)
    expected = peer_counts_loop(ids, 16, 4)
    got_torch = peer_counts(torch.from_numpy(ids), 16, 4)
    assert isinstance(got_torch, torch.Tensor) and got_torch.dtype == torch.int64
    assert np.array_equal(got_torch.numpy(), expected)
    assert np.array_equal(peer_counts(ids.astype(np.int16), 16, 4), expected)


def test_expert_counts_matches_loop_and_keeps_batch_dims():
    rng = np.random.default_rng(2)
    ids = random_ids(rng, (4, 30, 3), 10)
    got = expert_counts(ids, 10)
    assert got.shape == (4, 10)
    for b in range(4):
        ref = np.zeros(10, dtype=np.int64)
        for e in ids[b].ravel():
            if e >= 0:
                ref[e] += 1
        assert np.array_equal(got[b], ref)
    assert torch.equal(expert_counts(torch.from_numpy(ids[0]), 10), torch.from_numpy(got[0]))


def test_counts_of_empty_routing_are_zero():
    assert np.array_equal(expert_counts(np.zeros((0, 2), np.int64), 4), np.zeros(4))
    assert np.array_equal(peer_counts(np.zeros((0, 2), np.int64), 4, 2), np.zeros((2, 2)))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: peer_counts(np.zeros((10, 2), np.int64), 8, 4), "multiple of world_size"),
        (lambda: peer_counts(np.zeros((8, 2), np.int64), 6, 4), "world_size must divide"),
        (lambda: peer_counts(np.zeros((8, 2), np.int64), 8, 0), "world_size"),
        (lambda: peer_counts(np.full((8, 2), 8), 8, 4), r"\[-1, 7\]"),
        (lambda: peer_counts(np.full((8, 2), -5), 8, 4), r"\[-1, 7\]"),
        (lambda: peer_counts(np.zeros((8, 2), np.float32), 8, 4), "integer"),
        (lambda: expert_counts(np.zeros(8, np.int64), 8), r"\[\.\.\., T, K\]"),
        (lambda: expert_counts(np.zeros((8, 2), np.int64), 0), "num_experts"),
    ],
)
def test_invalid_inputs_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@settings(max_examples=60, deadline=None)
@given(
    P=st.sampled_from([1, 2, 4, 8]),
    experts_per_rank=st.integers(1, 4),
    tokens_per_rank=st.integers(0, 6),
    K=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    masked=st.floats(0.0, 1.0),
)
def test_peer_counts_conserve_slots(P, experts_per_rank, tokens_per_rank, K, seed, masked):
    E, T = P * experts_per_rank, P * tokens_per_rank
    ids = random_ids(np.random.default_rng(seed), (T, K), E, masked)
    c = peer_counts(ids, E, P)
    valid = ids >= 0
    assert c.sum() == valid.sum()
    # row i: everything rank i sends; column j: everything rank j's experts receive
    assert np.array_equal(c.sum(axis=1), valid.reshape(P, tokens_per_rank * K).sum(axis=1))
    assert np.array_equal(c.sum(axis=0), expert_counts(ids, E).reshape(P, experts_per_rank).sum(axis=1))


# -- balancedness / active_experts --------------------------------------------------------


def test_balancedness_reference_values_and_conventions():
    assert balancedness(np.array([5, 5, 5, 5])) == pytest.approx(1.0)
    assert balancedness(np.array([0, 9, 0, 0])) == pytest.approx(0.0)
    assert balancedness(np.array([3, 3, 0, 0])) == pytest.approx(0.5)
    assert math.isnan(balancedness(np.zeros(4)))
    assert balancedness(np.array([7])) == 1.0


def test_balancedness_matches_reference_on_random_batches():
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 6, size=(5, 7, 9))
    counts[0, 0] = 0
    got = balancedness(counts)
    assert got.shape == (5, 7)
    for b in np.ndindex(5, 7):
        ref = entropy_reference(list(counts[b]))
        assert (math.isnan(ref) and math.isnan(got[b])) or got[b] == pytest.approx(ref, abs=1e-12)
    as_tensor = balancedness(torch.from_numpy(counts))
    assert isinstance(as_tensor, torch.Tensor)
    np.testing.assert_array_equal(as_tensor.numpy(), got)


def test_active_experts():
    counts = np.array([[0, 1, 2, 0], [0, 0, 0, 0]])
    assert np.array_equal(active_experts(counts), [2, 0])
    assert active_experts(np.array([1, 1, 0])) == 2
    with pytest.raises(ValueError, match=">= 0"):
        active_experts(np.array([1, -1]))


# -- trace_stats ------------------------------------------------------------------------


@pytest.fixture
def small_trace():
    rng = np.random.default_rng(4)
    E, P, T, K = 8, 4, 16, 2
    ids = random_ids(rng, (6, 3, T, K), E, masked=0.1)
    ids[0, 0] = -1  # an empty (step, layer): balancedness is nan there and must be skipped
    return RoutingTrace(ids, num_experts=E, name="small"), P


def test_trace_stats_match_independent_numpy(small_trace):
    trace, P = small_trace
    ids = trace.topk_ids
    E = trace.num_experts
    c = np.zeros(ids.shape[:2] + (P, P), dtype=np.int64)
    for s, layer in np.ndindex(*ids.shape[:2]):
        c[s, layer] = peer_counts_loop(ids[s, layer], E, P)
    flat = c.ravel()
    stats = trace_stats(trace, P, capacity=3)
    assert stats.num_observations == flat.size == 6 * 3 * P * P
    assert stats.routed_slots == int((ids >= 0).sum())
    assert stats.mean == pytest.approx(flat.mean())
    assert stats.std == pytest.approx(flat.std())
    assert stats.max == flat.max()
    for q, v in stats.quantiles.items():
        assert v == pytest.approx(np.percentile(flat, 100 * q))
    assert stats.overflow_slice_fraction == pytest.approx(np.mean(flat > 3))
    sends_over = [(c[s, layer, i] > 3).any() for s, layer, i in np.ndindex(6, 3, P)]
    assert stats.overflow_send_fraction == pytest.approx(np.mean(sends_over))
    assert stats.overflow_token_fraction == pytest.approx(np.clip(flat - 3, 0, None).sum() / flat.sum())
    assert stats.padding_waste_at_capacity == pytest.approx(1 - np.minimum(flat, 3).mean() / 3)
    assert stats.padding_waste_at_max == pytest.approx(1 - flat.mean() / flat.max())
    loads = [[sum(1 for e in ids[s, layer].ravel() if e == x) for x in range(E)] for s, layer in np.ndindex(6, 3)]
    assert stats.active_experts_mean == pytest.approx(np.mean([sum(1 for x in load if x) for load in loads]))
    betas = [entropy_reference(load) for load in loads]
    betas = [b for b in betas if not math.isnan(b)]
    assert stats.balancedness_mean == pytest.approx(np.mean(betas))
    assert stats.balancedness_min == pytest.approx(min(betas))


def test_default_capacity_is_ceil_q99_and_report_is_readable(small_trace):
    trace, P = small_trace
    stats = trace_stats(trace, P)
    counts = peer_counts(trace.topk_ids, trace.num_experts, P).ravel()
    assert stats.capacity == math.ceil(np.quantile(counts, 0.99))
    assert stats.capacity_source == "ceil(Q0.99)"
    d = stats.to_dict()
    assert json.loads(json.dumps(d))["quantiles"]["0.99"] == pytest.approx(np.quantile(counts, 0.99))
    text = format_stats(stats)
    for needle in ("'small'", f"mean {stats.mean:.2f}", f"C = {stats.capacity}", "Q99 ", "balancedness"):
        assert needle in text


def test_capacity_zero_overflows_everything(small_trace):
    """C = 0 (the command's help allows it): every routed slot overflows; a buffer of no rows has no padding."""
    trace, P = small_trace
    stats = trace_stats(trace, P, capacity=0)
    assert stats.capacity == 0 and stats.overflow_token_fraction == 1.0 and stats.padding_waste_at_capacity == 0.0
    counts = np.asarray(peer_counts(trace.topk_ids, trace.num_experts, P))
    assert stats.overflow_slice_fraction == pytest.approx(float((counts > 0).mean()))


def test_trace_stats_rejects_bad_arguments(small_trace):
    trace, P = small_trace
    for bad in (-1, 2**31, 10**20, 1.5, True):
        with pytest.raises(ValueError, match=r"capacity must be an int in \[0, 2147483647\]"):
            trace_stats(trace, P, capacity=bad)
    with pytest.raises(ValueError, match="quantiles"):
        trace_stats(trace, P, quantiles=(1.5,))
    with pytest.raises(ValueError, match="world_size"):
        trace_stats(trace, 5)  # 16 tokens over 5 ranks (and 8 experts)
    with pytest.raises(ValueError, match="RoutingTrace"):
        trace_stats(trace.topk_ids, P)
    with pytest.raises(ValueError, match="no \\(step, layer\\)"):
        trace_stats(RoutingTrace(np.zeros((0, 2, 4, 2), np.int64), 8), P)
