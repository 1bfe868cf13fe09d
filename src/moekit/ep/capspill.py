"""Fixed-buffer dispatchers for CUDA graphs: MaxCounts and Cap-and-Spill.

A CUDA graph replays fixed shapes, so a graph-captured dispatch cannot size its messages
from this step's counts the way :class:`~moekit.ep.AllToAllDispatcher` does. Both
dispatchers here send per-peer buffers ``[P, rows, ...]`` whose size is fixed at
construction, exchanged with ``all_to_all_single`` on equal splits:

* :class:`MaxCountsDispatcher` — one pass with ``rows = C_max``, the worst case seen in a
  trace (the Cap-and-Spill paper's baseline). A step whose per-peer count exceeds C_max
  cannot be delivered: it raises :class:`CapacityOverflowError` on every rank, before
  anything is sent, in eager mode, and sets ``handle.state["overflow"]`` inside a graph.
* :class:`CapAndSpillDispatcher` — pass 1 carries the first C pairs of every peer pair
  (C = a high quantile, e.g. Q99); pass 2 ("spill") carries the rest in buffers of
  ``S = max(T_max * K - C, 0)`` rows per peer, the exact bound on one pair's overflow
  (:func:`moekit.ep.capacity.spill_capacity`). Nothing can be lost. ``conditional=True``
  skips pass 2 when no rank overflowed, which eager mode decides from the step statuses
  every rank exchanges anyway (below), and a graph from :meth:`CapAndSpillDispatcher.spill_flag`.

Wire format. Every row of a dispatch message is raw bytes: a 16-byte header (int32 local
expert or -1 for an empty row, token, slot, and the sender's status word: its largest
per-peer count in bits 0-29, bit 30 set when it had expert ids outside [-1, E)) followed
by the token's hidden vector. With ``combine_order="rank"`` the header is 32 bytes and its
fifth int32 holds the pair's routing weight (float32 bits): the rank that runs the experts
needs it to sum a token's slots. Carrying the routing in the row keeps each pass to one
collective, lets the receiver place rows without a separate count exchange, and tells
every rank every sender's largest count and flag, so inside a CUDA graph all ranks reach
the same overflow decision and see the same bad-id flags without another collective.
Copying bytes never changes a value, so results are bitwise.

Ranks fail together (:mod:`moekit.ep.agreement`). Building a dispatcher checks once that
every rank passed the same configuration. An eager ``dispatch`` first exchanges every
rank's step status in one small all-gather (with the one host read it makes anyway), so a
bad input on one rank — malformed arguments, ids outside [-1, E), T > T_max, another H
or dtype than its peers' — or a MaxCounts overflow raises the same error on every rank
before any token moves, and the next step pairs up normally. Inside a CUDA graph the
status cannot be read, so bad ids are masked and flagged per rank in the row headers;
call :meth:`check_replay` after a replay to raise what the eager path would have raised.
An eager ``combine`` whose ``expert_out`` is wrong on one rank (not the dispatched tokens'
shape and dtype) fails every rank the same way: that rank still sends its rows (NaN), and
every rank's status travels in front of its rows in the first pass (on CUDA tensors it is
read with the next eager dispatch's status, see :mod:`moekit.ep.agreement`). Inside a
capture ``expert_out`` is checked on the host, once, at capture time.

Result layout. ``Dispatched.tokens`` is ``[E_local, cap, H]`` with the fixed
``cap = P * min(pair capacity, T_max * K)`` (:func:`moekit.ep.capacity.expert_capacity`);
within an expert, rows are in the canonical (source rank, token, slot) order, so valid
rows, counts and the handle are bitwise equal to the eager dispatcher's. Combine sends the
expert outputs back along the same passes and ends with ``weighted_slot_sum``; with
``combine_order="rank"`` each returned row holds the partial sum of its (token, rank)
instead (:mod:`moekit.ep.rank_order`), and the source adds the partials in rank order. The
buffers have a fixed size, so the rank order sends the same bytes here: what it changes
is where the slots are summed (the eager dispatcher and the low-latency layer do ship
fewer rows).

All steps are vectorized torch with fixed shapes (no loop over tokens or peers, no
``.item()``/``.tolist()``), so ``dispatch`` + ``combine`` can be captured in one CUDA graph
and replayed after writing new routing into the same input tensors. Inputs may carry
fewer than T_max tokens, or rows of -1 ids (masked), as a fixed-shape buffer does.

With ``packing="auto"`` the phases run on CUDA tensors as one Triton launch each
(:mod:`moekit.ep.capspill_pack`: plan + pack, compact, unpack, and the slot-order combine's
send and sum), writing the same bytes as the torch phases; ``packing`` (an attribute, torch by
default) picks the path (:meth:`uses_kernels`).

The phases are public (:meth:`plan_and_pack` or :meth:`plan` then :meth:`pack`,
:meth:`compact`, :meth:`exchange`, :meth:`unpack`) so a benchmark can time them one by one;
:meth:`dispatch` is just their composition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.ep.agreement import (MAX_COUNT, StepCheck, agree_on_config, checked_expert_out, raise_for_flagged_ranks,
                                  status_rows, statuses_from_rows)
from moekit.ep.capacity import expert_capacity, pair_bound, spill_capacity
from moekit.ep.checks import check_bool, check_int, check_optional_int, is_int
from moekit.ep.dispatcher import Dispatched, DispatchHandle, check_combine_order, validate_routing, weighted_slot_sum
from moekit.ep.layout import ExpertPlacement, PlacedExperts
from moekit.ep.peers import PeerGroup
from moekit.ep.rank_order import compact_width, partial_rows, rank_columns, rank_hits, sum_partials

HEADER_BYTES = 16  # four int32 per row: local expert (-1 = empty), token, slot, sender's status word
RANK_ORDER_HEADER_BYTES = 32  # ... then the routing weight (float32 bits), padded so payloads stay aligned
_EXPERT, _TOKEN, _SLOT, _STATUS, _WEIGHT = range(5)
_INVALID_BIT = 30  # in the status word, above the largest per-peer count (< 2**30, checked when built)
_COUNT_MASK = (1 << _INVALID_BIT) - 1


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
    ``invalid``: an id was out of range (replaced by -1; the eager path refuses such a step
    before planning, a graph carries the flag in the headers). ``num_tokens``: the caller's
    T (the plan may hold one extra masked row when T = 0, since fixed-shape gathers need a
    row to read).
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


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s work is being recorded into a CUDA graph (no host reads allowed)."""
    return isinstance(t, torch.Tensor) and t.is_cuda and torch.cuda.is_current_stream_capturing()


