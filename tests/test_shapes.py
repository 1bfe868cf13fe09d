"""Presets against the seeds' tables (transcribed here from ../shared/seeds)."""

from __future__ import annotations

import pytest

from moekit.shapes import PRESETS, MoEShape, get_shape

# The MoE tax paper, Table 2: hidden, MoE intermediate, routed experts, experts per token,
# shared experts, layers.
TAX_TABLE_2 = {
    "mixtral-8x7b": (4096, 14336, 8, 2, 0, 32),
    "qwen2-moe": (3584, 2560, 64, 8, 8, 28),
    "deepseek-v3": (7168, 2048, 256, 8, 1, 61),
}
# The RaMP paper, Table IV: E, fused up-projection width 2N, hidden H.
RAMP_TABLE_IV = {"olmoe-1b-7b": (64, 2048, 2048), "qwen3-30b-a3b": (128, 1536, 2048)}
# DiT-MoE public release (the models of the DICE paper): layers, hidden, E, K.
DIT_MOE = {"dit-moe-xl": (28, 1152, 8, 2), "dit-moe-g": (40, 1408, 16, 2)}


@pytest.mark.parametrize("name", sorted(TAX_TABLE_2))
def test_tax_seed_table(name):
    s = get_shape(name)
    assert (s.hidden, s.intermediate, s.num_experts, s.top_k, s.num_shared_experts, s.num_layers) == TAX_TABLE_2[name]


@pytest.mark.parametrize("name", sorted(RAMP_TABLE_IV))
def test_ramp_seed_table(name):
    s = get_shape(name)
    assert (s.num_experts, 2 * s.intermediate, s.hidden) == RAMP_TABLE_IV[name]
    assert s.top_k == 8


@pytest.mark.parametrize("name", sorted(DIT_MOE))
def test_dit_moe(name):
    s = get_shape(name)
    assert (s.num_layers, s.hidden, s.num_experts, s.top_k) == DIT_MOE[name]
    assert s.intermediate == 4 * s.hidden and s.num_shared_experts == 2


def test_all_seven_presets_and_errors():
    assert set(PRESETS) == set(TAX_TABLE_2) | set(RAMP_TABLE_IV) | set(DIT_MOE)
    with pytest.raises(ValueError, match="unknown shape"):
        get_shape("gpt-5")
    with pytest.raises(ValueError, match="top_k"):
        MoEShape("bad", num_experts=4, top_k=5, hidden=8, intermediate=8)
    assert get_shape("deepseek-v3").experts_per_rank(8) == 32
