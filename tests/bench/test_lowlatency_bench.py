"""`moekit bench lowlatency` on 2 CPU ranks (gloo, tiny sizes): the record, table, figure and traces."""

from __future__ import annotations

import pytest
import torch

from moekit.bench.lowlatency import (LowLatencyBenchConfig, _routing_bytes, format_lowlatency_bench,
                                     run_lowlatency_bench)
from moekit.bench.perfetto import load_trace
from moekit.bench.report import load_record
from moekit.cli import main as cli_main


def test_bench_record_on_cpu(tmp_path):
    cfg = LowLatencyBenchConfig(world_size=2, hidden=128, top_k=2, num_experts=8, tokens=(1, 4), iters=3, warmup=1,
                                routings=3, trace_dir=str(tmp_path / "traces"))
    record = run_lowlatency_bench(cfg, out_dir=str(tmp_path))
    saved = load_record(record["path"])
    p, r = saved["params"], saved["results"]
    assert p["backend"] == "gloo" and not p["cuda_graphs"] and p["max_m"] == 4 and p["num_experts"] == 8
    assert set(r["series"]) == {"lowlatency", "alltoall"}  # vdev2d needs GPUs
    assert r["vdev2d"]["ran"] is False and "CUDA" in r["vdev2d"]["skipped"]
    for by_t in r["series"].values():
        assert set(by_t) == {"1", "4"}
        for s in by_t.values():
            assert s["dispatch"]["n"] == 3 and 0 < s["dispatch"]["median"] <= s["total"]["max"]
            # the total is the slowest rank's dispatch + combine of one iteration
            assert s["total"]["max"] <= s["dispatch"]["max"] + s["combine"]["max"] + 1e-6
    assert set(r["ratios"]["4"]) == {"alltoall/lowlatency"}
    assert r["checks"]["lowlatency_counts"] == {"1": True, "4": True}
    assert r["byte_floor"]["lowlatency"]["4"]["dispatch_bytes"] > 0 and "dispatch_us" not in r["byte_floor"][
        "lowlatency"]["4"]  # no bandwidth on the CPU
    assert r["goal"] is None  # no 128-token point
    assert record["figures"][0].endswith(".png")
    assert len(r["traces"]) == 4
    for path in r["traces"]:
        assert {e["name"] for e in load_trace(path)["traceEvents"] if e["ph"] == "X"}
    # the profiled run (eager on the CPU): every phase of both calls, per rank, warm-up left out
    assert [ph["rank"] for ph in r["phases"]] == [0, 1]
    for ph in r["phases"]:
        assert ph["tokens"] == 4 and ph["graph"] is False and ph["calls"] == 18
        assert {"dispatch.quant_and_put", "dispatch.postprocess", "combine.copy_and_put",
                "combine.topk_reduce", "gap before combine.copy_and_put"} <= set(ph)
        assert ph["step"] >= ph["dispatch.quant_and_put"] > 0
    text = format_lowlatency_bench(record)
    # the shape is not deepseek-v3's, and the header says so
    assert "deepseek-v3 with hidden, top_k, num_experts changed: H=128 top-2 E=8" in text
    assert "deepseek-v3: H=" not in text
    assert "lowlatency" in text and "alltoall/lowlatency" in text and "skipped" in text
    assert "profile rank 1 (T=4, eager, median of 18 steps" in text


def test_phase_summary_on_hand_made_traces(tmp_path):
    """Durations, gaps and step span from two traces whose timings are known (µs)."""
    from moekit.bench.lowlatency import phase_summary
    from moekit.bench.perfetto import phase_events, trace_document, write_trace

    us = 1000  # the stamps are in ns
    # call c starts at 100 * c µs; dispatch: a [0, 2], b [3, 7]; combine: c [10, 15 + c]
    d = [torch.tensor([[100 * c * us, (100 * c + 2) * us], [(100 * c + 3) * us, (100 * c + 7) * us]])
         for c in range(3)]
    k = [torch.tensor([[(100 * c + 10) * us, (100 * c + 15 + c) * us]]) for c in range(3)]
    dp = write_trace(tmp_path / "d.json", trace_document(phase_events(d, ("a", "b"), pid=0, tid=0,
                                                                       thread_name="dispatch")))
    kp = write_trace(tmp_path / "k.json", trace_document(phase_events(k, ("c",), pid=0, tid=1,
                                                                       thread_name="combine")))
    s = phase_summary(dp, kp)
    assert s == {"dispatch.a": 2, "dispatch.b": 4, "gap before dispatch.b": 1, "combine.c": 6,
                 "gap before combine.c": 3, "step": 16, "calls": 3}
    assert phase_summary(dp, kp, skip=2)["combine.c"] == 7 and phase_summary(dp, kp, skip=2)["calls"] == 1


