"""`moekit ramp profile`: time every configuration at 25 points on this GPU, fit, write a model file.

Points: 5 token counts x 5 target balancedness levels (:data:`DEFAULT_M`, :data:`DEFAULT_BETAS`),
routed with ``moekit.routing.synthetic_routing`` (the same random numbers at every beta of one
token count, so the levels differ only in skew). Every configuration of the space (the FP8 W8A8
space with ``--dtype fp8``; two_launch without split-K for ``--family expert_major``, the
schedule that follows a dispatcher's counts) runs at every point:

* the call (``fused_moe`` / ``fused_moe_expert_major``) is captured once per (config, token
  count) in a CUDA graph; per point the routing is copied into the graph's buffers, one replay
  is checked against a torch reference, then ``warmup + iters`` replays are timed with CUDA
  events after an L2 flush (``moekit.bench.timing.queue_cold``), every point of the token
  count queued before one wait -- the timing of ``moekit bench kernel``;
* Triton's cache is first filled by a pool of processes (one small launch per config and token
  count), as ``moekit bench kernel`` does.

The fit (:func:`moekit.ramp.costmodel.fit`) and the model file
(:func:`moekit.ramp.modelfile.save_model`) follow; the raw timings are written too
(:func:`save_timings`, after every token count), so a model can be refitted -- another form,
the ablation -- on any machine. ``--deadline-s`` starts no configuration past it (what is
measured is kept and fitted; within a token count the configs go in :func:`timing_order`), and
``--resume`` on those timings keeps the token counts they completed and times the rest.

Without a GPU (``--tiny``) the same pipeline runs in Triton's interpreter on tiny shapes,
timed with the host clock: meaningless numbers, for the tests.
"""

from __future__ import annotations

import gzip
import json
import math
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from moekit.jsonfile import read_json
from moekit.kernels.configs import KernelConfig
from moekit.ramp.dataset import Point, Timings, config_from_record
from moekit.ramp.modelfile import dtype_name
from moekit.routing import balancedness, expert_counts, synthetic_routing
from moekit.shapes import PRESETS, MoEShape, get_shape

DEFAULT_M = (1, 16, 64, 256, 2048)
DEFAULT_BETAS = (1.0, 0.85, 0.7, 0.55, 0.4)
DEFAULT_CAPACITY = 256  # expert_major: a low-latency layer's receive buffer at decode
TINY = dict(hidden=64, intermediate=32)
TIMINGS_FORMAT = "moekit-ramp-timings"
TIMINGS_VERSION = 1
FLUSH_SKIP_FACTOR = 4  # as moekit bench kernel: weights >= 4x L2 evict themselves, no flush needed
FP8_TOL, BF16_TOL = 0.08, 2e-2  # relative error vs the torch reference (FP8: W8A8 quantization error)


# ------------------------------------------------------------------------------ shapes


def resolve_shape(name: str | None = None, *, experts: int | None = None, top_k: int | None = None,
                  hidden: int | None = None, intermediate: int | None = None,
                  routed_experts: int | None = None) -> tuple[MoEShape, int]:
    """(kernel-facing shape, experts the router picks from) of a preset name -- one of
    ``moekit bench kernel``'s shapes (EP / TP shards of deepseek-v3 included) or of
    ``moekit.shapes.PRESETS`` -- with H / N replaced if given, or of explicit dimensions."""
    from moekit.bench.kernel import MODELS, bench_shape

    if name is not None:
        if name in MODELS:
            b = bench_shape(name, hidden, intermediate)
            return b.moe_shape, b.routed_experts
        if name in PRESETS:
            s = get_shape(name)
            s = MoEShape(s.name, s.num_experts, s.top_k, hidden or s.hidden, intermediate or s.intermediate)
            return s, routed_experts or s.num_experts
        raise ValueError(f"shape must be one of {', '.join(dict.fromkeys(MODELS + tuple(PRESETS)))}, got {name!r}")
    dims = dict(experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate)
    missing = [k for k, v in dims.items() if v is None]
    if missing:
        raise ValueError(f"give --shape NAME or all of --experts --top-k --hidden --intermediate (missing: "
                         f"{', '.join(missing)})")
    shape = MoEShape(f"E{experts}-K{top_k}-H{hidden}-N{intermediate}", experts, top_k, hidden, intermediate)
    routed = routed_experts or experts
    if routed < experts:
        raise ValueError(f"routed_experts must be >= experts={experts}, got {routed}")
    return shape, routed


# ----------------------------------------------------------------------------- points


@dataclass(frozen=True)
class PointSpec:
    """How to route one point: M tokens at target ``beta``, or with Zipf exponent ``zipf``, or
    as recorded: ``ids`` [M, K] over the routed experts (a routing trace's rows; ``weights``
    [M, K] float32, else 1 / K each; ``beta`` and ``zipf`` None)."""

    M: int
    beta: float | None = 1.0
    zipf: float | None = None
    seed: int = 0
    label: str = "grid"
    ids: np.ndarray | None = field(default=None, compare=False, repr=False)
    weights: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.ids is not None and (self.ids.ndim != 2 or self.ids.shape[0] != self.M):
            raise ValueError(f"a recorded point's ids must be [M={self.M}, K], got {tuple(self.ids.shape)}")
        if self.weights is not None and (self.ids is None or self.weights.shape != self.ids.shape):
            raise ValueError("a recorded point's weights must come with its ids, of the same shape")


