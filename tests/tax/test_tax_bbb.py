from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moekit.tax.bbb import FIG10_CONFIGS, bbb_bounds, expert_counts, figure10_data, loads_from_counts, simulate
from moekit.tax.placement import Placement, assignment_gpus
from moekit.tax.topk import as_topk_array, sample_routing


@st.composite
def routing_and_placement(draw):
    """Small random routing with masked slots, and a placement with replicas."""
    n = draw(st.integers(1, 4))
    per_gpu = draw(st.integers(1, 3))
    e = draw(st.integers(1, n * per_gpu))
    k = draw(st.integers(1, e))
    s = draw(st.integers(1, 3))
    t = draw(st.integers(0, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.permutation(e)[:k] for _ in range(t)]) if t else np.zeros((0, k), int)
                    for _ in range(s)]).reshape(s, t, k)
    ids = np.where(rng.random(ids.shape) < 0.2, -1, ids)
    # Every expert once, the remaining slots random experts, shuffled over GPUs.
    table = np.concatenate([np.arange(e), rng.integers(0, e, n * per_gpu - e)])
    table = rng.permutation(table).reshape(n, per_gpu)
    split = draw(st.sampled_from(["even", "block"]))
    block = draw(st.integers(1, 5))
    return ids, e, Placement(table, e, split=split, block_size=block)


def brute_counts(ids, e):
    out = np.zeros((ids.shape[0], e), dtype=int)
    for b in range(ids.shape[0]):
        for row in ids[b]:
            for x in row:
                if x >= 0:
                    out[b, x] += 1
    return out


@settings(max_examples=100, deadline=None)
@given(routing_and_placement())
def test_counts_and_work_conservation(case):
    ids, e, placement = case
    counts = expert_counts(ids, e)
    np.testing.assert_array_equal(counts, brute_counts(ids, e))
    stats = loads_from_counts(counts, placement, block_size=4)
    # Every token-expert assignment lands in exactly one slot of its own expert.
    slot = stats.slot_counts.reshape(ids.shape[0], -1)
    per_expert = np.zeros_like(counts)
    for j, ex in enumerate(placement.slots.ravel()):
        per_expert[:, ex] += slot[:, j]
    np.testing.assert_array_equal(per_expert, counts)
    np.testing.assert_array_equal(stats.routed.sum(axis=1), (ids >= 0).sum(axis=(1, 2)))
    assert np.all(stats.padded >= stats.routed)
    assert np.all(stats.padded % 4 == 0)
    assert np.all(stats.straggler() >= 1.0 - 1e-12)


@settings(max_examples=100, deadline=None)
@given(routing_and_placement())
def test_assignment_gpus_agree_with_slot_counts(case):
    ids, e, placement = case
    dst = assignment_gpus(ids, placement)
    assert np.array_equal(dst < 0, ids < 0)
    stats = loads_from_counts(expert_counts(ids, e), placement)
    for b in range(ids.shape[0]):
        per_gpu = np.bincount(dst[b][dst[b] >= 0], minlength=placement.n_gpus)
        np.testing.assert_array_equal(per_gpu, stats.routed[b])
        for (t, k), g in np.ndenumerate(dst[b]):  # the GPU must hold the expert
            if g >= 0:
                assert ids[b, t, k] in placement.slots[g]


def test_even_and_block_splits_by_hand():
    p = Placement(np.array([[0, 1], [0, 2], [0, 3]]), 4)
    assert p.replicas.tolist() == [3, 1, 1, 1]
    counts = np.array([[10, 1, 0, 5]])
    # Even: 10 over 3 replicas -> 4, 3, 3 (the first replica takes the remainder).
    assert p.slot_counts(counts)[0].tolist() == [[4, 1], [3, 0], [3, 5]]
    b = p.with_split("block", 4)
    # Block: ceil(10/4) = 3 blocks, one per replica, filled in order: 4, 4, 2.
    assert b.slot_counts(counts)[0].tolist() == [[4, 1], [4, 0], [2, 5]]
    # Few tokens: one block only, so only the first replica is activated.
    assert b.slot_counts(np.array([[3, 0, 0, 0]]))[0, :, 0].tolist() == [3, 0, 0]


