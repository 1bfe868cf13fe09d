"""The data movement of the eager all-to-all (:class:`moekit.ep.AllToAllDispatcher`): four
row kernels, each one launch, with a plain torch twin that does the same thing bit for bit.

* :func:`pack_dispatch` writes this rank's rows in send order (destination rank, local
  expert, token, slot) into the send buffer, each followed by its metadata (token, slot,
  and for the rank combine order its (token, rank) group and routing weight), so tokens and
  their indices travel in ONE exchange. It also records, per (token, slot), the row its
  expert output will come back on (the slot-order combine reads it).
* :func:`unpack_dispatch` writes the expert-major result ``[E_local, capacity, H]`` from the
  received rows (zeros on padding), the handle's source rank / token / slot (-1 on padding),
  and the tables combine needs: where each row goes back, and for the rank order which
  rows make up each (token, this rank) group.
* :func:`copy_rows` gathers expert outputs into combine's send buffer.
* :func:`weighted_row_sum` is combine's unpack and reduction in one: per output row, the
  rows its index table names, in table order, each times its weight (optional), summed in
  float32 from 0 and rounded once. It is the slot-order sum, the rank-order partials and
  the rank-order final sum, depending on the table; absent entries (-1) are never read.

Rows move as integer words (bit for bit, whatever the float format); only
:func:`weighted_row_sum` does arithmetic, with the float32 operations of
``moekit.ep.dispatcher.weighted_slot_sum`` in the same order and no fused multiply-add
(``enable_fp_fusion=False``), which is what makes it bitwise equal to the torch path.

The Triton kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``
(how the tests hold them to the torch twins); :func:`use_triton` picks the path. Every
function does nothing for zero rows, so no zero-size grid is ever launched.
"""

from __future__ import annotations

import os

import torch

try:  # the package must import where Triton is missing; the torch path then does the work
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with torch on the platforms we test
    triton = None

META_WORDS = 4  # int32 words after each dispatched row: token, slot, group, weight bits
META_BYTES = META_WORDS * 4
ROW_ALIGN = 16  # bytes: a row's metadata starts 16-byte aligned, and so does every row
BLOCK_WORDS = 1024  # words one program copies per loop step
BLOCK_H = 1024  # columns one program of the reduction handles


# On CPU tensors the Triton kernels run only in the interpreter, and only when asked for (the
# tests that hold them to the torch twins set this; ``MOEKIT_EP_TRITON_CPU=1`` sets it in
# spawned ranks). Otherwise CPU tensors take the torch path.
CPU_TRITON = os.environ.get("MOEKIT_EP_TRITON_CPU", "0") == "1"


def kernels_interpreted() -> bool:
    """Whether the kernels were decorated under ``TRITON_INTERPRET=1`` (it is read at import)."""
    return triton is not None and type(_copy_rows_kernel).__name__ == "InterpretedFunction"


def use_triton(t: torch.Tensor) -> bool:
    """The Triton kernels for tensors on ``t``'s device: always on CUDA; on the CPU only
    interpreted and when :data:`CPU_TRITON` asks for them."""
    if triton is None:
        return False
    return t.device.type == "cuda" or (CPU_TRITON and kernels_interpreted())


def word_dtype(row_bytes: int) -> torch.dtype:
    """The widest integer word that tiles a row of ``row_bytes`` bytes."""
    for size, dtype in ((4, torch.int32), (2, torch.int16)):
        if row_bytes % size == 0:
            return dtype
    return torch.uint8


def as_words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous 2-D tensor's rows as integer words (a view: no copy)."""
    return t.view(torch.uint8).view(dtype)