def grid_points(m_values=DEFAULT_M, betas=DEFAULT_BETAS, seed: int = 0, label: str = "grid") -> list[PointSpec]:
    return [PointSpec(M, b, None, seed + M, label) for M in m_values for b in betas]


@dataclass
class Routing:
    ids: torch.Tensor  # [M, K] int64, -1 outside the shard
    weights: torch.Tensor  # [M, K] float32
    counts: np.ndarray  # [E] pairs per local expert
    realized_beta: float


def make_routing(shape: MoEShape, routed: int, p: PointSpec) -> Routing:
    """The routing of point ``p`` over all ``routed`` experts, cut to the shard's [0, E)."""
    if p.ids is not None:
        if p.ids.shape[1] != shape.top_k or p.ids.min() < 0 or p.ids.max() >= routed:
            raise ValueError(f"a recorded point routes top-{p.ids.shape[1]} over ids in [{p.ids.min()}, "
                             f"{p.ids.max()}]; the shape routes top-{shape.top_k} over {routed} experts")
        ids = torch.from_numpy(np.ascontiguousarray(p.ids, dtype=np.int64))
        w = torch.from_numpy(np.ascontiguousarray(p.weights, dtype=np.float32)) if p.weights is not None else \
            torch.full(ids.shape, 1.0 / shape.top_k, dtype=torch.float32)
    elif p.zipf is not None:
        ids, w = synthetic_routing(p.M, routed, shape.top_k, zipf=p.zipf, seed=p.seed)
    else:
        ids, w = synthetic_routing(p.M, routed, shape.top_k, beta=p.beta, seed=p.seed)
    realized = float(balancedness(expert_counts(ids, routed)))
    local = ids < shape.num_experts
    ids = torch.where(local, ids, torch.full_like(ids, -1))
    w = torch.where(local, w, torch.zeros_like(w))
    counts = np.bincount(ids[ids >= 0].numpy(), minlength=shape.num_experts).astype(np.int64)
    return Routing(ids, w, counts, realized)


# ----------------------------------------------------------------------------- timings I/O


def timings_to_dict(t: Timings, params: dict | None = None, family: str = "token",
                    capacity: int | None = None) -> dict:
    s = t.shape
    return {
        "format": TIMINGS_FORMAT, "version": TIMINGS_VERSION,
        "shape": {"name": s.name, "num_experts": s.num_experts, "top_k": s.top_k, "hidden": s.hidden,
                  "intermediate": s.intermediate, "routed_experts": t.routed_experts},
        "dtype": t.dtype, "family": family, "capacity": capacity,
        "configs": [asdict(c) for c in t.configs],
        "points": [{"M": p.M, "beta": None if math.isnan(p.beta) else p.beta, "realized_beta": p.realized_beta,
                    "counts": p.counts.tolist(), "label": p.label} for p in t.points],
        "times_us": [[None if not math.isfinite(v) else float(v) for v in row] for row in t.times],
        "baseline_us": None if t.baseline is None else [None if not math.isfinite(v) else float(v)
                                                         for v in t.baseline],
        "environment": t.environment, "params": params or {},
    }


def save_timings(t: Timings, path: str | Path, **meta) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(timings_to_dict(t, **meta), f, separators=(",", ":"), allow_nan=False)
    return path


def load_timings(path: str | Path) -> tuple[Timings, dict]:
    """(timings, {family, capacity, params}) of a file written by :func:`save_timings`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such timings file")
    d = read_json(path, "a timings file", gzipped=True)  # bounded in size and depth
    if not isinstance(d, dict) or d.get("format") != TIMINGS_FORMAT or d.get("version") != TIMINGS_VERSION:
        raise ValueError(f"{path}: not a {TIMINGS_FORMAT} v{TIMINGS_VERSION} file")
    try:
        s = d["shape"]
        shape = MoEShape(s["name"], s["num_experts"], s["top_k"], s["hidden"], s["intermediate"])
        configs = [config_from_record(c) for c in d["configs"]]
        points = [Point(int(p["M"]), float(p["beta"]) if p["beta"] is not None else math.nan,
                        float(p["realized_beta"]), np.asarray(p["counts"], dtype=np.int64), str(p.get("label", "")))
                  for p in d["points"]]
        times = np.array([[math.nan if v is None else float(v) for v in row] for row in d["times_us"]],
                         dtype=np.float64).reshape(len(points), len(configs))
        base = d.get("baseline_us")
        base = None if base is None else np.array([math.nan if v is None else float(v) for v in base])
        t = Timings(shape, int(s.get("routed_experts", shape.num_experts)), dtype_name(d["dtype"]), configs, points,
                    times, base, d.get("environment", {}), str(path))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: malformed timings ({type(error).__name__}: {error})") from None
    if any(len(p.counts) != shape.num_experts for p in points):
        raise ValueError(f"{path}: a point's counts do not have {shape.num_experts} experts")
    return t, {"family": d.get("family", "token"), "capacity": d.get("capacity"), "params": d.get("params", {})}


# ------------------------------------------------------------------------ compile pool

_WORKER: dict = {}
COMPILE_TIMEOUT_S = 180


def _worker_weights(key: tuple):
    if _WORKER.get("key") != key:
        _WORKER.clear()
        E, K, H, N, fp8, family, capacity = key
        dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        act = torch.bfloat16 if dev.type == "cuda" else torch.float32
        w13 = torch.randn(E, 2 * N, H, device=dev, dtype=act) * H**-0.5
        w2 = torch.randn(E, H, N, device=dev, dtype=act) * N**-0.5
        scales = {}
        if fp8:
            # Compiling needs the dtypes and layouts, not quantized values: a cast and unit block
            # scales keep each of the 16 workers at the bf16 weights' size (quantizing in float32
            # took ~6 GiB per worker at qwen3-30b-a3b and filled an 80 GB card).
            from moekit.fp8 import FP8_DTYPE

            s13 = torch.ones(E, -(-2 * N // 128), -(-H // 128), device=dev)
            s2 = torch.ones(E, -(-H // 128), -(-N // 128), device=dev)
            w13, w2 = w13.to(FP8_DTYPE), w2.to(FP8_DTYPE)
            scales = dict(w13_scale=s13, w2_scale=s2)
        _WORKER.update(key=key, w13=w13, w2=w2, scales=scales, dev=dev, act=act)
    return _WORKER


def _compile_task(task) -> tuple[dict, str | None]:
    """Run one config once at every token count (fills Triton's on-disk cache)."""
    key, cfg_fields, m_values = task
    from moekit.kernels import KernelConfig, fused_moe, fused_moe_expert_major

    st = _worker_weights(key)
    E, K, H, N, fp8, family, capacity = key
    cfg = KernelConfig(**cfg_fields)
    try:
        for M in m_values:
            if family == "token":
                x = torch.randn(M, H, device=st["dev"], dtype=st["act"])
                ids = torch.randint(0, E, (M, K), device=st["dev"])
                fused_moe(x, st["w13"], st["w2"], ids, torch.rand(M, K, device=st["dev"]), cfg, **st["scales"])
            else:
                tok = torch.randn(E, capacity, H, device=st["dev"], dtype=st["act"])
                counts = torch.randint(0, capacity + 1, (E,), device=st["dev"], dtype=torch.int32)
                fused_moe_expert_major(tok, counts, st["w13"], st["w2"], cfg, **st["scales"])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - a config that fails is recorded, not fatal
        return cfg_fields, f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:300]
    return cfg_fields, None


