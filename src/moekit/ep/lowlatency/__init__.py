"""The low-latency expert-parallel layer: fixed double-buffered receive buffers,
one copy of a token per destination rank, online FP8, per-phase traces.

Importing this package needs neither CUDA nor Triton: the GPU transport
(``moekit.ep.lowlatency.cuda``) is imported only when a layer is made on a CUDA device.
"""

from moekit.ep.lowlatency.api import EPLowLatencyAllToAll, LowLatencyDispatched, LowLatencyHandle, make_transport
from moekit.ep.lowlatency.gloo import GlooTransport
from moekit.ep.lowlatency.layout import (LowLatencyLayout, LowLatencyMeta, RecvBuffers, destinations, fan_out,
                                         postprocess, topk_reduce)
from moekit.ep.lowlatency.transport import COMBINE_PHASES, DISPATCH_PHASES, Transport, TransportDefaults

__all__ = [
    "COMBINE_PHASES", "DISPATCH_PHASES", "EPLowLatencyAllToAll", "GlooTransport", "LowLatencyDispatched",
    "LowLatencyHandle", "LowLatencyLayout", "LowLatencyMeta", "RecvBuffers", "Transport", "TransportDefaults",
    "destinations", "fan_out", "make_transport", "postprocess", "topk_reduce",
]
