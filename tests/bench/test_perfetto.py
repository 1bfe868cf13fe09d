"""Chrome/Perfetto trace JSON: events from stamps, write, load back with json, reject bad files."""

from __future__ import annotations

import json

import pytest
import torch

from moekit.bench.perfetto import (load_trace, merge_traces, phase_durations, phase_events, trace_document,
                                   write_trace)

PHASES = ("a", "b", "c")


def _stamps(start_ns: int, durations_ns: list[int]) -> torch.Tensor:
    s, t = [], start_ns
    for d in durations_ns:
        s.append([t, t + d])
        t += d + 10
    return torch.tensor(s, dtype=torch.int64)


def test_events_write_and_load(tmp_path):
    calls = [_stamps(1_000_000, [2000, 500, 1500]), _stamps(2_000_000, [1000, 3000, 0])]
    calls[1][2] = -1  # phase c of call 1 never ran: left out
    events = phase_events(calls, PHASES, pid=3, tid=1, thread_name="combine")
    path = write_trace(tmp_path / "deep" / "t.json", trace_document(events, {"rank": 3}))
    doc = json.loads(path.read_text())
    assert doc == load_trace(path)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"], e["args"]["call"]) for e in spans] == [
        ("a", 1000.0, 2.0, 0), ("b", 1002.01, 0.5, 0), ("c", 1002.52, 1.5, 0),
        ("a", 2000.0, 1.0, 1), ("b", 2001.01, 3.0, 1)]
    assert all(e["pid"] == 3 and e["tid"] == 1 for e in doc["traceEvents"])
    assert {e["name"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"} == {
        "process_name": "rank 3", "thread_name": "combine"}
    assert doc["otherData"] == {"rank": 3}
    assert phase_durations(doc) == {"a": [2.0, 1.0], "b": [0.5, 3.0], "c": [1.5]}


def test_merge(tmp_path):
    paths = [write_trace(tmp_path / f"r{r}.json", trace_document(
        phase_events([_stamps(10_000 * r, [100, 100, 100])], PHASES, pid=r, tid=0, thread_name="dispatch")))
        for r in range(2)]
    merged = load_trace(merge_traces(paths, tmp_path / "all.json"))
    assert sorted({e["pid"] for e in merged["traceEvents"]}) == [0, 1]
    assert len([e for e in merged["traceEvents"] if e["ph"] == "X"]) == 6


def test_bad_stamps_and_bad_files(tmp_path):
    with pytest.raises(ValueError, match=r"must be \[3, 2\]"):
        phase_events([torch.zeros(2, 2, dtype=torch.int64)], PHASES, pid=0, tid=0, thread_name="x")
    bad = {"not json": "{", "no events": "{}", "bad ph": '{"traceEvents": [{"ph": "B", "name": "a", "pid": 0, '
           '"tid": 0}]}', "no ts": '{"traceEvents": [{"ph": "X", "name": "a", "pid": 0, "tid": 0, "dur": 1}]}',
           "negative": '{"traceEvents": [{"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": 1, "dur": -1}]}',
           "string pid": '{"traceEvents": [{"ph": "M", "name": "a", "pid": "0", "tid": 0}]}'}
    for i, (what, text) in enumerate(bad.items()):
        path = tmp_path / f"bad{i}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=f"bad{i}.json"):
            load_trace(path)
    with pytest.raises(ValueError, match="missing.json"):
        load_trace(tmp_path / "missing.json")
