"""The configuration space: valid, within the shared-memory bound, frozen and hashable."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moekit.kernels.configs import (
    HOPPER_SMEM_PER_BLOCK,
    KernelConfig,
    config_space,
    default_config,
    fp8_config_error,
)
from moekit.shapes import PRESETS, MoEShape


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_space_per_preset(name):
    space = config_space(PRESETS[name])
    assert len(space) >= 100, len(space)
    assert len(set(space)) == len(space)  # no duplicates
    for c in space:
        assert c.smem_bytes(2) <= HOPPER_SMEM_PER_BLOCK
        assert c.fits()
    # every polymorphic mode is represented
    assert {c.form for c in space} == {"two_launch", "fused"}
    assert {c.bm for c in space} == {16, 32, 64, 128}
    assert {c.group_m for c in space} == {1, 8}
    assert {c.split_k for c in space} == {1, 4}
    assert all(c.split_k == 1 for c in space if c.form == "fused")


def test_space_is_deterministic():
    s = PRESETS["olmoe-1b-7b"]
    assert config_space(s) == config_space(s)


def test_smaller_smem_limit_shrinks_space():
    s = PRESETS["mixtral-8x7b"]
    full = config_space(s)
    small = [c for c in full if c.fits(smem_limit=100 * 1024)]
    assert 0 < len(small) < len(full)


def test_frozen_and_hashable():
    c = KernelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.bm = 32  # type: ignore[misc]
    assert {c: 1}[KernelConfig()] == 1
    assert hash(c) == hash(KernelConfig())


@pytest.mark.parametrize("kwargs", [dict(bm=8), dict(bn=48), dict(bk=8), dict(num_warps=3), dict(num_stages=0),
                                    dict(group_m=0), dict(split_k=0), dict(form="other"),
                                    dict(form="fused", split_k=2), dict(bn2=48), dict(bn2=8),
                                    dict(form="fused", bn2=256)])
def test_invalid_config(kwargs):
    with pytest.raises(ValueError):
        KernelConfig(**kwargs)


@pytest.mark.parametrize("M", [1, 4, 64, 512, 4096])
def test_default_config_valid(M):
    for shape in PRESETS.values():
        c = default_config(M, shape)
        assert c.fits()


# --- FP8 W8A8 space ------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_fp8_space_per_preset(name):
    space = config_space(PRESETS[name], dtype=FP8)
    assert len(space) >= 100, len(space)
    assert len(set(space)) == len(space)
    for c in space:
        assert fp8_config_error(c) is None, c
        assert c.bk == 128 and c.bn in (128, 256)
        assert c.smem_bytes(1) <= HOPPER_SMEM_PER_BLOCK and c.fits(elem_bytes=1)
    assert {c.form for c in space} == {"two_launch", "fused"}
    assert {c.bm for c in space} == {16, 32, 64, 128}
    assert {c.group_m for c in space} == {1, 8}
    assert {c.split_k for c in space} == {1, 4}
    assert {c.bn for c in space if c.form == "two_launch"} == {128, 256}
    assert all(c.bn == 128 and c.split_k == 1 for c in space if c.form == "fused")
    # 1-byte tiles admit pipelines that bf16 tiles of the same shape cannot fit
    assert any(not c.fits(elem_bytes=2) for c in space)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_fp8_swapped_dots_are_a_mode_of_the_space(name):
    """Every FP8 config with bm < 64 comes both ways (swap_ab), bm >= 64 never swapped (the
    warpgroup MMA takes those blocks as they are); bf16 has no swapped configs."""
    space = config_space(PRESETS[name], dtype=FP8)
    swapped = [c for c in space if c.swap_ab]
    small = [c for c in space if c.bm < 64 and not c.swap_ab]
    assert swapped and {dataclasses.replace(c, swap_ab=False) for c in swapped} == set(small)
    assert len(space) == 2 * len(small) + sum(c.bm >= 64 for c in space)
    assert not any(c.swap_ab for c in config_space(PRESETS[name]))


def test_swap_ab_validation():
    assert KernelConfig(bm=32, bn=128, bk=128, swap_ab=True).swap_ab
    with pytest.raises(ValueError, match="swap_ab needs bm < 64"):
        KernelConfig(bm=64, bn=128, bk=128, swap_ab=True)
    with pytest.raises(ValueError, match="swap_ab must be a bool"):
        KernelConfig(bm=16, bn=128, bk=128, swap_ab=1)


def test_fp8_space_small_shape_drops_wide_tiles():
    tiny = MoEShape("tiny", num_experts=4, top_k=2, hidden=128, intermediate=128)
    space = config_space(tiny, dtype=FP8)
    assert space and all(c.bn == 128 for c in space)


def test_bf16_space_unchanged_by_fp8():
    # the bf16 space keeps its families (no FP8-only depth 5 or bk = 128 only)
    space = config_space(PRESETS["mixtral-8x7b"])
    assert len(space) == 317  # 240 general tiles + 24 with GEMM2's wide tile + 53 narrow decode tiles
    assert max(c.num_stages for c in space) == 4


def test_decode_tiles_only_for_small_token_blocks():
    space = config_space(PRESETS["deepseek-v3"])
    narrow = [c for c in space if c.bn < 64 or c.bk == 256]
    assert {(c.bn, c.bk) for c in narrow} == {(16, 256), (32, 128), (32, 256)}
    assert {c.bm for c in narrow} == {16, 32} and {c.group_m for c in narrow} == {1}
    assert {c.form for c in narrow} == {"two_launch", "fused"}


@pytest.mark.parametrize("kwargs,match", [
    (dict(bk=64), "bk must be 128"),
    (dict(bn=64), "bn must be a multiple of 128"),
    (dict(bn=256, form="fused"), "bn must be 128 for FP8 in the fused form"),
])
def test_fp8_config_error(kwargs, match):
    cfg = KernelConfig(**{**dict(bm=16, bn=128, bk=128), **kwargs})
    err = fp8_config_error(cfg)
    assert err is not None and match in err
    assert fp8_config_error(KernelConfig(bm=16, bn=128, bk=128)) is None


@pytest.mark.parametrize("M", [1, 4, 64, 512, 4096])
def test_default_config_fp8_valid(M):
    for shape in PRESETS.values():
        c = default_config(M, shape, dtype=FP8)
        assert fp8_config_error(c) is None and c.fits(elem_bytes=1)
        assert c in config_space(shape, dtype=FP8)
        assert not default_config(M, shape).swap_ab


def test_wide_gemm2_tiles():
    """bn2 (GEMM2's own tile) appears for large two_launch token blocks in bf16 only, and counts
    in the shared memory and register estimates."""
    s = PRESETS["mixtral-8x7b"]
    wide = [c for c in config_space(s) if c.bn2]
    assert wide
    for c in wide:
        assert c.form == "two_launch" and c.split_k == 1 and c.bm >= 64 and c.bn2 > c.bn
        assert c.gemm2_bn == c.bn2 and dataclasses.replace(c, bn2=0) in config_space(s)
    assert not any(c.bn2 for c in config_space(s, dtype=torch.float8_e4m3fn))
    c = KernelConfig(bm=128, bn=128, bk=64, num_warps=8, num_stages=3, bn2=256)
    assert c.smem_bytes() == 3 * (128 * 64 + 2 * 128 * 64) * 2  # GEMM1's is still the larger
    assert c.acc_regs_per_thread() == 128
    assert KernelConfig(bm=128, bn=64, bk=64, num_warps=8, bn2=512).acc_regs_per_thread() == 256
    assert KernelConfig(bm=64, bn=64).gemm2_bn == 64
