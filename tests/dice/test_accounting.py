"""Bytes, buffers and the speedup model; the measured communication curves from the repo's records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moekit.dice import ScheduleConfig, SchedulePlan
from moekit.dice import accounting
from moekit.dice.bench import memory_rows, share_rows, speed_rows, time_parts
from moekit.dice.dit_moe import get_config

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_rows_per_step_by_hand():
    # 2 layers, displaced over 5 steps: step 0 synchronous (2 layers x T K), launches at steps 1 and 2
    plan = SchedulePlan(ScheduleConfig("displaced"), 5, 2)
    assert accounting.rows_per_step(plan, tokens=10, top_k=2) == [40, 40, 40, 0, 0]
    plan = SchedulePlan(ScheduleConfig("interweaved", cond_every=2), 4, 1)
    # step 1: top-1 only (10 rows), step 2: refresh (20), step 3: the last step launches nothing
    assert accounting.rows_per_step(plan, tokens=10, top_k=2) == [20, 10, 20, 0]


def test_peak_buffers_by_mode():
    def peak(steps=10, **kw):
        plan = SchedulePlan(ScheduleConfig(**kw), steps, 4)
        if steps == 10:  # long enough for the steady state
            assert accounting.peak_buffers(plan) == accounting.steady_buffers(plan)
        return accounting.peak_buffers(plan)
    assert peak(mode="sync", warmup=0) == 0
    assert peak(mode="displaced") == 8 and peak(mode="interweaved") == 4
    assert peak(mode="displaced", cond_every=2) == 12 and peak(mode="interweaved", cond_every=2) == 8
    assert peak(mode="interweaved", async_layers="shallow") == 2
    # 3 steps: displaced never launches (step 0 is synchronous, nothing launched at 1 would be used
    # before the end); only the results held after step 0 remain
    assert peak(steps=3, mode="displaced") == 4
    # after each slot and step end of a 3-step interweaved run over 1 layer: step 0 keeps its result;
    # step 1 uses it, drops it and launches (a dispatch, then its combine from the step's end on);
    # step 2 uses the combine and keeps nothing
    assert accounting.buffer_timeline(SchedulePlan(ScheduleConfig("interweaved"), 3, 1)) == [1, 1, 1, 1, 0, 0]
    assert accounting.buffer_bytes(SchedulePlan(ScheduleConfig("interweaved"), 10, 4), 8, 2, 16, 2) == 4 * 8 * 2 * 16 * 2


def test_speedup_model_by_hand():
    plan = SchedulePlan(ScheduleConfig("interweaved"), 4, 1)
    # step 0 sync: 1 + 3; steps 1, 2 overlap: max(1, 3); step 3 launches nothing: 1
    out = accounting.speedup(plan, compute_us=1.0, comm_us=3.0, top_k=2)
    assert out["sync_step_us"] == 4.0 and out["step_us"] == (4 + 3 + 3 + 1) / 4
    assert accounting.speedup(SchedulePlan(ScheduleConfig(warmup=0), 4, 1), 1.0, 3.0, 2)["speedup"] == 1.0
    # the share form, a 75 % all-to-all over 1000 steps: step 0 costs 1, steps 1..998 max(0.25, 0.75), the
    # last (no launch) 0.25
    long = SchedulePlan(ScheduleConfig("interweaved"), 1000, 1)
    assert accounting.speedup_from_share(long, 0.75, 2) == pytest.approx(1000 / (1 + 998 * 0.75 + 0.25))
    with pytest.raises(ValueError, match="share must be in"):
        accounting.speedup_from_share(long, 1.0, 2)


def test_fit_line_recovers_latency_and_bandwidth():
    pts = [(x, 5.0 + 0.25 * x) for x in (0, 10, 100, 1000)]
    assert accounting.fit_line(pts) == pytest.approx((5.0, 0.25))
    assert accounting.fit_line([(1, 3.0), (2, 2.0)])[1] == 0.0  # never a negative bandwidth term


def test_measured_curves_from_the_repo_records():
    curves = accounting.load_comm_curves([RESULTS / "lowlatency-nvidia-h200-x2", RESULTS / "dispatch-nvidia-h200-x2"])
    assert {("lowlatency", "dispatch"), ("lowlatency", "combine"), ("alltoall", "dispatch")} <= set(curves)
    ll = accounting.comm_us(curves, "lowlatency", 1e6)
    a2a = accounting.comm_us(curves, "alltoall", 1e6)
    assert 0 < ll < a2a  # the low-latency layer is the faster path in those records
    with pytest.raises(ValueError, match="no timings of method 'nvshmem'"):
        accounting.comm_us(curves, "nvshmem", 1e6)


def test_malformed_records_are_named(tmp_path):
    bad = tmp_path / "lowlatency-x.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="lowlatency-x.json: not a JSON record"):
        accounting.load_comm_curves([bad])
    bad.write_text("[" * 100000 + "]" * 100000)  # the parser's recursion limit: still a ValueError
    with pytest.raises(ValueError, match="lowlatency-x.json: not a JSON record"):
        accounting.load_comm_curves([bad])
    odd = tmp_path / "lowlatency-y.json"
    odd.write_text(json.dumps(dict(kind="lowlatency", params={}, results={"series": {"lowlatency": {"1": {}}},
                                                                          "byte_floor": {"lowlatency": {}}})))
    with pytest.raises(ValueError, match="lowlatency-y.json: malformed"):
        accounting.load_comm_curves([odd])
    with pytest.raises(FileNotFoundError):
        accounting.load_comm_curves([tmp_path / "missing"])


def test_bench_tables_on_the_cpu():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        parts = [time_parts(get_config("dit-moe-digits"), 2, iters=1, warmup=0, device="cpu", dtype=torch.float32)]
    finally:
        torch.set_num_threads(threads)
    p = parts[0]
    assert set(p["per_layer_us"]) == {"adaln", "attention", "router", "experts", "shared", "slot_sum"}
    assert all(v > 0 for v in p["per_layer_us"].values()) and p["tokens"] == 2 * 2 * 16
    assert p["message_bytes"] == p["tokens"] * 2 * 128 * 4
    curves = accounting.load_comm_curves([RESULTS / "lowlatency-nvidia-h200-x2"])
    speed = speed_rows(parts, curves, steps=10)
    assert {r["method"] for r in speed} == {"lowlatency", "alltoall"}
    assert all(r["sync"] == pytest.approx(1.0) and r["interweaved"] >= 1.0 for r in speed)
    shares = share_rows({"dit-moe-xl": 28}, steps=50)
    assert len(shares) == 8 and all(r["displaced"] > 1.0 for r in shares)
    memory = memory_rows(parts, steps=10)
    assert memory[0]["interweaved MiB"] * 2 == memory[0]["displaced MiB"] > 0
    assert memory[0]["sync rows/sync"] == 1.0