def compile_configs(key: tuple, configs: list[KernelConfig], m_values, workers: int,
                    log: Callable[[str], None]) -> dict[KernelConfig, str]:
    """Fill Triton's cache with ``workers`` spawned processes; {config: error} of the failures."""
    tasks = [(key, asdict(c), tuple(m_values)) for c in configs]
    errors: dict[KernelConfig, str] = {}
    if not tasks or workers < 1:
        return errors
    start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    with ctx.Pool(min(workers, len(tasks))) as pool:
        results = pool.imap_unordered(_compile_task, tasks)
        for done in range(1, len(tasks) + 1):
            try:
                fields_, err = results.next(timeout=COMPILE_TIMEOUT_S)
            except multiprocessing.TimeoutError:
                log(f"  no answer from the compile pool for {COMPILE_TIMEOUT_S} s; going on without it")
                pool.terminate()
                break
            if err:
                errors[KernelConfig(**fields_)] = err
            if done % 50 == 0 or done == len(tasks):
                log(f"  compiled {done}/{len(tasks)} configs in {time.perf_counter() - start:.0f} s"
                    f"{f', {len(errors)} failed' if errors else ''}")
    return errors


# ------------------------------------------------------------------------------ timing


@dataclass
class TimerSpec:
    """What to time and how (see the module docstring)."""

    shape: MoEShape
    routed: int
    dtype: str = "bfloat16"  # bfloat16 | float8_e4m3fn (the weights; activations are bf16 on a GPU)
    family: str = "token"
    capacity: int = DEFAULT_CAPACITY
    iters: int = 10
    warmup: int = 1
    flush_mb: int = 256
    queue_ahead_us: float = 20.0
    seed: int = 0
    compile_workers: int | None = None
    deadline_s: float | None = None
    baseline: bool = True  # also time the torch baseline at every point (token family)
    tol: float | None = None


@dataclass
class TimingRun:
    timings: Timings
    errors: dict = field(default_factory=dict)  # "config id @ M": reason
    incomplete: list = field(default_factory=list)
    seconds: float = 0.0
    compile_seconds: float = 0.0
    complete_m: list = field(default_factory=list)  # token counts every config was timed at


def timing_order(n: int, seed: int = 0) -> list[int]:
    """The order in which a token count's ``n`` configurations are timed: a fixed shuffle. The
    space is listed block size by block size (bm 16 first), so a deadline inside a token count
    would otherwise leave it measured for the small blocks alone -- at a large token count the
    ones that lose; shuffled, what was measured is a sample of the whole space."""
    return [int(i) for i in np.random.default_rng(seed + 104729).permutation(n)]


