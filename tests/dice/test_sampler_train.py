"""The rectified-flow sampler and loss, and the training recipe with its checkpoints."""

from __future__ import annotations

import pytest
import torch

from moekit.dice import DiTMoE, rf_loss, sample
from moekit.dice.quality import load_digits
from moekit.dice.train import TrainConfig, load_checkpoint, save_checkpoint, train_dit
from tests.dice.cases import CONFIG, tiny_model


class ConstantVelocity:
    """A stand-in model whose velocity is noise - target: Euler integration must land on target."""

    def __init__(self, noise, target):
        self.v = noise - target
        self.calls = []

    def forward_with_cfg(self, z, t, y, cfg_scale, moe=None):
        self.calls.append(float(t[0]))
        return self.v


def test_euler_integrates_from_t1_to_t0():
    noise, target = torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8)
    model = ConstantVelocity(noise, target)
    seen = []
    z = sample(model, noise, torch.zeros(2, dtype=torch.long), steps=4, on_step=lambda i, z: seen.append(i))
    torch.testing.assert_close(z, target)
    assert model.calls == [1.0, 0.75, 0.5, 0.25] and seen == [0, 1, 2, 3]


def test_sampler_checks_arguments():
    model = tiny_model()
    noise = torch.randn(2, 1, 8, 8)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        sample(model, noise, torch.zeros(2, dtype=torch.long), steps=0)
    with pytest.raises(ValueError, match="cfg_scale must be >= 1"):
        sample(model, noise, torch.zeros(2, dtype=torch.long), cfg_scale=0.5)
    with pytest.raises(ValueError, match="labels must be"):
        sample(model, noise, torch.zeros(3, dtype=torch.long))


def test_rf_loss_is_the_velocity_error():
    model = DiTMoE(CONFIG, seed=0)  # adaLN-Zero: the velocity is 0 at init, so the loss is E|noise - x|^2
    x = torch.randn(64, 1, 8, 8)
    loss = rf_loss(model, x, torch.zeros(64, dtype=torch.long), generator=torch.Generator().manual_seed(0))
    assert abs(loss.item() - (1 + x.pow(2).mean().item())) < 0.15
    loss.backward()
    assert model.final.weight.grad.abs().sum() > 0


def test_training_lowers_the_loss_and_checkpoints_round_trip(tmp_path):
    data = load_digits()
    cfg = TrainConfig(hidden=32, depth=2, num_heads=2, steps=30, batch=32, log_every=10, warmup_steps=5)
    model, log = train_dit(cfg, data, progress=lambda m: None)
    assert [e["step"] for e in log] == [10, 20, 30]
    assert log[-1]["loss"] < log[0]["loss"]
    path = save_checkpoint(model, tmp_path / "m.pt", meta=dict(log=log))
    loaded, meta = load_checkpoint(path)
    x, t, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2])
    assert torch.equal(loaded(x, t, y), model(x, t, y)) and meta["log"] == log
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="bad.pt: not a DiT-MoE checkpoint"):
        load_checkpoint(bad)


def test_train_config_validation():
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="ema_decay"):
        TrainConfig(ema_decay=1.0)
    with pytest.raises(ValueError, match="time_budget_s"):
        TrainConfig(time_budget_s=0)


def test_time_budget_stops_training_and_logs_the_last_step():
    data = load_digits()
    cfg = TrainConfig(steps=10_000, batch=8, log_every=10_000, time_budget_s=0.3)
    _, log = train_dit(cfg, data, progress=lambda m: None)
    assert len(log) == 1 and 0 < log[0]["step"] < 10_000 and log[0]["seconds"] >= 0.3
