"""Offline checks of RaMP on measured timings (CPU only): the region predictions against what
won, the cost model's regret for several forms (the ablation), the fallback.

Everything takes :class:`~moekit.ramp.dataset.Timings`: from the committed ``moekit bench
kernel`` dataset or from ``moekit ramp profile`` / ``moekit bench ramp`` records.
"""

from __future__ import annotations

import math

import numpy as np

from moekit.ramp import costmodel as cm
from moekit.ramp.dataset import Timings
from moekit.ramp.fallback import fallback_choice, templates
from moekit.ramp.regions import Hardware, predict_modes, predict_point

WIN_MARGIN = 0.02  # a mode "wins" at a point when its best config is this much faster than the best without it
MODES = ("group_m", "split_k", "small_bm")


def _best(times: np.ndarray, mask: np.ndarray) -> float:
    sel = times[mask]
    sel = sel[np.isfinite(sel)]
    return float(sel.min()) if sel.size else math.nan


def measured_wins(timings: Timings, j: int) -> dict[str, bool | None]:
    """Whether each mode won at point ``j``: its best configuration at least WIN_MARGIN faster
    than the best configuration without it (None where one side was not timed)."""
    t = timings.times[j]
    cfgs = timings.configs
    masks = {
        "group_m": np.array([c.group_m > 1 for c in cfgs]),
        "split_k": np.array([c.split_k > 1 for c in cfgs]),
        "small_bm": np.array([c.bm <= 32 for c in cfgs]),
    }
    out = {}
    for mode, m in masks.items():
        with_, without = _best(t, m), _best(t, ~m)
        out[mode] = None if math.isnan(with_) or math.isnan(without) else with_ < (1 - WIN_MARGIN) * without
    return out


def region_check(timings: Timings, hw: Hardware, elem_bytes: int = 2) -> dict:
    """The region analysis against the measurements (the RaMP paper's Table III, checked point
    by point): the shape's region and predicted modes, and per mode how often a prediction at
    a point (:func:`~moekit.ramp.regions.predict_point`) matched what won."""
    shape = timings.shape
    pm = predict_modes(shape, hw, elem_bytes, timings.routed_experts)
    rows = []
    tally = {m: {"pred_win": 0, "pred_lose": 0, "nopred_win": 0, "nopred_lose": 0} for m in MODES}
    for j, p in enumerate(timings.points):
        pred = predict_point(shape, p.counts, p.M, hw, elem_bytes=elem_bytes, space=timings.configs)
        won = measured_wins(timings, j)
        row = {"M": p.M, "beta": p.beta, "realized_beta": p.realized_beta, "waste64": pred.waste64}
        for mode in MODES:
            predicted = getattr(pred, mode)
            row[f"{mode}_pred"], row[f"{mode}_won"] = predicted, won[mode]
            if won[mode] is None:
                continue
            key = ("pred_" if predicted else "nopred_") + ("win" if won[mode] else "lose")
            tally[mode][key] += 1
        rows.append(row)
    summary = {}
    for mode, t in tally.items():
        n = sum(t.values())
        summary[mode] = {**t, "points": n, "agree": (t["pred_win"] + t["nopred_lose"]) / n if n else math.nan}
    return {"shape": shape.name, "region": pm["region"], "lam": pm["lam"], "kappa": pm["kappa"],
            "decode_grid": pm["decode_grid"], "modes": pm["modes"], "summary": summary, "points": rows}


def regret_of_choices(timings: Timings, chosen: list[int]) -> np.ndarray:
    """t(chosen) / t(best) - 1 per point (a choice not timed there counts as the slowest)."""
    out = []
    for j, i in enumerate(chosen):
        row = timings.times[j]
        t = row[i] if np.isfinite(row[i]) else np.nanmax(row)
        out.append(t / np.nanmin(row) - 1.0)
    return np.asarray(out)


def ablation(fit_on: Timings, test_on: Timings, hw: Hardware, forms: dict[str, cm.ModelForm]) -> dict:
    """Mean / max regret on ``test_on`` of each form fitted on ``fit_on``."""
    out = {}
    for name, form in forms.items():
        model = cm.fit(fit_on, hw, form)
        r = cm.regret(model, test_on).regrets
        r_fit = cm.regret(model, fit_on).regrets
        out[name] = {"form": form.to_dict(), "mean": float(r.mean()), "max": float(r.max()),
                     "fit_mean": float(r_fit.mean()), "fit_max": float(r_fit.max()), "points": len(r)}
    return out


