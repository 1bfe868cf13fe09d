"""`moekit bench lowlatency`: dispatch and combine latency of the low-latency layer (the Low-Latency EP All-to-All Layer)
against the eager all-to-all and torch's ``all_to_all_vdev_2d``, with the byte floor.

What runs. For each tokens-per-rank T (default 1, 8, 32, 128, 256) every rank holds fixed
input buffers ``x[T, H]``, ``topk_ids[T, K]``, ``topk_weights[T, K]`` and a bank of random
routings (top-K of E without repeats, drawn per rank); before each iteration the next
routing is written into the buffers, outside the timed region. Each iteration times
dispatch and combine back to back (an event between them), so the two series and their sum
come from the same iterations; the slowest rank's time per iteration is kept (a collective
is done when its last rank is). Ranks are aligned once before the timed loop, then step
after step runs as in a serving loop (steady state; on a GPU the iterations are queued ahead
of the GPU in chunks, so the events time the GPU and not the host: see ``_time_pair``).

* ``lowlatency`` — :class:`~moekit.ep.EPLowLatencyAllToAll` (``max_m`` = the largest T),
  FP8 by default; on a GPU dispatch and combine are each captured once in a CUDA graph and
  replayed (what a graph-captured serving step sees); with E = the shape's experts. It is
  also timed as one ``step``: dispatch and combine captured together in one graph, as a
  serving engine's graph holds them (one graph launch per step, where ``total`` pays two);
* ``alltoall`` — :class:`~moekit.ep.AllToAllDispatcher`, eager (it syncs with the host and
  cannot be captured), bf16, same E;
* ``vdev2d`` — ``torch.ops.symm_mem.all_to_all_vdev_2d`` (NVSHMEM backend; it allows at most
  16 experts per rank, so E = ``peer_experts``, default 32): dispatch = sort the (token,
  slot) pairs by expert + the op; combine = ``all_to_all_vdev_2d_offset`` back + un-sort +
  ``weighted_slot_sum``; bf16, eager; run in its own processes (it switches the symmetric
  memory backend), skipped cleanly without CUDA or without the op. ``lowlatency@32`` is
  the low-latency layer at the same E for the ratio.

Combine orders (``--combine-order slot|rank|both``). ``rank`` times the layer and the
all-to-all with ``combine_order="rank"`` (one partial row per (token, rank) comes back;
series ``lowlatency[rank]``, ``alltoall[rank]``); ``both`` times both orders in the same run.
``--recv-capacity C`` adds the layer with a bounded receive buffer (``lowlatency[C=..]``,
per order): C rows per source, the rest in spill rounds.

Byte floor. The bytes that must cross NVLink for each step's routing (the slowest rank;
dispatch: one copy per (token, remote rank) of the FP8 payload + scales, plus the routing
rows; combine: one bf16 row per remote slot, or per (token, remote rank) in the rank order;
for vdev2d one bf16 row per remote slot both ways), divided by the peer bandwidth measured
in this run (a large copy-engine copy GPU 0 -> GPU 1). Small messages are latency-bound, so
the floor is far below the times.

On the CPU (gloo) the same code runs eagerly at tiny sizes: the numbers only show that the
pipeline works. ``--buffers`` runs nothing on ranks: it prints the layer's memory per rank,
worst case against a bounded receive buffer, and the spill on traces
(:mod:`moekit.ep.lowlatency.buffers`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moekit.perfetto import load_trace
from moekit.bench.report import DEFAULT_OUT_DIR, format_table, new_figure, save_figure, write_record
from moekit.bench.stats import summarize
from moekit.bench.timing import capture_graph, gather_samples, queue_timed, rank_aligner
from moekit.ep import AllToAllDispatcher, EPLowLatencyAllToAll, current_device, default_backend, launch
from moekit.ep.dispatcher import weighted_slot_sum
from moekit.ep.lowlatency.buffers import DEFAULT_BETA as DEFAULT_BUFFER_BETA
from moekit.ep.lowlatency.buffers import DEFAULT_EPS as DEFAULT_BUFFER_EPS
from moekit.ep.lowlatency.buffers import DEFAULT_SHAPES as DEFAULT_BUFFER_SHAPES
from moekit.outputs import check_output_dir
from moekit.shapes import get_shape

METHODS = ("lowlatency", "alltoall", "vdev2d")
SERIES = ("dispatch", "combine", "total")
COMBINE_ORDER_CHOICES = ("slot", "rank", "both")
GOAL_US, GOAL_TOKENS = 30.0, 128  # the layer's target: dispatch + combine <= 30 µs at 128 tokens/rank on 2xH200


# Points and counts by device. On the CPU (gloo) one deepseek-v3 step takes milliseconds, so
# the GPU's 1000 iterations at five token counts would run for many minutes.
GPU_DEFAULTS = dict(tokens=(1, 8, 32, 128, 256), iters=1000, warmup=50)
CPU_DEFAULTS = dict(tokens=(1, 8, 32), iters=10, warmup=2)


@dataclass(frozen=True)
class LowLatencyBenchConfig:
    """What ``run_lowlatency_bench`` measures; None fields take the device's default
    (``GPU_DEFAULTS`` / ``CPU_DEFAULTS``, :meth:`for_device`)."""

    world_size: int = 2
    shape: str = "deepseek-v3"
    hidden: int | None = None  # default: the shape's
    top_k: int | None = None
    num_experts: int | None = None
    peer_experts: int = 32  # E for the all_to_all_vdev_2d comparison (<= 16 per rank)
    tokens: tuple[int, ...] | None = None
    online_fp8: bool = True
    methods: tuple[str, ...] = METHODS
    iters: int | None = None
    warmup: int | None = None
    routings: int = 32  # random routings cycled through
    bandwidth_mb: int = 256  # size of the peer copy that measures the bandwidth
    trace_dir: str | None = None  # write Perfetto traces of a profiled run here
    seed: int = 0
    combine_order: str = "slot"  # slot, rank, or both (timed in one run)
    recv_capacity: int | None = None  # also time the layer with this bounded receive buffer

    def __post_init__(self) -> None:
        for name in ("world_size", "iters", "routings", "bandwidth_mb", "peer_experts"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.warmup is not None and (isinstance(self.warmup, bool) or not isinstance(self.warmup, int)
                                        or self.warmup < 0):
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")
        if self.tokens is not None and (not self.tokens or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in self.tokens)):
            raise ValueError(f"tokens must be ints >= 1, got {self.tokens!r}")
        for name in ("hidden", "top_k", "num_experts"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        unknown = set(self.methods) - set(METHODS)
        if unknown or not self.methods:
            raise ValueError(f"methods must be among {list(METHODS)}, got {list(self.methods)}")
        if self.combine_order not in COMBINE_ORDER_CHOICES:
            raise ValueError(f"combine_order must be one of {list(COMBINE_ORDER_CHOICES)}, got {self.combine_order!r}")
        if self.recv_capacity is not None and (isinstance(self.recv_capacity, bool)
                                               or not isinstance(self.recv_capacity, int) or self.recv_capacity < 1):
            raise ValueError(f"recv_capacity must be None or an int >= 1, got {self.recv_capacity!r}")
        get_shape(self.shape)  # raises for an unknown shape

    @property
    def orders(self) -> tuple[str, ...]:
        return ("slot", "rank") if self.combine_order == "both" else (self.combine_order,)

    def for_device(self, on_gpu: bool) -> "LowLatencyBenchConfig":
        """A copy with the unset points and counts taken from the device's defaults."""
        defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    @property
    def max_m(self) -> int:
        return max(self.tokens)

    @property
    def shape_label(self) -> str:
        """The preset's name, or what the shape is when its sizes were changed."""
        changed = [n for n in ("hidden", "top_k", "num_experts") if getattr(self, n) is not None]
        return self.shape if not changed else f"{self.shape} with {', '.join(changed)} changed"

    def resolved(self) -> tuple[int, int, int]:
        """(hidden, top_k, num_experts)."""
        s = get_shape(self.shape)
        return self.hidden or s.hidden, self.top_k or s.top_k, self.num_experts or s.num_experts


