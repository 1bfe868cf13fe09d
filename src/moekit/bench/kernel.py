"""`moekit bench kernel`: every fused-MoE kernel config, timed across batch sizes and routing skews.

The dataset the RaMP paper fits its cost model on, and the fused kernel's report. For each model
shape, batch size M and target routing balancedness beta (a *point*), every config of
``moekit.kernels.config_space`` (or every ``--config-stride``-th) runs
``moekit.kernels.fused_moe`` on the same inputs; the run records each config's median / p95 /
min µs, the torch baseline (``moekit.bench.kernel_baseline``) measured in the same run, and the
ceilings of the device (HBM copy GB/s, bf16 matmul TFLOP/s).

Shapes (``MODELS``): the presets olmoe-1b-7b, qwen3-30b-a3b, mixtral-8x7b; ``deepseek-v3-tp8``,
a tensor-parallel shard of DeepSeek-V3's experts (all 256 experts, intermediate 2048 / 8 = 256);
``deepseek-v3-ep32``, an expert-parallel shard (32 local experts of full size): the router picks
top-8 of all 256 experts and the slots that land outside the shard (experts 32..255) are -1, so M
is the number of tokens arriving at the layer and about M of the 8M pairs are local.

Routing: ``moekit.routing.synthetic_routing(M, routed_experts, K, beta=beta, seed=seed + M)`` (the
same random numbers at every beta of one M, so the betas differ only in skew). The realized
beta is recorded; the most skewed routing a top-K router can produce has beta = log K / log E,
so a lower target gives that routing.

Timing on a GPU (``moekit.bench.timing.time_cold``): each config's whole call (alignment,
kernels, output allocation and cast) is captured once per (shape, M) in a CUDA graph; for each
beta the routing is copied into the graph's input buffers, one replay is checked against the
torch baseline (relative error < ``tol``; a config that fails is recorded, not timed), then
``warmup + iters`` replays are timed with CUDA events, each after an L2 flush (a 256 MB read)
queued outside the timed region, so the expert weights come from HBM and the host's launch
gaps are not in the numbers. Triton compiles each (shape, config) once; the on-disk cache is
first filled by a pool of processes (``--compile-workers``), one small launch per config and M.

On the CPU (``--tiny`` or ``--hidden/--intermediate``) the kernels run in Triton's
interpreter in float32/float16 and are timed with the host clock: slow and meaningless as
numbers, but the same pipeline end to end (what CI tests).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moekit.bench.kernel_baseline import IMPLS as BASELINE_IMPLS
from moekit.bench.kernel_baseline import make_torch_moe, resolve_impl
from moekit.bench.kernel_report import (
    TABLE_FORMAT,
    TABLE_VERSION,
    draw_kernel_figures,
    format_kernel_report,
    load_table,
    merge_tables,
    save_table,
    summarize_table,
)
from moekit.bench.ceilings import measure_ceilings
from moekit.bench.report import DEFAULT_OUT_DIR, cpu_smoke_line, environment, write_record
from moekit.bench.stats import summarize
from moekit.bench.timing import DEFAULT_FLUSH_BYTES, L2Flusher, capture_graph, queue_cold, time_cold
from moekit.bench.triton_kernels import load_kernels
from moekit.outputs import check_output_dir
from moekit.routing import balancedness, expert_counts, synthetic_routing
from moekit.shapes import MoEShape, get_shape

MODELS = ("olmoe-1b-7b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3-tp8", "deepseek-v3-ep32")
DEFAULT_M = (1, 4, 16, 64, 256, 1024, 4096)
DEFAULT_BETAS = (1.0, 0.75, 0.5, 0.25)
TP_DEGREE = 8  # deepseek-v3-tp8: intermediate / 8
EP_LOCAL_EXPERTS = 32  # deepseek-v3-ep32: 256 experts over 8 ranks
TINY_HIDDEN, TINY_INTERMEDIATE = 64, 32
# Where the touched expert weights are at least this many times the L2 size, one call streams
# them through L2 and evicts its own earlier lines (reuse distance >> L2): they cannot be in L2
# at the next call's start, so the flush (a 256 MB read per replay) is skipped there.
FLUSH_SKIP_FACTOR = 4
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# --------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class BenchShape:
    """What the kernel sees: ``num_experts`` expert weights of [2N, H] and [H, N], top-k routing
    over ``routed_experts`` experts (more than ``num_experts`` for an EP shard: the slots that
    pick an expert outside the shard are -1)."""

    name: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    routed_experts: int

    @property
    def moe_shape(self) -> MoEShape:
        """The kernel-facing MoEShape (for config_space / default_config)."""
        return MoEShape(self.name, self.num_experts, self.top_k, self.hidden, self.intermediate)

    @property
    def expert_bytes_per_elem(self) -> int:
        """Elements of one expert's weights (gate + up + down)."""
        return 3 * self.hidden * self.intermediate


def bench_shape(name: str, hidden: int | None = None, intermediate: int | None = None) -> BenchShape:
    """The shape called ``name`` (one of ``MODELS``), with H and/or N replaced if given."""
    if name not in MODELS:
        raise ValueError(f"models must be among {', '.join(MODELS)}, got {name!r}")
    base = get_shape("deepseek-v3" if name.startswith("deepseek-v3") else name)
    E, N = base.num_experts, base.intermediate
    if name == "deepseek-v3-tp8":
        N = base.intermediate // TP_DEGREE
    local = EP_LOCAL_EXPERTS if name == "deepseek-v3-ep32" else E
    return BenchShape(name, local, base.top_k, hidden or base.hidden, intermediate or N, routed_experts=E)


# -------------------------------------------------------------------------------- options


def _positive_ints(name: str, values, high: int | None = None) -> tuple[int, ...]:
    values = tuple(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 or (high and v > high)
                         for v in values):
        raise ValueError(f"{name} must be a non-empty list of ints in [1, {high or 'inf'}], got {list(values)}")
    return values


