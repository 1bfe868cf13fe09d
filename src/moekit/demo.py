"""`moekit demo`: the distributed MoE layer on local ranks, checked against the reference.

Spawns ``world_size`` ranks (gloo on CPU; NCCL when there are enough GPUs), runs a
scaled-down Mixtral-like MoE layer on synthetic routing for a few steps, and reports the
routing, the traffic each rank sent and received, the time per step beside a bare
``all_to_all_single`` of the same bytes in the same run (the floor of the layer's exchanges),
and two checks:

1. exactness: dispatch -> identity experts -> combine equals ``sum_k w_k * x`` bitwise;
2. accuracy: the layer's output against the float64 single-process reference.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist

from moekit.ep import current_device, default_backend, launch
from moekit.moe import MoELayer, MoEWeights, reference_moe, reference_slot_sum
from moekit.routing import active_experts, balancedness, expert_counts, peer_counts, synthetic_routing
from moekit.shapes import MoEShape, get_shape

# The layer runs in float32 here; see tests/moe/test_layer.py for why 1e-5 is the bound.
REL_TOL = 1e-5
FLOOR_REPEATS = 10  # bare all-to-alls timed for the floor


@dataclass(frozen=True)
class DemoConfig:
    world_size: int = 4
    tokens_per_rank: int = 128
    steps: int = 5
    beta: float = 0.9
    seed: int = 0
    hidden: int = 256
    intermediate: int = 512

    @property
    def shape(self) -> MoEShape:
        return get_shape("mixtral-8x7b").scaled(
            name="mixtral-8x7b (scaled down)", hidden=self.hidden, intermediate=self.intermediate, num_layers=1)


def step_routing(cfg: DemoConfig, step: int):
    """The routing of all ranks' tokens at one step (rank-major), the same in every process."""
    s = cfg.shape
    return synthetic_routing(cfg.world_size * cfg.tokens_per_rank, s.num_experts, s.top_k,
                             beta=cfg.beta, seed=cfg.seed * 1000 + step)


def _demo_rank(rank: int, world_size: int, cfg: DemoConfig, progress: str | None = None) -> dict:
    device, shape, T = current_device(), cfg.shape, cfg.tokens_per_rank
    weights = MoEWeights.random(shape, seed=cfg.seed).to(device=device)
    weights64 = weights.to(dtype=torch.float64, device="cpu")
    layer = MoELayer(shape, weights, rank=rank, world_size=world_size)
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + rank)
    out = dict(rank=rank, step_ms=[], rel_err=[], roundtrip_exact=[], sent=[], received=[])
    for step in range(cfg.steps):
        all_ids, all_w = step_routing(cfg, step)
        ids, w = all_ids[rank * T:(rank + 1) * T].to(device), all_w[rank * T:(rank + 1) * T].to(device)
        x = torch.randn(T, shape.hidden, generator=gen).to(device)

        _barrier()
        t0 = time.perf_counter()
        y = layer(x, ids, w)
        _sync(device)
        out["step_ms"].append((time.perf_counter() - t0) * 1e3)

        ref = reference_moe(x.cpu(), weights64, ids.cpu(), w.cpu())
        out["rel_err"].append(((y.cpu().double() - ref).norm() / ref.norm()).item())

        dispatched = layer.dispatcher.dispatch(x, ids, w)
        roundtrip = layer.dispatcher.combine(dispatched.tokens, dispatched)  # identity experts
        want = reference_slot_sum(x.cpu().unsqueeze(1).expand(T, shape.top_k, shape.hidden), ids.cpu(), w.cpu(), x.dtype)
        out["roundtrip_exact"].append(bool(torch.equal(roundtrip.cpu(), want)))
        out["sent"].append(dispatched.handle.state["send_splits"])
        out["received"].append(dispatched.handle.state["recv_splits"])
        if progress and rank == 0:  # the ranks are other processes: rank 0 tells the user as each step ends
            print(f"  step {step + 1}/{cfg.steps}: {out['step_ms'][-1]:.2f} ms on rank 0, relative error "
                  f"{out['rel_err'][-1]:.2e}, round trip bitwise: {'yes' if out['roundtrip_exact'][-1] else 'NO'}",
                  file=getattr(sys, progress), flush=True)
    out["floor_ms"] = bare_exchange_ms(out["sent"][0], out["received"][0], shape.hidden, x.dtype, device)
    out["device"] = str(device)
    return out


