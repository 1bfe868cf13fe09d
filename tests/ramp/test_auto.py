"""``config="auto"`` wired into the kernels' entries and FusedExperts, in Triton's interpreter:
the call runs exactly the configuration the selector chose (bitwise), that choice is the
model's argmin for the call's routing, the first call at a token count runs the static choice
without reading the routing, and a step of many layers reads the host once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from moekit.kernels import KernelConfig, config_space, expert_major_default  # noqa: E402
from moekit.ops import fused_moe, fused_moe_expert_major  # noqa: E402
from moekit.moe import FusedExperts  # noqa: E402
from moekit.ramp import select as sel  # noqa: E402
from moekit.ramp.modelfile import model_filename, save_model  # noqa: E402
from moekit.ramp.regions import HARDWARE  # noqa: E402
from moekit.shapes import MoEShape  # noqa: E402

from .synthetic import synthetic_model  # noqa: E402

# H and N span two reduction chunks of bk = 64, so configs differ in their float32 rounding and
# "the chosen config ran" is visible bitwise (at one chunk every config gives the same bits).
SHAPE = MoEShape("auto", num_experts=4, top_k=2, hidden=256, intermediate=128)
M = 3


def _two_launch(bk: int, bm: int = 16) -> KernelConfig:
    return KernelConfig(bm=bm, bn=64, bk=bk, num_warps=4, num_stages=2, form="two_launch")


def _few_vs_many(model, cheap_few: int, cheap_many: int):
    """Config ``cheap_few`` wins when the routing names at most 2 of the 4 experts, ``cheap_many``
    from 3 on (10 + 8 A against 25 + A); the others never."""
    for (i, _), v in model.variants.items():
        v.coef[:] = {cheap_few: [10, 0, 0, 0, 8, 0], cheap_many: [25, 0, 0, 0, 1, 0]}.get(i, [100 + i, 0, 0, 0, 0, 0])
    return model


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    """An empty model directory searched first; the process-wide selectors forgotten around the test."""
    monkeypatch.setenv("MOEKIT_RAMP_MODELS", str(tmp_path))
    sel.forget_selectors()
    yield tmp_path
    sel.forget_selectors()


def _token_model(path) -> list[KernelConfig]:
    configs = [_two_launch(64), _two_launch(128), KernelConfig(bm=16, bn=64, bk=64, num_warps=4, num_stages=2,
                                                               form="fused")]
    assert set(configs) <= set(config_space(SHAPE))
    model = _few_vs_many(synthetic_model(SHAPE, configs, np.random.default_rng(0), hw=HARDWARE["h200"]), 0, 1)
    save_model(model, path / model_filename("h200", SHAPE, "bfloat16"), dtype="bfloat16")
    return configs


def _weights(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(SHAPE.num_experts, 2 * SHAPE.intermediate, SHAPE.hidden, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(SHAPE.num_experts, SHAPE.hidden, SHAPE.intermediate, generator=g) * 0.2).to(dtype)
    return w13, w2


def _routing(experts: list[int], seed: int):
    """M tokens whose K slots name only ``experts`` (each at least once), random weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts)
    ids = pool[torch.randint(0, len(experts), (M, SHAPE.top_k), generator=g)]
    ids.view(-1)[: len(experts)] = pool
    return ids, torch.rand(M, SHAPE.top_k, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fused_moe_auto_runs_the_chosen_config_exactly(models_dir, dtype):
    configs = _token_model(models_dir)
    w13, w2 = _weights(dtype)
    x = torch.randn(M, SHAPE.hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    ids0, w0 = _routing([0, 1, 2, 3], seed=0)
    y0 = fused_moe(x, w13, w2, ids0, w0, config="auto")
    s = sel.selector_for(4, 2, 256, 128, dtype=torch.bfloat16, device="cpu")
    assert not s.fallback and s.host_reads == 0  # the first call at M: the static choice, nothing read
    assert s.last == s.static_choice(M) and torch.equal(y0, fused_moe(x, w13, w2, ids0, w0, s.last))
    seen = set()
    for seed, experts in enumerate(([0, 1], [0, 1, 2, 3], [2, 3], [1, 2, 3])):
        ids, w = _routing(experts, seed)
        y = fused_moe(x, w13, w2, ids, w, config="auto")
        assert s.host_reads == seed + 1  # outside a step: one read per call
        want = configs[0] if len(experts) <= 2 else configs[1]
        counts = np.bincount(ids.reshape(-1).numpy(), minlength=4)
        assert s.last == want == configs[s.model.choose(counts, M)]
        assert torch.equal(y, fused_moe(x, w13, w2, ids, w, want))
        other = configs[1] if want == configs[0] else configs[0]
        if dtype == torch.float32:  # (fp16's rounding of the output hides the difference here)
            assert not torch.equal(y, fused_moe(x, w13, w2, ids, w, other))
        seen.add(s.last)
    assert seen == set(configs[:2])


def test_fused_moe_auto_in_a_step_reads_once(models_dir):
    _token_model(models_dir)
    w13, w2 = _weights(torch.float32)
    x = torch.randn(M, SHAPE.hidden, generator=torch.Generator().manual_seed(2))
    fused_moe(x, w13, w2, *_routing([0, 1], 0), config="auto")  # the first call at M (static)
    s = sel.selector_for(4, 2, 256, 128, dtype=torch.bfloat16, device="cpu")
    for step in range(2):  # (each interpreted call costs about a second)
        picks = set()
        with sel.step():
            for k, experts in enumerate(([0, 1], [0, 1, 2, 3], [3, 2])):  # three layers' routings
                fused_moe(x, w13, w2, *_routing(experts, 10 * step + k), config="auto")
                picks.add(s.last)
        assert s.host_reads == step + 1 and len(picks) == 1  # the step's first routing decided for all


def test_fallback_auto_runs_its_choice_and_warns_once(models_dir):
    w13, w2 = _weights(torch.float32)
    x = torch.randn(M, SHAPE.hidden, generator=torch.Generator().manual_seed(3))
    ids, w = _routing([0, 2, 3], 4)
    with pytest.warns(UserWarning, match="moekit ramp profile --experts 4 --top-k 2 --hidden 256"):
        first = fused_moe(x, w13, w2, ids, w, config="auto")
    s = sel.selector_for(4, 2, 256, 128, dtype=torch.bfloat16, device="cpu")
    from moekit.kernels.configs import default_config

    assert s.fallback and s.last == default_config(M, s.shape)  # the static choice without a model
    assert torch.equal(first, fused_moe(x, w13, w2, ids, w, s.last))
    y = fused_moe(x, w13, w2, ids, w, config="auto")
    assert s.host_reads == 1 and s.last in s.configs  # then the region analysis' template
    assert torch.equal(y, fused_moe(x, w13, w2, ids, w, s.last))


def test_bad_config_names_the_choices():
    w13, w2 = _weights(torch.float32)
    x = torch.zeros(M, SHAPE.hidden)
    ids, w = _routing([0, 1], 0)
    with pytest.raises(ValueError, match="'auto'.* or None"):
        fused_moe(x, w13, w2, ids, w, config="fast")
    with pytest.raises(ValueError, match="'auto'.* or None"):
        fused_moe_expert_major(torch.zeros(4, 8, SHAPE.hidden), torch.zeros(4, dtype=torch.int32), w13, w2, "bm16")


# -- the expert-major family (fused_moe_expert_major, FusedExperts) -----------------------------------

CAPACITY = 8


def _expert_major_model(path, top_k: int = 2) -> list[KernelConfig]:
    """A model file of another K than any caller states: the expert-major selector takes any K's."""
    configs = [_two_launch(64), _two_launch(128), _two_launch(64, bm=32)]
    assert set(configs) <= set(config_space(SHAPE))
    shape = MoEShape("auto", SHAPE.num_experts, top_k, SHAPE.hidden, SHAPE.intermediate)
    model = _few_vs_many(synthetic_model(shape, configs, np.random.default_rng(1), family="expert_major",
                                         capacity=CAPACITY), 0, 1)
    save_model(model, path / model_filename("h200", shape, "bfloat16", "expert_major"), dtype="bfloat16")
    return configs


def _counts(named: list[int]) -> torch.Tensor:
    c = torch.zeros(SHAPE.num_experts, dtype=torch.int32)
    c[named] = torch.tensor([3, 8, 1, 5][: len(named)], dtype=torch.int32)
    return c


def test_expert_major_auto_runs_the_chosen_config_exactly(models_dir):
    configs = _expert_major_model(models_dir, top_k=3)
    w13, w2 = _weights(torch.float32, seed=5)
    tokens = torch.randn(SHAPE.num_experts, CAPACITY, SHAPE.hidden, generator=torch.Generator().manual_seed(6))
    fused_moe_expert_major(tokens, _counts([0, 1]), w13, w2, "auto")  # the static choice
    s = sel.selector_for(4, None, 256, 128, dtype=torch.bfloat16, device="cpu", family="expert_major",
                         capacity=CAPACITY)
    assert not s.fallback and s.shape.top_k == 3 and s.host_reads == 0
    for k, named in enumerate(([0, 1, 2, 3], [1, 3], [0, 2, 3])):
        counts = _counts(named)
        y = fused_moe_expert_major(tokens, counts, w13, w2, "auto")
        assert s.host_reads == k + 1 and s.last == configs[0 if len(named) <= 2 else 1]
        want = fused_moe_expert_major(tokens, counts, w13, w2, s.last)
        other = fused_moe_expert_major(tokens, counts, w13, w2, configs[1] if s.last == configs[0] else configs[0])
        valid = [(e, n) for e, n in enumerate(counts.tolist()) if n]  # rows past the counts are unspecified
        assert all(torch.equal(y[e, :n], want[e, :n]) for e, n in valid)
        assert not all(torch.equal(y[e, :n], other[e, :n]) for e, n in valid)


def test_fused_experts_choose_per_step_and_run_the_choice(models_dir):
    configs = _expert_major_model(models_dir)
    w13, w2 = _weights(torch.float32, seed=7)
    layers = [FusedExperts(w13, w2, config="auto") for _ in range(3)]
    assert FusedExperts(w13, w2).config == "static"  # RaMP is opt-in
    tokens = torch.randn(SHAPE.num_experts, CAPACITY, SHAPE.hidden, generator=torch.Generator().manual_seed(8))
    s = None
    for step, first_named in enumerate(([0, 1, 2, 3], [0, 1], [0, 1, 2], [3])):
        for k, m in enumerate(layers):
            counts = _counts(first_named if k == 0 else [k, 3])
            y = m(tokens, counts)
            want = fused_moe_expert_major(tokens, counts, w13, w2, m.last_config)
            assert all(torch.equal(y[e, :n], want[e, :n]) for e, n in enumerate(counts.tolist()))
        s = s or sel.selector_for(4, None, 256, 128, dtype=torch.bfloat16, device="cpu", family="expert_major",
                                  capacity=CAPACITY)
        # A layer coming back starts a step; the first step ran the static choice (no read).
        assert s.host_reads == step
        assert {m.last_config for m in layers} == {s.static_choice(CAPACITY) if step == 0 else
                                                   configs[0 if len(first_named) <= 2 else 1]}


def test_fused_experts_default_mode_is_the_kernels_default():
    w13, w2 = _weights(torch.float32, seed=9)
    m = FusedExperts(w13, w2, config="default")
    tokens = torch.randn(SHAPE.num_experts, CAPACITY, SHAPE.hidden, generator=torch.Generator().manual_seed(10))
    counts = _counts([0, 2])
    y = m(tokens, counts)
    assert m.last_config == expert_major_default(CAPACITY, False)
    want = fused_moe_expert_major(tokens, counts, w13, w2, None)
    assert all(torch.equal(y[e, :n], want[e, :n]) for e, n in enumerate(counts.tolist()))


def test_expert_major_fallback_keeps_the_schedule_that_follows_the_counts(models_dir):
    """Region B (split-K templates for the token path): the expert-major fallback offers only
    two_launch with split_k = 1, the schedule whose cost follows the counts."""
    with pytest.warns(UserWarning, match="--top-k K --hidden 7168"):
        s = sel.selector_for(8, None, 7168, 2048, dtype=torch.bfloat16, device="cpu", family="expert_major",
                             capacity=64)
    from moekit.ramp.fallback import templates

    assert any(c.split_k > 1 for c in templates(s.shape, s.hardware))
    assert s.fallback and s.configs and all(c.form == "two_launch" and c.split_k == 1 for c in s.configs)
    assert s.static_choice(64) == expert_major_default(64, False)
    counts = torch.tensor([64, 0, 3, 17, 64, 1, 0, 9], dtype=torch.int32)
    assert s.select(counts=counts, M=64) in s.configs


# -- reading the routing only where it pays (FusedExperts' default) -----------------------------------


def _em_selector(models_dir) -> sel.Selector:
    _expert_major_model(models_dir)
    return sel.selector_for(4, None, 256, 128, dtype=torch.bfloat16, device="cpu", family="expert_major",
                            capacity=CAPACITY)


def test_read_gains_are_the_models_over_the_sweep(models_dir):
    """``read_gains_us``: the live choice's mean gain over the static one on the routing it read,
    and on the same skew's routing of the other seed (the other layers of a step), against a
    plain loop over the model's predictions."""
    from moekit.ramp.graphs import routing_sweep

    shape = MoEShape("gains", 16, 4, 256, 128)
    configs = [c for c in config_space(shape) if c.form == "two_launch" and c.split_k == 1]
    model = synthetic_model(shape, configs, np.random.default_rng(0), family="expert_major", capacity=64)
    s = sel.Selector(shape, model=model, family="expert_major", capacity=64, device="cpu")
    M = 12
    hists = routing_sweep(s, M, seeds=2)
    preds = [[float(v) for v in s.model.predict(np.minimum(h, 64), M)] for h in hists]
    half = len(preds) // 2
    static = min(range(len(configs)), key=lambda i: sum(p[i] for p in preds[:half]))  # one seed
    best = [min(range(len(configs)), key=lambda i: p[i]) for p in preds]
    same = sum(p[static] - p[best[j]] for j, p in enumerate(preds)) / len(preds)
    other = sum(p[static] - p[best[(j + half) % len(preds)]] for j, p in enumerate(preds)) / len(preds)
    assert same > other > 0  # the choice moves with the routing, not only with its skew
    assert s.static_choice(M) == configs[static]
    got = s.read_gains_us(M)
    assert got[0] == pytest.approx(same, rel=1e-12) and got[1] == pytest.approx(other, rel=1e-12, abs=1e-12)
    assert s.read_gain_us(M) == got[0]
    for calls in (1.0, 3.0, 48.0):
        s.calls_per_read = calls
        assert s.read_value_us(M) == pytest.approx(same + (calls - 1) * other, rel=1e-12)


def test_when_pays_reads_only_where_the_gain_covers_the_read(models_dir):
    s = _em_selector(models_dir)
    configs = s.configs
    layers = ("a", "b", "c")
    routings = ([0, 1, 2, 3], [1, 3], [0, 2], [0, 1, 3])

    def run_steps(n):
        for step in range(n):
            for k, layer in enumerate(layers):
                s.auto(CAPACITY, counts=_counts(routings[(step + k) % 4]), layer=layer, reads="when_pays")
                yield step, k

    same, other = s.read_gains_us(CAPACITY)
    assert same > 0 and other > 0
    value = same + (len(layers) - 1) * other  # what one read is worth to a step of three layers
    s.read_cost_us = max(same, value) * 1.05
    for _ in run_steps(3):
        assert s.last == s.static_choice(CAPACITY)
    assert s.host_reads == 0 and s.calls_per_read == len(layers) and not s.read_pays(CAPACITY)
    s.read_cost_us = value * 0.95
    assert s.read_pays(CAPACITY)
    for step, k in run_steps(3):
        first = routings[step % 4]  # the step's first layer decides for all of them
        assert s.host_reads == step + 1 and s.last == configs[0 if len(first) <= 2 else 1]
    with pytest.raises(ValueError, match="reads must be"):
        s.auto(CAPACITY, counts=_counts([0]), reads="always")


def test_the_first_call_at_a_token_count_reads_nothing_whatever_was_asked_before(models_dir):
    """The warm-up before a CUDA-graph capture must load the configuration the capture will run:
    the first call at M runs the static choice, even after the static choice, the gains or
    read_pays were computed for M."""
    s = _em_selector(models_dir)
    s.read_cost_us = 0.0
    assert s.read_pays(CAPACITY) and s.static_choice(CAPACITY)
    for reads in ("when_pays", "step"):
        s.new_step()
        s._launched.clear()
        assert s.auto(CAPACITY, counts=_counts([1, 3]), layer="a", reads=reads) == s.static_choice(CAPACITY)
        assert s.host_reads == 0
    s.new_step()
    s.auto(CAPACITY, counts=_counts([1, 3]), layer="a", reads="when_pays")  # a layer comes back: a new step
    assert s.host_reads == 1 and s.last == s.configs[0]


def test_model_selector_only_where_a_model_exists(models_dir):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "how to profile" warning on this path
        assert sel.model_selector_for(4, None, 256, 128, dtype=torch.bfloat16, device="cpu", family="expert_major",
                                      capacity=CAPACITY) is None
    _expert_major_model(models_dir)
    assert sel.model_selector_for(4, None, 256, 128, dtype=torch.bfloat16, device="cpu", family="expert_major",
                                  capacity=CAPACITY) is None  # remembered until the selectors are forgotten
    sel.forget_selectors()
    s = sel.model_selector_for(4, None, 256, 128, dtype=torch.bfloat16, device="cpu", family="expert_major",
                               capacity=CAPACITY)
    assert s is not None and not s.fallback
    assert s is sel.selector_for(4, None, 256, 128, dtype=torch.bfloat16, device="cpu", family="expert_major",
                                 capacity=CAPACITY)


def test_fused_experts_default_is_the_kernels_default_off_the_gpu(models_dir):
    """RaMP's models are per GPU: on the CPU (Triton's interpreter) the default policy (the static
    choice) runs the kernel's default even where a model file exists."""
    _expert_major_model(models_dir)
    w13, w2 = _weights(torch.float32, seed=11)
    m = FusedExperts(w13, w2)
    tokens = torch.randn(SHAPE.num_experts, CAPACITY, SHAPE.hidden, generator=torch.Generator().manual_seed(12))
    counts = _counts([1, 2])
    y = m(tokens, counts)
    assert m.config == "static" and m.last_config == expert_major_default(CAPACITY, False)
    want = fused_moe_expert_major(tokens, counts, w13, w2, None)
    assert all(torch.equal(y[e, :n], want[e, :n]) for e, n in enumerate(counts.tolist()))


def test_the_read_is_priced_by_its_mode(models_dir):
    """Without an explicit cost, a read is priced at the measured cost of its mode: the captured
    selection's, or the eager launch's (about three times more)."""
    s = _em_selector(models_dir)
    assert s.read_cost_us is None and s.graphed_reads
    gain = s.read_gain_us(CAPACITY)
    s.calls_per_read = (sel.GRAPHED_READ_COST_US + sel.EAGER_READ_COST_US) / 2 / gain  # between the two
    assert s.read_pays(CAPACITY)
    s.graphed_reads = False
    assert not s.read_pays(CAPACITY)
    s.read_cost_us = 0.0
    assert s.read_pays(CAPACITY)
