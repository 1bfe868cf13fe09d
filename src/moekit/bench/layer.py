"""`moekit bench layer`: one MoE layer (``MoELayer``) end to end on several ranks, by wire,
expert compute and kernel choice, each checked against the float64 block.

What runs. Every rank builds the same block (``MoEWeights.random``, one seed) and, per
variant, a :class:`~moekit.moe.MoELayer` that keeps its experts. A variant is
``WIRE+EXPERTS[+CONFIG][@eager]``:

* ``WIRE`` -- ``ll-fp8``: the low-latency layer (:class:`~moekit.ep.EPLowLatencyAllToAll`,
  ``max_m`` = the largest T) with online FP8 dispatch (e4m3 + one float32 scale per 128
  columns) and a bf16 combine; ``ll-bf16``: the same layer with the tokens in bf16 both ways;
  ``alltoall``: the eager all-to-all (:class:`~moekit.ep.AllToAllDispatcher`), which reads its
  message sizes on the host once per dispatch and so cannot be captured in a CUDA graph;
* ``EXPERTS`` -- ``torch`` (batched matmuls over the whole receive buffer), ``fused`` (the fused
  Triton kernel on the weights' dtype), ``fused_fp8`` (its W8A8 form, e4m3 weights in 128 x 128
  blocks);
* ``CONFIG`` (fused experts only) -- ``static``: the kernel's static default for the receive
  buffer's capacity (``kernel_config="default"``); ``auto``: RaMP's routing-aware choice
  (``kernel_config="auto"``): with a fitted model file for the shape and GPU its cost model,
  without one the region analysis (a one-time warning says how to profile); ``ramp``: the
  layer's default (``kernel_config="ramp"``): RaMP's model where one exists, reading the routing
  only where it predicts that pays, else the kernel's default. The record says which, and every
  config each variant ran;
* ``@eager`` -- time this variant eagerly even where graphs are on.

With ``--graph`` (the default on GPUs) each variant's forward, routing given, is captured
once per T in one CUDA graph and its replays are timed; the eager all-to-all (and ``@eager``
variants) run eagerly, and the record says so. Inside a graph no value may be read back, so
``auto`` runs RaMP's *static* choice for the capacity, fixed at capture (with a fitted model the
least mean predicted time over a sweep of routings; without one the kernel's own default,
then the same config as ``static``): the per-step, routing-aware choice runs eagerly
(``...+auto@eager``), one host read per forward.

Timing. Per T, every rank holds fixed buffers ``x[T, H]``, ``topk_ids[T, K]``,
``topk_weights[T, K]`` and a bank of ``routings`` uniform random routings (drawn per rank);
before each iteration the next routing is written into the buffers, outside the timed
region. Ranks are aligned once before the warm-up and once before the timed loop, then step
after step as in a serving loop; the slowest rank's time per iteration is kept (a layer step
is done when its last rank is); median, p95, p99 over ``iters``. A warm-up of at least
``routings`` iterations sees every routing once, so each kernel config an eager ``auto`` picks
is compiled before the timed loop. On a GPU captured replays are
queued ahead of the GPU (:func:`moekit.bench.timing.queue_timed`), so the samples are GPU
time, not the host's launch time; eager variants are queued with no head start, so a step
whose host launches more slowly than the GPU runs is timed as the host drives it, which is
what an eager step costs.

Check. Once per (variant, T), on the routing of the first bank entry, every rank compares
the layer's output (the graph's replay where captured) with :func:`moekit.moe.reference_moe`
in float64 on the tokens and weights as the variant sees them (tokens quantized per 128
columns where the wire or the W8A8 kernel quantizes them; weights dequantized from their
128 x 128 blocks for ``fused_fp8``): ``calc_diff`` < 1e-3 for the FP8 experts, relative error
< 1e-2 in bf16 (GPU) and < 1e-5 in float32 (CPU) otherwise, the bounds of the layer's tests.
The record keeps the worst rank's error; a variant over its bound fails the command.

On the CPU (gloo) the same code runs eagerly at a tiny shape in float32, the fused kernels in
Triton's interpreter: the run checks the command and the numerics, its times mean nothing.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from moekit.bench.report import (DEFAULT_OUT_DIR, cpu_smoke_line, format_table, new_figure, save_figure,
                                 write_record)
from moekit.bench.stats import summarize
from moekit.bench.timing import gather_samples, rank_aligner
from moekit.shapes import PRESETS, MoEShape, get_shape

WIRES = ("ll-fp8", "ll-bf16", "alltoall")
EXPERTS = ("torch", "fused", "fused_fp8")
CONFIGS = {"auto": "auto", "static": "default", "ramp": "ramp"}  # variant's CONFIG -> MoELayer(kernel_config=...)
EAGER_SUFFIX = "@eager"
DEFAULT_VARIANTS = ("ll-fp8+fused_fp8+auto", "ll-fp8+fused_fp8+static", "alltoall+fused_fp8+static")
FP8_GROUP = 128  # the wire's columns per scale and the W8A8 kernel's activation groups

# The CPU's shape: the smallest whose H and N take FP8 blocks of 128, so the FP8 wire and the
# W8A8 kernel run there too (the interpreter takes about a second per forward).
CPU_SHAPE = MoEShape("tiny-layer", num_experts=4, top_k=2, hidden=128, intermediate=128)
SHAPES = {**PRESETS, CPU_SHAPE.name: CPU_SHAPE}
GPU_DEFAULTS = dict(shape="qwen3-30b-a3b", tokens=(1, 16, 128), iters=200, warmup=20)
CPU_DEFAULTS = dict(shape=CPU_SHAPE.name, tokens=(1, 4), iters=3, warmup=1)

# Error bounds of the check, as the layer's tests use them: calc_diff for the W8A8 experts
# (DeepEP's metric), relative error otherwise, by activation dtype.
FP8_DIFF = 1e-3
REL_TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}

# Head start per iteration of queued graph replays (µs): enough for the host to queue one
# replay, the routing copies and the events before the GPU reaches them.
QUEUE_AHEAD_US = 160.0


# ------------------------------------------------------------------------------ variants


@dataclass(frozen=True)
class Variant:
    """One parsed ``WIRE+EXPERTS[+CONFIG][@eager]``."""

    name: str
    wire: str
    experts: str
    config: str | None  # "auto" / "static" / "ramp"; None for torch experts
    eager: bool

    @property
    def kernel_config(self) -> str | None:
        return None if self.config is None else CONFIGS[self.config]

    @property
    def capturable(self) -> bool:
        return self.wire != "alltoall" and not self.eager

    @property
    def fp8_experts(self) -> bool:
        return self.experts == "fused_fp8"

    @property
    def quantizes_tokens(self) -> bool:
        """The experts see the tokens quantized per 128 columns (by the wire or the W8A8 kernel)."""
        return self.wire == "ll-fp8" or self.fp8_experts


VARIANT_FORM = (f"WIRE+EXPERTS[+CONFIG][{EAGER_SUFFIX}] with WIRE in {list(WIRES)}, EXPERTS in {list(EXPERTS)}, "
                f"CONFIG in {list(CONFIGS)} (fused experts only; required for them)")


def parse_variant(text: str) -> Variant:
    """A :class:`Variant` from its name; ValueError naming ``--variants`` and the form otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"--variants: each must be a string {VARIANT_FORM}, got {text!r}")
    body, eager = (text[:-len(EAGER_SUFFIX)], True) if text.endswith(EAGER_SUFFIX) else (text, False)
    parts = body.split("+")
    bad = f"--variants: {text!r} is not {VARIANT_FORM}"
    if len(parts) not in (2, 3) or parts[0] not in WIRES or parts[1] not in EXPERTS:
        raise ValueError(bad)
    wire, experts = parts[0], parts[1]
    config = parts[2] if len(parts) == 3 else None
    if experts == "torch" and config is not None:
        raise ValueError(f"--variants: {text!r}: torch experts take no kernel CONFIG")
    if experts != "torch" and config not in CONFIGS:
        raise ValueError(f"{bad} ({experts} experts need +auto, +ramp or +static)")
    return Variant(text, wire, experts, config, eager)


