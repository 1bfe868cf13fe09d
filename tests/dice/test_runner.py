"""The schedule runner on one process (world size 1, the eager all-to-all's single-rank path)
against the simulator, its buffers and rows against the accounting model, and its pieces."""

from __future__ import annotations

import pytest
import torch

from moekit.dice import ScheduleConfig, ScheduledMoE, SchedulePlan, StalenessSimulator, make_executor, preset, sample
from moekit.dice import accounting
from moekit.dice.runner import SlotResult, cache_lookup, scale
from moekit.dice.schedules import PRESET_NAMES
from tests.dice.cases import CFG_SCALE, CONFIG, global_batch, tiny_model

STEPS = 6


def _run(moe, model=None, batch=3):
    model = model or tiny_model()
    noise, labels = global_batch([batch])
    return sample(model, noise, labels, steps=STEPS, cfg_scale=CFG_SCALE, moe=moe)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_single_rank_runner_matches_the_simulator(name):
    model = tiny_model()
    weights, shape = model.moe_weights(), CONFIG.moe_shape
    schedule = preset(name, STEPS)
    runner = ScheduledMoE(weights, shape, schedule, STEPS, experts="rowwise", batch_invariant=True)
    z = _run(runner, model)
    sim = StalenessSimulator(weights, shape, schedule, STEPS, batch_invariant=True,
                             row_rank=torch.zeros(2 * 3 * CONFIG.tokens_per_image, dtype=torch.int64))
    assert torch.equal(z, _run(sim, model))
    stats = runner.stats()
    assert stats["sources"] == sim.stats()["sources"] == SchedulePlan(schedule, STEPS, CONFIG.depth).source_table
    assert stats["rows_local"] == sim.stats()["rows_local"] and sum(stats["rows_remote"]) == 0


def test_sync_schedule_is_the_models_own_moe():
    model = tiny_model()
    runner = ScheduledMoE(model.moe_weights(), CONFIG.moe_shape, ScheduleConfig(warmup=0), STEPS, experts="rowwise",
                          batch_invariant=True)
    assert torch.equal(_run(runner, model), _run(None, model))


def test_schedules_change_the_result_and_stay_close():
    model = tiny_model()
    outs = {}
    for name in ("sync", "displaced", "interweaved"):
        runner = ScheduledMoE(model.moe_weights(), CONFIG.moe_shape, preset(name, STEPS), STEPS)
        outs[name] = _run(runner, model)
    for name in ("displaced", "interweaved"):
        diff = (outs[name] - outs["sync"]).abs().max().item()
        assert 0 < diff < 5 * outs["sync"].abs().max().item(), (name, diff)


@pytest.mark.parametrize("config", [
    ScheduleConfig("displaced"), ScheduleConfig("interweaved"), ScheduleConfig("displaced", cond_every=2),
    ScheduleConfig("interweaved", cond_every=3), ScheduleConfig("interweaved", async_layers="shallow", cond_every=2),
    ScheduleConfig("displaced", async_layers="interleaved", warmup=2), ScheduleConfig("interweaved", sync_every=2),
    ScheduleConfig("sync", warmup=0),
])
@pytest.mark.parametrize("steps", [3, STEPS])
def test_peak_buffers_and_rows_follow_the_accounting_model(config, steps):
    model = tiny_model()
    runner = ScheduledMoE(model.moe_weights(), CONFIG.moe_shape, config, steps)
    noise, labels = global_batch([3])
    sample(model, noise, labels, steps=steps, cfg_scale=CFG_SCALE, moe=runner)
    plan = SchedulePlan(config, steps, CONFIG.depth)
    assert runner.stats()["peak_buffers"]["total"] == accounting.peak_buffers(plan)
    tokens = 2 * 3 * CONFIG.tokens_per_image
    model_rows = accounting.rows_per_step(plan, tokens, CONFIG.top_k)
    measured = runner.stats()["rows_local"]
    if config.cond_every is None:
        assert measured == model_rows
    else:  # the model counts no cache misses: a lower bound, reached on refresh steps
        full = accounting.rows_per_step(SchedulePlan(config.with_(cond_every=None), steps, CONFIG.depth), tokens,
                                        CONFIG.top_k)
        assert all(lo <= m <= hi for lo, m, hi in zip(model_rows, measured, full)), (model_rows, measured, full)
        if steps == STEPS:
            assert any(m < hi for m, hi in zip(measured, full))  # conditional communication does cut rows


def test_interweaved_needs_fewer_buffers_than_displaced():
    def peak(mode):
        return accounting.peak_buffers(SchedulePlan(ScheduleConfig(mode), 50, 28))
    assert peak("interweaved") * 2 == peak("displaced") == 56


def test_async_executor_gives_the_same_bits():
    model = tiny_model()
    outs = []
    for kind in ("inline", "async"):
        runner = ScheduledMoE(model.moe_weights(), CONFIG.moe_shape, preset("dice", STEPS), STEPS,
                              executor=make_executor(kind))
        outs.append(_run(runner, model))
        runner.close()
    assert torch.equal(*outs)


