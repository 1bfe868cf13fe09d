"""The `moekit` subcommands, one module each.

Every module here has ``register(sub)``, which adds its parser(s) to the top-level
subparsers and binds each to a ``run(args) -> int`` function. Modules import the library
lazily, inside ``run``, so that ``moekit --help`` stays fast and works without Triton.
"""

from __future__ import annotations

# The order is the order of ``moekit --help``.
MODULES = ("demo", "trace", "bench", "tax", "ramp")
