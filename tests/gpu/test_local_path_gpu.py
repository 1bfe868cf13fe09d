"""The one-GPU path of a patched model and of MoELayer: no host sync, compiled equals eager,
the custom operators pass opcheck on the GPU.

* A patched block's experts call (the local dispatcher, the token-major fused kernel; bf16 and
  FP8 W8A8) and an MoELayer forward run under ``torch.cuda.set_sync_debug_mode("error")``,
  after one warm-up call (which compiles the kernels).
* A tiny float32 model generates the same greedy tokens eagerly and under transformers' static
  cache with ``torch.compile(fullgraph=True, mode="reduce-overhead")`` (CUDA graphs), patched
  with ``"fused"``; its logits agree within float32 rounding.
* ``torch.library.opcheck`` on ``moekit::fused_moe`` (bf16, FP8) and
  ``moekit::fused_moe_expert_major`` with CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")
pytest.importorskip("transformers")

import moekit.ops  # noqa: E402,F401  (registers torch.ops.moekit.*)
from moekit.fp8 import calc_diff, quantize_blocks  # noqa: E402
from moekit.integrations.transformers import moe_blocks, patch, unpatch  # noqa: E402
from moekit.moe import MoELayer, MoEWeights, reference_moe  # noqa: E402
from moekit.shapes import MoEShape  # noqa: E402
from tests.integrations.tiny_models import build, prompts  # noqa: E402

SHAPE = dict(hidden=256, intermediate=128, experts=8, top_k=2)


def _routing(M, E, K, seed, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(M, E, generator=g).argsort(1)[:, :K]
    w = torch.rand(M, K, generator=g)
    return ids.to(device), (w / w.sum(1, keepdim=True)).to(device)


@pytest.mark.parametrize("experts", ["fused", "fused_fp8"])
@pytest.mark.parametrize("M", [1, 16, 200])
def test_patched_experts_call_makes_no_host_sync(experts, M):
    model = build("qwen3_moe", dtype=torch.bfloat16, device="cuda", **SHAPE)
    block = moe_blocks(model)[0][1]
    x = torch.randn(M, SHAPE["hidden"], device="cuda", dtype=torch.bfloat16)
    ids, w = _routing(M, SHAPE["experts"], SHAPE["top_k"], M)
    with torch.no_grad():
        want = block.experts(x, ids, w).float()
        patch(model, experts=experts)
        block.experts(x, ids, w)  # warm-up: the kernels compile
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = block.experts(x, ids, w).float()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    diff = calc_diff(got, want)
    print(f"{experts} M={M}: calc_diff against transformers' experts {diff:.2e}")
    assert diff < (5e-3 if experts == "fused_fp8" else 1e-4)  # FP8: e4m3 weights and activations
    unpatch(model)


@pytest.mark.parametrize("experts", ["fused", "fused_fp8"])
def test_layer_forward_makes_no_host_sync(experts):
    shape = MoEShape("gpu-local", num_experts=8, top_k=2, hidden=256, intermediate=128)
    weights = MoEWeights.random(shape, seed=1)
    layer = MoELayer(shape, weights.to(torch.bfloat16, "cuda"), experts=experts)
    x = torch.randn(33, shape.hidden, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    ids, w = layer.router(x)
    layer(x, ids, w)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(x, ids, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = reference_moe(x.cpu(), weights.to(torch.float64), ids.cpu(), w.cpu())
    diff = calc_diff(y.cpu().double(), want)
    print(f"MoELayer {experts}: calc_diff against float64 {diff:.2e}")
    assert diff < (5e-3 if experts == "fused_fp8" else 2e-4)


def _greedy(model, ids, compiled):
    kwargs = {}
    if compiled:
        from transformers import CompileConfig

        kwargs = dict(cache_implementation="static", compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                             **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def test_compiled_generate_equals_eager():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build("olmoe", device="cuda", **SHAPE)
    ids = prompts(batch=4, length=8, seed=5).cuda()
    patch(model, experts="fused")
    eager_tokens, eager_logits = _greedy(model, ids, compiled=False)
    compiled_tokens, compiled_logits = _greedy(model, ids, compiled=True)
    compiled_tokens2, _ = _greedy(model, ids, compiled=True)  # replays the captured graphs
    torch._dynamo.reset()
    unpatch(model)
    assert torch.equal(compiled_tokens, eager_tokens)
    assert torch.equal(compiled_tokens2, eager_tokens)
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fp8", [False, True])
def test_opcheck_on_the_gpu(fp8):
    E, K, H, N, M = 8, 2, 256, 128, 5
    g = torch.Generator().manual_seed(7)
    w13 = (torch.randn(E, 2 * N, H, generator=g) * H**-0.5).cuda().bfloat16()
    w2 = (torch.randn(E, H, N, generator=g) * N**-0.5).cuda().bfloat16()
    x = torch.randn(M, H, generator=g).cuda().bfloat16()
    ids, w = _routing(M, E, K, 8)
    scales = (None, None)
    # opcheck's schema test perturbs every input with a multiply, which torch has no e4m3 kernel
    # for: FP8 weights get the other three tests.
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if fp8:
        (w13, s13), (w2, s2) = quantize_blocks(w13, 128), quantize_blocks(w2, 128)
        scales = (s13, s2)
        tests = tests[1:]
    torch.library.opcheck(torch.ops.moekit.fused_moe.default, (x, w13, w2, ids, w, *scales, None, "static"),
                          test_utils=tests)
    tokens = torch.randn(E, 4, H, generator=g).cuda().bfloat16()
    counts = torch.full((E,), 4, device="cuda")
    torch.library.opcheck(torch.ops.moekit.fused_moe_expert_major.default,
                          (tokens, counts, w13, w2, *scales, None, "static"), test_utils=tests)
