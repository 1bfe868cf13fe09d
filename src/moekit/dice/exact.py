"""Batch-invariant arithmetic: every row's result independent of how many rows share the call.

A dense ``x @ W^T`` on the CPU picks its kernel from the number of rows (MKL switches
kernels below a handful of rows), so the same token can round differently on a rank that
holds 3 of its rows than in a single process that holds all of them. The staleness
simulator must match the distributed schedules *bitwise*, so in that mode every linear map
goes through :func:`rowwise_linear`: one ``1 x K @ K x N`` product per row, batched with
``bmm``, which makes each row's arithmetic the same whatever its batch. It is slow; it is
for correctness checks at tiny sizes, never for speed.
"""

from __future__ import annotations

import torch
from torch import nn

from moekit.moe.experts import SwiGLUExperts, swiglu


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with every row computed as its own 1-row product."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, 1, k)
    w = weight.t().unsqueeze(0).expand(rows.shape[0], -1, -1)
    out = torch.bmm(rows, w).reshape(*lead, weight.shape[0])
    return out if bias is None else out + bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           batch_invariant: bool = False) -> torch.Tensor:
    """``F.linear``, or :func:`rowwise_linear` when ``batch_invariant``."""
    if batch_invariant:
        return rowwise_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, batch_invariant: bool = False) -> torch.Tensor:
    """One SwiGLU MLP on rows x[..., H] (w13 [2N, H], w2 [H, N]), optionally batch-invariant."""
    return linear(swiglu(linear(x, w13, batch_invariant=batch_invariant)), w2, batch_invariant=batch_invariant)


class RowwiseExperts(SwiGLUExperts):
    """A rank's SwiGLU experts on a Dispatcher's expert-major tokens, batch-invariant.

    Same call as :class:`moekit.moe.SwiGLUExperts` (``tokens[E_local, capacity, H]``,
    ``counts``, ``scales``); every row's output is bitwise what :func:`expert_mlp` gives for
    that row alone, whatever the capacity a dispatcher padded to.
    """

    def compute(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.stack([expert_mlp(tokens[e], self.w13[e], self.w2[e], batch_invariant=True)
                            for e in range(self.num_experts)])
