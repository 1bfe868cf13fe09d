"""Calibrated efficiencies: how close one GPU gets to its own measured ceilings, per kind of launch.

The MoE-tax paper's model (``moekit.tax.model``) charges every GEMM block at 100 % of the HBM
bandwidth or of the matmul peak, whichever binds. Real launches reach less, by an amount that
depends on the launch: a GEMV streams weights at most of the bandwidth, a GEMM of 512 rows
reaches 60-85 % of the matmul peak, a kernel of a few microseconds is mostly its fixed cost.
This module holds the small curves that say how much, fitted once per GPU from timings of a
fixed set of launches (``moekit tax calibrate``, in ``moekit.bench.tax_calibrate``):

* :class:`LaunchCost`, for a GEMM-like launch of ``bytes`` moved, ``flops`` done and ``tiles``
  output tiles::

      t = fixed + (t_mem^p + t_cmp^p)^(1/p)
      t_mem = bytes / (BW * mem(bytes))
      t_cmp = flops / (peak * cmp(flops / bytes) * q^gamma),  q = tiles / (ceil(tiles / SMs) * SMs)

  ``mem`` is the achieved fraction of the bandwidth against the bytes moved (small transfers
  reach less), ``cmp`` the achieved fraction of the matmul peak against the arithmetic
  intensity (rows per weight, in effect), ``q`` the wave quantization of the tiles over the
  SMs, and ``p`` how sharp the roofline's corner is (p -> infinity is the plain max).
  One for dense GEMMs (cuBLAS through torch), one for moekit's grouped expert kernel.
* :class:`StreamCost`: an elementwise launch (SwiGLU's two passes, a residual add, zeroing):
  ``fixed + bytes / (BW * mem(bytes))``.
* :class:`RouterCost`: the router and top-k, linear in a few products of (m, H, E).

Curves are piecewise linear in log2 of their feature, clamped at the end knots. Everything is
relative to the ceilings measured in the same calibration run (``hbm_bw``: a 1 GiB copy, read
+ write; ``peak_flops``: an 8192^3 bf16 matmul), so a :class:`Calibration` can also be moved to
other ceilings (:func:`adapt_calibration`: the what-if for hardware that is not here).

A calibration is saved as JSON (``moekit-tax-calibration``, :func:`save_calibration`) and read
with ``json`` only (:func:`load_calibration`); a malformed file raises ValueError naming it.
The fit (:func:`fit_launch`, :func:`fit_stream`, :func:`fit_router`) is plain numpy:
Levenberg-Marquardt on log time with a smoothness penalty on the curves.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from ..jsonfile import read_json
from .gpus import DATASHEET, MAX_SMS, gpu_key

FORMAT = "moekit-tax-calibration"
VERSION = 1
NOMINAL_TILE = 128  # the tile edge used to count a dense GEMM's output tiles (cuBLAS picks its own)

# Knot positions (log2 of the feature). Bytes: 16 KiB .. 4 GiB; arithmetic intensity: 1 .. 8192.
MEM_KNOTS = tuple(float(k) for k in range(14, 33, 2))
CMP_KNOTS = tuple(float(k) for k in range(0, 14))
STREAM_KNOTS = tuple(float(k) for k in range(10, 33, 2))


# --------------------------------------------------------------------------- curves


@dataclass(frozen=True)
class Curve:
    """An efficiency against a feature: piecewise linear in log2(feature), clamped outside."""

    knots: tuple[float, ...]  # log2 of the feature, strictly increasing
    values: tuple[float, ...]  # achieved fraction of the ceiling at each knot, > 0

    def __post_init__(self) -> None:
        if len(self.knots) < 1 or len(self.knots) != len(self.values):
            raise ValueError(f"a curve needs as many knots as values (>= 1), got {len(self.knots)} and "
                             f"{len(self.values)}")
        if any(not _finite(k) for k in self.knots) or any(b <= a for a, b in zip(self.knots, self.knots[1:])):
            raise ValueError(f"curve knots must be finite and strictly increasing, got {self.knots}")
        if any(not _finite(v) or v <= 0 for v in self.values):
            raise ValueError(f"curve values must be finite and > 0, got {self.values}")

    def __call__(self, x) -> np.ndarray:
        lx = np.log2(np.maximum(np.asarray(x, dtype=np.float64), 1e-30))
        return np.interp(lx, self.knots, self.values)

    def to_dict(self) -> dict:
        return {"log2_knots": list(self.knots), "values": list(self.values)}

    @classmethod
    def from_dict(cls, d, where: str) -> "Curve":
        if not isinstance(d, dict) or set(d) != {"log2_knots", "values"}:
            raise ValueError(f"{where}: a curve is {{'log2_knots': [...], 'values': [...]}}, got {d!r:.60}")
        knots, values = d["log2_knots"], d["values"]
        if not _numbers(knots) or not _numbers(values):
            raise ValueError(f"{where}: log2_knots and values must be lists of numbers")
        try:
            return cls(tuple(float(k) for k in knots), tuple(float(v) for v in values))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


def wave_quantization(tiles, sms: int) -> np.ndarray:
    """The fraction of the last wave's SM slots that hold a tile: tiles / (ceil(tiles / SMs) SMs)."""
    t = np.maximum(np.asarray(tiles, dtype=np.float64), 1.0)
    return t / (np.ceil(t / sms) * sms)


