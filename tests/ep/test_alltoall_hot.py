"""The eager all-to-all's hot path (moekit.ep.alltoall + moekit.ep.pack) on 2 and 4 gloo ranks.

* The Triton kernels (interpreted on the CPU) against the torch path, bitwise, and both
  against the loop references: the received rows and handle (``expected_dispatch``) and the
  combine of position-dependent expert outputs (``reference_slot_sum`` / ``weighted_rank_sum``
  of the same outputs, token by token), in both combine orders, float32 and float16, on
  random routings with masked slots, duplicates, empty ranks and a hidden size whose rows
  are not a multiple of 4 bytes.
* Host reads: ``Tensor.item`` / ``tolist`` / ``cpu`` are counted in dispatch (at most one)
  and raise inside combine.
* Buffers: the same storage across two calls of the same size; a larger step grows them once.
* The full input check runs when the inputs' shapes change, not per call, and a bad input
  after a run of good steps still fails every rank together.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from moekit.ep import AllToAllDispatcher, weighted_rank_sum
from moekit.ep.reference import expected_dispatch
from moekit.moe.reference import reference_slot_sum
from tests.ep.deadline import run_ranks

ORDERS = ("slot", "rank")
DTYPES = (torch.float32, torch.float16)
HIDDEN = {torch.float32: 24, torch.float16: 13}  # 13 half words: rows of 26 bytes, copied as int16
STEPS = 3  # routings per (order, dtype), on one dispatcher


def routing(world_size: int, step: int, dtype: torch.dtype):
    """Every rank's (x, topk_ids, topk_weights) of one step: random T (rank 1 sometimes none),
    K = 3 of E = 4 * P with masked slots and repeated experts, x and weights random."""
    g = torch.Generator().manual_seed(1000 * world_size + 17 * step + (dtype == torch.float16))
    E, K, H = 4 * world_size, 3, HIDDEN[dtype]
    xs, ids, ws = [], [], []
    for rank in range(world_size):
        T = 0 if (rank == 1 and step == 1) else int(torch.randint(1, 12, (1,), generator=g))
        i = torch.randint(0, E, (T, K), generator=g)
        if step == 2:  # skew: most slots to the experts of rank 0
            i = torch.where(torch.rand(T, K, generator=g) < 0.7, i % 4, i)
        i = torch.where(torch.rand(T, K, generator=g) < 0.2, torch.full_like(i, -1), i)
        xs.append(torch.randn(T, H, generator=g).to(dtype))
        ids.append(i)
        ws.append(torch.rand(T, K, generator=g).to(dtype))
    return xs, ids, ws, E


def expert_fn(rows: torch.Tensor, expert: int) -> torch.Tensor:
    return (rows.float() * (0.5 + expert) - 0.125 * expert).to(rows.dtype)


def expert_outputs(dispatched, rank: int) -> torch.Tensor:
    """expert_fn of every received row, NaN past ``counts`` (combine must never read those)."""
    tokens = dispatched.tokens
    E_local, cap = tokens.shape[:2]
    out = torch.stack([expert_fn(tokens[e], rank * E_local + e) for e in range(E_local)])
    valid = torch.arange(cap).unsqueeze(0) < dispatched.counts.unsqueeze(1)
    return torch.where(valid.unsqueeze(2), out, torch.full_like(out, float("nan")))


def reference_combine(x, ids, w, dtype, order, E, world_size):
    T, K = ids.shape
    slot_out = torch.zeros(T, K, x.shape[1], dtype=dtype)
    for t in range(T):
        for k in range(K):
            if int(ids[t, k]) >= 0:
                slot_out[t, k] = expert_fn(x[t:t + 1], int(ids[t, k]))[0]
    if order == "rank":
        return weighted_rank_sum(slot_out, ids, w, dtype, num_experts=E, world_size=world_size)
    return reference_slot_sum(slot_out, ids, w, dtype)


# -- Triton vs torch vs reference ------------------------------------------------------------


def _paths_worker(rank: int, world_size: int) -> dict:
    from moekit.ep import pack

    assert pack.kernels_interpreted(), "TRITON_INTERPRET=1 must be set before moekit.ep.pack is imported"
    out = {}
    for triton_path in (False, True):
        pack.CPU_TRITON = triton_path
        for order in ORDERS:
            for dtype in DTYPES:
                E = 4 * world_size
                d = AllToAllDispatcher(E, combine_order=order)
                for step in range(STEPS):
                    xs, ids, ws, _ = routing(world_size, step, dtype)
                    dispatched = d.dispatch(xs[rank], ids[rank], ws[rank])
                    y = d.combine(expert_outputs(dispatched, rank), dispatched)
                    h = dispatched.handle
                    out[(triton_path, order, str(dtype), step)] = dict(
                        tokens=dispatched.tokens.clone(), counts=dispatched.counts.clone(), y=y,
                        src_rank=h.src_rank.clone(), src_token=h.src_token.clone(), src_slot=h.src_slot.clone())
    pack.CPU_TRITON = False
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_triton_kernels_match_torch_path_and_reference(world_size, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by the ranks when they import the kernels
    results, _ = run_ranks(_paths_worker, world_size, deadline=900, timeout=300)
    for order in ORDERS:
        for dtype in DTYPES:
            for step in range(STEPS):
                xs, ids, ws, E = routing(world_size, step, dtype)
                for rank in range(world_size):
                    where = (order, dtype, step, rank)
                    torch_run = results[rank][(False, order, str(dtype), step)]
                    triton_run = results[rank][(True, order, str(dtype), step)]
                    for key, value in torch_run.items():  # every tensor, padding included
                        assert torch.equal(triton_run[key], value), (key,) + where
                    for e, want in enumerate(expected_dispatch(xs, ids, E, rank)):
                        n = int(torch_run["counts"][e])
                        assert n == want["tokens"].shape[0], where
                        assert torch.equal(torch_run["tokens"][e, :n], want["tokens"]), where
                        for key in ("src_rank", "src_token", "src_slot"):
                            assert torch.equal(torch_run[key][e, :n], want[key]), (key,) + where
                            assert bool((torch_run[key][e, n:] == -1).all()), (key,) + where
                    want_y = reference_combine(xs[rank], ids[rank], ws[rank], dtype, order, E, world_size)
                    assert torch.equal(torch_run["y"], want_y), where


def _weighted_row_sum_worker(rank: int, world_size: int) -> dict:
    """The reduction kernel alone on random tables (absent entries, NaN in unread rows)."""
    from moekit.ep import pack

    g = torch.Generator().manual_seed(rank)
    out = {}
    for dtype in DTYPES:
        src = torch.randn(40, 37, generator=g).to(dtype)
        src[::7] = float("nan")  # rows only absent entries name
        index = torch.randint(0, 40, (9, 5), generator=g)
        index = torch.where((index % 7 == 0) | (torch.rand(9, 5, generator=g) < 0.3), -1, index)
        weights = torch.rand(9, 5, generator=g).to(dtype)
        out_row = torch.randperm(12, generator=g)[:9]
        got = {}
        for triton_path in (False, True):
            pack.CPU_TRITON = triton_path
            a = pack.weighted_row_sum(src, index, weights, torch.zeros(9, 37, dtype=dtype))
            b = pack.weighted_row_sum(src, index, None, torch.zeros(12, 37, dtype=dtype), out_row=out_row)
            got[triton_path] = (a, b)
        pack.CPU_TRITON = False
        # the definition: float32 products, slot order, absent entries skipped, rounded once
        want = torch.zeros(9, 37)
        for j in range(5):
            for m in range(9):
                if index[m, j] >= 0:
                    want[m] = want[m] + src[index[m, j]].float() * weights[m, j].float()
        out[str(dtype)] = (got, want.to(dtype))
    return out


def test_weighted_row_sum_kernel(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    results, _ = run_ranks(_weighted_row_sum_worker, 2, deadline=600, timeout=300)
    for per_rank in results:
        for (got, want) in per_rank.values():
            assert torch.equal(got[False][0], want) and torch.equal(got[True][0], want)
            assert torch.equal(got[True][1], got[False][1])
            assert not got[True][1].isnan().any()


# -- host reads, buffers, the input check ----------------------------------------------------


@contextlib.contextmanager
def host_reads(counter: list[int] | None):
    """Count ``item`` / ``tolist`` / ``cpu`` calls on tensors into ``counter``; with None,
    make them raise."""
    saved = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "cpu")}

    def wrap(name):
        def read(self, *args, **kwargs):
            if counter is None:
                raise AssertionError(f"combine read a tensor on the host (Tensor.{name})")
            counter[0] += 1
            return saved[name](self, *args, **kwargs)
        return read

    for name in saved:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _host_worker(rank: int, world_size: int) -> dict:
    from moekit.ep.agreement import StepCheck

    out = {"reads": [], "same_storage": [], "grew": [], "inspections": {}, "errors": []}
    inspections = [0]
    inspect = StepCheck.inspect

    def counted(self, *args, **kwargs):
        inspections[0] += 1
        return inspect(self, *args, **kwargs)

    StepCheck.inspect = counted
    for order in ORDERS:
        E = 4 * world_size
        d = AllToAllDispatcher(E, combine_order=order)
        xs, ids, ws, _ = routing(world_size, 0, torch.float32)
        inspections[0] = 0
        pointers = []
        for step in range(3):  # the same inputs three times: same sizes every call
            reads = [0]
            with host_reads(reads):
                dispatched = d.dispatch(xs[rank], ids[rank], ws[rank])
            out["reads"].append(reads[0])
            with host_reads(None):
                y = d.combine(expert_outputs(dispatched, rank), dispatched)
            want = reference_combine(xs[rank], ids[rank], ws[rank], torch.float32, order, E, world_size)
            assert torch.equal(y, want), (order, step)
            pointers.append({k: v.data_ptr() for k, v in d._buffers._held.items()})
        out["inspections"][order] = inspections[0]
        out["same_storage"].append(pointers[0] == pointers[1] == pointers[2] and len(pointers[0]) >= 6)
        # Twice the tokens (same routing, repeated): the buffers grow once, then stay.
        big = [torch.cat([t, t]) for t in (xs[rank], ids[rank], ws[rank])]
        held = []
        for _ in range(2):
            dispatched = d.dispatch(*big)
            d.combine(dispatched.tokens, dispatched)
            held.append({k: v.data_ptr() for k, v in d._buffers._held.items()})
        out["grew"].append(held[0] == held[1] and all(held[0][k] != pointers[0][k] for k in ("send", "recv")))
        out["inspections"][order + " after a new T"] = inspections[0]
        # A bad expert id on the last rank after the cached steps: every rank raises together.
        bad = ids[rank].clone()
        if rank == world_size - 1 and bad.numel():
            bad[0, 0] = E + 5
        try:
            d.dispatch(xs[rank], bad, ws[rank])
        except ValueError as error:
            out["errors"].append(str(error))
        dispatched = d.dispatch(xs[rank], ids[rank], ws[rank])  # the next step pairs up normally
        y = d.combine(expert_outputs(dispatched, rank), dispatched)
        assert torch.equal(y, reference_combine(xs[rank], ids[rank], ws[rank], torch.float32, order, E, world_size))
    StepCheck.inspect = inspect
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_host_reads_buffers_and_checks(world_size):
    results, _ = run_ranks(_host_worker, world_size, deadline=600, timeout=120)
    last = world_size - 1
    for rank, out in enumerate(results):
        assert out["reads"] and all(n == 1 for n in out["reads"]), (rank, out["reads"])
        assert all(out["same_storage"]), rank
        assert all(out["grew"]), rank
        for order in ORDERS:
            assert out["inspections"][order] == 1, (rank, order, out["inspections"])  # first call only
            assert out["inspections"][order + " after a new T"] == 2, (rank, order, out["inspections"])
        assert len(out["errors"]) == 2, (rank, out["errors"])
        for text in out["errors"]:
            assert f"rank {last}: topk_ids must be in" in text and "every rank raises" in text, text
