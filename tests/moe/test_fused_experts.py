"""FusedExperts (the fused Triton kernel as a MoELayer expert compute) against float64.

Without a GPU the kernels run in Triton's interpreter (fp32 / fp16 exact there, FP8 with the
interpreter's rounding fix-up; see tests/kernels): tiny shapes. Checked: the expert-major
contract (valid rows = the expert's MLP; rows past the count are unspecified), FP8 tokens with scales
from a quantizing dispatcher, the W8A8 form on weights it quantizes itself, bad input, and
the whole MoELayer with ``experts="fused"`` / ``"fused_fp8"`` on 2 gloo ranks.
"""

from __future__ import annotations

import os

import pytest
import torch

# The kernels are decorated when moekit.kernels is imported: without a GPU that must happen
# under the interpreter (as tests/kernels/__init__.py does for the kernel tests).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from moekit.fp8 import calc_diff, dequantize_blocks, dequantize_groups, quantize_blocks, quantize_groups  # noqa: E402
from moekit.kernels import KernelConfig  # noqa: E402
from moekit.moe import FusedExperts, MoELayer, MoEWeights, SwiGLUExperts, expert_mlp, reference_moe  # noqa: E402
from moekit.shapes import MoEShape  # noqa: E402

SHAPE = MoEShape("tiny", num_experts=4, top_k=2, hidden=48, intermediate=40)
FP8_SHAPE = MoEShape("tiny-fp8", num_experts=4, top_k=2, hidden=128, intermediate=128)
REL_TOL = 1e-5  # float32 kernel (exact products) against float64
FP8_DIFF = 1e-3  # DeepEP's calc_diff bound for W8A8


