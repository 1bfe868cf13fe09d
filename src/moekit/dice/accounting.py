"""What a schedule sends, what it keeps, and what it could save: bytes, buffers, a speedup model.

Units. The runner drives a dispatcher with one row per (token, slot) (see
:mod:`moekit.dice.runner`), so a layer's dispatch moves up to T * K rows of H values and its
combine as many back; a *buffer* below is one such T * K-row message held by the schedule.

* :func:`rows_per_step` — (token, slot) rows each step sends, from the plan: a synchronous
  layer and an asynchronous launch send T * K, the asynchronous steps that launch nothing
  (the last ``lag`` steps) send none; conditional communication sends, on its non-refresh
  steps, the top-1 slot only (a lower bound: a cache miss is sent as well; the runner
  counts the real rows).
* :func:`peak_buffers` — the most buffers a schedule holds at once, from the lifetimes the
  plan implies (:func:`buffer_timeline`); the runner's measured peak must equal it. In a
  long run's steady state (:func:`steady_buffers`) displaced keeps a dispatch and a combine
  in flight per asynchronous layer, interweaved a combine per layer (its dispatch is
  consumed within the step, so one temporary dispatch buffer serves all layers), and
  conditional communication adds its cache, one held result per asynchronous layer.
* :func:`speedup` — an idealized overlap model: a synchronous (step, layer) costs compute +
  communication, an asynchronous one max(compute, communication of the rows it sends),
  one that sends nothing its compute. Fed either with the all-to-all's share of a
  synchronous step (the DICE paper's Table 5) or with measured part timings and the
  all-to-all / low-latency timings recorded in ``benchmarks/results`` (:func:`load_comm_curves`).
  It is an upper bound on what overlap can give, not a measurement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moekit.dice.schedules import SchedulePlan

# The DICE paper's Table 5: the all-to-all's share of a synchronous expert-parallel step
# (local batch 4, 8, 16, 32), by model and GPU count.
PAPER_A2A_SHARE = {
    ("dit-moe-xl", 4): {4: 0.629, 8: 0.709, 16: 0.738, 32: 0.744},
    ("dit-moe-xl", 8): {4: 0.756, 8: 0.781, 16: 0.790, 32: 0.792},
    ("dit-moe-g", 4): {4: 0.507, 8: 0.568, 16: 0.593, 32: 0.611},
    ("dit-moe-g", 8): {4: 0.647, 8: 0.678, 16: 0.692, 32: 0.689},
}


def _check_positive(name: str, value, *, zero_ok: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be a number {'>= 0' if zero_ok else '> 0'}, got {value!r}")


def rows_per_step(plan: SchedulePlan, tokens: int, top_k: int) -> list[int]:
    """(token, slot) rows this rank's dispatches carry at each step (the combine returns as
    many); conditional communication counted without cache misses (a lower bound)."""
    _check_positive("tokens", tokens, zero_ok=True)
    rows = []
    for t in range(plan.num_steps):
        n = 0
        for layer in range(plan.num_layers):
            if not plan.is_async(t, layer):
                n += tokens * top_k
            elif plan.launches(t, layer):
                n += tokens * (top_k if plan.refresh_all(t) else 1)
        rows.append(n)
    return rows


def sent_fractions(plan: SchedulePlan, top_k: int) -> list[list[float]]:
    """``[t][l]``: the share of a full T * K message (t, l) sends: 1 synchronous or launching
    on a refresh step, 1 / K launching on another step under conditional communication
    (top-1 only), 0 when asynchronous without a launch."""
    out = []
    for t in range(plan.num_steps):
        row = []
        for layer in range(plan.num_layers):
            if not plan.is_async(t, layer):
                row.append(1.0)
            elif plan.launches(t, layer):
                row.append(1.0 if plan.refresh_all(t) else 1.0 / top_k)
            else:
                row.append(0.0)
        out.append(row)
    return out


def async_layers(plan: SchedulePlan) -> int:
    return sum(plan.config.layer_is_async(layer, plan.num_layers) for layer in range(plan.num_layers))


def steady_buffers(plan: SchedulePlan) -> int:
    """Buffers held at once in a long run's steady state: displaced 2 per asynchronous layer
    (a dispatch waiting for next step's experts, a combine in flight), interweaved 1 (the
    combine; its dispatch is consumed within the step, so one temporary dispatch buffer
    serves the model and takes a combine's place), plus 1 per asynchronous layer for
    conditional communication's cache."""
    cfg = plan.config
    if not cfg.is_async:
        return 0
    La = async_layers(plan)
    return {"displaced": 2, "interweaved": 1}[cfg.mode] * La + (La if cfg.cond_every is not None else 0)


def buffer_timeline(plan: SchedulePlan) -> list[int]:
    """Buffers held after each (step, layer) slot and at each step's end, in order.

    Each buffer lives over an interval of those points: a displaced dispatch launched at
    (s, l) until its experts run at (s + 1, l), then its combine until (s + 2, l); an
    interweaved dispatch until the next layer's slot, then its combine until (s + 1, l); a
    result the plan keeps (:meth:`SchedulePlan.keeps_result`) until the next step's slot.
    """
    L, lag = plan.num_layers, plan.config.lag

    def point(step: int, slot: int) -> int:  # slot L is the step's end
        return step * (L + 1) + slot

    live = [0] * (plan.num_steps * (L + 1))

    def hold(start: int, end: int) -> None:
        for i in range(start, min(end, len(live))):
            live[i] += 1

    for t in range(plan.num_steps):
        for layer in range(L):
            if plan.launches(t, layer):
                if lag == 2:
                    hold(point(t, layer), point(t + 1, layer))
                    hold(point(t + 1, layer), point(t + 2, layer))
                else:
                    hold(point(t, layer), point(t, layer + 1))
                    hold(point(t, layer + 1), point(t + 1, layer))
            if plan.keeps_result(t, layer):
                hold(point(t, layer), point(t + 1, layer))
    return live


def peak_buffers(plan: SchedulePlan) -> int:
    """The most T * K-row buffers the schedule holds at once (the runner's measured peak)."""
    return max(buffer_timeline(plan), default=0)


def buffer_bytes(plan: SchedulePlan, tokens: int, top_k: int, hidden: int, itemsize: int) -> int:
    """:func:`peak_buffers` in bytes for T = ``tokens`` per rank."""
    return peak_buffers(plan) * tokens * top_k * hidden * itemsize


def speedup(plan: SchedulePlan, compute_us: float, comm_us: float, top_k: int) -> dict[str, float]:
    """Step time (µs) of the schedule and of sync under the idealized overlap model, for one
    layer's compute and one full message's dispatch + combine time (both per (step, layer))."""
    _check_positive("compute_us", compute_us, zero_ok=True)
    _check_positive("comm_us", comm_us, zero_ok=True)
    frac = sent_fractions(plan, top_k)
    total = 0.0
    for t in range(plan.num_steps):
        for layer in range(plan.num_layers):
            comm = comm_us * frac[t][layer]
            total += max(compute_us, comm) if plan.is_async(t, layer) else compute_us + comm
    sync = plan.num_steps * plan.num_layers * (compute_us + comm_us)
    return dict(step_us=total / plan.num_steps, sync_step_us=sync / plan.num_steps,
                speedup=sync / total if total else float("inf"))


def speedup_from_share(plan: SchedulePlan, share: float, top_k: int) -> float:
    """The model's speedup when the all-to-all takes ``share`` of a synchronous step."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"share must be in [0, 1), got {share}")
    return speedup(plan, 1.0 - share, share, top_k)["speedup"]


# ------------------------------------------------------------------- measured communication


@dataclass(frozen=True)
class CommCurve:
    """Time of one phase (dispatch or combine) of one method as latency + bytes / bandwidth,
    fitted by least squares to measured (bytes per rank, median µs) points."""

    method: str
    phase: str
    latency_us: float
    us_per_byte: float
    points: tuple[tuple[float, float], ...]
    source: str

    def time_us(self, nbytes: float) -> float:
        return self.latency_us + self.us_per_byte * nbytes


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y on x, both clamped at >= 0 (a time cannot fall
    with size; noise in flat, overhead-bound curves would otherwise give a negative slope)."""
    if not points:
        raise ValueError("points must not be empty")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx) if sxx > 0 else 0.0
    intercept = my - slope * mx
    if intercept < 0:  # refit through the origin
        sxx0 = sum(x * x for x, _ in points)
        return 0.0, (sum(x * y for x, y in points) / sxx0 if sxx0 else 0.0)
    return intercept, slope


