"""The configuration space: valid, within the shared-memory bound, frozen and hashable."""

from __future__ import annotations

import dataclasses

import pytest

from moekit.kernels.configs import HOPPER_SMEM_PER_BLOCK, KernelConfig, config_space, default_config
from moekit.shapes import PRESETS


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
                                    dict(form="fused", split_k=2)])
def test_invalid_config(kwargs):
    with pytest.raises(ValueError):
        KernelConfig(**kwargs)


@pytest.mark.parametrize("M", [1, 4, 64, 512, 4096])
def test_default_config_valid(M):
    for shape in PRESETS.values():
        c = default_config(M, shape)
        assert c.fits()
