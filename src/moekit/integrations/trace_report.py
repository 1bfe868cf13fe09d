"""What moekit's planners make of a routing trace — any trace file, recorded or synthetic.

``moekit trace report FILE`` prints three tables:

1. per layer: balancedness β (the RaMP paper's normalized entropy of the expert load; mean
   over steps), the share of experts that receive a token (mean, min, max over steps),
   and the mean per-peer count on P ranks;
2. the Cap-and-Spill quantile table (the Cap-and-Spill paper's Table 2 without the
   timings): for each quantile q, the per-peer capacity C = ceil(Q_q) of the trace's
   per-peer counts on P ranks, the spill capacity S = T_max * K - C, the share of sends
   (one source rank in one (step, layer)) that overflow to some peer, the share of routed
   pairs that take the spill pass, and the mean spilled pairs of an overflowing send
   (``moekit.ep.capacity``);
3. EPLB against the padding-aware balancer (``moekit.tax.eplb``), per layer: placements
   fitted on the first half of the steps and evaluated on the second half (the steps are
   the batches), averaged over layers: straggler ratio of raw tokens R, of padded work P
   (kernel blocks of ``block_size`` rows), experts activated per GPU, and activated slots.
"""

from __future__ import annotations

import math

import numpy as np

from moekit.routing import RoutingTrace
from moekit.routing.stats import active_experts, balancedness, expert_counts

CAPSPILL_QUANTILES = (0.5, 0.9, 0.95, 0.99, 0.995, 1.0)
LAYER_COLUMNS = ["layer", "steps", "beta", "beta_min", "active_share", "active_min", "active_max", "peer_count_mean"]


def layer_table(trace: RoutingTrace, world_size: int) -> list[dict]:
    """Per-layer skew: β, share of experts active, mean per-peer count on ``world_size`` ranks."""
    from moekit.ep.capacity import trace_peer_counts

    loads = np.asarray(expert_counts(trace.topk_ids, trace.num_experts))  # [S, L, E]
    beta = np.asarray(balancedness(loads), dtype=np.float64)  # [S, L]
    active = np.asarray(active_experts(loads)) / trace.num_experts
    peers = trace_peer_counts(trace, world_size)  # [S, L, P, P]
    rows = []
    for layer in range(trace.num_layers):
        ran = loads[:, layer].sum(-1) > 0  # steps in which this layer routed something
        b, a = beta[ran, layer], active[ran, layer]
        rows.append(dict(layer=layer, steps=int(ran.sum()), beta=_mean(b), beta_min=_min(b),
                         active_share=_mean(a), active_min=_min(a), active_max=_max(a),
                         peer_count_mean=float(peers[ran, layer].mean()) if ran.any() else float("nan")))
    return rows


def capspill_table(trace: RoutingTrace, world_size: int, quantiles=CAPSPILL_QUANTILES) -> list[dict]:
    """Capacity, overflow and spill volume per quantile of the per-peer counts on ``world_size`` ranks."""
    from moekit.ep.capacity import calibrate_capacity, trace_peer_counts

    counts = trace_peer_counts(trace, world_size)
    rows = []
    for q in quantiles:
        cal = calibrate_capacity(trace, q, world_size)
        spilled = np.maximum(counts - cal.capacity, 0).sum(-1)  # [S, L, P]: pairs of a send that spill
        overflowing = spilled > 0
        rows.append(dict(quantile=f"Q{100 * q:g}", capacity=cal.capacity, spill_capacity=cal.spill_capacity,
                         overflow_send_pct=100 * cal.overflow_send_fraction,
                         overflow_count_pct=100 * cal.overflow_slice_fraction,
                         spill_pair_pct=100 * cal.overflow_token_fraction,
                         spilled_per_overflowing_send=float(spilled[overflowing].mean()) if overflowing.any() else 0.0,
                         buffer_padding_pct=100 * (1 - float(np.minimum(counts, cal.capacity).mean()) / cal.capacity)
                         if cal.capacity else float("nan")))
    return rows