def parse_variants(texts) -> tuple[Variant, ...]:
    if not texts:
        raise ValueError(f"--variants: name at least one, {VARIANT_FORM}")
    variants = tuple(parse_variant(t) for t in texts)
    seen = Counter(v.name for v in variants)
    if any(n > 1 for n in seen.values()):
        raise ValueError(f"--variants: each at most once, got {[name for name, n in seen.items() if n > 1]}")
    return variants


# -------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class LayerBenchConfig:
    """What :func:`run_layer_bench` measures; None fields take the device's default
    (``GPU_DEFAULTS`` / ``CPU_DEFAULTS``, :meth:`for_device`). ``shape``: a preset's name,
    ``"tiny-layer"`` or a :class:`MoEShape`. ``graph`` None: on GPUs."""

    shape: str | MoEShape | None = None
    tokens: tuple[int, ...] | None = None
    world_size: int = 2
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    iters: int | None = None
    warmup: int | None = None
    graph: bool | None = None
    routings: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("world_size", 1), ("iters", 1), ("warmup", 0), ("routings", 1), ("seed", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= {low}, got {value!r}")
        if self.tokens is not None and (not self.tokens or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in self.tokens)):
            raise ValueError(f"--tokens must be ints >= 1, got {self.tokens!r}")
        if self.tokens is not None and len(set(self.tokens)) != len(self.tokens):
            raise ValueError(f"--tokens: each at most once, got {list(self.tokens)}")
        if self.graph is not None and not isinstance(self.graph, bool):
            raise ValueError(f"graph must be a bool or None, got {self.graph!r}")
        if isinstance(self.shape, str) and self.shape not in SHAPES:
            raise ValueError(f"--shape must be one of {sorted(SHAPES)}, got {self.shape!r}")
        if self.shape is not None and not isinstance(self.shape, (str, MoEShape)):
            raise ValueError(f"shape must be a preset's name or a MoEShape, got {self.shape!r}")
        parse_variants(self.variants)

    def for_device(self, on_gpu: bool) -> "LayerBenchConfig":
        """A copy with the unset fields taken from the device's defaults."""
        defaults = dict(GPU_DEFAULTS if on_gpu else CPU_DEFAULTS, graph=on_gpu)
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    def moe_shape(self) -> MoEShape:
        if isinstance(self.shape, MoEShape):
            return self.shape
        return SHAPES[self.shape] if self.shape in SHAPES else get_shape(self.shape)


