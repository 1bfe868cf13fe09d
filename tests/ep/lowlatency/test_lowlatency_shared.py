"""One low-latency buffer per process (moekit.ep.lowlatency.pool) on 2 and 4 gloo ranks.

Several layers of different shapes (hidden size, top-k, dtype, FP8 or not, both combine
orders, a bounded receive buffer) share one slot's buffer and run in one step interleaved:
all dispatches first and the combines after them, or dispatch A, dispatch B, combine A,
combine B, ... Every dispatch and combine is checked against the loop reference
(tests/ep/lowlatency/reference.py): received rows, payload, and combine bitwise. The shared
buffer's memory does not change when layers that fit it are added, grows once for a larger
one, and is freed with the last layer; a second slot is a second buffer.
"""

from __future__ import annotations

import pytest
import torch

from moekit.ep import EPLowLatencyAllToAll
from moekit.ep.lowlatency.layout import LowLatencyLayout
from moekit.ep.lowlatency.pool import buffer_report, live_buffers, symm_bytes
from tests.ep.deadline import run_ranks
from tests.ep.lowlatency.reference import (check_dispatch, expected_combine, fake_expert_outputs, meta_to_host,
                                          routing_steps)

GROUP = 16


def configs(world_size: int) -> dict:
    """name -> layer arguments; shapes differ in every size the buffer's regions depend on."""
    P = world_size
    return {
        "A": dict(max_m=6, hidden=32, topk=3, num_experts=4 * P, dtype=torch.bfloat16, online_fp8=True),
        "B": dict(max_m=4, hidden=64, topk=2, num_experts=2 * P, dtype=torch.bfloat16, online_fp8=False,
                  combine_order="rank"),
        "C": dict(max_m=8, hidden=16, topk=1, num_experts=P, dtype=torch.float32, online_fp8=False,
                  recv_capacity=2, spill_rows=1),
        "D": dict(max_m=5, hidden=48, topk=4, num_experts=4 * P, dtype=torch.float16, online_fp8=True),
    }


def _build(cfg: dict, **extra) -> EPLowLatencyAllToAll:
    c = dict(cfg)
    return EPLowLatencyAllToAll(c.pop("max_m"), c.pop("hidden"), c.pop("topk"), c.pop("num_experts"),
                                fp8_group_size=GROUP, **c, **extra)


def _orders(names: list[str], step: int) -> list[tuple[str, str]]:
    """The call order of one step: every dispatch then every combine (in reverse on odd steps),
    or pairs (dispatch A, dispatch B, combine A, combine B, ...)."""
    if step % 3 == 0:
        return [("dispatch", n) for n in names] + [("combine", n) for n in names]
    if step % 3 == 1:
        return [("dispatch", n) for n in names] + [("combine", n) for n in reversed(names)]
    calls = []
    for a, b in zip(names[0::2], names[1::2]):
        calls += [("dispatch", a), ("dispatch", b), ("combine", a), ("combine", b)]
    return calls


def _interleaved(rank: int, world_size: int, num_steps: int) -> dict:
    cfgs = configs(world_size)
    names = list(cfgs)
    layers = {n: _build(c) for n, c in cfgs.items()}
    shared = {id(layer.transport.shared) for layer in layers.values()}
    routing = {n: routing_steps(world_size, num_steps, max_m=c["max_m"], num_experts=c["num_experts"],
                                topk=c["topk"], hidden=c["hidden"], seed=100 + i + world_size, dtype=torch.float32)
               for i, (n, c) in enumerate(cfgs.items())}
    failures: list[str] = []
    checked = 0
    for step in range(num_steps):
        pending = {}
        for call, n in _orders(names, step):
            c, layer = cfgs[n], layers[n]
            kind, xs_f32, ids, ws = routing[n][step]
            xs = [x.to(c["dtype"]) for x in xs_f32]
            where = f"step {step} ({kind}) layer {n} {call}"
            if call == "dispatch":
                d = layer.dispatch(xs[rank], ids[rank], ws[rank])
                failures += [f"{where}: {m}" for m in check_dispatch(
                    d.tokens, d.scales, d.counts, meta_to_host(d.meta), xs, ids, c["num_experts"], rank,
                    fp8=c["online_fp8"], group=GROUP)]
                # the experts run at once; the outputs wait for the combine, after other layers' calls
                pending[n] = (d, fake_expert_outputs(d.tokens, d.scales, d.counts, d.meta.src_rank,
                                                     d.meta.src_token, rank, c["dtype"], GROUP))
            else:
                d, out = pending.pop(n)
                y = layer.combine(out, d) if step % 2 else layer.combine(out, ids[rank], ws[rank], d.meta)
                want = expected_combine(xs, ids, ws, c["num_experts"], rank, fp8=c["online_fp8"], group=GROUP,
                                        dtype=c["dtype"], combine_order=c.get("combine_order", "slot"))
                if not torch.equal(y, want):
                    failures.append(f"{where}: combine differs from the reference")
                checked += 1
    for layer in layers.values():
        layer.finalize()
    return dict(failures=failures, checked=checked, shared=len(shared), left=len(live_buffers()))


@pytest.mark.parametrize("world_size,num_steps", [(2, 9), (4, 6)])
def test_layers_share_one_buffer_interleaved(world_size, num_steps):
    results, _ = run_ranks(_interleaved, world_size, num_steps)
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: {r['failures'][:8]}"
        assert r["checked"] == num_steps * len(configs(world_size))
        assert r["shared"] == 1, "the layers of one slot must share one buffer"
        assert r["left"] == 0, "the last finalize must free the shared buffer"


