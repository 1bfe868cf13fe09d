"""FP8 (e4m3) group quantization in Triton: the activation side of the W8A8 fused MoE kernel.

:func:`quantize_groups_triton` is ``moekit.fp8.quantize_groups(x, 128)`` in one launch: one
program per (block of rows, 128-column group) loads the group, takes its absolute maximum, and
writes the e4m3 values and the float32 scale. It is a Triton kernel rather than the torch
reference because the torch version is ~8 elementwise/reduction kernels (cast, abs, amax,
clamp, two divisions, clamp, cast), each a launch and a pass over [M, H]; at decode sizes those
launches cost more than the quantization itself. It reads nothing back to the host, so it can
be captured in a CUDA graph together with the MoE kernels.

Bitwise agreement with the torch reference. The scale is ``max(amax, 1e-4) / 448`` and the
value ``x / scale``, both with correctly rounded float32 division (``div_rn``; Triton's plain
``/`` on the GPU is an approximate division), then clamped to +-448 and rounded to nearest
even by the cast. So q and the scales equal ``quantize_groups`` exactly, on the GPU and in
Triton's CPU interpreter.

The interpreter (TRITON_INTERPRET=1, Triton 3.6) converts float32 to float8 wrongly: it drops
the extra mantissa bits and, with round-to-nearest-even, adds the rounding bit without carrying
it into the exponent (31.6 becomes 16, not 32). :func:`_e4m3_round` therefore
rounds to the e4m3 grid in float32 arithmetic first when ``SOFT_ROUND`` is set (only while
interpreting); the cast of an exactly representable value is then exact. The GPU uses the
hardware conversion (``cvt.rn.satfinite``), which needs no help. ``tl.dot`` on fp8 operands is
correct in the interpreter (it widens them to float16, which holds every e4m3 value, and
accumulates in float32), so the fp8 dots themselves need no switch.

The same :func:`quantize_tile` helper re-quantizes the SwiGLU output inside the fused MoE
kernels (``tiles.store_act`` and the fused form), so the activation and intermediate
quantizations cannot drift apart.
"""

from __future__ import annotations

import torch

from moekit.kernels.backend import HAVE_TRITON, check_device, interpreting, require_triton, tl, triton
from moekit.kernels.bound import launch as bound_launch
from moekit.kernels.pdl import early, launch_options, pdl_on
from moekit.kernels.plan import DEFAULT_PLAN, LaunchPlan

FP8_GROUP = 128  # activation group width and weight block size (DeepSeek-V3's 1x128 / 128x128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn; keep equal to moekit.fp8.FP8_MAX
MIN_AMAX = 1e-4  # keep equal to moekit.fp8._MIN_AMAX: an all-zero group must not get scale 0


if HAVE_TRITON:
    # Module constants a @triton.jit function reads must be tl.constexpr.
    _FP8_MAX = tl.constexpr(FP8_MAX)
    _MIN_AMAX = tl.constexpr(MIN_AMAX)

    from moekit.kernels.pdl import pdl_prologue

    @triton.jit
    def _e4m3_round(v):
        """Round float32 ``v`` (|v| <= 448) to the nearest e4m3 value, ties to even, in float32.

        The e4m3 spacing at magnitude 2**e is 2**(e - 3) for normal numbers (e >= -6) and the
        fixed subnormal spacing 2**-9 below. Scaling by the inverse spacing (a power of two,
        exact) leaves |v| < 16, and adding and subtracting 1.5 * 2**23 rounds that to an
        integer, ties to even, in float32 arithmetic (the float32 spacing there is 1).
        """
        bits = v.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127
        e = tl.maximum(e, -6)
        inv_ulp = ((127 + 3 - e) << 23).to(tl.float32, bitcast=True)  # 2**(3 - e)
        ulp = ((127 - 3 + e) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3)
        magic = 12582912.0  # 1.5 * 2**23
        r = tl.abs((v * inv_ulp + magic) - magic) * ulp
        # Put v's sign bit back with a bit operation: values that round to zero must give -0.0
        # as the hardware cast does, and Triton's unary minus is 0 - r, which gives +0.0.
        sign = (bits >> 31) << 31
        return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def quantize_tile(v, SOFT_ROUND: tl.constexpr):
        """One e4m3 group per row of float32 ``v`` [R, 128]: (q [R, 128] fp8, scale [R] float32)."""
        amax = tl.maximum(tl.max(tl.abs(v), axis=1), _MIN_AMAX)
        scale = tl.math.div_rn(amax, tl.full(amax.shape, _FP8_MAX, tl.float32))
        # A zero's quotient is that zero (sign and all). The correctly rounded division checks its
        # operands (FCHK on sm_90) and calls a slow subroutine for some, and the rows of a token
        # block past its tokens are all zeros: dividing a one in their place and keeping the zero
        # keeps the re-quantizing epilogues off that subroutine.
        zero = v == 0.0
        q = tl.math.div_rn(tl.where(zero, 1.0, v), tl.broadcast_to(scale[:, None], v.shape))
        q = tl.where(zero, v, q)
        q = tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX)
        if SOFT_ROUND:
            q = _e4m3_round(q)
        return q.to(tl.float8e4nv), scale

    @triton.jit
    def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, M, stride_xm, stride_qm, stride_sm,
                                BM: tl.constexpr, GROUP: tl.constexpr, SOFT_ROUND: tl.constexpr,
                                PDL: tl.constexpr, EARLY: tl.constexpr):
        """Program (i, g): rows [i*BM, (i+1)*BM), columns of group g. PDL, EARLY: ``pdl`` (the
        experts' kernels follow)."""
        pdl_prologue(PDL, EARLY)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        g = tl.program_id(1)
        cols = g * GROUP + tl.arange(0, GROUP)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        v = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=row_ok[:, None], other=0.0)
        q, scale = quantize_tile(v.to(tl.float32), SOFT_ROUND)
        tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], q, mask=row_ok[:, None])
        tl.store(s_ptr + rows64 * stride_sm + g, scale, mask=row_ok)


def quantize_groups_triton(x: torch.Tensor, plan: LaunchPlan = DEFAULT_PLAN) -> tuple[torch.Tensor, torch.Tensor]:
    """x[M, H] (float16/bfloat16/float32, H a multiple of 128) -> (q[M, H] e4m3, scales[M, H/128]).

    Equal, bit for bit, to ``moekit.fp8.quantize_groups(x, 128)``. ``plan``: its PDL fields.
    """
    require_triton()
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be a 2-D float16/bfloat16/float32 tensor [M, H], got {tuple(x.shape)} {x.dtype}")
    M, H = x.shape
    if H % FP8_GROUP:
        raise ValueError(f"x's hidden size H={H} must be a multiple of {FP8_GROUP} for FP8 groups")
    check_device(x.device)
    x = x.contiguous()
    q = torch.empty(M, H, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(M, H // FP8_GROUP, dtype=torch.float32, device=x.device)
    if M == 0 or H == 0:
        return q, scales
    bm = 16 if M <= 16 else 32
    grid = (triton.cdiv(M, bm), H // FP8_GROUP)
    on = pdl_on(x.device, plan)
    bound_launch(_quantize_groups_kernel, grid, x, q, scales, M, x.stride(0), q.stride(0), scales.stride(0),
                 BM=bm, GROUP=FP8_GROUP, SOFT_ROUND=interpreting(), PDL=on,
                 EARLY=early("quant", on, grid[0] * grid[1], x.device, plan), num_warps=4,
                 **launch_options(on))
    return q, scales