def balancer_table(trace: RoutingTrace, num_gpus: int = 8, slots_per_gpu: int | None = None,
                   block_size: int = 64) -> dict:
    """EPLB vs padding-aware per layer (fit: first half of the steps, evaluate: second half), averaged.

    ``slots_per_gpu`` None: E / num_gpus plus a quarter more (at least one extra slot), as
    the balancer docs' 64-expert example (8 + 2 on 8 GPUs).
    """
    from moekit.tax.bbb import Placement
    from moekit.tax.eplb import eplb_placement, evaluate_placement, padding_aware_placement

    E = trace.num_experts
    if num_gpus < 1 or E % num_gpus:
        raise ValueError(f"num_gpus must divide num_experts={E}, got {num_gpus}")
    per_gpu = E // num_gpus
    slots_per_gpu = slots_per_gpu or per_gpu + max(1, per_gpu // 4)
    if trace.num_steps < 2:
        raise ValueError(f"the balancer comparison needs >= 2 steps (half to fit, half to evaluate), "
                         f"got {trace.num_steps}")
    loads = np.asarray(expert_counts(trace.topk_ids, E))  # [S, L, E]
    half = trace.num_steps // 2
    per_balancer: dict[str, list[dict]] = {}
    for layer in range(trace.num_layers):
        fit, held = loads[:half, layer], loads[half:, layer]
        fit, held = fit[fit.sum(-1) > 0], held[held.sum(-1) > 0]
        if not len(fit) or not len(held):
            continue
        eplb = eplb_placement(fit, num_gpus, slots_per_gpu, mode="global")
        placements = [Placement.contiguous(E, num_gpus), eplb,
                      eplb.with_split("block", block_size, name="eplb+block-split"),
                      padding_aware_placement(fit, num_gpus, slots_per_gpu, block_size)]
        for p in placements:
            row = evaluate_placement(p, held, block_size)
            per_balancer.setdefault(row["placement"], []).append(row)
    keys = ("straggler", "padded_straggler", "max_active_per_gpu", "activated_slots", "padding_overhead")
    rows = [dict(balancer=name, layers=len(rs), **{k: float(np.mean([r[k] for r in rs])) for k in keys})
            for name, rs in per_balancer.items()]
    return dict(num_gpus=num_gpus, slots_per_gpu=slots_per_gpu, block_size=block_size, fit_steps=half,
                eval_steps=trace.num_steps - half, rows=rows)


def trace_report(trace: RoutingTrace, world_size: int = 8, *, num_gpus: int | None = None,
                 slots_per_gpu: int | None = None, block_size: int = 64) -> dict:
    """All three tables of ``trace`` (see the module docstring) as one JSON-ready dict."""
    if not isinstance(trace, RoutingTrace):
        raise ValueError(f"trace must be a RoutingTrace, got {type(trace).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if trace.num_experts % world_size or trace.num_tokens % world_size:
        raise ValueError(f"world_size={world_size} must divide num_experts={trace.num_experts} and the trace's "
                         f"token rows ({trace.num_tokens})")
    return dict(name=trace.name, shape=dict(steps=trace.num_steps, layers=trace.num_layers, tokens=trace.num_tokens,
                                            top_k=trace.top_k, num_experts=trace.num_experts),
                world_size=world_size, metadata=trace.metadata, layers=layer_table(trace, world_size),
                capspill=capspill_table(trace, world_size),
                balancers=balancer_table(trace, num_gpus or world_size, slots_per_gpu, block_size)
                if trace.num_steps >= 2 else None)


def format_report(report: dict) -> str:
    from moekit.bench.report import format_table

    s, P, b = report["shape"], report["world_size"], report["balancers"]
    title = f"Routing trace {report['name']!r}" if report["name"] else "Routing trace"
    return "\n".join([
        f"{title}: {s['steps']} steps x {s['layers']} layers x {s['tokens']} token rows, "
        f"top-{s['top_k']} of {s['num_experts']} experts",
        "",
        f"Per layer (beta = normalized entropy of the expert load, 1 = uniform; active = share of experts with a "
        f"token in a step; per-peer count on P = {P}):",
        format_table(report["layers"], LAYER_COLUMNS, floatfmt=".3f"),
        "",
        f"Cap-and-Spill on P = {P} ranks (C = ceil(Q_q) of the per-peer counts, S = T_max * K - C; overflow = sends "
        "with some count > C; spill = routed pairs on the spill pass):",
        format_table(report["capspill"], ["quantile", "capacity", "spill_capacity", "overflow_send_pct",
                                          "overflow_count_pct", "spill_pair_pct", "spilled_per_overflowing_send",
                                          "buffer_padding_pct"], floatfmt=".2f"),
        "",
        *(["Balancers: not compared (the trace has one step; they need one half to fit, one to evaluate)"]
          if b is None else [
            f"Balancers on {b['num_gpus']} GPUs x {b['slots_per_gpu']} slots, kernel blocks of {b['block_size']} "
            f"rows; fitted on {b['fit_steps']} steps, evaluated on {b['eval_steps']}, mean over layers "
            "(straggler = slowest GPU / mean, in tokens R and padded rows P):",
            format_table(b["rows"], ["balancer", "layers", "straggler", "padded_straggler", "max_active_per_gpu",
                                     "activated_slots", "padding_overhead"], floatfmt=".3f")]),
    ])


def _mean(a) -> float:
    return float(np.mean(a)) if len(a) else math.nan


def _min(a) -> float:
    return float(np.min(a)) if len(a) else math.nan


def _max(a) -> float:
    return float(np.max(a)) if len(a) else math.nan
