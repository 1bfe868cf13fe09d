"""The low-latency layer's layout: what crosses the wire, what the receiver holds, and how
the receiver turns it into the expert-major result (pure torch, shared by every transport).

Dedup by destination rank. Token t of source rank s crosses to rank d *once* if any of its
K experts lives on d (contiguous placement, ``E_local = E / world``), into row (s, t) of d's
rank-level receive buffer (:class:`RecvBuffers`). The receiver then fans the row out to
each of its experts the token names (:func:`fan_out`): the fan-out runs at HBM speed
(> 10x NVLink), so sending one copy per rank instead of one per expert saves wire bytes
whenever a token names two experts of one rank.

Row order. Rows of local expert e are ordered by (source rank, token), the canonical order
of the eager dispatcher, so with distinct experts per token the valid rows equal
:class:`~moekit.ep.AllToAllDispatcher`'s. A token that names one expert in several slots
gets ONE row for that expert; ``slot_bits`` records every slot it serves and combine sends
the expert's output to all of them (this keeps ``world * max_m`` rows per expert an exact
bound).

Combine orders. ``combine_order="slot"`` sends each expert output row back to every slot it
serves (``[max_m, K, H]`` slot rows on the token's rank); ``combine_order="rank"`` sums a
token's slots on the expert's rank first (:func:`rank_partials`, float32 in slot order, one
rounding) and sends one row per (token, rank) (:func:`rank_reduce` adds them on the token's
rank in rank order): bitwise :func:`moekit.ep.dispatcher.weighted_rank_sum`. The expert rank
then needs the routing weights, which travel with the routing rows (``RecvBuffers.weights``).

Capacity-bounded receive buffers (``recv_capacity`` C). The rank-level receive buffer holds
``max_m`` rows per source in the worst case: a source may send all its tokens to one rank.
Most steps send far fewer (with P ranks a token reaches about ``P * (1 - C(E - E/P, K) / C(E, K))``
of them), so the buffer can hold C rows per source instead, C a quantile of the
per-(source, destination rank) token counts of a trace
(:func:`moekit.ep.capacity.calibrate_capacity` with ``count="tokens"``). Row j of source s's
region is then the j-th token of s that goes to this rank (:func:`window_tokens`); the
tokens past C travel in spill rounds of ``spill_rows`` S rows per source, each fanned out
before the next arrives, so nothing is lost and the expert-major result is the same, bit
for bit. How many spill rounds a step needs follows from the routing rows, which every
rank receives whole (:func:`spill_rounds`), so every rank agrees on it without a
collective; it is counted on the device. What does not shrink is the expert-major result:
one expert may receive every token of every rank in one step, so ``world * max_m`` rows
per expert is the least a lossless, fixed-shape result can hold.

Everything here has fixed shapes and no host reads, so it can be captured in a CUDA graph;
there are no Python loops over tokens or peers. Padding rows of the fanned-out tokens are
left unspecified (not zeroed): zeroing ``E_local * world * max_m`` rows would cost more
than the whole exchange at deepseek-v3 sizes. Use ``counts`` to find the valid rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.ep.checks import check_int
from moekit.ep.dispatcher import check_combine_order, weighted_slot_sum
from moekit.ep.rank_order import compact_width, partial_rows, sum_partials

FP8_DTYPE = torch.float8_e4m3fn
MAX_TOPK = 32  # slot_bits is an int32 bit mask
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class LowLatencyLayout:
    """Sizes of one low-latency layer; every buffer shape follows from these.

    ``max_m``: most tokens a rank may dispatch per call; ``group_size``: FP8 scale group
    (columns per float32 scale); ``dtype``: the activations' dtype (input of dispatch,
    expert output, result of combine); ``online_fp8``: tokens cross the wire as e4m3 with
    per-group scales, else in ``dtype``. ``combine_order``: ``"slot"`` or ``"rank"`` (module
    docstring). ``recv_capacity``: rows per source in the receive buffer (None: ``max_m``,
    the worst case); ``spill_rows``: rows per source of one spill round when
    ``recv_capacity < max_m`` (None: ``ceil(recv_capacity / 4)``).
    """

    max_m: int
    hidden: int
    topk: int
    num_experts: int
    rank: int
    world_size: int
    local_world_size: int
    group_size: int = 128
    dtype: torch.dtype = torch.bfloat16
    online_fp8: bool = True
    combine_order: str = "slot"
    recv_capacity: int | None = None
    spill_rows: int | None = None

    def __post_init__(self) -> None:
        check_int("max_m", self.max_m, 1)
        check_int("hidden", self.hidden, 1)
        check_int("topk", self.topk, 1, MAX_TOPK)
        check_int("world_size", self.world_size, 1)
        check_int("rank", self.rank, 0, self.world_size - 1)
        check_int("local_world_size", self.local_world_size, 1, self.world_size)
        if self.world_size % self.local_world_size:
            raise ValueError(f"local_world_size={self.local_world_size} must divide world_size={self.world_size}")
        check_int("num_experts", self.num_experts, 1)
        if self.num_experts % self.world_size:
            raise ValueError(f"num_experts={self.num_experts} must be a multiple of world_size={self.world_size}")
        check_int("group_size", self.group_size, 1)
        if self.online_fp8 and self.hidden % self.group_size:
            raise ValueError(f"hidden={self.hidden} must be a multiple of group_size={self.group_size} "
                             "(one FP8 scale per group of columns)")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, got {self.dtype}")
        if not isinstance(self.online_fp8, bool):
            raise ValueError(f"online_fp8 must be a bool, got {self.online_fp8!r}")
        check_combine_order(self.combine_order)
        if self.recv_capacity is not None:
            check_int("recv_capacity", self.recv_capacity, 1, self.max_m)
        if self.spill_rows is not None:
            if self.recv_capacity is None:
                raise ValueError("spill_rows needs recv_capacity (without it every source has max_m rows and "
                                 "nothing spills)")
            check_int("spill_rows", self.spill_rows, 1, self.max_m)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def capacity(self) -> int:
        """Rows per local expert: every token of every source, once (the exact bound)."""
        return self.world_size * self.max_m

    @property
    def num_groups(self) -> int:
        return self.hidden // self.group_size

    @property
    def first_expert(self) -> int:
        """Global id of this rank's local expert 0."""
        return self.rank * self.experts_per_rank

    @property
    def wire_dtype(self) -> torch.dtype:
        """dtype of the tokens in the receive buffers."""
        return FP8_DTYPE if self.online_fp8 else self.dtype

    @property
    def token_bytes(self) -> int:
        """Bytes of one token on the wire in dispatch (payload + scales)."""
        if self.online_fp8:
            return self.hidden + 4 * self.num_groups
        return self.hidden * self.dtype.itemsize

    @property
    def combine_row_bytes(self) -> int:
        """Bytes of one expert output row on the wire in combine."""
        return self.hidden * self.dtype.itemsize

    # -- capacity-bounded receive buffers --------------------------------------------------

    @property
    def recv_rows(self) -> int:
        """Rows per source in the receive buffer: ``recv_capacity``, or ``max_m``."""
        return self.max_m if self.recv_capacity is None else self.recv_capacity

    @property
    def bounded(self) -> bool:
        """Whether tokens past ``recv_rows`` of a source travel in spill rounds."""
        return self.recv_rows < self.max_m

    @property
    def spill_rows_per_round(self) -> int:
        """Rows per source of one spill round (0 when nothing can spill)."""
        if not self.bounded:
            return 0
        return self.spill_rows if self.spill_rows is not None else -(-self.recv_rows // 4)

    @property
    def max_spill_rounds(self) -> int:
        """Spill rounds of the worst step: a source sending all ``max_m`` tokens to one rank."""
        if not self.bounded:
            return 0
        return -(-(self.max_m - self.recv_rows) // self.spill_rows_per_round)

    @property
    def combine_columns(self) -> int:
        """Rows per token of the combine receive region: one per slot (K), or one per rank
        holding its experts (``min(K, world)``) in the rank order."""
        return self.topk if self.combine_order == "slot" else compact_width(self.topk, self.world_size)

    def receive_region_bytes(self) -> dict[str, int]:
        """Bytes of one phase of what the peers write into on this rank (symmetric memory on
        GPUs; the gloo transport's receive messages hold the same segments), by segment."""
        W, M, K, H = self.world_size, self.max_m, self.topk, self.hidden
        wire = self.wire_dtype.itemsize
        scales = 4 * self.num_groups if self.online_fp8 else 0
        rows, spill = self.recv_rows, self.spill_rows_per_round
        return {
            "tokens": W * rows * H * wire, "scales": W * rows * scales,
            "spill_tokens": W * spill * H * wire, "spill_scales": W * spill * scales,
            "routing": W * M * K * 4, "weights": W * M * K * 4 if self.combine_order == "rank" else 0,
            "counts": W * 4,
            "combine": M * self.combine_columns * H * self.dtype.itemsize,
        }

    def buffer_bytes(self) -> dict[str, int]:
        """Memory of one layer on one rank, by part: the double-buffered receive regions
        (``receive``: dispatch, ``combine``), the expert-major result of a dispatch
        (``result``: tokens, scales and meta) and the expert output it implies (``expert_out``,
        allocated by the caller), and their ``total``."""
        region = self.receive_region_bytes()
        E_loc, cap, W, M, K, H = (self.experts_per_rank, self.capacity, self.world_size, self.max_m, self.topk,
                                  self.hidden)
        scales = 4 * self.num_groups if self.online_fp8 else 0
        # meta: src_rank, src_token, src_slot, slot_bits (int32) and row_index (int64) per row;
        # slot_row (int64) per received slot; counts, layout_range, num_tokens
        meta = E_loc * cap * (4 * 4 + 8) + W * M * K * 8 + E_loc * 4 + E_loc * W * 2 * 4 + W * 4
        out = {
            "receive": 2 * (sum(region.values()) - region["combine"]),
            "combine": 2 * region["combine"],
            "result": E_loc * cap * (H * self.wire_dtype.itemsize + scales) + meta,
            "expert_out": E_loc * cap * H * self.dtype.itemsize,
        }
        out["total"] = sum(out.values())
        return out


@dataclass
class RecvBuffers:
    """What one dispatch step delivered to this rank, indexed by (source rank s, token t).

    ``x [world, max_m, H]``: ``layout.wire_dtype``; ``scales [world, max_m, H/group]``
    float32 (None unless online_fp8); ``ids [world, max_m, K]`` int32, source s's topk_ids row
    of its token t (global ids, -1 masked; rows t >= num_tokens[s] unspecified);
    ``num_tokens [world]`` int32. Row (s, t) of ``x`` is valid iff t < num_tokens[s] and
    ids[s, t] names an expert of this rank; other rows are unspecified. These are views of
    the current phase's buffers, valid until that phase is reused (two dispatches later).
    ``status [world, STATUS_WORDS]`` int64: every source's step status
    (:mod:`moekit.ep.agreement`), from a transport that carries it, else None.
    ``weights [world, max_m, K]`` float32: the sources' routing weights (``combine_order="rank"``
    only, else None). With a bounded layout (``layout.bounded``) ``x`` and ``scales`` are
    ``[world, recv_rows, ...]``: row (s, j) holds the j-th token source s sent here
    (:func:`window_tokens`); ``overflow [world]`` int64 counts the tokens of each source past
    them, which came in ``spill_rounds`` further rounds (None and 0 otherwise).
    """

    x: torch.Tensor
    scales: torch.Tensor | None
    ids: torch.Tensor
    num_tokens: torch.Tensor
    status: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    overflow: torch.Tensor | None = None
    spill_rounds: int = 0


@dataclass
class LowLatencyMeta:
    """Everything combine needs, built by :func:`postprocess` on the receiver.

    Per local expert e and row r (``[E_local, capacity]``, -1 on padding rows):
    ``src_rank``, ``src_token`` int32 (where the row came from), ``src_slot`` int32 (the first
    slot of that token naming e), ``slot_bits`` int32 (bit k set iff slot k names e: a token
    naming e twice has one row whose output goes to both slots), ``row_index`` int64
    (``src_rank * max_m + src_token``, the row of the receive buffers).
    ``counts [E_local]`` int32 valid rows; ``layout_range [E_local, world, 2]`` int32
    (count, start) of each source's rows inside expert e; ``num_tokens [world]`` int32.
    ``slot_row [world, max_m, K]`` int64: for each slot of each received token, the flat row
    ``e * capacity + r`` of the expert-major tensors that serves it, -1 if the slot names no
    expert of this rank (the inverse map, so fan-out and combine touch only valid rows).
    ``recv``: the :class:`RecvBuffers` this came from. ``num_dispatched``: this rank's T of
    the dispatch, a host int the layer sets (combine checks its routing against it).
    """

    counts: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_slot: torch.Tensor
    slot_bits: torch.Tensor
    layout_range: torch.Tensor
    row_index: torch.Tensor
    num_tokens: torch.Tensor
    slot_row: torch.Tensor
    recv: RecvBuffers
    num_dispatched: int | None = None


def destinations(topk_ids: torch.Tensor, layout: LowLatencyLayout) -> torch.Tensor:
    """``[T, world]`` bool: token t must cross to rank d (one of its valid ids lives on d).

    Ids outside [0, E) (masked -1 or invalid) send nothing.
    """
    ids = topk_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < layout.num_experts)
    owner = torch.where(valid, torch.div(ids, layout.experts_per_rank, rounding_mode="floor"), layout.world_size)
    hit = torch.zeros(ids.shape[0], layout.world_size + 1, dtype=torch.bool, device=ids.device)
    hit.scatter_(1, owner, True)
    return hit[:, : layout.world_size]


def postprocess(recv: RecvBuffers, layout: LowLatencyLayout) -> LowLatencyMeta:
    """Expert-major bookkeeping from the received routing (no host reads, fixed shapes).

    One "cell" per (source, token, local expert): scatter-add each slot's bit into its cell
    (distinct slots give distinct bits, so the sum is the OR), then number the occupied
    cells of each expert in (source, token) order with a cumsum.
    """
    P, M, K = layout.world_size, layout.max_m, layout.topk
    E_loc, cap = layout.experts_per_rank, layout.capacity
    device = recv.ids.device
    ids = recv.ids.to(torch.int64).view(P, M, K)
    live = torch.arange(M, device=device).unsqueeze(0) < recv.num_tokens.to(torch.int64).unsqueeze(1)  # [P, M]
    local = ids - layout.first_expert
    mine = live.unsqueeze(2) & (local >= 0) & (local < E_loc)  # [P, M, K]
    local = local.clamp(0, E_loc - 1)
    num_cells = P * M * E_loc  # plus one spare cell that collects the slots that are not ours
    token_row = torch.arange(P * M, device=device).view(P, M, 1)
    cell = torch.where(mine, token_row * E_loc + local, num_cells).view(-1)
    k = torch.arange(K, device=device).expand(P, M, K).reshape(-1)
    bits = torch.zeros(num_cells + 1, dtype=torch.int64, device=device).scatter_add_(0, cell, 1 << k)
    first = torch.full((num_cells + 1,), K, dtype=torch.int64, device=device)
    first = first.scatter_reduce_(0, cell, k, reduce="amin")
    bits, first = bits[:num_cells].view(P * M, E_loc), first[:num_cells].view(P * M, E_loc)

    present = (bits != 0).to(torch.int64)  # [P*M, E_loc]
    pos = torch.cumsum(present, 0) - present  # rows of the same expert before this cell
    counts = present.sum(0)
    per_source = present.view(P, M, E_loc).sum(1)  # [P, E_loc]
    start = torch.cumsum(per_source, 0) - per_source
    layout_range = torch.stack([per_source, start], -1).transpose(0, 1).to(torch.int32).contiguous()

    spare = E_loc * cap
    flat_row = torch.arange(E_loc, device=device) * cap + pos  # [P*M, E_loc]
    dest = torch.where(present.bool(), flat_row, spare).view(-1)
    # Slots with bit 31 (K = 32) wrap to a negative int32 on purpose: the bit pattern is what counts.
    bits32 = torch.where(bits >= 2**31, bits - 2**32, bits)
    values = torch.stack([token_row.view(-1, 1).expand(P * M, E_loc), bits32, first]).view(3, -1)
    table = torch.full((3, spare + 1), -1, dtype=torch.int64, device=device)
    table.index_copy_(1, dest, values)  # the spare column collects the empty cells, then is dropped
    row_index, slot_bits, src_slot = table[:, :spare].view(3, E_loc, cap).unbind(0)
    valid = row_index >= 0
    src_rank = torch.where(valid, torch.div(row_index, M, rounding_mode="floor"), -1)
    src_token = torch.where(valid, row_index % M, -1)

    slot_row = flat_row.view(P, M, E_loc).gather(2, local)
    slot_row = torch.where(mine, slot_row, -1)
    return LowLatencyMeta(
        counts=counts.to(torch.int32), src_rank=src_rank.to(torch.int32), src_token=src_token.to(torch.int32),
        src_slot=src_slot.to(torch.int32), slot_bits=slot_bits.to(torch.int32), layout_range=layout_range,
        row_index=row_index, num_tokens=recv.num_tokens, slot_row=slot_row, recv=recv,
    )


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as a same-size integer dtype: copies of it move bits exactly (and
    every indexing op supports integers, which is not true of float8 on every device)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def fan_out(recv: RecvBuffers, meta: LowLatencyMeta, layout: LowLatencyLayout
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Received rows -> ``tokens [E_local, capacity, H]`` (+ ``scales [E_local, capacity, G]``).

    Each received token is written to the row of every local expert it names, using
    ``slot_row`` (the work is proportional to the received slots, not to the mostly empty
    ``E_local x capacity`` table). A token naming one expert twice writes the same bytes to
    the same row twice, which is harmless. Padding rows are unspecified.
    """
    P, M, K = layout.world_size, layout.max_m, layout.topk
    spare = layout.experts_per_rank * layout.capacity
    dest = torch.where(meta.slot_row >= 0, meta.slot_row, spare).view(P * M, K)

    def scatter(src: torch.Tensor) -> torch.Tensor:
        rows = bits_view(src).reshape(P * M, 1, src.shape[-1])
        out = rows.new_empty(spare + 1, src.shape[-1])
        out[dest] = rows.expand(P * M, K, src.shape[-1])
        return out[:spare].view(layout.experts_per_rank, layout.capacity, src.shape[-1]).view(src.dtype)

    tokens = scatter(recv.x)
    scales = scatter(recv.scales) if recv.scales is not None else None
    return tokens, scales


def gather_slot_outputs(expert_out: torch.Tensor, meta: LowLatencyMeta, layout: LowLatencyLayout) -> torch.Tensor:
    """``[world, max_m, K, H]``: for each received token's slot, the expert output row that
    serves it (slots that name no local expert hold unspecified values).

    This is the combine message of a transport that sends slot rows back to their source.
    """
    P, M, K, H = layout.world_size, layout.max_m, layout.topk, layout.hidden
    flat = expert_out.reshape(-1, H)
    return flat.index_select(0, meta.slot_row.clamp(min=0).view(-1)).view(P, M, K, H)


def topk_reduce(slot_rows: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, H]`` from this rank's slot rows ``[max_m, K, H]``: exactly ``weighted_slot_sum``
    on the first T rows (the slot accumulation order of docs/architecture.md; masked slots skipped)."""
    return weighted_slot_sum(slot_rows[: topk_ids.shape[0]], topk_ids, topk_weights, out_dtype)


# -- combine_order="rank" -------------------------------------------------------------------


def rank_partials(expert_out: torch.Tensor, meta: LowLatencyMeta, layout: LowLatencyLayout) -> torch.Tensor:
    """``[world, max_m, H]``: row (s, t) is the partial of source s's token t on this rank —
    its slots served here, weighted (``meta.recv.weights``), summed in float32 in slot order,
    rounded once to ``layout.dtype``. Tokens with no slot here hold zeros (never read)."""
    P, M, K, H = layout.world_size, layout.max_m, layout.topk, layout.hidden
    rows = expert_out.reshape(-1, H).index_select(0, meta.slot_row.clamp(min=0).view(-1)).view(P * M, K, H)
    present = (meta.slot_row >= 0).view(P * M, K)
    return partial_rows(rows, meta.recv.weights.reshape(P * M, K), present, layout.dtype).view(P, M, H)


def rank_reduce(rank_rows: torch.Tensor, topk_ids: torch.Tensor, layout: LowLatencyLayout,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, H]`` from ``rank_rows [max_m, world, H]`` (row (t, d): rank d's partial of this
    rank's token t): the partials of the ranks holding the token's experts, added in float32
    in rank order (the rank half of :func:`moekit.ep.dispatcher.weighted_rank_sum`)."""
    T = topk_ids.shape[0]
    hit = destinations(topk_ids, layout)  # [T, world]
    return sum_partials(rank_rows[:T], hit, out_dtype)


# -- capacity-bounded receive buffers ---------------------------------------------------------


def stream_positions(needed: torch.Tensor) -> torch.Tensor:
    """``[T, N]`` int64: for each column n, the position of token t among the tokens with
    ``needed[:, n]`` (an exclusive cumsum down the tokens)."""
    as_int = needed.to(torch.int64)
    return torch.cumsum(as_int, 0) - as_int


def window_tokens(needed: torch.Tensor, first: int, rows: int) -> torch.Tensor:
    """``[N, rows]`` int64: the token at stream position ``first + i`` of column n (the
    tokens t with ``needed[t, n]``, in token order), -1 past the end of the stream.

    On the sender, ``needed [T, world]`` is :func:`destinations` and column d the stream to
    rank d; on the receiver, column s is what source s sent here. A scatter into a table
    with a spare column for the tokens outside the window: fixed shapes, no host read.
    """
    T, N = needed.shape
    pos = stream_positions(needed)
    inside = needed & (pos >= first) & (pos < first + rows)
    column = torch.where(inside, pos - first, rows).t()  # [N, T]
    token = torch.arange(T, device=needed.device).unsqueeze(0).expand(N, T)
    table = torch.full((N, rows + 1), -1, dtype=torch.int64, device=needed.device)
    table.scatter_(1, column, torch.where(inside.t(), token, -1))  # the spare column takes the rest
    return table[:, :rows]


def received_streams(recv: RecvBuffers, layout: LowLatencyLayout) -> torch.Tensor:
    """``[max_m, world]`` bool: source s's token t came to this rank (t < its T and one of
    its ids lives here): the receiver's view of the streams, from the routing rows alone."""
    P, M = layout.world_size, layout.max_m
    hit = destinations(recv.ids.reshape(P * M, layout.topk), layout).view(P, M, P)[:, :, layout.rank]
    live = torch.arange(M, device=hit.device).unsqueeze(0) < recv.num_tokens.to(torch.int64).unsqueeze(1)
    return (hit & live).t()


def stream_counts(recv: RecvBuffers, layout: LowLatencyLayout) -> torch.Tensor:
    """``[world, world]`` int64: tokens source s sends rank d this step (every rank computes
    the same matrix: the routing rows of every source reach every rank)."""
    P, M = layout.world_size, layout.max_m
    hit = destinations(recv.ids.reshape(P * M, layout.topk), layout).view(P, M, P)
    live = torch.arange(M, device=hit.device).unsqueeze(0) < recv.num_tokens.to(torch.int64).unsqueeze(1)
    return (hit & live.unsqueeze(2)).sum(1)


def spill_rounds(counts: torch.Tensor, layout: LowLatencyLayout) -> torch.Tensor:
    """0-d int64: spill rounds this step needs, ``ceil(max(count - C, 0) / S)`` over every
    (source, destination) pair, on the counts' device (the same on every rank)."""
    if not layout.bounded:
        return counts.new_zeros(())
    over = (counts.max() - layout.recv_rows).clamp(min=0)
    S = layout.spill_rows_per_round
    return torch.div(over + S - 1, S, rounding_mode="floor")


def fan_out_window(out: torch.Tensor, rows: torch.Tensor, table: torch.Tensor, meta: LowLatencyMeta,
                   layout: LowLatencyLayout) -> None:
    """Write a window of received rows into the expert-major ``out`` (``[E_local * capacity + 1, X]``
    integer view, the last row a spare): row (s, i) of ``rows [world, n, X]`` is token
    ``table[s, i]`` of source s and goes to every local expert row serving one of its slots."""
    P, n, X = rows.shape
    K = layout.topk
    spare = out.shape[0] - 1
    token = table.clamp(min=0)
    slot_row = meta.slot_row.gather(1, token.unsqueeze(2).expand(P, n, K))  # [P, n, K]
    dest = torch.where((table >= 0).unsqueeze(2) & (slot_row >= 0), slot_row, spare).view(P * n, K)
    out[dest] = rows.reshape(P * n, 1, X).expand(P * n, K, X)
