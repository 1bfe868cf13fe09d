"""Ranks fail together on CUDA: the step status built on the GPU, and the device flag of
the fixed-buffer dispatchers inside a real CUDA graph, checked by ``check_replay``.

One GPU: every dispatcher in one process (no process group). Two GPUs (NCCL): a bad id on
one rank inside a captured MaxCounts / Cap-and-Spill step makes ``check_replay`` raise
the same error on both ranks. The CPU tests (tests/ep/test_fail_together.py) cover the
rest on gloo; the low-latency layer's symmetric-memory kernels do not carry the flag yet.
"""

from __future__ import annotations

import os

import pytest
import torch

from moekit.bench.timing import capture_graph
from moekit.ep import AllToAllDispatcher, CapAndSpillDispatcher, MaxCountsDispatcher, current_device, launch
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
