"""RaMP on a GPU: the auto choice runs exactly the chosen config, one host read per step, the
Triton selection agrees with torch's, and the CUDA-graph path replays correctly with new routing.

``config="auto"`` through the kernels' entries and ``FusedExperts``: the call runs the config
the selector chose (bitwise), the routing decides it, a step reads the host once, and a call
captured in a CUDA graph (after one warm-up call) replays the static choice with new routing,
reading nothing back (a host read inside a capture would fail it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytest.importorskip("triton")

from moekit.kernels import KernelConfig, config_space, expert_major_default  # noqa: E402
from moekit.ops import fused_moe, fused_moe_expert_major  # noqa: E402  (the policy entries: "auto" and configs)
from moekit.moe import FusedExperts  # noqa: E402
from moekit.ramp import costmodel as cm  # noqa: E402
from moekit.ramp import graphs  # noqa: E402
from moekit.ramp import select as sel  # noqa: E402
from moekit.ramp.modelfile import model_filename, save_model  # noqa: E402
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


def _model(configs, coefs, family: str = "token", capacity=None) -> cm.CostModel:
    """A model whose variant i costs coefs[i] = (alpha, epsilon): alpha + epsilon * named experts."""
    model = cm.CostModel(SHAPE, hardware_for(device=DEV), list(configs), cm.ModelForm(), {}, family=family,
                         capacity=capacity)
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


def test_an_empty_histogram_selects_the_same_row_in_triton_torch_and_the_model():
    """Every slot masked (no pair reaches this shard): the Triton kernel, the torch path and the
    host model take the least empty-call rank, and the fused call with it runs and is zero."""
    rng = np.random.default_rng(2)
    configs = config_space(SHAPE)[::3]
    model = _model(configs, [((1.0 if c.split_k > 1 else 20.0) + rng.uniform(0, 1), rng.uniform(0, 3))
                             for c in configs])
    dm = sel.device_model(model, DEV)
    zeros = np.zeros(SHAPE.num_experts, dtype=np.int64)
    for M in (4, 200):
        ids = torch.full((M, SHAPE.top_k), -1, dtype=torch.int64, device=DEV)
        r_t, c_t = sel.choose_device(dm, M, topk_ids=ids, num_experts=SHAPE.num_experts, use_triton=True)
        r_p, c_p = sel.choose_device(dm, M, topk_ids=ids, num_experts=SHAPE.num_experts, use_triton=False)
        i = model.choose(zeros, M)
        assert dm.rows[int(r_t)] == dm.rows[int(r_p)] == i and configs[i].split_k == 1
        assert float(c_t) == pytest.approx(float(c_p), rel=1e-5)
        x, w13, w2 = _inputs(M)
        y = fused_moe(x, w13, w2, ids, torch.rand(M, SHAPE.top_k, device=DEV), configs[i])
        assert torch.equal(y, torch.zeros_like(y))


def test_graphed_reads_choose_what_the_eager_selection_chooses():
    """The captured selection (one graph per token count, its input copied in) gives the eager
    selection's config for every new routing, from topk_ids and from counts."""
    rng = np.random.default_rng(1)
    configs = config_space(SHAPE)[::4]
    model = _model(configs, [(rng.uniform(5, 50), rng.uniform(0, 3)) for _ in configs])
    graphed, eager = sel.Selector(SHAPE, device=DEV, model=model), sel.Selector(SHAPE, device=DEV, model=model)
    eager.graphed_reads = False
    assert graphed.graphed_reads
    for M in (1, 7, 64, 700):
        picks = set()
        for seed, beta in enumerate((1.0, 0.3, 0.6, 0.9, 0.45)):
            ids, _ = _routing(M, beta, 10 * M + seed)
            cfg = graphed.choose(M, topk_ids=ids)
            assert cfg == eager.choose(M, topk_ids=ids)
            picks.add(cfg)
            counts = sel.histogram(ids, SHAPE.num_experts).to(torch.int32)
            assert graphed.choose(M, counts=counts) == eager.choose(M, counts=counts)
        # each new routing reached the captured graph: its choice changes with them (at M = 1 the
        # 4 named experts give every routing the same choice)
        assert len(picks) == (1 if M == 1 else 2)
    assert len(graphed._graphs) == 8  # (M, topk_ids | counts)


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


