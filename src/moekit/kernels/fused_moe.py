"""Fused SwiGLU MoE experts in Triton: up-projection, SwiGLU, down-projection, weighted top-k sum.

Two execution forms, picked by ``KernelConfig.form``:

* ``two_launch``: GEMM1 (``x @ w13[e].T`` for a [bm, bn] tile of gate and the matching tile of
  up, SwiGLU in the epilogue) writes the intermediate ``[capacity, N]`` in the input dtype;
  GEMM2 (``inter @ w2[e].T``) multiplies each row by its routing weight and adds it into a
  float32 output with atomics. ``split_k > 1`` splits GEMM2's reduction over N across CTAs
  (grid axis 1), each adding its partial sum.
* ``fused``: one launch. A CTA computes one [bm, bn] tile of the SwiGLU output in registers and
  immediately multiplies it by the matching [H, bn] slice of w2, adding the [bm, H] partial
  down-projection (in chunks of bk columns) into the float32 output with atomics. The
  intermediate never reaches device memory; the price is N / bn atomic adds per output element.

Numerics and order. All dot products accumulate in float32. The SwiGLU output is rounded to
the input dtype before the down-projection (as the tensor cores need it, and as the plain torch
experts do). The weighted top-k sum is accumulated in a float32 buffer and cast once at the
end. Because several CTAs add into the same output row with atomics (the K slots of a token
live in different expert blocks; split-K and the fused form add partial sums), the order of
the float32 additions is decided by the hardware scheduler: results are not bitwise
reproducible run to run (differences of float32 rounding only), unlike the dispatchers'
combine, which sums the K slots in a fixed order. (The decode schedule below is the exception.)

Token blocks find their rows in one of two ways (``fused_moe(alignment=...)``). Sorted: the
alignment (align.py) gives the padded expert-grouped row order without a host sync; the grid
is launched for the upper bound of blocks and blocks past the real end return at once. Direct
(the default when every token fits one block, M <= bm): no alignment; block j serves the j-th
named expert and its rows are the tokens themselves (``tiles.block_rows``).

The decode schedule: ``two_launch`` with ``split_k = 1`` under direct addressing replaces the
atomic GEMM2 by ``gemm2_decode_kernel``, whose CTAs own a column tile of the whole output
and sum a token's experts in registers, in a fixed order; where the column tiles alone would
leave the GPU short of CTAs, the named experts are split over several CTAs per tile whose float32
partials the last one to finish adds in split order. That call is two launches (no zeroed
float32 buffer, no cast) and bitwise reproducible.

By default (``LaunchPlan.decode_persistent``) the decode schedule is one launch instead:
``persistent_decode_kernel``, a cooperative grid of about two CTAs per SM that runs GEMM1
as equal work units, waits at a grid barrier, then runs the decode GEMM2's units. Where the
routing names too few (expert, N tile) pairs to give every CTA one (deepseek-v3's TP8 shard
has 8 tiles of 32 columns per expert), each tile's reduction over H is split into shares whose
float32 partials the last share adds in share order before the SwiGLU: GEMM1 then streams w13
from every SM. Still deterministic; not bitwise equal to the two-kernel version where GEMM1 is
split (another float32 summation order). The call is a zeroing of its int32 counters plus the
kernel.

FP8 W8A8 with block scales (DeepSeek-V3's scheme; ``FP8=True`` in the kernels). Weights are
``float8_e4m3fn`` with one float32 scale per [128, 128] block (``moekit.fp8.quantize_blocks``);
activations are e4m3 with one scale per token per 128 columns (``quantize_groups``), made by
``quant.quantize_groups_triton`` from bf16/fp16/fp32 inputs or handed over already quantized.
Every reduction chunk is exactly one scale block (bk = 128), so each chunk's fp8 x fp8 dot
(float32 result) is multiplied by ``a_scale[row, chunk] * w_scale[col block, chunk]`` before
it is added to the float32 accumulator (the decode GEMM2 loads several blocks per step and
takes one such dot per block, in order). Weight scales are loaded per output column (the index
``col // 128``), so a bn = 256 tile spanning two scale blocks needs nothing special. The SwiGLU
output is re-quantized per row per 128 columns with the same helper as the activations
(``quant.quantize_tile``): two_launch in GEMM1's epilogue, which writes the fp8 intermediate
and its scales [capacity, N / 128]; fused in registers, which is why the fused form needs
bn = 128 (one N group, so one scale per row for the down-projection's reduction). On sm_90
Triton's fp8 dot accumulates each 128-deep chunk in the tensor core's reduced-precision
accumulator (its default ``max_num_imprecise_acc``); chunks are then summed in float32, which
is DeepSeek-V3's "promote every 128" scheme. The constraints on configurations are checked by
``configs.fp8_config_error``.

Where the code is: ``tiles`` (the shared ``@triton.jit`` tile helpers), ``token_kernels`` (the
forms' kernels over token blocks), ``decode_kernels`` (the decode schedule, two kernels or one
persistent), ``grid_sync`` (the persistent kernel's grid barrier), ``plan`` (:class:`LaunchPlan`,
the launch choices a caller passes, and the decode schedule's launch shape), ``launch`` (buffers,
grids and launches of one call), ``inputs`` (argument checks) and this module (the entry).
"""

