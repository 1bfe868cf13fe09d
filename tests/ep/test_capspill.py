"""MaxCounts and Cap-and-Spill against the eager all-to-all: bitwise, on 2, 4 and 8 gloo ranks.

Every rank rebuilds the same routing steps from a seed (``capspill_steps``), so a worker
needs only the world size. One launch per world size runs all steps through every
dispatcher and compares each with ``AllToAllDispatcher`` in place, returning the
mismatches (none expected) and what happened (spill passes run or skipped, overflow).
On the gloo ranks the steps are fewer than the GPU tests' ``NUM_STEPS`` (``GLOO_STEPS``):
every routing kind still comes several times (twice on 8 ranks), in both dtypes.
"""

from __future__ import annotations

import math

import pytest
import torch

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # tests/gpu imports the helpers below on machines that may lack hypothesis
    given = None

import moekit.ep.capspill as capspill
from moekit.ep import AllToAllDispatcher, Dispatcher
from moekit.ep.capacity import expert_capacity, spill_capacity
from moekit.ep.capspill import CapacityOverflowError, CapAndSpillDispatcher, MaxCountsDispatcher
from moekit.ep.reference import expected_dispatch
from moekit.moe.reference import reference_slot_sum
from tests.ep.cases import skewed_ids, uniform_ids

T_MAX, K, H = 9, 2, 12
NUM_STEPS = 60  # the GPU tests' steps (tests/gpu/test_capspill_graph.py, test_combine_order_gpu.py)
# Steps per world size on the gloo ranks: KINDS repeat every 8 steps and bf16 comes every 5th,
# so 24 steps run each kind 3 times (16: twice) and bf16 on 4 (3) kinds.
GLOO_STEPS = {2: 24, 4: 24, 8: 16}
KINDS = ["uniform", "skewed", "one_peer", "masked", "full", "one_expert_repeat", "tail_masked", "empty"]
CAPACITIES = [0, 1, 3, T_MAX * K, 40]  # 40 > T_max * K: no spill pass at all


def num_experts(world_size: int) -> int:
    return 2 * world_size