def check_shape(shape: MoEShape, world_size: int, variants: tuple[Variant, ...]) -> None:
    """ValueError before any rank starts, for what the layers would reject one by one."""
    if shape.num_experts % world_size:
        raise ValueError(f"--world-size {world_size} must divide the shape's {shape.num_experts} experts "
                         f"({shape.name})")
    needs_blocks = [v.name for v in variants if v.wire == "ll-fp8" or v.fp8_experts]
    sizes = {"H": shape.hidden} | ({"N": shape.intermediate} if any(v.fp8_experts for v in variants) else {})
    odd = {k: n for k, n in sizes.items() if n % FP8_GROUP}
    if needs_blocks and odd:
        raise ValueError(f"--shape {shape.name}: {', '.join(f'{k}={n}' for k, n in odd.items())} must be a "
                         f"multiple of {FP8_GROUP} for {needs_blocks} (FP8 scales per {FP8_GROUP} columns)")


# ------------------------------------------------------------------------------ per rank


class _Inputs:
    """Fixed input buffers of one T and a bank of routings written into them before each iteration."""

    def __init__(self, shape: MoEShape, T: int, routings: int, seed: int, device, dtype):
        from moekit.routing import synthetic_routing

        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(T, shape.hidden, generator=g).to(device=device, dtype=dtype)
        bank = [synthetic_routing(T, shape.num_experts, shape.top_k, zipf=0.0, seed=seed * 1000 + i)
                for i in range(routings)]  # zipf 0: uniform
        self.ids_bank = torch.stack([ids for ids, _ in bank]).to(device)
        self.w_bank = torch.stack([w for _, w in bank]).to(device=device, dtype=torch.float32)
        self.ids = self.ids_bank[0].clone()
        self.w = self.w_bank[0].clone()
        self.written = 0

    def write(self, i: int) -> None:
        self.ids.copy_(self.ids_bank[i % self.ids_bank.shape[0]])
        self.w.copy_(self.w_bank[i % self.w_bank.shape[0]])

    def next(self) -> None:
        self.write(self.written)
        self.written += 1


class _ConfigLog:
    """The kernel configs a layer's fused experts ran, call by call (a forward hook: host only,
    so it also fires while a graph is captured, for the config the graph holds)."""

    def __init__(self, experts: torch.nn.Module):
        self.calls: list[tuple[int, str]] = []  # (capacity, config id)
        self.handle = experts.register_forward_hook(self._hook)

    def _hook(self, module, args, out) -> None:
        config = getattr(module, "last_config", None)
        if config is not None:
            self.calls.append((int(args[0].shape[1]), config.id))

    def ids(self, since: int = 0) -> dict[str, int]:
        return dict(Counter(cid for _, cid in self.calls[since:]))


