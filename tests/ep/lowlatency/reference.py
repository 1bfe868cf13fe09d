"""An independent, single-process reference for the low-latency layer (loops; for tests).

Given every rank's inputs it says, for one destination rank, which rows each local expert
must hold (source rank, token, first slot, slot bits, in (source, token) order), what a
position-dependent fake expert returns for them, and what combine must then give on each
source rank. Nothing here uses moekit.ep.lowlatency.
"""

from __future__ import annotations

import torch

from moekit.ep.dispatcher import weighted_rank_sum, weighted_slot_sum
from moekit.fp8 import dequantize_groups, quantize_groups
from tests.ep.cases import skewed_ids, uniform_ids

KINDS = ("uniform", "skewed", "masked", "empty", "full", "duplicate", "one_rank", "tail_masked", "all_masked")


def routing_steps(world_size: int, num_steps: int, *, max_m: int, num_experts: int, topk: int, hidden: int,
                  seed: int = 0, dtype=torch.bfloat16):
    """[(kind, xs, ids, ws)] per step with every rank's inputs; the same in every process."""
    g = torch.Generator().manual_seed(seed)
    E, K, P = num_experts, topk, world_size
    steps = []
    for i in range(num_steps):
        kind = KINDS[i % len(KINDS)]
        xs, ids, ws = [], [], []
        for _ in range(P):
            T = int(torch.randint(0, max_m + 1, (1,), generator=g))
            if kind in ("full", "duplicate", "tail_masked"):
                T = max_m
            if kind == "empty":
                T = 0
            ids_r = skewed_ids(g, T, E, K) if kind == "skewed" else uniform_ids(g, T, E, K)
            if kind == "masked":
                ids_r = torch.where(torch.rand(T, K, generator=g) < 0.3, torch.full_like(ids_r, -1), ids_r)
            if kind == "duplicate":  # slots repeat experts: one row per (token, expert), several slots
                ids_r = torch.randint(0, E, (T, K), generator=g)
                ids_r[:, -1] = ids_r[:, 0]
            if kind == "one_rank":  # every token to the last rank's experts
                ids_r = E - E // P + torch.rand(T, E // P, generator=g).argsort(dim=1)[:, :K] % (E // P)
            if kind == "tail_masked":
                ids_r[int(torch.randint(0, max_m, (1,), generator=g)):] = -1
            if kind == "all_masked":
                ids_r = torch.full((T, K), -1, dtype=torch.int64)
            w = torch.rand(T, K, generator=g) + 0.05
            xs.append((torch.randn(T, hidden, generator=g) * 3).to(dtype))
            ids.append(ids_r.to(torch.int64))
            ws.append(w / w.sum(1, keepdim=True))
        steps.append((kind, xs, ids, ws))
    return steps


def expected_rows(ids: list[torch.Tensor], num_experts: int, rank: int) -> list[list[tuple[int, int, int, int]]]:
    """Per local expert of ``rank``: [(src_rank, src_token, first_slot, slot_bits)] in (source, token) order."""
    P = len(ids)
    per_rank = num_experts // P
    ids = [i.tolist() for i in ids]  # plain ints: reading a tensor element by element is slow
    rows: list[list[tuple[int, int, int, int]]] = [[] for _ in range(per_rank)]
    for e in range(per_rank):
        g = rank * per_rank + e
        for s in range(P):
            for t in range(len(ids[s])):
                slots = [k for k in range(len(ids[s][t])) if ids[s][t][k] == g]
                if slots:
                    rows[e].append((s, t, slots[0], sum(1 << k for k in slots)))
    return rows


def received_value(x_row: torch.Tensor, fp8: bool, group: int) -> torch.Tensor:
    """The float32 value the expert sees for one source row: x itself, or its FP8 round trip."""
    if not fp8:
        return x_row.float()
    q, s = quantize_groups(x_row, group)
    return dequantize_groups(q, s)


def fake_expert(values: torch.Tensor, expert: torch.Tensor, position: torch.Tensor, src_rank: torch.Tensor,
                src_token: torch.Tensor, dtype: torch.dtype, use_content: bool = True) -> torch.Tensor:
    """A stand-in expert whose output depends on the expert, the row's position inside it and
    where the row came from, so a row returned to the wrong slot (or placed at the wrong
    position) cannot pass. Elementwise float32 ops in a fixed order: computing it row by row
    or on a whole block gives the same bits. ``values [..., H]`` float32; the index tensors
    broadcast against ``values[..., 0]``."""
    a = expert.to(torch.float32) / 8 + 1
    b = position.to(torch.float32) * 0.25 + src_rank.to(torch.float32) * 0.5 + src_token.to(torch.float32) * 0.0625
    v = values if use_content else torch.ones_like(values)
    return (v * a.unsqueeze(-1) + b.unsqueeze(-1)).to(dtype)


