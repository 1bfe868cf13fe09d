"""The graph path's candidates and its masked form, eagerly in the interpreter (the captured
graphs themselves are tested on the GPU: tests/gpu/test_ramp_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from moekit.kernels import fused_moe  # noqa: E402
from moekit.kernels.configs import KernelConfig  # noqa: E402
from moekit.ramp import graphs  # noqa: E402
from moekit.ramp.select import Selector, histogram  # noqa: E402
from moekit.routing import synthetic_routing  # noqa: E402
from moekit.shapes import MoEShape  # noqa: E402

from .synthetic import synthetic_model  # noqa: E402

SHAPE = MoEShape("graph", num_experts=4, top_k=2, hidden=48, intermediate=40)
CONFIGS = [KernelConfig(bm=16, bn=32, bk=32, form="fused"), KernelConfig(bm=16, bn=16, bk=16, form="two_launch"),
           KernelConfig(bm=32, bn=16, bk=32, form="two_launch", split_k=2), KernelConfig(bm=64, bn=32, bk=16, form="fused")]


def _selector():
    """Config 0 is cheapest with few named experts, config 1 with many (crossover at 3 of 4),
    the others never."""
    model = synthetic_model(SHAPE, CONFIGS, np.random.default_rng(7))
    for (i, _), v in model.variants.items():
        v.coef[:] = {0: [10, 0, 0, 0, 8, 0], 1: [25, 0, 0, 0, 1, 0]}.get(i, [100 + i, 0, 0, 0, 0, 0])
    return Selector(SHAPE, device="cpu", model=model, use_triton=True)


def test_candidates_are_the_most_picked_and_include_the_static_choice():
    s = _selector()
    cands, static, facts = graphs.graph_candidates(s, 6, k=2)
    assert sorted(cands) == [0, 1] and static in cands
    preds = np.stack([s.model.predict(h, 6) for h in graphs.routing_sweep(s, 6)])
    assert static == int(np.argmin(np.where(np.isfinite(preds), preds, np.inf).mean(axis=0)))
    assert facts["predicted_loss_candidates"] <= facts["predicted_loss_static"] + 1e-12
    assert sum(facts["picks"].values()) == facts["routings"]


def test_masked_switch_runs_the_chosen_config_exactly():
    s = _selector()
    M = 6
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, SHAPE.hidden, generator=g)
    w13 = torch.randn(SHAPE.num_experts, 2 * SHAPE.intermediate, SHAPE.hidden, generator=g) * 0.2
    w2 = torch.randn(SHAPE.num_experts, SHAPE.hidden, SHAPE.intermediate, generator=g) * 0.2
    ids = torch.empty(M, SHAPE.top_k, dtype=torch.int64)
    w = torch.empty(M, SHAPE.top_k)
    gm = graphs.GraphedMoE(s, x, w13, w2, ids, w, candidates=[0, 1, 3], static=1)
    chosen = set()
    for seed, beta in enumerate((1.0, 0.5, 0.8, 0.6)):
        rid, rw = synthetic_routing(M, SHAPE.num_experts, SHAPE.top_k, beta=beta, seed=seed)
        ids.copy_(rid)
        w.copy_(rw)
        out = gm.run_masked().clone()
        pos = int(gm.choice)
        pred = s.model.predict(histogram(ids, SHAPE.num_experts).numpy(), M)[[0, 1, 3]]
        assert pos == int(np.argmin(pred))
        want = fused_moe(x, w13, w2, ids, w, gm.configs[pos])
        assert torch.equal(out, want)
        chosen.add(pos)
    assert chosen == {0, 1}  # the routing decided, both ways


def test_bad_mode_and_capture_without_gpu():
    s = _selector()
    x = torch.zeros(2, SHAPE.hidden)
    ids = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="mode"):
        graphs.GraphedMoE(s, x, None, None, ids, ids.float(), mode="fast", candidates=[0], static=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            graphs.GraphedMoE(s, x, None, None, ids, ids.float(), candidates=[0], static=0).capture()
