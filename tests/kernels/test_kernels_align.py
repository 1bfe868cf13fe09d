"""Token alignment against a plain Python reference (torch only; no Triton needed)."""

from __future__ import annotations

import pytest
import torch

from moekit.kernels.align import align_expert_major, align_tokens, padded_capacity
from moekit.routing.generate import synthetic_routing


def _reference(ids: torch.Tensor, E: int, bm: int) -> tuple[list[int], list[int]]:
    """Padded sorted pair ids and the expert of each real block, written as plainly as possible."""
    M, K = ids.shape
    sentinel = M * K
    rows, blocks = [], []
    for e in range(E):
        seg = [t * K + k for t in range(M) for k in range(K) if int(ids[t, k]) == e]
        if not seg:
            continue
        n_blocks = -(-len(seg) // bm)
        rows += seg + [sentinel] * (n_blocks * bm - len(seg))
        blocks += [e] * n_blocks
    return rows, blocks


def _check(ids, E, bm):
    al = align_tokens(ids, E, bm)
    M, K = ids.shape
    rows, blocks = _reference(ids, E, bm)
    n = int(al.num_padded)
    assert n == len(rows) and n % bm == 0
    assert al.capacity == padded_capacity(M * K, E, bm) and al.capacity % bm == 0
    assert n <= al.capacity
    assert al.sorted_ids[:n].tolist() == rows
    assert (al.sorted_ids[n:] == M * K).all()  # past the end: sentinel only
    assert al.block_expert[: n // bm].tolist() == blocks
    assert (al.block_expert[n // bm :] == -1).all()
    # every unmasked pair appears exactly once
    real = al.sorted_ids[al.sorted_ids < M * K]
    expected = (ids.reshape(-1) >= 0).nonzero().reshape(-1)
    assert sorted(real.tolist()) == expected.tolist()
    assert al.sorted_ids.dtype == torch.int32 and al.block_expert.dtype == torch.int32


@pytest.mark.parametrize("bm", [16, 32, 64, 128])
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_align_matches_reference(bm, beta):
    ids, _ = synthetic_routing(37, 8, 2, beta=beta, seed=bm)
    _check(ids, 8, bm)


def test_align_masked_slots_and_empty_experts():
    ids = torch.tensor([[0, -1], [3, 0], [-1, -1], [3, 5]])
    _check(ids, 8, 16)  # experts 1, 2, 4, 6, 7 are empty
    al = align_tokens(ids, 8, 16)
    assert int(al.num_padded) == 3 * 16


def test_align_all_masked_and_single_token():
    _check(torch.full((3, 2), -1), 4, 16)
    _check(torch.tensor([[2]]), 4, 16)
    _check(torch.tensor([[1, 0, 3]], dtype=torch.int32), 4, 32)


def test_align_exact_multiple_needs_no_padding():
    ids = torch.zeros(16, 1, dtype=torch.int64)
    al = align_tokens(ids, 2, 16)
    assert int(al.num_padded) == 16 and al.sorted_ids[:16].tolist() == list(range(16))


def test_align_upper_bound_is_tight_when_every_expert_has_one_pair():
    ids = torch.arange(8).reshape(8, 1)
    al = align_tokens(ids, 8, 16)
    assert int(al.num_padded) == al.capacity == 8 * 16


def test_align_expert_major():
    counts = torch.tensor([3, 0, 20])
    al = align_expert_major(counts, capacity=20, bm=16)
    cap = 20
    per = 32
    assert al.capacity == 3 * per and al.num_pairs == 3 * cap
    for e in range(3):
        seg = al.sorted_ids[e * per : (e + 1) * per].tolist()
        n = int(counts[e])
        assert seg[:n] == [e * cap + r for r in range(n)]
        assert all(v == 3 * cap for v in seg[n:])
    assert al.block_expert.tolist() == [0, 0, 1, 1, 2, 2]
