"""Single-process ground truth: the whole MoE block on one device, in float64 by default.

Written as plainly as possible (a loop over experts, index_add for the weighted sum) so it
shares no code with the dispatch path it checks.
"""

from __future__ import annotations

import torch

from moekit.moe.experts import MoEWeights, expert_mlp
from moekit.moe.router import softmax_topk


def reference_routing(x: torch.Tensor, weights: MoEWeights, top_k: int, *, renormalize: bool = True,
                      dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing computed in ``dtype``."""
    logits = x.to(dtype) @ weights.router.to(dtype).t()
    return softmax_topk(logits, top_k, renormalize)


def reference_moe(x: torch.Tensor, weights: MoEWeights, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  *, dtype=torch.float64) -> torch.Tensor:
    """y = sum_k w_k * expert_{id_k}(x) (+ shared experts), everything in ``dtype``.

    Takes the routing as given so a comparison is not thrown off by near-tie top-k picks
    that differ between precisions. Masked slots (-1) contribute nothing.
    """
    x = x.to(dtype)
    y = torch.zeros_like(x)
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        out = expert_mlp(x[token], weights.w13[e].to(dtype), weights.w2[e].to(dtype))
        y.index_add_(0, token, out * topk_weights[token, slot].to(dtype).unsqueeze(1))
    if weights.shared_w13 is not None:
        y = y + expert_mlp(x, weights.shared_w13.to(dtype), weights.shared_w2.to(dtype))
    return y


def reference_slot_sum(slot_out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """The combine contract spelled out token by token, slot by slot (for tests; slow).

    acc = 0 (float32); for k = 0..K-1 with id >= 0: acc = acc + float32(w_k) * float32(out_k);
    then one cast to ``out_dtype``.
    """
    T, K, H = slot_out.shape
    y = torch.empty(T, H, dtype=out_dtype)
    for t in range(T):
        acc = torch.zeros(H, dtype=torch.float32)
        for k in range(K):
            if int(topk_ids[t, k]) >= 0:
                acc = acc + slot_out[t, k].float().cpu() * topk_weights[t, k].float().cpu()
        y[t] = acc.to(out_dtype)
    return y


def reference_rank_sum(slot_out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       out_dtype: torch.dtype, num_experts: int, world_size: int) -> torch.Tensor:
    """``combine_order="rank"`` spelled out token by token, rank by rank, slot by slot (for tests; slow).

    For each rank r = 0..P-1 holding slots of the token (expert e on rank e // (E / P)):
    part = 0 (float32); for k = 0..K-1 with id on r: part = part + float32(w_k) * float32(out_k);
    then y_acc = y_acc + float32(part rounded to ``out_dtype``); one cast of y_acc at the end.
    """
    T, K, H = slot_out.shape
    per_rank = num_experts // world_size
    y = torch.empty(T, H, dtype=out_dtype)
    for t in range(T):
        acc = torch.zeros(H, dtype=torch.float32)
        for r in range(world_size):
            slots = [k for k in range(K) if int(topk_ids[t, k]) >= 0 and int(topk_ids[t, k]) // per_rank == r]
            if not slots:
                continue
            part = torch.zeros(H, dtype=torch.float32)
            for k in slots:
                part = part + slot_out[t, k].float().cpu() * topk_weights[t, k].float().cpu()
            acc = acc + part.to(out_dtype).float()
        y[t] = acc.to(out_dtype)
    return y
