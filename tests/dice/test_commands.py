"""`moekit dice sample | quality | bench` end to end at tiny sizes, and their input errors."""

from __future__ import annotations

import json

import pytest

from moekit.cli import main


@pytest.mark.parametrize("argv, message", [
    (["dice", "sample", "--schedule", "fast"], "unknown schedule 'fast'"),
    (["dice", "sample", "--steps", "0"], "num_steps must be an int >= 1"),
    (["dice", "bench", "--batches", "0"], "--batches must list integers >= 1"),
    (["dice", "bench", "--models", "dit-moe-h"], "unknown DiT-MoE preset"),
    (["dice", "quality", "--schedules", "dice"], "must include 'sync'"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("moekit: error:")


def test_sample_checks_itself_against_the_simulator(capsys, tmp_path):
    out = tmp_path / "s.png"
    assert main(["dice", "sample", "--world-size", "1", "--steps", "3", "--batch", "2", "--schedule", "dice",
                 "--check", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bitwise equal to the single-process staleness simulator: yes" in text
    assert "used the step the plan says: yes" in text and out.exists()


def test_bench_writes_a_record(capsys, tmp_path):
    assert main(["dice", "bench", "--models", "dit-moe-digits", "--batches", "1", "--iters", "1", "--warmup", "0",
                 "--dtype", "fp32", "--out-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "modelled speedup at the DICE paper's all-to-all shares" not in text  # digits is not in its Table 5
    (record,) = tmp_path.glob("dice-bench-*.json")
    data = json.loads(record.read_text())
    assert data["kind"] == "dice-bench" and data["results"]["parts"][0]["model"] == "dit-moe-digits"
    assert data["results"]["speed"] and data["params"]["comm_curves"]


def test_quality_command(capsys, tmp_path):
    assert main(["dice", "quality", "--train-steps", "2", "--log-every", "1", "--per-class", "1", "--sample-steps",
                 "2", "--schedules", "sync,interweaved", "--classifier-epochs", "1", "--out-dir", str(tmp_path)]) == 0
    assert "| interweaved |" in capsys.readouterr().out
    assert (tmp_path / "quality.json").exists() and (tmp_path / "samples-interweaved.png").exists()
