"""Model files: JSON round trip, and every malformed or mismatched file rejected by name."""

from __future__ import annotations

import contextlib
import io
import json
import pickle

import numpy as np
import pytest

from moekit.kernels.configs import config_space
from moekit.ramp import modelfile as mf
from moekit.shapes import MoEShape

from .synthetic import grid, synthetic_model

SHAPE = MoEShape("mf", num_experts=8, top_k=2, hidden=256, intermediate=128)


@pytest.fixture
def saved(tmp_path):
    rng = np.random.default_rng(0)
    model = synthetic_model(SHAPE, config_space(SHAPE)[::20], rng)
    path = mf.save_model(model, tmp_path / mf.model_filename("h200", SHAPE, "bf16"), dtype="bf16",
                         environment={"device": "test"})
    return model, path


def test_round_trip_predicts_the_same(saved):
    model, path = saved
    loaded, meta = mf.load_model(path, shape=SHAPE, gpu="h200", dtype="bfloat16", family="token")
    assert meta["dtype"] == "bfloat16" and meta["environment"]["device"] == "test"
    assert loaded.configs == model.configs and loaded.form == model.form
    for p in grid(SHAPE, np.random.default_rng(1)):
        assert np.allclose(loaded.predict(p.counts, p.M), model.predict(p.counts, p.M), equal_nan=True)


@pytest.mark.parametrize("kw, msg", [
    (dict(shape=MoEShape("other", 8, 2, 256, 64)), "made for E8-K2-H256-N128"),
    (dict(gpu="h100"), "made for the GPU 'h200'"),
    (dict(dtype="fp8"), "made for bfloat16"),
    (dict(family="expert_major"), "made for the 'token' kernels"),
])
def test_mismatched_file_is_rejected(saved, kw, msg):
    _, path = saved
    with pytest.raises(ValueError, match=msg) as info:
        mf.load_model(path, **kw)
    assert str(path) in str(info.value)


