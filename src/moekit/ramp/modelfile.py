"""Model files: a fitted :class:`~moekit.ramp.costmodel.CostModel` as plain JSON.

A model file holds one shape's configurations and their coefficients on one GPU kind, for
one precision and one kernel family, plus the hardware constants, how it was profiled and
the environment (device name, torch / Triton versions, commit). Reading one never runs code
from it (``json``); a malformed file, or one made for another shape, GPU, precision, family
or configuration space, raises a ``ValueError`` that names the file and what is wrong.

Files are found by :func:`find_model`: first in the directories of ``MOEKIT_RAMP_MODELS``
(``os.pathsep``-separated; ``moekit ramp profile`` writes there), then among the files
shipped in ``moekit/ramp/models/``. A file's name says what it is for
(:func:`model_filename`): ``h200-bfloat16-token-E128-K8-H2048-N768.json``.
"""

from __future__ import annotations

import errno
import json
import math
import os
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import torch

from moekit.jsonfile import read_json
from moekit.kernels.configs import KernelConfig, config_space, fp8_config_error
from moekit.ramp.costmodel import N_COEF, CostModel, ModelForm, Variant
from moekit.ramp.dataset import config_from_record
from moekit.ramp.regions import FAMILIES, Hardware
from moekit.shapes import MoEShape

FORMAT = "moekit-ramp-model"
VERSION = 1
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn}
PATHS = {"token": ("direct", "sorted"), "expert_major": ("stored", "aligned")}
ENV_DIRS = "MOEKIT_RAMP_MODELS"
SHIPPED = Path(__file__).resolve().parent / "models"


def dtype_name(dtype) -> str:
    """``bfloat16`` / ``float16`` / ``float8_e4m3fn`` for a torch dtype or one of those names
    (``bf16``, ``fp16``, ``fp8`` accepted)."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).replace("torch.", "")
    else:
        name = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}.get(str(dtype), str(dtype))
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or bf16, fp16, fp8), got {dtype!r}")
    return name


def shape_key(shape: MoEShape) -> str:
    return f"E{shape.num_experts}-K{shape.top_k}-H{shape.hidden}-N{shape.intermediate}"


def model_filename(gpu: str, shape: MoEShape, dtype, family: str = "token") -> str:
    return f"{gpu}-{dtype_name(dtype)}-{family}-{shape_key(shape)}.json"


def config_record(c: KernelConfig) -> dict:
    return asdict(c)


def model_to_dict(model: CostModel, *, dtype, routed_experts: int | None = None, profile: dict | None = None,
                  environment: dict | None = None) -> dict:
    s = model.shape
    return {
        "format": FORMAT, "version": VERSION,
        "shape": {"name": s.name, "num_experts": s.num_experts, "top_k": s.top_k, "hidden": s.hidden,
                  "intermediate": s.intermediate, "routed_experts": routed_experts or s.num_experts},
        "gpu": model.hardware.key, "hardware": model.hardware.to_dict(), "dtype": dtype_name(dtype),
        "family": model.family, "capacity": model.capacity, "form": model.form.to_dict(),
        "configs": [config_record(c) for c in model.configs],
        "variants": [v.to_dict() for v in sorted(model.variants.values(), key=lambda v: (v.config, v.path))],
        "profile": profile or {}, "environment": environment or {},
    }


def save_model(model: CostModel, path: str | Path, **meta) -> Path:
    """Write ``model`` as JSON (``meta``: dtype, routed_experts, profile, environment)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(model_to_dict(model, **meta), indent=1, allow_nan=False) + "\n")
    return path


# Every count a model file holds (dimensions, SMs, bytes of L2 and shared memory, capacity)
# is at most this: what the kernels' int32 index arithmetic takes, far above any real GPU.
INT_MAX = 2**31 - 1
_KIND_NAMES = {dict: "an object", list: "a list", str: "a string", bool: "true or false"}
_CONFIG_TYPES = {f.name: {"int": int, "str": str, "bool": bool}.get(getattr(f.type, "__name__", f.type))
                 for f in fields(KernelConfig)}


