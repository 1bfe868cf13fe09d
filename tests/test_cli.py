"""The command line end to end on CPU (small sizes)."""

from __future__ import annotations

import json

import pytest

from moekit.cli import main


def test_demo_json_passes(capsys):
    assert main(["demo", "--world-size", "2", "--tokens", "16", "--steps", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checks"]["roundtrip_bitwise"] is True
    assert report["checks"]["passed"] is True
    assert len(report["ranks"]) == 2
    # Every (token, expert) pair is sent exactly once: rows sent = tokens * K (no masked slots).
    for rank in report["ranks"]:
        assert sum(rank["rows_sent_per_dest"]) == 16 * report["config"]["shape"]["top_k"]
    # Traffic per rank agrees with the per-peer counts of the routing (computed independently).
    peers = report["routing"]["peer_counts_step0"]
    for i, rank in enumerate(report["ranks"]):
        assert rank["rows_sent_per_dest"] == peers[i]
        assert rank["rows_received_per_src"] == [row[i] for row in peers]


def test_demo_text_report(capsys):
    assert main(["demo", "--world-size", "2", "--tokens", "8", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "Verdict: PASS" in out and "bitwise" in out


def test_bad_world_size_is_a_clear_error(capsys):
    assert main(["demo", "--world-size", "3"]) == 2
    assert "world_size must divide" in capsys.readouterr().err


def test_trace_generate_and_stats(tmp_path, capsys):
    path = tmp_path / "t.npz"
    assert main(["trace", "generate", str(path), "--steps", "4", "--layers", "2"]) == 0
    assert main(["trace", "stats", str(path), "--capacity", "16", "--json"]) == 0
    out = capsys.readouterr().out
    stats = json.loads(out[out.index("{"):])
    assert stats  # content is checked in tests/routing


def test_trace_stats_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not an npz")
    assert main(["trace", "stats", str(bad)]) == 2
    assert "bad.npz" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["directory", "corrupt compressed member", "flipped byte of a stored member",
                                  "member is not an npy", "truncated zip", "missing topk_ids", "float ids",
                                  "object array", "empty file"])
def test_trace_stats_malformed_file_is_one_line(tmp_path, capsys, case):
    """Each malformed trace: exit 2 and one line on stderr naming the file, no traceback."""
    from tests.routing.test_routing_trace import MALFORMED

    write, _ = MALFORMED[case]
    path = tmp_path / f"{case.replace(' ', '_')}.npz"
    write(path)
    assert main(["trace", "stats", str(path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moekit: error: ") and str(path) in lines[0], captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_trace_stats_missing_file_is_one_line(tmp_path, capsys):
    assert main(["trace", "stats", str(tmp_path / "nope.npz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.npz" in err[0]
