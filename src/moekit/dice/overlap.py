"""How much of the communication in a profiler trace ran at the same time as compute.

Reads a Chrome / Perfetto trace written by ``torch.profiler`` (``export_chrome_trace``) of
one rank and answers one question: of the time the transfers ran, which fraction had
compute running beside them?

* On a GPU the transfers are the kernels that move data between ranks: NCCL's kernels
  and the low-latency layer's dispatch / combine kernels (by name). Compute is every
  other kernel on the compute stream: the stream whose non-transfer kernels ran longest
  (the sampler's stream, where the model runs). Kernels on other streams — the packing
  and unpacking an executor queues on its communication stream around a transfer — count
  as neither, so what is reported hidden is the exchange time during which the model's
  own work ran on the other stream. A transfer kernel on the compute stream itself (a
  synchronous layer's) is never beside compute: it counts as exposed.
* On a CPU (gloo) there are no kernels: the transfers are gloo's own ``gloo:...`` spans
  (gloo's threads), compute is the operators of the thread with the most operators,
  without the collectives' own host operators (``c10d::...``) and what runs inside them.

A transfer kernel spans from its launch until its peer has sent or received, so its time
includes waiting for the peer: the fraction says how much of that span was hidden, not
how fast the wire was.
"""

from __future__ import annotations

import re
from collections import Counter

TRANSFER_KERNEL = re.compile(r"nccl|_dispatch_kernel|_combine_kernel", re.IGNORECASE)
TRANSFER_HOST = re.compile(r"^(gloo|nccl):", re.IGNORECASE)
COLLECTIVE_HOST = re.compile(r"^(c10d::|gloo:|nccl:|record_param_comms)", re.IGNORECASE)


def union(intervals) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint intervals."""
    merged: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals) -> float:
    return sum(e - s for s, e in union(intervals))


def intersection_length(a, b) -> float:
    """Length of (union of a) ∩ (union of b)."""
    a, b = union(a), union(b)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _events(document) -> list[dict]:
    if isinstance(document, dict):
        document = document.get("traceEvents")
    if not isinstance(document, list):
        raise ValueError("a Chrome trace must be a list of events or a dict with 'traceEvents'")
    return [e for e in document if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and "dur" in e]


def _span(e: dict) -> tuple[float, float]:
    start = float(e["ts"])
    return start, start + float(e["dur"])


def _summary(kind: str, transfer, compute, **extra) -> dict:
    transfer_us, compute_us = length(transfer), length(compute)
    overlap_us = intersection_length(transfer, compute)
    return dict(kind=kind, transfer_ms=transfer_us / 1e3, compute_ms=compute_us / 1e3, overlap_ms=overlap_us / 1e3,
                overlap_fraction=overlap_us / transfer_us if transfer_us > 0 else None, **extra)


def trace_overlap(document) -> dict:
    """``overlap_fraction``: the share of the transfers' time (union of their spans) during
    which compute ran (see the module docstring); None when the trace holds no transfer.
    Also ``transfer_ms``, ``compute_ms``, ``overlap_ms``, ``kind`` ("gpu" or "cpu") and
    the counts of spans each side had."""
    events = _events(document)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:
        return _gpu_overlap(events, kernels)
    return _cpu_overlap(events)


def _stream(kernel: dict):
    return kernel.get("args", {}).get("stream", kernel.get("tid"))


def _gpu_overlap(events: list[dict], kernels: list[dict]) -> dict:
    transfer = [k for k in kernels if TRANSFER_KERNEL.search(k.get("name", ""))]
    others = [k for k in kernels if not TRANSFER_KERNEL.search(k.get("name", ""))]
    busy: Counter = Counter()
    for k in others:
        busy[_stream(k)] += float(k["dur"])
    main = busy.most_common(1)[0][0] if busy else None
    compute = [k for k in others if _stream(k) == main]
    streams = sorted({_stream(k) for k in transfer}, key=str)
    spans = [_span(k) for k in compute]
    # Per transfer stream (one per communicator): a schedule whose synchronous layers use one
    # communicator and whose stale exchanges use another shows each part's share apart.
    by_stream = {}
    for stream in streams:
        mine = [_span(k) for k in transfer if _stream(k) == stream]
        total = length(mine)
        by_stream[str(stream)] = dict(transfer_ms=total / 1e3, overlap_ms=intersection_length(mine, spans) / 1e3,
                                      overlap_fraction=intersection_length(mine, spans) / total if total else None)
    return _summary("gpu", [_span(k) for k in transfer], spans,
                    compute_is="non-transfer kernels on the stream whose non-transfer kernels ran longest",
                    compute_stream=main, transfer_spans=len(transfer), compute_spans=len(compute),
                    transfer_streams=streams, by_stream=by_stream)


def _cpu_overlap(events: list[dict]) -> dict:
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    transfer = [e for e in events if TRANSFER_HOST.search(e.get("name", ""))]
    threads = Counter(e.get("tid") for e in ops if not COLLECTIVE_HOST.search(e.get("name", "")))
    compute = []
    if threads:
        main = threads.most_common(1)[0][0]
        mine = [e for e in ops if e.get("tid") == main]
        collectives = [_span(e) for e in mine if COLLECTIVE_HOST.search(e.get("name", ""))]
        for e in mine:
            s, t = _span(e)
            if not COLLECTIVE_HOST.search(e.get("name", "")) and not any(a <= s and t <= b for a, b in collectives):
                compute.append((s, t))
    return _summary("cpu", [_span(e) for e in transfer], compute,
                    compute_is="operators of the thread with the most operators, outside collectives",
                    transfer_spans=len(transfer), compute_spans=len(compute))
