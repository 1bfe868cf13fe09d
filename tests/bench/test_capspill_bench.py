"""`moekit bench capspill` on 2 CPU ranks (gloo, tiny sizes): the record holds the paper's tables."""

from __future__ import annotations

import pytest

from moekit.bench.capspill import (
    CapSpillBenchConfig,
    bench_routing,
    format_capspill_bench,
    gap_recovery,
    run_capspill_bench,
)
from moekit.bench.report import load_record
from moekit.ep.capacity import calibrate_capacity
from moekit.routing import mixtral_capspill_trace


def test_capspill_bench_record(tmp_path):
    trace = mixtral_capspill_trace(steps=10, layers=4, seed=0)
    cfg = CapSpillBenchConfig(world_size=2, hidden=32, steps=5, iters=2, warmup=1, phase_steps=2, verify_steps=5)
    record = run_capspill_bench(cfg, trace=trace, out_dir=str(tmp_path))
    saved = load_record(record["path"])
    r, p = saved["results"], saved["params"]

    # capacities come from the trace on this run's ranks
    assert p["cmax"] == calibrate_capacity(trace, 1.0, 2).capacity
    assert p["capacities"]["0.99"] == calibrate_capacity(trace, 0.99, 2).capacity
    assert p["max_tokens"] == 172 and p["backend"] == "gloo" and not p["cuda_graphs"]
    assert p["packing"] == "torch" and p["phase_kernels"] is False  # the default: the torch phases

    methods = {"eager", "maxcounts", "capspill-cond"} | {f"capspill q={q:g}" for q in cfg.sweep}
    assert set(r["summaries"]) == methods
    for series in r["summaries"].values():
        for s in series.values():
            assert s["n"] == 5 * 2 and 0 < s["min"] <= s["median"] <= s["p99"] <= s["max"]

    assert [row["method"] for row in r["table1"]] == ["MaxCounts", "Eager", "Cap-and-Spill",
                                                        "Cap-and-Spill (conditional)"]
    assert all({"mean", "median", "p95", "p99", "C", "cuda_graph"} <= set(row) for row in r["table1"])
    assert not any(row["cuda_graph"] for row in r["table1"])  # eager on the CPU, as the header says
    assert [row["setting"] for row in r["table2"]] == ["MaxCounts", "q=0.9", "q=0.95", "q=0.99", "q=0.995", "Eager"]
    assert all(row["S"] == 172 * 2 - row["C"] for row in r["table2"][1:-1])
    assert set(r["phases"]["maxcounts"]) == {"pack", "all-to-all", "unpack"}
    assert set(r["phases"]["capspill"]) == {"pack", "all-to-all", "compact", "all-to-all (spill)", "unpack"}
    assert all(v["exact"] and v["steps"] == 5 for v in r["verification"].values()), r["verification"]
    assert sum(r["trace_counts"]["histogram"]) == 10 * 4 * 2 * 2
    assert all(path.endswith(".png") for path in record["figures"])
    text = format_capspill_bench(record)
    assert "no CUDA graphs" in text
    assert "Table 1" in text and "Table 2" in text and "gap recovery" in text and "53.2%" in text


def test_gap_recovery_and_routing_selection():
    assert gap_recovery(1077.0, 712.0, 390.9) == pytest.approx(53.2, abs=0.05)  # the paper's figure
    assert gap_recovery(100.0, 90.0, 120.0) is None  # eager slower than MaxCounts: no gap to recover
    trace = mixtral_capspill_trace(steps=6, layers=3, seed=1)
    picks, ids, weights = bench_routing(trace, 4, seed=0)
    assert picks.tolist() == [0, 6, 11, 17] and ids.shape == (4, 344, 2)
    assert ((weights > 0) == (ids >= 0)).all()


def test_bad_config():
    with pytest.raises(ValueError, match="steps"):
        CapSpillBenchConfig(steps=0)
    with pytest.raises(ValueError, match="quantiles"):
        CapSpillBenchConfig(sweep=(0.9, 1.5))
    with pytest.raises(ValueError, match="dtype"):
        CapSpillBenchConfig(dtype="float99")
    with pytest.raises(ValueError, match="packing"):
        CapSpillBenchConfig(packing="numpy")


def test_device_defaults():
    """Unset sizes come from the device: the GPU's as before, small ones on the CPU."""
    from moekit.bench.capspill import CPU_DEFAULTS, GPU_DEFAULTS

    assert CapSpillBenchConfig().for_device(True) == CapSpillBenchConfig(**GPU_DEFAULTS)
    cpu = CapSpillBenchConfig(iters=7).for_device(False)
    assert cpu.iters == 7 and cpu.steps == CPU_DEFAULTS["steps"] and cpu.hidden == CPU_DEFAULTS["hidden"]
    assert GPU_DEFAULTS == dict(hidden=4096, trace_steps=1000, steps=200, iters=20, warmup=2, phase_steps=50,
                                verify_steps=50)