def smooth_max(a, b, p: float) -> np.ndarray:
    """(a^p + b^p)^(1/p): the roofline's max with a rounded corner (p large -> max)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    top = np.maximum(np.maximum(a, b), 1e-300)
    return top * ((a / top) ** p + (b / top) ** p) ** (1.0 / p)


@dataclass(frozen=True)
class LaunchCost:
    """Time of a GEMM-like launch from its bytes, FLOPs and output tiles (module docstring).

    ``sorted_fixed``: for the grouped expert kernel only, what its sorted path (token
    alignment, zeroed float32 output, the cast back) costs beyond the direct path, seconds.
    """

    fixed: float  # seconds per launch
    mem: Curve  # fraction of the bandwidth vs bytes
    cmp: Curve  # fraction of the matmul peak vs arithmetic intensity (FLOP / byte)
    gamma: float = 0.0  # exponent of the wave quantization, in [0, 1]
    p: float = 4.0  # corner sharpness, >= 1
    sorted_fixed: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed", "sorted_fixed"):
            v = getattr(self, name)
            if not _finite(v) or v < 0:
                raise ValueError(f"LaunchCost.{name} must be a finite number >= 0, got {v!r}")
        if not _finite(self.gamma) or not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"LaunchCost.gamma must be in [0, 1], got {self.gamma!r}")
        if not _finite(self.p) or self.p < 1.0:
            raise ValueError(f"LaunchCost.p must be a finite number >= 1, got {self.p!r}")

    def sides(self, nbytes, flops, tiles, hbm_bw: float, peak: float, sms: int) -> tuple[np.ndarray, np.ndarray]:
        """(memory side, compute side) in seconds, before the corner and the fixed cost."""
        nbytes = np.maximum(np.asarray(nbytes, dtype=np.float64), 1.0)
        flops = np.asarray(flops, dtype=np.float64)
        mem = nbytes / (hbm_bw * self.mem(nbytes))
        eff = self.cmp(np.maximum(flops, 1e-30) / nbytes) * wave_quantization(tiles, sms) ** self.gamma
        return mem, flops / (peak * eff)

    def time(self, nbytes, flops, tiles, hbm_bw: float, peak: float, sms: int) -> np.ndarray:
        mem, cmp = self.sides(nbytes, flops, tiles, hbm_bw, peak, sms)
        return self.fixed + smooth_max(mem, cmp, self.p)

    def to_dict(self) -> dict:
        return {"fixed_s": self.fixed, "mem": self.mem.to_dict(), "cmp": self.cmp.to_dict(), "gamma": self.gamma,
                "p": self.p, "sorted_fixed_s": self.sorted_fixed}

    @classmethod
    def from_dict(cls, d, where: str) -> "LaunchCost":
        keys = {"fixed_s", "mem", "cmp", "gamma", "p", "sorted_fixed_s"}
        if not isinstance(d, dict) or set(d) != keys:
            raise ValueError(f"{where}: needs exactly the keys {sorted(keys)}, got "
                             f"{sorted(d) if isinstance(d, dict) else type(d).__name__}")
        for k in ("fixed_s", "gamma", "p", "sorted_fixed_s"):
            if not _number(d[k]):
                raise ValueError(f"{where}: {k} must be a number, got {d[k]!r:.60}")
        try:
            return cls(float(d["fixed_s"]), Curve.from_dict(d["mem"], f"{where}.mem"),
                       Curve.from_dict(d["cmp"], f"{where}.cmp"), float(d["gamma"]), float(d["p"]),
                       float(d["sorted_fixed_s"]))
        except ValueError as exc:
            raise ValueError(exc if str(exc).startswith(where) else f"{where}: {exc}") from None


@dataclass(frozen=True)
class StreamCost:
    """An elementwise launch: ``fixed + bytes / (BW * mem(bytes))``."""

    fixed: float
    mem: Curve

    def __post_init__(self) -> None:
        if not _finite(self.fixed) or self.fixed < 0:
            raise ValueError(f"StreamCost.fixed must be a finite number >= 0, got {self.fixed!r}")

    def time(self, nbytes, hbm_bw: float) -> np.ndarray:
        nbytes = np.maximum(np.asarray(nbytes, dtype=np.float64), 1.0)
        return self.fixed + nbytes / (hbm_bw * self.mem(nbytes))

    def to_dict(self) -> dict:
        return {"fixed_s": self.fixed, "mem": self.mem.to_dict()}

    @classmethod
    def from_dict(cls, d, where: str) -> "StreamCost":
        if not isinstance(d, dict) or set(d) != {"fixed_s", "mem"} or not _number(d["fixed_s"]):
            raise ValueError(f"{where}: a stream cost is {{'fixed_s': number, 'mem': curve}}, got {d!r:.60}")
        try:
            return cls(float(d["fixed_s"]), Curve.from_dict(d["mem"], f"{where}.mem"))
        except ValueError as exc:
            raise ValueError(exc if str(exc).startswith(where) else f"{where}: {exc}") from None


ROUTER_FEATURES = ("1", "m", "m*H", "m*E", "m*H*E")


def router_features(m, hidden, experts) -> np.ndarray:
    """[..., 5]: the router's cost terms (launches; per token; the activation cast; the softmax /
    top-k over E; the float32 gate matmul)."""
    m = np.asarray(m, dtype=np.float64)
    h = np.broadcast_to(np.asarray(hidden, dtype=np.float64), m.shape)
    e = np.broadcast_to(np.asarray(experts, dtype=np.float64), m.shape)
    return np.stack([np.ones_like(m), m, m * h, m * e, m * h * e], axis=-1)


@dataclass(frozen=True)
class RouterCost:
    """Router + softmax + top-k: ``coef . (1, m, m H, m E, m H E)`` seconds, every coef >= 0."""

    coef: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.coef) != len(ROUTER_FEATURES) or any(not _finite(c) or c < 0 for c in self.coef):
            raise ValueError(f"RouterCost.coef must be {len(ROUTER_FEATURES)} finite numbers >= 0, got {self.coef}")

    def time(self, m, hidden, experts) -> np.ndarray:
        return router_features(m, hidden, experts) @ np.asarray(self.coef)

    def to_dict(self) -> dict:
        return {"features": list(ROUTER_FEATURES), "coef_s": list(self.coef)}

    @classmethod
    def from_dict(cls, d, where: str) -> "RouterCost":
        if (not isinstance(d, dict) or d.get("features") != list(ROUTER_FEATURES) or not _numbers(d.get("coef_s"))
                or set(d) != {"features", "coef_s"}):
            raise ValueError(f"{where}: a router cost is {{'features': {list(ROUTER_FEATURES)}, 'coef_s': [...]}}")
        try:
            return cls(tuple(float(c) for c in d["coef_s"]))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


# --------------------------------------------------------------------------- the calibration


@dataclass(frozen=True)
class Calibration:
    """Everything ``moekit tax calibrate`` measured on one GPU, fitted.

    ``hbm_bw`` and ``peak_flops`` are the ceilings the curves are fractions of; ``sms`` the SM
    count of the wave quantization; ``net_bw`` / ``net_latency`` the network numbers (not
    calibrated: from the preset, as the file says in ``sources``). ``grouped`` is None when the
    expert kernel was not timed (then the dense curve stands in for it); ``router`` likewise.
    ``sources``: where each part comes from, in words (what the report prints); ``meta``: the
    run's environment, what was timed, the fit's errors.
    """

    name: str
    gpu: str
    sms: int
    hbm_bw: float
    peak_flops: float
    net_bw: float
    net_latency: float
    dense: LaunchCost
    stream: StreamCost
    grouped: LaunchCost | None = None
    router: RouterCost | None = None
    sources: dict = field(default_factory=dict, compare=False)
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not isinstance(self.gpu, str) or not self.gpu:
            raise ValueError("Calibration.name and .gpu must be non-empty strings")
        if isinstance(self.sms, bool) or not isinstance(self.sms, int) or not 1 <= self.sms <= MAX_SMS:
            raise ValueError(f"Calibration.sms must be an int >= 1 and <= {MAX_SMS}, got {self.sms!r:.60}")
        for k in ("hbm_bw", "peak_flops", "net_bw"):
            v = getattr(self, k)
            if not _finite(v) or v <= 0:
                raise ValueError(f"Calibration.{k} must be a finite number > 0, got {v!r}")
        if not _finite(self.net_latency) or self.net_latency < 0:
            raise ValueError(f"Calibration.net_latency must be a finite number >= 0, got {self.net_latency!r}")

    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "name": self.name, "gpu": self.gpu, "sms": self.sms,
            "hbm_bw": self.hbm_bw, "peak_flops": self.peak_flops, "net_bw": self.net_bw,
            "net_latency": self.net_latency, "dense": self.dense.to_dict(), "stream": self.stream.to_dict(),
            "grouped": self.grouped.to_dict() if self.grouped else None,
            "router": self.router.to_dict() if self.router else None,
            "sources": dict(self.sources), "meta": dict(self.meta),
        }


def calibration_from_dict(d, where: str = "calibration") -> Calibration:
    """A :class:`Calibration` from its parsed JSON; every field is checked (ValueError naming ``where``)."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"{where}: not a {FORMAT} file")
    version = d.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version != VERSION:
        raise ValueError(f"{where}: version {version!r:.60}, this moekit reads version {VERSION}")
    allowed = {"format", "version", "name", "gpu", "sms", "hbm_bw", "peak_flops", "net_bw", "net_latency", "dense",
               "stream", "grouped", "router", "sources", "meta"}
    unknown = set(d) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    missing = [k for k in ("name", "gpu", "sms", "hbm_bw", "peak_flops", "net_bw", "net_latency", "dense", "stream")
               if k not in d]
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")
    for k in ("hbm_bw", "peak_flops", "net_bw", "net_latency"):
        if not _number(d[k]):
            raise ValueError(f"{where}: {k} must be a number, got {d[k]!r:.60}")
    for k in ("sources", "meta"):
        if not isinstance(d.get(k, {}), dict):
            raise ValueError(f"{where}: {k} must be an object")
    wrong = [k for k, v in d.get("sources", {}).items() if not isinstance(v, str)]
    if wrong:  # the report prints them as they are
        raise ValueError(f"{where}: sources must map each part to a string, got {d['sources'][wrong[0]]!r:.60} "
                         f"for {wrong[0]!r}")
    try:
        return Calibration(
            name=d["name"], gpu=d["gpu"], sms=d["sms"], hbm_bw=float(d["hbm_bw"]), peak_flops=float(d["peak_flops"]),
            net_bw=float(d["net_bw"]), net_latency=float(d["net_latency"]),
            dense=LaunchCost.from_dict(d["dense"], f"{where}: dense"),
            stream=StreamCost.from_dict(d["stream"], f"{where}: stream"),
            grouped=None if d.get("grouped") is None else LaunchCost.from_dict(d["grouped"], f"{where}: grouped"),
            router=None if d.get("router") is None else RouterCost.from_dict(d["router"], f"{where}: router"),
            sources=dict(d.get("sources", {})), meta=dict(d.get("meta", {})),
        )
    except ValueError as exc:
        raise ValueError(exc if str(exc).startswith(where) else f"{where}: {exc}") from None


