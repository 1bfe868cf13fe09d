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
named expert and its rows are the tokens themselves (``_block_rows``).

The decode schedule: ``two_launch`` with ``split_k = 1`` under direct addressing replaces the
atomic GEMM2 by ``_gemm2_decode_kernel``, whose CTAs own a column tile of the whole output
and sum a token's experts in registers, in a fixed order; where the column tiles alone would
leave the GPU short of CTAs, the named experts are split over several CTAs per tile whose float32
partials the last one to finish adds in split order. That call is two launches (no zeroed
float32 buffer, no cast) and bitwise reproducible.

By default (``DECODE_PERSISTENT``) the decode schedule is one launch instead:
``_persistent_decode_kernel``, a cooperative grid of about two CTAs per SM that runs GEMM1
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
(``quant._quantize_tile``): two_launch in GEMM1's epilogue, which writes the fp8 intermediate
and its scales [capacity, N / 128]; fused in registers, which is why the fused form needs
bn = 128 (one N group, so one scale per row for the down-projection's reduction). On sm_90
Triton's fp8 dot accumulates each 128-deep chunk in the tensor core's reduced-precision
accumulator (its default ``max_num_imprecise_acc``); chunks are then summed in float32, which
is DeepSeek-V3's "promote every 128" scheme. The constraints on configurations are checked by
``configs.fp8_config_error``.
"""

from __future__ import annotations

import torch

from moekit.kernels.align import Alignment, DirectBlocks, align_tokens, direct_blocks
from moekit.kernels.configs import KernelConfig, fp8_config_error
from moekit.kernels import pdl
from moekit.kernels.occupancy import resident_ctas_per_sm, sm_count
from moekit.kernels.quant import FP8_GROUP, interpreting, quantize_groups_triton

try:  # Triton is optional: the package imports without it, the kernels need it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = tl = None
    HAVE_TRITON = False

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)
ALIGNMENTS = ("auto", "sort", "direct")  # fused_moe(alignment=...)
_FP8 = torch.float8_e4m3fn


def _interpreting() -> bool:
    return interpreting()


if HAVE_TRITON:
    from triton.language.extra.cuda import globaltimer

    from moekit.kernels.pdl import pdl_prologue
    from moekit.kernels.quant import _quantize_tile

    # H and N are tl.constexpr in every kernel: the K loops then have compile-time trip counts
    # (Triton's interpreter cannot loop over a run-time scalar argument, and the compiler
    # pipelines a constant-trip loop at least as well). One compile per model shape.
    #
    # FP8 is a constexpr: with FP8=False the scale arguments are never read (any pointer, zero
    # strides) and the compiled bf16/fp16/fp32 kernels are the same as before the FP8 path.
    _SB = tl.constexpr(FP8_GROUP)  # scale block: 128 columns of activations, 128x128 of weights
    # Integer arguments that change with the batch. Triton would otherwise compile a variant
    # per value class (== 1, multiple of 16, other): three binaries per kernel over M = 1, 4,
    # 16, each compiled and loaded once per process, for no speed-up (these only bound masks).
    _NO_SPECIALIZE = ["num_pairs", "num_tokens", "top_k", "num_experts", "num_m"]
    _NO_SPECIALIZE_DECODE = ["num_tokens", "top_k", "num_experts"]

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
    def _direct_routing(ids_ptr, weights_ptr, num_tokens, top_k, num_experts, BM: tl.constexpr, KP: tl.constexpr,
                        BINS: tl.constexpr, MUL_WEIGHT: tl.constexpr):
        """Direct addressing, once per program: the [BM, KP] ids of the tokens (-1 past the
        end), their validity, their routing weights (zeros unless MUL_WEIGHT), and ``named[b]``,
        how many distinct experts <= b the routing names (a cumsum over the ids' histogram).

        The weights are loaded here, with the ids, so that no later step (in particular no
        iteration of the decode GEMM2's loop) waits on a global load that is not pipelined."""
        tok = tl.arange(0, BM)
        slot = tl.arange(0, KP)
        offs = tok[:, None] * top_k + slot[None, :]
        in_range = (tok < num_tokens)[:, None] & (slot < top_k)[None, :]
        ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
        valid = (ids >= 0) & (ids < num_experts)
        if MUL_WEIGHT:
            wts = tl.load(weights_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        else:
            wts = tl.zeros((BM, KP), tl.float32)
        hist = tl.histogram(tl.reshape(tl.where(valid, ids, 0), (BM * KP,)), BINS, mask=tl.reshape(valid, (BM * KP,)))
        named = tl.cumsum((hist > 0).to(tl.int32), 0)
        return ids, valid, wts, named

    @triton.jit
    def _direct_block(j, ids, valid, wts, named, num_experts, BM: tl.constexpr):
        """Direct addressing: block ``j`` serves the j-th smallest named expert; its rows are
        the tokens that picked it, each with the sum of its slots' weights for that expert
        (from the weights ``_direct_routing`` loaded: registers only)."""
        expert = tl.sum((named <= j).to(tl.int32), 0)  # BINS (>= E) past the last named expert
        live = expert < num_experts
        match = valid & (ids == expert)
        row_ok = tl.max(match.to(tl.int32), 1) > 0
        tok = tl.arange(0, BM)
        w = tl.sum(tl.where(match, wts, 0.0), 1)
        return live, expert, j * BM + tok, tok.to(tl.int64), row_ok, w

    @triton.jit
    def _block_rows(pid_m, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                    ids_ptr, weights_ptr, num_tokens, top_k, num_experts,
                    A_DIV: tl.constexpr, OUT_DIV: tl.constexpr, BM: tl.constexpr, DIRECT: tl.constexpr,
                    KP: tl.constexpr, BINS: tl.constexpr, MUL_WEIGHT: tl.constexpr):
        """The token block ``pid_m``: (live, expert, rows, a_rows, out_rows, row_ok, w).

        ``live`` is False for blocks with no work (the grid covers an upper bound; the real
        count is on the device): the caller must return at once (a helper cannot return from
        its caller). ``rows`` are the block's rows of the padded order (the intermediate's rows
        in two_launch), ``a_rows`` / ``out_rows`` the rows of x and of the output they read and
        write, ``row_ok`` False on padding rows, ``w`` the routing weight of each row (when
        MUL_WEIGHT).

        Sorted addressing (DIRECT False): the block is a slice of the alignment (align.py);
        its rows hold pair ids ``token * K + slot`` (sentinel ``num_pairs`` on padding), loaded
        only when the block is live.

        Direct addressing (DIRECT True, every token fits one block: num_tokens <= BM): no
        alignment at all (``align.DirectBlocks``). Block j serves the j-th smallest expert that
        the routing names, and its rows are the tokens themselves (row i = token i, kept where
        the token picked that expert). Every program reads the [num_tokens, K] ids (at most
        BM * K) and finds its expert from their histogram. A token that names the expert in
        several slots gets the sum of those slots' weights.
        """
        if DIRECT:
            ids, valid, wts, named = _direct_routing(ids_ptr, weights_ptr, num_tokens, top_k, num_experts, BM, KP,
                                                     BINS, MUL_WEIGHT)
            live, expert, rows, a_rows, row_ok, w = _direct_block(pid_m, ids, valid, wts, named, num_experts, BM)
            out_rows = a_rows
        else:
            live = pid_m * BM < tl.load(num_padded_ptr)
            expert = tl.load(block_expert_ptr + pid_m)
            live = live & (expert >= 0)
            rows = pid_m * BM + tl.arange(0, BM)
            pair = tl.load(sorted_ids_ptr + rows, mask=live, other=num_pairs)
            row_ok = pair < num_pairs
            a_rows = tl.where(row_ok, pair // A_DIV, 0).to(tl.int64)
            out_rows = tl.where(row_ok, pair // OUT_DIV, 0).to(tl.int64)
            if MUL_WEIGHT:
                w = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
            else:
                w = tl.zeros((BM,), tl.float32)
        return live, expert, rows, a_rows, out_rows, row_ok, w

    @triton.jit
    def _fp8_dot(a, b, SWAP_AB: tl.constexpr):
        """a [m, k] @ b [k, n] of e4m3 tiles, in float32. SWAP_AB computes it as (b.T @ a.T).T:
        Hopper's FP8 tensor-core instruction (wgmma) takes the left operand in blocks of 64 rows,
        so with a token block under 64 rows Triton upcasts both tiles to fp16 for mma.sync, one
        conversion per weight element, which made the FP8 decode kernels slower per byte than
        bf16 (docs/kernel.md). Swapped, the weight tile's 128 columns are the 64-row blocks and
        the few tokens the instruction's narrow side, both read K-major as they lie in memory.
        The price: wgmma keeps a chunk's FP8 sums in less than float32 precision (as every
        bm >= 64 config always did), where mma.sync on fp16 does not (docs/kernel.md). Whether
        it pays depends on the kernel and the routing (the reduction's length, the grid), so
        it is a mode of the config space: ``KernelConfig.swap_ab``."""
        if SWAP_AB:
            return tl.trans(tl.dot(tl.trans(b), tl.trans(a)))
        return tl.dot(a, b)

    @triton.jit
    def _swiglu_tile(x_ptr, w13_ptr, a_rows, row_ok, expert, offs_n, H: tl.constexpr, N: tl.constexpr,
                     stride_xm, stride_we, stride_wn, stride_wk,
                     xs_ptr, ws_ptr, stride_xsm, stride_wse, stride_wsn, stride_wsk,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
                     FP8: tl.constexpr, SWAP_AB: tl.constexpr = False):
        """silu(x[a_rows] @ gate.T) * (x[a_rows] @ up.T) for columns offs_n of expert ``expert``,
        as a float32 [BM, BN] tile. gate is w13[e, :N], up is w13[e, N:].

        FP8: x and w13 are e4m3; xs is x's [rows, H/128] scales, ws w13's [E, 2N/128, H/128]
        block scales, and BK == 128, so chunk k0 is scale column k0 of both. SWAP_AB: see
        ``_fp8_dot``."""
        offs_k = tl.arange(0, BK)
        n_ok = offs_n < N
        a_ptrs = x_ptr + a_rows[:, None] * stride_xm + offs_k[None, :]
        w_base = w13_ptr + expert.to(tl.int64) * stride_we
        g_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
        u_ptrs = g_ptrs + N * stride_wn
        if FP8:
            # Per-column weight scales: gate column n is in row block n // 128 of w13, up column
            # n in block (N + n) // 128. Masked columns (n >= N) are never loaded.
            xs_ptrs = xs_ptr + a_rows * stride_xsm
            ws_base = ws_ptr + expert.to(tl.int64) * stride_wse
            gs_ptrs = ws_base + (offs_n // _SB) * stride_wsn
            us_ptrs = ws_base + ((N + offs_n) // _SB) * stride_wsn
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(H, BK)):
            if H % BK == 0 and N % BN == 0:
                # Whole tiles: only the padding rows of A are masked (no per-step k / n masks).
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                g = tl.load(g_ptrs)
                u = tl.load(u_ptrs)
            else:
                k_ok = offs_k < H - k0 * BK
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP8:
                # The chunk's fp8 products, then its scales, then into the float32 accumulator.
                a_s = tl.load(xs_ptrs + k0, mask=row_ok, other=0.0)
                g_s = tl.load(gs_ptrs + k0 * stride_wsk, mask=n_ok, other=0.0)
                u_s = tl.load(us_ptrs + k0 * stride_wsk, mask=n_ok, other=0.0)
                acc_g += _fp8_dot(a, g, SWAP_AB) * (a_s[:, None] * g_s[None, :])
                acc_u += _fp8_dot(a, u, SWAP_AB) * (a_s[:, None] * u_s[None, :])
            else:
                acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
            a_ptrs += BK
            g_ptrs += BK * stride_wk
            u_ptrs += BK * stride_wk
        return acc_g * tl.sigmoid(acc_g) * acc_u

    @triton.jit(do_not_specialize=_NO_SPECIALIZE)
    def _gemm1_swiglu_kernel(
        x_ptr, w13_ptr, inter_ptr, count_ptr, num_counters,
        sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_pairs, ids_ptr, num_tokens, top_k, num_experts,
        num_m, H: tl.constexpr, N: tl.constexpr,
        stride_xm, stride_we, stride_wn, stride_wk, stride_im,
        xs_ptr, ws_ptr, is_ptr, stride_xsm, stride_wse, stride_wsn, stride_wsk, stride_ism,
        A_DIV: tl.constexpr, DIRECT: tl.constexpr, KP: tl.constexpr, BINS: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, COUNTERS: tl.constexpr,
        GROUP_M: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, SOFT_ROUND: tl.constexpr,
        SWAP_AB: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    ):
        """two_launch, step 1: inter[row] = SwiGLU(x[pair // A_DIV] @ w13[e].T) per padded row.

        COUNTERS > 0 (a power of two >= num_counters): program 0 also zeroes the decode GEMM2's
        arrival counts (``_gemm2_decode_kernel``, which runs after this kernel on the stream),
        which saves that call a memset launch.
        FP8: inter is e4m3 and is[row, N/128] its scales, one per row per 128 columns; SWAP_AB:
        see ``_fp8_dot``. PDL, EARLY: ``pdl`` (GEMM2 follows)."""
        pdl_prologue(PDL, EARLY)
        if COUNTERS > 0:
            if tl.program_id(0) == 0:
                offs_c = tl.arange(0, COUNTERS)
                tl.store(count_ptr + offs_c, tl.zeros((COUNTERS,), tl.int32), mask=offs_c < num_counters)
        num_n = tl.cdiv(N, BN)
        pid_m, pid_n = _block_coords(tl.program_id(0), num_m, num_n, GROUP_M)
        live, expert, rows, a_rows, _, row_ok, _ = _block_rows(
            pid_m, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_pairs, ids_ptr, ids_ptr, num_tokens,
            top_k, num_experts, A_DIV, 1, BM, DIRECT, KP, BINS, False)
        if not live:
            return
        offs_n = pid_n * BN + tl.arange(0, BN)
        act = _swiglu_tile(x_ptr, w13_ptr, a_rows, row_ok, expert, offs_n, H, N,
                           stride_xm, stride_we, stride_wn, stride_wk,
                           xs_ptr, ws_ptr, stride_xsm, stride_wse, stride_wsn, stride_wsk,
                           BM, BN, BK, PRECISION, FP8, SWAP_AB)
        # Padding rows are written too (as zeros: their A rows were masked to 0), so GEMM2 never
        # reads uninitialised memory.
        _store_act(inter_ptr, is_ptr, rows, pid_n, act, stride_im, stride_ism, N, BM, BN, FP8, SOFT_ROUND)

    @triton.jit
    def _store_act(inter_ptr, is_ptr, rows, pid_n, act, stride_im, stride_ism, N: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, FP8: tl.constexpr, SOFT_ROUND: tl.constexpr):
        """Store the float32 SwiGLU tile ``act`` (rows ``rows``, column tile ``pid_n``) as the
        intermediate: in its dtype, or FP8 with one scale per row per 128 columns."""
        offs_n = pid_n * BN + tl.arange(0, BN)
        rows64 = rows.to(tl.int64)
        i_ptrs = inter_ptr + rows64[:, None] * stride_im + offs_n[None, :]
        if FP8:
            # Re-quantize per row per 128 columns: view the tile as [BM * BN/128, 128] (row-major,
            # so row r, group j becomes row r * BN/128 + j), one scale per row of that view.
            q, s = _quantize_tile(tl.reshape(act, (BM * (BN // _SB), _SB)), SOFT_ROUND)
            tl.store(i_ptrs, tl.reshape(q, (BM, BN)), mask=(offs_n < N)[None, :])
            offs_g = pid_n * (BN // _SB) + tl.arange(0, BN // _SB)
            s_ptrs = is_ptr + rows64[:, None] * stride_ism + offs_g[None, :]
            tl.store(s_ptrs, tl.reshape(s, (BM, BN // _SB)), mask=(offs_g < N // _SB)[None, :])
        else:
            tl.store(i_ptrs, act.to(inter_ptr.dtype.element_ty), mask=(offs_n < N)[None, :])

    @triton.jit
    def _down_tile(inter_ptr, w2_ptr, is_ptr, ws_ptr, rows, row_ok, expert, offs_h, c_begin,
                   H: tl.constexpr, N: tl.constexpr, stride_im, stride_we, stride_wh, stride_wk,
                   stride_ism, stride_wse, stride_wsh, stride_wsk, CHUNKS: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
                   FP8: tl.constexpr, WHOLE_CHUNKS: tl.constexpr, SWAP_AB: tl.constexpr = False):
        """inter[rows] @ w2[e][offs_h].T over the CHUNKS reduction chunks of BK starting at chunk
        ``c_begin``, as a float32 [BM, BN] tile. Rows with ``row_ok`` False are not read (0).
        WHOLE_CHUNKS: every split's chunks lie inside N (no chunk mask needed).

        FP8: inter and w2 are e4m3, is the intermediate's [rows, N/128] scales, ws w2's
        [E, H/128, N/128] block scales; BK == 128, so chunk c is scale column c of both."""
        h_ok = offs_h < H
        offs_k = tl.arange(0, BK)
        rows64 = rows.to(tl.int64)
        a_ptrs = inter_ptr + rows64[:, None] * stride_im + (c_begin * BK + offs_k)[None, :]
        b_ptrs = (w2_ptr + expert.to(tl.int64) * stride_we + offs_h[None, :] * stride_wh
                  + (c_begin * BK + offs_k)[:, None] * stride_wk)  # [BK, BN] = w2[e].T tile
        if FP8:
            as_ptrs = is_ptr + rows64 * stride_ism + c_begin
            bs_ptrs = (ws_ptr + expert.to(tl.int64) * stride_wse + (offs_h // _SB) * stride_wsh
                       + c_begin * stride_wsk)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for i in range(0, CHUNKS):
            if WHOLE_CHUNKS and H % BN == 0:
                # Whole tiles and every chunk inside N: only the padding rows of A are masked.
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs)
            else:
                # The last split may own fewer chunks (or none): mask the chunks past the end.
                k_ok = offs_k < N - (c_begin + i) * BK
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & h_ok[None, :], other=0.0)
            if FP8:
                chunk_ok = c_begin + i < N // _SB
                a_s = tl.load(as_ptrs + i, mask=row_ok & chunk_ok, other=0.0)
                b_s = tl.load(bs_ptrs + i * stride_wsk, mask=h_ok & chunk_ok, other=0.0)
                acc += _fp8_dot(a, b, SWAP_AB) * (a_s[:, None] * b_s[None, :])
            else:
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BK
            b_ptrs += BK * stride_wk
        return acc

    @triton.jit(do_not_specialize=_NO_SPECIALIZE)
    def _gemm2_kernel(
        inter_ptr, w2_ptr, out_ptr, weights_ptr,
        sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_pairs, ids_ptr, num_tokens, top_k, num_experts,
        num_m, H: tl.constexpr, N: tl.constexpr,
        stride_im, stride_we, stride_wh, stride_wk, stride_om,
        is_ptr, ws_ptr, stride_ism, stride_wse, stride_wsh, stride_wsk,
        OUT_DIV: tl.constexpr, DIRECT: tl.constexpr, KP: tl.constexpr, BINS: tl.constexpr,
        MUL_WEIGHT: tl.constexpr, PER_SPLIT: tl.constexpr, WHOLE_CHUNKS: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GROUP_M: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, SWAP_AB: tl.constexpr,
        PDL: tl.constexpr, EARLY: tl.constexpr,
    ):
        """two_launch, step 2: out[pair // OUT_DIV] += w[pair] * inter[row] @ w2[e].T.

        Grid axis 1 is the split-K index: CTA s reduces over the s-th contiguous share of N.
        FP8: see ``_down_tile``; SWAP_AB: ``_fp8_dot``. PDL, EARLY: ``pdl`` (the cast follows)."""
        pdl_prologue(PDL, EARLY)
        num_n = tl.cdiv(H, BN)
        pid_m, pid_n = _block_coords(tl.program_id(0), num_m, num_n, GROUP_M)
        live, expert, rows, _, out_rows, row_ok, w = _block_rows(
            pid_m, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_pairs, ids_ptr, weights_ptr, num_tokens,
            top_k, num_experts, 1, OUT_DIV, BM, DIRECT, KP, BINS, MUL_WEIGHT)
        if not live:
            return
        offs_h = pid_n * BN + tl.arange(0, BN)
        # This split's share of the reduction: PER_SPLIT = ceil(ceil(N / BK) / split_k) whole
        # BK chunks (computed on the host so the loop bound is a compile-time constant).
        acc = _down_tile(inter_ptr, w2_ptr, is_ptr, ws_ptr, rows, row_ok, expert, offs_h,
                         tl.program_id(1) * PER_SPLIT, H, N, stride_im, stride_we, stride_wh, stride_wk,
                         stride_ism, stride_wse, stride_wsh, stride_wsk, PER_SPLIT, BM, BN, BK, PRECISION, FP8,
                         WHOLE_CHUNKS, SWAP_AB)
        h_ok = offs_h < H
        if MUL_WEIGHT:
            acc = acc * w[:, None]
        o_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_h[None, :]
        tl.atomic_add(o_ptrs, acc, mask=row_ok[:, None] & h_ok[None, :], sem="relaxed")

    @triton.jit
    def _decode_step(acc, it, j_end, ids, valid, wts, named, inter_ptr, w2_ptr, is_ptr, ws_ptr, offs_h,
                     num_experts, H: tl.constexpr, N: tl.constexpr, stride_im, stride_we, stride_wh, stride_wk,
                     stride_ism, stride_wse, stride_wsh, stride_wsk, N_CHUNKS: tl.constexpr, BM: tl.constexpr,
                     BK: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr):
        """One step of ``_gemm2_decode_kernel``'s loop: acc + w * (inter rows of named expert j)
        @ w2[e_j][h-tile, chunk c].T, for j, c = divmod(it, N_CHUNKS). A block at or past
        ``j_end`` (the end of this CTA's share, at most the named count) reads nothing and adds
        zero.

        FP8: the chunk is BK / 128 scale groups (BK a multiple of 128), one fp8 dot per group,
        each scaled by its row and weight-block scales and added in group order, so the sum is
        the same as with 128-wide chunks; a wider chunk keeps more w2 bytes in flight per step."""
        j = it // N_CHUNKS
        c = it % N_CHUNKS
        live, expert, rows, _, row_ok, w = _direct_block(j, ids, valid, wts, named, num_experts, BM)
        live = live & (j < j_end)
        row_ok = row_ok & live
        rows64 = rows.to(tl.int64)
        h_ok = offs_h < H
        a_base = inter_ptr + rows64[:, None] * stride_im
        b_base = w2_ptr + expert.to(tl.int64) * stride_we + offs_h[None, :] * stride_wh
        s_base = ws_ptr + expert.to(tl.int64) * stride_wse + (offs_h // _SB) * stride_wsh
        GROUP: tl.constexpr = _SB if FP8 else BK  # the reduction width of one dot
        for g in tl.static_range(BK // GROUP):
            group = c * (BK // GROUP) + g
            offs_k = group * GROUP + tl.arange(0, GROUP)
            k_ok = offs_k < N
            a = tl.load(a_base + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_base + offs_k[:, None] * stride_wk, mask=live & k_ok[:, None] & h_ok[None, :],
                        other=0.0)  # [GROUP, BN] = w2[e].T tile
            if FP8:
                group_ok = group < N // _SB
                a_s = tl.load(is_ptr + rows64 * stride_ism + group, mask=row_ok & group_ok, other=0.0)
                b_s = tl.load(s_base + group * stride_wsk, mask=live & h_ok & group_ok, other=0.0)
                acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :]) * w[:, None]
            else:
                acc += tl.dot(a, b, input_precision=PRECISION) * w[:, None]
        return acc

    @triton.jit(do_not_specialize=_NO_SPECIALIZE_DECODE)
    def _gemm2_decode_kernel(
        inter_ptr, w2_ptr, out_ptr, part_ptr, count_ptr, weights_ptr, ids_ptr, num_tokens, top_k, num_experts,
        H: tl.constexpr, N: tl.constexpr,
        stride_im, stride_we, stride_wh, stride_wk, stride_om,
        is_ptr, ws_ptr, stride_ism, stride_wse, stride_wsh, stride_wsk,
        MAX_BLOCKS: tl.constexpr, N_CHUNKS: tl.constexpr, SPLITS: tl.constexpr, RUNTIME_TRIP: tl.constexpr,
        KP: tl.constexpr, BINS: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """two_launch under direct addressing with split_k = 1, step 2, without atomic adds:
        the CTAs of column tile h (grid axis 0) own out[:, h-tile]. CTA (h, s) walks the s-th
        of SPLITS contiguous shares of the named experts, (expert j, reduction chunk c) in
        order in one flat loop (so the software pipeline runs across experts without
        draining), adding w * (inter rows of block j) @ w2[e_j][h-tile, chunk c].T into
        float32 registers.

        SPLITS = 1: the tile is stored once in the output's dtype. SPLITS > 1 (more CTAs, so
        more w2 bytes in flight, where the column tiles alone leave SMs idle or one CTA per SM):
        each CTA stores its float32 partial in ``part`` [SPLITS, BM, H] and counts itself in
        ``count[h]`` (zeroed by GEMM1); the last of the tile's CTAs to arrive adds the SPLITS
        partials in split order and stores the tile. Either way the output needs no zeroing and
        no final cast, and the sum has a fixed order (this schedule is deterministic).

        RUNTIME_TRIP: the trip count is the CTA's share of the named experts (counted here from
        the ids); Triton's interpreter cannot loop to a run-time bound, so there it walks
        ceil(MAX_BLOCKS / SPLITS) experts (no share is longer) and the ones past its share are
        masked out (no loads, zero contribution). FP8: as ``_down_tile``. PDL: waits for GEMM1."""
        pdl_prologue(PDL, False)
        ids, valid, wts, named = _direct_routing(ids_ptr, weights_ptr, num_tokens, top_k, num_experts, BM, KP, BINS, True)
        num_named = tl.max(named, 0)
        # Never more splits than named experts: the CTAs past those exit, and with one named
        # expert the tile is stored directly. The shares differ by at most one expert.
        splits = tl.minimum(tl.maximum(num_named, 1), SPLITS)
        if tl.program_id(1) < splits:
            _decode_gemm2_tile(tl.program_id(0), tl.program_id(1), splits, num_named, ids, valid, wts, named,
                               inter_ptr, w2_ptr, out_ptr, part_ptr, count_ptr, num_tokens, num_experts, H, N,
                               stride_im, stride_we, stride_wh, stride_wk, stride_om,
                               is_ptr, ws_ptr, stride_ism, stride_wse, stride_wsh, stride_wsk,
                               MAX_BLOCKS, N_CHUNKS, SPLITS, RUNTIME_TRIP, BM, BN, BK, PRECISION, FP8)

    @triton.jit
    def _decode_gemm2_tile(pid_h, split, splits, num_named, ids, valid, wts, named,
                           inter_ptr, w2_ptr, out_ptr, part_ptr, count_ptr, num_tokens, num_experts,
                           H: tl.constexpr, N: tl.constexpr,
                           stride_im, stride_we, stride_wh, stride_wk, stride_om,
                           is_ptr, ws_ptr, stride_ism, stride_wse, stride_wsh, stride_wsk,
                           MAX_BLOCKS: tl.constexpr, N_CHUNKS: tl.constexpr, SPLITS: tl.constexpr,
                           RUNTIME_TRIP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           PRECISION: tl.constexpr, FP8: tl.constexpr):
        """The decode GEMM2's work for column tile ``pid_h``, share ``split`` of ``splits`` of
        the named experts (see ``_gemm2_decode_kernel``): the tile stored, or this share's
        partial stored and, by the share that arrives last, the tile summed and stored."""
        offs_h = pid_h * BN + tl.arange(0, BN)
        h_ok = offs_h < H
        j_begin = split * num_named // splits
        j_end = (split + 1) * num_named // splits
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if RUNTIME_TRIP:
            for it in range(j_begin * N_CHUNKS, j_end * N_CHUNKS):
                acc = _decode_step(acc, it, j_end, ids, valid, wts, named, inter_ptr, w2_ptr, is_ptr, ws_ptr,
                                   offs_h, num_experts, H, N, stride_im, stride_we, stride_wh, stride_wk,
                                   stride_ism, stride_wse, stride_wsh, stride_wsk, N_CHUNKS, BM, BK, PRECISION, FP8)
        else:
            for i in range(0, tl.cdiv(MAX_BLOCKS, SPLITS) * N_CHUNKS):
                acc = _decode_step(acc, j_begin * N_CHUNKS + i, j_end, ids, valid, wts, named, inter_ptr, w2_ptr,
                                   is_ptr, ws_ptr, offs_h, num_experts, H, N, stride_im, stride_we, stride_wh,
                                   stride_wk, stride_ism, stride_wse, stride_wsh, stride_wsk, N_CHUNKS, BM, BK,
                                   PRECISION, FP8)
        tok = tl.arange(0, BM).to(tl.int64)
        o_ptrs = out_ptr + tok[:, None] * stride_om + offs_h[None, :]
        o_mask = (tok < num_tokens)[:, None] & h_ok[None, :]
        if splits == 1:
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            p_ptrs = part_ptr + tok[:, None] * H + offs_h[None, :]  # split 0's [BM, BN] partial
            # Only the tokens' rows (the others are zero sums, never stored).
            tl.store(p_ptrs + split * BM * H, acc, mask=o_mask)
            # Every thread's partial is written before the (one-thread) release of the count.
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_h, 1, sem="acq_rel", scope="gpu")
            if arrived == splits - 1:
                total = tl.zeros((BM, BN), dtype=tl.float32)
                # Unrolled, so that every partial's load is issued before the first add waits (a
                # loop waited one L2 round trip per split); .cg: from L2, where the other CTAs'
                # partials are (never this SM's L1).
                for t in tl.static_range(SPLITS):
                    total += tl.load(p_ptrs + t * BM * H, mask=o_mask & (t < splits), other=0.0,
                                     cache_modifier=".cg")
                tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=o_mask)

    @triton.jit
    def _gate_up_step(acc_g, acc_u, c, live, x_ptr, w13_ptr, a_rows, row_ok, expert, offs_n,
                      H: tl.constexpr, N: tl.constexpr, stride_xm, stride_we, stride_wn, stride_wk,
                      xs_ptr, ws_ptr, stride_xsm, stride_wse, stride_wsn, stride_wsk,
                      BK: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, SWAP_AB: tl.constexpr):
        """(acc_g, acc_u) plus reduction chunk ``c`` of the gate and up dot products (as
        ``_swiglu_tile``'s loop body, addressed from ``c``); nothing is read where ``live`` is
        False."""
        offs_k = c * BK + tl.arange(0, BK)
        k_ok = (offs_k < H) & live
        n_ok = offs_n < N
        w_base = w13_ptr + expert.to(tl.int64) * stride_we
        a = tl.load(x_ptr + a_rows[:, None] * stride_xm + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        g_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(g_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8:
            ws_base = ws_ptr + expert.to(tl.int64) * stride_wse + c * stride_wsk
            a_s = tl.load(xs_ptr + a_rows * stride_xsm + c, mask=row_ok & live, other=0.0)
            g_s = tl.load(ws_base + (offs_n // _SB) * stride_wsn, mask=n_ok & live, other=0.0)
            u_s = tl.load(ws_base + ((N + offs_n) // _SB) * stride_wsn, mask=n_ok & live, other=0.0)
            acc_g += _fp8_dot(a, g, SWAP_AB) * (a_s[:, None] * g_s[None, :])
            acc_u += _fp8_dot(a, u, SWAP_AB) * (a_s[:, None] * u_s[None, :])
        else:
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        return acc_g, acc_u

    @triton.jit
    def _persistent_gemm1_unit(u, splits, ids, valid, wts, named, x_ptr, w13_ptr, inter_ptr, part_ptr, count_ptr,
                               num_experts, H: tl.constexpr, N: tl.constexpr,
                               stride_xm, stride_we, stride_wn, stride_wk, stride_im,
                               xs_ptr, ws_ptr, is_ptr, stride_xsm, stride_wse, stride_wsn, stride_wsk, stride_ism,
                               MAX_SPLITS: tl.constexpr, RUNTIME_TRIP: tl.constexpr, BM: tl.constexpr,
                               BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
                               SOFT_ROUND: tl.constexpr, SWAP_AB: tl.constexpr, SHARED_FIXUP: tl.constexpr,
                               FIX_BLOCKS: tl.constexpr, stamps_ptr, STAMPS: tl.constexpr):
        """Phase 1 of ``_persistent_decode_kernel``, work unit ``u``: share ``u % splits`` of the
        reduction chunks of (named expert j, column tile t) = divmod(u // splits, N tiles).
        Unsplit, it stores SwiGLU of its sums as the intermediate (as GEMM1). Split, it stores
        its float32 gate and up partials in ``part[u]`` [BM, 2 BN] and counts itself at the tile's
        count; the tile's partials are then added in share order and stored as the intermediate in
        FIX_BLOCKS row blocks: SHARED_FIXUP, by every share (its blocks share, share + splits, ...)
        once all have arrived; else by the share that arrives last (see PERSISTENT_SHARED_FIXUP).
        Either way each element is the same sum, bit for bit."""
        TILES: tl.constexpr = (N + BN - 1) // BN
        CHUNKS: tl.constexpr = (H + BK - 1) // BK
        tile = u // splits
        share = u % splits
        j = tile // TILES
        pid_n = tile % TILES
        _, expert, rows, a_rows, row_ok, _ = _direct_block(j, ids, valid, wts, named, num_experts, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        c_begin = share * CHUNKS // splits
        c_end = (share + 1) * CHUNKS // splits
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        if RUNTIME_TRIP:
            for c in range(c_begin, c_end):
                acc_g, acc_u = _gate_up_step(acc_g, acc_u, c, True, x_ptr, w13_ptr, a_rows, row_ok, expert, offs_n,
                                             H, N, stride_xm, stride_we, stride_wn, stride_wk, xs_ptr, ws_ptr,
                                             stride_xsm, stride_wse, stride_wsn, stride_wsk, BK, PRECISION, FP8,
                                             SWAP_AB)
        else:  # the interpreter: a constant trip count, chunks outside the share masked out
            for i in range(0, CHUNKS):
                acc_g, acc_u = _gate_up_step(acc_g, acc_u, c_begin + i, c_begin + i < c_end, x_ptr, w13_ptr, a_rows,
                                             row_ok, expert, offs_n, H, N, stride_xm, stride_we, stride_wn, stride_wk,
                                             xs_ptr, ws_ptr, stride_xsm, stride_wse, stride_wsn, stride_wsk, BK,
                                             PRECISION, FP8, SWAP_AB)
        _stamp(stamps_ptr, 5, STAMPS)
        if splits == 1:
            _store_act(inter_ptr, is_ptr, rows, pid_n, acc_g * tl.sigmoid(acc_g) * acc_u, stride_im, stride_ism,
                       N, BM, BN, FP8, SOFT_ROUND)
        else:
            r = tl.arange(0, BM)[:, None] * (2 * BN) + tl.arange(0, BN)[None, :]
            p_ptrs = part_ptr + tile * splits * (BM * 2 * BN) + r  # share 0's gate partial
            # Only the rows of tokens that picked the expert (the others are zero sums).
            p_ok = row_ok[:, None]
            tl.store(p_ptrs + share * (BM * 2 * BN), acc_g, mask=p_ok)
            tl.store(p_ptrs + share * (BM * 2 * BN) + BN, acc_u, mask=p_ok)
            # Every thread's partial is written before the (one-thread) release of the count.
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            FIX_ROWS: tl.constexpr = BM // FIX_BLOCKS
            if SHARED_FIXUP:
                # Every share waits for the others (all resident: with splits > 1 each program has
                # one phase-1 unit), then sums and stores row blocks share, share + splits, ...
                seen = arrived + 1
                while seen < splits:
                    seen = tl.atomic_add(count_ptr + tile, 0, sem="acquire", scope="gpu")
                tl.debug_barrier()
                b = share
                step = splits
            else:  # the share that arrives last does every row block
                b = tl.where(arrived == splits - 1, 0, FIX_BLOCKS)
                step = 1
            ok_blocks = tl.reshape(row_ok.to(tl.int32), (FIX_BLOCKS, FIX_ROWS))
            while b < FIX_BLOCKS:
                # Row block b of the tile: its rows' validity picked out of row_ok (no slicing in Triton)
                ok_b = tl.sum(tl.where(tl.arange(0, FIX_BLOCKS)[:, None] == b, ok_blocks, 0), 0) > 0
                rows_b = b * FIX_ROWS + tl.arange(0, FIX_ROWS)
                b_ptrs = (part_ptr + tile * splits * (BM * 2 * BN) + rows_b[:, None] * (2 * BN)
                          + tl.arange(0, BN)[None, :])
                g_sum = tl.zeros((FIX_ROWS, BN), dtype=tl.float32)
                u_sum = tl.zeros((FIX_ROWS, BN), dtype=tl.float32)
                # Unrolled: every share's loads are issued before the first add waits.
                for t in tl.static_range(MAX_SPLITS):
                    t_ok = ok_b[:, None] & (t < splits)
                    g_sum += tl.load(b_ptrs + t * (BM * 2 * BN), mask=t_ok, other=0.0, cache_modifier=".cg")
                    u_sum += tl.load(b_ptrs + t * (BM * 2 * BN) + BN, mask=t_ok, other=0.0, cache_modifier=".cg")
                _stamp(stamps_ptr, 7, STAMPS)
                _store_act(inter_ptr, is_ptr, j * BM + rows_b, pid_n, g_sum * tl.sigmoid(g_sum) * u_sum, stride_im,
                           stride_ism, N, FIX_ROWS, BN, FP8, SOFT_ROUND)
                b += step
        _stamp(stamps_ptr, 6, STAMPS)

    @triton.jit
    def _grid_barrier(count_ptr, num_programs):
        """Wait until every program of the grid has arrived (a cooperative launch keeps them
        all resident, so the spin cannot starve a program that has not started). Writes made
        before the barrier by any program are visible after it: release on arrival, acquire
        while polling, and a CTA barrier on each side for the other threads."""
        tl.debug_barrier()
        seen = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") + 1
        while seen < num_programs:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def _stamp(stamps_ptr, k, STAMPS: tl.constexpr):
        """Probe only (STAMPS): this program's k-th timestamp (ns, the GPU's global timer)."""
        if STAMPS:
            tl.store(stamps_ptr + tl.program_id(0) * 8 + k, globaltimer())

    @triton.jit(do_not_specialize=_NO_SPECIALIZE_DECODE)
    def _persistent_decode_kernel(
        x_ptr, w13_ptr, w2_ptr, inter_ptr, out_ptr, part1_ptr, part2_ptr, sync_ptr, stamps_ptr, weights_ptr,
        ids_ptr, num_tokens, top_k, num_experts, H: tl.constexpr, N: tl.constexpr,
        stride_xm, stride_w13e, stride_w13n, stride_w13k, stride_w2e, stride_w2h, stride_w2k, stride_im, stride_om,
        xs_ptr, w13s_ptr, w2s_ptr, is_ptr, stride_xsm, stride_w13se, stride_w13sn, stride_w13sk,
        stride_w2se, stride_w2sh, stride_w2sk, stride_ism,
        PHASES: tl.constexpr, MAX_BLOCKS: tl.constexpr,
        MAX_SPLITS1: tl.constexpr, SPLITS2: tl.constexpr, RUNTIME_TRIP: tl.constexpr, KP: tl.constexpr,
        BINS: tl.constexpr, BM: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr, BN2: tl.constexpr,
        BK2: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, SOFT_ROUND: tl.constexpr,
        SWAP_AB: tl.constexpr, SHARED_FIXUP: tl.constexpr, FIX_BLOCKS: tl.constexpr, STAMPS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """The decode schedule in one launch: GEMM1 + SwiGLU, a grid barrier, the decode GEMM2.

        A cooperative grid of about two CTAs per SM walks two lists of equal work units.
        Phase 1 (``_persistent_gemm1_unit``): (named expert, N tile, reduction share), with
        the reduction split into as many shares as bring the units to about the grid size
        (at most MAX_SPLITS1), so few named experts with a narrow N (deepseek-v3's TP8 shard)
        still stream w13 from every SM. Phase 2 (``_decode_gemm2_tile``): (H tile, expert
        share), as ``_gemm2_decode_kernel``'s grid. The barrier replaces the kernel boundary
        between the two launches of the two-kernel schedule; every sum has a fixed order, so
        the call is deterministic.

        ``sync`` (int32, zeroed by the caller): [0] the barrier, [1, 1 + grid) phase 1's tile
        counts, then phase 2's. PHASES: 3 on the GPU (both phases, the barrier between); the
        interpreter runs programs one after another, so a spin would never end: it launches the
        kernel twice, PHASES = 1 then 2. Each program walks units pid, pid + grid, ...
        RUNTIME_TRIP: the reduction loops run to run-time bounds (GPU); the interpreter walks
        every chunk, masking the ones outside the unit's share. SWAP_AB: phase 1's FP8 dots
        as ``_fp8_dot`` (phase 2's column tiles are too narrow for the warpgroup MMA's 64 rows).
        PDL: waits for the zeroing of ``sync`` (``pdl``). STAMPS (probes only): each program
        writes the global timer to ``stamps[pid, 0..4]`` as it starts, after the routing, after
        phase 1, after the barrier and at its end, and to ``stamps[pid, 5..7]`` as its last phase-1
        unit ends its reduction loop and its epilogue and (the share that sums a split tile) has
        summed the partials."""
        pdl_prologue(PDL, False)
        _stamp(stamps_ptr, 0, STAMPS)
        pid = tl.program_id(0)
        grid = tl.num_programs(0)
        TILES1: tl.constexpr = (N + BN1 - 1) // BN1
        TILES2: tl.constexpr = (H + BN2 - 1) // BN2
        ids, valid, wts, named = _direct_routing(ids_ptr, weights_ptr, num_tokens, top_k, num_experts, BM, KP, BINS,
                                                 True)
        num_named = tl.max(named, 0)
        _stamp(stamps_ptr, 1, STAMPS)
        if PHASES % 2 == 1:
            tiles = num_named * TILES1
            splits1 = tl.minimum(tl.maximum(grid // tl.maximum(tiles, 1), 1), MAX_SPLITS1)
            units1 = tiles * splits1
            u = pid
            while u < units1:
                _persistent_gemm1_unit(u, splits1, ids, valid, wts, named, x_ptr, w13_ptr, inter_ptr, part1_ptr,
                                       sync_ptr + 1, num_experts, H, N,
                                       stride_xm, stride_w13e, stride_w13n, stride_w13k, stride_im,
                                       xs_ptr, w13s_ptr, is_ptr, stride_xsm, stride_w13se, stride_w13sn,
                                       stride_w13sk, stride_ism, MAX_SPLITS1, RUNTIME_TRIP, BM, BN1, BK1,
                                       PRECISION, FP8, SOFT_ROUND, SWAP_AB, SHARED_FIXUP, FIX_BLOCKS, stamps_ptr,
                                       STAMPS)
                u += grid
        _stamp(stamps_ptr, 2, STAMPS)
        if PHASES == 3:
            _grid_barrier(sync_ptr, grid)
        _stamp(stamps_ptr, 3, STAMPS)
        if PHASES >= 2:
            splits2 = tl.minimum(tl.maximum(num_named, 1), SPLITS2)
            # Share-major order: the live units (shares < splits2) are the first ones.
            u = pid
            while u < splits2 * TILES2:
                _decode_gemm2_tile(u % TILES2, u // TILES2, splits2, num_named, ids, valid, wts, named,
                                   inter_ptr, w2_ptr, out_ptr, part2_ptr, sync_ptr + 1 + grid, num_tokens,
                                   num_experts, H, N, stride_im, stride_w2e, stride_w2h, stride_w2k, stride_om,
                                   is_ptr, w2s_ptr, stride_ism, stride_w2se, stride_w2sh, stride_w2sk,
                                   MAX_BLOCKS, (N + BK2 - 1) // BK2, SPLITS2, RUNTIME_TRIP, BM, BN2, BK2,
                                   PRECISION, FP8)
                u += grid
        _stamp(stamps_ptr, 4, STAMPS)

    @triton.jit(do_not_specialize=_NO_SPECIALIZE)
    def _fused_kernel(
        x_ptr, w13_ptr, w2_ptr, out_ptr, weights_ptr,
        sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_pairs, ids_ptr, num_tokens, top_k, num_experts,
        num_m, H: tl.constexpr, N: tl.constexpr,
        stride_xm, stride_w13e, stride_w13n, stride_w13k, stride_w2e, stride_w2h, stride_w2k, stride_om,
        xs_ptr, w13s_ptr, w2s_ptr, stride_xsm, stride_w13se, stride_w13sn, stride_w13sk,
        stride_w2se, stride_w2sh, stride_w2sk,
        A_DIV: tl.constexpr, OUT_DIV: tl.constexpr, DIRECT: tl.constexpr, KP: tl.constexpr,
        BINS: tl.constexpr, MUL_WEIGHT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GROUP_M: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, SOFT_ROUND: tl.constexpr,
        SWAP_AB: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    ):
        """fused: one CTA = one token block x one N-tile; SwiGLU in registers, then its share of
        the down-projection, added into out over all H in BK-wide chunks.

        FP8: BN == BK == 128, so the CTA's N-tile is N scale block pid_n and H chunk h0 is H
        scale block h0: one activation scale per row and one w2 scale per chunk. SWAP_AB: see
        ``_fp8_dot``. PDL, EARLY: ``pdl`` (the cast follows)."""
        pdl_prologue(PDL, EARLY)
        num_n = tl.cdiv(N, BN)
        pid_m, pid_n = _block_coords(tl.program_id(0), num_m, num_n, GROUP_M)
        live, expert, _, a_rows, out_rows, row_ok, w = _block_rows(
            pid_m, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_pairs, ids_ptr, weights_ptr, num_tokens,
            top_k, num_experts, A_DIV, OUT_DIV, BM, DIRECT, KP, BINS, MUL_WEIGHT)
        if not live:
            return
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        act = _swiglu_tile(x_ptr, w13_ptr, a_rows, row_ok, expert, offs_n, H, N,
                           stride_xm, stride_w13e, stride_w13n, stride_w13k,
                           xs_ptr, w13s_ptr, stride_xsm, stride_w13se, stride_w13sn, stride_w13sk,
                           BM, BN, BK, PRECISION, FP8, SWAP_AB)
        if FP8:
            # In-register re-quantization: the tile is one 128-column group of every row.
            act, act_s = _quantize_tile(act, SOFT_ROUND)
            w2s_ptrs = w2s_ptr + expert.to(tl.int64) * stride_w2se + pid_n * stride_w2sk
        else:
            # Same rounding as the two_launch intermediate, and the dtype the tensor cores take.
            act = act.to(x_ptr.dtype.element_ty)
        offs_h = tl.arange(0, BK)
        # w2[e, h, n] read as a [BN, BK] tile (n down, h across) = (w2[e][h-chunk, n-tile]).T
        b_ptrs = (w2_ptr + expert.to(tl.int64) * stride_w2e + offs_n[:, None] * stride_w2k
                  + offs_h[None, :] * stride_w2h)
        o_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_h[None, :]
        for h0 in range(0, tl.cdiv(H, BK)):
            h_ok = offs_h < H - h0 * BK
            b = tl.load(b_ptrs, mask=n_ok[:, None] & h_ok[None, :], other=0.0)
            if FP8:
                part = _fp8_dot(act, b, SWAP_AB) * (act_s[:, None] * tl.load(w2s_ptrs + h0 * stride_w2sh))
            else:
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


def _is_fp8_weights(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """True for FP8 W8A8 weights; mixed or other float8 formats are not implemented."""
    fp8 = [t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in (w13, w2)]
    if not any(fp8):
        return False
    if w13.dtype != _FP8 or w2.dtype != _FP8:
        raise NotImplementedError(f"FP8 experts need both w13 and w2 in {_FP8} (W8A8 with block scales); "
                                  f"got w13 {w13.dtype} and w2 {w2.dtype}")
    return True


def _check_scale(name: str, s: torch.Tensor | None, shape: tuple, device) -> torch.Tensor:
    if s is None:
        raise ValueError(f"{name} is required with FP8 weights/tokens: a float32 tensor of shape {shape}")
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != tuple(shape):
        got = f"{tuple(s.shape)} {s.dtype}" if isinstance(s, torch.Tensor) else type(s).__name__
        raise ValueError(f"{name} must be a float32 tensor of shape {tuple(shape)}, got {got}")
    if s.device != device:
        raise ValueError(f"{name} is on {s.device} but the activations are on {device}")
    return s


def _fp8_weight_scales(E: int, N: int, H: int, w13_scale, w2_scale, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the FP8 shape constraints and the weight block scales (quantize_blocks(w, 128))."""
    g = FP8_GROUP
    if H % g:
        raise ValueError(f"FP8 needs the hidden size H to be a multiple of {g}, got H={H}")
    if N % g:
        raise ValueError(f"FP8 needs the intermediate size N to be a multiple of {g}, got N={N}")
    w13_scale = _check_scale("w13_scale", w13_scale, (E, 2 * N // g, H // g), device)
    w2_scale = _check_scale("w2_scale", w2_scale, (E, H // g, N // g), device)
    return w13_scale, w2_scale


def _no_scales(**scales) -> None:
    for name, s in scales.items():
        if s is not None:
            raise ValueError(f"{name} is only for FP8 ({_FP8}) weights/tokens; the inputs are not FP8")


def _check_config(config: KernelConfig, fp8: bool) -> None:
    """The FP8 rules for FP8 weights; 16/32-bit weights have no dots to swap."""
    err = fp8_config_error(config) if fp8 else None
    if err:
        raise ValueError(f"config is not valid for FP8: {err}")
    if config.swap_ab and not fp8:
        raise ValueError("KernelConfig.swap_ab is for FP8 weights only (it swaps the FP8 dots' operands)")


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs: exact float32 products ("ieee"), not tf32, so fp32 runs can be checked
    # to 1e-4 and serve as a precise path; 16-bit inputs use the tensor cores as they are.
    return "ieee" if dtype == torch.float32 else "tf32"


def _decode_schedule(config: KernelConfig, al: Alignment | DirectBlocks) -> bool:
    """two_launch over direct addressing without split-K: GEMM2 sums a token's experts in
    registers (``_gemm2_decode_kernel``), so there are no atomics, no zeroed float32 buffer and
    no final cast: two launches in all."""
    return config.form == "two_launch" and config.split_k == 1 and isinstance(al, DirectBlocks)


def _decode_column_tile(H: int, device: torch.device) -> int:
    """The decode schedule's GEMM2 column tile (not the config's bn, which tiles GEMM1 there).

    32 columns: with each [chunk, tile] of w2 a CTA also reads the [bm, chunk] slice of the
    intermediate (from L2), so a 16-column tile reads as many intermediate bytes as weight
    bytes, and measured up to a third slower (the split probe in docs/kernel.md). The GPU is
    filled by splitting the experts (``_decode_gemm2_plan``) rather than by narrowing the
    tile; 64 columns only where 32 would give more than DECODE_CTAS_PER_SM CTAs per SM on its
    own (H > 8448 on 132 SMs).
    """
    return 64 if -(-H // 32) > DECODE_CTAS_PER_SM * sm_count(device) else 32


# The decode GEMM2 streams w2 with one or two CTAs per SM, so each CTA must keep many bytes in
# flight (Little's law: ~32 GB/s per SM at the copy rate, times ~1-2 µs of loaded latency).
# With the config's bk = 128 a chunk of a 32-column tile of w2 is 8 KB; the chunk is widened
# towards DECODE_W2_CHUNK_BYTES (on an H200 this took olmoe's bf16 GEMM2, then with 16-column
# tiles, from 58 to 42 µs of call time; FP8 widens it by whole 128-column scale groups). The
# pipeline depth stays the config's: deeper (5-6 stages) measured slower than 3-4.
# DECODE_CTAS_PER_SM: the named experts are split over more CTAs (``_gemm2_decode_kernel``'s
# SPLITS) until the grid has about that many per SM (olmoe at M = 1 on an H200: 4 splits of
# 64 tiles, GEMM2 call 50 -> 35 µs; docs/kernel.md).
DECODE_W2_CHUNK_BYTES = 16 * 1024
DECODE_SMEM_BUDGET = 192 * 1024
DECODE_CTAS_PER_SM = 2
# FP8 w2 (1-byte elements) under token blocks of at most 32 rows is widened further, towards
# DECODE_W2_CHUNK_BYTES_FP8 (a 32-column tile's whole row up to N = 1024), counting stages - 1
# copies in the budget: compiled for sm_90 (bm 16 / 32, 2-5 stages), those kernels' shared
# memory is that of phase 1's tiles plus stages - 1 chunk copies, and every plan fits two CTAs
# per SM where it did before. (At bm >= 64 the compiled kernels hold `stages` copies and more,
# so they keep the bf16 rule.) On an H200 (benchmarks/results/h200-decode-timeline, 539b99b) this
# took the best FP8 decode call from 148.8 to 131.4 µs at qwen3 M = 16, beta = 1, and 30.0 to 28.8
# at M = 1; for bf16 the same widening was slower (31.8 -> 34.1 µs at qwen3 M = 1).
DECODE_W2_CHUNK_BYTES_FP8 = 32 * 1024
# The decode schedule runs as one cooperative launch (``_persistent_decode_kernel``: GEMM1, a
# grid barrier, GEMM2) instead of two kernels; False selects the two-kernel version (kept to
# measure one against the other). The persistent grid takes up to PERSISTENT_CTAS_PER_SM CTAs
# per SM (fewer where the compiled kernel's registers or shared memory do not allow it), and
# splits each GEMM1 tile's reduction into at most PERSISTENT_MAX_SPLITS shares. The
# interpreter runs INTERPRET_GRID programs (it runs them one by one; a few exercise the loops).
DECODE_PERSISTENT = True
PERSISTENT_CTAS_PER_SM = 2
PERSISTENT_MAX_SPLITS = 8
# A phase-1 tile split into shares is summed, SwiGLU'd and stored in PERSISTENT_FIX_BLOCKS row
# blocks. FP8 (PERSISTENT_SHARED_FIXUP): every share waits until all have stored their partials and
# does its blocks, where the last share to arrive used to do the whole tile alone, its re-quantizing
# epilogue the end of phase 1 (on an H200, best FP8 config: qwen3-30b-a3b M = 16 beta = 0.25,
# 31.3 -> 28.2 µs; deepseek-v3-ep32 37.0 -> 31.9). 16-bit tiles keep the last share summing the
# whole tile (the shared version was 0.3-0.5 µs slower there). benchmarks/results/h200-decode-timeline,
# 4f5d68e.
PERSISTENT_SHARED_FIXUP = True
PERSISTENT_FIX_BLOCKS = 4
INTERPRET_GRID = 5
# Probes only: an int64 tensor of at least 8 x grid elements; while set, every persistent launch
# writes its programs' phase timestamps there (``_persistent_decode_kernel``'s STAMPS).
PERSISTENT_STAMPS: torch.Tensor | None = None


def _decode_gemm2_plan(H: int, N: int, bm: int, bk: int, stages: int, elem_bytes: int, max_blocks: int,
                       device: torch.device) -> tuple[int, int, int]:
    """(column tile, reduction chunk, expert splits) of the decode schedule's GEMM2.

    The column tile is :func:`_decode_column_tile`'s. The splits bring the grid (column tiles x
    splits) to about DECODE_CTAS_PER_SM CTAs per SM, at most one split per block that can be
    named (``max_blocks``). The chunk is the config's bk, widened (in powers of two) towards
    ``DECODE_W2_CHUNK_BYTES`` of w2 and N rounded up to a power of two, as long as ``stages``
    copies of the [bm, chunk] and [chunk, tile] tiles fit DECODE_SMEM_BUDGET shared among the
    CTAs an SM then holds. FP8 (bk = 128) widens it by whole scale groups, one dot per group
    (``_decode_step``); with bm <= 32 towards ``DECODE_W2_CHUNK_BYTES_FP8``, counting stages - 1
    copies (see there).
    """
    bn = _decode_column_tile(H, device)
    tiles = -(-H // bn)
    sms = sm_count(device)
    splits = max(1, min(max_blocks, round(DECODE_CTAS_PER_SM * sms / tiles)))
    narrow_fp8 = elem_bytes == 1 and bm <= 32
    chunk_bytes, copies = ((DECODE_W2_CHUNK_BYTES_FP8, stages - 1) if narrow_fp8
                           else (DECODE_W2_CHUNK_BYTES, stages))
    budget = DECODE_SMEM_BUDGET // max(1, min(DECODE_CTAS_PER_SM, -(-tiles * splits // sms)))
    target = min(max(bk, chunk_bytes // (bn * elem_bytes)), 1 << max(0, N - 1).bit_length())
    chunk = bk
    while chunk < target and copies * (bm + bn) * 2 * chunk * elem_bytes <= budget:  # (the doubled chunk)
        chunk *= 2
    return bn, chunk, splits


def _scale_args(scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, unused: torch.Tensor):
    """The kernels' FP8 scale arguments: (x scales, stride), (w13 scales, 3 strides), (w2 scales,
    3 strides). Without FP8 they are never read: any pointer (``unused``) and zero strides."""
    if scales is None:
        return (unused, 0), (unused, 0, 0, 0), (unused, 0, 0, 0)
    xs, w13s, w2s = scales
    return (xs, xs.stride(0)), (w13s, *w13s.stride()), (w2s, *w2s.stride())


def _intermediate(rows: int, N: int, dtype: torch.dtype, fp8: bool, unused: torch.Tensor):
    """two_launch's intermediate ``[rows, N]`` (e4m3 under FP8, else ``dtype``) and its scale
    arguments (FP8: the [rows, N/128] float32 scales and their row stride; else never read).
    Uninitialised: GEMM1 writes every row of every block it runs, GEMM2 reads only those."""
    inter = torch.empty(rows, N, dtype=_FP8 if fp8 else dtype, device=unused.device)
    if not fp8:
        return inter, (unused, 0)
    inter_s = torch.empty(rows, N // FP8_GROUP, dtype=torch.float32, device=unused.device)
    return inter, (inter_s, inter_s.stride(0))


def _run(x2d: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor | None,
         al: Alignment | DirectBlocks, out_rows: int, out_dtype: torch.dtype, a_div: int, out_div: int,
         config: KernelConfig, scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Launch the kernels of ``config`` over the token blocks of ``al``: the ``[out_rows, H]``
    output in ``out_dtype``.

    ``al`` is an alignment (sorted addressing) or :class:`DirectBlocks` (direct addressing,
    no alignment). ``scales`` = (x_scale [rows of x2d, H/128], w13_scale, w2_scale) selects
    the FP8 kernels (x2d, w13, w2 then e4m3); None the bf16/fp16/fp32 ones. Except in the
    decode schedule (``_decode_schedule``), the kernels add into a zeroed float32 buffer with
    atomics, cast once at the end (``expert_major`` has the expert-major layout's own
    two_launch kernels, which store each row once).
    """
    H = x2d.shape[1]
    N = w2.shape[2]
    device = x2d.device
    num_m = al.max_blocks
    decode = _decode_schedule(config, al)
    if num_m == 0:
        return torch.zeros(out_rows, H, dtype=out_dtype, device=device)
    out = (torch.empty(out_rows, H, dtype=out_dtype, device=device) if decode
           else pdl.zeros((out_rows, H), torch.float32, device))
    fp8 = scales is not None
    prec = _precision(x2d.dtype)
    c = config
    mul_weight = weights is not None
    wptr = weights if mul_weight else out  # any pointer; never read when MUL_WEIGHT is False
    addr, addr_const = al.kernel_args()
    on = pdl.pdl_on(device)
    launch = dict(num_warps=c.num_warps, num_stages=c.num_stages, PDL=on, **pdl.launch_options(on))
    xs_args, w13s_args, w2s_args = _scale_args(scales, out)
    soft = fp8 and _interpreting()
    if c.form == "fused":
        grid = (num_m * triton.cdiv(N, c.bn),)
        _fused_kernel[grid](
            x2d, w13, w2, out, wptr, *addr, num_m, H, N,
            x2d.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
            w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
            xs_args[0], w13s_args[0], w2s_args[0], xs_args[1], *w13s_args[1:], *w2s_args[1:],
            A_DIV=a_div, OUT_DIV=out_div, **addr_const, MUL_WEIGHT=mul_weight,
            BM=c.bm, BN=c.bn, BK=c.bk, GROUP_M=c.group_m, PRECISION=prec, FP8=fp8, SOFT_ROUND=soft,
            SWAP_AB=c.swap_ab, EARLY=pdl.early("fused", on, grid[0], device), **launch,
        )
        return pdl.cast(out, out_dtype)
    # Padding rows of blocks past the real end are never written nor read; rows inside real
    # blocks are all written by GEMM1, so empty() is safe.
    inter, is_args = _intermediate(al.capacity, N, x2d.dtype, fp8, out)
    if decode and DECODE_PERSISTENT:
        _run_persistent(x2d, w13, w2, wptr, inter, out, al, config, fp8, prec, soft,
                        xs_args, w13s_args, w2s_args, is_args)
        return out
    if decode:
        bn2, bk2, splits = _decode_gemm2_plan(H, N, c.bm, c.bk, c.num_stages, inter.element_size(), num_m, device)
        tiles = triton.cdiv(H, bn2)
        # Split partials and arrival counts (zeroed by GEMM1) only where the experts are split.
        part = torch.empty(splits, c.bm, H, dtype=torch.float32, device=device) if splits > 1 else out
        count = torch.empty(tiles, dtype=torch.int32, device=device) if splits > 1 else out
        counters = triton.next_power_of_2(tiles) if splits > 1 else 0
    else:
        count, tiles, counters = out, 0, 0
    grid1 = (num_m * triton.cdiv(N, c.bn),)
    _gemm1_swiglu_kernel[grid1](
        x2d, w13, inter, count, tiles, *addr, num_m, H, N,
        x2d.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), inter.stride(0),
        xs_args[0], w13s_args[0], is_args[0], xs_args[1], *w13s_args[1:], is_args[1],
        A_DIV=a_div, **addr_const, BM=c.bm, BN=c.bn, BK=c.bk, COUNTERS=counters, GROUP_M=c.group_m,
        PRECISION=prec, FP8=fp8, SOFT_ROUND=soft, SWAP_AB=c.swap_ab, EARLY=pdl.early("gemm1", on, grid1[0], device),
        **launch,
    )
    if decode:
        ids, num_tokens, top_k, num_experts = addr[4:]
        _gemm2_decode_kernel[(tiles, splits)](
            inter, w2, out, part, count, wptr, ids, num_tokens, top_k, num_experts, H, N,
            inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
            is_args[0], w2s_args[0], is_args[1], *w2s_args[1:],
            MAX_BLOCKS=num_m, N_CHUNKS=triton.cdiv(N, bk2), SPLITS=splits, RUNTIME_TRIP=not _interpreting(),
            KP=addr_const["KP"], BINS=addr_const["BINS"],
            BM=c.bm, BN=bn2, BK=bk2, PRECISION=prec, FP8=fp8, **launch,
        )
        return out
    grid2 = (num_m * triton.cdiv(H, c.gemm2_bn), c.split_k)
    per_split = triton.cdiv(triton.cdiv(N, c.bk), c.split_k)  # whole BK chunks per split
    _gemm2_kernel[grid2](
        inter, w2, out, wptr, *addr, num_m, H, N,
        inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
        is_args[0], w2s_args[0], is_args[1], *w2s_args[1:],
        OUT_DIV=out_div, **addr_const, MUL_WEIGHT=mul_weight,
        PER_SPLIT=per_split, WHOLE_CHUNKS=N % c.bk == 0 and per_split * c.split_k == N // c.bk,
        BM=c.bm, BN=c.gemm2_bn, BK=c.bk, GROUP_M=c.group_m, PRECISION=prec, FP8=fp8,
        SWAP_AB=c.swap_ab, EARLY=pdl.early("gemm2", on, grid2[0] * grid2[1], device), **launch,
    )
    return pdl.cast(out, out_dtype)


_RESIDENT_GRIDS: dict[tuple, int] = {}  # resident_grid's answer per binary


def _binary_key(kernel, args: tuple, const: dict, cap: int) -> tuple:
    """What decides the binary ``kernel`` compiles to for ``args`` and ``const`` (and so its
    registers and shared memory): per tensor its dtype and whether its address is 16-byte
    aligned (Triton specializes pointers on that), every other argument by value (the
    constexpr sizes, and the integers Triton specializes on == 1 and multiples of 16; keying
    on values is finer than that, never coarser), the constants and the cap. Two shapes with
    the same constants can compile to binaries of different sizes, and a cooperative grid
    sized for the smaller one fails to launch with the larger."""
    spec = tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    return (kernel.fn.__name__, device, spec, cap, tuple(sorted(const.items())))


def resident_grid(kernel, args: tuple, const: dict, cap: int) -> int:
    """As many programs of ``kernel`` (compiled for ``args`` and the constexprs / launch options
    ``const``) as the device's SMs hold at once, at most ``cap`` per SM: the grid of a kernel
    whose programs loop over work units. The answer depends only on the binary, so it is
    looked up once per ``_binary_key``: an eager call does not pay the compile-cache lookup
    twice."""
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    key = _binary_key(kernel, args, const, cap)
    grid = _RESIDENT_GRIDS.get(key)
    if grid is None:
        compiled = kernel.warmup(*args, grid=(1,), **const)
        grid = _RESIDENT_GRIDS[key] = sm_count(device) * resident_ctas_per_sm(compiled, device, cap)
    return grid


def _fixup_plan(fp8: bool, bm: int, interp: bool) -> tuple[bool, int]:
    """(every share sums its row blocks, row blocks) for a split phase-1 tile of the persistent
    decode kernel (see PERSISTENT_SHARED_FIXUP). The interpreter runs programs one after another, so
    a share there cannot wait for the others: the last one sums every block."""
    if not fp8:
        return False, 1
    return PERSISTENT_SHARED_FIXUP and not interp, min(PERSISTENT_FIX_BLOCKS, bm)


def _run_persistent(x2d, w13, w2, wptr, inter, out, al: DirectBlocks, c: KernelConfig, fp8: bool, prec: str,
                    soft: bool, xs_args, w13s_args, w2s_args, is_args) -> None:
    """The decode schedule as ``_persistent_decode_kernel``: one cooperative launch on the GPU
    (a grid as large as the SMs hold, so its barrier cannot wait on a CTA that is not running);
    two launches, one per phase, in the interpreter. Writes ``out``."""
    H, N = x2d.shape[1], w2.shape[2]
    device = x2d.device
    num_m = al.max_blocks
    bn2, bk2, splits2 = _decode_gemm2_plan(H, N, c.bm, c.bk, c.num_stages, inter.element_size(), num_m, device)
    tiles2 = triton.cdiv(H, bn2)
    max_splits1 = max(1, min(triton.cdiv(H, c.bk), PERSISTENT_MAX_SPLITS))
    addr, addr_const = al.kernel_args()
    ids, num_tokens, top_k, num_experts = addr[4:]
    interp = _interpreting()
    on = pdl.pdl_on(device)
    # (MAX_BLOCKS bounds only the interpreter's loops: 0 on the GPU, so every M shares a binary)
    shared_fixup, fix_blocks = _fixup_plan(fp8, c.bm, interp)
    const = dict(MAX_BLOCKS=num_m if interp else 0, MAX_SPLITS1=max_splits1, SPLITS2=splits2,
                 RUNTIME_TRIP=not interp, KP=addr_const["KP"], BINS=addr_const["BINS"], BM=c.bm, BN1=c.bn,
                 BK1=c.bk, BN2=bn2, BK2=bk2, PRECISION=prec, FP8=fp8, SOFT_ROUND=soft,
                 SWAP_AB=c.swap_ab, SHARED_FIXUP=shared_fixup, FIX_BLOCKS=fix_blocks, STAMPS=PERSISTENT_STAMPS is not None, PDL=on,
                 num_warps=c.num_warps, num_stages=c.num_stages, **pdl.launch_options(on))

    def args(sync, part1, part2):
        return (x2d, w13, w2, inter, out, part1, part2, sync, stamps, wptr, ids, num_tokens, top_k, num_experts,
                H, N, x2d.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), w2.stride(0), w2.stride(1),
                w2.stride(2), inter.stride(0), out.stride(0),
                xs_args[0], w13s_args[0], w2s_args[0], is_args[0], xs_args[1], *w13s_args[1:], *w2s_args[1:],
                is_args[1])

    f32 = torch.empty(1, dtype=torch.float32, device=device)  # the partials' pointers where there are none
    stamps = PERSISTENT_STAMPS if PERSISTENT_STAMPS is not None else f32
    if interp:
        grid = INTERPRET_GRID
        launches = [dict(PHASES=1), dict(PHASES=2)]
    else:
        launches = [dict(PHASES=3, launch_cooperative_grid=True)]
        sync_type = torch.empty(1, dtype=torch.int32, device=device)
        grid = resident_grid(_persistent_decode_kernel, args(sync_type, f32, f32), {**launches[0], **const},
                             PERSISTENT_CTAS_PER_SM)
    # [0] the barrier, then phase 1's tile counts (fewer than the grid), then phase 2's.
    sync = pdl.zeros((1 + grid + tiles2,), torch.int32, device)
    part1 = torch.empty(grid, c.bm, 2 * c.bn, dtype=torch.float32, device=device) if max_splits1 > 1 else f32
    part2 = torch.empty(splits2, c.bm, H, dtype=torch.float32, device=device) if splits2 > 1 else f32
    for launch in launches:
        _persistent_decode_kernel[(grid,)](*args(sync, part1, part2), **launch, **const)


def _fp8_activations(a: torch.Tensor, a_scale, scale_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, their [rows, H/128] scales) of 2-D ``a``: quantized here (one Triton launch)
    when ``a`` is 16/32-bit, validated when it comes already quantized."""
    rows, H = a.shape
    if a.dtype == _FP8:
        return a, _check_scale(scale_name, a_scale, (rows, H // FP8_GROUP), a.device).contiguous()
    _no_scales(**{scale_name: a_scale})
    return quantize_groups_triton(a)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, config: KernelConfig | None = None, *,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              x_scale: torch.Tensor | None = None, alignment: str = "auto") -> torch.Tensor:
    """y[M, H] = sum_k topk_weights[:, k] * SwiGLU-expert_{topk_ids[:, k]}(x), in Triton.

    x [M, H] fp16/bf16/fp32; w13 [E, 2N, H] (gate rows first, then up) and w2 [E, H, N] of
    the same dtype; topk_ids [M, K] int32/int64 in [-1, E) (-1 = masked slot, contributes
    nothing; ids are not range-checked, to avoid a host sync); topk_weights [M, K] float.
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
    """
    _require_triton()
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    if x.dim() != 2 or x.dtype not in _SUPPORTED + (_FP8,):
        raise ValueError(f"x must be a 2-D {_SUPPORTED + (_FP8,)} tensor [M, H], got {tuple(x.shape)} {x.dtype}")
    fp8 = _is_fp8_weights(w13, w2)
    if x.dtype == _FP8 and not fp8:
        raise ValueError(f"x in {_FP8} needs FP8 weights (w13, w2 in {_FP8}), got {w13.dtype}")
    if config is None:
        from moekit.kernels.configs import default_config
        from moekit.shapes import MoEShape

        config = default_config(x.shape[0], MoEShape("adhoc", w13.shape[0], topk_ids.shape[1], x.shape[1],
                                                     w2.shape[2]), dtype=_FP8 if fp8 else torch.bfloat16)
    if not isinstance(config, KernelConfig):
        raise ValueError(f"config must be a KernelConfig, got {type(config).__name__}")
    M, H = x.shape
    E, N = _check_weights(w13, w2, H, _FP8 if fp8 else x.dtype, x.device)
    _check_config(config, fp8)
    if fp8:
        w13_scale, w2_scale = _fp8_weight_scales(E, N, H, w13_scale, w2_scale, x.device)
    else:
        _no_scales(w13_scale=w13_scale, w2_scale=w2_scale, x_scale=x_scale)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != M or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32/int64 [M={M}, K], got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be a float tensor of shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)} {topk_weights.dtype}")
    K = topk_ids.shape[1]
    out_dtype = torch.bfloat16 if x.dtype == _FP8 else x.dtype
    x = x.contiguous()
    scales = None
    if fp8:
        x, xs = _fp8_activations(x, x_scale, "x_scale")
        scales = (xs, w13_scale, w2_scale)
    if M == 0 or K == 0:
        return torch.zeros(M, H, dtype=out_dtype, device=x.device)
    if alignment == "direct" or (alignment == "auto" and M <= config.bm):
        al = direct_blocks(topk_ids, E, config.bm)
    else:
        al = align_tokens(topk_ids, E, config.bm)
    weights = topk_weights.to(torch.float32).contiguous().reshape(-1)
    return _run(x, w13, w2, weights, al, M, out_dtype, a_div=K, out_div=K, config=config, scales=scales)