def expected_combine(xs, ids, ws, num_experts: int, rank: int, *, fp8: bool, group: int, dtype: torch.dtype,
                     use_content: bool = True, combine_order: str = "slot") -> torch.Tensor:
    """``[T, H]`` that combine must return on ``rank`` after every rank ran ``fake_expert`` on
    its rows: the reference slot outputs summed by ``weighted_slot_sum`` (or, in the rank
    order, by ``weighted_rank_sum``)."""
    P = len(xs)
    per_rank = num_experts // P
    positions = {}
    for d in range(P):
        for e, rows in enumerate(expected_rows(ids, num_experts, d)):
            for r, (s, t, _, _) in enumerate(rows):
                positions[(d * per_rank + e, s, t)] = r
    T, K = ids[rank].shape
    H = xs[rank].shape[1]
    slot_out = torch.zeros(T, K, H, dtype=dtype)
    for t in range(T):
        for k in range(K):
            g = int(ids[rank][t, k])
            if g < 0:
                continue
            r = positions[(g, rank, t)]
            v = received_value(xs[rank][t:t + 1], fp8, group)
            one = lambda value: torch.tensor([value])  # noqa: E731
            slot_out[t, k] = fake_expert(v, one(g), one(r), one(rank), one(t), dtype, use_content)[0]
    if combine_order == "rank":
        return weighted_rank_sum(slot_out, ids[rank], ws[rank], dtype, num_experts=num_experts, world_size=P)
    return weighted_slot_sum(slot_out, ids[rank], ws[rank], dtype)


def fake_expert_outputs(tokens: torch.Tensor, scales: torch.Tensor | None, counts: torch.Tensor,
                        src_rank: torch.Tensor, src_token: torch.Tensor, rank: int, dtype: torch.dtype,
                        group: int, use_content: bool = True) -> torch.Tensor:
    """``fake_expert`` on a whole received block ``[E_local, capacity, H]`` (vectorized, any
    device, no host reads), NaN on padding rows, which combine must never read."""
    E_local, cap, _ = tokens.shape
    values = tokens.float() if scales is None else dequantize_groups(tokens, scales)
    device = tokens.device
    expert = (rank * E_local + torch.arange(E_local, device=device)).view(E_local, 1).expand(E_local, cap)
    position = torch.arange(cap, device=device).view(1, cap).expand(E_local, cap)
    out = fake_expert(values, expert, position, src_rank, src_token, dtype, use_content)
    valid = position < counts.to(device).view(E_local, 1)
    return torch.where(valid.unsqueeze(2), out, torch.full_like(out, float("nan")))


def check_dispatch(tokens, scales, counts, meta: dict, xs, ids, num_experts: int, rank: int, *, fp8: bool,
                   group: int, exact_fp8: bool = True) -> list[str]:
    """Mismatches between one rank's dispatch result (CPU tensors) and the reference.

    Checks, per local expert: counts; the valid rows' (src_rank, src_token, src_slot,
    slot_bits, row_index) in order; -1 on every padding row; layout_range; and each row's
    payload — bitwise the source token (bf16 mode), or its FP8 encoding (bitwise when
    ``exact_fp8``, else dequantized within the e4m3 bound of :func:`moekit.fp8.e4m3_error_bound`).
    """
    from moekit.fp8 import e4m3_error_bound

    bad: list[str] = []
    P = len(xs)
    max_m = meta["num_tokens_shape"]
    want = expected_rows(ids, num_experts, rank)
    if counts.tolist() != [len(rows) for rows in want]:
        return [f"counts {counts.tolist()} != {[len(rows) for rows in want]}"]
    for e, rows in enumerate(want):
        n = len(rows)
        got = list(zip(*(meta[k][e, :n].tolist() for k in ("src_rank", "src_token", "src_slot", "slot_bits"))))
        if got != [tuple(r) for r in rows]:
            bad.append(f"expert {e}: rows {got[:6]} != {rows[:6]}")
            continue
        for key in ("src_rank", "src_token", "src_slot", "slot_bits", "row_index"):
            if not bool((meta[key][e, n:] == -1).all()):
                bad.append(f"expert {e}: {key} of padding rows is not -1")
        if meta["row_index"][e, :n].tolist() != [s * max_m + t for s, t, _, _ in rows]:
            bad.append(f"expert {e}: row_index")
        per_source = [sum(1 for r in rows if r[0] == s) for s in range(P)]
        starts = [sum(per_source[:s]) for s in range(P)]
        if meta["layout_range"][e].tolist() != [[c, st] for c, st in zip(per_source, starts)]:
            bad.append(f"expert {e}: layout_range {meta['layout_range'][e].tolist()}")
        if n == 0:
            continue
        src = torch.stack([xs[s][t] for s, t, _, _ in rows])
        if not fp8:
            if not torch.equal(tokens[e, :n], src):
                bad.append(f"expert {e}: tokens differ from the sources")
            continue
        q_ref, s_ref = quantize_groups(src, group)
        q, s = tokens[e, :n], scales[e, :n]
        if exact_fp8:
            if not (torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)):
                bad.append(f"expert {e}: FP8 rows differ from quantize_groups")
        else:
            err = (dequantize_groups(q, s) - src.float()).abs()
            if not bool((err <= e4m3_error_bound(src, s_ref, group)).all()):
                bad.append(f"expert {e}: FP8 error {float(err.max())} above the e4m3 bound")
            if not torch.allclose(s, s_ref, rtol=1e-6, atol=0):
                bad.append(f"expert {e}: FP8 scales differ from amax / 448")
    return bad


def meta_to_host(meta) -> dict:
    """The meta fields :func:`check_dispatch` reads, on the CPU."""
    out = {k: getattr(meta, k).cpu() for k in ("src_rank", "src_token", "src_slot", "slot_bits", "row_index",
                                                 "layout_range", "counts")}
    out["num_tokens_shape"] = meta.recv.ids.shape[1]
    return out