def load_calibration(path: str | os.PathLike) -> Calibration:
    """Read a calibration file with ``json`` only; anything malformed raises ValueError naming it."""
    path = os.fspath(path)
    return calibration_from_dict(read_json(path, "calibration file"), path)


def save_calibration(cal: Calibration, path: str | os.PathLike) -> str:
    import json

    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(cal.to_dict(), fh, indent=1, allow_nan=False)
        fh.write("\n")
    return path


# --------------------------------------------------------------------------- what-if


def adapt_calibration(cal: Calibration, target) -> tuple[Calibration, list[str]]:
    """``cal`` moved to the ``target`` hardware (a ``moekit.tax.Hardware``), and what was done, in words.

    Same GPU kind (``gpu_key`` of the names agree): the calibration as measured. Another GPU:
    its ceilings are the target's datasheet peaks times the calibrated GPU's measured /
    datasheet ratio (the fraction of the datasheet a copy and a large matmul reach there), or
    the target's own numbers when it has no datasheet entry (a hardware file); the efficiency
    curves, fixed launch costs and router cost are the calibrated GPU's, unchanged; the SM
    count is the target's where known. The network numbers are the target's.
    """
    when = cal.meta.get("environment", {}).get("timestamp_utc", "?") if isinstance(cal.meta.get("environment"),
                                                                                     dict) else "?"
    src = f"calibrated on {cal.name} ({when})"
    if gpu_key(target.name) == cal.gpu:
        notes = [f"ceilings, efficiency curves, launch and router costs: measured ({src}): "
                 f"HBM copy {cal.hbm_bw / 1e9:.0f} GB/s, bf16 matmul {cal.peak_flops / 1e12:.0f} TFLOP/s",
                 f"network: {cal.net_bw / 1e9:.0f} GB/s, {cal.net_latency * 1e6:.1f} us/msg "
                 f"[{cal.sources.get('network', 'calibration file')}]"]
        return cal, notes
    mine = DATASHEET.get(gpu_key(cal.name)) or DATASHEET.get(cal.gpu)
    theirs = DATASHEET.get(gpu_key(target.name))
    if mine is not None and theirs is not None:
        bw_ratio, pk_ratio = cal.hbm_bw / mine["hbm_bw"], cal.peak_flops / mine["peak_flops"]
        bw, peak = theirs["hbm_bw"] * bw_ratio, theirs["peak_flops"] * pk_ratio
        how = (f"ceilings: {target.name} datasheet ({theirs['hbm_bw'] / 1e12:.2f} TB/s, "
               f"{theirs['peak_flops'] / 1e12:.0f} TFLOP/s) x the fraction {cal.name} reached of its own datasheet "
               f"(copy {100 * bw_ratio:.0f} %, matmul {100 * pk_ratio:.0f} %) = {bw / 1e12:.2f} TB/s, "
               f"{peak / 1e12:.0f} TFLOP/s")
    else:
        bw, peak = target.hbm_bw, target.peak_flops
        how = (f"ceilings: {target.name}'s own numbers taken as reachable ({bw / 1e12:.2f} TB/s, "
               f"{peak / 1e12:.0f} TFLOP/s; no datasheet entry to scale by)")
    sms = getattr(target, "sms", None) or cal.sms
    adapted = replace(cal, name=f"{target.name} (scaled from {cal.name})", gpu=gpu_key(target.name), sms=sms,
                      hbm_bw=bw, peak_flops=peak, net_bw=target.net_bw, net_latency=target.net_latency)
    notes = [how,
             f"efficiency curves (dense GEMM, {'grouped expert kernel' if cal.grouped else 'no grouped kernel'}, "
             f"elementwise), launch and router costs: {src}, applied unchanged (assumed to carry over)",
             f"SMs for the wave quantization: {sms} ({'target' if getattr(target, 'sms', None) else 'calibrated GPU'})",
             f"network: the target's preset ({target.net_bw / 1e9:.0f} GB/s, {target.net_latency * 1e6:.1f} us/msg)"]
    return adapted, notes


