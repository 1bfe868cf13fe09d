"""Shapes, configs and inputs shared by the GPU tests of bound and replayed fused-MoE calls
(``test_bound_launch_gpu.py``, ``test_replay_gpu.py``), and the fixture that clears both caches
(autouse where a test module imports it)."""

from __future__ import annotations

import pytest
import torch

from moekit.fp8 import calc_diff, quantize_blocks
from moekit.kernels import KernelConfig, bound, recipe

E, H, N, K = 8, 256, 256, 2
CONFIGS = {
    "decode": KernelConfig(bm=16, bn=128, bk=128, form="two_launch", split_k=1),
    "fused": KernelConfig(bm=16, bn=128, bk=128, form="fused"),
    "split_k": KernelConfig(bm=32, bn=128, bk=128, num_stages=2, form="two_launch", split_k=2),
}


@pytest.fixture(autouse=True)
def fresh_caches():
    """Every test binds and records its own calls (others may have run the same signatures)."""
    bound._BOUND.clear()
    recipe.forget()


def weights(fp8: bool, seed: int = 0):
    """(w13, w2, scale keywords) of E experts, bf16 or FP8 with block scales."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(E, 2 * N, H, device="cuda", generator=g).mul_(0.05).bfloat16()
    w2 = torch.randn(E, H, N, device="cuda", generator=g).mul_(0.05).bfloat16()
    if not fp8:
        return w13, w2, {}
    (q13, s13), (q2, s2) = quantize_blocks(w13, 128), quantize_blocks(w2, 128)
    return q13, q2, dict(w13_scale=s13, w2_scale=s2)


def inputs(M: int, seed: int):
    """(x, top-K ids without repeats, normalized weights) of M tokens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, H, device="cuda", generator=g).bfloat16()
    ids = torch.rand(M, E, device="cuda", generator=g).argsort(1)[:, :K].to(torch.int32)
    w = torch.rand(M, K, device="cuda", generator=g)
    return x, ids, (w / w.sum(1, keepdim=True)).bfloat16()


def check(got, want, deterministic: bool, what: str):
    """Bitwise where the schedule is deterministic, else to float32 rounding."""
    if deterministic:
        assert torch.equal(got, want), what
    else:
        assert calc_diff(got.float(), want.float()) < 1e-6, what
