"""RaMP's routing-aware kernel cost model as the tax model's cost of the expert kernel.

Where a RaMP model file (``moekit.ramp.modelfile``: per GPU kind, precision and shape) covers the
MoE shape on this GPU, its predicted time of the configuration it would choose for the routing
(the least predicted over its configurations) replaces the calibrated grouped-GEMM curve in
``moekit.tax.calibrated`` for that call. ``moekit.tax`` itself stays a pure model: it takes the
cost as a function (``TaxModel(kernel_cost=...)``); this module builds that function.

Model files are looked up where ``moekit ramp`` looks (``MOEKIT_RAMP_MODELS``, then the files
shipped with moekit). A file that does not load (damaged, another kernel version's configs) is
skipped with its reason, and the curve is used. A fitted model is used only for the token counts
its profile measured completely (up to the largest of its ``m_values`` that timed every
config): past that it would be an extrapolation, and the curve prices the call.
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

    try:
        path = find_model(shape, gpu, dtype, "token")
    except ValueError as exc:  # a precision RaMP has no model files for (float32, say)
        return None, None, f"no RaMP model for {dtype} ({exc}): grouped-kernel curve"
    if path is None:
        return None, None, f"no RaMP model file for {shape.name} on {gpu} ({dtype}): grouped-kernel curve"
    try:
        model, meta = load_model(path, shape=shape, gpu=gpu, dtype=dtype, family="token")
    except ValueError as exc:
        return None, None, f"RaMP model file skipped ({exc}): grouped-kernel curve"
    e = shape.num_experts
    covered = covered_tokens(meta.get("profile", {}))

    def cost(counts, tokens: int) -> float | None:
        counts = np.asarray(counts)
        if counts.shape != (e,) or tokens < 1 or (covered is not None and tokens > covered):
            return None
        pred = model.predict(counts, int(tokens))
        best = float(np.nanmin(pred)) if np.isfinite(pred).any() else math.nan
        return best * 1e-6 if math.isfinite(best) and best > 0 else None

    reach = f" (m <= {covered}; the curve beyond)" if covered is not None else ""
    return cost, f"RaMP model {path.name}", f"expert kernel: RaMP model {path} where it covers the routing{reach}"


def covered_tokens(profile: dict) -> int | None:
    """The largest token count a model file's profile timed every config at (its ``m_values``
    less those listed ``incomplete``); None when the file does not say (then no limit)."""
    values = profile.get("m_values")
    if not values:
        return None
    partial = {item.get("M") for item in profile.get("incomplete", []) if isinstance(item, dict)}
    complete = [int(v) for v in values if v not in partial]
    return max(complete) if complete else 0
