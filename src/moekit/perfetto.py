"""Per-phase timestamps as Chrome trace JSON, which https://ui.perfetto.dev (and
chrome://tracing) opens.

The format (the "Trace Event Format"): a JSON object ``{"traceEvents": [...], ...}``; each
phase of each call is one complete event ``{"ph": "X", "name", "ts", "dur", "pid", "tid"}``
with ``ts``/``dur`` in microseconds. Here ``pid`` is the rank and ``tid`` the call type
(0 = dispatch, 1 = combine), named by metadata events (``"ph": "M"``) so the UI shows
"rank 0 / dispatch". Timestamps stay on the recording clock (not shifted to zero), so
the traces of several ranks that share a clock can be merged (:func:`merge_traces`) and
shown on one timeline.

Loading (:func:`load_trace`) uses ``json`` only and checks the structure; a malformed file
raises ValueError naming the file.

This module imports nothing else of moekit: the low-latency layer writes its traces with it
(``dump_dispatch_trace``), and the benchmarks read them back (``moekit.bench.lowlatency``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from moekit.jsonfile import read_json


def phase_events(stamps: Iterable[torch.Tensor], phases: Sequence[str], *, pid: int, tid: int,
                 thread_name: str, process_name: str | None = None) -> list[dict]:
    """Events for a series of calls; ``stamps``: one int64 ``[len(phases), 2]`` (start, end ns)
    tensor per call, as the low-latency layer records them. Phases still at -1 (not run)
    are left out; a phase whose end precedes its start gets duration 0."""
    events = [{"name": "process_name", "ph": "M", "pid": pid, "tid": tid,
               "args": {"name": process_name or f"rank {pid}"}},
              {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread_name}}]
    for call, s in enumerate(stamps):
        s = torch.as_tensor(s).to(torch.int64).cpu()
        if tuple(s.shape) != (len(phases), 2):
            raise ValueError(f"stamps of call {call} must be [{len(phases)}, 2] (one (start, end) per phase "
                             f"{list(phases)}), got {tuple(s.shape)}")
        for name, (start, end) in zip(phases, s.tolist()):
            if start < 0 or end < 0:
                continue
            events.append({"name": name, "cat": thread_name, "ph": "X", "ts": start / 1e3,
                           "dur": max(end - start, 0) / 1e3, "pid": pid, "tid": tid, "args": {"call": call}})
    return events


def trace_document(events: list[dict], metadata: dict | None = None) -> dict:
    """The JSON object of a trace file: the events plus free-form ``otherData``."""
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": dict(metadata or {})}


def write_trace(path: str | Path, document: dict) -> Path:
    """Write a trace document (making the parent directory); returns the path."""
    check_trace(document, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))
    return path


def load_trace(path: str | Path) -> dict:
    """Read a trace written by :func:`write_trace` (json only, never code), checked."""
    document = read_json(path, "a trace file")
    check_trace(document, str(path))
    return document


def check_trace(document, where: str = "trace") -> None:
    """Raise ValueError (naming ``where``) unless ``document`` is a well-formed trace."""
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise ValueError(f"{where}: a trace must be a JSON object with a 'traceEvents' list")
    for i, event in enumerate(document["traceEvents"]):
        if not isinstance(event, dict) or event.get("ph") not in ("X", "M"):
            raise ValueError(f"{where}: event {i} must be an object with ph 'X' or 'M', got {event!r}")
        for key in ("name", "pid", "tid"):
            if key not in event:
                raise ValueError(f"{where}: event {i} lacks {key!r}")
        if not isinstance(event["pid"], int) or not isinstance(event["tid"], int):
            raise ValueError(f"{where}: event {i} must have integer pid and tid")
        if event["ph"] == "X":
            for key in ("ts", "dur"):
                if not isinstance(event.get(key), (int, float)) or isinstance(event.get(key), bool):
                    raise ValueError(f"{where}: event {i} needs a numeric {key!r} (µs)")
            if event["dur"] < 0:
                raise ValueError(f"{where}: event {i} has a negative duration")


def merge_traces(paths: Sequence[str | Path], out: str | Path) -> Path:
    """One trace holding the events of several (e.g. one per rank)."""
    events: list[dict] = []
    other: dict = {"merged_from": [str(p) for p in paths]}
    for p in paths:
        events += load_trace(p)["traceEvents"]
    return write_trace(out, trace_document(events, other))


def phase_durations(document: dict) -> dict[str, list[float]]:
    """``{phase name: [duration µs per call]}`` of a trace's complete events (for reports)."""
    out: dict[str, list[float]] = {}
    for event in document["traceEvents"]:
        if event["ph"] == "X":
            out.setdefault(event["name"], []).append(float(event["dur"]))
    return out
