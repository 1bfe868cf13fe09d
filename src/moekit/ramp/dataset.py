"""Timings of every configuration at many points, as RaMP fits and checks them.

A :class:`Timings` holds one shape's measured times: points (token count, target and
realized balancedness, the expert histogram) x configurations. It comes from a
``moekit bench kernel`` table (:func:`from_kernel_table`, e.g. the committed H200 dataset) or
from ``moekit ramp profile`` (:mod:`moekit.bench.ramp_profile`), and feeds the cost-model fit, the
ablation and the region check.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from moekit.kernels.configs import KernelConfig
from moekit.shapes import MoEShape

_CONFIG_FIELDS = {f.name for f in fields(KernelConfig)}


@dataclass
class Point:
    """One operating point: M tokens routed at target balancedness ``beta`` (realized
    ``realized_beta``), ``counts[e]`` the pairs that reach local expert e."""

    M: int
    beta: float
    realized_beta: float
    counts: np.ndarray  # [E] int64
    label: str = ""  # how it was made: "grid", "held-out M", "zipf", ...


@dataclass
class Timings:
    """Median µs of every configuration at every point of one shape (NaN: not timed)."""

    shape: MoEShape
    routed_experts: int
    dtype: str
    configs: list[KernelConfig]
    points: list[Point]
    times: np.ndarray  # [points, configs]
    baseline: np.ndarray | None = None  # [points] torch baseline µs where measured
    environment: dict = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        self.times = np.asarray(self.times, dtype=np.float64)
        if self.times.shape != (len(self.points), len(self.configs)):
            raise ValueError(f"times must be [points={len(self.points)}, configs={len(self.configs)}], "
                             f"got {self.times.shape}")

    def select_points(self, keep) -> "Timings":
        """The points where ``keep(point)`` is true."""
        idx = [i for i, p in enumerate(self.points) if keep(p)]
        return Timings(self.shape, self.routed_experts, self.dtype, self.configs, [self.points[i] for i in idx],
                       self.times[idx], None if self.baseline is None else self.baseline[idx], self.environment,
                       self.source)

    def best(self) -> np.ndarray:
        """[points] the fastest measured time."""
        return np.nanmin(self.times, axis=1)


def config_from_record(record: dict) -> KernelConfig:
    """A KernelConfig from a table's config record (its fields; other keys such as ``id`` are ignored)."""
    return KernelConfig(**{k: v for k, v in record.items() if k in _CONFIG_FIELDS})


def from_kernel_table(table: dict, shape_name: str, source: str = "") -> Timings:
    """One shape of a ``moekit bench kernel`` table (``moekit.bench.kernel_report.load_table``)."""
    shapes = table.get("shapes", {})
    if shape_name not in shapes:
        raise ValueError(f"{source or 'table'}: no shape {shape_name!r}; it has {', '.join(shapes) or 'none'}")
    s = shapes[shape_name]
    shape = MoEShape(shape_name, s["num_experts"], s["top_k"], s["hidden"], s["intermediate"])
    configs = [config_from_record(table["configs"][i]) for i in s["configs"]]
    points, times, base = [], [], []
    for p in table["points"]:
        if p["shape"] != shape_name:
            continue
        points.append(Point(int(p["M"]), float(p["beta"]), float(p["realized_beta"]),
                            np.asarray(p["expert_counts"], dtype=np.int64), "grid"))
        times.append([np.nan if t is None else float(t) for t in p["median_us"]])
        base.append(p.get("baseline", {}).get("median_us", np.nan))
    dtype = table.get("params", {}).get("dtype", "bfloat16")
    return Timings(shape, int(s.get("routed_experts", s["num_experts"])), dtype, configs, points,
                   np.asarray(times).reshape(len(points), len(configs)), np.asarray(base, dtype=np.float64),
                   table.get("environment", {}), source)
