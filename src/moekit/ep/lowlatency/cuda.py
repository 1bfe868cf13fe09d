"""The GPU transport of the low-latency layer: Triton kernels over torch symmetric memory.

Every rank allocates one symmetric buffer (``torch.distributed._symmetric_memory``, CUDA
backend: peer pointers over NVLink) holding, for each of two phases, the receive regions of
the layout (:mod:`moekit.ep.lowlatency.layout`) and the combine slot rows, plus arrival
counters. The buffer and the step state (epochs, tickets) belong to a slot of the process
(:mod:`moekit.ep.lowlatency.pool`), shared by every layer on it and laid out for the largest:
a layer's kernels take the regions' offsets and phase sizes as arguments and use a prefix of
each region. Kernels store straight into the peers' regions; no host sync, no NCCL, so a whole
dispatch + combine can be captured in one CUDA graph and replayed.

Two kernels per step, each one cooperative launch (every program resident at once, so a
program spinning on a signal can never keep one that must send from running; the grids are
sized from the compiled kernels' occupancy):

* ``_dispatch_kernel``: quant_and_put (units (token, column share) pid, pid + grid, ...: mask
  ids outside [-1, E) to -1, quantize the share to e4m3 with one float32 scale per 128
  columns when ``online_fp8``, store it ONCE into every rank that hosts one of the token's
  experts, its ids row and T into every rank; at small T a token is split into up to 8
  shares so idle programs help); count_put (the last program to finish its puts adds 1 to
  this source's arrival counter on every rank, release at system scope); wait (every
  source's counter reached this step's value); postprocess (local experts pid, pid + grid,
  ...: the expert-major meta from the received ids with a cumsum, then the fan-out copy of
  the expert's rows out of the receive buffer).
* ``_combine_kernel``: copy_and_put (units of (source rank, token, column share), as many
  as each source sent tokens: each expert output row this rank serves goes to its source
  rank's slot rows ``[token, k]``, once per slot); per-token arrival signals (each program
  fences once, then adds its units' column blocks to each of their tokens' counters on the
  token's rank); then topk_reduce (units of (token, 1024 columns)), each unit waiting only
  for its own token (recv_wait), so tokens whose rows are in are summed while others are
  still arriving: the K-slot float32 sum in slot order, compiled without FMA contraction so
  it is bitwise equal to :func:`moekit.ep.dispatcher.weighted_slot_sum`.

The rank combine order (``combine_order="rank"``): the dispatch also stores each token's
float32 weights row with its ids, and the combine's put units send one partial row per
(token, rank) instead of one row per slot: the weighted outputs of the token's slots served
here, summed in float32 in slot order and rounded once, into row (t, RANK) of the token's
rank; the reduce adds the partials of the ranks the token's ids name, in rank order
(bitwise :func:`moekit.ep.dispatcher.weighted_rank_sum`). A token's bytes on the way back
fall from K rows to one per rank that holds its experts.

Ranks fail together: program 0 of the dispatch stores this rank's step status
(:mod:`moekit.ep.agreement`, built on the host without a device read) into a status row of
every rank, and a program that masked an out-of-range id stores a flag there; both travel
ahead of the arrival signal, so after the wait every rank holds every rank's status (read on
the host by an eager step) and flags (read by the host check after a graph replay). A rank
with bad input sends an empty step (T = 0) and still takes part.

Each direction is one kernel, not a put kernel and a receive kernel: under graph replay
every extra launch leaves a gap between kernels (docs/lowlatency.md has the numbers).

Double buffering and signals. A step's phase is ``epoch & 1`` where ``epoch`` lives on the
device (one for dispatch, one for combine) and is advanced by the last program of the
step's kernel (a ticket counter tells which program is last, after every program
has read the epoch). A sender may run at most one step ahead of a receiver (it cannot
finish step n+1 before the receiver has sent its step n+1 data, which the receiver does
only after it finished reading step n), so two phases are enough. The dispatch's counters
are int64 and only grow: the receiver of use u of a phase waits for the value u, which no
earlier step can reach, so a stale signal can never match. The combine's per-token
counters get a routing-independent amount per step (W times the column blocks of a row)
and are zeroed by the receiver's last program once all have arrived (``_combine_kernel``).
Several layers may interleave on one slot (dispatch A, dispatch B, combine A, combine B):
the phases count the slot's exchanges, not a layer's; a combine that directly follows
another combine synchronizes with every peer (``BARRIER``), so no rank runs two combines
ahead; the rank order's weights are copied out of the receive region when the dispatch ends.
Replaying a captured graph keeps working because nothing is frozen on the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.ep.agreement import STATUS_WORDS
from moekit.ep.lowlatency.layout import LowLatencyLayout, LowLatencyMeta, RecvBuffers, rank_reduce, topk_reduce
from moekit.ep.lowlatency.pool import (STATUS_ROW, SharedBuffer, SymmOffsets, device_key, group_key, merge_sizes,
                                       shared_buffer, symm_region_bytes)
from moekit.kernels import bound
from moekit.kernels.occupancy import resident_ctas_per_sm

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

MAX_PEERS = 8  # peer base pointers are kernel arguments P0..P7 (ranks of one NVLink domain)
MAX_PROGRAMS = 1024  # the most programs of one cooperative grid
# Programs per SM of the cooperative grids, at most (fewer where registers or shared memory
# do not allow it): the put loops keep more NVLink stores in flight with more programs.
DISPATCH_CTAS_PER_SM = 2  # 8 warps each
COMBINE_CTAS_PER_SM = 4  # 4 warps each
# The fan-out copy runs in each expert's own program unless the grid has at least this many
# programs per local expert; then it is split into 8-row blocks over the whole grid, after a
# grid barrier. The barrier pays off only when each expert has many rows to copy (few local
# experts); many local experts copying a few rows each do not win its cost back
# (docs/lowlatency.md).
SPLIT_COPY_BELOW = 4
# Programs per token in the put loops, each storing a contiguous share of the token's
# columns (whole FP8 groups), at most this many, and only as far as the shares fit the grid
# the other part of the kernel needs anyway (``_dispatch_put_split``, ``_combine_put_split``):
# at small T, one program per token would quantize and store a whole wide token alone while
# the rest of the grid idles (docs/lowlatency.md).
MAX_DISPATCH_PUT_SPLIT = 8
MAX_COMBINE_PUT_SPLIT = 4
_ALIGN = 256
# The combine's per-token arrival counters: int32, one per 128-byte line.
TOK_STRIDE = tl.constexpr(32)
# state tensor (int64, local, one per shared buffer): dispatch epoch, combine epoch, and the
# tickets that find the last program of each kernel (2, 3) and of the dispatch's put part (4; 5
# is unused since the combine signals per token), the dispatch kernel's grid barrier (6:
# arrivals, 7: generation), the spill rounds of a bounded dispatch: their epoch (8) and
# tickets (9: put, 10: last), and the combines launched with BARRIER: their epoch (11) and
# ticket (12)
_STATE_SIZE = 13


def _aligned(t: torch.Tensor) -> bool:
    """Whether Triton specializes ``t``'s pointer as 16-byte aligned (part of a bound launch's key)."""
    return t.data_ptr() % 16 == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _round_up(n: int, m: int = _ALIGN) -> int:
    return -(-n // m) * m


def _dispatch_put_split(T: int, experts_per_rank: int, pieces: int) -> int:
    """Shares per token in the dispatch put: as many as the receive side (one program per
    local expert) leaves programs for at this T, at most MAX_DISPATCH_PUT_SPLIT and
    ``pieces`` (the token's FP8 groups or 128-column blocks)."""
    return max(1, min(MAX_DISPATCH_PUT_SPLIT, experts_per_rank // max(T, 1), pieces))


def _combine_put_split(put_units: int, blocks: int, grid_cap: int) -> int:
    """Shares per (source, tokens) unit in the combine put: the largest power of two up to
    MAX_COMBINE_PUT_SPLIT and ``blocks`` (column blocks) whose units still fit ``grid_cap``
    programs at once."""
    split = 1
    while split * 2 <= min(MAX_COMBINE_PUT_SPLIT, blocks) and put_units * split * 2 <= grid_cap:
        split *= 2
    return split


@triton.jit
def _peer(d: tl.constexpr, P0, P1, P2, P3, P4, P5, P6, P7):
    """Base pointer (uint8) of rank d's symmetric buffer; d is a compile-time constant."""
    p = P0
    if d == 1:
        p = P1
    if d == 2:
        p = P2
    if d == 3:
        p = P3
    if d == 4:
        p = P4
    if d == 5:
        p = P5
    if d == 6:
        p = P6
    if d == 7:
        p = P7
    return p


@triton.jit
def _fence_system():
    """fence.acq_rel.sys in thread 0 of the CTA, between two CTA barriers.

    The first barrier makes every thread's earlier stores performed relative to thread 0; the
    fence, being cumulative, then orders them all before whatever follows for observers on
    other GPUs (the grid-sync idiom: syncthreads, then one thread fences). One fence per CTA
    instead of one per thread: a system-scope fence waits for the stores to be acknowledged
    across NVLink, and thousands of them would serialize on that wait."""
    tl.debug_barrier()
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; @p fence.acq_rel.sys; mov.u32 $0, 0; }",
        "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def _region(base, offset, phase, phase_bytes, dtype: tl.constexpr):
    """Typed pointer to one phase of a region of a symmetric buffer. Every region starts at a
    multiple of 256 bytes; saying so lets the compiler emit 16-byte vector accesses (a cast
    pointer otherwise counts as 1-byte aligned)."""
    return tl.multiple_of((base + offset + phase * phase_bytes).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _wait_all_sources(own_ptr, OFF_CNT, phase, epoch, W: tl.constexpr):
    """Spin until every source's arrival counter of this phase (raised by the peers' last
    programs) reached this step's value, with acquire semantics at system scope: use u of a
    phase waits for u, which no earlier step can produce. (A plain ld.acquire.sys poll is
    no faster than the atomic: docs/lowlatency.md.)"""
    cnt = (own_ptr + OFF_CNT).to(tl.pointer_type(tl.int64)) + phase * W
    expected = (epoch >> 1) + 1
    for s in tl.static_range(W):
        v = tl.atomic_add(cnt + s, 0, sem="acquire", scope="sys")
        while v < expected:
            v = tl.atomic_add(cnt + s, 0, sem="acquire", scope="sys")


@triton.jit
def _stamp_range(stamps_ptr, index, t0, t1):
    tl.atomic_min(stamps_ptr + 2 * index, t0)
    tl.atomic_max(stamps_ptr + 2 * index + 1, t1)


@triton.jit
def _stamp_now(stamps_ptr, index):
    tl.store(stamps_ptr + index, globaltimer())


@triton.jit
def _last_program_advances(state_ptr, epoch, EPOCH: tl.constexpr, TICKET: tl.constexpr, NPROG):
    """The last program of the grid (by ticket) advances the epoch and resets the ticket."""
    ticket = tl.atomic_add(state_ptr + TICKET, 1, sem="acq_rel", scope="gpu")
    if ticket == NPROG - 1:
        tl.store(state_ptr + TICKET, 0)
        tl.store(state_ptr + EPOCH, epoch + 1)


@triton.jit
def _signal_arrival(state_ptr, phase, OFF_CNT, P0, P1, P2, P3, P4, P5, P6, P7,
                    TICKET: tl.constexpr, RANK: tl.constexpr, W: tl.constexpr, NPROG):
    """Called by every program after its stores: the last one to finish raises this source's
    arrival counter on every rank, once.

    One thread per CTA fences the CTA's stores at system scope (:func:`_fence_system`); the
    gpu-scope acq_rel ticket puts every program's stores before the last program's release at
    system scope, which is what the receiver's acquire pairs with (one remote atomic per peer per
    step: many programs hitting one remote address serialize over NVLink)."""
    _fence_system()
    ticket = tl.atomic_add(state_ptr + TICKET, 1, sem="acq_rel", scope="gpu")
    if ticket == NPROG - 1:
        tl.store(state_ptr + TICKET, 0)
        for d in tl.static_range(W):
            base = _peer(d, P0, P1, P2, P3, P4, P5, P6, P7)
            cnt = (base + OFF_CNT).to(tl.pointer_type(tl.int64)) + phase * W + RANK
            tl.atomic_add(cnt, 1, sem="release", scope="sys")


@triton.jit
def _put_tokens(pid, nprog, x_ptr, ids_ptr, ids_out_ptr, T, NE, phase,
                P0, P1, P2, P3, P4, P5, P6, P7,
                OFF_X, X_PHASE, OFF_S, S_PHASE, OFF_I, I_PHASE, OFF_T, T_PHASE,
                RANK: tl.constexpr, W: tl.constexpr, M: tl.constexpr, H: tl.constexpr, HSP: tl.constexpr,
                K: tl.constexpr, KP: tl.constexpr, EL: tl.constexpr,
                G: tl.constexpr, NG: tl.constexpr, NGSP: tl.constexpr, QUANT: tl.constexpr,
                SPLIT: tl.constexpr, w_ptr, OFF_W, W_PHASE, BY_RANK: tl.constexpr,
                BOUNDED: tl.constexpr, FIRST, ROWS: tl.constexpr, MP: tl.constexpr, ROUTING: tl.constexpr):
    """quant_and_put for units pid, pid + nprog, ... of (token, column share): SPLIT units per
    token, each a contiguous share of its columns (whole groups when quantizing; HSP / NGSP:
    the share's columns / groups, rounded up to a power of two). A unit masks the token's ids
    (those outside [-1, NE) become -1), quantizes its share and stores it once into every rank
    hosting one of the token's experts; share 0 also stores the int32 ids row into
    ``ids_out`` and into every rank, and in the rank combine order (BY_RANK) the float32
    weights row too (the expert ranks weight the outputs); program 0 stores T (the routing
    stores only with ROUTING: a spill round sends rows alone). A token's row goes to row
    (RANK, t) of the destination's region, or, with BOUNDED receive buffers, to row
    (RANK, j - FIRST) where j is its position in the stream to that rank, and only if
    FIRST <= j < FIRST + ROWS (the window, or one spill round). Returns 1 if this program
    masked an id, else 0."""
    ks = tl.arange(0, KP)
    k_ok = ks < K
    if QUANT:
        NGS: tl.constexpr = (NG + SPLIT - 1) // SPLIT
        grp = tl.arange(0, NGSP)
    else:
        HS: tl.constexpr = (H + SPLIT - 1) // SPLIT
        cols = tl.arange(0, HSP)
    bad_any = tl.zeros((KP,), tl.int32)
    for u in range(pid, T * SPLIT, nprog):
        t = u // SPLIT
        part = u % SPLIT
        raw = tl.load(ids_ptr + t * K + ks, mask=k_ok, other=-1)
        bad = k_ok & ((raw < -1) | (raw >= NE))
        bad_any = bad_any | bad.to(tl.int32)
        ids = tl.where(bad, -1, raw).to(tl.int32)
        first = k_ok & (part == 0) & ROUTING
        tl.store(ids_out_ptr + t * K + ks, ids, mask=first)
        if BY_RANK:
            wts = tl.load(w_ptr + t * K + ks, mask=first, other=0.0).to(tl.float32)
        row = (RANK * M + t).to(tl.int64)
        if QUANT:
            g = part * NGS + grp  # this share's groups
            g_ok = (grp < NGS) & (g < NG)
            offs = g[:, None] * G + tl.arange(0, G)[None, :]  # [NGSP, G]: group, column
            x_ok = g_ok[:, None] & (tl.arange(0, G) < G)[None, :]
            xv = tl.load(x_ptr + t.to(tl.int64) * H + offs, mask=x_ok, other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(xv), axis=1), 1e-4)
            scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
            q = tl.math.div_rn(xv, scale[:, None])
            payload = tl.clamp(q, -448.0, 448.0).to(tl.float8e4nv)
        else:
            offs = part * HS + cols
            x_ok = (cols < HS) & (offs < H)
            payload = tl.load(x_ptr + t.to(tl.int64) * H + offs, mask=x_ok)
        for d in tl.static_range(W):
            base = _peer(d, P0, P1, P2, P3, P4, P5, P6, P7)
            i_dst = _region(base, OFF_I, phase, I_PHASE, tl.int32)
            tl.store(i_dst + row * K + ks, ids, mask=first)
            if BY_RANK:
                w_dst = _region(base, OFF_W, phase, W_PHASE, tl.float32)
                tl.store(w_dst + row * K + ks, wts, mask=first)
            hits = tl.sum(((ids >= d * EL) & (ids < (d + 1) * EL)).to(tl.int32), axis=0)
            x_row = row
            if BOUNDED:
                j = _stream_pos(ids_ptr, t, NE, d, K, KP, EL, MP)
                x_row = (RANK * ROWS + j - FIRST).to(tl.int64)
                hits = tl.where((j >= FIRST) & (j < FIRST + ROWS), hits, 0)
            if hits > 0:
                x_dst = _region(base, OFF_X, phase, X_PHASE, payload.dtype)
                tl.store(x_dst + x_row * H + offs, payload, mask=x_ok)
                if QUANT:
                    s_dst = _region(base, OFF_S, phase, S_PHASE, tl.float32)
                    tl.store(s_dst + x_row * NG + g, scale, mask=g_ok)
    if pid == 0 and ROUTING:
        for d in tl.static_range(W):
            base = _peer(d, P0, P1, P2, P3, P4, P5, P6, P7)
            t_dst = _region(base, OFF_T, phase, T_PHASE, tl.int32)
            tl.store(t_dst + RANK, T)
    return tl.max(bad_any, 0)


@triton.jit
def _stream_pos(ids_ptr, t, NE, d: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EL: tl.constexpr,
                MP: tl.constexpr):
    """Token t's position in this rank's stream to rank d: how many earlier tokens have an id
    (valid, in [0, NE)) on d. The receiver numbers the same stream from the ids rows it gets."""
    tt = tl.arange(0, MP)
    ks = tl.arange(0, KP)
    ids = tl.load(ids_ptr + tt[:, None] * K + ks[None, :], mask=(tt < t)[:, None] & (ks < K)[None, :], other=-1)
    on_d = (ids >= d * EL) & (ids < (d + 1) * EL) & (ids < NE)
    return tl.sum((tl.sum(on_d.to(tl.int32), axis=1) > 0).to(tl.int32), axis=0)


@triton.jit
def _send_status(pid, bad, status_ptr, phase, epoch, OFF_ST, ST_PHASE, P0, P1, P2, P3, P4, P5, P6, P7,
                 RANK: tl.constexpr, W: tl.constexpr, SW: tl.constexpr, SWP: tl.constexpr):
    """Before this program's arrival signal (whose fence orders these stores): program 0
    stores this rank's step status words into row RANK of every rank's status region, and a
    program that masked an id stores this use of the phase (``epoch // 2 + 1``) into the
    row's last word, the device flag. The flag counts only when it equals the receiver's use,
    so a flag left from an earlier step never does, and nobody has to clear it."""
    ww = tl.arange(0, SWP)
    for d in tl.static_range(W):
        row = _region(_peer(d, P0, P1, P2, P3, P4, P5, P6, P7), OFF_ST, phase, ST_PHASE, tl.int64) + RANK * SW
        if pid == 0:
            words = tl.load(status_ptr + ww, mask=ww < SW - 1, other=0)
            tl.store(row + ww, words, mask=ww < SW - 1)
        if bad != 0:
            tl.store(row + (SW - 1), (epoch >> 1) + 1)


@triton.jit
def _gather_flags(own_ptr, phase, epoch, OFF_ST, ST_PHASE, invalid_ranks_ptr, invalid_ptr,
                  W: tl.constexpr, WP: tl.constexpr, SW: tl.constexpr):
    """After the wait: which sources flagged masked ids in this step (``invalid_ranks``, int32
    per rank) and whether any did (``invalid``), the same on every rank."""
    ss = tl.arange(0, WP)
    rows = _region(own_ptr, OFF_ST, phase, ST_PHASE, tl.int64)
    flag = tl.load(rows + ss * SW + (SW - 1), mask=ss < W, other=0)
    flagged = (flag == (epoch >> 1) + 1).to(tl.int32)
    tl.store(invalid_ranks_ptr + ss, flagged, mask=ss < W)
    tl.store(invalid_ptr, tl.max(flagged, 0) > 0)


@triton.jit
def _recv_meta(e, own_ptr, phase,
                 counts_ptr, src_rank_ptr, src_token_ptr, src_slot_ptr, slot_bits_ptr, range_ptr, row_index_ptr,
                 num_tokens_ptr, slot_row_ptr,
                 OFF_I, I_PHASE, OFF_T, T_PHASE,
                 RANK: tl.constexpr, W: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
                 K: tl.constexpr, KP: tl.constexpr, EL: tl.constexpr, CAPP: tl.constexpr,
                 BOUNDED: tl.constexpr, C: tl.constexpr, S: tl.constexpr, copy_from_ptr, stream_pos_ptr,
                 overflow_ptr, rounds_ptr):
    """postprocess for local expert e (after the wait), before the fan-out: number e's rows
    in (source, token) order with a cumsum over the received ids and write the meta
    (scattered to the rows' places, padding rows -1), ``counts`` and ``slot_row``.

    With BOUNDED receive buffers, each of e's rows also gets the receive row it is copied
    from (``copy_from``: row (s, j) of the window, j the token's position in source s's
    stream here, or -1 when j >= C and a spill round brings it), and expert 0's program
    writes every token's stream position (``stream_pos [W, M]``), each source's tokens past
    the window (``overflow``) and the spill rounds the step needs (``rounds``: from every
    (source, destination) stream, the same number on every rank)."""
    CAP: tl.constexpr = W * M
    ids_base = _region(own_ptr, OFF_I, phase, I_PHASE, tl.int32)
    t_base = _region(own_ptr, OFF_T, phase, T_PHASE, tl.int32)
    my_expert = RANK * EL + e
    tt = tl.arange(0, MP)
    ks = tl.arange(0, KP)
    row0 = e * CAP
    base = 0
    worst = tl.program_id(0) * 0  # the longest (source, destination) stream of the step (BOUNDED)
    for s in tl.static_range(W):
        n_tok = tl.load(t_base + s)
        live = (tt < n_tok)[:, None] & (ks < K)[None, :]
        ids = tl.load(ids_base + (s * M + tt)[:, None] * K + ks[None, :], mask=live, other=-1)
        match = ids == my_expert
        bits = tl.sum(match.to(tl.int32) << ks[None, :], axis=1)  # [MP]; distinct slots -> OR
        first = tl.min(tl.where(match, ks[None, :], KP), axis=1)
        has = bits != 0
        pos = base + tl.cumsum(has.to(tl.int32), axis=0) - 1  # row of (s, t) inside expert e
        n_s = tl.sum(has.to(tl.int32), axis=0)
        dst = row0 + pos
        tl.store(src_rank_ptr + dst, tl.full((MP,), s, tl.int32), mask=has)
        tl.store(src_token_ptr + dst, tt, mask=has)
        tl.store(slot_bits_ptr + dst, bits, mask=has)
        tl.store(src_slot_ptr + dst, first, mask=has)
        tl.store(row_index_ptr + dst, (s * M + tt).to(tl.int64), mask=has)
        if BOUNDED:
            here = (tl.sum(((ids >= RANK * EL) & (ids < RANK * EL + EL)).to(tl.int32), axis=1) > 0).to(tl.int32)
            j = tl.cumsum(here, axis=0) - here  # position of (s, t) in s's stream to this rank
            tl.store(copy_from_ptr + dst, tl.where(j < C, s * C + j, -1).to(tl.int64), mask=has)
            if e == 0:
                tl.store(stream_pos_ptr + s * M + tt, j, mask=tt < M)
                for d in tl.static_range(W):
                    n_d = tl.sum((tl.sum(((ids >= d * EL) & (ids < (d + 1) * EL)).to(tl.int32), axis=1) > 0)
                                 .to(tl.int32), axis=0)
                    worst = tl.maximum(worst, n_d)
                    if d == RANK:
                        tl.store(overflow_ptr + s, tl.maximum(n_d - C, 0).to(tl.int64))
        tl.store(range_ptr + (e * W + s) * 2, n_s)
        tl.store(range_ptr + (e * W + s) * 2 + 1, base)
        # The inverse map for e's slots; expert 0's program also marks every other slot -1.
        slot_dst = slot_row_ptr + (s * M + tt)[:, None] * K + ks[None, :]
        tl.store(slot_dst, (row0 + pos)[:, None].to(tl.int64), mask=match)
        if e == 0:
            mine = (ids >= RANK * EL) & (ids < RANK * EL + EL)
            tl.store(slot_dst, tl.full((MP, KP), -1, tl.int64), mask=~mine & (tt < M)[:, None] & (ks < K)[None, :])
        base += n_s
    count = base
    tl.store(counts_ptr + e, count)
    if e == 0:
        ss = tl.arange(0, W)
        tl.store(num_tokens_ptr + ss, tl.load(t_base + ss))
        if BOUNDED:
            tl.store(rounds_ptr, (tl.maximum(worst - C, 0) + S - 1) // S)
    # Padding rows: -1 (disjoint from the valid rows written above).
    pr = tl.arange(0, CAPP)
    pad = (pr >= count) & (pr < CAP)
    minus = tl.full((CAPP,), -1, tl.int32)
    tl.store(src_rank_ptr + row0 + pr, minus, mask=pad)
    tl.store(src_token_ptr + row0 + pr, minus, mask=pad)
    tl.store(slot_bits_ptr + row0 + pr, minus, mask=pad)
    tl.store(src_slot_ptr + row0 + pr, minus, mask=pad)
    tl.store(row_index_ptr + row0 + pr, minus.to(tl.int64), mask=pad)
    return count


@triton.jit
def _copy_block(e, r0, count, row_index_ptr, own_ptr, phase, tok_ptr, tsc_ptr, OFF_X, X_PHASE, OFF_S, S_PHASE,
                W: tl.constexpr, M: tl.constexpr, H: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr,
                QUANT: tl.constexpr, ROWS: tl.constexpr, BH: tl.constexpr):
    """The fan-out of rows [r0, r0 + ROWS) of local expert e (of its ``count``): each copied,
    with its scales, out of the receive buffer, BH columns at a time (``row_index_ptr``: each
    row's receive row, -1 for none). What other programs of
    the kernel wrote is loaded through L2 (.cg). (Each column block's load waits for the
    previous block's store: the compiler cannot tell they do not alias. Loading the rows
    whole, as one [rows, next_pow2(H)] register tile, helps at small T and loses at large T:
    docs/lowlatency.md.)"""
    rows = r0 + tl.arange(0, ROWS)
    valid = rows < count
    row0 = e * (W * M)
    src_row = tl.load(row_index_ptr + row0 + rows, mask=valid, other=-1, cache_modifier=".cg")
    valid = valid & (src_row >= 0)  # a bounded window's copy skips the rows a spill round brings
    dst_row = (row0 + rows).to(tl.int64)
    x_base = _region(own_ptr, OFF_X, phase, X_PHASE, tok_ptr.dtype.element_ty)
    for h0 in tl.static_range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        m = valid[:, None] & (hh < H)[None, :]
        v = tl.load(x_base + src_row[:, None] * H + hh[None, :], mask=m, cache_modifier=".cg")
        tl.store(tok_ptr + dst_row[:, None] * H + hh[None, :], v, mask=m)
    if QUANT:
        s_base = _region(own_ptr, OFF_S, phase, S_PHASE, tl.float32)
        gg = tl.arange(0, NGP)
        m = valid[:, None] & (gg < NG)[None, :]
        v = tl.load(s_base + src_row[:, None] * NG + gg[None, :], mask=m, cache_modifier=".cg")
        tl.store(tsc_ptr + dst_row[:, None] * NG + gg[None, :], v, mask=m)


@triton.jit
def _expert_counts(counts_ptr, EL: tl.constexpr, ELP: tl.constexpr):
    """The local experts' row counts the meta wrote (other programs' writes: through L2)."""
    ee = tl.arange(0, ELP)
    return tl.load(counts_ptr + ee, mask=ee < EL, other=0, cache_modifier=".cg")


@triton.jit
def _copy_unit(u, cnts, ELP: tl.constexpr, ROWS: tl.constexpr):
    """Fan-out unit u of the split copy: (expert, first row, expert's count). The experts'
    ROWS-row blocks are numbered in expert order from the counts ``cnts`` (every program
    computes the same numbering), so the copy spreads over the whole grid however few experts
    there are."""
    ee = tl.arange(0, ELP)
    blocks = (cnts + ROWS - 1) // ROWS
    ends = tl.cumsum(blocks, 0)
    e = tl.sum((ends <= u).to(tl.int32), 0)
    is_e = ee == e
    r0 = (u - tl.sum(tl.where(is_e, ends - blocks, 0), 0)) * ROWS
    return e, r0, tl.sum(tl.where(is_e, cnts, 0), 0)


@triton.jit
def _grid_barrier(state_ptr, COUNT: tl.constexpr, GEN: tl.constexpr, nprog):
    """Every program of the (cooperative) grid waits here for all the others. Sense by
    generation: the last to arrive resets the count and bumps the generation the others
    watch, so the state is ready for the next use. Release on arrival, acquire on leaving."""
    tl.debug_barrier()
    gen = tl.atomic_add(state_ptr + GEN, 0, sem="acquire", scope="gpu")
    if tl.atomic_add(state_ptr + COUNT, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        tl.store(state_ptr + COUNT, 0)
        tl.atomic_add(state_ptr + GEN, 1, sem="release", scope="gpu")
    else:
        now = gen
        while now == gen:
            now = tl.atomic_add(state_ptr + GEN, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _dispatch_kernel(x_ptr, ids_ptr, w_ptr, status_ptr, ids_out_ptr, invalid_ranks_ptr, invalid_ptr, T, NE,
                     own_ptr, state_ptr, stamps_ptr,
                     tok_ptr, tsc_ptr, counts_ptr, src_rank_ptr, src_token_ptr, src_slot_ptr, slot_bits_ptr,
                     range_ptr, row_index_ptr, num_tokens_ptr, slot_row_ptr,
                     P0, P1, P2, P3, P4, P5, P6, P7,
                     OFF_X, X_PHASE, OFF_S, S_PHASE, OFF_I, I_PHASE, OFF_T, T_PHASE, OFF_W, W_PHASE, OFF_ST, ST_PHASE,
                     OFF_CNT, BY_RANK: tl.constexpr, SW: tl.constexpr, SWP: tl.constexpr, WP: tl.constexpr,
                     BOUNDED: tl.constexpr, C: tl.constexpr, S: tl.constexpr, copy_from_ptr, stream_pos_ptr,
                     overflow_ptr, rounds_ptr,
                     RANK: tl.constexpr, W: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, H: tl.constexpr,
                     HSP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EL: tl.constexpr,
                     G: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr, NGSP: tl.constexpr, QUANT: tl.constexpr,
                     ROWS: tl.constexpr, CAPP: tl.constexpr, BH: tl.constexpr, ELP: tl.constexpr,
                     SPLIT_COPY: tl.constexpr, PUT_SPLIT: tl.constexpr, PROFILE: tl.constexpr):
    """The whole dispatch in one cooperative launch (every program resident, so a program
    spinning in the wait cannot keep a sender off the GPU): quant_and_put (tokens pid,
    pid + grid, ...), count_put (the last program to finish its puts raises this source's
    counter on every rank), wait (every source's counter), postprocess (local experts pid,
    pid + grid, ...). The step status and the masked-id flag travel with the tokens
    (:func:`_send_status`), and program 0 gathers every source's flag after the wait, so
    every rank learns in the same step which ranks had bad ids."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(state_ptr + 0)
    phase = epoch & 1
    if PROFILE:
        t0 = globaltimer()
    bad = _put_tokens(pid, nprog, x_ptr, ids_ptr, ids_out_ptr, T, NE, phase, P0, P1, P2, P3, P4, P5, P6, P7,
                      OFF_X, X_PHASE, OFF_S, S_PHASE, OFF_I, I_PHASE, OFF_T, T_PHASE,
                      RANK, W, M, H, HSP, K, KP, EL, G, NG, NGSP, QUANT, PUT_SPLIT, w_ptr, OFF_W, W_PHASE, BY_RANK,
                      BOUNDED, 0, C, MP, True)
    _send_status(pid, bad, status_ptr, phase, epoch, OFF_ST, ST_PHASE, P0, P1, P2, P3, P4, P5, P6, P7,
                 RANK, W, SW, SWP)
    if PROFILE:
        t1 = globaltimer()
        _stamp_range(stamps_ptr, 0, t0, t1)
    _signal_arrival(state_ptr, phase, OFF_CNT, P0, P1, P2, P3, P4, P5, P6, P7, 4, RANK, W, nprog)
    if PROFILE:
        t2 = globaltimer()
        _stamp_range(stamps_ptr, 1, t1, t2)
    if pid < EL or pid == 0:
        _wait_all_sources(own_ptr, OFF_CNT, phase, epoch, W)
    if PROFILE:
        t3 = globaltimer()
        _stamp_range(stamps_ptr, 2, t2, t3)
    if pid == 0:  # the sources' flags were stored before their arrival signals, which the wait acquired
        _gather_flags(own_ptr, phase, epoch, OFF_ST, ST_PHASE, invalid_ranks_ptr, invalid_ptr, W, WP, SW)
    e = pid
    while e < EL:
        count = _recv_meta(e, own_ptr, phase, counts_ptr, src_rank_ptr, src_token_ptr, src_slot_ptr, slot_bits_ptr,
                           range_ptr, row_index_ptr, num_tokens_ptr, slot_row_ptr, OFF_I, I_PHASE, OFF_T, T_PHASE,
                           RANK, W, M, MP, K, KP, EL, CAPP, BOUNDED, C, S, copy_from_ptr, stream_pos_ptr,
                           overflow_ptr, rounds_ptr)
        if not SPLIT_COPY:  # the expert's program copies its rows (the meta is this CTA's own writes)
            tl.debug_barrier()
            for r0 in range(0, count, ROWS):
                _copy_block(e, r0, count, copy_from_ptr if BOUNDED else row_index_ptr, own_ptr, phase, tok_ptr,
                            tsc_ptr, OFF_X, X_PHASE,
                            OFF_S, S_PHASE, W, M, H, NG, NGP, QUANT, ROWS, BH)
        e += nprog
    if SPLIT_COPY:
        # Few experts for the grid: every program copies row blocks of any expert, which
        # needs every expert's meta: after a grid barrier.
        _grid_barrier(state_ptr, 6, 7, nprog)
        cnts = _expert_counts(counts_ptr, EL, ELP)
        units = tl.sum((cnts + ROWS - 1) // ROWS, 0)
        u = pid
        while u < units:
            ue, r0, count = _copy_unit(u, cnts, ELP, ROWS)
            _copy_block(ue, r0, count, copy_from_ptr if BOUNDED else row_index_ptr, own_ptr, phase, tok_ptr,
                        tsc_ptr, OFF_X, X_PHASE,
                        OFF_S, S_PHASE, W, M, H, NG, NGP, QUANT, ROWS, BH)
            u += nprog
    if PROFILE:
        _stamp_range(stamps_ptr, 3, t3, globaltimer())
    _last_program_advances(state_ptr, epoch, 0, 2, nprog)


@triton.jit
def _copy_spilled(u, first, own_ptr, phase, stream_pos_ptr, num_tokens_ptr, slot_row_ptr, tok_ptr, tsc_ptr,
                  OFF_SX, SX_PHASE, OFF_SS, SS_PHASE, W: tl.constexpr, M: tl.constexpr, H: tl.constexpr,
                  K: tl.constexpr, S: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr, QUANT: tl.constexpr,
                  BH: tl.constexpr):
    """The fan-out of one spill round for unit u = (source s, token t): if the token's
    position j in s's stream here is in the round [first, first + S), its row (s, j - first)
    of the spill region goes to the expert-major row of each of its slots served here
    (``slot_row``; a repeated expert gets the same row twice, with the same bytes)."""
    src = u // M
    t = u % M
    j = tl.load(stream_pos_ptr + u)
    if (t < tl.load(num_tokens_ptr + src)) & (j >= first) & (j < first + S):
        row = (src * S + j - first).to(tl.int64)
        x_base = _region(own_ptr, OFF_SX, phase, SX_PHASE, tok_ptr.dtype.element_ty)
        for k in tl.static_range(K):
            dst = tl.load(slot_row_ptr + u * K + k)
            if dst >= 0:
                for h0 in tl.static_range(0, H, BH):
                    hh = h0 + tl.arange(0, BH)
                    v = tl.load(x_base + row * H + hh, mask=hh < H, cache_modifier=".cg")
                    tl.store(tok_ptr + dst * H + hh, v, mask=hh < H)
                if QUANT:
                    s_base = _region(own_ptr, OFF_SS, phase, SS_PHASE, tl.float32)
                    gg = tl.arange(0, NGP)
                    v = tl.load(s_base + row * NG + gg, mask=gg < NG, cache_modifier=".cg")
                    tl.store(tsc_ptr + dst * NG + gg, v, mask=gg < NG)


@triton.jit(do_not_specialize=["r"])
def _spill_kernel(r, x_ptr, ids_ptr, T, NE, own_ptr, state_ptr, rounds_ptr, stream_pos_ptr, num_tokens_ptr,
                  slot_row_ptr, tok_ptr, tsc_ptr, P0, P1, P2, P3, P4, P5, P6, P7,
                  OFF_SX, SX_PHASE, OFF_SS, SS_PHASE, OFF_SCNT,
                  RANK: tl.constexpr, W: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, H: tl.constexpr,
                  HSP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EL: tl.constexpr, G: tl.constexpr,
                  NG: tl.constexpr, NGP: tl.constexpr, NGSP: tl.constexpr, QUANT: tl.constexpr, C: tl.constexpr,
                  S: tl.constexpr, BH: tl.constexpr, PUT_SPLIT: tl.constexpr):
    """Spill round r of a bounded dispatch, one cooperative launch, after the window's
    dispatch kernel. The round count (``rounds``) was computed by that kernel from every
    source's routing rows, the same on every rank, so every rank runs or skips round r alike:
    a round past the count returns at once, with no signal and no epoch change. A round puts
    the tokens at stream positions [C + r*S, C + (r + 1)*S) of each destination into its
    spill region (quantized again, to the same bits), signals and waits like the dispatch
    (its own epoch and counters), then fans the round's rows out (:func:`_copy_spilled`).
    The spill region is double-buffered by the round's epoch: a rank can write round n + 1
    only after every peer sent round n, which each does after fanning out round n - 1."""
    if r < tl.load(rounds_ptr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        epoch = tl.load(state_ptr + 8)
        phase = epoch & 1
        _put_tokens(pid, nprog, x_ptr, ids_ptr, ids_ptr, T, NE, phase, P0, P1, P2, P3, P4, P5, P6, P7,
                    OFF_SX, SX_PHASE, OFF_SS, SS_PHASE, 0, 0, 0, 0,
                    RANK, W, M, H, HSP, K, KP, EL, G, NG, NGSP, QUANT, PUT_SPLIT, x_ptr, 0, 0, False,
                    True, C + r * S, S, MP, False)
        _signal_arrival(state_ptr, phase, OFF_SCNT, P0, P1, P2, P3, P4, P5, P6, P7, 9, RANK, W, nprog)
        _wait_all_sources(own_ptr, OFF_SCNT, phase, epoch, W)
        u = pid
        while u < W * M:
            _copy_spilled(u, C + r * S, own_ptr, phase, stream_pos_ptr, num_tokens_ptr, slot_row_ptr, tok_ptr,
                          tsc_ptr, OFF_SX, SX_PHASE, OFF_SS, SS_PHASE, W, M, H, K, S, NG, NGP, QUANT, BH)
            u += nprog
        _last_program_advances(state_ptr, epoch, 8, 10, nprog)


@triton.jit
def _put_outputs(d: tl.constexpr, b, part, eo_ptr, slot_row_ptr, n_tok, phase, P0, P1, P2, P3, P4, P5, P6, P7,
                 OFF_C, C_PHASE, M: tl.constexpr, H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                 TB: tl.constexpr, BH: tl.constexpr, SPLIT: tl.constexpr):
    """copy_and_put for source rank d's tokens [b*TB, (b+1)*TB) (of its ``n_tok``), column
    blocks part, part + SPLIT, ... of BH columns: each slot this rank serves (``slot_row``)
    gets its expert output row, stored into rank d's slot row [t, k]."""
    i = tl.arange(0, TB * KP)
    t = b * TB + i // KP
    k = i % KP
    live = (k < K) & (t < n_tok)
    src = tl.load(slot_row_ptr + (d * M + t) * K + k, mask=live, other=-1)
    ok = src >= 0
    slot = (t * K + k).to(tl.int64)
    c_dst = _region(_peer(d, P0, P1, P2, P3, P4, P5, P6, P7), OFF_C, phase, C_PHASE, eo_ptr.dtype.element_ty)
    NBH: tl.constexpr = (H + BH - 1) // BH
    for j in tl.static_range((NBH + SPLIT - 1) // SPLIT):
        hh = (j * SPLIT + part) * BH + tl.arange(0, BH)
        m = ok[:, None] & (hh < H)[None, :]
        v = tl.load(eo_ptr + src[:, None] * H + hh[None, :], mask=m)
        tl.store(c_dst + slot[:, None] * H + hh[None, :], v, mask=m)


@triton.jit
def _put_partials(d: tl.constexpr, b, part, eo_ptr, slot_row_ptr, n_tok, phase, wts_ptr,
                  P0, P1, P2, P3, P4, P5, P6, P7, OFF_C, C_PHASE,
                  RANK: tl.constexpr, W: tl.constexpr, M: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                  TB: tl.constexpr, BH: tl.constexpr, SPLIT: tl.constexpr):
    """The rank order's copy_and_put for source rank d's tokens [b*TB, (b+1)*TB), column
    blocks part, part + SPLIT, ...: per token, the weighted expert outputs of its slots this
    rank serves, summed in float32 in slot order (separate multiply and add: the kernel is
    compiled without FMA contraction, so the float32 operations are those of
    ``rank_order.partial_rows``), rounded once, stored as row (t, RANK) of rank d's partial
    rows. Tokens with no slot here store nothing (the token's rank does not read that row).
    The weights are the ones d sent with its dispatch (``wts_ptr``: the layer's copy of them,
    ``[W, M, K]`` float32, taken when the dispatch ended: the shared receive region may have
    served other layers' dispatches since)."""
    t = b * TB + tl.arange(0, TB)
    live = t < n_tok
    wts = wts_ptr
    p_dst = _region(_peer(d, P0, P1, P2, P3, P4, P5, P6, P7), OFF_C, phase, C_PHASE, eo_ptr.dtype.element_ty)
    NBH: tl.constexpr = (H + BH - 1) // BH
    for j in tl.static_range((NBH + SPLIT - 1) // SPLIT):
        hh = (j * SPLIT + part) * BH + tl.arange(0, BH)
        h_ok = hh < H
        acc = tl.zeros((TB, BH), tl.float32)
        has = tl.zeros((TB,), tl.int32)
        for k in tl.static_range(K):
            slot = (d * M + t) * K + k
            src = tl.load(slot_row_ptr + slot, mask=live, other=-1)
            ok = src >= 0
            w = tl.load(wts + slot, mask=ok, other=0.0)
            v = tl.load(eo_ptr + src[:, None] * H + hh[None, :], mask=ok[:, None] & h_ok[None, :],
                        other=0.0).to(tl.float32)
            acc = tl.where(ok[:, None], acc + v * w[:, None], acc)
            has = has | ok.to(tl.int32)
        dst = (t * W + RANK).to(tl.int64) * H
        tl.store(p_dst + dst[:, None] + hh[None, :], acc.to(eo_ptr.dtype.element_ty),
                 mask=(has != 0)[:, None] & h_ok[None, :])


@triton.jit
def _reduce_ranks(t, hb, own_ptr, ids_ptr, out_ptr, phase, OFF_C, C_PHASE,
                  W: tl.constexpr, H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EL: tl.constexpr,
                  BH: tl.constexpr):
    """The rank order's reduce of token t, columns [hb*BH, (hb+1)*BH): the partial rows of the
    ranks holding the token's experts, added in float32 in rank order from 0 and rounded once
    (``rank_order.sum_partials``); a rank holding none of them is never read into the sum."""
    hh = hb * BH + tl.arange(0, BH)
    h_ok = hh < H
    ks = tl.arange(0, KP)
    ids = tl.load(ids_ptr + t * K + ks, mask=ks < K, other=-1)
    parts = _region(own_ptr, OFF_C, phase, C_PHASE, out_ptr.dtype.element_ty)
    acc = tl.zeros((BH,), tl.float32)
    for r in tl.static_range(W):
        hit = tl.sum(((ids >= r * EL) & (ids < (r + 1) * EL)).to(tl.int32), axis=0) > 0
        v = tl.load(parts + (t * W + r).to(tl.int64) * H + hh, mask=h_ok, other=0.0).to(tl.float32)
        acc = tl.where(hit, acc + v, acc)
    tl.store(out_ptr + t.to(tl.int64) * H + hh, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def _reduce_slots(t, hb, own_ptr, ids_ptr, w_ptr, out_ptr, phase, OFF_C, C_PHASE,
                  H: tl.constexpr, K: tl.constexpr, BH: tl.constexpr):
    """topk_reduce of token t, columns [hb*BH, (hb+1)*BH): the K-slot float32 sum in slot
    order. Separate multiply and add (the kernel is compiled without FMA contraction), so the
    float32 operations are those of weighted_slot_sum and the result is bitwise equal."""
    hh = hb * BH + tl.arange(0, BH)
    h_ok = hh < H
    slots = _region(own_ptr, OFF_C, phase, C_PHASE, out_ptr.dtype.element_ty)
    acc = tl.zeros((BH,), tl.float32)
    for k in tl.static_range(K):
        eid = tl.load(ids_ptr + t * K + k)
        w = tl.load(w_ptr + t * K + k).to(tl.float32)
        v = tl.load(slots + (t * K + k).to(tl.int64) * H + hh, mask=h_ok, other=0.0).to(tl.float32)
        acc = tl.where(eid >= 0, acc + v * w, acc)
    tl.store(out_ptr + t.to(tl.int64) * H + hh, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def _token_counter(base, OFF_TOK, phase, TOK_PHASE, t):
    """Pointer to token t's arrival counter (int32, one per 128-byte line so that the peers'
    atomics on different tokens do not meet in one line) of this phase in the buffer at base."""
    return (base + OFF_TOK + phase * TOK_PHASE).to(tl.pointer_type(tl.int32)) + t * TOK_STRIDE


@triton.jit
def _signal_tokens(d: tl.constexpr, b, part, n_tok, phase, P0, P1, P2, P3, P4, P5, P6, P7, OFF_TOK, TOK_PHASE,
                   NBH: tl.constexpr, TB: tl.constexpr, SPLIT: tl.constexpr):
    """After this program's stores are fenced: for each token of put unit (d, b, part), add
    the number of column blocks the unit stored to the token's counter on rank d. Every
    source adds NBH per token in all (its SPLIT shares together), whether or not it served
    one of the token's slots, so the receiver expects W * NBH without reading the routing.
    Relaxed: the fence before it makes the pair a release."""
    nblk = (NBH - part + SPLIT - 1) // SPLIT
    base = _peer(d, P0, P1, P2, P3, P4, P5, P6, P7)
    for i in tl.static_range(TB):
        t = b * TB + i
        if t < n_tok:
            tl.atomic_add(_token_counter(base, OFF_TOK, phase, TOK_PHASE, t), nblk, sem="relaxed", scope="sys")


@triton.jit
def _wait_token(own_ptr, OFF_TOK, phase, TOK_PHASE, t, EXPECTED: tl.constexpr):
    """Spin until token t's slot rows of this phase have all arrived (acquire, system scope)."""
    cnt = _token_counter(own_ptr, OFF_TOK, phase, TOK_PHASE, t)
    v = tl.atomic_add(cnt, 0, sem="acquire", scope="sys")
    while v < EXPECTED:
        v = tl.atomic_add(cnt, 0, sem="acquire", scope="sys")


@triton.jit
def _signal_barrier(state_ptr, bepoch, OFF_CCNT, P0, P1, P2, P3, P4, P5, P6, P7, RANK: tl.constexpr,
                    W: tl.constexpr, NPROG):
    """A BARRIER combine's arrival signal: after every program's stores (fenced at system
    scope), the last program (ticket 12) raises this source's combine counter of phase
    ``bepoch & 1`` on every rank and advances the barrier epoch (state 11; every program read
    it before taking its ticket)."""
    _fence_system()
    ticket = tl.atomic_add(state_ptr + 12, 1, sem="acq_rel", scope="gpu")
    if ticket == NPROG - 1:
        tl.store(state_ptr + 12, 0)
        for d in tl.static_range(W):
            base = _peer(d, P0, P1, P2, P3, P4, P5, P6, P7)
            cnt = (base + OFF_CCNT).to(tl.pointer_type(tl.int64)) + (bepoch & 1) * W + RANK
            tl.atomic_add(cnt, 1, sem="release", scope="sys")
        tl.store(state_ptr + 11, bepoch + 1)


@triton.jit
def _last_combine_program(state_ptr, epoch, own_ptr, OFF_TOK, phase, TOK_PHASE, T, NPROG):
    """The last program of the combine (ticket 3), after every program's waits: zero this
    phase's token counters of this step's T tokens, then advance the combine epoch."""
    ticket = tl.atomic_add(state_ptr + 3, 1, sem="acq_rel", scope="gpu")
    if ticket == NPROG - 1:
        for z0 in range(0, T, 1024):
            tt = z0 + tl.arange(0, 1024)
            tl.store(_token_counter(own_ptr, OFF_TOK, phase, TOK_PHASE, tt), 0, mask=tt < T)
        tl.store(state_ptr + 3, 0)
        tl.store(state_ptr + 1, epoch + 1)


@triton.jit
def _combine_kernel(eo_ptr, slot_row_ptr, num_tokens_ptr, own_ptr, ids_ptr, w_ptr, wrecv_ptr, out_ptr, T, state_ptr,
                    stamps_ptr, P0, P1, P2, P3, P4, P5, P6, P7, OFF_C, C_PHASE, OFF_TOK, TOK_PHASE, OFF_CCNT,
                    RANK: tl.constexpr, W: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, H: tl.constexpr,
                    K: tl.constexpr, KP: tl.constexpr, EL: tl.constexpr, TB: tl.constexpr, BH_PUT: tl.constexpr,
                    BH: tl.constexpr, PUT_SPLIT: tl.constexpr, BY_RANK: tl.constexpr, PROFILE: tl.constexpr,
                    BARRIER: tl.constexpr):
    """The whole combine in one cooperative launch: copy_and_put over units (source rank,
    TB tokens, column share), then the per-token arrival signals (one fence per program, then
    one counter add per token of its units, on the token's rank), then topk_reduce over units
    (token, BH columns), each waiting only for its own token's rows (recv_wait): a token whose
    rows are in is summed while other tokens are still on the wire. Each list is walked pid,
    pid + grid, ... The put units are numbered source after source, as many as each source
    sent tokens (the grid is sized on the host from this rank's T, without knowing the peers').
    In the rank combine order (BY_RANK) a put unit sends one partial row per token instead of
    one row per slot (:func:`_put_partials`), and the reduce adds the ranks' partials
    (:func:`_reduce_ranks`); the signals are the same.

    The token counters of this phase are zeroed by the last program, once every program has
    waited for its tokens (every peer's adds of this step have landed: a token's counter
    reaches its value only when all have). No peer adds to them again before this rank has
    finished: the next use of this phase is two combines later on the slot, and between the
    two there is either a dispatch (which no peer finishes before this rank sends it, after
    this kernel) or a combine launched with BARRIER. The shared buffer launches a combine
    that directly follows another combine with BARRIER: every program signals the combine's
    own counters on every peer (like the dispatch) and program 0 waits for every source's,
    so no rank finishes it before every rank has started it. (Without it a rank with no
    tokens, which waits for nothing, could run two combines ahead.)"""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(state_ptr + 1)
    phase = epoch & 1
    if BARRIER:
        bepoch = tl.load(state_ptr + 11)
    if PROFILE:
        t0 = globaltimer()
    NBH: tl.constexpr = (H + BH_PUT - 1) // BH_PUT
    u = pid  # the unit index, relative to the current source's first unit
    for d in tl.static_range(W):
        n_tok = tl.load(num_tokens_ptr + d)
        units = (n_tok + TB - 1) // TB * PUT_SPLIT
        while u < units:
            if BY_RANK:
                _put_partials(d, u // PUT_SPLIT, u % PUT_SPLIT, eo_ptr, slot_row_ptr, n_tok, phase, wrecv_ptr,
                              P0, P1, P2, P3, P4, P5, P6, P7, OFF_C, C_PHASE,
                              RANK, W, M, H, K, TB, BH_PUT, PUT_SPLIT)
            else:
                _put_outputs(d, u // PUT_SPLIT, u % PUT_SPLIT, eo_ptr, slot_row_ptr, n_tok, phase,
                             P0, P1, P2, P3, P4, P5, P6, P7, OFF_C, C_PHASE, M, H, K, KP, TB, BH_PUT, PUT_SPLIT)
            u += nprog
        u -= units
    if PROFILE:
        t1 = globaltimer()
        _stamp_range(stamps_ptr, 0, t0, t1)
    _fence_system()
    u = pid
    for d in tl.static_range(W):  # the same walk again: signal the tokens of this program's units
        n_tok = tl.load(num_tokens_ptr + d)
        units = (n_tok + TB - 1) // TB * PUT_SPLIT
        while u < units:
            _signal_tokens(d, u // PUT_SPLIT, u % PUT_SPLIT, n_tok, phase, P0, P1, P2, P3, P4, P5, P6, P7,
                           OFF_TOK, TOK_PHASE, NBH, TB, PUT_SPLIT)
            u += nprog
        u -= units
    if BARRIER:
        _signal_barrier(state_ptr, bepoch, OFF_CCNT, P0, P1, P2, P3, P4, P5, P6, P7, RANK, W, nprog)
    HB: tl.constexpr = (H + BH - 1) // BH
    if pid < T * HB:
        if PROFILE:
            t1 = globaltimer()
            t_wait = t1 - t1
        u = pid
        while u < T * HB:
            if PROFILE:
                tw = globaltimer()
            _wait_token(own_ptr, OFF_TOK, phase, TOK_PHASE, u // HB, W * NBH)
            if PROFILE:
                t_wait += globaltimer() - tw
            if BY_RANK:
                _reduce_ranks(u // HB, u % HB, own_ptr, ids_ptr, out_ptr, phase, OFF_C, C_PHASE, W, H, K, KP, EL, BH)
            else:
                _reduce_slots(u // HB, u % HB, own_ptr, ids_ptr, w_ptr, out_ptr, phase, OFF_C, C_PHASE, H, K, BH)
            u += nprog
        if PROFILE:
            # recv_wait: from the end of the signals to the end of this program's waiting (the
            # reduce of tokens that arrived early overlaps it); topk_reduce: the rest.
            t2 = t1 + t_wait
            _stamp_range(stamps_ptr, 1, t1, t2)
            _stamp_range(stamps_ptr, 2, t2, globaltimer())
    if BARRIER:
        if pid == 0:
            _wait_all_sources(own_ptr, OFF_CCNT, bepoch & 1, bepoch, W)
    _last_combine_program(state_ptr, epoch, own_ptr, OFF_TOK, phase, TOK_PHASE, T, nprog)


class SymmMemTransport:
    """:class:`~moekit.ep.lowlatency.transport.Transport` over torch symmetric memory (one node).

    ``dispatch`` runs the whole receive side (wait, meta, fan-out) in its second kernel, so
    :meth:`postprocess` and :meth:`fan_out` return what it already built. The returned
    :class:`RecvBuffers` are views of the phase the host believes current (it counts calls);
    under CUDA-graph replay only the meta and the expert-major tokens are meaningful.
    """

    stamps_layer_phases = True  # the kernels stamp postprocess / topk_reduce themselves
    exchanges_status = True  # dispatch(..., status=) carries every rank's step status
    combine_orders = ("slot", "rank")
    bounded_receive = True  # layout.recv_capacity < max_m: spill rounds (_spill_kernel)

    def __init__(self, layout: LowLatencyLayout, group=None, device: torch.device | str | None = None, *,
                 slot: int | None = 0):
        if layout.world_size > MAX_PEERS:
            raise ValueError(f"SymmMemTransport supports world_size <= {MAX_PEERS} (one NVLink domain), "
                             f"got {layout.world_size}")
        if layout.online_fp8 and layout.group_size & (layout.group_size - 1):
            raise ValueError(f"SymmMemTransport needs a power-of-two fp8 group size, got {layout.group_size}")
        if layout.local_world_size != layout.world_size:
            raise ValueError("SymmMemTransport needs every rank in one node (local_world_size == world_size); "
                             "the NVSHMEM route across nodes is not implemented")
        self.layout = L = layout
        self.group = group if group is not None else dist.group.WORLD
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        W, M, H, K, EL = L.world_size, L.max_m, L.hidden, L.topk, L.experts_per_rank
        self.quant = L.online_fp8
        self.by_rank = L.combine_order == "rank"
        ng = L.num_groups if self.quant else 0
        self.bounded = L.bounded
        # The receive regions live in the slot's shared symmetric buffer (moekit.ep.lowlatency.pool),
        # laid out for the largest layer on the slot; this layer uses a prefix of each region.
        # Reserving room may grow the buffer: a collective (every rank builds the same layers).
        self.slot = slot
        if slot is None:
            self.shared = SymmSharedBuffer(None, self.group, self.device, W)
        else:
            key = ("symm", group_key(self.group), device_key(self.device), W, slot)
            self.shared = shared_buffer(key, lambda: SymmSharedBuffer(key, self.group, self.device, W))
        self.shared.reserve(symm_region_bytes(L))

        dev = self.device
        self.tokens = torch.empty(EL, L.capacity, H, dtype=L.wire_dtype, device=dev)
        self.token_scales = torch.empty(EL, L.capacity, max(ng, 1), dtype=torch.float32, device=dev) if self.quant else None
        self.meta = LowLatencyMeta(
            counts=torch.zeros(EL, dtype=torch.int32, device=dev),
            src_rank=torch.full((EL, L.capacity), -1, dtype=torch.int32, device=dev),
            src_token=torch.full((EL, L.capacity), -1, dtype=torch.int32, device=dev),
            src_slot=torch.full((EL, L.capacity), -1, dtype=torch.int32, device=dev),
            slot_bits=torch.full((EL, L.capacity), -1, dtype=torch.int32, device=dev),
            layout_range=torch.zeros(EL, W, 2, dtype=torch.int32, device=dev),
            row_index=torch.full((EL, L.capacity), -1, dtype=torch.int64, device=dev),
            num_tokens=torch.zeros(W, dtype=torch.int32, device=dev),
            slot_row=torch.full((W, M, K), -1, dtype=torch.int64, device=dev),
            recv=None,
        )
        self.out = torch.empty(M, H, dtype=L.dtype, device=dev)
        self.ids = torch.empty(M, K, dtype=torch.int32, device=dev)  # the masked ids of the latest dispatch
        # ... which ranks' dispatch masked ids (the same on every rank), and whether any did
        self.invalid_ranks = torch.zeros(W, dtype=torch.int32, device=dev)
        self.invalid = torch.zeros((), dtype=torch.bool, device=dev)
        self._no_status = torch.zeros(STATUS_WORDS, dtype=torch.int64, device=dev)  # sent when the layer sends none
        self._no_weights = torch.zeros(M, K, dtype=torch.float32, device=dev)
        # A bounded dispatch's bookkeeping (written by the dispatch kernel, read by the spill
        # rounds): each expert row's window row, every received token's stream position, each
        # source's tokens past the window, and the spill rounds of the step.
        rows = EL * L.capacity if self.bounded else 1
        self.copy_from = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        self.stream_pos = torch.zeros(W * M if self.bounded else 1, dtype=torch.int32, device=dev)
        self.overflow = torch.zeros(W, dtype=torch.int64, device=dev)
        self.rounds = torch.zeros(1, dtype=torch.int32, device=dev)
        # combine_order="rank": the weights the sources sent, copied out of the shared receive
        # region when the dispatch ends (the combine reads them after other layers' exchanges).
        self.w_local = torch.zeros(W, M, K, dtype=torch.float32, device=dev) if self.by_rank else None
        self._no_stamps = torch.zeros(8, dtype=torch.int64, device=dev)
        self._pending = None  # combine's arguments, until topk_reduce launches the combine kernel
        # Launch shapes. The grids are cooperative (every program resident at once): as many
        # programs as the units of work, at most what the SMs hold (``_cooperative_grid``).
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self._per_sm: dict[tuple, int] = {}
        self._dispatch_plans: dict[tuple, tuple] = {}  # launch constants and grid per T (_dispatch_plan)
        self._combine_plans: dict[tuple, tuple] = {}
        self.tokens_per_out = max(1, 8 // _next_pow2(K))  # 8 (token, slot) entries per put unit
        torch.cuda.synchronize(dev)
        dist.barrier(group=self.group)

    # The shared buffer's parts, under the names probes and tests read.
    @property
    def _buf(self) -> torch.Tensor:
        return self.shared.buf

    @property
    def _state(self) -> torch.Tensor:
        return self.shared.state

    @property
    def _peer_args(self) -> list:
        return self.shared.peer_args

    @property
    def off_dcnt(self) -> int:
        return self.shared.off["dcnt"]

    @property
    def off_tok(self) -> int:
        return self.shared.off["tok"]

    @property
    def tok_phase(self) -> int:
        return self.shared.sizes["tok"]

    # ------------------------------------------------------------------ views
    def _recv_view(self, phase: int) -> RecvBuffers:
        L = self.layout
        W, M, H, K = L.world_size, L.max_m, L.hidden, L.topk

        b = self.shared

        def region(name, nbytes, dtype, shape):
            off = b.off[name] + phase * b.sizes[name]
            return b.buf[off: off + nbytes].view(dtype).view(shape)

        x_elem = 1 if self.quant else L.dtype.itemsize
        C = L.recv_rows
        x = region("x", W * C * H * x_elem, L.wire_dtype, (W, C, H))
        scales = (region("s", W * C * L.num_groups * 4, torch.float32,
                         (W, C, L.num_groups)) if self.quant else None)
        ids = region("i", W * M * K * 4, torch.int32, (W, M, K))
        num = region("t", W * 4, torch.int32, (W,))
        status = region("st", W * STATUS_ROW * 8, torch.int64, (W, STATUS_ROW))[:, :STATUS_WORDS]
        weights = self.w_local
        bounded = dict(overflow=self.overflow, spill_rounds=self.rounds[0]) if self.bounded else {}
        return RecvBuffers(x=x, scales=scales, ids=ids, num_tokens=num, status=status, weights=weights, **bounded)

    def _consts(self) -> dict:
        L = self.layout
        return dict(RANK=L.rank, W=L.world_size, M=L.max_m, H=L.hidden, K=L.topk, EL=L.experts_per_rank)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, stamps: torch.Tensor | None, *,
                 status: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> RecvBuffers:
        """The Transport's dispatch. ``status`` (``[STATUS_WORDS]`` int64 on this device, or
        None: zeros) is this rank's step status, delivered with the tokens to every rank as
        ``RecvBuffers.status``; ``weights [T, K]`` (rank order only) go with the ids."""
        return self.dispatch_unchecked(x, topk_ids, self.layout.num_experts, stamps, status=status,
                                       weights=weights)[0]

    def dispatch_unchecked(self, x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                           stamps: torch.Tensor | None, *, status: torch.Tensor | None = None,
                           weights: torch.Tensor | None = None) -> tuple[RecvBuffers, torch.Tensor, torch.Tensor]:
        """:meth:`dispatch` for ids the host has not checked (under CUDA-graph capture it
        cannot read them): ``topk_ids`` int32/int64, any values. The kernel treats ids outside
        [-1, num_experts) as -1. Returns (receive buffers, the masked int32 ids [T, K], a
        device bool: whether any rank masked an id in this step); the last two, and
        :attr:`invalid_ranks` (which ranks did, the same on every rank), are valid until the
        next dispatch. One launch: ``_dispatch_kernel``. A step of
        T = 0 (a rank whose input was bad still takes part) reads none of x, ids, weights."""
        L = self.layout
        T = x.shape[0]
        if self.by_rank and weights is None:
            raise ValueError("weights: combine_order='rank' weights the expert outputs on the expert ranks, so "
                             "dispatch needs the routing weights")
        if T == 0:  # any valid device pointers will do: nothing is read
            x, topk_ids, weights = self.out, self.ids, self._no_weights
        if weights is None:
            weights = self._no_weights
        status = self._no_status if status is None else status
        profile = stamps is not None
        if profile:
            stamps[:, 0] = torch.iinfo(torch.int64).max
            stamps[:, 1] = 0
        st = stamps if profile else self._no_stamps
        m = self.meta
        tsc = self.token_scales if self.quant else self.tokens
        b = self.shared
        phase = b.note_dispatch()
        args = (x, topk_ids, weights, status, self.ids, self.invalid_ranks, self.invalid, T, num_experts, b.buf,
                b.state, st,
                self.tokens, tsc, m.counts, m.src_rank, m.src_token, m.src_slot, m.slot_bits, m.layout_range,
                m.row_index, m.num_tokens, m.slot_row, *b.peer_args, *b.dispatch_offsets)
        # The launch's constants and grid depend on T, profiling and the input dtypes only:
        # computed once per such key, not per call (the eager host path).
        plan_key = (T, profile, topk_ids.dtype, weights.dtype)
        plan = self._dispatch_plans.get(plan_key)
        if plan is None:
            plan = self._dispatch_plans[plan_key] = self._dispatch_plan(T, profile, topk_ids.dtype, weights.dtype,
                                                                        args)
        kwargs, grid, ps = plan
        # Bound launch (moekit.kernels.bound): after the first call of a key, straight from the
        # binary, without Triton's per-call binding. The key holds everything the binary's
        # specialization depends on: the layout and plan (constexprs, T), the ids bound, and the
        # 16-byte alignment of the tensors the caller passes (the layer's own are fresh allocations).
        key = ("ll-dispatch", L, plan_key, num_experts, _aligned(x), _aligned(topk_ids), _aligned(weights),
               _aligned(status), _aligned(st))
        with bound.call(key):
            bound.launch(_dispatch_kernel, (grid,), *args, **kwargs)
        if self.bounded:
            self._spill_rounds(x, topk_ids, T, num_experts, ps)
        if self.by_rank:
            self._keep_weights()
        recv = self._recv_view(phase)
        self.meta.recv = recv
        return recv, self.ids[:T], self.invalid

    def _dispatch_plan(self, T: int, profile: bool, ids_dtype, w_dtype, args: tuple) -> tuple[dict, int, int]:
        """(kwargs, grid, put split) of the dispatch kernel for this T."""
        L = self.layout
        ng = L.num_groups if self.quant else 1
        ps = _dispatch_put_split(T, L.experts_per_rank, ng if self.quant else triton.cdiv(L.hidden, 128))
        kwargs = dict(MP=_next_pow2(L.max_m), HSP=_next_pow2(triton.cdiv(L.hidden, ps)), KP=_next_pow2(L.topk),
                      G=L.group_size if self.quant else 1, NG=ng, NGP=_next_pow2(ng),
                      NGSP=_next_pow2(triton.cdiv(ng, ps)), QUANT=self.quant,
                      CAPP=_next_pow2(L.capacity), ELP=_next_pow2(L.experts_per_rank),
                      BH=min(1024 if self.quant else 512, _next_pow2(L.hidden)), PUT_SPLIT=ps,
                      BY_RANK=self.by_rank, SW=STATUS_ROW, SWP=_next_pow2(STATUS_ROW), WP=_next_pow2(L.world_size),
                      BOUNDED=self.bounded, C=L.recv_rows, S=max(L.spill_rows_per_round, 1),
                      copy_from_ptr=self.copy_from, stream_pos_ptr=self.stream_pos, overflow_ptr=self.overflow,
                      rounds_ptr=self.rounds,
                      PROFILE=profile, num_warps=8, launch_cooperative_grid=True, **self._consts())
        # One program per (token, column share) to put or local expert to receive. With few
        # experts for the grid, the fan-out copy is split over all programs (SPLIT_COPY; a grid
        # barrier first).
        units = max(T * ps, L.experts_per_rank)
        split = L.experts_per_rank * SPLIT_COPY_BELOW <= min(units, self.sms * DISPATCH_CTAS_PER_SM)
        # Rows per copy step: 16 in an expert's own program (8 there made postprocess slower:
        # docs/lowlatency.md); 8 per unit of the split copy.
        kwargs.update(SPLIT_COPY=split, ROWS=8 if split else 16)
        grid = self._cooperative_grid(_dispatch_kernel, (profile, T, split, ps, ids_dtype, w_dtype),
                                      DISPATCH_CTAS_PER_SM, units, args, kwargs)
        return kwargs, grid, ps

    def _keep_weights(self) -> None:
        """Copy the routing weights every source sent with this dispatch out of the shared
        region into the layer's own (``w_local``; rank order). The phase is read on the device
        (the epoch the dispatch kernel advanced), so a graph replay copies the right one."""
        b = self.shared
        L = self.layout
        nbytes = L.world_size * L.max_m * L.topk * 4
        region = b.buf[b.off["w"]: b.off["w"] + 2 * b.sizes["w"]].view(2, b.sizes["w"])
        phase = torch.bitwise_and(b.state[0:1] - 1, 1)
        self.w_local.view(-1).view(torch.uint8).copy_(region.index_select(0, phase)[0, :nbytes])

    def _spill_rounds(self, x: torch.Tensor, topk_ids: torch.Tensor, T: int, num_experts: int, ps: int) -> None:
        """Launch the spill rounds of a bounded dispatch (``_spill_kernel``): as many as the step
        needs when the host may read that count (one read; the same on every rank), or the
        most any step can need inside a CUDA-graph capture, where each round past the step's
        count returns at once on every rank."""
        L = self.layout
        ng = L.num_groups if self.quant else 1
        tsc = self.token_scales if self.quant else self.tokens
        S = L.spill_rows_per_round
        kwargs = dict(MP=_next_pow2(L.max_m), HSP=_next_pow2(triton.cdiv(L.hidden, ps)), KP=_next_pow2(L.topk),
                      G=L.group_size if self.quant else 1, NG=ng, NGP=_next_pow2(ng),
                      NGSP=_next_pow2(triton.cdiv(ng, ps)), QUANT=self.quant, C=L.recv_rows, S=S,
                      BH=min(1024 if self.quant else 512, _next_pow2(L.hidden)), PUT_SPLIT=ps,
                      num_warps=8, launch_cooperative_grid=True, **self._consts())
        b = self.shared
        args = [0, x, topk_ids, T, num_experts, b.buf, b.state, self.rounds, self.stream_pos,
                self.meta.num_tokens, self.meta.slot_row, self.tokens, tsc, *b.peer_args,
                b.off["sx"], b.sizes["sx"], b.off["ss"], b.sizes["ss"], b.off["scnt"]]
        units = max(T * ps, L.world_size * L.max_m)
        # Sized (and compiled) on every call, so that an eager warm-up compiles what a capture
        # launches later.
        grid = self._cooperative_grid(_spill_kernel, ("spill", T, ps, topk_ids.dtype), DISPATCH_CTAS_PER_SM, units,
                                      tuple(args), kwargs)
        launches = L.max_spill_rounds if torch.cuda.is_current_stream_capturing() else int(self.rounds.item())
        for r in range(launches):
            args[0] = r
            _spill_kernel[(grid,)](*args, **kwargs)

    def postprocess(self, recv: RecvBuffers) -> LowLatencyMeta:
        """Built by the dispatch kernel already."""
        return self.meta

    def fan_out(self, recv: RecvBuffers, meta: LowLatencyMeta) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Done by the dispatch kernel already."""
        return self.tokens, self.token_scales

    # ------------------------------------------------------------------ combine
    def combine(self, expert_out: torch.Tensor, meta: LowLatencyMeta, stamps: torch.Tensor | None) -> torch.Tensor:
        """Record what to send home; returns None. The put, the wait and the slot sum run as
        one kernel, which needs the routing weights: :meth:`topk_reduce` launches it (and
        must follow, on every rank, or the peers wait forever)."""
        if stamps is not None:
            stamps[:, 0] = torch.iinfo(torch.int64).max
            stamps[:, 1] = 0
        self._pending = (expert_out.contiguous(), meta, stamps if stamps is not None else self._no_stamps)
        return None

    def topk_reduce(self, slot_rows, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
        """The combine recorded by :meth:`combine` in one launch (``_combine_kernel``): send,
        wait for this step's rows, sum them (bitwise ``weighted_slot_sum``, or in the rank
        order ``weighted_rank_sum``)."""
        if slot_rows is not None:  # rows handed in by someone else: the plain torch reduce
            if self.by_rank:
                return rank_reduce(slot_rows, topk_ids, self.layout, out_dtype)
            return topk_reduce(slot_rows, topk_ids, topk_weights, out_dtype)
        if self._pending is None:
            raise RuntimeError("topk_reduce(None, ...) needs a combine() before it")
        expert_out, meta, st = self._pending
        self._pending = None
        L = self.layout
        T = topk_ids.shape[0]
        if out_dtype != L.dtype:
            raise ValueError(f"out_dtype must be the layer's dtype {L.dtype}, got {out_dtype}")
        ids = topk_ids.contiguous()  # int32/int64 and float weights of any kind: cast in the kernel
        w = topk_weights.contiguous()
        profile = st is not self._no_stamps
        b = self.shared
        _, barrier = b.note_combine()
        wrecv = self.w_local if self.by_rank else self._no_weights
        args = (expert_out, meta.slot_row, meta.num_tokens, b.buf, ids, w, wrecv, self.out, T, b.state, st,
                *b.peer_args, b.off["c"], b.sizes["c"], b.off["tok"], b.sizes["tok"], b.off["ccnt"])
        plan_key = (T, profile, ids.dtype, w.dtype, barrier)
        plan = self._combine_plans.get(plan_key)
        if plan is None:
            plan = self._combine_plans[plan_key] = self._combine_plan(T, profile, ids.dtype, w.dtype, barrier, args)
        kwargs, grid = plan
        key = ("ll-combine", L, plan_key, _aligned(expert_out), _aligned(ids), _aligned(w), _aligned(st))
        with bound.call(key):
            bound.launch(_combine_kernel, (grid,), *args, **kwargs)
        return self.out[:T]

    def _combine_plan(self, T: int, profile: bool, ids_dtype, w_dtype, barrier: bool, args: tuple) -> tuple[dict, int]:
        """(kwargs, grid) of the combine kernel for this T."""
        L = self.layout
        bh = min(1024, _next_pow2(L.hidden))
        bh_put = min(1024, _next_pow2(L.hidden))
        ps = _combine_put_split(L.world_size * triton.cdiv(T, self.tokens_per_out), triton.cdiv(L.hidden, bh_put),
                                self.sms * COMBINE_CTAS_PER_SM)
        kwargs = dict(RANK=L.rank, W=L.world_size, M=L.max_m, MP=_next_pow2(L.max_m), H=L.hidden, K=L.topk,
                      KP=_next_pow2(L.topk), EL=L.experts_per_rank, TB=self.tokens_per_out, BH_PUT=bh_put, BH=bh,
                      PUT_SPLIT=ps, BY_RANK=self.by_rank, PROFILE=profile, BARRIER=barrier, num_warps=4,
                      enable_fp_fusion=False, launch_cooperative_grid=True)
        # Units: (source rank, tokens, column share) to put, then (token, columns) to sum. The
        # peers' token counts are on the device only; size the put part for this rank's T (a
        # peer that sent more is served by the same programs looping further).
        puts = L.world_size * triton.cdiv(T, self.tokens_per_out) * ps
        grid = self._cooperative_grid(_combine_kernel, (profile, T, ids_dtype, w_dtype, ps, barrier),
                                      COMBINE_CTAS_PER_SM, max(puts, T * triton.cdiv(L.hidden, bh)), args, kwargs)
        return kwargs, grid

    def _cooperative_grid(self, kernel, key: tuple, cap: int, units: int, args: tuple, kwargs: dict) -> int:
        """min(units, what the SMs hold of ``kernel`` compiled for these arguments, at most
        ``cap`` per SM); the occupancy is looked up once per key (the arguments that select
        a binary: Triton specializes T == 1 and T % 16 == 0)."""
        T = key[1]
        key = (kernel.fn.__name__, key[0], T == 1, T % 16 == 0, *key[2:])
        per_sm = self._per_sm.get(key)
        if per_sm is None:
            compiled = kernel.warmup(*args, grid=(1,), **kwargs)
            per_sm = self._per_sm[key] = resident_ctas_per_sm(compiled, self.device, cap)
        return max(1, min(units, self.sms * per_sm, MAX_PROGRAMS))

    # ------------------------------------------------------------------ misc
    def stamp(self, stamps: torch.Tensor | None, index: int, which: int) -> None:
        if stamps is not None:
            _stamp_now[(1,)](stamps, 2 * index + which)

    def close(self) -> None:
        """Leave the shared buffer (after a barrier, so no peer still writes into it); the
        last layer of a slot frees it."""
        if self.shared is None:
            return
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self.shared.release()
        self.shared = None


class SymmSharedBuffer(SharedBuffer):
    """One slot's symmetric buffer and step state (moekit.ep.lowlatency.pool), shared by the
    transports of every layer on the slot.

    ``buf``: this rank's symmetric buffer (uint8), ``peer_args``: the peers' base tensors as
    the kernels take them (P0..P7), ``state``: the epochs and tickets (``_STATE_SIZE`` int64,
    local), ``off`` / ``sizes``: each region's offset (phase 0) and phase bytes.

    :meth:`reserve` is a collective: every rank all-reduces (max) the region sizes the new
    layer needs; if they exceed the buffer's, every rank waits for its device and the
    peers, allocates the larger buffer, exchanges it (rendezvous), zeroes it, resets the
    step state and frees the old one. Captured CUDA graphs that used the old buffer are
    stale then: build the layers before capturing.
    """

    def __init__(self, key, group, device: torch.device, world_size: int):
        super().__init__(key)
        self.group, self.device, self.world_size = group, device, world_size
        self.buf = None
        self.nbytes = 0
        self.state = torch.zeros(_STATE_SIZE, dtype=torch.int64, device=device)
        self.off: dict[str, int] = {}
        self.peer_args: list = []
        self.dispatch_offsets: tuple = ()

    def reserve(self, sizes: dict[str, int]) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        names = sorted(sizes)
        want = torch.tensor([merge_sizes(self.sizes, sizes)[n] for n in names], dtype=torch.int64,
                            device=self.device)
        dist.all_reduce(want, op=dist.ReduceOp.MAX, group=self.group)  # every rank grows to the same size
        agreed = dict(zip(names, (int(v) for v in want.tolist())))
        if agreed != self.sizes:
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)  # nobody still reads or writes the old buffer
            layout = SymmOffsets.of(agreed)
            self.buf = self.peer_args = self._handle = None
            buf = symm_mem.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
            buf.zero_()
            # (torch >= 2.11 needs no enable_symm_mem_for_group first: it is deprecated there.)
            self._handle = symm_mem.rendezvous(buf, self.group.group_name)
            peers = [self._handle.get_buffer(r, (layout.nbytes,), torch.uint8) for r in range(self.world_size)]
            self.buf, self.nbytes, self.sizes, self.off = buf, layout.nbytes, agreed, layout.offsets
            self.peer_args = peers + [buf] * (MAX_PEERS - self.world_size)
            o, z = self.off, self.sizes
            self.dispatch_offsets = (o["x"], z["x"], o["s"], z["s"], o["i"], z["i"], o["t"], z["t"], o["w"], z["w"],
                                     o["st"], z["st"], o["dcnt"])
            self.state.zero_()
            self.dispatch_calls = self.combine_calls = 0
            self.after_combine = False
            self.generation += 1
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)
        self.users += 1

    def free(self) -> None:
        self.buf = self._handle = None
        self.peer_args = []
