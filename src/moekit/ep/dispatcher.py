"""The Dispatcher protocol, the Dispatched record, and what every dispatcher shares: input
validation and the two combine orders (``combine_order="slot"``, the default, and
``combine_order="rank"``), each defined by one function here.

A dispatch result says which layout it carries (docs/architecture.md):

* expert-major (:data:`EXPERT_MAJOR`, every multi-rank dispatcher): received rows
  ``[E_local, capacity, H]``; ``counts[e]`` rows of expert ``e`` are valid. Within an expert the
  rows are in canonical order (source rank, source token, slot k), so that every dispatcher
  returns the same rows in the same places and results can be compared with ``torch.equal``.
* token-major (:data:`TOKEN_MAJOR`, one process: :class:`moekit.ep.local.LocalDispatcher`):
  the tokens ``[T, H]`` as they are, with their ``topk_ids`` / ``topk_weights``. Nothing moves,
  so nothing is regrouped: the experts take the tokens and the routing directly.

An experts module declares the layouts it takes (``layouts``) and, for the token-major one,
whether it applies the routing weights and sums the K slots itself (``sums_slots``): then it
returns ``[T, H]`` and combine only finalizes (the output dtype); otherwise it returns the
``[T, K, H]`` slot outputs and combine sums them in the dispatcher's order.
:func:`run_experts` is the one place that calls an experts module on a ``Dispatched``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

COMBINE_ORDERS = ("slot", "rank")  # the ``combine_order`` every dispatcher takes
EXPERT_MAJOR = "expert_major"  # Dispatched.layout of the multi-rank dispatchers
TOKEN_MAJOR = "token_major"  # Dispatched.layout of the local (one-process) dispatcher
LAYOUTS = (EXPERT_MAJOR, TOKEN_MAJOR)


@dataclass
class DispatchHandle:
    """What combine needs to send expert outputs home.

    ``src_rank`` / ``src_token`` / ``src_slot``: ``[E_local, capacity]`` int64, the source
    rank, token index on that rank and top-k slot of every received row (-1 on padding
    rows). ``state`` is private to the dispatcher that made the handle.
    """

    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_slot: torch.Tensor
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class Dispatched:
    """Tokens received by this rank, in the layout ``layout`` names.

    Expert-major (the default): tokens ``[E_local, capacity, H]`` (FP8 when quantized, then
    ``scales`` is ``[E_local, capacity, H // group]`` float32); counts: ``[E_local]`` int64
    valid rows; ``handle``: where each row goes back to.

    Token-major: tokens ``[T, H]`` (FP8 with ``scales`` ``[T, H // group]`` when quantized),
    ``topk_ids`` / ``topk_weights`` ``[T, K]`` as given to dispatch; ``counts`` and ``handle``
    are None (nothing was regrouped).
    """

    tokens: torch.Tensor
    counts: torch.Tensor | None
    handle: DispatchHandle | None
    scales: torch.Tensor | None = None
    layout: str = EXPERT_MAJOR
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1] if self.layout == EXPERT_MAJOR else self.tokens.shape[0]

    def valid_rows(self, expert: int) -> torch.Tensor:
        """The ``counts[expert]`` received rows of one local expert (host sync: for tests and tools)."""
        return self.tokens[expert, : int(self.counts[expert])]


@runtime_checkable
class Dispatcher(Protocol):
    """Moves tokens to the ranks of their experts and the expert outputs back."""

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched: ...

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor: ...


def run_experts(experts, dispatched: Dispatched) -> torch.Tensor:
    """Call ``experts`` on ``dispatched`` in its layout: ``experts(tokens, counts, scales)`` on the
    expert-major layout, ``experts.token_major(tokens, topk_ids, topk_weights, scales)`` on the
    token-major one. An experts module that does not declare the layout (``experts.layouts``,
    expert-major only when absent) is a ValueError naming both."""
    layouts = getattr(experts, "layouts", (EXPERT_MAJOR,))
    if dispatched.layout not in layouts:
        raise ValueError(f"{type(experts).__name__} takes the layouts {tuple(layouts)}, but the dispatcher "
                         f"delivers {dispatched.layout!r}; use experts that take it or another dispatcher")
    if dispatched.layout == TOKEN_MAJOR:
        return experts.token_major(dispatched.tokens, dispatched.topk_ids, dispatched.topk_weights,
                                   dispatched.scales)
    return experts(dispatched.tokens, dispatched.counts, dispatched.scales)


def validate_routing(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    *,
    hidden: int | None = None,
    top_k: int | None = None,
    max_tokens: int | None = None,
    dtype: torch.dtype | None = None,
    check_ids: bool = True,
) -> None:
    """Raise ValueError naming the argument when the inputs of ``dispatch`` are malformed.

    ``check_ids`` reads the id range back to the host; the dispatchers pass False and check
    the range with their peers instead (:mod:`moekit.ep.agreement`), or, inside a CUDA
    graph, rely on a flag tensor.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [T, H], got {_describe(x)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"x must have dtype {dtype} (the dispatcher's dtype), got {x.dtype}")
    T, H = x.shape
    if hidden is not None and H != hidden:
        raise ValueError(f"x must have hidden size H={hidden}, got {H}")
    if max_tokens is not None and T > max_tokens:
        raise ValueError(f"x has T={T} tokens; this dispatcher allows T in [0, {max_tokens}]")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be a 2-D tensor [T={T}, K], got {_describe(topk_ids)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got dtype {topk_ids.dtype}")
    K = topk_ids.shape[1]
    if top_k is not None and K != top_k:
        raise ValueError(f"topk_ids must have K={top_k} columns, got {K}")
    if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (T, K):
        raise ValueError(f"topk_weights must have the shape of topk_ids {(T, K)}, got {_describe(topk_weights)}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be floating point, got dtype {topk_weights.dtype}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; they must share a device")
    if check_ids and topk_ids.numel():
        lo, hi = (int(v) for v in torch.stack(torch.aminmax(topk_ids)).tolist())  # one host read
        problem = id_range_problem(num_experts, lo, hi)
        if problem:
            raise ValueError(problem)


def id_range_problem(num_experts: int, lo: int, hi: int) -> str | None:
    """What is wrong with expert ids spanning [lo, hi], or None when they are in [-1, E)."""
    if lo < -1 or hi >= num_experts:
        return f"topk_ids must be in [-1, {num_experts - 1}] (-1 = masked slot), got values in [{lo}, {hi}]"
    return None


def weighted_slot_sum(
    slot_out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """y[t] = sum_k w[t, k] * slot_out[t, k], the combine every dispatcher ends with.

    The contract of docs/architecture.md: accumulate in float32 in slot order k = 0..K-1, each term the
    float32 product of the float32 routing weight and the float32 expert output, then cast
    once. Masked slots (id -1) are skipped, whatever their rows hold. Keeping one function
    for this is what makes all dispatchers bitwise identical.
    """
    T, K, H = slot_out.shape
    acc = torch.zeros(T, H, dtype=torch.float32, device=slot_out.device)
    weights = topk_weights.to(torch.float32)
    for k in range(K):
        term = slot_out[:, k].to(torch.float32) * weights[:, k : k + 1]
        acc = torch.where((topk_ids[:, k] >= 0).unsqueeze(1), acc + term, acc)
    return acc.to(out_dtype)


def check_combine_order(value: Any) -> str:
    """``value`` if it is one of :data:`COMBINE_ORDERS`, else a ValueError naming them."""
    if not isinstance(value, str) or value not in COMBINE_ORDERS:
        raise ValueError(f"combine_order must be one of {list(COMBINE_ORDERS)} ('slot': every slot's row travels "
                         f"back and the token's rank sums the K slots; 'rank': each rank sends one partial sum "
                         f"per token), got {value!r}")
    return value


def weighted_rank_sum(slot_out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      out_dtype: torch.dtype, *, num_experts: int, world_size: int) -> torch.Tensor:
    """The ``combine_order="rank"`` contract: what every dispatcher's combine in that order returns.

    Experts are placed contiguously (expert e on rank ``e // (num_experts / world_size)``).
    For each rank r that holds experts of token t, the partial row of (t, r) is the slot-order
    sum of DESIGN.md restricted to the slots on r: ``acc = 0`` (float32), then for
    k = 0..K-1 with ``topk_ids[t, k]`` on r, ``acc = acc + float32(w[t, k]) * float32(out[t, k])``,
    rounded once to ``out_dtype``. That partial is what travels back to the token's rank,
    which adds the partials of its ranks in float32 in rank order r = 0..P-1, starting from
    0, and rounds once. Masked slots (id -1) and ranks holding no slot of t are skipped,
    whatever the rows hold. With every slot of a token on one rank this is bitwise the
    slot order (the extra rounding to ``out_dtype`` and back is exact); otherwise it rounds
    once more per rank.

    Written plainly, one loop over ranks and one over slots, and sharing no code with the
    dispatchers (:mod:`moekit.ep.rank_order` is theirs): it is the definition they are
    tested against.
    """
    if world_size < 1 or num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} must be a positive multiple of world_size={world_size}")
    T, K, H = slot_out.shape
    experts_per_rank = num_experts // world_size
    ids = topk_ids.to(torch.int64)
    owner = torch.where(ids >= 0, torch.div(ids, experts_per_rank, rounding_mode="floor"), -1)
    weights = topk_weights.to(torch.float32)
    y = torch.zeros(T, H, dtype=torch.float32, device=slot_out.device)
    for r in range(world_size):
        on_r = owner == r  # [T, K]
        partial = torch.zeros(T, H, dtype=torch.float32, device=slot_out.device)
        for k in range(K):
            term = slot_out[:, k].to(torch.float32) * weights[:, k : k + 1]
            partial = torch.where(on_r[:, k : k + 1], partial + term, partial)
        rounded = partial.to(out_dtype).to(torch.float32)
        y = torch.where(on_r.any(1, keepdim=True), y + rounded, y)
    return y.to(out_dtype)


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor of shape {tuple(t.shape)} and dtype {t.dtype}"
    return type(t).__name__
