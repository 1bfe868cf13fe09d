"""Summary statistics for benchmark samples.

Every timing function in :mod:`moekit.bench.timing` returns per-iteration samples in
microseconds; :func:`summarize` turns them into the numbers the papers report (mean,
median, p95, p99, ...). Comparisons are reported as ratios (:func:`ratio`) and, over many
operating points, as a geometric mean of ratios (:func:`geomean`), as the RaMP paper does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

# The percentiles every summary carries, by key.
_PERCENTILES = {"p5": 5.0, "median": 50.0, "p95": 95.0, "p99": 99.0}


def _as_finite_array(values: Iterable[float], what: str) -> np.ndarray:
    """Flatten ``values`` into a float64 array, refusing empty or non-finite input.

    A NaN or infinity in timing samples means a broken measurement; summarizing it
    would silently produce a NaN mean or a meaningless percentile.
    """
    if not hasattr(values, "__len__"):  # a generator or iterator: materialize it once
        values = list(values)
    array = np.asarray(values, dtype=np.float64).ravel()
    if array.size == 0:
        raise ValueError(f"{what} must not be empty")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{what} must be finite, got {array[~np.isfinite(array)][:3].tolist()}")
    return array


def summarize(samples_us: Iterable[float]) -> dict[str, float | int]:
    """Summarize timing samples (microseconds).

    Returns ``n`` (int) and, as floats in the samples' unit: ``mean``, ``median``,
    ``p5``, ``p95``, ``p99``, ``min``, ``max`` and ``std``.

    Percentiles use numpy's default ``"linear"`` method: the value at rank
    ``q/100 * (n - 1)`` of the sorted samples, interpolated linearly between the two
    nearest samples (so the median of an even count is the mean of the middle two).
    ``std`` is the sample standard deviation (``ddof=1``), an estimate of the spread of
    the timing distribution; it is 0.0 for a single sample.
    """
    array = _as_finite_array(samples_us, "samples_us")
    summary: dict[str, float | int] = {"n": int(array.size), "mean": float(array.mean())}
    for key, q in _PERCENTILES.items():
        summary[key] = float(np.percentile(array, q, method="linear"))
    summary["min"] = float(array.min())
    summary["max"] = float(array.max())
    summary["std"] = float(array.std(ddof=1)) if array.size > 1 else 0.0
    return summary


def ratio(a: float, b: float) -> float:
    """``a / b`` as a float, for reporting one measurement relative to another.

    With times, ``ratio(baseline_us, ours_us)`` is the speedup of ours over the
    baseline (> 1 means ours is faster). ``b`` must be positive: a zero or negative
    time is a measurement error, not something to divide by.
    """
    a, b = float(a), float(b)
    if not math.isfinite(a) or not math.isfinite(b):
        raise ValueError(f"ratio needs finite numbers, got a={a}, b={b}")
    if b <= 0.0:
        raise ValueError(f"ratio's denominator b must be > 0, got {b}")
    return a / b


def geomean(values: Iterable[float]) -> float:
    """Geometric mean of positive numbers (typically speedup ratios).

    The geometric mean is the right average for ratios: a 2x speedup and a 2x slowdown
    average to 1.0. Computed as ``exp(mean(log(v)))`` so long lists don't overflow.
    """
    array = _as_finite_array(values, "geomean's values")
    if np.any(array <= 0.0):
        raise ValueError(f"geomean needs positive values, got min {array.min()}")
    return float(np.exp(np.log(array).mean()))
