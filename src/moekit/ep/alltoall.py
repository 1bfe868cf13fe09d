"""Eager expert-parallel dispatch/combine over ``all_to_all_single``.

Dispatch: each rank sorts its (token, slot) pairs by destination expert, exchanges the
per-(rank, expert) counts (and its step status, :mod:`moekit.ep.agreement`) with one
all-to-all, reads them on the host once to size the messages, then sends one row per pair
(the token's hidden vector) plus its (token, slot) index.
Combine returns the expert outputs along the reverse path and sums the K slots of each
token with ``weighted_slot_sum`` (``combine_order="slot"``). With ``combine_order="rank"``
each pair also carries its routing weight, the rank that ran the experts sums each
token's slots it holds (float32, slot order, rounded once) and sends back ONE row per
(token, rank) instead of one per slot, and the token's rank adds those partials in rank
order (:func:`moekit.ep.dispatcher.weighted_rank_sum`). Works on gloo (CPU) and NCCL (GPU);
a single process with no process group runs the same code with the collectives replaced
by copies.

This path is the baseline: it sizes everything exactly, so it pads nothing, but it
synchronizes with the host once per dispatch and cannot be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.ep.agreement import (NUMERIC_WORDS, STATUS_WORDS, StepCheck, agree_on_config, expert_out_problem,
                                  status_rows, statuses_from_rows)
from moekit.ep.checks import check_optional_int
from moekit.ep.dispatcher import Dispatched, DispatchHandle, check_combine_order, weighted_slot_sum
from moekit.ep.layout import ExpertPlacement, PlacedExperts, expert_major_positions, plan_send
from moekit.ep.peers import PeerGroup
from moekit.ep.rank_order import compact_width, partial_rows, rank_columns, rank_hits, sum_partials


class AllToAllDispatcher(PlacedExperts):
    """Eager dispatcher: exact-size messages, expert-major output with dynamic capacity.

    ``capacity`` of the result is the largest number of rows any local expert received.
    One host read per dispatch (message sizes and every rank's step status); combine reads
    nothing.

    ``hidden``, ``top_k``, ``max_tokens``, ``dtype``: optional limits on the inputs (None:
    any). ``timeout``: seconds a collective on CPU tensors waits for the peers before
    raising :class:`~moekit.ep.PeerError` (None: the process group's timeout; NCCL always
    uses that one, see :mod:`moekit.ep.peers`). ``combine_order``: ``"slot"`` (default) or
    ``"rank"`` (module docstring); the rows combine sends are in ``handle.state["combine_rows"]``.

    Ranks fail together (:mod:`moekit.ep.agreement`): building one checks, in one small
    collective, that every rank passed the same configuration. In ``dispatch``, a bad
    input on any rank (malformed arguments, expert ids outside [-1, E), T > ``max_tokens``,
    x of another H or dtype than the other ranks') travels to every peer in the counts
    message, which that rank still sends, so *every* rank raises the same ValueError naming
    the rank at fault, before any token moves, and the next step pairs up normally.
    ``combine`` likewise: a rank whose ``expert_out`` is not the dispatched tokens' shape and
    dtype still sends its rows (NaN) with its status in front of them, and every rank raises
    the same ValueError (on CPU tensors in that combine; on CUDA tensors at the next dispatch,
    whose host read carries the statuses, see :mod:`moekit.ep.agreement`).
    """

    def __init__(self, num_experts: int, *, group: dist.ProcessGroup | None = None,
                 hidden: int | None = None, top_k: int | None = None, max_tokens: int | None = None,
                 dtype: torch.dtype | None = None, timeout: float | None = None, combine_order: str = "slot"):
        self.peers = PeerGroup(group, owner="AllToAllDispatcher")
        self.group, self.rank, self.world_size = group, self.peers.rank, self.peers.world_size

        def build() -> None:
            self.peers.set_timeout(timeout)
            self.placement = ExpertPlacement(num_experts, self.world_size)
            self.hidden = check_optional_int("hidden", hidden, 1)
            self.top_k = check_optional_int("top_k", top_k, 1)
            self.max_tokens = check_optional_int("max_tokens", max_tokens, 0)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"dtype must be None or a floating-point torch.dtype, got {dtype!r}")
            self.dtype = dtype
            self.combine_order = check_combine_order(combine_order)

        agree_on_config(self.peers, "AllToAllDispatcher", dict(
            num_experts=num_experts, hidden=hidden, top_k=top_k, max_tokens=max_tokens, dtype=dtype,
            world_size=self.world_size, placement="contiguous", combine_order=combine_order), build)
        self.step = StepCheck("AllToAllDispatcher", self.peers, self.num_experts, hidden=self.hidden,
                              top_k=self.top_k, max_tokens=self.max_tokens, dtype=self.dtype)

    @property
    def needs_cuda(self) -> bool:
        return self.peers.needs_cuda

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        status = self.step.inspect(x, topk_ids, topk_weights)
        P, E_local = self.world_size, self.experts_per_rank
        by_rank = self.combine_order == "rank"
        if status.ok:
            plan = plan_send(topk_ids, self.placement)
            counts = plan.counts
        else:  # still take part in the step: an empty contribution that carries the error
            plan, counts = None, torch.zeros(P, E_local, dtype=torch.int64, device=status.words.device)
        # Rank order: the partial rows combine will return, one per (token, rank); each rank
        # learns how many it sends back to each source in the same counts message.
        hit = None
        if by_rank and plan is not None:
            owner = self.placement.rank_of(topk_ids.to(torch.int64))
            hit = rank_hits(torch.where((topk_ids >= 0) & (topk_ids < self.num_experts), owner, -1), P)  # [T, P]
            groups = hit.sum(0).view(P, 1)
        else:
            groups = counts.new_zeros(P, 1)
        message = torch.cat([counts, groups, status.words.view(1, STATUS_WORDS).expand(P, STATUS_WORDS)], dim=1)
        received = self._all_to_all_equal(message)  # [P, E_local + 1 + STATUS_WORDS]: row s = what s sends us
        recv_counts = received[:, :E_local]
        recv_groups = received[:, E_local]
        statuses = received[:, E_local + 1:]
        counts = recv_counts.sum(0)
        # The one host read of the eager path: message sizes, capacity and every rank's status.
        capacity = counts.max().view(1) if counts.numel() else counts.new_zeros(1)
        pending = self.step.pending_flags()  # a previous combine's statuses (CUDA), read with this step's
        host = torch.cat([counts.new_zeros(P) if plan is None else plan.counts.sum(1), recv_counts.sum(1),
                          groups.view(P), recv_groups, capacity, statuses[:, :NUMERIC_WORDS].reshape(-1),
                          *([] if pending is None else [pending])]).tolist()
        if pending is not None:
            self.step.raise_pending(host[-P:])
        send_splits, recv_splits = host[:P], host[P:2 * P]
        return_splits, partial_splits = host[2 * P:3 * P], host[3 * P:4 * P]
        capacity = host[4 * P]
        numeric = host[4 * P + 1:]
        self.step.settle([numeric[s * NUMERIC_WORDS:(s + 1) * NUMERIC_WORDS] for s in range(P)],
                         lambda s: statuses[s, NUMERIC_WORDS:])
        pair = plan.pairs(sum(send_splits))
        token, slot = pair // plan.top_k, pair % plan.top_k

        H = x.shape[1]
        recv_x = self._all_to_all(x[token], sum(recv_splits), recv_splits, send_splits)
        index = [token, slot]
        if by_rank:  # each pair also carries its (token, rank) group and its weight (float32 bits)
            dest = self.placement.rank_of(topk_ids.reshape(-1)[pair].to(torch.int64))
            group = (torch.cumsum(hit.to(torch.int64), 0) - hit.to(torch.int64))[token, dest]
            weight = topk_weights.reshape(-1)[pair].to(torch.float32).view(torch.int32).to(torch.int64)
            index += [group, weight]
        recv_index = self._all_to_all(torch.stack(index, dim=1), sum(recv_splits), recv_splits, send_splits)

        expert, pos, src = expert_major_positions(recv_counts, sum(recv_splits))
        tokens = x.new_zeros(E_local, capacity, H)
        tokens[expert, pos] = recv_x
        # Source rank, token and slot of every row, -1 on padding (one scatter for all three).
        meta = torch.full((3, E_local, capacity), -1, dtype=torch.int64, device=x.device)
        meta[:, expert, pos] = torch.cat([src.unsqueeze(0), recv_index[:, :2].t()])
        src_rank, src_token, src_slot = meta.unbind(0)
        # The routing is kept by reference: changing it in place before combine changes the combine.
        state = dict(pair=pair, top_k=plan.top_k, expert=expert, pos=pos, send_splits=send_splits,
                     recv_splits=recv_splits, topk_ids=topk_ids, topk_weights=topk_weights, num_tokens=x.shape[0],
                     combine_rows=sum(partial_splits) if by_rank else sum(recv_splits))
        if by_rank:
            group_start = torch.cumsum(recv_groups, 0) - recv_groups  # where each source's groups begin
            state.update(hit=hit, return_splits=return_splits, partial_splits=partial_splits,
                         recv_group=group_start[src] + recv_index[:, 2], recv_slot=recv_index[:, 1],
                         recv_weight=recv_index[:, 3].to(torch.int32).view(torch.float32))
        return Dispatched(tokens, counts, DispatchHandle(src_rank, src_token, src_slot, state))

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """[T, H] in the dispatched tokens' dtype. ``expert_out``: their shape and dtype.

        With several ranks every rank's status travels in front of its rows (one status per
        peer: ``STATUS_WORDS`` int64), so a bad ``expert_out`` on one rank fails every rank
        together (class docstring)."""
        state = dispatched.handle.state
        tokens = dispatched.tokens
        problem = expert_out_problem(expert_out, tokens)
        status = None
        if self.world_size == 1:  # no peer waits for this rank
            if problem is not None:
                raise ValueError(problem)
        else:
            status = self.step.problem_status(problem, tokens.device)
            if problem is not None:  # still take part, with rows nobody will use
                expert_out = torch.full_like(tokens, float("nan"))
        back = expert_out[state["expert"], state["pos"]]  # rows in the order they arrived
        if "recv_group" in state:
            return self._combine_by_rank(back, state, status, problem)
        returned = self._send_back(back, state["send_splits"], state["recv_splits"], status, problem)
        T, K, H = state["num_tokens"], state["top_k"], expert_out.shape[2]
        slot_out = expert_out.new_zeros(T * K, H)
        slot_out[state["pair"]] = returned
        return weighted_slot_sum(slot_out.view(T, K, H), state["topk_ids"], state["topk_weights"], expert_out.dtype)

    def _combine_by_rank(self, back: torch.Tensor, state: dict, status: torch.Tensor | None,
                         problem: str | None) -> torch.Tensor:
        """``combine_order="rank"``: one partial row per (source token, this rank) goes back."""
        K, H, P = state["top_k"], back.shape[1], self.world_size
        groups = sum(state["partial_splits"])
        # The received pairs by (group, slot): a group's slots in slot order, absent slots masked.
        cell = state["recv_group"] * K + state["recv_slot"]
        rows = back.new_zeros(groups * K, H)
        rows[cell] = back
        weights = torch.zeros(groups * K, dtype=torch.float32, device=back.device)
        weights[cell] = state["recv_weight"]
        present = torch.zeros(groups * K, dtype=torch.bool, device=back.device)
        present[cell] = True
        partials = partial_rows(rows.view(groups, K, H), weights.view(groups, K), present.view(groups, K), back.dtype)
        returned = self._send_back(partials, state["return_splits"], state["partial_splits"], status, problem)
        # Rank d's partial of token t arrived at (rows before d) + (t's index among d's tokens).
        hit = state["hit"]  # [T, P]
        T, R = hit.shape[0], compact_width(K, P)
        as_int = hit.to(torch.int64)
        dest_start = torch.cumsum(as_int.sum(0), 0) - as_int.sum(0)
        row = dest_start.unsqueeze(0) + torch.cumsum(as_int, 0) - as_int  # [T, P]
        column = rank_columns(hit)
        token = torch.arange(T, device=hit.device).unsqueeze(1).expand(T, P)
        target = torch.where(hit, token * R + column, T * R).reshape(-1)  # misses into a spare row
        source = torch.cat([returned, returned.new_zeros(1, H)])  # a row to read for the misses
        placed = back.new_zeros(T * R + 1, H)
        placed[target] = source[torch.where(hit, row, returned.shape[0]).reshape(-1)]
        present = torch.arange(R, device=hit.device).unsqueeze(0) < as_int.sum(1, keepdim=True)
        return sum_partials(placed[:T * R].view(T, R, H), present, back.dtype)

    # -- collectives (plain copies when there is a single rank) --------------------------------

    def _all_to_all_equal(self, t: torch.Tensor) -> torch.Tensor:
        return self.peers.all_to_all(torch.empty_like(t), t, what="counts exchange")

    def _send_back(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   status: torch.Tensor | None, problem: str | None) -> torch.Tensor:
        """Combine's exchange of ``rows`` (``in_splits[d]`` rows to rank d, ``out_splits[s]``
        from rank s); with a ``status``, it travels in front of each peer's rows (as raw bytes,
        in rows of their width) and every rank settles the statuses it received."""
        if status is None:
            return self._all_to_all(rows, sum(out_splits), out_splits, in_splits)
        data = rows.contiguous().view(torch.uint8)  # [n, H * itemsize]: rows travel bit for bit
        head = status_rows(status, data.shape[1])
        r, P = head.shape[0], self.world_size
        pieces, start = [], 0
        for n in in_splits:
            pieces += [head, data[start:start + n]]
            start += n
        received = self._all_to_all(torch.cat(pieces), P * r + sum(out_splits), [r + n for n in out_splits],
                                    [r + n for n in in_splits])
        starts = [0]
        for n in out_splits:
            starts.append(starts[-1] + r + n)
        self.step.settle_combine(statuses_from_rows(torch.stack([received[a:a + r] for a in starts[:P]])), problem)
        back = torch.cat([received[a + r:a + r + n] for a, n in zip(starts, out_splits)])
        return back.view(rows.dtype)

    def _all_to_all(self, t: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        out = t.new_empty((out_rows, *t.shape[1:]))
        return self.peers.all_to_all(out, t, out_splits, in_splits, what="token exchange")
