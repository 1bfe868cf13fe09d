"""The memory report of the low-latency layer (moekit.ep.lowlatency.buffers), by hand."""

from __future__ import annotations

import numpy as np
import pytest

from moekit.ep.lowlatency.buffers import calibrated_row, layout_for, spill_stats
from moekit.routing import RoutingTrace


def test_spill_stats_by_hand():
    # two steps on 2 ranks: per-(source, destination) token counts
    counts = np.array([[[[5, 1], [2, 7]]], [[[3, 3], [0, 1]]]])
    s = spill_stats(counts, capacity=3, spill_rows=2)
    assert s.token_fraction == pytest.approx((2 + 4) / counts.sum())  # 5 -> 2 over, 7 -> 4 over
    assert s.pair_fraction == pytest.approx(2 / 8)
    assert s.step_fraction == 0.5 and s.max_rounds == 2 and s.mean_rounds == 1.0  # ceil(4 / 2) in step 0


def test_calibrated_row_holds_out_half_the_trace():
    """Capacity from steps 0-1 (one token to rank 0), spill measured on steps 2-3 (four)."""
    ids = np.full((4, 1, 16, 1), -1, dtype=np.int64)  # 2 ranks x 8 tokens, top-1, 2 experts
    ids[:2, 0, 0, 0] = 0
    ids[2:, 0, :4, 0] = 0
    row = calibrated_row(RoutingTrace(ids, num_experts=2), 2, 1.0, shape="mixtral-8x7b")
    assert (row["capacity"], row["spill_rows"], row["max_m"], row["max_count"]) == (1, 1, 8, 4)
    assert row["spill"]["token_fraction"] == pytest.approx(3 / 4) and row["spill"]["step_fraction"] == 1.0
    assert row["spill"]["max_rounds"] == 3 == row["spill"]["mean_rounds"]
    assert row["bounded"]["receive"] < row["worst"]["receive"]
    # a capacity that with its spill round reaches max_m is not worth bounding
    ids[:2, 0, :6, 0] = 0
    row = calibrated_row(RoutingTrace(ids, num_experts=2), 2, 1.0, shape="mixtral-8x7b")
    assert row["capacity"] == 8 and row["bounded"] == row["worst"] and row["spill"]["token_fraction"] == 0


def test_layout_for_leaves_an_unbounded_capacity_alone():
    assert layout_for("deepseek-v3", 8, 16, recv_capacity=16).recv_capacity is None
    assert layout_for("deepseek-v3", 8, 16, recv_capacity=4, spill_rows=2).spill_rows_per_round == 2
