"""RaMP's wave cost model: the time of each configuration from its CTA grid.

Per configuration c (and per addressing path, see below), for the expert histogram h::

    t_c(h) = alpha_c + beta_c * W(h) + gamma_c * G(h) + delta_c * phi(G(h) / S)

summed over the launches of one call (:func:`moekit.ramp.regions.grid_plan`): ``G`` is the
launch's CTA grid from the histogram (Eq. 1), ``S`` its resident slots, ``W`` its wave count.

* ``alpha``: startup -- launches, pipeline fill, the alignment -- whatever the grid.
* ``beta * W``: wave scheduling. ``W = ceil(G / S)`` by default (``wave="ceil"``): with ``S``
  fixed per configuration, the continuous ratio ``G / S`` is proportional to ``G`` and ordinary
  least squares cannot tell ``beta`` from ``gamma`` (``wave="ratio"`` keeps it, for the
  comparison in docs/ramp.md).
* ``gamma * G``: per-CTA cost, mostly weight traffic that misses L2.
* ``delta * phi(G / S)``: the sub-wave term, only for configurations whose median profiling
  grid is below one wave (the paper's rule). ``phi`` is concave on [0, 1] and constant past
  one wave: ``sqrt`` (default), ``log`` (``log2(1 + u)``) or ``quad`` (``u (2 - u)``), compared
  in docs/ramp.md.

Two traffic terms extend the paper's four (``ModelForm(traffic=True)``, the default; off for
the paper's form): ``epsilon * A`` with ``A`` the experts the histogram names (each one's
weights come from HBM once, whatever the grid: the memory-bound regime of small batches) and
``zeta * P`` with ``P`` the routed pairs (rows gathered, the intermediate written and read,
atomic adds of the output: per valid row, not per CTA). Both are histogram sums, as ``G``.
On the committed H200 dataset they lower the held-out regret (docs/ramp.md, the ablation).

A configuration runs different kernels on its two addressing paths -- direct addressing
(``M <= bm``; with two_launch and split_k = 1 the persistent decode kernel) and the sorted
alignment -- so each (configuration, path) is a *variant* with its own coefficients, fitted by
ordinary least squares (:func:`fit`) from the profiling points that run it.

The ablation's 2- and 3-term forms: ``alpha + beta * G / S`` and ``alpha + beta * W +
gamma * G`` (``ModelForm(terms=2|3)``).

A histogram with no routed pair (an expert-parallel shard that no token of the call routes to)
has an empty grid for every configuration, so the model would compare intercepts fitted on
calls with work. The choice there follows :func:`empty_call_rank` instead: what an empty call
still pays is its launches, its split-K bookkeeping and the CTAs that start and find no block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moekit.kernels.configs import KernelConfig
from moekit.ramp.regions import FAMILIES, Hardware, GridPlan, grid_plan, token_blocks
from moekit.shapes import MoEShape

PHIS = ("sqrt", "log", "quad")
WAVES = ("ceil", "ratio")
WEIGHTINGS = ("ols", "relative")
# empty_call_rank's weight of one launch: above any config's column tiles per token block.
EMPTY_LAUNCH_RANK = 2 ** 20
N_COEF = 6  # alpha, beta, gamma, delta, epsilon (active experts), zeta (routed pairs)
COEF_NAMES = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta")


def phi(u, kind: str = "sqrt"):
    """The sub-wave term of a wave ratio ``u = G / S`` (numpy array or float): concave on
    [0, 1], 0 at 0, 1 from one wave on."""
    u = np.clip(np.asarray(u, dtype=np.float64), 0.0, 1.0)
    if kind == "sqrt":
        return np.sqrt(u)
    if kind == "log":
        return np.log2(1.0 + u)
    if kind == "quad":
        return u * (2.0 - u)
    raise ValueError(f"phi must be one of {PHIS}, got {kind!r}")


@dataclass(frozen=True)
class ModelForm:
    """Which grid terms the model has (2, 3 or 4), whether it adds the two traffic terms, its
    sub-wave ``phi``, its wave count ``wave`` (``ceil`` or ``ratio``), its least-squares
    ``weighting`` (``ols``: absolute µs, as the paper; ``relative``: each point weighted by
    1 / its time, so a config's fit is as good at 20 µs as at 2 ms) and whether every
    coefficient is kept >= 0 (``nonneg``: each term is a cost; without it the fit trades a
    negative per-CTA cost against a large per-wave one between the few distinct grids a
    variant is profiled at). :data:`PAPER_FORM` is the paper's model."""

    terms: int = 4
    phi: str = "sqrt"
    wave: str = "ceil"
    weighting: str = "relative"
    nonneg: bool = True
    traffic: bool = True

    def __post_init__(self) -> None:
        if self.terms not in (2, 3, 4):
            raise ValueError(f"terms must be 2, 3 or 4, got {self.terms!r}")
        if self.phi not in PHIS:
            raise ValueError(f"phi must be one of {PHIS}, got {self.phi!r}")
        if self.wave not in WAVES:
            raise ValueError(f"wave must be one of {WAVES}, got {self.wave!r}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")

    def to_dict(self) -> dict:
        return {"terms": self.terms, "phi": self.phi, "wave": self.wave, "weighting": self.weighting,
                "nonneg": self.nonneg, "traffic": self.traffic}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelForm":
        if not isinstance(d, dict) or set(d) != set(cls.__dataclass_fields__):
            raise ValueError(f"a model form needs exactly the keys {sorted(cls.__dataclass_fields__)}, got {d!r}")
        return cls(**d)


PAPER_FORM = ModelForm(terms=4, weighting="ols", nonneg=False, traffic=False)


@dataclass(frozen=True)
class Histogram:
    """What the model reads of an expert histogram for one token block ``bm``: the token blocks
    ``x = sum_e ceil(n_e / bm)``, the named experts ``A`` and the routed pairs ``P``."""

    blocks: int
    active: int
    pairs: int


def histogram_stats(counts, bm: int, capacity: int | None = None) -> Histogram:
    vals = [min(int(n), capacity) if capacity is not None else int(n)
            for n in (counts.tolist() if hasattr(counts, "tolist") else counts)]
    return Histogram(token_blocks(vals, bm), sum(1 for n in vals if n > 0), sum(vals))


def features(grid: list[tuple[int, int]], form: ModelForm, subwave: bool = True, active: int = 0,
             pairs: int = 0) -> np.ndarray:
    """The model's 6 features of one call's launches ``[(G, S)]`` and its histogram's named
    experts and routed pairs: (1, wave term, CTAs, phi, A, P); those the form does not use are 0."""
    u = np.array([g / s for g, s in grid], dtype=np.float64)
    G = float(sum(g for g, _ in grid))
    extra = [float(active), float(pairs)] if form.traffic else [0.0, 0.0]
    if form.terms == 2:
        return np.array([1.0, u.sum(), 0.0, 0.0, *extra])
    waves = np.ceil(u).sum() if form.wave == "ceil" else u.sum()
    sub = float(phi(u, form.phi).sum()) if form.terms == 4 and subwave else 0.0
    return np.array([1.0, waves, G, sub, *extra])


def subwave_rule(grids: list[list[tuple[int, int]]]) -> bool:
    """Whether a variant gets the phi term: its median profiling grid (the largest wave ratio
    of its launches) is below one wave."""
    if not grids:
        return False
    return float(np.median([max(g / s for g, s in grid) for grid in grids])) < 1.0


def ols(X: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None, nonneg: bool = False) -> np.ndarray:
    """Least squares ``argmin |W (X b - y)|`` over the columns of X that are not all zero (the
    others get 0); the minimum-norm solution where the points do not determine every term.
    ``nonneg``: every coefficient >= 0 (the best of the least-squares fits on every subset of
    the columns whose coefficients come out >= 0: exact for the few columns here).

    Where the first column is the intercept (all ones), a column that is constant over the
    points cannot be told from it and is left out (coefficient 0). The minimum-norm solution
    would split the constant between the two, and the share given to a term that grows with
    the batch -- the routed pairs, at one token count -- would be multiplied when the model is
    used at another token count (a variant profiled at one M then predicts nonsense at 4 M)."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    used = np.any(X != 0.0, axis=0)
    if len(X) and np.all(X[:, 0] == 1.0):
        used &= ~np.all(X == X[:1], axis=0) | (np.arange(X.shape[1]) == 0)
    coef = np.zeros(X.shape[1])
    if not used.any() or len(y) == 0:
        return coef
    A = X[:, used]
    if weights is not None:
        A = A * weights[:, None]
        y = y * weights
    # Scale the columns so the solve is well conditioned (CTA counts reach 1e5, the rest ~1).
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    A = A / scale
    sol, *_ = np.linalg.lstsq(A, y, rcond=None)
    if nonneg and np.any(sol < 0):
        sol = _nonneg_lstsq(A, y)
    coef[used] = sol / scale
    return coef


def _nonneg_lstsq(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    best, best_res = np.zeros(A.shape[1]), float(y @ y)
    for mask in range(1, 1 << A.shape[1]):
        cols = [k for k in range(A.shape[1]) if mask >> k & 1]
        sol, *_ = np.linalg.lstsq(A[:, cols], y, rcond=None)
        if np.any(sol < 0):
            continue
        r = A[:, cols] @ sol - y
        if float(r @ r) < best_res:
            best_res = float(r @ r)
            best = np.zeros(A.shape[1])
            best[cols] = sol
    return best


def empty_call_rank(config: KernelConfig, plan: GridPlan) -> float:
    """The order in which configurations are taken for a histogram with no pair (least
    first): without split-K before with it (its partial sums are set up and reduced whatever
    the grid), fewer launches before more, then fewer column tiles per token block (the CTAs an
    upper-bound grid still starts). An integer below 2**24, exact in float32."""
    launches = len(plan.launches) + (2 if config.split_k > 1 else 0)
    return float(launches * EMPTY_LAUNCH_RANK + sum(ln.per_block for ln in plan.launches))


@dataclass
class Variant:
    """The fit of one (configuration, path): coefficients (alpha, beta, gamma, delta), whether
    phi is on, the points it was fitted on and their root-mean-square error (µs)."""

    config: int  # index into the model's configs
    path: str
    coef: np.ndarray
    subwave: bool
    n_points: int
    rmse_us: float

    def to_dict(self) -> dict:
        return {"config": self.config, "path": self.path, "coef": [float(c) for c in self.coef],
                "subwave": self.subwave, "n_points": self.n_points, "rmse_us": float(self.rmse_us)}


@dataclass
class CostModel:
    """Fitted variants of one shape's configurations on one GPU.

    ``predict(counts, M)`` gives every configuration's predicted µs (NaN where the variant
    its path needs was not fitted); ``choose`` the argmin (:func:`empty_call_rank`'s least
    for a histogram with no pair).
    """

    shape: MoEShape
    hardware: Hardware
    configs: list[KernelConfig]
    form: ModelForm
    variants: dict[tuple[int, str], Variant]
    elem_bytes: int = 2
    family: str = "token"
    capacity: int | None = None
    _plans: dict = field(default_factory=dict, repr=False)

    def plan(self, i: int, M: int) -> GridPlan:
        c = self.configs[i]
        path_key = (i, "direct" if (self.family == "token" and M <= c.bm) else "other")
        plan = self._plans.get(path_key)
        if plan is None:
            plan = self._plans[path_key] = grid_plan(self.shape, c, M, self.hardware, elem_bytes=self.elem_bytes,
                                                       family=self.family, capacity=self.capacity)
        return plan

    def stats(self, counts) -> dict[int, Histogram]:
        """The histogram's blocks, named experts and pairs at every bm of the configs."""
        cap = self.capacity if self.family == "expert_major" else None
        return {bm: histogram_stats(counts, bm, cap) for bm in sorted({c.bm for c in self.configs})}

    def row(self, i: int, M: int, h: Histogram, subwave: bool) -> np.ndarray:
        return features(self.plan(i, M).grids(h.blocks), self.form, subwave, h.active, h.pairs)

    def predict(self, counts, M: int) -> np.ndarray:
        stats = self.stats(counts)
        out = np.full(len(self.configs), np.nan)
        for i, c in enumerate(self.configs):
            v = self.variants.get((i, self.plan(i, M).path))
            if v is not None:
                out[i] = self.row(i, M, stats[c.bm], v.subwave) @ v.coef
        return out

    def choose(self, counts, M: int) -> int:
        """The configuration with the least predicted time (the first of equals); for a
        histogram with no pair, the least :func:`empty_call_rank` among the fitted ones."""
        return self.choose_predicted(counts, M, self.predict(counts, M))

    def choose_predicted(self, counts, M: int, pred: np.ndarray) -> int:
        """:meth:`choose` with ``pred = predict(counts, M)`` already at hand (NaN or inf where a
        configuration has no fitted variant)."""
        if not np.isfinite(pred).any():
            raise ValueError(f"no fitted configuration covers M={M}")
        vals = counts.tolist() if hasattr(counts, "tolist") else list(counts)
        if not any(int(n) > 0 for n in vals):
            ranks = [empty_call_rank(c, self.plan(i, M)) if np.isfinite(pred[i]) else np.inf
                     for i, c in enumerate(self.configs)]
            return int(np.argmin(ranks))
        return int(np.nanargmin(pred))


