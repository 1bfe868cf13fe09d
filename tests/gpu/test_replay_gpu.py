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
from moekit.fp8 import calc_diff, quantize_blocks  # noqa: E402
from moekit.kernels import KernelConfig, bound, recipe  # noqa: E402
from moekit.kernels import fused_moe as triton_fused_moe  # noqa: E402
from moekit.kernels.expert_major import fused_moe_expert_major as triton_expert_major  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_caches():
    """Every test binds and records its own calls (others may have run the same signatures)."""
    bound._BOUND.clear()
    recipe.forget()

E, H, N, K = 8, 256, 256, 2
CONFIGS = {
    "decode": KernelConfig(bm=16, bn=128, bk=128, form="two_launch", split_k=1),
    "fused": KernelConfig(bm=16, bn=128, bk=128, form="fused"),
    "split_k": KernelConfig(bm=32, bn=128, bk=128, num_stages=2, form="two_launch", split_k=2),
}


def _weights(fp8: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(E, 2 * N, H, device="cuda", generator=g).mul_(0.05).bfloat16()
    w2 = torch.randn(E, H, N, device="cuda", generator=g).mul_(0.05).bfloat16()
    if not fp8:
        return w13, w2, {}
    (q13, s13), (q2, s2) = quantize_blocks(w13, 128), quantize_blocks(w2, 128)
    return q13, q2, dict(w13_scale=s13, w2_scale=s2)


def _inputs(M: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, H, device="cuda", generator=g).bfloat16()
    ids = torch.rand(M, E, device="cuda", generator=g).argsort(1)[:, :K].to(torch.int32)
    w = torch.rand(M, K, device="cuda", generator=g)
    return x, ids, (w / w.sum(1, keepdim=True)).bfloat16()


def _check(got, want, deterministic: bool, what: str):
    if deterministic:
        assert torch.equal(got, want), what
    else:
        assert calc_diff(got.float(), want.float()) < 1e-6, what


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("M", [1, 16, 300])
def test_replayed_calls_equal_tritons_launch(M, name, fp8):
    config = CONFIGS[name]
    layers = [_weights(fp8, seed) for seed in range(2)]  # two layers' weights, one signature
    before = recipe.recipe_count()
    torch.cuda.synchronize()
    for seed in range(6):
        w13, w2, scales = layers[seed % 2]
        x, ids, w = _inputs(M, seed)
        if seed >= 3:  # replayed: no host sync may happen inside
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = ops.fused_moe(x, w13, w2, ids, w, config, **scales)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = triton_fused_moe(x, w13, w2, ids, w, config, **scales)
        torch.cuda.synchronize()
        _check(got, want, name == "decode" and M <= config.bm, f"call {seed}")
    assert recipe.recipe_count() > before


def test_replay_on_two_streams_at_once():
    config = CONFIGS["decode"]
    w13, w2, _ = _weights(False)
    inputs = [_inputs(4, seed) for seed in range(8)]
    for x, ids, w in inputs[:3]:
        ops.fused_moe(x, w13, w2, ids, w, config)
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for i, (x, ids, w) in enumerate(inputs):
        with torch.cuda.stream(streams[i % 2]):
            outs.append(ops.fused_moe(x, w13, w2, ids, w, config))
    torch.cuda.synchronize()
    for out, (x, ids, w) in zip(outs, inputs):
        assert torch.equal(out, triton_fused_moe(x, w13, w2, ids, w, config))


def test_a_cuda_graph_captured_after_replay():
    config = CONFIGS["split_k"]
    w13, w2, _ = _weights(False)
    x, ids, w = _inputs(40, 0)
    for _ in range(4):
        ops.fused_moe(x, w13, w2, ids, w, config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fused_moe(x, w13, w2, ids, w, config)
    for seed in (1, 2):
        x2, ids2, w2_ = _inputs(40, seed)
        x.copy_(x2), ids.copy_(ids2), w.copy_(w2_)
        eager = ops.fused_moe(x, w13, w2, ids, w, config)  # replayed, between graph replays
        graph.replay()
        torch.cuda.synchronize()
        want = triton_fused_moe(x, w13, w2, ids, w, config)
        _check(out, want, False, f"graph, seed {seed}")
        _check(eager, want, False, f"eager, seed {seed}")


def test_replayed_expert_major_equals_tritons_launch():
    w13, w2, _ = _weights(False)
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
    w13, w2, _ = _weights(False)
    x, ids, w = _inputs(4, 0)
    for _ in range(3):
        ops.fused_moe(x, w13, w2, ids, w, config)
    compiled = torch.compile(lambda a, i, p: ops.fused_moe(a, w13, w2, i, p, config), fullgraph=True,
                             mode="reduce-overhead")
    for seed in range(4):
        x, ids, w = _inputs(4, seed)
        got = compiled(x, ids, w).clone()
        eager = ops.fused_moe(x, w13, w2, ids, w, config)
        torch.cuda.synchronize()
        want = triton_fused_moe(x, w13, w2, ids, w, config)
        assert torch.equal(got, want) and torch.equal(eager, want), f"seed {seed}"
