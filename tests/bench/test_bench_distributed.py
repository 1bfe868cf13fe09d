"""time_distributed with two gloo ranks spawned on this machine (CPU only)."""

import statistics
import time

import pytest
import torch
import torch.distributed as dist

from moekit.bench.timing import time_distributed

WORLD = 2
SLOW_RANK_SLEEP_S = 0.003
ITERS = 6


def _rank_main(rank: int, world_size: int) -> dict:
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
    return results


# One launch, shared with the other 2-rank tests (tests/rank_pool.py).
@pytest.mark.ranks(lambda: (_rank_main,), world_size=WORLD)
def test_time_distributed_gloo_two_ranks(pooled_launch):
    results = pooled_launch()
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