def capspill_steps(world_size: int, num_steps: int = NUM_STEPS, seed: int = 0):
    """[(kind, dtype, xs, ids, weights)] per step, every rank's inputs, same in every process."""
    g = torch.Generator().manual_seed(seed)
    E = num_experts(world_size)
    steps = []
    for i in range(num_steps):
        kind = KINDS[i % len(KINDS)]
        dtype = torch.bfloat16 if i % 5 == 4 else torch.float32
        xs, ids, ws = [], [], []
        for _ in range(world_size):
            T = int(torch.randint(0, T_MAX + 1, (1,), generator=g))
            if kind in ("full", "one_expert_repeat", "tail_masked"):
                T = T_MAX
            if kind == "empty":
                T = 0
            i_ = skewed_ids(g, T, E, K) if kind == "skewed" else uniform_ids(g, T, E, K)
            if kind == "one_peer":  # every pair to rank 0's experts: the heaviest overflow
                i_ = torch.rand(T, E // world_size, generator=g).argsort(dim=1)[:, :K]
            if kind == "one_expert_repeat":  # both slots name the last expert: T_max * K rows to one expert
                i_ = torch.full((T, K), E - 1, dtype=torch.int64)
            if kind == "masked":
                i_ = torch.where(torch.rand(T, K, generator=g) < 0.3, torch.full_like(i_, -1), i_)
            if kind == "tail_masked":  # a fixed-shape buffer carrying fewer tokens
                i_[int(torch.randint(0, T_MAX, (1,), generator=g)):] = -1
            w = torch.rand(T, K, generator=g) + 0.05
            xs.append(torch.randn(T, H, generator=g).to(dtype))
            ids.append(i_.to(torch.int64))
            ws.append(w / w.sum(1, keepdim=True))
        steps.append((kind, dtype, xs, ids, ws))
    return steps


def largest_pair_count(steps, world_size: int) -> int:
    E_local = num_experts(world_size) // world_size
    return max(int(torch.bincount(i[i >= 0] // E_local, minlength=world_size).max()) if i.numel() else 0
               for _, _, _, ids, _ in steps for i in ids)


def expert_outputs(dispatched):
    """A per-row function of the received tokens, NaN on padding rows (which combine must not read)."""
    tokens = dispatched.tokens
    valid = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0) < dispatched.counts.unsqueeze(1)
    return torch.where(valid.unsqueeze(2), tokens * 3 - 1, torch.full_like(tokens, math.nan))


def compare(name, step, got, want, y_got, y_want) -> list[str]:
    """Mismatches between two dispatch results (valid rows, counts, handle) and combines."""
    bad = []
    if not torch.equal(got.counts, want.counts):
        return [f"{name} step {step}: counts {got.counts.tolist()} != {want.counts.tolist()}"]
    for e, n in enumerate(want.counts.tolist()):
        if not torch.equal(got.tokens[e, :n], want.tokens[e, :n]):
            bad.append(f"{name} step {step}: tokens of expert {e}")
        for key in ("src_rank", "src_token", "src_slot"):
            g, w = getattr(got.handle, key), getattr(want.handle, key)
            if not torch.equal(g[e, :n], w[e, :n]) or not bool((g[e, n:] == -1).all()):
                bad.append(f"{name} step {step}: {key} of expert {e}")
    if not torch.equal(y_got, y_want):
        bad.append(f"{name} step {step}: combine")
    if bool(got.handle.state["overflow"]):
        bad.append(f"{name} step {step}: overflow flag set")
    return bad


def make_dispatchers(world_size: int, tight_cmax: int) -> dict:
    E = num_experts(world_size)
    out = {"maxcounts(C=T*K)": MaxCountsDispatcher(E, T_MAX * K, T_MAX, top_k=K),
           f"maxcounts(C={tight_cmax})": MaxCountsDispatcher(E, tight_cmax, T_MAX, top_k=K, hidden=H)}
    for C in CAPACITIES:
        out[f"capspill(C={C})"] = CapAndSpillDispatcher(E, C, T_MAX, top_k=K)
        if C < T_MAX * K:  # with C >= T_max * K there is no spill pass to skip
            out[f"capspill-cond(C={C})"] = CapAndSpillDispatcher(E, C, T_MAX, top_k=K, conditional=True, hidden=H)
    return out


def _equality_worker(rank, world_size, num_steps=NUM_STEPS):
    steps = capspill_steps(world_size, num_steps)
    E = num_experts(world_size)
    eager = AllToAllDispatcher(E)
    dispatchers = make_dispatchers(world_size, largest_pair_count(steps, world_size))
    mismatches, spill_ran, kept = [], {name: [] for name in dispatchers}, {}
    for i, (kind, _, xs, ids, ws) in enumerate(steps):
        want = eager.dispatch(xs[rank], ids[rank], ws[rank])
        y_want = eager.combine(expert_outputs(want), want)
        for name, d in dispatchers.items():
            got = d.dispatch(xs[rank], ids[rank], ws[rank])
            y_got = d.combine(expert_outputs(got), got)
            mismatches += compare(name, i, got, want, y_got, y_want)
            spill_ran[name].append(len(got.handle.state["pass_rows"]) == 2)
            if name == "capspill(C=1)" and kind in ("one_peer", "one_expert_repeat"):
                kept[i] = dict(tokens=got.tokens, counts=got.counts, src_rank=got.handle.src_rank,
                               src_token=got.handle.src_token, src_slot=got.handle.src_slot)
    return dict(mismatches=mismatches, spill_ran=spill_ran, kept=kept, overflow=_overflow_checks(rank, world_size))


def _overflow_checks(rank, world_size):
    """MaxCounts overflow on rank 0 only: every rank must raise (or flag) alike, then go on."""
    E = num_experts(world_size)
    T = 6
    x = torch.randn(T, H)
    w = torch.full((T, K), 0.5)
    heavy = torch.tensor([[E - 1, E - 2]] * T) if rank == 0 else torch.full((T, K), -1)  # 12 pairs to the last rank
    light = torch.full((T, K), -1)
    light[0] = torch.tensor([0, E - 1])  # one pair to rank 0, one to the last rank: fits C_max = 2
    out = {}
    try:
        MaxCountsDispatcher(E, 2, T, top_k=K).dispatch(x, heavy, w)
        out["raised"] = None
    except CapacityOverflowError as error:
        out["raised"] = str(error)
    flagger = MaxCountsDispatcher(E, 2, T, top_k=K, raise_on_overflow=False)
    d = flagger.dispatch(x, heavy, w)
    out["flag_heavy"] = bool(d.handle.state["overflow"])
    out["flag_light"] = bool(flagger.dispatch(x, light, w).handle.state["overflow"])
    # Inside a CUDA graph nothing may be read on the host: stand in for capture on the CPU.
    capturing, capspill._capturing = capspill._capturing, lambda t: True
    try:
        d = MaxCountsDispatcher(E, 2, T, top_k=K).dispatch(x, heavy, w)
        out["flag_in_graph"] = bool(d.handle.state["overflow"])
    finally:
        capspill._capturing = capturing
    # The group still works after the error: a collective every rank joins.
    eager = AllToAllDispatcher(E)
    dd = eager.dispatch(x, light, w)
    want = reference_slot_sum(x.unsqueeze(1).expand(T, K, H), light, w, x.dtype)
    out["after"] = torch.equal(eager.combine(dd.tokens, dd), want)
    return out


# One launch per world size, shared with the other multi-rank tests (tests/rank_pool.py).
@pytest.mark.ranks(lambda world_size: (_equality_worker, GLOO_STEPS[world_size]))
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_bitwise_equal_to_eager(world_size, pooled_launch):
    results = pooled_launch()
    steps = capspill_steps(world_size, GLOO_STEPS[world_size])
    for rank, result in enumerate(results):
        assert result["mismatches"] == [], result["mismatches"][:10]
        ran = result["spill_ran"]
        assert all(ran["capspill(C=1)"]) and not any(ran[f"capspill(C={T_MAX * K})"]) and not any(ran["capspill(C=40)"])
        # conditional mode skipped the spill pass on some steps and ran it on others
        assert any(ran["capspill-cond(C=3)"]) and not all(ran["capspill-cond(C=3)"])
        # the heavy steps, checked against the slow loop reference
        assert result["kept"], "no heavy step was kept"
        for i, got in result["kept"].items():
            _, _, xs, ids, _ = steps[i]
            for e, want in enumerate(expected_dispatch(xs, ids, num_experts(world_size), rank)):
                n = int(got["counts"][e])
                assert n == want["tokens"].shape[0]
                assert torch.equal(got["tokens"][e, :n], want["tokens"])
                for key in ("src_rank", "src_token", "src_slot"):
                    assert torch.equal(got[key][e, :n], want[key])
    # every rank raised the same error, flagged alike, and kept working
    over = [r["overflow"] for r in results]
    assert all(o["raised"] and "12 (token, slot) pairs" in o["raised"] for o in over), over
    assert all(o["flag_heavy"] and o["flag_in_graph"] and not o["flag_light"] and o["after"] for o in over), over


def test_capacity_bound_is_reached_on_many_ranks():
    """one_expert_repeat with T = T_max everywhere fills one expert's P * T_max * K rows exactly."""
    steps = capspill_steps(2)
    kinds = [k for k, *_ in steps]
    i = kinds.index("one_expert_repeat")
    _, _, xs, ids, _ = steps[i]
    rows = sum(int((r == num_experts(2) - 1).sum()) for r in ids)
    assert rows == expert_capacity(2, T_MAX, K, T_MAX * K) == 2 * T_MAX * K


# -- single process (P = 1: the exchange is a copy) ---------------------------------------


def _eager_and(d, x, ids, w):
    eager = AllToAllDispatcher(d.num_experts)
    want = eager.dispatch(x, ids, w)
    got = d.dispatch(x, ids, w)
    return compare("d", 0, got, want, d.combine(expert_outputs(got), got), eager.combine(expert_outputs(want), want))


def _single_rank_case(T, E, K_, C, masked, conditional, seed):
    K_ = min(K_, E)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T, K_), generator=g)  # repeats allowed, as the contract allows
    ids = torch.where(torch.rand(T, K_, generator=g) < masked, torch.full_like(ids, -1), ids)
    x, w = torch.randn(T, 5, generator=g), torch.rand(T, K_, generator=g)
    T_max = max(T, 1) + 1
    assert _eager_and(CapAndSpillDispatcher(E, C, T_max, top_k=K_, conditional=conditional), x, ids, w) == []
    assert _eager_and(MaxCountsDispatcher(E, T_max * K_, T_max, top_k=K_), x, ids, w) == []


