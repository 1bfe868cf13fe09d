"""MoELayer: router -> dispatcher -> local experts -> combine (+ shared experts)."""

from __future__ import annotations

import torch
from torch import nn

from moekit.ep.alltoall import AllToAllDispatcher
from moekit.ep.dispatcher import Dispatcher, check_combine_order, run_experts
from moekit.ep.local import LocalDispatcher
from moekit.moe.experts import MoEWeights, SwiGLUExperts, expert_mlp
from moekit.moe.fused_experts import FusedExperts
from moekit.moe.router import TopKRouter
from moekit.shapes import MoEShape

EXPERT_KINDS = ("torch", "fused", "fused_fp8")  # MoELayer(experts=...)


class MoELayer(nn.Module):
    """One expert-parallel MoE block on this rank.

    Holds the router (replicated), the experts this rank owns (contiguous placement:
    experts ``rank * E_local .. (rank + 1) * E_local - 1``) and the shared experts
    (replicated). ``rank`` / ``world_size`` default to the dispatcher's. The output has
    the dtype of the expert weights. ``weights`` are the full block's weights, identical on every rank (build
    them with ``MoEWeights.random(shape, seed=...)``). The dispatcher defaults to
    :func:`default_dispatcher`: with one rank (no process group, or a group of one) the
    :class:`~moekit.ep.local.LocalDispatcher`, which hands the tokens to the experts
    token-major (nothing moves, nothing is regrouped); with several, the low-latency layer on
    GPUs of one node when ``max_tokens`` (the most tokens a rank passes to one forward) is
    given and its shape fits, else the eager all-to-all over the default process group.

    ``experts`` picks the expert compute: ``"torch"`` (batched matmuls,
    :class:`SwiGLUExperts`), ``"fused"`` (the fused Triton kernel, :class:`FusedExperts`) or
    ``"fused_fp8"`` (its W8A8 form, the local experts' weights quantized to e4m3 at
    construction); ``kernel_config`` is the fused kernel's :class:`moekit.kernels.KernelConfig`
    or a policy of :mod:`moekit.ops.policy`: ``"static"`` / None (the default: one config per
    token-count bucket, no read of the routing), ``"default"``, ``"ramp"`` or ``"auto"``
    (RaMP's routing-aware choices; :class:`FusedExperts` says how each behaves). FP8
    tokens from a quantizing dispatcher reach the experts with their scales: the W8A8 kernel
    takes them as they are, the others dequantize them.

    ``combine_order``: how the routed outputs are summed (docs/architecture.md, "Exactness"): ``"slot"``
    or ``"rank"`` (each rank sums a token's slots it holds, one row per (token, rank) travels
    back). None: the dispatcher's order, or ``"slot"`` for the default dispatcher, which is
    built with the order given. A dispatcher of another order is an error.
    """

    def __init__(self, shape: MoEShape, weights: MoEWeights, *, dispatcher: Dispatcher | None = None,
                 rank: int | None = None, world_size: int | None = None, renormalize: bool = True,
                 experts: str = "torch", kernel_config=None, combine_order: str | None = None,
                 max_tokens: int | None = None):
        super().__init__()
        if combine_order is not None:
            check_combine_order(combine_order)
        if dispatcher is None:
            dispatcher = default_dispatcher(shape.num_experts, hidden=shape.hidden, top_k=shape.top_k,
                                            combine_order=combine_order or "slot", max_tokens=max_tokens,
                                            dtype=weights.w13.dtype)
        given = getattr(dispatcher, "combine_order", "slot")
        if combine_order is not None and given != combine_order:
            raise ValueError(f"combine_order={combine_order!r} but the dispatcher combines in the {given!r} order; "
                             f"build the dispatcher with combine_order={combine_order!r}")
        self.combine_order = given
        self.dispatcher = dispatcher
        # Which experts this rank owns follows from the dispatcher's group; explicit values
        # must agree with it (a mismatch would run the wrong experts on the received rows).
        rank = _agree("rank", rank, getattr(self.dispatcher, "rank", None))
        world_size = _agree("world_size", world_size, getattr(self.dispatcher, "world_size", None))
        E_local = shape.experts_per_rank(world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size - 1}], got {rank}")
        self.shape = shape
        self.router = TopKRouter(shape.hidden, shape.num_experts, shape.top_k,
                                 renormalize=renormalize, weight=weights.router, device=weights.w13.device)
        lo = rank * E_local
        self.experts = _make_experts(experts, kernel_config, weights.w13[lo:lo + E_local].clone(),
                                     weights.w2[lo:lo + E_local].clone(), top_k=shape.top_k)
        self.register_buffer("shared_w13", weights.shared_w13)
        self.register_buffer("shared_w2", weights.shared_w2)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor | None = None,
                topk_weights: torch.Tensor | None = None) -> torch.Tensor:
        """y[T, H]; the routing comes from the router unless given (synthetic or replayed routing)."""
        if (topk_ids is None) != (topk_weights is None):
            raise ValueError("topk_ids and topk_weights must be given together (or neither)")
        if topk_ids is None:
            topk_ids, topk_weights = self.router(x)
        dispatched = self.dispatcher.dispatch(x, topk_ids, topk_weights)
        y = self.dispatcher.combine(run_experts(self.experts, dispatched), dispatched)
        if self.shared_w13 is not None:
            y = y + expert_mlp(x, self.shared_w13, self.shared_w2).to(y.dtype)
        return y


