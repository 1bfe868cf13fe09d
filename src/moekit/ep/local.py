"""LocalDispatcher: the dispatcher of one process, where nothing moves.

With one rank every expert is local, so regrouping the tokens by expert (the expert-major
layout the multi-rank dispatchers need for their all-to-all) would only copy the activations
there and back. The local dispatcher hands the tokens over token-major instead (``[T, H]`` with
the routing, :data:`~moekit.ep.dispatcher.TOKEN_MAJOR`), quantized to FP8 when an FP8 wire is
asked for, and the experts run on them directly: the fused experts call the token-major kernel,
which weights and sums the K slots itself, so combine only finalizes.

Hot path: ``dispatch`` and ``combine`` read nothing back from the device. The checks of the
arguments' shapes, dtypes and devices run once per signature (the first call with new shapes)
and are remembered; expert ids are not range-checked here (that would read them back): the
experts' kernels see them.
"""

from __future__ import annotations

import torch

from moekit.ep.dispatcher import (TOKEN_MAJOR, Dispatched, check_combine_order, validate_routing,
                                  weighted_slot_sum)
from moekit.fp8 import quantize_groups

FP8_WIRE_GROUP = 128  # columns per activation scale on an FP8 wire (the W8A8 kernel's groups)


class LocalDispatcher:
    """``dispatch(x [T, H], topk_ids [T, K], topk_weights [T, K])`` -> a token-major
    :class:`~moekit.ep.dispatcher.Dispatched`; ``combine(expert_out, dispatched)`` -> ``[T, H]``.

    ``num_experts``: E (every expert is on this process). ``hidden`` / ``top_k`` / ``max_tokens``
    / ``dtype``: when given, the inputs must match (ValueError naming the argument).
    ``fp8=True``: the tokens are quantized to e4m3 in groups of 128 columns (``scales`` ``[T, H /
    128]``), as an FP8 wire would carry them; H must then be a multiple of 128.

    ``combine`` takes what the experts returned: ``[T, H]`` when they weighted and summed the K
    slots themselves (the fused experts): returned as it is; or the slot outputs ``[T, K, H]``
    (the torch experts): summed in slot order (:func:`~moekit.ep.dispatcher.weighted_slot_sum`).
    With every expert on one rank, ``combine_order="rank"`` is the same sum bit for bit (one
    partial per token, whose rounding to the output dtype and back is exact), so both orders
    are offered and agree.
    """

    rank = 0
    world_size = 1
    layout = TOKEN_MAJOR
    compile_traceable = True  # nothing read on the host: torch.compile traces through it

    def __init__(self, num_experts: int, *, hidden: int | None = None, top_k: int | None = None,
                 max_tokens: int | None = None, dtype: torch.dtype | None = None, fp8: bool = False,
                 combine_order: str = "slot"):
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
        for name, value in (("hidden", hidden), ("top_k", top_k), ("max_tokens", max_tokens)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        if not isinstance(fp8, bool):
            raise ValueError(f"fp8 must be a bool, got {fp8!r}")
        if fp8 and hidden is not None and hidden % FP8_WIRE_GROUP:
            raise ValueError(f"fp8=True needs hidden to be a multiple of {FP8_WIRE_GROUP}, got {hidden}")
        self.num_experts = num_experts
        self.hidden, self.top_k, self.max_tokens, self.dtype = hidden, top_k, max_tokens, dtype
        self.fp8 = fp8
        self.combine_order = check_combine_order(combine_order)
        self._checked: set = set()  # signatures of inputs already validated

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        self._validate(x, topk_ids, topk_weights)
        tokens, scales = x, None
        if self.fp8:
            tokens, scales = quantize_groups(x, FP8_WIRE_GROUP)
        return Dispatched(tokens, None, None, scales, TOKEN_MAJOR, topk_ids, topk_weights)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """[T, H] in ``expert_out``'s dtype (see the class docstring)."""
        if dispatched.layout != TOKEN_MAJOR:
            raise ValueError(f"LocalDispatcher.combine takes its own token-major dispatch, got {dispatched.layout!r}")
        ids = dispatched.topk_ids
        T, K = ids.shape
        H = dispatched.tokens.shape[1]
        if expert_out.dim() == 2 and tuple(expert_out.shape) == (T, H):
            return expert_out
        if expert_out.dim() == 3 and tuple(expert_out.shape) == (T, K, H):
            return weighted_slot_sum(expert_out, ids, dispatched.topk_weights, expert_out.dtype)
        raise ValueError(f"expert_out must be [T, H] = {(T, H)} (slots weighted and summed) or the slot outputs "
                         f"[T, K, H] = {(T, K, H)}, got {tuple(expert_out.shape)}")

    def _validate(self, x, topk_ids, topk_weights) -> None:
        if torch.compiler.is_compiling():  # traced once per graph: the checks become its guards
            self._check(x, topk_ids, topk_weights)
            return
        try:
            key = (x.shape, x.dtype, x.device, topk_ids.shape, topk_ids.dtype, topk_ids.device,
                   topk_weights.shape, topk_weights.dtype, topk_weights.device)
        except AttributeError:  # not tensors: the checks say which
            key = None
        if key is None or key not in self._checked:
            self._check(x, topk_ids, topk_weights)
            if len(self._checked) > 4096:  # many distinct token counts: forget, re-check as they come
                self._checked.clear()
            self._checked.add(key)

    def _check(self, x, topk_ids, topk_weights) -> None:
        validate_routing(x, topk_ids, topk_weights, self.num_experts, hidden=self.hidden, top_k=self.top_k,
                         max_tokens=self.max_tokens, dtype=self.dtype, check_ids=False)
        if self.fp8 and x.shape[1] % FP8_WIRE_GROUP:
            raise ValueError(f"fp8=True needs the hidden size to be a multiple of {FP8_WIRE_GROUP}, "
                             f"got H={x.shape[1]}")
