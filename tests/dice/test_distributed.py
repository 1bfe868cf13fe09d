"""The distributed DICE schedules on 2 and 4 gloo ranks against the staleness simulator, bitwise.

One launch per world size: on 2 ranks every case of ``cases.CASES`` (each schedule and option,
over the eager all-to-all and the low-latency layer's gloo transport, in-order and with the
asynchronous executor's worker thread), on 4 ranks (uneven batches, one rank empty) one case per
schedule kind and dispatcher (``ON_4_RANKS``). The simulator runs the same global batch on this
process. Both use batch-invariant arithmetic, so every latent of every step must be
bitwise equal, the step whose data each (step, layer) used must be the plan's table, and
the rows sent to other ranks must be what the simulator counts.
"""

from __future__ import annotations

import pytest
import torch

from moekit.dice import ScheduledMoE, make_executor, sample
from moekit.ep import AllToAllDispatcher, EPLowLatencyAllToAll
from tests.dice.cases import (CASES, CFG_SCALE, CONFIG, STEPS, check_ranks_against_simulator, global_batch, rank_slice,
                              tiny_model)

WORLDS = {2: [3, 1], 4: [1, 2, 0, 1]}  # samples per rank; 4 in all, one rank empty
# Every case runs on 2 ranks. On 4 (uneven batches, one rank empty) the cases whose exchange
# differs: each schedule kind (sync, displaced, interweaved: in "dice" and "ll-interweaved-latest"),
# each dispatcher, in order and asynchronously; the options (warm-up, sync_every, layer sets,
# cond_every, scores) change the plan, which is the same at any rank count.
ON_4_RANKS = ["sync", "displaced", "dice", "ll-sync", "ll-interweaved-latest"]
CASES_OF = {2: list(CASES), 4: ON_4_RANKS}


def _dispatchers(kind: str, sizes: list[int]):
    shape = CONFIG.moe_shape
    if kind == "alltoall":
        return AllToAllDispatcher(shape.num_experts, hidden=shape.hidden, top_k=1), []
    # One low-latency layer per (layer, parity): its results live in buffers it reuses.
    max_m = max(2 * s * CONFIG.tokens_per_image * shape.top_k for s in sizes)
    pool = {(layer, parity): EPLowLatencyAllToAll(max_m, shape.hidden, 1, shape.num_experts, dtype=torch.float32,
                                                  online_fp8=False)
            for layer in range(CONFIG.depth) for parity in range(2)}
    return (lambda layer, parity: pool[(layer, parity)]), list(pool.values())


def _worker(rank, world_size, sizes, names):
    torch.set_num_threads(1)
    model = tiny_model()
    weights = model.moe_weights()
    noise, labels = global_batch(sizes)
    mine = rank_slice(sizes, rank)
    out = {}
    for name in names:
        schedule, kind, executor = CASES[name]
        dispatcher, owned = _dispatchers(kind, sizes)
        runner = ScheduledMoE(weights, CONFIG.moe_shape, schedule, STEPS, dispatcher=dispatcher,
                              executor=make_executor(executor), experts="rowwise", batch_invariant=True)
        steps = []
        sample(model, noise[mine], labels[mine], steps=STEPS, cfg_scale=CFG_SCALE, moe=runner,
               on_step=lambda i, z: steps.append(z.clone()))
        runner.close()
        for layer in owned:
            layer.finalize()
        out[name] = dict(traj=torch.stack(steps), stats=runner.stats())
    return out


# One launch per world size, shared with the other multi-rank tests (tests/rank_pool.py).
@pytest.mark.ranks(lambda world_size: (_worker, WORLDS[world_size], CASES_OF[world_size]))
@pytest.mark.parametrize("world_size", sorted(WORLDS))
def test_schedules_match_the_simulator_bitwise(world_size, one_thread, pooled_launch):
    sizes = WORLDS[world_size]
    results = pooled_launch()
    model = tiny_model()
    noise, labels = global_batch(sizes)
    simulated = {name: check_ranks_against_simulator(results, name, CASES[name][0], sizes, model, noise, labels)
                 for name in CASES_OF[world_size]}
    assert torch.equal(simulated["sync"], simulated["ll-sync"])
    if world_size == 4:
        assert not torch.equal(simulated["dice"], simulated["sync"])
        return
    # The asynchronous schedules really use other data than sync (the equalities above are not vacuous),
    # and the options really change the result.
    sync = simulated["sync"]
    for name in ("displaced", "interweaved", "dice", "displaced-cond2-latest", "interweaved-latest", "interweaved-cond3"):
        assert not torch.equal(simulated[name], sync), name
    assert not torch.equal(simulated["interweaved"], simulated["interweaved-latest"])
    assert not torch.equal(simulated["interweaved"], simulated["interweaved-cond3"])
    assert torch.equal(simulated["interweaved"], simulated["interweaved-cond1"])  # n = 1 sends every slot
