"""The DiT-MoE model: presets, shapes, adaLN-Zero, guidance, the MoE FFN against moekit's
float64 reference, and the batch-invariant mode."""

from __future__ import annotations

import pytest
import torch

from moekit.dice import DiTMoE, DiTMoEConfig, digits_config, get_config
from moekit.dice.dit_moe import PRESETS, route
from moekit.dice.exact import RowwiseExperts, expert_mlp, rowwise_linear
from moekit.moe import MoEWeights, reference_moe
from moekit.shapes import get_shape


SMALL = digits_config(hidden=32, depth=2, num_heads=2, num_experts=4)


def test_presets_follow_moekit_shapes():
    for name in ("dit-moe-xl", "dit-moe-g"):
        cfg, shape = get_config(name), get_shape(name)
        assert cfg.moe_shape == shape.scaled(name=name)
        assert cfg.tokens_per_image == 256  # 256 x 256 images: a 32 x 32 latent in 2 x 2 patches
    assert get_config("dit-moe-s").moe_shape.intermediate == 4 * 384
    assert get_config("dit-moe-b").hidden == 768
    assert set(PRESETS) >= {"dit-moe-s", "dit-moe-b", "dit-moe-xl", "dit-moe-g", "dit-moe-digits"}
    with pytest.raises(ValueError, match="unknown DiT-MoE preset 'dit-moe-h'"):
        get_config("dit-moe-h")


@pytest.mark.parametrize("kwargs, match", [
    (dict(hidden=30, num_heads=4), "hidden=30 must be num_heads"),
    (dict(input_size=9), "input_size=9 must be a multiple"),
    (dict(top_k=9), "top_k must be in"),
    (dict(depth=0), "depth must be a positive int"),
    (dict(class_dropout=1.0), "class_dropout"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DiTMoEConfig(**kwargs)


def test_adaln_zero_starts_as_zero_velocity_and_shapes_are_kept():
    model = DiTMoE(SMALL, seed=0)
    x = torch.randn(3, 1, 8, 8)
    v = model(x, torch.rand(3), torch.tensor([0, 1, 10]))
    assert v.shape == x.shape and torch.equal(v, torch.zeros_like(v))
    assert torch.equal(model.unpatchify(model.patchify(x)), x)
    with pytest.raises(ValueError, match="x must be"):
        model(torch.randn(3, 2, 8, 8), torch.rand(3), torch.zeros(3, dtype=torch.long))


def test_patchify_is_a_strided_convolution():
    model = DiTMoE(SMALL, seed=0)
    x = torch.randn(2, 1, 8, 8)
    conv = torch.nn.functional.conv2d(x, model.patch.weight.view(32, 1, 2, 2), model.patch.bias, stride=2)
    ours = torch.nn.functional.linear(model.patchify(x), model.patch.weight, model.patch.bias)
    torch.testing.assert_close(ours, conv.flatten(2).transpose(1, 2))


def test_guidance_combines_conditional_and_null_velocities():
    model = DiTMoE(SMALL, seed=1, adaln_zero=False)
    x, t, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([3, 4])
    cond, null = model(x, t, y), model(x, t, torch.full_like(y, 10))
    torch.testing.assert_close(model.forward_with_cfg(x, t, y, 3.0), null + 3.0 * (cond - null), rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(model.forward_with_cfg(x, t, y, 1.0), cond)


def test_moe_ffn_matches_the_float64_reference():
    model = DiTMoE(SMALL, seed=2)
    ffn = model.blocks[0].moe
    h = torch.randn(40, 32)
    probs, weights, ids = route(h, ffn.router, 2)
    assert torch.equal(weights, probs.gather(1, ids))  # no renormalization
    assert (weights.sum(1) < 1).all()
    w = ffn.weights()
    ref = reference_moe(h, w.to(torch.float64), ids, weights)
    err = ((ffn(h).double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5


def test_batch_invariant_mode_makes_each_sample_independent_of_its_batch():
    model = DiTMoE(SMALL, seed=3, adaln_zero=False).set_batch_invariant(True)
    x, t, y = torch.randn(5, 1, 8, 8), torch.rand(5), torch.tensor([0, 1, 2, 3, 4])
    together = model(x, t, y)
    for i in range(5):
        assert torch.equal(model(x[i:i + 1], t[i:i + 1], y[i:i + 1]), together[i:i + 1])
    model.set_batch_invariant(False)
    torch.testing.assert_close(model(x, t, y), together, rtol=1e-4, atol=1e-5)


def test_rowwise_pieces_match_plain_math():
    x, w, b = torch.randn(7, 16), torch.randn(24, 16), torch.randn(24)
    torch.testing.assert_close(rowwise_linear(x, w, b), x @ w.t() + b)
    weights = MoEWeights.random(digits_config().moe_shape.scaled(hidden=16, intermediate=8), seed=1)
    experts = RowwiseExperts(weights.w13[:2], weights.w2[:2])
    tokens = torch.randn(2, 5, 16)
    out = experts(tokens, torch.tensor([5, 3]))
    for e in range(2):  # every row as if it were alone, whatever the capacity around it
        for r in range(5):
            assert torch.equal(out[e, r:r + 1], expert_mlp(tokens[e, r:r + 1], weights.w13[e], weights.w2[e],
                                                           batch_invariant=True))
    ref = torch.nn.functional.silu(tokens[0] @ weights.w13[0][:8].t()) * (tokens[0] @ weights.w13[0][8:].t())
    torch.testing.assert_close(out[0], ref @ weights.w2[0].t())
