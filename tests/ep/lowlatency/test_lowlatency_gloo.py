"""EPLowLatencyAllToAll on 2 and 4 gloo ranks against the loop reference (tests/ep/lowlatency/reference.py).

Every step draws fresh routing (uniform, skewed, masked, empty, T = max_m, repeated experts,
all to one rank, tail masked, all masked) and runs four layers on it — FP8 from bf16 and
fp16, plain bf16 and fp32 — checking per local expert the received rows (sources, slots,
order, payload bitwise or within the e4m3 bound) and combine of a position-dependent fake
expert bitwise against ``weighted_slot_sum`` of the reference's slot outputs. The buffers
must alternate between two phases, and a result must survive the next dispatch.
"""

from __future__ import annotations

import pytest
import torch

from moekit.ep import AllToAllDispatcher, EPLowLatencyAllToAll
from moekit.ep.lowlatency.layout import bits_view
from tests.ep.lowlatency.reference import (KINDS, check_dispatch, expected_combine, fake_expert_outputs, meta_to_host,
                                          routing_steps)

H, GROUP, K = 32, 16, 3
MODES = {  # name: (dtype, online_fp8)
    "fp8<-bf16": (torch.bfloat16, True), "fp8<-fp16": (torch.float16, True),
    "bf16": (torch.bfloat16, False), "fp32": (torch.float32, False),
}


def sizes(world_size: int) -> dict:
    """max_m and experts for a world size (E_local >= K, so 'one_rank' can pick K distinct experts)."""
    return dict(max_m=6, num_experts=4 * world_size) if world_size == 2 else dict(max_m=5, num_experts=3 * world_size)


STEPS = {2: 2 * len(KINDS), 4: len(KINDS), 8: len(KINDS)}  # routing steps per world size


def _steps(world_size: int, num_steps: int):
    s = sizes(world_size)
    return routing_steps(world_size, num_steps, max_m=s["max_m"], num_experts=s["num_experts"], topk=K, hidden=H,
                         seed=world_size, dtype=torch.float32)


def _worker(rank: int, world_size: int, num_steps: int) -> dict:
    s = sizes(world_size)
    E, M = s["num_experts"], s["max_m"]
    # buffer_slot=None: a buffer per layer, so that each layer's receive buffers alternate on their own
    layers = {name: EPLowLatencyAllToAll(M, H, K, E, fp8_group_size=GROUP, dtype=dtype, online_fp8=fp8,
                                         buffer_slot=None)
              for name, (dtype, fp8) in MODES.items()}
    eager = AllToAllDispatcher(E)
    failures: list[str] = []
    pointers = {name: [] for name in MODES}
    previous = {}
    for i, (kind, xs_f32, ids, ws) in enumerate(_steps(world_size, num_steps)):
        for name, layer in layers.items():
            dtype, fp8 = MODES[name]
            xs = [x.to(dtype) for x in xs_f32]
            where = f"step {i} ({kind}) {name}"
            d = layer.dispatch(xs[rank], ids[rank], ws[rank])
            # the other phase's result is untouched by this dispatch
            if name in previous:
                recv, snapshot = previous[name]
                if not torch.equal(bits_view(recv.x), snapshot):  # bits: poisoned rows hold NaN
                    failures.append(f"{where}: the previous step's receive buffer changed")
            recv = d.meta.recv
            previous[name] = (recv, bits_view(recv.x).clone())
            pointers[name].append(recv.x.data_ptr())

            failures += [f"{where}: {m}" for m in check_dispatch(
                d.tokens, d.scales, d.counts, meta_to_host(d.meta), xs, ids, E, rank, fp8=fp8, group=GROUP)]
            out = fake_expert_outputs(d.tokens, d.scales, d.counts, d.meta.src_rank, d.meta.src_token, rank,
                                      dtype, GROUP)
            if i % 2:
                tokens, scales, counts, meta = d  # the paper's API
                y = layer.combine(out, ids[rank], ws[rank], meta)
            else:
                y = layer.combine(out, d)  # the Dispatcher protocol
            want = expected_combine(xs, ids, ws, E, rank, fp8=fp8, group=GROUP, dtype=dtype)
            if not torch.equal(y, want):
                failures.append(f"{where}: combine differs from the reference "
                                f"(max diff {float((y.float() - want.float()).abs().max()) if y.numel() else 0})")
            distinct = all(len(set(r.tolist()) - {-1}) == int((r >= 0).sum()) for x in ids for r in x)
            if not fp8 and distinct:
                failures += _compare_with_eager(eager, d, y, xs[rank], ids[rank], ws[rank], rank, dtype, where)
    return dict(failures=failures, pointers=pointers)


def _compare_with_eager(eager, d, y, x, ids, ws, rank, dtype, where) -> list[str]:
    """With distinct experts per token the valid rows, handle and combine equal AllToAllDispatcher's."""
    want = eager.dispatch(x, ids, ws)
    bad = []
    if not torch.equal(d.counts.long(), want.counts):
        return [f"{where}: counts differ from AllToAllDispatcher"]
    for e, n in enumerate(want.counts.tolist()):
        if not torch.equal(d.tokens[e, :n], want.tokens[e, :n]):
            bad.append(f"{where}: expert {e} rows differ from AllToAllDispatcher")
        for key in ("src_rank", "src_token", "src_slot"):
            if not torch.equal(getattr(d.handle, key)[e, :n], getattr(want.handle, key)[e, :n]):
                bad.append(f"{where}: expert {e} {key} differs from AllToAllDispatcher")
    out_eager = fake_expert_outputs(want.tokens, None, want.counts, want.handle.src_rank, want.handle.src_token,
                                    rank, dtype, GROUP)
    if not torch.equal(eager.combine(out_eager, want), y):
        bad.append(f"{where}: combine differs from AllToAllDispatcher's")
    return bad


# One launch per world size, shared with the other multi-rank tests (tests/rank_pool.py).
@pytest.mark.ranks(lambda world_size: (_worker, STEPS[world_size]))
@pytest.mark.parametrize("world_size,num_steps", sorted(STEPS.items()))
def test_matches_reference_on_gloo(world_size, num_steps, pooled_launch):
    results = pooled_launch()
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}: {result['failures'][:8]}"
        for name, ptrs in result["pointers"].items():
            assert len(set(ptrs)) == 2 and all(ptrs[i] == ptrs[i + 2] for i in range(len(ptrs) - 2)) \
                and all(ptrs[i] != ptrs[i + 1] for i in range(len(ptrs) - 1)), f"{name}: buffers do not alternate"
