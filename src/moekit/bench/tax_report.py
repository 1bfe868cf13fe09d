"""The report of a ``moekit tax --measure`` record: text tables, the figure, and the model
side recomputed with other hardware numbers (``moekit tax --recompare``).

A record (kind ``tax-measure``, written by :func:`moekit.bench.tax_measure.run_measure`)
keeps, per model, routing and batch size m, the measured block times and the model's
prediction for exactly what was timed. :func:`recompare` re-runs the model side from the
record alone (the routing's summary instead of its ids), so a record measured once can be
checked against other bandwidth and FLOP/s figures without a device.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from moekit.bench.report import load_record, new_figure, save_figure
from moekit.bench.tax_blocks import elem_bytes
from moekit.shapes import MoEShape
from moekit.tax.efficiency import Calibration, adapt_calibration, nearest_calibration
from moekit.tax.hardware import Hardware, calibration_hardware, with_overrides
from moekit.tax.model import TaxModel, TaxPoint

ERROR_TARGET = 0.30  # the accuracy asked of the model: |model / measured - 1| <= 30 % at every point


# --------------------------------------------------------------------------- recompare


def predict_from_summary(shape: MoEShape, hw: Hardware, m: int, block_size: int, e_active: float,
                         eta: float, elem: int, calibration: Calibration | None = None,
                         tile_n: int | None = None) -> TaxPoint:
    """:func:`predict` from the routing's summary (mean E_active and mean padding eta over
    the timed input sets) instead of the ids, which a record does not keep.

    The same TaxModel and the same TP+TP terms (eq. 4 at n = 1, T_anc, the regime logic of
    ``TaxModel._finish``). Both roofline sides are linear in E_active and eta and every set
    has m*K pairs, so the mean memory and compute sides are exact; only the max of the two
    is taken after averaging rather than per set, which differs where the sets straddle the
    ridge (:func:`recompare` reports the difference on the record's own hardware).
    """
    tm = TaxModel(shape, hw, n_gpus=1, padding="blockwise", block_size=block_size, f=1.0,
                  weight_bytes=elem, act_bytes=elem, calibration=calibration, tile_n=tile_n)
    k_s, mk = tm.costs.k_shared, m * shape.top_k
    t_full, mem, comp, how = tm._moe_sides(e_active, eta * mk, m, 1, k_s, k_s * m, block_size)
    t_nopad = tm._moe_sides(e_active, mk, m, 1, k_s, k_s * m, block_size)[0]
    anc = tm.ancillary(m)
    t_other, _ = tm.other_times(m, "decode")
    parts = dict(
        t_moe=float(t_full) + anc + tm.allreduce(m), t_other_moe=t_other,
        steps={"padding": float(t_full - t_nopad), "ancillary": anc},
        moe_mem=float(mem), moe_comp=float(comp), e_active=float(e_active), eta=float(eta),
        straggler=1.0, padded_straggler=float(eta), block=block_size, moe_compute=float(t_full), how=how,
    )
    return tm._finish(m, "decode", "TP+TP", parts)


def ids_from_counts(counts, top_k: int) -> np.ndarray:
    """Top-k ids [sets, m, K] whose tokens per expert are ``counts`` [sets, E] (each set sums to
    m K). Which token holds which expert is arbitrary: under TP+TP on one GPU the model reads
    only the counts."""
    counts = np.asarray(counts, dtype=np.int64)
    flat = [np.repeat(np.arange(counts.shape[1]), c) for c in counts]
    return np.stack([f.reshape(-1, top_k) for f in flat])


def recompare(record, hbm_bw: float | None = None, peak_flops: float | None = None,
              calibrations: list[Calibration] | None = None, ramp: bool = True) -> list[dict]:
    """The model side of a saved ``tax-measure`` record, recomputed with other hardware
    numbers (bytes/s, FLOP/s; None keeps the record's), against the measured times.

    One row per model, routing and m: measured tau, model tau, error (model / measured - 1),
    the model's regime, its T_MoE and T_DenseFA errors, and ``model_drift``: how far this
    recomputation lands from the record's own prediction when run with the record's
    hardware (0 up to rounding unless the input sets straddle the roofline ridge).

    With ``calibrations``, the calibrated model too (``tau_calibrated``, ``error_calibrated``):
    the one for the record's GPU kind, or the nearest moved to it (``calibration_notes``
    say which). From the timed routing's counts where the record keeps them, else from its
    summary (mean E_active and padding, as above). With ``ramp=True`` the expert kernel is
    priced as the GPU run prices it: by a RaMP model file of the record's GPU kind where one
    covers the shape and the token count (:mod:`moekit.bench.tax_ramp`), else the curve.
    """
    data = load_record(record, kind="tax-measure")
    res = data["results"]
    for name, value in (("hbm_bw", hbm_bw), ("peak_flops", peak_flops)):
        if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    base = res["hardware"]
    recorded = Hardware(name=base["name"], hbm_bw=float(base["hbm_bw"]), peak_flops=float(base["peak_flops"]),
                        net_bw=float(base["net_bw"]), net_latency=float(base["net_latency"]))
    hw = with_overrides(recorded, **{k: float(v) for k, v in (("hbm_bw", hbm_bw), ("peak_flops", peak_flops))
                                     if v is not None})
    elem = elem_bytes(getattr(torch, data["params"]["dtype"].removeprefix("torch.")))
    cal, notes = None, []
    if calibrations:
        device = Hardware(name=data["environment"].get("device") or base["name"], hbm_bw=recorded.hbm_bw,
                          peak_flops=recorded.peak_flops, net_bw=recorded.net_bw, net_latency=recorded.net_latency)
        cal = nearest_calibration(device, calibrations)
        cal, notes = adapt_calibration(cal, device)
    rows = []
    for name, mres in res["models"].items():
        shape = MoEShape(**mres["shape"])
        kernel_cost = kernel_name = None
        if cal is not None and ramp and data["params"].get("ramp", True):
            from moekit.bench.tax_ramp import ramp_kernel_cost
            from moekit.tax.gpus import gpu_key

            kernel_cost, kernel_name, _ = ramp_kernel_cost(
                shape, gpu_key(data["environment"].get("device") or base["name"]),
                data["params"]["dtype"].removeprefix("torch."))
        for label, rres in mres["routings"].items():
            for p in rres["points"]:
                m, mod = p["m"], p["model"]
                args = (shape, m, mod["block_size"], mod["e_active"], mod["eta"], elem)
                point = predict_from_summary(args[0], hw, *args[1:])
                again = predict_from_summary(args[0], recorded, *args[1:])
                t_moe, t_fa = p["t_moe_us"]["median"], p["t_densefa_us"]["median"]
                extra = {}
                if cal is not None:
                    bn = p.get("config", {}).get("bn")
                    if p.get("expert_counts"):
                        from moekit.bench.tax_measure import predict_calibrated

                        ids = ids_from_counts(p["expert_counts"], shape.top_k)
                        cp, _ = predict_calibrated(shape, cal, m, mod["block_size"], bn, ids, elem,
                                                   kernel_cost=kernel_cost, kernel_name=kernel_name)
                    else:
                        cp = predict_from_summary(shape, calibration_hardware(cal), m, mod["block_size"],
                                                  mod["e_active"], mod["eta"], elem, calibration=cal, tile_n=bn)
                    extra = {"tau_calibrated": cp.tau, "error_calibrated": cp.tau / p["tau_measured"] - 1.0,
                             "t_moe_error_calibrated": cp.t_moe * 1e6 / t_moe - 1.0,
                             "t_densefa_error_calibrated": cp.t_dense * 1e6 / t_fa - 1.0,
                             "calibration_notes": notes, "calibration": cal.name}
                rows.append({
                    **extra, "device": data["environment"].get("device", base["name"]), "model": name, "routing": label, "m": m, "config_id": p.get("config_id"),
                    "tau_measured": p["tau_measured"], "tau_model": point.tau,
                    "error": point.tau / p["tau_measured"] - 1.0, "regime": point.regime,
                    "t_moe_error": point.t_moe * 1e6 / t_moe - 1.0, "t_densefa_error": point.t_dense * 1e6 / t_fa - 1.0,
                    "tau_densepa_measured": p["tau_densepa_measured"], "tau_densepa_model": point.tau_densepa,
                    "hbm_bw": hw.hbm_bw, "peak_flops": hw.peak_flops,
                    "model_drift": again.tau / mod["tau"] - 1.0,
                })
    return rows


def format_recompare(rows: list[dict]) -> str:
    """Markdown tables of :func:`recompare` rows, one per model and routing, with the verdict."""
    if not rows:
        return "no points"
    lines = [f"model recomputed with HBM {rows[0]['hbm_bw'] / 1e9:.0f} GB/s, "
             f"{rows[0]['peak_flops'] / 1e12:.0f} TFLOP/s; error = model / measured - 1"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["routing"]), []).append(r)
    for (name, label), rs in groups.items():
        lines += ["", f"{name}, routing {label}", "",
                  "| m | τ measured | τ model | error | regime | T_MoE err | T_DenseFA err |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['m']} | {r['tau_measured']:.2f} | {r['tau_model']:.2f} | {100 * r['error']:+.0f}% | "
                  f"{r['regime']} | {100 * r['t_moe_error']:+.0f}% | {100 * r['t_densefa_error']:+.0f}% |"
                  for r in rs]
        worst = max(rs, key=lambda r: abs(r["error"]))
        inside = sum(abs(r["error"]) <= ERROR_TARGET for r in rs)
        lines.append(f"\n{inside}/{len(rs)} points within {100 * ERROR_TARGET:.0f}%; largest "
                     f"{100 * worst['error']:+.0f}% at m={worst['m']}; max drift from the record's own model "
                     f"{100 * max(abs(r['model_drift']) for r in rs):.2g}%")
        if "error_calibrated" in rs[0]:
            worst = max(rs, key=lambda r: abs(r["error_calibrated"]))
            inside = sum(abs(r["error_calibrated"]) <= ERROR_TARGET for r in rs)
            lines.append(f"calibrated ({rs[0]['calibration']}): {inside}/{len(rs)} within {100 * ERROR_TARGET:.0f}%; "
                         f"largest {100 * worst['error_calibrated']:+.1f}% at m={worst['m']}; per m: "
                         + ", ".join(f"{r['m']}: {r['tau_calibrated']:.2f} ({100 * r['error_calibrated']:+.0f}%)"
                                     for r in rs))
    return "\n".join(lines)



# --------------------------------------------------------------------------- output


def explain_point(p: dict) -> str:
    """Which side of tau the model gets wrong at point ``p``, in numbers."""
    e, a, b, mod = p["rel_error"], p["achieved"], p["breakdown_us"], p["model"]
    moe_side = "bw" if mod["regime"] in ("memory-bound", "transition") else "flops"
    fa_side = "bw" if mod["regime"] == "memory-bound" else "flops"
    what = {"bw": "HBM bandwidth", "flops": "matmul FLOP/s"}
    text = (f"m={p['m']}: model tau {mod['tau']:.2f} vs measured {p['tau_measured']:.2f} ({100 * e['tau']:+.0f}%), "
            f"{mod['regime']}. Model T_MoE {100 * e['t_moe']:+.0f}% and T_DenseFA {100 * e['t_dense']:+.0f}% "
            f"against measured: the MoE block reached {100 * a['moe'][moe_side + '_frac']:.0f}% of the measured "
            f"{what[moe_side]}, DenseFA {100 * a['densefa'][fa_side + '_frac']:.0f}% of the {what[fa_side]} "
            "(the model assumes 100% for both).")
    if b:
        shared = f", shared {b['shared']:.1f} us" if "shared" in b else ""
        text += (f" Router + top-k {b['router']:.1f} us, experts (align + kernel) {b['experts']:.1f} us{shared}; "
                 f"the model's T_anc is {mod['t_anc_us']:.1f} us.")
    return text


def explain_calibrated(p: dict) -> str:
    """Which side of tau the calibrated model gets wrong at point ``p``."""
    e, mod = p["rel_error_calibrated"], p["model_calibrated"]
    text = (f"m={p['m']}: calibrated tau {mod['tau']:.2f} vs measured {p['tau_measured']:.2f} "
            f"({100 * e['tau']:+.0f}%), {mod['regime']}; T_MoE {100 * e['t_moe']:+.0f}%, "
            f"T_DenseFA {100 * e['t_dense']:+.0f}% against measured ({mod['cost_model']}).")
    curve = p.get("model_calibrated_curve")
    if curve:  # a RaMP model priced the experts: what the grouped curve alone gives
        text += f" The grouped curve alone: tau {curve['tau']:.2f} ({100 * curve['rel_error_tau']:+.0f}%)."
    return text


_COLUMNS = (  # (header, width, cell of a point)
    ("m", 5, lambda p: f"{p['m']}"),
    ("kernel config", 40, lambda p: p["config_id"]),
    ("MoE us", 9, lambda p: f"{p['t_moe_us']['median']:.1f}"),
    ("FA us", 9, lambda p: f"{p['t_densefa_us']['median']:.1f}"),
    ("PA us", 9, lambda p: f"{p['t_densepa_us']['median']:.1f}"),
    ("tau", 6, lambda p: f"{p['tau_measured']:.2f}"),
    ("calib", 6, lambda p: f"{p['model_calibrated']['tau']:.2f}" if "model_calibrated" in p else "-"),
    ("error", 6, lambda p: f"{100 * p['rel_error_calibrated']['tau']:+.0f}%" if "model_calibrated" in p else "-"),
    ("peak", 6, lambda p: f"{p['model']['tau']:.2f}"),
    ("error", 6, lambda p: f"{100 * p['rel_error']['tau']:+.0f}%"),
    ("eMoE", 6, lambda p: f"{100 * p['rel_error']['t_moe']:+.0f}%"),
    ("eFA", 6, lambda p: f"{100 * p['rel_error']['t_dense']:+.0f}%"),
    ("PA/FA", 6, lambda p: f"{p['tau_densepa_measured']:.2f}"),
    ("model", 6, lambda p: f"{p['model']['tau_densepa']:.2f}"),
    ("regime", 13, lambda p: p["model"]["regime"]),
    ("E_act", 5, lambda p: f"{p['model']['e_active']:.1f}"),
    ("eta", 5, lambda p: f"{p['model']['eta']:.2f}"),
)


def format_measure(record: dict) -> str:
    """The comparison as text: one table per model and routing, the verdict, the worst point."""
    res = record["results"]
    hw = res["hardware"]
    lines = [f"MoE tax, measured vs model on {hw['name']}: HBM {hw['hbm_bw'] / 1e12:.3g} TB/s, "
             f"{hw['peak_flops'] / 1e12:.4g} TFLOP/s ({record['params']['dtype']}; {record['params']['timing']})",
             "tau = T(MoE) / T(DenseFA); calib = the calibrated model, peak = the 100 %-peak model (the paper's "
             "bound); error = model / measured - 1 (eMoE, eFA: the 100 %-peak model's block times); "
             "PA/FA = T(DensePA) / T(DenseFA)"]
    cal = res.get("calibration")
    if cal:
        lines.append(f"calibrated model: {cal['name']}")
        lines += [f"  {note}" for note in cal.get("notes", [])]

    def row(cells) -> str:
        return " ".join(c.ljust(w) if h in ("kernel config", "regime") else c.rjust(w)
                        for c, (h, w, _) in zip(cells, _COLUMNS))

    head = row([h for h, _, _ in _COLUMNS])
    for name, mres in res["models"].items():
        for label, rres in mres["routings"].items():
            betas = [p["realized_beta"] for p in rres["points"]]
            lines += ["", f"{name}, routing {label} (realized balancedness {min(betas):.2f}-{max(betas):.2f})",
                      head, "-" * len(head)]
            lines += [row([cell(p) for _, _, cell in _COLUMNS]) for p in rres["points"]]
            if "max_abs_error_calibrated" in rres:
                verdict = "within" if rres["within_target_calibrated"] else "NOT within"
                lines.append(f"calibrated: max |error| {100 * rres['max_abs_error_calibrated']:.1f}% at "
                             f"m={rres['worst_m_calibrated']}: {verdict} {100 * ERROR_TARGET:.0f}%; largest: "
                             + rres["explanation_calibrated"])
            verdict = "within" if rres["within_target"] else "NOT within"
            lines.append(f"100%-peak: max |error| {100 * rres['max_abs_error']:.1f}% at m={rres['worst_m']}: "
                         f"{verdict} {100 * ERROR_TARGET:.0f}%; largest: " + rres["explanation"])
    if res.get("skipped_models"):
        lines.append(f"not measured (deadline): {', '.join(res['skipped_models'])}")
    lines += ["", error_table([record])]
    if not res["verified"]:
        lines.append("WARNING: a timed block did not match its reference (see verify_rel_error in the record)")
    lines += [f"wrote {path}" for path in record.get("paths", {}).values()]
    return "\n".join(lines)


def record_rows(record: dict) -> list[dict]:
    """One row per point of a record: its device, model, routing, m and the errors of tau of the
    100 %-peak model (``error``) and, where the record has it, the calibrated one."""
    res = record["results"]
    device = record.get("environment", {}).get("device", res["hardware"]["name"])
    return [{"device": device, "model": name, "routing": label, "m": p["m"], "error": p["rel_error"]["tau"],
             **({"error_calibrated": p["rel_error_calibrated"]["tau"]} if "rel_error_calibrated" in p else {})}
            for name, mres in res["models"].items() for label, rres in mres["routings"].items()
            for p in rres["points"]]


def largest_errors(rows: list[dict]) -> list[dict]:
    """Per device and model: the largest |error| of tau over routings and batch sizes, for the
    calibrated model (where the rows have it) and the 100 %-peak one, with where it is and how
    many points are within the target (rows of :func:`record_rows` or :func:`recompare`)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.get("device", "?"), r["model"]), []).append(r)
    out = []
    for (device, model), rs in groups.items():
        row = {"device": device, "model": model, "points": len(rs)}
        for key, err in (("calibrated", "error_calibrated"), ("peak", "error")):
            have = [r for r in rs if r.get(err) is not None]
            if have:
                worst = max(have, key=lambda r: abs(r[err]))
                row[key] = {"error": worst[err], "m": worst["m"], "routing": worst["routing"],
                            "within": sum(abs(r[err]) <= ERROR_TARGET for r in have)}
        out.append(row)
    return out


