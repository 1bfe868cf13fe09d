"""Eager expert-parallel dispatch/combine over ``all_to_all_single``.

Dispatch: each rank sorts its (token, slot) pairs by destination expert, exchanges the
per-(rank, expert) counts with one all-to-all, reads them on the host to size the messages,
then sends one row per pair (the token's hidden vector) plus its (token, slot) index.
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
from moekit.ep.layout import ExpertPlacement, expert_major_positions, plan_send


class AllToAllDispatcher:
    """Eager dispatcher: exact-size messages, expert-major output with dynamic capacity.

    Host reads per dispatch: the id-range check (skip with ``check_ids=False``) and the
    message sizes; combine reads nothing.

    ``capacity`` of the result is the largest number of rows any local expert received.
    """

    def __init__(self, num_experts: int, *, group: dist.ProcessGroup | None = None,
                 hidden: int | None = None, top_k: int | None = None, max_tokens: int | None = None,
                 check_ids: bool = True):
        self.group = group
        self.check_ids = check_ids
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        self.world_size = dist.get_world_size(group) if distributed else 1
        self.placement = ExpertPlacement(num_experts, self.world_size)
        self.hidden, self.top_k, self.max_tokens = hidden, top_k, max_tokens

    @property
    def num_experts(self) -> int:
        return self.placement.num_experts

    @property
    def experts_per_rank(self) -> int:
        return self.placement.experts_per_rank

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        validate_routing(x, topk_ids, topk_weights, self.num_experts, hidden=self.hidden,
                         top_k=self.top_k, max_tokens=self.max_tokens, check_ids=self.check_ids)
        plan = plan_send(topk_ids, self.placement)
        recv_counts = self._all_to_all_equal(plan.counts)  # [P, E_local]: row s = what s sends us
        counts = recv_counts.sum(0)
        # The one host read of the eager path: message sizes and the output capacity.
        P = self.world_size
        capacity = counts.max().view(1) if counts.numel() else counts.new_zeros(1)
        sizes = torch.cat([plan.counts.sum(1), recv_counts.sum(1), capacity]).tolist()
        send_splits, recv_splits, capacity = sizes[:P], sizes[P:2 * P], sizes[2 * P]
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
        state = dict(pair=pair, top_k=plan.top_k, expert=expert, pos=pos, send_splits=send_splits, recv_splits=recv_splits,
                     topk_ids=topk_ids, topk_weights=topk_weights, num_tokens=x.shape[0])
        return Dispatched(tokens, counts, DispatchHandle(src_rank, src_token, src_slot, state))

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
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
