"""Perfetto (Chrome trace JSON) files of per-phase timestamps: :mod:`moekit.perfetto`, under
the name the benchmarks use. The format lives outside ``moekit.bench`` because the
low-latency layer itself writes these traces, and the library does not depend on its
benchmarks."""

from moekit.perfetto import (
    check_trace,
    load_trace,
    merge_traces,
    phase_durations,
    phase_events,
    trace_document,
    write_trace,
)

__all__ = ["check_trace", "load_trace", "merge_traces", "phase_durations", "phase_events", "trace_document",
           "write_trace"]
