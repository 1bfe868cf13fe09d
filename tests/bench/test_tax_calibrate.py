"""`moekit tax calibrate`: the pipeline at tiny sizes on the CPU (the kernel in Triton's
interpreter), the fixed calibration set (none of it a model the check predicts), the step from
timed rows to the model's launches, the RaMP cost adapter, and the development check of the
calibrated model on the committed H200 record."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' import (they decorate for it)

from moekit.bench import tax_calibrate as tc  # noqa: E402
from moekit.bench.tax_blocks import dense_intermediates  # noqa: E402
from moekit.bench.tax_measure import ALL_MODELS  # noqa: E402
from moekit.bench.tax_report import ids_from_counts, recompare  # noqa: E402
from moekit.shapes import PRESETS, MoEShape  # noqa: E402
from moekit.tax.calibrated import CalibratedBlocks  # noqa: E402
from moekit.tax.efficiency import (CMP_KNOTS, MEM_KNOTS, STREAM_KNOTS, Curve, LaunchCost, StreamCost,  # noqa: E402
                                   gemm_features, load_calibration)
from moekit.tax.hardware import PRESETS as HARDWARE  # noqa: E402
from moekit.tax.model import tax_shape  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
H200_RECORD = ROOT / "benchmarks/results/tax-nvidia-h200/tax-measure-nvidia-h200-1x-20261122T075647Z.json"
H200_KERNELS = ROOT / "benchmarks/results/kernel-nvidia-h200/kernel-nvidia-h200-1x-20261123T053014Z-table.json.gz"


# --------------------------------------------------------------------------- the fixed set


def _model_gemms() -> set[tuple[int, int]]:
    """(N, K) of every GEMM of the shapes the check predicts: DenseFA, DensePA, shared experts."""
    out = set()
    for name in ALL_MODELS:
        s = tax_shape(name)
        widths = list(dense_intermediates(s).values()) + [s.num_shared_experts * s.shared_intermediate]
        for w in widths:
            if w:
                out |= {(2 * w, s.hidden), (s.hidden, w)}
    return out


def test_calibration_set_is_not_the_models_it_predicts():
    assert not set(tc.DENSE_SHAPES) & _model_gemms()
    predicted = {(s.num_experts, s.top_k, s.hidden, s.intermediate)
                 for s in [*PRESETS.values(), *(tax_shape(n) for n in ALL_MODELS)]}
    for s in tc.GROUPED_SHAPES:
        assert (s.num_experts, s.top_k, s.hidden, s.intermediate) not in predicted
    for h, e, _ in tc.ROUTER_SHAPES:
        assert all((h, e) != (s.hidden, s.num_experts) for s in PRESETS.values())
    # The set spans the models' sizes: weights from under 10 MB to 2 GB, M up to 4096.
    wbytes = sorted(2 * n * k for n, k in tc.DENSE_SHAPES)
    assert wbytes[0] < 10e6 and wbytes[-1] > 1.9e9 and max(tc.DENSE_M) == 4096 and max(tc.GROUPED_M) == 4096


# --------------------------------------------------------------------------- from rows to the model


def test_grouped_rows_become_the_launches_the_model_prices():
    """A grouped row priced by a known curve, fitted back: the fitted calibration's model of the
    expert kernel reproduces the rows (same features and sorted-path costs on both sides)."""
    bw, peak, sms, elem = 3.0e12, 700e12, 132, 2
    stream = StreamCost(2e-6, Curve(STREAM_KNOTS, (0.85,) * len(STREAM_KNOTS)))
    truth = LaunchCost(9e-6, Curve(MEM_KNOTS, tuple(0.5 + 0.03 * i for i in range(len(MEM_KNOTS)))),
                       Curve(CMP_KNOTS, tuple(0.2 + 0.05 * i for i in range(len(CMP_KNOTS)))), 0.3, 2.5, 6e-6)
    rng = np.random.default_rng(1)
    rows, dense_rows = [], []
    for shape in tc.GROUPED_SHAPES:
        for m in tc.GROUPED_M:
            bm = 16 if m * shape.top_k <= 64 * shape.num_experts // 16 else 64
            counts = [np.bincount(rng.integers(0, shape.num_experts, m * shape.top_k),
                                  minlength=shape.num_experts).tolist() for _ in range(2)]
            rows.append({"shape": {"name": shape.name, "num_experts": shape.num_experts, "top_k": shape.top_k,
                                   "hidden": shape.hidden, "intermediate": shape.intermediate,
                                   "num_shared_experts": 0, "shared_intermediate": 0, "num_layers": 1},
                         "m": m, "config": {"bm": bm, "bn": 64}, "counts": counts, "us": 0.0})
    cal0 = tc.Calibration("X", "x", sms, bw, peak, 1e9, 0.0, dense=truth, stream=stream, grouped=truth)
    for r in rows:
        shape = MoEShape(**r["shape"])
        c, bm = np.asarray(r["counts"], float), r["config"]["bm"]
        active, padded = (c > 0).sum(1).mean(), (np.ceil(c / bm) * bm).sum(1).mean()
        t, _, _ = CalibratedBlocks(cal0, shape, elem).experts(active, padded, r["m"], shape.intermediate, bm, 64)
        r["us"] = float(t) * 1e6
    for n, k in tc.DENSE_SHAPES:
        for m in tc.DENSE_M[::4]:
            dense_rows.append({"m": m, "n": n, "k": k, "us": float(truth.time(*gemm_features(m, n, k), bw, peak,
                                                                                 sms)) * 1e6})
    stream_rows = [{"bytes": b, "us": float(stream.time(b, bw)) * 1e6} for b in tc.STREAM_BYTES]
    router_rows = [{"m": m, "hidden": h, "experts": e, "us": 10 + 0.01 * m} for h, e, _ in tc.ROUTER_SHAPES
                   for m in tc.ROUTER_M]
    cal, reports = tc.fit_calibration({"hbm_bw": bw, "peak_flops": peak}, stream_rows, dense_rows, router_rows, rows,
                                      name="NVIDIA H100", sms=sms, elem=elem, network=HARDWARE["H100"])
    assert reports["grouped"]["max_abs_rel_error"] < 0.03 and reports["dense"]["max_abs_rel_error"] < 0.03
    assert cal.gpu == "h100" and cal.grouped is not None and cal.grouped.sorted_fixed > 0
    for r in rows[::5]:
        shape = MoEShape(**r["shape"])
        c, bm = np.asarray(r["counts"], float), r["config"]["bm"]
        active, padded = (c > 0).sum(1).mean(), (np.ceil(c / bm) * bm).sum(1).mean()
        t, _, _ = CalibratedBlocks(cal, shape, elem).experts(active, padded, r["m"], shape.intermediate, bm, 64)
        assert float(t) * 1e6 == pytest.approx(r["us"], rel=0.05)


# --------------------------------------------------------------------------- the run (CPU)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("calibrate")
    t0 = time.perf_counter()
    cal, path = tc.run_calibrate(tc.CalibrateConfig(iters=2, warmup=0, input_sets=2), out_dir=str(out), log=None)
    return cal, path, time.perf_counter() - t0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU sizes; on a GPU the real run is the script's")
def test_calibrate_runs_on_the_cpu_in_seconds_and_writes_a_loadable_file(calibrated):
    cal, path, seconds = calibrated
    assert seconds < 60
    back = load_calibration(path)
    assert back == cal and back.grouped is not None and back.router is not None
    samples = back.meta["samples"]
    assert len(samples["dense"]) == len(tc.TINY_DENSE_SHAPES) * len(tc.TINY_DENSE_M)
    assert len(samples["grouped"]) == len(tc.TINY_GROUPED_SHAPES) * len(tc.TINY_GROUPED_M)
    assert all(r["us"] > 0 for part in samples.values() for r in part)
    for r in samples["grouped"]:  # the routing as timed: every set's counts sum to m K
        assert all(sum(c) == r["m"] * r["shape"]["top_k"] for c in r["counts"])
    assert set(back.sources) >= {"ceilings", "network", "dense", "stream", "router", "grouped"}
    assert back.meta["environment"]["torch"] == torch.__version__ and back.meta["complete"]


def test_calibrate_without_the_kernel_and_with_a_deadline(tmp_path):
    cal, path = tc.run_calibrate(tc.CalibrateConfig(iters=2, warmup=0, grouped=False), out_dir=str(tmp_path), log=None)
    assert cal.grouped is None and "dense curve stands in" in cal.sources["grouped"]
    assert load_calibration(path).grouped is None
    if torch.cuda.is_available():
        return
    pytest.importorskip("triton")
    cut, _ = tc.run_calibrate(tc.CalibrateConfig(iters=2, warmup=0, deadline_s=1e-6), out_dir=None, log=None)
    assert cut.grouped is None and not cut.meta["complete"] and "deadline" in cut.sources["grouped"]


def test_cli_calibrate(tmp_path, capsys):
    from moekit.cli import main

    assert main(["tax", "calibrate", "--no-grouped", "--iters", "1", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (path,) = tmp_path.glob("tax-calibration-*.json")
    assert str(path) in out and "dense: fitted on" in out
    assert main(["tax", "--model", "olmoe-1b-7b", "--hardware-file", str(path), "--hardware", "B200"]) == 0
    assert "calibrated model: B200 (scaled from" in capsys.readouterr().out
    for argv, words in ((["tax", "calibrate", "--configs", "-1"], "--configs"),
                        (["tax", "calibrate", "--deadline", "0"], "--deadline"),
                        (["tax", "--hardware-file", str(tmp_path / "none.json")], "none.json"),
                        (["tax", "--model", "all"], "--model all")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("moekit: error:") and words in err[0], err


# --------------------------------------------------------------------------- RaMP


def test_ramp_model_file_prices_the_kernel_where_it_covers_the_shape(monkeypatch):
    from moekit.bench.tax_ramp import ramp_kernel_cost
    from moekit.ramp.modelfile import ENV_DIRS, SHIPPED, load_model

    monkeypatch.delenv(ENV_DIRS, raising=False)  # the model file shipped with the package
    qwen3 = tax_shape("qwen3-30b-a3b")
    cost, name, note = ramp_kernel_cost(qwen3, "h100")
    assert cost is not None and "RaMP" in name and "h100-bfloat16-token-E128-K8-H2048-N768.json" in note
    model, _ = load_model(SHIPPED / "h100-bfloat16-token-E128-K8-H2048-N768.json")
    rng = np.random.default_rng(0)
    for m in (1, 16, 256, 1024):
        counts = np.bincount(rng.integers(0, 128, m * 8), minlength=128)
        assert cost(counts, m) == pytest.approx(float(np.nanmin(model.predict(counts, m))) * 1e-6, rel=1e-12)
    # The profile timed every config up to m = 1024: no extrapolation past it.
    assert "m <= 1024" in note
    for m in (1025, 4096):
        assert cost(np.bincount(rng.integers(0, 128, m * 8), minlength=128), m) is None
    assert cost(np.zeros(64), 4) is None  # another expert count: not covered
    c, _, note = ramp_kernel_cost(qwen3, "h200")  # each GPU its own file
    assert c is not None and "h200-bfloat16-token-E128-K8-H2048-N768.json" in note
    for gpu in ("h200", "h100"):
        c, _, why = ramp_kernel_cost(tax_shape("qwen2-moe"), gpu)
        assert c is None and "no RaMP model file" in why


def test_covered_tokens_is_the_largest_complete_profile_point():
    from moekit.bench.tax_ramp import covered_tokens

    assert covered_tokens({"m_values": [1, 16, 64, 256, 1024], "incomplete": [{"M": 1024, "reason": "partial"}]}) == 256
    assert covered_tokens({"m_values": [1, 4096]}) == 4096
    assert covered_tokens({"m_values": [8], "incomplete": [{"M": 8}]}) == 0
    assert covered_tokens({}) is None  # a file that does not say: no limit


# --------------------------------------------------------------------------- development check (H200 record)


def test_ids_from_counts_keep_the_counts():
    counts = np.array([[3, 0, 1, 4], [2, 2, 2, 2]])
    ids = ids_from_counts(counts, 2)
    assert ids.shape == (2, 4, 2)
    assert np.array_equal(np.stack([np.bincount(i.ravel(), minlength=4) for i in ids]), counts)


def test_calibrated_model_reproduces_the_h200_record_better_than_the_peaks():
    """Development check on the one committed record (not the acceptance check, which runs
    `moekit tax calibrate` on the GPU): a calibration assembled from H200 records alone --
    dense and router curves from the *other* model's blocks, the kernel curve from the kernel
    dataset's shapes that the tax record does not measure -- against the 100 %-peak model, on
    all 52 tau points (2 models x 2 routings x 13 batch sizes)."""
    cal_err, peak_err = [], []
    for model in ("mixtral-8x7b", "qwen2-moe"):
        cal = tc.calibration_from_records(H200_RECORD, H200_KERNELS, leave_out=model)
        assert "not " + model in cal.sources["dense"]
        rows = [r for r in recompare(str(H200_RECORD), calibrations=[cal]) if r["model"] == model]
        assert len(rows) == 26
        cal_err += [abs(r["error_calibrated"]) for r in rows]
        peak_err += [abs(r["error"]) for r in rows]
    cal_max, peak_max = max(cal_err), max(peak_err)
    cal_mean, peak_mean = float(np.mean(cal_err)), float(np.mean(peak_err))
    print(f"H200 record, 52 points: calibrated max {100 * cal_max:.1f} % mean {100 * cal_mean:.1f} %; "
          f"100 %-peak max {100 * peak_max:.1f} % mean {100 * peak_mean:.1f} %")
    assert cal_max < peak_max and cal_mean < peak_mean
    assert cal_max < 0.3 and sum(e <= 0.3 for e in cal_err) == 52
    # The record's own 100 %-peak numbers (docs/tax.md): largest 20.0 %.
    assert peak_max == pytest.approx(0.200, abs=0.002)


def test_calibration_from_records_rejects_a_wrong_file(tmp_path):
    bad = tmp_path / "not-a-table.json"
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not-a-table.json"):
        tc.calibration_from_records(H200_RECORD, bad)


def test_cli_recompare_with_a_calibration_tabulates_both_models(tmp_path, capsys):
    from moekit.cli import main
    from moekit.tax.efficiency import save_calibration

    cal = save_calibration(tc.calibration_from_records(H200_RECORD, H200_KERNELS, leave_out="qwen2-moe"),
                           tmp_path / "dev-h200.json")
    assert main(["tax", "--recompare", str(H200_RECORD), "--hardware-file", cal]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| NVIDIA H200 | ")]
    assert {r.split(" | ")[1] for r in rows} == {"mixtral-8x7b", "qwen2-moe"}
    for r in rows:  # both models' largest errors, recomputed (the record itself has no calibrated side)
        cells = r.split(" | ")
        assert "% (m = " in cells[2] and "% (m = " in cells[4] and cells[3] == "26/26"