class _References:
    """float64 ground truth per rank: the full block's weights as each variant's experts see them."""

    def __init__(self, weights, device):
        self.weights, self.device = weights, device
        self._w8a8 = None

    def weights_for(self, variant: Variant):
        from moekit.fp8 import dequantize_blocks, quantize_blocks
        from moekit.moe import MoEWeights

        if not variant.fp8_experts:
            return self.weights
        if self._w8a8 is None:  # the W8A8 kernel's weights: e4m3 in 128 x 128 blocks, dequantized
            w = self.weights
            self._w8a8 = MoEWeights(w.router, *(dequantize_blocks(*quantize_blocks(t, FP8_GROUP), FP8_GROUP)
                                                for t in (w.w13, w.w2)), w.shared_w13, w.shared_w2)
        return self._w8a8

    def error(self, variant: Variant, y: torch.Tensor, inputs: _Inputs) -> dict:
        from moekit.fp8 import calc_diff, dequantize_groups, quantize_groups
        from moekit.moe import reference_moe

        x = inputs.x
        if variant.quantizes_tokens:
            x = dequantize_groups(*quantize_groups(x, FP8_GROUP))
        ref = reference_moe(x, self.weights_for(variant), inputs.ids, inputs.w, dtype=torch.float64)
        y64 = y.double()
        finite = bool(torch.isfinite(y64).all())
        rel = float((y64 - ref).norm() / ref.norm()) if finite else float("inf")
        return dict(rel_err=rel, calc_diff=calc_diff(y64, ref) if finite else float("inf"))


def _bound(variant: Variant, dtype: torch.dtype) -> tuple[str, float]:
    """(metric, bound) of the check for this variant in this activation dtype."""
    return ("calc_diff", FP8_DIFF) if variant.fp8_experts else ("rel_err", REL_TOL[dtype])


def _dispatcher(wire: str, shape: MoEShape, max_m: int, dtype):
    from moekit.ep import AllToAllDispatcher, EPLowLatencyAllToAll

    if wire == "alltoall":
        return AllToAllDispatcher(shape.num_experts, hidden=shape.hidden, top_k=shape.top_k)
    return EPLowLatencyAllToAll(max_m, shape.hidden, shape.top_k, shape.num_experts, fp8_group_size=FP8_GROUP,
                                dtype=dtype, online_fp8=wire == "ll-fp8")


def _slowest_rank(samples: list[float], device) -> list[float]:
    """Per iteration, the slowest rank's µs (every rank passes its own samples)."""
    return gather_samples(samples, None, device.type == "cuda").amax(0).tolist()


def _time_steady(run, inputs: _Inputs, iters: int, warmup: int, device, queued: bool) -> list[float]:
    """µs per iteration of ``run`` on this rank, steady state (module docstring)."""
    from moekit.bench.timing import queue_timed

    align = rank_aligner(None, device.type == "cuda")
    align()
    samples = queue_timed([run], iters=iters, warmup=warmup, device=device, before_each=inputs.next,
                          after_warmup=align, queue_ahead_us=QUEUE_AHEAD_US if queued else 0.0)
    return samples()[0]


def kernel_choice(variant: Variant, captured: bool, selector) -> str:
    """How this variant's kernel config was chosen, in words."""
    if variant.config is None:
        return "no kernel (torch experts)"
    if variant.config == "static":
        return "static: the kernel's default for the capacity"
    if variant.config == "ramp":
        if selector is None:
            return "ramp (the default): no RaMP model file for this shape and GPU, so the kernel's default"
        name = Path(selector.model_path).name
        if captured:
            return f"ramp inside a CUDA graph: RaMP's static choice for the capacity, fixed at capture ({name})"
        return f"ramp (the default): RaMP's static choice, the routing read where {name} predicts it pays"
    source = (f"RaMP fitted model {Path(selector.model_path).name}" if selector is not None and not selector.fallback
              else "RaMP region-analysis fallback (no model file for this shape and GPU)")
    if captured:
        what = "the kernel's default" if selector is None or selector.fallback else "its least mean predicted time"
        return f"auto inside a CUDA graph: RaMP's static choice for the capacity, fixed at capture ({what}; {source})"
    return f"auto per forward (one host read): {source}"


