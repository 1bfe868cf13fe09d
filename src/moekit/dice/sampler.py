"""Rectified flow for DiT-MoE: the training loss and the Euler sampler with guidance.

The DiT-MoE release trains its larger models as a rectified flow: ``z_t = (1 - t) x + t e``
with ``e ~ N(0, I)`` and ``t`` logit-normal (``sigmoid`` of a standard normal); the model
predicts the velocity ``e - x``. Sampling integrates from pure noise at ``t = 1`` to
``t = 0`` with N Euler steps, ``z <- z - v / N`` at ``t = i / N`` for i = N..1 (50 steps
by default), and classifier-free guidance ``v = v_null + cfg (v_y - v_null)``.

The sampler tells the MoE runner which denoising step it is in (``begin_step`` /
``end_step``): a DICE schedule's decisions are per step.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

DEFAULT_STEPS = 50


def rf_loss(model, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Rectified-flow training loss (mean squared velocity error) on a batch x [B, C, S, S]
    with labels y [B]; labels are dropped to the null class with the model's
    ``class_dropout`` so it learns the unconditional velocity for guidance."""
    B = x.shape[0]
    dev = x.device
    t = torch.sigmoid(torch.randn(B, generator=generator, device=dev))
    noise = torch.randn(x.shape, generator=generator, device=dev)
    z = (1 - t.view(B, 1, 1, 1)) * x + t.view(B, 1, 1, 1) * noise
    drop = torch.rand(B, generator=generator, device=dev) < model.config.class_dropout
    labels = torch.where(drop, torch.full_like(y, model.null_class), y)
    v = model(z, t.to(x.dtype), labels)
    return ((noise - x - v) ** 2).mean()


@torch.no_grad()
def sample(model, noise: torch.Tensor, labels: torch.Tensor, *, steps: int = DEFAULT_STEPS, cfg_scale: float = 1.5,
           moe=None, on_step: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Integrate the flow from ``noise`` [B, C, S, S] at t = 1 to t = 0 in ``steps`` Euler steps.

    ``moe``: the MoE runner (a :class:`~moekit.dice.runner.ScheduledMoE`, a
    :class:`~moekit.dice.simulator.StalenessSimulator`, or None for the model's own
    layers). ``on_step(i, z)`` sees the latent after step i (0-based).
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not (math.isfinite(cfg_scale) and cfg_scale >= 1.0):  # NaN passes `< 1`; both make NaN images
        raise ValueError(f"cfg_scale must be >= 1 and finite (1 = no guidance), got {cfg_scale}")
    if labels.shape != (noise.shape[0],):
        raise ValueError(f"labels must be [B={noise.shape[0]}], got {tuple(labels.shape)}")
    z = noise
    B = z.shape[0]
    for i in range(steps):
        t = torch.full((B,), (steps - i) / steps, dtype=z.dtype, device=z.device)
        if moe is not None:
            moe.begin_step(i)
        v = model.forward_with_cfg(z, t, labels, cfg_scale, moe=moe)
        if moe is not None:
            moe.end_step()
        z = z - v / steps
        if on_step is not None:
            on_step(i, z)
    return z
