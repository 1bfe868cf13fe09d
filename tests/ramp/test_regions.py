"""The region analysis: grids (Eq. 1) per launch against hand-computed values, the variables,
the predictions, and the kernel constants it mirrors."""

from __future__ import annotations


import pytest
import torch

from moekit.kernels.configs import KernelConfig
from moekit.ramp import regions as rg
from moekit.shapes import MoEShape

HW = rg.HARDWARE["h200"]
SHAPE = MoEShape("small", num_experts=4, top_k=2, hidden=256, intermediate=128)


def test_sorted_two_launch_grid_by_hand():
    c = KernelConfig(bm=16, bn=64, bk=64, num_warps=4, num_stages=3, split_k=4, form="two_launch")
    counts = [17, 0, 3, 40]
    # blocks = ceil(17/16) + 0 + ceil(3/16) + ceil(40/16) = 2 + 0 + 1 + 3 = 6
    # GEMM1: 6 blocks x (N / bn = 2) tiles; GEMM2: 6 x (H / bn = 4) tiles x split_k 4
    # Resident GEMM1 CTAs per SM: smem 3 * (16*64 + 2*64*64) * 2 = 55296 B -> 233472 // (55296 + 1024) = 4;
    # registers (2*16*64/128 = 16 acc + 64) = 80 -> 2560 per warp -> 65536 // 2560 // 4 = 6; threads 16.
    # GEMM2: smem 3 * (16*64 + 64*64) * 2 = 30720 -> 7; regs 16*64/128 = 8 + 64 = 72 -> 2304 -> 7; -> 7.
    assert rg.grids(SHAPE, c, counts, HW, M=30) == [(12, 132 * 4), (96, 132 * 7)]


def test_fused_direct_grid_counts_named_experts():
    c = KernelConfig(bm=32, bn=32, bk=64, form="fused")
    counts = [3, 0, 5, 1]  # M = 5 <= bm: direct addressing, one block per named expert
    G, S = rg.grids(SHAPE, c, counts, HW, M=5)[0]
    assert G == 3 * (128 // 32)
    assert rg.grid_plan(SHAPE, c, 5, HW).path == "direct"
    assert rg.grid_plan(SHAPE, c, 33, HW).path == "sorted"


def test_decode_schedule_is_persistent_with_split_shares():
    c = KernelConfig(bm=16, bn=64, bk=64, num_warps=4, num_stages=3, split_k=1, form="two_launch")
    plan = rg.grid_plan(SHAPE, c, 4, HW)
    assert plan.path == "direct" and [ln.name for ln in plan.launches] == ["persistent-1", "persistent-2"]
    P = 132 * min(4, rg.KERNEL_PLAN.persistent_ctas_per_sm)  # 4 resident (as above), capped at 2
    assert plan.launches[0].slots == P
    # 2 named experts x 2 N tiles = 4 tiles -> P // 4 shares, capped at min(H / bk = 4, 8) = 4
    assert plan.grids(2)[0] == (2 * 2 * 4, P)
    # phase 2: (named expert, 32-column tile) work: 2 x 256 / 32
    assert plan.grids(2)[1] == (2 * 8, P)
    assert plan.grids(0) == [(0, P), (0, P)]


def test_expert_major_grid_clamps_counts_and_bounds_slots():
    c = KernelConfig(bm=16, bn=64, bk=64, num_warps=4, num_stages=3, split_k=1, form="two_launch")
    counts = [300, 0, 20, 1]  # capacity 32: expert 0 holds 32 rows
    g = rg.grids(SHAPE, c, counts, HW, family="expert_major", capacity=32)
    blocks = 2 + 0 + 2 + 1
    bound = 4 * 2  # E x ceil(32 / 16) blocks at most
    assert g == [(blocks * 2, min(bound * 2, 132 * 4)), (blocks * 4, min(bound * 4, 132 * 4))]
    with pytest.raises(ValueError, match="capacity"):
        rg.grid_plan(SHAPE, c, 1, HW, family="expert_major")


def test_token_blocks_and_bad_counts():
    assert rg.token_blocks([0, 1, 16, 17, 33], 16) == 0 + 1 + 1 + 2 + 3
    assert rg.token_blocks(torch.tensor([100, 5]), 64, capacity=50) == 1 + 1
    with pytest.raises(ValueError, match="counts"):
        rg.token_blocks([-1], 16)
    with pytest.raises(ValueError, match="family"):
        rg.grid_plan(SHAPE, KernelConfig(), 1, HW, family="nope")


def test_region_variables_by_hand():
    c = KernelConfig(bm=64, bn=128, bk=64, num_warps=4, num_stages=3, form="fused")
    v = rg.region_variables(SHAPE, c, [100, 0, 0, 28], HW, M=64)
    assert v.rho == pytest.approx(2 * 64 * 128 * 256 / 64**3)
    assert v.lam == pytest.approx(2 * 128 * 256 * 2 / (0.75 * 60 * 2**20))
    assert v.kappa == 128 // 64
    G, S = v.grid[0]
    assert G == (2 + 1) * 1 and v.omega == pytest.approx(G / S)


def test_predictions_follow_the_thresholds():
    big = MoEShape("big", num_experts=8, top_k=2, hidden=4096, intermediate=14336)
    # Two experts with many rows: GROUP_M (lam > 1 and > one 64-row block per expert).
    p = rg.predict_point(big, [200, 0, 0, 0, 0, 0, 0, 56], 128, HW)
    assert p.group_m and not p.small_bm
    # One token: a GEMM2 grid of 2 experts x 16 tiles = 32, x4 = 128 <= 132 SMs, kappa = 224.
    p1 = rg.predict_point(big, [1, 0, 0, 1, 0, 0, 0, 0], 1, HW)
    assert p1.split_k and not p1.group_m and p1.small_bm
    small = MoEShape("olmoe-like", num_experts=64, top_k=8, hidden=2048, intermediate=1024)
    modes = rg.predict_modes(small, HW)
    assert modes["region"] == "A" and "GROUP_M" not in modes["modes"] and "split-K" not in modes["modes"]
    assert rg.predict_modes(big, HW)["region"] == "B"


def test_hardware_presets_and_errors():
    assert rg.hardware_for("h100").l2_bytes == 50 * 2**20
    assert rg.hardware_for("H200").l2_bytes == 60 * 2**20
    assert rg.gpu_key("NVIDIA H100 80GB HBM3") == "h100"
    assert rg.gpu_key("NVIDIA H200") == "h200"
    assert rg.gpu_key("Some GPU X") == "some-gpu-x"
    with pytest.raises(ValueError, match="gpu must be one of"):
        rg.hardware_for("a100")


def test_grids_follow_the_kernels_default_launch_plan():
    """The region grids read the kernels' own LaunchPlan defaults, not copies of them."""
    from moekit.kernels.plan import LaunchPlan

    assert rg.KERNEL_PLAN == LaunchPlan()


def test_wave_fill():
    assert rg.wave_fill(133, 132) == pytest.approx(1 / 132)
    assert rg.wave_fill(132, 132) == 1.0
    assert rg.wave_fill(0, 132) == 0.0
