"""One Triton kernel per phase for the fixed-buffer dispatchers (MaxCounts and Cap-and-Spill).

The torch phases of :mod:`moekit.ep.capspill` are a chain of ~20-30 small kernels each (sort,
histogram, cumulative sums, gathers, the header's stack and cat, the unpack's scatters). With
the buffers of a decode or Mixtral-sized step (~1 MB) every one of them is launch-bound, so
packing cost several times the all-to-all it feeds. Here each phase is one launch whose cost
follows the bytes it moves:

* :func:`plan_and_pack` — plan + pass 1 (or, with ``first=C``, the spill pass): every program
  scans the step's expert ids once (two ``tl.histogram`` per chunk: all pairs, and the pairs
  before its own block), which gives it the start of every expert in send order without a
  sort or a second launch; then it places its block of (token, slot) pairs into the send
  buffer (header bytes + the token's row) and writes the empty rows of its block of buffer
  rows. Pass 1 also writes the :class:`~moekit.ep.capspill.FixedPlan` tensors combine reads.
* :func:`unpack` — every program rebuilds, by binary search over the received headers (each
  source's rows arrive sorted by local expert, empty rows last), where each (source, expert)
  run starts and how long it is; from that a received row knows its expert-major slot, and a
  slot past its expert's count knows it is padding. Each program writes its block of received
  rows (payload, handle, and the row's destination for combine) and its block of padding
  slots (zero rows, -1 handle), so every output element is written exactly once, with no
  memset before and no scatter collisions. Program 0 also writes the counts and the
  overflow / bad-id flags every rank derives from the senders' status words.

* :func:`gather_back` / :func:`combine_slots` — combine in the slot order: the expert rows each
  pass sends back (one launch per pass), and the source's weighted sum of its slots (one
  launch, term for term ``weighted_slot_sum``: float32 products and sums in slot order, no
  FMA contraction).

Payloads are copied as integer words (the widest of 8/4/2/1 bytes dividing a row), never as
floats, so values travel bit for bit, and the results are bitwise those of the torch phases
(tests/ep/test_capspill_pack.py checks it under ``TRITON_INTERPRET=1``). The wire format is the
torch path's, byte for byte (empty rows carry a zero payload and a zero weight in both).

Cost notes: each program of :func:`plan_and_pack` scans all T*K ids (a few KB for a decode or
Mixtral step); for prefill-sized steps (tens of thousands of pairs) the blocks grow to keep
the number of programs, and so the repeated scans, in check. Nothing here reads the host:
the launches can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from moekit.kernels.backend import HAVE_TRITON, check_device, interpreting, require_triton, tl, triton

_SCAN = 256  # ids per histogram chunk
BLOCK_OVERRIDE: int | None = None  # rows per program for every launch (tests: many programs in the interpreter)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def word_dtype(row_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest integer word (8, 4, 2 or 1 bytes) that divides ``row_bytes`` and every
    tensor's byte offset, so rows copy as whole words."""
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8)):
        if row_bytes % size == 0 and all((t.storage_offset() * t.element_size()) % size == 0 for t in tensors):
            return dtype
    raise AssertionError("unreachable: one byte divides everything")


def as_words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor's bytes as ``dtype`` words along its last dimension (a view)."""
    return t.view(torch.uint8).view(dtype)


