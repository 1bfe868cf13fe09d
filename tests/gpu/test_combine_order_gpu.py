"""The rank combine order and the bounded receive buffers on GPUs.

Run now (one GPU, or two with NCCL):

1. MaxCounts and Cap-and-Spill with ``combine_order="rank"``, dispatch + expert + combine
   captured in one CUDA graph and replayed with new routing written into the same input
   tensors (the steps of tests/ep/test_capspill.py): every replay bitwise equal to the eager
   ``AllToAllDispatcher(combine_order="rank")`` and to ``weighted_rank_sum`` of the slot
   outputs, computed on the token's own GPU. One GPU (no process group) and two (NCCL).
2. ``AllToAllDispatcher(combine_order="rank")`` on two GPUs over the adversarial routings of
   the conformance test (tests/ep/cases.py), bf16 and fp32, against ``weighted_rank_sum``.
3. ``EPLowLatencyAllToAll(combine_order="rank")`` on two GPUs (the symmetric-memory kernels'
   rank order), eager over every routing kind and 200 graph replays with new routing, bitwise
   ``weighted_rank_sum`` of the loop reference's slot outputs and equal to a second layer.
4. ``EPLowLatencyAllToAll(recv_capacity=1, spill_rows=1)`` (forced overflow) and
   ``recv_capacity=4``, eager and graph-replayed, bitwise equal to the worst-case layout.
"""

from __future__ import annotations

import os

import pytest
import torch

from moekit.bench.timing import capture_graph
from moekit.ep.lowlatency.layout import bits_view
from moekit.ep import (AllToAllDispatcher, CapAndSpillDispatcher, EPLowLatencyAllToAll, MaxCountsDispatcher,
                       current_device, launch, weighted_rank_sum)
from tests.ep.cases import ADVERSARIAL_CASES, build_case
from tests.ep.test_capspill import K, NUM_STEPS, T_MAX, capspill_steps, compare, expert_outputs, num_experts
from tests.gpu.test_capspill_graph import StaticInputs, _round_trip

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


def _setup_env() -> None:
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)  # never NVLink multicast (inherited by the ranks)


# -- 1. fixed-buffer dispatchers in the rank order, captured -----------------------------------


def _reference(inputs: StaticInputs, E: int, world_size: int) -> torch.Tensor:
    """``weighted_rank_sum`` of the slot outputs of ``expert_outputs`` (3x - 1 of the token,
    whatever the expert), computed on this rank's own tensors."""
    slot_out = (inputs.x * 3 - 1).unsqueeze(1).expand(-1, K, -1)
    return weighted_rank_sum(slot_out, inputs.ids, inputs.w, inputs.x.dtype, num_experts=E, world_size=world_size)


def _rank_order_graphs(rank: int, world_size: int, dtype_name: str) -> dict:
    device = current_device() if world_size > 1 else torch.device("cuda", 0)
    dtype = getattr(torch, dtype_name)
    steps = capspill_steps(world_size)
    E = num_experts(world_size)
    inputs = StaticInputs(device, dtype)
    _, _, xs, ids, ws = steps[0]
    inputs.write(xs[rank].to(device, dtype), ids[rank].to(device), ws[rank].to(device))
    graphs = {}
    for name, d in [("maxcounts", MaxCountsDispatcher(E, T_MAX * K, T_MAX, top_k=K, combine_order="rank"))] + [
            (f"capspill(C={C})", CapAndSpillDispatcher(E, C, T_MAX, top_k=K, combine_order="rank"))
            for C in (0, 1, 3)]:
        out = {}
        graphs[name] = (capture_graph(_round_trip(d, inputs, out)).replay, out)
    eager = AllToAllDispatcher(E, combine_order="rank")
    mismatches = []
    for i, (_, _, xs, ids, ws) in enumerate(steps):
        inputs.write(xs[rank].to(device, dtype), ids[rank].to(device), ws[rank].to(device))
        want = eager.dispatch(inputs.x, inputs.ids, inputs.w)
        y_want = eager.combine(expert_outputs(want), want)
        if not torch.equal(y_want, _reference(inputs, E, world_size)):
            mismatches.append(f"eager alltoall step {i}: differs from weighted_rank_sum")
        for name, (replay, out) in graphs.items():
            replay()
            mismatches += compare(f"{name}[rank]", i, out["d"], want, out["y"], y_want)
    return dict(mismatches=mismatches, steps=len(steps))