def nearest_calibration(target, calibrations: Sequence[Calibration]) -> Calibration | None:
    """The calibration of the same GPU kind as ``target`` if there is one, else the one whose
    ridge point (peak / bandwidth, datasheet where known) is nearest in log scale."""
    if not calibrations:
        return None
    key = gpu_key(target.name)
    for cal in calibrations:
        if cal.gpu == key:
            return cal

    def ridge(name: str, peak: float, bw: float) -> float:
        sheet = DATASHEET.get(gpu_key(name))
        return (sheet["peak_flops"] / sheet["hbm_bw"]) if sheet else peak / bw

    want = ridge(target.name, target.peak_flops, target.hbm_bw)
    return min(calibrations, key=lambda c: abs(math.log(ridge(c.name, c.peak_flops, c.hbm_bw) / want)))


# --------------------------------------------------------------------------- op features


def gemm_features(m, n, k, elem: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bytes, flops, tiles) of ``x[m, k] @ w[n, k].T``: read x and w, write the [m, n] result."""
    m, n, k = (np.asarray(v, dtype=np.float64) for v in (m, n, k))
    nbytes = elem * (m * k + n * k + m * n)
    tiles = np.ceil(m / NOMINAL_TILE) * np.ceil(n / NOMINAL_TILE)
    return nbytes, 2.0 * m * n * k, tiles


def grouped_features(active, padded_rows, tokens, hidden: int, width: int, bm: int, bn: int,
                     elem: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bytes, flops, tiles) of one grouped SwiGLU expert call (moekit's fused kernel).

    ``active`` experts' weights (3 H N each) are read once; every padded row gathers its token
    (H), writes and reads the intermediate (2 N) and adds its output (H); the tokens are read
    and written once more around the call. FLOPs count padded rows (the kernel computes
    them). Tiles: GEMM1's, ``padded_rows / bm`` token blocks times ``ceil(N / bn)`` columns.
    """
    active = np.asarray(active, dtype=np.float64)
    rows = np.asarray(padded_rows, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.float64)
    nbytes = elem * (active * 3.0 * hidden * width + rows * (2.0 * hidden + 2.0 * width) + 2.0 * tokens * hidden)
    flops = rows * 6.0 * hidden * width
    tiles = np.ceil(rows / bm) * math.ceil(width / bn)
    return nbytes, flops, tiles


