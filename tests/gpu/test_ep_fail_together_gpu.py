"""Ranks fail together on CUDA: the step status built on the GPU, and the device flag of
the fixed-buffer dispatchers inside a real CUDA graph, checked by ``check_replay``.

One GPU: every dispatcher in one process (no process group). Two GPUs (NCCL): a bad id on
one rank inside a captured MaxCounts / Cap-and-Spill step makes ``check_replay`` raise
the same error on both ranks. The low-latency layer's symmetric-memory kernels carry the
step status and the masked-id flag to every rank: eagerly, a bad id, too many tokens or a
wrong dtype on one rank raise the same error on both ranks (the bad rank still takes part
with an empty step) and the next step is exact; under graph replay a bad id on one rank
makes ``check_replay`` raise the same error on both, in each combine order. A wrong
``expert_out`` on one rank in an eager NCCL combine: that rank raises at once, its status
reaches the other with the rows (no host read in combine), and both raise at the next
dispatch, whose host read carries it; the low-latency layer's bad rank sends NaN rows through
the symmetric-memory combine and its error with its next dispatch, where both raise. The CPU tests (tests/ep/test_fail_together.py) cover
the rest on gloo.
"""

from __future__ import annotations

import os

import pytest
import torch

from moekit.bench.timing import capture_graph
from moekit.ep import (AllToAllDispatcher, CapAndSpillDispatcher, EPLowLatencyAllToAll, MaxCountsDispatcher,
                       current_device, launch, weighted_rank_sum)
from moekit.moe.reference import reference_slot_sum

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

T_MAX, K, H = 8, 2, 64


