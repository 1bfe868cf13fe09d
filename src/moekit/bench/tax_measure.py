"""``moekit tax --measure``: time one MoE FFN block, its DenseFA and its DensePA on this
device and check the MoE-tax model against the measurement (the MoE-tax paper, section 5.3).

What is timed, per model and batch size m (one device: the n_tp = 1 view of the model), are
the blocks of :mod:`moekit.bench.tax_blocks`: the MoE block (router, the fused Triton expert
kernel, the shared experts) and its dense equivalents DenseFA and DensePA. "The best expert
kernel": at each m the fastest of a short list of kernel configs (the static default, a fixed
stratified sample of ``config_space`` and, if given, configs from a benchmark file; see
:func:`load_config_hints`).

tau_measured = T(MoE) / T(DenseFA). The model's prediction is made for exactly the
configuration timed: ``TaxModel(shape, measured hardware, n_gpus=1, f=1.0,
block_size=<bm of the chosen config>)`` with the routing that was actually timed (f = 1:
no attention, so tau is the block ratio and the phase does not enter; n = 1: no AllReduce).
The hardware numbers are the ceilings measured in the same run
(:func:`moekit.bench.ceilings.measure_ceilings`), fed in through ``moekit.tax.hardware``.

On a GPU each block is captured in a CUDA graph per input set and the replays are timed
with CUDA events, rotating over the input sets and queued ahead of the GPU. On the CPU the
same pipeline runs eagerly under Triton's interpreter on tiny shapes and the host clock:
that tests the pipeline, not the hardware. The record's report, figure and recomputation
with other hardware numbers are in :mod:`moekit.bench.tax_report`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moekit.bench.ceilings import measure_ceilings
from moekit.bench.report import DEFAULT_OUT_DIR, environment, to_jsonable, write_record
from moekit.bench.stats import summarize
from moekit.bench.tax_blocks import (_verify_dense, _verify_moe, block_memory, check_memory, dense_intermediates,
                                     elem_bytes, make_dense_weights, make_moe_weights, moe_block, route, run_device,
                                     skew_bias)
from moekit.bench.tax_report import ERROR_TARGET, explain_calibrated, explain_point, measure_figure
from moekit.bench.timing import capture_graph, queue_timed
from moekit.bench.triton_kernels import load_kernels
from moekit.jsonfile import read_json
from moekit.moe.experts import expert_mlp
from moekit.shapes import MoEShape
from moekit.tax.efficiency import Calibration, adapt_calibration, load_calibration, nearest_calibration
from moekit.tax.hardware import Hardware, get_hardware, gpu_key, with_overrides
from moekit.tax.model import TaxModel, TaxPoint, compare, tax_shape, unit_costs

DEFAULT_MODELS = ("mixtral-8x7b", "qwen2-moe")
# Every preset MoE shape the calibrated model is checked on (deepseek-v3 as one GPU's TP8 shard).
ALL_MODELS = ("qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v3-tp8", "mixtral-8x7b", "qwen2-moe")
GPU_BATCH_SIZES = tuple(2**i for i in range(13))  # 1 .. 4096, as the paper's figures
CPU_BATCH_SIZES = (1, 4, 16)
MAX_BATCH = 65536
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
COMPILE_SECONDS = 1.5  # assumed Triton compile time of one kernel variant on the GPU hosts (estimate only)
SPECIALIZATIONS = 2  # Triton compiles an int argument (num_pairs) apart when divisible by 16
POOL_START_SECONDS = 20.0  # assumed: a compile pool's processes import torch and start CUDA (estimate only)
QUEUE_AHEAD_US = 40.0  # per timed replay: the host's time to queue a replay and its two events
L2_FALLBACK = 60 * 2**20  # the largest current L2 (H200), when the device does not say


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
    # Calibration file(s) (``moekit tax calibrate``) or Calibration objects: the calibrated model is
    # put beside the 100 %-peak one at every point (the one for this GPU kind, else the nearest, moved).
    calibration: str | Calibration | Sequence | None = None
    ramp: bool = True  # use a RaMP model file for the expert kernel where one covers the shape on this GPU
    deadline_s: float | None = None  # seconds from the start after which no further model is begun
    compile_workers: int | None = None  # processes filling Triton's cache first (None: min(16, cores) on a GPU)


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


def _resolve(cfg: MeasureConfig) -> _Plan:
    device, on_gpu = run_device(cfg.device)

    dtype = cfg.dtype or (torch.bfloat16 if on_gpu else torch.float32)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {cfg.dtype!r}")
    if not on_gpu and dtype == torch.bfloat16:
        # tl.dot on bfloat16 returns garbage in Triton's interpreter.
        raise ValueError("dtype bfloat16 is not usable on the CPU (Triton interpreter); use float32 or float16")

    models = cfg.models.split(",") if isinstance(cfg.models, str) else list(cfg.models)
    if not models:
        raise ValueError("models must name at least one model")
    shapes = []
    for m in models:
        shape = m if isinstance(m, MoEShape) else tax_shape(m.strip())
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
    if cfg.deadline_s is not None and not (isinstance(cfg.deadline_s, (int, float)) and cfg.deadline_s > 0):
        raise ValueError(f"deadline_s must be a number > 0, got {cfg.deadline_s!r}")
    return _Plan(device, dtype, shapes, batch, routings, iters, select, warmup, copy_mib * 2**20, matmul_n,
                 bool(cfg.breakdown), cfg.input_sets)


class _Timer:
    """Times a list of callables (one per input set), rotating between them, with the one
    queued timer (``moekit.bench.timing.queue_timed``).

    CUDA: each callable is captured in its own CUDA graph (``capture_graph``) and the
    replays are queued ahead of the GPU and timed with CUDA events: the host of the GPU
    machines needs ~10 µs per launch, longer than the shortest blocks (the router alone),
    which eager timing would count. CPU: eager calls, host clock.
    """

    def __init__(self, device: torch.device, warmup: int) -> None:
        self.device, self.warmup = device, warmup

    def __call__(self, fns: Sequence[Callable[[], object]], iters: int) -> list[float]:
        graphs = [capture_graph(fn, warmup=2) for fn in fns] if self.device.type == "cuda" else None
        calls = [g.replay for g in graphs] if graphs else list(fns)
        done = [0]

        def rotate() -> None:
            calls[done[0] % len(calls)]()
            done[0] += 1

        samples = queue_timed(rotate, iters=iters, warmup=self.warmup, device=self.device,
                              queue_ahead_us=QUEUE_AHEAD_US)()[0]
        del graphs  # frees the graphs' memory pools
        return samples


# --------------------------------------------------------------------------- hardware


def measured_hardware(base: str | Hardware, ceilings: dict | None, device_name: str) -> Hardware:
    """The base preset with the measured HBM bandwidth and FLOP/s (through ``with_overrides``)."""
    hw = get_hardware(base)
    if ceilings is None:
        return hw
    hw = with_overrides(hw, name=f"{device_name} (measured)", hbm_bw=float(ceilings["hbm_gbps"]) * 1e9,
                        peak_flops=float(ceilings["matmul_tflops"]) * 1e12)
    sources = dict(hw.sources, hbm_bw="measured in this run, HBM copy (read + write)",
                   peak_flops=f"measured in this run, {ceilings['matmul_n']}^3 matmul")
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else hw.sms
    return dataclasses.replace(hw, sources=sources, sms=sms)


def load_calibrations(spec) -> list[Calibration]:
    """Calibrations from a path, comma-separated paths, a Calibration, or a sequence of those."""
    if spec is None:
        return []
    items = spec.split(",") if isinstance(spec, str) else (list(spec) if isinstance(spec, (list, tuple)) else [spec])
    out = []
    for item in items:
        if isinstance(item, Calibration):
            out.append(item)
        elif str(item).strip():
            cal = load_calibration(str(item).strip())
            out.append(dataclasses.replace(cal, meta={**cal.meta, "path": str(item).strip()}))
    return out


def device_calibration(calibrations: Sequence[Calibration], hw: Hardware) -> tuple[Calibration | None, list[str]]:
    """The calibration for the GPU of ``hw`` (or the nearest one, moved to it) and what was done."""
    cal = nearest_calibration(hw, calibrations)
    if cal is None:
        return None, []
    return adapt_calibration(cal, hw)


def write_hardware_file(hw: Hardware, path: str) -> str:
    """``hw`` as a file ``load_hardware`` reads back (all four numbers, no base preset)."""
    data = {"name": hw.name, "hbm_bw": hw.hbm_bw, "peak_flops": hw.peak_flops, "net_bw": hw.net_bw,
            "net_latency": hw.net_latency}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
    return path


# --------------------------------------------------------------------------- kernel configs


def sample_configs(shape: MoEShape, device: torch.device, dtype: torch.dtype, n: int, seed: int) -> list:
    """``n`` configs of the space, stratified over the token block bm (so every batch size
    has candidates with a fitting bm), the same for every m of a model (one compile each)."""
    kernels = load_kernels(device, "moekit tax --measure")
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
    integer ``m`` (or ``M``) and a ``config`` object of ``KernelConfig`` fields (and
    optionally its ``id``) is a hint;
    if it also names ``model`` or ``shape``, it must be this shape's name. A malformed file
    or config raises ValueError naming the file.
    """
    KernelConfig = load_kernels(what="moekit tax --measure").KernelConfig
    data = read_json(path, "kernel-config hints")
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
                conf = dict(conf)
                given_id = conf.pop("id", None)  # the kernel dataset's config records carry their id
                unknown = set(conf) - fields
                if unknown:
                    raise ValueError(f"{path}: config has unknown fields {sorted(unknown)}")
                try:
                    cfg = KernelConfig(**conf)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{path}: bad kernel config {conf!r} ({exc})") from None
                if given_id is not None and given_id != cfg.id:
                    raise ValueError(f"{path}: config id {given_id!r} does not match its fields ({cfg.id})")
                hints.setdefault(m, []).append(cfg)
            return
        for value in node.values():
            visit(value)

    visit(data)
    return hints