# --------------------------------------------------------------------------- fitting


@dataclass
class LaunchSample:
    """One timed thing for :func:`fit_launch`: ``ops`` launches of the curve being fitted, each
    (bytes, flops, tiles), plus ``extra`` seconds of other launches (already known), plus
    ``sorted`` times the sorted-path fixed cost; ``seconds`` measured."""

    ops: list
    seconds: float
    extra: float = 0.0
    sorted: bool = False


@dataclass
class FitReport:
    """How well a fit reproduces its own samples: relative errors of the times (model / measured - 1)."""

    n: int
    rms: float
    max_abs: float
    errors: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"n": self.n, "rms_rel_error": self.rms, "max_abs_rel_error": self.max_abs}


def _report(pred: np.ndarray, meas: np.ndarray) -> FitReport:
    err = pred / meas - 1.0
    return FitReport(len(err), float(np.sqrt(np.mean(err**2))) if len(err) else 0.0,
                     float(np.max(np.abs(err))) if len(err) else 0.0, [float(e) for e in err])


def _levenberg_marquardt(residuals: Callable[[np.ndarray], np.ndarray], theta: np.ndarray, iters: int = 200,
                         tol: float = 1e-10) -> np.ndarray:
    """Minimise |residuals(theta)|^2 (forward-difference Jacobian; a few dozen parameters)."""
    theta = np.asarray(theta, dtype=np.float64).copy()
    r = residuals(theta)
    cost = float(r @ r)
    lam = 1e-3
    for _ in range(iters):
        jac = np.empty((r.size, theta.size))
        for j in range(theta.size):
            h = 1e-6 * max(1.0, abs(theta[j]))
            t2 = theta.copy()
            t2[j] += h
            jac[:, j] = (residuals(t2) - r) / h
        a = jac.T @ jac
        g = jac.T @ r
        improved = False
        while lam < 1e12:
            step = np.linalg.solve(a + lam * (np.diag(np.diag(a)) + 1e-9 * np.eye(theta.size)), -g)
            with np.errstate(all="ignore"):
                r_new = residuals(theta + step)
            c_new = float(r_new @ r_new)
            if np.isfinite(c_new) and c_new < cost:
                theta, r, gain, cost = theta + step, r_new, cost - c_new, c_new
                lam = max(lam * 0.3, 1e-12)
                improved = True
                break
            lam *= 10.0
        if not improved or gain <= tol * max(cost, 1e-30):
            break
    return theta


