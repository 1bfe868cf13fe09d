"""The Mixtral-8x7B Cap-and-Spill preset reproduces the paper's per-peer count statistics."""

import numpy as np
import pytest

from moekit.routing import mixtral_capspill_trace, trace_stats

# the Cap-and-Spill paper, section 3.2: per-peer counts over ~2M observations.
SEED_FIGURES = {"mean": 5.1, "std": 3.6, "q99": 16.0, "max": 43.0}


@pytest.mark.parametrize("seed", [0, 1])
def test_full_size_trace_matches_seed_statistics_within_10_percent(seed):
    trace = mixtral_capspill_trace(steps=1000, layers=32, seed=seed)
    stats = trace_stats(trace, world_size=8)
    assert stats.num_observations == 1000 * 32 * 64  # the paper's "over 2 million"
    got = {"mean": stats.mean, "std": stats.std, "q99": stats.quantiles[0.99], "max": stats.max}
    for key, target in SEED_FIGURES.items():
        assert abs(got[key] - target) <= 0.1 * target, f"{key}: got {got[key]}, seed says {target}"


def test_trace_layout():
    trace = mixtral_capspill_trace(steps=40, layers=4, seed=3, weights=True)
    ids = trace.topk_ids
    assert ids.shape == (40, 4, 344, 2) and trace.num_experts == 8
    assert trace.metadata["world_size"] == 8
    valid = ids[..., 0] >= 0
    assert np.array_equal(valid, ids[..., 1] >= 0), "a token is either routed in both slots or masked"
    assert (ids[..., 0] != ids[..., 1])[valid].all(), "top-2 experts must be distinct"
    # every layer of a step sees the same tokens; each rank holds L//8 or L//8+1 of them
    assert (valid == valid[:, :1]).all()
    per_rank = valid[:, 0].reshape(40, 8, 43).sum(axis=-1)
    assert (per_rank.max(axis=1) - per_rank.min(axis=1) <= 1).all()
    w = trace.topk_weights
    assert (w[valid] > 0).all() and np.allclose(w[valid].sum(axis=-1), 1.0, atol=1e-6)
    assert (w[~valid] == 0).all()


def test_same_seed_same_trace():
    a = mixtral_capspill_trace(steps=20, layers=2, seed=5)
    b = mixtral_capspill_trace(steps=20, layers=2, seed=5)
    c = mixtral_capspill_trace(steps=20, layers=2, seed=6)
    assert np.array_equal(a.topk_ids, b.topk_ids)
    assert not np.array_equal(a.topk_ids, c.topk_ids)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="steps"):
        mixtral_capspill_trace(steps=-1)
    with pytest.raises(ValueError, match="layers"):
        mixtral_capspill_trace(layers=2.5)
