"""The eager all-to-all's hot path (moekit.ep.alltoall + moekit.ep.pack) on 2 and 4 gloo ranks.

* The Triton kernels (interpreted on the CPU) against the torch path, bitwise on every
  tensor (padding included), and both against the loop references: the received rows and
  handle (``expected_dispatch``) and the combine of position-dependent expert outputs
  (``reference_slot_sum`` / ``weighted_rank_sum`` of the same outputs, token by token), in
  both combine orders, float32 and float16, on random routings with masked slots, a repeated
  expert, skew, a rank without tokens, a rank whose slots are all masked, and steps where no
  token moves at all; the float16 rows (26 bytes) are not a multiple of 4 bytes.
* Empty steps in a single process (T = 0, every slot masked, one expert): both paths, both
  orders, bitwise against the reference.
* Host reads: ``Tensor.item`` / ``tolist`` / ``cpu`` are counted in dispatch (at most one)
  and raise inside combine.
* Buffers: the same storage across calls of the same size; a larger step grows them once.
* The full input check runs when the inputs' shapes change, not per call, and a bad input
  after a run of good steps still fails every rank together.

The interpreter is slow per kernel program, so the shapes where the Triton path runs are
tiny; the multi-rank checks of each world size share one launch of ranks (``pooled_launch``,
tests/rank_pool.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from moekit.ep import AllToAllDispatcher, pack, weighted_rank_sum
from moekit.ep.reference import expected_dispatch
from moekit.moe.reference import reference_slot_sum

ORDERS = ("slot", "rank")
DTYPES = (torch.float32, torch.float16)
HIDDEN = {torch.float32: 6, torch.float16: 13}  # 13 half words: rows of 26 bytes, copied as int16
K = 2
# The routing kinds of ``routing``, run in turn on one dispatcher per combine order, each in
# one dtype: each dtype has a step that moves rows and an empty one, and the dispatcher sees
# its row width change from step to step.
STEP_DTYPES = (torch.float32, torch.float16, torch.float32, torch.float16)
STEPS = len(STEP_DTYPES)


def num_experts(world_size: int) -> int:
    return 2 * world_size


def triton_paths() -> tuple[bool, ...]:
    """The paths this process can compare: the Triton kernels run on CPU tensors only when
    interpreted (``TRITON_INTERPRET=1``, which tests/conftest.py sets without CUDA)."""
    interpreted = pack.kernels_interpreted()
    assert interpreted or torch.cuda.is_available(), "TRITON_INTERPRET=1 must be set before moekit.ep.pack is imported"
    return (False, True) if interpreted else (False,)


@contextlib.contextmanager
def kernel_path(triton_path: bool):
    """Run moekit.ep.pack's Triton kernels (interpreted) or its torch twins on CPU tensors."""
    saved = pack.CPU_TRITON
    pack.CPU_TRITON = triton_path
    try:
        yield
    finally:
        pack.CPU_TRITON = saved


def routing(world_size: int, step: int):
    """Every rank's (x, topk_ids, topk_weights) of one step, in ``STEP_DTYPES[step]``, x and
    weights random, K = 2 of E = 2 * P with 20% masked slots and token 0's two slots on one
    expert. Step 0: just that.
    Step 1: rank 1 has no tokens; most slots go to rank 0's experts. Step 2: rank 0's slots
    are all masked and the last rank has no tokens (with 2 ranks nothing moves; with 4 ranks
    0 sends nothing but receives). Step 3: every slot of every rank masked."""
    dtype = STEP_DTYPES[step]
    g = torch.Generator().manual_seed(1000 * world_size + 17 * step + (dtype == torch.float16))
    E, H = num_experts(world_size), HIDDEN[dtype]
    xs, ids, ws = [], [], []
    for rank in range(world_size):
        empty = (step == 1 and rank == 1) or (step == 2 and rank == world_size - 1)
        T = 0 if empty else int(torch.randint(1, 5, (1,), generator=g))
        i = torch.randint(0, E, (T, K), generator=g)
        if step == 1:  # skew: most slots to the experts of rank 0
            i = torch.where(torch.rand(T, K, generator=g) < 0.7, i % 2, i)
        i = torch.where(torch.rand(T, K, generator=g) < 0.2, torch.full_like(i, -1), i)
        if T:
            i[0, 1] = i[0, 0] = i[0, 0].clamp(min=0)  # a repeated expert
        if step == 3 or (step == 2 and rank == 0):
            i = torch.full_like(i, -1)
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
    T, K_ = ids.shape
    slot_out = torch.zeros(T, K_, x.shape[1], dtype=dtype)
    for t in range(T):
        for k in range(K_):
            if int(ids[t, k]) >= 0:
                slot_out[t, k] = expert_fn(x[t:t + 1], int(ids[t, k]))[0]
    if order == "rank":
        return weighted_rank_sum(slot_out, ids, w, dtype, num_experts=E, world_size=world_size)
    return reference_slot_sum(slot_out, ids, w, dtype)