# ------------------------------------------------------------------------------ per rank


class _Bank:
    """Fixed input buffers and a bank of routings written into them before each iteration."""

    def __init__(self, T: int, H: int, K: int, E: int, routings: int, seed: int, device, dtype=torch.bfloat16):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.x = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
        self.ids_bank = torch.rand(routings, T, E, generator=g).argsort(dim=2)[..., :K].to(device)
        w = torch.rand(routings, T, K, generator=g) + 0.05
        self.w_bank = (w / w.sum(-1, keepdim=True)).to(device)
        self.ids = self.ids_bank[0].clone()
        self.w = self.w_bank[0].clone()

    def write(self, i: int) -> None:
        self.ids.copy_(self.ids_bank[i % self.ids_bank.shape[0]])
        self.w.copy_(self.w_bank[i % self.w_bank.shape[0]])


# On a GPU the timed iterations are queued ahead of the GPU (moekit.bench.timing.queue_timed)
# behind a sleep of this many µs per iteration: enough for the host to queue a step's
# launches, the routing copy included, before the GPU reaches them.
QUEUE_AHEAD_US = 160.0


def _time_calls(fns, bank: _Bank, iters: int, warmup: int, on_cuda: bool) -> list[list[float]]:
    """Per iteration: write the next routing, then time each of ``fns`` back to back (one event
    between two calls). Returns, per fn, the slowest rank's µs per iteration, and last the
    slowest rank's sum over the fns.

    Steady state, as in a serving loop: the ranks are aligned before the warm-up and again
    before the timed loop, then run step after step without a barrier; the waits inside the
    layer keep them in lockstep. (Aligning before every iteration instead adds the barrier's
    exit skew between ranks, tens of µs on the device VM, to every dispatch.)

    On a GPU the iterations are queued ahead (``queue_timed``): the device VM's host needs
    ~10 µs per launch, more than a small step takes on the GPU, and an event recorded before
    a launch the host has not made yet would time the host. A method that syncs with the host
    inside its call (the eager all-to-all) is timed as before: the sleep only delays it."""
    align = rank_aligner(None, on_cuda)
    written = [0]

    def next_routing() -> None:
        bank.write(written[0])
        written[0] += 1

    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    align()
    samples = queue_timed(fns, iters=iters, warmup=warmup, device=device, before_each=next_routing,
                          after_warmup=align, queue_ahead_us=QUEUE_AHEAD_US)
    stacked = gather_samples(samples(), None, on_cuda)  # [rank, fn, iteration]
    slowest = stacked.amax(0)
    total = stacked.sum(1).amax(0)  # the slowest rank's sum over the fns
    return [row.tolist() for row in slowest] + [total.tolist()]


def _time_pair(dispatch_fn, combine_fn, bank: _Bank, iters: int, warmup: int, on_cuda: bool) -> dict[str, list]:
    """Dispatch then combine per iteration (``_time_calls``): the slowest rank's dispatch,
    combine, and dispatch + combine."""
    d, c, total = _time_calls([dispatch_fn, combine_fn], bank, iters, warmup, on_cuda)
    return dict(dispatch=d, combine=c, total=total)


def _graphed(fn, on_cuda: bool):
    """A CUDA graph's replay on a GPU (captured now), ``fn`` itself on the CPU."""
    if not on_cuda:
        return fn
    graph = capture_graph(fn)
    return graph.replay


