import json

import pytest

from moekit.tax.hardware import PRESETS, Hardware, get_hardware, load_hardware, with_overrides


def test_presets_carry_our_measured_ceilings():
    h200 = PRESETS["H200"]
    assert h200.peak_flops == pytest.approx(790e12)
    assert h200.hbm_bw == pytest.approx(4.3e12)
    assert h200.net_bw == pytest.approx(372e9)
    assert PRESETS["H100"].hbm_bw == pytest.approx(3.0e12)
    assert PRESETS["H100"].peak_flops == pytest.approx(989e12)  # datasheet
    # The paper's validation numbers for A100 (section 5.3).
    assert PRESETS["A100"].hbm_bw == pytest.approx(1500e9)
    assert PRESETS["A100"].peak_flops == pytest.approx(312e12)
    assert set(PRESETS) == {"A100", "H100", "H200", "B200"}
    for hw in PRESETS.values():
        assert set(hw.sources) == {"hbm_bw", "peak_flops", "net_bw", "net_latency"}


def test_get_hardware_by_name_is_case_insensitive():
    assert get_hardware("h200") is PRESETS["H200"]
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("TPUv9")


def test_load_full_file(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"name": "lab", "hbm_bw": 1e12, "peak_flops": 1e14, "net_bw": 1e11, "net_latency": 5e-6}))
    hw = load_hardware(path)
    assert (hw.name, hw.hbm_bw, hw.peak_flops, hw.net_bw, hw.net_latency) == ("lab", 1e12, 1e14, 1e11, 5e-6)
    assert hw.sources["net_latency"].startswith("measured")
    assert get_hardware(str(path)).hbm_bw == 1e12


def test_load_partial_file_on_a_base_preset(tmp_path):
    path = tmp_path / "h200_measured.json"
    path.write_text(json.dumps({"base": "H200", "net_latency": 45e-6}))
    hw = load_hardware(path)
    assert hw.net_latency == 45e-6
    assert hw.hbm_bw == PRESETS["H200"].hbm_bw
    assert hw.sources["hbm_bw"] == PRESETS["H200"].sources["hbm_bw"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ("__import__('os').system('echo pwned')", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"base": "H200", "hbm_bw": "fast"}', "must be a number"),
        ('{"base": "H200", "hbm_bw": true}', "must be a number"),
        ('{"base": "H200", "hbm_bw": -1}', "> 0"),
        ('{"base": "H200", "hbm_bandwidth": 1}', "unknown keys"),
        ('{"hbm_bw": 1e12}', "missing keys"),
        ('{"base": "TPU"}', "not a preset"),
        ('{"base": ["H200"]}', "not a preset"),
        ('{"base": {"H200": 1}}', "not a preset"),
        ('{"base": "H200", "hbm_bw": 1' + "0" * 400 + "}", "hbm_bw must be a number"),
        ('{"base": "H200", "sms": 1' + "0" * 30 + "}", "sms must be None or an int >= 1"),
        ('{"base": "H200", "sms": 1e30}', "sms must be None or an int >= 1"),
        ('{"base": "H200", "sms": true}', "sms must be None or an int >= 1"),
        ('{"base": "H200", "name": ["lab"]}', "'name' must be a non-empty string"),
        ("[" * 100000 + "]" * 100000, "nested too deeply"),
        ('{"base": "H200", "hbm_bw": 1' + "0" * 5000 + "}", "not valid JSON"),
    ],
)
def test_malformed_files_raise_value_error_naming_the_file(tmp_path, text, message):
    path = tmp_path / "bad_hw.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_hardware(path)
    assert "bad_hw.json" in str(info.value)


def test_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="nope.json"):
        load_hardware(tmp_path / "nope.json")


def test_hardware_validates_numbers_and_overrides_are_marked():
    with pytest.raises(ValueError):
        Hardware("x", hbm_bw=0, peak_flops=1, net_bw=1, net_latency=0)
    with pytest.raises(ValueError):
        Hardware("x", hbm_bw=1, peak_flops=float("inf"), net_bw=1, net_latency=0)
    hw = with_overrides(PRESETS["H100"], hbm_bw=2.9e12)
    assert hw.hbm_bw == 2.9e12 and hw.sources["hbm_bw"] == "override"
    assert "TB/s" in hw.describe()


def _cli(*argv):
    import contextlib
    import io

    from moekit.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as stop:
            code = stop.code
    return code, err.getvalue()


@pytest.mark.parametrize("flag", ["--hardware", "--hardware-file", "--recompare"])
@pytest.mark.parametrize("text, message", [
    ("[" * 100000 + "]" * 100000, "nested too deeply"),  # the parser's recursion: no RecursionError
    ('{"base": ["H200"]}', ""),
    ('{"base": "H200", "hbm_bw": 1' + "0" * 400 + "}", ""),
])
def test_tax_cli_reports_a_malformed_file_in_one_line(tmp_path, flag, text, message):
    path = tmp_path / "bad_hw.json"
    path.write_text(text)
    code, err = _cli("tax", "--model", "mixtral-8x7b", flag, str(path))
    assert code == 2, err
    assert err.startswith(f"moekit: error: {path}: ") and message in err and err.count("\n") == 1, err


def test_tax_cli_refuses_a_file_that_never_ends():
    import os
    import time

    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero here")
    start = time.monotonic()
    for flag in ("--hardware", "--hardware-file"):
        code, err = _cli("tax", "--model", "mixtral-8x7b", flag, "/dev/zero")
        assert code == 2 and err.startswith("moekit: error: /dev/zero: ") and "larger than 64 MiB" in err, err
    assert time.monotonic() - start < 30
