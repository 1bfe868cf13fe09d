"""Run-time selection: the device evaluation (Triton kernel in the interpreter, and torch) is the
model's argmin, never an invalid config; the per-step cache reads the host once per step; the
fallback warns once."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from moekit.kernels.configs import config_space
from moekit.ramp import select as sel
from moekit.ramp import costmodel as cm
from moekit.ramp.costmodel import ModelForm
from moekit.routing import synthetic_routing
from moekit.shapes import MoEShape

from .synthetic import synthetic_model

SHAPE = MoEShape("sel", num_experts=24, top_k=4, hidden=512, intermediate=256)


def _loop_argmin(model, counts, M):
    """The plain Python reference: every config's predicted time, the first least."""
    best, arg = np.inf, None
    pred = model.predict(counts, M)  # every config's time (once: it is the same for every i)
    for i in range(len(model.configs)):
        v = pred[i]
        if np.isfinite(v) and v < best:
            best, arg = v, i
    return arg, best


@pytest.mark.parametrize("form", [ModelForm(), ModelForm(terms=2), ModelForm(wave="ratio", phi="log"),
                                  ModelForm(phi="quad", traffic=False)])
@pytest.mark.parametrize("use_triton", [False, True])
def test_device_choice_is_the_models_argmin(form, use_triton):
    if use_triton:
        pytest.importorskip("triton")
    rng = np.random.default_rng(3)
    model = synthetic_model(SHAPE, config_space(SHAPE)[::3], rng, form=form)
    dm = sel.device_model(model, "cpu")
    space = set(config_space(SHAPE))
    for M, beta in ((1, 1.0), (5, 0.6), (16, 0.5), (40, 1.0), (300, 0.45), (1000, 0.8)):
        ids, _ = synthetic_routing(M, SHAPE.num_experts, SHAPE.top_k, beta=beta, seed=M)
        ids[0, 0] = -1  # a masked slot
        counts = sel.histogram(ids, SHAPE.num_experts)
        assert counts.tolist() == np.bincount(ids[ids >= 0].numpy(), minlength=SHAPE.num_experts).tolist()
        row, cost = sel.choose_device(dm, M, topk_ids=ids, num_experts=SHAPE.num_experts, use_triton=use_triton)
        i = dm.rows[int(row)]
        ref_i, ref_cost = _loop_argmin(model, counts.numpy(), M)
        assert float(cost) == pytest.approx(ref_cost, rel=1e-5)
        pred = model.predict(counts.numpy(), M)
        second = np.sort(pred[np.isfinite(pred)])[1]
        if second > ref_cost * (1 + 1e-4):  # no near tie: the same index
            assert i == ref_i
        c = model.configs[i]
        assert c in space and model.plan(i, M).path == ("direct" if M <= c.bm else "sorted")
        # from counts (the expert-major entry) the same answer
        row2, _ = sel.choose_device(dm, M, counts=counts, use_triton=use_triton)
        assert int(row2) == int(row)


@pytest.mark.parametrize("use_triton", [False, True])
def test_expert_major_choice_clamps_to_capacity(use_triton):
    if use_triton:
        pytest.importorskip("triton")
    rng = np.random.default_rng(4)
    cfgs = [c for c in config_space(SHAPE) if c.form == "two_launch" and c.split_k == 1][::4]
    model = synthetic_model(SHAPE, cfgs, rng, family="expert_major", capacity=32)
    dm = sel.device_model(model, "cpu", capacity=32)
    counts = torch.tensor(rng.integers(0, 80, SHAPE.num_experts), dtype=torch.int32)
    row, cost = sel.choose_device(dm, 32, counts=counts, use_triton=use_triton)
    ref_i, ref_cost = _loop_argmin(model, counts.numpy(), 32)
    assert float(cost) == pytest.approx(ref_cost, rel=1e-5)