def test_placement_validation():
    with pytest.raises(ValueError, match="without a slot"):
        Placement(np.array([[0, 0], [1, 1]]), 3)
    with pytest.raises(ValueError, match="expert ids"):
        Placement(np.array([[0, 5]]), 3)
    with pytest.raises(ValueError, match="ranks"):
        Placement(np.array([[0, 0]]), 1, ranks=np.array([[0, 0]]))
    p = Placement(np.array([[0, 0]]), 1, ranks=np.array([[1, 0]]))
    assert p.slot_counts(np.array([[5]]))[0].tolist() == [[2, 3]]
    with pytest.raises(ValueError, match="divide"):
        Placement.contiguous(8, 3)


def test_sample_routing_picks_distinct_experts():
    for e, k in [(8, 2), (64, 8), (16, 16), (256, 8)]:
        ids = sample_routing(500, e, k, samples=3, seed=1)
        assert ids.shape == (3, 500, k)
        assert ids.min() >= 0 and ids.max() < e
        s = np.sort(ids, axis=-1)
        assert not np.any(s[..., 1:] == s[..., :-1])
    # Popularity skews the counts toward popular experts.
    p = np.array([8.0, 4, 2, 1, 1, 1, 1, 1])
    counts = expert_counts(sample_routing(4000, 8, 1, popularity=p, seed=2), 8)[0]
    assert counts[0] > 2 * counts[2] > 0


def test_uniform_routing_counts_match_expectation():
    e, k, m = 16, 4, 200
    counts = expert_counts(sample_routing(m, e, k, samples=200, seed=3), e)
    assert counts.mean() == pytest.approx(m * k / e, rel=0.02)


def test_routing_trace_like_objects_are_accepted():
    rng = np.random.default_rng(0)
    topk = rng.integers(-1, 8, size=(3, 2, 10, 2))  # [steps, layers, tokens, K]
    trace = SimpleNamespace(topk_ids=topk, num_experts=8)
    ids, e = as_topk_array(trace)
    assert ids.shape == (6, 10, 2) and e == 8
    stats = simulate(8, 4, 0, 2, routing=trace, block_size=4)
    assert stats.routed.shape == (6, 4)
    np.testing.assert_array_equal(stats.total, (topk >= 0).reshape(6, -1).sum(axis=1))
    with pytest.raises(ValueError, match=r"\[-1, 7\]"):
        as_topk_array(np.array([[[8, 0]]]), 8)
    with pytest.raises(ValueError, match="integer"):
        as_topk_array(np.zeros((2, 2)), 8)
    with pytest.raises(ValueError, match="num_experts"):
        as_topk_array(np.zeros((2, 2), dtype=int))


def test_straggler_bound_holds_on_average_for_prefill():
    for e, n, k, m in [(8, 4, 2, 2048), (64, 4, 8, 1024), (64, 8, 8, 4096)]:
        stats = simulate(e, n, m, k, trials=300, block_size=1, scheme="none", seed=4)
        assert 1.0 < stats.straggler().mean() <= float(bbb_bounds(m, e, n, k)["straggler_bound"])


def test_figure10_trends():
    rows = figure10_data(batch_sizes=(64, 1024), trials=200)
    by = {(r["config"], r["m"]): r for r in rows}
    labels = [c.label for c in FIG10_CONFIGS]
    for m in (64, 1024):
        for lab in labels:
            assert 0 < by[(lab, m)]["padded_balance"] <= by[(lab, m)]["balance"] <= 1.0
        # DP attention (32 GPUs for 64 experts) worsens the worst-case GPU load.
        assert by[("64E, 32G", m)]["balance"] < by[("64E, 4G", m)]["balance"]
    for lab in labels:  # bigger batches balance better
        assert by[(lab, 1024)]["balance"] > by[(lab, 64)]["balance"]
