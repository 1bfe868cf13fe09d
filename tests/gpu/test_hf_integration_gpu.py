"""transformers MoE models on moekit's fused experts, on one GPU, against the peer.

Tiny random models of every supported architecture (H = 256, N = 128: the FP8 kernel's
128-multiples), built from configs. The float32 model on the GPU (TF32 off, transformers'
eager experts) is the reference. In bfloat16 no two implementations give the same bits —
transformers' own experts implementations differ from each other too — and a random tiny
model has many near-ties (router top-k and vocabulary argmax), so "the same in bf16" is
checked against transformers' own bf16 error, on the same inputs:

* ``"fused"`` in bf16, teacher-forced: relative L2 error of the logits against float32 at
  most 1.25 x transformers' bf16 error + 0.01, and the same top-1 token as transformers'
  bf16 at >= 95 % of positions;
* ``"fused"`` in bf16, greedy generate() of 32 tokens for 16 prompts: the share of tokens
  before the first difference from the float32 model's tokens at least transformers' bf16
  share - 0.15 (the share of agreement with transformers' bf16 tokens is printed);
* ``"fused_fp8"`` (W8A8, block scales), teacher-forced: relative L2 error at most
  2 x transformers' bf16 error + 0.05, top-1 agreement with float32 at least transformers'
  bf16 agreement - 0.10.

(On the CPU with moekit's ``"torch"`` experts in bf16 these measured: relative errors
0.045-0.14 for both, top-1 agreement with transformers 0.98-1.0, greedy prefix shares
within 0.03 of transformers'.) Each test prints what it measured.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")
pytest.importorskip("transformers")

from moekit.integrations.lm.bench import agreement  # noqa: E402
from moekit.integrations.transformers import patch, unpatch  # noqa: E402
from tests.integrations.tiny_models import ARCHS, build, greedy, prompts  # noqa: E402

SHAPE = dict(hidden=256, intermediate=128, experts=8, top_k=2)
BF16_FACTOR, BF16_SLACK, BF16_TOP1 = 1.25, 0.01, 0.95
GREEDY_SLACK = 0.15
FP8_FACTOR, FP8_SLACK, FP8_TOP1_SLACK = 2.0, 0.05, 0.10


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def _rel(got, want) -> float:
    return ((got - want).norm() / want.norm()).item()


def _top1(a, b) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def _models(arch: str, seed: int = 0):
    ref = build(arch, seed=seed, dtype=torch.float32, device="cuda", **SHAPE)
    ref.set_experts_implementation("eager")  # float32 on the GPU: transformers' plain loop
    low = build(arch, seed=seed, dtype=torch.bfloat16, device="cuda", **SHAPE)
    return ref, low


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_fused_logits(arch):
    ref, model = _models(arch)
    ids = prompts(batch=8, length=32, device="cuda")
    want, hf = _logits(ref, ids), _logits(model, ids)
    patch(model, experts="fused")
    got = _logits(model, ids)
    unpatch(model)
    print(f"{arch}: relative logit error vs float32: transformers bf16 {_rel(hf, want):.4f}, moekit fused bf16 "
          f"{_rel(got, want):.4f}; top-1 same as transformers bf16 at {100 * _top1(got, hf):.1f}%")
    assert _rel(got, want) <= BF16_FACTOR * _rel(hf, want) + BF16_SLACK
    assert _top1(got, hf) >= BF16_TOP1


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_fused_greedy_tokens(arch):
    ref, model = _models(arch, seed=1)
    ids = prompts(batch=16, length=8, seed=9, device="cuda")
    exact, hf = greedy(ref, ids), greedy(model, ids)
    patch(model, experts="fused")
    got = greedy(model, ids)
    unpatch(model)
    ours, theirs = agreement(got, exact)["prefix_share"], agreement(hf, exact)["prefix_share"]
    same = agreement(got, hf)
    print(f"{arch}: greedy tokens before the first difference from float32: transformers bf16 {100 * theirs:.0f}%, "
          f"moekit fused bf16 {100 * ours:.0f}%; vs transformers bf16: {100 * same['prefix_share']:.0f}% "
          f"({100 * same['identical_sequences']:.0f}% of sequences identical)")
    assert ours >= theirs - GREEDY_SLACK


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_fused_logits(arch):
    ref, model = _models(arch, seed=2)
    ids = prompts(batch=8, length=32, seed=7, device="cuda")
    want, hf = _logits(ref, ids), _logits(model, ids)
    patch(model, experts="fused_fp8")
    got = _logits(model, ids)
    unpatch(model)
    print(f"{arch}: fused_fp8 vs float32: relative error {_rel(got, want):.4f} (transformers bf16 "
          f"{_rel(hf, want):.4f}), top-1 agreement {100 * _top1(got, want):.1f}% (bf16 {100 * _top1(hf, want):.1f}%)")
    assert _rel(got, want) <= FP8_FACTOR * _rel(hf, want) + FP8_SLACK
    assert _top1(got, want) >= _top1(hf, want) - FP8_TOP1_SLACK


def test_fp8_weights_are_the_only_copy():
    """fused keeps the model's bf16 storage; fused_fp8 holds e4m3 weights of its own."""
    _, model = _models("olmoe")
    for kind in ("fused", "fused_fp8"):
        blocks = patch(model, experts=kind)
        for p in blocks:
            same = p.backend.compute.w13.data_ptr() == p.original_experts.gate_up_proj.data_ptr()
            assert same == (kind == "fused")
            assert p.backend.compute.w13.dtype == (torch.bfloat16 if kind == "fused" else torch.float8_e4m3fn)
        unpatch(model)
