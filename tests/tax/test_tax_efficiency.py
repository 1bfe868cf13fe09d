"""Calibrated efficiencies: curves, the fit (recovering known efficiencies from synthetic
timings), the calibration file (plain JSON; malformed files rejected by name) and the what-if
move of a calibration to another GPU."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest

from moekit.tax.efficiency import (CMP_KNOTS, FORMAT, MEM_KNOTS, STREAM_KNOTS, Calibration, Curve, LaunchCost,
                                   LaunchSample, RouterCost, StreamCost, adapt_calibration, fit_launch, fit_router,
                                   fit_stream, gemm_features, grouped_features, load_calibration, nearest_calibration,
                                   save_calibration, smooth_max, wave_quantization)
from moekit.tax.hardware import DATASHEET, PRESETS, get_hardware, load_hardware

BW, PEAK, SMS = 3.0e12, 750e12, 132


def truth_launch() -> LaunchCost:
    """A smooth, known efficiency: bandwidth fraction rising with bytes, matmul fraction rising
    with arithmetic intensity and saturating."""
    mem = tuple(0.45 + 0.5 * (1 - math.exp(-(k - 14) / 6)) for k in MEM_KNOTS)
    cmp = tuple(0.08 + 0.72 / (1 + math.exp(-(k - 7.0))) for k in CMP_KNOTS)
    return LaunchCost(3e-6, Curve(MEM_KNOTS, mem), Curve(CMP_KNOTS, cmp), gamma=0.6, p=3.0)


def dense_grid():
    shapes = ((1024, 3072), (3072, 1024), (10240, 2560), (2560, 10240), (40960, 3072), (5120, 24576), (98304, 5120))
    ms = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
    return [(m, n, k) for n, k in shapes for m in ms]


# --------------------------------------------------------------------------- pieces


def test_curve_interpolates_in_log2_and_clamps():
    c = Curve((10.0, 20.0), (0.2, 0.8))
    assert c(2**10) == pytest.approx(0.2) and c(2**20) == pytest.approx(0.8)
    assert c(2**15) == pytest.approx(0.5)  # halfway in log2
    assert c(1.0) == pytest.approx(0.2) and c(2**40) == pytest.approx(0.8)  # clamped
    for knots, values in (((1.0, 1.0), (0.5, 0.5)), ((2.0, 1.0), (0.5, 0.5)), ((1.0,), (0.0,)), ((1.0, 2.0), (0.5,)),
                          ((1.0, 2.0), (0.5, float("nan")))):
        with pytest.raises(ValueError, match="curve"):
            Curve(knots, values)


def test_wave_quantization_and_smooth_max():
    assert wave_quantization(132, 132) == pytest.approx(1.0)
    assert wave_quantization(133, 132) == pytest.approx(133 / 264)
    assert wave_quantization(66, 132) == pytest.approx(0.5)
    a, b = np.array([1.0, 3.0]), np.array([2.0, 1.0])
    assert np.allclose(smooth_max(a, b, 1.0), a + b)
    assert np.allclose(smooth_max(a, b, 200.0), np.maximum(a, b), rtol=1e-2)
    assert np.all(smooth_max(a, b, 3.0) >= np.maximum(a, b))


def test_launch_time_is_the_formula_written_out():
    cost = truth_launch()
    m, n, k = 256, 8192, 4096
    nbytes, flops, tiles = gemm_features(m, n, k)
    assert nbytes == 2 * (m * k + n * k + m * n) and flops == 2 * m * n * k
    assert tiles == math.ceil(m / 128) * math.ceil(n / 128)
    mem = nbytes / (BW * np.interp(math.log2(nbytes), MEM_KNOTS, cost.mem.values))
    q = tiles / (math.ceil(tiles / SMS) * SMS)
    cmp = flops / (PEAK * np.interp(math.log2(flops / nbytes), CMP_KNOTS, cost.cmp.values) * q**cost.gamma)
    want = cost.fixed + (mem**cost.p + cmp**cost.p) ** (1 / cost.p)
    assert float(cost.time(nbytes, flops, tiles, BW, PEAK, SMS)) == pytest.approx(want, rel=1e-12)


def test_grouped_features_count_padded_rows_and_active_weights():
    nbytes, flops, tiles = grouped_features(active=5, padded_rows=96, tokens=40, hidden=512, width=256, bm=32, bn=64)
    assert nbytes == 2 * (5 * 3 * 512 * 256 + 96 * (2 * 512 + 2 * 256) + 2 * 40 * 512)
    assert flops == 96 * 6 * 512 * 256
    assert tiles == 3 * 4


# --------------------------------------------------------------------------- the fit


def test_fit_recovers_known_efficiencies_from_synthetic_gemm_timings():
    truth = truth_launch()
    grid = dense_grid()
    feats = [gemm_features(m, n, k) for m, n, k in grid]
    rng = np.random.default_rng(0)
    samples = [LaunchSample([tuple(float(v) for v in f)], float(truth.time(*f, BW, PEAK, SMS)) * rng.normal(1, 0.002))
               for f in feats]
    fit, report = fit_launch(samples, BW, PEAK, SMS)
    assert report.rms < 0.01 and report.max_abs < 0.03
    # The efficiencies where the timings pin them: bandwidth at the GEMV end (M <= 8, weights
    # from 6 MB up), matmul at large intensity; and the time of points the fit never saw.
    gemv = [f for (m, _, _), f in zip(grid, feats) if m <= 8]
    for nbytes, _, _ in gemv:
        assert float(fit.mem(nbytes)) == pytest.approx(float(truth.mem(nbytes)), rel=0.05)
    for ai in (2**9, 2**10, 2**11):
        assert float(fit.cmp(ai)) == pytest.approx(float(truth.cmp(ai)), rel=0.06)
    for m, n, k in ((3, 6144, 6144), (200, 20000, 4000), (700, 4096, 30000), (2500, 50000, 5000)):
        f = gemm_features(m, n, k)
        assert float(fit.time(*f, BW, PEAK, SMS)) == pytest.approx(float(truth.time(*f, BW, PEAK, SMS)), rel=0.05)


def test_fit_with_known_extra_time_and_a_sorted_path():
    """Composite samples (two launches + known extra seconds) and a sorted-path fixed cost."""
    truth = LaunchCost(4e-6, Curve(MEM_KNOTS, (0.8,) * len(MEM_KNOTS)), Curve(CMP_KNOTS, (0.7,) * len(CMP_KNOTS)),
                       gamma=0.0, p=4.0, sorted_fixed=9e-6)
    samples = []
    for m, n, k in dense_grid()[::3]:
        f1, f2 = gemm_features(m, 2 * n, k), gemm_features(m, k, n)
        extra = 1e-6 * (1 + m / 100)
        sort = m > 16
        t = float(truth.time(*f1, BW, PEAK, SMS) + truth.time(*f2, BW, PEAK, SMS)) + extra + (9e-6 if sort else 0)
        samples.append(LaunchSample([tuple(map(float, f1)), tuple(map(float, f2))], t, extra, sort))
    fit, report = fit_launch(samples, BW, PEAK, SMS)
    assert report.max_abs < 0.02
    assert fit.sorted_fixed == pytest.approx(9e-6, rel=0.25)
    assert fit.fixed == pytest.approx(4e-6, rel=0.25)


def test_fit_stream_and_router_recover_their_parameters():
    truth = StreamCost(2.5e-6, Curve(STREAM_KNOTS, tuple(0.3 + 0.6 * (k - 10) / 22 for k in STREAM_KNOTS)))
    sizes = [2**k for k in range(12, 31)]
    fit, rep = fit_stream(sizes, [float(truth.time(b, BW)) for b in sizes], BW)
    assert rep.max_abs < 0.01
    assert fit.fixed == pytest.approx(2.5e-6, rel=0.1)
    assert float(fit.mem(2**28)) == pytest.approx(float(truth.mem(2**28)), rel=0.03)

    coef = (9e-6, 2e-8, 3e-13, 0.0, 1e-15)
    rc = RouterCost(coef)
    ms, hs, es = zip(*[(m, h, e) for h, e in ((2560, 16), (4608, 96), (1536, 192), (6144, 48))
                          for m in (1, 4, 16, 64, 256, 1024)])
    fit_r, rep_r = fit_router(ms, hs, es, rc.time(np.array(ms), np.array(hs), np.array(es)))
    assert rep_r.max_abs < 1e-6
    assert np.allclose(fit_r.coef, coef, rtol=1e-4, atol=1e-18)


def test_fits_reject_empty_or_bad_samples():
    with pytest.raises(ValueError, match="sample"):
        fit_launch([], BW, PEAK, SMS)
    with pytest.raises(ValueError, match="sample 0"):
        fit_launch([LaunchSample([(1.0, 1.0, 1.0)], -1.0)], BW, PEAK, SMS)
    with pytest.raises(ValueError, match="fit_stream"):
        fit_stream([1, 2], [1e-6], BW)
    with pytest.raises(ValueError, match="fit_router"):
        fit_router([1], [1], [1], [0.0])


# --------------------------------------------------------------------------- the file


def make_calibration(name="NVIDIA H200", gpu="h200", **changes) -> Calibration:
    flat = Curve(MEM_KNOTS, (0.9,) * len(MEM_KNOTS))
    values = dict(name=name, gpu=gpu, sms=132, hbm_bw=4.2e12, peak_flops=780e12, net_bw=372e9, net_latency=1e-6,
                  dense=truth_launch(), stream=StreamCost(2e-6, flat),
                  grouped=LaunchCost(1e-5, flat, Curve(CMP_KNOTS, (0.5,) * len(CMP_KNOTS)), 0.2, 2.0, 6e-6),
                  router=RouterCost((1e-5, 1e-8, 0.0, 0.0, 1e-15)),
                  sources={"ceilings": "measured", "network": "preset H200"}, meta={"environment": {"x": 1}})
    values.update(changes)
    return Calibration(**values)


def test_calibration_file_round_trip_is_plain_json(tmp_path):
    cal = make_calibration()
    path = save_calibration(cal, tmp_path / "cal.json")
    data = json.loads(open(path).read())  # plain JSON text
    assert data["format"] == FORMAT and data["dense"]["mem"]["log2_knots"] == list(MEM_KNOTS)
    back = load_calibration(path)
    assert back == cal and back.sources == cal.sources and back.meta == cal.meta
    hw = load_hardware(path)  # the 100 %-peak model reads the same file's ceilings
    assert (hw.hbm_bw, hw.peak_flops, hw.net_bw, hw.sms) == (4.2e12, 780e12, 372e9, 132)
    assert get_hardware(str(path)).peak_flops == 780e12


def _mutate(data: dict, path: str, value) -> dict:
    node, keys = data, path.split(".")
    for key in keys[:-1]:
        node = node[key]
    if value is KeyError:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return data


@pytest.mark.parametrize("path, value, message", [
    ("format", "something-else", "not a moekit-tax-calibration"),
    ("version", 99, "version 99"),
    ("hbm_bw", "fast", "hbm_bw must be a number"),
    ("peak_flops", -1.0, "peak_flops must be a finite number > 0"),
    ("sms", 0, "sms must be an int >= 1"),
    ("sms", True, "sms must be an int >= 1"),
    ("dense", KeyError, "missing keys"),
    ("dense.p", 0.5, "p must be a finite number >= 1"),
    ("dense.gamma", "x", "gamma must be a number"),
    ("dense.mem.log2_knots", [20.0, 10.0] + [30.0] * 8, "strictly increasing"),
    ("dense.cmp.values", [0.5], "as many knots as values"),
    ("stream.mem.values", [-0.1] * len(MEM_KNOTS), "stream.mem: curve values must be finite and > 0"),
    ("grouped.extra", 1, "needs exactly the keys"),
    ("router.coef_s", [1e-6, 1e-9], "router: RouterCost.coef must be 5"),
    ("router.coef_s", [-1e-6, 0, 0, 0, 0], ">= 0"),
    ("surprise", 1, "unknown keys"),
    ("sources", [], "sources must be an object"),
    ("sources.dense", ["fitted"], "sources must map each part to a string"),
    ("version", True, "version True, this moekit reads version 1"),
    ("version", 1.0, "version 1.0"),
    ("sms", 10**30, "sms must be an int >= 1 and <= 2147483647"),
    ("hbm_bw", 10**400, "hbm_bw must be a number"),  # past a float's range: no OverflowError
    ("dense.fixed_s", 10**400, "dense: fixed_s must be a number"),
    ("stream.fixed_s", [1], "a stream cost is"),
    ("router.coef_s", [10**400] * 5, "a router cost is"),
])
def test_malformed_calibration_is_rejected_naming_the_file(tmp_path, path, value, message):
    good = tmp_path / "good.json"
    save_calibration(make_calibration(), good)
    bad = tmp_path / "bad-calibration.json"
    bad.write_text(json.dumps(_mutate(json.loads(good.read_text()), path, value)))
    with pytest.raises(ValueError, match=message) as err:
        load_calibration(bad)
    assert str(bad) in str(err.value)
    with pytest.raises(ValueError) as err:  # the hardware loader reads the same files
        load_hardware(bad)
    assert str(bad) in str(err.value)


def test_a_pickle_or_a_broken_file_is_rejected_and_never_run(tmp_path):
    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("unpickled",))

    for name, payload in (("pickled.json", pickle.dumps(Boom())), ("truncated.json", b'{"format": "moekit-tax-cal'),
                          ("list.json", b"[1, 2]"), ("empty.json", b"")):
        path = tmp_path / name
        path.write_bytes(payload)
        with pytest.raises(ValueError) as err:
            load_calibration(path)
        assert str(path) in str(err.value)


# --------------------------------------------------------------------------- what-if


def test_same_gpu_kind_keeps_the_calibration():
    cal = make_calibration()
    same, notes = adapt_calibration(cal, PRESETS["H200"])
    assert same is cal and any("measured" in n for n in notes)


def test_another_gpu_gets_its_datasheet_times_the_measured_fraction():
    cal = make_calibration()
    b200 = PRESETS["B200"]
    moved, notes = adapt_calibration(cal, b200)
    sheet_h200, sheet_b200 = DATASHEET["h200"], DATASHEET["b200"]
    assert moved.hbm_bw == pytest.approx(sheet_b200["hbm_bw"] * 4.2e12 / sheet_h200["hbm_bw"])
    assert moved.peak_flops == pytest.approx(sheet_b200["peak_flops"] * 780e12 / sheet_h200["peak_flops"])
    assert moved.dense == cal.dense and moved.grouped == cal.grouped and moved.router == cal.router
    assert moved.sms == 148 and moved.net_bw == b200.net_bw and moved.gpu == "b200"
    text = " ".join(notes)
    assert "datasheet" in text and "unchanged" in text and "NVIDIA H200" in text


def test_nearest_calibration_prefers_the_same_kind_then_the_nearest_ridge():
    h100 = make_calibration(name="NVIDIA H100 80GB HBM3", gpu="h100", hbm_bw=3.0e12, peak_flops=760e12)
    h200 = make_calibration()
    assert nearest_calibration(PRESETS["H100"], [h200, h100]) is h100
    assert nearest_calibration(PRESETS["H200"], [h100, h200]) is h200
    # B200's datasheet ridge (281 FLOP/byte) is nearer H100's (295) than H200's (206).
    assert nearest_calibration(PRESETS["B200"], [h200, h100]) is h100
    assert nearest_calibration(PRESETS["B200"], []) is None
