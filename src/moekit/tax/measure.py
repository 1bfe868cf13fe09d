"""``moekit tax --measure``: time one MoE FFN block, its DenseFA and its DensePA on this
device and check the tax model against the measurement (seed 003, section 5.3).

What is timed, per model and batch size m (one device: the n_tp = 1 view of the model):

* **MoE block**: router (float32 gate matmul, softmax, top-k) + the fused Triton expert
  kernel ``moekit.kernels.fused_moe`` (alignment, GEMMs, weighted top-k sum) + the shared
  experts as one dense SwiGLU FFN (qwen2-moe). "The best expert kernel": at each m the
  fastest of a short list of kernel configs (the static default, a fixed stratified sample
  of ``config_space`` and, if given, configs from a benchmark file; see
  :func:`load_config_hints`).
* **DenseFA**: one SwiGLU FFN of intermediate K*N + S (S = shared width), the seed's
  FLOP-aligned model; **DensePA**: intermediate E*N + S, the parameter-aligned model.
  Both are plain torch matmuls. This is what ``TaxModel.dense_ffn`` charges (K + k_s and
  E + k_s expert widths).

tau_measured = T(MoE) / T(DenseFA). The model's prediction is made for exactly the
configuration timed: ``TaxModel(shape, measured hardware, n_gpus=1, f=1.0,
block_size=<bm of the chosen config>)`` with the routing that was actually timed (f = 1:
no attention, so tau is the block ratio and the phase does not enter; n = 1: no AllReduce).
The hardware numbers are the ceilings measured in the same run (HBM copy bandwidth counting
read + write, dense matmul FLOP/s at 8192^3), fed in through ``moekit.tax.hardware``.

On a GPU each block is captured in a CUDA graph per input set and the replays are timed
with CUDA events, rotating over the input sets (the host of the GPU machines is slow, ~10 us
per launch, which eager timing would count). On the CPU the same pipeline runs eagerly
under Triton's interpreter on tiny shapes and the host clock: that tests the pipeline, not
the hardware.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from ..shapes import MoEShape, get_shape
from .hardware import Hardware, get_hardware, with_overrides
from .model import TaxModel, TaxPoint, compare, unit_costs

DEFAULT_MODELS = ("mixtral-8x7b", "qwen2-moe")
GPU_BATCH_SIZES = tuple(2**i for i in range(13))  # 1 .. 4096, as the seed's figures
CPU_BATCH_SIZES = (1, 4, 16)
MAX_BATCH = 65536
ERROR_TARGET = 0.30  # the bar: |model / measured - 1| <= 30 % at every point
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
VERIFY_ROWS = 32  # tokens of the first input set checked against the reference
COMPILE_SECONDS = 1.5  # assumed Triton compile time of one kernel variant on the GPU hosts (estimate only)
SPECIALIZATIONS = 2  # Triton compiles an int argument (num_pairs) apart when divisible by 16
QUEUE_AHEAD_US = 40.0  # host time per timed replay that time_replays lets the GPU sleep for
SLEEP_CYCLES_PER_US = 2000  # torch.cuda._sleep counts clock cycles; ~2 GHz on H100/H200
L2_FALLBACK = 60 * 2**20  # H200's L2, when the device does not say


# --------------------------------------------------------------------------- configuration


@dataclass
class MeasureConfig:
    """What ``run_measure`` times. ``None`` fields take a per-device default.

    ``models``: preset names (a comma-separated string is fine) or ``MoEShape`` objects; on
    the CPU presets are shrunk by :func:`tiny_shape`. ``configs``: kernel configs sampled
    from the space besides the default (and the hints). ``configs_from``: a JSON file of
    measured best configs (:func:`load_config_hints`). ``beta``: also time skewed routing of
    this balancedness. ``input_sets``: inputs rotated between replays. ``iters`` timed
    replays per block (median reported), ``select_iters`` per candidate config.
    """

    models: Sequence[str | MoEShape] | str = DEFAULT_MODELS
    batch_sizes: Sequence[int] | str | None = None
    hardware: str | Hardware = "H200"  # base preset: names the device, fills the network numbers
    configs: int = 6
    configs_from: str | None = None
    beta: float | None = None
    input_sets: int = 4
    iters: int | None = None
    select_iters: int | None = None
    warmup: int | None = None
    breakdown: bool = True
    dtype: str | torch.dtype | None = None
    device: str | None = None
    measure_ceilings: bool = True
    copy_mib: int | None = None
    matmul_n: int | None = None
    seed: int = 0
    memory_limit: int | None = None  # bytes; default: free device memory (CUDA), unchecked on CPU


@dataclass
class _Plan:
    """A MeasureConfig resolved for the device at hand."""

    device: torch.device
    dtype: torch.dtype
    shapes: list
    batch_sizes: tuple
    routings: list  # [(label, beta or None)]
    iters: int
    select_iters: int
    warmup: int
    copy_bytes: int
    matmul_n: int
    breakdown: bool
    input_sets: int


def parse_batch_sizes(spec) -> tuple[int, ...]:
    """``"1,2,4"`` or a sequence of ints -> sorted unique tuple; ValueError otherwise."""
    if isinstance(spec, str):
        try:
            values = [int(v) for v in spec.replace(" ", "").split(",") if v]
        except ValueError:
            raise ValueError(f"batch_sizes must be comma-separated integers, got {spec!r}") from None
    else:
        values = list(spec)
    if not values:
        raise ValueError("batch_sizes must name at least one batch size")
    for v in values:
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not 1 <= v <= MAX_BATCH:
            raise ValueError(f"batch_sizes must be integers in [1, {MAX_BATCH}], got {v!r}")
    return tuple(sorted({int(v) for v in values}))


def tiny_shape(shape: MoEShape) -> MoEShape:
    """A CPU-sized copy of ``shape`` for the interpreter: H = N = 32, at most 8 experts,
    top-2, at most 2 shared experts of width 32. The structure (shared experts or not,
    K < E) is kept; the numbers are not the model's."""
    e = min(shape.num_experts, 8)
    shared = min(shape.num_shared_experts, 2)
    return shape.scaled(
        name=f"{shape.name}-tiny", num_experts=e, top_k=min(shape.top_k, 2, e), hidden=32, intermediate=32,
        num_shared_experts=shared, shared_intermediate=32 if shared else 0,
    )


def dense_intermediates(shape: MoEShape) -> dict[str, int]:
    """Intermediate widths of the dense equivalents (seed 003, section 2, plus shared experts):
    DenseFA K*N + S (same activated parameters), DensePA E*N + S (same total parameters)."""
    s = shape.num_shared_experts * shape.shared_intermediate
    return {"densefa": shape.top_k * shape.intermediate + s, "densepa": shape.num_experts * shape.intermediate + s}


