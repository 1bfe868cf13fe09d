"""The fused-MoE kernels over token blocks (sorted or direct addressing, or the expert-major
layout's fixed block table): the ``two_launch`` form's GEMM1 + SwiGLU (``gemm1_swiglu_kernel``)
and atomic GEMM2 (``gemm2_kernel``, split-K on grid axis 1), and the ``fused`` form
(``fused_kernel``). ``launch.run_blocks`` launches them; the forms are described in
``moekit.kernels.fused_moe``.
"""

from __future__ import annotations

from moekit.kernels.backend import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from moekit.kernels.pdl import pdl_prologue
    from moekit.kernels.quant import quantize_tile
    from moekit.kernels.tiles import block_coords, block_rows, down_tile, fp8_dot, store_act, swiglu_tile

    # Integer arguments that change with the batch. Triton would otherwise compile a variant
    # per value class (== 1, multiple of 16, other): three binaries per kernel over M = 1, 4,
    # 16, each compiled and loaded once per process, for no speed-up (these only bound masks).
    _NO_SPECIALIZE = ["num_pairs", "num_tokens", "top_k", "num_experts", "num_m"]

    @triton.jit(do_not_specialize=_NO_SPECIALIZE)
    def gemm1_swiglu_kernel(
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
        arrival counts (``gemm2_decode_kernel``, which runs after this kernel on the stream),
        which saves that call a memset launch.
        FP8: inter is e4m3 and is[row, N/128] its scales, one per row per 128 columns; SWAP_AB:
        see ``fp8_dot``. PDL, EARLY: ``pdl`` (GEMM2 follows)."""
        pdl_prologue(PDL, EARLY)
        if COUNTERS > 0:
            if tl.program_id(0) == 0:
                offs_c = tl.arange(0, COUNTERS)
                tl.store(count_ptr + offs_c, tl.zeros((COUNTERS,), tl.int32), mask=offs_c < num_counters)
        num_n = tl.cdiv(N, BN)
        pid_m, pid_n = block_coords(tl.program_id(0), num_m, num_n, GROUP_M)
        live, expert, rows, a_rows, _, row_ok, _ = block_rows(
            pid_m, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_pairs, ids_ptr, ids_ptr, num_tokens,
            top_k, num_experts, A_DIV, 1, BM, DIRECT, KP, BINS, False)
        if not live:
            return
        offs_n = pid_n * BN + tl.arange(0, BN)
        act = swiglu_tile(x_ptr, w13_ptr, a_rows, row_ok, expert, offs_n, H, N,
                           stride_xm, stride_we, stride_wn, stride_wk,
                           xs_ptr, ws_ptr, stride_xsm, stride_wse, stride_wsn, stride_wsk,
                           BM, BN, BK, PRECISION, FP8, SWAP_AB)
        # Padding rows are written too (as zeros: their A rows were masked to 0), so GEMM2 never
        # reads uninitialised memory.
        store_act(inter_ptr, is_ptr, rows, pid_n, act, stride_im, stride_ism, N, BM, BN, FP8, SOFT_ROUND)

    @triton.jit(do_not_specialize=_NO_SPECIALIZE)
    def gemm2_kernel(
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
        FP8: see ``down_tile``; SWAP_AB: ``fp8_dot``. PDL, EARLY: ``pdl`` (the cast follows)."""
        pdl_prologue(PDL, EARLY)
        num_n = tl.cdiv(H, BN)
        pid_m, pid_n = block_coords(tl.program_id(0), num_m, num_n, GROUP_M)
        live, expert, rows, _, out_rows, row_ok, w = block_rows(
            pid_m, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_pairs, ids_ptr, weights_ptr, num_tokens,
            top_k, num_experts, 1, OUT_DIV, BM, DIRECT, KP, BINS, MUL_WEIGHT)
        if not live:
            return
        offs_h = pid_n * BN + tl.arange(0, BN)
        # This split's share of the reduction: PER_SPLIT = ceil(ceil(N / BK) / split_k) whole
        # BK chunks (computed on the host so the loop bound is a compile-time constant).
        acc = down_tile(inter_ptr, w2_ptr, is_ptr, ws_ptr, rows, row_ok, expert, offs_h,
                         tl.program_id(1) * PER_SPLIT, H, N, stride_im, stride_we, stride_wh, stride_wk,
                         stride_ism, stride_wse, stride_wsh, stride_wsk, PER_SPLIT, BM, BN, BK, PRECISION, FP8,
                         WHOLE_CHUNKS, SWAP_AB)
        h_ok = offs_h < H
        if MUL_WEIGHT:
            acc = acc * w[:, None]
        o_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_h[None, :]
        tl.atomic_add(o_ptrs, acc, mask=row_ok[:, None] & h_ok[None, :], sem="relaxed")

    @triton.jit(do_not_specialize=_NO_SPECIALIZE)
    def fused_kernel(
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
        ``fp8_dot``. PDL, EARLY: ``pdl`` (the cast follows)."""
        pdl_prologue(PDL, EARLY)
        num_n = tl.cdiv(N, BN)
        pid_m, pid_n = block_coords(tl.program_id(0), num_m, num_n, GROUP_M)
        live, expert, _, a_rows, out_rows, row_ok, w = block_rows(
            pid_m, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_pairs, ids_ptr, weights_ptr, num_tokens,
            top_k, num_experts, A_DIV, OUT_DIV, BM, DIRECT, KP, BINS, MUL_WEIGHT)
        if not live:
            return
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        act = swiglu_tile(x_ptr, w13_ptr, a_rows, row_ok, expert, offs_n, H, N,
                           stride_xm, stride_w13e, stride_w13n, stride_w13k,
                           xs_ptr, w13s_ptr, stride_xsm, stride_w13se, stride_w13sn, stride_w13sk,
                           BM, BN, BK, PRECISION, FP8, SWAP_AB)
        if FP8:
            # In-register re-quantization: the tile is one 128-column group of every row.
            act, act_s = quantize_tile(act, SOFT_ROUND)
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
                part = fp8_dot(act, b, SWAP_AB) * (act_s[:, None] * tl.load(w2s_ptrs + h0 * stride_w2sh))
            else:
                part = tl.dot(act, b, input_precision=PRECISION)  # [BM, BK] fp32
            if MUL_WEIGHT:
                part = part * w[:, None]
            tl.atomic_add(o_ptrs, part, mask=row_ok[:, None] & h_ok[None, :], sem="relaxed")
            b_ptrs += BK * stride_w2h
            o_ptrs += BK
