"""``moekit tax``: the model's predictions for one preset model on one GPU type, as text.

``tax_report`` returns what the command prints: per phase, tau for every batch size and
parallelism, with the regime and the dominant tax source (the largest share of tau - 1).
With a calibration for the GPU (``calibrations``, or one shipped in ``moekit/tax/calibrations``)
every cell shows the calibrated model's tau beside the 100 %-peak bound's, and the report
says which parts are measured and which are moved from another GPU (the what-if).
``as_json=True`` returns every number instead; ``out_dir`` also draws the paper's figures.
"""

from __future__ import annotations

import json
from pathlib import Path

from .efficiency import Calibration, adapt_calibration, load_calibration, nearest_calibration
from .hardware import get_hardware
from .model import PARALLELISMS, PHASES, TaxModel, tax_shape

DEFAULT_BATCH_SIZES = tuple(2**i for i in range(13))  # 1 .. 4096
SHIPPED_CALIBRATIONS = Path(__file__).resolve().parent / "calibrations"

_REGIME = {"memory-bound": "mem", "transition": "trans", "compute-bound": "comp"}
_SOURCE = {
    "weight amplification": "weight-amp",
    "batch subdivision": "batch-subdiv",
    "padding": "padding",
    "straggler": "straggler",
    "communication": "comm",
    "ancillary": "ancillary",
    "DP replication": "DP-repl",
    "none": "-",
}


def shipped_calibrations() -> list[Calibration]:
    """The calibration files shipped with moekit (``moekit/tax/calibrations/*.json``)."""
    return [load_calibration(p) for p in sorted(SHIPPED_CALIBRATIONS.glob("*.json"))]


def tax_report(
    model: str = "mixtral-8x7b",
    hardware: str = "H200",
    batch_sizes=DEFAULT_BATCH_SIZES,
    n_gpus: int = 8,
    out_dir: str | None = None,
    as_json: bool = False,
    *,
    phases=PHASES,
    parallelisms=PARALLELISMS,
    calibrations: list[Calibration] | None = None,
    **options,
) -> str:
    """The MoE-tax table (or JSON) for a preset model on preset or JSON-file hardware.

    ``calibrations``: calibrations to choose from besides the shipped ones (the one of this GPU
    kind, else the nearest, moved to it); with none, the 100 %-peak model alone.
    ``options`` go to ``TaxModel`` (e.g. ``block_size=64``, ``eta=1.25``, ``f=0.7``).
    """
    shape = tax_shape(model)
    hw = get_hardware(hardware)
    sizes = sorted({int(m) for m in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_sizes must be ints >= 1, got {batch_sizes!r}")
    tm = TaxModel(shape, hw, n_gpus, **options)
    points = tm.sweep(sizes, phases, parallelisms)
    found = nearest_calibration(hw, [*(calibrations or []), *shipped_calibrations()])
    cal_tm = cal_points = None
    notes: list[str] = []
    if found is not None:
        cal, notes = adapt_calibration(found, hw)
        cal_tm = TaxModel(shape, hw, n_gpus, calibration=cal, **options)
        cal_points = cal_tm.sweep(sizes, phases, parallelisms)
    skipped = [p for p in parallelisms if p != "TP+TP" and shape.num_experts % n_gpus]
    figures = []
    if out_dir is not None:
        from .figures import draw_all  # matplotlib only when figures are asked for

        figures = draw_all(points, shape, sizes, out_dir)

    if as_json:
        return json.dumps(
            {
                "model": shape.name,
                "hardware": {"name": hw.name, "hbm_bw": hw.hbm_bw, "peak_flops": hw.peak_flops,
                             "net_bw": hw.net_bw, "net_latency": hw.net_latency, "sources": hw.sources},
                "n_gpus": n_gpus,
                "skipped_parallelisms": skipped,
                "figures": figures,
                "points": [p.as_dict() for p in points],
                "calibration": None if cal_tm is None else {"name": cal_tm.calibration.name, "notes": notes},
                "points_calibrated": None if cal_points is None else [p.as_dict() for p in cal_points],
            },
            indent=2,
        )
    return _format(tm, points, phases, [p for p in parallelisms if p not in skipped], skipped, figures,
                   cal_tm, cal_points, notes)


def _format(tm: TaxModel, points, phases, parallelisms, skipped, figures, cal_tm=None, cal_points=None,
            notes=()) -> str:
    shp = tm.shape
    lines = [
        f"MoE tax: {shp.name} (E={shp.num_experts}, K={shp.top_k}, H={shp.hidden}, N={shp.intermediate}"
        + (f", {shp.num_shared_experts} shared" if shp.num_shared_experts else "")
        + f") on {tm.n} x {tm.hw.describe()}",
    ]
    if cal_tm is None:
        lines += [
            "tau = T(MoE) / T(DenseFA) per layer (the MoE-tax paper, eqs. 1-7) at 100 % of the HBM and matmul peaks; "
            "regime: mem = memory-bound, trans = transition, comp = compute-bound; source = largest share of tau - 1",
            "no calibration for this GPU (run `moekit tax calibrate` on it, or give --hardware-file): the 100 %-peak "
            "bound only",
        ]
    else:
        lines += [
            "tau = T(MoE) / T(DenseFA) per layer; each cell: calibrated tau, the 100 %-peak tau (the paper's bound, "
            "eqs. 1-7), then the calibrated model's regime (mem = memory-bound, trans = transition, comp = "
            "compute-bound) and largest share of tau - 1",
            f"calibrated model: {cal_tm.calibration.name}",
            *[f"  {note}" for note in notes],
            "  not calibrated (both models): attention (T_other, a roofline at the peaks), the network (alpha-beta "
            "with the numbers above)",
        ]
    if skipped:
        lines.append(f"skipped {', '.join(skipped)}: {tm.n} GPUs do not divide {shp.num_experts} experts")
    by_key = {(p.phase, p.parallelism, p.m): p for p in points}
    cal_key = {(p.phase, p.parallelism, p.m): p for p in cal_points or []}
    sizes = sorted({p.m for p in points})
    cell = 28 if cal_tm is None else 34
    for phase in phases:
        lines.append("")
        lines.append(f"{phase}")
        pa, pa_w = ("DensePA", 7) if cal_tm is None else ("DensePA cal/peak", 16)
        header = f"{'m':>6} {pa:>{pa_w}} |" + "|".join(f" {par:<{cell - 1}}" for par in parallelisms)
        lines.append(header)
        lines.append("-" * len(header))
        for m in sizes:
            ref = next((by_key[(phase, par, m)] for par in parallelisms if (phase, par, m) in by_key), None)
            if ref is None:
                continue
            cells = []
            for par in parallelisms:
                p, c = by_key.get((phase, par, m)), cal_key.get((phase, par, m))
                if p is None:
                    text = ""
                elif c is None:
                    text = f"{p.tau:5.2f} {_REGIME[p.regime]:<5} {_SOURCE.get(p.dominant, p.dominant)}"
                else:
                    text = f"{c.tau:5.2f} {p.tau:5.2f} {_REGIME[c.regime]:<5} {_SOURCE.get(c.dominant, c.dominant)}"
                cells.append(f" {text:<{cell - 1}}")
            cref = cal_key.get((ref.phase, ref.parallelism, m))
            pa_text = f"{ref.tau_densepa:.2f}" if cref is None else f"{cref.tau_densepa:.2f} / {ref.tau_densepa:.2f}"
            lines.append(f"{m:>6} {pa_text:>{pa_w}} |" + "|".join(cells))
    if figures:
        lines.append("")
        lines.append("figures: " + ", ".join(figures))
    return "\n".join(lines)
