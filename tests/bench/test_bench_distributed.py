"""time_distributed with two gloo ranks spawned on this machine (CPU only)."""

import json
import os
import socket
import statistics
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekit.bench.timing import time_distributed

WORLD = 2
SLOW_RANK_SLEEP_S = 0.003
ITERS = 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        token = torch.ones(8)

        def independent():
            # Only rank 1 is slow and nothing waits for it: rank 0's own times stay short.
            if rank == 1:
                time.sleep(SLOW_RANK_SLEEP_S)

        def collective():
            # Rank 0 waits inside the all-reduce for rank 1, which started at the same time.
            if rank == 1:
                time.sleep(SLOW_RANK_SLEEP_S)
            dist.all_reduce(token)

        results = {}
        for name, fn in (("independent", independent), ("collective", collective)):
            times = time_distributed(fn, iters=ITERS, warmup=2)
            results[name] = {"max_us": times.max_us, "per_rank_us": times.per_rank_us}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
            json.dump(results, file)
    finally:
        dist.destroy_process_group()


def run_ranks(out_dir, timeout_s: float = 60.0) -> None:
    """Spawn the ranks and wait; kill them (only them) if they hang."""
    context = mp.spawn(_rank_main, args=(free_port(), str(out_dir)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"ranks did not finish within {timeout_s} s")


def test_time_distributed_gloo_two_ranks(tmp_path):
    run_ranks(tmp_path)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert results[0] == results[1]  # every rank returns the same gathered numbers
    sleep_us = SLOW_RANK_SLEEP_S * 1e6

    independent = results[0]["independent"]
    per_rank = independent["per_rank_us"]
    assert len(per_rank) == WORLD and all(len(times) == ITERS for times in per_rank)
    assert independent["max_us"] == [max(column) for column in zip(*per_rank)]
    assert all(sample >= sleep_us for sample in per_rank[1])
    assert all(sample >= sleep_us for sample in independent["max_us"])

    # Aligned starts: rank 0's all-reduce waits for most of rank 1's sleep. (Only the
    # median is bounded, and loosely, since the two ranks leave the barrier a little apart.)
    collective = results[0]["collective"]
    assert statistics.median(collective["per_rank_us"][0]) >= sleep_us / 2
    assert all(sample >= sleep_us for sample in collective["max_us"])
