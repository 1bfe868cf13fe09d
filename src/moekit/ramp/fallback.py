"""The choice RaMP makes where no fitted model exists: region analysis and hardware constants.

Without profiling, nothing says how fast a particular compiled configuration is, so the
fallback does two things:

1. It restricts itself to a few **template** configurations (:func:`templates`), one or two
   per token block, whose modes the region analysis picks for the shape: GROUP_M where an
   expert's weights overflow the effective L2, split-K variants where the K-reduction is deep
   enough, the narrow deep-reduction decode tile, GEMM2's wide tile at large blocks; the
   two_launch form only (the fused form's cost grows with N / bn atomic adds over H, which
   none of the region variables sees). On the committed H200 dataset these templates hold a
   configuration within a few per cent of the best at almost every point.
2. Among them it takes the least **analytic estimate** (:func:`estimate_us`): launches, the
   expert weights streamed once from HBM, and per launch the waves ``ceil(G / S)`` times one
   wave's time, a CTA's tensor-core work (rows padded to the 64-row warpgroup MMA, narrow tiles
   at a fraction of the peak rate) or its operand traffic from L2, whichever is longer.

Checked on the H200 dataset (docs/ramp.md): faster than ``torch._grouped_mm`` at all 140
points and than ``default_config`` on average; a fitted model does much better (profile!).
"""

from __future__ import annotations

import math

import torch

from moekit.kernels.configs import KernelConfig, config_space
from moekit.ramp.regions import Hardware, grid_plan, predict_modes, token_blocks
from moekit.shapes import MoEShape

LAUNCH_US = 3.0  # one kernel launch inside a call, with its tail (measured 2-4 µs on an H200 in graphs)
ALIGN_US = 6.0  # the sorted path's alignment (4-11 µs on an H200: docs/kernel.md)
WGMMA_ROWS = 64  # Hopper's warpgroup MMA takes 64-row left operands: fewer rows still cost 64
FULL_RATE_BN = 128  # narrower output tiles reach this fraction of the tensor rate: bn / 128
L2_OVER_HBM = 2.5  # L2 bandwidth over HBM bandwidth (H100 / H200, rough)
DEFAULT_RATES = (4300.0, 790.0)  # GB/s, TFLOP/s where the hardware does not say
# The block-scaled W8A8 kernels' MMAs reach about the bf16 rate, not twice it: the accumulator is
# rescaled after every 128-deep k-block, which waits for that block's MMAs (docs/ramp.md).
FP8_RATE_OVER_BF16 = 1.0
FP8_WARPS_64 = 8  # FP8 64-row tiles take two warpgroups: one alone waits out each rescale
# FP8 calls with larger token blocks run this much slower than the estimate says, relative to
# 16-row blocks (measured / estimated, medians over the qwen3-30b-a3b and olmoe-1b-7b H100 FP8
# profiles, which agree within 0.1; checked on the other FP8 profiles: docs/ramp.md).
FP8_BLOCK_FACTOR = {16: 1.0, 32: 1.4, 64: 1.5, 128: 1.8}

# (bm, bn, bk, warps, stages, swizzle allowed, GEMM2 tile) of the bf16 templates; FP8's use
# bn = bk = 128 (see templates()).
_TEMPLATES = (
    (16, 32, 256, 4, 3, False, 0),
    (16, 64, 128, 4, 3, True, 0),
    (16, 128, 128, 4, 3, True, 0),
    (32, 64, 128, 4, 3, True, 0),
    (32, 128, 128, 4, 2, True, 0),
    (64, 128, 64, 4, 4, True, 0),
    (64, 64, 64, 4, 3, True, 256),
    (128, 128, 64, 8, 4, True, 256),
)


