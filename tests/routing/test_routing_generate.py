"""synthetic_routing: reproducibility, distinct experts, weights, skew targets, validation."""

import math

import numpy as np
import pytest
import torch

from moekit.routing import balancedness, expert_counts, synthetic_routing


def realized_beta(ids: torch.Tensor, num_experts: int) -> float:
    return float(balancedness(expert_counts(ids, num_experts)))


def assert_distinct_per_token(ids: torch.Tensor) -> None:
    s, _ = torch.sort(ids, dim=1)
    assert bool((s[:, 1:] != s[:, :-1]).all()), "a token was routed to the same expert twice"


def test_same_seed_same_output_and_other_seed_differs():
    a = synthetic_routing(512, 32, 4, beta=0.8, seed=7)
    b = synthetic_routing(512, 32, 4, beta=0.8, seed=7)
    c = synthetic_routing(512, 32, 4, beta=0.8, seed=8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_shapes_dtypes_and_range():
    ids, w = synthetic_routing(100, 16, 3, seed=1)
    assert ids.shape == (100, 3) and ids.dtype == torch.int64
    assert w.shape == (100, 3) and w.dtype == torch.float32
    assert int(ids.min()) >= 0 and int(ids.max()) < 16


@pytest.mark.parametrize(
    "kwargs",
    [dict(beta=1.0), dict(beta=0.7), dict(beta=0.01), dict(zipf=0.0), dict(zipf=1.5), dict(zipf=50.0)],
)
def test_no_duplicate_experts_within_a_token(kwargs):
    ids, _ = synthetic_routing(2000, 16, 6, seed=3, **kwargs)
    assert_distinct_per_token(ids)


def test_weights_positive_sorted_and_normalized():
    _, w = synthetic_routing(1000, 64, 8, beta=0.6, seed=2)
    assert bool((w > 0).all())
    assert bool((w[:, :-1] >= w[:, 1:]).all())
    torch.testing.assert_close(w.sum(dim=1), torch.ones(1000), rtol=0, atol=1e-6)


def test_weights_false_gives_none_and_same_ids():
    ids_w, _ = synthetic_routing(300, 16, 2, beta=0.8, seed=5)
    ids, w = synthetic_routing(300, 16, 2, beta=0.8, seed=5, weights=False)
    assert w is None
    assert torch.equal(ids, ids_w)


@pytest.mark.parametrize(
    "T, E, K, beta",
    [
        (4096, 64, 8, 1.0),
        (4096, 64, 8, 0.75),
        (4096, 64, 8, 0.6),
        (4096, 8, 2, 0.8),
        (4096, 128, 8, 0.7),
        (2048, 256, 8, 0.65),
        (4096, 16, 1, 0.3),
    ],
)
def test_beta_target_is_achieved(T, E, K, beta):
    ids, _ = synthetic_routing(T, E, K, beta=beta, seed=11)
    assert abs(realized_beta(ids, E) - beta) < 0.005


def test_beta_below_achievable_returns_most_skewed_routing():
    E, K, T = 64, 8, 1024
    ids, _ = synthetic_routing(T, E, K, beta=0.2, seed=0)  # min achievable is log 8 / log 64 = 0.5
    load = expert_counts(ids, E)
    assert int((load > 0).sum()) == K and bool((load[load > 0] == T).all())
    assert realized_beta(ids, E) == pytest.approx(math.log(K) / math.log(E))


def test_tiny_T_does_not_raise():
    for beta in (1.0, 0.5, 0.05):
        ids, w = synthetic_routing(1, 8, 2, beta=beta, seed=0)
        assert ids.shape == (1, 2) and ids[0, 0] != ids[0, 1]


def test_all_experts_per_token():
    ids, _ = synthetic_routing(10, 4, 4, beta=0.3, seed=0)
    assert torch.equal(torch.sort(ids, dim=1).values, torch.arange(4).expand(10, 4))


def test_zipf_top1_frequencies_follow_the_law():
    T, E, a = 40000, 16, 1.2
    ids, _ = synthetic_routing(T, E, 1, zipf=a, seed=4)
    load = np.sort(expert_counts(ids, E).numpy())[::-1]
    p = np.arange(1, E + 1, dtype=np.float64) ** -a
    p /= p.sum()
    sigma = np.sqrt(T * p * (1 - p))
    assert np.all(np.abs(load - T * p) < 5 * sigma)


def test_zipf_skew_grows_with_exponent_and_permutes_experts():
    betas = [realized_beta(synthetic_routing(4096, 64, 8, zipf=a, seed=1)[0], 64) for a in (0.0, 0.5, 1.0, 2.0)]
    assert betas[0] > 0.99
    assert betas == sorted(betas, reverse=True)
    favourites = {int(torch.mode(synthetic_routing(2000, 64, 1, zipf=2.0, seed=s)[0][:, 0]).values) for s in range(6)}
    assert len(favourites) > 1, "the most popular expert should depend on the seed"


def test_empty_token_count():
    ids, w = synthetic_routing(0, 8, 2, beta=0.5)
    assert ids.shape == (0, 2) and ids.dtype == torch.int64
    assert w.shape == (0, 2) and w.dtype == torch.float32


@pytest.mark.parametrize(
    "args, kwargs, name",
    [
        ((-1, 8, 2), {}, "num_tokens"),
        ((4, 0, 1), {}, "num_experts"),
        ((4, 8, 9), {}, "top_k"),
        ((4, 8, 0), {}, "top_k"),
        ((4.0, 8, 2), {}, "num_tokens"),
        ((4, 8, 2), dict(beta=0.0), "beta"),
        ((4, 8, 2), dict(beta=1.5), "beta"),
        ((4, 8, 2), dict(beta=float("nan")), "beta"),
        ((4, 8, 2), dict(zipf=-1.0), "zipf"),
        ((4, 8, 2), dict(zipf=float("inf")), "zipf"),
        ((4, 8, 2), dict(zipf=1.0, beta=0.5), "zipf"),
        ((4, 8, 2), dict(seed=-3), "seed"),
    ],
)
def test_invalid_arguments_name_the_argument(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        synthetic_routing(*args, **kwargs)