def _edit(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


@pytest.mark.parametrize("edit, msg", [
    (lambda d: d.update(format="other"), "not a moekit-ramp-model"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d["variants"][0].update(coef=[1.0, 2.0]), "coef must be 6 finite numbers"),
    (lambda d: d["variants"][0].update(config=10**6), "outside"),
    (lambda d: d["variants"][0].update(path="sideways"), "path must be one of"),
    (lambda d: d["variants"].append(dict(d["variants"][0])), "duplicate variant"),
    (lambda d: d["configs"][0].update(bm=17), "config 0"),
    (lambda d: d["shape"].update(top_k=99), "bad shape"),
    (lambda d: d.update(gpu="h100"), "does not match its hardware"),
    (lambda d: d["form"].update(terms=7), "bad form"),
    (lambda d: d.update(dtype="int8"), "dtype must be one of"),
    (lambda d: d.update(variants=[]), "no fitted variants"),
    (lambda d: d["configs"][0].update(bn=2048), "not in this kernel's config space"),
])
def test_malformed_file_is_rejected_naming_it(saved, edit, msg):
    _, path = saved
    _edit(path, edit)
    with pytest.raises(ValueError, match=msg) as info:
        mf.load_model(path)
    assert str(path) in str(info.value)


def test_not_json_and_pickle_are_rejected(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_bytes(pickle.dumps({"format": mf.FORMAT}))
    with pytest.raises(ValueError, match="not a UTF-8 text file"):
        mf.load_model(bad)
    bad.write_text("[1, 2")
    with pytest.raises(ValueError, match=str(bad)):
        mf.load_model(bad)
    with pytest.raises(FileNotFoundError):
        mf.load_model(tmp_path / "missing.json")


@pytest.mark.parametrize("edit, msg", [
    (lambda d: d["variants"][0].update(n_points=[25]), r"variant 0: n_points must be an int in \[0, "),
    (lambda d: d["variants"][0].update(n_points=None), "variant 0: n_points must be an int"),
    (lambda d: d["variants"][0].update(rmse_us={}), "variant 0: rmse_us must be a finite number >= 0"),
    (lambda d: d["variants"][0].update(rmse_us=10**400), "variant 0: rmse_us must be a finite number >= 0"),
    (lambda d: d["variants"][0]["coef"].__setitem__(0, 10**400), "variant 0: coef must be 6 finite numbers"),
    (lambda d: d["variants"][0].update(subwave="yes"), "variant 0: subwave must be true or false"),
    (lambda d: d["variants"].__setitem__(0, [1, 2]), "variant 0: variant must be an object"),
    (lambda d: d.update(configs=[1, 2, 3]), "config 0: must be an object of KernelConfig fields, got 1"),
    (lambda d: d["configs"][0].update(num_warps=4.0), "config 0: num_warps must be an int"),
    (lambda d: d["configs"][0].update(split_k=True), "config 0: split_k must be an int"),
    (lambda d: d["configs"][0].update(bn2={}), "config 0: bn2 must be an int"),
    (lambda d: d["hardware"].update(sms=1e30), r"hardware sms must be an int in \[1, 2147483647\], got 1e\+30"),
    (lambda d: d["hardware"].update(sms=10**30), "hardware sms must be an int"),
    (lambda d: d["hardware"].update(sms=True), "hardware sms must be an int"),
    (lambda d: d["hardware"].update(hbm_gbps="fast"), "hardware hbm_gbps must be a finite number >= 0, got 'fast'"),
    (lambda d: d["hardware"].update(bf16_tflops=-1), "hardware bf16_tflops must be a finite number >= 0"),
    (lambda d: d["hardware"].update(key=["h200"]), "hardware key must be a string"),
    (lambda d: d["hardware"].update(fast=True), "hardware has unknown keys"),
    (lambda d: d.update(hardware=[]), "hardware must be an object"),
    (lambda d: d.update(profile="fast"), "profile must be an object, got 'fast'"),
    (lambda d: d.update(environment=[1]), r"environment must be an object, got \[1\]"),
    (lambda d: d.update(version=True), "version True, this moekit reads version 1"),
    (lambda d: d.update(version=1.0), "version 1.0"),
    (lambda d: d.update(dtype=["bfloat16"]), "dtype must be a string"),
    (lambda d: d.update(capacity=2**40), "capacity must be an int"),
    (lambda d: d["shape"].update(routed_experts="all"), "routed_experts must be an int"),
    (lambda d: d["shape"].update(hidden=2**40), "hidden must be an int"),
    (lambda d: d["form"].update(nonneg="no"), "bad form: nonneg must be true or false"),
    (lambda d: d["form"].update(terms=4.0), "bad form: terms must be an int"),
])
def test_malformed_fields_are_one_line_errors_naming_the_file_and_field(saved, edit, msg):
    """Each wrong type or range is a ValueError naming the file and the field (never a
    TypeError / AttributeError, nor a file that loads and fails later)."""
    _, path = saved
    _edit(path, edit)
    with pytest.raises(ValueError, match=msg) as info:
        mf.load_model(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


def _cli(*argv):
    from moekit.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["variants"][0].update(n_points=[25]), "n_points"),
    (lambda d: d["variants"][0].update(rmse_us={}), "rmse_us"),
    (lambda d: d.update(configs=[1, 2, 3]), "config 0"),
    (lambda d: d["hardware"].update(sms=1e30), "hardware sms"),
    (lambda d: d.update(profile="fast"), "profile"),
    (lambda d: d.update(environment=[1]), "environment"),
    (lambda d: d.update(version=True), "version"),
    (lambda d: d["hardware"].update(hbm_gbps="fast"), "hardware hbm_gbps"),
])
def test_ramp_show_and_models_report_a_malformed_file_in_one_line(saved, monkeypatch, edit, field):
    """``moekit ramp show FILE``: one ``moekit: error:`` line naming the file and the field;
    ``moekit ramp models``: the file listed as not loading, the others still listed."""
    _, path = saved
    _edit(path, edit)
    code, out, err = _cli("ramp", "show", str(path))
    assert code == 2 and out == "", (out, err)
    assert err.startswith(f"moekit: error: {path}: ") and field in err and err.count("\n") == 1, err
    monkeypatch.setenv(mf.ENV_DIRS, str(path.parent))
    code, out, err = _cli("ramp", "models")
    assert code == 0, err
    assert f"-- {path.name}  ({path.parent}): does not load: {path}: " in out and field in out