def candidate_configs(shape: MoEShape, m: int, sampled: Sequence, hints: dict[int, list] | None = None) -> list:
    """The configs tried at batch m: the static default first, then the hints for the
    nearest hinted m (in log2 distance), then the sample; duplicates dropped."""
    out = [load_kernels(what="moekit tax --measure").default_config(m, shape)]
    if hints:
        near = min(hints, key=lambda h: (abs(math.log2(h) - math.log2(m)), h))
        out += hints[near]
    out += list(sampled)
    return list(dict.fromkeys(out))


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


def predict_calibrated(shape: MoEShape, cal: Calibration, m: int, block_size: int, tile_n: int, ids: np.ndarray,
                       elem: int, kernel_cost=None, kernel_name: str | None = None) -> tuple[TaxPoint, float]:
    """The calibrated model for exactly what was timed (as :func:`predict`), with the chosen
    config's token block and column tile; ``kernel_cost``: a routing-aware cost of the expert
    kernel (a RaMP model) where one covers the shape. Returns (TaxPoint, T_DensePA)."""
    from moekit.tax.hardware import calibration_hardware

    tm = TaxModel(shape, calibration_hardware(cal), n_gpus=1, padding="blockwise", block_size=block_size, f=1.0,
                  weight_bytes=elem, act_bytes=elem, calibration=cal, kernel_cost=kernel_cost,
                  kernel_name=kernel_name, tile_n=tile_n)
    point = tm.point(m, "decode", "TP+TP", routing=ids)
    return point, tm.dense_ffn(m, experts=shape.num_experts)