from __future__ import annotations

import torch

from moekit.kernels.align import align_launches, align_tokens, direct_blocks
from moekit.kernels.backend import HAVE_TRITON, check_device, require_triton
from moekit.kernels.configs import KernelConfig
from moekit.kernels.inputs import (FP8, SUPPORTED, check_config, check_scale, check_weights, fp8_activations,
                                   fp8_weight_scales, is_fp8_weights, no_scales)
from moekit.kernels.launch import run_blocks
from moekit.kernels.plan import DEFAULT_PLAN, LaunchPlan, check_plan
from moekit.kernels.quant import FP8_GROUP

__all__ = ["ALIGNMENTS", "HAVE_TRITON", "check_fused_moe", "fused_moe", "run_fused_moe"]

ALIGNMENTS = ("auto", "sort", "direct")  # fused_moe(alignment=...)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # routing weights the kernels read as they are


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, config: KernelConfig, *,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              x_scale: torch.Tensor | None = None, alignment: str = "auto",
              plan: LaunchPlan | None = None) -> torch.Tensor:
    """y[M, H] = sum_k topk_weights[:, k] * SwiGLU-expert_{topk_ids[:, k]}(x), in Triton.

    x [M, H] fp16/bf16/fp32; w13 [E, 2N, H] (gate rows first, then up) and w2 [E, H, N] of
    the same dtype; topk_ids [M, K] int32/int64 in [-1, E) (-1 = masked slot, contributes
    nothing; any other id outside [0, E) makes its token's row NaN, with no host read, see
    ``align.py``); topk_weights [M, K] float
    (float32, bfloat16 or float16 are read as they are and widened to float32 in the kernel).
    float32 accumulation; the result has x's dtype. No host sync: usable under CUDA graphs.
    Not bitwise reproducible (float32 atomics, see the module docstring).

    FP8 W8A8: w13, w2 in float8_e4m3fn with ``w13_scale`` [E, 2N/128, H/128] and ``w2_scale``
    [E, H/128, N/128] (``moekit.fp8.quantize_blocks(w, 128)``); H and N multiples of 128; a
    config with ``fp8_config_error(config) is None``. x is either 16/32-bit (quantized here
    per token per 128 columns; the result has x's dtype) or e4m3 with ``x_scale`` [M, H/128]
    (``quantize_groups(x, 128)``; the result is bf16).

    ``alignment``: how token blocks find their rows. ``"sort"`` runs the token alignment
    (``align_tokens``: pairs sorted by expert, padded to ``config.bm``); ``"direct"`` skips it
    (:class:`~moekit.kernels.align.DirectBlocks`: one block per named expert, rows = tokens;
    needs M <= config.bm); ``"auto"`` (default) is direct when M <= config.bm, else sort. Both
    do the same arithmetic on the same tiles; direct saves the alignment's launch.

    ``config``: the :class:`KernelConfig` to run. Which one a caller should run (a static choice
    per token count, RaMP's routing-aware choice) is decided above the kernels, in
    :mod:`moekit.ops` (``moekit.ops.fused_moe`` takes the policy's names).

    ``plan``: how the call is launched (:class:`~moekit.kernels.plan.LaunchPlan`; None: the
    library's defaults).

    :func:`check_fused_moe` holds every argument check and :func:`run_fused_moe` the launch, so
    a caller that has checked a signature once can launch without checking again.

    On a machine without a CUDA GPU the kernels run in Triton's CPU interpreter (slow; see
    ``moekit.kernels.backend``); CPU tensors where the kernels were set up for the GPU raise.
    """
    check_fused_moe(x, w13, w2, topk_ids, topk_weights, config, w13_scale=w13_scale, w2_scale=w2_scale,
                    x_scale=x_scale, alignment=alignment, plan=plan)
    return run_fused_moe(x, w13, w2, topk_ids, topk_weights, config, w13_scale=w13_scale, w2_scale=w2_scale,
                         x_scale=x_scale, alignment=alignment, plan=plan)