def dispatch_row_bytes(hidden: int, element_size: int) -> int:
    """Bytes of one dispatched row on the wire: the data, padded to 16 bytes, then the metadata."""
    data = -(-hidden * element_size // ROW_ALIGN) * ROW_ALIGN
    return data + META_BYTES


# -- pack ------------------------------------------------------------------------------------


def pack_dispatch(x: torch.Tensor, order: torch.Tensor, num_rows: int, topk_ids: torch.Tensor, experts_per_rank: int,
                  head_rows: int, send: torch.Tensor, slot_row: torch.Tensor | None,
                  group_of: torch.Tensor | None, weights32: torch.Tensor | None) -> None:
    """Rows ``x[order[i] // K]`` for i < ``num_rows`` into ``send [>= num_rows, row_bytes]``
    (uint8), each followed at byte ``dispatch_row_bytes - META_BYTES`` by int32
    (token, slot, group, weight bits).

    ``slot_row`` (slot order, [T * K] int64, -1 where nothing is written): pair p = order[i]
    comes back on row ``i + (d + 1) * head_rows`` of combine's receive buffer, d its
    destination rank (each peer's rows follow ``head_rows`` status rows). ``group_of``
    ([T, P] int64) and ``weights32`` ([T * K] float32) fill the rank order's group and weight;
    without them those words are 0.
    """
    if num_rows == 0:
        return
    T, H = x.shape
    K = topk_ids.shape[1]
    data_bytes = H * x.element_size()
    meta_at = send.shape[1] - META_BYTES
    wd = word_dtype(data_bytes)
    if use_triton(x):
        xw = as_words(x.contiguous(), wd)
        sw = as_words(send, wd)
        meta = send.view(torch.int32)
        dummy = order
        _pack_dispatch_kernel[(num_rows,)](
            xw, order, topk_ids.contiguous(), sw, meta, slot_row if slot_row is not None else dummy,
            group_of if group_of is not None else dummy, weights32 if weights32 is not None else dummy,
            xw.stride(0), sw.stride(0), meta.stride(0), meta_at // 4, K, experts_per_rank, head_rows,
            group_of.shape[1] if group_of is not None else 1, N_WORDS=xw.shape[1],
            HAS_SLOT_ROW=slot_row is not None, HAS_GROUP=group_of is not None, BLOCK=BLOCK_WORDS)
        return
    pair = order[:num_rows]
    token, slot = pair // K, pair % K
    send[:num_rows, :data_bytes] = x.contiguous().view(torch.uint8)[token]
    dest = torch.div(topk_ids.reshape(-1)[pair].to(torch.int64), experts_per_rank, rounding_mode="floor")
    zero = torch.zeros_like(token)
    group = group_of[token, dest] if group_of is not None else zero
    wbits = weights32[pair].view(torch.int32).to(torch.int64) if weights32 is not None else zero
    meta = torch.stack([token, slot, group, wbits], dim=1).to(torch.int32)
    send[:num_rows, meta_at:meta_at + META_BYTES] = meta.view(torch.uint8)
    if slot_row is not None:
        slot_row[pair] = torch.arange(num_rows, device=x.device) + (dest + 1) * head_rows


# -- unpack ----------------------------------------------------------------------------------


def unpack_dispatch(recv: torch.Tensor, layout: torch.Tensor, num_sources: int, experts_per_rank: int, capacity: int,
                    hidden: int, dtype: torch.dtype, top_k: int, head_rows: int, *, tokens: torch.Tensor,
                    handle: torch.Tensor, back_src: torch.Tensor, back_dst: torch.Tensor,
                    cells: torch.Tensor | None = None, cell_weights: torch.Tensor | None = None,
                    part_dst: torch.Tensor | None = None, group_start: torch.Tensor | None = None) -> None:
    """The expert-major result from the received rows ``recv [n, row_bytes]`` (uint8).

    ``layout [3, P, E_local]`` int64: per (source s, local expert e) the rows received
    (``count``), the first position of s's rows inside e (``start``: rows of e from sources
    before s) and the received row they begin at (``row``). Output row (e, p) takes the row of
    the source whose [start, start + count) holds p. Writes ``tokens [E_local, capacity, H]``
    (zeros on padding), ``handle [3, E_local, capacity]`` int64 (source rank, token, slot;
    -1 on padding), and per received row r: ``back_src[r]`` its output row, ``back_dst[r]``
    its row in combine's send buffer (``r + (s + 1) * head_rows``). For the rank order
    (``cells`` given, prefilled with -1): ``cells[g * K + k]`` the output row of group g's
    slot k, ``cell_weights`` its weight, ``part_dst[g]`` g's row in combine's send buffer,
    with g = ``group_start[s]`` + the group the row carries.
    """
    rows_out = experts_per_rank * capacity
    if rows_out == 0:
        return
    data_bytes = hidden * torch.empty((), dtype=dtype).element_size()
    meta_at = recv.shape[1] - META_BYTES
    wd = word_dtype(data_bytes)
    by_rank = cells is not None
    if use_triton(recv):
        rw = as_words(recv, wd)
        tw = as_words(tokens.view(rows_out, hidden), wd)
        meta = recv.view(torch.int32)
        dummy = back_src
        _unpack_dispatch_kernel[(rows_out,)](
            rw, meta, layout, tw, handle, back_src, back_dst,
            cells if by_rank else dummy, cell_weights.view(torch.int32) if by_rank else dummy,
            part_dst if by_rank else dummy, group_start if by_rank else dummy,
            rw.stride(0), meta.stride(0), meta_at // 4, tw.stride(0), experts_per_rank, capacity, top_k, head_rows,
            N_WORDS=tw.shape[1], P=num_sources, BY_RANK=by_rank, BLOCK=BLOCK_WORDS)
        return
    count, start, row = (t.reshape(-1) for t in layout.unbind(0))  # per (source, expert) segment
    # Received rows are ordered by (source, expert): segment (s, e) holds rows row[s, e] ..
    # row[s, e] + count[s, e] - 1, which land at start[s, e] onward inside expert e.
    seg = torch.repeat_interleave(torch.arange(count.numel(), device=recv.device), count)
    r = torch.arange(seg.numel(), device=recv.device)
    s, e = seg // experts_per_rank, seg % experts_per_rank
    out_row = e * capacity + start[seg] + (r - row[seg])
    flat_tokens = tokens.view(rows_out, hidden)
    flat_tokens.zero_()
    flat_tokens.view(torch.uint8)[out_row] = recv[r, :data_bytes]
    meta = recv[r, meta_at:meta_at + META_BYTES].contiguous().view(torch.int32).to(torch.int64)  # [n, 4]
    flat_handle = handle.view(3, rows_out)
    flat_handle.fill_(-1)
    flat_handle[0, out_row] = s
    flat_handle[1, out_row] = meta[:, 0]
    flat_handle[2, out_row] = meta[:, 1]
    back_src[r] = out_row
    back_dst[r] = r + (s + 1) * head_rows
    if by_rank:
        g = group_start[s] + meta[:, 2]
        cells[g * top_k + meta[:, 1]] = out_row
        cell_weights.view(torch.int32)[g * top_k + meta[:, 1]] = meta[:, 3].to(torch.int32)
        part_dst[g] = g + (s + 1) * head_rows


# -- combine ---------------------------------------------------------------------------------


def copy_rows(src: torch.Tensor, src_index: torch.Tensor, dst: torch.Tensor, dst_index: torch.Tensor,
              num_rows: int) -> None:
    """``dst[dst_index[i]] = src[src_index[i]]`` for i < ``num_rows``, rows as raw bytes
    (``src`` and ``dst``: 2-D uint8 of the same row width; ``dst`` rows may be wider)."""
    if num_rows == 0:
        return
    row_bytes = src.shape[1]
    wd = word_dtype(row_bytes)
    if use_triton(src):
        sw, dw = as_words(src, wd), as_words(dst, wd)
        _copy_rows_kernel[(num_rows,)](sw, src_index, dw, dst_index, sw.stride(0), dw.stride(0),
                                       N_WORDS=sw.shape[1], BLOCK=BLOCK_WORDS)
        return
    dst[dst_index[:num_rows], :row_bytes] = src[src_index[:num_rows]]


def weighted_row_sum(src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor,
                     out_row: torch.Tensor | None = None) -> torch.Tensor:
    """Per m < M: ``acc = 0`` (float32); for j = 0..J-1 with ``index[m, j] >= 0``:
    ``acc = acc + float32(src[index[m, j]]) * float32(weights[m, j])`` (no weights: ``+
    float32(src[...])``); then ``out[out_row[m]] = acc`` rounded once to ``out``'s dtype
    (``out_row`` None: row m). Rows named -1 are never read.

    ``src [N, H]`` and ``out [*, H]`` 2-D with unit column stride; ``index [M, J]`` int64.
    """
    M, J = index.shape
    H = src.shape[1]
    if M == 0:
        return out
    if use_triton(src):
        index = index.contiguous()
        dummy = index
        grid = (M, triton.cdiv(H, BLOCK_H))
        _weighted_row_sum_kernel[grid](
            src, index, weights.contiguous() if weights is not None else dummy, out,
            out_row if out_row is not None else dummy,
            H, src.stride(0), out.stride(0), J=J, HAS_WEIGHTS=weights is not None, HAS_OUT_ROW=out_row is not None,
            BLOCK=BLOCK_H, enable_fp_fusion=False)
        return out
    acc = torch.zeros(M, H, dtype=torch.float32, device=src.device)
    w = weights.to(torch.float32) if weights is not None else None
    safe = index.clamp(min=0)
    for j in range(J):
        term = src[safe[:, j]].to(torch.float32)
        if w is not None:
            term = term * w[:, j:j + 1]
        acc = torch.where((index[:, j] >= 0).unsqueeze(1), acc + term, acc)
    if out_row is None:
        out[:M] = acc.to(out.dtype)
    else:
        out[out_row] = acc.to(out.dtype)
    return out


# -- Triton kernels --------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _pack_dispatch_kernel(x_ptr, order_ptr, ids_ptr, send_ptr, meta_ptr, slot_row_ptr, group_ptr, w_ptr,
                              x_stride, send_stride, meta_stride, meta_at, K, experts_per_rank, head_rows, P,
                              N_WORDS: tl.constexpr, HAS_SLOT_ROW: tl.constexpr, HAS_GROUP: tl.constexpr,
                              BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        pair = tl.load(order_ptr + i).to(tl.int64)
        token = pair // K
        slot = pair % K
        dest = tl.load(ids_ptr + pair).to(tl.int64) // experts_per_rank
        for c in range(0, N_WORDS, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            mask = cols < N_WORDS
            v = tl.load(x_ptr + token * x_stride + cols, mask=mask)
            tl.store(send_ptr + i * send_stride + cols, v, mask=mask)
        if HAS_GROUP:
            group = tl.load(group_ptr + token * P + dest).to(tl.int32)
            wbits = tl.load(w_ptr + pair).to(tl.int32, bitcast=True)
        else:
            group = tl.full((), 0, tl.int32)
            wbits = tl.full((), 0, tl.int32)
        w4 = tl.arange(0, 4)
        meta = tl.where(w4 == 0, token.to(tl.int32),
                        tl.where(w4 == 1, slot.to(tl.int32), tl.where(w4 == 2, group, wbits)))
        tl.store(meta_ptr + i * meta_stride + meta_at + w4, meta)
        if HAS_SLOT_ROW:
            tl.store(slot_row_ptr + pair, i + (dest + 1) * head_rows)

    @triton.jit
    def _unpack_dispatch_kernel(recv_ptr, meta_ptr, layout_ptr, tokens_ptr, handle_ptr, back_src_ptr, back_dst_ptr,
                                cells_ptr, cell_w_ptr, part_dst_ptr, group_start_ptr,
                                recv_stride, meta_stride, meta_at, tokens_stride, E, capacity, K, head_rows,
                                N_WORDS: tl.constexpr, P: tl.constexpr, BY_RANK: tl.constexpr, BLOCK: tl.constexpr):
        o = tl.program_id(0).to(tl.int64)
        e = o // capacity
        p = o % capacity
        r = tl.full((), -1, tl.int64)
        src = tl.full((), -1, tl.int64)
        for s in range(0, P):
            cnt = tl.load(layout_ptr + s * E + e)
            start = tl.load(layout_ptr + P * E + s * E + e)
            first = tl.load(layout_ptr + 2 * P * E + s * E + e)
            inside = (p >= start) & (p < start + cnt)
            r = tl.where(inside, first + p - start, r)
            src = tl.where(inside, s, src)
        valid = r >= 0
        for c in range(0, N_WORDS, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            mask = cols < N_WORDS
            v = tl.load(recv_ptr + r * recv_stride + cols, mask=mask & valid, other=0)
            tl.store(tokens_ptr + o * tokens_stride + cols, v, mask=mask)
        w4 = tl.arange(0, 4)
        meta = tl.load(meta_ptr + r * meta_stride + meta_at + w4, mask=(w4 < 4) & valid, other=-1)
        token = tl.sum(tl.where(w4 == 0, meta, 0), 0).to(tl.int64)
        slot = tl.sum(tl.where(w4 == 1, meta, 0), 0).to(tl.int64)
        group = tl.sum(tl.where(w4 == 2, meta, 0), 0).to(tl.int64)
        wbits = tl.sum(tl.where(w4 == 3, meta, 0), 0)
        n_out = E * capacity
        tl.store(handle_ptr + o, src)
        tl.store(handle_ptr + n_out + o, tl.where(valid, token, -1))
        tl.store(handle_ptr + 2 * n_out + o, tl.where(valid, slot, -1))
        tl.store(back_src_ptr + r, o, mask=valid)
        tl.store(back_dst_ptr + r, r + (src + 1) * head_rows, mask=valid)
        if BY_RANK:
            g = tl.load(group_start_ptr + src, mask=valid, other=0) + group
            tl.store(cells_ptr + g * K + slot, o, mask=valid)
            tl.store(cell_w_ptr + g * K + slot, wbits, mask=valid)
            tl.store(part_dst_ptr + g, g + (src + 1) * head_rows, mask=valid)

    @triton.jit
    def _copy_rows_kernel(src_ptr, src_index_ptr, dst_ptr, dst_index_ptr, src_stride, dst_stride,
                          N_WORDS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        a = tl.load(src_index_ptr + i).to(tl.int64)
        b = tl.load(dst_index_ptr + i).to(tl.int64)
        for c in range(0, N_WORDS, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            mask = cols < N_WORDS
            tl.store(dst_ptr + b * dst_stride + cols, tl.load(src_ptr + a * src_stride + cols, mask=mask), mask=mask)

    @triton.jit
    def _weighted_row_sum_kernel(src_ptr, index_ptr, w_ptr, out_ptr, out_row_ptr, H, src_stride, out_stride,
                                 J: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_OUT_ROW: tl.constexpr,
                                 BLOCK: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in range(0, J):
            idx = tl.load(index_ptr + m * J + j).to(tl.int64)
            present = idx >= 0
            v = tl.load(src_ptr + idx * src_stride + cols, mask=mask & present, other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                v = v * tl.load(w_ptr + m * J + j).to(tl.float32)
            acc = tl.where(present, acc + v, acc)
        row = m
        if HAS_OUT_ROW:
            row = tl.load(out_row_ptr + m).to(tl.int64)
        tl.store(out_ptr + row * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