if given is not None:
    @settings(max_examples=30, deadline=None)
    @given(T=st.integers(0, 7), E=st.integers(1, 6), K_=st.integers(1, 3), C=st.integers(0, 25),
           masked=st.floats(0, 1), conditional=st.booleans(), seed=st.integers(0, 2**16))
    def test_single_rank_matches_eager(T, E, K_, C, masked, conditional, seed):
        _single_rank_case(T, E, K_, C, masked, conditional, seed)


def test_protocol_and_shapes():
    E, T_max = 8, 5
    cs = CapAndSpillDispatcher(E, 3, T_max, top_k=2)
    mc = MaxCountsDispatcher(E, 8, T_max, top_k=2)
    assert isinstance(cs, Dispatcher) and isinstance(mc, Dispatcher)
    assert cs.spill_rows == spill_capacity(T_max, 2, 3) == 7
    x, ids, w = torch.randn(4, 6), torch.randint(0, E, (4, 2)), torch.rand(4, 2)
    d = cs.dispatch(x, ids, w)
    assert d.tokens.shape == (E, T_max * 2, 6) and d.handle.state["pass_rows"] == [3, 7]
    d = mc.dispatch(x, torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]]), w)
    assert d.tokens.shape == (E, 8, 6) and d.handle.state["pass_rows"] == [8]  # min(C_max, T_max * K) rows
    assert cs.combine(d.tokens.new_zeros(E, T_max * 2, 6), cs.dispatch(x, ids, w)).shape == (4, 6)