def achieved(shape: MoEShape, hw: Hardware, elem: int, seconds: float, widths: float, rows: float) -> dict:
    """Fractions of the measured HBM bandwidth and matmul FLOP/s that a block reached,
    counting the model's bytes (``widths`` expert weights + activations of ``rows``
    token-expert rows) and useful FLOPs (``rows`` rows)."""
    c = unit_costs(shape, hw, weight_bytes=elem, act_bytes=elem)
    moved = c.expert_bytes * widths + c.act_bytes_per_pair * rows
    return {"bw_frac": moved / seconds / hw.hbm_bw, "flops_frac": c.flops_per_pair * rows / seconds / hw.peak_flops}


# --------------------------------------------------------------------------- the run


def estimate_seconds(plan: _Plan, n_configs: int, hints: bool, workers: int = 0) -> tuple[float, float]:
    """(total, compile) seconds, from the H200 preset model at an assumed 50 % efficiency;
    ``workers`` > 0: compiles shared by a pool of that many processes (plus their start)."""
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
    if workers > 0:
        compile_s = POOL_START_SECONDS + compile_s / workers
    return total + compile_s, compile_s


def run_measure(cfg: MeasureConfig | None = None, out_dir: str | None = DEFAULT_OUT_DIR,
                log: Callable[[str], None] | None = print) -> dict:
    """Time every block, compare with the model, write the JSON record (+ PNG) to ``out_dir``
    (None: write nothing) and return the record (with ``paths`` of what was written)."""
    cfg = cfg or MeasureConfig()
    plan = _resolve(cfg)
    say = (lambda s: (log(s), sys.stdout.flush())) if log else (lambda s: None)
    kernels = load_kernels(plan.device, "moekit tax --measure")
    elem = elem_bytes(plan.dtype)
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
        est, est_compile = estimate_seconds(plan, cfg.configs, cfg.configs_from is not None, _workers(cfg))
        say(f"estimate: ~{est / 60:.1f} min (of which ~{est_compile / 60:.1f} min Triton compiles)")
    else:
        say("CPU run: Triton interpreter and host clock on tiny shapes; this checks the pipeline, not the hardware")

    ceilings = None
    if cfg.measure_ceilings:
        ceilings = measure_ceilings(plan.device, plan.dtype, plan.copy_bytes, plan.matmul_n,
                                    iters=max(plan.iters // 2, 3), warmup=plan.warmup)
        say(f"ceilings: HBM copy {ceilings['hbm_gbps']:.1f} GB/s (read + write), "
            f"{plan.matmul_n}^3 matmul {ceilings['matmul_tflops']:.4g} TFLOP/s")
    hw = measured_hardware(cfg.hardware, ceilings, device_name)
    l2 = (getattr(torch.cuda.get_device_properties(plan.device), "L2_cache_size", 0) or L2_FALLBACK) if on_gpu else None
    cal, cal_notes = device_calibration(load_calibrations(cfg.calibration), dataclasses.replace(hw, name=device_name))
    if cal is not None:
        say(f"calibrated model: {cal.name}")
        for note in cal_notes:
            say(f"  {note}")
    sampled = {s.name: sample_configs(s, plan.device, plan.dtype, cfg.configs, cfg.seed + 1000 * i)
               for i, s in enumerate(plan.shapes)}
    if on_gpu:
        warm_measure(plan, cfg, sampled, say)

    models, skipped, written = {}, [], {}
    for mi, shape in enumerate(plan.shapes):
        if cfg.deadline_s is not None and time.perf_counter() - start > cfg.deadline_s:
            skipped.append(shape.name)
            say(f"deadline of {cfg.deadline_s:.0f} s passed: {shape.name} not measured")
            continue
        cost, cost_name = None, None
        if cal is not None and cfg.ramp and on_gpu:
            from moekit.bench.tax_ramp import ramp_kernel_cost

            cost, cost_name, note = ramp_kernel_cost(shape, gpu_key(device_name), str(plan.dtype).replace("torch.", ""))
            say(f"  {shape.name}: {note}")
        ctx = _ModelRun(shape, plan, cfg, hw, timer, kernels, cfg.seed + 1000 * mi, say, start,
                        cal=cal, kernel_cost=cost, kernel_name=cost_name, sampled=sampled[shape.name])
        models[shape.name] = ctx.run(l2)
        if out_dir is not None and mi < len(plan.shapes) - 1:  # what is measured so far survives a cut-off run
            written = _write(plan, cfg, hw, ceilings, l2, models, skipped, cal, cal_notes, start, out_dir, written,
                             complete=False)

    record, written = _assemble(plan, cfg, hw, ceilings, l2, models, skipped, cal, cal_notes, start, out_dir,
                                written)
    paths = dict(written)
    if out_dir is not None:
        if ceilings is not None:  # for `moekit tax --hardware <file>`: the model with these numbers
            paths["hardware"] = write_hardware_file(hw, paths["json"].removesuffix(".json") + "-hardware.json")
        try:
            if models:
                paths["png"] = measure_figure(record, paths["json"].removesuffix(".json") + "-tau.png")
        except ImportError as exc:
            say(f"no figure: {exc}")
    record["paths"] = paths
    say(f"done in {time.perf_counter() - start:.0f} s")
    return record


def warm_measure(plan: _Plan, cfg: MeasureConfig, sampled: dict, say) -> None:
    """Fill Triton's cache for every model's candidate configs with a pool of processes, so the
    timed run compiles nothing (``compile_workers`` 0: compile in the run instead)."""
    from moekit.bench.kernel import BenchShape, warm_compile_cache

    workers = pool_workers(_workers(cfg), plan.shapes, plan.dtype, plan.device)
    if workers <= 0:
        return
    hints = {s.name: (load_config_hints(cfg.configs_from, s) if cfg.configs_from else None) for s in plan.shapes}
    jobs = []
    for s in plan.shapes:
        configs = list(dict.fromkeys(c for m in plan.batch_sizes for c in candidate_configs(s, m, sampled[s.name],
                                                                                             hints[s.name])))
        jobs.append((BenchShape(s.name, s.num_experts, s.top_k, s.hidden, s.intermediate, s.num_experts), configs))
    t0 = time.perf_counter()
    say(f"filling the Triton cache: {sum(len(c) for _, c in jobs)} (model, config) pairs, {workers} processes")
    errors = warm_compile_cache(jobs, plan.batch_sizes, plan.dtype, workers, say)
    say(f"compiled in {time.perf_counter() - t0:.0f} s{f'; {len(errors)} failed' if errors else ''}")


def pool_workers(requested: int, shapes, dtype: torch.dtype, device: torch.device) -> int:
    """At most ``requested`` compile processes, and no more than the free device memory holds:
    each keeps one shape's expert weights (the largest, plus a CUDA context and activations)."""
    if requested <= 0 or device.type != "cuda":
        return max(requested, 0)
    _free(device)
    elem = elem_bytes(dtype)
    per_worker = max(3 * s.num_experts * s.hidden * s.intermediate * elem for s in shapes) + 1.5 * 2**30
    free = torch.cuda.mem_get_info(device)[0]
    return max(1, min(requested, int(0.8 * free // per_worker)))


def _workers(cfg: MeasureConfig) -> int:
    return cfg.compile_workers if cfg.compile_workers is not None else min(16, os.cpu_count() or 1)


def _write(plan, cfg, hw, ceilings, l2, models, skipped, cal, cal_notes, start, out_dir, written, complete):
    _, written = _assemble(plan, cfg, hw, ceilings, l2, models, skipped, cal, cal_notes, start, out_dir, written,
                           complete)
    return written


def _assemble(plan, cfg, hw, ceilings, l2, models, skipped, cal, cal_notes, start, out_dir, written,
              complete: bool = True) -> tuple[dict, dict]:
    """The record of what is measured so far, written to ``out_dir`` (the same file each time)."""
    on_gpu = plan.device.type == "cuda"
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
        "model_calibrated": None if cal is None else
        "the same TaxModel with calibration= (and tile_n = bn of the chosen config, kernel_cost = a RaMP model "
        "where one covers the shape on this GPU)",
        "calibration_file": None if cal is None else cal.meta.get("path"),
        "deadline_s": cfg.deadline_s,
    }
    results = {
        "hardware": {"name": hw.name, "hbm_bw": hw.hbm_bw, "peak_flops": hw.peak_flops, "net_bw": hw.net_bw,
                     "net_latency": hw.net_latency, "sources": hw.sources},
        "calibration": None if cal is None else {
            "name": cal.name, "gpu": cal.gpu, "hbm_bw": cal.hbm_bw, "peak_flops": cal.peak_flops, "notes": cal_notes,
            "sources": cal.sources, "environment": cal.meta.get("environment")},
        "ceilings": ceilings, "l2_bytes": l2, "models": models, "skipped_models": skipped, "complete": complete,
        "verified": verified, "seconds": time.perf_counter() - start,
    }
    record = to_jsonable({"kind": "tax-measure", "environment": environment(), "params": params, "results": results})
    written = dict(written)
    if out_dir is not None:
        name = os.path.basename(written["json"]) if "json" in written else None
        written["json"] = str(write_record("tax-measure", params, results, out_dir=out_dir, name=name))
    return record, written


class _ModelRun:
    """Everything timed for one model: DenseFA, DensePA, then the MoE block per routing."""

    def __init__(self, shape, plan, cfg, hw, timer, kernels, seed, say, start, *, cal=None, kernel_cost=None,
                 kernel_name=None, sampled=None) -> None:
        self.shape, self.plan, self.cfg, self.hw, self.timer = shape, plan, cfg, hw, timer
        self.kernels, self.seed, self.say, self.start = kernels, seed, say, start
        self.cal, self.kernel_cost, self.kernel_name, self.sampled = cal, kernel_cost, kernel_name, sampled
        self.elem = elem_bytes(plan.dtype)
        # The same input sets for every block kind, so the three see the same activations.
        self.xs = {m: [_inputs(shape, m, g, plan, seed) for g in range(plan.input_sets)] for m in plan.batch_sizes}

    def _progress(self, what: str, m: int, us: float, t0: float, extra: str = "") -> None:
        now = time.perf_counter()
        self.say(f"  {self.shape.name:16} {what:16} m={m:<5} {us:10.1f} us {extra}"
                 f"({now - t0:.1f} s, {now - self.start:.0f} s total)")

    def run(self, l2: int | None) -> dict:
        shape, plan = self.shape, self.plan
        hints = load_config_hints(self.cfg.configs_from, shape) if self.cfg.configs_from else None
        sampled = self.sampled if self.sampled is not None else sample_configs(shape, plan.device, plan.dtype,
                                                                                self.cfg.configs, self.seed)
        dense_us, dense_err = self.dense()
        weights = make_moe_weights(shape, plan.dtype, plan.device, self.seed + 3)
        routings = {}
        for label, beta in plan.routings:
            points = []
            for m in plan.batch_sizes:
                t0 = time.perf_counter()
                res = _measure_moe_point(shape, m, self.xs[m], weights, beta, plan, self.timer, self.kernels,
                                         sampled, hints, self.seed)
                res.update(_model_side(shape, self.hw, self.elem, m, res, dense_us, self.cal, self.kernel_cost,
                                       self.kernel_name))
                res["dense_verify_rel_error"] = dense_err
                points.append(res)
                cal_text = "" if self.cal is None else (
                    f"calibrated {res['model_calibrated']['tau']:.2f}, "
                    f"{100 * res['rel_error_calibrated']['tau']:+.0f}%; ")
                self._progress(f"MoE {label}", m, res["t_moe_us"]["median"], t0,
                               f" tau {res['tau_measured']:.2f} ({cal_text}100%-peak {res['model']['tau']:.2f}, "
                               f"{100 * res['rel_error']['tau']:+.0f}%) {res['config_id']} "
                               f"best of {len(res['candidates'])} ")
            errors = [abs(p["rel_error"]["tau"]) for p in points]
            worst = points[int(np.argmax(errors))]
            routings[label] = {
                "beta_target": beta, "points": points, "max_abs_error": max(errors),
                "within_target": bool(max(errors) <= ERROR_TARGET), "worst_m": worst["m"],
                "explanation": explain_point(worst),
            }
            if self.cal is not None:
                cal_errors = [abs(p["rel_error_calibrated"]["tau"]) for p in points]
                worst_cal = points[int(np.argmax(cal_errors))]
                routings[label].update({
                    "max_abs_error_calibrated": max(cal_errors),
                    "within_target_calibrated": bool(max(cal_errors) <= ERROR_TARGET),
                    "worst_m_calibrated": worst_cal["m"], "explanation_calibrated": explain_calibrated(worst_cal),
                })
        del weights
        _free(plan.device)
        # The least weight traffic of any timed block (MoE at m=1: K experts + shared) vs L2:
        # far above 1 means every replay streams its weights from HBM, not from L2.
        c = unit_costs(shape, self.hw, weight_bytes=self.elem, act_bytes=self.elem)
        least = c.expert_bytes * (shape.top_k + c.k_shared)
        return {
            "shape": dataclasses.asdict(shape), "dense_intermediate": dense_intermediates(shape),
            "sampled_configs": [c.id for c in sampled],
            "config_hints": {m: [c.id for c in cs] for m, cs in (hints or {}).items()},
            "weight_bytes": {k: block_memory(shape, k, 0, self.elem, 0) for k in ("moe", "densefa", "densepa")},
            "least_weight_bytes_per_replay": least, "least_weight_bytes_over_l2": least / l2 if l2 else None,
            "routings": routings,
        }

    def dense(self) -> tuple[dict, float | None]:
        """Median-bearing summaries of DenseFA and DensePA per m (weights made and freed per kind)."""
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
    if len(configs) == 1:
        return configs[0], [{"config": configs[0].id, "median_us": None}]
    rows, best = [], None
    for cfg in configs:
        try:
            med = summarize(timer([lambda c=cfg: moe_block(xs[0], bias, weights, shape.top_k, c, kernels)],
                                  plan.select_iters))["median"]
        except Exception as exc:  # noqa: BLE001 - Triton raises several kinds (resources, compile)
            if cfg == configs[0]:
                raise
            rows.append({"config": cfg.id, "median_us": None, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        rows.append({"config": cfg.id, "median_us": med})
        if best is None or med < best[1]:
            best = (cfg, med)
    return best[0], rows


def _measure_moe_point(shape, m, xs, weights, beta, plan, timer, kernels, sampled, hints, seed) -> dict:
    """The MoE block at batch m: routing (skewed by a bias if ``beta``), the fastest config,
    its timing over all input sets, the parts (router, experts, shared) and a reference check."""
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
        "m": m, "config": dataclasses.asdict(cfg), "config_id": cfg.id, "candidates": candidates,
        "t_moe_us": t_moe, "breakdown_us": {k: summarize(v)["median"] for k, v in parts.items()},
        "realized_beta": realized_beta, "e_active_timed": float(np.mean([len(np.unique(i)) for i in ids])),
        "verify_rel_error": _verify_moe(xs[0], weights, bias, routed[0], shape, cfg, kernels), "_ids": ids,
    }


def _model_side(shape, hw, elem, m, res, dense_us, cal=None, kernel_cost=None, kernel_name=None) -> dict:
    """The models' numbers for this point (the 100 %-peak one and, with ``cal``, the calibrated
    one), the measured ratios and their errors."""
    ids = res.pop("_ids")
    side = _peak_side(shape, hw, elem, m, res, dense_us, ids)
    # The routing as timed, per input set (tokens per expert): enough to recompute any model later.
    side["expert_counts"] = [np.bincount(i.reshape(-1)[i.reshape(-1) >= 0], minlength=shape.num_experts).tolist()
                             for i in ids]
    if cal is not None:
        t_moe = res["t_moe_us"]["median"] * 1e-6
        t_fa = dense_us["densefa", m]["median"] * 1e-6
        t_pa = dense_us["densepa", m]["median"] * 1e-6
        bm, bn = res["config"]["bm"], res["config"]["bn"]
        point, c_pa = predict_calibrated(shape, cal, m, bm, bn, ids, elem, kernel_cost, kernel_name)
        side["model_calibrated"] = calibrated_summary(point, c_pa)
        side["rel_error_calibrated"] = {"tau": point.tau / (t_moe / t_fa) - 1.0, "t_moe": point.t_moe / t_moe - 1.0,
                                        "t_dense": point.t_dense / t_fa - 1.0,
                                        "tau_densepa": (c_pa / point.t_dense) / (t_pa / t_fa) - 1.0}
        if kernel_cost is not None and "RaMP" in point.cost_model:  # the curve's answer too, for comparison
            curve, _ = predict_calibrated(shape, cal, m, bm, bn, ids, elem)
            side["model_calibrated_curve"] = {"tau": curve.tau, "t_moe_us": curve.t_moe * 1e6,
                                              "rel_error_tau": curve.tau / (t_moe / t_fa) - 1.0}
    return side


def calibrated_summary(point: TaxPoint, t_densepa: float) -> dict:
    return {"tau": point.tau, "tau_densepa": t_densepa / point.t_dense, "t_moe_us": point.t_moe * 1e6,
            "t_densefa_us": point.t_dense * 1e6, "t_densepa_us": t_densepa * 1e6, "regime": point.regime,
            "e_active": point.e_active, "eta": point.eta, "block_size": point.block_size,
            "cost_model": point.cost_model}


def _peak_side(shape, hw, elem, m, res, dense_us, ids) -> dict:
    """The 100 %-peak model's numbers for this point, the measured ratios and their errors."""
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
