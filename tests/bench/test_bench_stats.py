"""moekit.bench.stats against statistics computed independently of numpy's percentile."""

import math
import statistics

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moekit.bench.stats import geomean, ratio, summarize


def linear_percentile(values, q):
    """Percentile by the textbook linear rule: rank q/100 * (n - 1) in the sorted values."""
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


def check_against_reference(samples):
    summary = summarize(samples)
    # Rounding error of float64 sums scales with the samples' magnitude.
    tol = 1e-12 * (1.0 + max(abs(x) for x in samples))
    assert summary["n"] == len(samples)
    assert isinstance(summary["n"], int)
    assert summary["mean"] == pytest.approx(statistics.fmean(samples), rel=1e-12, abs=tol)
    assert summary["median"] == pytest.approx(statistics.median(samples), rel=1e-12, abs=tol)
    for key, q in (("p5", 5), ("median", 50), ("p95", 95), ("p99", 99)):
        assert summary[key] == pytest.approx(linear_percentile(samples, q), rel=1e-12, abs=tol)
    assert summary["min"] == min(samples)
    assert summary["max"] == max(samples)
    expected_std = statistics.stdev(samples) if len(samples) > 1 else 0.0
    assert summary["std"] == pytest.approx(expected_std, rel=1e-9, abs=tol)
    for key in ("mean", "median", "p5", "p95", "p99", "min", "max", "std"):
        assert isinstance(summary[key], float)


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_summarize_matches_reference_on_random_samples(n):
    rng = np.random.default_rng(n)
    # Heavy-tailed like real latencies: a lognormal around ~50 µs.
    samples = rng.lognormal(mean=4.0, sigma=0.5, size=n).tolist()
    check_against_reference(samples)


@given(st.lists(st.floats(min_value=0.0, max_value=1e7), min_size=1, max_size=200))
def test_summarize_matches_reference_on_any_samples(samples):
    check_against_reference(samples)


def test_summarize_accepts_arrays_and_generators():
    array = np.array([3.0, 1.0, 2.0])
    assert summarize(array) == summarize(x for x in [3.0, 1.0, 2.0])
    assert summarize(array)["median"] == 2.0


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [float("inf")]])
def test_summarize_refuses_empty_and_non_finite(bad):
    with pytest.raises(ValueError, match="samples_us"):
        summarize(bad)


def test_ratio():
    assert ratio(300.0, 150.0) == 2.0
    assert isinstance(ratio(np.float32(3), 2), float)
    with pytest.raises(ValueError, match="denominator"):
        ratio(1.0, 0.0)
    with pytest.raises(ValueError, match="finite"):
        ratio(float("nan"), 1.0)


def test_geomean():
    assert geomean([2.0, 0.5]) == pytest.approx(1.0)
    assert geomean([1.0, 10.0, 100.0]) == pytest.approx(10.0)
    rng = np.random.default_rng(0)
    values = rng.uniform(0.5, 3.0, size=50)
    assert geomean(values) == pytest.approx(math.prod(values) ** (1 / len(values)))
    # Long lists of large ratios must not overflow a running product.
    assert geomean([1e300] * 10) == pytest.approx(1e300)
    with pytest.raises(ValueError, match="positive"):
        geomean([1.0, 0.0])
    with pytest.raises(ValueError):
        geomean([])
