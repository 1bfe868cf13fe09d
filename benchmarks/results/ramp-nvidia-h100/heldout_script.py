"""The partial H100 profile of qwen3-30b-a3b bf16 checked offline: regret in sample, leaving one
token count out and leaving one balancedness out, with today's fit ("after") and with the fit
before a constant column was left to the intercept ("before": the minimum-norm least squares
over every column). Writes heldout.json, prints heldout.txt. Run from the repo root with
PYTHONPATH=src (CPU, ~1 min)."""
import json

import numpy as np

from moekit.bench.report import to_jsonable
from moekit.ramp import analysis
from moekit.ramp import costmodel as cm
from moekit.ramp.profile import load_timings
from moekit.ramp.regions import HARDWARE

DIR = "benchmarks/results/ramp-nvidia-h100"
t, _ = load_timings(f"{DIR}/profile-h100-qwen3-30b-a3b-bfloat16-token-timings.json.gz")
hw = HARDWARE["h100"]
after_ols = cm.ols


def before_ols(X, y, weights=None, nonneg=False):
    """cm.ols as it was: every column that is not all zero, constant ones included."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    used = np.any(X != 0.0, axis=0)
    coef = np.zeros(X.shape[1])
    if not used.any() or len(y) == 0:
        return coef
    A = X[:, used]
    if weights is not None:
        A, y = A * weights[:, None], y * weights
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    A = A / scale
    sol, *_ = np.linalg.lstsq(A, y, rcond=None)
    if nonneg and np.any(sol < 0):
        sol = cm._nonneg_lstsq(A, y)
    coef[used] = sol / scale
    return coef


def pct(x):
    return f"{x * 100:6.2f} %"


out = {}
for name, fn in (("before", before_ols), ("after", after_ols)):
    cm.ols = fn
    r = cm.regret(cm.fit(t, hw), t)
    res = {"in_sample": {"mean": r.mean, "max": r.max, "complete_mean": r.complete_mean,
                         "complete_max": r.complete_max, "partial": int((~r.complete).sum()),
                         "unmeasured_choices": int(r.unmeasured.sum())}}
    print(f"== {name}: in sample, all 25 points: mean {pct(r.mean)} max {pct(r.max)}; the 20 complete ones "
          f"(M <= 256): mean {pct(r.complete_mean)} max {pct(r.complete_max)}")
    for by in ("M", "beta"):
        h = res[f"leave_one_{by}_out"] = analysis.held_out(t, hw, by=by)
        print(f"   leave one {by} out: all {h['points']} points mean {pct(h['mean'])} max {pct(h['max'])}; "
              f"{h['points'] - h['partial']} complete: mean {pct(h['complete_mean'])} max {pct(h['complete_max'])}")
        for g, row in h["groups"].items():
            print(f"      {by} = {g:>5s}: mean {pct(row['mean'])} max {pct(row['max'])}"
                  + (f"  ({row['partial']} partial points, choice unmeasured at {row['unmeasured_choices']})"
                     if row["partial"] else ""))
    out[name] = res
cm.ols = after_ols
with open(f"{DIR}/heldout.json", "w") as f:
    json.dump(to_jsonable(out), f, indent=1)
