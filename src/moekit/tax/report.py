"""``moekit tax``: the model's predictions for one preset model on one GPU type, as text.

``tax_report`` returns what the command prints: per phase, tau for every batch size and
parallelism, with the regime and the dominant tax source (the largest share of tau - 1).
``as_json=True`` returns every number instead; ``out_dir`` also draws the paper's figures.
"""

from __future__ import annotations

import json

from ..shapes import get_shape
from .hardware import get_hardware
from .model import PARALLELISMS, PHASES, TaxModel

DEFAULT_BATCH_SIZES = tuple(2**i for i in range(13))  # 1 .. 4096

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
    **options,
) -> str:
    """The MoE-tax table (or JSON) for a preset model on preset or JSON-file hardware.

    ``options`` go to ``TaxModel`` (e.g. ``block_size=64``, ``eta=1.25``, ``f=0.7``).
    """
    shape = get_shape(model)
    hw = get_hardware(hardware)
    sizes = sorted({int(m) for m in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_sizes must be ints >= 1, got {batch_sizes!r}")
    tm = TaxModel(shape, hw, n_gpus, **options)
    points = tm.sweep(sizes, phases, parallelisms)
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
            },
            indent=2,
        )
    return _format(tm, points, phases, [p for p in parallelisms if p not in skipped], skipped, figures)


def _format(tm: TaxModel, points, phases, parallelisms, skipped, figures) -> str:
    shp = tm.shape
    lines = [
        f"MoE tax: {shp.name} (E={shp.num_experts}, K={shp.top_k}, H={shp.hidden}, N={shp.intermediate}"
        + (f", {shp.num_shared_experts} shared" if shp.num_shared_experts else "")
        + f") on {tm.n} x {tm.hw.describe()}",
        "tau = T(MoE) / T(DenseFA) per layer (the MoE-tax paper, eqs. 1-7); regime: mem = memory-bound, "
        "trans = transition, comp = compute-bound; source = largest share of tau - 1",
    ]
    if skipped:
        lines.append(f"skipped {', '.join(skipped)}: {tm.n} GPUs do not divide {shp.num_experts} experts")
    by_key = {(p.phase, p.parallelism, p.m): p for p in points}
    sizes = sorted({p.m for p in points})
    cell = 28
    for phase in phases:
        lines.append("")
        lines.append(f"{phase}")
        header = f"{'m':>6} {'DensePA':>7} |" + "|".join(f" {par:<{cell - 1}}" for par in parallelisms)
        lines.append(header)
        lines.append("-" * len(header))
        for m in sizes:
            ref = next((by_key[(phase, par, m)] for par in parallelisms if (phase, par, m) in by_key), None)
            if ref is None:
                continue
            cells = []
            for par in parallelisms:
                p = by_key.get((phase, par, m))
                text = "" if p is None else f"{p.tau:5.2f} {_REGIME[p.regime]:<5} {_SOURCE.get(p.dominant, p.dominant)}"
                cells.append(f" {text:<{cell - 1}}")
            lines.append(f"{m:>6} {ref.tau_densepa:>7.2f} |" + "|".join(cells))
    if figures:
        lines.append("")
        lines.append("figures: " + ", ".join(figures))
    return "\n".join(lines)
