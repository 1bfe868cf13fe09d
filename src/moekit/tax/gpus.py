"""GPU kinds by name, and their vendor datasheet numbers.

The datasheet numbers (SXM parts; bf16 dense tensor FLOP/s, HBM bandwidth) are used only to move
a calibration from the GPU it was measured on to another one (the what-if of
``moekit.tax.efficiency.adapt_calibration``): the calibrated GPU's measured / datasheet ratio is
applied to the target's datasheet.
"""

from __future__ import annotations

MAX_SMS = 2**31 - 1  # far above any GPU: an SM count past it comes from a damaged file, not a GPU

DATASHEET = {
    "a100": {"hbm_bw": 2.039e12, "peak_flops": 312e12},  # A100 SXM 80 GB
    "h100": {"hbm_bw": 3.35e12, "peak_flops": 989e12},  # H100 SXM
    "h200": {"hbm_bw": 4.8e12, "peak_flops": 989e12},  # H200 SXM
    "b200": {"hbm_bw": 8.0e12, "peak_flops": 2250e12},  # B200 (HGX)
}


def gpu_key(name: str) -> str:
    """``a100`` / ``h100`` / ``h200`` / ``b200`` for those GPUs (any spelling of the device or
    preset name), else a lower-case slug of ``name``."""
    low = name.lower()
    for key in ("h200", "h100", "b200", "a100"):
        if key in low:
            return key
    return "-".join("".join(c if c.isalnum() else " " for c in low).split()) or "unknown"