def _memory(rank: int, world_size: int) -> dict:
    base = dict(max_m=6, hidden=32, topk=3, num_experts=4 * world_size, dtype=torch.bfloat16, online_fp8=False)
    layers = [_build(base)]
    pool = layers[0].transport.shared
    sizes = [pool.nbytes]
    for _ in range(7):  # as many more layers of the same shape: nothing new is allocated
        layers.append(_build(base))
        sizes.append(pool.nbytes)
    same_pool = all(layer.transport.shared is pool for layer in layers)
    generation = pool.generation
    bigger = _build(dict(base, hidden=128))  # a larger layer grows the buffer, once
    grown = (pool.nbytes, pool.generation)
    layers.append(_build(dict(base, hidden=128)))
    after = (pool.nbytes, pool.generation)
    other = _build(base, buffer_slot=1)  # another slot: another buffer
    private = _build(base, buffer_slot=None)  # a buffer of its own
    distinct = other.transport.shared is not pool and private.transport.shared is not pool
    # every layer still works after the growth, on the grown buffer
    failures = []
    steps = routing_steps(world_size, 2, max_m=6, num_experts=base["num_experts"], topk=3, hidden=32, seed=5,
                          dtype=torch.float32)
    for i, (kind, xs_f32, ids, ws) in enumerate(steps):
        xs = [x.to(torch.bfloat16) for x in xs_f32]
        for j, layer in enumerate((layers[0], layers[7], other, private)):
            d = layer.dispatch(xs[rank], ids[rank], ws[rank])
            failures += [f"step {i} layer {j}: {m}" for m in check_dispatch(
                d.tokens, d.scales, d.counts, meta_to_host(d.meta), xs, ids, base["num_experts"], rank, fp8=False,
                group=GROUP)]
            y = layer.combine(fake_expert_outputs(d.tokens, None, d.counts, d.meta.src_rank, d.meta.src_token, rank,
                                                  torch.bfloat16, GROUP), d)
            if not torch.equal(y, expected_combine(xs, ids, ws, base["num_experts"], rank, fp8=False, group=GROUP,
                                                   dtype=torch.bfloat16)):
                failures.append(f"step {i} layer {j}: combine differs from the reference")
    for layer in layers + [bigger, other, private]:
        layer.finalize()
    return dict(sizes=sizes, same_pool=same_pool, generation=generation, grown=grown, after=after,
                distinct=distinct, failures=failures, left=len(live_buffers()))


@pytest.mark.parametrize("world_size", [2, 4])
def test_memory_constant_in_layers(world_size):
    results, _ = run_ranks(_memory, world_size)
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: {r['failures'][:8]}"
        assert r["same_pool"]
        assert len(set(r["sizes"])) == 1, f"the buffer grew with layers of one shape: {r['sizes']}"
        assert r["grown"][0] > r["sizes"][0] and r["grown"][1] == r["generation"] + 1
        assert r["after"] == r["grown"], "a second layer of the larger shape must not grow it again"
        assert r["distinct"]
        assert r["left"] == 0


def test_buffer_report_is_constant_in_layers():
    """The report's shared symmetric bytes are one buffer per slot, sized by the largest layer;
    per layer they grow with the layer count."""
    def layout(**kw):
        args = dict(max_m=64, hidden=256, topk=2, num_experts=8, rank=0, world_size=4, local_world_size=4,
                    dtype=torch.bfloat16, online_fp8=False)
        args.update(kw)
        return LowLatencyLayout(**args)

    small, large = layout(), layout(hidden=512, max_m=128)
    one, many = buffer_report([small]), buffer_report([small] * 56)
    assert many["symm_shared"] == one["symm_shared"] == symm_bytes([small])
    assert many["symm_per_layer"] == 56 * one["symm_per_layer"]
    assert many["local"] == 56 * one["local"]
    mixed = buffer_report([small] * 10 + [large], slots=2)
    assert mixed["symm_shared"] == 2 * symm_bytes([large]) >= 2 * symm_bytes([small])
    assert mixed["shared"] == mixed["symm_shared"] + mixed["local"]
    with pytest.raises(ValueError):
        buffer_report([small], slots=0)


def test_bench_memory_report(capsys):
    """``moekit bench lowlatency --memory`` prints the report's numbers for the preset."""
    from moekit.bench.lowlatency import main
    from moekit.shapes import get_shape

    assert main(["--memory", "--shape", "dit-moe-xl", "--world-size", "4", "--top-k", "1", "--bf16-wire",
                 "--memory-max-m", "4096", "--layers", "56", "--no-record"]) == 0
    out = capsys.readouterr().out
    s = get_shape("dit-moe-xl")
    layout = LowLatencyLayout(max_m=4096, hidden=s.hidden, topk=1, num_experts=s.num_experts, rank=0, world_size=4,
                              local_world_size=4, dtype=torch.bfloat16, online_fp8=False)
    report = buffer_report([layout] * 56)
    row = next(line for line in out.splitlines() if line.startswith("dit-moe-xl"))
    fields = row.split()
    assert float(fields[-2]) == pytest.approx(report["per_layer"] / 2 ** 30, abs=0.01)
    assert float(fields[-1]) == pytest.approx(report["shared"] / 2 ** 30, abs=0.01)
    assert report["per_layer"] > report["shared"]