def _layout(shape: MoEShape, capacity: int, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(shape.num_experts, capacity, shape.hidden, generator=g) * scale
    counts = torch.randint(0, capacity + 1, (shape.num_experts,), generator=g)
    counts[0], counts[-1] = 0, capacity  # an empty expert and a full one
    return tokens, counts


def _valid(out: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The valid rows of an expert-major [E, capacity, H], expert after expert."""
    return torch.cat([out[e, :c] for e, c in enumerate(counts.tolist())])


def _reference(tokens: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """float64 expert MLPs on the valid rows (as ``_valid`` orders them)."""
    return torch.cat([expert_mlp(tokens[e, :c].double(), w13[e].double(), w2[e].double())
                      for e, c in enumerate(counts.tolist())])


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all()
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("config", [None, KernelConfig(bm=16, bn=32, bk=16, form="fused"),
                                    KernelConfig(bm=32, bn=16, bk=32, split_k=2)], ids=["default", "fused", "sk2"])
def test_fused_experts_match_float64(config):
    w = MoEWeights.random(SHAPE, seed=3)
    tokens, counts = _layout(SHAPE, 19, seed=4)
    experts = FusedExperts(w.w13, w.w2, config=config)
    out = experts(tokens, counts)
    assert out.dtype == torch.float32 and out.shape == tokens.shape
    assert _rel_err(_valid(out, counts), _reference(tokens, counts, w.w13, w.w2)) < REL_TOL


def test_fp8_tokens_are_dequantized_with_their_scales():
    """A quantizing dispatcher's e4m3 tokens + group scales: both expert computes run the
    dequantized tokens, bitwise as if they had been handed those tokens."""
    w = MoEWeights.random(SHAPE, seed=5)
    tokens, counts = _layout(SHAPE, 9, seed=6, scale=4.0)
    q, s = quantize_groups(tokens, 16)
    deq = dequantize_groups(q, s)
    for experts in (FusedExperts(w.w13, w.w2), SwiGLUExperts(w.w13, w.w2)):
        out = _valid(experts(q, counts, s), counts)
        assert torch.equal(out, _valid(experts(deq, counts), counts)), type(experts).__name__
        assert _rel_err(out, _reference(deq, counts, w.w13, w.w2)) < REL_TOL


@pytest.mark.parametrize("token_kind", ["fp8", "float32"])
def test_fp8_experts_quantize_their_weights(token_kind):
    """fused_fp8: weights quantized at construction (128 x 128 blocks); FP8 tokens go in with
    their scales, float32 tokens are quantized by the kernel. Reference: float64 on the
    dequantized weights and tokens."""
    w = MoEWeights.random(FP8_SHAPE, seed=7)
    tokens, counts = _layout(FP8_SHAPE, 6, seed=8, scale=2.0)
    experts = FusedExperts(w.w13, w.w2, fp8=True)
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.w13_scale.shape == (4, 2, 1)
    q, s = quantize_groups(tokens, 128)
    out = experts(q, counts, s) if token_kind == "fp8" else experts(tokens, counts)
    assert out.dtype == torch.float32
    ref = _reference(dequantize_groups(q, s), counts, dequantize_blocks(experts.w13, experts.w13_scale),
                     dequantize_blocks(experts.w2, experts.w2_scale))
    assert calc_diff(_valid(out, counts), ref) < FP8_DIFF


def test_bad_input_raises():
    w = MoEWeights.random(SHAPE, seed=1)
    experts = FusedExperts(w.w13, w.w2)
    tokens, counts = _layout(SHAPE, 5, seed=2)
    with pytest.raises(ValueError, match="tokens must be"):
        experts(tokens[:, :, :-1], counts)
    q, s = quantize_groups(tokens, 16)
    with pytest.raises(ValueError, match="scales are required"):
        experts(q, counts)
    with pytest.raises(ValueError, match="only for"):
        experts(tokens, counts, s)
    with pytest.raises(ValueError, match="do not tile"):
        experts(q, counts, torch.ones(*s.shape[:2], 5))  # 48 columns are not 5 groups
    with pytest.raises(ValueError, match="do not tile"):
        experts(q, counts, s[:, 1:])
    with pytest.raises(ValueError, match="multiples of 128"):
        FusedExperts(w.w13, w.w2, fp8=True)
    with pytest.raises(ValueError, match="KernelConfig"):
        FusedExperts(w.w13, w.w2, config="bm16")
    with pytest.raises(ValueError, match="disagree"):
        FusedExperts(w.w13, w.w2[:, :-1])


# -- the layer on 2 gloo ranks -----------------------------------------------------------------

LAYER_SHAPES = {"fused": MoEShape("tiny-layer", num_experts=8, top_k=2, hidden=64, intermediate=48),
                "fused_fp8": MoEShape("tiny-layer-fp8", num_experts=4, top_k=2, hidden=128, intermediate=128)}
MAX_M = 8


def _layer_worker(rank, world_size, kind, fp8_wire):
    from moekit.ep import EPLowLatencyAllToAll

    shape = LAYER_SHAPES[kind]
    weights = MoEWeights.random(shape, seed=21)
    dispatcher = None
    if fp8_wire:
        dispatcher = EPLowLatencyAllToAll(MAX_M, shape.hidden, shape.top_k, shape.num_experts, fp8_group_size=128,
                                          dtype=torch.float32, online_fp8=True)
    layer = MoELayer(shape, weights, dispatcher=dispatcher, experts=kind)
    x = torch.randn([MAX_M, 5][rank], shape.hidden, generator=torch.Generator().manual_seed(300 + rank))
    ids, w = layer.router(x)
    y = layer(x, ids, w)
    if dispatcher is not None:
        dispatcher.finalize()
    return dict(x=x, y=y, ids=ids, w=w)


# One launch, shared with the other 2-rank tests (tests/rank_pool.py).
@pytest.mark.ranks(lambda kind, fp8_wire: (_layer_worker, kind, fp8_wire), world_size=2)
@pytest.mark.parametrize("kind,fp8_wire", [("fused", False), ("fused_fp8", True)],
                         ids=["fused-alltoall", "fused_fp8-lowlatency_fp8"])
def test_layer_with_fused_experts_matches_float64(kind, fp8_wire, pooled_launch):
    results = pooled_launch()
    shape = LAYER_SHAPES[kind]
    weights = MoEWeights.random(shape, seed=21)
    if kind == "fused_fp8":  # the reference gets the weights as the W8A8 kernel sees them
        weights = MoEWeights(weights.router, *(dequantize_blocks(*quantize_blocks(t, 128)) for t in
                                               (weights.w13, weights.w2)))
    weights = weights.to(torch.float64)
    for r in results:
        x = dequantize_groups(*quantize_groups(r["x"], 128)) if fp8_wire else r["x"]
        ref = reference_moe(x, weights, r["ids"], r["w"])
        if kind == "fused":
            assert _rel_err(r["y"], ref) < REL_TOL
        else:  # e4m3 weights and tokens (and intermediate): DeepEP's metric
            assert calc_diff(r["y"], ref) < FP8_DIFF
