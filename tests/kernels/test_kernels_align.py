"""Token alignment against a plain Python reference: the torch ops and the Triton kernels.

The Triton kernels run in the interpreter on CPU (tests/kernels/__init__.py sets it), so the
sizes stay small; the GPU run of this file covers the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from moekit.kernels import align as align_mod
from moekit.kernels.align import align_expert_major, align_tokens, padded_capacity
from moekit.routing.generate import synthetic_routing


def _reference(ids: torch.Tensor, E: int, bm: int) -> tuple[list[int], list[int]]:
    """Padded sorted pair ids and the expert of each real block, written as plainly as possible."""
    M, K = ids.shape
    sentinel = M * K
    ids = ids.tolist()  # plain ints (indexing a tensor element by element is slow)
    rows, blocks = [], []
    for e in range(E):
        seg = [t * K + k for t in range(M) for k in range(K) if ids[t][k] == e]
        if not seg:
            continue
        n_blocks = -(-len(seg) // bm)
        rows += seg + [sentinel] * (n_blocks * bm - len(seg))
        blocks += [e] * n_blocks
    return rows, blocks


IMPLS = ["torch"] + (["triton"] if align_mod.HAVE_TRITON else [])


@pytest.fixture(params=IMPLS)
def align(request):
    return getattr(align_mod, f"align_tokens_{request.param}")


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check(ids, E, bm, align=align_tokens):
    ids = ids.to(_device())
    al = align(ids, E, bm)
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
def test_align_matches_reference(align, bm, beta):
    ids, _ = synthetic_routing(37, 8, 2, beta=beta, seed=bm)
    _check(ids, 8, bm, align)


def test_align_masked_slots_and_empty_experts(align):
    ids = torch.tensor([[0, -1], [3, 0], [-1, -1], [3, 5]])
    _check(ids, 8, 16, align)  # experts 1, 2, 4, 6, 7 are empty
    assert int(align(ids.to(_device()), 8, 16).num_padded) == 3 * 16


def test_align_bad_ids_go_to_expert_zero(align):
    """Only -1 is masked: ids E, -2 and an int64 2**40 (no wrap to int32) are aligned as expert
    0 (the kernels then weight those slots NaN), next to expert 0's real pairs in (token, slot)
    order."""
    E = 4
    ids = torch.tensor([[1, 0], [E, -1], [-2, 3], [2**40, 0], [2, -1]], dtype=torch.int64)
    as_routed = torch.tensor([[1, 0], [0, -1], [0, 3], [0, 0], [2, -1]], dtype=torch.int64)
    al = align(ids.to(_device()), E, 16)
    rows, blocks = _reference(as_routed, E, 16)
    n = int(al.num_padded)
    assert al.sorted_ids[:n].tolist() == rows and al.block_expert[:n // 16].tolist() == blocks


def test_align_all_masked_and_single_token(align):
    _check(torch.full((3, 2), -1), 4, 16, align)
    _check(torch.tensor([[2]]), 4, 16, align)
    _check(torch.tensor([[1, 0, 3]], dtype=torch.int32), 4, 32, align)


def test_align_exact_multiple_needs_no_padding(align):
    al = align(torch.zeros(16, 1, dtype=torch.int64, device=_device()), 2, 16)
    assert int(al.num_padded) == 16 and al.sorted_ids[:16].tolist() == list(range(16))


def test_align_upper_bound_is_tight_when_every_expert_has_one_pair(align):
    al = align(torch.arange(8, device=_device()).reshape(8, 1), 8, 16)
    assert int(al.num_padded) == al.capacity == 8 * 16


# The Triton path scans SCAN pairs per chunk (align._MAX_SCAN, 1024). In the interpreter each
# chunk's tl.sort of SCAN keys costs seconds, so there the scan is cut to INTERPRETER_SCAN pairs
# and M by the same factor (rounded up): the chunk counts stay 3, 3 and 2, each with a partial
# last chunk. The compiled kernels meet SCAN = 1024 with many chunks in tests/gpu/test_align_gpu.py.
INTERPRETER_SCAN = 128


@pytest.mark.parametrize("M,K,E,bm", [(700, 3, 20, 16), (300, 8, 256, 64), (129, 8, 61, 128)])
def test_align_many_chunks_and_many_experts(align, M, K, E, bm, monkeypatch):
    # M*K > SCAN gives the Triton path several chunks (running offsets across chunks); E = 256
    # needs 512 histogram bins; skewed routing leaves experts empty; -1 slots sprinkled in.
    if align is getattr(align_mod, "align_tokens_triton", None) and _device() == "cpu":
        factor = align_mod._MAX_SCAN // INTERPRETER_SCAN
        monkeypatch.setattr(align_mod, "_MAX_SCAN", INTERPRETER_SCAN)
        M = -(-M // factor)
        assert M * K > INTERPRETER_SCAN
    ids, _ = synthetic_routing(M, E, K, beta=0.3, seed=M)
    ids[torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.1] = -1
    _check(ids, E, bm, align)


@pytest.mark.skipif(not align_mod.HAVE_TRITON, reason="needs Triton")
@pytest.mark.parametrize("seed", range(3))
def test_align_triton_equals_torch(seed):
    g = torch.Generator().manual_seed(seed)
    M = int(torch.randint(1, 400, (1,), generator=g))
    ids = torch.randint(-1, 32, (M, 4), generator=g).to(_device())
    a, b = align_mod.align_tokens_triton(ids, 32, 32), align_mod.align_tokens_torch(ids, 32, 32)
    assert torch.equal(a.sorted_ids, b.sorted_ids)
    assert torch.equal(a.block_expert, b.block_expert)
    assert torch.equal(a.num_padded, b.num_padded)


def test_align_rejects_bad_arguments(align):
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        align(torch.zeros(4, dtype=torch.int64), 8, 16)
    with pytest.raises(ValueError, match="int32 or int64"):
        align(torch.zeros(4, 2), 8, 16)
    with pytest.raises(ValueError, match="bm"):
        align(torch.zeros(4, 2, dtype=torch.int64), 8, 0)


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
    # blocks without a valid row are marked -1 (the kernels skip them)
    assert al.block_expert.tolist() == [0, -1, -1, -1, 2, 2]
