"""RaMP on a GPU: the auto choice runs exactly the chosen config, one host read per step, the
Triton selection agrees with torch's, and the CUDA-graph path replays correctly with new routing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytest.importorskip("triton")

from moekit.kernels import KernelConfig, config_space, fused_moe  # noqa: E402
from moekit.ramp import costmodel as cm  # noqa: E402
from moekit.ramp import graphs  # noqa: E402
from moekit.ramp import select as sel  # noqa: E402
from moekit.ramp.regions import hardware_for  # noqa: E402
from moekit.routing import synthetic_routing  # noqa: E402
from moekit.shapes import MoEShape  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
SHAPE = MoEShape("gpu-ramp", num_experts=16, top_k=4, hidden=512, intermediate=384)
# Decode-schedule configs (two_launch, split_k = 1, M <= bm: the persistent kernel): bitwise
# reproducible run to run, so "the same config" can be checked with torch.equal.
DECODE = [KernelConfig(bm=16, bn=32, bk=128, num_warps=4, num_stages=3),
          KernelConfig(bm=16, bn=64, bk=128, num_warps=4, num_stages=3),
          KernelConfig(bm=32, bn=64, bk=64, num_warps=4, num_stages=3)]


def _model(configs, coefs) -> cm.CostModel:
    """A model whose variant i costs coefs[i] = (alpha, epsilon): alpha + epsilon * named experts."""
    model = cm.CostModel(SHAPE, hardware_for(device=DEV), list(configs), cm.ModelForm(), {})
    for i, c in enumerate(configs):
        for M in (1, c.bm + 1):
            path = model.plan(i, M).path
            a, e = coefs[i]
            model.variants[(i, path)] = cm.Variant(i, path, np.array([a, 0, 0, 0, e, 0.0]), False, 25, 0.0)
    return model


def _inputs(M, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, SHAPE.hidden, generator=g, device=DEV, dtype=torch.bfloat16)
    w13 = torch.randn(SHAPE.num_experts, 2 * SHAPE.intermediate, SHAPE.hidden, generator=g, device=DEV,
                      dtype=torch.bfloat16) * SHAPE.hidden**-0.5
    w2 = torch.randn(SHAPE.num_experts, SHAPE.hidden, SHAPE.intermediate, generator=g, device=DEV,
                     dtype=torch.bfloat16) * SHAPE.intermediate**-0.5
    return x, w13, w2


def _routing(M, beta, seed):
    ids, w = synthetic_routing(M, SHAPE.num_experts, SHAPE.top_k, beta=beta, seed=seed)
    return ids.to(DEV), w.to(DEV)


def test_auto_runs_exactly_the_chosen_config():
    # Few named experts -> config 0, many -> config 1 (crossover at 8 of 16).
    model = _model(DECODE, [(10, 4), (42, 0), (1000, 0)])
    s = sel.Selector(SHAPE, device=DEV, model=model)
    x, w13, w2 = _inputs(8)
    seen = set()
    for seed, beta in enumerate((1.0, 0.35, 0.8, 0.4)):
        ids, w = _routing(8, beta, seed)
        cfg = s.choose(8, topk_ids=ids)
        named = int((sel.histogram(ids, SHAPE.num_experts) > 0).sum())
        assert cfg == DECODE[0 if 10 + 4 * named < 42 else 1]
        y_auto = fused_moe(x, w13, w2, ids, w, cfg)
        assert torch.equal(y_auto, fused_moe(x, w13, w2, ids, w, cfg))
        seen.add(cfg)
    assert len(seen) == 2


def test_triton_selection_matches_torch_on_the_gpu():
    rng = np.random.default_rng(0)
    configs = config_space(SHAPE)[::4]
    model = _model(configs, [(rng.uniform(5, 50), rng.uniform(0, 3)) for _ in configs])
    for (i, p), v in model.variants.items():
        v.coef[1:4] = rng.uniform(0, 5), rng.uniform(0, 0.02), 0.0
        v.coef[5] = rng.uniform(0, 0.1)
    dm = sel.device_model(model, DEV)
    for M, beta in ((1, 1.0), (7, 0.5), (64, 0.8), (700, 0.5), (3000, 1.0)):
        ids, _ = _routing(M, beta, M)
        r_t, c_t = sel.choose_device(dm, M, topk_ids=ids, num_experts=SHAPE.num_experts, use_triton=True)
        r_p, c_p = sel.choose_device(dm, M, topk_ids=ids, num_experts=SHAPE.num_experts, use_triton=False)
        assert float(c_t) == pytest.approx(float(c_p), rel=1e-5)
        pred = model.predict(sel.histogram(ids, SHAPE.num_experts).cpu().numpy(), M)
        assert float(c_t) == pytest.approx(np.nanmin(pred), rel=1e-5)


def test_one_host_read_per_step_for_every_layer():
    model = _model(DECODE, [(10, 4), (42, 0), (1000, 0)])
    s = sel.Selector(SHAPE, device=DEV, model=model)
    x, w13, w2 = _inputs(8)
    for step in range(3):
        for layer in range(6):
            ids, w = _routing(8, 0.5 + 0.1 * layer, 100 * step + layer)
            cfg = s.select(topk_ids=ids, layer=layer)
            fused_moe(x, w13, w2, ids, w, cfg)
        assert s.host_reads == step + 1


@pytest.mark.parametrize("mode", ["auto", "masked"])
def test_graph_path_replays_with_new_routing(mode):
    model = _model(DECODE, [(10, 4), (42, 0), (1000, 0)])
    s = sel.Selector(SHAPE, device=DEV, model=model)
    M = 8
    x, w13, w2 = _inputs(M, seed=1)
    ids = torch.empty(M, SHAPE.top_k, dtype=torch.int64, device=DEV)
    w = torch.empty(M, SHAPE.top_k, dtype=torch.float32, device=DEV)
    r0 = _routing(M, 1.0, 0)
    ids.copy_(r0[0])
    w.copy_(r0[1])
    gm = graphs.GraphedMoE(s, x, w13, w2, ids, w, candidates=[0, 1], static=0, mode=mode).capture()
    assert gm.mode in ("conditional", "masked")
    chosen = set()
    for seed, beta in enumerate((0.35, 1.0, 0.4, 0.9, 0.6)):
        rid, rw = _routing(M, beta, 10 + seed)
        ids.copy_(rid)
        w.copy_(rw)
        out = gm.replay()
        torch.cuda.synchronize()
        pos = int(gm.choice.item())
        assert DECODE[pos] == s.choose(M, topk_ids=ids)
        assert torch.equal(out, fused_moe(x, w13, w2, ids, w, DECODE[pos]))
        chosen.add(pos)
    assert chosen == {0, 1}