def error_table(records: list[dict] = (), rows: list[dict] = ()) -> str:
    """Markdown: the largest error per shape and GPU, calibrated model and 100 %-peak model side
    by side, from records (what they hold) and/or recomputed rows (:func:`recompare`)."""
    lines = ["| GPU | model | calibrated: largest error (m, routing) | within 30 % | "
             "100 % peaks: largest error (m, routing) | within 30 % |", "|---|---|---|---|---|---|"]

    def cell(d) -> tuple[str, str]:
        if not d:
            return "-", "-"
        return f"{100 * d['error']:+.1f} % (m = {d['m']}, {d['routing']})", f"{d['within']}"

    every = [r for record in records for r in record_rows(record)] + list(rows)
    for r in largest_errors(every):
        cal, cal_in = cell(r.get("calibrated"))
        peak, peak_in = cell(r.get("peak"))
        lines.append(f"| {r['device']} | {r['model']} | {cal} | {cal_in}/{r['points']} | {peak} | "
                     f"{peak_in}/{r['points']} |")
    return "\n".join(lines)


def measure_figure(record: dict, path: str) -> str:
    """Per model: tau over m, measured and predicted (with DensePA / DenseFA) on top, the
    model's relative error per point below, with the +-30 % target band."""
    models = record["results"]["models"]
    fig, axes = new_figure(2, len(models), figsize=(5.5 * len(models), 6.5),
                           subplots=dict(squeeze=False, gridspec_kw={"height_ratios": [2, 1]}, sharex="col"))
    for col, (name, mres) in enumerate(models.items()):
        top, bottom = axes[0][col], axes[1][col]
        for i, (label, rres) in enumerate(mres["routings"].items()):
            pts = rres["points"]
            ms, color = [p["m"] for p in pts], f"C{i}"
            top.plot(ms, [p["tau_measured"] for p in pts], "o-", color=color, label=f"MoE measured ({label})")
            top.plot(ms, [p["model"]["tau"] for p in pts], "s--", color=color, mfc="none",
                     label=f"MoE 100%-peak model ({label})")
            bottom.plot(ms, [100 * p["rel_error"]["tau"] for p in pts], "s--", color=color, mfc="none",
                        label=f"100%-peak, {label}")
            if all("model_calibrated" in p for p in pts):
                top.plot(ms, [p["model_calibrated"]["tau"] for p in pts], "D:", color=color,
                         label=f"MoE calibrated model ({label})")
                bottom.plot(ms, [100 * p["rel_error_calibrated"]["tau"] for p in pts], "D-", color=color,
                            label=f"calibrated, {label}")
            if i == 0:
                top.plot(ms, [p["tau_densepa_measured"] for p in pts], "^-", color="k", label="DensePA measured")
                top.plot(ms, [p["model"]["tau_densepa"] for p in pts], "k:", label="DensePA model")
        top.axhline(1.0, color="grey", lw=0.8)
        top.set_ylabel("T / T(DenseFA)")
        top.set_title(f"{name} on {record['results']['hardware']['name']}", fontsize=9)
        top.legend(fontsize=7)
        band = 100 * ERROR_TARGET
        bottom.axhspan(-band, band, color="green", alpha=0.1)
        bottom.axhline(0.0, color="grey", lw=0.8)
        bottom.set_ylabel("model / measured - 1 (%)")
        bottom.set_xlabel("batch size m (tokens)")
        bottom.set_xscale("log", base=2)
        bottom.legend(fontsize=6)
    fig.tight_layout()
    return str(save_figure(fig, path, dpi=120))
