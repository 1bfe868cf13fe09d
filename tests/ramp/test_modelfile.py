"""Model files: JSON round trip, and every malformed or mismatched file rejected by name."""

from __future__ import annotations

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
    with pytest.raises(ValueError, match="not a JSON model file"):
        mf.load_model(bad)
    bad.write_text("[1, 2")
    with pytest.raises(ValueError, match=str(bad)):
        mf.load_model(bad)
    with pytest.raises(FileNotFoundError):
        mf.load_model(tmp_path / "missing.json")


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
    from moekit.ramp.profile import resolve_shape

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