def fit(timings, hardware: Hardware, form: ModelForm = ModelForm(), *, family: str = "token",
        capacity: int | None = None, elem_bytes: int | None = None) -> CostModel:
    """Fit every (configuration, path) of ``timings`` (a :class:`moekit.ramp.dataset.Timings`)
    by least squares on the points that run it."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if elem_bytes is None:
        elem_bytes = 1 if "float8" in timings.dtype or timings.dtype == "fp8" else 2
    model = CostModel(timings.shape, hardware, list(timings.configs), form, {}, elem_bytes, family, capacity)
    stats = [model.stats(p.counts) for p in timings.points]
    for i, c in enumerate(model.configs):
        by_path: dict[str, tuple[list, list, list]] = {}
        for j, p in enumerate(timings.points):
            t = timings.times[j, i]
            if not np.isfinite(t):
                continue
            plan = model.plan(i, p.M)
            h = stats[j][c.bm]
            grids, hists, ys = by_path.setdefault(plan.path, ([], [], []))
            grids.append(plan.grids(h.blocks))
            hists.append(h)
            ys.append(t)
        for path, (grids, hists, ys) in by_path.items():
            sub = form.terms == 4 and subwave_rule(grids)
            X = np.stack([features(g, form, sub, h.active, h.pairs) for g, h in zip(grids, hists)])
            y = np.asarray(ys)
            w = 1.0 / np.maximum(y, 1e-3) if form.weighting == "relative" else None
            coef = ols(X, y, w, form.nonneg)
            rmse = float(np.sqrt(np.mean((X @ coef - y) ** 2)))
            model.variants[(i, path)] = Variant(i, path, coef, sub, len(ys), rmse)
    return model


@dataclass
class Regret:
    """Regret of a choice against exhaustive search at a set of points.

    ``complete[k]``: every configuration measured anywhere was measured at point k (a deadline can cut a token
    count short: there the "best" is the best of those measured, and a choice that was not
    measured, ``unmeasured[k]``, counts as the slowest measured -- a bound, not a measurement).
    ``mean`` / ``max`` are over all points; ``complete_mean`` / ``complete_max`` over the
    complete ones, the number to quote."""

    regrets: np.ndarray  # [points] t(chosen) / t(best) - 1
    chosen: list[int]
    complete: np.ndarray | None = None  # [points] bool
    unmeasured: np.ndarray | None = None  # [points] bool

    def __post_init__(self) -> None:
        n = len(self.regrets)
        self.complete = np.ones(n, dtype=bool) if self.complete is None else np.asarray(self.complete, dtype=bool)
        self.unmeasured = np.zeros(n, dtype=bool) if self.unmeasured is None else np.asarray(self.unmeasured,
                                                                                              dtype=bool)

    @property
    def mean(self) -> float:
        return float(np.mean(self.regrets)) if len(self.regrets) else float("nan")

    @property
    def max(self) -> float:
        return float(np.max(self.regrets)) if len(self.regrets) else float("nan")

    @property
    def complete_mean(self) -> float:
        r = self.regrets[self.complete]
        return float(np.mean(r)) if len(r) else float("nan")

    @property
    def complete_max(self) -> float:
        r = self.regrets[self.complete]
        return float(np.max(r)) if len(r) else float("nan")

    def describe(self) -> str:
        """One line: mean / max over the complete points, and what the partial ones were."""
        n, c = len(self.regrets), int(self.complete.sum())
        text = f"mean {self.complete_mean * 100:.2f} %, max {self.complete_max * 100:.1f} % over {c} points"
        if c < n:
            text += (f"; {n - c} partially measured points (a deadline) left out: the choice there was not "
                     f"measured at {int(self.unmeasured.sum())} (counted as the slowest measured, all points: "
                     f"mean {self.mean * 100:.2f} %, max {self.max * 100:.1f} %)")
        return text


def regret(model: CostModel, timings, measured: np.ndarray | None = None) -> Regret:
    """The model's choice at every point of ``timings`` against the fastest measured config.
    ``measured`` [configs]: those a complete point has (default: those measured at some point
    of ``timings``; a config that never ran makes no point partial)."""
    regrets, chosen, complete, unmeasured = [], [], [], []
    anywhere = np.isfinite(timings.times).any(axis=0) if measured is None else np.asarray(measured, dtype=bool)
    for j, p in enumerate(timings.points):
        if not np.isfinite(timings.times[j]).any():  # a point nothing was measured at (a deadline)
            continue
        i = model.choose(p.counts, p.M)
        best = np.nanmin(timings.times[j])
        t = timings.times[j, i]
        unmeasured.append(not np.isfinite(t))
        if not np.isfinite(t):  # chosen but not measured here: count it as the slowest measured
            t = np.nanmax(timings.times[j])
        regrets.append(t / best - 1.0)
        chosen.append(i)
        complete.append(bool(np.all(np.isfinite(timings.times[j]) | ~anywhere)))
    return Regret(np.asarray(regrets), chosen, np.asarray(complete, dtype=bool), np.asarray(unmeasured, dtype=bool))