@needs_cuda
def test_rank_order_graphs_on_one_gpu():
    """P = 1 (no process group): the captured partial sums and rank sum alone."""
    result = _rank_order_graphs(0, 1, "bfloat16")
    assert result["mismatches"] == [], result["mismatches"][:10]
    assert result["steps"] == NUM_STEPS


@needs_two_gpus
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_rank_order_graphs_on_two_gpus(dtype_name):
    _setup_env()
    for result in launch(_rank_order_graphs, 2, dtype_name, backend="nccl"):
        assert result["mismatches"] == [], result["mismatches"][:10]


# -- 2. the eager all-to-all in the rank order, adversarial routings -----------------------------


def _alltoall_cases(rank: int, world_size: int) -> list[str]:
    from tests.ep.test_dispatcher_contract import expert_fn

    device = current_device()
    bad = []
    for dtype in (torch.bfloat16, torch.float32):
        for case in ADVERSARIAL_CASES:
            xs, ids, ws, E = build_case(case, world_size, 5, dtype=dtype)
            d = AllToAllDispatcher(E, combine_order="rank")
            got = d.dispatch(xs[rank].to(device), ids[rank].to(device), ws[rank].to(device))
            E_local = got.tokens.shape[0]
            out = torch.stack([expert_fn(got.tokens[e], rank * E_local + e) for e in range(E_local)])
            y = d.combine(out, got).cpu()
            T, K_ = ids[rank].shape
            slot_out = torch.zeros(T, K_, xs[rank].shape[1], dtype=dtype)
            for t in range(T):
                for k in range(K_):
                    if int(ids[rank][t, k]) >= 0:
                        slot_out[t, k] = expert_fn(xs[rank][t:t + 1], int(ids[rank][t, k]))[0]
            want = weighted_rank_sum(slot_out, ids[rank], ws[rank], dtype, num_experts=E, world_size=world_size)
            if not torch.equal(y, want):
                bad.append(f"{case} {dtype}: combine differs from weighted_rank_sum")
    return bad


@needs_two_gpus
def test_alltoall_rank_order_on_two_gpus():
    _setup_env()
    for failures in launch(_alltoall_cases, 2, backend="nccl"):
        assert failures == [], failures[:10]


# -- 3, 4. the symmetric-memory kernels ---------------------------------------------------------------

LL_M, LL_H, LL_K, LL_E, LL_G = 8, 256, 4, 16, 128


