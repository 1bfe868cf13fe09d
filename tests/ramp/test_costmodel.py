"""The wave cost model: features, the least-squares fit recovers known coefficients, regret."""

from __future__ import annotations

import numpy as np
import pytest

from moekit.kernels.configs import KernelConfig, config_space
from moekit.ramp import costmodel as cm
from moekit.ramp.dataset import Point
from moekit.shapes import MoEShape

from .synthetic import align_subwave, grid, random_counts, synthetic_model, timings_from_model

SHAPE = MoEShape("fit", num_experts=16, top_k=4, hidden=512, intermediate=256)


def test_phi_is_concave_below_one_wave_and_flat_after():
    u = np.linspace(0, 1, 101)
    for kind in cm.PHIS:
        f = cm.phi(u, kind)
        assert f[0] == 0.0 and f[-1] == pytest.approx(1.0)
        assert np.all(np.diff(f, 2) <= 1e-12), kind  # concave
        assert np.all(np.diff(f) >= 0), kind  # increasing
        assert cm.phi(3.0, kind) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="phi"):
        cm.phi(0.5, "cube")


def test_features_of_each_form():
    grid_ = [(100, 132), (300, 264)]
    f4 = cm.features(grid_, cm.ModelForm(), True, active=5, pairs=40)
    assert f4.tolist() == pytest.approx([1, 1 + 2, 400, np.sqrt(100 / 132) + 1.0, 5, 40])
    f3 = cm.features(grid_, cm.ModelForm(terms=3, traffic=False))
    assert f3.tolist() == pytest.approx([1, 3, 400, 0, 0, 0])
    f2 = cm.features(grid_, cm.ModelForm(terms=2, traffic=False))
    assert f2.tolist() == pytest.approx([1, 100 / 132 + 300 / 264, 0, 0, 0, 0])
    ratio = cm.features(grid_, cm.ModelForm(wave="ratio", traffic=False), False)
    assert ratio[1] == pytest.approx(100 / 132 + 300 / 264) and ratio[3] == 0.0
    with pytest.raises(ValueError, match="terms"):
        cm.ModelForm(terms=5)


def test_ols_recovers_coefficients_and_nonneg_is_the_constrained_optimum():
    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(40), rng.uniform(1, 9, 40), rng.uniform(0, 1e4, 40), rng.uniform(0, 1, 40),
                         np.zeros(40), rng.uniform(0, 300, 40)])
    true = np.array([12.0, 3.5, 0.02, 7.0, 0.0, 0.4])
    y = X @ true
    assert cm.ols(X, y) == pytest.approx(true, rel=1e-8, abs=1e-9)
    assert cm.ols(X, y, 1 / y) == pytest.approx(true, rel=1e-8, abs=1e-9)
    # A target that wants a negative coefficient: the constrained fit is >= 0 and no worse than
    # any other non-negative vector tried at random.
    y2 = X @ np.array([12.0, -3.0, 0.02, 7.0, 0.0, 0.4]) + 50
    b = cm.ols(X, y2, nonneg=True)
    assert np.all(b >= 0)
    res = np.sum((X @ b - y2) ** 2)
    for _ in range(200):
        trial = np.abs(b + rng.normal(0, 0.1, 6) * (np.abs(b) + 1e-3))
        trial[4] = 0
        assert res <= np.sum((X @ trial - y2) ** 2) + 1e-6


def test_fit_recovers_a_known_model_and_has_zero_regret():
    rng = np.random.default_rng(1)
    configs = config_space(SHAPE)[::9]
    truth = synthetic_model(SHAPE, configs, rng, form=cm.ModelForm(weighting="ols", nonneg=False))
    pts = grid(SHAPE, rng)
    align_subwave(truth, pts)
    t = timings_from_model(truth, pts)
    for form in (cm.ModelForm(weighting="ols", nonneg=False), cm.ModelForm()):
        fitted = cm.fit(t, truth.hardware, form)
        assert set(fitted.variants) == set(truth.variants)
        for p in pts:
            assert fitted.predict(p.counts, p.M) == pytest.approx(truth.predict(p.counts, p.M), rel=1e-6)
        r = cm.regret(fitted, t)
        assert r.max == pytest.approx(0.0, abs=1e-9)
    # With 2 % noise the fit is still close and picks near-best configs.
    noisy = timings_from_model(truth, pts, noise=0.02, rng=rng)
    r = cm.regret(cm.fit(noisy, truth.hardware), timings_from_model(truth, pts))
    assert r.mean < 0.02


def test_subwave_rule_uses_the_median_grid():
    assert cm.subwave_rule([[(10, 100)], [(50, 100)], [(500, 100)]])
    assert not cm.subwave_rule([[(10, 100)], [(150, 100)], [(500, 100)]])
    assert not cm.subwave_rule([])


def test_predict_is_nan_where_a_path_was_not_fitted_and_choose_picks_the_least():
    rng = np.random.default_rng(2)
    c16 = KernelConfig(bm=16, bn=64, bk=64, form="fused")
    c64 = KernelConfig(bm=64, bn=64, bk=64, form="fused")
    model = synthetic_model(SHAPE, [c16, c64], rng)
    del model.variants[(0, "sorted")]  # bm 16 never profiled above 16 tokens
    counts = random_counts(rng, 16, 40 * 4, 1.0)
    pred = model.predict(counts, 40)
    assert np.isnan(pred[0]) and np.isfinite(pred[1]) and model.choose(counts, 40) == 1
    pred = model.predict(counts[:], 10)
    assert model.choose(counts, 10) == int(np.argmin(pred))


