"""The offline checks: which mode won at a point, the region table, the ablation runner."""

from __future__ import annotations

import numpy as np
import pytest

from moekit.kernels.configs import KernelConfig, config_space
from moekit.ramp import analysis
from moekit.ramp.dataset import Point, Timings
from moekit.ramp.regions import HARDWARE
from moekit.shapes import MoEShape

from .synthetic import grid, synthetic_model, timings_from_model

SHAPE = MoEShape("an", num_experts=8, top_k=2, hidden=4096, intermediate=14336)


def test_measured_wins_compare_best_with_and_without_each_mode():
    cfgs = [KernelConfig(bm=16, group_m=1), KernelConfig(bm=16, group_m=8), KernelConfig(bm=64, split_k=4),
            KernelConfig(bm=128)]
    times = np.array([[100.0, 90.0, 120.0, 99.0], [100.0, 99.5, 95.0, np.nan]])
    t = Timings(SHAPE, 8, "bfloat16", cfgs, [Point(1, 1, 1, np.ones(8, int)), Point(2, 1, 1, np.ones(8, int))], times)
    w0 = analysis.measured_wins(t, 0)
    assert w0 == {"group_m": True, "split_k": False, "small_bm": True}
    w1 = analysis.measured_wins(t, 1)  # 99.5 vs 95: split-K wins; GROUP_M 99.5 vs 95 no
    assert w1 == {"group_m": False, "split_k": True, "small_bm": False}


def test_region_check_and_ablation_on_synthetic_timings():
    rng = np.random.default_rng(0)
    model = synthetic_model(SHAPE, config_space(SHAPE)[::15], rng)
    t = timings_from_model(model, grid(SHAPE, rng, Ms=(1, 4, 32, 128, 512, 2048)))
    rc = analysis.region_check(t, HARDWARE["h200"])
    assert rc["region"] == "B" and "GROUP_M" in rc["modes"]
    for s in rc["summary"].values():
        assert s["points"] == len(t.points) and 0 <= s["agree"] <= 1
    fit_t, test_t = analysis.split_points(t, {1, 32, 512, 2048})
    ab = analysis.ablation(fit_t, test_t, HARDWARE["h200"], {"default": analysis.ABLATION_FORMS["4-term + traffic (default)"]})
    assert ab["default"]["points"] == len(test_t.points) and ab["default"]["mean"] >= 0


def test_regret_of_choices_counts_untimed_as_slowest():
    cfgs = [KernelConfig(bm=16), KernelConfig(bm=32)]
    t = Timings(SHAPE, 8, "bfloat16", cfgs, [Point(1, 1, 1, np.ones(8, int))], np.array([[10.0, np.nan]]))
    assert analysis.regret_of_choices(t, [1]).tolist() == pytest.approx([0.0])
    t2 = Timings(SHAPE, 8, "bfloat16", cfgs + [KernelConfig(bm=64)], [Point(1, 1, 1, np.ones(8, int))],
                 np.array([[10.0, np.nan, 15.0]]))
    assert analysis.regret_of_choices(t2, [1]).tolist() == pytest.approx([0.5])


@pytest.mark.parametrize("by", ["M", "beta"])
def test_held_out_fits_without_each_group(by):
    """Leave one token count / one balancedness out: each group's regret is that of a model
    fitted on the other points and scored on the group (checked against doing it by hand)."""
    from moekit.ramp import costmodel as cm

    rng = np.random.default_rng(1)
    shape = MoEShape("ho", num_experts=16, top_k=4, hidden=512, intermediate=256)
    truth = synthetic_model(shape, config_space(shape)[::20], rng)
    pts = grid(shape, rng, Ms=(1, 8, 40, 200))
    for k, p in enumerate(pts):
        p.beta = (1.0, 0.7, 0.4)[k % 3]
    t = timings_from_model(truth, pts, noise=0.05, rng=rng)
    t.times[[j for j, p in enumerate(pts) if p.M == 200][0], 1:] = np.nan  # a deadline at M = 200
    hw = HARDWARE["h200"]
    h = analysis.held_out(t, hw, by=by)
    key = (lambda p: p.M) if by == "M" else (lambda p: p.beta)
    groups = sorted({key(p) for p in pts})
    assert list(h["groups"]) == [str(g) for g in groups] and h["points"] == len(pts)
    measured = np.isfinite(t.times).any(axis=0)
    for g in groups:
        model = cm.fit(t.select_points(lambda p: key(p) != g), hw)
        r = cm.regret(model, t.select_points(lambda p: key(p) == g), measured)
        assert h["groups"][str(g)]["mean"] == pytest.approx(r.mean)
        assert h["groups"][str(g)]["max"] == pytest.approx(r.max)
    assert h["partial"] == 1
    with pytest.raises(ValueError, match="by must be"):
        analysis.held_out(t, hw, by="K")
