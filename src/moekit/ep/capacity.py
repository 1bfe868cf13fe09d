"""Buffer sizes of the fixed-buffer dispatchers, and capacity calibration from a routing trace.

Names (docs/architecture.md): P ranks, T_max the most tokens a rank dispatches per call, K top-k,
E_local experts per rank. A *pair* is one (token, slot) of a rank with an expert; the
*per-peer count* c[i, j] is the number of pairs rank i sends to rank j in one call.

Bounds used by :mod:`moekit.ep.capspill` (they hold for every routing the Dispatcher
contract allows, which does not forbid a token from naming the same expert in two slots):

* one rank has at most ``T_max * K`` pairs, so ``c[i, j] <= T_max * K``
  (:func:`pair_bound`; reached when every pair of rank i goes to rank j);
* with a first-pass capacity C, the overflow of one peer pair is ``max(c[i, j] - C, 0)
  <= max(T_max * K - C, 0)`` — the spill capacity S (:func:`spill_capacity`). It is also
  the bound on all of rank i's overflow together, ``sum_j max(c[i, j] - C, 0)``: moving
  pairs to a second overflowing peer spends another C of them on that peer's first pass;
* one local expert receives at most ``min(per-pair capacity, T_max * K)`` rows from each
  of the P sources (:func:`expert_capacity`), the fixed row count of ``Dispatched.tokens``.

Calibration reads the per-peer counts of a :class:`~moekit.routing.RoutingTrace` on P
ranks (tokens rank-major, experts contiguous: :func:`moekit.routing.peer_counts`) and picks
C as a quantile of them, as the Cap-and-Spill paper does (C = Q99); MaxCounts takes their
maximum. ``count="tokens"`` counts tokens instead of pairs, one per (token, destination
rank) (:func:`moekit.routing.peer_token_counts`): the rows of the low-latency layer's
bounded receive buffer (``EPLowLatencyAllToAll(recv_capacity=C)``), which sends a token
once to each rank holding one of its experts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from moekit.ep.checks import check_int
from moekit.routing.stats import peer_counts, peer_token_counts

COUNTS = ("pairs", "tokens")  # what a per-peer count counts
from moekit.routing.trace import RoutingTrace


def pair_bound(max_tokens: int, top_k: int) -> int:
    """Most pairs one rank can send to one peer in a call: ``T_max * K``."""
    return check_int("max_tokens", max_tokens, 0) * check_int("top_k", top_k, 1)


def spill_capacity(max_tokens: int, top_k: int, capacity: int) -> int:
    """Rows per peer of the spill pass: ``S = max(T_max * K - C, 0)``, the exact bound.

    Exact: no routing overflows a pair by more, and routing all ``T_max * K`` pairs of a
    rank to one peer overflows it by exactly S.
    """
    return max(pair_bound(max_tokens, top_k) - check_int("capacity", capacity, 0), 0)


def expert_capacity(world_size: int, max_tokens: int, top_k: int, pair_capacity: int) -> int:
    """Rows per local expert of a fixed-shape dispatch result: ``P * min(pair_capacity, T_max * K)``.

    ``pair_capacity`` is how many rows one peer pair can deliver (C_max for MaxCounts,
    C + S for Cap-and-Spill). All rows a source sends one expert belong to one pair, so
    no expert receives more; the bound is reached when every rank sends all its pairs to
    the same expert.
    """
    world_size = check_int("world_size", world_size, 1)
    return world_size * min(check_int("pair_capacity", pair_capacity, 0), pair_bound(max_tokens, top_k))


@dataclass(frozen=True)
class CapacityCalibration:
    """A per-peer capacity C chosen from a trace, and what it implies on that trace.

    ``capacity`` = ceil(quantile ``quantile`` of the per-peer counts) (numpy's linear
    interpolation; the same definition as :func:`moekit.routing.trace_stats`). The
    overflow figures say how often a count exceeds C:

    * ``overflow_send_fraction``: of sends — one source rank in one (step, layer) — that
      overflow to at least one peer. This is the Cap-and-Spill paper's "overflow (%)" (5.4% at Q99 on its
      8-rank Mixtral traces, which ``mixtral_capspill_trace`` reproduces);
    * ``overflow_slice_fraction``: of per-peer counts c[i, j] > C;
    * ``overflow_token_fraction``: of routed pairs that do not fit in the first pass,
      ``sum(max(c - C, 0)) / sum(c)`` — the share of the traffic the spill pass carries.

    ``count``: ``"pairs"`` ((token, slot) pairs per peer, the fixed-buffer dispatchers') or
    ``"tokens"`` (tokens per destination rank, the low-latency layer's); with tokens the
    fractions above are of token copies instead of pairs.
    """

    capacity: int
    quantile: float
    world_size: int
    max_tokens: int  # T_max = trace rows per rank
    top_k: int
    max_count: int  # the trace's largest per-peer count (MaxCounts' C_max)
    mean_count: float
    num_observations: int
    overflow_send_fraction: float
    overflow_slice_fraction: float
    overflow_token_fraction: float
    count: str = "pairs"

    @property
    def spill_capacity(self) -> int:
        """S for this C on this trace's shapes (see :func:`spill_capacity`)."""
        return spill_capacity(self.max_tokens, self.top_k, self.capacity)

    def to_dict(self) -> dict:
        return asdict(self) | {"spill_capacity": self.spill_capacity}


def trace_peer_counts(trace: RoutingTrace, world_size: int, count: str = "pairs") -> np.ndarray:
    """Per-peer counts ``[steps, layers, P, P]`` of ``trace`` on ``world_size`` ranks, of
    (token, slot) pairs or (``count="tokens"``) of tokens per destination rank."""
    if not isinstance(trace, RoutingTrace):
        raise ValueError(f"trace must be a RoutingTrace, got {type(trace).__name__}")
    if count not in COUNTS:
        raise ValueError(f"count must be one of {list(COUNTS)}, got {count!r}")
    counter = peer_counts if count == "pairs" else peer_token_counts
    return np.asarray(counter(trace.topk_ids, trace.num_experts, check_int("world_size", world_size, 1)))


def calibrate_capacity(trace: RoutingTrace, quantile: float, world_size: int, *,
                       count: str = "pairs") -> CapacityCalibration:
    """C = ceil(Q_quantile) of the trace's per-peer counts on ``world_size`` ranks, with its overflow.

    ``quantile`` is in [0, 1]; 1.0 gives the maximum, i.e. MaxCounts' C_max (never
    overflows on this trace). ``count``: ``"pairs"`` (the fixed-buffer dispatchers) or
    ``"tokens"`` (the low-latency layer's ``recv_capacity``). Raises ValueError for an empty
    trace, a quantile outside [0, 1], an unknown ``count``, or a world size that does not
    divide the experts or the trace's token rows.
    """
    if isinstance(quantile, bool) or not isinstance(quantile, (int, float, np.floating)) \
            or not 0.0 <= float(quantile) <= 1.0:
        raise ValueError(f"quantile must be a number in [0, 1], got {quantile!r}")
    counts = trace_peer_counts(trace, world_size, count)
    if counts.size == 0:
        raise ValueError(f"trace has no (step, layer) observations: {trace!r}")
    flat = counts.reshape(-1)
    capacity = int(math.ceil(float(np.quantile(flat, float(quantile)))))
    return _calibration(counts, capacity, float(quantile), world_size, trace, count)


def max_counts_capacity(trace: RoutingTrace, world_size: int) -> CapacityCalibration:
    """MaxCounts' C_max: the largest per-peer count of the trace (quantile 1.0)."""
    return calibrate_capacity(trace, 1.0, world_size)


def overflow_fractions(counts: np.ndarray, capacity: int) -> dict[str, float]:
    """The three overflow figures of :class:`CapacityCalibration` for counts ``[..., P, P]``."""
    counts = np.asarray(counts)
    if counts.size == 0:
        return dict.fromkeys(("overflow_send_fraction", "overflow_slice_fraction", "overflow_token_fraction"), 0.0)
    over = counts > capacity
    total = counts.sum()
    spilled = np.maximum(counts - capacity, 0).sum()
    return {
        "overflow_send_fraction": float(over.any(axis=-1).mean()),
        "overflow_slice_fraction": float(over.mean()),
        "overflow_token_fraction": float(spilled / total) if total else 0.0,
    }


def _calibration(counts: np.ndarray, capacity: int, quantile: float, world_size: int,
                 trace: RoutingTrace, count: str = "pairs") -> CapacityCalibration:
    flat = counts.reshape(-1)
    return CapacityCalibration(
        capacity=capacity,
        quantile=quantile,
        world_size=world_size,
        max_tokens=trace.num_tokens // world_size,
        top_k=trace.top_k,
        max_count=int(flat.max()),
        mean_count=float(flat.mean()),
        num_observations=int(flat.size),
        **overflow_fractions(counts, capacity),
        count=count,
    )
