"""The tiny DiT-MoE and the schedule cases the distributed tests run, rebuilt by name in every
process (the spawned ranks receive only names)."""

from __future__ import annotations

import torch

from moekit.dice import DiTMoE, ScheduleConfig, digits_config

STEPS = 6
CFG_SCALE = 1.5
CONFIG = digits_config(hidden=32, depth=4, num_heads=2, num_experts=8, top_k=2, num_shared_experts=1)
SEED = 5
NOISE_SEED = 17


def tiny_model() -> DiTMoE:
    """Random weights with every block active (no adaLN-Zero), row-wise arithmetic."""
    return DiTMoE(CONFIG, seed=SEED, adaln_zero=False).set_batch_invariant(True)


def global_batch(sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise [sum(sizes), 1, 8, 8] and labels for every rank's samples, rank by rank."""
    g = torch.Generator().manual_seed(NOISE_SEED)
    B = sum(sizes)
    noise = torch.randn(B, CONFIG.in_channels, CONFIG.input_size, CONFIG.input_size, generator=g)
    labels = torch.randint(0, CONFIG.num_classes, (B,), generator=g)
    return noise, labels


def rank_slice(sizes: list[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


# name -> (schedule, dispatcher kind, executor kind)
CASES: dict[str, tuple[ScheduleConfig, str, str]] = {
    "sync": (ScheduleConfig("sync", warmup=0), "alltoall", "inline"),
    "displaced": (ScheduleConfig("displaced"), "alltoall", "inline"),
    "displaced-warm2-cool1": (ScheduleConfig("displaced", warmup=2, cooldown=1), "alltoall", "inline"),
    "displaced-every3": (ScheduleConfig("displaced", sync_every=3), "alltoall", "inline"),
    "displaced-shallow": (ScheduleConfig("displaced", async_layers="shallow"), "alltoall", "inline"),
    "displaced-cond2-latest": (ScheduleConfig("displaced", cond_every=2, scores="latest"), "alltoall", "async"),
    "interweaved": (ScheduleConfig("interweaved"), "alltoall", "inline"),
    "interweaved-deep": (ScheduleConfig("interweaved", async_layers="deep"), "alltoall", "inline"),
    "interweaved-interleaved": (ScheduleConfig("interweaved", async_layers="interleaved"), "alltoall", "inline"),
    "interweaved-every2-cool1": (ScheduleConfig("interweaved", sync_every=2, cooldown=1), "alltoall", "inline"),
    "interweaved-cond1": (ScheduleConfig("interweaved", cond_every=1), "alltoall", "inline"),
    "interweaved-cond3": (ScheduleConfig("interweaved", cond_every=3), "alltoall", "inline"),
    "interweaved-latest": (ScheduleConfig("interweaved", scores="latest"), "alltoall", "inline"),
    "dice": (ScheduleConfig("interweaved", async_layers="shallow", cond_every=2, warmup=2), "alltoall", "async"),
    "ll-sync": (ScheduleConfig("sync", warmup=0), "lowlatency", "inline"),
    "ll-displaced-cond2": (ScheduleConfig("displaced", cond_every=2), "lowlatency", "inline"),
    "ll-interweaved-latest": (ScheduleConfig("interweaved", scores="latest"), "lowlatency", "async"),
    "ll-dice": (ScheduleConfig("interweaved", async_layers="interleaved", cond_every=2), "lowlatency", "inline"),
}
