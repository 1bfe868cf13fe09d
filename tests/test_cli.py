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
    # The floor beside the step: a bare all-to-all of those rows, timed on every rank in the same run.
    floor = report["bare_all_to_all_ms"]
    assert len(floor["all"]) == 10 and all(t > 0 for t in floor["all"])
    assert floor["min"] <= floor["median"] <= max(floor["all"])


def test_demo_text_report(capsys):
    assert main(["demo", "--world-size", "2", "--tokens", "8", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "Verdict: PASS" in out and "bitwise" in out
    assert "the floor, a bare all-to-all of the same rows out and back (gloo): median" in out


def test_demo_prints_as_it_goes():
    """The header comes at once and a line per step as the ranks go (they print from other processes: the
    order in a pipe is the order of the flushes), then the report."""
    proc = subprocess.Popen([sys.executable, "-m", "moekit.cli", "demo", "--world-size", "2", "--tokens", "8",
                             "--steps", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert first.startswith("moekit demo: one expert-parallel MoE layer on 2 local ranks")
    assert proc.poll() is None  # the header came before the ranks ran (they take seconds to start)
    out, err = proc.communicate(timeout=300)
    lines = (first + out).splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith("  step ")]
    assert len(steps) == 2 and "step 1/2" in lines[steps[0]] and "step 2/2" in lines[steps[1]], out
    assert 0 < steps[0] < steps[1] < lines.index("Routing (all ranks' tokens)"), out
    assert lines[-1] == "Verdict: PASS" and sum(line.startswith("moekit demo:") for line in lines) == 1, out
    assert proc.returncode == 0, err


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


def test_version_and_help_do_not_import_torch():
    """`moekit --help` and `--version` answer at once: building the parser imports no torch (seconds)."""
    code = "import sys; from moekit.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr
    done = subprocess.run([sys.executable, "-m", "moekit.cli", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"moekit {moekit.__version__}", done.stderr


def test_help_names_match_the_library():
    """The names the parser lists without importing the library are the library's."""
    from moekit.commands.dice import PRESET_NAMES as CLI_SCHEDULES
    from moekit.commands.tax import HARDWARE as CLI_HARDWARE
    from moekit.dice.schedules import PRESET_NAMES
    from moekit.tax.hardware import PRESETS

    assert CLI_SCHEDULES == PRESET_NAMES and CLI_HARDWARE == tuple(PRESETS)


def test_a_failed_rank_is_one_line(capsys, monkeypatch):
    """A rank's exception (torch's ProcessRaisedException) is one line, with torch imported lazily."""
    import torch.multiprocessing as mp

    from moekit.commands import demo

    def fail(args):
        raise mp.ProcessRaisedException("Traceback ...\nRuntimeError: rank 1 broke\n", 1, 1234)

    monkeypatch.setattr(demo, "run", fail)
    assert main(["demo"]) == 2
    assert capsys.readouterr().err.strip() == "moekit: error in a rank: RuntimeError: rank 1 broke"


@pytest.mark.parametrize("argv, words", [
    (["demo", "--world-size", "0"], ["--world-size", "1, 2, 4 or 8"]),
    (["demo", "--world-size", "-2"], ["--world-size", "got -2"]),
    (["demo", "--tokens", "0"], ["--tokens", "[1, 16384]"]),
    (["bench", "dispatch", "--tokens", "-3"], ["--tokens", ">= 1", "got -3"]),
    (["bench", "dispatch", "--world-size", "0"], ["--world-size"]),
    (["bench", "dispatch", "--iters", "0"], ["--iters"]),
    (["tax", "--gpus", "0"], ["--gpus", "[1, 65536]"]),
    (["tax", "--gpus", str(10**20)], ["--gpus", "[1, 65536]"]),
    (["tax", "--beta", "nan"], ["--beta", "finite number in (0, 1)"]),
    (["tax", "--beta", "-0.5"], ["--beta", "(0, 1)"]),
    (["tax", "--hbm-bw", "nan"], ["--hbm-bw", "finite number > 0"]),
    (["tax", "--hbm-bw", "-1"], ["--hbm-bw", "> 0"]),
    (["tax", "--peak-tflops", "inf"], ["--peak-tflops", "finite number > 0"]),
    (["tax", "--peak-tflops", "0"], ["--peak-tflops", "> 0"]),
    (["demo", "--tokens", str(10**9)], ["--tokens", "[1, 16384]"]),
    (["trace", "generate", "t.npz", "--steps", str(10**8)], ["--steps x --layers", "at most 320,000"]),
    (["trace", "generate", "t.npz", "--seed", str(10**20)], ["--seed", "[0, 4294967295]"]),
    (["trace", "stats", "t.npz", "--capacity", str(10**20)], ["--capacity", "[0, 2147483647]"]),
    (["trace", "stats", "t.npz", "--capacity", "-1"], ["--capacity", "[0, 2147483647]"]),
    (["bench", "ramp", "--fallback-shape", "1,2"], ["--fallback-shape", "E,K,H,N"]),
    (["bench", "ramp", "--fallback-shape", "8,0,64,32"], ["--fallback-shape", ">= 1"]),
])
def test_bad_options_are_one_line_naming_the_option(argv, words, capsys, tmp_path, monkeypatch):
    """Refused at once (NaN and negative numbers were ignored, huge ones accepted or left to run for hours)."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err, *words)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "t.npz"
    assert main(["trace", "generate", str(path), "--steps", "4", "--layers", "2"]) == 0
    return path


def test_trace_stats_takes_capacity_zero(small_trace, capsys):
    """Its help says C >= 0: every routed slot overflows a zero buffer, none of which is padding."""
    capsys.readouterr()
    assert main(["trace", "stats", str(small_trace), "--capacity", "0", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["capacity"] == 0 and stats["overflow_token_fraction"] == 1.0
    assert stats["padding_waste_at_capacity"] == 0.0


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "0"], ["--gpus", "[1, 8]"]),
    (["--slots-per-gpu", "0"], ["--slots-per-gpu", "[1, 8]"]),
    (["--slots-per-gpu", str(10**12)], ["--slots-per-gpu", "[1, 8]"]),
    (["--gpus", "4", "--slots-per-gpu", "1"], ["--slots-per-gpu", "[2, 8]"]),
    (["--block-size", "0"], ["--block-size", ">= 1"]),
])
def test_trace_report_refuses_bad_balancer_sizes(small_trace, argv, words, capsys):
    """--gpus 0 and --slots-per-gpu 0 were read as "not given"; a huge --slots-per-gpu did not finish."""
    capsys.readouterr()
    assert main(["trace", "report", str(small_trace)] + argv) == 2
    _one_error_line(capsys.readouterr().err, *words)


def _output_case(tmp_path, case: str):
    """(path, what is there before) for each kind of bad output path."""
    (tmp_path / "file").write_text("keep")
    return {"directory": tmp_path, "existing file": tmp_path / "file",
            "under a file": tmp_path / "file" / "out"}[case]


@pytest.mark.parametrize("case", ["directory", "existing file", "under a file"])
def test_trace_generate_refuses_a_bad_out_before_work(case, tmp_path, capsys):
    assert main(["trace", "generate", str(_output_case(tmp_path, case))]) == 2
    _one_error_line(capsys.readouterr().err, "OUT")
    assert (tmp_path / "file").read_text() == "keep"


@pytest.mark.parametrize("argv", [["tax", "--figures"], ["tax", "calibrate", "--no-grouped", "--out-dir"],
                                  ["tax", "--measure", "--out-dir"], ["bench", "dispatch", "--out-dir"],
                                  ["bench", "layer", "--out-dir"], ["bench", "capspill", "--out-dir"],
                                  ["bench", "combine-order", "--out-dir"], ["bench", "lowlatency", "--out-dir"],
                                  ["bench", "kernel", "--tiny", "--out-dir"], ["dice", "bench", "--out-dir"],
                                  ["dice", "quality", "--out-dir"], ["dice", "step", "--out-dir"]])
@pytest.mark.parametrize("case", ["existing file", "under a file"])
def test_output_folders_are_checked_before_work(argv, case, tmp_path, capsys):
    path = _output_case(tmp_path, case)
    assert main(argv + [str(path)]) == 2
    captured = capsys.readouterr()
    _one_error_line(captured.err, argv[-1], "not a directory" if case == "under a file" else "is a file")
    assert captured.out == "" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_output_folder_is_refused(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert main(["trace", "generate", str(locked / "t.npz")]) == 2
    _one_error_line(capsys.readouterr().err, "OUT", "not writable")


def test_output_checks():
    """moekit.outputs: what each check allows."""
    from moekit.outputs import check_output_dir, check_output_file

    with pytest.raises(ValueError, match="--out must be a file path"):
        check_output_file("", "--out")
    with pytest.raises(ValueError, match="--out-dir must be a directory path"):
        check_output_dir("", "--out-dir")


def test_output_checks_allow_new_paths(tmp_path):
    from moekit.outputs import check_output_dir, check_output_file

    (tmp_path / "old.txt").write_text("x")
    assert check_output_file(tmp_path / "new" / "deeper" / "a.npz", "OUT") == tmp_path / "new" / "deeper" / "a.npz"
    assert check_output_file(tmp_path / "old.txt", "OUT", overwrite=True) == tmp_path / "old.txt"
    assert check_output_dir(tmp_path, "--out-dir") == tmp_path
    assert check_output_dir(tmp_path / "a" / "b", "--out-dir") == tmp_path / "a" / "b"
    assert not (tmp_path / "new").exists() and not (tmp_path / "a").exists()  # a check creates nothing


def test_records_go_to_a_local_folder_by_default():
    """Not benchmarks/results/, where the records measured on GPUs are kept."""
    from moekit.bench import ramp
    from moekit.bench.report import DEFAULT_OUT_DIR, write_record

    assert DEFAULT_OUT_DIR == "moekit-results" and write_record.__defaults__[0] == DEFAULT_OUT_DIR
    parsers = [p for p in _parsers() + [ramp.build_parser()] if not p.prog.startswith("moekit lm")]  # (lm: its own)
    defaults = [action.default for parser in parsers for action in parser._actions if action.dest == "out_dir"]
    assert "benchmarks/results" not in defaults and defaults.count(DEFAULT_OUT_DIR) == 11, defaults
    with open(os.path.join(os.path.dirname(__file__), "..", ".gitignore"), encoding="utf-8") as f:
        assert f"{DEFAULT_OUT_DIR}/" in f.read().split()


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
