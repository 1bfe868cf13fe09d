"""DICE on a GPU: the asynchronous executor really overlaps, and the schedules give the
simulator's results with it (and with the fused expert kernel). Skips without CUDA."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def sleep_ms(cycles: int) -> float:
    """GPU time in ms of one ``torch.cuda._sleep(cycles)``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def sleep_cycles_for(ms: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``ms`` milliseconds,
    calibrated three times over: the first sleeps can run while the GPU's clock is still
    rising, which makes a cycle look slower than it is (one calibration gave 11 ms for 40 on
    an H200)."""
    cycles = 10_000_000
    for _ in range(3):
        cycles = int(cycles * ms / sleep_ms(cycles))
    return cycles


def timed_overlap(executor, cycles: int) -> float:
    """Submit a "transfer" (a sleep on the executor's side), run "compute" (a sleep on the
    caller's stream), wait for the transfer; wall time in ms, measured from the host."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    handle = executor.submit(lambda: torch.cuda._sleep(cycles))
    torch.cuda._sleep(cycles)
    executor.wait(handle)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def test_async_executor_overlaps_transfer_and_compute():
    from moekit.dice import AsyncExecutor, InlineExecutor

    cycles = sleep_cycles_for(40.0)
    executor = AsyncExecutor("cuda")
    try:
        timed_overlap(executor, cycles)  # warm-up: thread and stream
        overlapped = min(timed_overlap(executor, cycles) for _ in range(3))
    finally:
        executor.close()
    serial = min(timed_overlap(InlineExecutor(), cycles) for _ in range(3))
    one = sleep_ms(cycles)  # one sleep, timed after the runs above: serial is two of them
    assert serial > 1.75 * one, (serial, one)
    assert overlapped < 0.7 * serial, (overlapped, serial)


def test_async_executor_orders_the_streams():
    """The transfer reads what the caller wrote before submit; the caller reads the result after wait."""
    from moekit.dice import AsyncExecutor

    cycles = sleep_cycles_for(20.0)
    executor = AsyncExecutor("cuda")
    try:
        x = torch.zeros(1 << 20, device="cuda")
        torch.cuda._sleep(cycles)  # the caller's stream is busy when x is written
        x.add_(1)
        handle = executor.submit(lambda: x * 2, inputs=(x,))
        y = executor.wait(handle)
        assert torch.equal(y, torch.full_like(x, 2.0))
    finally:
        executor.close()


def _tiny():
    from moekit.dice import DiTMoE, digits_config

    cfg = digits_config(hidden=64, depth=4, num_heads=2, num_experts=8)
    return DiTMoE(cfg, seed=3, adaln_zero=False).cuda().eval()


@pytest.mark.parametrize("name", ["sync", "displaced", "interweaved", "dice", "interweaved+latest"])
def test_schedules_on_the_gpu_match_the_simulator(name):
    from moekit.dice import ScheduledMoE, SchedulePlan, StalenessSimulator, make_executor, preset, sample

    model = _tiny()
    steps = 8
    schedule = preset(name, steps)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(6, 1, 8, 8, generator=g).cuda()
    labels = torch.arange(6).cuda()
    weights = model.moe_weights()
    outs = {}
    for kind in ("inline", "async"):
        runner = ScheduledMoE(weights, model.config.moe_shape, schedule, steps, executor=make_executor(kind, "cuda"))
        outs[kind] = sample(model, noise, labels, steps=steps, moe=runner)
        runner.close()
        assert runner.stats()["sources"] == SchedulePlan(schedule, steps, model.config.depth).source_table
    assert torch.equal(outs["inline"], outs["async"])  # the same kernels on other streams: the same bits
    sim = StalenessSimulator(weights, model.config.moe_shape, schedule, steps)
    ref = sample(model, noise, labels, steps=steps, moe=sim)
    torch.testing.assert_close(outs["async"], ref, rtol=1e-4, atol=1e-4)


def test_fused_experts_serve_the_schedules():
    pytest.importorskip("triton")
    from moekit.dice import ScheduledMoE, make_executor, preset, sample

    model = _tiny()
    steps = 6
    schedule = preset("dice", steps)
    noise = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1)).cuda()
    labels = torch.arange(4).cuda()
    outs = {}
    for experts in ("torch", "fused"):
        runner = ScheduledMoE(model.moe_weights(), model.config.moe_shape, schedule, steps, experts=experts,
                              executor=make_executor("async", "cuda"))
        outs[experts] = sample(model, noise, labels, steps=steps, moe=runner)
        runner.close()
    # The kernel's fp32 dots may use TF32: a few 1e-3 apart after 6 steps; a wrong routing or
    # combine would be off by order 1.
    err = ((outs["fused"] - outs["torch"]).norm() / outs["torch"].norm()).item()
    assert err < 2e-2, err