def test_routing_bytes_dedup():
    # 2 ranks, 4 experts (2 per rank); rank 0's tokens
    ids = torch.tensor([[[0, 2], [2, 3], [0, 1]]])  # one routing, T = 3, K = 2
    d, c = _routing_bytes(ids, rank=0, E=4, P=2, dispatch_row=10, combine_row=100, dedup=True)
    assert (d, c) == (2 * 10, 3 * 100)  # tokens 0 and 1 cross once each; 3 slots come back
    d, c = _routing_bytes(ids, rank=0, E=4, P=2, dispatch_row=10, combine_row=100, dedup=False)
    assert (d, c) == (3 * 10, 3 * 100)


@pytest.mark.parametrize("bad,match", [(dict(tokens=()), "tokens"), (dict(methods=("x",)), "methods"),
                                       (dict(iters=0), "iters"), (dict(shape="nope"), "nope")])
def test_config_validation(bad, match):
    with pytest.raises((ValueError, KeyError), match=match):
        LowLatencyBenchConfig(**bad)


def test_cli_help_and_bad_input(capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["bench", "lowlatency", "--help"])
    assert done.value.code == 0 and "--peer-experts" in capsys.readouterr().out
    assert cli_main(["bench", "lowlatency", "--num-experts", "7", "--no-record"]) == 2
    assert "num_experts=7 must be a multiple of world_size=2" in capsys.readouterr().err


def test_device_defaults():
    from moekit.bench.lowlatency import CPU_DEFAULTS, GPU_DEFAULTS

    gpu = LowLatencyBenchConfig().for_device(True)
    assert (gpu.tokens, gpu.iters, gpu.warmup) == ((1, 8, 32, 128, 256), 1000, 50) == tuple(GPU_DEFAULTS.values())
    cpu = LowLatencyBenchConfig(tokens=(2,)).for_device(False)
    assert cpu.tokens == (2,) and cpu.iters == CPU_DEFAULTS["iters"] < gpu.iters
    assert LowLatencyBenchConfig().shape_label == "deepseek-v3"


def test_both_orders_and_a_bounded_buffer_in_one_run(tmp_path):
    """--combine-order both --recv-capacity: every variant timed and count-checked on 2 CPU
    ranks; the rank order's combine floor is one row per (token, remote rank)."""
    cfg = LowLatencyBenchConfig(world_size=2, hidden=128, top_k=4, num_experts=8, tokens=(3,), iters=2, warmup=1,
                                routings=3, methods=("lowlatency", "alltoall"), combine_order="both", recv_capacity=2)
    record = run_lowlatency_bench(cfg, out_dir=str(tmp_path), figures=False)
    r = load_record(record["path"])["results"]
    assert set(r["series"]) == {"lowlatency", "lowlatency[C=2]", "lowlatency[rank]", "lowlatency[rank, C=2]",
                                "alltoall", "alltoall[rank]"}
    assert all(v == {"3": True} for v in r["checks"].values()) and len(r["checks"]) == 4
    slot, rank = r["byte_floor"]["lowlatency"]["3"], r["byte_floor"]["lowlatency[rank]"]["3"]
    assert rank["combine_bytes"] < slot["combine_bytes"]
    assert r["byte_floor"]["alltoall[rank]"]["3"]["combine_bytes"] < r["byte_floor"]["alltoall"]["3"]["combine_bytes"]
    assert "lowlatency/lowlatency[rank]" in r["ratios"]["3"] and r["skipped"] == {}
    assert "lowlatency[rank, C=2]" in format_lowlatency_bench(record)


def test_buffer_report_from_the_cli(tmp_path, capsys):
    """--buffers: rows computed from the layout for a preset and for a recorded trace; the
    bounded bytes are the layout's at the reported capacity."""
    from moekit.ep.lowlatency.buffers import layout_for

    trace = "benchmarks/traces/olmoe-stdlib.npz"
    code = cli_main(["bench", "lowlatency", "--buffers", "--buffer-shapes", "qwen3-30b-a3b", "--eps", "8", "64",
                     "--max-m", "32", "--buffer-steps", "4", "--mixtral-steps", "4", "--trace",
                     f"{trace}=olmoe-1b-7b", "--out-dir", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b" in out and "olmoe-stdlib.npz (recorded)" in out and "Mixtral" in out
    rows = load_record(next(tmp_path.glob("*.json")))["results"]["rows"]
    assert [(r["shape"], r["world_size"]) for r in rows][:2] == [("qwen3-30b-a3b", 8), ("qwen3-30b-a3b", 64)]
    for r in rows:
        bounded = layout_for(r["shape"], r["world_size"], r["max_m"], recv_capacity=r["capacity"])
        assert r["bounded"] == bounded.buffer_bytes()
        assert r["worst"] == layout_for(r["shape"], r["world_size"], r["max_m"]).buffer_bytes()
        sp = r["spill"]
        assert all(0.0 <= sp[k] <= 1.0 for k in ("token_fraction", "pair_fraction", "step_fraction"))
        assert (sp["token_fraction"] > 0) == (sp["pair_fraction"] > 0) == (sp["max_rounds"] > 0)
        assert r["capacity"] == r["max_m"] or r["capacity"] + r["spill_rows"] < r["max_m"]
    assert cli_main(["bench", "lowlatency", "--buffers", "--quantile", "0", "--no-record"]) == 2
    assert "--quantile must be in (0, 1]" in capsys.readouterr().err
