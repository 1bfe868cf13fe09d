"""`moekit bench capspill`: MaxCounts vs eager vs Cap-and-Spill on Mixtral-like routing (the Cap-and-Spill paper).

What runs. A routing trace (default: ``moekit.routing.mixtral_capspill_trace``, whose
per-peer counts on 8 ranks match the paper's) fixes the capacities on this run's P ranks:
C_max = the largest per-peer count (MaxCounts) and C = ceil(Q_q) for each quantile of the
sweep (Cap-and-Spill; Table 2). Then ``steps`` (sequence, layer) routings of the trace
are replayed. Each rank holds fixed input buffers ``x[T_max, H]``, ``topk_ids`` and
``topk_weights``; before each step the step's routing is written into them (``copy_``,
outside the timed region). Per step and method, ``iters`` iterations are timed with
``moekit.bench.timing.time_distributed`` (ranks aligned before each iteration; the
slowest rank's time per iteration):

* ``eager`` — :class:`~moekit.ep.AllToAllDispatcher`, run eagerly (not graph-capturable);
* ``maxcounts`` — :class:`~moekit.ep.capspill.MaxCountsDispatcher`, one CUDA graph;
* ``capspill q=...`` — :class:`~moekit.ep.capspill.CapAndSpillDispatcher`, unconditional,
  one CUDA graph per quantile;
* ``capspill-cond`` — the conditional mode at the main quantile: a probe graph
  (``spill_flag``: per-peer histogram + all-reduce), a host read of the flag, then the
  graph with or without the spill pass.

Two series per method: ``dispatch`` (what the paper's Table 1 times) and ``round_trip``
(dispatch -> identity experts -> combine). On a GPU the graphs are captured with
``moekit.bench.timing.capture_graph`` and replayed; on the CPU (gloo) there are no graphs
and the same functions run eagerly, so CPU numbers only show that the pipeline works.

Also measured: a per-phase breakdown (pack, all-to-all, compact, all-to-all (spill),
unpack; each phase captured as its own graph) like the paper's Figure 3, and a bitwise
check of every method against eager on the first ``verify_steps`` steps (valid rows,
counts, handle, combine). The record holds the per-peer count histogram, so Figure 2
(histogram + CDF) and Figure 3 can be drawn from it anywhere (:func:`draw_capspill_figures`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from moekit.bench.report import DEFAULT_OUT_DIR, format_table, new_figure, save_figure, write_record
from moekit.bench.stats import summarize
from moekit.bench.timing import capture_graph, time_distributed
from moekit.ep import AllToAllDispatcher, current_device, default_backend, launch
from moekit.ep.capacity import calibrate_capacity, overflow_fractions, spill_capacity, trace_peer_counts
from moekit.ep.capspill import CapAndSpillDispatcher, MaxCountsDispatcher
from moekit.outputs import check_output_dir
from moekit.routing.trace import RoutingTrace

# The paper's numbers (8x A100 NVLink, Mixtral-8x7B traces, P = 8), for side-by-side tables.
PAPER_TABLE1 = [
    dict(method="MaxCounts (baseline)", C=43, mean=1077.0, median=1040.4, p95=1224.5, p99=1726.9, cuda_graph=True),
    dict(method="Eager (oracle)", C=None, mean=390.9, median=340.6, p95=528.9, p99=1227.7, cuda_graph=False),
    dict(method="Cap-and-Spill", C=16, mean=712.0, median=676.4, p95=854.3, p99=1196.6, cuda_graph=True),
]
PAPER_CONDITIONAL_MEAN_US = 949.0
PAPER_TABLE2 = [
    dict(setting="MaxCounts", C=43, mean=1077.0, p99=1726.9, overflow_pct=0.0, gap_recovery_pct=0.0),
    dict(setting="q=0.90", C=10, mean=756.7, p99=1328.8, overflow_pct=31.1, gap_recovery_pct=46.7),
    dict(setting="q=0.95", C=12, mean=738.7, p99=1302.1, overflow_pct=18.5, gap_recovery_pct=49.3),
    dict(setting="q=0.99", C=16, mean=712.0, p99=1210.8, overflow_pct=5.4, gap_recovery_pct=53.2),
    dict(setting="q=0.995", C=18, mean=722.5, p99=1227.0, overflow_pct=2.7, gap_recovery_pct=51.7),
    dict(setting="Eager", C=None, mean=390.9, p99=1227.7, overflow_pct=0.0, gap_recovery_pct=100.0),
]
PAPER_PHASES_US = {"maxcounts": {"pack": 848.0}, "capspill": {"pack": 553.0}}  # Figure 3's quoted numbers

SERIES = ("dispatch", "round_trip")
PACKINGS = ("auto", "triton", "torch")  # see MaxCountsDispatcher.uses_kernels


# Sizes by device. On the CPU (gloo) every iteration is a barrier and a real exchange of
# the buffers (MaxCounts at H=4096 moves ~0.2 s of data per dispatch), so the GPU's sizes would
# run for an hour; the CPU's show in seconds that the pipeline works.
GPU_DEFAULTS = dict(hidden=4096, trace_steps=1000, steps=200, iters=20, warmup=2, phase_steps=50, verify_steps=50)
CPU_DEFAULTS = dict(hidden=256, trace_steps=200, steps=8, iters=3, warmup=1, phase_steps=4, verify_steps=4)


@dataclass(frozen=True)
class CapSpillBenchConfig:
    """What ``run_capspill_bench`` measures; None fields take the device's default
    (``GPU_DEFAULTS`` / ``CPU_DEFAULTS``, :meth:`for_device`)."""

    world_size: int = 2
    hidden: int | None = None
    dtype: str | None = None  # default: bfloat16 on GPU, float32 on CPU
    quantile: float = 0.99  # the main Cap-and-Spill operating point (Table 1)
    sweep: tuple[float, ...] = (0.90, 0.95, 0.99, 0.995)  # Table 2
    trace_path: str | None = None  # a saved RoutingTrace; default: the Mixtral preset
    trace_steps: int | None = None  # preset size (the paper: 1000 sequences x 32 layers)
    trace_layers: int = 32
    trace_seed: int = 0
    steps: int | None = None  # (sequence, layer) routings measured, evenly spread over the trace
    iters: int | None = None  # timed iterations per routing step and series
    warmup: int | None = None  # untimed iterations before each step's timing
    phase_steps: int | None = None  # steps in the per-phase breakdown
    verify_steps: int | None = None  # steps checked bitwise against eager
    seed: int = 0
    packing: str = "torch"  # the fixed-buffer dispatchers' phases: "torch", "auto" (kernels on GPUs), "triton"

    def __post_init__(self) -> None:
        for name in ("world_size", "hidden", "steps", "iters", "trace_steps", "trace_layers"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("warmup", "phase_steps", "verify_steps", "trace_seed", "seed"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for q in (self.quantile, *self.sweep):
            if not 0.0 <= q <= 1.0:
                raise ValueError(f"quantiles must be in [0, 1], got {q}")
        if self.packing not in PACKINGS:
            raise ValueError(f"packing must be one of {list(PACKINGS)}, got {self.packing!r}")
        if self.dtype is not None and not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"dtype must name a torch dtype (e.g. bfloat16), got {self.dtype!r}")

    def for_device(self, on_gpu: bool) -> "CapSpillBenchConfig":
        """A copy with the unset sizes taken from the device's defaults."""
        defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    @property
    def quantiles(self) -> list[float]:
        """The sweep plus the main quantile, sorted, without repeats."""
        return sorted({float(q) for q in (*self.sweep, self.quantile)})


