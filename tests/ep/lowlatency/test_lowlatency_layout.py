"""postprocess / fan_out / topk_reduce / destinations on hand-made receive buffers, one process.

The receive buffers stand in for what P sources sent: rows past a source's T hold random
ids (this rank's experts included) and random payload, which postprocess must ignore.
"""

from __future__ import annotations

import pytest
import torch

from moekit.ep.dispatcher import weighted_slot_sum
from moekit.ep.lowlatency.layout import (FP8_DTYPE, LowLatencyLayout, RecvBuffers, destinations, fan_out,
                                         postprocess, topk_reduce)
from tests.ep.lowlatency.reference import expected_rows

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # hypothesis is a test extra
    given = None


def _recv(P, M, K, E, H, rank, seed, masked=0.2, dup=0.2, fp8=False, group=4):
    g = torch.Generator().manual_seed(seed)
    num_tokens = torch.randint(0, M + 1, (P,), generator=g)
    ids = torch.randint(0, E, (P, M, K), generator=g)
    ids = torch.where(torch.rand(P, M, K, generator=g) < masked, -1, ids)
    repeat = torch.rand(P, M, generator=g) < dup  # the last slot repeats the first
    ids[..., -1] = torch.where(repeat, ids[..., 0], ids[..., -1])
    layout = LowLatencyLayout(max_m=M, hidden=H, topk=K, num_experts=E, rank=rank, world_size=P,
                              local_world_size=P, group_size=group, dtype=torch.float32, online_fp8=fp8)
    x = torch.randn(P, M, H, generator=g)
    scales = torch.rand(P, M, H // group, generator=g) if fp8 else None
    recv = RecvBuffers(x=x.to(FP8_DTYPE) if fp8 else x, scales=scales, ids=ids.to(torch.int32),
                       num_tokens=num_tokens.to(torch.int32))
    live_ids = [ids[s, : int(num_tokens[s])] for s in range(P)]
    return layout, recv, live_ids


def _check(P, M, K, E_local, H, rank, seed, masked, dup, fp8):
    E = E_local * P
    layout, recv, live_ids = _recv(P, M, K, E, H, rank, seed, masked, dup, fp8)
    meta = postprocess(recv, layout)
    tokens, scales = fan_out(recv, meta, layout)
    assert tokens.shape == (E_local, P * M, H) and tokens.dtype == recv.x.dtype
    want = expected_rows(live_ids, E, rank)
    assert meta.counts.tolist() == [len(r) for r in want]
    for e, rows in enumerate(want):
        n = len(rows)
        got = list(zip(meta.src_rank[e, :n].tolist(), meta.src_token[e, :n].tolist(), meta.src_slot[e, :n].tolist(),
                       meta.slot_bits[e, :n].tolist()))
        assert got == rows
        for key in ("src_rank", "src_token", "src_slot", "slot_bits", "row_index"):
            assert bool((getattr(meta, key)[e, n:] == -1).all()), key
        assert meta.row_index[e, :n].tolist() == [s * M + t for s, t, _, _ in rows]
        counts = [sum(1 for r in rows if r[0] == s) for s in range(P)]
        assert meta.layout_range[e].tolist() == [[c, sum(counts[:s])] for s, c in enumerate(counts)]
        for r, (s, t, _, _) in enumerate(rows):  # payload bitwise, scales too
            assert torch.equal(tokens[e, r].view(torch.uint8), recv.x[s, t].view(torch.uint8))
            if fp8:
                assert torch.equal(scales[e, r], recv.scales[s, t])
    # slot_row: each live slot naming a local expert points at the row serving it
    for s in range(P):
        for t in range(M):
            for k in range(K):
                gid = int(recv.ids[s, t, k])
                e = gid - rank * E_local
                if t < int(recv.num_tokens[s]) and 0 <= e < E_local:
                    r = [(a, b) for a, b, _, _ in want[e]].index((s, t))
                    assert int(meta.slot_row[s, t, k]) == e * P * M + r
                else:
                    assert int(meta.slot_row[s, t, k]) == -1
    assert (scales is None) == (not fp8)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("P,rank", [(1, 0), (2, 1), (4, 2)])
def test_postprocess_and_fan_out(P, rank, fp8):
    _check(P, M=5, K=3, E_local=3, H=8, rank=rank, seed=P * 10 + rank, masked=0.2, dup=0.3, fp8=fp8)


if given is not None:
    @settings(max_examples=60, deadline=None)
    @given(P=st.integers(1, 4), M=st.integers(1, 6), K=st.integers(1, 5), E_local=st.integers(1, 4),
           rank_seed=st.integers(0, 3), seed=st.integers(0, 2**16), masked=st.floats(0, 1), dup=st.floats(0, 1),
           fp8=st.booleans())
    def test_postprocess_and_fan_out_random(P, M, K, E_local, rank_seed, seed, masked, dup, fp8):
        _check(P, M, K, E_local, 8, rank_seed % P, seed, masked, dup, fp8)


def test_thirty_two_slots_on_one_expert():
    """K = 32 slots naming one expert: one row, every bit set (bit 31 makes the int32 negative)."""
    layout = LowLatencyLayout(max_m=2, hidden=4, topk=32, num_experts=2, rank=0, world_size=1, local_world_size=1,
                              group_size=4, dtype=torch.float32, online_fp8=False)
    ids = torch.zeros(1, 2, 32, dtype=torch.int32)
    ids[0, 1] = torch.arange(32) % 2  # token 1: expert 0 in even slots, expert 1 in odd ones
    recv = RecvBuffers(x=torch.randn(1, 2, 4), scales=None, ids=ids, num_tokens=torch.tensor([2], dtype=torch.int32))
    meta = postprocess(recv, layout)
    assert meta.counts.tolist() == [2, 1]
    assert meta.slot_bits[0, :2].tolist() == [-1, 0x55555555]
    assert int(meta.slot_bits[1, 0]) == -0x55555556  # 0xAAAAAAAA as int32
    assert meta.src_slot[:, 0].tolist() == [0, 1]


def test_topk_reduce_is_weighted_slot_sum_of_the_first_rows():
    g = torch.Generator().manual_seed(3)
    slot_rows = torch.randn(6, 3, 5, generator=g).bfloat16()
    slot_rows[4:] = float("nan")  # rows past T are never read
    ids = torch.tensor([[0, -1, 2], [1, 1, -1], [-1, -1, -1], [3, 0, 1]])
    w = torch.rand(4, 3, generator=g)
    assert torch.equal(topk_reduce(slot_rows, ids, w, torch.bfloat16),
                       weighted_slot_sum(slot_rows[:4], ids, w, torch.bfloat16))
    assert torch.equal(topk_reduce(slot_rows, ids[:0], w[:0], torch.float32), torch.zeros(0, 5))


def test_destinations_send_once_per_rank():
    layout = LowLatencyLayout(max_m=4, hidden=4, topk=3, num_experts=8, rank=0, world_size=4, local_world_size=4,
                              group_size=4)
    ids = torch.tensor([[0, 1, 7], [-1, -1, -1], [2, 3, -1], [5, 5, 4]])
    assert destinations(ids, layout).tolist() == [
        [True, False, False, True], [False] * 4, [False, True, False, False], [False, False, True, False]]


@pytest.mark.parametrize("bad,match", [
    (dict(max_m=0), "max_m"), (dict(hidden=0), "hidden"), (dict(topk=33), r"topk must be an int in \[1, 32\]"),
    (dict(num_experts=6), "num_experts=6 must be a multiple of world_size=4"), (dict(rank=4), r"rank .*\[0, 3\]"),
    (dict(local_world_size=3), "local_world_size=3 must divide"), (dict(hidden=40), "multiple of group_size=16"),
    (dict(dtype=torch.float64), "dtype must be one of"), (dict(online_fp8=1), "online_fp8 must be a bool"),
    (dict(max_m=2.0), "max_m must be an int"),
])
def test_layout_validation(bad, match):
    args = dict(max_m=4, hidden=32, topk=2, num_experts=8, rank=0, world_size=4, local_world_size=4,
                group_size=16) | bad
    with pytest.raises(ValueError, match=match):
        LowLatencyLayout(**args)


def test_layout_sizes():
    L = LowLatencyLayout(max_m=128, hidden=7168, topk=8, num_experts=256, rank=1, world_size=2, local_world_size=2)
    assert (L.experts_per_rank, L.capacity, L.num_groups, L.first_expert) == (128, 256, 56, 128)
    assert L.wire_dtype == FP8_DTYPE and L.token_bytes == 7168 + 4 * 56 and L.combine_row_bytes == 2 * 7168
    # hidden need not be a multiple of the group without FP8
    LowLatencyLayout(max_m=1, hidden=100, topk=1, num_experts=1, rank=0, world_size=1, local_world_size=1,
                     online_fp8=False)