if HAVE_TRITON:

    @triton.jit
    def _pick(table, idx, WIDTH: tl.constexpr):
        """``table[idx]`` for a register vector ``table [WIDTH]`` (one-hot sum; idx in range)."""
        cols = tl.arange(0, WIDTH)
        return tl.sum(tl.where(cols[None, :] == idx[:, None], table[None, :], 0), axis=1)

    @triton.jit
    def _store_header(u8_ptr, row, ok, expert, token, slot, status, wbits, row_bytes, HB: tl.constexpr):
        """The row's header: int32 fields (expert, token, slot, status[, weight bits, 0, 0, 0])
        as little-endian bytes at the start of byte row ``row``."""
        c = tl.arange(0, HB)
        field = (c // 4)[None, :]
        shift = ((c % 4) * 8)[None, :]
        v = tl.where(field == 0, expert[:, None],
                     tl.where(field == 1, token[:, None],
                              tl.where(field == 2, slot[:, None],
                                       tl.where(field == 3, status[:, None],
                                                tl.where(field == 4, wbits[:, None], 0)))))
        byte = ((v >> shift) & 255).to(tl.uint8)
        tl.store(u8_ptr + row[:, None] * row_bytes + c[None, :], byte, mask=ok[:, None])

    @triton.jit
    def _load_i32(u8_ptr, offset, ok, I32: tl.constexpr):
        """The little-endian int32 at byte ``offset`` (as int64), 0 where not ``ok``. With I32
        (rows a multiple of 4 bytes, the usual case) ``u8_ptr`` is the buffer's int32 view: one load."""
        if I32:
            v = tl.load(u8_ptr + offset // 4, mask=ok, other=0).to(tl.int64)
        else:
            b0 = tl.load(u8_ptr + offset, mask=ok, other=0).to(tl.int64)
            b1 = tl.load(u8_ptr + offset + 1, mask=ok, other=0).to(tl.int64)
            b2 = tl.load(u8_ptr + offset + 2, mask=ok, other=0).to(tl.int64)
            b3 = tl.load(u8_ptr + offset + 3, mask=ok, other=0).to(tl.int64)
            v = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
            v = tl.where(v >= 2147483648, v - 4294967296, v)
        return v

    @triton.jit
    def _copy_rows(src_ptr, src_row, src_stride, src_off, dst_ptr, dst_row, dst_stride, dst_off, ok, width,
                   ZERO: tl.constexpr, BLOCK_W: tl.constexpr, W_STEPS: tl.constexpr):
        """dst[dst_row, dst_off:+width] = src[src_row, src_off:+width] (or 0 with ZERO), in words;
        W_STEPS = cdiv(width, BLOCK_W). (Loop bounds are constexpr throughout: Triton's interpreter
        cannot run a loop over a runtime bound.)"""
        for step in range(W_STEPS):
            cols = step * BLOCK_W + tl.arange(0, BLOCK_W)
            m = ok[:, None] & (cols < width)[None, :]
            d = dst_ptr + dst_row[:, None] * dst_stride + dst_off + cols[None, :]
            if ZERO:
                tl.store(d, ((src_row * 0)[:, None] + (cols * 0)[None, :]).to(dst_ptr.dtype.element_ty), mask=m)
            else:
                v = tl.load(src_ptr + src_row[:, None] * src_stride + src_off + cols[None, :], mask=m)
                tl.store(d, v, mask=m)

    @triton.jit(do_not_specialize=["num_pairs", "top_k", "num_experts", "experts_per_rank", "world_size",
                                   "hidden_words", "row_bytes", "row_words", "header_words", "first", "rows"])
    def _pack_kernel(ids_ptr, w_ptr, x_ptr, u8_ptr, buf_ptr,
                     mids_ptr, pair_rank_ptr, pair_pos_ptr, sorted_pair_ptr, sorted_local_ptr,
                     rank_counts_ptr, rank_start_ptr, max_count_ptr, invalid_ptr,
                     num_pairs, top_k, num_experts, experts_per_rank, world_size,
                     hidden_words, row_bytes, row_words, header_words, first, rows,
                     WRITE_PLAN: tl.constexpr, RANK_ORDER: tl.constexpr, HB: tl.constexpr,
                     BLOCK: tl.constexpr, EB: tl.constexpr, PB: tl.constexpr, SCAN: tl.constexpr,
                     CHUNKS: tl.constexpr, BLOCK_W: tl.constexpr, W_STEPS: tl.constexpr):
        pid = tl.program_id(0)
        E = num_experts
        lo = pid * BLOCK  # this program's pairs [lo, lo + BLOCK) and buffer rows [lo, lo + BLOCK)
        # 1. Every pair's key (its expert, E when masked or out of range): counts per key over
        # all pairs and over the pairs before this program's block.
        total = tl.zeros([EB], tl.int32)
        before = tl.zeros([EB], tl.int32)
        bad = tl.zeros([SCAN], tl.int32)
        for chunk in range(CHUNKS):  # CHUNKS >= cdiv(num_pairs, SCAN)
            i = chunk * SCAN + tl.arange(0, SCAN)
            inside = i < num_pairs
            e = tl.load(ids_ptr + i, mask=inside, other=-1).to(tl.int64)
            bad = bad | (inside & ((e < -1) | (e >= E))).to(tl.int32)
            key = tl.where((e >= 0) & (e < E), e, E).to(tl.int32)
            total += tl.histogram(key, EB, mask=inside)
            before += tl.histogram(key, EB, mask=inside & (i < lo))
        key_start = tl.cumsum(total, 0) - total
        ranks = tl.arange(0, PB)
        bins = tl.arange(0, EB)
        on_rank = (bins[None, :] >= ranks[:, None] * experts_per_rank) & \
            (bins[None, :] < (ranks[:, None] + 1) * experts_per_rank) & (ranks[:, None] < world_size)
        rank_counts = tl.sum(tl.where(on_rank, total[None, :], 0), axis=1)  # [PB]
        rank_start = _pick(key_start, ranks * experts_per_rank, EB)
        if WRITE_PLAN:
            max_count = tl.max(rank_counts, axis=0)
            invalid = tl.max(bad, axis=0)
            if pid == 0:
                tl.store(rank_counts_ptr + ranks, rank_counts.to(tl.int64), mask=ranks < world_size)
                tl.store(rank_start_ptr + ranks, rank_start.to(tl.int64), mask=ranks < world_size)
                tl.store(max_count_ptr, max_count)
                tl.store(invalid_ptr, invalid.to(tl.uint8))
        else:  # the spill pass: the ids were masked by pass 1, the status is the plan's
            max_count = tl.load(max_count_ptr).to(tl.int32)
            invalid = tl.load(invalid_ptr).to(tl.int32)
        status = (max_count.to(tl.int64) | (invalid.to(tl.int64) << 30))

        # 2. This program's pairs: place in send order = start of its key + same-key pairs before it.
        i = lo + tl.arange(0, BLOCK)
        inside = i < num_pairs
        e = tl.load(ids_ptr + i, mask=inside, other=-1).to(tl.int64)
        routed = (e >= 0) & (e < E)
        key = tl.where(routed, e, E).to(tl.int32)
        j = tl.arange(0, BLOCK)
        earlier = (key[None, :] == key[:, None]) & (j[None, :] < j[:, None]) & inside[None, :]
        gpos = (_pick(key_start, key, EB) + _pick(before, key, EB) + tl.sum(earlier.to(tl.int32), axis=1)).to(tl.int64)
        rank = tl.where(routed, e // experts_per_rank, world_size)
        pos = gpos - tl.where(routed, _pick(rank_start, rank.to(tl.int32), PB), 0).to(tl.int64)
        local = key.to(tl.int64) % experts_per_rank
        if WRITE_PLAN:
            tl.store(mids_ptr + i, tl.where(routed, e, -1), mask=inside)
            tl.store(pair_rank_ptr + i, rank, mask=inside)
            tl.store(pair_pos_ptr + i, pos, mask=inside)
            tl.store(sorted_pair_ptr + gpos, i.to(tl.int64), mask=inside)
            tl.store(sorted_local_ptr + gpos, local, mask=inside)
        sent = inside & routed & (pos >= first) & (pos < first + rows)
        row = rank * rows + pos - first
        token = i // top_k
        wbits = tl.zeros([BLOCK], tl.int64)
        if RANK_ORDER:
            w = tl.load(w_ptr + i, mask=sent, other=0.0).to(tl.float32)
            wbits = w.to(tl.int32, bitcast=True).to(tl.int64)
        _store_header(u8_ptr, row, sent, local, token.to(tl.int64), (i % top_k).to(tl.int64),
                      tl.zeros([BLOCK], tl.int64) + status, wbits, row_bytes, HB)
        _copy_rows(x_ptr, token.to(tl.int64), hidden_words, 0, buf_ptr, row, row_words, header_words, sent,
                   hidden_words, False, BLOCK_W, W_STEPS)

        # 3. This program's block of buffer rows: the empty ones (past their peer's count).
        r = (lo + tl.arange(0, BLOCK)).to(tl.int64)
        rows_or_1 = tl.maximum(rows, 1)  # no row to write when rows = 0 (then nothing is empty either)
        peer = r // rows_or_1
        empty = (r < world_size * rows) & (first + r % rows_or_1 >= _pick(rank_counts, peer.to(tl.int32), PB))
        minus = tl.zeros([BLOCK], tl.int64) - 1
        _store_header(u8_ptr, r, empty, minus, minus, minus, tl.zeros([BLOCK], tl.int64) + status,
                      tl.zeros([BLOCK], tl.int64), row_bytes, HB)
        _copy_rows(x_ptr, r, 0, 0, buf_ptr, r, row_words, header_words, empty,
                   hidden_words, True, BLOCK_W, W_STEPS)

    @triton.jit
    def _stream_key(u1_ptr, u2_ptr, source, pos, n1, n2, row_bytes, experts_per_rank, ok, I32: tl.constexpr):
        """Local expert of stream position ``pos`` of ``source`` over the passes (empty rows and
        positions past the stream: ``experts_per_rank``, which sorts last)."""
        in1 = ok & (pos < n1)
        in2 = ok & (pos >= n1) & (pos < n1 + n2)
        v1 = _load_i32(u1_ptr, (source * n1 + pos) * row_bytes, in1, I32)
        v2 = _load_i32(u2_ptr, (source * n2 + pos - n1) * row_bytes, in2, I32)
        v = tl.where(in1, v1, tl.where(in2, v2, -1))
        return tl.where(v >= 0, v, experts_per_rank)

    @triton.jit
    def _lower_bound(u1_ptr, u2_ptr, source, target, n1, n2, row_bytes, experts_per_rank, ok, STEPS: tl.constexpr,
                     I32: tl.constexpr):
        """First stream position of ``source`` whose key is >= ``target`` (vectorized binary
        search; STEPS >= bit length of the stream length + 1)."""
        lo = tl.zeros_like(target)
        hi = tl.zeros_like(target) + n1 + n2
        for _ in range(STEPS):
            active = ok & (lo < hi)
            mid = (lo + hi) // 2
            k = _stream_key(u1_ptr, u2_ptr, source, mid, n1, n2, row_bytes, experts_per_rank, active, I32)
            go_right = active & (k < target)
            lo = tl.where(go_right, mid + 1, lo)
            hi = tl.where(active & ~go_right, mid, hi)
        return lo

    @triton.jit(do_not_specialize=["n1", "n2", "row_bytes", "row_words", "header_words", "hidden_words",
                                   "world_size", "experts_per_rank", "cap", "rank"])
    def _unpack_kernel(u1_ptr, w1_ptr, u2_ptr, w2_ptr, tok_ptr, src_rank_ptr, src_token_ptr, src_slot_ptr,
                       dest_ptr, counts_ptr, row_weight_ptr, row_token_ptr,
                       mine_max_ptr, mine_invalid_ptr, largest_ptr, overflow_ptr, invalid_by_rank_ptr, invalid_any_ptr,
                       n1, n2, row_bytes, row_words, header_words, hidden_words, world_size, experts_per_rank, cap,
                       rank,
                       RANK_ORDER: tl.constexpr, BLOCK: tl.constexpr, TB: tl.constexpr, EB: tl.constexpr,
                       PB: tl.constexpr, STEPS: tl.constexpr, BLOCK_W: tl.constexpr, W_STEPS: tl.constexpr,
                       I32: tl.constexpr):
        pid = tl.program_id(0)
        n = n1 + n2
        E_local = experts_per_rank
        # 1. Per (source, local expert) run of the streams: start and length (t = s * EB + e).
        t = tl.arange(0, TB)
        ts = t // EB
        te = t % EB
        tok = (ts < world_size) & (te < E_local)
        ts64, te64 = ts.to(tl.int64), te.to(tl.int64)
        start = _lower_bound(u1_ptr, u2_ptr, ts64, te64, n1, n2, row_bytes, E_local, tok, STEPS, I32)
        end = _lower_bound(u1_ptr, u2_ptr, ts64, te64 + 1, n1, n2, row_bytes, E_local, tok, STEPS, I32)
        length = tl.where(tok, end - start, 0)

        # 2. This program's received rows -> their slot, payload, handle.
        r = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        inside = r < world_size * n
        n_or_1 = tl.maximum(n, 1)  # n = 0: no rows (inside is all False)
        s = r // n_or_1
        p = r % n_or_1
        in1 = inside & (p < n1)
        in2 = inside & (p >= n1)
        off1 = (s * n1 + p) * row_bytes
        off2 = (s * n2 + p - n1) * row_bytes
        expert = tl.where(in1, _load_i32(u1_ptr, off1, in1, I32), _load_i32(u2_ptr, off2, in2, I32))
        token = tl.where(in1, _load_i32(u1_ptr, off1 + 4, in1, I32), _load_i32(u2_ptr, off2 + 4, in2, I32))
        slot = tl.where(in1, _load_i32(u1_ptr, off1 + 8, in1, I32), _load_i32(u2_ptr, off2 + 8, in2, I32))
        valid = inside & (expert >= 0)
        e = tl.where(valid, expert, 0)
        same_e = te[None, :] == e[:, None]
        run_start = tl.sum(tl.where(same_e & (ts[None, :] == s[:, None]), start[None, :], 0), axis=1)
        from_earlier = tl.sum(tl.where(same_e & (ts[None, :] < s[:, None]), length[None, :], 0), axis=1)
        spare = E_local * cap
        dest = tl.where(valid, e * cap + from_earlier + p - run_start, spare)
        tl.store(dest_ptr + r, dest, mask=inside)
        tl.store(src_rank_ptr + dest, s, mask=valid)
        tl.store(src_token_ptr + dest, token, mask=valid)
        tl.store(src_slot_ptr + dest, slot, mask=valid)
        row1 = s * n1 + p
        row2 = s * n2 + p - n1
        _copy_rows(w1_ptr, row1, row_words, header_words, tok_ptr, dest, hidden_words, 0, valid & in1, hidden_words,
                   False, BLOCK_W, W_STEPS)
        _copy_rows(w2_ptr, row2, row_words, header_words, tok_ptr, dest, hidden_words, 0, valid & in2, hidden_words,
                   False, BLOCK_W, W_STEPS)
        if RANK_ORDER:
            bits = tl.where(in1, _load_i32(u1_ptr, off1 + 16, in1, I32), _load_i32(u2_ptr, off2 + 16, in2, I32))
            tl.store(row_weight_ptr + dest, bits.to(tl.int32).to(tl.float32, bitcast=True), mask=valid)
            tl.store(row_token_ptr + r, token, mask=inside)

        # 3. This program's block of slots: padding past the expert's count.
        q = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        cap_or_1 = tl.maximum(cap, 1)
        qe = q // cap_or_1
        total = tl.sum(tl.where(te[None, :] == qe[:, None], length[None, :], 0), axis=1)
        pad = (q < spare) & (q % cap_or_1 >= total)
        minus = tl.zeros([BLOCK], tl.int64) - 1
        tl.store(src_rank_ptr + q, minus, mask=pad)
        tl.store(src_token_ptr + q, minus, mask=pad)
        tl.store(src_slot_ptr + q, minus, mask=pad)
        _copy_rows(tok_ptr, q, 0, 0, tok_ptr, q, hidden_words, 0, pad, hidden_words, True, BLOCK_W, W_STEPS)
        if RANK_ORDER:
            tl.store(row_weight_ptr + q, tl.zeros([BLOCK], tl.float32), mask=pad)

        # 4. Program 0: counts, and every sender's status word (row 0 of its stream).
        if pid == 0:
            ex = tl.arange(0, EB)
            counts = tl.sum(tl.where(te[None, :] == ex[:, None], length[None, :], 0), axis=1)
            tl.store(counts_ptr + ex, counts, mask=ex < E_local)
            src = tl.arange(0, PB)
            has = (src < world_size) & (n > 0)
            st1 = _load_i32(u1_ptr, src * n1 * row_bytes + 12, has & (n1 > 0), I32)
            st2 = _load_i32(u2_ptr, src * n2 * row_bytes + 12, has & (n1 == 0), I32)
            word = tl.where(n1 > 0, st1, st2)
            mine = tl.load(mine_max_ptr).to(tl.int64)
            largest = tl.maximum(mine, tl.max(tl.where(has, word & 1073741823, 0), axis=0))
            own = (src == rank) & (tl.load(mine_invalid_ptr) != 0)
            flagged = (src < world_size) & (own | (has & (((word >> 30) & 1) != 0)))
            tl.store(largest_ptr, largest)
            tl.store(overflow_ptr, (largest > n).to(tl.uint8))
            tl.store(invalid_by_rank_ptr + src, flagged.to(tl.uint8), mask=src < world_size)
            tl.store(invalid_any_ptr, tl.max(flagged.to(tl.int32), axis=0).to(tl.uint8))


    @triton.jit(do_not_specialize=["num_rows", "first", "rows", "stride_dest", "spare", "width"])
    def _gather_back_kernel(src_ptr, dest_ptr, out_ptr, num_rows, first, rows, stride_dest, spare, width,
                            BLOCK: tl.constexpr, BLOCK_W: tl.constexpr, W_STEPS: tl.constexpr):
        """Combine's send buffer of one pass: row (j, p) = expert row ``dest[j, first + p]``
        (empty rows point past the end: any real row goes instead, its owner never reads it)."""
        r = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        ok = r < num_rows
        rows_or_1 = tl.maximum(rows, 1)
        d = tl.load(dest_ptr + (r // rows_or_1) * stride_dest + first + r % rows_or_1, mask=ok, other=0)
        _copy_rows(src_ptr, tl.minimum(d, spare - 1), width, 0, out_ptr, r, width, 0, ok, width, False, BLOCK_W,
                   W_STEPS)

    @triton.jit(do_not_specialize=["num_tokens", "hidden", "world_size", "first1", "n1", "first2", "n2"])
    def _combine_kernel(ret1_ptr, ret2_ptr, ids_ptr, w_ptr, pair_rank_ptr, pair_pos_ptr, y_ptr,
                        num_tokens, hidden, world_size, first1, n1, first2, n2,
                        K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        """y[t] = sum over k of float32(w[t, k]) * float32(returned row of (t, k)), in slot order,
        masked slots skipped, slots no pass carried read as zero rows: ``weighted_slot_sum`` of
        the torch path, term by term (launched without FMA contraction, so every product and
        sum rounds as torch's do)."""
        t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        tok = t < num_tokens
        hm = (h < hidden)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
        for k in range(K):
            pair = t * K + k
            e = tl.load(ids_ptr + pair, mask=tok, other=-1)
            w = tl.load(w_ptr + pair, mask=tok, other=0.0).to(tl.float32)
            rank = tl.load(pair_rank_ptr + pair, mask=tok, other=0)
            pos = tl.load(pair_pos_ptr + pair, mask=tok, other=0)
            routed = tok & (rank < world_size)
            in1 = routed & (pos >= first1) & (pos < first1 + n1)
            in2 = routed & (pos >= first2) & (pos < first2 + n2)
            v1 = tl.load(ret1_ptr + (rank * n1 + pos - first1)[:, None] * hidden + h[None, :],
                         mask=in1[:, None] & hm, other=0.0)
            v2 = tl.load(ret2_ptr + (rank * n2 + pos - first2)[:, None] * hidden + h[None, :],
                         mask=in2[:, None] & hm, other=0.0)
            v = tl.where(in1[:, None], v1, v2).to(tl.float32)
            acc = tl.where((e >= 0)[:, None], acc + v * w[:, None], acc)
        tl.store(y_ptr + t[:, None] * hidden + h[None, :], acc.to(y_ptr.dtype.element_ty), mask=tok[:, None] & hm)


def gather_back(expert_rows: torch.Tensor, dest: torch.Tensor, first: int, rows: int) -> torch.Tensor:
    """One launch: combine's send buffer ``[P, rows, H]`` for stream positions [first, first + rows):
    ``expert_rows[E_local * cap, H]`` at ``dest[:, first:first + rows]`` (clamped to the last row)."""
    require_triton()
    check_device(expert_rows.device, "expert_out")
    src = expert_rows.contiguous()
    P, H = dest.shape[0], src.shape[1]
    out = torch.empty(P, rows, H, dtype=src.dtype, device=src.device)
    if out.numel() == 0:
        return out
    word = word_dtype(H * src.element_size(), src)
    width = H * src.element_size() // torch.empty((), dtype=word).element_size()
    block = _block(P * rows, None)
    _gather_back_kernel[(triton.cdiv(P * rows, block),)](
        as_words(src, word), dest, out.view(P * rows, H).view(torch.uint8).view(word), P * rows, first, rows,
        dest.stride(0), src.shape[0], width, BLOCK=block, **_width(width))
    return out


def combine_slots(returned: list[tuple[torch.Tensor, int]], plan, world_size: int, out_dtype: torch.dtype,
                  hidden: int) -> torch.Tensor:
    """One launch: the source's half of the slot-order combine. ``returned``: each pass that
    carried rows, as (``[P, rows, H]`` received rows, first stream position). Returns
    ``y[plan.num_tokens, H]``, bitwise ``weighted_slot_sum`` over the rows the passes returned."""
    require_triton()
    T, K = plan.ids.shape
    T_out = plan.num_tokens
    dev = plan.ids.device
    y = torch.empty(T_out, hidden, dtype=out_dtype, device=dev)
    if T_out == 0 or hidden == 0:
        return y
    check_device(dev, "expert_out")
    (r1, f1), (r2, f2) = (list(returned) + [(None, 0)] * 2)[:2]  # absent passes carry no rows

    def rows_of(r):
        return (0, torch.empty(1, dtype=out_dtype, device=dev)) if r is None else (r.shape[1], _ptr(r.contiguous()))

    (n1, r1), (n2, r2) = rows_of(r1), rows_of(r2)
    block_t = min(1024 if interpreting() else 16, _pow2(max(T_out, 2)))
    block_h = min(256, _pow2(max(hidden, 2)))
    _combine_kernel[(triton.cdiv(T_out, block_t), triton.cdiv(hidden, block_h))](
        r1, r2, plan.ids, plan.weights.contiguous(), plan.pair_rank,
        plan.pair_pos, y, T_out, hidden, world_size, f1, n1, f2, n2,
        K=K, BLOCK_T=block_t, BLOCK_H=block_h, enable_fp_fusion=False)
    return y


def _block(work: int, block: int | None, small: int = 4096) -> int:
    """Rows per program. On a GPU: small blocks for small steps (more programs, each scanning
    few ids), larger ones for prefill-sized steps (fewer repeated scans). In the interpreter,
    where every operation costs the same whatever its size, one block covers up to 1024."""
    block = BLOCK_OVERRIDE if block is None else block
    if block is not None:
        return block
    if interpreting():
        return min(1024, _pow2(max(work, 2)))
    return 32 if work <= small else 128


def plan_and_pack(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, world_size: int,
                  num_experts: int, rows: int, header_bytes: int, first: int = 0, plan=None,
                  block: int | None = None):
    """One launch: the send buffer ``[P, rows, header_bytes + H * itemsize]`` (bytes) for stream
    positions [first, first + rows), and (with ``plan=None``) the plan's tensors.

    ``x [T', H]`` (T' >= 1), ``ids`` / ``weights [T'', K]`` (T'' >= 1 rows; ids of any integer
    dtype, out-of-range ids are masked and flagged). Returns ``(buffer, fields)`` where
    ``fields`` holds the plan tensors (ids, weights, invalid, sorted_pair, sorted_local,
    rank_counts, rank_start, pair_rank, pair_pos, max_count) when ``plan`` is None; with a
    ``plan`` (the spill pass) its masked ids and status are used and nothing else is written.
    ``block``: rows per program (a power of 2; default: by size, see :func:`_block`).
    """
    require_triton()
    check_device(x.device)
    P, E = world_size, num_experts
    E_local = E // P
    x = x.contiguous()
    source_ids = ids if plan is None else plan.ids
    source_ids = source_ids.contiguous()
    weights = (weights if plan is None else plan.weights).contiguous()
    T, K = source_ids.shape
    N = T * K
    H = x.shape[1]
    row_bytes = header_bytes + H * x.element_size()
    word = word_dtype(H * x.element_size(), x)
    itemsize = torch.empty((), dtype=word).element_size()
    buf = torch.empty(P, rows, row_bytes, dtype=torch.uint8, device=x.device)
    dev = x.device
    if plan is None:
        fields = dict(
            ids=torch.empty(T, K, dtype=torch.int64, device=dev), weights=weights,
            sorted_pair=torch.empty(N, dtype=torch.int64, device=dev),
            sorted_local=torch.empty(N, dtype=torch.int64, device=dev),
            rank_counts=torch.empty(P, dtype=torch.int64, device=dev),
            rank_start=torch.empty(P, dtype=torch.int64, device=dev),
            pair_rank=torch.empty(N, dtype=torch.int64, device=dev),
            pair_pos=torch.empty(N, dtype=torch.int64, device=dev),
            max_count=torch.empty((), dtype=torch.int32, device=dev),
            invalid=torch.empty((), dtype=torch.uint8, device=dev))
    else:
        fields = dict(ids=plan.ids, sorted_pair=plan.sorted_pair, sorted_local=plan.sorted_local,
                      rank_counts=plan.rank_counts, rank_start=plan.rank_start, pair_rank=plan.pair_rank,
                      pair_pos=plan.pair_pos, max_count=plan.max_count, invalid=plan.invalid.view(torch.uint8))
    block = _block(max(N, P * rows) if interpreting() else N, block)
    programs = max(triton.cdiv(N, block), triton.cdiv(P * rows, block), 1)
    _pack_kernel[(programs,)](
        source_ids, weights, as_words(x, word), _ptr(buf), _ptr(buf.view(-1).view(word)),
        fields["ids"], fields["pair_rank"], fields["pair_pos"], fields["sorted_pair"], fields["sorted_local"],
        fields["rank_counts"], fields["rank_start"], fields["max_count"], fields["invalid"],
        N, K, E, E_local, P, H * x.element_size() // itemsize, row_bytes, row_bytes // itemsize,
        header_bytes // itemsize, first, rows,
        WRITE_PLAN=plan is None, RANK_ORDER=header_bytes > 16, HB=header_bytes, BLOCK=block, EB=_pow2(E + 1),
        PB=_pow2(max(P, 2)), SCAN=_SCAN, CHUNKS=_pow2(triton.cdiv(N, _SCAN)),
        **_width(H * x.element_size() // itemsize))
    if plan is None:
        fields["invalid"] = fields["invalid"].view(torch.bool)
        return buf, fields
    return buf, None


def _ptr(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a one-element stand-in when it is empty (its pointer is then never read)."""
    return t if t.numel() else torch.empty(1, dtype=t.dtype, device=t.device)


def _width(words: int) -> dict:
    """Payload loop of ``words`` words per row: block width and steps (both constexpr)."""
    block = min(256, _pow2(max(words, 2)))
    return dict(BLOCK_W=block, W_STEPS=triton.cdiv(words, block))


def unpack(received: list[torch.Tensor], *, dtype: torch.dtype, hidden: int, header_bytes: int, world_size: int,
           experts_per_rank: int, cap: int, rank: int, max_count: torch.Tensor, invalid: torch.Tensor,
           rank_order: bool, block: int | None = None) -> dict:
    """One launch: the received passes (``[P, n_i, header_bytes + H * itemsize]`` bytes, one or
    two) into the expert-major result. Returns tokens ``[E_local, cap, H]``, counts, the handle
    rows (``[E_local * cap]`` each), ``dest [P, n]``, and the state flags (largest count,
    overflow, invalid by rank / any; with ``rank_order`` the row weights and tokens)."""
    require_triton()
    P, E_local = world_size, experts_per_rank
    r1 = received[0].contiguous()
    r2 = received[1].contiguous() if len(received) > 1 else r1
    n1, n2 = r1.shape[1], (received[1].shape[1] if len(received) > 1 else 0)
    n = n1 + n2
    dev = r1.device
    check_device(dev, "received")
    itemsize_x = torch.empty((), dtype=dtype).element_size()
    row_bytes = header_bytes + hidden * itemsize_x
    word = word_dtype(hidden * itemsize_x)
    itemsize = torch.empty((), dtype=word).element_size()
    spare = E_local * cap
    tokens = torch.empty(E_local, cap, hidden, dtype=dtype, device=dev)
    handle = torch.empty(3, spare, dtype=torch.int64, device=dev)
    out = dict(
        tokens=tokens, src_rank=handle[0], src_token=handle[1], src_slot=handle[2],
        dest=torch.empty(P, n, dtype=torch.int64, device=dev),
        counts=torch.empty(E_local, dtype=torch.int64, device=dev),
        largest_count=torch.empty((), dtype=torch.int64, device=dev),
        overflow=torch.empty((), dtype=torch.uint8, device=dev),
        invalid_by_rank=torch.empty(P, dtype=torch.uint8, device=dev),
        invalid_ids=torch.empty((), dtype=torch.uint8, device=dev))
    if rank_order:
        out["row_weight"] = torch.empty(spare, dtype=torch.float32, device=dev)
        out["row_token"] = torch.empty(P, n, dtype=torch.int64, device=dev)
    def words(r):
        return _ptr(r.view(-1).view(word))

    i32 = row_bytes % 4 == 0  # headers read as int32 words, else byte by byte

    def heads(r):
        return _ptr(r.view(-1).view(torch.int32)) if i32 else _ptr(r)

    block = _block(max(P * n, spare), block, small=8192)
    programs = max(triton.cdiv(P * n, block), triton.cdiv(spare, block), 1)
    _unpack_kernel[(programs,)](
        heads(r1), words(r1), heads(r2), words(r2), _ptr(tokens.view(-1).view(torch.uint8).view(word)),
        handle[0], handle[1], handle[2],
        _ptr(out["dest"]), out["counts"], out.get("row_weight", out["counts"]), _ptr(out.get("row_token", out["dest"])),
        max_count, invalid.view(torch.uint8), out["largest_count"], out["overflow"], out["invalid_by_rank"],
        out["invalid_ids"],
        n1, n2, row_bytes, row_bytes // itemsize, header_bytes // itemsize, hidden * itemsize_x // itemsize, P,
        E_local, cap, rank,
        RANK_ORDER=rank_order, BLOCK=block, TB=_pow2(max(P, 2)) * _pow2(E_local + 1), EB=_pow2(E_local + 1),
        PB=_pow2(max(P, 2)),
        STEPS=n.bit_length() + 1, **_width(hidden * itemsize_x // itemsize), I32=i32)
    for name in ("overflow", "invalid_by_rank", "invalid_ids"):
        out[name] = out[name].view(torch.bool)
    return out