# --------------------------------------------------------------------------- routing input


def load_trace(cfg: CapSpillBenchConfig) -> RoutingTrace:
    if cfg.trace_path is not None:
        return RoutingTrace.load(cfg.trace_path)
    from moekit.routing import mixtral_capspill_trace

    return mixtral_capspill_trace(steps=cfg.trace_steps, layers=cfg.trace_layers, seed=cfg.trace_seed)


def bench_routing(trace: RoutingTrace, steps: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indices into the flattened (step, layer) list, ids [n, tokens, K] int64, weights float32).

    ``steps`` routings evenly spread over the trace. Weights come from the trace when it
    has them, else softmax-like random weights (they only scale the combine).
    """
    flat_ids = trace.topk_ids.reshape(-1, trace.num_tokens, trace.top_k)
    picks = np.unique(np.linspace(0, flat_ids.shape[0] - 1, num=min(steps, flat_ids.shape[0])).round().astype(np.int64))
    ids = flat_ids[picks].astype(np.int64)
    if trace.topk_weights is not None:
        weights = trace.topk_weights.reshape(flat_ids.shape)[picks].astype(np.float32)
    else:
        logits = np.random.default_rng(seed).standard_normal(ids.shape)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights = (weights / weights.sum(-1, keepdims=True)).astype(np.float32)
    return picks, ids, np.where(ids >= 0, weights, 0.0).astype(np.float32)


@dataclass
class _Plan:
    """Everything the ranks need, decided once by the parent."""

    cfg: CapSpillBenchConfig
    num_experts: int
    top_k: int
    max_tokens: int
    cmax: int
    capacities: dict[float, int]  # quantile -> C
    ids: np.ndarray  # [steps, P * T_max, K]
    weights: np.ndarray


# ------------------------------------------------------------------------------- per rank


class _Inputs:
    """The fixed input buffers every captured graph reads; steps are written into them."""

    def __init__(self, rank: int, plan: _Plan, device: torch.device, dtype: torch.dtype):
        T, H, K = plan.max_tokens, plan.cfg.hidden, plan.top_k
        g = torch.Generator().manual_seed(plan.cfg.seed * 7919 + rank)
        self.x = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
        self.ids = torch.full((T, K), -1, dtype=torch.int64, device=device)
        self.w = torch.zeros(T, K, device=device)
        rows = slice(rank * T, (rank + 1) * T)
        self._ids = torch.from_numpy(plan.ids[:, rows])
        self._w = torch.from_numpy(plan.weights[:, rows])

    def write(self, step: int) -> None:
        self.ids.copy_(self._ids[step])
        self.w.copy_(self._w[step])

    @property
    def args(self):
        return self.x, self.ids, self.w


def _runner(fn: Callable[[], None], on_cuda: bool) -> Callable[[], None]:
    """``fn`` itself on the CPU; on a GPU, a replay of its CUDA graph (outputs filled once)."""
    if not on_cuda:
        return fn
    graph = capture_graph(fn, warmup=2)
    graph.replay()  # later graphs may read this one's outputs: give them real data
    return graph.replay


@dataclass
class _Method:
    """One dispatcher's two timed series and the outputs of its last round trip."""

    name: str
    capacity: int | None
    graph: bool
    dispatch: Callable[[], None]
    round_trip: Callable[[], None]
    outputs: Callable[[], tuple]  # (Dispatched, y) of the last round trip
    state: dict = field(default_factory=dict)  # conditional mode: {"spill": whether the last call spilled}


