"""Time a DiT-MoE's parts per denoising step on this device, and model what each schedule saves.

:func:`time_parts` times one block's parts at a preset's shape (dit-moe-xl, dit-moe-g...),
for a local batch of B images with classifier-free guidance (2B images, ``2 B N`` tokens
through every layer), as one rank of ``world_size``-way expert parallelism would run them:
its E / P experts receive the rank's T * K (token, slot) rows (balanced routing). Blocks are
identical, so a step's compute is ``depth`` times a block plus the embeddings and the final
layer, timed once. Weights are random (timing does not depend on their values).

:func:`speed_rows` combines those timings with the measured dispatch / combine times
(:func:`moekit.dice.accounting.load_comm_curves`) in the overlap model of
:func:`moekit.dice.accounting.speedup`; :func:`share_rows` feeds the model the
all-to-all shares of the DICE paper's Table 5 instead; :func:`memory_rows` gives each
schedule's buffers.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from moekit.bench.stats import summarize
from moekit.bench.timing import time_fn
from moekit.dice import accounting
from moekit.dice.dit_moe import DiTMoEConfig, modulate, route, timestep_embedding, FREQ_DIM
from moekit.dice.exact import expert_mlp
from moekit.dice.schedules import SchedulePlan, preset
from moekit.ep.dispatcher import weighted_slot_sum
from moekit.moe.experts import SwiGLUExperts

PARTS = ("adaln", "attention", "router", "experts", "shared", "slot_sum")
SPEED_SCHEDULES = ("sync", "displaced", "interweaved", "interweaved+cond", "dice", "dice+sync")


def _check_batch(batch: int) -> None:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")


def time_parts(config: DiTMoEConfig, batch: int, *, world_size: int = 2, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str | None = None, iters: int = 20, warmup: int = 3, seed: int = 0) -> dict:
    """Median µs of each part of one block, and of the step-level parts, at this shape."""
    _check_batch(batch)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    E_local = config.moe_shape.experts_per_rank(world_size)
    H, K, N = config.hidden, config.top_k, config.tokens_per_image
    B2 = 2 * batch  # guidance doubles the batch
    T = B2 * N
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, std=1.0):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).mul_(std).to(dtype)

    x, c = rand(B2, N, H), rand(B2, H)
    adaln_w, adaln_b = rand(6 * H, H, std=H ** -0.5), rand(6 * H, std=0.02)
    qkv_w, qkv_b = rand(3 * H, H, std=H ** -0.5), rand(3 * H, std=0.02)
    proj_w, proj_b = rand(H, H, std=H ** -0.5), rand(H, std=0.02)
    router = rand(config.num_experts, H, std=H ** -0.5).float()
    Ni = config.expert_intermediate
    experts = SwiGLUExperts(rand(E_local, 2 * Ni, H, std=H ** -0.5), rand(E_local, H, Ni, std=Ni ** -0.5))
    S = config.num_shared_experts * config.shared_intermediate
    shared = (rand(2 * S, H, std=H ** -0.5), rand(H, S, std=S ** -0.5)) if S else None
    rows_per_expert = -(-T * K // E_local)
    tokens = rand(E_local, rows_per_expert, H)
    counts = torch.full((E_local,), rows_per_expert, dtype=torch.int64, device=device)
    h = x.reshape(T, H)
    slot_out = rand(T, K, H)
    _, topk_w, topk_ids = route(h, router, K)
    heads = config.num_heads

    def adaln():
        return F.linear(F.silu(c), adaln_w, adaln_b)

    mods = adaln().chunk(6, dim=1)

    def attention():
        a = modulate(F.layer_norm(x, (H,), eps=1e-6), mods[0], mods[1])
        q, k, v = F.linear(a, qkv_w, qkv_b).reshape(B2, N, 3, heads, H // heads).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B2, N, H)
        return x + mods[2].unsqueeze(1) * F.linear(o, proj_w, proj_b)

    parts = {
        "adaln": adaln,
        "attention": attention,
        "router": lambda: route(h, router, K),
        "experts": lambda: experts(tokens, counts),
        "shared": (lambda: expert_mlp(h, *shared)) if shared else (lambda: None),
        "slot_sum": lambda: weighted_slot_sum(slot_out, topk_ids, topk_w, dtype),
    }
    # Step-level parts: patch embedding, timestep / class embedding, final layer (once per step).
    C, p = config.in_channels, config.patch_size
    patches = rand(B2, N, C * p * p)
    patch_w, t_w1, t_w2 = rand(H, C * p * p), rand(H, FREQ_DIM, std=0.02), rand(H, H, std=0.02)
    final_ada, final_w = rand(2 * H, H, std=H ** -0.5), rand(p * p * C, H, std=H ** -0.5)
    t_in = torch.rand(B2, device=device)

    def step_parts():
        e = F.linear(patches, patch_w)
        temb = F.linear(F.silu(F.linear(timestep_embedding(t_in * 1000, FREQ_DIM).to(dtype), t_w1)), t_w2)
        shift, scale = F.linear(F.silu(temb), final_ada).chunk(2, dim=1)
        return F.linear(modulate(F.layer_norm(e, (H,), eps=1e-6), shift, scale), final_w)

    with torch.no_grad():
        per_layer = {name: summarize(time_fn(fn, iters=iters, warmup=warmup, device=device))["median"]
                     for name, fn in parts.items()}
        step_extra = summarize(time_fn(step_parts, iters=iters, warmup=warmup, device=device))["median"]
    layer_us = sum(per_layer.values())
    itemsize = torch.empty(0, dtype=dtype).element_size()
    message = T * K * H * itemsize
    return dict(model=config.name, batch=batch, tokens=T, world_size=world_size, experts_per_rank=E_local,
                dtype=str(dtype).replace("torch.", ""), per_layer_us=per_layer, layer_us=layer_us,
                step_extra_us=step_extra, step_compute_us=config.depth * layer_us + step_extra,
                message_bytes=message, remote_bytes=message * (world_size - 1) / world_size,
                depth=config.depth, top_k=K)


def _plans(names, steps: int, depth: int):
    return {name: SchedulePlan(preset(name, steps), steps, depth) for name in names}


def speed_rows(parts: list[dict], curves: dict, *, steps: int = 50, schedules=SPEED_SCHEDULES) -> list[dict]:
    """Per (model, batch, measured method): the all-to-all's share of a sync step and each
    schedule's modelled speedup, from measured compute and measured communication."""
    rows = []
    for p in parts:
        plans = _plans(schedules, steps, p["depth"])
        for method in sorted({m for m, _ in curves}):
            comm = accounting.comm_us(curves, method, p["remote_bytes"])
            compute = p["step_compute_us"] / p["depth"]  # per layer, the step-level parts spread over layers
            row = dict(model=p["model"], batch=p["batch"], method=method, compute_us=compute, comm_us=comm,
                       a2a_share=comm / (compute + comm))
            for name, plan in plans.items():
                row[name] = accounting.speedup(plan, compute, comm, p["top_k"])["speedup"]
            rows.append(row)
    return rows