def test_cache_lookup_finds_the_expert_in_any_cached_slot():
    cache = SlotResult(0, torch.tensor([[3, 5], [1, 2]]), torch.ones(2, 2),
                       torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 3))
    hit, rows = cache_lookup(cache, torch.tensor([[5, 3], [2, 7]]))
    assert hit.tolist() == [[True, True], [True, False]]
    assert torch.equal(rows[0, 0], cache.out[0, 1]) and torch.equal(rows[0, 1], cache.out[0, 0])
    assert torch.equal(rows[1, 0], cache.out[1, 1]) and torch.equal(rows[1, 1], torch.zeros(3))
    hit, rows = cache_lookup(None, torch.tensor([[1, 2]]))
    assert not hit.any() and rows is None


def test_latest_scores_reweight_with_this_steps_router():
    ids = torch.tensor([[0, 2]])
    result = SlotResult(0, ids, torch.tensor([[0.6, 0.3]]), torch.ones(1, 2, 4))
    probs = torch.tensor([[0.1, 0.2, 0.7]])
    def f32(a, b):  # the float32 slot-order sum of two weights times 1.0
        return (torch.tensor(a, dtype=torch.float32) + torch.tensor(b, dtype=torch.float32)).expand(1, 4)
    assert torch.equal(scale(result, probs, "stale", torch.float32), f32(0.6, 0.3))
    assert torch.equal(scale(result, probs, "latest", torch.float32), f32(0.1, 0.7))


def test_runner_errors():
    model = tiny_model()
    with pytest.raises(ValueError, match="experts must be one of"):
        ScheduledMoE(model.moe_weights(), CONFIG.moe_shape, ScheduleConfig(), STEPS, experts="cutlass")
    with pytest.raises(ValueError, match="weights must list"):
        ScheduledMoE([], CONFIG.moe_shape, ScheduleConfig(), STEPS)
    runner = ScheduledMoE(model.moe_weights(), CONFIG.moe_shape, ScheduleConfig(), STEPS)
    with pytest.raises(RuntimeError, match="begin_step"):
        runner(0, torch.randn(4, CONFIG.hidden))
    with pytest.raises(ValueError, match="step must be in \\[0, 5\\]"):
        runner.begin_step(6)
    with pytest.raises(ValueError, match="warmup \\+ cooldown"):
        ScheduledMoE(model.moe_weights(), CONFIG.moe_shape, ScheduleConfig("interweaved", warmup=7), STEPS)


def test_a_dispatch_error_reaches_the_caller_through_the_async_executor():
    model = tiny_model()

    class Broken:
        rank, world_size = 0, 1

        def dispatch(self, x, ids, w):
            raise ValueError("topk_ids must be in [-1, 7]")

        def combine(self, out, d):
            raise AssertionError("unreachable")

    runner = ScheduledMoE(model.moe_weights(), CONFIG.moe_shape, preset("interweaved", STEPS), STEPS,
                          dispatcher=Broken(), executor=make_executor("async"))
    with pytest.raises(ValueError, match="topk_ids must be in"):
        _run(runner, model)
    runner.close()


def test_sync_layer_equals_moekits_moe_layer():
    """The runner composes moekit's pieces (router, Dispatcher, experts, slot-order combine):
    under sync its output is MoELayer's, with DiT-MoE's router (no renormalization)."""
    from moekit.moe import MoELayer

    model = tiny_model()
    weights = model.moe_weights()
    h = torch.randn(40, CONFIG.hidden, generator=torch.Generator().manual_seed(9))
    runner = ScheduledMoE(weights, CONFIG.moe_shape, ScheduleConfig(warmup=0), 1)
    runner.begin_step(0)
    ours = runner(1, h)
    runner.end_step()
    layer = MoELayer(CONFIG.moe_shape, weights[1], renormalize=False)
    torch.testing.assert_close(ours, layer(h), rtol=1e-6, atol=1e-6)


def test_prebuilt_local_experts_replace_the_sliced_ones():
    """A runner given this rank's experts already built computes what it computes from the
    full weights, and reads neither w13 nor w2 of them (here: stand-ins of the wrong size)."""
    from moekit.moe.experts import MoEWeights, SwiGLUExperts

    model = tiny_model()
    weights = model.moe_weights()
    schedule = preset("dice", STEPS)
    full = ScheduledMoE(weights, CONFIG.moe_shape, schedule, STEPS)
    experts = [SwiGLUExperts(w.w13.clone(), w.w2.clone()) for w in weights]  # world size 1: every expert is local
    stand_ins = [MoEWeights(w.router, w.w13[:, :2].clone(), w.w2[:, :, :1].clone(), w.shared_w13, w.shared_w2)
                 for w in weights]
    prebuilt = ScheduledMoE(stand_ins, CONFIG.moe_shape, schedule, STEPS, local_experts=experts)
    assert prebuilt.experts == experts
    assert torch.equal(_run(prebuilt, model), _run(full, model))
    with pytest.raises(ValueError, match="one module per layer"):
        ScheduledMoE(weights, CONFIG.moe_shape, schedule, STEPS, local_experts=experts[:1])
    half = SwiGLUExperts(weights[0].w13[:4].clone(), weights[0].w2[:4].clone())
    with pytest.raises(ValueError, match="this rank's 8 experts"):
        ScheduledMoE(weights, CONFIG.moe_shape, schedule, STEPS, local_experts=[half] * CONFIG.depth)