@dataclass(frozen=True)
class KernelBenchConfig:
    models: tuple[str, ...] = MODELS
    m_values: tuple[int, ...] = DEFAULT_M
    betas: tuple[float, ...] = DEFAULT_BETAS
    iters: int = 20  # timed replays per (config, point); the median is reported
    warmup: int = 2  # untimed replays before them
    slow_iters: int | None = None  # fewer timed replays for configs >= slow_factor x the best so far
    slow_factor: float = 3.0
    config_stride: int = 1  # time every stride-th config of the space ...
    config_offset: int = 0  # ... starting at this one (split the space over device calls)
    dtype: str | None = None  # default: bfloat16 on a GPU, float32 on the CPU
    hidden: int | None = None  # replace every shape's H (CPU runs)
    intermediate: int | None = None  # replace every shape's N
    seed: int = 0
    baseline: str = "auto"  # torch baseline: auto | grouped_mm | loop
    tol: float = 1e-2  # relative error vs the baseline above which a config is not timed
    compile_workers: int | None = None  # processes filling the Triton cache (None: min(16, cores); 0: none)
    flush_mb: int = DEFAULT_FLUSH_BYTES >> 20  # L2 flush read before each timed replay ...
    always_flush: bool = False  # ... also where the touched weights are >= FLUSH_SKIP_FACTOR x L2
    queue_ahead_us: float = 20.0
    copy_mb: int | None = None  # HBM ceiling: copy size (default 1024 on GPU, 64 on CPU)
    matmul_n: int | None = None  # matmul ceiling: n x n x n (default 8192 on GPU, 256 on CPU)
    deadline_s: float | None = None  # stop starting new work after this many seconds (results kept)

    def __post_init__(self) -> None:
        for m in self.models:
            if m not in MODELS:
                raise ValueError(f"models must be among {', '.join(MODELS)}, got {m!r}")
        if not self.models:
            raise ValueError("models must name at least one model")
        object.__setattr__(self, "m_values", _positive_ints("m_values", self.m_values, 1 << 20))
        betas = tuple(float(b) for b in self.betas)
        if not betas or any(not 0.0 < b <= 1.0 for b in betas):
            raise ValueError(f"betas must be a non-empty list of numbers in (0, 1], got {list(self.betas)}")
        object.__setattr__(self, "betas", betas)
        for name, low in (("iters", 1), ("warmup", 0), ("config_stride", 1), ("config_offset", 0), ("seed", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        for name in ("hidden", "intermediate", "copy_mb", "matmul_n", "slow_iters"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.baseline not in BASELINE_IMPLS:
            raise ValueError(f"baseline must be one of {BASELINE_IMPLS}, got {self.baseline!r}")
        if not 0.0 < self.tol < 1.0:
            raise ValueError(f"tol must be in (0, 1), got {self.tol}")
        if self.compile_workers is not None and (not isinstance(self.compile_workers, int) or self.compile_workers < 0):
            raise ValueError(f"compile_workers must be an int >= 0, got {self.compile_workers!r}")
        if not isinstance(self.flush_mb, int) or self.flush_mb < 0:
            raise ValueError(f"flush_mb must be an int >= 0, got {self.flush_mb!r}")
        if not self.queue_ahead_us >= 0:
            raise ValueError(f"queue_ahead_us must be >= 0, got {self.queue_ahead_us}")
        if not self.slow_factor > 1.0:
            raise ValueError(f"slow_factor must be > 1, got {self.slow_factor}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")

    def shapes(self) -> list[BenchShape]:
        return [bench_shape(m, self.hidden, self.intermediate) for m in self.models]


def _run_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def resolve_dtype(cfg: KernelBenchConfig, device: torch.device) -> torch.dtype:
    """bf16 on a GPU, fp32 on the CPU; bf16 on the CPU is refused (the interpreter's bf16 dot is wrong)."""
    if cfg.dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type != "cuda" and cfg.dtype == "bfloat16":
        raise ValueError("dtype bfloat16 needs a GPU: Triton's CPU interpreter computes bf16 dots wrongly; "
                         "use float32 or float16 on the CPU")
    return _DTYPES[cfg.dtype]


def _kernels():
    """moekit.kernels for this machine (Triton's interpreter without a GPU); ValueError without Triton."""
    return load_kernels(what="moekit bench kernel")


# ------------------------------------------------------------------------ configs, ids


def config_id(c) -> str:
    """``c.id`` (:attr:`moekit.kernels.KernelConfig.id`), for the scripts that import it from here."""
    return c.id


def config_record(c) -> dict:
    return {"id": c.id, **asdict(c)}


def selected_configs(shape: BenchShape, cfg: KernelBenchConfig, device: torch.device, dtype: torch.dtype):
    """(every config of the space for this shape, the ones this run times)."""
    space = _kernels().config_space(shape.moe_shape, device if device.type == "cuda" else None, dtype=dtype)
    return space, space[cfg.config_offset::cfg.config_stride]


# ------------------------------------------------------------------------ routing, work


@dataclass
class PointRouting:
    beta: float
    realized_beta: float
    ids: torch.Tensor  # [M, K] int64, -1 = masked (outside the shard)
    weights: torch.Tensor  # [M, K] float32, 0 on masked slots


def point_routing(shape: BenchShape, M: int, beta: float, seed: int) -> PointRouting:
    """Routing of M tokens at target balancedness ``beta`` (over all routed experts), cut to the
    shard's experts [0, num_experts)."""
    ids, w = synthetic_routing(M, shape.routed_experts, shape.top_k, beta=beta, seed=seed)
    realized = float(balancedness(expert_counts(ids, shape.routed_experts)))
    local = ids < shape.num_experts
    ids = torch.where(local, ids, torch.full_like(ids, -1))
    return PointRouting(beta, realized, ids, torch.where(local, w, torch.zeros_like(w)))


def point_work(shape: BenchShape, ids: torch.Tensor, elem_bytes: int) -> dict:
    """What one call must do at least: the bytes it must move and the FLOPs of the routed pairs.

    bytes = touched experts x 3 H N (their gate, up and down weights, read once) + the routed
    tokens' rows of x (read once) + y (M x H, written once), in the run's dtype;
    flops = 6 H N per routed (token, slot) pair (2 per multiply-add: 2N x H up, H x N down).
    """
    valid = ids >= 0
    M = ids.shape[0]
    pairs = int(valid.sum())
    touched = int(torch.unique(ids[valid]).numel())
    tokens = int(valid.any(dim=1).sum())
    H, N = shape.hidden, shape.intermediate
    weight_bytes = touched * 3 * H * N * elem_bytes
    return {"pairs": pairs, "touched_experts": touched, "tokens_routed": tokens, "weight_bytes": weight_bytes,
            "bytes": weight_bytes + (tokens + M) * H * elem_bytes, "flops": 6 * pairs * H * N}


# ----------------------------------------------------------------------- time estimate

# Rough per-item costs on a GPU machine whose host is slow (~10 µs of CPU per launch). They
# only size the device calls; the run prints its real progress and rate.
EST_COMPILE_S = 1.5  # one Triton kernel compile, one CPU core
EST_CONFIG_S = 0.01  # per (config, M): first eager call + graph capture
EST_CHECK_S = 0.002  # per (config, point): copy routing, one replay, error check
EST_HOST_ITER_US = 45.0  # host time to queue one timed iteration
EST_FIXED_US = 20.0  # alignment (one or two Triton launches) + memset + cast inside every call
EST_SLOWDOWN = 2.5  # average config vs the roofline time
EST_POINT_S = 0.5  # per point: routing, baseline (+ reference check), alignment timing
EST_ROUTING_S_PER_4K = 1.0  # synthetic_routing's bisection at M = 4096
# Triton's interpreter runs each program of a launch in Python: a call's time follows the experts the
# routing touches (their row blocks) and, less, the experts in all (the sorted layout's padding). Fitted
# to calls on a 2-core CPU (with other work beside it) at the --tiny sizes, mean over configs: mixtral
# 0.7 s at M = 1 and 2.1 s at M = 16, olmoe 1.2 / 10.4 s, deepseek-v3-tp8 (E = 256) 2.3 / 18.8 s;
# larger H and N cost about sqrt(H N) more (x1.7-2.7 at 4x the tiny H N). align_tokens: 0.4 s a call.
EST_INTERPRET_CALL_S = 0.17  # one fused_moe call in the interpreter, at the --tiny sizes: fixed part ...
EST_INTERPRET_TOUCHED_S = 0.24  # ... per expert the routing touches ...
EST_INTERPRET_EXPERT_S = 0.006  # ... and per expert of the shard
EST_INTERPRET_ALIGN_S = 0.4  # one align_tokens call
NOMINAL_HBM_GBPS, NOMINAL_TFLOPS = 4300.0, 790.0  # the reference device's rates (the H200 preset)


def _roofline_us(shape: BenchShape, M: int, elem_bytes: int) -> float:
    """Lower-bound µs of one call under uniform routing (enough for sizing the run)."""
    pairs = M * shape.top_k * shape.num_experts / shape.routed_experts
    touched = shape.num_experts * (1 - (1 - 1 / shape.routed_experts) ** (M * shape.top_k))
    byt = touched * shape.expert_bytes_per_elem * elem_bytes + 2 * M * shape.hidden * elem_bytes
    flops = 6 * pairs * shape.hidden * shape.intermediate
    return max(byt / (NOMINAL_HBM_GBPS * 1e3), flops / (NOMINAL_TFLOPS * 1e6))


def estimate_group_s(shape: BenchShape, M: int, n_configs: int, cfg: KernelBenchConfig, on_gpu: bool,
                     elem_bytes: int, n_block_sizes: int = 1) -> float:
    """Estimated seconds for one (shape, M): every config at every beta (``n_block_sizes``: the
    configs' distinct block rows, each an alignment timed per point)."""
    n_b = len(cfg.betas)
    routing = n_b * (EST_POINT_S + EST_ROUTING_S_PER_4K * M / 4096)
    reps = cfg.iters + cfg.warmup
    touched = shape.num_experts * (1 - (1 - 1 / shape.routed_experts) ** (M * shape.top_k))
    if not on_gpu:
        size = math.sqrt(shape.hidden * shape.intermediate / (TINY_HIDDEN * TINY_INTERMEDIATE))
        call_s = max(size, 1.0) * (EST_INTERPRET_CALL_S + EST_INTERPRET_TOUCHED_S * touched
                                   + EST_INTERPRET_EXPERT_S * shape.num_experts)
        align_s = n_block_sizes * reps * EST_INTERPRET_ALIGN_S
        return routing + n_b * (align_s + n_configs * (reps + 1) * call_s)  # + 1: the checked call
    flushed = cfg.always_flush or touched * shape.expert_bytes_per_elem * elem_bytes < FLUSH_SKIP_FACTOR * 60e6
    flush_us = cfg.flush_mb * 2**20 / (NOMINAL_HBM_GBPS * 1e3) if flushed else 0.0
    gpu_us = flush_us + cfg.queue_ahead_us + EST_FIXED_US + EST_SLOWDOWN * _roofline_us(shape, M, elem_bytes)
    per_point = EST_CHECK_S + reps * max(gpu_us, EST_HOST_ITER_US) * 1e-6
    baseline = n_b * reps * (gpu_us + 100.0) * 1e-6
    return routing + baseline + n_configs * (EST_CONFIG_S + n_b * per_point)


def compiled_kernels(config, m_values, plan=None) -> int:
    """How many kernels Triton compiles for ``config`` over ``m_values``: the addressing
    (direct where M <= bm, sorted above) is a compile-time constant, so each path present is
    its own binary of every launch (fused: one; two_launch: GEMM1 and a GEMM2, except the
    decode schedule, direct addressing without split-K, which is one persistent kernel while
    ``plan.decode_persistent`` holds, a LaunchPlan, None: the default). The batch-size ints are not
    specialized, so the M values of one path mostly share a binary (a lower bound: a few plan
    constants follow M)."""
    from moekit.kernels.plan import DEFAULT_PLAN

    direct = any(M <= config.bm for M in m_values)
    sorted_ = any(M > config.bm for M in m_values)
    if config.form == "fused":
        return direct + sorted_
    decode_launches = 1 if config.split_k == 1 and (plan or DEFAULT_PLAN).decode_persistent else 2
    return direct * decode_launches + sorted_ * 2


def estimate_compile_s(n_kernels: int, workers: int) -> float:
    return n_kernels * EST_COMPILE_S / max(1, workers)


# ----------------------------------------------------------------- compile warm-up pool

_WORKER: dict = {}
WARM_TASK_TIMEOUT_S = 120  # the longest wait for one (shape, config) of the compile pool (a dead worker)


def _warm_inputs(shape: dict, dtype: torch.dtype, m_values) -> dict:
    """Random inputs of the real sizes (values do not matter: compiling depends on sizes)."""
    if _WORKER.get("shape") != shape:
        _WORKER.clear()
        cuda = torch.cuda.is_available()  # (the CPU path only serves to test the pool)
        if cuda:
            torch.cuda.empty_cache()
        dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        E, K, H, N = shape["num_experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
        w13 = torch.empty(E, 2 * N, H, device=dev, dtype=dtype).normal_(0.0, H**-0.5)
        w2 = torch.empty(E, H, N, device=dev, dtype=dtype).normal_(0.0, N**-0.5)
        inputs = {M: (torch.randn(M, H, device=dev, dtype=dtype), torch.randint(0, E, (M, K), device=dev),
                      torch.rand(M, K, device=dev)) for M in m_values}
        _WORKER.update(shape=shape, w13=w13, w2=w2, inputs=inputs)
    return _WORKER


def _warm_task(task) -> tuple[str, str | None]:
    """Launch one config at every M once (compiling it into Triton's on-disk cache)."""
    shape, cfg_fields, m_values, dtype_name = task
    from moekit.kernels import KernelConfig, fused_moe

    cfg = KernelConfig(**cfg_fields)
    st = _warm_inputs(shape, _DTYPES[dtype_name], m_values)
    try:
        for M in m_values:
            x, ids, w = st["inputs"][M]
            fused_moe(x, st["w13"], st["w2"], ids, w, cfg)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - any compile/launch failure is recorded, not fatal
        return cfg.id, _one_line(error)
    return cfg.id, None


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def warm_compile_cache(jobs: list[tuple[BenchShape, list]], m_values, dtype: torch.dtype, workers: int,
                       log: Callable[[str], None]) -> dict[str, str]:
    """Fill Triton's on-disk cache for every (shape, config) with a pool of ``workers`` processes.

    Returns {config id @ shape: error} for the configs that failed to compile or launch.
    """
    dtype_name = next(k for k, v in _DTYPES.items() if v == dtype)
    tasks = [({f: getattr(s, f) for f in ("num_experts", "top_k", "hidden", "intermediate")},
              asdict(c), tuple(m_values), dtype_name)
             for s, configs in jobs for c in configs]
    if not tasks:
        return {}
    names = [s.name for s, configs in jobs for _ in configs]
    errors, start = {}, time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    with ctx.Pool(min(workers, len(tasks))) as pool:
        results = pool.imap(_warm_task, tasks)
        for done, name in enumerate(names, 1):
            try:
                cid, err = results.next(timeout=WARM_TASK_TIMEOUT_S)
            except multiprocessing.TimeoutError:  # a worker died or hung: compile the rest in the run
                log(f"  no answer from the compile pool for {WARM_TASK_TIMEOUT_S} s; going on without it")
                pool.terminate()
                break
            if err:
                errors[f"{cid}@{name}"] = err
            if done % 100 == 0 or done == len(tasks):
                log(f"  compiled {done}/{len(tasks)} (shape, config) pairs in {time.perf_counter() - start:.0f} s"
                    f"{f', {len(errors)} failed' if errors else ''}")
    return errors


# -------------------------------------------------------------------------- measuring


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _stats(samples: list[float]) -> tuple[float, float, float]:
    s = summarize(samples)
    return s["median"], s["p95"], s["min"]


@dataclass
class _Group:
    """The inputs of one (shape, M): fixed buffers that every captured graph reads."""

    shape: BenchShape
    M: int
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    routings: list[PointRouting]
    refs: list[torch.Tensor] = field(default_factory=list)  # baseline outputs, one per beta
    flushers: list = field(default_factory=list)  # per beta: the L2 flusher, or None where not needed
    best_check_us: list[float] = field(default_factory=list)  # per beta: fastest check replay so far

    def write(self, r: PointRouting) -> None:
        self.ids.copy_(r.ids)
        self.weights.copy_(r.weights)


class KernelBench:
    """One run: the shapes' configs at every (M, beta), in the order shape -> M -> config -> beta."""

    def __init__(self, cfg: KernelBenchConfig, log: Callable[[str], None] = print):
        self.cfg = cfg
        self.log = log
        self.device = _run_device()
        self.on_gpu = self.device.type == "cuda"
        if not self.on_gpu and cfg.hidden is None and cfg.intermediate is None:
            raise ValueError("without a GPU the kernels run in Triton's interpreter: pass --tiny "
                             "(or --hidden/--intermediate) to shrink the shapes")
        self.dtype = resolve_dtype(cfg, self.device)
        self.elem = torch.empty((), dtype=self.dtype).element_size()
        self.kernels = _kernels()
        self.shapes = cfg.shapes()
        self.configs = {s.name: selected_configs(s, cfg, self.device, self.dtype) for s in self.shapes}
        self.start = time.perf_counter()
        self.flusher = L2Flusher(cfg.flush_mb << 20, self.device) if self.on_gpu and cfg.flush_mb else None
        # H100 50 MB, H200 60 MB; 60 MB where this torch does not report it.
        props = torch.cuda.get_device_properties(self.device) if self.on_gpu else None
        self.l2_bytes = getattr(props, "L2_cache_size", 60 << 20) if self.on_gpu else 0
        self.baseline_impl = resolve_impl(cfg.baseline, self.device, self.dtype)

    # -- plan ----------------------------------------------------------------------------

    def timed_configs(self, shape: BenchShape) -> tuple[list, dict[int, object]]:
        """(configs timed for ``shape``: the selected part of the space + any default_config
        outside it, {M: default config})."""
        configs = list(self.configs[shape.name][1])
        defaults = {M: self.kernels.default_config(M, shape.moe_shape) for M in self.cfg.m_values}
        for d in defaults.values():
            if d not in configs:
                configs.append(d)
        return configs, defaults

    def estimate(self) -> dict:
        cfg, workers = self.cfg, self._workers()
        groups = {(s.name, M): estimate_group_s(s, M, len(self.timed_configs(s)[0]), cfg, self.on_gpu, self.elem,
                                                len({c.bm for c in self.timed_configs(s)[0]}))
                  for s in self.shapes for M in cfg.m_values}
        kernels = sum(compiled_kernels(c, cfg.m_values) for s in self.shapes for c in self.timed_configs(s)[0])
        compile_s = estimate_compile_s(kernels, workers) if self.on_gpu else 0.0
        return {"compile_s": compile_s, "groups_s": groups, "total_s": compile_s + sum(groups.values()) + 20.0}

    def _workers(self) -> int:
        if not self.on_gpu:
            return 0
        if self.cfg.compile_workers is not None:
            return self.cfg.compile_workers
        return min(16, os.cpu_count() or 1)

    def describe(self) -> str:
        est = self.estimate()
        lines = [f"moekit bench kernel on {self.device} ({torch.cuda.get_device_name() if self.on_gpu else 'CPU'}), "
                 f"{self.dtype}, M in {list(self.cfg.m_values)}, beta in {list(self.cfg.betas)}, "
                 f"{self.cfg.iters} timed + {self.cfg.warmup} warm-up replays per (config, point); baseline: "
                 f"{self.baseline_impl}"]
        for s in self.shapes:
            space, chosen = self.configs[s.name]
            timed = self.timed_configs(s)[0]
            lines.append(f"  {s.name}: E={s.num_experts} (routed over {s.routed_experts}) K={s.top_k} H={s.hidden} "
                         f"N={s.intermediate}; {len(chosen)}/{len(space)} configs of the space"
                         f"{f' + {len(timed) - len(chosen)} default' if len(timed) > len(chosen) else ''}; "
                         f"est. {sum(v for (n, _), v in est['groups_s'].items() if n == s.name):.0f} s")
        lines.append(f"estimated run time: {est['total_s']:.0f} s (compile {est['compile_s']:.0f} s with "
                     f"{self._workers()} workers; a rough guess, see the progress lines for the real rate)")
        return "\n".join(lines)

    # -- run -----------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def run(self) -> dict:
        cfg = self.cfg
        self.log(self.describe())
        est = self.estimate()
        compile_errors = {}
        if self._workers() > 0:
            self.log(f"filling the Triton cache with {self._workers()} processes ...")
            jobs = [(s, self.timed_configs(s)[0]) for s in self.shapes]
            compile_errors = warm_compile_cache(jobs, cfg.m_values, self.dtype, self._workers(), self.log)
        ceilings = self._ceilings()
        self.log(f"ceilings: HBM copy {ceilings['hbm_gbps']:.0f} GB/s, matmul {ceilings['matmul_tflops']:.1f} TFLOP/s "
                 f"({self.elapsed():.0f} s)")
        table = self._empty_table(ceilings)
        table["compile_errors"] = compile_errors
        spent_est = spent = 0.0
        for shape in self.shapes:
            weights = self._weights(shape)
            for M in cfg.m_values:
                group_est = est["groups_s"][(shape.name, M)]
                rate = max(1.0, spent / spent_est) if spent_est else 1.0
                if cfg.deadline_s is not None and self.elapsed() + group_est * rate > cfg.deadline_s:
                    table["incomplete"].append({"shape": shape.name, "M": M, "reason": "skipped: deadline"})
                    self.log(f"[{shape.name} M={M}] skipped: would pass the deadline ({group_est * rate:.0f} s)")
                    continue
                t0 = time.perf_counter()
                points = self._measure_group(shape, M, weights, table, ceilings)
                spent += time.perf_counter() - t0
                spent_est += group_est
                table["points"].extend(points)
                left = sum(v for k, v in est["groups_s"].items()) - spent_est
                self.log(f"[{shape.name} M={M}] {time.perf_counter() - t0:.1f} s (est. {group_est:.1f}); "
                         f"elapsed {self.elapsed():.0f} s, about {left * max(1.0, spent / spent_est):.0f} s left")
            del weights
            if self.on_gpu:
                torch.cuda.empty_cache()
        table["run_seconds"] = self.elapsed()
        return table

    def _ceilings(self) -> dict:
        copy_mb = self.cfg.copy_mb or (1024 if self.on_gpu else 64)
        n = self.cfg.matmul_n or (8192 if self.on_gpu else 256)
        return measure_ceilings(self.device, self.dtype, copy_mb << 20, n)

    def _empty_table(self, ceilings: dict) -> dict:
        configs, shapes = [], {}
        index: dict[str, int] = {}
        for s in self.shapes:
            timed, defaults = self.timed_configs(s)
            for c in timed:
                index.setdefault(c.id, len(index))
                if len(configs) < len(index):
                    configs.append(config_record(c))
            shapes[s.name] = {
                "num_experts": s.num_experts, "top_k": s.top_k, "hidden": s.hidden, "intermediate": s.intermediate,
                "routed_experts": s.routed_experts, "space_size": len(self.configs[s.name][0]),
                "configs": [index[c.id] for c in timed],
                "default": {str(M): index[d.id] for M, d in defaults.items()},
            }
        params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.cfg).items()}
        from moekit.kernels.pdl import pdl_on

        params |= {"dtype": str(self.dtype).replace("torch.", ""), "device": str(self.device),
                   "baseline_impl": self.baseline_impl, "pdl": pdl_on(self.device),
                   "routing": "synthetic_routing(M, routed_experts, K, beta=beta, seed=seed + M)"}
        return {"format": TABLE_FORMAT, "version": TABLE_VERSION, "environment": environment(), "params": params,
                "ceilings": ceilings, "configs": configs, "shapes": shapes, "points": [], "incomplete": []}

    def _weights(self, shape: BenchShape) -> tuple[torch.Tensor, torch.Tensor]:
        """Random expert weights drawn on the device (a host draw of ~1e9 numbers is too slow)."""
        g = torch.Generator(device=self.device).manual_seed(self.cfg.seed + 17)
        E, H, N = shape.num_experts, shape.hidden, shape.intermediate
        w13 = torch.randn(E, 2 * N, H, generator=g, device=self.device, dtype=self.dtype).mul_(H**-0.5)
        w2 = torch.randn(E, H, N, generator=g, device=self.device, dtype=self.dtype).mul_(N**-0.5)
        return w13, w2

    def _new_group(self, shape: BenchShape, M: int) -> _Group:
        g = torch.Generator(device=self.device).manual_seed(self.cfg.seed + 7 * M + 1)
        x = torch.randn(M, shape.hidden, generator=g, device=self.device, dtype=self.dtype)
        routings = [point_routing(shape, M, b, self.cfg.seed + M) for b in self.cfg.betas]
        ids = torch.empty(M, shape.top_k, dtype=torch.int64, device=self.device)
        w = torch.empty(M, shape.top_k, dtype=torch.float32, device=self.device)
        return _Group(shape, M, x, ids, w, [
            PointRouting(r.beta, r.realized_beta, r.ids.to(self.device), r.weights.to(self.device)) for r in routings])

    def _measure_group(self, shape, M, weights, table, ceilings) -> list[dict]:
        group = self._new_group(shape, M)
        points = [self._point(group, r, weights, ceilings) for r in group.routings]
        timed, _ = self.timed_configs(shape)
        n = len(timed)
        for p in points:
            p["median_us"], p["p95_us"], p["min_us"], p["iters"] = [None] * n, [None] * n, [None] * n, [None] * n
        index = table["shapes"][shape.name]["configs"]
        for i, c in enumerate(timed):
            if self.cfg.deadline_s is not None and self.elapsed() > self.cfg.deadline_s:
                table["incomplete"].append({"shape": shape.name, "M": M,
                                            "reason": f"partial: deadline after {i}/{n} configs"})
                break
            for p, res in zip(points, self._time_config(c, group, weights)):
                if isinstance(res, str):
                    p["errors"][str(index[i])] = res
                else:
                    p["median_us"][i], p["p95_us"][i], p["min_us"][i], p["iters"][i] = res
            if (i + 1) % 60 == 0:
                self.log(f"  {shape.name} M={M}: {i + 1}/{n} configs ({self.elapsed():.0f} s)")
        return points

    def _point(self, group: _Group, r: PointRouting, weights, ceilings) -> dict:
        """The point's routing facts, the baseline (checked against the reference, timed),
        and the alignment's time per token block."""
        shape, (w13, w2) = group.shape, weights
        group.write(r)
        work = point_work(shape, r.ids.cpu(), self.elem)
        flusher = self._flusher_for(work["weight_bytes"])
        group.flushers.append(flusher)
        group.best_check_us.append(math.inf)
        fn, impl = make_torch_moe(group.x, w13, w2, group.ids, group.weights, self.baseline_impl)
        ref_out = fn().clone()
        group.refs.append(ref_out)
        base = {"impl": impl, "rel_err_vs_reference": self._reference_error(group, weights, ref_out),
                "timing": "graph" if self.on_gpu else "host clock"}
        try:
            base["median_us"], base["p95_us"], base["min_us"] = self._time(fn, flusher=flusher)
        except RuntimeError as error:  # not capturable here: time eager calls, queued behind the flush
            self.log(f"  baseline not captured ({_one_line(error)}); timing eager calls")
            base["timing"] = "eager"
            base["median_us"], base["p95_us"], base["min_us"] = self._time(fn, capture=False, flusher=flusher)
        bms = sorted({c.bm for c in self.timed_configs(shape)[0]})
        align = {str(bm): self._time(lambda bm=bm: self.kernels.align_tokens(group.ids, shape.num_experts, bm),
                                     flusher=flusher)[0] for bm in bms}
        counts = torch.bincount(r.ids[r.ids >= 0].cpu(), minlength=shape.num_experts)
        return {"shape": shape.name, "M": group.M, "beta": r.beta, "realized_beta": r.realized_beta,
                "expert_counts": counts.tolist(), **work, "l2_flush": flusher is not None,
                "ceilings": {"hbm_gbps": ceilings["hbm_gbps"], "matmul_tflops": ceilings["matmul_tflops"]},
                "baseline": base, "align_us": align, "errors": {}}

    def _reference_error(self, group: _Group, weights, out: torch.Tensor) -> float:
        """The baseline against moekit.moe.reference_moe (float32 on a GPU, float64 on the CPU)."""
        from moekit.moe.experts import MoEWeights
        from moekit.moe.reference import reference_moe

        ref_dtype = torch.float32 if self.on_gpu else torch.float64
        w = MoEWeights(torch.empty(0), weights[0], weights[1])
        ref = reference_moe(group.x, w, group.ids, group.weights, dtype=ref_dtype)
        return float((out.to(ref_dtype) - ref).norm() / ref.norm().clamp_min(1e-30))

    def _flusher_for(self, weight_bytes: int) -> L2Flusher | None:
        """The flusher, unless the weights are too large to survive in L2 anyway."""
        if self.flusher is None or (not self.cfg.always_flush and weight_bytes >= FLUSH_SKIP_FACTOR * self.l2_bytes):
            return None
        return self.flusher

    def _time(self, fn, capture: bool = True, flusher: L2Flusher | None = None,
              iters: int | None = None) -> tuple[float, float, float]:
        return _stats(time_cold(fn, iters=iters or self.cfg.iters, warmup=self.cfg.warmup,
                                capture=capture and self.on_gpu, flush_bytes=0, flusher=flusher,
                                queue_ahead_us=self.cfg.queue_ahead_us, device=self.device))

    def _check_run(self, run) -> float:
        """One call of ``run`` (untimed work's output is then checked); its µs, host-waited."""
        if not self.on_gpu:
            t0 = time.perf_counter()
            run()
            return (time.perf_counter() - t0) * 1e6
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def _time_config(self, c, group: _Group, weights) -> list:
        """Per beta: (median, p95, min µs, timed replays), or the reason the config was not timed."""
        w13, w2 = weights
        out: dict = {}

        def call():
            out["y"] = self.kernels.fused_moe(group.x, w13, w2, group.ids, group.weights, c)

        run = call
        if self.on_gpu:
            group.write(group.routings[0])
            try:
                call()  # compiles here if the cache missed
                run = capture_graph(call, warmup=1).replay
            except Exception as error:  # noqa: BLE001 - a config that cannot run is recorded, not fatal
                return [_one_line(error)] * len(group.routings)
        if self.on_gpu and self.cfg.slow_iters is None:
            return self._time_betas_queued(run, out, group)
        results = []
        for b, (r, ref) in enumerate(zip(group.routings, group.refs)):
            group.write(r)
            try:
                check_us = self._check_run(run)
            except Exception as error:  # noqa: BLE001 - (CPU path: the first call of the config)
                results.append(_one_line(error))
                continue
            err = _rel_err(out["y"], ref)
            if not err < self.cfg.tol:  # also catches NaN
                results.append(f"relative error {err:.3g} vs the torch baseline (tol {self.cfg.tol:g})")
                continue
            iters = self.cfg.iters
            if self.cfg.slow_iters is not None and check_us > self.cfg.slow_factor * group.best_check_us[b]:
                iters = min(iters, self.cfg.slow_iters)
            group.best_check_us[b] = min(group.best_check_us[b], check_us)
            results.append(self._time(run, capture=False, flusher=group.flushers[b], iters=iters) + (iters,))
        return results

    def _time_betas_queued(self, run, out: dict, group: _Group) -> list:
        """``_time_config`` for a captured graph, every beta queued before one wait: per beta,
        the routing copied into the graph's buffers, one checked replay (its output kept), then
        the timed replays. The host never stalls the GPU between betas; a beta whose check
        fails keeps its error and its timings are dropped."""
        iters = self.cfg.iters
        queued = []
        for r, flusher in zip(group.routings, group.flushers):
            group.write(r)
            run()
            checked = out["y"].clone()
            queued.append((checked, queue_cold(run, iters=iters, warmup=self.cfg.warmup, flusher=flusher,
                                               queue_ahead_us=self.cfg.queue_ahead_us, device=self.device)))
        torch.cuda.synchronize(self.device)
        results = []
        for (checked, samples), ref in zip(queued, group.refs):
            err = _rel_err(checked, ref)
            if not err < self.cfg.tol:  # also catches NaN
                results.append(f"relative error {err:.3g} vs the torch baseline (tol {self.cfg.tol:g})")
            else:
                results.append(_stats(samples()) + (iters,))
        return results


# -------------------------------------------------------------------------------- output


def write_outputs(table: dict, out_dir: str | Path | None, kind: str = "kernel") -> dict:
    """Summarize ``table``; with ``out_dir``, write the summary record, the table and the figures."""
    summary = summarize_table(table)
    record = {"summary": summary}
    if out_dir is None:
        return record
    params = {"table_params": table["params"], "parts": [p["environment"] for p in table.get("parts", [])],
              "measured_on": table["environment"]}
    path = write_record(kind, params, summary, out_dir=out_dir)
    stem = path.with_suffix("")
    record["path"] = str(path)
    record["table"] = str(save_table(table, f"{stem}-table.json.gz"))
    try:
        record["figures"] = [str(p) for p in draw_kernel_figures(table, summary, stem)]
    except ImportError as error:  # matplotlib is optional
        record["figures"] = f"not drawn: {error}"
    return record


# ----------------------------------------------------------------------------------- CLI


# The command line's defaults on the CPU, where every kernel call runs in Triton's interpreter
# (~0.2 s each at the --tiny sizes): the GPU's defaults (KernelBenchConfig's) would take
# about 11 hours there; these take seconds and still run every step of the pipeline.
CPU_DEFAULTS = dict(models=("mixtral-8x7b",), m_values=(1, 16), betas=(1.0, 0.5), iters=3, warmup=1,
                    config_stride=20)


def _by_device(name: str) -> str:
    gpu, cpu = getattr(KernelBenchConfig(), name), CPU_DEFAULTS[name]
    if isinstance(gpu, tuple):
        gpu, cpu = " ".join(map(str, gpu)), " ".join(map(str, cpu))
    return f"(default: {gpu} on GPUs, {cpu} on the CPU)"


def build_parser() -> argparse.ArgumentParser:
    d = KernelBenchConfig()
    # Each help names its default itself (several differ between GPUs and the CPU): no defaults formatter.
    p = argparse.ArgumentParser(prog="moekit bench kernel", description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=None, choices=MODELS, metavar="MODEL",
                   help=f"model shapes: %(choices)s {_by_device('models')}")
    p.add_argument("--m", dest="m_values", type=int, nargs="+", default=None,
                   help=f"batch sizes M, each in [1, 1048576] {_by_device('m_values')}")
    p.add_argument("--betas", type=float, nargs="+", default=None,
                   help=f"target balancedness, each in (0, 1] {_by_device('betas')}")
    p.add_argument("--iters", type=int, default=None,
                   help=f"timed replays per (config, point), >= 1 {_by_device('iters')}")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed replays before them, >= 0 {_by_device('warmup')}")
    p.add_argument("--slow-iters", type=int, default=None,
                   help="timed replays for a config whose check replay took >= --slow-factor x the fastest so far "
                        "at that point (default: --iters for every config)")
    p.add_argument("--slow-factor", type=float, default=d.slow_factor,
                   help="see --slow-iters; > 1 (default %(default)s)")
    p.add_argument("--config-stride", type=int, default=None,
                   help=f"time every n-th config of the space, >= 1 {_by_device('config_stride')}")
    p.add_argument("--config-offset", type=int, default=d.config_offset,
                   help="... starting at this index, >= 0 (default %(default)s)")
    p.add_argument("--dtype", default=None, choices=list(_DTYPES), help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--tiny", action="store_true", help=f"H={TINY_HIDDEN}, N={TINY_INTERMEDIATE} (CPU runs)")
    p.add_argument("--hidden", type=int, default=None, help="replace every shape's H")
    p.add_argument("--intermediate", type=int, default=None, help="replace every shape's N")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the inputs and routing, >= 0 (default %(default)s)")
    p.add_argument("--baseline", default=d.baseline, choices=BASELINE_IMPLS,
                   help="the torch baseline: %(choices)s (auto: grouped_mm where torch has it; default %(default)s)")
    p.add_argument("--tol", type=float, default=d.tol,
                   help="max relative error vs the baseline, in (0, 1) (default %(default)s)")
    p.add_argument("--compile-workers", type=int, default=None,
                   help="processes filling Triton's cache first, >= 0 (default: min(16, cores) on GPU; 0: none)")
    p.add_argument("--flush-mb", type=int, default=d.flush_mb,
                   help="L2 flush read before each timed replay, >= 0 (default %(default)s)")
    p.add_argument("--always-flush", action="store_true",
                   help=f"flush also where the touched weights are >= {FLUSH_SKIP_FACTOR}x L2")
    p.add_argument("--queue-ahead-us", type=float, default=d.queue_ahead_us,
                   help="GPU sleep per timed replay queued ahead, so the host's launches are not timed, >= 0 "
                        "(default %(default)s)")
    p.add_argument("--copy-mb", type=int, default=None, help="HBM ceiling copy size (default 1024 GPU / 64 CPU)")
    p.add_argument("--matmul-n", type=int, default=None, help="matmul ceiling size (default 8192 GPU / 256 CPU)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no (shape, M) that would end after this many seconds; what is done is written")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate, run nothing")
    p.add_argument("--merge", nargs="+", default=None, metavar="TABLE",
                   help="no run: merge these -table.json.gz files and write one report")
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                   help="where the record, table and figures go (default %(default)s)")
    p.add_argument("--no-record", action="store_true", help="write no record, table or figures")
    return p


def config_from_args(args) -> KernelBenchConfig:
    hidden, inter = args.hidden, args.intermediate
    if args.tiny:
        hidden, inter = hidden or TINY_HIDDEN, inter or TINY_INTERMEDIATE
    defaults = asdict(KernelBenchConfig()) if torch.cuda.is_available() else CPU_DEFAULTS
    given = {name: getattr(args, name) for name in CPU_DEFAULTS}
    chosen = {name: (defaults[name] if value is None else value) for name, value in given.items()}
    return KernelBenchConfig(
        models=tuple(chosen["models"]), m_values=tuple(chosen["m_values"]), betas=tuple(chosen["betas"]),
        iters=chosen["iters"], warmup=chosen["warmup"], slow_iters=args.slow_iters, slow_factor=args.slow_factor,
        config_stride=chosen["config_stride"], config_offset=args.config_offset, dtype=args.dtype,
        hidden=hidden, intermediate=inter, seed=args.seed, baseline=args.baseline, tol=args.tol,
        compile_workers=args.compile_workers, flush_mb=args.flush_mb, always_flush=args.always_flush,
        queue_ahead_us=args.queue_ahead_us,
        copy_mb=args.copy_mb, matmul_n=args.matmul_n, deadline_s=args.deadline_s)


def _print_outputs(record: dict) -> None:
    print(format_kernel_report(record["summary"]))
    for key in ("path", "table"):
        if key in record:
            print(f"{key}: {record[key]}")
    if "figures" in record:
        print(f"figures: {record['figures']}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out_dir = None if args.no_record else args.out_dir
    if out_dir is not None and not args.dry_run:
        check_output_dir(out_dir, "--out-dir")
    if args.merge:
        record = write_outputs(merge_tables([load_table(p) for p in args.merge]), out_dir)
        _print_outputs(record)
        return 0
    bench = KernelBench(config_from_args(args), log=lambda s: print(s, file=sys.stderr, flush=True))
    if args.dry_run:
        print(bench.describe())
        return 0
    if not bench.on_gpu:
        print(cpu_smoke_line("timings, bandwidths and speedups (Triton's interpreter, host clock)"),
              flush=True)
    record = write_outputs(bench.run(), out_dir)
    _print_outputs(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
