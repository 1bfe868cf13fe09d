"""The command line end to end on CPU (small sizes)."""

from __future__ import annotations

import json


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
