"""patch(model, experts="fused" / "fused_fp8") on the CPU: the fused Triton kernel in Triton's
interpreter (float32 exact there; bf16 is not, so bf16 is checked on the GPU only).

* ``"fused"`` in float32: logits equal transformers' within the float32 tolerance of the
  torch path (|diff| <= 1e-5 + 1e-5 * |logit|; measured < 1e-6);
* ``"fused_fp8"`` (W8A8 with 128 x 128 block scales, H = N = 128): relative L2 error of the
  logits <= 0.15 (measured 0.06 on OLMoE) and the same top-1 token at every position.
"""

from __future__ import annotations

import os

import pytest
import torch

# The kernels are decorated when moekit.kernels is imported: without a GPU that must happen
# under the interpreter (as the kernel tests do).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from .tiny_models import ARCHS, build, prompts  # noqa: E402

from moekit.integrations.transformers import patch  # noqa: E402

FP8_REL = 0.15


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_float32_matches_transformers(arch):
    model = build(arch)
    ids = prompts(batch=1, length=6)
    want = _logits(model, ids)
    patch(model, experts="fused")
    torch.testing.assert_close(_logits(model, ids), want, rtol=1e-5, atol=1e-5)


def test_fused_fp8_within_bound():
    model = build("olmoe", hidden=128, intermediate=128)
    ids = prompts(batch=1, length=6)
    want = _logits(model, ids)
    blocks = patch(model, experts="fused_fp8")
    assert blocks[0].backend.compute.w13.dtype == torch.float8_e4m3fn  # the one copy: quantized weights
    got = _logits(model, ids)
    assert ((got - want).norm() / want.norm()).item() <= FP8_REL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_fp8_needs_128_multiples():
    with pytest.raises(ValueError, match="multiples of 128"):
        patch(build("olmoe"), experts="fused_fp8")
