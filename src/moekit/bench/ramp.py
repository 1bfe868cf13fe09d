"""`moekit bench ramp`: RaMP's evaluation on points that were not used for fitting.

For one shape, precision and kernel family on this GPU:

1. (``--profile``) profile the shape first, in this process (``moekit.bench.ramp_profile``), so the
   evaluation reuses its compiled and loaded kernels; else use ``--model`` (a model file, or
   the one ``moekit.ramp`` finds for this GPU);
2. time *every* configuration of the model (and ``default_config``, and the fallback's
   templates) at the evaluation points -- token counts between and beyond the profiling grid
   (:data:`EVAL_M`), balancedness levels not in it, Zipf routing -- with the profiling's timing
   (``ConfigTimer``: CUDA-graph replays after an L2 flush, median of ``--iters``) and the torch
   baseline, so the best measured configuration at each point (exhaustive search) is known;
3. compare, at every point: the routing-aware choice (the selector, on the device, from the
   point's ``topk_ids``), static dispatch (the best measured config at beta = 1 for that token
   count: what batch-keyed tuners produce), ``default_config`` and the fallback;
4. measure the selector's own cost (µs per step and amortized per layer) and the CUDA-graph
   path (``moekit.ramp.graphs``: conditional, masked and static graphs at decode sizes);
5. write the record (device, versions, commit, every number), the evaluation timings, the
   tables (the paper's Tables IV and V side by side with ours, the ablation) and a figure.

``--from-timings EVAL.json.gz --profile-timings PROFILE.json.gz`` redoes steps 3 and 5 on any
machine from saved timings (no GPU).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from moekit.outputs import DEFAULT_OUT_DIR, check_output_dir
from moekit.bench.ramp_profile import DEFAULT_CAPACITY, PointSpec

EVAL_M = (4, 32, 128, 512, 16, 256, 4096)  # between / beyond the profiling grid (16, 256: beta only)
EVAL_BETAS = (1.0, 0.9, 0.75, 0.6, 0.45)
EVAL_ZIPF = (1.2,)
SKEWED = 0.8  # Table V's points: realized beta <= this
GRAPH_M = (4, 16, 32)
GRAPH_SECTION_S = 40.0  # what the graph section needs at most (3 token counts x 3 modes x 4 routings)
FALLBACK_SHAPE_S = 45.0  # one fallback shape: a small compile pool and a few configs x its points
SELECTOR_S = 10.0

# The RaMP paper's numbers (H200, FP8, its CuTe kernel), as far as our copy of the text kept them.
PAPER_TABLE_IV = {  # model: (E, 2N, H, max regret %); the mean column was lost (overall mean 0.93 %)
    "OLMoE": (64, 2048, 2048, 8.2), "Qwen3": (128, 1536, 2048, 10.2), "Mixtral": (8, 32768, 6144, 2.0),
    "DSv3-EP8": (32, 512, 7168, 1.5), "DSv3-TP8": (256, 512, 7168, 1.4),
}
PAPER_OVERALL = {"mean_regret_pct": 0.93, "max_regret_pct": 10.2, "speedup_vs_static_geomean": 1.22}
PAPER_TABLE_V = [  # (model, T, static µs, RA µs, routing)
    ("DSv3-TP8", 64, 244, 143, "mean real"), ("DSv3-TP8", 128, 277, 198, "mean real"),
    ("DSv3-TP8", 32, 155, 116, "mean real"), ("DSv3-TP8", 16, 91, 72, "mean real"),
    ("DSv3-TP8", 256, 315, 248, "mean real"), ("OLMoE", 64, 127, 107, "mean real"),
    ("OLMoE", 16, 65, 55, "mean real"),
    ("DSv3-TP8", 64, 398, 369, "75th pct"), ("DSv3-TP8", 256, 406, 379, "75th pct"),
    ("OLMoE", 32, 116, 109, "75th pct"),
]
PAPER_ABLATION = {"2-param": (8.1, 42.3), "3-param": (4.0, 37.5), "4-param": (0.93, 10.2)}
PAPER_NAME = {"olmoe-1b-7b": "OLMoE", "qwen3-30b-a3b": "Qwen3", "mixtral-8x7b": "Mixtral",
              "deepseek-v3-ep32": "DSv3-EP8", "deepseek-v3-tp8": "DSv3-TP8"}


def eval_points(m_values=EVAL_M, betas=EVAL_BETAS, zipf=EVAL_ZIPF, seed: int = 0) -> list[PointSpec]:
    """The evaluation's points; their seeds differ from the profiling's (``seed + 7919 + M``)."""
    pts = []
    for M in m_values:
        s = seed + 7919 + M
        pts += [PointSpec(M, b, None, s, "eval") for b in betas]
        pts += [PointSpec(M, None, z, s, "eval-zipf") for z in zipf]
    return pts


def trace_points(path: str, routed: int, top_k: int, m_values=EVAL_M, samples: int = 2) -> list[PointSpec]:
    """Points routed as recorded: the first M fully routed rows of ``samples`` (step, layer)
    calls of a :class:`moekit.routing.RoutingTrace` file, at every token count of ``m_values``
    that one call holds. The trace must route top-``top_k`` over ``routed`` experts (the shape's
    router). Labelled ``trace:<file stem>``."""
    from moekit.routing.trace import RoutingTrace

    if samples < 1:
        raise ValueError(f"trace samples must be >= 1, got {samples}")
    trace = RoutingTrace.load(path)
    if trace.num_experts != routed or trace.top_k != top_k:
        raise ValueError(f"{path}: the trace routes top-{trace.top_k} over {trace.num_experts} experts; this shape's "
                         f"router picks top-{top_k} of {routed}")
    label = f"trace:{Path(path).name.removesuffix('.npz')}"
    steps, layers = trace.num_steps, trace.num_layers
    pts = []
    for k in range(samples):
        step, layer = (k * steps) // samples, (3 * k + 1) % layers  # spread over the steps and layers
        ids = trace.topk_ids[step, layer]
        rows = np.flatnonzero((ids >= 0).all(axis=1))
        w = trace.topk_weights[step, layer] if trace.topk_weights is not None else None
        for M in m_values:
            if M <= len(rows):
                take = rows[:M]
                pts.append(PointSpec(M, None, None, step * layers + layer, label, ids=ids[take].astype(np.int64),
                                     weights=None if w is None else w[take].astype(np.float32)))
    if not pts:
        raise ValueError(f"{path}: no call holds {min(m_values)} fully routed rows")
    return pts


def _finite(values) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    return a[np.isfinite(a)]


def _mean(values) -> float:
    a = _finite(values)
    return float(a.mean()) if a.size else math.nan


def _min(values) -> float:
    a = _finite(values)
    return float(a.min()) if a.size else math.nan


def geomean(x) -> float:
    x = np.asarray([v for v in x if np.isfinite(v) and v > 0])
    return float(np.exp(np.log(x).mean())) if x.size else math.nan


# ------------------------------------------------------------------------- analysis (CPU)


def evaluate(model, t_eval, t_profile=None, *, device_choices: list[int] | None = None, hw=None,
             dtype=None) -> dict:
    """Every number of the evaluation that follows from timings alone.

    ``model``: the fitted CostModel; ``t_eval``: exhaustive timings at the evaluation points (its
    configs must include the model's); ``t_profile``: the profiling timings (for the ablation and
    the pruning check); ``device_choices``: the selector's choices measured on the GPU (indices
    into ``t_eval.configs``), else the model's own argmin is used.
    """
    from moekit.kernels.configs import default_config
    from moekit.ramp import analysis
    from moekit.ramp.costmodel import fit, regret
    from moekit.ramp.fallback import fallback_choice, templates
    from moekit.bench.ramp_profile import prune_configs

    hw = hw or model.hardware
    index = {c: i for i, c in enumerate(t_eval.configs)}
    missing = [c for c in model.configs if c not in index]
    if missing:
        raise ValueError(f"the evaluation timings lack {len(missing)} of the model's configs")
    best = t_eval.best()
    T = t_eval.times
    model_choices = [index[model.configs[model.choose(p.counts, p.M)]] for p in t_eval.points]
    ra = device_choices if device_choices is not None else model_choices
    is_fp8 = "float8" in t_eval.dtype
    tdtype = dtype or (torch.float8_e4m3fn if is_fp8 else torch.bfloat16)
    cands = templates(t_eval.shape, hw, tdtype, t_eval.routed_experts)
    rows = []
    static_of_m = {}
    for M in sorted({p.M for p in t_eval.points}):
        j1 = [j for j, p in enumerate(t_eval.points) if p.M == M and p.beta == 1.0]
        if j1:
            static_of_m[M] = int(np.nanargmin(T[j1[0]]))
    if model.family == "expert_major":  # what fused_moe_expert_major runs without a config
        from moekit.kernels.expert_major import expert_major_default

        em_default = expert_major_default(model.capacity, is_fp8)
    for j, p in enumerate(t_eval.points):
        dflt = em_default if model.family == "expert_major" else default_config(p.M, t_eval.shape, dtype=tdtype)
        fb = fallback_choice(t_eval.shape, p.counts, p.M, hw, tdtype, cands)
        row = {"M": p.M, "beta": None if math.isnan(p.beta) else p.beta, "realized_beta": p.realized_beta,
               "label": p.label, "active": int((p.counts > 0).sum()), "best_us": float(best[j]),
               "ra_config": ra[j], "ra_us": float(T[j, ra[j]]), "model_config": model_choices[j],
               "default_us": float(T[j, index[dflt]]) if dflt in index else math.nan,
               "fallback_us": float(T[j, index[fb]]) if fb in index else math.nan,
               "static_us": float(T[j, static_of_m[p.M]]) if p.M in static_of_m else math.nan,
               "baseline_us": float(t_eval.baseline[j]) if t_eval.baseline is not None else math.nan}
        # A point the timing's deadline cut short has no exhaustive best: it is kept in the
        # record, and left out of every statistic.
        row["complete"] = bool(np.isfinite(T[j]).all())
        row["regret"] = row["ra_us"] / row["best_us"] - 1 if row["complete"] else math.nan
        rows.append(row)
    done = [r for r in rows if r["complete"]]
    if not done:
        raise ValueError("no evaluation point has every configuration timed: nothing to evaluate")
    regrets = np.array([r["regret"] for r in done])
    skewed = [r for r in done if r["realized_beta"] <= SKEWED + 1e-9 and r["active"] > 0]
    out = {
        "points": rows,
        "family": model.family,
        "default": "expert_major_default" if model.family == "expert_major" else "default_config",
        "complete_points": len(done),
        "partial_token_counts": sorted({r["M"] for r in rows if not r["complete"]}),
        "regret_mean": float(regrets.mean()), "regret_max": float(regrets.max()),
        "regret_by_label": {lab: {"mean": float(np.mean([r["regret"] for r in done if r["label"] == lab])),
                                  "max": float(np.max([r["regret"] for r in done if r["label"] == lab]))}
                            for lab in sorted({r["label"] for r in done})},
        "skewed_points": len(skewed),
        "speedup_vs_static_geomean": geomean([r["static_us"] / r["ra_us"] for r in skewed]),
        "speedup_vs_default_geomean": geomean([r["default_us"] / r["ra_us"] for r in skewed]),
        "speedup_vs_baseline_geomean": geomean([r["baseline_us"] / r["ra_us"] for r in done]),
        "fallback_regret_mean": _mean([r["fallback_us"] / r["best_us"] - 1 for r in done]),
        "fallback_vs_baseline_min": _min([r["baseline_us"] / r["fallback_us"] for r in done]),
        "default_regret_mean": _mean([r["default_us"] / r["best_us"] - 1 for r in done]),
        "static_regret_mean": _mean([r["static_us"] / r["best_us"] - 1 for r in done]),
        "device_matches_model": None if device_choices is None else
        int(sum(a == b for a, b in zip(device_choices, model_choices))),
    }
    if t_profile is not None:
        keep = [index[c] for c in t_profile.configs if c in index]
        full = [j for j, r in enumerate(rows) if r["complete"]]
        ev = type(t_eval)(t_eval.shape, t_eval.routed_experts, t_eval.dtype, [t_eval.configs[i] for i in keep],
                          [t_eval.points[j] for j in full], t_eval.times[np.ix_(full, keep)],
                          None if t_eval.baseline is None else t_eval.baseline[full])
        ev_best = t_eval.best()[full]
        out["ablation"] = {}
        for name, form in analysis.ABLATION_FORMS.items():
            m = fit(t_profile, hw, form, family=model.family, capacity=model.capacity, elem_bytes=model.elem_bytes)
            r = _regret_against(m, ev, ev_best)
            out["ablation"][name] = {"mean": float(r.mean()), "max": float(r.max())}
        for factor in (1.1, 1.3):
            kept = prune_configs(t_profile, factor)
            pt = type(t_profile)(t_profile.shape, t_profile.routed_experts, t_profile.dtype,
                                 [t_profile.configs[i] for i in kept], t_profile.points, t_profile.times[:, kept])
            m = fit(pt, hw, model.form, family=model.family, capacity=model.capacity, elem_bytes=model.elem_bytes)
            r = _regret_against(m, ev, ev_best)
            out[f"pruned_{factor}"] = {"kept": len(kept), "of": len(t_profile.configs), "mean": float(r.mean()),
                                       "max": float(r.max())}
        out["fit_regret_on_profile"] = {"mean": regret(model, t_profile).mean, "max": regret(model, t_profile).max}
    return out


def _regret_against(model, ev, best) -> np.ndarray:
    index = {c: i for i, c in enumerate(ev.configs)}
    out = []
    for j, p in enumerate(ev.points):
        i = index[model.configs[model.choose(p.counts, p.M)]]
        out.append(ev.times[j, i] / best[j] - 1)
    return np.asarray(out)


# --------------------------------------------------------------------------- formatting


def format_report(shape_name: str, ev: dict, device: str) -> str:
    from moekit.bench.report import format_table

    lines = [f"RaMP evaluation: {shape_name} on {device}", ""]
    paper = PAPER_NAME.get(shape_name)
    lines.append("Table IV -- regret against exhaustive search on held-out points (ours | the paper's, H200 FP8 CuTe):")
    p4 = PAPER_TABLE_IV.get(paper)
    lines.append(f"  ours: mean {ev['regret_mean'] * 100:.2f} %, max {ev['regret_max'] * 100:.1f} % over "
                 f"{ev.get('complete_points', len(ev['points']))} points (targets: mean <= 1 %, max <= 10 %)"
                 + (f" | paper {paper}: max {p4[3]} % (mean lost in our copy; overall mean "
                    f"{PAPER_OVERALL['mean_regret_pct']} %)" if p4 else ""))
    if ev.get("partial_token_counts"):
        lines.append(f"  (left out: the points at M = {ev['partial_token_counts']}, where the timing's deadline "
                     f"came before every configuration was timed)")
    for lab, r in ev["regret_by_label"].items():
        lines.append(f"    {lab}: mean {r['mean'] * 100:.2f} %, max {r['max'] * 100:.1f} %")
    lines.append("")
    lines.append(f"Table V -- routing-aware vs static dispatch (best at beta = 1 for the token count) at skewed points "
                 f"(realized beta <= {SKEWED}):")
    rows = [{"M": r["M"], "beta": r["realized_beta"], "static_us": r["static_us"], "ra_us": r["ra_us"],
             "speedup": r["static_us"] / r["ra_us"], "default_us": r["default_us"],
             "vs_default": r["default_us"] / r["ra_us"], "best_us": r["best_us"]}
            for r in ev["points"]
            if r["realized_beta"] <= SKEWED + 1e-9 and r["active"] > 0 and r.get("complete", True)]
    if rows:
        lines.append(format_table(rows, list(rows[0]), floatfmt=".2f"))
    lines.append(f"  geomean speedup vs static {ev['speedup_vs_static_geomean']:.3f}x, vs {ev.get('default', 'default_config')} "
                 f"{ev['speedup_vs_default_geomean']:.3f}x (target >= 1.2x; paper: {PAPER_OVERALL['speedup_vs_static_geomean']}x)")
    prow = [r for r in PAPER_TABLE_V if r[0] == paper]
    if prow:
        lines.append("  the paper's rows for this model: " + "; ".join(
            f"T={t} {s}->{ra} µs ({s / ra:.2f}x, {kind})" for _, t, s, ra, kind in prow))
    measured_baseline = math.isfinite(ev["speedup_vs_baseline_geomean"])
    if measured_baseline:
        lines.append(f"  over the torch baseline (grouped_mm): geomean {ev['speedup_vs_baseline_geomean']:.2f}x")
    lines.append(f"  mean regret: routing-aware {ev['regret_mean'] * 100:.2f} %, static {ev['static_regret_mean'] * 100:.2f} %, "
                 f"default {ev['default_regret_mean'] * 100:.2f} %, fallback {ev['fallback_regret_mean'] * 100:.2f} %"
                 + (f" (fallback vs baseline: min {ev['fallback_vs_baseline_min']:.2f}x)" if measured_baseline else ""))
    if "ablation" in ev:
        lines.append("")
        lines.append("Ablation (fitted on the profiling points, regret on these points) | the paper's:")
        for name, r in ev["ablation"].items():
            key = {"2-term (alpha + beta G/S)": "2-param", "3-term (+ gamma G)": "3-param",
                   "4-term, the paper's (+ delta phi)": "4-param"}.get(name)
            ref = f" | paper {key}: {PAPER_ABLATION[key][0]} % / {PAPER_ABLATION[key][1]} %" if key else ""
            lines.append(f"  {name:36s} mean {r['mean'] * 100:6.2f} %  max {r['max'] * 100:6.1f} %{ref}")
        for f in ("pruned_1.1", "pruned_1.3"):
            if f in ev:
                p = ev[f]
                lines.append(f"  pruned ({f[7:]}x of a point's best): {p['kept']}/{p['of']} configs, mean "
                             f"{p['mean'] * 100:.2f} %, max {p['max'] * 100:.1f} %")
    for key in ("selector", "graph", "fallback_shapes"):
        if ev.get(key) is not None:
            lines.append("")
            lines.append(f"{key}: {ev[key]}")
    return "\n".join(lines)


def draw_figure(shape_name: str, ev: dict, device: str, path: Path) -> Path:
    from moekit.bench.report import new_figure, save_figure

    fig, (a, b) = new_figure(1, 2, figsize=(12, 4.2))
    pts = ev["points"]
    Ms = sorted({r["M"] for r in pts})
    for k, M in enumerate(Ms):
        rs = [r for r in pts if r["M"] == M]
        a.scatter([k + 0.08 * i for i in range(len(rs))], [r["regret"] * 100 for r in rs],
                  c=[r["realized_beta"] for r in rs], cmap="viridis", vmin=0.3, vmax=1.0, s=22)
    a.axhline(1.0, ls="--", c="gray", lw=0.8)
    a.set_xticks(range(len(Ms)), [str(m) for m in Ms])
    a.set_xlabel("token count M (held out)")
    a.set_ylabel("regret vs exhaustive (%)")
    a.set_title("routing-aware choice (color: realized beta)")
    sk = [r for r in pts if r["realized_beta"] <= SKEWED + 1e-9 and r["active"] > 0 and r.get("complete", True)]
    x = np.arange(len(sk))
    b.bar(x - 0.2, [r["static_us"] / r["ra_us"] for r in sk], 0.4, label="vs static (best at beta=1)")
    b.bar(x + 0.2, [r["default_us"] / r["ra_us"] for r in sk], 0.4, label=f"vs {ev.get('default', 'default_config')}")
    b.axhline(1.0, c="k", lw=0.8)
    b.set_xticks(x, [f"{r['M']}\n{r['realized_beta']:.2f}" for r in sk], fontsize=7)
    b.set_ylabel("speedup of the routing-aware choice")
    b.set_title(f"skewed points (realized beta <= {SKEWED})")
    b.legend(fontsize=8)
    family = "" if ev.get("family", "token") == "token" else f" ({ev['family']} kernels)"
    fig.suptitle(f"RaMP, {shape_name}{family} on {device}")
    return save_figure(fig, path)


# ----------------------------------------------------------------------------- GPU parts


def selector_cost(selector, shape, M_values, routed: int, layers: int, iters: int = 200) -> dict:
    """µs of one selection: ``device_us``, eager calls between CUDA events (the Triton
    launch from Python and the small torch ops around it included: the host is slower than
    the kernel); ``graph_us``, the same call captured in a CUDA graph and replayed 20 times per
    sample (the kernels alone); ``choose_with_host_read_us``, a whole eager ``choose`` with its
    host read (host clock), and ``graphed_choose_with_host_read_us`` the same through the
    selector's captured selection (``Selector.graphed_reads``); ``per_layer_us``: the
    selector's own mode amortized over ``layers``."""
    from moekit.bench.timing import time_fn, time_graph_replay
    from moekit.bench.ramp_profile import make_routing
    from moekit.ramp.select import choose_device

    out = {}
    for M in M_values:
        r = make_routing(shape, routed, PointSpec(M, 0.7, None, 5 + M))
        ids = r.ids.to(selector.device)
        dm = selector.device_model()

        def select():
            return choose_device(dm, M, topk_ids=ids, num_experts=shape.num_experts)

        dev = time_fn(select, iters=iters, warmup=10, device=selector.device)
        graph = time_graph_replay(select, iters=max(iters // 4, 10), warmup=3, replays_per_sample=20)
        host = {}
        graphed = selector.graphed_reads
        try:
            for mode in (False, True):
                selector.graphed_reads = mode
                selector.choose(M, topk_ids=ids)  # a graphed read captures its graph at the first
                host[mode] = []
                for _ in range(50):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    selector.choose(M, topk_ids=ids)
                    host[mode].append((time.perf_counter() - t0) * 1e6)
        finally:
            selector.graphed_reads = graphed
        read = float(np.median(host[graphed]))
        out[str(M)] = {"device_us": float(np.median(dev)), "graph_us": float(np.median(graph)),
                       "choose_with_host_read_us": float(np.median(host[False])),
                       "graphed_choose_with_host_read_us": float(np.median(host[True])),
                       "per_layer_us": read / layers, "layers": layers, "graphed_reads": graphed,
                       "variants": dm.num_variants}
    return out


def graph_section(selector, timer, shape, routed, m_values, t_eval=None, iters: int = 20) -> dict:
    """The CUDA-graph path at decode sizes: each mode's replay time per routing, against the
    eager routing-aware call's measured best, and its output against the eager call."""
    from moekit.bench.timing import queue_cold
    from moekit.kernels import fused_moe
    from moekit.ramp.graphs import GraphedMoE, conditional_nodes_available
    from moekit.bench.ramp_profile import make_routing

    from moekit.bench.timing import L2Flusher

    w13, w2, scales, _, _ = timer.weights()
    flusher = L2Flusher(256 << 20, selector.device)  # cold L2, as the exhaustive timings
    out = {"conditional_nodes_available": conditional_nodes_available()}
    for M in m_values:
        g = torch.Generator(device=selector.device).manual_seed(M)
        x = torch.randn(M, shape.hidden, generator=g, device=selector.device, dtype=torch.bfloat16)
        ids = torch.empty(M, shape.top_k, dtype=torch.int64, device=selector.device)
        w = torch.empty(M, shape.top_k, dtype=torch.float32, device=selector.device)
        routings = [make_routing(shape, routed, PointSpec(M, b, z, 31 + M))
                    for b, z in ((1.0, None), (0.6, None), (0.45, None), (None, 1.2))]
        ids.copy_(routings[0].ids)
        w.copy_(routings[0].weights)
        res = {}
        for mode in ("conditional", "masked", "static"):
            try:
                gm = GraphedMoE(selector, x, w13, w2, ids, w, mode=mode, **scales).capture()
            except Exception as error:  # noqa: BLE001 - a mode that cannot be captured is reported
                res[mode] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
                continue
            rows = []
            for r in routings:
                ids.copy_(r.ids)
                w.copy_(r.weights)
                gm.replay()
                torch.cuda.synchronize()
                pos = int(gm.choice.item())
                cfg = gm.configs[pos] if 0 <= pos < len(gm.configs) else selector.configs[gm.static]
                want = fused_moe(x, w13, w2, ids, w, cfg, **scales)
                diff = float((gm.out.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))
                samples = queue_cold(gm.graph.replay, iters=iters, warmup=2, flusher=flusher, device=selector.device)
                torch.cuda.synchronize()
                rows.append({"realized_beta": r.realized_beta, "choice": pos, "config_index": selector.configs.index(cfg),
                             "replay_us": float(np.median(samples())), "rel_diff_vs_eager": diff,
                             "bitwise": bool(torch.equal(gm.out, want))})
            res[mode] = {"candidates": gm.candidates, "static": gm.static, "mode": gm.mode, "points": rows,
                         "facts": gm.facts}
            del gm
        out[str(M)] = res
    return out


def fallback_shapes_section(timer_factory, specs: list[tuple], dtype: str, log) -> dict:
    """Shapes outside the presets: the fallback's choice vs default_config vs the torch baseline."""
    from moekit.kernels.configs import default_config
    from moekit.ramp.fallback import fallback_choice, templates
    from moekit.bench.ramp_profile import make_routing
    from moekit.ramp.regions import hardware_for

    out = {}
    hw = hardware_for()
    tdtype = torch.float8_e4m3fn if dtype == "float8_e4m3fn" else torch.bfloat16
    for (E, K, H, N), Ms in specs:
        from moekit.shapes import MoEShape

        shape = MoEShape(f"E{E}-K{K}-H{H}-N{N}", E, K, H, N)
        timer = timer_factory(shape)
        cands = templates(shape, hw, tdtype)
        pts = [PointSpec(M, b, None, 101 + M, "fallback") for M in Ms for b in (1.0, 0.5)]
        chosen = set()
        for p in pts:
            r = make_routing(shape, E, p)
            chosen.add(fallback_choice(shape, r.counts, p.M, hw, tdtype, cands))
            chosen.add(default_config(p.M, shape, dtype=tdtype))
        cfgs = sorted(chosen, key=str)
        run = timer.run(cfgs, pts, compile_first=True)
        t = run.timings
        rows = []
        for j, p in enumerate(t.points):
            fb = fallback_choice(shape, p.counts, p.M, hw, tdtype, cands)
            d = default_config(p.M, shape, dtype=tdtype)
            rows.append({"M": p.M, "beta": p.beta, "fallback_us": float(t.times[j, cfgs.index(fb)]),
                         "default_us": float(t.times[j, cfgs.index(d)]), "baseline_us": float(t.baseline[j])})
        out[shape.name] = rows
        log(f"  fallback on {shape.name}: " + "; ".join(
            f"M={r['M']} b={r['beta']}: {r['fallback_us']:.0f} (default {r['default_us']:.0f}, torch "
            f"{r['baseline_us']:.0f}) µs" for r in rows))
        del timer
        torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moekit bench ramp", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"])
    p.add_argument("--family", default="token", choices=["token", "expert_major"],
                   help="token: fused_moe after a router; expert_major: fused_moe_expert_major after a dispatcher")
    p.add_argument("--capacity", type=int, default=DEFAULT_CAPACITY, help="expert_major: rows per expert")
    p.add_argument("--profile", action="store_true", help="profile the shape first, in this process")
    p.add_argument("--model", default=None, help="model file (default: the one moekit.ramp finds for this GPU)")
    p.add_argument("--profile-m", type=int, nargs="+", default=None, help="--profile: its token counts")
    p.add_argument("--profile-betas", type=float, nargs="+", default=None, help="--profile: its betas")
    p.add_argument("--eval-m", type=int, nargs="+", default=list(EVAL_M))
    p.add_argument("--betas", type=float, nargs="+", default=list(EVAL_BETAS))
    p.add_argument("--zipf", type=float, nargs="*", default=list(EVAL_ZIPF))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=None, help="stop starting work after this many seconds")
    p.add_argument("--profile-deadline-s", type=float, default=None)
    p.add_argument("--trace", nargs="*", default=[], metavar="FILE",
                   help="routing traces (moekit trace record) whose recorded calls are evaluation points too; "
                        "they must route over the shape's experts")
    p.add_argument("--trace-samples", type=int, default=2, help="recorded calls per trace")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph section")
    p.add_argument("--graph-m", type=int, nargs="*", default=list(GRAPH_M))
    p.add_argument("--fallback-shape", nargs="*", default=[], metavar="E,K,H,N",
                   help="shapes outside the presets to check the fallback on (at --fallback-m)")
    p.add_argument("--fallback-m", type=int, nargs="*", default=[16, 128, 1024])
    p.add_argument("--from-timings", default=None, help="no GPU: re-evaluate saved evaluation timings")
    p.add_argument("--profile-timings", default=None, help="the profiling timings (ablation, pruning check)")
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                   help="where the record, figure and timings go (default %(default)s)")
    p.add_argument("--tiny", action="store_true", help="CPU: tiny H / N in Triton's interpreter")
    p.add_argument("--config-stride", type=int, default=1, help="profile / evaluate every n-th config (tests)")
    return p


