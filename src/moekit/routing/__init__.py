"""Routing: synthetic routing with a chosen skew, recorded traces, and their statistics.

* :func:`synthetic_routing` — random top-k routing with a target balancedness or Zipf skew;
* :func:`mixtral_capspill_trace` — a trace with the per-peer statistics of the
  Cap-and-Spill paper's Mixtral-8x7B measurements;
* :class:`RoutingTrace` — ``topk_ids[steps, layers, tokens, K]`` with a safe ``.npz`` format;
* :class:`RoutingRecorder` — records a real model's routers into a trace;
* :func:`expert_counts`, :func:`peer_counts`, :func:`peer_token_counts`, :func:`balancedness`, :func:`active_experts`,
  :func:`trace_stats`, :func:`format_stats` — loads, per-peer counts, skew and overflow.
"""

from .generate import mixtral_capspill_trace, synthetic_routing
from .recorder import RoutingRecorder
from .stats import (
    DEFAULT_QUANTILES,
    TraceStats,
    active_experts,
    balancedness,
    expert_counts,
    format_stats,
    peer_counts,
    peer_token_counts,
    trace_stats,
)
from .trace import FORMAT_VERSION, RoutingTrace

__all__ = [
    "DEFAULT_QUANTILES",
    "FORMAT_VERSION",
    "RoutingRecorder",
    "RoutingTrace",
    "TraceStats",
    "active_experts",
    "balancedness",
    "expert_counts",
    "format_stats",
    "mixtral_capspill_trace",
    "peer_counts",
    "peer_token_counts",
    "synthetic_routing",
    "trace_stats",
]
