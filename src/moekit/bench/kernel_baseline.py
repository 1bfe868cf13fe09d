"""The plain-torch MoE experts that ``moekit bench kernel`` compares the fused Triton kernel with.

Same function as :func:`moekit.kernels.fused_moe`: route the (token, slot) pairs to their
experts, SwiGLU expert MLP (``silu(x @ gate.T) * (x @ up.T) @ w2.T``, float32 accumulation in
every product, results in the input dtype), then the weighted sum over the top-k slots in
float32, cast once. ``-1`` ids are masked slots that contribute nothing.

Two implementations:

* ``grouped_mm``: one ``torch._grouped_mm`` per projection over all experts at once (the
  pairs sorted by expert, group ends as int32 offsets). Everything stays on the device, so
  the call can be captured in a CUDA graph with any routing written into the same buffers.
  It needs a torch that has ``torch._grouped_mm`` and a device/dtype it runs on (bf16 on
  sm90+ in torch 2.11); :func:`grouped_mm_works` tries it once per (device, dtype).
* ``loop``: one matmul pair per non-empty expert. The row count of each expert is read to the
  host when the callable is *built*, so the callable is tied to that routing (the routing is
  fixed while a point is timed); the sort by expert is still done in every call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

IMPLS = ("auto", "grouped_mm", "loop")

_PROBED: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_works(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` exists here and computes a small grouped product right.

    Tried once per (device, dtype) on random data with an empty group, and compared with a
    per-group matmul in float32 (tolerance 2e-2 relative, as for bf16 operands).
    """
    device = torch.device(device)
    key = (str(device), dtype)
    if key not in _PROBED:
        _PROBED[key] = _probe_grouped_mm(device, dtype)
    return _PROBED[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 32, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(3, 48, 32, generator=g).to(device=device, dtype=dtype)  # [E, N, K] like w13
    offs = torch.tensor([16, 16, 40], dtype=torch.int32, device=device)  # expert 1 is empty
    try:
        got = torch._grouped_mm(a, w.transpose(1, 2), offs=offs).float()
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    want = torch.cat([a[:16].float() @ w[0].float().t(), a[16:40].float() @ w[2].float().t()])
    err = (got - want).norm() / want.norm()
    return bool(torch.isfinite(got).all()) and float(err) < 2e-2


def resolve_impl(impl: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """``auto`` -> ``grouped_mm`` where it works, else ``loop``; other names are checked."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "grouped_mm" if grouped_mm_works(device, dtype) else "loop"
    if impl == "grouped_mm" and not grouped_mm_works(device, dtype):
        raise ValueError(f"impl='grouped_mm' was asked for but torch._grouped_mm does not run for "
                         f"{dtype} on {device} in torch {torch.__version__}")
    return impl


def _sorted_pairs(topk_ids: torch.Tensor, num_experts: int):
    """(order, key) of the flattened pairs sorted by expert; masked slots get key E (last)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))
    key_sorted, order = torch.sort(key, stable=True)
    return order, key_sorted


def _weighted_slot_sum(expert_out: torch.Tensor, order: torch.Tensor, valid: torch.Tensor,
                       topk_weights: torch.Tensor, M: int, K: int, out_dtype: torch.dtype) -> torch.Tensor:
    """y[t] = sum over the valid sorted rows of token t of w * out, in float32, cast once."""
    w = topk_weights.reshape(-1).to(torch.float32)[order]
    # torch.where, not a multiply by 0: rows outside every group may hold garbage (even NaN).
    contrib = torch.where(valid.unsqueeze(1), expert_out.float() * w.unsqueeze(1), 0.0)
    y = torch.zeros(M, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    y.index_add_(0, order // K, contrib)
    return y.to(out_dtype)


def _grouped_moe(x, w13, w2, topk_ids, topk_weights) -> torch.Tensor:
    M, K = topk_ids.shape
    E = w13.shape[0]
    order, key_sorted = _sorted_pairs(topk_ids, E)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, key_sorted, torch.ones_like(key_sorted))
    offs = torch.cumsum(counts[:E], 0).to(torch.int32)  # group ends; masked pairs lie past the last
    a = x.index_select(0, order // K)
    h = torch._grouped_mm(a, w13.transpose(1, 2), offs=offs)  # [M*K, 2N]
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up
    out = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [M*K, H]
    return _weighted_slot_sum(out, order, key_sorted < E, topk_weights, M, K, x.dtype)


def _loop_moe(x, w13, w2, topk_ids, topk_weights, bounds: list[tuple[int, int, int]]) -> torch.Tensor:
    M, K = topk_ids.shape
    E = w13.shape[0]
    order, key_sorted = _sorted_pairs(topk_ids, E)
    a = x.index_select(0, order // K)
    out = torch.zeros(M * K, x.shape[1], dtype=x.dtype, device=x.device)
    for e, start, end in bounds:  # non-empty experts only
        gate, up = (a[start:end] @ w13[e].t()).chunk(2, dim=-1)
        out[start:end] = (F.silu(gate) * up) @ w2[e].t()
    return _weighted_slot_sum(out, order, key_sorted < E, topk_weights, M, K, x.dtype)


def _expert_bounds(topk_ids: torch.Tensor, num_experts: int) -> list[tuple[int, int, int]]:
    """(expert, first, end) sorted-row ranges of the non-empty experts (one host read)."""
    ids = topk_ids.reshape(-1)
    counts = torch.bincount(ids[ids >= 0].to(torch.int64), minlength=num_experts).tolist()
    bounds, start = [], 0
    for e, n in enumerate(counts[:num_experts]):
        if n:
            bounds.append((e, start, start + n))
        start += n
    return bounds


def make_torch_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, impl: str = "auto") -> tuple[Callable[[], torch.Tensor], str]:
    """A no-argument callable computing the MoE experts on these tensors, and the impl it uses.

    x [M, H]; w13 [E, 2N, H]; w2 [E, H, N] (x's dtype); topk_ids [M, K] in [-1, E);
    topk_weights [M, K]. The callable reads the tensors when called, so new routing copied
    into ``topk_ids`` / ``topk_weights`` is picked up by the ``grouped_mm`` impl (also inside
    a captured CUDA graph); the ``loop`` impl keeps the per-expert row counts of the routing
    it was built with (rebuild it for new routing).
    """
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be [M, H], w13 [E, 2N, H] and w2 [E, H, N], got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    E, two_n, H = w13.shape
    if x.shape[1] != H or tuple(w2.shape) != (E, H, two_n // 2) or two_n % 2:
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} disagree")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_ids and topk_weights must both be [M={x.shape[0]}, K], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    impl = resolve_impl(impl, x.device, x.dtype)
    if impl == "grouped_mm":
        return (lambda: _grouped_moe(x, w13, w2, topk_ids, topk_weights)), impl
    bounds = _expert_bounds(topk_ids, E)
    return (lambda: _loop_moe(x, w13, w2, topk_ids, topk_weights, bounds)), impl
