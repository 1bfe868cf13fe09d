"""The `moekit` subcommands, one module each.

Every module here has ``register(sub)``, which adds its parser(s) to the top-level
subparsers and binds each to a ``run(args) -> int`` function. Modules import the library
lazily, inside ``run``, so that ``moekit --help`` stays fast and works without Triton.
"""

from __future__ import annotations

# The order is the order of ``moekit --help``.
MODULES = ("demo", "trace", "bench", "tax", "ramp", "dice", "lm")


def check_int(flag: str, value, low: int, high: int | None = None) -> None:
    """ValueError naming the option ``flag`` (e.g. ``--tokens``) and its range, unless ``value``
    is None (not given) or an int in [low, high]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
        raise ValueError(f"{flag} must be {allowed}, got {value!r}")
