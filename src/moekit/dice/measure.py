"""Measured time per denoising step of each DICE schedule on real ranks (``moekit dice step``).

Every rank runs the sampler (Euler steps, classifier-free guidance) on a DiT-MoE at a
preset's shapes with random weights, its MoE layers under a schedule over a real
dispatcher: the eager all-to-all or the low-latency layer (NCCL / symmetric memory on
GPUs, gloo on CPUs). For each (model, local batch, dispatcher, schedule) one run of
``warmup + steps + 2`` steps is timed step by step, and the ``steps`` after the first
``warmup`` are kept: the steady state. (An asynchronous schedule's first step is
synchronous, and its last ``lag`` steps, 2 at most, launch nothing since no step would use
the result: a real run of N steps has those too, once per run.)

* on a GPU, CUDA events recorded on the sampler's stream between steps (no host sync in
  between, so an asynchronous schedule's transfers still cross step boundaries as they
  would in a real run); on a CPU, wall-clock time between steps;
* per step, the slowest rank's time; then median, p95 and mean over the timed steps;
* the speedup of a schedule is sync's median over its median (and the same with means),
  at the same model, batch and dispatcher, from the same launch.

Synchronous work runs with the in-order executor (expert parallelism as usual). The
asynchronous schedules run over the stale exchange (``stale``, ``stale-graph``) with the
side-stream executor (no thread, no host read between issue and use; ``stale-graph``
replays the steady steps from CUDA graphs, :mod:`moekit.dice.graphs`), and over the
dispatchers that read sizes on the host with the worker-thread executor. The stale
exchanges of the asynchronous layers use a process group of their own (``--comm-sms``
caps its NCCL thread blocks); a capacity that overflowed in a run is rebuilt at the exact
bound and the run repeated (:meth:`_Case.run`).

The all-to-all's share of a sync step is measured in one more sync run whose dispatcher
calls are wrapped in CUDA events (wall clock on a CPU): the time the sampler's stream
spends between the start and the end of each dispatch and combine (the eager all-to-all's
host read included), over that run's step time.

Weights. The model's own routed experts are never called (the runner holds this rank's
experts), so the model is built with 2-wide stand-ins for them and each rank draws only
its E / P experts, on the device: dit-moe-g's 16 x 40 experts would not fit one GPU, a
rank's 8 x 40 do. Routing follows the random router, attention and modulation (no
adaLN-Zero), so it changes from step to step as the latent does; a trained model's
routing may change less, which helps conditional communication.

Memory. Before each run every rank agrees (an all-reduce of free memory) whether what the
run needs fits: the held results of the schedule (its peak buffer count) and a working
set estimate, and for the low-latency layer its buffers, sized for the worst case of
every row of both ranks going to one expert (``LowLatencyLayout.buffer_bytes``), one
layer per (layer, step parity) for the asynchronous layers and one shared by the
synchronous ones. What does not fit is skipped with the reason, on every rank at once.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moekit.bench.stats import summarize
from moekit.dice import accounting
from moekit.dice.dit_moe import DiTMoE, DiTMoEConfig, digits_config, get_config
from moekit.dice.executor import make_executor
from moekit.dice.overlap import trace_overlap
from moekit.dice.runner import ScheduledMoE
from moekit.dice.sampler import sample
from moekit.dice.schedules import SchedulePlan, preset

DISPATCHERS = ("alltoall", "lowlatency", "stale", "stale-graph")
STALE = ("stale", "stale-graph")  # the fixed-capacity exchange; -graph: steady steps replayed from CUDA graphs
EXECUTOR_CHOICES = ("auto", "inline", "stream", "async")
EXPERT_KINDS = ("torch", "fused")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_SCHEDULES = ("sync", "displaced", "interweaved", "dice")
GPU_DEFAULTS = dict(models=("dit-moe-xl", "dit-moe-g"), batches=(4, 8, 16, 32), steps=10, warmup=2, dtype="bf16",
                    experts="fused")
CPU_DEFAULTS = dict(models=("digits",), batches=(1, 2), steps=3, warmup=1, dtype="fp32", experts="torch")
TINY = "digits"  # the sample command's tiny model: hidden 32, 4 layers
GIB = 2 ** 30
TAIL = 2  # untimed steps at the end: an asynchronous schedule's last `lag` steps launch nothing
STAND_IN_WIDTH = 2  # width of the model's own (never called) routed experts


@dataclass(frozen=True)
class StepSpec:
    """What ``moekit dice step`` measures; every field is checked by :meth:`check`."""

    models: tuple[str, ...]
    batches: tuple[int, ...]
    dispatchers: tuple[str, ...] = DISPATCHERS
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    steps: int = 10
    warmup: int = 2
    world_size: int = 2
    device: str = "cuda"
    dtype: str = "bf16"
    experts: str = "fused"
    depth: int | None = None
    cfg: float = 1.5
    seed: int = 0
    headroom_gib: float = 4.0
    trace_dir: str | None = None
    trace_steps: int = 3
    trace_case: tuple | None = None  # (model, batch, dispatcher, schedule), set by resolve_trace_case
    executor: str = "auto"  # the asynchronous schedules' executor (auto: stream on stale, else async)
    capacity_factor: float | None = 2.0  # stale: rows per peer, times the balanced share (None: exact bound)
    comm_sms: int | None = None  # stale: NCCL thread blocks (SMs) per collective of the stale group
    trace_schedules: tuple[str, ...] | None = None  # profiled schedules (None: sync and trace_case's)
    stale_packing: str | None = None  # stale: the fixed-buffer phases' implementation (None: the dispatcher's default)

    def check(self) -> "StepSpec":
        _check_int("--world-size", self.world_size, 1)
        _check_int("--steps", self.steps, 1)
        _check_int("--warmup", self.warmup, 0)
        _check_int("--trace-steps", self.trace_steps, 1)
        if self.depth is not None:
            _check_int("--depth", self.depth, 1)
        if not self.models:
            raise ValueError("--models must name at least one model")
        for name in self.models:
            config = model_config(name, self.depth)  # unknown names raise here
            config.moe_shape.experts_per_rank(self.world_size)  # P must divide E
        if not self.batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.batches):
            raise ValueError(f"--batches must list integers >= 1, got {list(self.batches)}")
        for name in self.dispatchers:
            if name not in DISPATCHERS:
                raise ValueError(f"--dispatchers must be from {', '.join(DISPATCHERS)}, got {name!r}")
        if not self.dispatchers:
            raise ValueError(f"--dispatchers must name at least one of {', '.join(DISPATCHERS)}")
        for name in self.schedules:
            preset(name, self.total_steps).check_run(self.total_steps, 1)  # unknown names raise
        if "sync" not in self.schedules:
            raise ValueError("--schedules must include 'sync' (the baseline of every speedup)")
        if len(set(self.schedules)) != len(self.schedules):
            raise ValueError(f"--schedules lists a schedule twice: {', '.join(self.schedules)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and torch.cuda.device_count() < self.world_size:
            raise ValueError(f"--device cuda needs --world-size={self.world_size} GPUs, this machine has "
                             f"{torch.cuda.device_count()}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.experts not in EXPERT_KINDS:
            raise ValueError(f"--experts must be one of {', '.join(EXPERT_KINDS)}, got {self.experts!r}")
        if self.experts == "fused" and self.device != "cuda":
            raise ValueError("--experts fused needs --device cuda (the Triton kernel); use --experts torch")
        if not (math.isfinite(self.cfg) and self.cfg >= 1.0):
            raise ValueError(f"--cfg must be a number >= 1, got {self.cfg}")
        if self.executor not in EXECUTOR_CHOICES:
            raise ValueError(f"--executor must be one of {', '.join(EXECUTOR_CHOICES)}, got {self.executor!r}")
        if self.capacity_factor is not None and not (isinstance(self.capacity_factor, (int, float))
                                                     and math.isfinite(self.capacity_factor)
                                                     and self.capacity_factor > 0):
            raise ValueError(f"--capacity-factor must be a positive number, got {self.capacity_factor!r}")
        if self.comm_sms is not None:
            _check_int("--comm-sms", self.comm_sms, 1)
        if self.stale_packing not in (None, "auto", "torch", "triton"):
            raise ValueError(f"--stale-packing must be auto, torch or triton, got {self.stale_packing!r}")
        for name in self.trace_schedules or ():
            if name not in self.schedules:
                raise ValueError(f"--trace-schedules: {name!r} is not among --schedules ({', '.join(self.schedules)})")
        if not (math.isfinite(self.headroom_gib) and self.headroom_gib >= 0):
            raise ValueError(f"--headroom-gib must be a number >= 0, got {self.headroom_gib}")
        return self

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps + TAIL

    @property
    def timed(self) -> slice:
        """The steps of a run that are kept."""
        return slice(self.warmup, self.warmup + self.steps)


def _check_int(flag: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{flag} must be an int >= {low}, got {value!r}")


def resolve_trace_case(spec: StepSpec) -> StepSpec:
    """The one (model, batch, dispatcher) ``--trace`` profiles, every schedule of it: the
    first model, batch 8 (else the smallest), the stale exchange (else the eager
    all-to-all, else the first dispatcher); the schedule field names dice (else the first
    asynchronous one, else sync), the one the overlap verdict reads."""
    if spec.trace_dir is None:
        return spec
    batch = 8 if 8 in spec.batches else min(spec.batches)
    dispatcher = next(d for d in ("stale", "stale-graph", "alltoall", *spec.dispatchers) if d in spec.dispatchers)
    asynchronous = [s for s in spec.schedules if s != "sync"]
    schedule = "dice" if "dice" in spec.schedules else (asynchronous[0] if asynchronous else "sync")
    return StepSpec(**{**asdict(spec), "trace_case": (spec.models[0], batch, dispatcher, schedule)})


# ------------------------------------------------------------------------------- the model


def model_config(name: str, depth: int | None = None) -> DiTMoEConfig:
    """A preset (``dit-moe-xl`` ...) or ``digits`` (the sample command's tiny model), with
    ``depth`` blocks if given."""
    config = digits_config(hidden=32, depth=4, num_heads=2) if name == TINY else get_config(name)
    return config.scaled(depth=depth) if depth is not None else config


def build_model(config: DiTMoEConfig, device: torch.device, dtype: torch.dtype, seed: int) -> DiTMoE:
    """The DiT-MoE with random weights (no adaLN-Zero), its routed experts 2-wide stand-ins
    (the runner holds the real ones)."""
    shell = config.scaled(expert_intermediate=STAND_IN_WIDTH)
    return DiTMoE(shell, seed=seed, adaln_zero=False).to(device=device, dtype=dtype).eval()


def expert_bytes(config: DiTMoEConfig, world_size: int, dtype: torch.dtype) -> int:
    """One rank's routed experts over every layer."""
    E_local = config.moe_shape.experts_per_rank(world_size)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return config.depth * E_local * 3 * config.hidden * config.expert_intermediate * itemsize


def build_local_experts(config: DiTMoEConfig, rank: int, world_size: int, device: torch.device,
                        dtype: torch.dtype, seed: int, kind: str) -> list:
    """This rank's experts of every layer, drawn on the device (Xavier-uniform, as the model's)."""
    from moekit.moe.experts import SwiGLUExperts

    E_local = config.moe_shape.experts_per_rank(world_size)
    H, N = config.hidden, config.expert_intermediate
    bound = math.sqrt(6.0 / (H + N))
    g = torch.Generator(device=device).manual_seed(10_000 * seed + 100 * rank + 1)

    def draw(*size):
        w = torch.empty(*size, device=device, dtype=torch.float32).uniform_(-bound, bound, generator=g)
        return w.to(dtype)

    experts = []
    for _ in range(config.depth):
        w13, w2 = draw(E_local, 2 * N, H), draw(E_local, H, N)
        if kind == "fused":
            from moekit.moe.fused_experts import FusedExperts

            # The static kernel choice: a choice that reads the counts on the host would stall the
            # host on the very exchange the experts wait for (and cannot be captured).
            experts.append(FusedExperts(w13, w2, config="static"))
        else:
            experts.append(SwiGLUExperts(w13, w2))
    return experts


def rank_batch(config: DiTMoEConfig, batch: int, rank: int, seed: int, device, dtype):
    """This rank's noise [batch, C, S, S] and labels, different on every rank."""
    g = torch.Generator().manual_seed(7919 * seed + rank + 1)
    noise = torch.randn(batch, config.in_channels, config.input_size, config.input_size, generator=g)
    labels = torch.randint(0, config.num_classes, (batch,), generator=g)
    return noise.to(device=device, dtype=dtype), labels.to(device)


def tokens_per_rank(config: DiTMoEConfig, batch: int, cfg: float) -> int:
    """Tokens through every MoE layer per rank: guidance doubles the batch."""
    return (1 if cfg == 1.0 else 2) * batch * config.tokens_per_image


# ------------------------------------------------------------------------------- memory


def agreed_free_bytes(device: torch.device) -> int | None:
    """The smallest free device memory over the ranks (what the caching allocator holds
    unused counts as free); None on a CPU (no check there). A collective: every rank calls it."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    t = torch.tensor([free], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def working_set_bytes(config: DiTMoEConfig, plan: SchedulePlan, tokens: int, itemsize: int) -> int:
    """An estimate of what one run allocates besides the weights and the dispatchers' own
    buffers: the results the schedule holds (its peak, T x K rows each), a few messages and
    expert intermediates in flight, and the attention's activations."""
    K, H, N = config.top_k, config.hidden, config.expert_intermediate
    message = tokens * K * H * itemsize
    held = accounting.peak_buffers(plan) * message
    return held + 4 * message + 2 * tokens * K * 2 * N * itemsize + 12 * tokens * H * itemsize


def lowlatency_layer_bytes(config: DiTMoEConfig, max_m: int, world_size: int, dtype: torch.dtype) -> dict[str, int]:
    """Memory of one low-latency layer on one rank at this shape (bf16/fp32 on the wire):
    ``persistent`` (receive and combine regions, the expert-major result) and ``expert_out``
    (the experts' output a call allocates)."""
    from moekit.ep.lowlatency.layout import LowLatencyLayout

    layout = LowLatencyLayout(max_m=max_m, hidden=config.hidden, topk=1, num_experts=config.num_experts, rank=0,
                              world_size=world_size, local_world_size=world_size, dtype=dtype, online_fp8=False)
    parts = layout.buffer_bytes()
    return dict(persistent=parts["receive"] + parts["combine"] + parts["result"], expert_out=parts["expert_out"],
                capacity=layout.capacity)


# --------------------------------------------------------------------------- dispatchers


class DispatcherPool:
    """The dispatchers of one (model, batch) on this rank, reused across schedules.

    ``alltoall``: one eager all-to-all (stateless). ``lowlatency``: its results live in
    buffers it reuses, so one layer per (layer, step parity) for each layer a schedule runs
    asynchronously, and one shared by the layers it never does; built when a schedule first
    needs them (every rank in the same order), released by :meth:`close`.
    """

    def __init__(self, kind: str, config: DiTMoEConfig, max_m: int, world_size: int, device: torch.device,
                 dtype: torch.dtype, *, side_group=None, capacity_factor: float | None = None,
                 packing: str | None = None):
        self.kind, self.config, self.max_m, self.world_size = kind, config, max_m, world_size
        self.packing = packing
        self.side_group, self.capacity_factor = side_group, capacity_factor
        self.device, self.dtype = device, dtype
        self.layers: dict = {}
        self.broken: str | None = None  # why the low-latency layer cannot serve this shape

    def keys(self, plan: SchedulePlan) -> list:
        if self.kind == "alltoall":
            return ["alltoall"]
        if self.kind in STALE:  # stateless: one per group (asynchronous layers on the side group)
            depth = self.config.depth
            return (["side"] if any(plan.config.layer_is_async(layer, depth) for layer in range(depth)) else []) + \
                (["main"] if any(not plan.config.layer_is_async(layer, depth) for layer in range(depth)) else [])
        depth = self.config.depth
        keys = [(layer, parity) for layer in range(depth) if plan.config.layer_is_async(layer, depth)
                for parity in range(2)]
        if any(not plan.config.layer_is_async(layer, depth) for layer in range(depth)):
            keys.append("shared")
        return keys

    def _key(self, plan: SchedulePlan, layer: int, parity: int):
        if self.kind == "alltoall":
            return "alltoall"
        if self.kind in STALE:
            return "side" if plan.config.layer_is_async(layer, self.config.depth) else "main"
        return (layer, parity) if plan.config.layer_is_async(layer, self.config.depth) else "shared"

    def missing_bytes(self, plan: SchedulePlan) -> int:
        """Device memory the layers this schedule still lacks will take, plus the experts'
        output of two calls in flight (low-latency layer; 0 for the eager all-to-all and the
        stale exchange, whose buffers are per call: in the working set)."""
        if self.kind == "alltoall":
            return 0
        if self.kind in STALE:  # fixed-capacity receive buffers held across steps, one unpacked per layer
            from moekit.dice.stale import balanced_capacity

            itemsize = torch.empty(0, dtype=self.dtype).element_size()
            rows = self.world_size * balanced_capacity(self.max_m, self.world_size, self.capacity_factor)
            E_local = self.config.moe_shape.experts_per_rank(self.world_size)
            return (accounting.peak_buffers(plan) * rows * (16 + self.config.hidden * itemsize)
                    + 2 * E_local * rows * self.config.hidden * itemsize)
        size = lowlatency_layer_bytes(self.config, self.max_m, self.world_size, self.dtype)
        missing = [k for k in self.keys(plan) if k not in self.layers]
        return len(missing) * size["persistent"] + 2 * size["expert_out"]

    def prepare(self, plan: SchedulePlan) -> str | None:
        """Build what ``plan`` needs; the reason it cannot, or None. A collective."""
        if self.broken:
            return self.broken
        from moekit.ep import AllToAllDispatcher, EPLowLatencyAllToAll

        shape = self.config.moe_shape
        for key in self.keys(plan):
            if key in self.layers:
                continue
            try:
                if self.kind == "alltoall":
                    self.layers[key] = AllToAllDispatcher(shape.num_experts, hidden=shape.hidden, top_k=1)
                elif self.kind in STALE:
                    from moekit.dice.stale import StaleExchange

                    self.layers[key] = StaleExchange(shape.num_experts, self.max_m, hidden=shape.hidden,
                                                     dtype=self.dtype, capacity_factor=self.capacity_factor,
                                                     packing=self.packing,
                                                     group=self.side_group if key == "side" else None)
                else:
                    self.layers[key] = EPLowLatencyAllToAll(self.max_m, shape.hidden, 1, shape.num_experts,
                                                            dtype=self.dtype, online_fp8=False, device=self.device)
            except (ValueError, RuntimeError) as error:  # a shape the layer refuses: every rank, together
                self.broken = f"the {self.kind} dispatcher cannot serve this shape: {error}"
                return self.broken
        return None

    def dispatcher(self, plan: SchedulePlan, wrap=None):
        """The runner's ``dispatcher`` argument for ``plan``; ``wrap(d)`` wraps each one (once)."""
        chosen = {key: (wrap(self.layers[key]) if wrap else self.layers[key]) for key in self.keys(plan)}
        if self.kind == "alltoall":
            return chosen["alltoall"]
        return lambda layer, parity: chosen[self._key(plan, layer, parity)]

    def close(self) -> None:
        for key, layer in self.layers.items():
            if hasattr(layer, "finalize"):
                layer.finalize()
        self.layers.clear()


class TimedDispatcher:
    """A dispatcher whose dispatch and combine calls are timed: CUDA events on the stream
    the call runs on (wall clock on a CPU), appended to ``log`` in call order."""

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def dispatch(self, x, topk_ids, topk_weights):
        return self._timed(lambda: self.inner.dispatch(x, topk_ids, topk_weights), x)

    def combine(self, expert_out, dispatched):
        return self._timed(lambda: self.inner.combine(expert_out, dispatched), expert_out)

    def _timed(self, fn, like: torch.Tensor):
        if like.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self.log.append((start, end))
            return out
        start = time.perf_counter()
        out = fn()
        self.log.append((time.perf_counter() - start) * 1e3)
        return out


def _elapsed_ms(entry) -> float:
    return entry[0].elapsed_time(entry[1]) if isinstance(entry, tuple) else entry


# ------------------------------------------------------------------------------- timing


def time_steps(model, runner, noise, labels, steps: int, cfg: float, device: torch.device,
               after_step=None, graphed=None) -> list[float]:
    """Run the sampler for ``steps`` steps; the ms of each step (CUDA events on the
    sampler's stream, or wall clock). ``after_step(i)`` runs after step i is queued.
    ``graphed``: a :class:`~moekit.dice.graphs.GraphedSampler` of ``runner`` to run instead."""
    cuda = device.type == "cuda"
    if cuda:
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        marks[0].record()
    else:
        stamps = [time.perf_counter()]

    def on_step(i, z):
        if cuda:
            marks[i + 1].record()
        else:
            stamps.append(time.perf_counter())
        if after_step is not None:
            after_step(i)

    if graphed is not None:
        graphed.run(noise, labels, on_step=on_step)
    else:
        sample(model, noise, labels, steps=steps, cfg_scale=cfg, moe=runner, on_step=on_step)
    if cuda:
        torch.cuda.synchronize(device)
        return [marks[i].elapsed_time(marks[i + 1]) for i in range(steps)]
    return [(stamps[i + 1] - stamps[i]) * 1e3 for i in range(steps)]


def _barrier(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class _Case:
    """What one rank's run needs besides the schedule (shared by the runs of one pool)."""

    def __init__(self, spec: StepSpec, config, model, weights, experts, pool, noise, labels, rank, world_size,
                 device, itemsize):
        self.spec, self.config, self.model, self.weights, self.experts = spec, config, model, weights, experts
        self.pool, self.noise, self.labels, self.device, self.itemsize = pool, noise, labels, device, itemsize
        self.rank, self.world_size = rank, world_size
        self.tokens = tokens_per_rank(config, noise.shape[0], spec.cfg)

    def fits(self, plan: SchedulePlan) -> str | None:
        """Why this run would not fit the device (agreed by every rank), or None."""
        free = agreed_free_bytes(self.device)
        if free is None:
            return None
        need = (working_set_bytes(self.config, plan, self.tokens, self.itemsize) + self.pool.missing_bytes(plan)
                + int(self.spec.headroom_gib * GIB))
        if need <= free:
            return None
        what = {"alltoall": "", "stale": f", of which {self.pool.missing_bytes(plan) / GIB:.1f} GiB fixed-capacity "
                                          f"receive buffers"}.get(self.pool.kind) or (
            f", of which {self.pool.missing_bytes(plan) / GIB:.1f} GiB low-latency layers "
            f"({len(self.pool.keys(plan))} of them, each with receive buffers for every row of every rank)")
        return (f"needs about {need / GIB:.1f} GiB per rank (held results, working set, {self.spec.headroom_gib:g} GiB "
                f"headroom{what}); {free / GIB:.1f} GiB free")

    def run(self, name: str, **kwargs) -> dict:
        """One sampler run of ``name``; this rank's step times, or the reason it was skipped.

        A stale exchange whose capacity overflowed in the run (every rank alike) is rebuilt
        with the exact bound, and the run is repeated once; ``capacity_factor`` in the
        result says which capacity the timing is of."""
        out = self._run(name, **kwargs)
        if out.get("overflowed") and self.pool.capacity_factor is not None:
            first = out["overflowed"]
            self.pool.capacity_factor = None  # the exact bound from here on, for every schedule of this pool
            self.pool.layers.clear()
            out = self._run(name, **kwargs)
            out["overflow_before"] = first
        if out.get("overflowed"):
            return dict(skipped=f"timing discarded, rows were not delivered: {out['overflowed']}")
        if self.pool.kind in STALE:
            out["capacity_factor"] = self.pool.capacity_factor
        return out

    def _run(self, name: str, *, timed_log: list | None = None, after_step=None, steps: int | None = None) -> dict:
        spec = self.spec
        total = steps if steps is not None else spec.total_steps
        schedule = preset(name, total)
        plan = SchedulePlan(schedule, total, self.config.depth)
        reason = self.fits(plan)
        if reason is None:
            reason = self.pool.prepare(plan)
        if reason is not None:
            return dict(skipped=reason)
        wrap = (lambda d: TimedDispatcher(d, timed_log)) if timed_log is not None else None
        executor = executor_for(schedule.is_async, self.pool.kind, spec.executor)
        runner = ScheduledMoE(self.weights, self.config.moe_shape, schedule, total,
                              dispatcher=self.pool.dispatcher(plan, wrap),
                              executor=make_executor(executor, self.device),
                              rank=self.rank, world_size=self.world_size, local_experts=self.experts)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        _barrier(self.device)
        try:
            graphed = None
            if self.pool.kind == "stale-graph" and timed_log is None and self.device.type == "cuda":
                from moekit.dice.graphs import GraphedSampler

                graphed = GraphedSampler(self.model, runner, steps=total, cfg_scale=spec.cfg)
            step_ms = time_steps(self.model, runner, self.noise, self.labels, total, spec.cfg, self.device,
                                 after_step, graphed=graphed)
            overflow = None
            try:
                runner.check()  # a stale exchange's overflow flag: one host read, after the run (every rank alike)
            except RuntimeError as error:
                overflow = str(error)
        finally:
            runner.close()
        if overflow is not None:
            return dict(overflowed=overflow)
        graph_info = {} if graphed is None else dict(
            replayed_steps=graphed.replayed_steps, graph_fallback=graphed.fallback, cycle=graphed.cycle)
        stats = runner.stats()
        peak = torch.cuda.max_memory_allocated(self.device) / GIB if self.device.type == "cuda" else None
        return dict(step_ms=step_ms, rows_remote=stats["rows_remote"], executor=executor, peak_gib=peak,
                    staleness=plan.staleness()["mean"], describe=schedule.describe(), **graph_info)


def executor_for(asynchronous: bool, kind: str, choice: str = "auto") -> str:
    """The executor of a run: synchronous schedules in order; asynchronous ones on the side
    stream over the stale exchange (it never reads the host), on the worker thread over
    dispatchers that read sizes on the host (the eager all-to-all; the low-latency layer's
    step status), unless ``choice`` names one."""
    if not asynchronous:
        return "inline"
    if choice != "auto":
        return choice
    return "stream" if kind in STALE else "async"


def _share_run(case: _Case) -> dict:
    """An instrumented sync run: per step, the ms inside dispatch + combine and the step's ms."""
    log: list = []
    bounds = [0]
    out = case.run("sync", timed_log=log, after_step=lambda i: bounds.append(len(log)))
    if "skipped" in out:
        return out
    comm = [sum(_elapsed_ms(e) for e in log[bounds[i]:bounds[i + 1]]) for i in range(len(bounds) - 1)]
    return dict(step_ms=out["step_ms"], comm_ms=comm, calls_per_step=bounds[-1] / max(1, len(comm)))


def _trace_run(case: _Case, name: str, out_dir: Path, rank: int) -> dict:
    """A profiled run of ``name`` (torch.profiler, ``trace_steps`` steps after the warm-up),
    its Chrome trace written to ``out_dir``, and the overlap figure read back from it."""
    from torch.profiler import ProfilerActivity, profile, schedule

    spec = case.spec
    model, batch, dispatcher, _ = spec.trace_case
    path = out_dir / f"dice-step-trace-{model}-b{batch}-{dispatcher}-{name}-rank{rank}.json"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if case.device.type == "cuda" else [])
    kwargs = dict(activities=activities, on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
                  schedule=schedule(wait=max(spec.warmup - 1, 0), warmup=min(spec.warmup, 1),
                                    active=spec.trace_steps, repeat=1))
    try:  # the executor's worker thread too (torch >= 2.7); CUDA kernels are traced from every thread anyway
        kwargs["experimental_config"] = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        pass
    total = spec.warmup + spec.trace_steps + TAIL

    def after_step(i: int) -> None:
        if i == spec.warmup + spec.trace_steps - 1 and case.device.type == "cuda":
            torch.cuda.synchronize(case.device)  # every kernel of the window done before the trace is written
        prof.step()

    with profile(**kwargs) as prof:
        out = case.run(name, after_step=after_step, steps=total)
    if "skipped" in out:
        return dict(schedule=name, dispatcher=dispatcher, skipped=out["skipped"])
    if not path.exists():
        return dict(schedule=name, dispatcher=dispatcher, skipped="the profiler wrote no trace")
    overlap = trace_overlap(json.loads(path.read_text()))
    return dict(schedule=name, dispatcher=dispatcher, file=path.name, overlap=overlap)


# ------------------------------------------------------------------------------ the ranks


def measure_worker(rank: int, world_size: int, spec: StepSpec) -> dict:
    """Every case of ``spec`` on this rank (run by :func:`moekit.ep.launch`)."""
    from moekit.ep import current_device

    device = current_device()
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = DTYPES[spec.dtype]
    itemsize = torch.empty(0, dtype=dtype).element_size()

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    result = dict(cases=[], shares=[], models=[], traces=[], sm_probe=[])
    side_group = None
    if any(k in STALE for k in spec.dispatchers) and world_size > 1:  # their own communicator (a collective)
        from moekit.dice.stale import exchange_group

        side_group = exchange_group(spec.comm_sms, device_type=device.type)
    for name in spec.models:
        config = model_config(name, spec.depth)
        start = time.perf_counter()
        shell = build_model(config, torch.device("cpu"), dtype, spec.seed)
        model_gib = sum(p.numel() * p.element_size() for p in shell.parameters()) / GIB
        experts_gib = expert_bytes(config, world_size, dtype) / GIB
        info = dict(model=name, depth=config.depth, hidden=config.hidden, num_experts=config.num_experts,
                    top_k=config.top_k, tokens_per_image=config.tokens_per_image, model_gib=model_gib,
                    experts_gib_per_rank=experts_gib)
        free = agreed_free_bytes(device)
        if free is not None and (model_gib + experts_gib + spec.headroom_gib) * GIB > free:
            info["skipped"] = (f"{name}: the model ({model_gib:.1f} GiB) and this rank's experts "
                               f"({experts_gib:.1f} GiB) do not fit {free / GIB:.1f} GiB free")
            say(f"skipping {info['skipped']}")
            result["models"].append(info)
            continue
        model = shell.to(device)
        del shell
        experts = build_local_experts(config, rank, world_size, device, dtype, spec.seed, spec.experts)
        weights = model.moe_weights()
        info["build_s"] = time.perf_counter() - start
        result["models"].append(info)
        say(f"{name}: {config.depth} layers, hidden {config.hidden}, {config.num_experts} experts top-{config.top_k}; "
            f"model {model_gib:.2f} GiB + this rank's experts {experts_gib:.2f} GiB, built in {info['build_s']:.1f} s")
        if side_group is not None and device.type == "cuda":  # what the side stream's SM budget costs the compute
            from moekit.dice.smshare import probe
            from moekit.dice.stale import StaleExchange

            rows = tokens_per_rank(config, 8 if 8 in spec.batches else min(spec.batches), spec.cfg) * config.top_k
            exchange = StaleExchange(config.num_experts, rows, hidden=config.hidden, dtype=dtype, group=side_group,
                                     capacity_factor=spec.capacity_factor, packing=spec.stale_packing)
            p = dict(model=name, comm_sms=spec.comm_sms, **probe(exchange, config.hidden, rows, dtype, device))
            result["sm_probe"].append(p)
            say(f"  {name}: side-stream exchange ({rows} rows, comm SMs {spec.comm_sms or 'NCCL default'}) beside "
                f"compute: compute {p['compute_ms']:.2f} -> {p['compute_beside_ms']:.2f} ms "
                f"({p['compute_slowdown']:.2f}x), exchange {p['exchange_ms']:.2f} -> {p['exchange_beside_ms']:.2f} ms "
                f"({p['exchange_slowdown']:.2f}x) (rank 0)")
        for batch in spec.batches:
            noise, labels = rank_batch(config, batch, rank, spec.seed, device, dtype)
            max_m = tokens_per_rank(config, batch, spec.cfg) * config.top_k  # one row per (token, slot)
            for kind in spec.dispatchers:
                pool = DispatcherPool(kind, config, max_m, world_size, device, dtype, side_group=side_group,
                                      capacity_factor=spec.capacity_factor, packing=spec.stale_packing)
                case = _Case(spec, config, model, weights, experts, pool, noise, labels, rank, world_size, device,
                             itemsize)
                try:
                    for schedule in spec.schedules:
                        start = time.perf_counter()
                        out = case.run(schedule)
                        result["cases"].append(dict(model=name, batch=batch, dispatcher=kind, schedule=schedule, **out))
                        say(_progress(name, batch, kind, schedule, out, spec.timed, time.perf_counter() - start))
                    share = _share_run(case) if kind != "stale-graph" else dict(
                        skipped="the instrumented sync run is eager: see the stale dispatcher's")
                    result["shares"].append(dict(model=name, batch=batch, dispatcher=kind, **share))
                    if "skipped" not in share:
                        ratios = [c / t for c, t in zip(share["comm_ms"][spec.timed], share["step_ms"][spec.timed])]
                        say(f"  {name} b{batch} {kind:10s} sync, dispatch + combine timed: "
                            f"{summarize(ratios)['median']:.1%} of the step (rank 0)")
                    if spec.trace_case is not None and spec.trace_case[:3] == (name, batch, kind):
                        out_dir = Path(spec.trace_dir)
                        out_dir.mkdir(parents=True, exist_ok=True)
                        traced = spec.trace_schedules or ("sync", spec.trace_case[3])
                        for schedule in dict.fromkeys(s for s in traced if s in spec.schedules):
                            result["traces"].append(_trace_run(case, schedule, out_dir, rank))
                            say(f"  traced {name} b{batch} {kind} {schedule}")
                finally:
                    pool.close()
            del noise, labels
        del model, experts, weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def _progress(model: str, batch: int, kind: str, schedule: str, out: dict, timed: slice, seconds: float) -> str:
    head = f"  {model} b{batch} {kind:10s} {schedule:12s}"
    if "skipped" in out:
        return f"{head} skipped: {out['skipped']}"
    timed = out["step_ms"][timed]
    return f"{head} {summarize(timed)['median']:9.2f} ms/step (rank 0, median of {len(timed)} steps; {seconds:.1f} s)"


# ----------------------------------------------------------------------------- the parent


def _slowest(runs: list[dict], key: str, timed: slice) -> list[float]:
    """Per timed step, the largest value of ``key`` over the ranks."""
    return [max(values) for values in zip(*(r[key][timed] for r in runs))]


def combine_ranks(per_rank: list[dict], spec: StepSpec) -> dict:
    """The record's results from every rank's: per step the slowest rank, then median / p95
    / mean over the timed steps, speedups over sync, the all-to-all share of sync."""
    timed = spec.timed
    rows = []
    for cases in zip(*(r["cases"] for r in per_rank)):
        first = cases[0]
        row = dict(model=first["model"], batch=first["batch"], dispatcher=first["dispatcher"],
                   schedule=first["schedule"])
        skipped = [c["skipped"] for c in cases if "skipped" in c]
        if skipped:
            rows.append(dict(row, skipped=skipped[0]))
            continue
        slowest = _slowest(cases, "step_ms", timed)
        s = summarize(slowest)
        rows_remote = [sum(values) for values in zip(*(c["rows_remote"][timed] for c in cases))]
        rows.append(dict(row, executor=first["executor"], describe=first["describe"], staleness=first["staleness"],
                         median_ms=s["median"], p95_ms=s["p95"], mean_ms=s["mean"], step_ms=slowest,
                         rank_median_ms=[summarize(c["step_ms"][timed])["median"] for c in cases],
                         rows_remote_per_step=sum(rows_remote) / len(rows_remote),
                         peak_gib=_max_or_none([c["peak_gib"] for c in cases]),
                         **{k: first[k] for k in ("capacity_factor", "overflow_before", "replayed_steps",
                                                  "graph_fallback", "cycle") if k in first}))
    _add_speedups(rows)
    shares = []
    for runs in zip(*(r["shares"] for r in per_rank)):
        first = runs[0]
        row = dict(model=first["model"], batch=first["batch"], dispatcher=first["dispatcher"])
        skipped = [r["skipped"] for r in runs if "skipped" in r]
        if skipped:
            shares.append(dict(row, skipped=skipped[0]))
            continue
        # Each rank's share per step (its own comm over its own step), the median over steps,
        # then the mean over ranks.
        per_rank_share = [summarize([c / t for c, t in zip(r["comm_ms"][timed], r["step_ms"][timed])])["median"]
                          for r in runs]
        shares.append(dict(row, a2a_share=sum(per_rank_share) / len(per_rank_share), rank_a2a_share=per_rank_share,
                           comm_median_ms=summarize(_slowest(runs, "comm_ms", timed))["median"],
                           step_median_ms=summarize(_slowest(runs, "step_ms", timed))["median"],
                           calls_per_step=first["calls_per_step"]))
    traces = [dict(rank=rank, **t) for rank, r in enumerate(per_rank) for t in r["traces"]]
    sm_probe = [dict(rank=rank, **p) for rank, r in enumerate(per_rank) for p in r.get("sm_probe", [])]
    return dict(rows=rows, shares=shares, models=per_rank[0]["models"], traces=traces, sm_probe=sm_probe)


def _max_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _add_speedups(rows: list[dict]) -> None:
    sync = {(r["model"], r["batch"], r["dispatcher"]): r for r in rows
            if r["schedule"] == "sync" and "skipped" not in r}
    for r in rows:
        base = sync.get((r["model"], r["batch"], r["dispatcher"]))
        if "skipped" in r or base is None:
            continue
        r["speedup"] = base["median_ms"] / r["median_ms"]
        r["speedup_mean"] = base["mean_ms"] / r["mean_ms"]
        r["rows_vs_sync"] = r["rows_remote_per_step"] / base["rows_remote_per_step"] if base["rows_remote_per_step"] \
            else None


def table_rows(results: dict, schedules) -> tuple[list[dict], list[str]]:
    """One line per (model, batch, dispatcher): sync's ms and all-to-all share, each other
    schedule's ms and speedup over sync ('-' where skipped)."""
    lines: dict = {}
    for r in results["rows"]:
        line = lines.setdefault((r["model"], r["batch"], r["dispatcher"]),
                                dict(model=r["model"], batch=r["batch"], dispatcher=r["dispatcher"]))
        if "skipped" in r:
            continue
        if r["schedule"] == "sync":
            line["sync ms"] = r["median_ms"]
        else:
            line[f"{r['schedule']} ms"] = r["median_ms"]
            line[f"{r['schedule']} x"] = r.get("speedup")
    for s in results["shares"]:
        line = lines.get((s["model"], s["batch"], s["dispatcher"]))
        if line is not None and "skipped" not in s:
            line["a2a share"] = s["a2a_share"]
    columns = ["model", "batch", "dispatcher", "sync ms", "a2a share"]
    for name in schedules:
        if name != "sync":
            columns += [f"{name} ms", f"{name} x"]
    return list(lines.values()), columns


def run_measure(spec: StepSpec, timeout: float) -> dict:
    """Launch the ranks (NCCL on GPUs, gloo on CPUs) and combine what they measured."""
    from moekit.ep import launch

    spec = resolve_trace_case(spec.check())
    backend = "nccl" if spec.device == "cuda" else "gloo"
    per_rank = launch(measure_worker, spec.world_size, spec, backend=backend, timeout=timeout)
    return combine_ranks(per_rank, spec)


__all__ = ["DEFAULT_SCHEDULES", "DISPATCHERS", "DispatcherPool", "StepSpec", "TimedDispatcher",
           "combine_ranks", "measure_worker", "model_config", "resolve_trace_case", "run_measure", "table_rows",
           "time_steps"]