def test_bad_arguments_raise_value_error():
    E = 4
    cs = CapAndSpillDispatcher(E, 2, 3, top_k=2, hidden=6)
    x, ids, w = torch.randn(3, 6), torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2)
    with pytest.raises(ValueError, match="T=4 tokens"):
        cs.dispatch(torch.randn(4, 6), torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2))
    with pytest.raises(ValueError, match=r"topk_ids must be in \[-1, 3\]"):
        cs.dispatch(x, torch.full((3, 2), 4), w)
    with pytest.raises(ValueError, match="H=6"):
        cs.dispatch(torch.randn(3, 5), ids, w)
    with pytest.raises(ValueError, match="K=2"):
        cs.dispatch(x, torch.zeros(3, 3, dtype=torch.int64), torch.rand(3, 3))
    with pytest.raises(ValueError, match="expert_out"):
        cs.combine(torch.zeros(E, 5, 6), cs.dispatch(x, ids, w))
    for bad in (dict(capacity=-1), dict(max_tokens=0), dict(top_k=0), dict(capacity=1.5)):
        args = dict(capacity=2, max_tokens=3, top_k=2) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            CapAndSpillDispatcher(E, args["capacity"], args["max_tokens"], top_k=args["top_k"])
    with pytest.raises(ValueError, match="C_max"):
        MaxCountsDispatcher(E, 0, 3, top_k=2)
    with pytest.raises(ValueError, match="num_experts"):
        CapAndSpillDispatcher(6, 2, 3, top_k=7)


def test_out_of_range_ids_inside_a_graph_are_masked_and_flagged(monkeypatch):
    """Inside a capture the id range cannot be read on the host: bad ids are masked and flagged."""
    monkeypatch.setattr(capspill, "_capturing", lambda t: True)
    E = 4
    cs = CapAndSpillDispatcher(E, 1, 3, top_k=2)
    x, w = torch.randn(3, 6), torch.rand(3, 2)
    ids = torch.tensor([[0, 9], [1, -5], [2, 3]])
    d = cs.dispatch(x, ids, w)
    assert bool(d.handle.state["invalid_ids"])
    clean = torch.tensor([[0, -1], [1, -1], [2, 3]])
    eager = AllToAllDispatcher(E)
    want = eager.dispatch(x, clean, w)
    assert compare("cs", 0, d, want, cs.combine(d.tokens, d), eager.combine(want.tokens, want)) == []
    assert not bool(cs.dispatch(x, clean, w).handle.state["invalid_ids"])


def test_maxcounts_overflow_in_a_graph_leaves_undelivered_slots_out(monkeypatch):
    monkeypatch.setattr(capspill, "_capturing", lambda t: True)
    mc = MaxCountsDispatcher(2, 2, 3, top_k=1)
    x, w = torch.randn(3, 4), torch.ones(3, 1)
    d = mc.dispatch(x, torch.zeros(3, 1, dtype=torch.int64), w)  # 3 pairs to expert 0, room for 2
    assert bool(d.handle.state["overflow"]) and int(d.handle.state["largest_count"]) == 3
    assert d.counts.tolist() == [2, 0]
    y = mc.combine(d.tokens, d)
    assert torch.equal(y[:2], x[:2]) and torch.equal(y[2], torch.zeros(4))


def test_spill_flag_and_skipping_the_spill_pass_by_hand():
    """spill_flag says whether a pair exceeds C; skipping the spill pass anyway is reported, not silent."""
    cs = CapAndSpillDispatcher(4, 2, 4, top_k=1, conditional=True)
    x, w = torch.randn(4, 3), torch.ones(4, 1)
    few, many = torch.tensor([[0], [1], [-1], [-1]]), torch.tensor([[0], [1], [0], [1]])
    assert cs.spill_flag(few).tolist() == [0] and cs.spill_flag(many).tolist() == [1]
    assert cs.dispatch(x, few, w).handle.state["pass_rows"] == [2]  # conditional: skipped
    assert cs.dispatch(x, many, w).handle.state["pass_rows"] == [2, 2]
    d = cs.dispatch(x, many, w, spill=False)  # misuse: rows 3 and 4 stay behind
    assert bool(d.handle.state["overflow"]) and d.counts.tolist() == [2, 0, 0, 0]
