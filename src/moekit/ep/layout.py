"""Where experts live, and the per-peer bookkeeping every dispatcher needs.

All functions are vectorized torch on the tokens' device: no Python loop over tokens or
peers, and no host sync (the eager all-to-all syncs only to size its messages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """Contiguous placement: expert e lives on rank e // E_local as local expert e % E_local."""

    num_experts: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.num_experts < 1 or self.num_experts % self.world_size:
            raise ValueError(
                f"num_experts={self.num_experts} must be a positive multiple of world_size={self.world_size}"
            )

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    def rank_of(self, experts: torch.Tensor) -> torch.Tensor:
        return torch.div(experts, self.experts_per_rank, rounding_mode="floor")

    def local_index(self, experts: torch.Tensor) -> torch.Tensor:
        return torch.remainder(experts, self.experts_per_rank)


@dataclass
class SendPlan:
    """The valid (token, slot) pairs of this rank, sorted by destination.

    ``pair``: flat index t * K + k of each pair, in send order (destination rank, local
    expert, token, slot). ``dest_expert``: destination-rank-major expert key
    ``rank * E_local + local`` of each pair, same order. ``counts``: ``[P, E_local]`` pairs
    per destination rank and expert.
    """

    pair: torch.Tensor
    dest_expert: torch.Tensor
    counts: torch.Tensor
    top_k: int

    @property
    def token(self) -> torch.Tensor:
        return self.pair // self.top_k

    @property
    def slot(self) -> torch.Tensor:
        return self.pair % self.top_k


def plan_send(topk_ids: torch.Tensor, placement: ExpertPlacement) -> SendPlan:
    """Sort this rank's (token, slot) pairs by (destination rank, local expert, token, slot).

    Since experts are placed contiguously, the global expert id *is* that key, and a stable
    sort on it keeps (token, slot) order within each expert.
    """
    K = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).to(torch.int64)
    pair = torch.nonzero(flat >= 0).flatten()  # ascending: (token, slot) order
    experts = flat[pair]
    order = torch.argsort(experts, stable=True)
    pair, experts = pair[order], experts[order]
    counts = torch.bincount(experts, minlength=placement.num_experts)
    return SendPlan(pair=pair, dest_expert=experts,
                    counts=counts.view(placement.world_size, placement.experts_per_rank), top_k=K)


def segment_offsets(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows laid out as consecutive segments of the given lengths: each row's segment
    id and its offset inside the segment."""
    flat = counts.reshape(-1)
    seg = torch.repeat_interleave(torch.arange(flat.numel(), device=flat.device), flat)
    starts = torch.cumsum(flat, 0) - flat
    offset = torch.arange(seg.numel(), device=flat.device) - starts[seg]
    return seg, offset


def expert_major_positions(recv_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each received row goes in the expert-major layout.

    ``recv_counts[s, e]``: rows received from source rank s for local expert e; rows arrive
    ordered by (source, expert). Returns, per row, its (local expert, position inside the
    expert, source rank); inside an expert, rows are ordered by source rank, which keeps
    the canonical (source rank, token, slot) order.
    """
    P, E_local = recv_counts.shape
    seg, offset = segment_offsets(recv_counts)
    src, expert = seg // E_local, seg % E_local
    # Start of source s inside expert e: rows of e from sources before s.
    src_start = torch.cumsum(recv_counts, 0) - recv_counts  # [P, E_local]
    return expert, src_start[src, expert] + offset, src