class ConfigTimer:
    """Times a list of configurations at a list of points (shared by profile and evaluation)."""

    def __init__(self, spec: TimerSpec, log: Callable[[str], None] = print):
        self.spec = spec
        self.log = log
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.on_gpu = self.device.type == "cuda"
        if not self.on_gpu:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        self.fp8 = dtype_name(spec.dtype) == "float8_e4m3fn"
        self.act = torch.bfloat16 if self.on_gpu else torch.float32
        self.start = time.perf_counter()
        self._weights = None
        self.l2_bytes = (getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 60 << 20)
                         if self.on_gpu else 0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def key(self) -> tuple:
        s = self.spec.shape
        return (s.num_experts, s.top_k, s.hidden, s.intermediate, self.fp8, self.spec.family, self.spec.capacity)

    def weights(self):
        """(w13, w2, scales kwargs, bf16 reference weights) on the device, drawn once."""
        if self._weights is None:
            s = self.spec.shape
            g = torch.Generator(device=self.device).manual_seed(self.spec.seed + 17)
            w13 = torch.randn(s.num_experts, 2 * s.intermediate, s.hidden, generator=g, device=self.device,
                              dtype=self.act).mul_(s.hidden**-0.5)
            w2 = torch.randn(s.num_experts, s.hidden, s.intermediate, generator=g, device=self.device,
                             dtype=self.act).mul_(s.intermediate**-0.5)
            scales = {}
            ref13, ref2 = w13, w2
            if self.fp8:
                from moekit.fp8 import dequantize_blocks, quantize_blocks

                (q13, s13), (q2, s2) = quantize_blocks(w13, 128), quantize_blocks(w2, 128)
                ref13 = dequantize_blocks(q13, s13, 128).to(self.act)
                ref2 = dequantize_blocks(q2, s2, 128).to(self.act)
                w13, w2, scales = q13, q2, dict(w13_scale=s13, w2_scale=s2)
            self._weights = (w13, w2, scales, ref13, ref2)
        return self._weights

    def compile(self, configs: list[KernelConfig], m_values) -> dict:
        if not self.on_gpu:
            return {}
        workers = self.spec.compile_workers
        if workers is None:
            workers = min(16, os.cpu_count() or 1)
        self.log(f"filling the Triton cache: {len(configs)} configs x {len(m_values)} token counts, "
                 f"{workers} processes ...")
        return compile_configs(self.key(), configs, m_values, workers, self.log)

    # -- one call ---------------------------------------------------------------------

    def _call(self, c: KernelConfig, buf: dict):
        from moekit.kernels import fused_moe, fused_moe_expert_major

        w13, w2, scales, _, _ = self.weights()
        if self.spec.family == "token":
            return lambda: buf.__setitem__("y", fused_moe(buf["x"], w13, w2, buf["ids"], buf["w"], c, **scales))
        return lambda: buf.__setitem__("y", fused_moe_expert_major(buf["tok"], buf["counts"], w13, w2, c, **scales))

    def _reference(self, buf: dict) -> torch.Tensor:
        """The torch result of the point in ``buf`` (float32)."""
        _, _, _, ref13, ref2 = self.weights()
        if self.spec.family == "token":
            from moekit.bench.kernel_baseline import make_torch_moe

            fn, _ = make_torch_moe(buf["x"], ref13, ref2, buf["ids"], buf["w"], "auto" if self.on_gpu else "loop")
            return fn().float()
        tok = buf["tok"].float()
        h = torch.bmm(tok, ref13.float().transpose(1, 2))
        N = ref2.shape[2]
        act = torch.nn.functional.silu(h[..., :N]) * h[..., N:]
        return torch.bmm(act.to(self.act).float(), ref2.float().transpose(1, 2))

    def _error(self, y: torch.Tensor, ref: torch.Tensor, counts: torch.Tensor | None) -> float:
        """Relative error of ``y`` against ``ref``; expert-major: over the rows that ``counts``
        (the point's own, not the buffer's latest) makes valid, the only ones defined."""
        if self.spec.family == "expert_major":
            rows = torch.arange(ref.shape[1], device=ref.device)[None, :] < counts.clamp(max=ref.shape[1])[:, None]
            y, ref = y.float()[rows], ref[rows]
        d = (y.float() - ref).norm()
        return float(d / ref.norm().clamp_min(1e-30))

    # -- many points -------------------------------------------------------------------

    def run(self, configs: list[KernelConfig], points: list[PointSpec], compile_first: bool = True,
            skip_m=frozenset(), after_group: Callable[[Timings, list], None] | None = None) -> TimingRun:
        """Median µs of every config at every point (NaN where it failed or was not reached).
        Token counts in ``skip_m`` are not timed (NaN; a resumed profile has them). The configs
        of a token count are timed in :func:`timing_order`. ``after_group(timings, complete_m)``:
        called after each token count with what is measured so far (to save it)."""
        spec = self.spec
        m_values = sorted({p.M for p in points})
        t_compile = time.perf_counter()
        to_time = [M for M in m_values if M not in skip_m]
        errors = {f"{_cid(c)}@compile": e for c, e in
                  (self.compile(configs, to_time) if compile_first and to_time else {}).items()}
        compile_s = time.perf_counter() - t_compile
        routings = [make_routing(spec.shape, spec.routed, p) for p in points]
        times = np.full((len(points), len(configs)), np.nan)
        base = np.full(len(points), np.nan)
        from moekit.bench.report import environment

        env = environment()
        pts = [Point(p.M, p.beta if p.beta is not None else math.nan, r.realized_beta, r.counts, p.label)
               for p, r in zip(points, routings)]

        def timings() -> Timings:
            return Timings(spec.shape, spec.routed, dtype_name(spec.dtype), list(configs), pts, times.copy(),
                           base.copy() if spec.family == "token" and spec.baseline else None, env)

        incomplete, complete_m = [], []
        order = timing_order(len(configs), spec.seed)
        from moekit.bench.timing import L2Flusher

        flusher = L2Flusher(spec.flush_mb << 20, self.device) if self.on_gpu and spec.flush_mb else None
        tol = spec.tol or (FP8_TOL if self.fp8 else BF16_TOL)
        for M in m_values:
            if M in skip_m:
                continue
            idx = [j for j, p in enumerate(points) if p.M == M]
            if spec.deadline_s is not None and self.elapsed() > spec.deadline_s:
                incomplete.append({"M": M, "reason": "skipped: deadline"})
                self.log(f"[M={M}] skipped: deadline")
                continue
            t0 = time.perf_counter()
            buf = self._buffers(M)
            refs, flushers = [], []
            for j in idx:
                self._write(buf, routings[j])
                refs.append(self._reference(buf))
                flushers.append(self._flusher_for(routings[j], flusher))
                if spec.baseline and spec.family == "token":
                    base[j] = self._time_baseline(buf, flushers[-1])
            for k, i in enumerate(order):
                c = configs[i]
                if spec.deadline_s is not None and self.elapsed() > spec.deadline_s:
                    incomplete.append({"M": M, "reason": f"partial: deadline after {k}/{len(configs)} configs"})
                    break
                res = self._time_config(c, buf, [routings[j] for j in idx], refs, flushers, tol)
                for j, r in zip(idx, res):
                    if isinstance(r, str):
                        errors[f"{_cid(c)}@M={M},beta={points[j].beta},zipf={points[j].zipf}"] = r
                    else:
                        times[j, i] = r
                if (k + 1) % 100 == 0:
                    self.log(f"  M={M}: {k + 1}/{len(configs)} configs ({self.elapsed():.0f} s)")
            else:
                complete_m.append(M)
            self.log(f"[M={M}] {len(idx)} points x {len(configs)} configs in {time.perf_counter() - t0:.1f} s "
                     f"(elapsed {self.elapsed():.0f} s)")
            if after_group is not None:
                after_group(timings(), list(complete_m))
            del buf
            if self.on_gpu:
                torch.cuda.empty_cache()
        return TimingRun(timings(), errors, incomplete, self.elapsed(), compile_s, complete_m)

    def _buffers(self, M: int) -> dict:
        s = self.spec.shape
        g = torch.Generator(device=self.device).manual_seed(self.spec.seed + 7 * M + 1)
        if self.spec.family == "token":
            return {"x": torch.randn(M, s.hidden, generator=g, device=self.device, dtype=self.act),
                    "ids": torch.empty(M, s.top_k, dtype=torch.int64, device=self.device),
                    "w": torch.empty(M, s.top_k, dtype=torch.float32, device=self.device)}
        cap = self.spec.capacity
        return {"tok": torch.randn(s.num_experts, cap, s.hidden, generator=g, device=self.device, dtype=self.act),
                "counts": torch.empty(s.num_experts, dtype=torch.int32, device=self.device)}

    def _write(self, buf: dict, r: Routing) -> None:
        if self.spec.family == "token":
            buf["ids"].copy_(r.ids)
            buf["w"].copy_(r.weights)
        else:
            buf["counts"].copy_(torch.as_tensor(np.minimum(r.counts, self.spec.capacity), dtype=torch.int32))

    def _flusher_for(self, r: Routing, flusher):
        if flusher is None:
            return None
        s = self.spec.shape
        touched = int((r.counts > 0).sum()) * 3 * s.hidden * s.intermediate * (1 if self.fp8 else 2)
        return None if touched >= FLUSH_SKIP_FACTOR * self.l2_bytes else flusher

    def _time_baseline(self, buf: dict, flusher) -> float:
        from moekit.bench.kernel_baseline import make_torch_moe
        from moekit.bench.timing import time_cold

        _, _, _, ref13, ref2 = self.weights()
        fn, _ = make_torch_moe(buf["x"], ref13, ref2, buf["ids"], buf["w"], "auto" if self.on_gpu else "loop")
        try:
            samples = time_cold(fn, iters=self.spec.iters, warmup=self.spec.warmup, capture=self.on_gpu,
                                flush_bytes=0, flusher=flusher, queue_ahead_us=self.spec.queue_ahead_us,
                                device=self.device)
        except RuntimeError:
            samples = time_cold(fn, iters=self.spec.iters, warmup=self.spec.warmup, capture=False, flush_bytes=0,
                                flusher=flusher, queue_ahead_us=self.spec.queue_ahead_us, device=self.device)
        return float(np.median(samples))

    def _time_config(self, c: KernelConfig, buf: dict, routings: list[Routing], refs, flushers, tol) -> list:
        """Per point: median µs, or why the config was not timed."""
        call = self._call(c, buf)
        spec = self.spec
        if not self.on_gpu:
            out = []
            for r, ref in zip(routings, refs):
                self._write(buf, r)
                try:
                    call()
                except Exception as error:  # noqa: BLE001 - recorded, not fatal
                    out.append(_one_line(error))
                    continue
                err = self._error(buf["y"], ref, buf.get("counts"))
                if not err < tol:
                    out.append(f"relative error {err:.3g} (tol {tol:g})")
                    continue
                ts = []
                for _ in range(spec.iters):
                    t0 = time.perf_counter()
                    call()
                    ts.append((time.perf_counter() - t0) * 1e6)
                out.append(float(np.median(ts)))
            return out
        from moekit.bench.timing import capture_graph, queue_cold

        self._write(buf, routings[0])
        try:
            call()
            graph = capture_graph(call, warmup=1)
        except Exception as error:  # noqa: BLE001 - a config that cannot run is recorded, not fatal
            return [_one_line(error)] * len(routings)
        queued = []
        for r, flusher in zip(routings, flushers):
            self._write(buf, r)
            graph.replay()
            checked = (buf["y"].clone(), buf["counts"].clone() if "counts" in buf else None)
            queued.append((checked, queue_cold(graph.replay, iters=spec.iters, warmup=spec.warmup, flusher=flusher,
                                               queue_ahead_us=spec.queue_ahead_us, device=self.device)))
        torch.cuda.synchronize(self.device)
        out = []
        for ((y, counts), samples), ref in zip(queued, refs):
            err = self._error(y, ref, counts)
            out.append(float(np.median(samples())) if err < tol else f"relative error {err:.3g} (tol {tol:g})")
        del graph
        return out