def default_dispatcher(num_experts: int, *, hidden: int | None = None, top_k: int | None = None,
                       combine_order: str = "slot", max_tokens: int | None = None, dtype: torch.dtype | None = None,
                       available=None) -> Dispatcher:
    """The dispatcher a layer or a patched model gets when it is given none.

    * one rank (no initialized process group, or a group of one): the
      :class:`~moekit.ep.local.LocalDispatcher`;
    * several, where the low-latency layer applies — ``max_tokens`` (the most tokens a rank
      sends per call) given, the shape within its limits
      (:func:`moekit.ep.lowlatency.select.lowlatency_limits`) and every rank able to run its
      GPU transport (CUDA, NCCL, symmetric memory, one node with NVLink peers:
      :func:`~moekit.ep.lowlatency.select.lowlatency_available`, agreed by all ranks): the
      :class:`~moekit.ep.lowlatency.EPLowLatencyAllToAll` (exact: no FP8 on the wire; every
      layer built this way shares the process's one low-latency buffer);
    * otherwise (CPU / gloo, several nodes, no ``max_tokens``): the eager
      :class:`~moekit.ep.alltoall.AllToAllDispatcher` over the default group.

    ``dtype``: the activations' dtype (the low-latency layer's). ``available``: the
    capability check, ``lowlatency_available`` by default (a collective: call this on every
    rank). Naming a dispatcher explicitly (``MoELayer(dispatcher=...)``) bypasses this."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return LocalDispatcher(num_experts, hidden=hidden, top_k=top_k, combine_order=combine_order)
    from moekit.ep.lowlatency.select import lowlatency_available, lowlatency_limits

    world = dist.get_world_size()
    misfit = lowlatency_limits(world_size=world, num_experts=num_experts, hidden=hidden, top_k=top_k,
                               max_tokens=max_tokens, dtype=dtype)
    # The limits are the same on every rank, so the collective check runs on all or none.
    if misfit is None and (available or lowlatency_available)():
        from moekit.ep.lowlatency import EPLowLatencyAllToAll

        return EPLowLatencyAllToAll(max_tokens, hidden, top_k, num_experts, dtype=dtype, online_fp8=False,
                                    combine_order=combine_order)
    return AllToAllDispatcher(num_experts, hidden=hidden, top_k=top_k, combine_order=combine_order)


def _make_experts(kind: str, kernel_config, w13: torch.Tensor, w2: torch.Tensor, *,
                  top_k: int | None = None) -> nn.Module:
    if kind not in EXPERT_KINDS:
        raise ValueError(f"experts must be one of {EXPERT_KINDS}, got {kind!r}")
    if kind == "torch":
        if kernel_config is not None:
            raise ValueError("kernel_config is for the fused experts (experts='fused' or 'fused_fp8')")
        return SwiGLUExperts(w13, w2)
    return FusedExperts(w13, w2, config=kernel_config, fp8=kind == "fused_fp8", top_k=top_k)


def _agree(name: str, given: int | None, from_dispatcher: int | None) -> int:
    if given is not None and from_dispatcher is not None and given != from_dispatcher:
        raise ValueError(f"{name}={given} disagrees with the dispatcher's {name}={from_dispatcher}")
    for value in (given, from_dispatcher):
        if value is not None:
            return value
    return 0 if name == "rank" else 1
