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
combine, which sums the K slots in a fixed order.

Alignment (align.py) gives the padded expert-grouped row order without a host sync; the grid
is launched for the upper bound of blocks and blocks past the real end return at once.

FP8 extension point: W8A8 with block scales needs (a) fp8 operands in both dots, (b) per-row
activation scales and per-[128, 128] weight-block scales applied to each bk-chunk's partial
product before it is added to the accumulator, and (c) re-quantizing the SwiGLU output to fp8
(two_launch: in GEMM1's epilogue; fused: in registers). The places are marked ``FP8:`` below;
nothing of it is implemented: fp8 weights raise ``NotImplementedError``.
"""

from __future__ import annotations

import os

import torch

from moekit.kernels.align import Alignment, align_expert_major, align_tokens
from moekit.kernels.configs import KernelConfig

try:  # Triton is optional: the package imports without it, the kernels need it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = tl = None
    HAVE_TRITON = False

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if HAVE_TRITON:
    # H and N are tl.constexpr in every kernel: the K loops then have compile-time trip counts
    # (Triton's interpreter cannot loop over a run-time scalar argument, and the compiler
    # pipelines a constant-trip loop at least as well). One compile per model shape.

    @triton.jit
    def _block_coords(pid, num_m, num_n, GROUP_M: tl.constexpr):
        """(token block, column tile) of program ``pid``, with GROUP_M swizzle.

        Without swizzle (GROUP_M = 1) consecutive programs walk the column tiles of one token
        block. With it, programs walk GROUP_M token blocks down one column tile before moving
        right, so CTAs running together read the same weight columns (and the same expert:
        neighbouring token blocks mostly belong to one expert) from L2.
        """
        if GROUP_M == 1:
            return pid // num_n, pid % num_n
        per_group = GROUP_M * num_n
        group = pid // per_group
        first_m = group * GROUP_M
        rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % rows
        pid_n = (pid % per_group) // rows
        return pid_m, pid_n

    @triton.jit
    def _swiglu_tile(x_ptr, w13_ptr, a_rows, row_ok, expert, offs_n, H: tl.constexpr, N: tl.constexpr,
                     stride_xm, stride_we, stride_wn, stride_wk,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
        """silu(x[a_rows] @ gate.T) * (x[a_rows] @ up.T) for columns offs_n of expert ``expert``,
        as a float32 [BM, BN] tile. gate is w13[e, :N], up is w13[e, N:]."""
        offs_k = tl.arange(0, BK)
        n_ok = offs_n < N
        a_ptrs = x_ptr + a_rows[:, None] * stride_xm + offs_k[None, :]
        w_base = w13_ptr + expert.to(tl.int64) * stride_we
        g_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
        u_ptrs = g_ptrs + N * stride_wn
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(H, BK)):
            k_ok = offs_k < H - k0 * BK
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            # FP8: scale the partial products by the activation-row and weight-block scales here.
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
            a_ptrs += BK
            g_ptrs += BK * stride_wk
            u_ptrs += BK * stride_wk
        return acc_g * tl.sigmoid(acc_g) * acc_u

    @triton.jit
    def _gemm1_swiglu_kernel(
        x_ptr, w13_ptr, inter_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
        num_pairs, num_m, H: tl.constexpr, N: tl.constexpr,
        stride_xm, stride_we, stride_wn, stride_wk, stride_im,
        A_DIV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """two_launch, step 1: inter[row] = SwiGLU(x[pair // A_DIV] @ w13[e].T) per padded row."""
        num_n = tl.cdiv(N, BN)
        pid_m, pid_n = _block_coords(tl.program_id(0), num_m, num_n, GROUP_M)
        # Early exit: the grid covers the upper bound of blocks; the real end is on the device.
        if pid_m * BM >= tl.load(num_padded_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        rows = pid_m * BM + tl.arange(0, BM)
        pair = tl.load(sorted_ids_ptr + rows)
        row_ok = pair < num_pairs  # padding rows hold the sentinel num_pairs
        a_rows = tl.where(row_ok, pair // A_DIV, 0).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        act = _swiglu_tile(x_ptr, w13_ptr, a_rows, row_ok, expert, offs_n, H, N,
                           stride_xm, stride_we, stride_wn, stride_wk, BM, BN, BK, PRECISION)
        # FP8: re-quantize act to fp8 with a per-row scale here and store the scales too.
        i_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_im + offs_n[None, :]
        # Padding rows are written too (as zeros: their A rows were masked to 0), so GEMM2 never
        # reads uninitialised memory.
        tl.store(i_ptrs, act.to(inter_ptr.dtype.element_ty), mask=(offs_n < N)[None, :])

    @triton.jit
    def _gemm2_kernel(
        inter_ptr, w2_ptr, out_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
        num_pairs, num_m, H: tl.constexpr, N: tl.constexpr,
        stride_im, stride_we, stride_wh, stride_wk, stride_om,
        OUT_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, PER_SPLIT: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """two_launch, step 2: out[pair // OUT_DIV] += w[pair] * inter[row] @ w2[e].T.

        Grid axis 1 is the split-K index: CTA s reduces over the s-th contiguous share of N.
        """
        num_n = tl.cdiv(H, BN)
        pid_m, pid_n = _block_coords(tl.program_id(0), num_m, num_n, GROUP_M)
        if pid_m * BM >= tl.load(num_padded_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        rows = pid_m * BM + tl.arange(0, BM)
        pair = tl.load(sorted_ids_ptr + rows)
        row_ok = pair < num_pairs
        offs_h = pid_n * BN + tl.arange(0, BN)
        h_ok = offs_h < H
        # This split's share of the reduction: PER_SPLIT = ceil(ceil(N / BK) / split_k) whole
        # BK chunks (computed on the host so the loop bound is a compile-time constant).
        c_begin = tl.program_id(1) * PER_SPLIT
        offs_k = tl.arange(0, BK)
        a_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_im + (c_begin * BK + offs_k)[None, :]
        b_ptrs = (w2_ptr + expert.to(tl.int64) * stride_we + offs_h[None, :] * stride_wh
                  + (c_begin * BK + offs_k)[:, None] * stride_wk)  # [BK, BN] = w2[e].T tile
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for i in range(0, PER_SPLIT):
            # The last split may own fewer chunks (or none): mask the chunks past the end.
            k_ok = offs_k < N - (c_begin + i) * BK
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & h_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BK
            b_ptrs += BK * stride_wk
        if MUL_WEIGHT:
            w = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
        out_rows = tl.where(row_ok, pair // OUT_DIV, 0).to(tl.int64)
        o_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_h[None, :]
        tl.atomic_add(o_ptrs, acc, mask=row_ok[:, None] & h_ok[None, :], sem="relaxed")

    @triton.jit
    def _fused_kernel(
        x_ptr, w13_ptr, w2_ptr, out_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
        num_pairs, num_m, H: tl.constexpr, N: tl.constexpr,
        stride_xm, stride_w13e, stride_w13n, stride_w13k, stride_w2e, stride_w2h, stride_w2k, stride_om,
        A_DIV: tl.constexpr, OUT_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """fused: one CTA = one token block x one N-tile; SwiGLU in registers, then its share of
        the down-projection, added into out over all H in BK-wide chunks."""
        num_n = tl.cdiv(N, BN)
        pid_m, pid_n = _block_coords(tl.program_id(0), num_m, num_n, GROUP_M)
        if pid_m * BM >= tl.load(num_padded_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        rows = pid_m * BM + tl.arange(0, BM)
        pair = tl.load(sorted_ids_ptr + rows)
        row_ok = pair < num_pairs
        a_rows = tl.where(row_ok, pair // A_DIV, 0).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        act = _swiglu_tile(x_ptr, w13_ptr, a_rows, row_ok, expert, offs_n, H, N,
                           stride_xm, stride_w13e, stride_w13n, stride_w13k, BM, BN, BK, PRECISION)
        # Same rounding as the two_launch intermediate, and the dtype the tensor cores take.
        # FP8: re-quantize to fp8 in registers here instead.
        act = act.to(x_ptr.dtype.element_ty)
        if MUL_WEIGHT:
            w = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        out_rows = tl.where(row_ok, pair // OUT_DIV, 0).to(tl.int64)
        offs_h = tl.arange(0, BK)
        # w2[e, h, n] read as a [BN, BK] tile (n down, h across) = (w2[e][h-chunk, n-tile]).T
        b_ptrs = (w2_ptr + expert.to(tl.int64) * stride_w2e + offs_n[:, None] * stride_w2k
                  + offs_h[None, :] * stride_w2h)
        o_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_h[None, :]
        for h0 in range(0, tl.cdiv(H, BK)):
            h_ok = offs_h < H - h0 * BK
            b = tl.load(b_ptrs, mask=n_ok[:, None] & h_ok[None, :], other=0.0)
            part = tl.dot(act, b, input_precision=PRECISION)  # [BM, BK] fp32
            if MUL_WEIGHT:
                part = part * w[:, None]
            tl.atomic_add(o_ptrs, part, mask=row_ok[:, None] & h_ok[None, :], sem="relaxed")
            b_ptrs += BK * stride_w2h
            o_ptrs += BK


def _require_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("moekit.kernels needs Triton: pip install 'moekit[triton]'")


def _check_weights(w13: torch.Tensor, w2: torch.Tensor, H: int, dtype: torch.dtype, device) -> tuple[int, int]:
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 must be [E, 2N, H] and w2 [E, H, N], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    E, two_n, h13 = w13.shape
    N = two_n // 2
    if two_n % 2 or h13 != H or tuple(w2.shape) != (E, H, N):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, 2N, H={H}] and [E, H={H}, N]")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise NotImplementedError("FP8 W8A8 (block-scaled) experts are not implemented yet")
        if t.dtype != dtype:
            raise ValueError(f"{name} must have the activations' dtype {dtype}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the activations are on {device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    return E, N


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs: exact float32 products ("ieee"), not tf32, so fp32 runs can be checked
    # to 1e-4 and serve as a precise path; 16-bit inputs use the tensor cores as they are.
    return "ieee" if dtype == torch.float32 else "tf32"


def _run(x2d: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor | None,
         al: Alignment, out32: torch.Tensor, a_div: int, out_div: int, config: KernelConfig) -> None:
    """Launch the kernels of ``config`` over alignment ``al``, adding into ``out32``."""
    H = x2d.shape[1]
    N = w2.shape[2]
    num_m = al.max_blocks
    if num_m == 0:
        return
    prec = _precision(x2d.dtype)
    c = config
    mul_weight = weights is not None
    wptr = weights if mul_weight else out32  # any pointer; never read when MUL_WEIGHT is False
    launch = dict(num_warps=c.num_warps, num_stages=c.num_stages)
    if c.form == "fused":
        grid = (num_m * triton.cdiv(N, c.bn),)
        _fused_kernel[grid](
            x2d, w13, w2, out32, wptr, al.sorted_ids, al.block_expert, al.num_padded,
            al.num_pairs, num_m, H, N,
            x2d.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
            w2.stride(0), w2.stride(1), w2.stride(2), out32.stride(0),
            A_DIV=a_div, OUT_DIV=out_div, MUL_WEIGHT=mul_weight,
            BM=c.bm, BN=c.bn, BK=c.bk, GROUP_M=c.group_m, PRECISION=prec, **launch,
        )
        return
    # Padding rows of blocks past the real end are never written nor read; rows inside real
    # blocks are all written by GEMM1, so empty() is safe.
    inter = torch.empty(al.capacity, N, dtype=x2d.dtype, device=x2d.device)
    grid1 = (num_m * triton.cdiv(N, c.bn),)
    _gemm1_swiglu_kernel[grid1](
        x2d, w13, inter, al.sorted_ids, al.block_expert, al.num_padded,
        al.num_pairs, num_m, H, N,
        x2d.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), inter.stride(0),
        A_DIV=a_div, BM=c.bm, BN=c.bn, BK=c.bk, GROUP_M=c.group_m, PRECISION=prec, **launch,
    )
    grid2 = (num_m * triton.cdiv(H, c.bn), c.split_k)
    _gemm2_kernel[grid2](
        inter, w2, out32, wptr, al.sorted_ids, al.block_expert, al.num_padded,
        al.num_pairs, num_m, H, N,
        inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out32.stride(0),
        OUT_DIV=out_div, MUL_WEIGHT=mul_weight, PER_SPLIT=triton.cdiv(triton.cdiv(N, c.bk), c.split_k),
        BM=c.bm, BN=c.bn, BK=c.bk, GROUP_M=c.group_m, PRECISION=prec, **launch,
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, config: KernelConfig | None = None) -> torch.Tensor:
    """y[M, H] = sum_k topk_weights[:, k] * SwiGLU-expert_{topk_ids[:, k]}(x), in Triton.

    x [M, H] fp16/bf16/fp32; w13 [E, 2N, H] (gate rows first, then up) and w2 [E, H, N] of
    the same dtype; topk_ids [M, K] int32/int64 in [-1, E) (-1 = masked slot, contributes
    nothing; ids are not range-checked, to avoid a host sync); topk_weights [M, K] float.
    float32 accumulation; the result has x's dtype. No host sync: usable under CUDA graphs.
    Not bitwise reproducible (float32 atomics, see the module docstring).
    """
    _require_triton()
    if config is None:
        from moekit.kernels.configs import default_config
        from moekit.shapes import MoEShape

        config = default_config(x.shape[0], MoEShape("adhoc", w13.shape[0], topk_ids.shape[1], x.shape[1],
                                                     w2.shape[2]))
    if not isinstance(config, KernelConfig):
        raise ValueError(f"config must be a KernelConfig, got {type(config).__name__}")
    if x.dim() != 2 or x.dtype not in _SUPPORTED:
        raise ValueError(f"x must be a 2-D {_SUPPORTED} tensor [M, H], got {tuple(x.shape)} {x.dtype}")
    M, H = x.shape
    E, N = _check_weights(w13, w2, H, x.dtype, x.device)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != M or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32/int64 [M={M}, K], got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be a float tensor of shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)} {topk_weights.dtype}")
    K = topk_ids.shape[1]
    x = x.contiguous()
    out32 = torch.zeros(M, H, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return out32.to(x.dtype)
    al = align_tokens(topk_ids, E, config.bm)
    weights = topk_weights.to(torch.float32).contiguous().reshape(-1)
    _run(x, w13, w2, weights, al, out32, a_div=K, out_div=K, config=config)
    return out32.to(x.dtype)


def fused_moe_expert_major(tokens: torch.Tensor, counts: torch.Tensor, w13_local: torch.Tensor,
                           w2_local: torch.Tensor, config: KernelConfig | None = None) -> torch.Tensor:
    """The experts on a Dispatcher's expert-major layout: [E_local, capacity, H] -> same shape.

    Row r of expert e gets expert_e(tokens[e, r]) for r < counts[e], unweighted (the
    dispatcher's combine applies the routing weights in slot order). Rows at or past counts[e]
    are zero. float32 accumulation, cast once to the tokens' dtype.
    """
    _require_triton()
    if tokens.dim() != 3 or tokens.dtype not in _SUPPORTED:
        raise ValueError(f"tokens must be a 3-D {_SUPPORTED} tensor [E_local, capacity, H], "
                         f"got {tuple(tokens.shape)} {tokens.dtype}")
    E, cap, H = tokens.shape
    E_w, N = _check_weights(w13_local, w2_local, H, tokens.dtype, tokens.device)
    if E_w != E:
        raise ValueError(f"tokens has E_local={E} experts but the weights have {E_w}")
    if counts.dim() != 1 or counts.shape[0] != E or counts.device != tokens.device:
        raise ValueError(f"counts must be [E_local={E}] on {tokens.device}, got {tuple(counts.shape)} on {counts.device}")
    if config is None:
        config = KernelConfig(bm=64 if cap >= 64 else 16, bn=64, bk=64)
    out32 = torch.zeros(E * cap, H, dtype=torch.float32, device=tokens.device)
    if E * cap:
        al = align_expert_major(counts, cap, config.bm)
        _run(tokens.contiguous().reshape(E * cap, H), w13_local, w2_local, None, al, out32,
             a_div=1, out_div=1, config=config)
    return out32.reshape(E, cap, H).to(tokens.dtype)
