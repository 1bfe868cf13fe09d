"""The ``@triton.jit`` tile helpers that the fused-MoE kernels share (``token_kernels``,
``decode_kernels``, ``expert_major``): where a program's token block and column tile are
(``block_coords``, ``block_rows``, the direct addressing of ``direct_routing`` / ``direct_block``),
the gate/up tile with its SwiGLU (``swiglu_tile``), the store of the intermediate
(``store_act``, re-quantized under FP8), the down-projection tile (``down_tile``) and the FP8 dot
(``fp8_dot``).

Shapes are compile-time constants: H and N are ``tl.constexpr`` in every kernel, so the K loops
have compile-time trip counts (Triton's interpreter cannot loop over a run-time scalar argument,
and the compiler pipelines a constant-trip loop at least as well): one compile per model shape.
``FP8`` is a constexpr too: with FP8=False the scale arguments are never read (any pointer, zero
strides) and the 16/32-bit kernels carry no FP8 code.
"""

from __future__ import annotations

from moekit.kernels.backend import HAVE_TRITON, tl, triton
from moekit.kernels.quant import FP8_GROUP

if HAVE_TRITON:
    from moekit.kernels.align import expert_of
    from moekit.kernels.quant import quantize_tile

    SB = tl.constexpr(FP8_GROUP)  # scale block: 128 columns of activations, 128x128 of weights

    @triton.jit
    def block_coords(pid, num_m, num_n, GROUP_M: tl.constexpr):
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
    def direct_routing(ids_ptr, weights_ptr, num_tokens, top_k, num_experts, BM: tl.constexpr, KP: tl.constexpr,
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
        ids, bad = expert_of(tl.load(ids_ptr + offs, mask=in_range, other=-1), num_experts)
        valid = ids >= 0
        if MUL_WEIGHT:
            wts = tl.load(weights_ptr + offs, mask=valid, other=0.0).to(tl.float32)
            wts = tl.where(bad, float("nan"), wts)  # a bad id's token comes out NaN (align.py)
        else:
            wts = tl.zeros((BM, KP), tl.float32)
        hist = tl.histogram(tl.reshape(tl.where(valid, ids, 0), (BM * KP,)), BINS, mask=tl.reshape(valid, (BM * KP,)))
        named = tl.cumsum((hist > 0).to(tl.int32), 0)
        return ids, valid, wts, named

    @triton.jit
    def direct_block(j, ids, valid, wts, named, num_experts, BM: tl.constexpr):
        """Direct addressing: block ``j`` serves the j-th smallest named expert; its rows are
        the tokens that picked it, each with the sum of its slots' weights for that expert
        (from the weights ``direct_routing`` loaded: registers only)."""
        expert = tl.sum((named <= j).to(tl.int32), 0)  # BINS (>= E) past the last named expert
        live = expert < num_experts
        match = valid & (ids == expert)
        row_ok = tl.max(match.to(tl.int32), 1) > 0
        tok = tl.arange(0, BM)
        w = tl.sum(tl.where(match, wts, 0.0), 1)
        return live, expert, j * BM + tok, tok.to(tl.int64), row_ok, w

    @triton.jit
    def block_rows(pid_m, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
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
            ids, valid, wts, named = direct_routing(ids_ptr, weights_ptr, num_tokens, top_k, num_experts, BM, KP,
                                                     BINS, MUL_WEIGHT)
            live, expert, rows, a_rows, row_ok, w = direct_block(pid_m, ids, valid, wts, named, num_experts, BM)
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
                _, bad = expert_of(tl.load(ids_ptr + pair, mask=row_ok, other=-1), num_experts)
                w = tl.where(bad, float("nan"), w)  # aligned as expert 0; its token comes out NaN
            else:
                w = tl.zeros((BM,), tl.float32)
        return live, expert, rows, a_rows, out_rows, row_ok, w

    @triton.jit
    def fp8_dot(a, b, SWAP_AB: tl.constexpr):
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
    def swiglu_tile(x_ptr, w13_ptr, a_rows, row_ok, expert, offs_n, H: tl.constexpr, N: tl.constexpr,
                     stride_xm, stride_we, stride_wn, stride_wk,
                     xs_ptr, ws_ptr, stride_xsm, stride_wse, stride_wsn, stride_wsk,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
                     FP8: tl.constexpr, SWAP_AB: tl.constexpr = False):
        """silu(x[a_rows] @ gate.T) * (x[a_rows] @ up.T) for columns offs_n of expert ``expert``,
        as a float32 [BM, BN] tile. gate is w13[e, :N], up is w13[e, N:].

        FP8: x and w13 are e4m3; xs is x's [rows, H/128] scales, ws w13's [E, 2N/128, H/128]
        block scales, and BK == 128, so chunk k0 is scale column k0 of both. SWAP_AB: see
        ``fp8_dot``."""
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
            gs_ptrs = ws_base + (offs_n // SB) * stride_wsn
            us_ptrs = ws_base + ((N + offs_n) // SB) * stride_wsn
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
                acc_g += fp8_dot(a, g, SWAP_AB) * (a_s[:, None] * g_s[None, :])
                acc_u += fp8_dot(a, u, SWAP_AB) * (a_s[:, None] * u_s[None, :])
            else:
                acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
            a_ptrs += BK
            g_ptrs += BK * stride_wk
            u_ptrs += BK * stride_wk
        return acc_g * tl.sigmoid(acc_g) * acc_u

    @triton.jit
    def store_act(inter_ptr, is_ptr, rows, pid_n, act, stride_im, stride_ism, N: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, FP8: tl.constexpr, SOFT_ROUND: tl.constexpr):
        """Store the float32 SwiGLU tile ``act`` (rows ``rows``, column tile ``pid_n``) as the
        intermediate: in its dtype, or FP8 with one scale per row per 128 columns."""
        offs_n = pid_n * BN + tl.arange(0, BN)
        rows64 = rows.to(tl.int64)
        i_ptrs = inter_ptr + rows64[:, None] * stride_im + offs_n[None, :]
        if FP8:
            # Re-quantize per row per 128 columns: view the tile as [BM * BN/128, 128] (row-major,
            # so row r, group j becomes row r * BN/128 + j), one scale per row of that view.
            q, s = quantize_tile(tl.reshape(act, (BM * (BN // SB), SB)), SOFT_ROUND)
            tl.store(i_ptrs, tl.reshape(q, (BM, BN)), mask=(offs_n < N)[None, :])
            offs_g = pid_n * (BN // SB) + tl.arange(0, BN // SB)
            s_ptrs = is_ptr + rows64[:, None] * stride_ism + offs_g[None, :]
            tl.store(s_ptrs, tl.reshape(s, (BM, BN // SB)), mask=(offs_g < N // SB)[None, :])
        else:
            tl.store(i_ptrs, act.to(inter_ptr.dtype.element_ty), mask=(offs_n < N)[None, :])

    @triton.jit
    def down_tile(inter_ptr, w2_ptr, is_ptr, ws_ptr, rows, row_ok, expert, offs_h, c_begin,
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
            bs_ptrs = (ws_ptr + expert.to(tl.int64) * stride_wse + (offs_h // SB) * stride_wsh
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
                chunk_ok = c_begin + i < N // SB
                a_s = tl.load(as_ptrs + i, mask=row_ok & chunk_ok, other=0.0)
                b_s = tl.load(bs_ptrs + i * stride_wsk, mask=h_ok & chunk_ok, other=0.0)
                acc += fp8_dot(a, b, SWAP_AB) * (a_s[:, None] * b_s[None, :])
            else:
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BK
            b_ptrs += BK * stride_wk
        return acc