@pytest.mark.parametrize("family", ["token", "expert_major"])
@pytest.mark.parametrize("use_triton", [False, True])
def test_an_empty_histogram_takes_the_least_empty_call_rank(family, use_triton):
    """No routed pair (an expert-parallel shard no token routes to): every grid is empty, so the
    choice is the empty-call rank's least (no split-K, fewest launches, fewest column tiles),
    not the least intercept, which here is a split-K variant's."""
    if use_triton:
        pytest.importorskip("triton")
    rng = np.random.default_rng(6)
    space = config_space(SHAPE)
    if family == "expert_major":
        space = [c for c in space if c.form == "two_launch"]
    cfgs = space[::2]
    assert any(c.split_k > 1 for c in cfgs) and any(c.split_k == 1 for c in cfgs)
    model = synthetic_model(SHAPE, cfgs, rng, family=family, capacity=32 if family == "expert_major" else None)
    for (i, _), v in model.variants.items():  # the least intercepts belong to split-K variants
        v.coef[0] = (1.0 if model.configs[i].split_k > 1 else 50.0) + rng.uniform(0, 1)
    dm = sel.device_model(model, "cpu", capacity=32 if family == "expert_major" else None)
    zeros = np.zeros(SHAPE.num_experts, dtype=np.int64)
    for M in (3, 40):
        i = model.choose(zeros, M)
        pred = model.predict(zeros, M)
        ranks = [cm.empty_call_rank(c, model.plan(k, M)) for k, c in enumerate(model.configs) if np.isfinite(pred[k])]
        assert cm.empty_call_rank(model.configs[i], model.plan(i, M)) == min(ranks)
        assert model.configs[i].split_k == 1 and np.nanargmin(pred) != i
        if family == "token":
            assert model.configs[i].form == "fused"  # one launch
        ids = torch.full((M, SHAPE.top_k), -1, dtype=torch.int64)  # every slot masked
        row, cost = sel.choose_device(dm, M, topk_ids=ids, num_experts=SHAPE.num_experts, use_triton=use_triton)
        assert dm.rows[int(row)] == i and float(cost) == pytest.approx(pred[i], rel=1e-5)
        row2, _ = sel.choose_device(dm, M, counts=torch.zeros(SHAPE.num_experts, dtype=torch.int32),
                                    use_triton=use_triton)
        assert int(row2) == int(row)
        # one routed pair: the model's argmin again
        ids[0, 0] = 1
        row3, _ = sel.choose_device(dm, M, topk_ids=ids, num_experts=SHAPE.num_experts, use_triton=use_triton)
        one = model.predict(sel.histogram(ids, SHAPE.num_experts).numpy(), M)
        assert float(one[dm.rows[int(row3)]]) == pytest.approx(np.nanmin(one), rel=1e-5)
    # Candidates that all split K (a graph's few winners): still a valid row, the least rank.
    split = [k for k, c in enumerate(model.configs) if c.split_k > 1]
    sub = sel.device_model(model, "cpu", capacity=32 if family == "expert_major" else None, configs=split)
    row, cost = sel.choose_device(sub, 40, counts=torch.zeros(SHAPE.num_experts, dtype=torch.int32),
                                  use_triton=use_triton)
    assert 0 <= int(row) < sub.num_variants and np.isfinite(float(cost))
    assert float(sub.empty_rank[int(row)]) == float(sub.empty_rank[torch.isfinite(
        sel.costs_torch(sub, torch.zeros(SHAPE.num_experts, dtype=torch.int32), 40))].min())


def _selector():
    model = synthetic_model(SHAPE, config_space(SHAPE)[::5], np.random.default_rng(5))
    return sel.Selector(SHAPE, device="cpu", model=model, use_triton=False)