def _fallback_specs(args) -> list[tuple]:
    """The ``--fallback-shape`` sections' ((E, K, H, N), Ms); called before any work, so that a bad
    shape is refused at once rather than after the evaluation's hours."""
    out = []
    for s in args.fallback_shape:
        try:
            E, K, H, N = (int(v) for v in s.split(","))
        except ValueError:
            raise ValueError(f"--fallback-shape takes E,K,H,N (four ints), got {s!r}") from None
        if min(E, K, H, N) < 1 or K > E:
            raise ValueError(f"--fallback-shape E,K,H,N must be ints >= 1 with K <= E, got {s!r}")
        out.append(((E, K, H, N), tuple(args.fallback_m)))
    if out and any(m < 1 for m in args.fallback_m):
        raise ValueError(f"--fallback-m must be ints >= 1, got {args.fallback_m}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    specs = _fallback_specs(args)  # checked now: its sections run last
    check_output_dir(args.out_dir, "--out-dir")
    from moekit.bench.report import write_record
    from moekit.ramp.dataset import Timings
    from moekit.ramp.modelfile import dtype_name, find_model, load_model
    from moekit.bench.ramp_profile import (ConfigTimer, ProfileSpec, TimerSpec, load_timings, profile, resolve_shape,
                                     save_timings)
    from moekit.ramp.regions import hardware_for

    log = lambda s: print(s, flush=True)  # noqa: E731
    dtype = dtype_name(args.dtype)
    out_dir = Path(args.out_dir)
    t_profile = None
    if args.profile_timings:
        t_profile, _ = load_timings(args.profile_timings)
    if args.from_timings:  # offline: everything that follows from saved timings
        t_eval, meta = load_timings(args.from_timings)
        if not args.model:
            raise ValueError("--from-timings needs --model (the model file that was evaluated)")
        model, _ = load_model(args.model, check_space=False)
        ev = evaluate(model, t_eval, t_profile)
        device = t_eval.environment.get("device", "unknown device")
        print(format_report(t_eval.shape.name, ev, device))
        path = write_record("ramp-eval", {"from_timings": args.from_timings, "model": args.model}, ev, out_dir=out_dir)
        print(f"record: {path}\nfigure: {draw_figure(t_eval.shape.name, ev, device, path.with_suffix('.png'))}")
        return 0
    hidden = intermediate = None
    if args.tiny:
        hidden, intermediate = 64, 32
    shape, routed = resolve_shape(args.shape, hidden=hidden, intermediate=intermediate)
    start = time.perf_counter()
    cap = args.capacity if args.family == "expert_major" else None
    if args.profile:
        grid = {k: tuple(v) for k, v in (("m_values", args.profile_m), ("betas", args.profile_betas)) if v}
        rec = profile(ProfileSpec(shape=args.shape, hidden=hidden, intermediate=intermediate, dtype=dtype,
                                  family=args.family, capacity=args.capacity, iters=args.iters, seed=args.seed,
                                  deadline_s=args.profile_deadline_s, config_stride=args.config_stride, **grid),
                      out_dir, log)
        model_path = rec["model_file"]
        t_profile, _ = load_timings(rec["timings_file"])
    else:
        hw0 = hardware_for()
        model_path = args.model or find_model(shape, hw0.key, dtype, args.family)
        if model_path is None:
            raise ValueError(f"no model file for {shape.name} {dtype} on {hw0.key}: pass --profile or --model")
    model, _ = load_model(model_path, shape=shape, dtype=dtype, family=args.family)
    # The evaluation's timing stops early enough to leave the graph, selector and fallback sections their time.
    reserve = SELECTOR_S + (0 if args.no_graph or args.family != "token" else GRAPH_SECTION_S) \
        + FALLBACK_SHAPE_S * len(args.fallback_shape)
    eval_deadline = None if args.deadline_s is None else args.deadline_s - reserve - (time.perf_counter() - start)
    timer = ConfigTimer(TimerSpec(shape, routed, dtype, args.family, args.capacity, args.iters, 1, seed=args.seed,
                                  deadline_s=eval_deadline), log)
    from moekit.kernels.configs import default_config
    from moekit.ramp.fallback import templates

    tdtype = torch.float8_e4m3fn if dtype == "float8_e4m3fn" else torch.bfloat16
    configs = list(model.configs)
    for c in [default_config(M, shape, dtype=tdtype) for M in args.eval_m] + templates(shape, model.hardware, tdtype,
                                                                                         routed):
        if c not in configs and (args.family == "token" or (c.form == "two_launch" and c.split_k == 1)):
            configs.append(c)
    points = eval_points(tuple(args.eval_m), tuple(args.betas), tuple(args.zipf), args.seed)
    for path in args.trace:
        points += trace_points(path, routed, shape.top_k, tuple(args.eval_m), args.trace_samples)
    log(f"moekit bench ramp: {shape.name} {dtype} {args.family}: {len(configs)} configs x {len(points)} held-out points")
    run = timer.run(configs, points, compile_first=not args.profile and timer.on_gpu)
    t_eval = run.timings
    epath = save_timings(t_eval, out_dir / f"eval-{model.hardware.key}-{shape.name}-{dtype}-{args.family}-timings.json.gz",
                         params={"args": vars(args)}, family=args.family, capacity=cap)
    from moekit.ramp.select import Selector

    selector = Selector(shape, dtype=dtype, device=timer.device, family=args.family, model=model,
                        capacity=cap, warn=False)
    device_choices = None
    if args.family == "token":
        device_choices = []
        from moekit.bench.ramp_profile import make_routing

        for p in points:  # the selector on the device, from the point's own routing
            r = make_routing(shape, routed, p)
            cfg = selector.choose(p.M, topk_ids=r.ids.to(timer.device))
            device_choices.append(configs.index(cfg))
    keep = [j for j in range(len(t_eval.points)) if np.isfinite(t_eval.times[j]).any()]  # (deadline)
    if len(keep) < len(t_eval.points):
        kept = set(keep)
        t_eval = Timings(t_eval.shape, t_eval.routed_experts, t_eval.dtype, t_eval.configs,
                         [p for j, p in enumerate(t_eval.points) if j in kept], t_eval.times[keep],
                         None if t_eval.baseline is None else t_eval.baseline[keep], t_eval.environment)
        if device_choices is not None:
            device_choices = [device_choices[j] for j in keep]
    ev = evaluate(model, t_eval, t_profile, device_choices=device_choices)
    ev["incomplete"] = run.incomplete
    ev["errors"] = dict(list(run.errors.items())[:50])
    if timer.on_gpu:
        layers = {"qwen3-30b-a3b": 48, "olmoe-1b-7b": 16, "mixtral-8x7b": 32}.get(shape.name, 61)
        ev["selector"] = selector_cost(selector, shape, [m for m in (1, 16, 256) if m], routed, layers) \
            if args.family == "token" else None
        def left() -> float:
            return math.inf if args.deadline_s is None else args.deadline_s - (time.perf_counter() - start)

        if not args.no_graph and args.family == "token":
            if left() > GRAPH_SECTION_S:
                try:
                    ev["graph"] = graph_section(selector, timer, shape, routed, args.graph_m)
                except Exception as error:  # noqa: BLE001 - reported in the record, the rest is kept
                    ev["graph"] = {"error": f"{type(error).__name__}: {error}"}
            else:
                ev["graph"] = {"skipped": f"deadline: {left():.0f} s left"}
        if specs:
            # Few configs per shape, large weights: a small compile pool (each process holds the weights).
            factory = lambda s: ConfigTimer(TimerSpec(s, s.num_experts, dtype, "token", iters=args.iters,  # noqa: E731
                                                      seed=args.seed, compile_workers=4), log)
            ev["fallback_shapes"] = {}
            for spec in specs:
                if left() < FALLBACK_SHAPE_S:
                    ev["fallback_shapes"][str(spec[0])] = f"skipped: deadline ({left():.0f} s left)"
                    continue
                ev["fallback_shapes"] |= fallback_shapes_section(factory, [spec], dtype, log)
    device = torch.cuda.get_device_name() if timer.on_gpu else "CPU (Triton interpreter; numbers meaningless)"
    report = format_report(shape.name, ev, device)
    print(report)
    params = {"shape": shape.name, "dtype": dtype, "family": args.family, "model": str(model_path),
              "eval_m": args.eval_m, "betas": args.betas, "zipf": args.zipf, "iters": args.iters,
              "eval_timings": str(epath), "seconds": time.perf_counter() - start}
    path = write_record("ramp-eval", params, ev, out_dir=out_dir)
    (path.with_suffix(".txt")).write_text(report + "\n")
    try:
        fig = draw_figure(shape.name, ev, device, path.with_suffix(".png"))
    except ImportError as error:
        fig = f"not drawn: {error}"
    log(f"record: {path}\nfigure: {fig}\neval timings: {epath}\n{time.perf_counter() - start:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
