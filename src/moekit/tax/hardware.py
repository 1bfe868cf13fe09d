"""Hardware parameters of the MoE-tax model (the MoE-tax paper, section 5).

The model needs four numbers per GPU: HBM bandwidth, peak dense FLOP/s, the effective
network (NVLink) bandwidth of one GPU, and a fixed latency per network message. All
values are SI units (bytes/s, FLOP/s, seconds) so that nothing is ever off by 1e9.

Presets say where each number comes from (``sources``): a datasheet, a measurement on
our machines (docs/foundation.md), the paper itself, or an assumption. Measured
values can replace any of them through a JSON file, read with ``json`` only (no code
is ever executed while loading).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace

from moekit.jsonfile import read_json

from .gpus import DATASHEET, MAX_SMS, gpu_key  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class Hardware:
    """One GPU (and its link to its peers) as the tax model sees it."""

    name: str
    hbm_bw: float  # bytes/s, BW_HBM
    peak_flops: float  # FLOP/s, dense bf16 matmul
    net_bw: float  # bytes/s per GPU and direction, BW_net
    net_latency: float  # seconds per peer message (the alpha of an alpha-beta model)
    sources: dict = field(default_factory=dict, compare=False)  # field -> where it came from
    sms: int | None = None  # streaming multiprocessors (wave quantization of the calibrated model); None: unknown

    def __post_init__(self) -> None:
        if self.sms is not None and (isinstance(self.sms, bool) or not isinstance(self.sms, int)
                                     or not 1 <= self.sms <= MAX_SMS):
            raise ValueError(f"Hardware.sms must be None or an int >= 1 and <= {MAX_SMS}, got {self.sms!r}")
        for name in ("hbm_bw", "peak_flops", "net_bw"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"Hardware.{name} must be a finite number > 0, got {value!r}")
        lat = self.net_latency
        if not _is_number(lat) or not math.isfinite(lat) or lat < 0:
            raise ValueError(f"Hardware.net_latency must be a finite number >= 0, got {lat!r}")

    def describe(self) -> str:
        """One line with the four numbers in human units (and where each came from)."""
        src = self.sources or {}

        def tag(key: str) -> str:
            return f" [{src[key]}]" if key in src else ""

        return (
            f"{self.name}: HBM {self.hbm_bw / 1e12:.2f} TB/s{tag('hbm_bw')}, "
            f"{self.peak_flops / 1e12:.0f} TFLOP/s{tag('peak_flops')}, "
            f"net {self.net_bw / 1e9:.0f} GB/s{tag('net_bw')}, "
            f"{self.net_latency * 1e6:.1f} us/msg{tag('net_latency')}"
        )


def _is_number(value) -> bool:
    # bool is an int in Python; a JSON `true` must not pass as a bandwidth. An int past the
    # range of a float (JSON has no bound on digits) is not a number the model can use.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _show(value) -> str:
    """``repr(value)``, shortened: a message about a file stays one readable line."""
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


# Per-message latency: no per-message figure has been measured (NCCL's time per all_to_all
# call is a per-call software floor, not a link latency), so all presets assume 1 us, the
# order of an NVLink peer write. Override it with a JSON file.
_ASSUMED_LATENCY = 1e-6

PRESETS: dict[str, Hardware] = {
    hw.name: hw
    for hw in (
        Hardware(
            "A100", hbm_bw=1.5e12, peak_flops=312e12, net_bw=300e9, net_latency=_ASSUMED_LATENCY,
            sources={
                "hbm_bw": "MoE-tax paper, section 5.3", "peak_flops": "MoE-tax paper, section 5.3",
                "net_bw": "datasheet NVLink3, one direction", "net_latency": "assumed",
            },
            sms=108,
        ),
        Hardware(
            "H100", hbm_bw=3.0e12, peak_flops=989e12, net_bw=450e9, net_latency=_ASSUMED_LATENCY,
            sources={
                "hbm_bw": "measured, HBM copy", "peak_flops": "datasheet SXM dense bf16",
                "net_bw": "datasheet NVLink4, one direction", "net_latency": "assumed",
            },
            sms=132,
        ),
        Hardware(
            "H200", hbm_bw=4.3e12, peak_flops=790e12, net_bw=372e9, net_latency=_ASSUMED_LATENCY,
            sources={
                "hbm_bw": "measured, HBM copy", "peak_flops": "measured, bf16 matmul",
                "net_bw": "measured, NVLink peer copy", "net_latency": "assumed",
            },
            sms=132,
        ),
        Hardware(
            "B200", hbm_bw=8.0e12, peak_flops=2250e12, net_bw=900e9, net_latency=_ASSUMED_LATENCY,
            sources={
                "hbm_bw": "datasheet", "peak_flops": "datasheet dense bf16",
                "net_bw": "datasheet NVLink5, one direction", "net_latency": "assumed",
            },
            sms=148,
        ),
    )
}

_NUMERIC_KEYS = ("hbm_bw", "peak_flops", "net_bw", "net_latency")

def load_hardware(path: str | os.PathLike) -> Hardware:
    """Read hardware parameters from a JSON object.

    Keys: ``name`` (str), ``base`` (optional preset name whose values fill the gaps) and
    any of ``hbm_bw`` (bytes/s), ``peak_flops`` (FLOP/s), ``net_bw`` (bytes/s),
    ``net_latency`` (s). Every value given is marked "measured, <file>" in ``sources``.
    A calibration file (``moekit tax calibrate``) is read too: its measured ceilings.
    Anything malformed raises ValueError naming the file.
    """
    path = os.fspath(path)
    data = read_json(path, "hardware file")  # plain JSON: no code can run while loading
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") is not None:  # a calibration file (`moekit tax calibrate`): its measured ceilings
        from .efficiency import calibration_from_dict

        return calibration_hardware(calibration_from_dict(data, path))

    unknown = set(data) - {"name", "base", "sms", *_NUMERIC_KEYS}
    if unknown:
        raise ValueError(f"{path}: unknown keys {_show(sorted(unknown))}; allowed: name, base, sms, "
                         f"{', '.join(_NUMERIC_KEYS)}")

    base_name = data.get("base")
    if base_name is not None:
        if not isinstance(base_name, str) or base_name not in PRESETS:
            raise ValueError(f"{path}: base {_show(base_name)} is not a preset ({', '.join(PRESETS)})")
        values = {f.name: getattr(PRESETS[base_name], f.name) for f in fields(Hardware)}
        values["sources"] = dict(PRESETS[base_name].sources)
    else:
        missing = [k for k in _NUMERIC_KEYS if k not in data]
        if missing:
            raise ValueError(f"{path}: missing keys {missing} (or give a 'base' preset)")
        values = {"sources": {}}

    name = data.get("name", f"{base_name or 'custom'} ({os.path.basename(path)})")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{path}: 'name' must be a non-empty string")
    values["name"] = name
    for key in _NUMERIC_KEYS:
        if key in data:
            value = data[key]
            if not _is_number(value):
                raise ValueError(f"{path}: {key} must be a number, got {_show(value)}")
            values[key] = float(value)
            values["sources"][key] = f"measured, {os.path.basename(path)}"
    if "sms" in data:
        values["sms"] = data["sms"]  # checked by Hardware
    try:
        return Hardware(**values)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def calibration_hardware(cal) -> Hardware:
    """The four numbers of the 100 %-peak model from a calibration's measured ceilings."""
    ceilings = cal.sources.get("ceilings", "calibration")
    network = cal.sources.get("network", "calibration file")
    return Hardware(cal.name, cal.hbm_bw, cal.peak_flops, cal.net_bw, cal.net_latency,
                    sources={"hbm_bw": ceilings, "peak_flops": ceilings, "net_bw": network, "net_latency": network},
                    sms=cal.sms)


def get_hardware(spec: str | os.PathLike | Hardware) -> Hardware:
    """A preset by name (case-insensitive), a JSON file path, or a Hardware as is."""
    if isinstance(spec, Hardware):
        return spec
    text = os.fspath(spec)
    for name, hw in PRESETS.items():
        if text.lower() == name.lower():
            return hw
    if text.endswith(".json") or os.path.exists(text):
        return load_hardware(text)
    raise ValueError(f"unknown hardware {text!r}; presets: {', '.join(PRESETS)} (or a .json file)")


def with_overrides(hw: Hardware, **changes) -> Hardware:
    """A copy with some numbers replaced (e.g. measured ones), marked as overridden."""
    sources = dict(hw.sources)
    for key in changes:
        if key in _NUMERIC_KEYS:
            sources[key] = "override"
    return replace(hw, sources=sources, **changes)