def _resolve(cfg: MeasureConfig) -> _Plan:
    if cfg.device is not None:
        device = torch.device(cfg.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={cfg.device!r} was asked for but CUDA is not available")
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, got {device}")
    on_gpu = device.type == "cuda"
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    dtype = cfg.dtype or (torch.bfloat16 if on_gpu else torch.float32)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {cfg.dtype!r}")
    if not on_gpu and dtype == torch.bfloat16:
        # DESIGN.md: tl.dot on bfloat16 returns garbage in the interpreter.
        raise ValueError("dtype bfloat16 is not usable on the CPU (Triton interpreter); use float32 or float16")

    models = cfg.models.split(",") if isinstance(cfg.models, str) else list(cfg.models)
    if not models:
        raise ValueError("models must name at least one model")
    shapes = []
    for m in models:
        shape = m if isinstance(m, MoEShape) else get_shape(m.strip())
        shapes.append(shape if on_gpu or isinstance(m, MoEShape) else tiny_shape(shape))
    if len({s.name for s in shapes}) != len(shapes):
        raise ValueError(f"models must be distinct, got {[s.name for s in shapes]}")

    batch = parse_batch_sizes(cfg.batch_sizes) if cfg.batch_sizes is not None else (
        GPU_BATCH_SIZES if on_gpu else CPU_BATCH_SIZES)
    routings = [("uniform", None)]
    if cfg.beta is not None:
        if not isinstance(cfg.beta, (int, float)) or not 0.0 < cfg.beta < 1.0:
            raise ValueError(f"beta must be in (0, 1) (1 = uniform, which is always timed), got {cfg.beta!r}")
        routings.append((f"beta={cfg.beta:g}", float(cfg.beta)))
    for name, value, low in (("configs", cfg.configs, 0), ("input_sets", cfg.input_sets, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")

    iters = cfg.iters if cfg.iters is not None else (100 if on_gpu else 3)
    select = cfg.select_iters if cfg.select_iters is not None else (10 if on_gpu else 2)
    warmup = cfg.warmup if cfg.warmup is not None else (5 if on_gpu else 1)
    for name, value, low in (("iters", iters, 1), ("select_iters", select, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    copy_mib = cfg.copy_mib if cfg.copy_mib is not None else (1024 if on_gpu else 16)
    matmul_n = cfg.matmul_n if cfg.matmul_n is not None else (8192 if on_gpu else 256)
    if not isinstance(copy_mib, int) or copy_mib < 1:
        raise ValueError(f"copy_mib must be an int >= 1, got {copy_mib!r}")
    if not isinstance(matmul_n, int) or not 16 <= matmul_n <= 32768:
        raise ValueError(f"matmul_n must be an int in [16, 32768], got {matmul_n!r}")
    return _Plan(device, dtype, shapes, batch, routings, iters, select, warmup, copy_mib * 2**20, matmul_n,
                 bool(cfg.breakdown), cfg.input_sets)


# --------------------------------------------------------------------------- memory


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def block_memory(shape: MoEShape, kind: str, m: int, elem: int, graphs: int) -> int:
    """Bytes one block kind needs at batch m: weights plus ``graphs`` copies of its
    activations (each captured graph keeps its own). Generous estimate, for the check."""
    h, n, e, k = shape.hidden, shape.intermediate, shape.num_experts, shape.top_k
    s = shape.num_shared_experts * shape.shared_intermediate
    if kind == "moe":
        weights = 3 * h * (e * n + s) * elem + 4 * e * h
        cap = m * k + min(e, m * k) * 127  # the largest token block (bm = 128)
        act = cap * n * elem + m * h * (4 + 4 * elem) + 16 * m * e + 3 * m * s * elem + 24 * m * k
    else:
        width = dense_intermediates(shape)[kind]
        weights = 3 * h * width * elem
        act = 4 * m * width * elem + 2 * m * h * elem
    return weights + graphs * act


def check_memory(shape: MoEShape, batch_sizes: Iterable[int], elem: int, graphs: int, limit: int) -> None:
    """ValueError (naming the block, m and sizes) if a block kind would not fit in ``limit``.

    Block kinds are timed one after another (their weights are freed in between), so each
    must fit on its own.
    """
    m = max(batch_sizes)
    for kind in ("moe", "densefa", "densepa"):
        need = block_memory(shape, kind, m, elem, graphs)
        if need > limit:
            raise ValueError(
                f"{shape.name} {kind} at m={m} needs about {need / 2**30:.1f} GiB "
                f"(weights + {graphs} graphs' activations) but only {limit / 2**30:.1f} GiB are available; "
                "use smaller batch_sizes or fewer input_sets")


# --------------------------------------------------------------------------- timing


def _kernels(device: torch.device):
    """moekit.kernels, imported for ``device`` (the interpreter on the CPU)."""
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import moekit.kernels as kernels

    if device.type == "cpu":
        module = sys.modules["moekit.kernels.token_kernels"]
        kernel = getattr(module, "gemm1_swiglu_kernel", None)
        if kernel is not None and type(kernel).__name__ != "InterpretedFunction":
            raise RuntimeError(
                "moekit.kernels was imported without TRITON_INTERPRET=1, so its kernels cannot run on "
                "the CPU; set TRITON_INTERPRET=1 before importing moekit.kernels")
    return kernels


class _Timer:
    """Times a list of callables (one per input set), rotating between them.

    CUDA: each callable is captured in its own CUDA graph (``capture_graph``) and the
    replays are timed with CUDA events (:func:`time_replays`). CPU: eager calls, host clock
    (``time_fn``).
    """

    def __init__(self, device: torch.device, warmup: int) -> None:
        self.device, self.warmup = device, warmup

    def __call__(self, fns: Sequence[Callable[[], object]], iters: int) -> list[float]:
        from ..bench.timing import capture_graph, time_fn

        if self.device.type == "cuda":
            graphs = [capture_graph(fn, warmup=2) for fn in fns]
            samples = time_replays([g.replay for g in graphs], iters, self.warmup, self.device)
            del graphs  # frees the graphs' memory pools
            return samples
        state = [0]

        def step() -> None:
            fns[state[0] % len(fns)]()
            state[0] += 1

        return time_fn(step, iters=iters, warmup=self.warmup, device=self.device)


def time_replays(replays: Sequence[Callable[[], object]], iters: int, warmup: int, device: torch.device) -> list[float]:
    """Microseconds of each of ``iters`` calls, cycling through ``replays``, by CUDA events.

    Before the timed loop the stream gets a ``torch.cuda._sleep`` of ~QUEUE_AHEAD_US per
    iteration, so the host (slow on the GPU machines, ~10 us per launch) has queued every
    event and replay before the GPU reaches them: a sample is then GPU time only, even for a
    block shorter than the host's launch time (the router alone is).
    """
    for i in range(warmup):
        replays[i % len(replays)]()
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(int(QUEUE_AHEAD_US * iters * SLEEP_CYCLES_PER_US))
        for i in range(iters):
            starts[i].record()
            replays[i % len(replays)]()
            ends[i].record()
        torch.cuda.synchronize(device)
    return [a.elapsed_time(b) * 1e3 for a, b in zip(starts, ends)]


def measure_ceilings(device: torch.device, dtype: torch.dtype, copy_bytes: int, matmul_n: int,
                     timer: _Timer, iters: int) -> dict:
    """HBM copy bandwidth (bytes/s, read + write counted, by an SM kernel) and dense matmul
    FLOP/s at matmul_n^3 on random data, the medians of ``iters`` timed runs each."""
    from ..bench.stats import summarize

    gen = torch.Generator(device=device).manual_seed(12345)
    n_elem = copy_bytes // 4
    src = torch.rand(n_elem, generator=gen, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    # Not dst.copy_(src): captured in a CUDA graph a same-device copy becomes a memcpy node,
    # run by a copy engine, which on an H200 reached 2.76 TB/s (this run's first records)
    # against 4.2 TB/s for an SM kernel (``moekit bench kernel``, eager). The blocks the model
    # describes read their weights with SM kernels, so the ceiling must be an SM kernel too:
    # an elementwise multiply by 1.0 reads src and writes dst once each (read + write counted).
    copy_us = summarize(timer([lambda d=dst, s=src: torch.mul(s, 1.0, out=d)], iters))
    del src, dst
    n = matmul_n
    a = torch.randn(n, n, generator=gen, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, generator=gen, device=device, dtype=torch.float32).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    mm_us = summarize(timer([lambda a=a, b=b, c=c: torch.matmul(a, b, out=c)], iters))
    del a, b, c
    return {
        "hbm_bw": 2.0 * n_elem * 4 / (copy_us["median"] * 1e-6),
        "peak_flops": 2.0 * n**3 / (mm_us["median"] * 1e-6),
        "copy_bytes": n_elem * 4, "matmul_n": n, "matmul_dtype": str(dtype),
        "copy_us": copy_us, "matmul_us": mm_us,
    }


def measured_hardware(base: str | Hardware, ceilings: dict | None, device_name: str) -> Hardware:
    """The base preset with the measured HBM bandwidth and FLOP/s (through ``with_overrides``)."""
    hw = get_hardware(base)
    if ceilings is None:
        return hw
    hw = with_overrides(hw, name=f"{device_name} (measured)", hbm_bw=float(ceilings["hbm_bw"]),
                        peak_flops=float(ceilings["peak_flops"]))
    sources = dict(hw.sources, hbm_bw="measured in this run, HBM copy (read + write)",
                   peak_flops=f"measured in this run, {ceilings['matmul_n']}^3 matmul")
    return dataclasses.replace(hw, sources=sources)


def write_hardware_file(hw: Hardware, path: str) -> str:
    """``hw`` as a file ``load_hardware`` reads back (all four numbers, no base preset)."""
    import json

    data = {"name": hw.name, "hbm_bw": hw.hbm_bw, "peak_flops": hw.peak_flops, "net_bw": hw.net_bw,
            "net_latency": hw.net_latency}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
    return path


# --------------------------------------------------------------------------- kernel configs


def config_id(cfg) -> str:
    return (f"{cfg.form}-bm{cfg.bm}-bn{cfg.bn}-bk{cfg.bk}-w{cfg.num_warps}-s{cfg.num_stages}"
            f"-g{cfg.group_m}-sk{cfg.split_k}" + (f"-n{cfg.bn2}" if getattr(cfg, "bn2", 0) else "")
            + ("-x" if getattr(cfg, "swap_ab", False) else ""))


def sample_configs(shape: MoEShape, device: torch.device, dtype: torch.dtype, n: int, seed: int) -> list:
    """``n`` configs of the space, stratified over the token block bm (so every batch size
    has candidates with a fitting bm), the same for every m of a model (one compile each)."""
    kernels = _kernels(device)
    space = kernels.config_space(shape, device, dtype=dtype)
    rng = random.Random(seed)
    groups = {}
    for c in space:
        groups.setdefault(c.bm, []).append(c)
    for g in groups.values():
        rng.shuffle(g)
    out, order = [], sorted(groups)
    while len(out) < n and any(groups.values()):
        for bm in order:
            if groups[bm] and len(out) < n:
                out.append(groups[bm].pop())
    return out


def load_config_hints(path: str, shape: MoEShape) -> dict[int, list]:
    """Best kernel configs measured elsewhere (e.g. by ``moekit bench kernel``), by batch size.

    Read with ``json`` only. Any object in the file (searched recursively) that has an
    integer ``m`` (or ``M``) and a ``config`` object of ``KernelConfig`` fields is a hint;
    if it also names ``model`` or ``shape``, it must be this shape's name. A malformed file
    or config raises ValueError naming the file.
    """
    from moekit.kernels.configs import KernelConfig

    data = _read_json(path, "kernel-config hints")
    fields = {f.name for f in dataclasses.fields(KernelConfig)}
    base = shape.name.removesuffix("-tiny")
    hints: dict[int, list] = {}

    def visit(node) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
            return
        if not isinstance(node, dict):
            return
        m = node.get("m", node.get("M"))
        conf = node.get("config")
        if isinstance(m, int) and not isinstance(m, bool) and isinstance(conf, dict):
            name = node.get("model", node.get("shape"))
            if isinstance(name, dict):
                name = name.get("name")
            if name is None or name in (shape.name, base):
                unknown = set(conf) - fields
                if unknown:
                    raise ValueError(f"{path}: config has unknown fields {sorted(unknown)}")
                try:
                    cfg = KernelConfig(**conf)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{path}: bad kernel config {conf!r} ({exc})") from None
                hints.setdefault(m, []).append(cfg)
            return
        for value in node.values():
            visit(value)

    visit(data)
    return hints


def candidate_configs(shape: MoEShape, m: int, sampled: Sequence, hints: dict[int, list] | None = None) -> list:
    """The configs tried at batch m: the static default first, then the hints for the
    nearest hinted m (in log2 distance), then the sample; duplicates dropped."""
    from moekit.kernels.configs import default_config

    out = [default_config(m, shape)]
    if hints:
        near = min(hints, key=lambda h: (abs(math.log2(h) - math.log2(m)), h))
        out += hints[near]
    out += list(sampled)
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------- blocks


def _randn(shape, fan_in: int, dtype, device, gen) -> torch.Tensor:
    """Random weights of unit-order outputs (fan-in scaling), drawn on the device."""
    if device.type == "cuda":
        w = torch.randn(*shape, generator=gen, device=device, dtype=dtype)
        return w.mul_(fan_in**-0.5)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * fan_in**-0.5).to(dtype)


def make_moe_weights(shape: MoEShape, dtype, device, seed: int):
    """Router (float32, as moekit's TopKRouter), stacked experts and fused shared experts."""
    from ..moe.experts import MoEWeights

    gen = torch.Generator(device=device).manual_seed(seed)
    h, n, e = shape.hidden, shape.intermediate, shape.num_experts
    router = _randn((e, h), h, torch.float32, device, gen)
    w13, w2 = _randn((e, 2 * n, h), h, dtype, device, gen), _randn((e, h, n), n, dtype, device, gen)
    sw13 = sw2 = None
    s = shape.num_shared_experts * shape.shared_intermediate
    if s:
        sw13, sw2 = _randn((2 * s, h), h, dtype, device, gen), _randn((h, s), s, dtype, device, gen)
    return MoEWeights(router, w13, w2, sw13, sw2)


def make_dense_weights(shape: MoEShape, kind: str, dtype, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [2I, H] and w2 [H, I] of DenseFA or DensePA."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width, h = dense_intermediates(shape)[kind], shape.hidden
    return _randn((2 * width, h), h, dtype, device, gen), _randn((h, width), width, dtype, device, gen)


def route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int):
    """float32 gate logits (+ a per-expert bias that sets the skew), softmax, top-k."""
    from ..moe.router import softmax_topk

    logits = x.to(torch.float32) @ router.t() + bias
    return softmax_topk(logits, top_k, renormalize=True)


def moe_block(x, bias, weights, top_k: int, config, kernels) -> torch.Tensor:
    """The timed MoE FFN block: route, fused experts, plus the shared experts."""
    from ..moe.experts import expert_mlp

    ids, tw = route(x, weights.router, bias, top_k)
    y = kernels.fused_moe(x, weights.w13, weights.w2, ids, tw, config)
    if weights.shared_w13 is not None:
        y = y + expert_mlp(x, weights.shared_w13, weights.shared_w2)
    return y


def skew_bias(logits: Sequence[torch.Tensor], top_k: int, beta: float | None, seed: int) -> tuple[torch.Tensor, float]:
    """A per-expert logit bias s * log(1/rank) (a Zipf popularity over a random expert order)
    whose routing of ``logits`` (all input sets together) has balancedness ~ ``beta``.

    beta None: zero bias (the random router is close to uniform). Bisection on s, as
    ``synthetic_routing`` does on its exponent. Returns (bias [E] float32, realized beta).
    """
    from ..routing.stats import balancedness, expert_counts

    e = logits[0].shape[1]
    device = logits[0].device
    stacked = torch.cat(list(logits))

    def realized(bias: torch.Tensor) -> float:
        ids = torch.topk(stacked + bias, top_k, dim=-1).indices.cpu().numpy()
        return float(balancedness(expert_counts(ids, e)))

    zero = torch.zeros(e, dtype=torch.float32, device=device)
    if beta is None:
        return zero, realized(zero)
    perm = np.random.default_rng(seed).permutation(e) + 1
    profile = torch.tensor(-np.log(perm), dtype=torch.float32, device=device)
    lo, hi = 0.0, 1.0
    for _ in range(30):  # bracket: grow s until the routing is skewed enough
        if realized(hi * profile) <= beta:
            break
        lo, hi = hi, 2 * hi
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if realized(mid * profile) > beta else (lo, mid)
    bias = hi * profile
    return bias, realized(bias)


# --------------------------------------------------------------------------- the model side


def predict(shape: MoEShape, hw: Hardware, m: int, block_size: int, ids: np.ndarray,
            elem: int) -> tuple[TaxPoint, float, float]:
    """The model for exactly what was timed: one device (n = 1, no AllReduce), FFN only
    (f = 1, so tau = T_MoE / T_FFN), blockwise padding to the chosen kernel's bm, the timed
    routing ``ids [sets, m, K]``. Returns (TaxPoint, T_DensePA, T_anc), times in seconds."""
    tm = TaxModel(shape, hw, n_gpus=1, padding="blockwise", block_size=block_size, f=1.0,
                  weight_bytes=elem, act_bytes=elem)
    point = tm.point(m, "decode", "TP+TP", routing=ids)
    return point, tm.dense_ffn(m, experts=shape.num_experts), tm.ancillary(m)


def achieved(shape: MoEShape, hw: Hardware, elem: int, seconds: float, widths: float, rows: float) -> dict:
    """Fractions of the measured HBM bandwidth and matmul FLOP/s that a block reached,
    counting the model's bytes (``widths`` expert weights + activations of ``rows``
    token-expert rows) and useful FLOPs (``rows`` rows)."""
    c = unit_costs(shape, hw, weight_bytes=elem, act_bytes=elem)
    moved = c.expert_bytes * widths + c.act_bytes_per_pair * rows
    return {"bw_frac": moved / seconds / hw.hbm_bw, "flops_frac": c.flops_per_pair * rows / seconds / hw.peak_flops}


# --------------------------------------------------------------------------- the run


def estimate_seconds(plan: _Plan, n_configs: int, hints: bool) -> tuple[float, float]:
    """(total, compile) seconds, from the H200 preset model at an assumed 50 % efficiency."""
    if plan.device.type != "cuda":
        return 0.0, 0.0
    total = compile_s = 0.0
    for shape in plan.shapes:
        k_defaults = 5  # distinct static defaults over 1..4096
        compile_s += (k_defaults + n_configs + (2 if hints else 0)) * 2 * SPECIALIZATIONS * COMPILE_SECONDS
        tm = TaxModel(shape, "H200", n_gpus=1, f=1.0)
        cands = 1 + n_configs + (2 if hints else 0)
        graphs = 2 * plan.input_sets
        for m in plan.batch_sizes:
            p = tm.point(m, "decode", "TP+TP")
            t_moe, t_fa, t_pa = p.t_moe / 0.5, p.t_dense / 0.5, tm.dense_ffn(m, shape.num_experts) / 0.5
            per_moe = cands * (2 + plan.warmup + plan.select_iters) + (graphs + plan.warmup + plan.iters) * 2
            total += len(plan.routings) * per_moe * t_moe + (graphs + plan.warmup + plan.iters) * (t_fa + t_pa)
    return total + compile_s, compile_s


def run_measure(cfg: MeasureConfig | None = None, out_dir: str | None = "benchmarks/results",
                log: Callable[[str], None] | None = print) -> dict:
    """Time every block, compare with the model, write the JSON record (+ PNG) to ``out_dir``
    (None: write nothing) and return the record (with ``paths`` of what was written)."""
    from ..bench.report import environment, to_jsonable, write_record

    cfg = cfg or MeasureConfig()
    plan = _resolve(cfg)
    say = (lambda s: (log(s), sys.stdout.flush())) if log else (lambda s: None)
    kernels = _kernels(plan.device)
    elem = _elem(plan.dtype)
    on_gpu = plan.device.type == "cuda"
    env = environment()
    device_name = torch.cuda.get_device_name(plan.device) if on_gpu else env["device"]
    timer = _Timer(plan.device, plan.warmup)
    start = time.perf_counter()

    if on_gpu or cfg.memory_limit is not None:
        limit = cfg.memory_limit if cfg.memory_limit is not None else int(0.9 * torch.cuda.mem_get_info(plan.device)[0])
        for shape in plan.shapes:
            check_memory(shape, plan.batch_sizes, elem, plan.input_sets + 1, limit)
    say(f"tax --measure on {device_name} ({plan.dtype}): models {', '.join(s.name for s in plan.shapes)}; "
        f"m = {', '.join(map(str, plan.batch_sizes))}; routing {', '.join(r for r, _ in plan.routings)}")
    if on_gpu:
        est, est_compile = estimate_seconds(plan, cfg.configs, cfg.configs_from is not None)
        say(f"estimate: ~{est / 60:.1f} min (of which ~{est_compile / 60:.1f} min Triton compiles)")
    else:
        say("CPU run: Triton interpreter and host clock on tiny shapes; this checks the pipeline, not the hardware")

    ceilings = None
    if cfg.measure_ceilings:
        ceilings = measure_ceilings(plan.device, plan.dtype, plan.copy_bytes, plan.matmul_n, timer,
                                    max(plan.iters // 2, 3))
        say(f"ceilings: HBM copy {ceilings['hbm_bw'] / 1e9:.1f} GB/s (read + write), "
            f"{plan.matmul_n}^3 matmul {ceilings['peak_flops'] / 1e12:.4g} TFLOP/s")
    hw = measured_hardware(cfg.hardware, ceilings, device_name)
    l2 = (getattr(torch.cuda.get_device_properties(plan.device), "L2_cache_size", 0) or L2_FALLBACK) if on_gpu else None

    models = {}
    for mi, shape in enumerate(plan.shapes):
        ctx = _ModelRun(shape, plan, cfg, hw, timer, kernels, cfg.seed + 1000 * mi, say, start)
        models[shape.name] = ctx.run(l2)

    verified = all(p["verify_rel_error"] <= TOLERANCE[plan.dtype]
                   and (p["dense_verify_rel_error"] is None or p["dense_verify_rel_error"] <= TOLERANCE[plan.dtype])
                   for mres in models.values() for rres in mres["routings"].values() for p in rres["points"])
    params = {
        "models": [s.name for s in plan.shapes], "batch_sizes": list(plan.batch_sizes), "dtype": str(plan.dtype),
        "device": str(plan.device), "routings": [r for r, _ in plan.routings], "input_sets": plan.input_sets,
        "iters": plan.iters, "select_iters": plan.select_iters, "warmup": plan.warmup, "configs": cfg.configs,
        "configs_from": cfg.configs_from, "seed": cfg.seed, "error_target": ERROR_TARGET,
        "timing": "CUDA-graph replays timed with CUDA events, rotating input sets" if on_gpu
        else "eager calls, host clock (Triton interpreter), rotating input sets",
        "model": "TaxModel(n_gpus=1, f=1.0, padding='blockwise', block_size=bm of the chosen config, "
                 "routing=the timed top-k ids), phase 'decode' (no effect at f=1), TP+TP",
    }
    results = {
        "hardware": {"name": hw.name, "hbm_bw": hw.hbm_bw, "peak_flops": hw.peak_flops, "net_bw": hw.net_bw,
                     "net_latency": hw.net_latency, "sources": hw.sources},
        "ceilings": ceilings, "l2_bytes": l2, "models": models, "verified": verified,
        "seconds": time.perf_counter() - start,
    }
    record = to_jsonable({"kind": "tax-measure", "environment": env, "params": params, "results": results})
    paths = {}
    if out_dir is not None:
        path = write_record("tax-measure", params, results, out_dir=out_dir)
        paths["json"] = str(path)
        if ceilings is not None:  # for `moekit tax --hardware <file>`: the model with these numbers
            paths["hardware"] = write_hardware_file(hw, str(path.with_suffix("")) + "-hardware.json")
        try:
            paths["png"] = measure_figure(record, str(path.with_suffix("")) + "-tau.png")
        except ImportError as exc:
            say(f"no figure: {exc}")
    record["paths"] = paths
    say(f"done in {time.perf_counter() - start:.0f} s")
    return record


class _ModelRun:
    """Everything timed for one model: DenseFA, DensePA, then the MoE block per routing."""

    def __init__(self, shape, plan, cfg, hw, timer, kernels, seed, say, start) -> None:
        self.shape, self.plan, self.cfg, self.hw, self.timer = shape, plan, cfg, hw, timer
        self.kernels, self.seed, self.say, self.start = kernels, seed, say, start
        self.elem = _elem(plan.dtype)
        # The same input sets for every block kind, so the three see the same activations.
        self.xs = {m: [_inputs(shape, m, g, plan, seed) for g in range(plan.input_sets)] for m in plan.batch_sizes}

    def _progress(self, what: str, m: int, us: float, t0: float, extra: str = "") -> None:
        now = time.perf_counter()
        self.say(f"  {self.shape.name:16} {what:16} m={m:<5} {us:10.1f} us {extra}"
                 f"({now - t0:.1f} s, {now - self.start:.0f} s total)")

    def run(self, l2: int | None) -> dict:
        shape, plan = self.shape, self.plan
        hints = load_config_hints(self.cfg.configs_from, shape) if self.cfg.configs_from else None
        sampled = sample_configs(shape, plan.device, plan.dtype, self.cfg.configs, self.seed)
        dense_us, dense_err = self.dense()
        weights = make_moe_weights(shape, plan.dtype, plan.device, self.seed + 3)
        routings = {}
        for label, beta in plan.routings:
            points = []
            for m in plan.batch_sizes:
                t0 = time.perf_counter()
                res = _measure_moe_point(shape, m, self.xs[m], weights, beta, plan, self.timer, self.kernels,
                                         sampled, hints, self.seed)
                res.update(_model_side(shape, self.hw, self.elem, m, res, dense_us))
                res["dense_verify_rel_error"] = dense_err
                points.append(res)
                self._progress(f"MoE {label}", m, res["t_moe_us"]["median"], t0,
                               f" tau {res['tau_measured']:.2f} (model {res['model']['tau']:.2f}, "
                               f"{100 * res['rel_error']['tau']:+.0f}%) {res['config_id']} "
                               f"best of {len(res['candidates'])} ")
            errors = [abs(p["rel_error"]["tau"]) for p in points]
            worst = points[int(np.argmax(errors))]
            routings[label] = {
                "beta_target": beta, "points": points, "max_abs_error": max(errors),
                "within_target": bool(max(errors) <= ERROR_TARGET), "worst_m": worst["m"],
                "explanation": explain_point(worst),
            }
        del weights
        _free(plan.device)
        # The least weight traffic of any timed block (MoE at m=1: K experts + shared) vs L2:
        # far above 1 means every replay streams its weights from HBM, not from L2.
        c = unit_costs(shape, self.hw, weight_bytes=self.elem, act_bytes=self.elem)
        least = c.expert_bytes * (shape.top_k + c.k_shared)
        return {
            "shape": dataclasses.asdict(shape), "dense_intermediate": dense_intermediates(shape),
            "sampled_configs": [config_id(c) for c in sampled],
            "config_hints": {m: [config_id(c) for c in cs] for m, cs in (hints or {}).items()},
            "weight_bytes": {k: block_memory(shape, k, 0, self.elem, 0) for k in ("moe", "densefa", "densepa")},
            "least_weight_bytes_per_replay": least, "least_weight_bytes_over_l2": least / l2 if l2 else None,
            "routings": routings,
        }

    def dense(self) -> tuple[dict, float | None]:
        """Median-bearing summaries of DenseFA and DensePA per m (weights made and freed per kind)."""
        from ..bench.stats import summarize
        from ..moe.experts import expert_mlp

        shape, plan = self.shape, self.plan
        out, err = {}, (None if plan.device.type == "cuda" else 0.0)
        for offset, kind in enumerate(("densefa", "densepa")):
            w13, w2 = make_dense_weights(shape, kind, plan.dtype, plan.device, self.seed + 1 + offset)
            for m in plan.batch_sizes:
                t0 = time.perf_counter()
                fns = [(lambda x=x, w13=w13, w2=w2: expert_mlp(x, w13, w2)) for x in self.xs[m]]
                out[kind, m] = summarize(self.timer(fns, plan.iters))
                self._progress(kind, m, out[kind, m]["median"], t0)
            # torch's matmul is its own reference on the GPU; on the CPU check the block function.
            if err is not None:
                err = max(err, _verify_dense(self.xs[plan.batch_sizes[0]][0], w13, w2))
            del w13, w2, fns
            _free(plan.device)
        return out, err


def _inputs(shape: MoEShape, m: int, g: int, plan: _Plan, seed: int) -> torch.Tensor:
    """Input set g at batch m: unit-normal activations, reproducible per (seed, m, g)."""
    gen = torch.Generator(device=plan.device).manual_seed(seed * 1_000_003 + m * 101 + g)
    return torch.randn(m, shape.hidden, generator=gen, device=plan.device, dtype=torch.float32).to(plan.dtype)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def select_config(shape, xs, bias, weights, plan, timer, kernels, configs) -> tuple:
    """The fastest of ``configs`` for the MoE block on input set 0 (median of
    ``select_iters`` replays each). A candidate that fails to compile or launch is recorded
    and skipped; the static default (first) must work. One candidate: nothing to time."""
    from ..bench.stats import summarize

    if len(configs) == 1:
        return configs[0], [{"config": config_id(configs[0]), "median_us": None}]
    rows, best = [], None
    for cfg in configs:
        try:
            med = summarize(timer([lambda c=cfg: moe_block(xs[0], bias, weights, shape.top_k, c, kernels)],
                                  plan.select_iters))["median"]
        except Exception as exc:  # noqa: BLE001 - Triton raises several kinds (resources, compile)
            if cfg == configs[0]:
                raise
            rows.append({"config": config_id(cfg), "median_us": None, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        rows.append({"config": config_id(cfg), "median_us": med})
        if best is None or med < best[1]:
            best = (cfg, med)
    return best[0], rows


def _measure_moe_point(shape, m, xs, weights, beta, plan, timer, kernels, sampled, hints, seed) -> dict:
    """The MoE block at batch m: routing (skewed by a bias if ``beta``), the fastest config,
    its timing over all input sets, the parts (router, experts, shared) and a reference check."""
    from ..bench.stats import summarize
    from ..moe.experts import expert_mlp

    logits = [x.to(torch.float32) @ weights.router.t() for x in xs]
    bias, realized_beta = skew_bias(logits, shape.top_k, beta, seed)
    routed = [route(x, weights.router, bias, shape.top_k) for x in xs]
    ids = np.stack([r[0].cpu().numpy() for r in routed])  # what the model is given
    cfg, candidates = select_config(shape, xs, bias, weights, plan, timer, kernels,
                                    candidate_configs(shape, m, sampled, hints))

    t_moe = summarize(timer([(lambda x=x: moe_block(x, bias, weights, shape.top_k, cfg, kernels)) for x in xs],
                            plan.iters))
    parts = {}
    if plan.breakdown:  # to explain errors: router + top-k, experts (align + kernel), shared experts
        n = min(plan.iters, 50)
        parts["router"] = timer([(lambda x=x: route(x, weights.router, bias, shape.top_k)) for x in xs], n)
        parts["experts"] = timer([(lambda x=x, r=r: kernels.fused_moe(x, weights.w13, weights.w2, r[0], r[1], cfg))
                                  for x, r in zip(xs, routed)], n)
        if weights.shared_w13 is not None:
            parts["shared"] = timer([(lambda x=x: expert_mlp(x, weights.shared_w13, weights.shared_w2))
                                     for x in xs], n)
    return {
        "m": m, "config": dataclasses.asdict(cfg), "config_id": config_id(cfg), "candidates": candidates,
        "t_moe_us": t_moe, "breakdown_us": {k: summarize(v)["median"] for k, v in parts.items()},
        "realized_beta": realized_beta, "e_active_timed": float(np.mean([len(np.unique(i)) for i in ids])),
        "verify_rel_error": _verify_moe(xs[0], weights, bias, routed[0], shape, cfg, kernels), "_ids": ids,
    }


def _model_side(shape, hw, elem, m, res, dense_us) -> dict:
    """The model's numbers for this point, the measured ratios and their errors."""
    ids = res.pop("_ids")
    point, t_pa, t_anc = predict(shape, hw, m, res["config"]["bm"], ids, elem)
    t_moe = res["t_moe_us"]["median"] * 1e-6
    t_fa = dense_us["densefa", m]["median"] * 1e-6
    t_pa_meas = dense_us["densepa", m]["median"] * 1e-6
    measured = {"phase": "decode", "parallelism": "TP+TP", "m": m, "tau": t_moe / t_fa, "t_moe": t_moe,
                "t_dense": t_fa}
    errors = {r["quantity"]: r["rel_error"] for r in compare([point], [measured])}
    tau_pa_meas = t_pa_meas / t_fa
    errors["tau_densepa"] = point.tau_densepa / tau_pa_meas - 1.0
    k_s = unit_costs(shape, hw).k_shared
    mk = m * shape.top_k
    return {
        "t_densefa_us": dense_us["densefa", m], "t_densepa_us": dense_us["densepa", m],
        "tau_measured": t_moe / t_fa, "tau_densepa_measured": tau_pa_meas,
        "model": {"tau": point.tau, "tau_densepa": point.tau_densepa, "t_moe_us": point.t_moe * 1e6,
                  "t_densefa_us": point.t_dense * 1e6, "t_densepa_us": t_pa * 1e6, "regime": point.regime,
                  "dominant": point.dominant, "e_active": point.e_active, "eta": point.eta,
                  "block_size": point.block_size, "t_anc_us": t_anc * 1e6},
        "rel_error": errors,
        "achieved": {
            "moe": achieved(shape, hw, elem, t_moe, point.e_active + k_s, mk + k_s * m),
            "densefa": achieved(shape, hw, elem, t_fa, shape.top_k + k_s, m * (shape.top_k + k_s)),
            "densepa": achieved(shape, hw, elem, t_pa_meas, shape.num_experts + k_s, m * (shape.num_experts + k_s)),
        },
    }


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.to(torch.float64) - ref.to(torch.float64)).norm() / ref.to(torch.float64).norm().clamp_min(1e-30))


def _verify_moe(x, weights, bias, routed, shape, cfg, kernels) -> float:
    """Relative error of the timed MoE block on the first VERIFY_ROWS tokens of set 0 against
    ``reference_moe`` (float64 on the CPU, float32 on the GPU, where float64 weights of a
    whole expert would be large), with the routing the block computed."""
    from ..moe.reference import reference_moe

    y = moe_block(x, bias, weights, shape.top_k, cfg, kernels)
    r = min(VERIFY_ROWS, x.shape[0])
    ref_dtype = torch.float64 if x.device.type == "cpu" else torch.float32
    ref = reference_moe(x[:r], weights, routed[0][:r], routed[1][:r], dtype=ref_dtype)
    return _rel_err(y[:r], ref)


def _verify_dense(x, w13, w2) -> float:
    """Relative error of a dense block on a few tokens against a float64 computation
    written out step by step."""
    from ..moe.experts import expert_mlp

    r = min(VERIFY_ROWS, x.shape[0])
    y = expert_mlp(x, w13, w2)[:r]
    xr = x[:r].to(torch.float64)
    h = xr @ w13.to(torch.float64).t()
    gate, up = h[:, : h.shape[1] // 2], h[:, h.shape[1] // 2:]
    ref = (gate * torch.sigmoid(gate) * up) @ w2.to(torch.float64).t()
    return _rel_err(y, ref)


# --------------------------------------------------------------------------- recompare


def load_record(record) -> dict:
    """A ``tax-measure`` record: the dict itself, or read (``json`` only) from a path."""
    if isinstance(record, dict):
        data = record
    else:
        data = _read_json(record, "a tax-measure record")
    if not isinstance(data, dict) or data.get("kind") != "tax-measure" or "results" not in data:
        raise ValueError("record must be a tax-measure record (kind 'tax-measure', as run_measure writes)")
    return data


def predict_from_summary(shape: MoEShape, hw: Hardware, m: int, block_size: int, e_active: float,
                         eta: float, elem: int) -> TaxPoint:
    """:func:`predict` from the routing's summary (mean E_active and mean padding eta over
    the timed input sets) instead of the ids, which a record does not keep.

    The same TaxModel and the same TP+TP terms (eq. 4 at n = 1, T_anc, the regime logic of
    ``TaxModel._finish``). Both roofline sides are linear in E_active and eta and every set
    has m*K pairs, so the mean memory and compute sides are exact; only the max of the two
    is taken after averaging rather than per set, which differs where the sets straddle the
    ridge (:func:`recompare` reports the difference on the record's own hardware).
    """
    tm = TaxModel(shape, hw, n_gpus=1, padding="blockwise", block_size=block_size, f=1.0,
                  weight_bytes=elem, act_bytes=elem)
    k_s, mk = tm.costs.k_shared, m * shape.top_k
    t_full, mem, comp = tm._roofline(e_active + k_s, eta * mk + k_s * m)
    t_nopad, _, _ = tm._roofline(e_active + k_s, mk + k_s * m)
    anc = tm.ancillary(m)
    t_other, _ = tm.other_times(m, "decode")
    parts = dict(
        t_moe=float(t_full) + anc + tm.allreduce(m), t_other_moe=t_other,
        steps={"padding": float(t_full - t_nopad), "ancillary": anc},
        moe_mem=float(mem), moe_comp=float(comp), e_active=float(e_active), eta=float(eta),
        straggler=1.0, padded_straggler=float(eta), block=block_size, moe_compute=float(t_full),
    )
    return tm._finish(m, "decode", "TP+TP", parts)


def recompare(record, hbm_bw: float | None = None, peak_flops: float | None = None) -> list[dict]:
    """The model side of a saved ``tax-measure`` record, recomputed with other hardware
    numbers (bytes/s, FLOP/s; None keeps the record's), against the measured times.

    One row per model, routing and m: measured tau, model tau, error (model / measured - 1),
    the model's regime, its T_MoE and T_DenseFA errors, and ``model_drift``: how far this
    recomputation lands from the record's own prediction when run with the record's
    hardware (0 up to rounding unless the input sets straddle the roofline ridge).
    """
    data = load_record(record)
    res = data["results"]
    for name, value in (("hbm_bw", hbm_bw), ("peak_flops", peak_flops)):
        if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    base = res["hardware"]
    recorded = Hardware(name=base["name"], hbm_bw=float(base["hbm_bw"]), peak_flops=float(base["peak_flops"]),
                        net_bw=float(base["net_bw"]), net_latency=float(base["net_latency"]))
    hw = with_overrides(recorded, **{k: float(v) for k, v in (("hbm_bw", hbm_bw), ("peak_flops", peak_flops))
                                     if v is not None})
    elem = _elem(getattr(torch, data["params"]["dtype"].removeprefix("torch.")))
    rows = []
    for name, mres in res["models"].items():
        shape = MoEShape(**mres["shape"])
        for label, rres in mres["routings"].items():
            for p in rres["points"]:
                m, mod = p["m"], p["model"]
                args = (shape, m, mod["block_size"], mod["e_active"], mod["eta"], elem)
                point = predict_from_summary(args[0], hw, *args[1:])
                again = predict_from_summary(args[0], recorded, *args[1:])
                t_moe, t_fa = p["t_moe_us"]["median"], p["t_densefa_us"]["median"]
                rows.append({
                    "model": name, "routing": label, "m": m, "config_id": p.get("config_id"),
                    "tau_measured": p["tau_measured"], "tau_model": point.tau,
                    "error": point.tau / p["tau_measured"] - 1.0, "regime": point.regime,
                    "t_moe_error": point.t_moe * 1e6 / t_moe - 1.0, "t_densefa_error": point.t_dense * 1e6 / t_fa - 1.0,
                    "tau_densepa_measured": p["tau_densepa_measured"], "tau_densepa_model": point.tau_densepa,
                    "hbm_bw": hw.hbm_bw, "peak_flops": hw.peak_flops,
                    "model_drift": again.tau / mod["tau"] - 1.0,
                })
    return rows


def format_recompare(rows: list[dict]) -> str:
    """Markdown tables of :func:`recompare` rows, one per model and routing, with the verdict."""
    if not rows:
        return "no points"
    lines = [f"model recomputed with HBM {rows[0]['hbm_bw'] / 1e9:.0f} GB/s, "
             f"{rows[0]['peak_flops'] / 1e12:.0f} TFLOP/s; error = model / measured - 1"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["routing"]), []).append(r)
    for (name, label), rs in groups.items():
        lines += ["", f"{name}, routing {label}", "",
                  "| m | τ measured | τ model | error | regime | T_MoE err | T_DenseFA err |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['m']} | {r['tau_measured']:.2f} | {r['tau_model']:.2f} | {100 * r['error']:+.0f}% | "
                  f"{r['regime']} | {100 * r['t_moe_error']:+.0f}% | {100 * r['t_densefa_error']:+.0f}% |"
                  for r in rs]
        worst = max(rs, key=lambda r: abs(r["error"]))
        inside = sum(abs(r["error"]) <= ERROR_TARGET for r in rs)
        lines.append(f"\n{inside}/{len(rs)} points within {100 * ERROR_TARGET:.0f}%; largest "
                     f"{100 * worst['error']:+.0f}% at m={worst['m']}; max drift from the record's own model "
                     f"{100 * max(abs(r['model_drift']) for r in rs):.2g}%")
    return "\n".join(lines)



# --------------------------------------------------------------------------- output


def explain_point(p: dict) -> str:
    """Which side of tau the model gets wrong at point ``p``, in numbers."""
    e, a, b, mod = p["rel_error"], p["achieved"], p["breakdown_us"], p["model"]
    moe_side = "bw" if mod["regime"] in ("memory-bound", "transition") else "flops"
    fa_side = "bw" if mod["regime"] == "memory-bound" else "flops"
    what = {"bw": "HBM bandwidth", "flops": "matmul FLOP/s"}
    text = (f"m={p['m']}: model tau {mod['tau']:.2f} vs measured {p['tau_measured']:.2f} ({100 * e['tau']:+.0f}%), "
            f"{mod['regime']}. Model T_MoE {100 * e['t_moe']:+.0f}% and T_DenseFA {100 * e['t_dense']:+.0f}% "
            f"against measured: the MoE block reached {100 * a['moe'][moe_side + '_frac']:.0f}% of the measured "
            f"{what[moe_side]}, DenseFA {100 * a['densefa'][fa_side + '_frac']:.0f}% of the {what[fa_side]} "
            "(the model assumes 100% for both).")
    if b:
        shared = f", shared {b['shared']:.1f} us" if "shared" in b else ""
        text += (f" Router + top-k {b['router']:.1f} us, experts (align + kernel) {b['experts']:.1f} us{shared}; "
                 f"the model's T_anc is {mod['t_anc_us']:.1f} us.")
    return text


_COLUMNS = (  # (header, width, cell of a point)
    ("m", 5, lambda p: f"{p['m']}"),
    ("kernel config", 40, lambda p: p["config_id"]),
    ("MoE us", 9, lambda p: f"{p['t_moe_us']['median']:.1f}"),
    ("FA us", 9, lambda p: f"{p['t_densefa_us']['median']:.1f}"),
    ("PA us", 9, lambda p: f"{p['t_densepa_us']['median']:.1f}"),
    ("tau", 6, lambda p: f"{p['tau_measured']:.2f}"),
    ("model", 6, lambda p: f"{p['model']['tau']:.2f}"),
    ("error", 6, lambda p: f"{100 * p['rel_error']['tau']:+.0f}%"),
    ("eMoE", 6, lambda p: f"{100 * p['rel_error']['t_moe']:+.0f}%"),
    ("eFA", 6, lambda p: f"{100 * p['rel_error']['t_dense']:+.0f}%"),
    ("PA/FA", 6, lambda p: f"{p['tau_densepa_measured']:.2f}"),
    ("model", 6, lambda p: f"{p['model']['tau_densepa']:.2f}"),
    ("regime", 13, lambda p: p["model"]["regime"]),
    ("E_act", 5, lambda p: f"{p['model']['e_active']:.1f}"),
    ("eta", 5, lambda p: f"{p['model']['eta']:.2f}"),
)


def format_measure(record: dict) -> str:
    """The comparison as text: one table per model and routing, the verdict, the worst point."""
    res = record["results"]
    hw = res["hardware"]
    lines = [f"MoE tax, measured vs model on {hw['name']}: HBM {hw['hbm_bw'] / 1e12:.3g} TB/s, "
             f"{hw['peak_flops'] / 1e12:.4g} TFLOP/s ({record['params']['dtype']}; {record['params']['timing']})",
             "tau = T(MoE) / T(DenseFA); error = model / measured - 1 (eMoE, eFA: of the block times); "
             "PA/FA = T(DensePA) / T(DenseFA)"]

    def row(cells) -> str:
        return " ".join(c.rjust(w) if i != 1 and i != 12 else c.ljust(w)
                        for i, (c, (_, w, _)) in enumerate(zip(cells, _COLUMNS)))

    head = row([h for h, _, _ in _COLUMNS])
    for name, mres in res["models"].items():
        for label, rres in mres["routings"].items():
            betas = [p["realized_beta"] for p in rres["points"]]
            lines += ["", f"{name}, routing {label} (realized balancedness {min(betas):.2f}-{max(betas):.2f})",
                      head, "-" * len(head)]
            lines += [row([cell(p) for _, _, cell in _COLUMNS]) for p in rres["points"]]
            verdict = "within" if rres["within_target"] else "NOT within"
            lines.append(f"max |error| {100 * rres['max_abs_error']:.0f}% at m={rres['worst_m']}: {verdict} "
                         f"{100 * ERROR_TARGET:.0f}%")
            lines.append("largest: " + rres["explanation"])
    if not res["verified"]:
        lines.append("WARNING: a timed block did not match its reference (see verify_rel_error in the record)")
    lines += [f"wrote {path}" for path in record.get("paths", {}).values()]
    return "\n".join(lines)


def measure_figure(record: dict, path: str) -> str:
    """Per model: tau over m, measured and predicted (with DensePA / DenseFA) on top, the
    model's relative error per point below, with the +-30 % target band."""
    from .figures import _pyplot

    plt = _pyplot()
    models = record["results"]["models"]
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 6.5), squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1]}, sharex="col")
    for col, (name, mres) in enumerate(models.items()):
        top, bottom = axes[0][col], axes[1][col]
        for i, (label, rres) in enumerate(mres["routings"].items()):
            pts = rres["points"]
            ms, color = [p["m"] for p in pts], f"C{i}"
            top.plot(ms, [p["tau_measured"] for p in pts], "o-", color=color, label=f"MoE measured ({label})")
            top.plot(ms, [p["model"]["tau"] for p in pts], "s--", color=color, mfc="none", label=f"MoE model ({label})")
            bottom.plot(ms, [100 * p["rel_error"]["tau"] for p in pts], "o-", color=color, label=label)
            if i == 0:
                top.plot(ms, [p["tau_densepa_measured"] for p in pts], "^-", color="k", label="DensePA measured")
                top.plot(ms, [p["model"]["tau_densepa"] for p in pts], "k:", label="DensePA model")
        top.axhline(1.0, color="grey", lw=0.8)
        top.set_ylabel("T / T(DenseFA)")
        top.set_title(f"{name} on {record['results']['hardware']['name']}", fontsize=9)
        top.legend(fontsize=7)
        band = 100 * ERROR_TARGET
        bottom.axhspan(-band, band, color="green", alpha=0.1)
        bottom.axhline(0.0, color="grey", lw=0.8)
        bottom.set_ylabel("model / measured - 1 (%)")
        bottom.set_xlabel("batch size m (tokens)")
        bottom.set_xscale("log", base=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _read_json(path, what: str):
    """JSON (never pickle) from ``path``; a ValueError naming the file when it cannot be read."""
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read {what} ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
