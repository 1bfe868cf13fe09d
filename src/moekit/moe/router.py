"""Softmax top-k router."""

from __future__ import annotations

import torch
from torch import nn


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each row of ``logits`` and their softmax weights.

    The softmax runs in float32 (float64 stays float64) so that routing does not depend on
    the activation dtype; with ``renormalize`` the k weights of a token sum to one.
    """
    compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(logits.to(compute_dtype), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int64), weights


class TopKRouter(nn.Module):
    """x[T, H] -> (topk_ids[T, K] int64, topk_weights[T, K] float32).

    The gate is a bias-free linear map to E logits, computed in float32.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, renormalize: bool = True,
                 weight: torch.Tensor | None = None, device=None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        if weight is None:
            weight = torch.empty(num_experts, hidden, device=device).normal_(std=hidden**-0.5)
        if tuple(weight.shape) != (num_experts, hidden):
            raise ValueError(f"weight must have shape {(num_experts, hidden)}, got {tuple(weight.shape)}")
        self.weight = nn.Parameter(weight.to(device=device, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = x.to(torch.float32) @ self.weight.t()
        ids, weights = softmax_topk(logits, self.top_k, self.renormalize)
        return ids, weights.to(torch.float32)
