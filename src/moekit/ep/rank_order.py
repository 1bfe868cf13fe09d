"""The two halves of ``combine_order="rank"``, as the dispatchers run them (vectorized, fixed
shapes, no host reads, so they can be captured in a CUDA graph).

* :func:`partial_rows`, on the rank that ran the experts: for each (token, this rank)
  group, the weighted outputs of the token's slots held here, summed in float32 in slot
  order and rounded once. One row per group is what travels back.
* :func:`sum_partials`, on the token's rank: the partials of its ranks added in float32 in
  rank order and rounded once.

The definition they must match bitwise is :func:`moekit.ep.dispatcher.weighted_rank_sum`;
the same elementwise float32 operations in the same order give the same bits.
"""

from __future__ import annotations

import torch


def partial_rows(slot_rows: torch.Tensor, weights: torch.Tensor, present: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """``[G, H]`` in ``out_dtype``: per group g, ``sum_k w[g, k] * rows[g, k]`` over the slots
    ``present[g, k]``, k = 0..K-1 in order, accumulated in float32 from 0.

    ``slot_rows [G, K, H]`` (rows of absent slots are never read into the sum, NaN
    included), ``weights [G, K]`` (any float dtype, taken as float32), ``present [G, K]`` bool.
    """
    G, K, H = slot_rows.shape
    acc = torch.zeros(G, H, dtype=torch.float32, device=slot_rows.device)
    w = weights.to(torch.float32)
    for k in range(K):
        term = slot_rows[:, k].to(torch.float32) * w[:, k : k + 1]
        acc = torch.where(present[:, k : k + 1], acc + term, acc)
    return acc.to(out_dtype)


def sum_partials(partials: torch.Tensor, present: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, H]``: per token, the partials ``present[t, j]`` added in float32 in order j, from 0.

    ``partials [T, R, H]`` hold a token's partial rows in rank order (column j is the j-th
    rank in increasing rank order that holds slots of the token, or rank j itself when
    R = world size); absent columns are never read into the sum.
    """
    T, R, H = partials.shape
    acc = torch.zeros(T, H, dtype=torch.float32, device=partials.device)
    for j in range(R):
        acc = torch.where(present[:, j : j + 1], acc + partials[:, j].to(torch.float32), acc)
    return acc.to(out_dtype)


def rank_hits(owner: torch.Tensor, world_size: int) -> torch.Tensor:
    """``[T, world_size]`` bool: token t has a slot on rank d. ``owner [T, K]`` int64 is each
    slot's rank, any value outside [0, world_size) for a slot that goes nowhere."""
    T = owner.shape[0]
    target = torch.where((owner >= 0) & (owner < world_size), owner, world_size)
    hit = torch.zeros(T, world_size + 1, dtype=torch.bool, device=owner.device)
    hit.scatter_(1, target, True)
    return hit[:, :world_size]


def rank_columns(hit: torch.Tensor) -> torch.Tensor:
    """``[T, P]`` int64: for each (token, rank d) the column of d among the token's ranks in
    rank order (the number of its ranks below d); meaningful where ``hit``."""
    as_int = hit.to(torch.int64)
    return torch.cumsum(as_int, 1) - as_int


def compact_width(top_k: int, world_size: int) -> int:
    """Most ranks one token's slots can reach: ``min(K, P)``, the columns of a rank-order
    receive buffer per token."""
    return max(1, min(top_k, world_size))
