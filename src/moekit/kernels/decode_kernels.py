"""The decode schedule's kernels (two_launch, split_k = 1, direct addressing: every token in one
block): the decode GEMM2 that sums a token's experts in registers without atomics
(``gemm2_decode_kernel``, after ``token_kernels.gemm1_swiglu_kernel``), and the whole call as
one cooperative launch (``persistent_decode_kernel``: GEMM1 as equal work units, a grid barrier,
then the decode GEMM2's units). Every sum has a fixed order: both are deterministic.
``launch.run_blocks`` and ``launch.run_persistent`` launch them; ``plan`` sizes them.
"""

from __future__ import annotations

from moekit.kernels.backend import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from triton.language.extra.cuda import globaltimer

    from moekit.kernels.grid_sync import grid_barrier
    from moekit.kernels.pdl import pdl_prologue
    from moekit.kernels.tiles import SB, direct_block, direct_routing, fp8_dot, store_act

    # Integer arguments that change with the batch (see token_kernels): not specialized.
    _NO_SPECIALIZE_DECODE = ["num_tokens", "top_k", "num_experts"]

    @triton.jit
    def _decode_step(acc, it, j_end, ids, valid, wts, named, inter_ptr, w2_ptr, is_ptr, ws_ptr, offs_h,
                     num_experts, H: tl.constexpr, N: tl.constexpr, stride_im, stride_we, stride_wh, stride_wk,
                     stride_ism, stride_wse, stride_wsh, stride_wsk, N_CHUNKS: tl.constexpr, BM: tl.constexpr,
                     BK: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr):
        """One step of ``gemm2_decode_kernel``'s loop: acc + w * (inter rows of named expert j)
        @ w2[e_j][h-tile, chunk c].T, for j, c = divmod(it, N_CHUNKS). A block at or past
        ``j_end`` (the end of this CTA's share, at most the named count) reads nothing and adds
        zero.

        FP8: the chunk is BK / 128 scale groups (BK a multiple of 128), one fp8 dot per group,
        each scaled by its row and weight-block scales and added in group order, so the sum is
        the same as with 128-wide chunks; a wider chunk keeps more w2 bytes in flight per step."""
        j = it // N_CHUNKS
        c = it % N_CHUNKS
        live, expert, rows, _, row_ok, w = direct_block(j, ids, valid, wts, named, num_experts, BM)
        live = live & (j < j_end)
        row_ok = row_ok & live
        rows64 = rows.to(tl.int64)
        h_ok = offs_h < H
        a_base = inter_ptr + rows64[:, None] * stride_im
        b_base = w2_ptr + expert.to(tl.int64) * stride_we + offs_h[None, :] * stride_wh
        s_base = ws_ptr + expert.to(tl.int64) * stride_wse + (offs_h // SB) * stride_wsh
        GROUP: tl.constexpr = SB if FP8 else BK  # the reduction width of one dot
        for g in tl.static_range(BK // GROUP):
            group = c * (BK // GROUP) + g
            offs_k = group * GROUP + tl.arange(0, GROUP)
            k_ok = offs_k < N
            a = tl.load(a_base + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_base + offs_k[:, None] * stride_wk, mask=live & k_ok[:, None] & h_ok[None, :],
                        other=0.0)  # [GROUP, BN] = w2[e].T tile
            if FP8:
                group_ok = group < N // SB
                a_s = tl.load(is_ptr + rows64 * stride_ism + group, mask=row_ok & group_ok, other=0.0)
                b_s = tl.load(s_base + group * stride_wsk, mask=live & h_ok & group_ok, other=0.0)
                acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :]) * w[:, None]
            else:
                acc += tl.dot(a, b, input_precision=PRECISION) * w[:, None]
        return acc

    @triton.jit(do_not_specialize=_NO_SPECIALIZE_DECODE)
    def gemm2_decode_kernel(
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
        masked out (no loads, zero contribution). FP8: as ``down_tile``. PDL: waits for GEMM1."""
        pdl_prologue(PDL, False)
        ids, valid, wts, named = direct_routing(ids_ptr, weights_ptr, num_tokens, top_k, num_experts, BM, KP, BINS, True)
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
        the named experts (see ``gemm2_decode_kernel``): the tile stored, or this share's
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
        ``swiglu_tile``'s loop body, addressed from ``c``); nothing is read where ``live`` is
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
            g_s = tl.load(ws_base + (offs_n // SB) * stride_wsn, mask=n_ok & live, other=0.0)
            u_s = tl.load(ws_base + ((N + offs_n) // SB) * stride_wsn, mask=n_ok & live, other=0.0)
            acc_g += fp8_dot(a, g, SWAP_AB) * (a_s[:, None] * g_s[None, :])
            acc_u += fp8_dot(a, u, SWAP_AB) * (a_s[:, None] * u_s[None, :])
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
        """Phase 1 of ``persistent_decode_kernel``, work unit ``u``: share ``u % splits`` of the
        reduction chunks of (named expert j, column tile t) = divmod(u // splits, N tiles).
        Unsplit, it stores SwiGLU of its sums as the intermediate (as GEMM1). Split, it stores
        its float32 gate and up partials in ``part[u]`` [BM, 2 BN] and counts itself at the tile's
        count; the tile's partials are then added in share order and stored as the intermediate in
        FIX_BLOCKS row blocks: SHARED_FIXUP, by every share (its blocks share, share + splits, ...)
        once all have arrived; else by the share that arrives last (``plan.FixupPlan``).
        Either way each element is the same sum, bit for bit."""
        TILES: tl.constexpr = (N + BN - 1) // BN
        CHUNKS: tl.constexpr = (H + BK - 1) // BK
        tile = u // splits
        share = u % splits
        j = tile // TILES
        pid_n = tile % TILES
        _, expert, rows, a_rows, row_ok, _ = direct_block(j, ids, valid, wts, named, num_experts, BM)
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
            store_act(inter_ptr, is_ptr, rows, pid_n, acc_g * tl.sigmoid(acc_g) * acc_u, stride_im, stride_ism,
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
                store_act(inter_ptr, is_ptr, j * BM + rows_b, pid_n, g_sum * tl.sigmoid(g_sum) * u_sum, stride_im,
                           stride_ism, N, FIX_ROWS, BN, FP8, SOFT_ROUND)
                b += step
        _stamp(stamps_ptr, 6, STAMPS)

    @triton.jit
    def _stamp(stamps_ptr, k, STAMPS: tl.constexpr):
        """Probe only (STAMPS): this program's k-th timestamp (ns, the GPU's global timer)."""
        if STAMPS:
            tl.store(stamps_ptr + tl.program_id(0) * 8 + k, globaltimer())

    @triton.jit(do_not_specialize=_NO_SPECIALIZE_DECODE)
    def persistent_decode_kernel(
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
        share), as ``gemm2_decode_kernel``'s grid. The barrier replaces the kernel boundary
        between the two launches of the two-kernel schedule; every sum has a fixed order, so
        the call is deterministic.

        ``sync`` (int32, zeroed by the caller): [0] the barrier, [1, 1 + grid) phase 1's tile
        counts, then phase 2's. PHASES: 3 on the GPU (both phases, the barrier between); the
        interpreter runs programs one after another, so a spin would never end: it launches the
        kernel twice, PHASES = 1 then 2. Each program walks units pid, pid + grid, ...
        RUNTIME_TRIP: the reduction loops run to run-time bounds (GPU); the interpreter walks
        every chunk, masking the ones outside the unit's share. SWAP_AB: phase 1's FP8 dots
        as ``fp8_dot`` (phase 2's column tiles are too narrow for the warpgroup MMA's 64 rows).
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
        ids, valid, wts, named = direct_routing(ids_ptr, weights_ptr, num_tokens, top_k, num_experts, BM, KP, BINS,
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
            grid_barrier(sync_ptr, grid)
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
