"""The tiny DiT-MoE and the schedule cases the distributed tests run, rebuilt by name in every
process (the spawned ranks receive only names)."""

from __future__ import annotations

import torch

from moekit.dice import DiTMoE, ScheduleConfig, SchedulePlan, StalenessSimulator, digits_config, sample

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


def row_rank(sizes: list[int]) -> torch.Tensor:
    """The rank of every MoE token row of the simulator's global batch ([cond | null] halves)."""
    sample_rank = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return torch.cat([sample_rank, sample_rank]).repeat_interleave(CONFIG.tokens_per_image)


def check_ranks_against_simulator(results: list[dict], name: str, schedule: ScheduleConfig, sizes: list[int],
                                  model: DiTMoE, noise: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Every rank's trajectory of schedule ``name`` (``results[rank][name]``) against the exact
    staleness simulator on the global batch, bitwise, with the steps each layer's data came from
    and the rows it sent; returns the simulated trajectory."""
    world_size = len(sizes)
    sim = StalenessSimulator(model.moe_weights(), CONFIG.moe_shape, schedule, STEPS, batch_invariant=True,
                             world_size=world_size, row_rank=row_rank(sizes))
    steps = []
    sample(model, noise, labels, steps=STEPS, cfg_scale=CFG_SCALE, moe=sim, on_step=lambda i, z: steps.append(z.clone()))
    traj = torch.stack(steps)
    table = SchedulePlan(schedule, STEPS, CONFIG.depth).source_table
    assert sim.stats()["sources"] == table, name
    for rank in range(world_size):
        got = results[rank][name]
        assert torch.equal(got["traj"], traj[:, rank_slice(sizes, rank)]), f"{name}: rank {rank} differs"
        assert got["stats"]["sources"] == table, f"{name}: rank {rank} used other steps' data"
    for key in ("rows_remote", "rows_local"):
        total = [sum(results[r][name]["stats"][key][t] for r in range(world_size)) for t in range(STEPS)]
        assert total == sim.stats()[key], f"{name}: {key}"
    return traj
