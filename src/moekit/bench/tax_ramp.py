"""RaMP's routing-aware kernel cost model as the tax model's cost of the expert kernel.

Where a RaMP model file (``moekit.ramp.modelfile``: per GPU kind, precision and shape) covers the
MoE shape on this GPU, its predicted time of the configuration it would choose for the routing
(the least predicted over its configurations) replaces the calibrated grouped-GEMM curve in
``moekit.tax.calibrated`` for that call. ``moekit.tax`` itself stays a pure model: it takes the
cost as a function (``TaxModel(kernel_cost=...)``); this module builds that function.

Model files are looked up where ``moekit ramp`` looks (``MOEKIT_RAMP_MODELS``, then the files
shipped with moekit). A file that does not load (damaged, another kernel version's configs) is
skipped with its reason, and the curve is used.
"""

from __future__ import annotations

import math

import numpy as np

from moekit.shapes import MoEShape


def ramp_kernel_cost(shape: MoEShape, gpu: str, dtype: str = "bfloat16"):
    """(cost, name, note): ``cost(counts [E], tokens) -> seconds | None`` from the RaMP model file
    for ``shape``'s dimensions on GPU kind ``gpu`` (``h100``, ``h200``), its name for the report,
    and a line saying what was found; (None, None, note) when there is no usable file."""
    from moekit.ramp.modelfile import find_model, load_model

    path = find_model(shape, gpu, dtype, "token")
    if path is None:
        return None, None, f"no RaMP model file for {shape.name} on {gpu} ({dtype}): grouped-kernel curve"
    try:
        model, _ = load_model(path, shape=shape, gpu=gpu, dtype=dtype, family="token")
    except ValueError as exc:
        return None, None, f"RaMP model file skipped ({exc}): grouped-kernel curve"
    e = shape.num_experts

    def cost(counts, tokens: int) -> float | None:
        counts = np.asarray(counts)
        if counts.shape != (e,) or tokens < 1:
            return None
        pred = model.predict(counts, int(tokens))
        best = float(np.nanmin(pred)) if np.isfinite(pred).any() else math.nan
        return best * 1e-6 if math.isfinite(best) and best > 0 else None

    return cost, f"RaMP model {path.name}", f"expert kernel: RaMP model {path} where it covers the routing"