ABLATION_FORMS = {
    "2-term (alpha + beta G/S)": cm.ModelForm(terms=2, weighting="ols", nonneg=False, traffic=False),
    "3-term (+ gamma G)": cm.ModelForm(terms=3, weighting="ols", nonneg=False, traffic=False),
    "4-term, the paper's (+ delta phi)": cm.PAPER_FORM,
    "4-term, wave = G/S": cm.ModelForm(terms=4, wave="ratio", weighting="ols", nonneg=False, traffic=False),
    "4-term, non-negative, relative": cm.ModelForm(terms=4, traffic=False),
    "4-term + traffic (default)": cm.ModelForm(),
    "2-term + traffic": cm.ModelForm(terms=2),
    "3-term + traffic": cm.ModelForm(terms=3),
}
PHI_FORMS = {f"phi = {p}": cm.ModelForm(phi=p) for p in cm.PHIS} | {
    f"phi = {p}, paper form": cm.ModelForm(terms=4, phi=p, weighting="ols", nonneg=False, traffic=False)
    for p in cm.PHIS}


def fallback_check(timings: Timings, hw: Hardware, dtype=None) -> dict:
    """The fallback's choice at every point: regret against the best and speed-up over the
    torch baseline (where the timings have it)."""
    import torch

    dtype = dtype or (torch.float8_e4m3fn if "float8" in timings.dtype else torch.bfloat16)
    cands = templates(timings.shape, hw, dtype, timings.routed_experts)
    index = {c: i for i, c in enumerate(timings.configs)}
    chosen = []
    for p in timings.points:
        c = fallback_choice(timings.shape, p.counts, p.M, hw, dtype, cands)
        chosen.append(index.get(c, -1))
    missing = sum(1 for i in chosen if i < 0)
    chosen = [i if i >= 0 else 0 for i in chosen]
    r = regret_of_choices(timings, chosen)
    out = {"templates": len(cands), "not_timed": missing, "mean": float(r.mean()), "max": float(r.max())}
    if timings.baseline is not None and np.isfinite(timings.baseline).all():
        t = np.array([timings.times[j, i] for j, i in enumerate(chosen)])
        speed = timings.baseline / t
        out |= {"vs_baseline_min": float(speed.min()), "vs_baseline_geomean": float(np.exp(np.log(speed).mean())),
                "slower_than_baseline": int((speed < 1).sum())}
    return out


def held_out(timings: Timings, hw: Hardware, form: cm.ModelForm = cm.ModelForm(), by: str = "M", *,
             family: str = "token", capacity: int | None = None) -> dict:
    """Leave one token count (``by="M"``) or one target balancedness (``by="beta"``) out: fit
    on the other points, the regret of the model's choice at the left-out ones. Per left-out
    group and over all of them; ``complete_*`` over the points where every configuration was
    measured (see :class:`~moekit.ramp.costmodel.Regret`). A point where no fitted variant
    covers the token count counts as choosing the slowest measured config."""
    if by not in ("M", "beta"):
        raise ValueError(f"by must be 'M' or 'beta', got {by!r}")

    def key(p):
        v = p.M if by == "M" else p.beta
        return None if isinstance(v, float) and math.isnan(v) else v

    groups = sorted({key(p) for p in timings.points if key(p) is not None})
    measured = np.isfinite(timings.times).any(axis=0)
    out, regrets, complete, unmeasured = {}, [], [], []
    for g in groups:
        fit_on = timings.select_points(lambda p, g=g: key(p) != g)
        test_on = timings.select_points(lambda p, g=g: key(p) == g)
        model = cm.fit(fit_on, hw, form, family=family, capacity=capacity)
        try:
            r = cm.regret(model, test_on, measured)
        except ValueError:  # no variant fitted for this token count's path
            rows = [test_on.times[j] for j in range(len(test_on.points)) if np.isfinite(test_on.times[j]).any()]
            r = cm.Regret(np.array([np.nanmax(t) / np.nanmin(t) - 1 for t in rows]), [-1] * len(rows),
                          np.array([bool(np.all(np.isfinite(t) | ~measured)) for t in rows], dtype=bool),
                          np.ones(len(rows), dtype=bool))
        out[str(g)] = _regret_dict(r)
        regrets.append(r.regrets)
        complete.append(r.complete)
        unmeasured.append(r.unmeasured)
    total = cm.Regret(np.concatenate(regrets), [], np.concatenate(complete), np.concatenate(unmeasured))
    return {"by": by, "form": form.to_dict(), "groups": out, **_regret_dict(total)}


def _regret_dict(r: cm.Regret) -> dict:
    return {"mean": r.mean, "max": r.max, "points": len(r.regrets), "complete_mean": r.complete_mean,
            "complete_max": r.complete_max, "partial": int((~r.complete).sum()),
            "unmeasured_choices": int(r.unmeasured.sum())}


def split_points(timings: Timings, fit_m) -> tuple[Timings, Timings]:
    fit_m = set(fit_m)
    return timings.select_points(lambda p: p.M in fit_m), timings.select_points(lambda p: p.M not in fit_m)