def _second_differences(v: np.ndarray) -> np.ndarray:
    return v[2:] - 2.0 * v[1:-1] + v[:-2] if v.size >= 3 else np.zeros(0)


def fit_launch(samples: Sequence[LaunchSample], hbm_bw: float, peak: float, sms: int, *,
               mem_knots: Sequence[float] = MEM_KNOTS, cmp_knots: Sequence[float] = CMP_KNOTS,
               smooth: float = 0.3, init: LaunchCost | None = None) -> tuple[LaunchCost, FitReport]:
    """Fit a :class:`LaunchCost` to timed samples (relative errors: least squares on log time).

    Parameters are kept in range by construction (efficiencies and times positive, gamma in
    [0, 1], p >= 1); ``smooth`` weighs a penalty on the curves' second differences in log, so
    knots the samples do not reach follow their neighbours. ``sorted_fixed`` is fitted only
    if some sample is on the sorted path. Returns the fit and its errors on the samples.
    """
    if not samples:
        raise ValueError("fit_launch needs at least one sample")
    for i, s in enumerate(samples):
        if not s.ops or not _finite(s.seconds) or s.seconds <= 0 or not _finite(s.extra) or s.extra < 0:
            raise ValueError(f"sample {i}: needs ops, seconds > 0 and extra >= 0, got {s!r}")
    nm, nc = len(mem_knots), len(cmp_knots)
    has_sorted = any(s.sorted for s in samples)
    # Flatten the ops for vectorised evaluation: op i belongs to sample owner[i].
    ops = np.array([op for s in samples for op in s.ops], dtype=np.float64)
    owner = np.repeat(np.arange(len(samples)), [len(s.ops) for s in samples])
    extra = np.array([s.extra for s in samples])
    flag = np.array([1.0 if s.sorted else 0.0 for s in samples])
    meas = np.array([s.seconds for s in samples])
    quant = wave_quantization(ops[:, 2], sms)
    intensity = np.maximum(ops[:, 1], 1e-30) / np.maximum(ops[:, 0], 1.0)
    lb, li = np.log2(np.maximum(ops[:, 0], 1.0)), np.log2(intensity)

    start = init or LaunchCost(2e-6, Curve(tuple(mem_knots), (0.8,) * nm), Curve(tuple(cmp_knots), (0.6,) * nc),
                               0.5, 3.0, 5e-6 if has_sorted else 0.0)
    theta0 = np.concatenate([
        [math.log(max(start.fixed, 1e-9) * 1e6)],
        np.log(np.interp(mem_knots, start.mem.knots, start.mem.values)),
        np.log(np.interp(cmp_knots, start.cmp.knots, start.cmp.values)),
        [_logit(min(max(start.gamma, 1e-3), 1 - 1e-3)), math.log(max(start.p - 1.0, 1e-3))],
        [math.log(max(start.sorted_fixed, 1e-9) * 1e6)] if has_sorted else [],
    ])
    prior = theta0.copy()

    def unpack(t):
        # Clipped so a wild trial step of the solver cannot overflow (it is then simply rejected):
        # fixed and sorted costs up to ~22 ms, efficiencies 1e-4 .. 20, p up to ~150.
        t = np.clip(t, -30.0, 30.0)
        fixed = math.exp(min(t[0], 10.0)) * 1e-6
        mem_v, cmp_v = np.exp(np.clip(t[1:1 + nm], -9.0, 3.0)), np.exp(np.clip(t[1 + nm:1 + nm + nc], -9.0, 3.0))
        gamma, p = _sigmoid(t[1 + nm + nc]), 1.0 + math.exp(min(t[2 + nm + nc], 5.0))
        sorted_fixed = math.exp(min(t[3 + nm + nc], 10.0)) * 1e-6 if has_sorted else 0.0
        return fixed, mem_v, cmp_v, gamma, p, sorted_fixed

    def predict(t):
        fixed, mem_v, cmp_v, gamma, p, sorted_fixed = unpack(t)
        mem = ops[:, 0] / (hbm_bw * np.interp(lb, mem_knots, mem_v))
        cmp = ops[:, 1] / (peak * np.interp(li, cmp_knots, cmp_v) * quant**gamma)
        per_op = fixed + smooth_max(mem, cmp, p)
        return np.bincount(owner, weights=per_op, minlength=len(samples)) + extra + flag * sorted_fixed

    def residuals(t):
        pred = predict(t)
        _, mem_v, cmp_v, *_ = unpack(t)
        return np.concatenate([
            np.log(np.maximum(pred, 1e-30) / meas),
            smooth * _second_differences(np.log(mem_v)), smooth * _second_differences(np.log(cmp_v)),
            1e-3 * (t - prior),
        ])

    theta = _levenberg_marquardt(residuals, theta0)
    fixed, mem_v, cmp_v, gamma, p, sorted_fixed = unpack(theta)
    fit = LaunchCost(fixed, Curve(tuple(float(k) for k in mem_knots), tuple(float(v) for v in mem_v)),
                     Curve(tuple(float(k) for k in cmp_knots), tuple(float(v) for v in cmp_v)), float(gamma),
                     float(p), float(sorted_fixed))
    return fit, _report(predict(theta), meas)