def _load_json(path: Path) -> dict:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:  # RecursionError: arrays or objects nested too deeply
        raise ValueError(f"{path}: not a JSON record ({error})") from error
    if not isinstance(record, dict) or "results" not in record or "params" not in record:
        raise ValueError(f"{path}: expected a benchmark record with 'params' and 'results'")
    return record


def _lowlatency_points(record: dict, path: Path) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(method, phase) -> [(bytes, median µs)] from a ``moekit bench lowlatency`` record."""
    try:
        series, floor = record["results"]["series"], record["results"]["byte_floor"]
        points: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for method in ("lowlatency", "alltoall"):
            if method not in series or method not in floor:
                continue
            for tokens, timing in series[method].items():
                for phase in ("dispatch", "combine"):
                    nbytes = float(floor[method][tokens][f"{phase}_bytes"])
                    points.setdefault((method, phase), []).append((nbytes, float(timing[phase]["median"])))
        return points
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: malformed low-latency record ({error!r})") from error


def _dispatch_points(record: dict, path: Path) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """From a ``moekit bench dispatch`` record: the eager all-to-all's bytes to other ranks
    and its dispatch / combine medians."""
    try:
        res = record["results"]
        nbytes = float(res["bytes_to_other_ranks_mean"])
        method = str(record["params"]["dispatcher"])
        return {(method, phase): [(nbytes, float(res[phase]["median"]))] for phase in ("dispatch", "combine")}
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: malformed dispatch record ({error!r})") from error


def load_comm_curves(paths: list[str | Path]) -> dict[tuple[str, str], CommCurve]:
    """Fit a :class:`CommCurve` per (method, phase) to the records at ``paths`` (files, or
    folders whose ``lowlatency-*.json`` / ``dispatch-*.json`` are read). Only JSON is parsed."""
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files.extend(sorted(p.glob("lowlatency-*.json")) + sorted(p.glob("dispatch-*.json")))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")
    points: dict[tuple[str, str], list[tuple[float, float]]] = {}
    sources: dict[tuple[str, str], list[str]] = {}
    for f in files:
        record = _load_json(f)
        kind = record.get("kind")
        found = _lowlatency_points(record, f) if kind == "lowlatency" else (
            _dispatch_points(record, f) if kind == "dispatch" else {})
        for key, pts in found.items():
            points.setdefault(key, []).extend(pts)
            sources.setdefault(key, []).append(f.name)
    if not points:
        raise ValueError(f"no all-to-all or low-latency timings in {', '.join(str(p) for p in paths)}")
    curves = {}
    for key, pts in points.items():
        latency, slope = fit_line(pts)
        curves[key] = CommCurve(key[0], key[1], latency, slope, tuple(sorted(pts)), ", ".join(sources[key]))
    return curves


def comm_us(curves: dict[tuple[str, str], CommCurve], method: str, nbytes: float) -> float:
    """Dispatch + combine time (µs) of ``method`` for ``nbytes`` sent to other ranks each way."""
    try:
        return curves[(method, "dispatch")].time_us(nbytes) + curves[(method, "combine")].time_us(nbytes)
    except KeyError:
        known = sorted({m for m, _ in curves})
        raise ValueError(f"no timings of method {method!r}; measured: {', '.join(known)}") from None
