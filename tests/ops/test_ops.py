"""moekit.ops: the configuration policy, the eager entries and the custom operators."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import moekit.ops as ops  # noqa: E402
from moekit.kernels import KernelConfig, default_config, expert_major_default, fused_moe as kernel_fused_moe  # noqa: E402
from moekit.moe import MoEWeights, reference_moe  # noqa: E402
from moekit.ops.policy import token_bucket  # noqa: E402
from moekit.shapes import MoEShape  # noqa: E402

SHAPE = MoEShape("tiny", num_experts=4, top_k=2, hidden=32, intermediate=64)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(M=5, seed=0, dtype=torch.float32):
    w = MoEWeights.random(SHAPE, seed=seed, dtype=dtype, device=DEVICE)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(M, SHAPE.hidden, generator=g).to(DEVICE, dtype)
    ids = torch.rand(M, SHAPE.num_experts, generator=g).argsort(1)[:, :SHAPE.top_k].to(DEVICE)
    tw = torch.rand(M, SHAPE.top_k, generator=g).to(DEVICE)
    return x, w, ids, tw


def test_buckets():
    assert [token_bucket(m) for m in (0, 1, 7, 64, 65, 128, 129, 4096)] == [1, 1, 7, 64, 128, 128, 256, 4096]


def test_static_policy_is_one_dict_entry_per_bucket():
    ops.forget_static()
    x, w, ids, tw = _case(M=80)
    first = ops.static_config(80, num_experts=4, top_k=2, hidden=32, intermediate=64, fp8=False, device=x.device)
    assert first == default_config(128, SHAPE)  # no model off the GPU: the kernels' default for the bucket
    assert ops.static_config(100, num_experts=4, top_k=2, hidden=32, intermediate=64, fp8=False,
                             device=x.device) is first  # same bucket: the same object, from the dict
    em = ops.static_config(8, num_experts=4, top_k=None, hidden=32, intermediate=64, fp8=False, device=x.device,
                           family="expert_major")
    assert em == expert_major_default(8, False)


def test_fused_moe_policies_match_the_reference_and_the_kernel():
    x, w, ids, tw = _case()
    want = reference_moe(x.cpu(), w.to(torch.float64, "cpu"), ids.cpu(), tw.cpu())
    for config in (None, "static", "default", KernelConfig(bm=16, bn=32, bk=32)):
        y = ops.fused_moe(x, w.w13, w.w2, ids, tw, config)
        assert (y.cpu().double() - want).abs().max() < 1e-4, config
    cfg = default_config(5, SHAPE)
    assert torch.equal(ops.fused_moe(x, w.w13, w.w2, ids, tw, "default"),
                       kernel_fused_moe(x, w.w13, w.w2, ids, tw, cfg))


def test_bad_arguments_are_reported_on_every_call():
    x, w, ids, tw = _case()
    with pytest.raises(ValueError, match="one of"):
        ops.fused_moe(x, w.w13, w.w2, ids, tw, "fastest")
    ops.fused_moe(x, w.w13, w.w2, ids, tw)
    for _ in range(2):  # a bad signature is never remembered as checked
        with pytest.raises(ValueError, match="topk_weights"):
            ops.fused_moe(x, w.w13, w.w2, ids, tw[:, :1])
    with pytest.raises(ValueError, match="config must be a moekit.kernels.KernelConfig"):
        kernel_fused_moe(x, w.w13, w.w2, ids, tw, "auto")  # the kernels take a config, not a policy


def test_bf16_routing_weights_are_read_as_they_are():
    x, w, ids, tw = _case(seed=3)
    cfg = KernelConfig(bm=16, bn=32, bk=32)
    tw16 = tw.to(torch.bfloat16)
    assert torch.equal(kernel_fused_moe(x, w.w13, w.w2, ids, tw16, cfg),
                       kernel_fused_moe(x, w.w13, w.w2, ids, tw16.float(), cfg))


def test_config_ids_round_trip():
    from moekit.kernels import config_space

    for c in config_space(SHAPE)[:50]:
        assert KernelConfig.from_id(c.id) == c
    for bad in ("T-bm16", "X-bm16-bn64-bk64-w4-s3-g1-k1", "T-bm16-bn64-bk64-w4-s3-g1-k1-q", 7):
        with pytest.raises(ValueError, match="KernelConfig id"):
            KernelConfig.from_id(bad)


def test_opcheck_token_major():
    x, w, ids, tw = _case(M=3, seed=4)
    torch.library.opcheck(torch.ops.moekit.fused_moe.default, (x, w.w13, w.w2, ids, tw, None, None, None, "static"))


def test_opcheck_expert_major():
    x, w, ids, tw = _case(seed=5)
    tokens = torch.randn(4, 6, SHAPE.hidden, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    # Every row valid: rows past counts are unspecified by contract, so two runs may differ there.
    counts = torch.tensor([6, 6, 6, 6], device=DEVICE)
    torch.library.opcheck(torch.ops.moekit.fused_moe_expert_major.default,
                          (tokens, counts, w.w13, w.w2, None, None, None, "default"))


def test_operator_has_no_backward():
    x, w, ids, tw = _case(seed=7)
    x.requires_grad_(True)
    y = torch.ops.moekit.fused_moe(x, w.w13, w.w2, ids, tw, None, None, None, "static")
    with pytest.raises(RuntimeError, match="no backward"):
        y.sum().backward()


def test_two_launch_alignment_zeroes_the_accumulator(monkeypatch):
    """Above 1024 pairs the alignment takes two launches, and the first zeroes the kernels'
    float32 accumulator (one launch fewer per call); the call still matches the reference.
    In Triton's interpreter a chunk's sort of 1024 keys costs seconds, so there the alignment
    scans 128 pairs per chunk (align._MAX_SCAN) and M shrinks with it: still two launches."""
    from moekit.kernels import align as align_mod
    from moekit.kernels.align import align_launches, align_tokens

    M = 516
    assert align_launches(M * SHAPE.top_k) == 2 and align_launches(1024) == 1
    if DEVICE == "cpu":
        monkeypatch.setattr(align_mod, "_MAX_SCAN", 128)
        M = 65
    x, w, ids, tw = _case(M=M, seed=9)
    assert align_launches(ids.numel()) == 2 and align_launches(align_mod._MAX_SCAN) == 1
    acc = torch.full((M, SHAPE.hidden), float("nan"), device=DEVICE)
    al = align_tokens(ids, SHAPE.num_experts, 64, zero=acc)
    assert al.zeroed and torch.equal(acc, torch.zeros_like(acc))
    cfg = KernelConfig(bm=64, bn=32, bk=32)
    y = ops.fused_moe(x, w.w13, w.w2, ids, tw, cfg)
    want = reference_moe(x.cpu(), w.to(torch.float64, "cpu"), ids.cpu(), tw.cpu())
    assert (y.cpu().double() - want).abs().max() < 1e-4