def step_tensors(d: AllToAllDispatcher, x, ids, w, rank: int) -> dict:
    """One dispatch + combine: every tensor it produced (whole, padding included)."""
    dispatched = d.dispatch(x, ids, w)
    y = d.combine(expert_outputs(dispatched, rank), dispatched)
    h = dispatched.handle
    return dict(tokens=dispatched.tokens.clone(), counts=dispatched.counts.clone(), y=y,
                src_rank=h.src_rank.clone(), src_token=h.src_token.clone(), src_slot=h.src_slot.clone())


# -- Triton vs torch vs reference ------------------------------------------------------------


def _paths_worker(rank: int, world_size: int) -> dict:
    out = {}
    for triton_path in triton_paths():
        with kernel_path(triton_path):
            for order in ORDERS:
                d = AllToAllDispatcher(num_experts(world_size), combine_order=order)
                for step in range(STEPS):
                    xs, ids, ws, _ = routing(world_size, step)
                    out[(triton_path, order, step)] = step_tensors(d, xs[rank], ids[rank], ws[rank], rank)
    return out


@pytest.mark.ranks(lambda world_size: (_paths_worker,), deadline=300, timeout=120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_triton_kernels_match_torch_path_and_reference(world_size, pooled_launch):
    results = pooled_launch()
    compared = 0
    for order in ORDERS:
        for step, dtype in enumerate(STEP_DTYPES):
            xs, ids, ws, E = routing(world_size, step)
            for rank in range(world_size):
                where = (order, dtype, step, rank)
                torch_run = results[rank][(False, order, step)]
                triton_run = results[rank].get((True, order, step))
                if triton_run is not None:
                    compared += 1
                    assert triton_run.keys() == torch_run.keys(), where
                    for key, value in torch_run.items():  # every tensor, padding included
                        assert triton_run[key].dtype == value.dtype, (key,) + where
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
    assert compared or torch.cuda.is_available(), "the Triton path did not run"


@pytest.mark.parametrize("order", ORDERS)
def test_empty_steps_in_one_process_match_reference(order):
    """No valid pair anywhere: T = 0, every slot masked (down to T = E = K = 1), in a single
    process, where combine's receive buffer has no row at all; then a step with rows, on the
    same dispatcher. Both paths, bitwise against the reference and each other."""
    g = torch.Generator().manual_seed(5)
    cases = []  # (E, x, ids, w)
    for dtype in DTYPES:
        H = HIDDEN[dtype]
        for E, T, K_, masked in ((1, 1, 1, True), (3, 0, 2, True), (3, 4, 2, True), (3, 4, 2, False),
                                 (3, 0, 2, True)):
            x = torch.randn(T, H, generator=g).to(dtype)
            ids = torch.randint(0, E, (T, K_), generator=g)
            if masked:
                ids = torch.full_like(ids, -1)
            cases.append((E, x, ids, torch.rand(T, K_, generator=g).to(dtype)))
    runs = {}
    for triton_path in triton_paths():
        with kernel_path(triton_path):
            dispatchers = {}
            for i, (E, x, ids, w) in enumerate(cases):
                d = dispatchers.setdefault(E, AllToAllDispatcher(E, combine_order=order))
                runs[(triton_path, i)] = step_tensors(d, x, ids, w, 0)
    for i, (E, x, ids, w) in enumerate(cases):
        got = runs[(False, i)]
        if (True, i) in runs:
            for key, value in got.items():
                assert torch.equal(runs[(True, i)][key], value), (key, i)
        assert got["y"].shape == x.shape, i
        assert torch.equal(got["y"], reference_combine(x, ids, w, x.dtype, order, E, 1)), i
        for e, want in enumerate(expected_dispatch([x], [ids], E, 0)):
            n = int(got["counts"][e])
            assert n == want["tokens"].shape[0] and torch.equal(got["tokens"][e, :n], want["tokens"]), i


def test_weighted_row_sum_kernel():
    """The reduction kernel alone on random tables (absent entries, NaN in unread rows), and on
    tables with nothing present, from a source with and without rows."""
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        for dtype in DTYPES:
            src = torch.randn(40, 37, generator=g).to(dtype)
            src[::7] = float("nan")  # rows only absent entries name
            index = torch.randint(0, 40, (9, 5), generator=g)
            index = torch.where((index % 7 == 0) | (torch.rand(9, 5, generator=g) < 0.3), -1, index)
            weights = torch.rand(9, 5, generator=g).to(dtype)
            out_row = torch.randperm(12, generator=g)[:9]
            none = torch.full((3, 5), -1)
            fill = torch.randn(12, 37, generator=g).to(dtype)  # rows out_row does not name stay as they are
            got = {}
            for triton_path in triton_paths():
                with kernel_path(triton_path):
                    got[triton_path] = (
                        pack.weighted_row_sum(src, index, weights, torch.zeros(9, 37, dtype=dtype)),
                        pack.weighted_row_sum(src, index, None, fill.clone(), out_row=out_row),
                        pack.weighted_row_sum(src, none, weights[:3], fill[:3].clone()),
                        pack.weighted_row_sum(src[:0], none, None, fill.clone(), out_row=out_row[:3]),
                    )
            # the definition: float32 products, slot order, absent entries skipped, rounded once
            want = torch.zeros(9, 37)
            for j in range(5):
                for m in range(9):
                    if index[m, j] >= 0:
                        want[m] = want[m] + src[index[m, j]].float() * weights[m, j].float()
            kept = torch.ones(12, dtype=torch.bool)
            kept[out_row] = False
            for a, b, c, e in got.values():
                assert torch.equal(a, want.to(dtype))
                assert torch.equal(b, got[False][1]) and not b[out_row].isnan().any()
                assert torch.equal(b[kept], fill[kept])
                assert torch.equal(c, torch.zeros(3, 37, dtype=dtype))
                assert torch.equal(e[out_row[:3]], torch.zeros(3, 37, dtype=dtype))
                assert torch.equal(e, got[False][3])


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


def host_routing(world_size: int):
    """Every rank's inputs of the host-read checks (torch path, so not tiny): T = 6, random x
    and weights, ids cycling over every expert so that every rank sends and receives rows
    (the buffers must grow when T doubles), one slot masked."""
    g = torch.Generator().manual_seed(world_size)
    E, T = num_experts(world_size), 6
    xs, ids, ws = [], [], []
    for rank in range(world_size):
        i = (torch.arange(T * K).view(T, K) + rank) % E
        i[1, 1] = -1
        xs.append(torch.randn(T, HIDDEN[torch.float32], generator=g))
        ids.append(i)
        ws.append(torch.rand(T, K, generator=g))
    return xs, ids, ws, E


def _host_worker(rank: int, world_size: int) -> dict:
    from moekit.ep.agreement import StepCheck

    out = {"reads": [], "same_storage": [], "grew": [], "inspections": {}, "errors": []}
    inspections = [0]
    inspect = StepCheck.inspect

    def counted(self, *args, **kwargs):
        inspections[0] += 1
        return inspect(self, *args, **kwargs)

    StepCheck.inspect = counted  # restored below: the ranks run other tests' jobs after this one
    try:
        with kernel_path(False):
            for order in ORDERS:
                xs, ids, ws, E = host_routing(world_size)
                d = AllToAllDispatcher(E, combine_order=order)
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
    finally:
        StepCheck.inspect = inspect
    return out


@pytest.mark.ranks(lambda world_size: (_host_worker,), deadline=300, timeout=120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_host_reads_buffers_and_checks(world_size, pooled_launch):
    results = pooled_launch()
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