def _fixed_method(name, dispatcher, inputs, on_cuda, graph=True, **kwargs) -> _Method:
    out: dict = {}

    def dispatch():
        out["dispatch"] = dispatcher.dispatch(*inputs.args, **kwargs)

    def round_trip():
        d = dispatcher.dispatch(*inputs.args, **kwargs)
        out["d"], out["y"] = d, dispatcher.combine(d.tokens, d)

    run = (lambda fn: _runner(fn, on_cuda)) if graph else (lambda fn: fn)
    return _Method(name, getattr(dispatcher, "capacity", None), graph and on_cuda, run(dispatch), run(round_trip),
                   lambda: (out["d"], out["y"]))


def _conditional_method(name, dispatcher, inputs, on_cuda) -> _Method:
    """Probe graph -> host read of the flag -> the graph with or without the spill pass."""
    flag: dict = {}
    probe = _runner(lambda: flag.update(v=dispatcher.spill_flag(inputs.ids)), on_cuda)
    branches = {spill: _fixed_method(name, dispatcher, inputs, on_cuda, spill=spill) for spill in (True, False)}
    last = {"spill": True}

    def choose(series: str) -> Callable[[], None]:
        def run():
            probe()
            last["spill"] = bool(flag["v"].item())  # the conditional mode's host sync
            getattr(branches[last["spill"]], series)()
        return run

    return _Method(name, dispatcher.capacity, on_cuda, choose("dispatch"), choose("round_trip"),
                   lambda: branches[last["spill"]].outputs(), state=last)


def _packed(dispatcher, packing: str):
    """``dispatcher`` with its phases' implementation set (``packing``: see ``uses_kernels``)."""
    dispatcher.packing = packing
    return dispatcher