def _two_gpu_worker(rank, world_size, name, steps):
    from moekit.dice import ScheduledMoE, make_executor, preset, sample

    model = _tiny()
    g = torch.Generator().manual_seed(0)
    noise, labels = torch.randn(4, 1, 8, 8, generator=g), torch.arange(4)
    mine = slice(2 * rank, 2 * rank + 2)
    runner = ScheduledMoE(model.moe_weights(), model.config.moe_shape, preset(name, steps), steps,
                          executor=make_executor("async", "cuda"))
    z = sample(model, noise[mine].cuda(), labels[mine].cuda(), steps=steps, moe=runner)
    runner.close()
    return z.cpu()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("name", ["displaced", "dice"])
def test_two_gpus_over_nccl_match_the_simulator(name):
    from moekit.dice import StalenessSimulator, preset, sample
    from moekit.ep import launch

    steps = 6
    z = torch.cat(launch(_two_gpu_worker, 2, name, steps, backend="nccl"))
    model = _tiny()
    g = torch.Generator().manual_seed(0)
    noise, labels = torch.randn(4, 1, 8, 8, generator=g).cuda(), torch.arange(4).cuda()
    sim = StalenessSimulator(model.moe_weights(), model.config.moe_shape, preset(name, steps), steps, world_size=2)
    torch.testing.assert_close(z, sample(model, noise, labels, steps=steps, moe=sim).cpu(), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dice_step_measures_every_schedule_on_two_gpus(tmp_path, capsys):
    """`moekit dice step` at dit-moe-xl's layer shape (2 of its blocks), batch 2 per GPU: every
    schedule over both dispatchers timed on 2 GPUs (NCCL; the low-latency layer's symmetric
    memory), speedups from the timings, the sync all-to-all share, and a GPU trace."""
    import json

    from moekit.cli import main

    trace = tmp_path / "trace"
    assert main(["dice", "step", "--world-size", "2", "--device", "cuda", "--models", "dit-moe-xl", "--depth", "2",
                 "--batches", "2", "--steps", "3", "--warmup", "2", "--trace", str(trace), "--trace-steps", "1",
                 "--timeout", "240", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("dice-step-*.json")
    record = json.loads(path.read_text())
    assert record["environment"]["gpu_count"] >= 2 and record["params"]["experts"] == "fused"
    rows = record["results"]["rows"]
    assert {(r["schedule"], r["dispatcher"]) for r in rows} == {
        (s, d) for s in ("sync", "displaced", "interweaved", "dice") for d in ("alltoall", "lowlatency")}
    skipped = [r for r in rows if "skipped" in r]
    assert not skipped, skipped
    sync = {r["dispatcher"]: r for r in rows if r["schedule"] == "sync"}
    for r in rows:
        assert len(r["step_ms"]) == 3 and min(r["step_ms"]) > 0 and r["peak_gib"] > 0
        assert r["speedup"] == pytest.approx(sync[r["dispatcher"]]["median_ms"] / r["median_ms"])
    for s in record["results"]["shares"]:
        assert 0 < s["a2a_share"] < 1 and s["calls_per_step"] == 2 * 2
    traces = record["results"]["traces"]
    assert {(t["schedule"], t["rank"]) for t in traces} == {(s, r) for s in ("sync", "dice") for r in (0, 1)}
    for t in traces:
        assert (trace / t["file"]).exists()
        assert t["overlap"]["kind"] == "gpu" and t["overlap"]["transfer_spans"] > 0, t