def share_rows(depth_of: dict[str, int], *, steps: int = 50, schedules=SPEED_SCHEDULES, top_k: int = 2) -> list[dict]:
    """The model's speedups at the DICE paper's Table 5 all-to-all shares."""
    rows = []
    for (model, gpus), shares in accounting.PAPER_A2A_SHARE.items():
        if model not in depth_of:
            continue
        plans = _plans(schedules, steps, depth_of[model])
        for batch, share in shares.items():
            row = dict(model=model, gpus=gpus, batch=batch, a2a_share=share)
            for name, plan in plans.items():
                row[name] = accounting.speedup_from_share(plan, share, top_k)
            rows.append(row)
    return rows


def memory_rows(parts: list[dict], *, steps: int = 50, schedules=SPEED_SCHEDULES) -> list[dict]:
    """Buffers each schedule holds at most (MiB per rank) and the (token, slot) rows it sends
    over the run relative to sync (conditional communication: without cache misses)."""
    rows = []
    for p in parts:
        plans = _plans(("sync",) + tuple(s for s in schedules if s != "sync"), steps, p["depth"])
        message_mib = p["message_bytes"] / 2 ** 20  # one T x K-row buffer
        sync_rows = sum(accounting.rows_per_step(plans["sync"], p["tokens"], p["top_k"]))
        row = dict(model=p["model"], batch=p["batch"], message_mib=message_mib)
        for name, plan in plans.items():
            row[f"{name} MiB"] = accounting.peak_buffers(plan) * message_mib
            row[f"{name} rows/sync"] = sum(accounting.rows_per_step(plan, p["tokens"], p["top_k"])) / sync_rows
        rows.append(row)
    return rows
