"""MaxCounts and Cap-and-Spill inside CUDA graphs: bitwise equal to the eager all-to-all.

Each dispatcher's dispatch + combine (with a per-row "expert" that writes NaN into padding
rows) is captured once with ``moekit.bench.timing.capture_graph``; every step then writes
new routing into the captured input buffers (``copy_``, rows past the step's T masked with
-1) and replays. The conditional mode is a probe graph (``spill_flag``) read on the host
plus two step graphs, with and without the spill pass. The steps are those of the gloo
tests (``tests/ep/test_capspill.py``): no overflow, heavy overflow, C = 0 and C = 1.
"""

from __future__ import annotations

import os

import pytest
import torch

from moekit.bench.timing import capture_graph
from moekit.ep import AllToAllDispatcher, current_device, launch
from moekit.ep.capspill import CapAndSpillDispatcher, MaxCountsDispatcher
from tests.ep.test_capspill import H, K, NUM_STEPS, T_MAX, capspill_steps, compare, expert_outputs, num_experts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


class StaticInputs:
    """Fixed-shape input buffers [T_max, ...] that captured graphs read."""

    def __init__(self, device, dtype):
        self.x = torch.zeros(T_MAX, H, device=device, dtype=dtype)
        self.ids = torch.full((T_MAX, K), -1, device=device, dtype=torch.int64)
        self.w = torch.zeros(T_MAX, K, device=device)

    def write(self, x, ids, w):
        """New routing into the same tensors; rows past T are masked."""
        T = x.shape[0]
        self.x.zero_()
        self.ids.fill_(-1)
        self.w.zero_()
        self.x[:T].copy_(x)
        self.ids[:T].copy_(ids)
        self.w[:T].copy_(w)


def _round_trip(dispatcher, inputs, out, **kwargs):
    """dispatch -> expert_outputs (graph-safe: no host reads) -> combine, outputs kept in ``out``."""
    def step():
        d = dispatcher.dispatch(inputs.x, inputs.ids, inputs.w, **kwargs)
        out["d"], out["y"] = d, dispatcher.combine(expert_outputs(d), d)
    return step


def _graphs_vs_eager(rank, world_size, dtype_name):
    device = current_device() if world_size > 1 else torch.device("cuda", 0)
    dtype = getattr(torch, dtype_name)
    steps = capspill_steps(world_size)
    E = num_experts(world_size)
    inputs = StaticInputs(device, dtype)
    _, _, xs, ids, ws = steps[0]
    inputs.write(xs[rank].to(device, dtype), ids[rank].to(device), ws[rank].to(device))

    graphs = {}  # name -> (replay function, outputs it fills)
    for name, d in [("maxcounts", MaxCountsDispatcher(E, T_MAX * K, T_MAX, top_k=K))] + [
            (f"capspill(C={C})", CapAndSpillDispatcher(E, C, T_MAX, top_k=K)) for C in (0, 1, 3, 12)]:
        out = {}
        graphs[name] = (capture_graph(_round_trip(d, inputs, out)).replay, out)
    cond = CapAndSpillDispatcher(E, 3, T_MAX, top_k=K, conditional=True)
    flag = {}
    probe = capture_graph(lambda: flag.update(v=cond.spill_flag(inputs.ids)))
    branch = {}
    for spill in (True, False):
        out = {}
        branch[spill] = (capture_graph(_round_trip(cond, inputs, out, spill=spill)), out)

    eager = AllToAllDispatcher(E)
    mismatches, took_spill = [], []
    for i, (_, _, xs, ids, ws) in enumerate(steps):
        inputs.write(xs[rank].to(device, dtype), ids[rank].to(device), ws[rank].to(device))
        want = eager.dispatch(inputs.x, inputs.ids, inputs.w)
        y_want = eager.combine(expert_outputs(want), want)
        for name, (replay, out) in graphs.items():
            replay()
            mismatches += compare(name, i, out["d"], want, out["y"], y_want)
        probe.replay()
        spill = bool(flag["v"].item())  # the host sync of the conditional mode
        graph, out = branch[spill]
        graph.replay()
        took_spill.append(spill)
        mismatches += compare("capspill-cond(C=3)", i, out["d"], want, out["y"], y_want)
    return dict(mismatches=mismatches, took_spill=took_spill, overflow=_maxcounts_flag_in_graph(rank, E, device))


def _maxcounts_flag_in_graph(rank, E, device):
    """C_max = 2 captured with light routing; replayed with heavy routing on rank 0 only."""
    inputs = StaticInputs(device, torch.float32)
    light = torch.full((T_MAX, K), -1, dtype=torch.int64)
    light[0] = torch.tensor([0, E - 1])
    heavy = torch.full((T_MAX, K), -1, dtype=torch.int64)
    if rank == 0:
        heavy[:] = torch.tensor([E - 1, E - 2])  # 18 pairs to the last rank
    x, w = torch.randn(T_MAX, H), torch.full((T_MAX, K), 0.5)
    inputs.write(x.to(device), light.to(device), w.to(device))
    out = {}
    graph = capture_graph(_round_trip(MaxCountsDispatcher(E, 2, T_MAX, top_k=K), inputs, out))
    flags = []
    for routing in (light, heavy, light):
        inputs.write(x.to(device), routing.to(device), w.to(device))
        graph.replay()
        flags.append(bool(out["d"].handle.state["overflow"]))
    return flags


@needs_two_gpus
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_graphs_bitwise_equal_to_eager_on_two_gpus(dtype_name):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (inherited by the ranks)
    results = launch(_graphs_vs_eager, 2, dtype_name, backend="nccl")
    for result in results:
        assert result["mismatches"] == [], result["mismatches"][:10]
        assert len(result["took_spill"]) == NUM_STEPS
        assert any(result["took_spill"]) and not all(result["took_spill"])
        assert result["overflow"] == [False, True, False]  # on both ranks, rank 0's overflow included
    assert results[0]["took_spill"] == results[1]["took_spill"]


@needs_cuda
def test_graphs_bitwise_equal_to_eager_on_one_gpu():
    """P = 1 (no process group): the captured pack / merge alone, on one GPU."""
    result = _graphs_vs_eager(0, 1, "bfloat16")
    assert result["mismatches"] == [], result["mismatches"][:10]
    assert result["overflow"] == [False, True, False]