def _inputs(T, E, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    w = torch.rand(T, K, generator=g)
    return x.to(device), ids.to(device), w.to(device)


def _identity_want(x, ids, w):
    T = x.shape[0]
    return reference_slot_sum(x.cpu().unsqueeze(1).expand(T, K, H), ids.cpu(), w.cpu(), x.dtype)


@needs_cuda
@pytest.mark.parametrize("kind", ["alltoall", "maxcounts", "capspill", "capspill-cond"])
def test_eager_status_on_one_gpu(kind):
    """Bad input raises the validation error; the dispatcher then runs a good step exactly."""
    device = torch.device("cuda", 0)
    E = 4
    d = {"alltoall": lambda: AllToAllDispatcher(E, max_tokens=T_MAX, hidden=H),
         "maxcounts": lambda: MaxCountsDispatcher(E, T_MAX * K, T_MAX, top_k=K, hidden=H),
         "capspill": lambda: CapAndSpillDispatcher(E, 1, T_MAX, top_k=K, hidden=H),
         "capspill-cond": lambda: CapAndSpillDispatcher(E, 1, T_MAX, top_k=K, hidden=H, conditional=True)}[kind]()
    x, ids, w = _inputs(T_MAX, E, 0, device)
    bad = ids.clone()
    bad[0, 0] = E
    with pytest.raises(ValueError, match=r"topk_ids must be in \[-1, 3\]"):
        d.dispatch(x, bad, w)
    with pytest.raises(ValueError, match="T=9 tokens"):
        d.dispatch(*_inputs(T_MAX + 1, E, 1, device))
    with pytest.raises(ValueError, match="x must be a 2-D tensor"):
        d.dispatch(x.tolist(), ids, w)
    dispatched = d.dispatch(x, ids, w)
    y = d.combine(dispatched.tokens.clone(), dispatched)
    assert torch.equal(y.cpu(), _identity_want(x, ids, w))


def _bad_expert_out(rank, world_size):
    """Rank 1 passes an expert_out of the wrong H to an eager combine, then both dispatch twice."""
    device = current_device()
    E = 2 * world_size
    out = {}
    for name, make in (("alltoall", lambda: AllToAllDispatcher(E, max_tokens=T_MAX, hidden=H)),
                       ("alltoall-rank", lambda: AllToAllDispatcher(E, max_tokens=T_MAX, hidden=H,
                                                                    combine_order="rank")),
                       ("maxcounts", lambda: MaxCountsDispatcher(E, T_MAX * K, T_MAX, top_k=K, hidden=H)),
                       ("capspill", lambda: CapAndSpillDispatcher(E, 1, T_MAX, top_k=K, hidden=H)),
                       ("lowlatency", lambda: EPLowLatencyAllToAll(T_MAX, H, K, E, online_fp8=False)),
                       ("lowlatency-rank", lambda: EPLowLatencyAllToAll(T_MAX, H, K, E, online_fp8=False,
                                                                        combine_order="rank"))):
        d = make()
        x, ids, w = _inputs(T_MAX, E, 10 + rank, device)
        if name.startswith("lowlatency"):
            x = x.to(torch.bfloat16)  # the layer's dtype
        dispatched = d.dispatch(x, ids, w)
        expert_out = dispatched.tokens.clone()
        errors = {}
        try:
            y = d.combine(expert_out[..., :-1] if rank == 1 else expert_out, dispatched)
            errors["combine"] = None if rank == 1 else bool(torch.isnan(y).any())  # rank 1's rows came as NaN
        except ValueError as error:
            errors["combine"] = str(error)
        try:
            d.dispatch(x, ids, w)
            errors["next"] = None
        except ValueError as error:
            errors["next"] = str(error)
        dispatched = d.dispatch(x, ids, w)
        y = d.combine(dispatched.tokens.clone(), dispatched).cpu()
        if d.combine_order == "slot":
            want = _identity_want(x, ids, w)
        else:  # the rank order's contract, bitwise
            slot_out = x.cpu().unsqueeze(1).expand(T_MAX, K, H)
            want = weighted_rank_sum(slot_out, ids.cpu(), w.cpu(), x.dtype, num_experts=E, world_size=world_size)
        errors["exact"] = torch.equal(y, want)
        out[name] = errors
    return out


@needs_two_gpus
def test_a_bad_expert_out_on_one_gpu_fails_both_ranks_at_the_next_dispatch():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (inherited by the ranks)
    results = launch(_bad_expert_out, 2, backend="nccl", timeout=300)
    for name in ("alltoall", "alltoall-rank", "maxcounts", "capspill", "lowlatency", "lowlatency-rank"):
        good, bad = results[0][name], results[1][name]
        assert "expert_out must be" in bad["combine"] and good["combine"] is True, (name, results)
        assert good["next"] == bad["next"] and "rank 1: expert_out must be" in good["next"], (name, results)
        assert "previous combine" in good["next"] and good["exact"] and bad["exact"], (name, results)


class _Static:
    def __init__(self, E, device):
        self.x, self.ids, self.w = _inputs(T_MAX, E, 2, device)

    def write(self, ids):
        self.ids.copy_(ids)


def _captured_flags(rank, world_size):
    """Capture each fixed-buffer round trip, replay with a bad id on rank 0 only, then a good one."""
    device = current_device() if world_size > 1 else torch.device("cuda", 0)
    E = 2 * world_size
    out = {}
    for name, d in (("maxcounts", MaxCountsDispatcher(E, T_MAX * K, T_MAX, top_k=K)),
                    ("capspill", CapAndSpillDispatcher(E, 1, T_MAX, top_k=K))):
        static = _Static(E, device)
        good = static.ids.clone()
        held = {}

        def step(d=d, static=static, held=held):
            held["d"] = d.dispatch(static.x, static.ids, static.w)
            held["y"] = d.combine(held["d"].tokens, held["d"])

        graph = capture_graph(step)
        bad = good.clone()
        if rank == 0:
            bad[1, 0] = E + 5
        static.write(bad)
        graph.replay()
        try:
            d.check_replay(held["d"])
            raised = None
        except ValueError as error:
            raised = str(error)
        static.write(good)
        graph.replay()
        d.check_replay(held["d"])
        exact = torch.equal(held["y"].cpu(), _identity_want(static.x, good, static.w))
        out[name] = dict(raised=raised, exact=exact)
    return out


@needs_cuda
def test_device_flag_in_a_cuda_graph_on_one_gpu():
    for name, r in _captured_flags(0, 1).items():
        assert r["raised"] and "topk_ids held ids outside [-1, 1]" in r["raised"], (name, r)
        assert r["exact"], name


@needs_two_gpus
def test_device_flag_in_a_cuda_graph_on_two_gpus():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (inherited by the ranks)
    results = launch(_captured_flags, 2, backend="nccl", timeout=300)
    for name in ("maxcounts", "capspill"):
        texts = {r[name]["raised"] for r in results}
        assert len(texts) == 1 and "rank 0 of 2" in texts.pop(), (name, results)
        assert all(r[name]["exact"] for r in results), name


# -- the low-latency layer's symmetric-memory kernels -------------------------------------------

LL_M, LL_H, LL_K, LL_E = 8, 256, 4, 16


def _ll_want(x, ids, w, order):
    """Identity experts: the combine contract of ``order`` on this rank's own tensors."""
    T = x.shape[0]
    slot_out = x.cpu().unsqueeze(1).expand(T, LL_K, LL_H)
    if order == "rank":
        return weighted_rank_sum(slot_out, ids.cpu(), w.cpu(), x.dtype, num_experts=LL_E, world_size=2)
    return reference_slot_sum(slot_out, ids.cpu(), w.cpu(), x.dtype)


def _lowlatency_fail_together(rank, world_size, order):
    device = current_device()
    g = torch.Generator().manual_seed(rank)

    def inputs(T):
        x = torch.randn(T, LL_H, generator=g).to(torch.bfloat16)
        ids = torch.rand(T, LL_E, generator=g).argsort(1)[:, :LL_K]
        return x.to(device), ids.to(device), (torch.rand(T, LL_K, generator=g) + 0.05).to(device)

    layer = EPLowLatencyAllToAll(LL_M, LL_H, LL_K, LL_E, online_fp8=False, combine_order=order)
    x, ids, w = inputs(LL_M)
    bad_id = ids.clone()
    if rank == 1:
        bad_id[0, 0] = LL_E
    big = inputs(LL_M + 1) if rank == 0 else (x, ids, w)
    cases = {"bad id on rank 1": (x, bad_id, w), "T > max_m on rank 0": big,
             "float32 x on rank 1": (x.float() if rank == 1 else x, ids, w)}
    eager = {}
    for what, args in cases.items():
        try:
            layer.dispatch(*args)
            eager[what] = None
        except ValueError as error:
            eager[what] = str(error)
    d = layer.dispatch(x, ids, w)
    eager_exact = torch.equal(layer.combine(d.tokens, d).cpu(), _ll_want(x, ids, w, order))

    x_s, ids_s, w_s = x.clone(), ids.clone(), w.clone()
    held = {}

    def step():
        held["d"] = layer.dispatch(x_s, ids_s, w_s)
        held["y"] = layer.combine(held["d"].tokens, held["d"])

    graph = capture_graph(step)
    replays = {}
    for what, who in (("bad id on rank 0", 0), ("clean", None)):
        ids_s.copy_(ids)
        if rank == who:
            ids_s[1, 0] = LL_E + 3
        graph.replay()
        torch.cuda.synchronize()
        try:
            layer.check_replay(held["d"])
            raised = None
        except ValueError as error:
            raised = str(error)
        replays[what] = dict(raised=raised, flags=held["d"].handle.state["invalid_by_rank"].tolist())
    replay_exact = torch.equal(held["y"].cpu(), _ll_want(x, ids, w, order))
    layer.finalize()
    return dict(eager=eager, eager_exact=eager_exact, replays=replays, replay_exact=replay_exact)


@needs_two_gpus
@pytest.mark.parametrize("order", ["slot", "rank"])
def test_lowlatency_ranks_fail_together_on_two_gpus(order):
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)  # never NVLink multicast (inherited by the ranks)
    results = launch(_lowlatency_fail_together, 2, order, backend="nccl", timeout=300)
    for what, bad_rank in (("bad id on rank 1", 1), ("T > max_m on rank 0", 0), ("float32 x on rank 1", 1)):
        texts = {r["eager"][what] for r in results}
        assert len(texts) == 1, (what, results)  # the same error on both ranks
        text = texts.pop()
        assert text is not None and f"rank {bad_rank}:" in text and "every rank raises" in text, (what, text)
    assert all(r["eager_exact"] for r in results), results
    bad = [r["replays"]["bad id on rank 0"] for r in results]
    assert bad[0]["raised"] == bad[1]["raised"] and "rank 0 of 2" in bad[0]["raised"], bad
    assert bad[0]["flags"] == bad[1]["flags"] == [1, 0], bad
    assert all(r["replays"]["clean"] == dict(raised=None, flags=[0, 0]) for r in results), results
    assert all(r["replay_exact"] for r in results), results