def check_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, config: KernelConfig | None, *, w13_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
                    alignment: str = "auto", plan: LaunchPlan | None = None) -> None:
    """Every check of :func:`fused_moe`'s arguments (ValueError naming the argument); reads
    nothing from the device. ``config`` None: everything but the config (a caller that picks
    it later checks it with ``inputs.check_config``)."""
    require_triton()
    check_plan(plan)
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in SUPPORTED + (FP8,):
        got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 2-D {SUPPORTED + (FP8,)} tensor [M, H], got {got}")
    fp8 = is_fp8_weights(w13, w2)
    if x.dtype == FP8 and not fp8:
        raise ValueError(f"x in {FP8} needs FP8 weights (w13, w2 in {FP8}), got {w13.dtype}")
    if config is not None and not isinstance(config, KernelConfig):
        raise ValueError(f"config must be a moekit.kernels.KernelConfig (moekit.ops.fused_moe picks one by "
                         f"policy: 'static', 'auto', ...), got {config!r}")
    M, H = x.shape
    E, N = check_weights(w13, w2, H, FP8 if fp8 else x.dtype, x.device)
    if config is not None:
        check_config(config, fp8)
    if fp8:
        fp8_weight_scales(E, N, H, w13_scale, w2_scale, x.device)
        if x.dtype == FP8:
            check_scale("x_scale", x_scale, (M, H // FP8_GROUP), x.device)
        else:
            no_scales(x_scale=x_scale)
    else:
        no_scales(w13_scale=w13_scale, w2_scale=w2_scale, x_scale=x_scale)
    if not isinstance(topk_ids, torch.Tensor) or not isinstance(topk_weights, torch.Tensor):
        raise ValueError("topk_ids and topk_weights must be tensors")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != M or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32/int64 [M={M}, K], got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be a float tensor of shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)} {topk_weights.dtype}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; they must share a device")
    # After every argument check, so that a bad argument is reported as such on any device.
    check_device(x.device)


def run_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, config: KernelConfig, *, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
                  alignment: str = "auto", plan: LaunchPlan | None = None) -> torch.Tensor:
    """:func:`fused_moe` on arguments :func:`check_fused_moe` accepted (not checked again)."""
    plan = DEFAULT_PLAN if plan is None else plan
    M, H = x.shape
    E = w13.shape[0]
    K = topk_ids.shape[1]
    fp8 = w13.dtype == FP8
    out_dtype = torch.bfloat16 if x.dtype == FP8 else x.dtype
    if M == 0 or K == 0:
        return torch.zeros(M, H, dtype=out_dtype, device=x.device)
    x = x.contiguous()
    scales = None
    if fp8:
        x, xs = fp8_activations(x, x_scale, "x_scale", plan)
        scales = (xs, w13_scale, w2_scale)
    accumulator = None
    if alignment == "direct" or (alignment == "auto" and M <= config.bm):
        al = direct_blocks(topk_ids, E, config.bm)
    else:
        # The accumulator the sorted path adds into, zeroed by the alignment's launches where
        # they are two (a launch saved); else run_blocks zeroes it.
        if align_launches(topk_ids.numel()) == 2:
            accumulator = torch.empty(M, H, dtype=torch.float32, device=x.device)
        al = align_tokens(topk_ids, E, config.bm, zero=accumulator)
        accumulator = accumulator if al.zeroed else None
    # The kernels widen 16-bit weights to float32 as they load them: no conversion launch.
    weights = topk_weights if topk_weights.dtype in WEIGHT_DTYPES else topk_weights.to(torch.float32)
    return run_blocks(x, w13, w2, weights.contiguous().reshape(-1), al, M, out_dtype, a_div=K, out_div=K,
                      config=config, scales=scales, plan=plan, accumulator=accumulator)
