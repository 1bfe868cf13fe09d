"""FP8 (e4m3) quantization with the block scales DeepSeek-V3's kernels use, in plain torch.

Two granularities, both with float32 scales chosen so the largest magnitude of a group maps to
the largest finite e4m3 value (448):

* activations: one scale per token per group of ``group`` consecutive columns (1 x 128),
  :func:`quantize_groups` / :func:`dequantize_groups`;
* weights: one scale per ``block x block`` tile of the last two dimensions (128 x 128),
  :func:`quantize_blocks` / :func:`dequantize_blocks`.

These are the references the Triton paths (the low-latency layer's fused quantization, the W8A8
fused MoE kernel) are tested against, and the CPU implementation of the low-latency layer uses
them directly: ``torch.float8_e4m3fn`` works on the CPU.

Error bound (:func:`e4m3_error_bound`): e4m3 keeps 3 mantissa bits, so a value in the normal
range is rounded to within half a unit in the last place, 2**-4 of its magnitude; below the
smallest normal (2**-6) the spacing is fixed at 2**-9, so the error is at most 2**-10, in units
of the group's scale. :func:`calc_diff` is DeepEP's similarity test metric.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_MIN_AMAX = 1e-4  # an all-zero group gets this amax, so its scale is not zero


def _check_groups(x: torch.Tensor, group: int, what: str) -> None:
    if group <= 0:
        raise ValueError(f"group must be positive, got {group}")
    if x.dim() < 1 or x.shape[-1] % group:
        raise ValueError(f"{what}'s last dimension ({tuple(x.shape)}) must be a multiple of group={group}")


def quantize_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x[..., H] -> (q[..., H] float8_e4m3fn, scales[..., H // group] float32), x ~ q * scale."""
    _check_groups(x, group, "x")
    g = x.float().unflatten(-1, (x.shape[-1] // group, group))
    amax = g.abs().amax(dim=-1).clamp_min(_MIN_AMAX)
    scales = amax / FP8_MAX
    q = (g / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2), scales


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_groups` (up to the e4m3 rounding): q * scale per group."""
    group = q.shape[-1] // scales.shape[-1] if scales.shape[-1] else 1
    if scales.shape[:-1] != q.shape[:-1] or scales.shape[-1] * group != q.shape[-1]:
        raise ValueError(f"scales {tuple(scales.shape)} do not tile q {tuple(q.shape)} in groups")
    g = q.float().unflatten(-1, (scales.shape[-1], group)) * scales.float().unsqueeze(-1)
    return g.flatten(-2).to(dtype)


def quantize_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w[..., R, C] -> (q float8_e4m3fn, scales[..., ceil(R/block), ceil(C/block)] float32).

    Partial edge blocks are allowed (their scale covers the rows/columns that exist)."""
    if w.dim() < 2:
        raise ValueError(f"w must have at least 2 dimensions, got {tuple(w.shape)}")
    R, C = w.shape[-2:]
    rb, cb = -(-R // block), -(-C // block)
    padded = torch.nn.functional.pad(w.float(), (0, cb * block - C, 0, rb * block - R))
    tiles = padded.unflatten(-1, (cb, block)).unflatten(-3, (rb, block))  # [..., rb, block, cb, block]
    amax = tiles.abs().amax(dim=(-3, -1)).clamp_min(_MIN_AMAX)  # [..., rb, cb]
    scales = amax / FP8_MAX
    q = (tiles / scales[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.flatten(-2).flatten(-3, -2)[..., :R, :C].to(FP8_DTYPE)
    return q.contiguous(), scales


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block: int = 128,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks` (up to the e4m3 rounding)."""
    R, C = q.shape[-2:]
    full = scales.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :R, :C]
    return (q.float() * full).to(dtype)


def e4m3_error_bound(x: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Per-element bound on |x - dequantize(quantize(x))| for group quantization of x."""
    s = scales.float().repeat_interleave(group, dim=-1)
    return torch.maximum(x.float().abs() * 2.0 ** -4, s * 2.0 ** -10) * (1 + 1e-6)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's test metric: 1 - 2<x,y> / (|x|^2 + |y|^2), in float64 (0 for identical)."""
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)
