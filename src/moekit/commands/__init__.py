"""The `moekit` subcommands, one module each.

Every module here has ``register(sub)``, which adds its parser(s) to the top-level
subparsers and binds each to a ``run(args) -> int`` function. Modules import the library
lazily, inside ``run``, so that ``moekit --help`` stays fast and works without Triton.
"""

from __future__ import annotations

import math

# The order is the order of ``moekit --help``.
MODULES = ("demo", "trace", "bench", "tax", "ramp", "dice", "lm")

SEED_MAX = 2**32 - 1  # the largest seed a command takes (numpy's and torch's generators take it)


def check_int(flag: str, value, low: int, high: int | None = None) -> None:
    """ValueError naming the option ``flag`` (e.g. ``--tokens``) and its range, unless ``value``
    is None (not given) or an int in [low, high]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
        raise ValueError(f"{flag} must be {allowed}, got {value!r}")


def check_float(flag: str, value, low: float | None = None, high: float | None = None, *,
                low_closed: bool = False, high_closed: bool = False) -> None:
    """ValueError naming the option ``flag`` and its range, unless ``value`` is None (not given) or a finite
    number between ``low`` and ``high`` (open bounds unless ``low_closed`` / ``high_closed``; None: no
    bound). NaN and infinities are refused: argparse's ``type=float`` takes them."""
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or (value >= low if low_closed else value > low))
    ok = ok and (high is None or (value <= high if high_closed else value < high))
    if not ok:
        if low is not None and high is not None:
            allowed = f" in {'[' if low_closed else '('}{low:g}, {high:g}{']' if high_closed else ')'}"
        elif low is not None:
            allowed = f" {'>=' if low_closed else '>'} {low:g}"
        else:
            allowed = "" if high is None else f" {'<=' if high_closed else '<'} {high:g}"
        raise ValueError(f"{flag} must be a finite number{allowed}, got {value!r}")