def _finite_number(v) -> bool:
    """An int or float (not a bool) that is a finite float: JSON has no bound on an integer's
    digits, and one past a float's range cannot be used."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _show(value) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _need(d: dict, key: str, kind, where: str, low: int = 1, high: int = INT_MAX):
    """``d[key]``, which must be there and be a ``kind`` (an int: in [low, high]; a bool is
    not an int here, nor is 8.0)."""
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"{where}: missing {key!r}")
    return _check(d[key], key, kind, where, low, high)


def _check(v, key: str, kind, where: str, low: int = 1, high: int = INT_MAX):
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise ValueError(f"{where}: {key} must be an int in [{low}, {high}], got {_show(v)}")
    elif kind is float:  # a finite number >= 0
        if not _finite_number(v) or v < 0:
            raise ValueError(f"{where}: {key} must be a finite number >= 0, got {_show(v)}")
    elif not isinstance(v, kind):
        raise ValueError(f"{where}: {key} must be {_KIND_NAMES.get(kind, kind)}, got {_show(v)}")
    return v


def _hardware(d, where: str) -> Hardware:
    known = Hardware.__dataclass_fields__
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(f"{where}: hardware has unknown keys {unknown}; allowed: {', '.join(known)}")
    for name, value in d.items():
        kind = str if name == "key" else float if name in ("hbm_gbps", "bf16_tflops") else int
        _check(value, f"hardware {name}", kind, where)
    if not d.get("key"):
        raise ValueError(f"{where}: hardware needs a non-empty 'key' (the GPU's name in file names)")
    try:
        return Hardware(**d)
    except TypeError as error:  # a required field is missing
        raise ValueError(f"{where}: bad hardware: {error}") from None


def _form(d, where: str) -> ModelForm:
    if isinstance(d, dict):
        for name, kind in (("terms", int), ("phi", str), ("wave", str), ("weighting", str), ("nonneg", bool),
                           ("traffic", bool)):
            if name in d:
                _check(d[name], name, kind, f"{where}: bad form", 2, 4)
    try:
        return ModelForm.from_dict(d)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: bad form: {error}") from None


def _config(rec, where: str) -> KernelConfig:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: must be an object of KernelConfig fields, got {_show(rec)}")
    for name, value in rec.items():
        kind = _CONFIG_TYPES.get(name)
        if kind is not None:
            _check(value, name, kind, where, 0)
    try:
        return config_from_record(rec)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None


def model_from_dict(d: dict, where: str = "model") -> tuple[CostModel, dict]:
    """(the model, its metadata: dtype, routed_experts, profile, environment) of a parsed model
    file; every field is checked, so a damaged file fails here and not at selection time."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"{where}: not a {FORMAT} file")
    version = d.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version != VERSION:
        raise ValueError(f"{where}: version {_show(version)}, this moekit reads version {VERSION}")
    s = _need(d, "shape", dict, where)
    try:
        shape = MoEShape(_need(s, "name", str, where), _need(s, "num_experts", int, where),
                         _need(s, "top_k", int, where), _need(s, "hidden", int, where),
                         _need(s, "intermediate", int, where))
    except ValueError as error:
        raise ValueError(f"{where}: bad shape: {error}") from None
    routed = _check(s.get("routed_experts", shape.num_experts), "routed_experts", int, where)
    dtype = _need(d, "dtype", str, where)
    if dtype not in DTYPES:
        raise ValueError(f"{where}: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    family = _need(d, "family", str, where)
    if family not in FAMILIES:
        raise ValueError(f"{where}: family must be one of {FAMILIES}, got {family!r}")
    capacity = d.get("capacity")
    if capacity is not None:
        _check(capacity, "capacity", int, where)
    hw = _hardware(_need(d, "hardware", dict, where), where)
    if hw.key != d.get("gpu"):
        raise ValueError(f"{where}: gpu {_show(d.get('gpu'))} does not match its hardware {hw.key!r}")
    form = _form(_need(d, "form", dict, where), where)
    configs = [_config(rec, f"{where}: config {k}") for k, rec in enumerate(_need(d, "configs", list, where))]
    if not configs:
        raise ValueError(f"{where}: no configs")
    fp8 = dtype == "float8_e4m3fn"
    for k, c in enumerate(configs):
        if fp8 and fp8_config_error(c):
            raise ValueError(f"{where}: config {k} cannot run FP8: {fp8_config_error(c)}")
    variants = {}
    for k, v in enumerate(_need(d, "variants", list, where)):
        w = f"{where}: variant {k}"
        _check(v, "variant", dict, w)
        i = _need(v, "config", int, w, 0)
        path = _need(v, "path", str, w)
        coef = _need(v, "coef", list, w)
        if not 0 <= i < len(configs):
            raise ValueError(f"{w}: config index {i} outside [0, {len(configs)})")
        if path not in PATHS[family]:
            raise ValueError(f"{w}: path must be one of {PATHS[family]}, got {path!r}")
        if len(coef) != N_COEF or not all(_finite_number(x) for x in coef):
            raise ValueError(f"{w}: coef must be {N_COEF} finite numbers")
        if (i, path) in variants:
            raise ValueError(f"{w}: duplicate variant ({i}, {path})")
        subwave = _check(v.get("subwave", False), "subwave", bool, w)
        n_points = _check(v.get("n_points", 0), "n_points", int, w, 0)
        rmse = _check(v.get("rmse_us", 0.0), "rmse_us", float, w)
        variants[(i, path)] = Variant(i, path, np.asarray(coef, dtype=np.float64), subwave, n_points, float(rmse))
    if not variants:
        raise ValueError(f"{where}: no fitted variants")
    model = CostModel(shape, hw, configs, form, variants, 1 if fp8 else 2, family, capacity)
    meta = {"dtype": dtype, "routed_experts": routed,
            "profile": _check(d.get("profile", {}), "profile", dict, where),
            "environment": _check(d.get("environment", {}), "environment", dict, where)}
    return model, meta


def load_model(path: str | Path, *, shape: MoEShape | None = None, gpu: str | None = None, dtype=None,
               family: str | None = None, check_space: bool = True,
               match_top_k: bool = True) -> tuple[CostModel, dict]:
    """Read a model file; with ``shape`` / ``gpu`` / ``dtype`` / ``family`` given, check that it
    was made for them (E, K, H, N must agree -- K only with ``match_top_k`` -- the name need
    not). ``check_space``: every config
    must belong to today's ``config_space`` for the shape (a model of another kernel version
    would otherwise choose a config this kernel does not offer)."""
    path = Path(path)
    if not path.exists():  # a missing file stays FileNotFoundError; every other problem is a ValueError
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    model, meta = model_from_dict(read_json(path, "a RaMP model file"), str(path))
    if shape is not None and _dims(shape, match_top_k) != _dims(model.shape, match_top_k):
        raise ValueError(f"{path}: made for {shape_key(model.shape)}, not {shape_key(shape)}")
    if gpu is not None and gpu != model.hardware.key:
        raise ValueError(f"{path}: made for the GPU {model.hardware.key!r}, not {gpu!r}")
    if dtype is not None and dtype_name(dtype) != meta["dtype"]:
        raise ValueError(f"{path}: made for {meta['dtype']}, not {dtype_name(dtype)}")
    if family is not None and family != model.family:
        raise ValueError(f"{path}: made for the {model.family!r} kernels, not {family!r}")
    if check_space:
        space = set(config_space(model.shape, dtype=DTYPES[meta["dtype"]]))
        foreign = [k for k, c in enumerate(model.configs) if c not in space]
        if foreign:
            raise ValueError(f"{path}: {len(foreign)} of its configs (first: index {foreign[0]}) are not in this "
                             "kernel's config space; profile the shape again")
    return model, meta


def _dims(shape: MoEShape, with_top_k: bool = True) -> tuple:
    return (shape.num_experts, shape.top_k if with_top_k else None, shape.hidden, shape.intermediate)


def model_dirs() -> list[Path]:
    """Where :func:`find_model` looks, in order."""
    extra = [Path(p) for p in os.environ.get(ENV_DIRS, "").split(os.pathsep) if p]
    return [*extra, SHIPPED]


def find_model(shape: MoEShape, gpu: str, dtype, family: str = "token", any_top_k: bool = False) -> Path | None:
    """The first model file for (shape dims, gpu, dtype, family) in :func:`model_dirs`, or None.
    ``any_top_k``: a file of any K will do (the expert-major kernels see the dispatcher's
    counts, never the router's K; K only shaped the profile's routing): the least K first."""
    name = model_filename(gpu, shape, dtype, family)
    for d in model_dirs():
        if (d / name).is_file():
            return d / name
        if any_top_k:
            s = shape
            pattern = f"{gpu}-{dtype_name(dtype)}-{family}-E{s.num_experts}-K*-H{s.hidden}-N{s.intermediate}.json"
            found = sorted(d.glob(pattern), key=lambda p: (len(p.name), p.name))
            if found:
                return found[0]
    return None


def list_models(gpu: str | None = None) -> list[dict]:
    """Every model file in :func:`model_dirs`, in search order (a file shadowed by an earlier one
    of the same name is marked), as rows: the file, its folder, GPU, dtype, family, (E, K, H, N),
    capacity, configs, profiled token counts, in-sample regret, commit. ``gpu``: that GPU's only.
    A file that does not load is listed with its error."""
    rows, seen = [], set()
    for d in model_dirs():
        for path in sorted(Path(d).glob("*.json")) if Path(d).is_dir() else []:
            try:
                model, meta = load_model(path)
            except (ValueError, KeyError, json.JSONDecodeError) as error:
                rows.append({"file": path.name, "dir": str(d), "error": str(error)})
                continue
            if gpu is not None and model.hardware.key != gpu:
                continue
            s, prof = model.shape, meta.get("profile", {})
            rows.append({"file": path.name, "dir": str(d), "shadowed": path.name in seen, "gpu": model.hardware.key,
                         "dtype": meta["dtype"], "family": model.family,
                         "shape": (s.num_experts, s.top_k, s.hidden, s.intermediate), "capacity": model.capacity,
                         "configs": len(model.configs), "m_values": prof.get("m_values"),
                         "fit_regret_mean": prof.get("fit_regret_mean"), "fit_regret_max": prof.get("fit_regret_max"),
                         "commit": meta.get("environment", {}).get("git_commit")})
            seen.add(path.name)
    return rows