def _cid(c: KernelConfig) -> str:
    from moekit.bench.kernel import config_id

    return config_id(c)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


# ------------------------------------------------------------------------- profiling


def family_configs(shape: MoEShape, dtype: str, family: str, device=None) -> list[KernelConfig]:
    """The configurations a family profiles: the whole space of the precision for fused_moe;
    the dispatcher's schedule (two_launch, split_k = 1) for the expert-major kernels."""
    from moekit.kernels.configs import config_space

    dt = torch.float8_e4m3fn if dtype_name(dtype) == "float8_e4m3fn" else torch.bfloat16
    space = config_space(shape, device, dtype=dt)
    if family == "expert_major":
        space = [c for c in space if c.form == "two_launch" and c.split_k == 1]
    return space


def estimate_seconds(shape: MoEShape, n_configs: int, points: list[PointSpec], family: str, on_gpu: bool,
                     iters: int, warmup: int, compile_workers: int = 16, fp8: bool = False) -> float:
    """A rough run time: compile (~1.5 s per kernel on one core, three kernels per config; FP8
    ~2.6 s), loading the binaries in the timing process (~0.2 s per config; FP8 ~0.7 s), graph
    capture (~20 ms per config and token count), the timed replays (flush ~60 µs + the call,
    the call from the kernel roofline times 2.5) and ~3 s per point for its routing and checks.
    Against H100 profiles: olmoe-1b-7b bf16 300 s measured, 309 s estimated; qwen3-30b-a3b FP8
    ~340 s of compile and timing (over three calls), 352 s estimated."""
    if not on_gpu:
        return len(points) * n_configs * (iters + 1) * 0.2
    Ms = sorted({p.M for p in points})
    compile_s = n_configs * 3 * (2.6 if fp8 else 1.5) / max(1, compile_workers)
    load_s = (0.7 if fp8 else 0.2) * n_configs
    capture_s = 0.02 * n_configs * len(Ms)
    replay_s = 0.0
    for p in points:
        touched = min(shape.num_experts, p.M * shape.top_k)
        call_us = 20 + 2.5 * max(touched * 3 * shape.hidden * shape.intermediate * 2 / 4.3e6,
                                 6 * p.M * shape.top_k * shape.hidden * shape.intermediate / 790e6)
        replay_s += n_configs * (iters + warmup + 1) * (80 + call_us) * 1e-6
    return compile_s + load_s + capture_s + replay_s + 3 * len(points)


