"""Fixed-buffer dispatchers for CUDA graphs: MaxCounts and Cap-and-Spill (seed 000).

A CUDA graph replays fixed shapes, so a graph-captured dispatch cannot size its messages
from this step's counts the way :class:`~moekit.ep.AllToAllDispatcher` does. Both
dispatchers here send per-peer buffers ``[P, rows, ...]`` whose size is fixed at
construction, exchanged with ``all_to_all_single`` on equal splits:

* :class:`MaxCountsDispatcher` — one pass with ``rows = C_max``, the worst case seen in a
  trace (the seed's baseline). A step whose per-peer count exceeds C_max cannot be
  delivered: it raises :class:`CapacityOverflowError` on every rank in eager mode and sets
  ``handle.state["overflow"]`` inside a graph.
* :class:`CapAndSpillDispatcher` — pass 1 carries the first C pairs of every peer pair
  (C = a high quantile, e.g. Q99); pass 2 ("spill") carries the rest in buffers of
  ``S = max(T_max * K - C, 0)`` rows per peer, the exact bound on one pair's overflow
  (:func:`moekit.ep.capacity.spill_capacity`). Nothing can be lost. ``conditional=True``
  skips pass 2 when no rank overflowed, which costs an all-reduce and a host sync.

Wire format. Every row of a dispatch message is raw bytes: a 16-byte header (int32 local
expert or -1 for an empty row, token, slot, and the sender's largest per-peer count)
followed by the token's hidden vector. Carrying the routing in the row keeps each pass to
one collective, lets the receiver place rows without a separate count exchange, and tells
every rank every sender's largest count, so all ranks reach the same overflow decision
without another collective. Copying bytes never changes a value, so results are bitwise.

Result layout. ``Dispatched.tokens`` is ``[E_local, cap, H]`` with the fixed
``cap = P * min(pair capacity, T_max * K)`` (:func:`moekit.ep.capacity.expert_capacity`);
within an expert, rows are in the canonical (source rank, token, slot) order, so valid
rows, counts and the handle are bitwise equal to the eager dispatcher's. Combine sends the
expert outputs back along the same passes and ends with ``weighted_slot_sum``.

All steps are vectorized torch with fixed shapes (no loop over tokens or peers, no
``.item()``/``.tolist()``), so ``dispatch`` + ``combine`` can be captured in one CUDA graph
and replayed after writing new routing into the same input tensors. Inputs may carry
fewer than T_max tokens, or rows of -1 ids (masked), as a fixed-shape buffer does.

The phases are public (:meth:`plan`, :meth:`pack`, :meth:`compact`, :meth:`exchange`,
:meth:`unpack`) so a benchmark can time them one by one; :meth:`dispatch` is just their
composition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.ep.capacity import expert_capacity, spill_capacity
from moekit.ep.dispatcher import Dispatched, DispatchHandle, validate_routing, weighted_slot_sum
from moekit.ep.layout import ExpertPlacement, PlacedExperts

HEADER_BYTES = 16  # four int32 per row: local expert (-1 = empty), token, slot, sender's max count
_EXPERT, _TOKEN, _SLOT, _MAX_COUNT = range(4)


class CapacityOverflowError(RuntimeError):
    """A step routed more pairs to one peer than a MaxCounts buffer holds.

    Raised on every rank of the step alike (the decision uses numbers every rank has), so
    no rank is left waiting in a collective.
    """


@dataclass
class FixedPlan:
    """This rank's (token, slot) pairs, sorted by destination, in fixed-shape tensors.

    N = T * K pairs (flat index ``t * K + k``). Masked pairs (id -1) sort last.

    ``sorted_pair`` / ``sorted_local``: flat pair index and destination local expert, in
    send order (destination rank, local expert, token, slot). ``rank_counts[j]`` /
    ``rank_start[j]``: pairs for rank j and where they start in send order.
    ``pair_rank`` / ``pair_pos``: per pair (flat order), destination rank (P when masked)
    and position in the stream to that rank. ``max_count``: ``rank_counts.max()`` (int32).
    ``invalid``: an id was out of range (replaced by -1; only checked on the host outside
    graphs). ``num_tokens``: the caller's T (the plan may hold one extra masked row when
    T = 0, since fixed-shape gathers need a row to read).
    """

    ids: torch.Tensor
    weights: torch.Tensor
    invalid: torch.Tensor
    sorted_pair: torch.Tensor
    sorted_local: torch.Tensor
    rank_counts: torch.Tensor
    rank_start: torch.Tensor
    pair_rank: torch.Tensor
    pair_pos: torch.Tensor
    max_count: torch.Tensor
    num_tokens: int

    @property
    def top_k(self) -> int:
        return self.ids.shape[1]


def _check_sizes(capacity, max_tokens, top_k) -> None:
    for name, value, low in (("capacity", capacity, 0), ("max_tokens", max_tokens, 1), ("top_k", top_k, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s work is being recorded into a CUDA graph (no host reads allowed)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _exclusive_cumsum(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(t, dim) - t


class _FixedBufferDispatcher(PlacedExperts):
    """Shared machinery: plan, pack a range of stream positions, exchange, unpack, combine.

    Subclasses choose the first-pass rows (``capacity``) and the spill rows
    (``spill_rows``, 0 for none) and when the spill pass runs.
    """

    def __init__(self, num_experts: int, capacity: int, max_tokens: int, *, top_k: int,
                 spill_rows: int, group: dist.ProcessGroup | None = None, hidden: int | None = None):
        _check_sizes(capacity, max_tokens, top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        self.world_size = dist.get_world_size(group) if distributed else 1
        self.placement = ExpertPlacement(num_experts, self.world_size)
        self.capacity, self.spill_rows = capacity, spill_rows
        self.max_tokens, self.top_k, self.hidden = max_tokens, top_k, hidden
        # Every row a pair can reach, over both passes, fits here (see capacity.py).
        self.expert_capacity = expert_capacity(self.world_size, max_tokens, top_k, capacity + spill_rows)

    # -- phases ------------------------------------------------------------------------

    def plan(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> FixedPlan:
        """Sort this rank's pairs by (destination rank, local expert, token, slot).

        A stable argsort of the global expert id (masked pairs keyed past the last
        expert) gives that order, since experts are placed contiguously; counts come from
        ``scatter_add`` into a fixed-size histogram (``bincount`` would size its output
        from the data, which a graph cannot do).
        """
        P, E, E_local = self.world_size, self.num_experts, self.experts_per_rank
        T = topk_ids.shape[0]
        ids, weights = topk_ids.to(torch.int64), topk_weights
        if T == 0:  # one masked row keeps every gather below well defined
            ids = ids.new_full((1, self.top_k), -1)
            weights = weights.new_zeros(1, self.top_k)
        bad = (ids < -1) | (ids >= E)
        ids = torch.where(bad, torch.full_like(ids, -1), ids)
        key = torch.where(ids >= 0, ids, E).reshape(-1)
        order = torch.argsort(key, stable=True)
        per_expert = torch.zeros(E + 1, dtype=torch.int64, device=ids.device)
        per_expert.scatter_add_(0, key, torch.ones_like(key))
        rank_counts = per_expert[:E].view(P, E_local).sum(1)
        rank_start = _exclusive_cumsum(rank_counts, 0)
        sorted_key = key[order]
        sorted_rank = torch.where(sorted_key < E, torch.div(sorted_key, E_local, rounding_mode="floor"), P)
        start_or_zero = torch.cat([rank_start, rank_start.new_zeros(1)])  # masked pairs: any position
        sorted_pos = torch.arange(key.numel(), device=ids.device) - start_or_zero[sorted_rank]
        return FixedPlan(
            ids=ids, weights=weights, invalid=bad.any(),
            sorted_pair=order, sorted_local=torch.remainder(sorted_key, E_local),
            rank_counts=rank_counts, rank_start=rank_start,
            pair_rank=torch.empty_like(order).scatter_(0, order, sorted_rank),
            pair_pos=torch.empty_like(order).scatter_(0, order, sorted_pos),
            max_count=rank_counts.max().to(torch.int32), num_tokens=T,
        )

    def pack(self, x: torch.Tensor, plan: FixedPlan, first: int = 0, rows: int | None = None) -> torch.Tensor:
        """Send buffer ``[P, rows, 16 + H * itemsize]`` (bytes) for stream positions [first, first + rows).

        Row p of peer j holds the pair at position ``first + p`` of the stream to j, or an
        empty row (expert -1) past the end of it. A gather: each buffer row looks up its
        pair, so the work is proportional to the buffer, with no scatter collisions.
        """
        rows = self.capacity if rows is None else rows
        P, K = self.world_size, plan.top_k
        position = torch.arange(first, first + rows, device=x.device)
        filled = position.unsqueeze(0) < plan.rank_counts.unsqueeze(1)  # [P, rows]
        in_order = (plan.rank_start.unsqueeze(1) + position.unsqueeze(0)).clamp(max=plan.sorted_pair.numel() - 1)
        pair = plan.sorted_pair[in_order]
        token = torch.div(pair, K, rounding_mode="floor")
        fields = [plan.sorted_local[in_order], token, pair % K]
        header = torch.stack([torch.where(filled, f, -1) for f in fields]
                             + [plan.max_count.expand(P, rows).to(torch.int64)], dim=-1).to(torch.int32)
        payload = _row_bytes(x).index_select(0, token.reshape(-1))
        row = torch.cat([header.view(torch.uint8).reshape(P * rows, HEADER_BYTES), payload], 1)
        return row.view(P, rows, HEADER_BYTES + payload.shape[1])

    def compact(self, x: torch.Tensor, plan: FixedPlan) -> torch.Tensor:
        """The spill buffer ``[P, S, ...]``: every pair past the first C of its peer pair."""
        return self.pack(x, plan, self.capacity, self.spill_rows)

    def exchange(self, buf: torch.Tensor) -> torch.Tensor:
        """``all_to_all_single`` of a ``[P, rows, ...]`` buffer: slice j goes to rank j."""
        out = torch.empty_like(buf)
        if self.world_size == 1 or buf.numel() == 0:  # nothing to send: every rank knows it statically
            return out.copy_(buf)
        dist.all_to_all_single(out, buf, group=self.group)
        return out

    def unpack(self, plan: FixedPlan, received: list[torch.Tensor], x: torch.Tensor) -> Dispatched:
        """Merge the received passes into the expert-major result, in canonical row order.

        ``received[0]`` holds stream positions [0, C) from every source, ``received[1]``
        (if the spill pass ran) positions [C, C + S). A source's rows arrive sorted by
        (local expert, token, slot), so a row's place inside its expert is: rows of that
        expert from earlier sources + its position in the source's stream - where the
        expert's rows start in that stream. Rows are scattered there (empty rows into a
        spare row past the end), which keeps the work proportional to what was received.
        """
        P, E_local, cap = self.world_size, self.experts_per_rank, self.expert_capacity
        H, dtype, device = x.shape[1], x.dtype, x.device
        header = torch.cat([r[..., :HEADER_BYTES].contiguous().view(torch.int32) for r in received], 1).long()
        rows = header.shape[1]  # C, or C + S with the spill pass
        expert = header[..., _EXPERT]
        valid = expert >= 0
        source = torch.arange(P, device=device).unsqueeze(1).expand(P, rows)
        # rows per (source, expert); empty rows counted in a spare column E_local
        key = source * (E_local + 1) + torch.where(valid, expert, E_local)
        per_source = torch.zeros(P * (E_local + 1), dtype=torch.int64, device=device)
        per_source = per_source.scatter_add_(0, key.reshape(-1), torch.ones_like(key).reshape(-1))
        per_source = per_source.view(P, E_local + 1)[:, :E_local]
        e = expert.clamp(min=0)
        from_earlier_sources = _exclusive_cumsum(per_source, 0).gather(1, e)
        expert_start_in_stream = _exclusive_cumsum(per_source, 1).gather(1, e)
        position = from_earlier_sources + torch.arange(rows, device=device) - expert_start_in_stream
        spare = E_local * cap
        dest = torch.where(valid, e * cap + position, spare)  # [P, rows]

        tokens = torch.zeros(spare + 1, H, dtype=dtype, device=device)
        first = 0
        for r in received:  # one or two passes: a static loop
            n = r.shape[1]
            payload = r[..., HEADER_BYTES:].view(dtype).reshape(P * n, H)
            tokens.index_copy_(0, dest[:, first:first + n].reshape(-1), payload)
            first += n
        handle = torch.full((3, spare + 1), -1, dtype=torch.int64, device=device)
        origin = torch.stack([source, header[..., _TOKEN], header[..., _SLOT]]).reshape(3, -1)
        handle.index_copy_(1, dest.reshape(-1), origin)

        largest = self._largest_count(plan, header)
        src_rank, src_token, src_slot = handle[:, :spare].reshape(3, E_local, cap)
        state = dict(plan=plan, dest=dest, pass_rows=[r.shape[1] for r in received],
                     largest_count=largest, overflow=largest > rows, invalid_ids=plan.invalid)
        return Dispatched(tokens[:spare].view(E_local, cap, H), per_source.sum(0),
                          DispatchHandle(src_rank, src_token, src_slot, state))

    def _largest_count(self, plan: FixedPlan, header: torch.Tensor) -> torch.Tensor:
        """The largest per-peer count of any rank this step (every row carries its sender's).

        Every rank receives at least one row from every sender whenever a pass has rows,
        so every rank computes the same number; with no rows at all (C = 0 and no spill)
        only this rank's own count is known.
        """
        mine = plan.max_count.to(torch.int64)
        if header.numel() == 0:
            return mine
        return torch.maximum(mine, header[..., _MAX_COUNT].max())

    # -- dispatch / combine -------------------------------------------------------------

    def _validate(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        # Outside a graph the id range is checked on the host (one sync, as every
        # dispatcher does); inside one it cannot be: plan() masks bad ids and flags them.
        validate_routing(x, topk_ids, topk_weights, self.num_experts, hidden=self.hidden, top_k=self.top_k,
                         max_tokens=self.max_tokens, check_ids=not _capturing(x))

    def _run_passes(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    spill: bool) -> Dispatched:
        x = x.contiguous()
        plan = self.plan(topk_ids, topk_weights)
        if x.shape[0] == 0:
            x = x.new_zeros(1, x.shape[1])
        received = [self.exchange(self.pack(x, plan))]
        if spill and self.spill_rows > 0:
            received.append(self.exchange(self.compact(x, plan)))
        return self.unpack(plan, received, x)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Send expert outputs back along the dispatch's passes; ``y[T, H]`` via ``weighted_slot_sum``.

        ``expert_out`` is ``[E_local, cap, H]`` like ``dispatched.tokens``; its rows past
        ``counts`` are never read into the result (they may hold anything, NaN included).
        """
        state = dispatched.handle.state
        E_local, cap = self.experts_per_rank, self.expert_capacity
        if expert_out.dim() != 3 or tuple(expert_out.shape[:2]) != (E_local, cap):
            raise ValueError(f"expert_out must be [E_local, capacity, H] = [{E_local}, {cap}, H], "
                             f"got {tuple(expert_out.shape)}")
        plan: FixedPlan = state["plan"]
        P, H = self.world_size, expert_out.shape[2]
        flat = expert_out.reshape(E_local * cap, H)
        slot_out = expert_out.new_zeros(plan.ids.numel(), H)
        first = 0
        for rows in state["pass_rows"]:
            if rows:
                # Empty rows point at the spare row past the end: send any real row
                # instead, its owner never reads it.
                dest = state["dest"][:, first:first + rows].clamp(max=E_local * cap - 1)
                returned = self.exchange(flat.index_select(0, dest.reshape(-1)).view(P, rows, H))
                slot_out = self._take_returned(slot_out, returned, plan, first)
            first += rows
        T, K = plan.ids.shape
        y = weighted_slot_sum(slot_out.view(T, K, H), plan.ids, plan.weights, expert_out.dtype)
        return y[:plan.num_tokens]

    @staticmethod
    def _take_returned(slot_out: torch.Tensor, returned: torch.Tensor, plan: FixedPlan, first: int) -> torch.Tensor:
        """Put each pair's returned row (if this pass carried it) in its (token, slot) place."""
        P, rows, H = returned.shape
        in_pass = (plan.pair_rank < P) & (plan.pair_pos >= first) & (plan.pair_pos < first + rows)
        index = plan.pair_rank.clamp(max=P - 1) * rows + (plan.pair_pos - first).clamp(0, rows - 1)
        return torch.where(in_pass.unsqueeze(1), returned.reshape(P * rows, H).index_select(0, index), slot_out)


class MaxCountsDispatcher(_FixedBufferDispatcher):
    """One all-to-all of per-peer buffers ``[P, C_max, H]``: the CUDA-graph baseline.

    ``capacity`` = C_max >= 1 (e.g. :func:`moekit.ep.capacity.max_counts_capacity` of a
    trace), ``max_tokens`` = T_max. Result capacity: ``P * min(C_max, T_max * K)`` rows per
    expert.

    Overflow (a per-peer count above C_max) is never silent: ``handle.state["overflow"]``
    (a bool tensor, the same on every rank) is set, and, outside a CUDA graph with
    ``raise_on_overflow`` (the default), every rank raises :class:`CapacityOverflowError`
    after the exchange. Inside a graph, check the flag after each replay; the combine of
    an overflowed step leaves the undelivered slots out.
    """

    def __init__(self, num_experts: int, capacity: int, max_tokens: int, *, top_k: int,
                 group: dist.ProcessGroup | None = None, hidden: int | None = None,
                 raise_on_overflow: bool = True):
        if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity < 1:
            # Rows carry every sender's count to every rank; with none, ranks could not agree.
            raise ValueError(f"capacity (C_max) must be an int >= 1, got {capacity}")
        super().__init__(num_experts, capacity, max_tokens, top_k=top_k, spill_rows=0, group=group, hidden=hidden)
        self.raise_on_overflow = raise_on_overflow

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        self._validate(x, topk_ids, topk_weights)
        dispatched = self._run_passes(x, topk_ids, topk_weights, spill=False)
        if self.raise_on_overflow and not _capturing(x):
            self._raise_if_overflow(dispatched)
        return dispatched

    def _raise_if_overflow(self, dispatched: Dispatched) -> None:
        state = dispatched.handle.state
        if bool(state["overflow"]):  # a host sync: eager mode only
            raise CapacityOverflowError(
                f"MaxCounts overflow: a rank routed {int(state['largest_count'])} (token, slot) pairs to one "
                f"peer, more than capacity C_max={self.capacity}; the step was not delivered (every rank "
                "raises this). Recalibrate C_max, or use CapAndSpillDispatcher, which spills instead")


class CapAndSpillDispatcher(_FixedBufferDispatcher):
    """Two fixed-size passes: the first C pairs of each peer pair, then the spill.

    ``capacity`` = C >= 0 (e.g. :func:`moekit.ep.capacity.calibrate_capacity` at q = 0.99),
    ``max_tokens`` = T_max. The spill pass sends ``[P, S, H]`` with
    ``S = max(T_max * K - C, 0)`` (:attr:`spill_rows`), the exact bound on one pair's
    overflow, so every routing is delivered. Result capacity: ``P * T_max * K`` rows per
    expert.

    ``conditional=False`` (default) always runs the spill pass: no host sync, one CUDA
    graph. ``conditional=True`` first all-reduces an "any pair over C" flag and reads it
    on the host, then skips the spill pass when nothing overflowed. In a graph setting,
    capture ``spill_flag`` on its own and ``dispatch(..., spill=True/False)`` + combine as
    two graphs, and replay the one the flag picks (see ``moekit.bench.capspill``).
    """

    def __init__(self, num_experts: int, capacity: int, max_tokens: int, *, top_k: int,
                 conditional: bool = False, group: dist.ProcessGroup | None = None, hidden: int | None = None):
        _check_sizes(capacity, max_tokens, top_k)
        spill_rows = spill_capacity(max_tokens, top_k, capacity)
        super().__init__(num_experts, capacity, max_tokens, top_k=top_k, spill_rows=spill_rows,
                         group=group, hidden=hidden)
        self.conditional = conditional

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 spill: bool | None = None) -> Dispatched:
        """Dispatch; ``spill`` overrides the mode's choice of running the spill pass.

        ``spill=None``: unconditional mode runs it, conditional mode asks every rank (an
        all-reduce and a host sync). ``spill=False`` is for capturing the conditional
        mode's no-spill graph: use it only when :meth:`spill_flag` said no rank
        overflows; otherwise ``handle.state["overflow"]`` reports the rows left behind.
        """
        self._validate(x, topk_ids, topk_weights)
        if spill is None:
            spill = True if not self.conditional else bool(self.spill_flag(topk_ids))
        return self._run_passes(x, topk_ids, topk_weights, spill=spill)

    def spill_flag(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """1 (int32, shape [1]) on every rank when any rank has a per-peer count over C, else 0.

        A histogram of this rank's destination ranks, then an all-reduce (MAX): no host
        read, so it can be captured as its own graph; reading it is the sync the
        conditional mode pays.
        """
        P, E = self.world_size, self.num_experts
        ids = topk_ids.to(torch.int64).reshape(-1)
        routed = (ids >= 0) & (ids < E)
        dest = torch.where(routed, torch.div(ids, self.experts_per_rank, rounding_mode="floor"), P)
        counts = torch.zeros(P + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, dest, torch.ones_like(dest))
        flag = (counts[:P] > self.capacity).any().to(torch.int32).reshape(1)
        if self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag


def _row_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x[T, H]`` as raw bytes ``[T, H * itemsize]`` (a view), so rows travel bit for bit."""
    return x.contiguous().view(torch.uint8)
