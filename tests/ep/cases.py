"""Routing cases for the multi-rank dispatcher tests, rebuilt identically in every process
from a name and a seed (workers receive only the names)."""

from __future__ import annotations

import torch


def skewed_ids(g: torch.Generator, T: int, E: int, K: int) -> torch.Tensor:
    """Top-k without replacement from a steep popularity (a few experts take most tokens)."""
    popularity = torch.tensor([0.6**i for i in range(E)], dtype=torch.float64)
    popularity = popularity[torch.randperm(E, generator=g)]
    if T == 0:
        return torch.empty(0, K, dtype=torch.int64)
    return torch.multinomial(popularity.expand(T, E), K, replacement=False, generator=g)


def uniform_ids(g: torch.Generator, T: int, E: int, K: int) -> torch.Tensor:
    return torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]


MAX_TOKENS = 20  # no case gives a rank more tokens than this


def build_case(name: str, world_size: int, seed: int, *, dtype=torch.float32):
    """(xs, ids, weights, num_experts) per rank for the named case (H = 24, K = 2 unless the
    case says otherwise, T <= MAX_TOKENS)."""
    g = torch.Generator().manual_seed(seed)
    E, K, H = 4 * world_size, 2, 24
    tokens = [int(t) for t in torch.randint(0, 20, (world_size,), generator=g)]
    if name == "k1":
        K = 1
    if name == "k_eq_e":  # every token names every expert
        K = E
    if name == "empty":
        tokens = [0] * world_size
    if name == "one_rank_empty":
        tokens[world_size - 1] = 0
    if name in ("t_max", "one_expert_every_slot"):
        tokens = [MAX_TOKENS] * world_size
    xs, ids, ws = [], [], []
    for r in range(world_size):
        T = tokens[r]
        if name == "skewed":
            i = skewed_ids(g, T, E, K)
        else:
            i = uniform_ids(g, T, E, K)
        if name == "one_expert":  # every token's first slot to expert 1; the rest masked
            i[:, 0] = 1
            i[:, 1:] = -1
        if name == "rank0_only":  # only rank 0's experts are used: the others receive nothing
            i = torch.rand(T, E // world_size, generator=g).argsort(dim=1)[:, :K]
        if name == "one_expert_every_slot":  # every slot of every token names the last expert
            i = torch.full((T, K), E - 1, dtype=torch.int64)
        if name == "masked":
            i = torch.where(torch.rand(T, K, generator=g) < 0.3, torch.full_like(i, -1), i)
        if name == "masked_rows":  # some rows fully masked, others partly
            row = torch.rand(T, 1, generator=g) < 0.3
            i = torch.where(row | (torch.rand(T, K, generator=g) < 0.2), torch.full_like(i, -1), i)
        if name == "duplicates":  # slots repeat an expert within a row (drawn with replacement)
            i = torch.randint(0, E, (T, K), generator=g)
            i[::2, K - 1] = i[::2, 0]
        w = torch.rand(T, K, generator=g, dtype=torch.float32) + 0.05
        xs.append(torch.randn(T, H, generator=g).to(dtype))
        ids.append(i.to(torch.int64))
        ws.append(w / w.sum(dim=1, keepdim=True).clamp_min(1e-6))
    return xs, ids, ws, E


CASES = ["uniform", "skewed", "rank0_only", "one_expert", "empty", "one_rank_empty", "k1", "masked"]
# The adversarial battery of the dispatcher contract test: CASES and the routings below.
ADVERSARIAL_CASES = CASES + ["t_max", "one_expert_every_slot", "masked_rows", "duplicates", "k_eq_e"]


def fake_expert_rows(rows: torch.Tensor, global_expert: int, first_row: int = 0) -> torch.Tensor:
    """A stand-in expert whose output depends on the expert and the row's position, so a
    combine that returns a row to the wrong (token, slot) cannot pass: f = x*(e+1) + j."""
    j = torch.arange(first_row, first_row + rows.shape[0], dtype=torch.float32, device=rows.device).unsqueeze(1)
    return (rows.float() * float(global_expert + 1) + j).to(rows.dtype)


def fake_experts(tokens: torch.Tensor, rank: int) -> torch.Tensor:
    """``fake_expert_rows`` on a whole expert-major block [E_local, capacity, H] of ``rank``."""
    E_local = tokens.shape[0]
    return torch.stack([fake_expert_rows(tokens[e], rank * E_local + e) for e in range(E_local)])


def expected_combine(xs, ids, ws, E, dtype, combine_order: str = "slot"):
    """Per source rank: the combine of the fake experts, built from the loop reference (in
    the given combine order)."""
    from moekit.ep.reference import expected_dispatch
    from moekit.moe.reference import reference_rank_sum, reference_slot_sum

    P = len(xs)
    slot_out = [torch.zeros(i.shape[0], i.shape[1], x.shape[1], dtype=dtype) for x, i in zip(xs, ids)]
    for dest in range(P):
        for e, rows in enumerate(expected_dispatch(xs, ids, E, dest)):
            out = fake_expert_rows(rows["tokens"], dest * (E // P) + e)
            for j in range(out.shape[0]):
                slot_out[int(rows["src_rank"][j])][int(rows["src_token"][j]), int(rows["src_slot"][j])] = out[j]
    if combine_order == "rank":
        return [reference_rank_sum(slot_out[r], ids[r], ws[r], dtype, E, P) for r in range(P)]
    return [reference_slot_sum(slot_out[r], ids[r], ws[r], dtype) for r in range(P)]