# -- config="auto" through the kernels' entries and FusedExperts ----------------------------------

CAPACITY = 32


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    """A model directory searched first (empty unless a test writes one); the process-wide
    selectors forgotten around the test."""
    monkeypatch.setenv("MOEKIT_RAMP_MODELS", str(tmp_path))
    sel.forget_selectors()
    yield tmp_path
    sel.forget_selectors()


def _save(model: cm.CostModel, where) -> None:
    save_model(model, where / model_filename(model.hardware.key, SHAPE, "bfloat16", model.family), dtype="bfloat16")


def _named(ids) -> int:
    return int((sel.histogram(ids, SHAPE.num_experts) > 0).sum())


def test_auto_entry_runs_the_chosen_config_and_reads_once_per_step(models_dir):
    _save(_model(DECODE, [(10, 4), (42, 0), (1000, 0)]), models_dir)
    x, w13, w2 = _inputs(8, seed=2)
    fused_moe(x, w13, w2, *_routing(8, 1.0, 0), config="auto")  # the first call at M: the static choice
    s = sel.selector_for(SHAPE.num_experts, SHAPE.top_k, SHAPE.hidden, SHAPE.intermediate, dtype=torch.bfloat16,
                         device=DEV)
    assert not s.fallback and s.host_reads == 0
    seen = set()
    for seed, beta in enumerate((1.0, 0.35, 0.8, 0.4)):
        ids, w = _routing(8, beta, seed)  # the routings of test_auto_runs_exactly_the_chosen_config: both configs
        y = fused_moe(x, w13, w2, ids, w, config="auto")
        assert s.last == DECODE[0 if 10 + 4 * _named(ids) < 42 else 1]
        assert torch.equal(y, fused_moe(x, w13, w2, ids, w, s.last))
        seen.add(s.last)
    assert len(seen) == 2 and s.host_reads == 4  # outside a step: one read per call
    with sel.step():
        for layer in range(6):
            fused_moe(x, w13, w2, *_routing(8, 0.4 + 0.1 * layer, 40 + layer), config="auto")
    assert s.host_reads == 5


def _expert_major_step(layers, tokens, w13, w2, g, step: int) -> None:
    """One forward step through ``layers`` (``FusedExperts``), their counts naming 4 or 14 of the
    16 experts in turn; each call ran exactly the config it reports (bitwise)."""
    for k, layer in enumerate(layers):
        named = 4 if (step + k) % 2 else 14
        counts = torch.zeros(SHAPE.num_experts, dtype=torch.int32, device=DEV)
        counts[:named] = torch.randint(1, CAPACITY + 1, (named,), generator=g, device=DEV, dtype=torch.int32)
        y = layer(tokens, counts)
        want = fused_moe_expert_major(tokens, counts, w13, w2, layer.last_config)
        assert all(torch.equal(y[e, :n], want[e, :n]) for e, n in enumerate(counts.tolist()))


def test_fused_experts_auto_reads_once_per_step(models_dir):
    em = [c for c in DECODE if c.bm == 16]
    _save(_model(em + [DECODE[2]], [(10, 2), (30, 0), (1000, 0)], "expert_major", CAPACITY), models_dir)
    _, w13, w2 = _inputs(1, seed=3)
    layers = [FusedExperts(w13, w2, config="auto") for _ in range(4)]
    g = torch.Generator(device=DEV).manual_seed(4)
    tokens = torch.randn(SHAPE.num_experts, CAPACITY, SHAPE.hidden, generator=g, device=DEV, dtype=torch.bfloat16)
    s = None
    for step in range(3):
        _expert_major_step(layers, tokens, w13, w2, g, step)
        s = s or sel.selector_for(SHAPE.num_experts, None, SHAPE.hidden, SHAPE.intermediate, dtype=torch.bfloat16,
                                  device=DEV, family="expert_major", capacity=CAPACITY)
        assert s.host_reads == step  # step 0: the static choice; then the step's first layer reads
        assert len({m.last_config for m in layers}) == 1


