"""moekit.bench timing on CUDA: events, graph replay, phases, NCCL ranks.

Lower bounds come from arithmetic: no GPU does a dense bf16 matrix product faster than
FLOOR_FLOPS_PER_S (about 6x an H200's measured rate), so a sample below
flops / FLOOR_FLOPS_PER_S means the events missed the work.
"""

import os
import re
import statistics
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from moekit.bench.ceilings import measure_ceilings
from moekit.bench.timing import queue_timed
from moekit.ep import launch
from moekit.bench import (
    PhaseTimer,
    capture_graph,
    environment,
    time_distributed,
    time_fn,
    time_graph_replay,
    write_record,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FLOOR_FLOPS_PER_S = 5e15
N = 4096  # one N x N x N bf16 product: 137 GFLOP, ~0.17 ms on an H200


def matmul_chain(count: int, n: int = N):
    """A function doing ``count`` bf16 products on random data into a fixed buffer."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)

    def fn():
        for _ in range(count):
            torch.matmul(a, b, out=out)

    return fn, (a, b, out)


def floor_us(count: int, n: int = N) -> float:
    return count * 2 * n**3 / FLOOR_FLOPS_PER_S * 1e6


def test_events_cover_the_gpu_work():
    one, _ = matmul_chain(1)
    four, _ = matmul_chain(4)
    one_us = time_fn(one, iters=20, warmup=3, device="cuda")
    four_us = time_fn(four, iters=20, warmup=3, device="cuda")
    assert len(one_us) == len(four_us) == 20
    assert min(one_us) >= floor_us(1)
    assert min(four_us) >= floor_us(4)
    assert statistics.median(four_us) > 2.5 * statistics.median(one_us)


def test_events_agree_with_the_host_clock():
    fn, _ = matmul_chain(4)
    events = statistics.median(time_fn(fn, iters=20, warmup=3, device="cuda"))
    host = statistics.median(
        time_fn(fn, iters=20, warmup=3, device="cpu", sync_fn=torch.cuda.synchronize)
    )
    # The host clock adds launch and sync overhead, never removes GPU time.
    assert host >= 0.9 * events


def test_graph_replay_runs_each_replay_once():
    counter = torch.zeros(1, device="cuda", dtype=torch.int64)

    def fn():
        counter.add_(1)

    samples = time_graph_replay(fn, iters=5, warmup=2, replays_per_sample=3)
    assert len(samples) == 5 and all(sample > 0 for sample in samples)
    # 2 eager warm-up calls before capture (capture itself runs nothing),
    # 2 x 3 warm-up replays, 5 x 3 timed replays.
    assert counter.item() == 2 + 2 * 3 + 5 * 3


def test_graph_replay_times_per_replay():
    fn, _ = matmul_chain(1)
    single = time_graph_replay(fn, iters=20, warmup=3)
    batched = time_graph_replay(fn, iters=10, warmup=3, replays_per_sample=4)
    assert min(single) >= floor_us(1) and min(batched) >= floor_us(1)
    assert 0.5 < statistics.median(batched) / statistics.median(single) < 2.0


def test_graph_replay_removes_launch_gaps():
    x = torch.randn(1024, device="cuda")

    def many_small_kernels():
        for _ in range(100):
            x.mul_(1.0001)

    eager = statistics.median(time_fn(many_small_kernels, iters=20, warmup=3, device="cuda"))
    graph = statistics.median(time_graph_replay(many_small_kernels, iters=20, warmup=3))
    assert graph < eager


def test_queue_timed_keeps_the_hosts_launch_time_out():
    """A call whose host side takes 200 µs before a short kernel: events around eager calls
    time the host; queued behind a sleep, the same events time the kernel alone."""
    x = torch.randn(1024, device="cuda")

    def slow_host_short_kernel():
        time.sleep(200e-6)
        x.mul_(1.0001)

    eager = statistics.median(time_fn(slow_host_short_kernel, iters=20, warmup=3, device="cuda"))
    read = queue_timed(slow_host_short_kernel, iters=20, warmup=3, device="cuda", queue_ahead_us=1000.0)
    queued = statistics.median(read()[0])
    assert eager > 150.0 and queued < 50.0, (eager, queued)


def test_queue_timed_times_each_fn_of_an_iteration():
    one, _ = matmul_chain(1)
    four, _ = matmul_chain(4)
    written = []
    samples = queue_timed([one, four], iters=10, warmup=2, device="cuda", before_each=lambda: written.append(1))()
    assert [len(s) for s in samples] == [10, 10] and len(written) == 12
    assert min(samples[0]) >= floor_us(1) and min(samples[1]) >= floor_us(4)
    assert statistics.median(samples[1]) > 2.5 * statistics.median(samples[0])


def test_ceilings_are_below_the_floor_rates():
    """HBM GB/s and matmul TFLOP/s: positive, and no faster than any current GPU can be."""
    c = measure_ceilings(torch.device("cuda"), torch.bfloat16, 256 << 20, 4096, iters=5, warmup=2)
    assert 100.0 < c["hbm_gbps"] < 20_000.0 and 10.0 < c["matmul_tflops"] < FLOOR_FLOPS_PER_S / 1e12


def test_capture_of_a_host_sync_fails_clearly():
    # In a fresh process: a failed capture can leave this process's CUDA state unusable.
    code = (
        "import torch\n"
        "from moekit.bench import capture_graph\n"
        "x = torch.ones(4, device='cuda')\n"
        "try:\n"
        "    capture_graph(lambda: x.sum().item(), warmup=1)\n"
        "except RuntimeError as error:\n"
        "    assert 'host syncs' in str(error), error\n"
        "    print('raised')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "raised" in done.stdout


def test_captured_graph_replays_new_inputs():
    x = torch.randn(64, device="cuda")
    y = torch.empty_like(x)

    def fn():
        torch.mul(x, 2.0, out=y)

    graph = capture_graph(fn)
    fresh = torch.randn(64, device="cuda")
    x.copy_(fresh)
    y.fill_(float("nan"))  # so an unwritten output cannot pass
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, fresh * 2.0)


def test_phase_timer_cuda():
    fn, (a, _, _) = matmul_chain(2)
    staging = torch.empty_like(a)
    timer = PhaseTimer(device="cuda")
    for iteration in range(6):
        if iteration == 2:
            timer.reset()
        with timer.phase("copy"):
            staging.copy_(a)
        with timer.phase("matmul"):
            fn()
    results = timer.results()
    assert list(results) == ["copy", "matmul"]
    assert len(results["copy"]) == len(results["matmul"]) == 4
    assert min(results["matmul"]) >= floor_us(2)
    assert statistics.median(results["matmul"]) > statistics.median(results["copy"])


def test_environment_names_the_gpus(tmp_path):
    env = environment()
    assert env["gpu_count"] == torch.cuda.device_count()
    assert env["device"] == torch.cuda.get_device_name(0)
    assert env["cuda"] == torch.version.cuda
    path = write_record("gpu-test", {}, {}, out_dir=tmp_path)
    slug = re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")
    assert path.name.startswith(f"gpu-test-{slug}-{env['gpu_count']}x-")


# ----------------------------------------------------------------------- NCCL, 2 GPUs

WORLD = 2


def _nccl_rank_main(rank: int, world_size: int) -> dict:
    compute, _ = matmul_chain(8)
    payload = torch.randn(1 << 20, device="cuda")

    def fn():
        if rank == 1:
            compute()  # rank 1 is late to the all-reduce
        dist.all_reduce(payload)

    times = time_distributed(fn, iters=10, warmup=3)
    return {"max_us": times.max_us, "per_rank_us": times.per_rank_us}


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD, reason="needs 2 GPUs"
)
def test_time_distributed_nccl():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
    results = launch(_nccl_rank_main, WORLD, backend="nccl")
    assert results[0] == results[1]
    per_rank = results[0]["per_rank_us"]
    assert results[0]["max_us"] == [max(column) for column in zip(*per_rank)]
    # Both ranks start together, so rank 0's all-reduce waits out rank 1's products.
    assert min(per_rank[1]) >= floor_us(8)
    assert statistics.median(per_rank[0]) >= floor_us(8) / 2
