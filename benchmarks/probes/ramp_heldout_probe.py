"""RaMP's held-out regret under four changes to the cost model or the selection rule, scored
on the H100 evaluation timings of qwen3-30b-a3b and olmoe-1b-7b (bf16, token family).

CPU only, from the committed records (~30 s). Each variant is scored twice: on the GPU
evaluation's complete points (fit on the whole profile) and leaving one profiled token count out
of the profile. Prints one line per variant; writes the lines as JSON with --out.

    PYTHONPATH=src python3 benchmarks/probes/ramp_heldout_probe.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from moekit.ramp import costmodel as cm
from moekit.ramp.dataset import Timings
from moekit.bench.ramp_profile import load_timings
from moekit.ramp.regions import HARDWARE

RESULTS = "benchmarks/results/ramp-nvidia-h100"
SHAPES = ("qwen3-30b-a3b", "olmoe-1b-7b")
HW = HARDWARE["h100"]


def load(shape: str) -> tuple[Timings, Timings]:
    """The profile's timings and the evaluation's complete points."""
    where = f"{RESULTS}/{shape}-bf16"
    tp, _ = load_timings(f"{where}/profile-h100-{shape}-bfloat16-token-timings.json.gz")
    te, _ = load_timings(f"{where}/eval-h100-{shape}-bfloat16-token-timings.json.gz")
    complete = {id(te.points[j]) for j in range(len(te.points)) if np.isfinite(te.times[j]).all()}
    return tp, te.select_points(lambda p: id(p) in complete)


def regrets(chooser, test: Timings) -> np.ndarray:
    return np.array([test.times[j, chooser(p)] / np.nanmin(test.times[j]) - 1 for j, p in enumerate(test.points)])


def model_chooser(t: Timings):
    model = cm.fit(t, HW)
    return lambda p: model.choose(p.counts, p.M)


def log_m_corrected(t: Timings):
    """The model times exp(the config's mean log residual at the profiled token counts,
    interpolated in log M): a per-config bias the features miss."""
    model = cm.fit(t, HW)
    ms = sorted({p.M for p in t.points})
    res = np.zeros((len(ms), len(t.configs)))
    for k, m in enumerate(ms):
        rows = [j for j, p in enumerate(t.points) if p.M == m]
        res[k] = np.nanmean([np.log(t.times[j] / model.predict(t.points[j].counts, m)) for j in rows], axis=0)
    res = np.nan_to_num(res)

    def choose(p):
        corr = np.array([np.interp(np.log(p.M), np.log(ms), res[:, i]) for i in range(res.shape[1])])
        return int(np.nanargmin(model.predict(p.counts, p.M) * np.exp(corr)))
    return choose


def shared_slopes(t: Timings):
    """One fit per config over both addressing paths: an intercept per path, shared slopes
    (twice the points per fit, at the price of one set of slopes for two kernels)."""
    form = cm.ModelForm()
    model = cm.CostModel(t.shape, HW, list(t.configs), form, {})
    stats = [model.stats(p.counts) for p in t.points]

    def row(i, M, h, sub):
        plan = model.plan(i, M)
        f = cm.features(plan.grids(h.blocks), form, sub, h.active, h.pairs)
        return np.concatenate([[float(plan.path == "direct"), float(plan.path != "direct")], f[1:]])

    coefs = {}
    for i, c in enumerate(model.configs):
        js = [j for j in range(len(t.points)) if np.isfinite(t.times[j, i])]
        sub = cm.subwave_rule([model.plan(i, t.points[j].M).grids(stats[j][c.bm].blocks) for j in js])
        X = np.stack([row(i, t.points[j].M, stats[j][c.bm], sub) for j in js])
        y = t.times[js, i]
        coefs[i] = (cm.ols(X, y, 1 / y, True), sub)

    def choose(p):
        st = model.stats(p.counts)
        return int(np.argmin([row(i, p.M, st[c.bm], coefs[i][1]) @ coefs[i][0] for i, c in enumerate(model.configs)]))
    return choose


def rerank_by_nearest_point(t: Timings, k: int = 3, tol: float = 0.02):
    """The model's top k (within tol of its best) re-ranked by their measured time at the
    nearest profiled point (log M, realized beta)."""
    model = cm.fit(t, HW)

    def choose(p):
        pred = np.nan_to_num(model.predict(p.counts, p.M), nan=np.inf)
        order = np.argsort(pred)
        top = [i for i in order[:k] if pred[i] <= pred[order[0]] * (1 + tol)]
        d = [abs(np.log(q.M / p.M)) * 10 + abs(q.realized_beta - p.realized_beta) for q in t.points]
        j = int(np.argmin(d))
        return int(top[int(np.nanargmin(t.times[j, top]))])
    return choose


VARIANTS = {
    "the shipped model": model_chooser,
    "+ log-M residual correction": log_m_corrected,
    "one fit per config, shared slopes": shared_slopes,
    "top-3 re-ranked by nearest profiled point": rerank_by_nearest_point,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON")
    args = ap.parse_args()
    data = {s: load(s) for s in SHAPES}
    out = {}
    for name, factory in VARIANTS.items():
        cells = []
        for shape, (tp, te) in data.items():
            ev = regrets(factory(tp), te)
            lo = np.concatenate([regrets(factory(tp.select_points(lambda p, m=m: p.M != m)),
                                         tp.select_points(lambda p, m=m: p.M == m))
                                 for m in sorted({p.M for p in tp.points})])
            out.setdefault(name, {})[shape] = {"eval_mean": ev.mean(), "eval_max": ev.max(),
                                               "leave_one_M_mean": lo.mean(), "leave_one_M_max": lo.max()}
            cells.append(f"{shape}: eval {ev.mean() * 100:.2f} / {ev.max() * 100:.1f} %, "
                         f"leave one M out {lo.mean() * 100:.2f} / {lo.max() * 100:.1f} %")
        print(f"{name:44s} " + " | ".join(cells), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=float)


if __name__ == "__main__":
    main()