def load_any_timings(path: str | Path, shape_name: str | None = None) -> tuple[Timings, dict]:
    """Timings from a ``moekit ramp profile`` timings file, or from a ``moekit bench kernel``
    table (``-table.json.gz``; ``shape_name`` picks its shape): (timings, family metadata)."""
    from moekit.bench.kernel_report import load_table
    from moekit.ramp.dataset import from_kernel_table

    path = str(path)
    if path.endswith(".json.gz") and "timings" in Path(path).name:
        return load_timings(path)
    if not shape_name:
        raise ValueError(f"{path}: a moekit bench kernel table needs a shape name")
    return from_kernel_table(load_table(path), shape_name, path), {"family": "token", "capacity": None, "params": {}}


def shortlist_configs(configs: list[KernelConfig], reference: Timings | list[Timings],
                      factor: float) -> list[KernelConfig]:
    """The configs that came within ``factor`` of some point's best in a ``reference`` (the same
    shape measured elsewhere, e.g. on another GPU, or shapes like it), plus those no reference
    measured: a profile that times only these skips what never came near the best there."""
    if not factor > 1:
        raise ValueError(f"the shortlist factor must be > 1, got {factor}")
    refs = [reference] if isinstance(reference, Timings) else list(reference)
    near = {r.configs[i] for r in refs for i in prune_configs(r, factor)}
    measured = {c for r in refs for j, c in enumerate(r.configs) if np.isfinite(r.times[:, j]).any()}
    return [c for c in configs if c in near or c not in measured]


def _shortlist_reference(path: str, shape: MoEShape, spec) -> Timings:
    """The timings of one ``--shortlist`` file, checked: the same dtype and family, and the same
    shape unless ``spec.shortlist_any_shape``."""
    ref, meta = load_any_timings(path, shape.name)
    dims = lambda s: (s.num_experts, s.top_k, s.hidden, s.intermediate)  # noqa: E731
    if ref.dtype != spec.dtype or meta["family"] != spec.family:
        raise ValueError(f"{path}: its timings are of another dtype or family ({ref.dtype}, {meta['family']})")
    if dims(ref.shape) != dims(shape) and not spec.shortlist_any_shape:
        raise ValueError(f"{path}: its timings are of another shape {dims(ref.shape)}; a shortlist comes from the "
                         "same shape measured elsewhere, or pass shortlist_any_shape (--shortlist-any-shape)")
    return ref