def test_deeply_nested_json_is_a_value_error(saved, monkeypatch):
    _, path = saved
    path.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ValueError, match="nested too deeply") as info:
        mf.load_model(path)
    assert str(info.value).startswith(f"{path}: ")
    code, _, err = _cli("ramp", "show", str(path))
    assert code == 2 and err.startswith(f"moekit: error: {path}: ") and "nested too deeply" in err, err
    monkeypatch.setenv(mf.ENV_DIRS, str(path.parent))
    code, out, err = _cli("ramp", "models")
    assert code == 0 and "nested too deeply" in out, err


def test_a_file_that_never_ends_is_refused_quickly():
    """/dev/zero never ends: the reader stops at its size bound instead of filling the memory."""
    import os
    import time

    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero here")
    start = time.monotonic()
    code, _, err = _cli("ramp", "show", "/dev/zero")
    assert code == 2 and err.startswith("moekit: error: /dev/zero: ") and "larger than 64 MiB" in err, err
    assert err.count("\n") == 1 and time.monotonic() - start < 20


def test_nan_coefficients_are_rejected(saved):
    _, path = saved
    text = path.read_text().replace('"coef": [', '"coef": [NaN, ', 1)
    path.write_text(text)
    with pytest.raises(ValueError, match="coef"):
        mf.load_model(path)


def test_find_model_looks_in_the_environment_first(saved, monkeypatch, tmp_path):
    _, path = saved
    monkeypatch.setenv(mf.ENV_DIRS, str(path.parent))
    assert mf.find_model(SHAPE, "h200", "bf16") == path
    assert mf.find_model(SHAPE, "h100", "bf16") is None
    assert mf.model_filename("h200", SHAPE, "fp8", "expert_major") == "h200-float8_e4m3fn-expert_major-E8-K2-H256-N128.json"
    with pytest.raises(ValueError, match="dtype must be one of"):
        mf.dtype_name("int4")


def test_shipped_models_load():
    for path in sorted(mf.SHIPPED.glob("*.json")):
        mf.load_model(path)


@pytest.mark.parametrize("gpu,name,dtype", [
    *(("h100", n, d) for d in ("bf16", "fp8")
      for n in ("qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v3-tp8", "mixtral-8x7b", "deepseek-v3-ep32")),
    *(("h200", n, "bf16") for n in ("qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v3-tp8", "mixtral-8x7b"))])
def test_shipped_token_models_are_found_for_their_presets(gpu, name, dtype, monkeypatch):
    from moekit.bench.ramp_profile import resolve_shape

    monkeypatch.delenv(mf.ENV_DIRS, raising=False)
    shape, _ = resolve_shape(name)
    path = mf.find_model(shape, gpu, dtype)
    assert path is not None and path.parent == mf.SHIPPED
    model, meta = mf.load_model(path, shape=shape, gpu=gpu, dtype=dtype, family="token")
    assert meta["profile"]["complete_m"] == meta["profile"]["m_values"]  # only complete profiles ship


# (E, H, N) of the shipped expert-major models: qwen3-30b-a3b at EP 1 / 2 / 4, olmoe-1b-7b at EP 1 / 2,
# deepseek-v3 at EP 8, mixtral-8x7b at EP 1.
EXPERT_MAJOR = [(128, 2048, 768), (64, 2048, 768), (32, 2048, 768), (64, 2048, 1024), (32, 2048, 1024),
                (32, 7168, 2048), (8, 4096, 14336)]


@pytest.mark.parametrize("E,H,N", EXPERT_MAJOR)
def test_shipped_h100_expert_major_models_are_found_without_the_routers_k(monkeypatch, E, H, N):
    from moekit.shapes import MoEShape

    monkeypatch.delenv(mf.ENV_DIRS, raising=False)
    shape = MoEShape("adhoc", E, 1, H, N)  # the expert-major kernels never see K
    path = mf.find_model(shape, "h100", "bf16", family="expert_major", any_top_k=True)
    assert path is not None and path.parent == mf.SHIPPED
    model, meta = mf.load_model(path, gpu="h100", dtype="bf16", family="expert_major")
    assert (model.shape.num_experts, model.shape.hidden, model.shape.intermediate) == (E, H, N)
    assert model.capacity == 256 and meta["profile"]["complete_m"] == meta["profile"]["m_values"]