def templates(shape: MoEShape, hw: Hardware, dtype: torch.dtype = torch.bfloat16,
              routed_experts: int | None = None) -> list[KernelConfig]:
    """The fallback's candidate configurations for ``shape`` (all in its config space)."""
    fp8 = dtype == torch.float8_e4m3fn
    elem = 1 if fp8 else 2
    modes = predict_modes(shape, hw, elem, routed_experts)["modes"]
    g = 8 if "GROUP_M" in modes else 1
    splits = (1, 4) if "split-K" in modes else (1,)
    space = config_space(shape, dtype=dtype)
    ok = set(space)
    out = []
    for bm, bn, bk, warps, stages, swizzle, bn2 in _TEMPLATES:
        if fp8:
            bn, bk, bn2 = max(bn, 128), 128, 0
            warps = FP8_WARPS_64 if bm == 64 else warps
        for sk in splits if not bn2 else (1,):
            c = KernelConfig(bm=bm, bn=bn, bk=bk, num_warps=warps, num_stages=stages,
                             group_m=g if swizzle else 1, split_k=sk, form="two_launch", bn2=bn2,
                             swap_ab=fp8 and bm < 64)
            if c in ok and c not in out:
                out.append(c)
    if not out:  # a shape so small that no template fits: the space's first two_launch config
        out = [next(c for c in space if c.form == "two_launch")]
    return out


def estimate_us(shape: MoEShape, config: KernelConfig, counts, M: int, hw: Hardware, elem_bytes: int = 2) -> float:
    """An analytic time of one call (µs) from hardware constants and the histogram."""
    c = config
    plan = grid_plan(shape, c, M, hw, elem_bytes=elem_bytes)
    x = token_blocks(counts, c.bm)
    vals = counts.tolist() if hasattr(counts, "tolist") else list(counts)
    active = sum(1 for n in vals if n > 0)
    H, N = shape.hidden, shape.intermediate
    gbps, tflops = hw.hbm_gbps or DEFAULT_RATES[0], hw.bf16_tflops or DEFAULT_RATES[1]
    if elem_bytes == 1:
        tflops *= FP8_RATE_OVER_BF16
    peak_sm = tflops * 1e6 / hw.sms  # flop per µs per SM
    l2_sm = L2_OVER_HBM * gbps * 1e3 / hw.sms  # bytes per µs per SM
    waves_us = 0.0
    for launch, (G, S) in zip(plan.launches, plan.grids(x)):
        if G == 0:
            continue
        first = launch.name in ("gemm1", "fused", "persistent-1")
        bn = c.bn if first else c.gemm2_bn
        K = H if first else N / c.split_k
        if launch.name == "persistent-2":  # the decode GEMM2: 32-column tiles of 16 rows
            flops = 2 * 16 * 32 * N
        elif first:
            flops = 2 * c.bm * 2 * c.bn * H + (2 * c.bm * c.bn * H if launch.name == "fused" else 0)
        else:
            flops = 2 * c.bm * c.gemm2_bn * K
        if launch.name == "persistent-1":  # each unit is one share of a tile's reduction
            flops /= max(1, G // max(1, x * launch.per_block))
        # Rows padded to the warpgroup MMA's 64, narrow tiles below the full rate. (A heuristic
        # calibrated on the H200 dataset: docs/ramp.md.) Swapped FP8 dots put the tokens on the
        # MMA's narrow side, which needs no padding.
        rows = c.bm if c.swap_ab else max(c.bm, WGMMA_ROWS)
        flops *= rows / c.bm / min(1.0, bn / FULL_RATE_BN)
        operand_bytes = (c.bm * K + (2 if first else 1) * bn * K) * elem_bytes
        per_cta = max(flops / peak_sm, operand_bytes / l2_sm)
        waves_us += math.ceil(G / S) * per_cta * (S / hw.sms)
    weights_us = active * 3 * H * N * elem_bytes / (gbps * 1e3)
    fixed = LAUNCH_US * len(plan.launches) + (ALIGN_US if plan.path == "sorted" else 0.0)
    factor = FP8_BLOCK_FACTOR.get(c.bm, 1.0) if elem_bytes == 1 else 1.0
    return fixed + factor * max(waves_us, weights_us)


def fallback_choice(shape: MoEShape, counts, M: int, hw: Hardware, dtype: torch.dtype = torch.bfloat16,
                    candidates: list[KernelConfig] | None = None) -> KernelConfig:
    """The template with the least analytic estimate for this histogram."""
    cands = candidates or templates(shape, hw, dtype)
    elem = 1 if dtype == torch.float8_e4m3fn else 2
    return min(cands, key=lambda c: estimate_us(shape, c, counts, M, hw, elem))

