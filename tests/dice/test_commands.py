"""`moekit dice sample | quality | bench` end to end at tiny sizes, and their input errors."""

from __future__ import annotations

import json

import pytest

from moekit.cli import main


@pytest.mark.parametrize("argv, message", [
    (["dice", "sample", "--schedule", "fast"], "unknown schedule 'fast'"),
    (["dice", "sample", "--steps", "0"], "--steps must be an int in [1, 1000]"),
    (["dice", "sample", "--steps", "100000000"], "--steps must be an int in [1, 1000]"),
    (["dice", "sample", "--world-size", "3"], "--world-size must divide the model's 8 experts, got 3"),
    (["dice", "sample", "--world-size", "1000000000"], "--world-size must divide"),
    (["dice", "sample", "--world-size", "0"], "--world-size must be an int >= 1"),
    (["dice", "sample", "--batch", "0"], "--batch must be an int in [1, 4096]"),
    (["dice", "sample", "--cfg", "nan"], "--cfg must be a finite number >= 1"),
    (["dice", "sample", "--cfg", "inf"], "--cfg must be a finite number >= 1"),
    (["dice", "sample", "--seed", "-1"], "--seed must be an int in [0, 4294967295]"),
    (["dice", "sample", "--model", "dit-moe-s", "--out", "x.png"], "--out draws single-channel"),
    (["dice", "quality", "--cfg", "nan"], "--cfg must be a finite number >= 1"),
    (["dice", "quality", "--train-steps", "0"], "--train-steps must be an int >= 1"),
    (["dice", "quality", "--lr", "-1"], "--lr must be a finite number > 0"),
    (["dice", "bench", "--world-size", "3"], "--world-size must divide dit-moe-s's 8 experts"),
    (["dice", "step", "--world-size", "3"], "world_size"),
    (["dice", "bench", "--batches", "0"], "--batches must list integers >= 1"),
    (["dice", "bench", "--models", "dit-moe-h"], "unknown DiT-MoE preset"),
    (["dice", "quality", "--schedules", "dice"], "must include 'sync'"),
])
def test_bad_input_is_one_line(argv, message, capsys, tmp_path, monkeypatch):
    """Checked in the parent before any rank starts (`--world-size 3` printed its error once per rank)."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("moekit: error:"), captured.err
    assert "rank" not in err[0] and "dice sample:" not in captured.out  # no rank started
    assert list(tmp_path.iterdir()) == []


def test_sampler_refuses_a_guidance_scale_that_is_not_a_finite_number():
    """NaN passed `cfg_scale < 1` and gave NaN images."""
    import torch

    from moekit.dice import DiTMoE, digits_config, sample

    model = DiTMoE(digits_config(hidden=32, depth=1, num_heads=2), seed=0)
    noise, labels = torch.randn(1, 1, 8, 8), torch.zeros(1, dtype=torch.long)
    for bad in (float("nan"), float("inf"), 0.5):
        with pytest.raises(ValueError, match="cfg_scale must be >= 1 and finite"):
            sample(model, noise, labels, steps=1, cfg_scale=bad)
    assert torch.isfinite(sample(model, noise, labels, steps=1, cfg_scale=1.5)).all()


@pytest.mark.parametrize("kind", ["directory", "existing file", "parent is a file"])
def test_sample_out_is_checked_before_any_work(kind, tmp_path, capsys):
    out = {"directory": tmp_path, "existing file": tmp_path / "s.png",
           "parent is a file": tmp_path / "s.png" / "t.png"}[kind]
    (tmp_path / "s.png").write_bytes(b"keep")
    assert main(["dice", "sample", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moekit: error: --out") and captured.out == "", captured.err
    assert (tmp_path / "s.png").read_bytes() == b"keep"


def test_sample_checks_itself_against_the_simulator(capsys, tmp_path):
    out = tmp_path / "s.png"
    assert main(["dice", "sample", "--world-size", "1", "--steps", "3", "--batch", "2", "--schedule", "dice",
                 "--check", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert sum(line.startswith("CPU smoke run at toy size") for line in text.splitlines()) == 1, text
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
    text = capsys.readouterr().out
    assert "| interweaved |" in text
    assert text.splitlines()[0].startswith("CPU smoke run at toy size") and "ignore its FD, accuracy" in text
    assert sum("CPU smoke run" in line for line in text.splitlines()) == 1
    assert (tmp_path / "quality.json").exists() and (tmp_path / "samples-interweaved.png").exists()


def test_quality_on_the_cpu_runs_on_one_thread(monkeypatch):
    """The recipe's ops are tiny: threads waiting for each other on a busy 2-core machine made `dice quality`
    take minutes (102-395 s) instead of tens of seconds."""
    import torch

    from moekit.dice import evaluate

    seen = []
    monkeypatch.setattr(evaluate, "_run_quality", lambda qc, **kw: seen.append(torch.get_num_threads()) or {})
    torch.set_num_threads(2)
    evaluate.run_quality(evaluate.QualityConfig(), device="cpu", out_dir="unused")
    assert seen == [1] and torch.get_num_threads() == 2  # one thread inside, the caller's after
