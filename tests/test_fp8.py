import pytest
import torch

from moekit.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    calc_diff,
    dequantize_blocks,
    dequantize_groups,
    e4m3_error_bound,
    quantize_blocks,
    quantize_groups,
)


def _random(shape, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    # Mix magnitudes across groups so scales differ and some values fall in e4m3's subnormals.
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return x * torch.exp(scale * torch.randn(shape[:-1] + (1,), generator=g, dtype=torch.float64))


@pytest.mark.parametrize("seed", range(4))
def test_group_round_trip_within_bound(seed):
    x = _random((37, 512), seed).float()
    q, s = quantize_groups(x, 128)
    assert q.dtype == FP8_DTYPE and s.shape == (37, 4) and s.dtype == torch.float32
    err = (dequantize_groups(q, s) - x).abs()
    assert torch.all(err <= e4m3_error_bound(x, s, 128))
    # The largest element of every group uses the top of the e4m3 range.
    assert torch.allclose(q.float().abs().unflatten(-1, (4, 128)).amax(-1), torch.full((37, 4), FP8_MAX))


def test_error_bound_is_tight_enough_to_catch_a_wrong_scale():
    x = _random((16, 256), 7).float()
    q, s = quantize_groups(x, 128)
    wrong = dequantize_groups(q, s * 1.1)
    assert not torch.all((wrong - x).abs() <= e4m3_error_bound(x, s, 128))


def test_zero_group_and_bad_shapes():
    x = torch.zeros(2, 128)
    q, s = quantize_groups(x)
    assert torch.equal(dequantize_groups(q, s), x) and torch.all(s > 0)
    with pytest.raises(ValueError, match="multiple of group"):
        quantize_groups(torch.ones(2, 100), 128)


@pytest.mark.parametrize("shape", [(3, 256, 384), (2, 200, 130)])
def test_block_round_trip(shape):
    w = _random(shape, 11, scale=1.0).float()
    q, s = quantize_blocks(w, 128)
    assert q.shape == w.shape and s.shape == (shape[0], -(-shape[1] // 128), -(-shape[2] // 128))
    deq = dequantize_blocks(q, s, 128)
    full = s.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., : shape[1], : shape[2]]
    bound = torch.maximum(w.abs() * 2.0 ** -4, full * 2.0 ** -10) * (1 + 1e-6)
    assert torch.all((deq - w).abs() <= bound)
    assert calc_diff(deq, w) < 1e-3


def test_calc_diff():
    x = _random((8, 64), 3)
    assert calc_diff(x, x) == pytest.approx(0.0, abs=1e-15)
    assert calc_diff(x, -x) == pytest.approx(2.0)
    assert calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
