"""Argument checks shared by the expert-parallel constructors: each raises a ValueError that
names the argument and the allowed range (``True`` is not an int here, nor is ``8.0``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high] (high None: no upper bound)."""
    if not is_int(value) or value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {allowed}, got {value!r}")
    return int(value)


def check_optional_int(name: str, value: Any, low: int) -> int | None:
    """None, or an int >= low."""
    if value is None:
        return None
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be None or an int >= {low}, got {value!r}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def check_timeout(value: Any) -> float | None:
    """None (wait as long as the process group allows) or a positive number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(value)) or value <= 0:
        raise ValueError(f"timeout must be None or a positive, finite number of seconds, got {value!r}")
    return float(value)