def bare_exchange_ms(sent: list[int], received: list[int], hidden: int, dtype: torch.dtype,
                     device: torch.device, repeats: int = FLOOR_REPEATS) -> list[float]:
    """The floor of a step's exchanges: ms per repeat of a bare ``all_to_all_single`` of the
    step's rows out (``sent[d]`` rows of ``hidden`` to rank d, ``received[s]`` from rank s) and
    back, ranks aligned before each repeat, after two untimed ones; [] without a process group."""
    if not dist.is_initialized():
        return []
    rows_out = torch.randn(sum(sent), hidden).to(device=device, dtype=dtype)
    rows_in = torch.empty(sum(received), hidden, dtype=dtype, device=device)
    times = []
    for i in range(repeats + 2):
        _barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(rows_in, rows_out, received, sent)  # dispatch's direction
        dist.all_to_all_single(rows_out, rows_in, sent, received)  # combine's
        _sync(device)
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_demo(cfg: DemoConfig, progress: str | None = None) -> dict:
    """Run the demo and return its report as a dict (what ``--json`` prints).

    ``progress``: ``"stdout"`` or ``"stderr"`` to print the header (:func:`format_header`) at once and a
    line per step as rank 0 finishes it (spawning the ranks and the steps take seconds each on a CPU);
    None for silence."""
    if progress not in (None, "stdout", "stderr"):
        raise ValueError(f"progress must be None, 'stdout' or 'stderr', got {progress!r}")
    for name, value in (("world_size", cfg.world_size), ("tokens_per_rank", cfg.tokens_per_rank),
                        ("steps", cfg.steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    cfg.shape.experts_per_rank(cfg.world_size)  # raises when P does not divide E
    step_routing(cfg, 0)  # bad routing parameters (beta) raise here, not inside the ranks
    backend = default_backend(cfg.world_size)
    if progress:
        stream = getattr(sys, progress)
        devices = ["cpu"] if backend == "gloo" else [f"cuda:{r}" for r in range(cfg.world_size)]
        print("\n".join(format_header(asdict(cfg), asdict(cfg.shape), backend, devices)), file=stream)
        print(f"  starting {cfg.world_size} ranks ...", file=stream, flush=True)
    ranks = launch(_demo_rank, cfg.world_size, cfg, progress, backend=backend)
    s, P = cfg.shape, cfg.world_size
    all_ids = torch.stack([step_routing(cfg, step)[0] for step in range(cfg.steps)])  # [steps, P*T, K]
    counts = expert_counts(all_ids, s.num_experts)  # [steps, E]
    peers = peer_counts(all_ids, s.num_experts, P)  # [steps, P, P]
    step_ms = np.max([r["step_ms"] for r in ranks], axis=0)  # a step ends when its slowest rank does
    floor_ms = np.max([r["floor_ms"] for r in ranks], axis=0) if ranks[0]["floor_ms"] else None
    max_err = max(max(r["rel_err"]) for r in ranks)
    exact = all(all(r["roundtrip_exact"]) for r in ranks)
    return {
        "config": asdict(cfg) | {"shape": asdict(s)},
        "backend": backend,
        "devices": sorted({r["device"] for r in ranks}),
        "routing": {
            "target_balancedness": cfg.beta,
            "balancedness_per_step": [float(balancedness(c)) for c in counts],
            "active_experts_per_step": [int(active_experts(c)) for c in counts],
            "tokens_per_expert_total": np.asarray(counts.sum(0)).tolist(),
            "peer_counts_step0": np.asarray(peers[0]).tolist(),
        },
        "ranks": [
            {"rank": r["rank"], "tokens": cfg.tokens_per_rank, "rows_sent_per_dest": r["sent"][0],
             "rows_received_per_src": r["received"][0]}
            for r in ranks
        ],
        "time_per_step_ms": {"median": float(np.median(step_ms)), "min": float(step_ms.min()),
                             "all": step_ms.tolist()},
        "bare_all_to_all_ms": None if floor_ms is None else {
            "median": float(np.median(floor_ms)), "min": float(floor_ms.min()), "all": floor_ms.tolist(),
            "what": "all_to_all_single of step 0's rows out and back, slowest rank"},
        "checks": {
            "roundtrip_bitwise": exact,
            "max_rel_err_vs_float64": max_err,
            "rel_err_tolerance": REL_TOL,
            "passed": exact and max_err < REL_TOL,
        },
    }


def format_header(cfg: dict, shape: dict, backend: str, devices: list[str]) -> list[str]:
    """The report's first lines: what runs where (``cfg``, ``shape``: the config and its shape as dicts)."""
    P, E = cfg["world_size"], shape["num_experts"]
    return [
        f"moekit demo: one expert-parallel MoE layer on {P} local ranks ({backend}, {', '.join(devices)})",
        f"  shape   {shape['name']}: {E} experts, top-{shape['top_k']}, hidden {shape['hidden']}, "
        f"expert width {shape['intermediate']} -> {E // P} experts per rank",
        f"  batch   {cfg['tokens_per_rank']} tokens per rank, {cfg['steps']} steps, synthetic routing "
        f"(target balancedness {cfg['beta']:.2f}; 1.00 = perfectly even)",
    ]


def format_demo(report: dict, header: bool = True) -> str:
    """The human-readable report; ``header=False`` leaves out :func:`format_header`'s lines (printed already
    by ``run_demo(..., progress=...)``)."""
    cfg, s, r = report["config"], report["config"]["shape"], report["routing"]
    E = s["num_experts"]
    lines = format_header(cfg, s, report["backend"], report["devices"]) if header else []
    lines += [
        "",
        "Routing (all ranks' tokens)",
        f"  balancedness per step   {' '.join(f'{b:.3f}' for b in r['balancedness_per_step'])}",
        f"  experts active per step {' '.join(str(a) for a in r['active_experts_per_step'])} of {E}",
        f"  (token, expert) pairs per expert over all steps: {r['tokens_per_expert_total']}",
        "  pairs sent from rank i (rows) to rank j (columns), step 0:",
    ]
    lines += ["    " + " ".join(f"{c:5d}" for c in row) for row in r["peer_counts_step0"]]
    lines += ["", "Traffic per rank, step 0 (one row per (token, expert) pair)",
              f"  {'rank':>4}  {'tokens':>6}  {'rows sent to each rank':<28}  rows received from each rank"]
    for rk in report["ranks"]:
        lines.append(f"  {rk['rank']:>4}  {rk['tokens']:>6}  {str(rk['rows_sent_per_dest']):<28}  "
                     f"{rk['rows_received_per_src']}")
    t, c, floor = report["time_per_step_ms"], report["checks"], report.get("bare_all_to_all_ms")
    lines += [
        "",
        f"Time per step (router given; dispatch + experts + combine, slowest rank): "
        f"median {t['median']:.2f} ms, best {t['min']:.2f} ms",
    ]
    if floor:
        lines.append(f"  the floor, a bare all-to-all of the same rows out and back ({report['backend']}): median "
                     f"{floor['median']:.2f} ms; the step takes {t['median'] / floor['median']:.1f}x that")
    lines += [
        "",
        "Checks",
        f"  dispatch -> identity experts -> combine == sum_k w_k * x, bitwise (torch.equal): "
        f"{'PASS' if c['roundtrip_bitwise'] else 'FAIL'}",
        f"  layer output vs float64 single-process reference: max relative error "
        f"{c['max_rel_err_vs_float64']:.2e} (tolerance {c['rel_err_tolerance']:.0e}): "
        f"{'PASS' if c['max_rel_err_vs_float64'] < c['rel_err_tolerance'] else 'FAIL'}",
        "",
        f"Verdict: {'PASS' if c['passed'] else 'FAIL'}",
    ]
    return "\n".join(lines)


def demo_json(report: dict) -> str:
    return json.dumps(report, indent=2)
