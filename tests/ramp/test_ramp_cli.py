"""`moekit ramp ...` and `moekit bench ramp --from-timings` on the CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moekit.cli import main
from moekit.kernels.configs import config_space
from moekit.ramp.modelfile import model_filename, save_model
from moekit.bench.ramp_profile import save_timings
from moekit.shapes import MoEShape

from .synthetic import grid, synthetic_model, timings_from_model


def test_regions_json(capsys):
    assert main(["ramp", "regions", "--json", "--gpu", "h100"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = {r["shape"]: r for r in out["shapes"]}
    assert names["mixtral-8x7b"]["region"] == "B" and names["qwen3-30b-a3b"]["region"] == "A"
    assert out["gpu"]["l2_bytes"] == 50 * 2**20


def test_regions_text_and_errors(capsys):
    assert main(["ramp", "regions", "--shape", "olmoe-1b-7b"]) == 0
    assert "olmoe-1b-7b" in capsys.readouterr().out
    assert main(["ramp", "regions", "--shape", "gpt-9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moekit: error: shape must be one of") and err.count("\n") == 1


def test_show_and_offline_evaluation(tmp_path, capsys):
    shape = MoEShape("cli", num_experts=8, top_k=2, hidden=256, intermediate=128)
    rng = np.random.default_rng(0)
    truth = synthetic_model(shape, config_space(shape)[::25], rng)
    mpath = save_model(truth, tmp_path / model_filename("h200", shape, "bf16"), dtype="bf16")
    assert main(["ramp", "show", str(mpath)]) == 0
    assert "E=8 K=2 H=256 N=128" in capsys.readouterr().out
    pts = grid(shape, rng, Ms=(2, 30, 300))
    for k, p in enumerate(pts):
        p.beta = 1.0 if k % 5 == 0 else 0.6
        p.label = "eval"
    t = timings_from_model(truth, pts, noise=0.01, rng=rng)
    t.baseline = t.best() * 2
    tpath = save_timings(t, tmp_path / "eval-timings.json.gz")
    prof = save_timings(timings_from_model(truth, grid(shape, rng, Ms=(1, 16, 64, 256, 2048))),
                        tmp_path / "profile-timings.json.gz")
    assert main(["bench", "ramp", "--from-timings", str(tpath), "--profile-timings", str(prof), "--model",
                 str(mpath), "--out-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "Table IV" in out and "Table V" in out and "Ablation" in out
    rec = json.loads(next((tmp_path / "out").glob("ramp-eval-*.json")).read_text())
    assert rec["results"]["regret_max"] < 0.05  # the true model, timings with 1 % noise
    assert (tmp_path / "out").glob("ramp-eval-*.png")


def test_offline_evaluation_leaves_out_points_a_deadline_cut_short(tmp_path, capsys):
    from moekit.bench.ramp import evaluate

    shape = MoEShape("cli-cut", num_experts=8, top_k=2, hidden=256, intermediate=128)
    rng = np.random.default_rng(2)
    truth = synthetic_model(shape, config_space(shape)[::25], rng)
    pts = grid(shape, rng, Ms=(2, 30, 300))
    for p in pts:
        p.label = "eval"
    t = timings_from_model(truth, pts, noise=0.01, rng=rng)
    cut = [j for j, p in enumerate(pts) if p.M == 300]
    t.times[np.ix_(cut, range(3, len(t.configs)))] = float("nan")
    ev = evaluate(truth, t, device_choices=None)
    full = [j for j in range(len(pts)) if j not in cut]
    want = [t.times[j, truth.choose(pts[j].counts, pts[j].M)] / np.nanmin(t.times[j]) - 1 for j in full]
    assert ev["complete_points"] == len(full) and ev["partial_token_counts"] == [300]
    assert ev["regret_mean"] == pytest.approx(np.mean(want)) and ev["regret_max"] == pytest.approx(np.max(want))
    assert all(np.isnan(r["regret"]) and not r["complete"] for r in ev["points"] if r["M"] == 300)
    t.times[:, 5:] = float("nan")
    with pytest.raises(ValueError, match="no evaluation point has every configuration timed"):
        evaluate(truth, t)


def test_fit_reports_partial_points_and_held_out_regret(tmp_path, capsys):
    shape = MoEShape("cli-fit", num_experts=8, top_k=2, hidden=256, intermediate=128)
    rng = np.random.default_rng(1)
    truth = synthetic_model(shape, config_space(shape)[::25], rng)
    pts = grid(shape, rng, Ms=(1, 16, 64, 256))
    t = timings_from_model(truth, pts, noise=0.02, rng=rng)
    t.times[[j for j, p in enumerate(pts) if p.M == 256], 2:] = float("nan")  # a deadline inside M = 256
    tpath = save_timings(t, tmp_path / "profile-cli-timings.json.gz")
    report = tmp_path / "heldout.json"
    assert main(["ramp", "fit", str(tpath), "--out-dir", str(tmp_path), "--held-out", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert f"over {len(pts) - 5} points; 5 partially measured points" in out
    assert "leave one token count out" in out and "leave one balancedness out" in out
    rec = json.loads(report.read_text())
    assert set(rec["leave_one_M_out"]["groups"]) == {"1", "16", "64", "256"}
    assert rec["leave_one_M_out"]["partial"] == rec["leave_one_beta_out"]["partial"] == 5
    assert rec["in_sample"]["complete_mean"] <= rec["in_sample"]["mean"]
    assert (tmp_path / model_filename("h200", shape, "bfloat16")).is_file()


def test_profile_needs_a_shape(capsys):
    assert main(["ramp", "profile", "--experts", "4"]) == 2
    assert "give --shape NAME or all of" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["ramp"], ["ramp", "regions", "--gpu", "a100"]])
def test_usage_errors_exit_nonzero(args):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code != 0


def test_expert_major_evaluation_compares_with_the_kernels_own_default():
    from moekit.bench.ramp import evaluate
    from moekit.kernels.expert_major import expert_major_default
    from moekit.bench.ramp_profile import family_configs

    shape = MoEShape("cli-em", num_experts=8, top_k=2, hidden=256, intermediate=128)
    rng = np.random.default_rng(4)
    configs = family_configs(shape, "bfloat16", "expert_major")
    dflt = expert_major_default(64, False)
    assert dflt in configs
    truth = synthetic_model(shape, configs, rng, family="expert_major", capacity=64)
    pts = grid(shape, rng, Ms=(2, 30, 300))
    t = timings_from_model(truth, pts, noise=0.01, rng=rng)
    ev = evaluate(truth, t)
    j = configs.index(dflt)
    assert ev["default"] == "expert_major_default" and ev["family"] == "expert_major"
    assert [r["default_us"] for r in ev["points"]] == [float(t.times[i, j]) for i in range(len(pts))]


def test_models_lists_what_selection_finds(tmp_path, monkeypatch, capsys):
    """``moekit ramp models``: the user's folder first, a shipped file it shadows marked, a file
    that does not load listed with its error, ``--gpu`` filtering."""
    import shutil

    from moekit.ramp.modelfile import ENV_DIRS, SHIPPED, list_models

    shipped = sorted(SHIPPED.glob("h100-*.json"))
    assert shipped
    shutil.copy(shipped[0], tmp_path / shipped[0].name)
    (tmp_path / "h100-bfloat16-token-E1-K1-H1-N1.json").write_text("{not json")
    monkeypatch.setenv(ENV_DIRS, str(tmp_path))
    rows = list_models()
    assert [r["dir"] for r in rows[:2]] == [str(tmp_path)] * 2 and "error" in rows[1]
    assert len(rows) == len(list(SHIPPED.glob("*.json"))) + 2
    same = [r for r in rows if r["file"] == shipped[0].name]
    assert [r["shadowed"] for r in same] == [False, True]
    assert all(r["gpu"] == "h100" for r in list_models("h100") if "error" not in r)
    h200 = [r for r in list_models("h200") if "error" not in r]
    assert h200 and all(r["gpu"] == "h200" for r in h200)
    assert main(["ramp", "models"]) == 0
    out = capsys.readouterr().out
    assert "does not load" in out and "(shadowed)" in out and f"{len(rows)} model files" in out
    assert main(["ramp", "models", "--gpu", "h100", "--json"]) == 0
    assert all(r.get("gpu", "h100") == "h100" for r in json.loads(capsys.readouterr().out))