def _methods(plan: _Plan, inputs: _Inputs, on_cuda: bool) -> dict[str, _Method]:
    E, K, T = plan.num_experts, plan.top_k, plan.max_tokens
    H, packing = plan.cfg.hidden, plan.cfg.packing
    methods = {
        "eager": _fixed_method("eager", AllToAllDispatcher(E, hidden=H, top_k=K, max_tokens=T), inputs, on_cuda,
                               graph=False),
        "maxcounts": _fixed_method("maxcounts", _packed(MaxCountsDispatcher(E, plan.cmax, T, top_k=K, hidden=H),
                                                        packing), inputs, on_cuda),
    }
    for q, C in plan.capacities.items():
        methods[f"capspill q={q:g}"] = _fixed_method(
            f"capspill q={q:g}", _packed(CapAndSpillDispatcher(E, C, T, top_k=K, hidden=H), packing), inputs, on_cuda)
    C = plan.capacities[plan.cfg.quantile]
    methods["capspill-cond"] = _conditional_method(
        "capspill-cond", _packed(CapAndSpillDispatcher(E, C, T, top_k=K, hidden=H, conditional=True), packing),
        inputs, on_cuda)
    return methods


def _phases(dispatcher, inputs: _Inputs, on_cuda: bool) -> dict[str, Callable[[], None]]:
    """The dispatch as separately captured phases, chained through a dict of their outputs.

    "pack" is the plan and pass 1's buffer (one launch where the dispatcher uses its kernels),
    "compact" the spill pass's buffer, "unpack" the expert-major result."""
    st: dict = {}
    two_pass = getattr(dispatcher, "spill_rows", 0) > 0

    def pack():
        st["plan"], st["send"] = dispatcher.plan_and_pack(inputs.x, inputs.ids, inputs.w)

    def exchange():
        st["recv"] = dispatcher.exchange(st["send"])

    def compact():
        st["spill"] = dispatcher.compact(inputs.x, st["plan"])

    def exchange_spill():
        st["recv_spill"] = dispatcher.exchange(st["spill"])

    def unpack():
        received = [st["recv"], st["recv_spill"]] if two_pass else [st["recv"]]
        st["d"] = dispatcher.unpack(st["plan"], received, inputs.x)

    steps = {"pack": pack, "all-to-all": exchange}
    if two_pass:
        steps |= {"compact": compact, "all-to-all (spill)": exchange_spill}
    steps["unpack"] = unpack
    return {name: _runner(fn, on_cuda) for name, fn in steps.items()}  # captured in order


def _same(got, want) -> bool:
    """Bitwise equality of two dispatch results (valid rows, counts, handle) and their combines."""
    (d, y), (de, ye) = got, want
    if not torch.equal(d.counts, de.counts) or not torch.equal(y, ye):
        return False
    for e, n in enumerate(de.counts.tolist()):
        for a, b in ((d.tokens, de.tokens), (d.handle.src_rank, de.handle.src_rank),
                     (d.handle.src_token, de.handle.src_token), (d.handle.src_slot, de.handle.src_slot)):
            if not torch.equal(a[e, :n], b[e, :n]):
                return False
    return True


