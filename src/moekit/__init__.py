"""moekit: fast expert-parallel Mixture-of-Experts inference.

The data path (see docs/architecture.md): Router -> Dispatcher.dispatch -> expert compute ->
Dispatcher.combine. ``moekit.shapes`` holds model shapes, ``moekit.routing`` synthetic and
recorded routing, ``moekit.moe`` the reference MoE layer, ``moekit.ep`` expert parallelism.
"""

from moekit.shapes import PRESETS, MoEShape, get_shape

__version__ = "0.1.0"
__all__ = ["MoEShape", "PRESETS", "get_shape", "__version__"]