def _selector_of(variant: Variant, shape: MoEShape, world_size: int, capacity: int, device):
    """The RaMP selector a ``config="auto"`` or ``"ramp"`` FusedExperts used (the process-wide
    one of its key; for ``"ramp"`` None where no model file exists)."""
    from moekit.ramp.select import model_selector_for, selector_for

    dtype = torch.float8_e4m3fn if variant.fp8_experts else torch.bfloat16
    find = model_selector_for if variant.config == "ramp" else selector_for
    return find(shape.num_experts // world_size, None, shape.hidden, shape.intermediate, dtype=dtype,
                device=device, family="expert_major", capacity=capacity)


def _progress(rank: int, what: str) -> None:
    if rank == 0:
        print(f"[bench layer] {what}", file=sys.stderr, flush=True)


def _bench_rank(rank: int, world_size: int, cfg: LayerBenchConfig) -> dict:
    """Every variant at every T on this rank: samples (slowest rank), errors, configs."""
    from moekit.bench.timing import capture_graph
    from moekit.ep import current_device
    from moekit.moe import MoELayer, MoEWeights

    device = current_device()
    on_cuda = device.type == "cuda"
    if not on_cuda:  # RaMP's advice to profile the shape on the GPU means nothing for a CPU smoke run
        warnings.filterwarnings("ignore", message="moekit.ramp: no fitted model")
    dtype = torch.bfloat16 if on_cuda else torch.float32  # the interpreter's dots are exact in fp32, not bf16
    shape = cfg.moe_shape()
    variants = parse_variants(cfg.variants)
    weights = MoEWeights.random(shape, seed=cfg.seed, dtype=dtype, device=device)
    refs = _References(weights, device)
    dispatchers = {w: _dispatcher(w, shape, max(cfg.tokens), dtype) for w in dict.fromkeys(v.wire for v in variants)}
    out: dict = {"samples": {}, "errors": {}, "configs": {}, "modes": {}, "choices": {}}
    for v in variants:
        layer = MoELayer(shape, weights, dispatcher=dispatchers[v.wire], experts=v.experts,
                         kernel_config=v.kernel_config)
        log = _ConfigLog(layer.experts)
        captured = bool(cfg.graph and on_cuda and v.capturable)
        out["modes"][v.name] = "graph" if captured else "eager"
        for T in cfg.tokens:
            inputs = _Inputs(shape, T, cfg.routings, seed=cfg.seed * 7919 + 100 * T + rank, device=device, dtype=dtype)
            held = {}

            def step(layer=layer, inputs=inputs, held=held) -> None:
                held["y"] = layer(inputs.x, inputs.ids, inputs.w)

            _progress(rank, f"{v.name} T={T}: {'capture, ' if captured else 'eager, '}{cfg.iters} iterations "
                            f"after {cfg.warmup} warm-up")
            start = len(log.calls)
            with torch.no_grad():
                if captured:
                    graph = capture_graph(step)
                    run = graph.replay
                    start = len(log.calls) - 1  # the call made during capture: the config the graph holds
                else:
                    graph, run = None, step
                samples = _time_steady(run, inputs, cfg.iters, cfg.warmup, device, queued=captured)
                out["samples"].setdefault(v.name, {})[T] = _slowest_rank(samples, device)
                out["configs"].setdefault(v.name, {})[T] = log.ids(start)
                inputs.write(0)  # the check: the first routing of the bank, through what was timed
                run()
                if on_cuda:
                    torch.cuda.synchronize()
                out["errors"].setdefault(v.name, {})[T] = refs.error(v, held["y"], inputs)
            del graph, held, run
        if v.config in ("auto", "ramp"):
            capacity = log.calls[-1][0] if log.calls else 1
            out["choices"][v.name] = kernel_choice(v, captured, _selector_of(v, shape, world_size, capacity, device))
        else:
            out["choices"][v.name] = kernel_choice(v, captured, None)
        log.handle.remove()
        del layer
    for d in dispatchers.values():
        if hasattr(d, "finalize"):
            d.finalize()
    out["device"] = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    return out


# --------------------------------------------------------------------------------- driver


