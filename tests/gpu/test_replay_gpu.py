"""Replayed calls (moekit.kernels.recipe) on the GPU: from the third call of a signature on,
``moekit.ops.fused_moe`` runs from its recorded launches, and what it computes equals Triton's own
launch of the same kernels (``moekit.kernels.fused_moe``): bitwise where the schedule is
deterministic, to float32 rounding where atomics add; with no host sync; with several weight sets
sharing one recipe (the layers of a model); on two streams at once; and in a CUDA graph captured
after replay. The expert-major call likewise."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import moekit.ops as ops  # noqa: E402
from moekit.kernels import KernelConfig, recipe  # noqa: E402
from tests.gpu.launch_cases import CONFIGS, E, H, check, fresh_caches, inputs, weights  # noqa: E402,F401
from moekit.kernels import fused_moe as triton_fused_moe  # noqa: E402
from moekit.kernels.expert_major import fused_moe_expert_major as triton_expert_major  # noqa: E402


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("M", [1, 16, 300])
def test_replayed_calls_equal_tritons_launch(M, name, fp8):
    config = CONFIGS[name]
    layers = [weights(fp8, seed) for seed in range(2)]  # two layers' weights, one signature
    before = recipe.recipe_count()
    torch.cuda.synchronize()
    for seed in range(6):
        w13, w2, scales = layers[seed % 2]
        x, ids, w = inputs(M, seed)
        if seed >= 3:  # replayed: no host sync may happen inside
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = ops.fused_moe(x, w13, w2, ids, w, config, **scales)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = triton_fused_moe(x, w13, w2, ids, w, config, **scales)
        torch.cuda.synchronize()
        check(got, want, name == "decode" and M <= config.bm, f"call {seed}")
    assert recipe.recipe_count() > before


def test_replay_on_two_streams_at_once():
    config = CONFIGS["decode"]
    w13, w2, _ = weights(False)
    cases = [inputs(4, seed) for seed in range(8)]
    for x, ids, w in cases[:3]:
        ops.fused_moe(x, w13, w2, ids, w, config)
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for i, (x, ids, w) in enumerate(cases):
        with torch.cuda.stream(streams[i % 2]):
            outs.append(ops.fused_moe(x, w13, w2, ids, w, config))
    torch.cuda.synchronize()
    for out, (x, ids, w) in zip(outs, cases):
        assert torch.equal(out, triton_fused_moe(x, w13, w2, ids, w, config))


def test_a_cuda_graph_captured_after_replay():
    config = CONFIGS["split_k"]
    w13, w2, _ = weights(False)
    x, ids, w = inputs(40, 0)
    for _ in range(4):
        ops.fused_moe(x, w13, w2, ids, w, config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fused_moe(x, w13, w2, ids, w, config)
    for seed in (1, 2):
        x2, ids2, w2_ = inputs(40, seed)
        x.copy_(x2), ids.copy_(ids2), w.copy_(w2_)
        eager = ops.fused_moe(x, w13, w2, ids, w, config)  # replayed, between graph replays
        graph.replay()
        torch.cuda.synchronize()
        want = triton_fused_moe(x, w13, w2, ids, w, config)
        check(out, want, False, f"graph, seed {seed}")
        check(eager, want, False, f"eager, seed {seed}")


def test_replayed_expert_major_equals_tritons_launch():
    w13, w2, _ = weights(False)
    capacity = 40
    config = KernelConfig(bm=16, bn=64, bk=64)
    before = recipe.recipe_count()
    for seed in range(5):
        g = torch.Generator(device="cuda").manual_seed(seed)
        tokens = torch.randn(E, capacity, H, device="cuda", generator=g).bfloat16()
        counts = torch.randint(0, capacity + 1, (E,), device="cuda", generator=g, dtype=torch.int32)
        got = ops.fused_moe_expert_major(tokens, counts, w13, w2, config)
        want = triton_expert_major(tokens, counts, w13, w2, config)
        torch.cuda.synchronize()
        live = torch.arange(capacity, device="cuda").unsqueeze(0) < counts.unsqueeze(1)
        assert torch.equal(got[live], want[live]), f"seed {seed}"
    assert recipe.recipe_count() > before


def test_compiled_calls_after_eager_replay():
    """The custom operator (what torch.compile runs) never replays: its CUDA graphs own their
    memory. Eager calls of the same signature replay before and after."""
    config = CONFIGS["decode"]
    w13, w2, _ = weights(False)
    x, ids, w = inputs(4, 0)
    for _ in range(3):
        ops.fused_moe(x, w13, w2, ids, w, config)
    compiled = torch.compile(lambda a, i, p: ops.fused_moe(a, w13, w2, i, p, config), fullgraph=True,
                             mode="reduce-overhead")
    for seed in range(4):
        x, ids, w = inputs(4, seed)
        got = compiled(x, ids, w).clone()
        eager = ops.fused_moe(x, w13, w2, ids, w, config)
        torch.cuda.synchronize()
        want = triton_fused_moe(x, w13, w2, ids, w, config)
        assert torch.equal(got, want) and torch.equal(eager, want), f"seed {seed}"