def _exclusive_cumsum(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(t, dim) - t


class _FixedBufferDispatcher(PlacedExperts):
    """Shared machinery: plan, pack a range of stream positions, exchange, unpack, combine.

    Subclasses choose the first-pass rows (``capacity``, at least ``_min_capacity``), whether
    there is a spill pass (``_spills``: then ``spill_rows`` = S, else 0), their own options
    (``_set_options``) and when the spill pass runs.
    """

    _capacity_name = "capacity"
    _min_capacity = 0
    _spills = False
    packing = "torch"  # "torch" | "auto" | "triton": see uses_kernels

    def __init__(self, num_experts: int, capacity: int, max_tokens: int, *, top_k: int,
                 group: dist.ProcessGroup | None = None, hidden: int | None = None,
                 dtype: torch.dtype | None = None, timeout: float | None = None, combine_order: str = "slot",
                 **options):
        kind = type(self).__name__
        self.peers = PeerGroup(group, owner=kind)
        self.group, self.rank, self.world_size = group, self.peers.rank, self.peers.world_size

        def build() -> None:
            self.peers.set_timeout(timeout)
            self.placement = ExpertPlacement(num_experts, self.world_size)
            self.capacity = check_int(self._capacity_name, capacity, self._min_capacity)
            self.max_tokens = check_int("max_tokens", max_tokens, 1)
            if not is_int(top_k) or not 1 <= top_k <= num_experts:
                raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
            self.top_k = int(top_k)
            if pair_bound(self.max_tokens, self.top_k) > _COUNT_MASK:  # the status word's count bits
                raise ValueError(f"max_tokens * top_k must be < 2**{_INVALID_BIT}, got {max_tokens} * {top_k}")
            self.hidden = check_optional_int("hidden", hidden, 1)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"dtype must be None or a floating-point torch.dtype, got {dtype!r}")
            self.dtype = dtype
            self.combine_order = check_combine_order(combine_order)
            self.header_bytes = RANK_ORDER_HEADER_BYTES if self.combine_order == "rank" else HEADER_BYTES
            self.spill_rows = spill_capacity(self.max_tokens, self.top_k, self.capacity) if self._spills else 0
            self._set_options(**options)
            # Every row a pair can reach, over both passes, fits here (see capacity.py).
            self.expert_capacity = expert_capacity(self.world_size, self.max_tokens, self.top_k,
                                                   self.capacity + self.spill_rows)

        agree_on_config(self.peers, kind, dict(
            num_experts=num_experts, capacity=capacity, max_tokens=max_tokens, top_k=top_k, hidden=hidden,
            dtype=dtype, world_size=self.world_size, placement="contiguous", combine_order=combine_order, **options),
            build)
        self.step = StepCheck(kind, self.peers, self.num_experts, hidden=self.hidden, top_k=self.top_k,
                              max_tokens=self.max_tokens, dtype=self.dtype)

    def _set_options(self, **options) -> None:
        """Each dispatcher's own constructor options (MaxCounts: ``raise_on_overflow``;
        Cap-and-Spill: ``conditional``), validated and stored before the ranks agree."""
        raise NotImplementedError(f"{type(self).__name__} must define _set_options")

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

    def uses_kernels(self, x: torch.Tensor) -> bool:
        """Whether the phases run as the one-launch Triton kernels of :mod:`moekit.ep.capspill_pack`.

        ``packing`` (an attribute, settable after construction since it changes no result):
        ``"torch"`` (the default) never uses them; ``"auto"`` uses the kernels on CUDA tensors
        and the torch phases elsewhere (gloo on the CPU); ``"triton"`` always uses the kernels
        (on the CPU they need ``TRITON_INTERPRET=1``). Both give the same bytes. The kernels
        are opt-in until their own GPU tests pass (docs/capspill.md, "One kernel per phase").
        """
        if self.packing == "torch":
            return False
        return self.packing == "triton" or (x.is_cuda and _have_triton())

    def plan_and_pack(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                      ) -> tuple[FixedPlan, torch.Tensor]:
        """:meth:`plan` and pass 1's :meth:`pack` together: one kernel launch where
        :meth:`uses_kernels`, else the torch phases. ``x`` as :meth:`pack` takes it (T >= 1 rows)."""
        if not self.uses_kernels(x):
            plan = self.plan(topk_ids, topk_weights)
            return plan, self.pack(x, plan)
        from moekit.ep import capspill_pack

        T = topk_ids.shape[0]
        ids, weights = topk_ids, topk_weights
        if T == 0:  # one masked row, as plan() does
            ids = topk_ids.new_full((1, self.top_k), -1)
            weights = topk_weights.new_zeros(1, self.top_k)
        buf, f = capspill_pack.plan_and_pack(x, ids, weights, world_size=self.world_size,
                                             num_experts=self.num_experts, rows=self.capacity,
                                             header_bytes=self.header_bytes)
        return FixedPlan(num_tokens=T, **f), buf

    def pack(self, x: torch.Tensor, plan: FixedPlan, first: int = 0, rows: int | None = None) -> torch.Tensor:
        """Send buffer ``[P, rows, header + H * itemsize]`` (bytes) for stream positions [first, first + rows).

        Row p of peer j holds the pair at position ``first + p`` of the stream to j, or an
        empty row (expert -1, zero payload) past the end of it. A gather: each buffer row
        looks up its pair, so the work is proportional to the buffer, with no scatter
        collisions. Where :meth:`uses_kernels`, one kernel launch writes the same bytes.
        """
        rows = self.capacity if rows is None else rows
        if self.uses_kernels(x):
            from moekit.ep import capspill_pack

            return capspill_pack.plan_and_pack(x, None, None, world_size=self.world_size,
                                               num_experts=self.num_experts, rows=rows,
                                               header_bytes=self.header_bytes, first=first, plan=plan)[0]
        P, K = self.world_size, plan.top_k
        position = torch.arange(first, first + rows, device=x.device)
        filled = position.unsqueeze(0) < plan.rank_counts.unsqueeze(1)  # [P, rows]
        in_order = (plan.rank_start.unsqueeze(1) + position.unsqueeze(0)).clamp(max=plan.sorted_pair.numel() - 1)
        pair = plan.sorted_pair[in_order]
        token = torch.div(pair, K, rounding_mode="floor")
        fields = [plan.sorted_local[in_order], token, pair % K]
        status = plan.max_count.to(torch.int64) | (plan.invalid.to(torch.int64) << _INVALID_BIT)
        words = [torch.where(filled, f, -1) for f in fields] + [status.expand(P, rows)]
        if self.header_bytes == RANK_ORDER_HEADER_BYTES:  # the pair's weight, as float32 bits
            weight = plan.weights.reshape(-1).to(torch.float32).view(torch.int32).to(torch.int64)[pair]
            weight = torch.where(filled, weight, 0)
            words += [weight] + [torch.zeros_like(weight)] * 3
        header = torch.stack(words, dim=-1).to(torch.int32)
        # Empty rows carry zeros (their bytes are never read; zeros keep the wire deterministic).
        payload = torch.where(filled.reshape(-1, 1), _row_bytes(x).index_select(0, token.reshape(-1)), 0)
        row = torch.cat([header.view(torch.uint8).reshape(P * rows, self.header_bytes), payload], 1)
        return row.view(P, rows, self.header_bytes + payload.shape[1])

    def compact(self, x: torch.Tensor, plan: FixedPlan) -> torch.Tensor:
        """The spill buffer ``[P, S, ...]``: every pair past the first C of its peer pair."""
        return self.pack(x, plan, self.capacity, self.spill_rows)

    def exchange(self, buf: torch.Tensor) -> torch.Tensor:
        """``all_to_all_single`` of a ``[P, rows, ...]`` buffer: slice j goes to rank j."""
        out = torch.empty_like(buf)
        if buf.numel() == 0:  # nothing to send: every rank knows it statically
            return out
        return self.peers.all_to_all(out, buf, what="token exchange")

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
        if self.uses_kernels(x):
            return self._unpack_kernel(plan, received, x)
        header = torch.cat([r[..., :self.header_bytes].contiguous().view(torch.int32) for r in received], 1).long()
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
            payload = r[..., self.header_bytes:].view(dtype).reshape(P * n, H)
            tokens.index_copy_(0, dest[:, first:first + n].reshape(-1), payload)
            first += n
        handle = torch.full((3, spare + 1), -1, dtype=torch.int64, device=device)
        origin = torch.stack([source, header[..., _TOKEN], header[..., _SLOT]]).reshape(3, -1)
        handle.index_copy_(1, dest.reshape(-1), origin)

        largest = self._largest_count(plan, header)
        invalid_by_rank = self._invalid_by_rank(plan, header)
        src_rank, src_token, src_slot = handle[:, :spare].reshape(3, E_local, cap)
        state = dict(plan=plan, dest=dest, pass_rows=[r.shape[1] for r in received], largest_count=largest,
                     overflow=largest > rows, invalid_ids=invalid_by_rank.any(), invalid_by_rank=invalid_by_rank)
        if self.combine_order == "rank":  # what the expert side needs to sum each token's slots
            weight = torch.zeros(spare + 1, dtype=torch.float32, device=device)
            bits = header[..., _WEIGHT].to(torch.int32)
            weight.index_copy_(0, dest.reshape(-1), bits.view(torch.float32).reshape(-1))
            state.update(row_weight=weight[:spare], row_token=header[..., _TOKEN], src_rank=handle[0, :spare],
                         src_token=handle[1, :spare], src_slot=handle[2, :spare])
        return Dispatched(tokens[:spare].view(E_local, cap, H), per_source.sum(0),
                          DispatchHandle(src_rank, src_token, src_slot, state))

    def _unpack_kernel(self, plan: FixedPlan, received: list[torch.Tensor], x: torch.Tensor) -> Dispatched:
        """:meth:`unpack` as one kernel launch (:func:`moekit.ep.capspill_pack.unpack`): the same tensors."""
        from moekit.ep import capspill_pack

        E_local, cap = self.experts_per_rank, self.expert_capacity
        by_rank = self.combine_order == "rank"
        out = capspill_pack.unpack(received, dtype=x.dtype, hidden=x.shape[1], header_bytes=self.header_bytes,
                                   world_size=self.world_size, experts_per_rank=E_local, cap=cap, rank=self.rank,
                                   max_count=plan.max_count, invalid=plan.invalid, rank_order=by_rank)
        state = dict(plan=plan, dest=out["dest"], pass_rows=[r.shape[1] for r in received],
                     largest_count=out["largest_count"], overflow=out["overflow"], invalid_ids=out["invalid_ids"],
                     invalid_by_rank=out["invalid_by_rank"])
        if by_rank:
            state.update(row_weight=out["row_weight"], row_token=out["row_token"], src_rank=out["src_rank"],
                         src_token=out["src_token"], src_slot=out["src_slot"])
        view = [out[k].view(E_local, cap) for k in ("src_rank", "src_token", "src_slot")]
        return Dispatched(out["tokens"], out["counts"], DispatchHandle(*view, state))

    def _largest_count(self, plan: FixedPlan, header: torch.Tensor) -> torch.Tensor:
        """The largest per-peer count of any rank this step (every row carries its sender's).

        Every rank receives at least one row from every sender whenever a pass has rows,
        so every rank computes the same number; with no rows at all (C = 0 and no spill)
        only this rank's own count is known.
        """
        mine = plan.max_count.to(torch.int64)
        if header.numel() == 0:
            return mine
        return torch.maximum(mine, (header[..., _STATUS] & _COUNT_MASK).max())

    def _invalid_by_rank(self, plan: FixedPlan, header: torch.Tensor) -> torch.Tensor:
        """``[P]`` bool: sender r had expert ids outside [-1, E) (from its rows' status words;
        with no rows at all, only this rank's own flag is known)."""
        own = torch.zeros(self.world_size, dtype=torch.bool, device=header.device)
        own[self.rank] = plan.invalid
        if header.shape[1] == 0:
            return own
        return own | ((header[:, 0, _STATUS] >> _INVALID_BIT) & 1).bool()

    # -- dispatch / combine -------------------------------------------------------------

    def _dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  spill: bool | None) -> Dispatched:
        """Check the step with every rank (eager) or trust the captured shapes (graph), then run the passes.

        ``spill``: run the spill pass (None: let the status of every rank decide, eager only).
        """
        if _capturing(x):
            # Inside a capture nothing is read on the host: shapes are checked here, once, at
            # capture time (a rank failing this fails alone, as a setup error); bad ids are
            # masked by plan() and flagged to every rank in the headers (see check_replay).
            validate_routing(x, topk_ids, topk_weights, self.num_experts, hidden=self.hidden, top_k=self.top_k,
                             max_tokens=self.max_tokens, dtype=self.dtype, check_ids=False)
            x = _send_rows(x)
            plan, first_pass = self.plan_and_pack(x, topk_ids, topk_weights)
            return self._run_passes(x, plan, first_pass, spill=bool(spill))
        status = self.step.inspect(x, topk_ids, topk_weights)
        plan = first_pass = None
        if status.ok:  # pass 1 is packed with the plan (one launch with the kernels), before the step is settled
            x = _send_rows(x)
            plan, first_pass = self.plan_and_pack(x, topk_ids, topk_weights)
            status.words[MAX_COUNT] = plan.max_count
        numeric = self.step.settle_gathered(self.peers.all_gather(status.words, what="step status exchange"))
        largest = max(words[MAX_COUNT] for words in numeric)
        self._before_exchange(largest)
        return self._run_passes(x, plan, first_pass, spill=largest > self.capacity if spill is None else spill)

    def _before_exchange(self, largest: int) -> None:
        """Eager mode, after every rank's status: the largest per-peer count of any rank."""

    def _run_passes(self, x: torch.Tensor, plan: FixedPlan, first_pass: torch.Tensor, spill: bool) -> Dispatched:
        """``x`` from :func:`_send_rows`; ``first_pass`` = pass 1's send buffer."""
        received = [self.exchange(first_pass)]
        if spill and self.spill_rows > 0:
            received.append(self.exchange(self.compact(x, plan)))
        return self.unpack(plan, received, x)

    def check_replay(self, dispatched: Dispatched) -> None:
        """The host check after replaying a captured dispatch (one host read).

        Raises what the eager path raises before the exchange, the same on every rank:
        a ValueError naming the ranks whose expert ids were outside [-1, E) (the graph
        treated them as masked), then :class:`CapacityOverflowError` when a per-peer count
        did not fit the passes that ran. Also usable on an eager result (then it finds nothing).
        """
        state = dispatched.handle.state
        flags = torch.cat([state["invalid_by_rank"].to(torch.int64), state["overflow"].to(torch.int64).view(1),
                           state["largest_count"].to(torch.int64).view(1)]).tolist()
        P = self.world_size
        raise_for_flagged_ranks(
            type(self).__name__, [bool(f) for f in flags[:P]],
            f"topk_ids held ids outside [-1, {self.num_experts - 1}] (-1 = masked slot) in the replayed step; "
            "the graph treated them as masked slots, so its result does not follow that routing")
        if flags[P]:
            raise self._overflow_error(flags[P + 1], sum(state["pass_rows"]))

    def _overflow_error(self, largest: int, rows: int) -> CapacityOverflowError:
        return CapacityOverflowError(
            f"{type(self).__name__} overflow: a rank routed {largest} (token, slot) pairs to one peer, more than "
            f"the {rows} rows per peer of the passes that ran; the rows past them were not delivered "
            "(every rank raises this)")

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Send expert outputs back along the dispatch's passes; ``y[T, H]`` via ``weighted_slot_sum``.

        ``expert_out`` is ``[E_local, cap, H]`` like ``dispatched.tokens``, in their dtype; its
        rows past ``counts`` are never read into the result (they may hold anything, NaN included).
        """
        state = dispatched.handle.state
        E_local, cap = self.experts_per_rank, self.expert_capacity
        tokens = dispatched.tokens
        alone = self.world_size == 1 or _capturing(tokens)  # no peer to tell, or nothing can be read
        expert_out, problem = checked_expert_out(expert_out, tokens, alone=alone)
        status = None if alone else self.step.problem_status(problem, tokens.device)
        plan: FixedPlan = state["plan"]
        P, H = self.world_size, expert_out.shape[2]
        flat = expert_out.reshape(E_local * cap, H)
        by_rank = self.combine_order == "rank"
        if by_rank:  # one partial row per (source, token); every row of the token returns it
            partials = self._partials(expert_out, state)
            token_of_row = state["row_token"].clamp(min=0)
            source = torch.arange(P, device=flat.device).unsqueeze(1)
        kernels = not by_rank and self.uses_kernels(flat)  # one launch per pass out, one for the sum
        if kernels:
            from moekit.ep import capspill_pack
        slot_out = None if kernels else expert_out.new_zeros(plan.ids.numel(), H)
        # Which slots a pass returned: only the rank order needs it (to place one partial per rank).
        taken = torch.zeros(plan.ids.numel(), dtype=torch.bool, device=flat.device) if by_rank else None
        first, statuses, returned_passes = 0, None, []
        for rows in state["pass_rows"]:
            if rows or (status is not None and statuses is None):
                if by_rank:
                    index = source * self.max_tokens + token_of_row[:, first:first + rows]
                    back = partials.index_select(0, index.reshape(-1))
                elif kernels:
                    back = capspill_pack.gather_back(flat, state["dest"], first, rows)
                else:
                    # Empty rows point at the spare row past the end: send any real row
                    # instead, its owner never reads it.
                    dest = state["dest"][:, first:first + rows].clamp(max=E_local * cap - 1)
                    back = flat.index_select(0, dest.reshape(-1))
                if status is not None and statuses is None:  # the first pass carries every rank's status
                    returned, statuses = self._exchange_with_status(back.view(P, rows, H), status)
                else:
                    returned = self.exchange(back.view(P, rows, H))
                if rows and kernels:
                    returned_passes.append((returned, first))
                elif rows:
                    slot_out, taken = self._take_returned(slot_out, taken, returned, plan, first)
            first += rows
        if statuses is not None:  # after every pass: the peers run them all before they decide
            self.step.settle_combine(statuses, problem)
        T, K = plan.ids.shape
        if kernels:
            return capspill_pack.combine_slots(returned_passes, plan, P, expert_out.dtype, H)
        if by_rank:
            y = self._sum_returned_partials(slot_out, taken, plan, expert_out.dtype)
        else:
            y = weighted_slot_sum(slot_out.view(T, K, H), plan.ids, plan.weights, expert_out.dtype)
        return y[:plan.num_tokens]

    def _exchange_with_status(self, buf: torch.Tensor, status: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`exchange` of ``buf [P, rows, H]`` with ``status`` in front of every peer's
        rows (raw bytes, in rows of their width); returns (the received rows, every sender's
        status ``[P, STATUS_WORDS]``)."""
        P, rows = buf.shape[:2]
        data = buf.contiguous().view(torch.uint8)  # [P, rows, H * itemsize]: rows travel bit for bit
        head = status_rows(status, data.shape[2])
        r = head.shape[0]
        received = self.exchange(torch.cat([head.expand(P, r, head.shape[1]), data], 1))
        return received[:, r:].view(buf.dtype), statuses_from_rows(received[:, :r])

    def _partials(self, expert_out: torch.Tensor, state: dict) -> torch.Tensor:
        """``[P * T_max, H]``: row ``s * T_max + t`` is the rank-order partial of source s's
        token t over the slots this rank received (zero rows for tokens with none here)."""
        P, K, T_max = self.world_size, self.top_k, self.max_tokens
        E_local, cap, H = expert_out.shape
        handle = torch.stack([state["src_rank"], state["src_token"], state["src_slot"]]).reshape(3, -1)
        valid = handle[0] >= 0
        cells = P * T_max * K
        cell = torch.where(valid, (handle[0] * T_max + handle[1]) * K + handle[2], cells)  # padding: a spare cell
        rows = expert_out.new_zeros(cells + 1, H).index_copy_(0, cell, expert_out.reshape(E_local * cap, H))
        weights = torch.zeros(cells + 1, dtype=torch.float32, device=expert_out.device)
        weights.index_copy_(0, cell, state["row_weight"])
        present = torch.zeros(cells + 1, dtype=torch.bool, device=expert_out.device).index_fill_(0, cell, True)
        return partial_rows(rows[:cells].view(P * T_max, K, H), weights[:cells].view(P * T_max, K),
                            present[:cells].view(P * T_max, K), expert_out.dtype)

    def _sum_returned_partials(self, slot_out: torch.Tensor, taken: torch.Tensor, plan: FixedPlan,
                               out_dtype: torch.dtype) -> torch.Tensor:
        """The source's half of the rank order: each returned slot row holds its (token, rank)
        partial; place one per (token, rank) in rank order and add them."""
        P = self.world_size
        T, K = plan.ids.shape
        H = slot_out.shape[1]
        owner = plan.pair_rank.view(T, K)  # P for masked slots
        hit = rank_hits(owner, P)
        R = compact_width(K, P)
        column = rank_columns(hit).gather(1, owner.clamp(max=P - 1))  # [T, K]
        token = torch.arange(T, device=owner.device).unsqueeze(1)
        # Every taken slot of a (token, rank) carries the same partial, so the writes agree.
        target = torch.where(taken.view(T, K), token * R + column, T * R).reshape(-1)
        placed = slot_out.new_zeros(T * R + 1, H).index_copy_(0, target, slot_out)
        present = torch.arange(R, device=owner.device).unsqueeze(0) < hit.sum(1, keepdim=True)
        return sum_partials(placed[:T * R].view(T, R, H), present, out_dtype)

    @staticmethod
    def _take_returned(slot_out: torch.Tensor, taken: torch.Tensor | None, returned: torch.Tensor, plan: FixedPlan,
                       first: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Put each pair's returned row (if this pass carried it) in its (token, slot) place."""
        P, rows, H = returned.shape
        in_pass = (plan.pair_rank < P) & (plan.pair_pos >= first) & (plan.pair_pos < first + rows)
        index = plan.pair_rank.clamp(max=P - 1) * rows + (plan.pair_pos - first).clamp(0, rows - 1)
        slot_out = torch.where(in_pass.unsqueeze(1), returned.reshape(P * rows, H).index_select(0, index), slot_out)
        return slot_out, None if taken is None else taken | in_pass


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

    # Rows carry every sender's count (and bad-id flag) to every rank; with none, ranks could not agree.
    _capacity_name = "capacity (C_max)"
    _min_capacity = 1

    def __init__(self, num_experts: int, capacity: int, max_tokens: int, *, top_k: int,
                 group: dist.ProcessGroup | None = None, hidden: int | None = None,
                 raise_on_overflow: bool = True, dtype: torch.dtype | None = None, timeout: float | None = None,
                 combine_order: str = "slot"):
        super().__init__(num_experts, capacity, max_tokens, top_k=top_k, group=group, hidden=hidden, dtype=dtype,
                         timeout=timeout, combine_order=combine_order, raise_on_overflow=raise_on_overflow)

    def _set_options(self, raise_on_overflow) -> None:
        self.raise_on_overflow = check_bool("raise_on_overflow", raise_on_overflow)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        return self._dispatch(x, topk_ids, topk_weights, spill=False)

    def _before_exchange(self, largest: int) -> None:
        if self.raise_on_overflow and largest > self.capacity:
            raise self._overflow_error(largest, self.capacity)

    def _overflow_error(self, largest: int, rows: int) -> CapacityOverflowError:
        return CapacityOverflowError(
            f"MaxCounts overflow: a rank routed {largest} (token, slot) pairs to one peer, more than capacity "
            f"C_max={self.capacity}; the step was not delivered (every rank raises this). Recalibrate C_max, "
            "or use CapAndSpillDispatcher, which spills instead")


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

    _spills = True

    def __init__(self, num_experts: int, capacity: int, max_tokens: int, *, top_k: int,
                 conditional: bool = False, group: dist.ProcessGroup | None = None, hidden: int | None = None,
                 dtype: torch.dtype | None = None, timeout: float | None = None, combine_order: str = "slot"):
        super().__init__(num_experts, capacity, max_tokens, top_k=top_k, group=group, hidden=hidden, dtype=dtype,
                         timeout=timeout, combine_order=combine_order, conditional=conditional)

    def _set_options(self, conditional) -> None:
        self.conditional = check_bool("conditional", conditional)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 spill: bool | None = None) -> Dispatched:
        """Dispatch; ``spill`` overrides the mode's choice of running the spill pass.

        ``spill=None``: unconditional mode runs it, conditional mode runs it when any
        rank has a per-peer count over C (known from the step statuses every rank
        exchanges; no extra collective). ``spill=False`` is for capturing the conditional
        mode's no-spill graph: use it only when :meth:`spill_flag` said no rank
        overflows; otherwise ``handle.state["overflow"]`` reports the rows left behind.
        """
        if spill is None and not self.conditional:
            spill = True
        if spill is None and _capturing(x):
            raise ValueError("spill: a conditional CapAndSpillDispatcher cannot decide inside a CUDA graph; "
                             "capture dispatch(..., spill=True) and dispatch(..., spill=False) and replay the one "
                             "spill_flag picks")
        return self._dispatch(x, topk_ids, topk_weights, spill=spill)

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
        return self.peers.all_reduce_max(flag, what="spill flag all-reduce")


def _send_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the packers read it: contiguous, with one zero row when T = 0 (a gather needs a row)."""
    x = x.contiguous()
    return x.new_zeros(1, x.shape[1]) if x.shape[0] == 0 else x


def _have_triton() -> bool:
    from moekit.kernels.backend import HAVE_TRITON

    return HAVE_TRITON


def _row_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x[T, H]`` as raw bytes ``[T, H * itemsize]`` (a view), so rows travel bit for bit."""
    return x.contiguous().view(torch.uint8)
