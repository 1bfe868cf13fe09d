"""Eager expert-parallel dispatch/combine over ``all_to_all_single``.

Dispatch: each rank sorts its (token, slot) pairs by destination expert, exchanges the
per-(rank, expert) counts (and an error code) with one all-to-all, reads them on the host
once to size the messages, then sends one row per pair (the token's hidden vector) plus its (token, slot) index.
Combine returns the expert outputs along the reverse path and sums the K slots of each
token with ``weighted_slot_sum``. Works on gloo (CPU) and NCCL (GPU); a single process
with no process group runs the same code with the collectives replaced by copies.

This path is the baseline: it sizes everything exactly, so it pads nothing, but it
synchronizes with the host once per dispatch and cannot be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.ep.dispatcher import Dispatched, DispatchHandle, validate_routing, weighted_slot_sum
from moekit.ep.layout import ExpertPlacement, PlacedExperts, expert_major_positions, plan_send


class AllToAllDispatcher(PlacedExperts):
    """Eager dispatcher: exact-size messages, expert-major output with dynamic capacity.

    ``capacity`` of the result is the largest number of rows any local expert received.
    One host read per dispatch (message sizes and errors); combine reads nothing.

    Errors: malformed arguments (dims, dtypes, devices, H or K not the dispatcher's) raise
    a ValueError on the calling rank before any communication. Data-dependent errors —
    expert ids outside [-1, E) and T > ``max_tokens`` — are found on the device and sent
    to every peer with the counts, so *every* rank raises the same ValueError, naming the
    rank at fault, instead of the healthy ranks waiting forever in a collective.
    """

    # Error codes carried in the extra column of the counts message.
    _BAD_IDS, _TOO_MANY_TOKENS = 1, 2

    def __init__(self, num_experts: int, *, group: dist.ProcessGroup | None = None,
                 hidden: int | None = None, top_k: int | None = None, max_tokens: int | None = None):
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        self.world_size = dist.get_world_size(group) if distributed else 1
        # NCCL moves only CUDA tensors: check the device up front for a clear error.
        self.needs_cuda = distributed and "nccl" in str(dist.get_backend(group))
        self.placement = ExpertPlacement(num_experts, self.world_size)
        self.hidden, self.top_k, self.max_tokens = hidden, top_k, max_tokens

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        validate_routing(x, topk_ids, topk_weights, self.num_experts, hidden=self.hidden,
                         top_k=self.top_k, check_ids=False)
        if self.needs_cuda and x.device.type != "cuda":
            raise ValueError(f"x is on {x.device}; this dispatcher's process group is NCCL, which needs CUDA tensors")
        plan = plan_send(topk_ids, self.placement)
        error = torch.where(plan.invalid > 0, self._BAD_IDS, 0)
        if self.max_tokens is not None and x.shape[0] > self.max_tokens:
            error = torch.full_like(error, self._TOO_MANY_TOKENS)
        P, E_local = self.world_size, self.experts_per_rank
        message = torch.cat([plan.counts, error.view(1, 1).expand(P, 1)], dim=1)
        received = self._all_to_all_equal(message)  # [P, E_local + 1]: row s = what s sends us
        recv_counts = received[:, :E_local]
        counts = recv_counts.sum(0)
        # The one host read of the eager path: message sizes, capacity and every rank's error.
        capacity = counts.max().view(1) if counts.numel() else counts.new_zeros(1)
        host = torch.cat([plan.counts.sum(1), recv_counts.sum(1), capacity, received[:, E_local],
                          plan.invalid.view(1)]).tolist()
        send_splits, recv_splits, capacity = host[:P], host[P:2 * P], host[2 * P]
        self._raise_peer_errors(host[2 * P + 1:3 * P + 1], x.shape[0], host[-1])
        pair = plan.pairs(sum(send_splits))
        token, slot = pair // plan.top_k, pair % plan.top_k

        H = x.shape[1]
        recv_x = self._all_to_all(x[token], sum(recv_splits), recv_splits, send_splits)
        recv_index = self._all_to_all(torch.stack([token, slot], dim=1), sum(recv_splits), recv_splits, send_splits)

        expert, pos, src = expert_major_positions(recv_counts, sum(recv_splits))
        E_local = self.experts_per_rank
        tokens = x.new_zeros(E_local, capacity, H)
        tokens[expert, pos] = recv_x
        # Source rank, token and slot of every row, -1 on padding (one scatter for all three).
        meta = torch.full((3, E_local, capacity), -1, dtype=torch.int64, device=x.device)
        meta[:, expert, pos] = torch.cat([src.unsqueeze(0), recv_index.t()])
        src_rank, src_token, src_slot = meta.unbind(0)
        # The routing is kept by reference: changing it in place before combine changes the combine.
        state = dict(pair=pair, top_k=plan.top_k, expert=expert, pos=pos, send_splits=send_splits,
                     recv_splits=recv_splits, topk_ids=topk_ids, topk_weights=topk_weights, num_tokens=x.shape[0])
        return Dispatched(tokens, counts, DispatchHandle(src_rank, src_token, src_slot, state))

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """[T, H] in ``expert_out``'s dtype. The shape check is rank-local: a rank passing a
        wrong ``expert_out`` raises alone (its peers then wait in the collective)."""
        state = dispatched.handle.state
        if expert_out.dim() != 3 or expert_out.shape[:2] != dispatched.tokens.shape[:2]:
            raise ValueError(
                f"expert_out must be [E_local, capacity, H] = {tuple(dispatched.tokens.shape[:2])} + [H], "
                f"got {tuple(expert_out.shape)}"
            )
        back = expert_out[state["expert"], state["pos"]]  # rows in the order they arrived
        returned = self._all_to_all(back, sum(state["send_splits"]), state["send_splits"], state["recv_splits"])
        T, K, H = state["num_tokens"], state["top_k"], expert_out.shape[2]
        slot_out = expert_out.new_zeros(T * K, H)
        slot_out[state["pair"]] = returned
        return weighted_slot_sum(slot_out.view(T, K, H), state["topk_ids"], state["topk_weights"], expert_out.dtype)

    def _raise_peer_errors(self, codes: list[int], num_tokens: int, my_invalid: int) -> None:
        """Raise the same ValueError on every rank when any rank's input was bad."""
        bad = [(src, code) for src, code in enumerate(codes) if code]
        if not bad:
            return
        parts = []
        for src, code in bad:
            if code == self._BAD_IDS:
                detail = f" ({my_invalid} ids)" if src == self.rank else ""
                parts.append(f"rank {src}: topk_ids must be in [-1, {self.num_experts - 1}] "
                             f"(-1 = masked slot), got ids outside that range{detail}")
            else:
                detail = f" (got T={num_tokens})" if src == self.rank else ""
                parts.append(f"rank {src}: x has more tokens than this dispatcher allows, "
                             f"T in [0, {self.max_tokens}]{detail}")
        raise ValueError("; ".join(parts))

    # -- collectives (plain copies when there is a single rank) --------------------------------

    def _all_to_all_equal(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t)
        if self.world_size == 1:
            return out.copy_(t)
        dist.all_to_all_single(out, t.contiguous(), group=self.group)
        return out

    def _all_to_all(self, t: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        out = t.new_empty((out_rows, *t.shape[1:]))
        if self.world_size == 1:
            return out.copy_(t)
        dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=self.group)
        return out
