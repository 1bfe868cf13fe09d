"""`moekit dice step`: the measured step times of each schedule on 2 gloo ranks, end to end;
how the ranks' timings combine; what is skipped when it does not fit; the overlap figure
read from a trace; and the command's input errors."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from moekit.cli import main
from moekit.dice import SchedulePlan, preset
from moekit.dice import measure
from moekit.dice.measure import DispatcherPool, StepSpec, combine_ranks, model_config, table_rows
from moekit.dice.overlap import trace_overlap

SCHEDULES = ("sync", "displaced", "interweaved", "dice")


# ---------------------------------------------------------------------------- end to end


def test_step_command_measures_every_case_on_two_ranks(capsys, tmp_path):
    trace_dir = tmp_path / "trace"
    assert main(["dice", "step", "--world-size", "2", "--models", "digits", "--batches", "1,2", "--steps", "2",
                 "--warmup", "1", "--trace", str(trace_dir), "--trace-steps", "1", "--out-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "speedup over sync" in text and "dice x" in text
    (path,) = tmp_path.glob("dice-step-*.json")
    record = json.loads(path.read_text())
    assert record["kind"] == "dice-step" and record["params"]["device"] == "cpu"
    rows = record["results"]["rows"]
    cases = {(r["schedule"], r["dispatcher"], r["batch"]) for r in rows}
    assert cases == {(s, d, b) for s in SCHEDULES for d in ("alltoall", "lowlatency") for b in (1, 2)}
    assert len(rows) == len(cases) and not any("skipped" in r for r in rows)
    sync = {(r["dispatcher"], r["batch"]): r for r in rows if r["schedule"] == "sync"}
    for r in rows:
        assert len(r["step_ms"]) == 2 and min(r["step_ms"]) > 0
        assert r["median_ms"] == pytest.approx(float(np.median(r["step_ms"])))
        # Per step the slowest rank: its median is at least every rank's own median.
        assert r["median_ms"] >= max(r["rank_median_ms"]) - 1e-9
        base = sync[(r["dispatcher"], r["batch"])]
        assert r["speedup"] == pytest.approx(base["median_ms"] / r["median_ms"])
        assert r["speedup_mean"] == pytest.approx(np.mean(base["step_ms"]) / np.mean(r["step_ms"]))
        assert r["executor"] == ("inline" if r["schedule"] == "sync" else "async")
    assert all(s["speedup"] == 1.0 for s in sync.values())
    shares = record["results"]["shares"]
    assert {(s["dispatcher"], s["batch"]) for s in shares} == set(sync)
    for s in shares:
        assert 0 < s["a2a_share"] < 1
        assert s["calls_per_step"] == 2 * 4  # a dispatch and a combine in each of digits' 4 layers
    traces = record["results"]["traces"]
    assert {(t["schedule"], t["rank"]) for t in traces} == {(s, r) for s in ("sync", "dice") for r in (0, 1)}
    for t in traces:
        assert (trace_dir / t["file"]).exists() and t["overlap"]["kind"] == "cpu" and t["overlap"]["transfer_spans"]
        if t["schedule"] == "sync":  # in-order: the sampler's thread waits inside every transfer
            assert t["overlap"]["overlap_fraction"] < 0.1
    assert record["params"]["trace_case"] == ["digits", 1, "alltoall", "dice"]


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0"], "--world-size must be an int >= 1, got 0"),
    (["--schedules", "sync,fast"], "unknown schedule 'fast'"),
    (["--batches", "0"], "--batches must list integers >= 1"),
    (["--batches", "2,x"], "--batches must be comma-separated integers"),
    (["--schedules", "dice,displaced"], "must include 'sync'"),
    (["--dispatchers", "alltoall,nvshmem"], "--dispatchers must be from alltoall, lowlatency"),
    (["--models", "dit-moe-h"], "unknown DiT-MoE preset 'dit-moe-h'"),
    (["--steps", "0"], "--steps must be an int >= 1"),
    (["--warmup", "-1"], "--warmup must be an int >= 0"),
    (["--world-size", "3"], "world_size must divide num_experts=8"),
    (["--experts", "fused", "--device", "cpu"], "--experts fused needs --device cuda"),
    (["--dtype", "int8", "--device", "cpu"], "--dtype must be one of bf16, fp16, fp32"),
    (["--cfg", "0.5"], "--cfg must be a number >= 1"),
])
def test_bad_options_are_one_line(argv, message, capsys, tmp_path):
    assert main(["dice", "step", "--out-dir", str(tmp_path)] + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moekit: error:") and message in err[0], err
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs")
def test_cuda_without_the_gpus_is_refused(capsys):
    assert main(["dice", "step", "--device", "cuda"]) == 2
    assert "--device cuda needs --world-size=2 GPUs" in capsys.readouterr().err


# ------------------------------------------------------------------ combining the ranks


def _case(schedule, step_ms, rows, dispatcher="alltoall", **extra):
    return dict(model="m", batch=4, dispatcher=dispatcher, schedule=schedule, step_ms=step_ms, rows_remote=rows,
                executor="inline" if schedule == "sync" else "async", describe=schedule, staleness=0.0,
                peak_gib=None, **extra)


def test_ranks_combine_into_the_slowest_per_step_and_speedups_over_sync():
    spec = StepSpec(models=("digits",), batches=(4,), steps=3, warmup=1, device="cpu", experts="torch")
    # Per rank: a warm-up step, 3 timed steps, and the untimed tail of 2 (TAIL).
    rank0 = dict(cases=[_case("sync", [50, 10, 14, 12, 1, 1], [9, 5, 5, 5, 0, 0]),
                        _case("dice", [50, 6, 9, 7, 1, 1], [9, 2, 3, 2, 0, 0]),
                        dict(model="m", batch=4, dispatcher="alltoall", schedule="displaced", skipped="too big")],
                 shares=[dict(model="m", batch=4, dispatcher="alltoall", step_ms=[50, 10, 20, 10, 1, 1],
                              comm_ms=[9, 5, 5, 2, 0, 0], calls_per_step=8.0)],
                 models=[dict(model="m")], traces=[])
    rank1 = dict(cases=[_case("sync", [40, 11, 13, 16, 1, 1], [8, 4, 4, 4, 0, 0]),
                        _case("dice", [40, 8, 8, 8, 1, 1], [8, 1, 1, 1, 0, 0]),
                        dict(model="m", batch=4, dispatcher="alltoall", schedule="displaced", skipped="too big")],
                 shares=[dict(model="m", batch=4, dispatcher="alltoall", step_ms=[50, 10, 10, 10, 1, 1],
                              comm_ms=[9, 1, 2, 3, 0, 0], calls_per_step=8.0)],
                 models=[dict(model="m")], traces=[dict(schedule="dice", file="t.json")])
    out = combine_ranks([rank0, rank1], spec)
    sync, dice, displaced = out["rows"]
    assert sync["step_ms"] == [11, 14, 16] and dice["step_ms"] == [8, 9, 8]
    assert (sync["median_ms"], dice["median_ms"]) == (14, 8)
    assert dice["speedup"] == 14 / 8 and sync["speedup"] == 1.0
    assert dice["speedup_mean"] == pytest.approx((41 / 3) / (25 / 3))
    assert sync["rows_remote_per_step"] == 9 and dice["rows_remote_per_step"] == 10 / 3
    assert dice["rows_vs_sync"] == pytest.approx(10 / 27)
    assert displaced == dict(model="m", batch=4, dispatcher="alltoall", schedule="displaced", skipped="too big")
    (share,) = out["shares"]
    # rank 0: shares 0.5, 0.25, 0.2 -> median 0.25; rank 1: 0.1, 0.2, 0.3 -> 0.2
    assert share["rank_a2a_share"] == pytest.approx([0.25, 0.2]) and share["a2a_share"] == pytest.approx(0.225)
    assert out["traces"] == [dict(rank=1, schedule="dice", file="t.json")]
    lines, columns = table_rows(out, ("sync", "displaced", "dice"))
    assert columns == ["model", "batch", "dispatcher", "sync ms", "a2a share", "displaced ms", "displaced x",
                       "dice ms", "dice x"]
    assert lines == [{"model": "m", "batch": 4, "dispatcher": "alltoall", "sync ms": 14, "dice ms": 8,
                      "dice x": 14 / 8, "a2a share": pytest.approx(0.225)}]


# ---------------------------------------------------------------- what fits, what is built


def test_low_latency_layers_per_layer_and_parity_for_the_asynchronous_layers():
    config = model_config("digits")
    pool = DispatcherPool("lowlatency", config, max_m=64, world_size=1, device=torch.device("cpu"),
                          dtype=torch.float32)
    plan = SchedulePlan(preset("dice", 6), 6, config.depth)  # the shallow half (layers 0, 1) asynchronous
    assert pool.keys(plan) == [(0, 0), (0, 1), (1, 0), (1, 1), "shared"]
    assert pool.keys(SchedulePlan(preset("sync", 6), 6, config.depth)) == ["shared"]
    assert len(pool.keys(SchedulePlan(preset("displaced", 6), 6, config.depth))) == 2 * config.depth
    pool.layers = {key: key for key in pool.keys(plan)}  # stand-ins: the mapping, without building layers
    pick = pool.dispatcher(plan)
    assert [pick(layer, 1) for layer in range(4)] == [(0, 1), (1, 1), "shared", "shared"]
    assert DispatcherPool("alltoall", config, 64, 1, torch.device("cpu"), torch.float32).keys(plan) == ["alltoall"]


def test_what_does_not_fit_is_skipped_with_the_reason(monkeypatch, capsys):
    """One process (world size 1), the free memory pretended: enough for everything but the
    low-latency layers of the asynchronous schedules, which then say why they were skipped."""
    config = model_config("digits")
    spec = StepSpec(models=("digits",), batches=(1,), steps=1, warmup=1, world_size=1, device="cpu", dtype="fp32",
                    experts="torch", headroom_gib=0.0)
    tokens = measure.tokens_per_rank(config, 1, spec.cfg)
    layer = measure.lowlatency_layer_bytes(config, tokens * config.top_k, 1, torch.float32)
    plans = {name: SchedulePlan(preset(name, spec.total_steps), spec.total_steps, config.depth) for name in SCHEDULES}
    working = max(measure.working_set_bytes(config, p, tokens, 4) for p in plans.values())
    free = working + layer["persistent"] + 2 * layer["expert_out"]  # the shared layer of sync and no more
    calls = []

    def pretend(device):  # the first call asks before the model is built: room for it
        calls.append(device)
        return 1 << 40 if len(calls) == 1 else free

    monkeypatch.setattr(measure, "agreed_free_bytes", pretend)
    out = measure.measure_worker(0, 1, spec)
    status = {(c["dispatcher"], c["schedule"]): c.get("skipped") for c in out["cases"]}
    assert all(status[("alltoall", s)] is None for s in SCHEDULES) and status[("lowlatency", "sync")] is None
    for name in ("displaced", "interweaved", "dice"):
        assert "low-latency layers" in status[("lowlatency", name)] and "GiB free" in status[("lowlatency", name)]
    monkeypatch.setattr(measure, "agreed_free_bytes", lambda device: 1024)
    out = measure.measure_worker(0, 1, spec)
    assert not out["cases"] and "do not fit" in out["models"][0]["skipped"]


# ------------------------------------------------------------------------------ overlap


def _covered(intervals, grid):
    on = np.zeros(grid, dtype=bool)
    for s, e in intervals:
        on[s:e] = True
    return on


@pytest.mark.parametrize("seed", range(5))
def test_gpu_overlap_is_the_transfer_time_beside_the_main_threads_kernels(seed):
    """Integer spans on a microsecond grid: the reference counts covered grid cells."""
    rng = random.Random(seed)
    events, transfer, compute = [], [], []
    for corr in range(60):
        start, dur = rng.randrange(0, 900), rng.randrange(1, 80)
        kind = rng.choice(["nccl", "main", "worker"])
        name = {"nccl": "ncclDevKernel_SendRecv", "main": "gemm_kernel", "worker": "index_put_kernel"}[kind]
        tid = 11 if kind == "main" else 22
        events.append(dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=start - 5, dur=2, tid=tid,
                           args=dict(correlation=corr)))
        events.append(dict(ph="X", cat="kernel", name=name, ts=start, dur=dur, tid=7 if kind == "main" else 9,
                           args=dict(correlation=corr, stream=7 if kind == "main" else 9)))
        (transfer if kind == "nccl" else compute if kind == "main" else []).append((start, start + dur))
    # the main thread launches the most kernels, and its stream's non-transfer kernels run longest
    for corr in range(60, 100):
        events.append(dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=0, dur=1, tid=11,
                           args=dict(correlation=corr)))
        events.append(dict(ph="X", cat="kernel", name="elementwise", ts=2000, dur=50, tid=7,
                           args=dict(correlation=corr, stream=7)))
    out = trace_overlap(dict(traceEvents=events))
    t, c = _covered(transfer, 3000), _covered(compute, 3000)
    assert out["kind"] == "gpu"
    assert out["transfer_ms"] == pytest.approx(t.sum() / 1e3)
    assert out["overlap_ms"] == pytest.approx((t & c).sum() / 1e3)
    assert out["overlap_fraction"] == pytest.approx((t & c).sum() / t.sum())


def test_cpu_overlap_leaves_out_what_runs_inside_a_collective():
    main_tid, gloo_tid = 1, 2
    events = [
        dict(ph="X", cat="user_annotation", name="gloo:all_to_all", ts=100, dur=100, tid=gloo_tid),
        dict(ph="X", cat="cpu_op", name="c10d::alltoall_base_", ts=90, dur=120, tid=main_tid),
        dict(ph="X", cat="cpu_op", name="aten::empty", ts=95, dur=5, tid=main_tid),  # inside the collective
        dict(ph="X", cat="cpu_op", name="aten::mm", ts=180, dur=50, tid=3),  # another thread: not compute
        dict(ph="X", cat="cpu_op", name="aten::mm", ts=150, dur=10, tid=main_tid),  # overlaps? inside: no
        dict(ph="X", cat="user_annotation", name="gloo:all_to_all", ts=300, dur=100, tid=gloo_tid),
        dict(ph="X", cat="cpu_op", name="aten::mm", ts=350, dur=100, tid=main_tid),  # beside it: 50 of 100
    ]
    out = trace_overlap(events)
    assert out["kind"] == "cpu" and out["transfer_ms"] == pytest.approx(0.2)
    assert out["overlap_fraction"] == pytest.approx(50 / 200)


def test_overlap_of_a_trace_without_transfers_is_none():
    out = trace_overlap([dict(ph="X", cat="cpu_op", name="aten::mm", ts=0, dur=5, tid=1)])
    assert out["overlap_fraction"] is None and out["transfer_ms"] == 0
    with pytest.raises(ValueError, match="Chrome trace"):
        trace_overlap({"events": []})
