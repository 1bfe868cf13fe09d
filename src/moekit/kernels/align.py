"""Token alignment: group the (token, slot) pairs by expert and pad each expert to the token block.

The kernel runs one CTA per block of ``bm`` rows of one expert. Alignment produces

* ``sorted_ids[capacity]`` int32: pair ids ``token * K + slot`` grouped by expert (experts in
  increasing order, pairs inside an expert by (token, slot)), each expert's segment padded with
  the sentinel ``M * K`` up to a multiple of ``bm``; everything past the real end is sentinel;
* ``block_expert[capacity // bm]`` int32: the expert of each block, -1 past the real end;
* ``num_padded[1]`` int32: the real padded length (a multiple of ``bm``).

Everything stays on the device and no size depends on the routing: ``capacity`` is the upper
bound ``M*K + min(E, M*K) * (bm - 1)`` rounded up to ``bm`` (every non-empty expert wastes at
most ``bm - 1`` rows), so the grid can be launched at ``capacity // bm`` blocks without reading
anything back to the host (no sync, CUDA-graph friendly); blocks past ``num_padded`` exit at
once. Masked slots (id -1) are left out.

Written with torch ops (a stable sort, a scatter-add histogram, cumsums and a searchsorted):
each is one or a few device kernels with shapes fixed by (M, K, E, bm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Alignment:
    """The padded expert-grouped row order the kernel walks (see the module docstring)."""

    sorted_ids: torch.Tensor  # [capacity] int32, pair ids; sentinel = num_pairs
    block_expert: torch.Tensor  # [capacity // bm] int32, -1 past the real end
    num_padded: torch.Tensor  # [1] int32
    bm: int
    num_pairs: int  # M*K (or E*capacity in expert-major): the sentinel value

    @property
    def capacity(self) -> int:
        return self.sorted_ids.shape[0]

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def padded_capacity(num_pairs: int, num_experts: int, bm: int) -> int:
    """Upper bound of the padded length, rounded up to a multiple of ``bm``."""
    bound = num_pairs + min(num_experts, num_pairs) * (bm - 1)
    return -(-bound // bm) * bm


def align_tokens(topk_ids: torch.Tensor, num_experts: int, bm: int) -> Alignment:
    """Sort the pairs of ``topk_ids[M, K]`` by expert and pad each expert to ``bm`` (no host sync).

    Ids must be in [-1, num_experts); out-of-range ids are not checked here (the caller
    validates, see ``moekit.ep.dispatcher.validate_routing``).
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [M, K], got shape {tuple(topk_ids.shape)}")
    if bm < 1:
        raise ValueError(f"bm must be >= 1, got {bm}")
    device = topk_ids.device
    E = num_experts
    num_pairs = topk_ids.numel()
    cap = padded_capacity(num_pairs, E, bm)

    flat = topk_ids.reshape(-1).to(torch.int64)
    # Masked slots get key E, so they sort after every real expert and fall into a dump bin.
    key = torch.where(flat >= 0, flat, torch.full_like(flat, E))
    # Stable sort: inside one expert the pairs keep their flat order token*K + slot, which is
    # the (token, slot) order the tests (and the dispatch layout) expect.
    key_sorted, order = torch.sort(key, stable=True)

    # Per-expert counts by scatter-add (torch.bincount would read the max back to the host).
    counts = torch.zeros(E + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:E]
    padded = (counts + bm - 1) // bm * bm
    start = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    pstart = torch.cumsum(padded, 0) - padded  # first padded row of each expert

    # Destination of the i-th sorted pair: its expert's padded start + its rank in the expert.
    # Masked pairs (key E) are sent to a dump row at index cap, cut off below.
    pos = torch.arange(num_pairs, device=device)
    e_sorted = key_sorted.clamp(max=E - 1)
    dest = pstart[e_sorted] + (pos - start[e_sorted])
    dest = torch.where(key_sorted < E, dest, torch.full_like(dest, cap))

    sorted_ids = torch.full((cap + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:cap]

    # Expert of each block: the number of experts whose padded segment ends at or before the
    # block's first row. Blocks at or past the total padded length get -1.
    pend_blocks = torch.cumsum(padded, 0) // bm
    blocks = torch.arange(cap // bm, device=device, dtype=torch.int64)
    block_expert = torch.searchsorted(pend_blocks, blocks, right=True)
    block_expert = torch.where(block_expert < E, block_expert, torch.full_like(block_expert, -1))
    num_padded = padded.sum().reshape(1)
    return Alignment(sorted_ids, block_expert.to(torch.int32), num_padded.to(torch.int32), bm, num_pairs)


def align_expert_major(counts: torch.Tensor, capacity: int, bm: int) -> Alignment:
    """The alignment of an expert-major buffer ``[E_local, capacity, H]`` (rows already grouped).

    Row ``r`` of expert ``e`` is pair id ``e * capacity + r``. Each expert gets
    ``ceil(capacity / bm)`` blocks whether it uses them or not (the buffer is sized for the
    worst case anyway); rows at or past ``counts[e]`` are sentinels, so their blocks do no
    loads and no stores, and fully empty blocks exit early.
    """
    if counts.dim() != 1:
        raise ValueError(f"counts must be [E_local], got shape {tuple(counts.shape)}")
    E = counts.shape[0]
    device = counts.device
    per_expert = -(-capacity // bm) * bm
    num_pairs = E * capacity
    rows = torch.arange(per_expert, device=device)
    ids = torch.arange(E, device=device).unsqueeze(1) * capacity + rows
    valid = rows < counts.to(torch.int64).clamp(max=capacity).unsqueeze(1)
    sorted_ids = torch.where(valid, ids, torch.full_like(ids, num_pairs)).reshape(-1).to(torch.int32)
    block_expert = torch.arange(E, device=device, dtype=torch.int32).repeat_interleave(per_expert // bm)
    num_padded = torch.full((1,), E * per_expert, dtype=torch.int32, device=device)
    return Alignment(sorted_ids, block_expert, num_padded, bm, num_pairs)
