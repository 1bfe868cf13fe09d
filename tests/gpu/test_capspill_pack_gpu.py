"""The one-launch Triton phases of MaxCounts and Cap-and-Spill on GPUs, against the torch phases.

* One GPU: the compiled kernels against the torch phases, bitwise, on the simulated ranks of
  ``tests/ep/test_capspill_pack.py`` (small shapes, every routing kind) and on two real sizes:
  the Mixtral-like step of the Cap-and-Spill benchmark (P = 4, E = 8, top-2, T_max = 86,
  H = 4096 bf16) and a prefill-sized one (P = 8, E = 64, top-8, T_max = 640, H = 256), whose
  many pairs take the larger blocks and several histogram chunks.
* Two GPUs (NCCL): dispatch + combine captured as CUDA graphs twice per dispatcher, once with
  the kernels and once with the torch phases, replayed on the 60 steps of the gloo tests; the
  two replays must agree bit for bit on everything (the full result with padding, counts,
  handle, the state combine and ``check_replay`` read, and the combine), and the kernels must
  have been used. ``tests/gpu/test_capspill_graph.py`` compares the same graphs (kernels, the
  default on CUDA) with the eager all-to-all.
"""

from __future__ import annotations

import os

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _on(device, inputs):
    return [(x.to(device), ids.to(device), w.to(device)) for x, ids, w in inputs]


@needs_cuda
@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("order", ["slot", "rank"])
def test_kernels_equal_torch_phases_small(world_size, order):
    from moekit.ep.capspill import CapAndSpillDispatcher, MaxCountsDispatcher
    from tests.ep.test_capspill_pack import KINDS, check_step, routing

    T_max, K, H = 7, 2, 10
    E = 2 * world_size
    g = torch.Generator().manual_seed(world_size)
    bad = []
    for i, kind in enumerate(KINDS):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        inputs = _on("cuda", routing(g, kind, world_size, T_max, E, K, H, dtype))
        for cls, C in ((MaxCountsDispatcher, T_max * K), (MaxCountsDispatcher, 3), (CapAndSpillDispatcher, 0),
                       (CapAndSpillDispatcher, 1), (CapAndSpillDispatcher, 4), (CapAndSpillDispatcher, T_max * K)):
            bad += [f"{kind} {cls.__name__}(C={C}): {b}"
                    for b in check_step(cls, world_size, C, T_max, E, K, order, inputs)]
    assert bad == [], bad[:10]


@needs_cuda
@pytest.mark.parametrize("shape", ["mixtral-p4", "prefill-p8"])
def test_kernels_equal_torch_phases_real_sizes(shape):
    from moekit.ep.capacity import calibrate_capacity
    from moekit.ep.capspill import CapAndSpillDispatcher, MaxCountsDispatcher
    from moekit.routing import mixtral_capspill_trace
    from tests.ep.test_capspill_pack import check_step, routing

    g = torch.Generator().manual_seed(1)
    if shape == "mixtral-p4":
        P, E, K, H = 4, 8, 2, 4096
        trace = mixtral_capspill_trace(steps=20, layers=4)
        T_max = trace.num_tokens // P
        C, C_max = calibrate_capacity(trace, 0.99, P).capacity, calibrate_capacity(trace, 1.0, P).capacity
        steps = [("uniform", [(torch.randn(T_max, H, generator=g).to(torch.bfloat16),
                               torch.from_numpy(trace.topk_ids[s, layer, r * T_max:(r + 1) * T_max]).long(),
                               torch.rand(T_max, K, generator=g)) for r in range(P)])
                 for s, layer in ((0, 0), (5, 1), (19, 3))]
    else:
        P, E, K, H, T_max = 8, 64, 8, 256, 640  # 5120 pairs per rank: the large blocks, 32 histogram chunks
        C, C_max = 600, T_max * K
        steps = [(kind, routing(g, kind, P, T_max, E, K, H, torch.bfloat16)) for kind in ("uniform", "one_peer")]
    bad = []
    for kind, inputs in steps:
        for cls, cap in ((MaxCountsDispatcher, C_max), (CapAndSpillDispatcher, C)):
            for order in ("slot", "rank"):
                bad += [f"{kind} {cls.__name__}(C={cap}) {order}: {b}"
                        for b in check_step(cls, P, cap, T_max, E, K, order, _on("cuda", inputs))]
    assert bad == [], bad[:10]


def _graphs_kernels_vs_torch(rank, world_size):
    from moekit.bench.timing import capture_graph
    from moekit.ep import current_device
    from moekit.ep.capspill import CapAndSpillDispatcher, MaxCountsDispatcher
    from tests.ep.test_capspill import K, T_MAX, capspill_steps, expert_outputs, num_experts
    from tests.gpu.test_capspill_graph import StaticInputs

    device = current_device()
    steps = capspill_steps(world_size)
    E = num_experts(world_size)
    inputs = StaticInputs(device, torch.float32)
    _, _, xs, ids, ws = steps[0]
    inputs.write(xs[rank].to(device, torch.float32), ids[rank].to(device), ws[rank].to(device))
    made = {
        "maxcounts": lambda order: MaxCountsDispatcher(E, T_MAX * K, T_MAX, top_k=K, combine_order=order),
        "capspill(C=1)": lambda order: CapAndSpillDispatcher(E, 1, T_MAX, top_k=K, combine_order=order),
        "capspill(C=3)": lambda order: CapAndSpillDispatcher(E, 3, T_MAX, top_k=K, combine_order=order),
    }
    graphs, used = {}, []
    for name, make in made.items():
        for order in ("slot", "rank"):
            for packing in ("triton", "torch"):
                d = make(order)
                d.packing = packing
                used.append(d.uses_kernels(inputs.x) == (packing == "triton"))
                out = {}

                def step(d=d, out=out):
                    got = d.dispatch(inputs.x, inputs.ids, inputs.w)
                    out["d"], out["y"] = got, d.combine(expert_outputs(got), got)

                graphs[name, order, packing] = (capture_graph(step).replay, out)
    mismatches = []
    for i, (_, _, xs, ids, ws) in enumerate(steps):
        inputs.write(xs[rank].to(device, torch.float32), ids[rank].to(device), ws[rank].to(device))
        for name in made:
            for order in ("slot", "rank"):
                for packing in ("triton", "torch"):  # the same order on every rank: each replay runs collectives
                    graphs[name, order, packing][0]()
                got, want = graphs[name, order, "triton"][1], graphs[name, order, "torch"][1]
                mismatches += _differences(f"step {i} {name} {order}", got, want)
    return dict(mismatches=mismatches, used=all(used))


def _differences(what, got, want) -> list[str]:
    a, b = got["d"], want["d"]
    pairs = [("tokens", a.tokens, b.tokens), ("counts", a.counts, b.counts), ("y", got["y"], want["y"])]
    pairs += [(k, getattr(a.handle, k), getattr(b.handle, k)) for k in ("src_rank", "src_token", "src_slot")]
    pairs += [(f"state[{k}]", a.handle.state[k].reshape(-1), b.handle.state[k].reshape(-1))
              for k in ("dest", "largest_count", "overflow", "invalid_by_rank")]
    return [f"{what}: {k}" for k, u, v in pairs if not torch.equal(u, v)]


@needs_two_gpus
def test_graphs_with_kernels_equal_graphs_with_torch_phases():
    from moekit.ep import launch

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (inherited by the ranks)
    for result in launch(_graphs_kernels_vs_torch, 2, backend="nccl"):
        assert result["used"]
        assert result["mismatches"] == [], result["mismatches"][:10]