def _lowlatency_variant(rank: int, world_size: int, kwargs: dict, graph_steps: int) -> list[str]:
    """Eager steps over every routing kind, then ``graph_steps`` replays of one captured step
    with new routing: each bitwise against the reference (rank order) or the worst-case
    layout (bounded: its expert-major tokens and scales too, and some step must spill)."""
    from tests.ep.lowlatency.reference import KINDS, expected_combine, fake_expert_outputs, routing_steps

    device = current_device()
    kwargs = dict(kwargs)
    fp8 = kwargs.pop("online_fp8", False)
    order = kwargs.get("combine_order", "slot")
    layer = EPLowLatencyAllToAll(LL_M, LL_H, LL_K, LL_E, fp8_group_size=LL_G, dtype=torch.bfloat16,
                                 online_fp8=fp8, **kwargs)
    full = EPLowLatencyAllToAll(LL_M, LL_H, LL_K, LL_E, fp8_group_size=LL_G, dtype=torch.bfloat16,
                                online_fp8=fp8, combine_order=order)
    steps = routing_steps(world_size, 2 * len(KINDS) + graph_steps, max_m=LL_M, num_experts=LL_E, topk=LL_K,
                          hidden=LL_H, seed=3, dtype=torch.bfloat16)
    bad, rounds = [], []

    def combine(which, d):
        out = fake_expert_outputs(d.tokens, d.scales, d.counts, d.meta.src_rank, d.meta.src_token, rank,
                                  torch.bfloat16, LL_G, use_content=not fp8)
        return which.combine(out, d)

    def run(which, x, ids, w):
        return combine(which, which.dispatch(x, ids, w))

    def same_tokens(d, d_full) -> bool:
        if not torch.equal(d.counts, d_full.counts):
            return False
        for e, c in enumerate(d.counts.tolist()):
            if not torch.equal(bits_view(d.tokens[e, :c]), bits_view(d_full.tokens[e, :c])):
                return False
            if fp8 and not torch.equal(d.scales[e, :c], d_full.scales[e, :c]):
                return False
        return True

    for i, (kind, xs, ids, ws) in enumerate(steps[:2 * len(KINDS)]):
        args = (xs[rank].to(device), ids[rank].to(device), ws[rank].to(device))
        d, d_full = layer.dispatch(*args), full.dispatch(*args)
        if "recv_capacity" in kwargs:
            rounds.append(int(d.handle.state["spill_rounds"]))
        if not same_tokens(d, d_full):
            bad.append(f"eager step {i} ({kind}): expert-major tokens differ from the worst-case layout")
        y, y_full = combine(layer, d).cpu(), combine(full, d_full).cpu()
        want = expected_combine(xs, ids, ws, LL_E, rank, fp8=fp8, group=LL_G, dtype=torch.bfloat16,
                                combine_order=order, use_content=not fp8)
        if not torch.equal(y, want) or not torch.equal(y, y_full):
            bad.append(f"eager step {i} ({kind}): differs")
    x = torch.zeros(LL_M, LL_H, dtype=torch.bfloat16, device=device)
    ids = torch.full((LL_M, LL_K), -1, dtype=torch.int64, device=device)
    w = torch.zeros(LL_M, LL_K, device=device)
    held = {}
    graph = capture_graph(lambda: held.update(y=run(layer, x, ids, w)))
    for i, (kind, xs, ids_s, ws) in enumerate(steps[2 * len(KINDS):]):
        T = xs[rank].shape[0]
        x.zero_()
        ids.fill_(-1)
        w.zero_()
        x[:T].copy_(xs[rank])
        ids[:T].copy_(ids_s[rank])
        w[:T].copy_(ws[rank])
        graph.replay()
        padded = [torch.cat([xr, xr.new_zeros(LL_M - xr.shape[0], LL_H)]) for xr in xs]
        padded_ids = [torch.cat([ir, ir.new_full((LL_M - ir.shape[0], LL_K), -1)]) for ir in ids_s]
        padded_w = [torch.cat([wr, wr.new_zeros(LL_M - wr.shape[0], LL_K)]) for wr in ws]
        want = expected_combine(padded, padded_ids, padded_w, LL_E, rank, fp8=fp8, group=LL_G,
                                dtype=torch.bfloat16, combine_order=order, use_content=not fp8)
        if not torch.equal(held["y"].cpu(), want):
            bad.append(f"replay {i} ({kind}): differs")
    if "recv_capacity" in kwargs and not any(r > 0 for r in rounds):
        bad.append("no eager step spilled: the spill rounds were not exercised")
    layer.finalize()
    full.finalize()
    return bad


@needs_two_gpus
def test_lowlatency_rank_order_kernels():
    _setup_env()
    for failures in launch(_lowlatency_variant, 2, dict(combine_order="rank"), 200, backend="nccl"):
        assert failures == [], failures[:10]


@needs_two_gpus
@pytest.mark.parametrize("bounds", [dict(recv_capacity=1, spill_rows=1), dict(recv_capacity=4),
                                    dict(recv_capacity=2, spill_rows=3, combine_order="rank"),
                                    dict(recv_capacity=3, spill_rows=2, online_fp8=True)],
                         ids=["C=1,S=1", "C=4", "C=2,S=3,rank", "C=3,S=2,fp8"])
def test_lowlatency_bounded_kernels(bounds):
    _setup_env()
    for failures in launch(_lowlatency_variant, 2, bounds, 200, backend="nccl"):
        assert failures == [], failures[:10]