def _capture(fn):
    """``fn`` warmed up once on a side stream (the first call at a token count: the static
    choice, which loads its kernels), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("fitted", [True, False], ids=["model", "fallback"])
def test_captured_auto_call_replays_the_static_choice(models_dir, fitted):
    if fitted:
        _save(_model(DECODE, [(10, 4), (42, 0), (1000, 0)]), models_dir)
    M = 8
    x, w13, w2 = _inputs(M, seed=5)
    ids = torch.empty(M, SHAPE.top_k, dtype=torch.int64, device=DEV)
    w = torch.empty(M, SHAPE.top_k, dtype=torch.float32, device=DEV)
    r = _routing(M, 0.35, 50)
    ids.copy_(r[0])
    w.copy_(r[1])
    graph, out = _capture(lambda: fused_moe(x, w13, w2, ids, w, config="auto"))
    s = sel.selector_for(SHAPE.num_experts, SHAPE.top_k, SHAPE.hidden, SHAPE.intermediate, dtype=torch.bfloat16,
                         device=DEV)
    assert s.fallback != fitted and s.host_reads == 0 and s.last == s.static_choice(M)
    for seed, beta in enumerate((1.0, 0.35, 0.7)):
        r = _routing(M, beta, 60 + seed)
        ids.copy_(r[0])
        w.copy_(r[1])
        graph.replay()
        torch.cuda.synchronize()
        want = fused_moe(x, w13, w2, ids, w, s.static_choice(M))
        if fitted:  # the model's configs are decode-schedule ones: bitwise reproducible
            assert torch.equal(out, want)
        else:  # default_config splits K with float32 atomics: equal up to their summation order
            torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
    assert s.host_reads == 0


def test_captured_fused_experts_replay_the_static_choice(models_dir):
    _, w13, w2 = _inputs(1, seed=6)
    experts = FusedExperts(w13, w2, config="auto")
    g = torch.Generator(device=DEV).manual_seed(7)
    tokens = torch.randn(SHAPE.num_experts, CAPACITY, SHAPE.hidden, generator=g, device=DEV, dtype=torch.bfloat16)
    counts = torch.randint(0, CAPACITY + 1, (SHAPE.num_experts,), generator=g, device=DEV, dtype=torch.int32)
    graph, out = _capture(lambda: experts(tokens, counts))
    static = expert_major_default(CAPACITY, False)  # no model file: the kernel's default
    assert experts.last_config == static
    for _ in range(3):
        tokens.copy_(torch.randn(tokens.shape, generator=g, device=DEV, dtype=torch.bfloat16))
        counts.copy_(torch.randint(0, CAPACITY + 1, (SHAPE.num_experts,), generator=g, device=DEV,
                                   dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = fused_moe_expert_major(tokens, counts, w13, w2, static)
        assert all(torch.equal(out[e, :n], want[e, :n]) for e, n in enumerate(counts.tolist()))


def test_fused_experts_ramp_policy_reads_only_where_it_pays(models_dir):
    """FusedExperts' "ramp" policy (opt-in): with a model file, the static choice where the model's
    predicted gain over the calls one read serves does not cover the read, one read per step
    where it does; the call runs the chosen config exactly either way."""
    em = [c for c in DECODE if c.bm == 16]
    _save(_model(em + [DECODE[2]], [(10, 2), (30, 0), (1000, 0)], "expert_major", CAPACITY), models_dir)
    _, w13, w2 = _inputs(1, seed=8)
    layers = [FusedExperts(w13, w2, config="ramp") for _ in range(4)]
    assert all(m.config == "ramp" for m in layers)
    s = sel.model_selector_for(SHAPE.num_experts, None, SHAPE.hidden, SHAPE.intermediate, dtype=torch.bfloat16,
                               device=DEV, family="expert_major", capacity=CAPACITY)
    assert s is not None and not s.fallback
    gain = s.read_gain_us(CAPACITY)
    assert gain > 0
    g = torch.Generator(device=DEV).manual_seed(9)
    tokens = torch.randn(SHAPE.num_experts, CAPACITY, SHAPE.hidden, generator=g, device=DEV, dtype=torch.bfloat16)
    for cost, reads in ((gain * len(layers) * 1.5, 0), (gain * 0.5, 3)):
        s.read_cost_us = cost
        before = s.host_reads
        for step in range(3):
            _expert_major_step(layers, tokens, w13, w2, g, step)
            if not reads:
                assert all(m.last_config == s.static_choice(CAPACITY) for m in layers)
        assert s.host_reads - before == reads
