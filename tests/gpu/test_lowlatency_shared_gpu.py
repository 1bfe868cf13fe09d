"""One low-latency buffer per process on 2 GPUs (NCCL group, symmetric-memory transport).

1. Several layers of different shapes (hidden, top-k, dtype, FP8 or not, both combine
   orders) share slot 0's symmetric buffer and run interleaved in each step (dispatch A,
   dispatch B, combine A, combine B; every dispatch then every combine, which launches the
   combines after the first with the peer barrier; one after the other), on the gloo tests'
   routing kinds (empty ranks included): received rows against the loop reference
   (tests/ep/lowlatency/reference.py), combine bitwise. The buffer is one allocation, the
   same size whatever the number of layers.
2. A soak: 8 layers sharing the buffer, ``MOEKIT_LL_SOAK_STEPS`` (default 10,000) layer steps
   eager (random T, zero included, random interleaving) and as many under CUDA-graph replay
   (one graph holding a round of the 8 layers, new routing written into its inputs before
   each replay). Each combine is checked bitwise on the device against ``weighted_slot_sum``
   (``weighted_rank_sum``) of an expert whose output depends only on (expert, source rank,
   source token), computed on the source rank alone; mismatches are counted on the GPU and
   read once at the end.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from moekit.ep import EPLowLatencyAllToAll, current_device, launch
from moekit.ep.dispatcher import weighted_rank_sum, weighted_slot_sum
from tests.ep.lowlatency.reference import (KINDS, check_dispatch, expected_combine, fake_expert_outputs, meta_to_host,
                                          routing_steps)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)

SOAK_STEPS = int(os.environ.get("MOEKIT_LL_SOAK_STEPS", "10000"))
GROUP = 128


def _setup_env() -> None:
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)  # never NVLink multicast (inherited by the ranks)


# -- 1. several layers, interleaved, against the reference -------------------------------------

LAYERS = {
    "fp8-k4": dict(max_m=8, hidden=256, topk=4, num_experts=16, dtype=torch.bfloat16, online_fp8=True),
    "bf16-rank": dict(max_m=6, hidden=512, topk=2, num_experts=8, dtype=torch.bfloat16, online_fp8=False,
                      combine_order="rank"),
    "fp32-k1": dict(max_m=12, hidden=128, topk=1, num_experts=4, dtype=torch.float32, online_fp8=False),
    "bf16-k3": dict(max_m=5, hidden=384, topk=3, num_experts=16, dtype=torch.bfloat16, online_fp8=False),
}


def _build(cfg: dict) -> EPLowLatencyAllToAll:
    c = dict(cfg)
    return EPLowLatencyAllToAll(c.pop("max_m"), c.pop("hidden"), c.pop("topk"), c.pop("num_experts"),
                                fp8_group_size=GROUP, **c)


def _orders(names, step: int):
    if step % 3 == 0:
        calls = []
        for a, b in zip(names[0::2], names[1::2]):
            calls += [("d", a), ("d", b), ("c", a), ("c", b)]
        return calls
    if step % 3 == 1:
        return [("d", n) for n in names] + [("c", n) for n in reversed(names)]
    return [call for n in names for call in (("d", n), ("c", n))]


def _interleaved(rank: int, world_size: int) -> dict:
    device = current_device()
    names = list(LAYERS)
    first = _build(LAYERS[names[0]])
    pool = first.transport.shared
    layers = {names[0]: first}
    for n in names[1:]:
        layers[n] = _build(LAYERS[n])
    grown = pool.nbytes
    for j in range(4):  # more layers of shapes already there: the buffer stays as it is
        layers[f"extra{j}"] = _build(LAYERS[names[j % len(names)]])
    same_size = pool.nbytes == grown and all(layer.transport.shared is pool for layer in layers.values())
    num_steps = 2 * len(KINDS)
    routing = {n: routing_steps(world_size, num_steps, max_m=c["max_m"], num_experts=c["num_experts"],
                                topk=c["topk"], hidden=c["hidden"], seed=20 + i, dtype=torch.float32)
               for i, (n, c) in enumerate(LAYERS.items())}
    failures, checked = [], 0
    for step in range(num_steps):
        pending = {}
        for call, n in _orders(names, step):
            c, layer = LAYERS[n], layers[n]
            kind, xs_f32, ids, ws = routing[n][step]
            xs = [x.to(c["dtype"]) for x in xs_f32]
            fp8 = c["online_fp8"]
            where = f"step {step} ({kind}) {n} {call}"
            if call == "d":
                d = layer.dispatch(xs[rank].to(device), ids[rank].to(device), ws[rank].to(device))
                scales = d.scales.cpu() if d.scales is not None else None
                failures += [f"{where}: {m}" for m in check_dispatch(
                    d.tokens.cpu(), scales, d.counts.cpu(), meta_to_host(d.meta), xs, ids, c["num_experts"], rank,
                    fp8=fp8, group=GROUP, exact_fp8=False)]
                pending[n] = (d, fake_expert_outputs(d.tokens, d.scales, d.counts, d.meta.src_rank,
                                                     d.meta.src_token, rank, c["dtype"], GROUP,
                                                     use_content=not fp8))
            else:
                d, out = pending.pop(n)
                if step % 2:
                    y = layer.combine(out, ids[rank].to(device), ws[rank].to(device), d.meta)
                else:
                    y = layer.combine(out, d)
                want = expected_combine(xs, ids, ws, c["num_experts"], rank, fp8=fp8, group=GROUP, dtype=c["dtype"],
                                        use_content=not fp8, combine_order=c.get("combine_order", "slot"))
                if not torch.equal(y.cpu(), want):
                    failures.append(f"{where}: combine differs from the reference")
                checked += 1
    torch.cuda.synchronize()
    for layer in layers.values():
        layer.finalize()
    return dict(failures=failures, checked=checked, same_size=same_size)


def test_layers_share_the_buffer_against_reference(capsys):
    _setup_env()
    t0 = time.perf_counter()
    results = launch(_interleaved, 2, backend="nccl")
    with capsys.disabled():
        print(f"\n[lowlatency shared gpu] {results[0]['checked']} combines checked x 2 ranks, failures "
              f"{[len(r['failures']) for r in results]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: {r['failures'][:8]}"
        assert r["same_size"], "layers that fit the buffer must not grow it or get their own"


# -- 2. the soak: 8 layers, eager and graph-replayed ------------------------------------------

SOAK_E, SOAK_M = 16, 32
SOAK_LAYERS = [  # (hidden, topk, online_fp8, combine_order)
    (1024, 8, True, "slot"), (512, 2, False, "slot"), (2048, 4, True, "rank"), (256, 1, False, "slot"),
    (768, 6, False, "rank"), (1024, 8, False, "slot"), (384, 3, True, "slot"), (1536, 2, False, "rank"),
]


def _routing(T: int, H: int, K: int, device, g: torch.Generator):
    """x, ids (top-K without repeats, ~10% masked, ~10% of tokens repeating an expert), weights."""
    x = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, SOAK_E, device=device, generator=g).argsort(dim=1)[:, :K]
    ids = torch.where(torch.rand(T, K, device=device, generator=g) < 0.1, -1, ids)
    if K > 1:
        dup = torch.rand(T, device=device, generator=g) < 0.1
        ids[:, -1] = torch.where(dup, ids[:, 0], ids[:, -1])
    w = torch.rand(T, K, device=device, generator=g) + 0.05
    return x, ids, w


def _value(expert: torch.Tensor, src_rank: torch.Tensor, src_token: torch.Tensor, H: int) -> torch.Tensor:
    """The soak's expert output, float32 [..., H]: a function of (expert, source rank, source
    token) only, elementwise, so the expert rank and the source rank compute the same bits."""
    cols = torch.arange(H, device=expert.device, dtype=torch.float32) * 0.001
    a = expert.to(torch.float32).unsqueeze(-1) * 0.125 + 1
    b = src_rank.to(torch.float32).unsqueeze(-1) * 0.5 + src_token.to(torch.float32).unsqueeze(-1) * 0.0625
    return cols * a + b


def _expert(d, rank: int) -> torch.Tensor:
    E_loc, cap, H = d.tokens.shape
    expert = (rank * E_loc + torch.arange(E_loc, device=d.tokens.device)).view(E_loc, 1).expand(E_loc, cap)
    return _value(expert, d.meta.src_rank, d.meta.src_token, H).to(torch.bfloat16)


def _want(ids, w, rank: int, H: int, order: str, world_size: int) -> torch.Tensor:
    T, K = ids.shape
    tok = torch.arange(T, device=ids.device).view(T, 1).expand(T, K)
    slot_out = _value(ids.clamp(min=0), torch.full_like(ids, rank), tok, H).to(torch.bfloat16)
    if order == "rank":
        return weighted_rank_sum(slot_out, ids, w, torch.bfloat16, num_experts=SOAK_E, world_size=world_size)
    return weighted_slot_sum(slot_out, ids, w, torch.bfloat16)


def _soak(rank: int, world_size: int, steps: int) -> dict:
    device = current_device()
    layers = [EPLowLatencyAllToAll(SOAK_M, H, K, SOAK_E, dtype=torch.bfloat16, online_fp8=fp8, combine_order=order)
              for H, K, fp8, order in SOAK_LAYERS]
    pool = layers[0].transport.shared
    one_buffer = all(layer.transport.shared is pool for layer in layers)
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    host = torch.Generator().manual_seed(99)  # the same on both ranks: the call order
    bad = torch.zeros((), dtype=torch.int64, device=device)
    n = len(layers)
    t0 = time.perf_counter()
    done = 0
    while done < steps:  # eager: rounds of the 8 layers in a random interleaving
        order = torch.randperm(n, generator=host).tolist()
        pattern = int(torch.randint(0, 3, (1,), generator=host))
        calls = ([("d", i) for i in order] + [("c", i) for i in order] if pattern == 0 else
                 [c for a, b in zip(order[0::2], order[1::2]) for c in (("d", a), ("d", b), ("c", a), ("c", b))]
                 if pattern == 1 else [c for i in order for c in (("d", i), ("c", i))])
        pending = {}
        for call, i in calls:
            H, K, _, corder = SOAK_LAYERS[i]
            if call == "d":
                T = int(torch.randint(0, SOAK_M + 1, (1,), generator=g, device=device)) if (done + rank) % 7 else 0
                x, ids, w = _routing(T, H, K, device, g)
                d = layers[i].dispatch(x, ids, w)
                pending[i] = (d, ids, w, _expert(d, rank))
            else:
                d, ids, w, out = pending.pop(i)
                y = layers[i].combine(out, d)
                bad += (y != _want(ids, w, rank, H, corder, world_size)).sum()  # NaN counts as a mismatch
                done += 1
    torch.cuda.synchronize()
    eager_s = time.perf_counter() - t0
    eager_bad = int(bad)

    # graphed: one graph holds a round (pairs interleaved: dispatch A, dispatch B, combine A, combine B)
    from moekit.bench.timing import capture_graph

    inputs = [(torch.zeros(SOAK_M, H, device=device, dtype=torch.bfloat16),
               torch.full((SOAK_M, K), -1, device=device, dtype=torch.int64),
               torch.zeros(SOAK_M, K, device=device)) for H, K, _, _ in SOAK_LAYERS]
    outs: dict[int, torch.Tensor] = {}

    def round_trip():
        for a, b in zip(range(0, n, 2), range(1, n, 2)):
            da = layers[a].dispatch(*inputs[a])
            db = layers[b].dispatch(*inputs[b])
            outs[a] = layers[a].combine(_expert(da, rank), da)
            outs[b] = layers[b].combine(_expert(db, rank), db)

    graph = capture_graph(round_trip)
    bad.zero_()
    t0 = time.perf_counter()
    replays = -(-steps // n)
    for _ in range(replays):
        for i, (H, K, _, _) in enumerate(SOAK_LAYERS):
            x, ids, w = _routing(SOAK_M, H, K, device, g)
            inputs[i][0].copy_(x)
            inputs[i][1].copy_(ids)
            inputs[i][2].copy_(w)
        graph.replay()
        for i, (H, K, _, corder) in enumerate(SOAK_LAYERS):
            bad += (outs[i] != _want(inputs[i][1], inputs[i][2], rank, H, corder, world_size)).sum()
    torch.cuda.synchronize()
    graph_s = time.perf_counter() - t0
    for layer in layers:
        layer.finalize()
    return dict(eager_bad=eager_bad, graph_bad=int(bad), eager_steps=done, graph_steps=replays * n,
                eager_s=eager_s, graph_s=graph_s, one_buffer=one_buffer)


def test_soak_eight_layers_eager_and_graphed(capsys):
    _setup_env()
    results = launch(_soak, 2, SOAK_STEPS, backend="nccl")
    r0 = results[0]
    with capsys.disabled():
        print(f"\n[lowlatency shared gpu] soak: {r0['eager_steps']} eager layer steps in {r0['eager_s']:.1f} s, "
              f"{r0['graph_steps']} graphed in {r0['graph_s']:.1f} s; mismatches "
              f"{[(r['eager_bad'], r['graph_bad']) for r in results]}", flush=True)
    for rank, r in enumerate(results):
        assert r["one_buffer"]
        assert r["eager_steps"] >= SOAK_STEPS and r["graph_steps"] >= SOAK_STEPS
        assert r["eager_bad"] == 0 and r["graph_bad"] == 0, f"rank {rank}: {r}"
