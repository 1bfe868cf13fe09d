"""The argument checks the two fused-MoE entries share (``fused_moe``, ``fused_moe_expert_major``):
weights, FP8 scales, the config against the precision, and the FP8 activations.
"""

from __future__ import annotations

import torch

from moekit.kernels.configs import KernelConfig, fp8_config_error
from moekit.kernels.plan import DEFAULT_PLAN, LaunchPlan
from moekit.kernels.quant import FP8_GROUP, quantize_groups_triton

SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)  # the 16/32-bit activations and weights
FP8 = torch.float8_e4m3fn


def check_weights(w13: torch.Tensor, w2: torch.Tensor, H: int, dtype: torch.dtype, device) -> tuple[int, int]:
    """Shapes, dtype (``dtype``: the activations', or e4m3 for FP8), device, layout of w13 and w2."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 must be [E, 2N, H] and w2 [E, H, N], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    E, two_n, h13 = w13.shape
    N = two_n // 2
    if two_n % 2 or h13 != H or tuple(w2.shape) != (E, H, N):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, 2N, H={H}] and [E, H={H}, N]")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != dtype:
            raise ValueError(f"{name} must have the activations' dtype {dtype}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the activations are on {device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    return E, N


def is_fp8_weights(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """True for FP8 W8A8 weights; mixed or other float8 formats are not implemented."""
    fp8 = [t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in (w13, w2)]
    if not any(fp8):
        return False
    if w13.dtype != FP8 or w2.dtype != FP8:
        raise NotImplementedError(f"FP8 experts need both w13 and w2 in {FP8} (W8A8 with block scales); "
                                  f"got w13 {w13.dtype} and w2 {w2.dtype}")
    return True


def check_scale(name: str, s: torch.Tensor | None, shape: tuple, device) -> torch.Tensor:
    if s is None:
        raise ValueError(f"{name} is required with FP8 weights/tokens: a float32 tensor of shape {shape}")
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != tuple(shape):
        got = f"{tuple(s.shape)} {s.dtype}" if isinstance(s, torch.Tensor) else type(s).__name__
        raise ValueError(f"{name} must be a float32 tensor of shape {tuple(shape)}, got {got}")
    if s.device != device:
        raise ValueError(f"{name} is on {s.device} but the activations are on {device}")
    return s


def fp8_weight_scales(E: int, N: int, H: int, w13_scale, w2_scale, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the FP8 shape constraints and the weight block scales (quantize_blocks(w, 128))."""
    g = FP8_GROUP
    if H % g:
        raise ValueError(f"FP8 needs the hidden size H to be a multiple of {g}, got H={H}")
    if N % g:
        raise ValueError(f"FP8 needs the intermediate size N to be a multiple of {g}, got N={N}")
    w13_scale = check_scale("w13_scale", w13_scale, (E, 2 * N // g, H // g), device)
    w2_scale = check_scale("w2_scale", w2_scale, (E, H // g, N // g), device)
    return w13_scale, w2_scale


def no_scales(**scales) -> None:
    for name, s in scales.items():
        if s is not None:
            raise ValueError(f"{name} is only for FP8 ({FP8}) weights/tokens; the inputs are not FP8")


def check_config(config: KernelConfig, fp8: bool) -> None:
    """The FP8 rules for FP8 weights; 16/32-bit weights have no dots to swap."""
    err = fp8_config_error(config) if fp8 else None
    if err:
        raise ValueError(f"config is not valid for FP8: {err}")
    if config.swap_ab and not fp8:
        raise ValueError("KernelConfig.swap_ab is for FP8 weights only (it swaps the FP8 dots' operands)")



def fp8_activations(a: torch.Tensor, a_scale, scale_name: str,
                    plan: LaunchPlan = DEFAULT_PLAN) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, their [rows, H/128] scales) of 2-D ``a``: quantized here (one Triton launch)
    when ``a`` is 16/32-bit, validated when it comes already quantized."""
    rows, H = a.shape
    if a.dtype == FP8:
        return a, check_scale(scale_name, a_scale, (rows, H // FP8_GROUP), a.device).contiguous()
    no_scales(**{scale_name: a_scale})
    return quantize_groups_triton(a, plan)
