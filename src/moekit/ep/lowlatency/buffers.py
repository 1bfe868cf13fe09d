"""How much memory the low-latency layer holds per rank, worst case against a bounded
receive buffer, and how often a bounded buffer spills on a routing trace.

Every byte count comes from :meth:`LowLatencyLayout.buffer_bytes` — the same segment sizes
the gloo transport allocates — so the report is the layout's, not a separate formula. The
capacity is calibrated on the first half of a trace's steps (``calibrate_capacity`` with
``count="tokens"``) and the overflow measured on the second half, so the share reported is
out of sample.

Used by ``moekit bench lowlatency --buffers``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moekit.ep.capacity import calibrate_capacity, trace_peer_counts
from moekit.ep.lowlatency.layout import LowLatencyLayout
from moekit.routing import RoutingTrace, synthetic_routing
from moekit.shapes import get_shape

DEFAULT_EPS = (2, 8, 16, 32, 64)
DEFAULT_SHAPES = ("deepseek-v3", "qwen3-30b-a3b")
# Balancedness of the synthetic routing: that of the recorded OLMoE-architecture prefill
# trace (benchmarks/traces/olmoe-stdlib.npz, median over its (step, layer) observations).
DEFAULT_BETA = 0.87


@dataclass(frozen=True)
class Spill:
    """What a bounded buffer of ``capacity`` rows per source (``spill_rows`` per spill
    round) does on per-(source, destination) token counts ``[..., P, P]``.

    ``token_fraction``: of token copies, those past the capacity (carried by spill rounds);
    ``pair_fraction``: of (source, destination) counts, those over it; ``step_fraction``: of
    steps (one layer of one step: every pair together), those with at least one spill round;
    ``mean_rounds`` / ``max_rounds``: spill rounds per step.
    """

    capacity: int
    spill_rows: int
    token_fraction: float
    pair_fraction: float
    step_fraction: float
    mean_rounds: float
    max_rounds: int


def spill_stats(counts: np.ndarray, capacity: int, spill_rows: int) -> Spill:
    """:class:`Spill` of ``counts [steps, layers, P, P]`` (or any ``[..., P, P]``)."""
    counts = np.asarray(counts)
    over = np.maximum(counts - capacity, 0)
    per_step = over.reshape(-1, counts.shape[-2] * counts.shape[-1]).max(axis=1)
    rounds = -(-per_step // max(spill_rows, 1))
    total = counts.sum()
    return Spill(capacity=capacity, spill_rows=spill_rows,
                 token_fraction=float(over.sum() / total) if total else 0.0,
                 pair_fraction=float((over > 0).mean()) if over.size else 0.0,
                 step_fraction=float((per_step > 0).mean()) if per_step.size else 0.0,
                 mean_rounds=float(rounds.mean()) if rounds.size else 0.0,
                 max_rounds=int(rounds.max()) if rounds.size else 0)


def layout_for(shape: str, world_size: int, max_m: int, *, recv_capacity: int | None = None,
               spill_rows: int | None = None, combine_order: str = "slot", online_fp8: bool = True,
               hidden: int | None = None) -> LowLatencyLayout:
    """Rank 0's layout of a layer at a preset's sizes (bf16 activations)."""
    s = get_shape(shape)
    return LowLatencyLayout(max_m=max_m, hidden=hidden or s.hidden, topk=s.top_k, num_experts=s.num_experts, rank=0,
                            world_size=world_size, local_world_size=world_size, dtype=torch.bfloat16,
                            online_fp8=online_fp8, combine_order=combine_order,
                            recv_capacity=None if recv_capacity is None or recv_capacity >= max_m else recv_capacity,
                            spill_rows=spill_rows if recv_capacity is not None and recv_capacity < max_m else None)


def synthetic_trace(shape: str, world_size: int, max_m: int, steps: int, *, beta: float = DEFAULT_BETA,
                    seed: int = 0) -> RoutingTrace:
    """``steps`` routings of ``world_size * max_m`` tokens at the preset's E and K, each drawn
    with its own seed (a new popularity order every step), balancedness ``beta``."""
    s = get_shape(shape)
    T = world_size * max_m
    ids = np.stack([synthetic_routing(T, s.num_experts, s.top_k, beta=beta, seed=seed * 100_003 + i,
                                      weights=False)[0].numpy() for i in range(steps)])
    return RoutingTrace(ids[:, None], num_experts=s.num_experts, name=f"synthetic {shape} beta={beta}")


def calibrated_row(trace: RoutingTrace, world_size: int, quantile: float, *, shape: str,
                   spill_rows: int | None = None, combine_order: str = "slot") -> dict:
    """One row of the report: capacity from the first half of ``trace``'s steps, spill on
    the second half, and the layout's bytes worst case and bounded at ``shape``'s H
    (``max_m`` = the trace's tokens per rank). Where the capacity plus one spill round
    (``spill_rows``, default a quarter of it) would reach ``max_m`` the buffer is left at
    ``max_m``: bounding it would not save memory."""
    if trace.num_steps < 2:
        raise ValueError(f"trace needs at least 2 steps (calibrate on half, measure on the other), got "
                         f"{trace.num_steps}")
    half = trace.num_steps // 2
    first = RoutingTrace(trace.topk_ids[:half], num_experts=trace.num_experts)
    cal = calibrate_capacity(first, quantile, world_size, count="tokens")
    max_m = trace.num_tokens // world_size
    capacity = max(1, min(cal.capacity, max_m))
    spill = spill_rows if spill_rows is not None else -(-capacity // 4)
    if capacity + spill >= max_m:  # the receive buffer plus a spill round would not be smaller: keep max_m
        capacity = max_m
    worst = layout_for(shape, world_size, max_m, combine_order=combine_order)
    bounded = layout_for(shape, world_size, max_m, recv_capacity=capacity, spill_rows=spill_rows,
                         combine_order=combine_order)
    counts = trace_peer_counts(RoutingTrace(trace.topk_ids[half:], num_experts=trace.num_experts), world_size,
                               "tokens")
    spill = spill_stats(counts, bounded.recv_rows, bounded.spill_rows_per_round or 1)
    return dict(world_size=world_size, max_m=max_m, quantile=quantile, capacity=bounded.recv_rows,
                spill_rows=bounded.spill_rows_per_round, max_spill_rounds=bounded.max_spill_rounds,
                mean_count=float(counts.mean()), max_count=int(counts.max()),
                worst=worst.buffer_bytes(), bounded=bounded.buffer_bytes(), spill=spill.__dict__)


def shape_report(shape: str, *, eps=DEFAULT_EPS, max_m: int = 128, quantile: float = 0.99, steps: int = 16,
                 beta: float = DEFAULT_BETA, seed: int = 0, progress=None) -> list[dict]:
    """Rows for one preset at each EP size, on synthetic routing of ``max_m`` tokens per rank."""
    s = get_shape(shape)
    rows = []
    for P in eps:
        if s.num_experts % P:
            continue
        if progress:
            progress(f"{shape} EP {P}: {steps} synthetic steps of {P * max_m} tokens")
        trace = synthetic_trace(shape, P, max_m, steps, beta=beta, seed=seed)
        rows.append(dict(source=f"synthetic (beta={beta})", shape=shape,
                         **calibrated_row(trace, P, quantile, shape=shape)))
    return rows


def trace_report(trace: RoutingTrace, label: str, shape: str, *, eps=DEFAULT_EPS, quantile: float = 0.99,
                 progress=None) -> list[dict]:
    """Rows for a recorded or generated trace at each EP size its experts and tokens allow."""
    rows = []
    for P in eps:
        if trace.num_experts % P or trace.num_tokens % P:
            continue
        if progress:
            progress(f"{label} EP {P}")
        rows.append(dict(source=label, shape=shape, **calibrated_row(trace, P, quantile, shape=shape)))
    return rows


def format_report(rows: list[dict]) -> str:
    """One line per row: MB per rank of the receive regions (dispatch, double-buffered) worst
    case and bounded, the whole layer (result and expert output included) both ways, and
    the spill on the held-out half."""
    head = (f"{'source':<34} {'shape':<14} {'EP':>3} {'max_m':>5} {'C':>4} {'S':>3} {'recv MB':>9} {'bounded':>8} "
            f"{'saved':>6} {'layer MB':>9} {'bounded':>8} {'spilled':>8} {'steps':>6} {'rounds':>6}")
    lines = [head]
    for r in rows:
        w, b, sp = r["worst"], r["bounded"], r["spill"]
        saved = 1 - b["receive"] / w["receive"] if w["receive"] else 0.0
        lines.append(
            f"{r['source']:<34} {r['shape']:<14} {r['world_size']:>3} {r['max_m']:>5} {r['capacity']:>4} "
            f"{r['spill_rows']:>3} {w['receive'] / 1e6:>9.2f} {b['receive'] / 1e6:>8.2f} {saved:>6.0%} "
            f"{w['total'] / 1e6:>9.1f} {b['total'] / 1e6:>8.1f} {sp['token_fraction']:>8.2%} "
            f"{sp['step_fraction']:>6.1%} {sp['max_rounds']:>6}")
    lines.append("recv MB: the dispatch receive regions per rank (two phases: tokens, scales, routing rows; spill "
                 "rows when bounded); layer MB: those + the combine region + the expert-major result + the expert "
                 "output; spilled: token copies past C (second half of the trace, C from the first half); steps: "
                 "steps with a spill round; rounds: the most in one step")
    return "\n".join(lines)