def prune_configs(t: Timings, factor: float) -> list[int]:
    """Indices of the configs within ``factor`` of the best at some point (the rest never came near)."""
    best = t.best()
    near = t.times <= best[:, None] * factor
    return [i for i in range(len(t.configs)) if near[:, i].any()]


@dataclass
class ProfileSpec:
    """``moekit ramp profile``'s options (see the module docstring)."""

    shape: str | None = None
    experts: int | None = None
    top_k: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    routed_experts: int | None = None
    dtype: str = "bf16"
    family: str = "token"
    capacity: int = DEFAULT_CAPACITY
    m_values: tuple[int, ...] = DEFAULT_M
    betas: tuple[float, ...] = DEFAULT_BETAS
    iters: int = 10
    warmup: int = 1
    seed: int = 0
    compile_workers: int | None = None
    deadline_s: float | None = None
    prune: float | None = None  # keep in the model only configs within this factor of a point's best
    shortlist: str | tuple[str, ...] | None = None  # time only the configs near the best in these timings
    shortlist_factor: float = 1.10
    shortlist_any_shape: bool = False  # the shortlist's timings may be of other shapes (same dtype and family)
    form: dict | None = None  # a ModelForm's fields; None: the default form
    config_stride: int = 1  # profile every n-th config of the space (CPU tests; splitting a space)
    config_offset: int = 0
    resume: str | None = None  # timings of an earlier, cut-short run of this spec: its complete token counts are kept

    def __post_init__(self) -> None:
        from moekit.ramp.regions import FAMILIES

        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        self.dtype = dtype_name(self.dtype)
        if self.dtype == "float16":
            raise ValueError("dtype must be bf16 or fp8 (the kernels' fp16 runs as bf16 on the GPU)")
        if not self.m_values or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in self.m_values):
            raise ValueError(f"m_values must be ints >= 1, got {list(self.m_values)}")
        if not self.betas or any(not 0 < b <= 1 for b in self.betas):
            raise ValueError(f"betas must be in (0, 1], got {list(self.betas)}")
        for name in ("iters", "capacity", "config_stride"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prune is not None and not self.prune > 1:
            raise ValueError(f"prune must be a factor > 1, got {self.prune}")
        if not self.shortlist_factor > 1:
            raise ValueError(f"shortlist_factor must be > 1, got {self.shortlist_factor}")
        if isinstance(self.shortlist, str):
            self.shortlist = (self.shortlist,)
        self.shortlist = tuple(self.shortlist) if self.shortlist else None


def _resumed(spec: ProfileSpec, shape: MoEShape, routed: int, configs: list[KernelConfig],
             points: list[PointSpec]) -> tuple[Timings, list[int]]:
    """(the timings of ``spec.resume``, the token counts it completed), checked to be this
    profile's: same shape, precision, family, configurations and points."""
    t, meta = load_timings(spec.resume)
    where = spec.resume
    if (t.shape.num_experts, t.shape.top_k, t.shape.hidden, t.shape.intermediate) != \
            (shape.num_experts, shape.top_k, shape.hidden, shape.intermediate) or t.dtype != spec.dtype \
            or meta["family"] != spec.family or t.routed_experts != routed:
        raise ValueError(f"{where}: made for another shape, dtype or family; it cannot resume this profile")
    if list(t.configs) != list(configs):
        raise ValueError(f"{where}: its configurations differ from this profile's ({len(t.configs)} vs {len(configs)})")
    want = [(p.M, p.beta) for p in points]
    if [(p.M, p.beta) for p in t.points] != want:
        raise ValueError(f"{where}: its points differ from this profile's (token counts, betas)")
    ours = [make_routing(shape, routed, p).counts for p in points]
    if any(not np.array_equal(a, p.counts) for a, p in zip(ours, t.points)):
        raise ValueError(f"{where}: its routing differs from this profile's (another seed?)")
    return t, complete_token_counts(t, meta)


def complete_token_counts(t: Timings, meta: dict) -> list[int]:
    """The token counts a profile's timings file completed (every configuration tried at
    them): recorded by the profile; for a file written before that, those measured throughout."""
    done = meta.get("params", {}).get("complete_m")
    if done is None:
        done = {p.M for p in t.points} - {p.M for j, p in enumerate(t.points) if not np.isfinite(t.times[j]).all()}
    return sorted(int(m) for m in done)


def profile(spec: ProfileSpec, out_dir: str | Path | None, log: Callable[[str], None] = print,
            hidden_override: dict | None = None) -> dict:
    """Time, fit and write: returns the record (model path, timings path, summary)."""
    from moekit.bench.report import environment, write_record
    from moekit.ramp.costmodel import ModelForm, fit, regret
    from moekit.ramp.modelfile import model_filename, save_model
    from moekit.ramp.regions import hardware_for

    shape, routed = resolve_shape(spec.shape, experts=spec.experts, top_k=spec.top_k, hidden=spec.hidden,
                                  intermediate=spec.intermediate, routed_experts=spec.routed_experts)
    timer = ConfigTimer(TimerSpec(shape, routed, spec.dtype, spec.family, spec.capacity, spec.iters, spec.warmup,
                                  seed=spec.seed, compile_workers=spec.compile_workers, deadline_s=spec.deadline_s),
                        log)
    configs = family_configs(shape, spec.dtype, spec.family, timer.device if timer.on_gpu else None)
    configs = configs[spec.config_offset::spec.config_stride]
    if not configs:
        raise ValueError(f"config_offset={spec.config_offset} leaves no config of the {spec.family} space")
    space = len(configs)
    if spec.shortlist:
        refs = [_shortlist_reference(path, shape, spec) for path in spec.shortlist]
        configs = shortlist_configs(configs, refs, spec.shortlist_factor)
        log(f"shortlist: {len(configs)} of {space} configs came within {spec.shortlist_factor:g}x of a point's best "
            f"in {', '.join(spec.shortlist)}")
    points = grid_points(spec.m_values, spec.betas, spec.seed)
    hw = hardware_for(device=timer.device if timer.on_gpu else None)
    est = estimate_seconds(shape, len(configs), points, spec.family, timer.on_gpu, spec.iters, spec.warmup,
                           fp8=spec.dtype == "float8_e4m3fn")
    log(f"moekit ramp profile: {shape.name} (E={shape.num_experts} K={shape.top_k} H={shape.hidden} "
        f"N={shape.intermediate}, routed over {routed}) {spec.dtype}, family {spec.family}, on "
        f"{torch.cuda.get_device_name() if timer.on_gpu else 'CPU (interpreter)'} ({hw.key}); "
        f"{len(configs)} configs x {len(points)} points; est. {est:.0f} s")
    kept, done = _resumed(spec, shape, routed, configs, points) if spec.resume else (None, [])
    if done:
        log(f"resuming {spec.resume}: token counts {done} are measured there; "
            f"timing {sorted({p.M for p in points} - set(done))}")
    tpath = None if out_dir is None else \
        Path(out_dir) / f"profile-{hw.key}-{shape.name}-{spec.dtype}-{spec.family}-timings.json.gz"
    capacity = spec.capacity if spec.family == "expert_major" else None

    def merged(t: Timings) -> Timings:
        if kept is not None:
            rows = [j for j, p in enumerate(points) if p.M in done]
            t.times[rows] = kept.times[rows]
            if t.baseline is not None and kept.baseline is not None:
                t.baseline[rows] = kept.baseline[rows]
        return t

    def save(t: Timings, complete_m: list) -> None:
        # The raw timings first, after every token count: whatever happens next (the fit, the
        # call's time limit), what was measured is kept, and --resume can go on from it.
        params = {"profile": asdict(spec), "complete_m": sorted(set(done) | set(complete_m))}
        save_timings(merged(t), tpath, params=params, family=spec.family, capacity=capacity)

    run = timer.run(configs, points, skip_m=frozenset(done), after_group=save if tpath is not None else None)
    t = merged(run.timings)
    run.complete_m = sorted(set(done) | set(run.complete_m))
    if tpath is not None:
        save(t, run.complete_m)
    form = ModelForm(**spec.form) if spec.form else ModelForm()
    elem = 1 if spec.dtype == "float8_e4m3fn" else 2
    model = fit(t, hw, form, family=spec.family, capacity=spec.capacity if spec.family == "expert_major" else None,
                elem_bytes=elem)
    kept = list(range(len(configs)))
    if spec.prune:
        kept = prune_configs(t, spec.prune)
        model = fit(Timings(t.shape, t.routed_experts, t.dtype, [configs[i] for i in kept], t.points,
                            t.times[:, kept], t.baseline, t.environment), hw, form, family=spec.family,
                    capacity=model.capacity, elem_bytes=elem)
    fit_regret = regret(model, t)
    env = environment()
    profile_meta = {"m_values": list(spec.m_values), "betas": list(spec.betas), "points": len(points),
                    "iters": spec.iters, "seconds": round(run.seconds, 1), "compile_seconds": round(run.compile_seconds, 1),
                    "timed_configs": len(configs), "space_configs": space, "kept_configs": len(kept),
                    "prune": spec.prune, "shortlist": spec.shortlist,
                    "shortlist_factor": spec.shortlist_factor if spec.shortlist else None,
                    "shortlist_any_shape": spec.shortlist_any_shape if spec.shortlist else None,
                    "failed": len(run.errors), "incomplete": run.incomplete, "complete_m": run.complete_m,
                    "resumed_from": spec.resume,
                    "fit_regret_mean": fit_regret.mean, "fit_regret_max": fit_regret.max,
                    "fit_regret_complete_mean": fit_regret.complete_mean,
                    "fit_regret_complete_max": fit_regret.complete_max,
                    "partial_points": int((~fit_regret.complete).sum())}
    record = {"shape": shape.name, "gpu": hw.key, "dtype": spec.dtype, "family": spec.family, "profile": profile_meta,
              "errors": dict(list(run.errors.items())[:50])}
    log(f"fitted {len(model.variants)} variants of {len(model.configs)} configs; regret on the profiling points: "
        f"{fit_regret.describe()}; {run.seconds:.0f} s in all"
        f"{f'; {len(run.errors)} (config, point) failures' if run.errors else ''}")
    if out_dir is None:
        record["model"] = model
        record["timings"] = t
        return record
    out = Path(out_dir)
    mpath = save_model(model, out / model_filename(hw.key, shape, spec.dtype, spec.family), dtype=spec.dtype,
                       routed_experts=routed, profile=profile_meta, environment=env)
    record |= {"model_file": str(mpath), "timings_file": str(tpath)}
    rpath = write_record("ramp-profile", {"spec": asdict(spec)}, record, out_dir=out)
    record["record"] = str(rpath)
    log(f"model: {mpath}\ntimings: {tpath}\nrecord: {rpath}")
    return record
