"""Capacity-bounded receive buffers of the low-latency layer (``recv_capacity``, spill rounds).

On 2 and 4 gloo ranks (one launch each), every routing kind of the gloo tests runs through
layers with a bounded receive buffer — capacity 1 with one-row spill rounds (forced
overflow: nearly every token spills, up to max_m - 1 rounds), capacity 2 with 3-row rounds,
and a capacity no step exceeds — in both combine orders, FP8 and plain wires. Each step is
compared with ``torch.equal`` against the worst-case layer run on the same inputs (counts,
valid rows, scales, meta, and combine of a position-dependent fake expert) and against the
loop reference; the overflow the layer counts on the device and its spill rounds are
checked against counts made here from the routing of every rank.

Single-process parts: the stream windows against a loop, and the buffer sizes the layout
reports against the segments the gloo transport really allocates.
"""

from __future__ import annotations

import pytest
import torch

from moekit.ep import EPLowLatencyAllToAll
from moekit.ep.lowlatency.layout import LowLatencyLayout, window_tokens
from tests.ep.lowlatency.reference import (KINDS, check_dispatch, expected_combine, fake_expert_outputs, meta_to_host,
                                          routing_steps)

H, GROUP, K, M = 32, 16, 3, 6
MODES = {"fp8<-bf16": (torch.bfloat16, True), "fp32": (torch.float32, False)}
BOUNDS = {"C=1,S=1": (1, 1), "C=2,S=3": (2, 3), f"C={M - 1}": (M - 1, None)}
META = ("counts", "src_rank", "src_token", "src_slot", "slot_bits", "row_index", "layout_range", "slot_row")


