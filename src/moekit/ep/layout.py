"""Where experts live, and the per-peer bookkeeping every dispatcher needs.

All functions are vectorized torch on the tokens' device: no Python loop over tokens or
peers, and no host sync (the eager all-to-all syncs only to size its messages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.ep.checks import check_int

@dataclass(frozen=True)
class ExpertPlacement:
    """Contiguous placement: expert e lives on rank e // E_local as local expert e % E_local."""

    num_experts: int
    world_size: int

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1)
        check_int("num_experts", self.num_experts, 1)
        if self.num_experts % self.world_size:
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


class PlacedExperts:
    """For dispatchers holding a ``placement``: the expert counts they are asked for."""

    placement: ExpertPlacement

    @property
    def num_experts(self) -> int:
        return self.placement.num_experts

    @property
    def experts_per_rank(self) -> int:
        return self.placement.experts_per_rank


@dataclass
class SendPlan:
    """This rank's (token, slot) pairs sorted by destination, built without a host sync.

    ``order``: flat index t * K + k of *every* slot, valid ones first in send order
    (destination rank, local expert, token, slot), masked slots (-1) and invalid ids after
    them. ``counts``: ``[P, E_local]`` valid pairs per destination rank and expert.
    ``invalid``: 0-d count of ids outside [-1, E). These live on the device; ``pairs(n)``
    cuts the order once the caller has read the number of valid pairs (the eager path
    reads it with its message sizes, in one host read).
    """

    order: torch.Tensor
    counts: torch.Tensor
    invalid: torch.Tensor
    top_k: int

    def pairs(self, num_valid: int) -> torch.Tensor:
        return self.order[:num_valid]


def plan_send(topk_ids: torch.Tensor, placement: ExpertPlacement) -> SendPlan:
    """Sort this rank's (token, slot) pairs by (destination rank, local expert, token, slot).

    Since experts are placed contiguously, the global expert id *is* that key, and a stable
    sort on it keeps (token, slot) order within each expert. Masked slots get key E and ids
    outside [-1, E) key E + 1, so both sort last and the invalid ones are counted, not
    silently dropped; counting with scatter_add (not bincount/nonzero) avoids host syncs.
    """
    E = placement.num_experts
    flat = topk_ids.reshape(-1).to(torch.int64)
    key = torch.where((flat >= 0) & (flat < E), flat, torch.where(flat == -1, E, E + 1))
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(E + 2, dtype=torch.int64, device=flat.device).scatter_add_(0, key, torch.ones_like(key))
    return SendPlan(order=order, counts=counts[:E].view(placement.world_size, placement.experts_per_rank),
                    invalid=counts[E + 1], top_k=topk_ids.shape[1])


def segment_offsets(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``total`` rows laid out as consecutive segments of the given lengths: each row's
    segment id and its offset inside the segment. ``total`` (= counts.sum(), known to the
    caller) spares repeat_interleave a host sync."""
    flat = counts.reshape(-1)
    seg = torch.repeat_interleave(torch.arange(flat.numel(), device=flat.device), flat, output_size=total)
    starts = torch.cumsum(flat, 0) - flat
    offset = torch.arange(total, device=flat.device) - starts[seg]
    return seg, offset


def expert_major_positions(recv_counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each received row goes in the expert-major layout.

    ``recv_counts[s, e]``: rows received from source rank s for local expert e; rows arrive
    ordered by (source, expert); ``total`` is their number. Returns, per row, its (local expert, position inside the
    expert, source rank); inside an expert, rows are ordered by source rank, which keeps
    the canonical (source rank, token, slot) order.
    """
    P, E_local = recv_counts.shape
    seg, offset = segment_offsets(recv_counts, total)
    src, expert = seg // E_local, seg % E_local
    # Start of source s inside expert e: rows of e from sources before s.
    src_start = torch.cumsum(recv_counts, 0) - recv_counts  # [P, E_local]
    return expert, src_start[src, expert] + offset, src
