"""Synthetic cost models and timings for the RaMP tests (no measurements involved)."""

from __future__ import annotations

import numpy as np

from moekit.ramp import costmodel as cm
from moekit.ramp.dataset import Point, Timings
from moekit.ramp.regions import HARDWARE


def random_counts(rng: np.random.Generator, E: int, pairs: int, skew: float) -> np.ndarray:
    """A histogram of ``pairs`` over E experts, Zipf-like with exponent ``skew``."""
    p = 1.0 / np.arange(1, E + 1) ** skew
    p = rng.permutation(p / p.sum())
    return rng.multinomial(pairs, p).astype(np.int64)


def synthetic_model(shape, configs, rng: np.random.Generator, form=cm.ModelForm(), hw=HARDWARE["h200"],
                    family: str = "token", capacity=None) -> cm.CostModel:
    """A CostModel whose every variant has random positive coefficients."""
    model = cm.CostModel(shape, hw, list(configs), form, {}, 2, family, capacity)
    paths = ("direct", "sorted") if family == "token" else (None,)
    for i, c in enumerate(configs):
        for path in paths:
            M = (1 if path == "direct" else c.bm + 1) if family == "token" else 1
            real = model.plan(i, M).path
            coef = np.array([rng.uniform(5, 30), rng.uniform(1, 20), rng.uniform(0, 0.05), rng.uniform(0, 10),
                             rng.uniform(0, 2), rng.uniform(0, 0.05)])
            model.variants[(i, real)] = cm.Variant(i, real, coef, bool(rng.integers(2)), 25, 0.0)
    return model


def timings_from_model(model: cm.CostModel, points: list[Point], noise: float = 0.0,
                       rng: np.random.Generator | None = None) -> Timings:
    """Timings that the model's own formula produces (times (1 + noise * N(0, 1)))."""
    times = np.stack([model.predict(p.counts, p.M) for p in points])
    if noise:
        times = times * (1 + noise * rng.standard_normal(times.shape))
    return Timings(model.shape, model.shape.num_experts, "bfloat16", model.configs, points, times)


def grid(shape, rng, Ms=(1, 8, 40, 200, 900), skews=(0.0, 0.5, 1.0, 1.5, 2.5)) -> list[Point]:
    return [Point(M, 1.0, 1.0, random_counts(rng, shape.num_experts, M * shape.top_k, s)) for M in Ms for s in skews]


def align_subwave(model: cm.CostModel, points: list[Point]) -> cm.CostModel:
    """Give each variant the phi term exactly where the fit's rule would (its median grid over
    ``points`` below one wave), so a fit on those points can reproduce the model."""
    for (i, path), v in model.variants.items():
        c = model.configs[i]
        grids = [model.plan(i, p.M).grids(model.stats(p.counts)[c.bm].blocks) for p in points
                 if model.plan(i, p.M).path == path]
        v.subwave = cm.subwave_rule(grids)
        if not v.subwave:
            v.coef[3] = 0.0
    return model
