import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moekit.tax.padding import (
    binomial_pmf,
    eta,
    expected_active_experts,
    expected_eta,
    expected_padded_work,
    max_load_bounds,
    padded_work,
    round_up,
)

counts_st = st.lists(st.integers(0, 300), min_size=1, max_size=16)
block_st = st.integers(1, 130)


def brute_blockwise(counts, b):
    total = 0
    for n in counts:
        blocks = 0
        while blocks * b < n:
            blocks += 1
        total += blocks * b
    return total


def brute_max(counts, b):
    active = [n for n in counts if n > 0]
    if not active:
        return 0
    top = max(active)
    padded = b * math.ceil(top / b)
    return padded * len(active)


@settings(max_examples=200, deadline=None)
@given(counts_st, block_st)
def test_blockwise_matches_a_loop_and_bounds_hold(counts, b):
    p = int(padded_work(np.array(counts), b, "blockwise"))
    assert p == brute_blockwise(counts, b)
    real = sum(counts)
    active = sum(1 for n in counts if n > 0)
    assert real <= p < real + b * active or (p == real == 0)
    assert p % b == 0


@settings(max_examples=200, deadline=None)
@given(counts_st, block_st)
def test_max_padding_matches_a_loop_and_dominates_blockwise(counts, b):
    p = int(padded_work(np.array(counts), b, "max"))
    assert p == brute_max(counts, b)
    assert p >= int(padded_work(np.array(counts), b, "blockwise"))


@settings(max_examples=100, deadline=None)
@given(st.lists(counts_st.filter(lambda c: len(c) == 6), min_size=1, max_size=5), block_st)
def test_eta_is_padded_over_real_per_batch(batches, b):
    arr = np.array(batches)
    got = eta(arr, b)
    for row, value in zip(batches, got):
        real = sum(row)
        expected = brute_blockwise(row, b) / real if real else 1.0
        assert value == pytest.approx(expected)
        assert value >= 1.0


def test_opposite_worst_cases_of_the_two_schemes():
    # 64 tokens either way. Spread over many experts: more blocks (blockwise waste);
    # one hot expert: every active expert padded to its size (max-padding waste).
    spread = np.array([8] * 8)
    hot = np.array([61, 1, 1, 1, 0, 0, 0, 0])
    b = 16
    assert eta(spread, b, "blockwise") == 2.0 and eta(hot, b, "blockwise") == 1.75
    assert eta(spread, b, "max") == 2.0 and eta(hot, b, "max") == 4.0
    assert eta(spread, b, "blockwise") > eta(hot, b, "blockwise")
    assert eta(hot, b, "max") > eta(spread, b, "max")


def test_round_up_and_bad_block():
    assert round_up([0, 1, 16, 17], 16).tolist() == [0, 16, 16, 32]
    with pytest.raises(ValueError):
        round_up([1], 0)
    with pytest.raises(ValueError):
        padded_work([1], 4, "diagonal")


def test_binomial_pmf_matches_math_comb():
    n, p = 30, 0.27
    pmf = binomial_pmf(n, p)
    exact = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    np.testing.assert_allclose(pmf, exact, rtol=1e-10, atol=1e-15)
    assert binomial_pmf(5, 0.0)[0] == 1.0 and binomial_pmf(5, 1.0)[5] == 1.0


def test_expected_active_experts_by_enumeration():
    # E=5, K=2, m=3: all C(5,2)^3 = 1000 routings are equally likely.
    e, k, m = 5, 2, 3
    choices = list(itertools.combinations(range(e), k))
    total = 0
    for routing in itertools.product(choices, repeat=m):
        total += len(set(x for token in routing for x in token))
    assert expected_active_experts(e, k, m) == pytest.approx(total / len(choices) ** m)


def test_expected_padding_by_enumeration():
    e, k, m, b = 4, 2, 3, 2
    choices = list(itertools.combinations(range(e), k))
    total = 0
    for routing in itertools.product(choices, repeat=m):
        counts = [0] * e
        for token in routing:
            for x in token:
                counts[x] += 1
        total += brute_blockwise(counts, b)
    assert expected_padded_work(e, k, m, b) == pytest.approx(total / len(choices) ** m)
    assert expected_eta(e, k, m, b) == pytest.approx(total / len(choices) ** m / (m * k))


def test_expert_activation_saturates():
    # Seed 5.2: E[E_active] approaches E rapidly; a single token activates exactly K.
    assert expected_active_experts(8, 2, 1) == pytest.approx(2.0)
    assert expected_active_experts(256, 8, 1) == pytest.approx(8.0)
    assert expected_active_experts(8, 2, 64) > 7.9999  # Mixtral: saturated by 64 tokens
    assert expected_active_experts(64, 8, 64) > 63.9  # Qwen2-MoE
    assert expected_active_experts(256, 8, 64) < 230  # DeepSeek-V3 saturates later
    ms = np.arange(1, 200)
    values = expected_active_experts(64, 8, ms)
    assert np.all(np.diff(values) > 0) and np.all(values <= 64)


def test_heavy_bound_holds_on_average_for_many_balls():
    rng = np.random.default_rng(0)
    for balls, bins in [(4096, 8), (2048, 64), (20000, 256), (512, 4)]:
        loads = np.stack([np.bincount(rng.integers(0, bins, balls), minlength=bins) for _ in range(400)])
        mean_max = loads.max(axis=1).mean()
        bound = max_load_bounds(balls, bins)["heavy"]
        assert balls / bins < mean_max <= bound


def test_light_bound_is_the_right_order():
    # log E / log log E is an order of growth for m ~ E: within a factor 2 of the truth.
    rng = np.random.default_rng(1)
    for bins in (16, 64, 256, 1024):
        loads = np.stack([np.bincount(rng.integers(0, bins, bins), minlength=bins) for _ in range(300)])
        mean_max = loads.max(axis=1).mean()
        light = float(max_load_bounds(bins, bins)["light"])
        assert light / 2 <= mean_max <= 2 * light
