"""What each rank should receive, computed the slow, obvious way (for tests).

Given the inputs of all ranks, ``expected_dispatch`` lists for one destination rank the rows
of each local expert in canonical order (source rank, source token, slot), with loops over
ranks, tokens and slots — independent of the vectorized layout code it checks.
"""

from __future__ import annotations

import torch


def expected_dispatch(xs: list[torch.Tensor], topk_ids: list[torch.Tensor], num_experts: int,
                      rank: int) -> list[dict[str, torch.Tensor]]:
    """Per local expert of ``rank``: {"tokens": [n, H], "src_rank", "src_token", "src_slot": [n]}."""
    world_size = len(xs)
    per_rank = num_experts // world_size
    rows = [{"tokens": [], "src_rank": [], "src_token": [], "src_slot": []} for _ in range(per_rank)]
    for src, (x, ids) in enumerate(zip(xs, topk_ids)):
        for t in range(ids.shape[0]):
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                if e < 0 or e // per_rank != rank:
                    continue
                r = rows[e % per_rank]
                r["tokens"].append(x[t])
                r["src_rank"].append(src)
                r["src_token"].append(t)
                r["src_slot"].append(k)
    H = xs[0].shape[1]
    out = []
    for r in rows:
        tokens = torch.stack(r["tokens"]) if r["tokens"] else xs[0].new_zeros(0, H)
        out.append({"tokens": tokens, **{key: torch.tensor(r[key], dtype=torch.int64)
                                          for key in ("src_rank", "src_token", "src_slot")}})
    return out