def _expected_overflow(ids, num_experts: int, world_size: int, capacity: int, spill: int, rank: int):
    """Tokens of each source past ``capacity`` that come to ``rank``, and the spill rounds of
    the step (the largest overflow over every (source, destination) pair), counted by loops."""
    per_rank = num_experts // world_size
    counts = [[0] * world_size for _ in range(world_size)]
    for s, i in enumerate(ids):
        for t in range(i.shape[0]):
            for d in {int(e) // per_rank for e in i[t].tolist() if e >= 0}:
                counts[s][d] += 1
    over = [max(counts[s][rank] - capacity, 0) for s in range(world_size)]
    largest = max(max(c - capacity, 0) for row in counts for c in row)
    return sum(over), -(-largest // spill)


def _num_steps(world_size: int) -> int:
    """Every routing kind once, and on 2 ranks four more steps (the 4-rank run repeats what they add)."""
    return len(KINDS) + (4 if world_size == 2 else 0)


def _worker(rank: int, world_size: int) -> dict:
    E = 4 * world_size
    steps = routing_steps(world_size, _num_steps(world_size), max_m=M, num_experts=E, topk=K, hidden=H, seed=11,
                          dtype=torch.float32)
    failures, rounds_seen, compared = [], set(), 0
    for order in ("slot", "rank"):
        for mode, (dtype, fp8) in MODES.items():
            common = dict(fp8_group_size=GROUP, dtype=dtype, online_fp8=fp8, combine_order=order)
            full = EPLowLatencyAllToAll(M, H, K, E, **common)
            bounded = {name: EPLowLatencyAllToAll(M, H, K, E, recv_capacity=c, spill_rows=s, **common)
                       for name, (c, s) in BOUNDS.items()}
            for name, layer in bounded.items():
                if not layer.transport.message_bytes < full.transport.message_bytes:
                    failures.append(f"{name}: the bounded dispatch message is not smaller")
            for i, (kind, xs_f32, ids, ws) in enumerate(steps):
                xs = [x.to(dtype) for x in xs_f32]
                d_full = full.dispatch(xs[rank], ids[rank], ws[rank])
                out = fake_expert_outputs(d_full.tokens, d_full.scales, d_full.counts, d_full.meta.src_rank,
                                          d_full.meta.src_token, rank, dtype, GROUP)
                y_full = full.combine(out, d_full)
                want = expected_combine(xs, ids, ws, E, rank, fp8=fp8, group=GROUP, dtype=dtype, combine_order=order)
                if not torch.equal(y_full, want):
                    failures.append(f"{order} {mode} step {i}: the worst-case layout differs from the reference")
                for name, layer in bounded.items():
                    where = f"{order} {mode} {name} step {i} ({kind})"
                    d = layer.dispatch(xs[rank], ids[rank], ws[rank])
                    failures += [f"{where}: {m}" for m in check_dispatch(
                        d.tokens, d.scales, d.counts, meta_to_host(d.meta), xs, ids, E, rank, fp8=fp8, group=GROUP)]
                    for key in META:
                        if not torch.equal(getattr(d.meta, key), getattr(d_full.meta, key)):
                            failures.append(f"{where}: meta.{key} differs from the worst-case layout's")
                    for e, n in enumerate(d_full.counts.tolist()):
                        if not torch.equal(d.tokens[e, :n].view(torch.uint8) if fp8 else d.tokens[e, :n],
                                           d_full.tokens[e, :n].view(torch.uint8) if fp8 else d_full.tokens[e, :n]):
                            failures.append(f"{where}: expert {e}'s rows differ from the worst-case layout's")
                        if fp8 and not torch.equal(d.scales[e, :n], d_full.scales[e, :n]):
                            failures.append(f"{where}: expert {e}'s scales differ from the worst-case layout's")
                    c, s = layer.layout.recv_rows, layer.layout.spill_rows_per_round
                    over, rounds = _expected_overflow(ids, E, world_size, c, s, rank)
                    state = d.handle.state
                    if (int(state["overflow_tokens"]), state["spill_rounds"]) != (over, rounds):
                        failures.append(f"{where}: overflow {int(state['overflow_tokens'])} tokens in "
                                        f"{state['spill_rounds']} rounds, expected {over} in {rounds}")
                    rounds_seen.add((name, rounds))
                    y = layer.combine(out, d) if i % 2 else layer.combine(out, ids[rank], ws[rank], d.meta)
                    if not torch.equal(y, y_full):
                        failures.append(f"{where}: combine differs from the worst-case layout's")
                    compared += 1
    return dict(failures=failures, rounds=sorted(rounds_seen), compared=compared)


# One launch per world size, shared with the other multi-rank tests (tests/rank_pool.py).
@pytest.mark.ranks(lambda: (_worker,), deadline=900, timeout=60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_bounded_equals_worst_case_layout(world_size, pooled_launch):
    results = pooled_launch()
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}: {result['failures'][:8]}"
        assert result["compared"] == 2 * len(MODES) * len(BOUNDS) * _num_steps(world_size)
    rounds = dict()
    for name, r in results[0]["rounds"]:
        rounds.setdefault(name, set()).add(r)
    assert max(rounds["C=1,S=1"]) >= 3  # forced overflow: several spill rounds in one step
    assert 0 in rounds["C=1,S=1"] and max(rounds["C=2,S=3"]) >= 1  # steps that spill and steps that do not


# -- single process ----------------------------------------------------------------------------


def test_window_tokens_against_a_loop():
    g = torch.Generator().manual_seed(0)
    needed = torch.rand(13, 4, generator=g) < 0.6
    for first, rows in ((0, 3), (3, 2), (5, 6), (12, 4)):
        table = window_tokens(needed, first, rows)
        for n in range(4):
            stream = [t for t in range(13) if needed[t, n]]
            want = stream[first:first + rows]
            assert table[n].tolist() == want + [-1] * (rows - len(want))


def test_buffer_bytes_follow_the_layout():
    """deepseek-v3 sizes on 64 ranks: the worst case by hand, the bounded regions smaller by
    the rows they drop, and the gloo transport's message segments the layout's."""
    common = dict(max_m=128, hidden=7168, topk=8, num_experts=256, rank=0, world_size=64, local_world_size=64)
    worst = LowLatencyLayout(**common)
    region = worst.receive_region_bytes()
    assert region["tokens"] == 64 * 128 * 7168 and region["scales"] == 64 * 128 * 56 * 4
    assert region["routing"] == 64 * 128 * 8 * 4 and region["combine"] == 128 * 8 * 7168 * 2
    assert region["spill_tokens"] == region["weights"] == 0
    bounded = LowLatencyLayout(**common, recv_capacity=32, spill_rows=8, combine_order="rank")
    b = bounded.receive_region_bytes()
    assert b["tokens"] + b["spill_tokens"] == 64 * (32 + 8) * 7168 and b["weights"] == region["routing"]
    assert b["combine"] == region["combine"]  # min(K, P) = K partials per token here
    assert bounded.buffer_bytes()["receive"] < worst.buffer_bytes()["receive"]
    assert bounded.buffer_bytes()["result"] == worst.buffer_bytes()["result"]  # the expert-major result is exact
    assert bounded.max_spill_rounds == (128 - 32) // 8


def test_gloo_messages_hold_the_layout_segments():
    from moekit.ep.lowlatency.gloo import GlooTransport

    for kwargs in (dict(), dict(recv_capacity=2, spill_rows=2, combine_order="rank")):
        layout = LowLatencyLayout(max_m=6, hidden=32, topk=3, num_experts=4, rank=0, world_size=1,
                                  local_world_size=1, group_size=16, **kwargs)
        transport = GlooTransport(layout)
        region = layout.receive_region_bytes()
        main = transport._main.x_bytes + transport._main.scale_bytes
        assert main == region["tokens"] + region["scales"]  # 16-byte multiples at these sizes
        assert transport._spill.nbytes == region["spill_tokens"] + region["spill_scales"]
        # one rank: the gloo combine message is the combine region (K slot rows, or one partial, per token)
        assert transport._combine_recv[0].numel() * 2 == region["combine"]


@pytest.mark.parametrize("bad,match", [
    (dict(recv_capacity=0), "recv_capacity must be an int in"), (dict(recv_capacity=7), "recv_capacity must be"),
    (dict(spill_rows=2), "spill_rows needs recv_capacity"),
    (dict(recv_capacity=2, spill_rows=0), "spill_rows must be an int in"),
])
def test_bad_bounds_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        EPLowLatencyAllToAll(6, 32, 3, 4, online_fp8=False, **bad)