def _routing_bytes(ids: torch.Tensor, rank: int, E: int, P: int, dispatch_row: int, combine_row: int,
                   dedup: bool, combine_dedup: bool = False) -> tuple[float, float]:
    """Mean bytes this rank sends to other ranks per step (dispatch, combine) over the bank.

    ``dedup``: dispatch sends one copy per (token, remote rank), else one per remote slot;
    ``combine_dedup``: combine returns one row per (token, remote rank) (the rank order),
    else one per remote slot. (Combine's rows go to the token's rank; by symmetry of the
    random routing this rank's own tokens stand in for what it returns.)"""
    owner = torch.div(ids, E // P, rounding_mode="floor")  # [R, T, K]
    remote = owner != rank
    hit = torch.zeros(*owner.shape[:2], P, dtype=torch.bool, device=ids.device).scatter_(2, owner, True)
    hit[..., rank] = False
    per_rank = hit.sum((1, 2)).double()
    slots = remote.sum((1, 2)).double()
    copies = per_rank if dedup else slots
    returned = per_rank if combine_dedup else slots
    return float((copies * dispatch_row).mean()), float((returned * combine_row).mean())


def series_name(method: str, order: str, recv_capacity: int | None = None) -> str:
    """``lowlatency``, ``lowlatency[rank]``, ``lowlatency[C=4]``, ``lowlatency[rank, C=4]``, ..."""
    tags = ([order] if order != "slot" else []) + ([f"C={recv_capacity}"] if recv_capacity is not None else [])
    return method + (f"[{', '.join(tags)}]" if tags else "")


def _bench_main(rank: int, world_size: int, cfg: LowLatencyBenchConfig, run_peer_e: bool) -> dict:
    """lowlatency (E and, for the vdev2d ratio, peer E) and alltoall, every T."""
    device = current_device()
    on_cuda = device.type == "cuda"
    H, K, E = cfg.resolved()
    P = world_size
    out: dict = {"samples": {}, "bytes": {}, "checks": {}, "skipped": {}}
    layers = {}  # series name: (E, combine order, receive capacity)
    if "lowlatency" in cfg.methods:
        for order in cfg.orders:
            for capacity in (None, cfg.recv_capacity) if cfg.recv_capacity is not None else (None,):
                layers[series_name("lowlatency", order, capacity)] = (E, order, capacity)
        if run_peer_e:
            layers[f"lowlatency@{cfg.peer_experts}"] = (cfg.peer_experts, "slot", None)
    for T in cfg.tokens:
        for name, (E_m, order, capacity) in layers.items():
            _progress(rank, f"{name} T={T}: {cfg.iters} iterations after {cfg.warmup} warm-up")
            layer = EPLowLatencyAllToAll(cfg.max_m, H, K, E_m, online_fp8=cfg.online_fp8, dtype=torch.bfloat16,
                                         combine_order=order,
                                         recv_capacity=None if capacity is None else min(capacity, cfg.max_m))
            bank = _Bank(T, H, K, E_m, cfg.routings, cfg.seed * 1000 + rank, device)
            expert_out = torch.randn(layer.experts_per_rank, layer.capacity, H, device=device).to(torch.bfloat16)
            held = {}

            def d(layer=layer, bank=bank, held=held):
                held["d"] = layer.dispatch(bank.x, bank.ids, bank.w)

            def c(layer=layer, expert_out=expert_out, held=held):
                # The captured combine is replayed in alternation with the captured dispatch:
                # it needs no synchronization with the peers against a second combine in a row
                # (the eager warm-ups before the capture do come in a row, and keep it).
                capturing = on_cuda and torch.cuda.is_current_stream_capturing()
                held["y"] = layer.combine(expert_out, held["d"], follows_dispatch=True if capturing else None)

            d_run = _graphed(d, on_cuda)
            d_run()  # the captured dispatch's outputs are real before combine is captured on them
            c_run = _graphed(c, on_cuda)
            samples = _time_pair(d_run, c_run, bank, cfg.iters, cfg.warmup, on_cuda)

            def step(layer=layer, bank=bank, held=held, expert_out=expert_out):
                held["y"] = layer.combine(expert_out, layer.dispatch(bank.x, bank.ids, bank.w))

            # The step as a serving engine runs it: dispatch and combine in one graph (one
            # graph launch instead of two; on the CPU the same as the pair).
            samples["step"] = _time_calls([_graphed(step, on_cuda)], bank, cfg.iters, cfg.warmup, on_cuda)[0]
            out["samples"].setdefault(name, {})[T] = samples
            token_bytes, row_bytes = layer.layout.token_bytes, layer.layout.combine_row_bytes
            routing_row = K * 4 * (2 if order == "rank" else 1)  # ids, and the weights in the rank order
            out["bytes"].setdefault(name, {})[T] = _routing_bytes(bank.ids_bank, rank, E_m, P,
                                                                  token_bytes + routing_row, row_bytes, dedup=True,
                                                                  combine_dedup=order == "rank")
            if not name.startswith("lowlatency@"):
                out["checks"].setdefault(name, {})[T] = _count_check(layer, bank, E_m)
            layer.finalize()
            del layer, expert_out, held
        if "alltoall" in cfg.methods:
            for order in cfg.orders:
                name = series_name("alltoall", order)
                _progress(rank, f"{name} T={T}: {cfg.iters} iterations after {cfg.warmup} warm-up")
                eager = AllToAllDispatcher(E, hidden=H, top_k=K, combine_order=order)
                bank = _Bank(T, H, K, E, cfg.routings, cfg.seed * 1000 + rank, device)
                held = {}

                def d(eager=eager, bank=bank, held=held):
                    held["d"] = eager.dispatch(bank.x, bank.ids, bank.w)

                def c(eager=eager, held=held):
                    held["y"] = eager.combine(held["d"].tokens, held["d"])  # identity experts

                out["samples"].setdefault(name, {})[T] = _time_pair(d, c, bank, cfg.iters, cfg.warmup, on_cuda)
                out["bytes"].setdefault(name, {})[T] = _routing_bytes(
                    bank.ids_bank, rank, E, P, 2 * H + (4 if order == "rank" else 0), 2 * H, dedup=False,
                    combine_dedup=order == "rank")
    if cfg.trace_dir and "lowlatency" in cfg.methods:
        out["profile"] = _profiled_run(rank, cfg, device, H, K, E)
    out["device"] = str(device)
    return out


def _count_check(layer, bank: _Bank, E: int) -> bool:
    """The layer's per-expert counts for the last routing equal a direct count (all ranks' ids)."""
    d = layer.dispatch(bank.x, bank.ids, bank.w)
    gathered = [torch.empty_like(bank.ids) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, bank.ids.contiguous())
    want = torch.bincount(torch.cat(gathered).reshape(-1), minlength=E)
    E_loc = layer.experts_per_rank
    ok = torch.equal(d.counts.long(), want[layer.rank * E_loc:(layer.rank + 1) * E_loc])
    layer.combine(torch.zeros(E_loc, layer.capacity, bank.x.shape[1], dtype=torch.bfloat16,
                              device=bank.x.device), d)  # keep dispatch / combine paired
    return bool(ok)


PROFILED_STEPS = 200


def _profiled_run(rank: int, cfg: LowLatencyBenchConfig, device, H: int, K: int, E: int,
                  tokens: int | None = None) -> dict:
    """Profiled steps at T = ``tokens`` (default min(128, max_m)): Perfetto traces into
    ``trace_dir`` and the median of each phase and of the gaps between phases (µs).

    On a GPU the step (dispatch + combine) runs as the timed runs do, as a CUDA graph replayed
    with the ranks in step, and the stamps of each replay are kept
    (``EPLowLatencyAllToAll.snapshot_stamps``); on the CPU the steps run eagerly. The first
    tenth of the steps are warm-up and left out of the medians."""
    T = min(GOAL_TOKENS, cfg.max_m) if tokens is None else tokens
    on_cuda = device.type == "cuda"
    layer = EPLowLatencyAllToAll(cfg.max_m, H, K, E, online_fp8=cfg.online_fp8, dtype=torch.bfloat16, profile=True)
    bank = _Bank(T, H, K, E, cfg.routings, cfg.seed * 1000 + rank, device)
    expert_out = torch.randn(layer.experts_per_rank, layer.capacity, H, device=device).to(torch.bfloat16)
    held = {}

    def step():
        held["y"] = layer.combine(expert_out, layer.dispatch(bank.x, bank.ids, bank.w))

    steps = PROFILED_STEPS if on_cuda else 20
    run = _graphed(step, on_cuda)
    layer.clear_stamps()  # the warm-up and capture calls
    dist.barrier()
    for i in range(steps):
        bank.write(i)
        run()
        if on_cuda:
            torch.cuda.synchronize()
            layer.snapshot_stamps()
    dist.barrier()
    paths = [layer.dump_dispatch_trace(Path(cfg.trace_dir) / f"ll_dispatch_RANK_{rank}.json"),
             layer.dump_combine_trace(Path(cfg.trace_dir) / f"ll_combine_RANK_{rank}.json")]
    layer.finalize()
    return dict(traces=[str(p) for p in paths], phases=phase_summary(paths[0], paths[1], skip=steps // 10),
                tokens=T, graph=on_cuda)


def phase_summary(dispatch_trace: str | Path, combine_trace: str | Path, skip: int = 0) -> dict:
    """Median µs of each phase, of the gap before it (from the previous phase's end, the
    first combine phase counting from dispatch's last), and of the step (dispatch's first
    start to combine's last end), over the calls of two traces of one rank, the first
    ``skip`` calls left out."""
    calls: dict[int, list] = {}
    for path in (dispatch_trace, combine_trace):
        for e in load_trace(path)["traceEvents"]:
            if e["ph"] == "X" and e["args"]["call"] >= skip:
                calls.setdefault(e["args"]["call"], []).append((e["cat"], e["name"], e["ts"], e["ts"] + e["dur"]))
    per_phase: dict[str, list[float]] = {}
    spans = []
    for events in calls.values():
        events.sort(key=lambda ev: (ev[0] != "dispatch", ev[2]))
        prev_end = None
        for cat, name, start, end in events:
            per_phase.setdefault(f"{cat}.{name}", []).append(end - start)
            if prev_end is not None:
                per_phase.setdefault(f"gap before {cat}.{name}", []).append(start - prev_end)
            prev_end = end
        spans.append(max(ev[3] for ev in events) - min(ev[2] for ev in events))
    out = {k: statistics.median(v) for k, v in per_phase.items()}
    out["step"] = statistics.median(spans) if spans else None
    out["calls"] = len(calls)
    return out


def vdev2d_available() -> str | None:
    """None if ``all_to_all_vdev_2d`` can run here, else why not."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs 2 CUDA GPUs"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as error:
        return f"no torch.distributed._symmetric_memory: {error}"
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d"):
        return "torch.ops.symm_mem.all_to_all_vdev_2d is missing in this torch"
    if hasattr(symm_mem, "is_nvshmem_available") and not symm_mem.is_nvshmem_available():
        return "NVSHMEM is not available"
    return None


def _bench_vdev2d(rank: int, world_size: int, cfg: LowLatencyBenchConfig) -> dict:
    """``all_to_all_vdev_2d`` dispatch and ``all_to_all_vdev_2d_offset`` combine, eager, every T."""
    import torch.distributed._symmetric_memory as symm_mem

    device = current_device()
    symm_mem.set_backend("NVSHMEM")
    group_name = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group_name)
    H, K, _ = cfg.resolved()
    E, P = cfg.peer_experts, world_size
    nsplits = E  # (destination rank, local expert), rank-major
    max_in = cfg.max_m * K
    max_out = max_in * P

    def symm(shape, dtype):
        t = symm_mem.empty(shape, dtype=dtype, device=device)
        symm_mem.rendezvous(t, group=group_name)
        return t

    inp, back = symm((max_in, H), torch.bfloat16), symm((max_in, H), torch.bfloat16)
    out = symm((max_out, H), torch.bfloat16)
    in_splits = symm((nsplits,), torch.int64)
    out_so, back_so = symm((2, nsplits), torch.int64), symm((2, nsplits), torch.int64)
    dist.barrier()
    result: dict = {"samples": {}, "bytes": {}, "checks": {}}
    for T in cfg.tokens:
        _progress(rank, f"vdev2d T={T}")
        bank = _Bank(T, H, K, E, cfg.routings, cfg.seed * 1000 + rank, device)
        held = {}

        def d(bank=bank, held=held, T=T):
            order = torch.argsort(bank.ids.reshape(-1), stable=True)  # by (rank, local expert): rank-major
            held["order"] = order
            in_splits.zero_().scatter_add_(0, bank.ids.reshape(-1), torch.ones_like(order))
            torch.index_select(bank.x, 0, torch.div(order, K, rounding_mode="floor"), out=inp[:T * K])
            torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, in_splits, out_so, group_name)

        def c(bank=bank, held=held, T=T):  # identity experts: send the received rows back
            torch.ops.symm_mem.all_to_all_vdev_2d_offset(out, back, out_so, back_so, group_name)
            slots = torch.empty(T * K, H, dtype=torch.bfloat16, device=device)
            slots[held["order"]] = back[:T * K]
            held["y"] = weighted_slot_sum(slots.view(T, K, H), bank.ids, bank.w, torch.bfloat16)

        result["samples"][T] = _time_pair(d, c, bank, cfg.iters, cfg.warmup, True)
        d()
        c()
        want = weighted_slot_sum(bank.x.unsqueeze(1).expand(T, K, H), bank.ids, bank.w, torch.bfloat16)
        result["checks"][T] = bool(torch.equal(held["y"], want))
        result["bytes"][T] = _routing_bytes(bank.ids_bank, rank, E, P, 2 * H, 2 * H, dedup=False)
    dist.barrier()
    return result


def _progress(rank: int, what: str) -> None:
    if rank == 0:
        print(f"[bench lowlatency] {what}", file=sys.stderr, flush=True)


def measure_peer_bandwidth(mb: int) -> float | None:
    """GB/s of a copy-engine copy GPU 0 -> GPU 1 (median of 10), None without 2 GPUs."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    n = mb * 2**20
    src = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    times = []
    with torch.cuda.device(0):
        dst.copy_(src)
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return n / float(np.median(times)) / 1e9


# --------------------------------------------------------------------------------- driver


def run_lowlatency_bench(cfg: LowLatencyBenchConfig, *, out_dir: str | None = DEFAULT_OUT_DIR,
                         figures: bool = True) -> dict:
    """Run every method on ``cfg.world_size`` local ranks; write and return the record."""
    backend = default_backend(cfg.world_size)
    cfg = cfg.for_device(backend == "nccl")
    H, K, E = cfg.resolved()
    for name, value in (("num_experts", E), ("peer_experts", cfg.peer_experts)):
        if value % cfg.world_size:
            raise ValueError(f"{name}={value} must be a multiple of world_size={cfg.world_size}")
    bandwidth = measure_peer_bandwidth(cfg.bandwidth_mb) if backend == "nccl" else None
    vdev2d_skip = None
    if "vdev2d" in cfg.methods:
        vdev2d_skip = vdev2d_available() if backend == "nccl" else "needs 2 CUDA GPUs (NCCL)"
        if vdev2d_skip is None and cfg.peer_experts // cfg.world_size > 16:
            vdev2d_skip = f"peer_experts / world_size = {cfg.peer_experts // cfg.world_size} > 16 experts per rank"
    run_vdev2d = "vdev2d" in cfg.methods and vdev2d_skip is None
    main = launch(_bench_main, cfg.world_size, cfg, run_vdev2d, backend=backend)
    peer = launch(_bench_vdev2d, cfg.world_size, cfg, backend=backend) if run_vdev2d else None
    results = _results(cfg, main, peer, bandwidth, E, vdev2d_skip)
    params = asdict(cfg) | dict(
        shape_label=cfg.shape_label, hidden=H, top_k=K, num_experts=E, max_m=cfg.max_m, backend=backend,
        device=main[0]["device"],
        cuda_graphs=backend == "nccl", dtype="bfloat16", wire="fp8 e4m3 + float32 scales" if cfg.online_fp8 else
        "bfloat16", timing="slowest rank per iteration; ranks aligned once before the timed loop, then steady state "
                           "(GPU: iterations queued ahead in chunks); dispatch and combine timed back to back in "
                           "one iteration (two graphs), and the layer's step (both in one graph) in its own loop; "
                           "routing written outside the timed region",
        peer_bandwidth_gbps=bandwidth, combine_orders=list(cfg.orders))
    record = {"params": params, "results": results}
    if out_dir is not None:
        path = write_record("lowlatency", params, results, out_dir=out_dir)
        record["path"] = str(path)
        if figures:
            try:
                record["figures"] = [str(draw_lowlatency_figure(record, path.with_suffix(".png")))]
            except ImportError as error:  # matplotlib is optional
                record["figures"] = f"not drawn: {error}"
    return record


def _results(cfg, main: list[dict], peer: list[dict] | None, bandwidth: float | None, E: int,
             vdev2d_skip: str | None) -> dict:
    samples = main[0]["samples"]
    series: dict = {m: {str(T): {s: summarize(x) for s, x in v.items()} for T, v in by_t.items()}
                    for m, by_t in samples.items()}
    byte_sources = {m: [r["bytes"][m] for r in main] for m in main[0]["bytes"]}
    if peer is not None:
        series["vdev2d"] = {str(T): {s: summarize(v[s]) for s in SERIES} for T, v in peer[0]["samples"].items()}
        byte_sources["vdev2d"] = [r["bytes"] for r in peer]
    floor = {}
    for m, per_rank in byte_sources.items():
        floor[m] = {}
        for T in cfg.tokens:
            d_bytes = max(b[T][0] for b in per_rank)  # the rank with the most to send bounds the step
            c_bytes = max(b[T][1] for b in per_rank)
            entry = dict(dispatch_bytes=d_bytes, combine_bytes=c_bytes)
            if bandwidth:
                entry |= dict(dispatch_us=d_bytes / (bandwidth * 1e3), combine_us=c_bytes / (bandwidth * 1e3),
                              total_us=(d_bytes + c_bytes) / (bandwidth * 1e3))
            floor[m][str(T)] = entry
    ratios = {}
    pairs = [("alltoall", "lowlatency"), ("vdev2d", f"lowlatency@{cfg.peer_experts}"),
             ("alltoall[rank]", "lowlatency[rank]"), ("lowlatency", "lowlatency[rank]"),
             ("alltoall", "alltoall[rank]")]
    if cfg.recv_capacity is not None:
        pairs += [(series_name("lowlatency", o), series_name("lowlatency", o, cfg.recv_capacity)) for o in cfg.orders]
    for T in map(str, cfg.tokens):
        ratios[T] = {f"{a}/{b}": series[a][T]["total"]["median"] / series[b][T]["total"]["median"]
                     for a, b in pairs if a in series and b in series}
    goal = None
    if "lowlatency" in series and str(GOAL_TOKENS) in series["lowlatency"]:
        median = series["lowlatency"][str(GOAL_TOKENS)]["total"]["median"]
        step = series["lowlatency"][str(GOAL_TOKENS)].get("step", {}).get("median")
        goal = dict(tokens=GOAL_TOKENS, goal_us=GOAL_US, total_median_us=median, step_median_us=step,
                    met=median <= GOAL_US)
    checks = {f"{name}_counts": {str(T): all(r["checks"][name][T] for r in main) for T in by_t}
              for name, by_t in main[0]["checks"].items()}
    if peer is not None:
        checks["vdev2d_identity_round_trip"] = {str(T): all(r["checks"][T] for r in peer) for T in peer[0]["checks"]}
    profiles = [r["profile"] for r in main if "profile" in r]
    traces = [p for prof in profiles for p in prof["traces"]]
    phases = [dict(rank=rank, tokens=prof["tokens"], graph=prof["graph"], **prof["phases"])
              for rank, prof in enumerate(profiles)]
    goals = {}  # the same goal line for every variant of the layer that ran
    for name, by_t in series.items():
        if name.startswith("lowlatency") and not name.startswith("lowlatency@") and str(GOAL_TOKENS) in by_t:
            median = by_t[str(GOAL_TOKENS)]["total"]["median"]
            goals[name] = dict(tokens=GOAL_TOKENS, goal_us=GOAL_US, total_median_us=median,
                               step_median_us=by_t[str(GOAL_TOKENS)].get("step", {}).get("median"),
                               met=median <= GOAL_US)
    return dict(series=series, byte_floor=floor, ratios=ratios, goal=goal, goals=goals, checks=checks,
                vdev2d=dict(ran=peer is not None, skipped=vdev2d_skip, experts=cfg.peer_experts),
                peer_bandwidth_gbps=bandwidth, traces=traces, phases=phases, skipped=main[0]["skipped"])


# -------------------------------------------------------------------------- text, figure


def _rows(record: dict) -> list[dict]:
    r = record["results"]
    rows = []
    for m, by_t in r["series"].items():
        for T, s in by_t.items():
            f = r["byte_floor"].get(m, {}).get(T, {})
            if m.startswith("lowlatency@"):
                f = {}
            rows.append(dict(method=m, T=int(T), d_med=s["dispatch"]["median"], d_p95=s["dispatch"]["p95"],
                             d_p99=s["dispatch"]["p99"], c_med=s["combine"]["median"], c_p95=s["combine"]["p95"],
                             c_p99=s["combine"]["p99"], total_med=s["total"]["median"],
                             step_med=s["step"]["median"] if "step" in s else None,
                             floor_us=f.get("total_us"), kB=(f["dispatch_bytes"] + f["combine_bytes"]) / 1e3
                             if f else None))
    return rows


def format_lowlatency_bench(record: dict) -> str:
    p, r = record["params"], record["results"]
    lines = [
        f"Low-latency EP layer on {p['world_size']} ranks ({p['backend']}, {p['device']}, "
        f"{'CUDA graphs' if p['cuda_graphs'] else 'eager, no CUDA graphs'}); {p.get('shape_label', p['shape'])}: "
        f"H={p['hidden']} "
        f"top-{p['top_k']} E={p['num_experts']}, max_m={p['max_m']}, wire {p['wire']}; "
        f"{p['iters']} iterations per point (µs, slowest rank)",
        format_table(_rows(record), ["method", "T", "d_med", "d_p95", "d_p99", "c_med", "c_p95", "c_p99",
                                     "total_med", "step_med", "floor_us", "kB"]),
        "ratios (total medians): " + "; ".join(f"T={T}: " + ", ".join(f"{k} {v:.2f}x" for k, v in rs.items())
                                             for T, rs in r["ratios"].items() if rs),
        f"peer bandwidth: {r['peer_bandwidth_gbps']:.0f} GB/s" if r["peer_bandwidth_gbps"] else
        "peer bandwidth: not measured (no 2 GPUs): no byte floor in µs",
        "vdev2d: " + ("ran" if r["vdev2d"]["ran"] else f"skipped ({r['vdev2d']['skipped'] or 'not requested'})"),
        *[f"{name}: skipped ({why})" for name, why in r.get("skipped", {}).items()],
        "checks: " + ", ".join(f"{k} {'ok' if all(v.values()) else 'FAILED ' + str(v)}" for k, v in r["checks"].items()),
    ]
    for name, g in (r.get("goals") or ({"lowlatency": r["goal"]} if r["goal"] else {})).items():
        step = f"; as one graph {g['step_median_us']:.1f} µs" if g.get("step_median_us") is not None else ""
        lines.append(f"goal ({name}): dispatch + combine at {g['tokens']} tokens/rank = {g['total_median_us']:.1f} µs "
                     f"(goal <= {g['goal_us']:.0f} µs on 2xH200): {'met' if g['met'] else 'not met'}{step}")
    for ph in r.get("phases", []):
        parts = ", ".join(f"{k} {v:.1f}" for k, v in ph.items()
                          if k not in ("rank", "tokens", "graph", "calls", "step") and v is not None)
        lines.append(f"profile rank {ph['rank']} (T={ph['tokens']}, {'graph replay' if ph['graph'] else 'eager'}, "
                     f"median of {ph['calls']} steps, µs): step {ph['step']:.1f}; {parts}")
    if r["traces"]:
        lines.append("traces: " + ", ".join(r["traces"]))
    if "path" in record:
        lines.append(f"record: {record['path']}")
    if isinstance(record.get("figures"), list):
        lines.append("figure: " + ", ".join(record["figures"]))
    return "\n".join(lines)


def draw_lowlatency_figure(record: dict, path: str | Path) -> Path:
    """Median dispatch / combine latency against tokens per rank, one line per method, floor dashed."""
    r = record["results"]
    fig, axes = new_figure(1, 2, figsize=(11, 4))
    for ax, s in zip(axes, ("dispatch", "combine")):
        for m, by_t in r["series"].items():
            Ts = sorted(int(t) for t in by_t)
            ax.plot(Ts, [by_t[str(t)][s]["median"] for t in Ts], marker="o", label=m)
        for m, by_t in r["byte_floor"].items():
            Ts = sorted(int(t) for t in by_t)
            if all(f"{s}_us" in by_t[str(t)] for t in Ts):
                ax.plot(Ts, [by_t[str(t)][f"{s}_us"] for t in Ts], linestyle="--", label=f"byte floor ({m})")
        ax.set(xscale="log", yscale="log", xlabel="tokens per rank", ylabel="µs (median)", title=s)
        ticks = sorted({int(t) for by_t in r["series"].values() for t in by_t})
        ax.set_xticks(ticks, labels=[str(t) for t in ticks], minor=False)
        ax.xaxis.set_minor_locator(matplotlib_null_locator())
        ax.legend(fontsize=7)
    p = record["params"]
    fig.suptitle(f"{p.get('shape_label', p['shape'])} (H={p['hidden']}, top-{p['top_k']}, E={p['num_experts']}) "
                 f"on {p['world_size']} "
                 f"ranks ({p['device']})")
    return save_figure(fig, path)


def matplotlib_null_locator():
    from matplotlib.ticker import NullLocator

    return NullLocator()


# ---------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    from moekit.shapes import PRESETS

    p = argparse.ArgumentParser(prog="moekit bench lowlatency", description=__doc__.split("\n")[0])
    d = LowLatencyBenchConfig()

    def by_device(name: str) -> str:
        gpu, cpu = GPU_DEFAULTS[name], CPU_DEFAULTS[name]
        if isinstance(gpu, tuple):
            gpu, cpu = " ".join(map(str, gpu)), " ".join(map(str, cpu))
        return f"(default: {gpu} on GPUs, {cpu} on the CPU)"

    p.add_argument("--world-size", type=int, default=d.world_size,
                   help="local ranks, >= 1, dividing the experts (default %(default)s)")
    p.add_argument("--shape", default=d.shape, choices=sorted(PRESETS), metavar="SHAPE",
                   help="model shape preset: %(choices)s (default %(default)s)")
    p.add_argument("--hidden", type=int, default=None, help="replace the shape's hidden size H, >= 1")
    p.add_argument("--top-k", type=int, default=None, help="replace the shape's experts per token K, >= 1")
    p.add_argument("--num-experts", type=int, default=None,
                   help="replace the shape's expert count E, >= 1, a multiple of --world-size")
    p.add_argument("--peer-experts", type=int, default=d.peer_experts,
                   help="E for the all_to_all_vdev_2d comparison, at most 16 per rank (default %(default)s)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help=f"tokens per rank, each >= 1 {by_device('tokens')}")
    p.add_argument("--bf16-wire", action="store_true", help="send bf16 instead of online FP8")
    p.add_argument("--methods", nargs="+", default=list(d.methods), choices=METHODS,
                   help="what to time: %(choices)s (default: all)")
    p.add_argument("--iters", type=int, default=None, help=f"timed iterations per point, >= 1 {by_device('iters')}")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed iterations first, >= 0 {by_device('warmup')}")
    p.add_argument("--routings", type=int, default=d.routings,
                   help="random routings cycled through, >= 1 (default %(default)s)")
    p.add_argument("--bandwidth-mb", type=int, default=d.bandwidth_mb,
                   help="MB of the GPU 0 -> GPU 1 copy that measures the peer bandwidth, >= 1 (default %(default)s)")
    p.add_argument("--combine-order", default=d.combine_order, choices=COMBINE_ORDER_CHOICES,
                   help="combine order of the layer and the all-to-all: slot, rank, or both in one run "
                        "(default %(default)s)")
    p.add_argument("--recv-capacity", type=int, default=None,
                   help="also time the layer with a receive buffer of this many rows per source, >= 1 "
                        "(tokens past it spill)")
    p.add_argument("--trace-dir", default=None, help="write Perfetto traces of a profiled run here")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the inputs and routings, >= 0 (default %(default)s)")
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                   help="where the JSON record and figure go (default %(default)s)")
    p.add_argument("--no-record", action="store_true", help="write no record or figure")
    b = p.add_argument_group("buffer report (--buffers: nothing is timed)")
    b.add_argument("--buffers", action="store_true",
                   help="print the layer's memory per rank, worst case against a bounded receive buffer, and "
                        "the spill on traces, instead of timing")
    b.add_argument("--buffer-shapes", nargs="+", default=list(DEFAULT_BUFFER_SHAPES), metavar="SHAPE",
                   help="presets of the synthetic rows (default: %(default)s)")
    b.add_argument("--eps", type=int, nargs="+", default=list(DEFAULT_BUFFER_EPS),
                   help="expert-parallel sizes, each >= 1 (default: %(default)s)")
    b.add_argument("--quantile", type=float, default=0.99,
                   help="the capacity: this quantile of the per-(source, destination) token counts, in (0, 1] "
                        "(default %(default)s)")
    b.add_argument("--max-m", type=int, default=128,
                   help="tokens per rank of the synthetic rows, >= 1 (default %(default)s)")
    b.add_argument("--buffer-beta", type=float, default=DEFAULT_BUFFER_BETA,
                   help="balancedness of the synthetic routing in (0, 1]; 1 = uniform (default %(default)s: that of "
                        "the recorded OLMoE-architecture prefill trace)")
    b.add_argument("--buffer-steps", type=int, default=16,
                   help="synthetic steps per row, >= 2 (capacity from the first half; default %(default)s)")
    b.add_argument("--trace", action="append", default=[], metavar="FILE=SHAPE",
                   help="a routing trace (.npz) and the preset whose hidden size it takes, repeatable")
    b.add_argument("--mixtral-steps", type=int, default=200,
                   help="steps of the synthetic Mixtral trace (moekit trace generate) to add, 0 for none "
                        "(default %(default)s)")
    m = p.add_argument_group("memory report (--memory: nothing is timed)")
    m.add_argument("--memory", action="store_true",
                   help="print the bytes per rank the model's low-latency layers allocate with a buffer per layer "
                        "and with the one shared buffer (moekit.ep.lowlatency.pool), instead of timing; uses "
                        "--shape, --world-size, --hidden, --top-k, --num-experts, --bf16-wire, --combine-order, "
                        "--recv-capacity")
    m.add_argument("--layers", type=int, default=None,
                   help="low-latency layers of the model, >= 1 (default: the shape's MoE layers)")
    m.add_argument("--memory-max-m", type=int, nargs="+", default=[128],
                   help="tokens per rank per call (the layers' max_m), each >= 1 (default %(default)s)")
    m.add_argument("--slots", type=int, default=1,
                   help="shared buffers (one per stream that runs exchanges at the same time), >= 1 "
                        "(default %(default)s)")
    return p


def run_memory_report(args) -> dict:
    """The ``--memory`` report: per ``max_m``, the bytes per rank of ``--layers`` layers at the
    shape, a buffer each against one shared buffer per slot (:func:`moekit.ep.lowlatency.pool.buffer_report`)."""
    from moekit.ep.lowlatency.layout import LowLatencyLayout
    from moekit.ep.lowlatency.pool import buffer_report

    s = get_shape(args.shape)
    layers = args.layers if args.layers is not None else s.num_layers
    for flag, values in (("--layers", [layers]), ("--memory-max-m", args.memory_max_m), ("--slots", [args.slots]),
                         ("--world-size", [args.world_size])):
        if any(not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{flag} must be >= 1, got {values}")
    H = args.hidden or s.hidden
    K = args.top_k or s.top_k
    E = args.num_experts or s.num_experts
    order = "slot" if args.combine_order == "both" else args.combine_order
    rows, lines = [], []
    gib = 2 ** 30
    lines.append(f"{'shape':<16} {'EP':>3} {'max_m':>6} {'layers':>6} {'slots':>5} {'symm/layer GiB':>15} "
                 f"{'shared symm GiB':>16} {'local GiB':>10} {'before GiB':>11} {'after GiB':>10}")
    for max_m in args.memory_max_m:
        cap = args.recv_capacity if args.recv_capacity is not None and args.recv_capacity < max_m else None
        layout = LowLatencyLayout(max_m=max_m, hidden=H, topk=K, num_experts=E, rank=0, world_size=args.world_size,
                                  local_world_size=args.world_size, dtype=torch.bfloat16,
                                  online_fp8=not args.bf16_wire, combine_order=order, recv_capacity=cap)
        report = buffer_report([layout] * layers, slots=args.slots)
        rows.append(dict(shape=args.shape, world_size=args.world_size, max_m=max_m, hidden=H, top_k=K,
                         num_experts=E, online_fp8=not args.bf16_wire, combine_order=order, **report))
        lines.append(f"{args.shape:<16} {args.world_size:>3} {max_m:>6} {layers:>6} {args.slots:>5} "
                     f"{report['symm_per_layer'] / layers / gib:>15.3f} {report['symm_shared'] / gib:>16.3f} "
                     f"{report['local'] / gib:>10.2f} {report['per_layer'] / gib:>11.2f} "
                     f"{report['shared'] / gib:>10.2f}")
    lines.append("before: a symmetric buffer per layer + what each layer keeps (local: its expert-major result, "
                 "meta and combine output); after: one shared symmetric buffer per slot + the same local part; "
                 "the experts' output (the caller's) is not counted")
    record = {"params": dict(shape=args.shape, world_size=args.world_size, layers=layers, slots=args.slots,
                             max_m=list(args.memory_max_m), device="cpu (computed, nothing allocated)"),
              "results": {"rows": rows}, "text": "\n".join(lines)}
    if not args.no_record:
        record["path"] = str(write_record("lowlatency-memory", record["params"], record["results"],
                                          out_dir=args.out_dir))
    return record


def config_from_args(args) -> LowLatencyBenchConfig:
    return LowLatencyBenchConfig(
        world_size=args.world_size, shape=args.shape, hidden=args.hidden, top_k=args.top_k,
        num_experts=args.num_experts, peer_experts=args.peer_experts,
        tokens=tuple(args.tokens) if args.tokens is not None else None,
        online_fp8=not args.bf16_wire, methods=tuple(args.methods), iters=args.iters, warmup=args.warmup,
        routings=args.routings, bandwidth_mb=args.bandwidth_mb, trace_dir=args.trace_dir, seed=args.seed,
        combine_order=args.combine_order, recv_capacity=args.recv_capacity)


def run_buffer_report(args) -> dict:
    """The ``--buffers`` report: rows for the presets on synthetic routing and for each trace."""
    from moekit.ep.lowlatency.buffers import format_report, shape_report, trace_report
    from moekit.routing import RoutingTrace, mixtral_capspill_trace

    for flag, values, low in (("--eps", args.eps, 1), ("--max-m", [args.max_m], 1),
                              ("--buffer-steps", [args.buffer_steps], 2), ("--mixtral-steps", [args.mixtral_steps], 0)):
        if any(v < low for v in values):
            raise ValueError(f"{flag} must be >= {low}, got {values}")
    if not 0.0 < args.quantile <= 1.0:
        raise ValueError(f"--quantile must be in (0, 1], got {args.quantile}")
    if not 0.0 < args.buffer_beta <= 1.0:
        raise ValueError(f"--buffer-beta must be in (0, 1], got {args.buffer_beta}")
    traces = []
    for item in args.trace:
        path, sep, shape = item.rpartition("=")
        if not sep or not path:
            raise ValueError(f"--trace takes FILE=SHAPE, got {item!r}")
        get_shape(shape)
        traces.append((RoutingTrace.load(path), f"{Path(path).name} (recorded)", shape))
    if args.mixtral_steps:
        traces.append((mixtral_capspill_trace(steps=args.mixtral_steps, layers=8), "Mixtral (trace generate)",
                       "mixtral-8x7b"))

    def progress(what: str) -> None:
        print(f"[bench lowlatency --buffers] {what}", file=sys.stderr, flush=True)

    rows = []
    for shape in args.buffer_shapes:
        rows += shape_report(shape, eps=tuple(args.eps), max_m=args.max_m, quantile=args.quantile,
                             steps=args.buffer_steps, beta=args.buffer_beta, seed=args.seed, progress=progress)
    for trace, label, shape in traces:
        rows += trace_report(trace, label, shape, eps=tuple(args.eps), quantile=args.quantile, progress=progress)
    record = {"params": dict(quantile=args.quantile, eps=list(args.eps), max_m=args.max_m, beta=args.buffer_beta,
                             buffer_steps=args.buffer_steps, shapes=list(args.buffer_shapes),
                             traces=[label for _, label, _ in traces], device="cpu (computed, nothing timed)"),
              "results": {"rows": rows}, "text": format_report(rows)}
    if not args.no_record:
        record["path"] = str(write_record("lowlatency-buffers", record["params"], record["results"],
                                          out_dir=args.out_dir))
    return record


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.no_record:
        check_output_dir(args.out_dir, "--out-dir")
    if args.memory:
        record = run_memory_report(args)
        print(record["text"] + (f"\nrecord: {record['path']}" if "path" in record else ""))
        return 0
    if args.buffers:
        record = run_buffer_report(args)
        print(record["text"] + (f"\nrecord: {record['path']}" if "path" in record else ""))
        return 0
    record = run_lowlatency_bench(config_from_args(args), out_dir=None if args.no_record else args.out_dir)
    print(format_lowlatency_bench(record))
    return 0 if all(all(v.values()) for v in record["results"]["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