def _bench_rank(rank: int, world_size: int, plan: _Plan) -> dict | None:
    cfg = plan.cfg
    device = current_device()
    on_cuda = device.type == "cuda"
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else (torch.bfloat16 if on_cuda else torch.float32)
    inputs = _Inputs(rank, plan, device, dtype)
    inputs.write(0)
    methods = _methods(plan, inputs, on_cuda)
    phase_dispatchers = {"maxcounts": _packed(MaxCountsDispatcher(plan.num_experts, plan.cmax, plan.max_tokens,
                                                                  top_k=plan.top_k, hidden=cfg.hidden), cfg.packing),
                         "capspill": _packed(CapAndSpillDispatcher(plan.num_experts, plan.capacities[cfg.quantile],
                                                                   plan.max_tokens, top_k=plan.top_k,
                                                                   hidden=cfg.hidden), cfg.packing)}
    kernels = phase_dispatchers["maxcounts"].uses_kernels(inputs.x)
    phases = {name: _phases(d, inputs, on_cuda) for name, d in phase_dispatchers.items()}

    samples = {name: {s: [] for s in SERIES} for name in methods}
    phase_samples = {name: {p: [] for p in runs} for name, runs in phases.items()}
    verified = {name: 0 for name in methods if name != "eager"}
    mismatched = {name: [] for name in verified}
    cond_spilled = []
    timed = dict(iters=cfg.iters, warmup=cfg.warmup)
    steps, start = plan.ids.shape[0], time.perf_counter()
    for step in range(steps):
        if rank == 0 and (step % max(1, steps // 10) == 0 or step == steps - 1):
            _progress(f"step {step + 1}/{steps} ({time.perf_counter() - start:.0f} s)")
        inputs.write(step)
        for name, m in methods.items():  # interleaved, so drift hits every method alike
            for series in SERIES:
                samples[name][series] += time_distributed(getattr(m, series), **timed).max_us
        if step < cfg.verify_steps:
            methods["eager"].round_trip()
            want = methods["eager"].outputs()
            for name in verified:
                methods[name].round_trip()
                verified[name] += 1
                if not _same(methods[name].outputs(), want):
                    mismatched[name].append(step)
        if step < cfg.phase_steps:
            for name, runs in phases.items():
                for run in runs.values():  # fill every phase's outputs for this step first
                    run()
                for phase, run in runs.items():
                    phase_samples[name][phase] += time_distributed(run, **timed).max_us
        cond_spilled.append(methods["capspill-cond"].state["spill"])
    if rank != 0:
        return None
    return dict(samples=samples, phases=phase_samples, verified=verified, mismatched=mismatched,
                cond_spilled=cond_spilled, device=str(device), dtype=str(dtype).removeprefix("torch."),
                graphs=on_cuda, kernels=kernels)


# --------------------------------------------------------------------------------- driver


def run_capspill_bench(cfg: CapSpillBenchConfig, *, trace: RoutingTrace | None = None,
                       out_dir: str | None = DEFAULT_OUT_DIR, figures: bool = True) -> dict:
    """Run the benchmark on ``cfg.world_size`` local ranks; write and return the record.

    ``trace`` overrides the configured trace. With ``out_dir`` the JSON record is written
    there (and, with ``figures``, Figure 2 and 3 PNGs next to it when matplotlib is
    available).
    """
    backend = default_backend(cfg.world_size)
    cfg = cfg.for_device(backend == "nccl")
    trace = load_trace(cfg) if trace is None else trace
    P = cfg.world_size
    counts = trace_peer_counts(trace, P)  # raises when P does not divide E or the token rows
    calibrations = {q: calibrate_capacity(trace, q, P) for q in cfg.quantiles}
    top = calibrate_capacity(trace, 1.0, P)
    picks, ids, weights = bench_routing(trace, cfg.steps, cfg.seed)
    plan = _Plan(cfg=cfg, num_experts=trace.num_experts, top_k=trace.top_k, max_tokens=trace.num_tokens // P,
                 cmax=max(top.capacity, 1), capacities={q: c.capacity for q, c in calibrations.items()},
                 ids=ids, weights=weights)
    _progress(f"{P} ranks ({backend}), H={cfg.hidden}: {ids.shape[0]} routing steps x {len(cfg.quantiles) + 3} "
              f"methods x 2 series, {cfg.iters} iterations each")
    measured = launch(_bench_rank, P, plan, backend=backend)[0]

    step_counts = counts.reshape(-1, P, P)[picks]
    results = _results(plan, measured, calibrations, top, counts, step_counts, graphs=measured["graphs"])
    params = asdict(cfg) | dict(
        backend=backend, device=measured["device"], dtype=measured["dtype"], cuda_graphs=measured["graphs"],
        phase_kernels=measured["kernels"],
        trace=dict(name=trace.name, steps=trace.num_steps, layers=trace.num_layers, tokens=trace.num_tokens,
                   top_k=trace.top_k, num_experts=trace.num_experts, metadata=trace.metadata),
        max_tokens=plan.max_tokens, experts_per_rank=trace.num_experts // P, cmax=plan.cmax,
        capacities={repr(q): c for q, c in plan.capacities.items()},
        timing="slowest rank per iteration; ranks aligned before each iteration; routing written into the "
               "graph's input buffers before each step, outside the timed region")
    record = {"params": params, "results": results}
    if out_dir is not None:
        path = write_record("capspill", params, results, out_dir=out_dir)
        record["path"] = str(path)
        if figures:
            record["figures"] = _try_figures(record, path.with_suffix(""))
    return record


def _progress(what: str) -> None:
    print(f"[bench capspill] {what}", file=sys.stderr, flush=True)


def _try_figures(record: dict, stem: Path) -> list[str] | str:
    try:
        return [str(p) for p in draw_capspill_figures(record, stem)]
    except ImportError as error:  # matplotlib is optional; the record holds the data
        return f"not drawn: {error}"


def _results(plan, measured, calibrations, top, counts, step_counts, graphs: bool) -> dict:
    cfg = plan.cfg
    summaries = {name: {s: summarize(v) for s, v in series.items()} for name, series in measured["samples"].items()}
    main = f"capspill q={cfg.quantile:g}"
    gap = {series: {name: gap_recovery(summaries["maxcounts"][series]["mean"], summaries[name][series]["mean"],
                                       summaries["eager"][series]["mean"])
                    for name in summaries if name.startswith("capspill")} for series in SERIES}
    flat = counts.reshape(-1)
    return dict(
        summaries=summaries,
        gap_recovery=gap,
        table1=_table1(plan, summaries, main, graphs),
        table2=_table2(plan, summaries, calibrations, top, step_counts),
        phases={name: {p: summarize(v) for p, v in phases.items() if v}
                for name, phases in measured["phases"].items()},
        verification={name: dict(steps=n, exact=not measured["mismatched"][name],
                                 mismatched_steps=measured["mismatched"][name])
                      for name, n in measured["verified"].items()},
        conditional_spill_fraction=float(np.mean(measured["cond_spilled"])),
        trace_counts=dict(world_size=cfg.world_size, mean=float(flat.mean()), std=float(flat.std()),
                          max=int(flat.max()), quantiles={repr(q): c.capacity for q, c in calibrations.items()},
                          histogram=np.bincount(flat).tolist()),
        calibration={repr(q): c.to_dict() for q, c in calibrations.items()} | {"1.0": top.to_dict()},
    )


def gap_recovery(t_max: float, t_cs: float, t_eager: float) -> float | None:
    """(T_max - T_cs) / (T_max - T_eager) in percent; None when eager is not faster than MaxCounts."""
    if not t_max > t_eager:
        return None
    return 100.0 * (t_max - t_cs) / (t_max - t_eager)


def _table1(plan, summaries, main, graphs: bool) -> list[dict]:
    """The paper's Table 1 for this run; ``cuda_graph`` says whether the method ran as CUDA
    graphs here (on the CPU nothing does: the graph methods run eagerly)."""
    rows = []
    base = summaries["maxcounts"]["dispatch"]["mean"]
    names = [("maxcounts", "MaxCounts", plan.cmax, True), ("eager", "Eager", None, False),
             (main, "Cap-and-Spill", plan.capacities[plan.cfg.quantile], True),
             ("capspill-cond", "Cap-and-Spill (conditional)", plan.capacities[plan.cfg.quantile], True)]
    for key, label, C, graph in names:
        s = summaries[key]["dispatch"]
        rows.append(dict(method=label, C=C, mean=s["mean"], median=s["median"], p95=s["p95"], p99=s["p99"],
                         cuda_graph=graph and graphs, vs_maxcounts_pct=100.0 * (base - s["mean"]) / base,
                         round_trip_mean=summaries[key]["round_trip"]["mean"]))
    return rows


def _table2(plan, summaries, calibrations, top, step_counts) -> list[dict]:
    T, K = plan.max_tokens, plan.top_k

    def row(setting, key, C, cal):
        s = summaries[key]["dispatch"]
        return dict(setting=setting, C=C, S=spill_capacity(T, K, C) if key.startswith("capspill") else None,
                    mean=s["mean"], p99=s["p99"],
                    overflow_pct=100.0 * cal["overflow_send_fraction"],
                    overflow_token_pct=100.0 * cal["overflow_token_fraction"],
                    measured_overflow_pct=100.0 * overflow_fractions(step_counts, C)["overflow_send_fraction"],
                    gap_recovery_pct=gap_recovery(summaries["maxcounts"]["dispatch"]["mean"], s["mean"],
                                                  summaries["eager"]["dispatch"]["mean"]))

    rows = [row("MaxCounts", "maxcounts", plan.cmax, top.to_dict())]
    rows += [row(f"q={q:g}", f"capspill q={q:g}", c.capacity, c.to_dict()) for q, c in calibrations.items()]
    e = summaries["eager"]["dispatch"]
    rows.append(dict(setting="Eager", C=None, S=None, mean=e["mean"], p99=e["p99"], overflow_pct=0.0,
                     overflow_token_pct=0.0, measured_overflow_pct=0.0, gap_recovery_pct=100.0))
    return rows


# -------------------------------------------------------------------------- text, figures


def format_capspill_bench(record: dict) -> str:
    p, r = record["params"], record["results"]
    tc = r["trace_counts"]
    lines = [
        f"Cap-and-Spill dispatch on {p['world_size']} ranks ({p['backend']}, {p['device']}, "
        f"{'CUDA graphs' if p['cuda_graphs'] else 'no CUDA graphs: eager calls'}), H={p['hidden']} {p['dtype']}, "
        f"E={p['trace']['num_experts']} top-{p['trace']['top_k']}, T_max={p['max_tokens']} tokens/rank; "
        f"{r['summaries']['eager']['dispatch']['n']} samples per series "
        f"({p['steps']} routing steps x {p['iters']} iterations)",
        f"trace {p['trace']['name']!r}: per-peer counts on P={tc['world_size']}: mean {tc['mean']:.2f}, "
        f"max {tc['max']} (paper, P=8: mean 5.1, Q99 16, max 43)",
        "",
        "Table 1: dispatch latency (µs, slowest rank per iteration)",
        format_table(r["table1"], ["method", "C", "mean", "median", "p95", "p99", "cuda_graph", "vs_maxcounts_pct",
                                   "round_trip_mean"]),
        "the paper (8x A100, P=8, not this machine):",
        format_table(PAPER_TABLE1, ["method", "C", "mean", "median", "p95", "p99", "cuda_graph"]),
        "gap recovery (T_max - T_cs) / (T_max - T_eager), dispatch means: "
        + ", ".join(f"{k}: {_pct(v)}" for k, v in r["gap_recovery"]["dispatch"].items())
        + "  (paper: 53.2% at q=0.99)",
        "",
        "Table 2: quantile sweep (dispatch; overflow % = sends with any per-peer count > C, on the trace)",
        format_table(r["table2"], ["setting", "C", "S", "mean", "p99", "overflow_pct", "overflow_token_pct",
                                   "measured_overflow_pct", "gap_recovery_pct"]),
        "paper:",
        format_table(PAPER_TABLE2, ["setting", "C", "mean", "p99", "overflow_pct", "gap_recovery_pct"]),
        "",
        "Per-phase breakdown (µs, median; on a GPU each phase is replayed as its own graph; phases: "
        + ("one Triton kernel each (moekit.ep.capspill_pack)" if p.get("phase_kernels") else "torch ops") + ")",
        format_table(_phase_rows(r["phases"]), ["method", *_phase_names(r["phases"]), "sum"]),
        "",
        "bitwise equal to eager: " + ", ".join(
            f"{k} {'yes' if v['exact'] else 'NO (steps ' + str(v['mismatched_steps'][:5]) + ')'} ({v['steps']} steps)"
            for k, v in r["verification"].items()),
    ]
    if "path" in record:
        lines.append(f"record: {record['path']}")
    if isinstance(record.get("figures"), list):
        lines.append("figures: " + ", ".join(record["figures"]))
    return "\n".join(lines)


def _pct(value) -> str:
    return "-" if value is None else f"{value:.1f}%"


PHASE_ORDER = ("pack", "all-to-all", "compact", "all-to-all (spill)", "unpack")


def _phase_names(phases: dict) -> list[str]:
    """The phases present in any method, in pipeline order."""
    return [p for p in PHASE_ORDER if any(p in runs for runs in phases.values())]


def _phase_rows(phases: dict) -> list[dict]:
    return [{"method": name, **{p: s["median"] for p, s in runs.items()},
             "sum": sum(s["median"] for s in runs.values())} for name, runs in phases.items()]


def draw_capspill_figures(record: dict, stem: str | Path) -> list[Path]:
    """Figure 2 (per-peer count histogram + CDF) and Figure 3 (per-phase bars) as ``{stem}-figure2.png`` etc."""
    r, stem = record["results"], Path(stem)
    tc = r["trace_counts"]
    hist = np.asarray(tc["histogram"], dtype=np.float64)
    values = np.arange(hist.size)
    cmax = record["params"]["cmax"]
    C = record["params"]["capacities"][repr(float(record["params"]["quantile"]))]

    fig, (ax_h, ax_c) = new_figure(1, 2, figsize=(11, 4))
    ax_h.bar(values, hist / hist.sum(), width=1.0, color="tab:blue")
    ax_h.axvspan(C + 0.5, max(cmax, C) + 0.5, color="tab:red", alpha=0.15, label="overflow (spill pass)")
    for x, label, color in ((tc["mean"], f"mean {tc['mean']:.1f}", "k"), (C, f"C = {C}", "tab:red"),
                            (cmax, f"C_max = {cmax}", "tab:purple")):
        ax_h.axvline(x, color=color, linestyle="--", label=label)
    ax_h.set(xlabel="per-peer token count", ylabel="fraction of observations", title="(a) histogram")
    ax_h.legend()
    cdf = np.cumsum(hist) / hist.sum()
    ax_c.step(values, cdf, where="post")
    for q, c in tc["quantiles"].items():
        ax_c.plot([c], [float(q)], "o", label=f"Q{100 * float(q):g} = {c}")
    ax_c.axvline(cmax, color="tab:purple", linestyle="--", label=f"C_max = {cmax}")
    ax_c.set(xlabel="per-peer token count", ylabel="CDF", title="(b) CDF")
    ax_c.legend()
    fig.suptitle(f"Per-peer counts on P={tc['world_size']} ranks ({record['params']['trace']['name']})")
    paths = [save_figure(fig, f"{stem}-figure2.png")]

    phases = r["phases"]
    fig, ax = new_figure(figsize=(7, 4))
    names = list(phases)
    bottom = np.zeros(len(names))
    for phase in _phase_names(phases):
        heights = np.array([phases[n][phase]["median"] if phase in phases[n] else 0.0 for n in names])
        ax.bar(names, heights, bottom=bottom, label=phase)
        bottom += heights
    ax.set(ylabel="µs (median per phase)", title=f"Per-phase dispatch time ({record['params']['device']})")
    ax.legend()
    paths.append(save_figure(fig, f"{stem}-figure3.png"))
    return paths


# ---------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moekit bench capspill", description=__doc__.split("\n")[0])
    d = CapSpillBenchConfig()

    def by_device(name: str) -> str:
        return f"(default: {GPU_DEFAULTS[name]} on GPUs, {CPU_DEFAULTS[name]} on the CPU)"

    p.add_argument("--world-size", type=int, default=d.world_size,
                   help="local ranks, >= 1, dividing the trace's experts and token rows (default %(default)s)")
    p.add_argument("--hidden", type=int, default=None, help=f"hidden size H of the tokens, >= 1 {by_device('hidden')}")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="activations' dtype: %(choices)s (default: bfloat16 on GPUs, float32 on the CPU)")
    p.add_argument("--quantile", type=float, default=d.quantile,
                   help="the main Cap-and-Spill capacity quantile, in [0, 1] (default %(default)s)")
    p.add_argument("--sweep", type=float, nargs="+", default=list(d.sweep),
                   help="quantiles of the Table 2 sweep, each in [0, 1] (default %(default)s)")
    p.add_argument("--trace", default=None, help="a saved RoutingTrace (.npz); default: the Mixtral preset")
    p.add_argument("--trace-steps", type=int, default=None,
                   help=f"sequences of the preset trace, >= 1 {by_device('trace_steps')}")
    p.add_argument("--trace-layers", type=int, default=d.trace_layers,
                   help="layers of the preset trace, >= 1 (default %(default)s)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"(sequence, layer) routings measured, >= 1 {by_device('steps')}")
    p.add_argument("--iters", type=int, default=None,
                   help=f"timed iterations per routing and series, >= 1 {by_device('iters')}")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed iterations before each, >= 0 {by_device('warmup')}")
    p.add_argument("--phase-steps", type=int, default=None,
                   help=f"steps in the per-phase breakdown, >= 0 {by_device('phase_steps')}")
    p.add_argument("--verify-steps", type=int, default=None,
                   help=f"steps checked bitwise against eager, >= 0 {by_device('verify_steps')}")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the inputs and weights, >= 0 (default %(default)s)")
    p.add_argument("--packing", default=d.packing, choices=list(PACKINGS),
                   help="the fixed-buffer dispatchers' pack / compact / unpack: one Triton kernel each "
                        "('triton'; 'auto' = on GPUs) or the torch phases ('torch', the baseline) "
                        "(default %(default)s)")
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                   help="where the JSON record and figures go (default %(default)s)")
    p.add_argument("--no-record", action="store_true", help="write no record or figures")
    return p


def config_from_args(args) -> CapSpillBenchConfig:
    return CapSpillBenchConfig(world_size=args.world_size, hidden=args.hidden, dtype=args.dtype,
                               quantile=args.quantile, sweep=tuple(args.sweep), trace_path=args.trace,
                               trace_steps=args.trace_steps, trace_layers=args.trace_layers, steps=args.steps,
                               iters=args.iters, warmup=args.warmup, phase_steps=args.phase_steps,
                               verify_steps=args.verify_steps, seed=args.seed, packing=args.packing)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.no_record:
        check_output_dir(args.out_dir, "--out-dir")
    record = run_capspill_bench(config_from_args(args), out_dir=None if args.no_record else args.out_dir)
    print(format_capspill_bench(record))
    return 0 if all(v["exact"] for v in record["results"]["verification"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
