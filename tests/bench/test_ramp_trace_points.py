"""`moekit bench ramp --trace`: evaluation points routed as a recorded trace (CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moekit.bench.ramp import build_parser, trace_points
from moekit.bench.ramp_profile import make_routing
from moekit.routing.trace import RoutingTrace
from moekit.shapes import MoEShape

ROOT = Path(__file__).resolve().parents[2]


def _trace(tmp_path, steps=3, layers=2, tokens=40, experts=16, top_k=2, masked_rows=(0, 5)):
    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(steps * layers * tokens)])
    ids = ids.reshape(steps, layers, tokens, top_k)
    ids[:, :, list(masked_rows), 1] = -1  # padding slots: those rows are not fully routed
    w = rng.random(ids.shape).astype(np.float32)
    path = tmp_path / "t.npz"
    RoutingTrace(ids, experts, w, name="t").save(path)
    return path, ids, w


def test_points_are_the_first_fully_routed_rows_of_spread_calls(tmp_path):
    path, ids, w = _trace(tmp_path)
    pts = trace_points(str(path), 16, 2, m_values=(4, 32, 64), samples=2)
    assert [(p.M, p.label) for p in pts] == [(4, "trace:t"), (32, "trace:t")] * 2  # 38 full rows per call: no 64
    rows = [r for r in range(40) if r not in (0, 5)]
    for k, p in enumerate(pts):
        step, layer = ((k // 2) * 3) // 2, (3 * (k // 2) + 1) % 2
        assert np.array_equal(p.ids, ids[step, layer, rows[:p.M]])
        assert np.array_equal(p.weights, w[step, layer, rows[:p.M]])
    shape = MoEShape("t", num_experts=16, top_k=2, hidden=64, intermediate=32)
    r = make_routing(shape, 16, pts[1])
    assert r.counts.tolist() == np.bincount(pts[1].ids.ravel(), minlength=16).tolist()


def test_a_trace_of_another_router_or_too_short_is_refused(tmp_path):
    path, _, _ = _trace(tmp_path)
    with pytest.raises(ValueError, match="routes top-2 over 16 experts; this shape's router picks top-2 of 64"):
        trace_points(str(path), 64, 2)
    with pytest.raises(ValueError, match="no call holds 64 fully routed rows"):
        trace_points(str(path), 16, 2, m_values=(64, 128))
    with pytest.raises(ValueError, match="samples must be >= 1"):
        trace_points(str(path), 16, 2, samples=0)


def test_the_shipped_olmoe_traces_route_the_olmoe_preset():
    decode = trace_points(str(ROOT / "benchmarks/traces/olmoe-stdlib.decode.npz"), 64, 8, m_values=(4, 32))
    assert [p.M for p in decode] == [4, 4]  # 8 sequences per decode step
    prefill = trace_points(str(ROOT / "benchmarks/traces/olmoe-stdlib.npz"), 64, 8, m_values=(4, 32, 128, 512, 4096))
    assert sorted({p.M for p in prefill}) == [4, 32, 128, 512]
    args = build_parser().parse_args(["--trace", "a.npz", "b.npz", "--trace-samples", "3"])
    assert args.trace == ["a.npz", "b.npz"] and args.trace_samples == 3
