"""EPLowLatencyAllToAll on 2 GPUs (NCCL group, symmetric-memory transport).

1. Correctness against the loop reference (tests/ep/lowlatency/reference.py), the gloo
   tests' routing kinds, three modes (FP8 from bf16, bf16, fp32): received rows per expert
   with their sources, slots and order; FP8 within the e4m3 bound (bitwise payload for the
   plain modes); combine of a position-dependent fake expert bitwise equal to
   ``weighted_slot_sum`` of the reference's slot outputs; T > max_m and bad ids raise.
2. In each combine order (slot, rank): 10,000 eager alternating-phase steps (FP8) + 2,000
   (bf16 wire) with fresh random routing
   made on the GPU each step (random T, masked slots, repeated experts), and 10,000
   CUDA-graph replays of one captured dispatch + fake expert + combine with new routing
   written into the same input tensors. The fake expert's output depends on the expert and
   the row's source (rank, token) (and, on the bf16 wire, the token), so each step's combine
   is checked bitwise against ``weighted_slot_sum`` (``weighted_rank_sum``) computed on the
   source rank alone;
   mismatches are counted on the GPU and read once at the end.
3. profile=True: both traces dumped (to $OUT/ll_traces when OUT is set) and loaded back.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
import torch

from moekit.bench.perfetto import load_trace, phase_durations
from moekit.bench.timing import capture_graph
from moekit.ep import EPLowLatencyAllToAll, current_device, launch
from moekit.ep.dispatcher import weighted_rank_sum, weighted_slot_sum
from moekit.ep.lowlatency import COMBINE_PHASES, DISPATCH_PHASES
from moekit.ep.lowlatency.layout import bits_view
from tests.ep.lowlatency.reference import (KINDS, check_dispatch, expected_combine, fake_expert,
                                          fake_expert_outputs, meta_to_host, routing_steps)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)

# MOEKIT_LL_SOAK_STEPS shortens the soak (a quick check); 10,000 is the test as documented.
STRESS_ITERS = GRAPH_ITERS = int(os.environ.get("MOEKIT_LL_SOAK_STEPS", "10000"))
MODES = {"fp8<-bf16": (torch.bfloat16, True), "bf16": (torch.bfloat16, False), "fp32": (torch.float32, False)}


def _setup_env() -> None:
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)  # never NVLink multicast (inherited by the ranks)


# -- 1. correctness against the loop reference ------------------------------------------------

C_M, C_H, C_G, C_K, C_E = 8, 256, 128, 4, 16


def _correctness(rank: int, world_size: int) -> dict:
    device = current_device()
    failures, steps_checked = [], 0
    steps = routing_steps(world_size, 2 * len(KINDS), max_m=C_M, num_experts=C_E, topk=C_K, hidden=C_H,
                          seed=7, dtype=torch.float32)
    for name, (dtype, fp8) in MODES.items():
        layer = EPLowLatencyAllToAll(C_M, C_H, C_K, C_E, fp8_group_size=C_G, dtype=dtype, online_fp8=fp8)
        for i, (kind, xs_f32, ids, ws) in enumerate(steps):
            xs = [x.to(dtype) for x in xs_f32]
            where = f"{name} step {i} ({kind})"
            d = layer.dispatch(xs[rank].to(device), ids[rank].to(device), ws[rank].to(device))
            scales = d.scales.cpu() if d.scales is not None else None
            failures += [f"{where}: {m}" for m in check_dispatch(
                d.tokens.cpu(), scales, d.counts.cpu(), meta_to_host(d.meta), xs, ids, C_E, rank, fp8=fp8,
                group=C_G, exact_fp8=False)]
            # FP8 may round differently from the CPU reference: then the expert ignores the payload
            out = fake_expert_outputs(d.tokens, d.scales, d.counts, d.meta.src_rank, d.meta.src_token, rank, dtype,
                                      C_G, use_content=not fp8)
            if i % 2:
                y = layer.combine(out, ids[rank].to(device), ws[rank].to(device), d.meta)
            else:
                y = layer.combine(out, d)
            want = expected_combine(xs, ids, ws, C_E, rank, fp8=fp8, group=C_G, dtype=dtype, use_content=not fp8)
            if not torch.equal(y.cpu(), want):
                failures.append(f"{where}: combine differs from the reference")
            steps_checked += 1
        errors = _error_cases(layer, device, dtype)
        failures += [f"{name}: {e}" for e in errors]
        layer.finalize()
    return dict(failures=failures, steps=steps_checked)


def _error_cases(layer, device, dtype) -> list[str]:
    """Raised on every rank alike, before anything is sent (so no rank waits)."""
    missing = []
    cases = {"T > max_m": (torch.randn(C_M + 1, C_H, device=device).to(dtype),
                           torch.zeros(C_M + 1, C_K, dtype=torch.int64, device=device)),
             "id >= E": (torch.randn(2, C_H, device=device).to(dtype),
                         torch.full((2, C_K), C_E, dtype=torch.int64, device=device))}
    for what, (x, ids) in cases.items():
        try:
            layer.dispatch(x, ids, torch.rand(x.shape[0], C_K, device=device))
            missing.append(f"{what} did not raise")
        except ValueError:
            pass
    return missing


def test_correctness_against_reference(capsys):
    _setup_env()
    t0 = time.perf_counter()
    results = launch(_correctness, 2, backend="nccl")
    with capsys.disabled():
        print(f"\n[lowlatency gpu] correctness: {results[0]['steps']} steps x 2 ranks, "
              f"failures {[len(r['failures']) for r in results]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: {r['failures'][:8]}"


# -- 2. many steps, eager and graph-replayed -------------------------------------------------

S_M, S_H, S_G, S_K, S_E = 32, 1024, 128, 8, 64


def _random_routing(T: int, device, g: torch.Generator):
    """On the GPU: x, ids (top-K without repeats, ~10% masked, ~10% of tokens repeating an
    expert), weights."""
    x = torch.randn(T, S_H, device=device, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, S_E, device=device, generator=g).argsort(dim=1)[:, :S_K]
    ids = torch.where(torch.rand(T, S_K, device=device, generator=g) < 0.1, -1, ids)
    dup = torch.rand(T, device=device, generator=g) < 0.1
    ids[:, -1] = torch.where(dup, ids[:, 0], ids[:, -1])
    w = torch.rand(T, S_K, device=device, generator=g) + 0.05
    return x, ids, w


def _source_expert(d, rank: int, fp8: bool) -> torch.Tensor:
    """The fake expert of the stress steps: a function of (expert, source rank, source token)
    and, on the bf16 wire, the token; NaN on padding rows."""
    E_loc, cap, _ = d.tokens.shape
    expert = (rank * E_loc + torch.arange(E_loc, device=d.tokens.device)).view(E_loc, 1).expand(E_loc, cap)
    zero = torch.zeros((), device=d.tokens.device)
    values = d.tokens.float() if not fp8 else torch.ones(E_loc, cap, S_H, device=d.tokens.device)
    out = fake_expert(values, expert, zero, d.meta.src_rank, d.meta.src_token, torch.bfloat16)
    valid = torch.arange(cap, device=d.tokens.device).view(1, cap) < d.counts.view(E_loc, 1)
    return torch.where(valid.unsqueeze(2), out, torch.full_like(out, float("nan")))


def _mismatch(y, x, ids, w, rank: int, fp8: bool, order: str = "slot") -> torch.Tensor:
    """0-d int: 1 if y differs (bitwise) from what the source rank computes alone (the
    contract of the combine order: ``weighted_slot_sum`` or ``weighted_rank_sum``)."""
    T = ids.shape[0]
    values = x.float().unsqueeze(1).expand(T, S_K, S_H) if not fp8 else torch.ones(T, S_K, S_H, device=x.device)
    token = torch.arange(T, device=x.device).view(T, 1).expand(T, S_K)
    slot_out = fake_expert(values, ids, torch.zeros((), device=x.device), torch.full_like(ids, rank), token,
                           torch.bfloat16)
    if order == "rank":
        want = weighted_rank_sum(slot_out, ids, w, torch.bfloat16, num_experts=S_E, world_size=2)
    else:
        want = weighted_slot_sum(slot_out, ids, w, torch.bfloat16)
    return (bits_view(y) != bits_view(want)).any().to(torch.int64)


def _stress(rank: int, world_size: int, eager_iters: int, graph_iters: int, order: str = "slot",
            bounds: dict | None = None) -> dict:
    device = current_device()
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    host = random.Random(rank)
    out = {}
    for name, fp8, n in (("eager fp8", True, eager_iters), ("eager bf16", False, eager_iters // 5)):
        layer = EPLowLatencyAllToAll(S_M, S_H, S_K, S_E, fp8_group_size=S_G, online_fp8=fp8, combine_order=order,
                                     **(bounds or {}))
        bad = torch.zeros((), dtype=torch.int64, device=device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            T = host.choice([0, S_M, host.randint(0, S_M)])
            x, ids, w = _random_routing(T, device, g)
            d = layer.dispatch(x, ids, w)
            bad += _mismatch(layer.combine(_source_expert(d, rank, fp8), d), x, ids, w, rank, fp8, order)
        torch.cuda.synchronize()
        out[name] = dict(iters=n, mismatches=int(bad), us_per_iter=(time.perf_counter() - t0) / max(n, 1) * 1e6)
        layer.finalize()

    # one captured step, replayed with new routing written into the same tensors (tail masked)
    layer = EPLowLatencyAllToAll(S_M, S_H, S_K, S_E, fp8_group_size=S_G, online_fp8=True, combine_order=order,
                                 **(bounds or {}))
    x_s = torch.zeros(S_M, S_H, dtype=torch.bfloat16, device=device)
    ids_s = torch.full((S_M, S_K), -1, dtype=torch.int64, device=device)
    w_s = torch.zeros(S_M, S_K, device=device)
    held = {}

    def write(T: int) -> None:
        x, ids, w = _random_routing(S_M, device, g)
        ids[T:] = -1
        x_s.copy_(x)
        ids_s.copy_(ids)
        w_s.copy_(w)

    def step() -> None:
        d = layer.dispatch(x_s, ids_s, w_s)
        held["y"] = layer.combine(_source_expert(d, rank, True), d)

    write(S_M)
    graph = capture_graph(step)
    bad = torch.zeros((), dtype=torch.int64, device=device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(graph_iters):
        write(host.randint(0, S_M))
        graph.replay()
        bad += _mismatch(held["y"], x_s, ids_s, w_s, rank, True, order)
    torch.cuda.synchronize()
    out["graph fp8"] = dict(iters=graph_iters, mismatches=int(bad),
                            us_per_iter=(time.perf_counter() - t0) / max(graph_iters, 1) * 1e6)
    layer.finalize()
    return out


@pytest.mark.parametrize("order, bounds", [("slot", None), ("rank", None),
                                           ("slot", dict(recv_capacity=12, spill_rows=6))],
                         ids=["slot", "rank", "slot-bounded"])
def test_many_steps_eager_and_graph_replay(capsys, order, bounds):
    """The soak, in each combine order (each against its own contract, bitwise), and with a
    bounded receive buffer (12 of 32 rows per source: random T spills often)."""
    _setup_env()
    t0 = time.perf_counter()
    results = launch(_stress, 2, STRESS_ITERS, GRAPH_ITERS, order, bounds, backend="nccl")
    with capsys.disabled():
        for rank, r in enumerate(results):
            print(f"\n[lowlatency gpu] {order} order, rank {rank}: " + "; ".join(
                f"{k}: {v['iters']} steps, {v['mismatches']} mismatched, {v['us_per_iter']:.0f} µs/step (incl. checks)"
                for k, v in r.items()), end="")
        print(f"\n[lowlatency gpu] stress total {time.perf_counter() - t0:.0f} s", flush=True)
    for rank, r in enumerate(results):
        for name, v in r.items():
            assert v["mismatches"] == 0, f"rank {rank} {name}: {v['mismatches']} mismatched steps of {v['iters']}"


# -- 3. traces ---------------------------------------------------------------------------------


def _profiled(rank: int, world_size: int, out_dir: str) -> dict:
    device = current_device()
    g = torch.Generator(device=device).manual_seed(rank)
    layer = EPLowLatencyAllToAll(S_M, S_H, S_K, S_E, fp8_group_size=S_G, profile=True)
    for _ in range(20):
        x, ids, w = _random_routing(S_M, device, g)
        d = layer.dispatch(x, ids, w)
        layer.combine(_source_expert(d, rank, True), d)
    torch.cuda.synchronize()
    torch.distributed.barrier()
    paths = [str(layer.dump_dispatch_trace(Path(out_dir) / f"ll_dispatch_RANK_{rank}.json")),
             str(layer.dump_combine_trace(Path(out_dir) / f"ll_combine_RANK_{rank}.json"))]
    layer.finalize()
    return dict(paths=paths)


def test_profile_traces(tmp_path, capsys):
    _setup_env()
    out_dir = Path(os.environ["OUT"]) / "ll_traces" if os.environ.get("OUT") else tmp_path
    results = launch(_profiled, 2, str(out_dir), backend="nccl")
    lines = []
    for rank, r in enumerate(results):
        for path, phases in zip(r["paths"], (DISPATCH_PHASES, COMBINE_PHASES)):
            durations = phase_durations(load_trace(path))
            assert set(durations) == set(phases), (path, sorted(durations))
            assert all(len(v) == 20 and min(v) >= 0 for v in durations.values()), path
            lines.append(f"rank {rank} " + ", ".join(f"{p} {sorted(durations[p])[10]:.1f}" for p in phases))
    with capsys.disabled():
        print("\n[lowlatency gpu] trace medians (µs): " + " | ".join(lines) + f" -> {out_dir}", flush=True)


def _profiled_graph(rank: int, world_size: int, replays: int, out_dir: str) -> dict:
    device = current_device()
    g = torch.Generator(device=device).manual_seed(rank)
    layer = EPLowLatencyAllToAll(S_M, S_H, S_K, S_E, fp8_group_size=S_G, profile=True)
    x, ids, w = _random_routing(S_M, device, g)
    expert_out = torch.randn(layer.experts_per_rank, layer.capacity, S_H, device=device).bfloat16()
    graph = capture_graph(lambda: layer.combine(expert_out, layer.dispatch(x, ids, w)))
    layer.clear_stamps()
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        layer.snapshot_stamps()
    torch.distributed.barrier()
    out = {}
    for call, dump in (("dispatch", layer.dump_dispatch_trace), ("combine", layer.dump_combine_trace)):
        path = dump(Path(out_dir) / f"graph_{call}_RANK_{rank}.json")
        events = [e for e in load_trace(path)["traceEvents"] if e["ph"] == "X"]
        out[call] = [(e["args"]["call"], e["name"], e["ts"], e["dur"]) for e in events]
    layer.finalize()
    return out


def test_profile_under_graph_replay(tmp_path):
    """A step captured in a CUDA graph with profile=True: snapshot_stamps after each replay
    keeps every replay as its own call (each replay overwrites the captured stamps), each
    with every phase, later replays later in time."""
    _setup_env()
    replays = 5
    for rank, r in enumerate(launch(_profiled_graph, 2, replays, str(tmp_path), backend="nccl")):
        for call, phases in (("dispatch", DISPATCH_PHASES), ("combine", COMBINE_PHASES)):
            events = r[call]
            assert sorted({c for c, *_ in events}) == list(range(replays)), (rank, call)
            for c in range(replays):
                assert {name for k, name, *_ in events if k == c} == set(phases), (rank, call, c)
            first = [min(ts for k, _, ts, _ in events if k == c) for c in range(replays)]
            assert all(a < b for a, b in zip(first, first[1:])), (rank, call, first)


# -- 4. ids the host cannot check --------------------------------------------------------------


def _masked_in_capture(rank: int, world_size: int) -> dict:
    device = current_device()
    g = torch.Generator(device=device).manual_seed(10 + rank)
    layer = EPLowLatencyAllToAll(S_M, S_H, S_K, S_E, fp8_group_size=S_G, online_fp8=False)
    x, clean, w = _random_routing(S_M, device, g)
    bad = clean.clone()
    bad[1, 0], bad[2, 1] = S_E + 3, -7
    clean[1, 0], clean[2, 1] = -1, -1
    ids = clean.clone()  # the graph's input buffer: valid ids while warming up (checked on the host)
    held = {}

    def step():
        held["d"] = layer.dispatch(x, ids, w)
        held["y"] = layer.combine(held["d"].tokens, held["d"])  # identity experts

    graph = capture_graph(step)
    want = weighted_slot_sum(x.unsqueeze(1).expand(-1, S_K, -1), clean, w, torch.bfloat16)
    out = {}
    for name, routing in (("bad", bad), ("clean", clean)):
        ids.copy_(routing)
        graph.replay()
        torch.cuda.synchronize()
        out[name] = dict(equal=torch.equal(held["y"], want), flagged=bool(held["d"].handle.state["invalid_ids"]))
    layer.finalize()
    return out


def test_out_of_range_ids_in_a_graph_are_masked_and_flagged():
    """Under capture the layer checks ids on the device (in the dispatch kernel, dispatch_unchecked):
    a replay with out-of-range ids gives the output of the same routing with those slots
    masked, bitwise, and sets ``invalid_ids``; a replay with valid ids clears it."""
    _setup_env()
    for rank, r in enumerate(launch(_masked_in_capture, 2, backend="nccl")):
        assert r["bad"] == dict(equal=True, flagged=True), (rank, r)
        assert r["clean"] == dict(equal=True, flagged=False), (rank, r)