def test_timings_shape_is_checked():
    from moekit.ramp.dataset import Timings

    with pytest.raises(ValueError, match="times must be"):
        Timings(SHAPE, 16, "bfloat16", [KernelConfig()], [Point(1, 1.0, 1.0, np.zeros(16))], np.zeros((2, 1)))


def test_regret_skips_points_that_were_not_measured():
    """A profile cut short by its deadline leaves whole points unmeasured (NaN rows): the fit and
    the regret use the measured points only, and the regret stays finite."""
    rng = np.random.default_rng(2)
    configs = config_space(SHAPE)[::9]
    truth = synthetic_model(SHAPE, configs, rng)
    pts = grid(SHAPE, rng)
    align_subwave(truth, pts)
    t = timings_from_model(truth, pts)
    cut = timings_from_model(truth, pts)
    cut.times[-3:] = np.nan
    r_cut = cm.regret(cm.fit(cut, truth.hardware), cut)
    assert np.isfinite(r_cut.mean) and np.isfinite(r_cut.max)
    assert len(r_cut.regrets) == len(pts) - 3
    assert len(cm.regret(cm.fit(t, truth.hardware), t).regrets) == len(pts)


def test_a_column_constant_over_the_points_is_left_to_the_intercept():
    """At one token count the routed pairs P are the same at every point: the fit cannot tell
    their cost from the intercept, so it gives P nothing (the minimum-norm split would give it
    a share that grows with the batch when the model is used at another token count)."""
    rng = np.random.default_rng(5)
    n = 12
    G = rng.uniform(100, 900, n)
    X = np.column_stack([np.ones(n), np.ceil(G / 264), G, np.zeros(n), rng.integers(4, 16, n), np.full(n, 512.0)])
    y = X @ np.array([20.0, 4.0, 0.05, 0.0, 1.5, 0.03])  # the truth has a per-pair cost
    for nonneg in (False, True):
        b = cm.ols(X, y, 1 / y, nonneg)
        assert b[5] == 0.0  # the constant P column
        assert X @ b == pytest.approx(y, rel=1e-9)  # the intercept took it: exact at these points
        assert b[0] == pytest.approx(20.0 + 0.03 * 512)
    # Without an intercept column nothing is dropped.
    Z = X[:, 1:]
    assert cm.ols(Z, Z @ np.array([4.0, 0.05, 0.0, 1.5, 0.03]))[4] == pytest.approx(0.03)


def test_a_variant_profiled_at_one_token_count_does_not_extrapolate_its_constant():
    """Fitted on the 5 balancedness levels of M = 64 only, a variant predicts M = 256 without a
    per-pair share of its intercept multiplied by 4 (it keeps what the grid explains)."""
    rng = np.random.default_rng(6)
    configs = [c for c in config_space(SHAPE) if c.bm == 16 and c.form == "two_launch"][:3]
    truth = synthetic_model(SHAPE, configs, rng)
    for v in truth.variants.values():
        v.coef[:] = [30.0, 0.0, 0.0, 0.0, 2.0, 0.0]  # the named experts only: no per-pair cost
    pts = [Point(64, 1.0, 1.0, random_counts(rng, SHAPE.num_experts, 64 * SHAPE.top_k, s)) for s in
           (0.0, 0.5, 1.0, 1.5, 2.5)]
    fitted = cm.fit(timings_from_model(truth, pts), truth.hardware)
    for v in fitted.variants.values():
        assert v.coef[5] == 0.0
    far = random_counts(rng, SHAPE.num_experts, 256 * SHAPE.top_k, 0.5)
    assert fitted.predict(far, 256) == pytest.approx(truth.predict(far, 256), rel=1e-6)


def test_regret_separates_partially_measured_points():
    """A deadline inside a token count leaves some configs unmeasured at its points: those
    points are partial, a choice there that was not measured is flagged, and the complete
    points' regret is reported apart."""
    rng = np.random.default_rng(7)
    configs = config_space(SHAPE)[::9]
    truth = synthetic_model(SHAPE, configs, rng)
    pts = grid(SHAPE, rng)
    align_subwave(truth, pts)
    t = timings_from_model(truth, pts)
    r_all = cm.regret(truth, t)
    chosen = r_all.chosen
    last = [j for j, p in enumerate(pts) if p.M == pts[-1].M]
    for j in last:  # the last token count: every config but the first few unmeasured, the choice too
        keep = [i for i in range(len(configs)) if i < 3 and i != chosen[j]]
        t.times[j, [i for i in range(len(configs)) if i not in keep]] = np.nan
    r = cm.regret(truth, t)
    assert r.complete.tolist() == [j not in last for j in range(len(pts))]
    assert r.unmeasured.tolist() == [j in last for j in range(len(pts))]
    assert r.complete_mean == pytest.approx(0.0, abs=1e-12) and r.complete_max == pytest.approx(0.0, abs=1e-12)
    assert r.max > 0  # the unmeasured choices count as the slowest measured
    assert "partially measured points" in r.describe() and f"over {len(pts) - len(last)} points" in r.describe()
    # A config that never ran anywhere makes no point partial.
    t2 = timings_from_model(truth, pts)
    t2.times[:, 0] = np.nan
    assert cm.regret(truth, t2).complete.all()