def fit_stream(nbytes: Sequence[float], seconds: Sequence[float], hbm_bw: float, *,
               knots: Sequence[float] = STREAM_KNOTS, smooth: float = 0.3) -> tuple[StreamCost, FitReport]:
    """Fit a :class:`StreamCost` to elementwise launches of ``nbytes`` (read + write) taking ``seconds``."""
    b = np.asarray(nbytes, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if b.size == 0 or b.shape != y.shape or np.any(b <= 0) or np.any(~np.isfinite(y)) or np.any(y <= 0):
        raise ValueError("fit_stream needs matching positive bytes and seconds")
    lb = np.log2(b)
    n = len(knots)
    theta0 = np.concatenate([[math.log(2.0)], np.log(np.full(n, 0.8))])
    prior = theta0.copy()

    def predict(t):
        t = np.clip(t, -9.0, 10.0)  # (as in fit_launch: a wild trial step cannot overflow)
        return math.exp(t[0]) * 1e-6 + b / (hbm_bw * np.interp(lb, knots, np.exp(np.minimum(t[1:], 3.0))))

    def residuals(t):
        return np.concatenate([np.log(predict(t) / y), smooth * _second_differences(t[1:]), 1e-3 * (t - prior)])

    theta = np.clip(_levenberg_marquardt(residuals, theta0), -9.0, 10.0)
    fit = StreamCost(math.exp(theta[0]) * 1e-6, Curve(tuple(float(k) for k in knots),
                                                       tuple(float(v) for v in np.exp(np.minimum(theta[1:], 3.0)))))
    return fit, _report(predict(theta), y)


def fit_router(m, hidden, experts, seconds) -> tuple[RouterCost, FitReport]:
    """Non-negative least squares of the router's time on :func:`router_features`, in relative terms."""
    x = router_features(m, hidden, experts)
    y = np.asarray(seconds, dtype=np.float64)
    if x.shape[0] == 0 or x.shape[0] != y.shape[0] or np.any(~np.isfinite(y)) or np.any(y <= 0):
        raise ValueError("fit_router needs matching positive times")
    a = x / y[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    coef = _nonneg_lstsq(a / scale, np.ones_like(y)) / scale
    fit = RouterCost(tuple(float(c) for c in coef))
    return fit, _report(x @ coef, y)


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |a c - y| over c >= 0: the best unconstrained solution over every column subset
    whose coefficients come out >= 0 (exact for the handful of columns here)."""
    best, best_res = np.zeros(a.shape[1]), float(y @ y)
    for mask in range(1, 1 << a.shape[1]):
        cols = [j for j in range(a.shape[1]) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if np.any(sol < 0):
            continue
        r = a[:, cols] @ sol - y
        if float(r @ r) < best_res:
            best_res, best = float(r @ r), np.zeros(a.shape[1])
            best[cols] = sol
    return best


# --------------------------------------------------------------------------- helpers


def _finite(v) -> bool:
    return _number(v) and math.isfinite(v)


def _number(v) -> bool:
    # bool is an int in Python; an int past the range of a float (JSON has no bound on
    # digits) would overflow where it is used.
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def _numbers(v) -> bool:
    return isinstance(v, list) and all(_number(x) for x in v)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-min(max(x, -30.0), 30.0)))


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))
