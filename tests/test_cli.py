"""The command line end to end on CPU (small sizes)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

import moekit
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
    assert [row["layer"] for row in stats["layers"]] == [0, 1]  # per-layer beta (tests/integrations)
    assert main(["trace", "stats", str(path)]) == 0
    assert "Per layer (beta" in capsys.readouterr().out


def test_trace_stats_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not an npz")
    assert main(["trace", "stats", str(bad)]) == 2
    assert "bad.npz" in capsys.readouterr().err


# ------------------------------------------------------------------ the front door: errors, help


def _one_error_line(err: str, *words: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moekit: error:"), err
    assert "Traceback" not in err and all(w in lines[0] for w in words), err


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"moekit {moekit.__version__}"


@pytest.mark.parametrize("argv, words", [
    (["demo", "--world-size", "0"], ["--world-size", "1, 2, 4 or 8"]),
    (["demo", "--world-size", "-2"], ["--world-size", "got -2"]),
    (["demo", "--tokens", "0"], ["--tokens", ">= 1"]),
    (["bench", "dispatch", "--tokens", "-3"], ["--tokens", ">= 1", "got -3"]),
    (["bench", "dispatch", "--world-size", "0"], ["--world-size"]),
    (["bench", "dispatch", "--iters", "0"], ["--iters"]),
    (["tax", "--gpus", "0"], ["--gpus", ">= 1"]),
])
def test_bad_options_are_one_line_naming_the_option(argv, words, capsys):
    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err, *words)


def test_trace_generate_rejects_zero_steps_and_writes_nothing(tmp_path, capsys):
    path = tmp_path / "t.npz"
    for flag in ("--steps", "--layers"):
        assert main(["trace", "generate", str(path), flag, "0"]) == 2
        _one_error_line(capsys.readouterr().err, flag, ">= 1")
    assert not path.exists()


@pytest.mark.parametrize("argv", [["bench", "kernel", "--tiny"], ["tax", "--measure", "--batch-sizes", "1"]])
def test_kernel_benchmarks_without_triton_say_so(argv, monkeypatch, tmp_path, capsys):
    """Without Triton the kernels cannot run: one line and a non-zero exit, nothing timed."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # as the kernel tests do, before the import
    kernels = pytest.importorskip("moekit.kernels")
    monkeypatch.setattr(kernels, "HAVE_TRITON", False)
    assert main(argv + ["--out-dir", str(tmp_path)]) == 2
    _one_error_line(capsys.readouterr().err, "needs Triton", "pip install")
    assert list(tmp_path.iterdir()) == []


def test_a_reader_that_stops_reading_is_no_error():
    """`moekit tax --json | head`: the pipe closes before moekit writes; no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "moekit.cli", "tax", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def _parsers():
    """Every parser of the command line, the pass-through benchmarks' own included."""
    from moekit.bench import capspill, combine_order, kernel, lowlatency
    from moekit.cli import build_parser

    todo, seen = [build_parser()], []
    while todo:
        parser = todo.pop()
        seen.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += list(action.choices.values())
    return seen + [capspill.build_parser(), kernel.build_parser(), lowlatency.build_parser(),
                   combine_order.build_parser()]


def test_every_option_has_help_and_presets_are_listed():
    from moekit.shapes import PRESETS
    from moekit.tax.hardware import PRESETS as HARDWARE

    for parser in _parsers():
        for action in parser._actions:
            if action.option_strings and action.help != argparse.SUPPRESS:
                assert action.help and action.help.strip(), (parser.prog, action.option_strings)
            # An option that takes a MoE preset (its default is one) lists them all; DiT-MoE
            # models and model directories are other kinds of --model.
            if action.dest in ("shape", "model") and str(action.default).split(",")[0] in PRESETS:
                assert all(name in parser.format_help().replace("\n", " ").replace(" ", "")
                           for name in PRESETS), (parser.prog, action.dest)
            if action.dest == "hardware":
                assert all(name in action.help for name in HARDWARE)


def test_bench_dispatch_cli_prints_progress(capsys):
    from moekit.bench.dispatch import DISPATCHERS
    from moekit.commands.bench import DISPATCHERS as CLI_DISPATCHERS

    assert set(CLI_DISPATCHERS) == set(DISPATCHERS)
    assert main(["bench", "dispatch", "--hidden", "32", "--tokens", "4", "--iters", "2", "--warmup", "0",
                 "--no-record"]) == 0
    out, err = capsys.readouterr()
    assert "[bench dispatch] alltoall on 2 ranks" in err and "deepseek-v3 with hidden changed" in out


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
