"""Bound launches (moekit.kernels.bound) on the GPU: ``moekit.ops.fused_moe`` launches from the
binaries after the first call of a signature, and what those launches compute equals Triton's own
launch of the same kernels (``moekit.kernels.fused_moe``, outside any call scope): bitwise where the
schedule is deterministic (the decode schedule), to float32 rounding where atomics add (the other
forms); in a CUDA graph too. The expert-major call likewise."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import moekit.ops as ops  # noqa: E402
from moekit.fp8 import calc_diff  # noqa: E402
from moekit.kernels import KernelConfig, bound  # noqa: E402
from tests.gpu.launch_cases import CONFIGS, E, H, fresh_caches, inputs, weights  # noqa: E402,F401
from moekit.kernels import fused_moe as triton_fused_moe  # noqa: E402
from moekit.kernels.expert_major import fused_moe_expert_major as triton_expert_major  # noqa: E402


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("M", [1, 7, 16, 300])
def test_bound_launches_equal_tritons_launch(M, name, fp8):
    config = CONFIGS[name]
    w13, w2, scales = weights(fp8)
    before = bound.bound_count()
    for seed in range(3):  # the first call binds; the others launch from the binaries
        x, ids, w = inputs(M, seed)
        got = ops.fused_moe(x, w13, w2, ids, w, config, **scales)
        want = triton_fused_moe(x, w13, w2, ids, w, config, **scales)
        torch.cuda.synchronize()
        deterministic = name == "decode" and M <= config.bm
        if deterministic:
            assert torch.equal(got, want), f"seed {seed}"
        else:
            assert calc_diff(got.float(), want.float()) < 1e-6, f"seed {seed}"
    assert bound.bound_count() > before


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_bound_launches_in_a_cuda_graph(fp8):
    config = CONFIGS["decode"]
    w13, w2, scales = weights(fp8)
    x, ids, w = inputs(4, 0)
    ops.fused_moe(x, w13, w2, ids, w, config, **scales)  # binds
    ops.fused_moe(x, w13, w2, ids, w, config, **scales)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fused_moe(x, w13, w2, ids, w, config, **scales)
    for seed in (1, 2):
        x2, ids2, w2_ = inputs(4, seed)
        x.copy_(x2), ids.copy_(ids2), w.copy_(w2_)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, triton_fused_moe(x, w13, w2, ids, w, config, **scales))


def test_bound_expert_major_equals_tritons_launch():
    w13, w2, _ = weights(False)
    capacity = 40
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        tokens = torch.randn(E, capacity, H, device="cuda", generator=g).bfloat16()
        counts = torch.randint(0, capacity + 1, (E,), device="cuda", generator=g, dtype=torch.int32)
        config = KernelConfig(bm=16, bn=64, bk=64)
        got = ops.fused_moe_expert_major(tokens, counts, w13, w2, config)
        want = triton_expert_major(tokens, counts, w13, w2, config)
        torch.cuda.synchronize()
        live = torch.arange(capacity, device="cuda").unsqueeze(0) < counts.unsqueeze(1)
        assert torch.equal(got[live], want[live]), f"seed {seed}"
