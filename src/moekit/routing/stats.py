"""Statistics of routing: expert loads, per-peer token counts, skew, capacity overflow.

These are host-side analysis tools (they copy GPU tensors to the CPU). Every function
accepts a torch tensor or a numpy array; the result is a torch tensor on the input's
device when the input is a tensor, and a numpy array otherwise.

Conventions (shared with the dispatchers, see docs/architecture.md):

* ``topk_ids[..., T, K]`` with ``-1`` for a masked slot, which counts nowhere;
* tokens are laid out rank-major: with P ranks, rank r owns token rows
  ``[r*T/P, (r+1)*T/P)`` (so T must be a multiple of P);
* experts are placed contiguously: expert e lives on rank ``e // (E/P)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .trace import RoutingTrace, as_numpy

# Slots counted per bincount call; bounds the temporary index arrays to ~64 MB.
_CHUNK_SLOTS = 1 << 23

DEFAULT_QUANTILES = (0.5, 0.9, 0.95, 0.99, 0.995, 1.0)
MAX_CAPACITY = 2**31 - 1  # the largest per-peer buffer (rows) considered: an int32 row count


# -- counting -------------------------------------------------------------------------


def expert_counts(topk_ids: Any, num_experts: int) -> Any:
    """Load of every expert: ``[..., T, K] -> [..., E]`` int64.

    ``counts[..., e]`` is the number of (token, slot) pairs routed to expert e; ``-1``
    slots are ignored. A plain ``[T, K]`` routing gives an ``[E]`` vector.
    """
    ids = _checked_ids(topk_ids, num_experts)
    counts = _count_per_row(_rows(ids), lambda chunk: chunk, num_bins=num_experts)
    return _like_input(counts.reshape(*ids.shape[:-2], num_experts), topk_ids)


def peer_counts(topk_ids: Any, num_experts: int, world_size: int) -> Any:
    """Per-peer token counts: ``[..., T, K] -> [..., P, P]`` int64.

    ``c[..., i, j]`` is the number of (token, slot) pairs whose token lives on source
    rank i (rank-major rows) and whose expert lives on rank j (contiguous experts).
    Masked ``-1`` slots count nothing. Row i therefore sums to the routed slots of rank i.
    """
    ids, P, batch, T, K = _rank_major(topk_ids, num_experts, world_size)
    experts_per_rank = num_experts // P
    src = np.repeat(np.arange(T) // max(T // P, 1), K)  # source rank of every slot of a row

    def pair_bin(chunk: np.ndarray) -> np.ndarray:
        # (source rank, destination rank) folded into one bin index per slot
        return src * P + chunk // experts_per_rank

    counts = _count_per_row(_rows(ids), pair_bin, num_bins=P * P)
    return _like_input(counts.reshape(*batch, P, P), topk_ids)


def peer_token_counts(topk_ids: Any, num_experts: int, world_size: int) -> Any:
    """Per-peer *token* counts: ``[..., T, K] -> [..., P, P]`` int64.

    ``c[..., i, j]`` is the number of tokens of source rank i (rank-major rows) with at
    least one slot on rank j (contiguous experts): what a layer that sends each token once
    per destination rank (the low-latency layer) moves from i to j. At most
    :func:`peer_counts`, which counts every (token, slot) pair; masked ``-1`` slots count
    nothing.
    """
    ids, P, batch, T, K = _rank_major(topk_ids, num_experts, world_size)
    rows = ids.reshape(math.prod(batch), T, K)
    out = np.zeros((rows.shape[0], P, P), dtype=np.int64)
    step = max(1, _CHUNK_SLOTS // max(T * (P + 1), 1))  # bounds the [chunk, T, P + 1] hit table
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step].astype(np.int64)
        owner = np.where(chunk >= 0, chunk // (num_experts // P), P)
        hit = np.zeros((*chunk.shape[:2], P + 1), dtype=bool)
        np.put_along_axis(hit, owner, True, axis=2)
        out[start:start + step] = hit[:, :, :P].reshape(chunk.shape[0], P, T // P, P).sum(axis=2)
    return _like_input(out.reshape(*batch, P, P), topk_ids)



def _rank_major(topk_ids: Any, num_experts: int, world_size: int):
    """(ids, P, batch dims, T, K) of routing split rank-major over ``world_size`` ranks with
    contiguous experts, or a ValueError naming what does not divide."""
    _check_positive_int("world_size", world_size)
    ids = _checked_ids(topk_ids, num_experts)
    P = world_size
    if num_experts % P != 0:
        raise ValueError(f"world_size must divide num_experts={num_experts}, got world_size={P}")
    batch, (T, K) = ids.shape[:-2], ids.shape[-2:]
    if T % P != 0:
        raise ValueError(
            f"topk_ids token dim T={T} must be a multiple of world_size={P} "
            "(tokens are split rank-major into equal blocks)"
        )
    return ids, P, batch, T, K

def _rows(ids: np.ndarray) -> np.ndarray:
    """``[..., T, K] -> [batch, T*K]`` (explicit sizes, so T = 0 works too)."""
    return ids.reshape(math.prod(ids.shape[:-2]), ids.shape[-2] * ids.shape[-1])


def _count_per_row(ids: np.ndarray, to_bin, num_bins: int) -> np.ndarray:
    """Histogram of ``to_bin(ids)[b, :]`` for every row b, skipping ``-1`` slots.

    One bincount over (row, bin) pairs, in chunks of rows so the temporary index arrays
    stay small even for a whole trace.
    """
    rows, width = ids.shape
    out = np.zeros((rows, num_bins), dtype=np.int64)
    step = max(1, _CHUNK_SLOTS // max(width, 1))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        chunk = ids[start:stop].astype(np.int64)
        row = np.arange(stop - start)[:, None]
        flat = (row * num_bins + to_bin(chunk))[chunk >= 0]
        out[start:stop] = np.bincount(flat, minlength=(stop - start) * num_bins).reshape(-1, num_bins)
    return out


# -- skew -----------------------------------------------------------------------------


def balancedness(counts: Any) -> Any:
    """Normalized entropy of an expert-load histogram: ``[..., E] -> [...]`` float64.

    ``H(load) / log(E)`` with ``load = counts / counts.sum()`` (the RaMP paper's beta):
    1 means perfectly uniform, lower means skewed. Conventions: an all-zero histogram
    (no tokens) has no defined skew and gives ``nan``; with a single expert (E = 1) any
    non-empty load is uniform and gives 1.0.
    """
    c = _checked_counts(counts).astype(np.float64)
    E = c.shape[-1]
    total = c.sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = c / total[..., None]
        entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)
        beta = entropy / math.log(E) if E > 1 else np.ones_like(total)
    beta = np.where(total > 0, beta, np.nan)
    return _like_input(beta, counts, scalar=True)


def active_experts(counts: Any) -> Any:
    """How many experts receive at least one token: ``[..., E] -> [...]`` int64."""
    c = _checked_counts(counts)
    return _like_input(np.count_nonzero(c > 0, axis=-1).astype(np.int64), counts, scalar=True)


# -- whole-trace statistics -----------------------------------------------------------


@dataclass
class TraceStats:
    """Summary of a trace's per-peer token counts and expert skew (see :func:`trace_stats`).

    An *observation* is one per-peer count ``c[i, j]`` of one layer in one step, so a
    trace gives ``steps * layers * P * P`` of them.
    """

    name: str
    num_steps: int
    num_layers: int
    num_tokens: int
    top_k: int
    num_experts: int
    world_size: int
    num_observations: int
    routed_slots: int  # (token, slot) pairs that go to an expert
    mean: float
    std: float  # population std (ddof=0)
    max: int
    quantiles: dict[float, float]  # q -> value (numpy "linear" interpolation)
    capacity: int
    capacity_source: str  # "given" or "ceil(Q0.99)"
    overflow_slice_fraction: float  # of observations with c > capacity
    # of (step, layer, source rank) sends with any c > capacity; this reading matches the
    # "Overflow (%)" column of the Cap-and-Spill paper's Table 2 (5.4% at C = Q99), which
    # cannot be a per-count fraction (that is ~1% at Q99 by definition)
    overflow_send_fraction: float
    overflow_token_fraction: float  # sum(max(c - C, 0)) / sum(c)
    padding_waste_at_capacity: float  # 1 - mean(min(c, C)) / C
    padding_waste_at_max: float  # 1 - mean / max: waste of worst-case (MaxCounts) buffers
    active_experts_mean: float  # per (step, layer)
    balancedness_mean: float  # per (step, layer); layers without tokens are skipped
    balancedness_min: float

    def to_dict(self) -> dict:
        """Plain JSON-serializable dict (quantile keys become strings like ``"0.99"``)."""
        out = asdict(self)
        out["quantiles"] = {repr(float(q)): v for q, v in self.quantiles.items()}
        return out


def trace_stats(
    trace: RoutingTrace,
    world_size: int,
    capacity: int | None = None,
    quantiles: tuple[float, ...] = DEFAULT_QUANTILES,
) -> TraceStats:
    """Per-peer count distribution, capacity overflow and expert skew of ``trace`` on P ranks.

    ``capacity`` is the per-peer buffer size C used for the overflow figures, an int in
    [0, ``MAX_CAPACITY``]; when None it is ``ceil(Q0.99)`` of the counts, the operating point the
    Cap-and-Spill paper uses.
    """
    if not isinstance(trace, RoutingTrace):
        raise ValueError(f"trace must be a RoutingTrace, got {type(trace).__name__}")
    if trace.num_steps == 0 or trace.num_layers == 0:
        raise ValueError(f"trace has no (step, layer) observations: {trace!r}")
    for q in quantiles:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantiles must be in [0, 1], got {q}")
    c = peer_counts(trace.topk_ids, trace.num_experts, world_size)  # [S, L, P, P]
    flat = c.reshape(-1)
    if capacity is None:
        capacity, source = int(math.ceil(np.quantile(flat, 0.99))), "ceil(Q0.99)"
    else:
        valid = isinstance(capacity, (int, np.integer)) and not isinstance(capacity, bool)
        if not (valid and 0 <= capacity <= MAX_CAPACITY):
            raise ValueError(f"capacity must be an int in [0, {MAX_CAPACITY}], got {capacity!r}")
        source = "given"
    loads = expert_counts(trace.topk_ids, trace.num_experts)  # [S, L, E]
    beta = balancedness(loads)
    total = int(flat.sum())
    over = c > capacity
    max_count = int(flat.max())
    return TraceStats(
        name=trace.name,
        num_steps=trace.num_steps,
        num_layers=trace.num_layers,
        num_tokens=trace.num_tokens,
        top_k=trace.top_k,
        num_experts=trace.num_experts,
        world_size=world_size,
        num_observations=int(flat.size),
        routed_slots=total,
        mean=float(flat.mean()),
        std=float(flat.std()),
        max=max_count,
        quantiles={float(q): float(np.quantile(flat, q)) for q in quantiles},
        capacity=int(capacity),
        capacity_source=source,
        overflow_slice_fraction=float(over.mean()),
        overflow_send_fraction=float(over.any(axis=-1).mean()),
        overflow_token_fraction=_ratio(np.maximum(flat - capacity, 0).sum(), total),
        # A buffer of C = 0 rows holds nothing, so none of it is padding (and everything overflows).
        padding_waste_at_capacity=1.0 - float(np.minimum(flat, capacity).mean()) / capacity if capacity else 0.0,
        padding_waste_at_max=1.0 - _ratio(flat.mean(), max_count) if max_count else float("nan"),
        active_experts_mean=float(active_experts(loads).mean()),
        balancedness_mean=_nan_reduce(np.nanmean, beta),
        balancedness_min=_nan_reduce(np.nanmin, beta),
    )


def format_stats(stats: TraceStats) -> str:
    """A short report of :class:`TraceStats` that explains each figure in words."""
    s = stats
    title = f"Routing trace {s.name!r}" if s.name else "Routing trace"
    q_text = "  ".join(f"Q{_percent_label(q)} {v:g}" for q, v in s.quantiles.items())
    lines = [
        f"{title}: {s.num_steps} steps x {s.num_layers} layers, up to {s.num_tokens} tokens "
        f"per step, top-{s.top_k} of {s.num_experts} experts on {s.world_size} ranks "
        f"(E/P = {s.num_experts // s.world_size} per rank)",
        "",
        "Per-peer token counts c[i,j] = (token, slot) pairs that source rank i sends to rank j",
        f"in one layer of one step ({s.num_observations:,} observations, "
        f"{s.routed_slots:,} routed slots in all):",
        f"  mean {s.mean:.2f}   std {s.std:.2f}   max {s.max}",
        f"  quantiles: {q_text}",
        "",
        f"With a per-peer buffer capacity C = {s.capacity} "
        f"({'as given' if s.capacity_source == 'given' else 'the ceiling of Q99, the Cap-and-Spill choice'}):",
        f"  {_pct(s.overflow_slice_fraction):>7} of per-peer counts exceed C",
        f"  {_pct(s.overflow_send_fraction):>7} of sends (one source rank, one layer, one step) "
        "overflow to at least one peer",
        f"  {_pct(s.overflow_token_fraction):>7} of routed slots do not fit and would go to a spill pass",
        f"  {_pct(s.padding_waste_at_capacity):>7} of a C-sized buffer is padding on average "
        f"(vs {_pct(s.padding_waste_at_max)} for worst-case buffers of size max = {s.max})",
        "",
        f"Expert load per (step, layer): {s.active_experts_mean:.2f} of {s.num_experts} experts active "
        "on average;",
        f"  balancedness (normalized entropy of the load, 1 = uniform) mean {s.balancedness_mean:.3f}, "
        f"min {s.balancedness_min:.3f}",
    ]
    return "\n".join(lines)


# -- helpers --------------------------------------------------------------------------


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _checked_ids(topk_ids: Any, num_experts: int) -> np.ndarray:
    """``topk_ids`` as a numpy integer array ``[..., T, K]`` with values in ``[-1, E)``."""
    _check_positive_int("num_experts", num_experts)
    ids = as_numpy(topk_ids)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"topk_ids must be an integer array, got dtype {ids.dtype}")
    if ids.ndim < 2:
        raise ValueError(f"topk_ids must have shape [..., T, K], got shape {ids.shape}")
    if ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < -1 or high >= num_experts:
            raise ValueError(
                f"topk_ids values must be in [-1, {num_experts - 1}] (num_experts={num_experts}), "
                f"found range [{low}, {high}]"
            )
    return ids


def _checked_counts(counts: Any) -> np.ndarray:
    c = as_numpy(counts)
    if c.ndim < 1 or c.shape[-1] < 1:
        raise ValueError(f"counts must have shape [..., E] with E >= 1, got shape {c.shape}")
    if c.dtype.kind not in "iuf":
        raise ValueError(f"counts must be numeric, got dtype {c.dtype}")
    if c.size and c.min() < 0:
        raise ValueError("counts must be >= 0")
    return c


def _like_input(result: np.ndarray, original: Any, scalar: bool = False) -> Any:
    """Return ``result`` as a tensor on the input's device when the input was a tensor."""
    if isinstance(original, torch.Tensor):
        return torch.from_numpy(np.ascontiguousarray(result)).to(original.device)
    if scalar and np.ndim(result) == 0:
        return result[()]  # a numpy scalar rather than a 0-d array
    return result


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else 0.0


def _nan_reduce(fn, values: np.ndarray) -> float:
    """nanmean / nanmin that give nan (without a warning) when every value is nan."""
    values = np.asarray(values, dtype=np.float64)
    return float(fn(values)) if np.any(~np.isnan(values)) else float("nan")


def _pct(x: float) -> str:
    return f"{100.0 * x:.2f}%"


def _percent_label(q: float) -> str:
    return f"{100.0 * q:g}"
