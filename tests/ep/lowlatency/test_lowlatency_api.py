"""EPLowLatencyAllToAll in one process (world size 1, gloo transport as a copy): the two
APIs, bad arguments, the capture-mode id masking, finalize, and the profiling traces."""

from __future__ import annotations

import json

import pytest
import torch

from moekit.bench.perfetto import load_trace
from moekit.ep import Dispatcher, EPLowLatencyAllToAll
from moekit.ep.dispatcher import weighted_slot_sum
from moekit.ep.lowlatency import COMBINE_PHASES, DISPATCH_PHASES, api
from tests.ep.lowlatency.reference import expected_combine, fake_expert_outputs

M, H, K, E, G = 6, 32, 3, 4, 16


def _layer(**kwargs):
    args = dict(fp8_group_size=G, dtype=torch.bfloat16, online_fp8=False) | kwargs
    return EPLowLatencyAllToAll(M, H, K, E, **args)


def _inputs(T=5, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[:1, 1] = -1  # a masked slot (when there is a token)
    w = torch.rand(T, K, generator=g)
    return x, ids, w


def test_protocol_round_trip_and_seed_api_agree():
    layer = _layer()
    assert isinstance(layer, Dispatcher)
    x, ids, w = _inputs()
    d = layer.dispatch(x, ids, w)
    # identity experts: y = sum_k w_k x (masked slot skipped), bitwise
    y = layer.combine(d.tokens.clone(), d)
    assert torch.equal(y, weighted_slot_sum(x.unsqueeze(1).expand(5, K, H), ids, w, torch.bfloat16))
    tokens, scales, counts, meta = layer.dispatch(x, ids.to(torch.int32))
    assert scales is None and counts.dtype == torch.int32 and tokens.shape == (E, M, H)
    out = fake_expert_outputs(tokens, None, counts, meta.src_rank, meta.src_token, 0, torch.bfloat16, G)
    want = expected_combine([x], [ids], [w], E, 0, fp8=False, group=G, dtype=torch.bfloat16)
    assert torch.equal(layer.combine(out, ids, w, meta), want)
    assert torch.equal(layer.combine(out, ids, w, meta, zero_copy=True), want)  # accepted, same result


def test_fp8_round_trip_within_bound_and_handle_dtypes():
    layer = _layer(online_fp8=True)
    x, ids, w = _inputs(seed=1)
    d = layer.dispatch(x, ids, w)
    assert d.tokens.dtype == torch.float8_e4m3fn and d.scales.shape == (E, M, H // G)
    assert d.handle.src_token.dtype == torch.int64 and d.meta.src_token.dtype == torch.int32
    out = fake_expert_outputs(d.tokens, d.scales, d.counts, d.meta.src_rank, d.meta.src_token, 0, torch.bfloat16, G)
    want = expected_combine([x], [ids], [w], E, 0, fp8=True, group=G, dtype=torch.bfloat16)
    assert torch.equal(layer.combine(out, d), want)


def test_empty_and_fully_masked_batches():
    layer = _layer(online_fp8=True)
    x, ids, w = _inputs(T=0)
    d = layer.dispatch(x, ids, w)
    assert d.counts.tolist() == [0] * E
    assert layer.combine(torch.zeros(E, M, H, dtype=torch.bfloat16), d).shape == (0, H)
    x, _, w = _inputs(T=M)
    d = layer.dispatch(x, torch.full((M, K), -1), w)
    assert d.counts.tolist() == [0] * E
    y = layer.combine(torch.full((E, M, H), float("nan"), dtype=torch.bfloat16), d)
    assert torch.equal(y, torch.zeros(M, H, dtype=torch.bfloat16))  # -1 slots are skipped, NaN never read


def test_bad_arguments_raise_value_error():
    layer = _layer()
    x, ids, w = _inputs()
    cases = [
        ((torch.randn(M + 1, H).bfloat16(), torch.zeros(M + 1, K, dtype=torch.int64), torch.rand(M + 1, K)),
         rf"T={M + 1} tokens; this dispatcher allows T in \[0, {M}\]"),
        ((x, torch.full_like(ids, E), w), rf"topk_ids must be in \[-1, {E - 1}\]"),
        ((x, torch.full_like(ids, -2), w), rf"topk_ids must be in \[-1, {E - 1}\]"),
        ((x.float(), ids, w), "x must have dtype torch.bfloat16"),
        ((x[:, :16], ids, w), f"H={H}"),
        ((x, ids[:, :2], w[:, :2]), f"K={K}"),
        ((x, ids.float(), w), "topk_ids must be int32 or int64"),
        ((x, ids, w[:, :2]), "topk_weights must have the shape"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            layer.dispatch(*args)
    d = layer.dispatch(x, ids, w)
    out = d.tokens.clone()
    for call, match in [
        (lambda: layer.combine(out[:, :3], d), r"expert_out must be \[E_local, world \* max_m, H\]"),
        (lambda: layer.combine(out.float(), d), "expert_out must have dtype"),
        (lambda: layer.combine(out, ids[:4], w[:4], d.meta), r"topk_ids must be \[T, K\] = \[5, 3\]"),
        (lambda: layer.combine(out, ids, w.long(), d.meta), "topk_weights must be a floating-point"),
        (lambda: layer.combine(out, ids, w), "dispatch_meta is required"),
        (lambda: layer.combine(out, ids, w, "meta"), "dispatch_meta must be the LowLatencyMeta"),
        (lambda: layer.combine(out, d, w), "takes the routing from dispatched"),
        (lambda: layer.combine(out, d, zero_copy=1), "zero_copy must be a bool"),
        (lambda: layer.combine(out, layer.dispatch(x, ids)), "topk_weights: dispatch was called without weights"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(ValueError, match="rank=1, world_size=2 do not match"):
        EPLowLatencyAllToAll(M, H, K, E, 1, 2)
    with pytest.raises(ValueError, match="profile must be a bool"):
        _layer(profile="yes")


def test_topk_above_num_experts_is_refused_at_construction():
    """A router picks K distinct experts of E: K > E is a ValueError naming topk and its range."""
    for topk in (E + 1, 32):
        with pytest.raises(ValueError, match=rf"topk must be an int in \[1, num_experts={E}\], got {topk}"):
            EPLowLatencyAllToAll(M, H, topk, E, fp8_group_size=G, online_fp8=False)
    assert _layer().layout.topk == K and EPLowLatencyAllToAll(M, H, E, E, fp8_group_size=G).layout.topk == E


def test_out_of_range_ids_inside_a_capture_are_masked_and_flagged(monkeypatch):
    """Inside a CUDA-graph capture the id range cannot be read on the host (stand-in on CPU)."""
    layer = _layer()
    x, ids, w = _inputs(seed=2)
    bad = ids.clone()
    bad[1, 0], bad[2, 2] = E + 3, -7
    clean = ids.clone()
    clean[1, 0], clean[2, 2] = -1, -1
    monkeypatch.setattr(api, "_capturing", lambda t: True)
    d = layer.dispatch(x, bad, w)
    assert bool(d.handle.state["invalid_ids"])
    y = layer.combine(d.tokens.clone(), d)
    y_seed = layer.combine(d.tokens.clone(), bad, w, d.meta)
    monkeypatch.setattr(api, "_capturing", lambda t: False)
    want = weighted_slot_sum(x.unsqueeze(1).expand(5, K, H), clean, w, torch.bfloat16)
    assert torch.equal(y, want) and torch.equal(y_seed, want)
    assert layer.dispatch(x, clean, w).handle.state["invalid_ids"] is None  # checked on the host instead


def test_finalize_and_context_manager():
    x, ids, w = _inputs()
    with _layer() as layer:
        d = layer.dispatch(x, ids, w)
    with pytest.raises(RuntimeError, match="finalized"):
        layer.dispatch(x, ids, w)
    with pytest.raises(RuntimeError, match="finalized"):
        layer.combine(d.tokens, d)
    layer.finalize()  # idempotent


def test_profile_traces(tmp_path, monkeypatch):
    layer = _layer(profile=True, online_fp8=True)
    calls = 3
    for i in range(calls):
        x, ids, w = _inputs(seed=i)
        d = layer.dispatch(x, ids, w)
        layer.combine(torch.zeros(E, M, H, dtype=torch.bfloat16), d)
    monkeypatch.chdir(tmp_path)
    paths = [layer.dump_dispatch_trace(), layer.dump_combine_trace(tmp_path / "sub" / "combine.json")]
    assert paths[0] == tmp_path.joinpath("prof", "ll_dispatch_RANK_0.json").relative_to(tmp_path)
    for path, phases, tid in zip(paths, (DISPATCH_PHASES, COMBINE_PHASES), (0, 1)):
        doc = json.loads((tmp_path / path).read_text())  # plain JSON, as ui.perfetto.dev reads it
        assert load_trace(tmp_path / path) == doc
        spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        assert [e["name"] for e in spans] == list(phases) * calls
        assert all(e["pid"] == 0 and e["tid"] == tid and e["dur"] >= 0 for e in spans)
        assert [e["args"]["call"] for e in spans] == [c for c in range(calls) for _ in phases]
        for c in range(calls):  # phases of a call run one after the other
            mine = [e for e in spans if e["args"]["call"] == c]
            assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(mine, mine[1:]))
        names = {e["name"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
        assert names == {"process_name": "rank 0", "thread_name": ("dispatch", "combine")[tid]}
        assert doc["otherData"]["calls"] == calls
    with pytest.raises(RuntimeError, match="profile=False"):
        _layer().dump_dispatch_trace(tmp_path / "x.json")


def test_clear_and_snapshot_stamps(tmp_path):
    """clear_stamps forgets the calls so far; snapshot_stamps copies only what a CUDA graph
    captured, so without a capture (here, on the CPU) it adds nothing."""
    layer = _layer(profile=True, online_fp8=False)
    for i in range(2):
        x, ids, w = _inputs(seed=i)
        layer.combine(torch.zeros(E, M, H, dtype=torch.bfloat16), layer.dispatch(x, ids, w))
    layer.clear_stamps()
    layer.snapshot_stamps()
    x, ids, w = _inputs(seed=5)
    layer.combine(torch.zeros(E, M, H, dtype=torch.bfloat16), layer.dispatch(x, ids, w))
    layer.snapshot_stamps()
    doc = load_trace(layer.dump_combine_trace(tmp_path / "c.json"))
    assert doc["otherData"]["calls"] == 1
    assert {e["args"]["call"] for e in doc["traceEvents"] if e["ph"] == "X"} == {0}
