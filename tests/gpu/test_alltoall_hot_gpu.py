"""The eager all-to-all's hot path over NCCL on 2 and 4 GPUs (the Triton kernels of
moekit.ep.pack): bitwise against the loop references in both combine orders, no host sync in
combine (``torch.cuda.set_sync_debug_mode("error")``), at most one in a dispatch (counted with
the "warn" mode), and the communication buffers reused across calls of the same size.

Shapes: deepseek-v3's (H 7168, top-8 of 256 experts, bf16, 128 tokens per rank) and a small
float32 one (H 24, rows of 96 bytes: several status rows per peer in combine), with masked
slots, repeated experts and a rank without tokens.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from moekit.ep import AllToAllDispatcher, current_device, launch, weighted_rank_sum
from moekit.ep.reference import expected_dispatch
from moekit.moe.reference import reference_slot_sum

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)

# name: (H, K, E, T per rank, dtype)
SHAPES = {"deepseek-v3": (7168, 8, 256, 128, torch.bfloat16), "small": (24, 3, 16, 40, torch.float32)}
STEPS = 3
ORDERS = ("slot", "rank")


def routing(shape: str, world_size: int, step: int):
    H, K, E, T, dtype = SHAPES[shape]
    g = torch.Generator().manual_seed(7919 * world_size + 31 * step + len(shape))
    xs, ids, ws = [], [], []
    for rank in range(world_size):
        n = 0 if (rank == 1 and step == 1) else T - int(torch.randint(0, T // 4, (1,), generator=g))
        i = torch.randint(0, E, (n, K), generator=g)
        if step == 2:  # skewed: most slots on the experts of rank 0
            i = torch.where(torch.rand(n, K, generator=g) < 0.6, i % (E // world_size), i)
        i = torch.where(torch.rand(n, K, generator=g) < 0.1, torch.full_like(i, -1), i)
        xs.append(torch.randn(n, H, generator=g).to(dtype))
        ids.append(i)
        ws.append(torch.rand(n, K, generator=g).to(dtype))
    return xs, ids, ws, E


def expert_fn(rows: torch.Tensor, expert: int) -> torch.Tensor:
    return (rows.float() * (0.5 + expert) - 0.125 * expert).to(rows.dtype)


def expert_outputs(dispatched, rank: int) -> torch.Tensor:
    tokens = dispatched.tokens
    E_local, cap = tokens.shape[:2]
    e = torch.arange(E_local, device=tokens.device).view(E_local, 1, 1) + rank * E_local
    out = (tokens.float() * (0.5 + e) - 0.125 * e).to(tokens.dtype)  # expert_fn, every expert at once
    valid = torch.arange(cap, device=tokens.device).unsqueeze(0) < dispatched.counts.unsqueeze(1)
    return torch.where(valid.unsqueeze(2), out, torch.full_like(out, float("nan")))


def reference_combine(x, ids, w, dtype, order, E, world_size):
    T, K = ids.shape
    slot_out = torch.zeros(T, K, x.shape[1], dtype=dtype)
    for k in range(K):
        for t in range(T):
            if int(ids[t, k]) >= 0:
                slot_out[t, k] = expert_fn(x[t:t + 1], int(ids[t, k]))[0]
    if order == "rank":
        return weighted_rank_sum(slot_out, ids, w, dtype, num_experts=E, world_size=world_size)
    return reference_slot_sum(slot_out, ids, w, dtype)


def _worker(rank: int, world_size: int) -> dict:
    device = current_device()
    out = {}
    for shape in SHAPES:
        for order in ORDERS:
            E = SHAPES[shape][2]
            d = AllToAllDispatcher(E, combine_order=order)
            syncs, pointers = [], []
            for step in range(STEPS):
                xs, ids, ws, _ = routing(shape, world_size, step)
                x, i, w = (t[rank].to(device) for t in (xs, ids, ws))
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        dispatched = d.dispatch(x, i, w)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                # torch's sync-debug warnings ("called a synchronizing CUDA operation"), not its
                # note that the debug mode is a prototype
                syncs.append(sum("called a synchronizing" in str(c.message) for c in caught))
                expert_out = expert_outputs(dispatched, rank)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")  # any host sync in combine raises
                try:
                    y = d.combine(expert_out, dispatched)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                h = dispatched.handle
                out[(shape, order, step)] = dict(tokens=dispatched.tokens.cpu(), counts=dispatched.counts.cpu(),
                                                 src_rank=h.src_rank.cpu(), src_token=h.src_token.cpu(),
                                                 src_slot=h.src_slot.cpu(), y=y.cpu())
                pointers.append({k: v.data_ptr() for k, v in d._buffers._held.items()})
            # the same step again: every buffer keeps its storage
            xs, ids, ws, _ = routing(shape, world_size, STEPS - 1)
            again = d.dispatch(*(t[rank].to(device) for t in (xs, ids, ws)))
            d.combine(again.tokens, again)
            out[(shape, order, "buffers")] = (pointers[-1] == {k: v.data_ptr() for k, v in d._buffers._held.items()})
            out[(shape, order, "syncs")] = syncs
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_hot_path_bitwise_and_sync_free_combine(world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA GPUs")
    results = launch(_worker, world_size, backend="nccl")
    for shape in SHAPES:
        dtype = SHAPES[shape][4]
        for order in ORDERS:
            for rank in range(world_size):
                assert results[rank][(shape, order, "buffers")], (shape, order, rank)
                # one host read per dispatch, the first included
                assert all(n <= 1 for n in results[rank][(shape, order, "syncs")]), results[rank][(shape, order,
                                                                                                   "syncs")]
            for step in range(STEPS):
                xs, ids, ws, E = routing(shape, world_size, step)
                for rank in range(world_size):
                    got = results[rank][(shape, order, step)]
                    where = (shape, order, step, rank)
                    for e, want in enumerate(expected_dispatch(xs, ids, E, rank)):
                        n = int(got["counts"][e])
                        assert n == want["tokens"].shape[0], where
                        assert torch.equal(got["tokens"][e, :n], want["tokens"]), where
                        for key in ("src_rank", "src_token", "src_slot"):
                            assert torch.equal(got[key][e, :n], want[key]), (key,) + where
                            assert bool((got[key][e, n:] == -1).all()), (key,) + where
                    want_y = reference_combine(xs[rank], ids[rank], ws[rank], dtype, order, E, world_size)
                    assert torch.equal(got["y"], want_y), where
