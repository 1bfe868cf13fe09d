"""moekit.bench.timing on the CPU clock (runs everywhere, also on GPU machines).

Bounds are one-sided (a sample is at least the sleep it contains), so a loaded machine
can make the numbers larger but never fail the tests.
"""

import time

import pytest
import torch

from moekit.bench.timing import PhaseTimer, queue_timed, time_distributed, time_fn, time_graph_replay

SLEEP_S = 0.002


def test_time_fn_cpu_counts_each_sleep_and_excludes_warmup():
    calls = []

    def fn():
        calls.append(None)
        time.sleep(SLEEP_S)

    samples = time_fn(fn, iters=5, warmup=2, device="cpu")
    assert len(calls) == 7
    assert len(samples) == 5
    assert all(isinstance(sample, float) for sample in samples)
    assert all(sample >= SLEEP_S * 1e6 for sample in samples)


def test_time_fn_cpu_sync_fn_is_inside_the_timed_region():
    syncs = []

    def sync():
        syncs.append(None)
        time.sleep(SLEEP_S)  # stands in for waiting on asynchronous work

    samples = time_fn(lambda: None, iters=4, warmup=1, device="cpu", sync_fn=sync)
    assert len(syncs) == 1 + 4  # once after warm-up, then once per timed call
    assert all(sample >= SLEEP_S * 1e6 for sample in samples)


def test_time_fn_defaults_to_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    samples = time_fn(lambda: time.sleep(SLEEP_S), iters=2, warmup=0)
    assert all(sample >= SLEEP_S * 1e6 for sample in samples)


@pytest.mark.parametrize("iters, warmup", [(0, 1), (-1, 0), (2, -1), (1.5, 0)])
def test_time_fn_rejects_bad_counts(iters, warmup):
    with pytest.raises(ValueError, match="iters|warmup"):
        time_fn(lambda: None, iters=iters, warmup=warmup, device="cpu")


def test_cuda_functions_fail_clearly_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="time_graph_replay needs a CUDA GPU"):
        time_graph_replay(lambda: None, iters=2, warmup=1)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        time_fn(lambda: None, iters=2, warmup=1, device="cuda")
    with pytest.raises(ValueError, match="replays_per_sample"):
        time_graph_replay(lambda: None, iters=2, warmup=1, replays_per_sample=0)


def test_time_distributed_needs_a_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="process group"):
        time_distributed(lambda: None, iters=2, warmup=1)


def test_phase_timer_cpu():
    timer = PhaseTimer(device="cpu")
    for iteration in range(4):
        if iteration == 1:
            timer.reset()  # drop the warm-up iteration
        with timer.phase("pack"):
            time.sleep(SLEEP_S)
        with timer.phase("all-to-all"):
            time.sleep(2 * SLEEP_S)
    results = timer.results()
    assert list(results) == ["pack", "all-to-all"]
    assert len(results["pack"]) == len(results["all-to-all"]) == 3
    assert all(sample >= SLEEP_S * 1e6 for sample in results["pack"])
    assert all(sample >= 2 * SLEEP_S * 1e6 for sample in results["all-to-all"])


def test_phase_timer_records_nothing_for_a_failed_phase():
    timer = PhaseTimer(device="cpu")
    with pytest.raises(KeyError):
        with timer.phase("broken"):
            raise KeyError("boom")
    with timer.phase("ok"):
        pass
    assert list(timer.results()) == ["ok"]


def test_phase_timer_sync_fn_runs_at_each_boundary():
    syncs = []
    timer = PhaseTimer(device="cpu", sync_fn=lambda: syncs.append(None))
    with timer.phase("a"):
        pass
    assert len(syncs) == 2



def test_queue_timed_on_the_cpu_times_each_fn_of_an_iteration():
    """Several fns per iteration: each its own samples; before_each outside the timed region
    (its sleep is in no sample's lower bound, its calls counted), after_warmup once."""
    log = []
    fns = [lambda: (log.append("a"), time.sleep(SLEEP_S)), lambda: (log.append("b"), time.sleep(2 * SLEEP_S))]
    samples = queue_timed(fns, iters=3, warmup=2, device="cpu", before_each=lambda: log.append("w"),
                          after_warmup=lambda: log.append("aligned"))()
    assert log == ["w", "a", "b"] * 2 + ["aligned"] + ["w", "a", "b"] * 3
    assert [len(s) for s in samples] == [3, 3]
    assert all(t >= SLEEP_S * 1e6 for t in samples[0]) and all(t >= 2 * SLEEP_S * 1e6 for t in samples[1])
    single = queue_timed(lambda: time.sleep(SLEEP_S), iters=2, warmup=0, device="cpu")()
    assert len(single) == 1 and len(single[0]) == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(iters=0), "iters"), (dict(warmup=-1), "warmup"), (dict(chunk=0), "chunk"),
    (dict(queue_ahead_us=-1.0), "queue_ahead_us"), (dict(fns=[]), "fns"),
])
def test_queue_timed_rejects_bad_arguments(kwargs, match):
    args = dict(fns=lambda: None, iters=2, warmup=0, device="cpu") | kwargs
    with pytest.raises(ValueError, match=match):
        queue_timed(args.pop("fns"), **args)