def test_per_step_cache_reads_the_host_once_per_step():
    s = _selector()
    ids = [synthetic_routing(8, SHAPE.num_experts, SHAPE.top_k, beta=b, seed=i)[0]
           for i, b in enumerate((1.0, 0.5, 0.7, 0.9))]
    picks = [s.select(topk_ids=ids[layer], layer=layer) for layer in range(4)]
    assert s.host_reads == 1 and len(set(picks)) == 1  # layers 1-3 reuse layer 0's choice
    s.select(topk_ids=ids[1], layer=0)  # layer 0 again: a new step
    assert s.host_reads == 2
    s.select(topk_ids=synthetic_routing(9, SHAPE.num_experts, SHAPE.top_k, seed=1)[0], layer=1)
    assert s.host_reads == 3  # another token count: its own entry
    s.new_step()
    s.select(topk_ids=ids[0], layer=0)
    assert s.host_reads == 4


def test_explicit_steps_and_no_cache_outside():
    s = _selector()
    ids = synthetic_routing(8, SHAPE.num_experts, SHAPE.top_k, seed=0)[0]
    s.select(topk_ids=ids)
    s.select(topk_ids=ids)
    assert s.host_reads == 2  # no step: every call selects
    with s.step():
        for _ in range(5):
            s.select(topk_ids=ids)
    assert s.host_reads == 3
    with sel.step():
        s.select(topk_ids=ids)
        s.select(topk_ids=ids)
    with sel.step():
        s.select(topk_ids=ids)
    assert s.host_reads == 5


def test_selection_changes_with_the_routing():
    """The same token count, other routing: the cache must not hide a new step's histogram."""
    s = _selector()
    seen = set()
    for i, beta in enumerate((1.0, 0.45, 0.7, 0.5, 0.9, 0.6)):
        ids = synthetic_routing(64, SHAPE.num_experts, SHAPE.top_k, beta=beta, seed=i)[0]
        with s.step():
            got = s.select(topk_ids=ids)
        counts = sel.histogram(ids, SHAPE.num_experts).numpy()
        assert got == s.model.configs[s.model.choose(counts, 64)]
        seen.add(got)
    assert s.host_reads == 6


def test_fallback_warns_once_and_says_how_to_profile(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEKIT_RAMP_MODELS", str(tmp_path))  # no model file anywhere for this shape
    shape = MoEShape("nofile", num_experts=6, top_k=2, hidden=384, intermediate=256)
    sel.forget_selectors()
    with pytest.warns(UserWarning, match="moekit ramp profile --experts 6 --top-k 2 --hidden 384"):
        s = sel.selector_for(6, 2, 384, 256, dtype=torch.bfloat16, device="cpu")
    assert s.fallback
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sel.selector_for(6, 2, 384, 256, dtype=torch.bfloat16, device="cpu") is s
    ids = synthetic_routing(12, 6, 2, beta=0.7, seed=0)[0]
    c = s.select(topk_ids=ids)
    assert c in set(config_space(shape)) and c in s.configs
    with pytest.raises(ValueError, match="fitted model"):
        s.choose_device(12, topk_ids=ids)
    sel.forget_selectors()


def test_auto_config_reads_shape_and_precision_from_the_weights(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEKIT_RAMP_MODELS", str(tmp_path))
    sel.forget_selectors()
    w13 = torch.zeros(4, 2 * 256, 384, dtype=torch.float8_e4m3fn)
    w2 = torch.zeros(4, 384, 256, dtype=torch.float8_e4m3fn)
    ids = synthetic_routing(3, 4, 2, seed=0)[0]
    with pytest.warns(UserWarning, match="float8_e4m3fn"):
        c = sel.auto_config(ids, w13, w2)
    from moekit.kernels.configs import fp8_config_error

    assert fp8_config_error(c) is None
    counts = torch.tensor([3, 0, 1, 2], dtype=torch.int32)
    with pytest.warns(UserWarning, match="--family expert_major"):
        c2 = sel.auto_config_expert_major(counts, 16, w13, w2, top_k=2)
    assert c2.form == "two_launch"
    sel.forget_selectors()
