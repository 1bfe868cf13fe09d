"""Schedule options, their validation, and the plan's decisions against hand-written tables."""

from __future__ import annotations

import pytest

from moekit.dice.schedules import PRESET_NAMES, ScheduleConfig, SchedulePlan, extra_sync_steps, preset


def table(config: ScheduleConfig, steps: int, layers: int = 1) -> list:
    plan = SchedulePlan(config, steps, layers)
    return [row[0] for row in plan.source_table] if layers == 1 else plan.source_table


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="staggered"), "mode must be one of"),
    (dict(mode="interweaved", async_layers="middle"), "async_layers must be one of"),
    (dict(mode="interweaved", scores="fresh"), "scores must be one of"),
    (dict(mode="interweaved", cond_every=0), "cond_every must be an int >= 1"),
    (dict(mode="displaced", sync_every=0), "sync_every must be an int >= 1"),
    (dict(mode="displaced", warmup=0), "warmup must be an int >= 1"),
    (dict(mode="displaced", cooldown=-1), "cooldown must be an int >= 0"),
    (dict(mode="sync", warmup=-1), "warmup must be an int >= 0"),
    (dict(mode="interweaved", cond_every=1.5), "cond_every must be an int"),
])
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScheduleConfig(**kwargs)


def test_warmup_longer_than_the_run_raises():
    with pytest.raises(ValueError, match="warmup \\+ cooldown must be at most num_steps=5"):
        SchedulePlan(ScheduleConfig("displaced", warmup=6), 5, 2)
    with pytest.raises(ValueError, match="warmup \\+ cooldown must be at most num_steps=5"):
        SchedulePlan(ScheduleConfig("interweaved", warmup=3, cooldown=3), 5, 2)
    with pytest.raises(ValueError, match="num_steps must be an int >= 1"):
        SchedulePlan(ScheduleConfig(), 0, 2)
    with pytest.raises(ValueError, match="step must be in"):
        SchedulePlan(ScheduleConfig("displaced"), 4, 2).is_async(4, 0)


def test_source_tables_by_hand():
    # displaced: two steps to get going after the synchronous step 0, then t - 2
    assert table(ScheduleConfig("displaced"), 6) == [0, 0, 0, 1, 2, 3]
    # interweaved: t - 1 from the first asynchronous step on
    assert table(ScheduleConfig("interweaved"), 6) == [0, 0, 1, 2, 3, 4]
    # warm-up of 2 and a synchronous last step
    assert table(ScheduleConfig("displaced", warmup=2, cooldown=1), 7) == [0, 1, 1, 1, 2, 3, 6]
    # periodic synchronization every 3 steps restarts the pipeline
    assert table(ScheduleConfig("interweaved", sync_every=3), 7) == [0, 0, 1, 3, 3, 4, 6]
    assert table(ScheduleConfig("displaced", sync_every=3), 7) == [0, 0, 0, 3, 3, 3, 6]
    assert table(ScheduleConfig("sync", warmup=0), 3) == [0, 1, 2]


def test_launches_only_what_is_used():
    plan = SchedulePlan(ScheduleConfig("displaced"), 6, 1)
    assert [plan.launches(t, 0) for t in range(6)] == [False, True, True, True, False, False]
    assert [plan.arrives(t, 0) for t in range(6)] == [False, False, False, True, True, True]
    plan = SchedulePlan(ScheduleConfig("interweaved", sync_every=3), 7, 1)
    assert [plan.launches(t, 0) for t in range(7)] == [False, True, False, False, True, False, False]


@pytest.mark.parametrize("layers, expected", [
    (4, dict(all=[0, 1, 2, 3], shallow=[0, 1], deep=[2, 3], interleaved=[1, 3])),
    (5, dict(all=[0, 1, 2, 3, 4], shallow=[0, 1, 2], deep=[2, 3, 4], interleaved=[1, 3])),
])
def test_selective_synchronization_layers(layers, expected):
    for which, async_layers in expected.items():
        plan = SchedulePlan(ScheduleConfig("interweaved", async_layers=which), 4, layers)
        assert [layer for layer in range(layers) if plan.is_async(2, layer)] == async_layers
        for layer in range(layers):  # a synchronous layer always uses fresh data
            if layer not in async_layers:
                assert all(plan.source_step(t, layer) == t for t in range(4))


def test_keeps_results_for_held_use_and_the_cache():
    plan = SchedulePlan(ScheduleConfig("interweaved"), 5, 1)
    # step 0 is synchronous and step 1 has nothing arriving: keep; afterwards results arrive each step
    assert [plan.keeps_result(t, 0) for t in range(5)] == [True, False, False, False, False]
    plan = SchedulePlan(ScheduleConfig("interweaved", cond_every=2), 5, 1)
    assert [plan.keeps_result(t, 0) for t in range(5)] == [True, True, True, False, False]


def test_staleness_summary():
    s = SchedulePlan(ScheduleConfig("interweaved"), 6, 2).staleness()
    assert s == dict(mean=5 / 6, max=1, async_share=5 / 6)
    assert SchedulePlan(ScheduleConfig("displaced"), 6, 2).staleness()["max"] == 2


def test_presets():
    for name in PRESET_NAMES:
        config = preset(name, 50)
        SchedulePlan(config, 50, 28)
    assert preset("displaced+sync", 50).warmup == extra_sync_steps(50) == 5
    assert preset("dice", 50).mode == "interweaved" and preset("dice", 50).cond_every == 2
    assert preset("sync").describe() == "sync"
    assert "cond=2" in preset("dice").describe()
    with pytest.raises(ValueError, match="unknown schedule 'fast'"):
        preset("fast")