def run_layer_bench(cfg: LayerBenchConfig, *, out_dir: str | None = DEFAULT_OUT_DIR,
                    figures: bool = True) -> dict:
    """Run every variant at every T on ``cfg.world_size`` local ranks; write and return the record."""
    from moekit.ep import default_backend, launch

    backend = default_backend(cfg.world_size)
    on_gpu = backend == "nccl"
    cfg = cfg.for_device(on_gpu)
    if cfg.graph and not on_gpu:
        raise ValueError("--graph needs a CUDA GPU per rank; on the CPU every variant runs eagerly (--no-graph)")
    shape = cfg.moe_shape()
    variants = parse_variants(cfg.variants)
    check_shape(shape, cfg.world_size, variants)
    if any(v.experts != "torch" for v in variants):
        from moekit.bench.triton_kernels import load_kernels

        load_kernels("cuda" if on_gpu else "cpu", "the fused experts of `moekit bench layer`")  # ranks inherit
    if on_gpu:
        for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
            os.environ.setdefault(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")  # never NVLink multicast
    print(f"[bench layer] {shape.name} on {cfg.world_size} ranks ({backend}): {len(variants)} variants x "
          f"T = {' '.join(map(str, cfg.tokens))}", file=sys.stderr, flush=True)
    ranks = launch(_bench_rank, cfg.world_size, cfg, backend=backend)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    results = _results(cfg, variants, ranks, dtype)
    params = asdict(cfg) | dict(
        shape=asdict(shape), shape_name=shape.name, variants=[v.name for v in variants], backend=backend,
        device=ranks[0]["device"], dtype=str(dtype).replace("torch.", ""),
        wires={"ll-fp8": "low-latency layer, FP8 dispatch (e4m3 + float32 scale per 128 columns), "
                         f"{'bf16' if on_gpu else 'float32'} combine",
               "ll-bf16": f"low-latency layer, {'bf16' if on_gpu else 'float32'} both ways",
               "alltoall": "eager all-to-all (host reads the message sizes each dispatch; cannot be captured)"},
        timing="slowest rank per iteration; ranks aligned once before the warm-up and the timed loop, then steady "
               "state; routing written before each iteration, outside the timed region; "
               + ("graph replays queued ahead of the GPU (GPU time); eager variants queued with no head start "
                  "(host launch time counted where it is the slower)" if on_gpu else
                  "CPU host clock, eager, kernels in Triton's interpreter: checks the command, not numbers"),
        routing=f"uniform synthetic (moekit.routing.synthetic_routing), {cfg.routings} routings per rank and T, cycled",
        check="once per (variant, T) on every rank against moekit.moe.reference_moe in float64 on the tokens and "
              "weights as the variant sees them; the worst rank kept")
    record = {"params": params, "results": results}
    if out_dir is not None:
        path = write_record("layer", params, results, out_dir=out_dir)
        record["path"] = str(path)
        if figures:
            try:
                record["figures"] = [str(draw_layer_figure(record, path.with_suffix(".png")))]
            except ImportError:  # matplotlib is an optional extra: no figure
                pass
    return record


def _results(cfg: LayerBenchConfig, variants: tuple[Variant, ...], ranks: list[dict], dtype) -> dict:
    first = ranks[0]
    rows = []
    for v in variants:
        metric, bound = _bound(v, dtype)
        for T in cfg.tokens:
            s = summarize(first["samples"][v.name][T])
            worst = {k: max(r["errors"][v.name][T][k] for r in ranks) for k in ("rel_err", "calc_diff")}
            configs = {str(rank): r["configs"][v.name][T] for rank, r in enumerate(ranks)}
            rows.append(dict(variant=v.name, T=T, mode=first["modes"][v.name], median_us=s["median"],
                             p95_us=s["p95"], p99_us=s["p99"], mean_us=s["mean"], min_us=s["min"], n=s["n"],
                             configs=configs, metric=metric, error=worst[metric], bound=bound,
                             ok=worst[metric] < bound, **worst))
    base = variants[0].name
    for row in rows:
        ref = next(r for r in rows if r["variant"] == base and r["T"] == row["T"])
        row["vs_first"] = row["median_us"] / ref["median_us"]
    notes = []
    if any(v.config == "auto" for v in variants) and any(v.config == "static" for v in variants):
        for v in variants:
            twin = next((w for w in variants if w.config == "static" and (w.wire, w.experts, w.eager) ==
                         (v.wire, v.experts, v.eager)), None)
            if v.config != "auto" or twin is None:
                continue
            same = all(r["configs"] == t["configs"] for r in rows if r["variant"] == v.name
                       for t in rows if t["variant"] == twin.name and t["T"] == r["T"])
            if same:
                notes.append(f"{v.name} ran the same kernel configs as {twin.name} at every T: "
                             f"{first['choices'][v.name]}")
    if any(v.wire == "alltoall" for v in variants) and cfg.graph:
        notes.append("alltoall variants run eagerly: the all-to-all reads its message sizes on the host")
    return dict(rows=rows, first=base, choices=first["choices"], modes=first["modes"], notes=notes,
                checks_passed=all(r["ok"] for r in rows))


# -------------------------------------------------------------------------- text, figure


def _config_cell(configs: dict) -> str:
    """The config ids of rank 0, most used first (``+n`` when there are more)."""
    ids = sorted(configs.get("0", {}).items(), key=lambda kv: -kv[1])
    if not ids:
        return "-"
    return ids[0][0] + (f" +{len(ids) - 1}" if len(ids) > 1 else "")


def format_layer_bench(record: dict) -> str:
    p, r = record["params"], record["results"]
    s = p["shape"]
    lines = [
        f"MoELayer end to end on {p['world_size']} ranks ({p['backend']}, {p['device']}, {p['dtype']}); "
        f"{p['shape_name']}: E={s['num_experts']} top-{s['top_k']} H={s['hidden']} N={s['intermediate']}; "
        f"µs per layer, slowest rank, {p['iters']} iterations per point after {p['warmup']} warm-up; "
        f"vs_first = median / median of {r['first']}",
        format_table([dict(row, config=_config_cell(row["configs"]), err=f"{row['metric']} {row['error']:.1e}",
                           check="ok" if row["ok"] else "FAILED") for row in r["rows"]],
                     ["variant", "mode", "T", "median_us", "p95_us", "vs_first", "config", "err", "check"],
                     floatfmt=".2f"),
        *[f"{name}: {how}" for name, how in r["choices"].items()],
        *[f"note: {n}" for n in r["notes"]],
    ]
    lines.append("checks: " + ("all variants within their bounds" if r["checks_passed"] else
                               "FAILED: " + ", ".join(f"{row['variant']} T={row['T']}" for row in r["rows"]
                                                      if not row["ok"])))
    if "path" in record:
        lines.append(f"record: {record['path']}")
    if record.get("figures"):
        lines.append("figure: " + ", ".join(record["figures"]))
    return "\n".join(lines)


def draw_layer_figure(record: dict, path: str | Path) -> Path:
    """Median µs per layer against tokens per rank, one line per variant (p95 as the bar's top)."""
    p, r = record["params"], record["results"]
    fig, ax = new_figure(figsize=(6.5, 4))
    for name in p["variants"]:
        rows = sorted((row for row in r["rows"] if row["variant"] == name), key=lambda row: row["T"])
        Ts = [row["T"] for row in rows]
        med = [row["median_us"] for row in rows]
        ax.errorbar(Ts, med, yerr=[[0] * len(rows), [row["p95_us"] - row["median_us"] for row in rows]],
                    marker="o", capsize=3, label=f"{name} ({r['modes'][name]})")
    ax.set(xscale="log", xlabel="tokens per rank", ylabel="µs per layer (median; bar to p95)")
    Ts = sorted({row["T"] for row in r["rows"]})
    ax.set_xticks(Ts, labels=[str(t) for t in Ts])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    ax.set_title(f"{p['shape_name']}, MoELayer on {p['world_size']} ranks ({p['device']})", fontsize=9)
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------- main


def main_from_args(args) -> int:
    """``moekit bench layer``: run, print the table, 1 if a variant failed its check."""
    from moekit.ep import default_backend

    cfg = LayerBenchConfig(shape=args.shape, tokens=None if args.tokens is None else tuple(args.tokens),
                           world_size=args.world_size, variants=tuple(args.variants), iters=args.iters,
                           warmup=args.warmup, graph=args.graph, routings=args.routings, seed=args.seed)
    if default_backend(cfg.world_size) != "nccl":  # gloo ranks, Triton's interpreter, a tiny float32 shape
        print(cpu_smoke_line("timings and ratios (not its error checks)"), flush=True)
    record = run_layer_bench(cfg, out_dir=None if args.no_record else args.out_dir)
    print(format_layer_bench(record))
    return 0 if record["results"]["checks_passed"] else 1
