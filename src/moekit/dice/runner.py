"""ScheduledMoE: a DiT-MoE's MoE layers run under a DICE schedule over any moekit Dispatcher.

Per rank: every layer's router and shared expert (replicated) and this rank's experts
(contiguous placement). Called by the model as ``runner(layer, h[T, H])`` once per layer
and step, between ``begin_step(t)`` and ``end_step()`` (the sampler calls them).

How the Dispatcher is driven. The schedule needs every (token, slot)'s expert output back
at the token's rank, not only the weighted sum a combine returns: conditional
communication keeps some slots from earlier steps, and ``scores="latest"`` re-weights a
stale output with this step's router. So each dispatch carries one row per (token, slot)
— ``x`` repeated K times, one expert per row (top_k = 1), weight 1 — and slots that are
not sent are masked (-1). The dispatcher's combine then returns each row's expert output
times 1.0 (exact), and this runner sums the K slots itself with
:func:`moekit.ep.weighted_slot_sum`, the float32 slot-order sum every dispatcher's combine
uses. Build the dispatcher with ``top_k=1`` (and, for the low-latency layer,
``max_m >= T * K``). The eager all-to-all sends one row per (token, slot) either way; the
low-latency layer, which otherwise sends a token once per destination rank, sends up to K.

A dispatcher with ``issue`` / ``receive`` (:class:`moekit.dice.stale.StaleExchange`) is
driven in two halves: ``issue`` (plan, pack, exchange) is what the executor runs when the
dispatch is launched, and ``receive`` (the unpack into the expert-major layout) runs on
the compute stream when the experts are about to run, so a dispatch held across a step
boundary holds only the received bytes. Its ``check`` runs in :meth:`ScheduledMoE.check`.

Dispatchers whose results live in buffers they reuse (the low-latency layer: valid until
its next dispatch) need one instance per in-flight dispatch: pass ``dispatcher`` as a
callable ``(layer, parity) -> Dispatcher``; (layer, step % 2) never has two dispatches in
flight. A stateless dispatcher (the eager all-to-all) can be one object for everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moekit.dice.dit_moe import route
from moekit.dice.exact import RowwiseExperts, expert_mlp
from moekit.dice.executor import InlineExecutor
from moekit.dice.schedules import ScheduleConfig, SchedulePlan
from moekit.ep.dispatcher import Dispatcher, weighted_slot_sum
from moekit.moe.experts import MoEWeights, SwiGLUExperts
from moekit.shapes import MoEShape

EXPERT_KINDS = ("torch", "rowwise", "fused")


@dataclass
class SlotResult:
    """The K expert outputs of every token for the data of one step: ``source`` (that
    step), ``ids`` / ``weights`` [T, K] (its routing), ``out`` [T, K, H] (unweighted)."""

    source: int
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor


def cache_lookup(cache: SlotResult | None, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each (token, slot) of ``ids`` [T, K]: whether the cache holds that token's output for
    that expert, and the row (zeros where it does not). [T, K] bool, [T, K, H]."""
    T, K = ids.shape
    if cache is None:
        return torch.zeros(T, K, dtype=torch.bool, device=ids.device), None
    match = cache.ids.unsqueeze(1) == ids.unsqueeze(2)  # [T, K(asked), K(cached)]
    hit = match.any(dim=2)
    j = match.to(torch.int8).argmax(dim=2)  # the cached slot holding that expert
    rows = cache.out.gather(1, j.unsqueeze(2).expand(T, K, cache.out.shape[2]))
    return hit, torch.where(hit.unsqueeze(2), rows, torch.zeros_like(rows))


def send_mask(plan: SchedulePlan, step: int, layer: int, ids: torch.Tensor, cache: SlotResult | None,
              asynchronous: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Conditional communication (Algorithm 4): which (token, slot) are sent, and the cached
    rows for the others. Synchronous work and refresh steps send everything; otherwise the
    top-1 slot is always sent and a lower slot is sent only on a cache miss."""
    T, K = ids.shape
    if not asynchronous or plan.refresh_all(step) or K == 1:
        return torch.ones(T, K, dtype=torch.bool, device=ids.device), None
    hit, rows = cache_lookup(cache, ids)
    send = ~hit
    send[:, 0] = True
    return send, rows


def assemble(fresh: torch.Tensor, send: torch.Tensor, cached: torch.Tensor | None) -> torch.Tensor:
    """Slot outputs: the fresh row where the slot was sent, the cached row where not."""
    return fresh if cached is None else torch.where(send.unsqueeze(2), fresh, cached)


def scale(result: SlotResult, probs: torch.Tensor, scores: str, dtype: torch.dtype) -> torch.Tensor:
    """The routed output: slot outputs weighted by the stale (their step's) or latest
    (this step's) router probabilities of the same experts, summed in slot order."""
    weights = result.weights if scores == "stale" else probs.gather(1, result.ids)
    return weighted_slot_sum(result.out, result.ids, weights, dtype)


@dataclass
class _Launch:
    """An asynchronous dispatch in flight (or waiting for its experts)."""

    step: int
    layer: int
    ids: torch.Tensor
    weights: torch.Tensor
    send: torch.Tensor
    cached: torch.Tensor | None
    dispatcher: Dispatcher
    handle: object


@dataclass
class _Combine:
    """A combine in flight: due at ``due``; its rows complete ``launch``'s slots."""

    due: int
    launch: _Launch
    handle: object


class ScheduledMoE:
    """The MoE FFNs of a DiT-MoE under one schedule, on this rank.

    ``weights``: every layer's :class:`MoEWeights` (identical on all ranks); ``shape``: the
    layer shape (E, K, H; ``num_layers`` is ``len(weights)``); ``schedule``: a
    :class:`ScheduleConfig`; ``num_steps``: denoising steps of the run. ``dispatcher``: a
    Dispatcher or ``(layer, parity) -> Dispatcher`` (see the module docstring; default: the
    eager all-to-all over the default group, top_k=1). ``executor``: an
    :class:`~moekit.dice.executor.InlineExecutor` (default) or
    :class:`~moekit.dice.executor.AsyncExecutor`. ``experts``: ``"torch"`` (batched
    matmuls), ``"rowwise"`` (batch-invariant, for bitwise checks) or ``"fused"`` (the
    Triton kernel). ``batch_invariant`` also makes the router and shared expert row-wise.
    ``local_experts``: this rank's experts of every layer, already built (modules called as
    ``experts(tokens, counts, scales)`` with ``num_experts == E / world_size``); then the
    ``w13`` / ``w2`` of ``weights`` are not read and ``experts`` is ignored. Timing runs at
    the release's shapes use it: all E experts of every layer need not fit one device.
    """

    def __init__(self, weights: list[MoEWeights], shape: MoEShape, schedule: ScheduleConfig, num_steps: int, *,
                 dispatcher: Dispatcher | Callable[[int, int], Dispatcher] | None = None, executor=None,
                 experts: str = "torch", batch_invariant: bool = False, rank: int | None = None,
                 world_size: int | None = None, local_experts: list | None = None):
        if experts not in EXPERT_KINDS:
            raise ValueError(f"experts must be one of {EXPERT_KINDS}, got {experts!r}")
        if not weights:
            raise ValueError("weights must list at least one layer's MoEWeights")
        self.plan = SchedulePlan(schedule, num_steps, len(weights))
        self.schedule, self.shape = schedule, shape
        if dispatcher is None:
            from moekit.ep.alltoall import AllToAllDispatcher

            dispatcher = AllToAllDispatcher(shape.num_experts, hidden=shape.hidden, top_k=1)
        self._dispatcher = dispatcher
        probe = dispatcher(0, 0) if _is_factory(dispatcher) else dispatcher
        self.rank = rank if rank is not None else getattr(probe, "rank", 0)
        self.world_size = world_size if world_size is not None else getattr(probe, "world_size", 1)
        E_local = shape.experts_per_rank(self.world_size)
        self.E_local = E_local
        lo = self.rank * E_local
        self.routers = [w.router for w in weights]
        self.shared = [(w.shared_w13, w.shared_w2) for w in weights]
        if local_experts is not None:
            self.experts = _check_local_experts(local_experts, len(weights), E_local)
        else:
            self.experts = [_make_experts(experts, w.w13[lo:lo + E_local].clone(), w.w2[lo:lo + E_local].clone())
                            for w in weights]
        self.batch_invariant = batch_invariant
        self.executor = executor if executor is not None else InlineExecutor()
        L = len(weights)
        self.step: int | None = None
        self._pending_dispatch: list[_Launch | None] = [None] * L  # displaced: launched last step
        self._queue: list[_Launch] = []  # interweaved: launched this step, experts not run yet
        self._combines: list[list[_Combine]] = [[] for _ in range(L)]
        self._held: list[SlotResult | None] = [None] * L
        # Accounting, on the device, read once by stats(): (token, slot) rows sent to other
        # ranks and to this rank, per step, summed in a [2] counter during the step and
        # added to its row at end_step (a captured step holds no step index on the device).
        self._rows = None
        self._step_rows = None
        self.capturing = False  # set by moekit.dice.graphs while a step is captured
        self.sources = [[-1] * L for _ in range(num_steps)]  # the step each (t, l) used
        self._peak = dict(dispatch=0, combine=0, held=0, total=0)
        self._used: dict[int, object] = {}  # every dispatcher this run called, for check()

    # -- the model's hooks ----------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        if self.step is not None:
            raise RuntimeError(f"begin_step({step}) while step {self.step} is still open; call end_step() first")
        if not 0 <= step < self.plan.num_steps:
            raise ValueError(f"step must be in [0, {self.plan.num_steps - 1}], got {step}")
        self.step = step

    def end_step(self) -> None:
        """Run the experts still queued (interweaved: the last asynchronous layer's) and
        check that nothing is left over that the plan does not expect."""
        self._drain_queue()
        t = self.step
        for layer, combines in enumerate(self._combines):
            if any(c.due <= t for c in combines):
                raise RuntimeError(f"layer {layer}: a combine due by step {t} was never consumed")
        self._note_buffers()
        if self._step_rows is not None and not self.capturing:
            self.settle_rows(t)
        self.step = None

    def settle_rows(self, step: int) -> None:
        """Add the step's row counter to ``step``'s row and clear it (a graph's replay calls
        this after the step, outside the graph)."""
        self._rows[step] += self._step_rows
        self._step_rows.zero_()

    def __call__(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        t, plan = self.step, self.plan
        if t is None:
            raise RuntimeError("call begin_step(step) before running the layers")
        probs, weights, ids = route(h, self.routers[layer], self.shape.top_k, batch_invariant=self.batch_invariant)
        if self._rows is None:
            self._rows = torch.zeros(plan.num_steps, 2, dtype=torch.int64, device=h.device)
            self._step_rows = torch.zeros(2, dtype=torch.int64, device=h.device)
        if plan.is_async(t, layer):
            launch = self._launch(layer, t, h, ids, weights, asynchronous=True) if plan.launches(t, layer) else None
            if self.schedule.mode == "displaced":
                previous = self._pending_dispatch[layer]
                self._pending_dispatch[layer] = None
                if previous is not None:  # Algorithm 2: last step's tokens through this layer's experts now
                    self._run_experts(previous, due=t + 1)
            else:
                self._drain_queue()  # Algorithm 3: the earlier layers' dispatches of this step
            arriving = [c for c in self._combines[layer] if c.due == t]
            if arriving:
                self._combines[layer] = [c for c in self._combines[layer] if c.due != t]
                self._held[layer] = self._finish(arriving[0])
            result = self._held[layer]
            if result is None:
                raise RuntimeError(f"layer {layer} at step {t}: nothing to reuse (the plan starts asynchronous)")
            if launch is not None:
                if self.schedule.mode == "displaced":
                    self._pending_dispatch[layer] = launch
                else:
                    self._queue.append(launch)
        else:
            self._drain_queue()
            launch = self._launch(layer, t, h, ids, weights, asynchronous=False)
            result = self._finish(self._run_experts(launch, due=t))
            self._held[layer] = result
        self.sources[t][layer] = result.source
        y = scale(result, probs, self.schedule.scores, h.dtype)
        if not plan.keeps_result(t, layer):
            self._held[layer] = None
        self._note_buffers()
        w13, w2 = self.shared[layer]
        if w13 is not None:
            y = y + expert_mlp(h, w13, w2, batch_invariant=self.batch_invariant).to(y.dtype)
        return y

    # -- dispatch, experts, combine --------------------------------------------------------

    def dispatcher_for(self, layer: int, step: int) -> Dispatcher:
        d = self._dispatcher
        return d(layer, step % 2) if _is_factory(d) else d

    def _launch(self, layer: int, t: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                asynchronous: bool) -> _Launch:
        send, cached = send_mask(self.plan, t, layer, ids, self._held[layer], asynchronous)
        T, K = ids.shape
        x = h.unsqueeze(1).expand(T, K, h.shape[1]).reshape(T * K, h.shape[1])
        pair_ids = torch.where(send, ids, -1).reshape(T * K, 1)
        ones = torch.ones(T * K, 1, dtype=torch.float32, device=h.device)
        owner = torch.div(ids, self.E_local, rounding_mode="floor")
        self._step_rows[0] += (send & (owner != self.rank)).sum()
        self._step_rows[1] += (send & (owner == self.rank)).sum()
        dispatcher = self.dispatcher_for(layer, t)
        self._used.setdefault(id(dispatcher), dispatcher)
        # A split dispatcher (StaleExchange) issues only the exchange; its unpack waits for the experts.
        issue = getattr(dispatcher, "issue", None) or dispatcher.dispatch
        handle = self.executor.submit(lambda: issue(x, pair_ids, ones), inputs=(x, pair_ids, ones))
        return _Launch(t, layer, ids, weights, send, cached, dispatcher, handle)

    def _run_experts(self, launch: _Launch, due: int) -> _Combine:
        d = launch.dispatcher
        dispatched = self.executor.wait(launch.handle)
        if hasattr(d, "receive"):
            dispatched = d.receive(dispatched)
        out = self.experts[launch.layer](dispatched.tokens, dispatched.counts, dispatched.scales)
        handle = self.executor.submit(lambda: d.combine(out, dispatched), inputs=(out, dispatched))
        combine = _Combine(due, launch, handle)
        if due != self.step:  # asynchronous: consumed by a later step
            self._combines[launch.layer].append(combine)
        return combine

    def _finish(self, combine: _Combine) -> SlotResult:
        rows = self.executor.wait(combine.handle)
        launch = combine.launch
        T, K = launch.ids.shape
        out = assemble(rows.view(T, K, rows.shape[1]), launch.send, launch.cached)
        return SlotResult(launch.step, launch.ids, launch.weights, out)

    def _drain_queue(self) -> None:
        while self._queue:
            launch = self._queue.pop(0)
            self._run_experts(launch, due=launch.step + 1)

    # -- the state between steps (for moekit.dice.graphs) -------------------------------------

    def state(self) -> tuple:
        """What crosses a step boundary: per layer the displaced dispatch in flight, the
        combines in flight, the held result (the interweaved queue is empty between steps)."""
        if self.step is not None or self._queue:
            raise RuntimeError("state() is taken between steps")
        return (list(self._pending_dispatch), [list(c) for c in self._combines], list(self._held))

    def set_state(self, state: tuple, shift: int = 0) -> None:
        """Install ``state`` (from :meth:`state`) with every step number in it moved by
        ``shift``: the same tensors, now standing for the state ``shift`` steps later."""
        pending, combines, held = state
        launches: dict[int, _Launch] = {}

        def moved(launch: _Launch | None) -> _Launch | None:
            if launch is None:
                return None
            if id(launch) not in launches:
                launches[id(launch)] = _Launch(launch.step + shift, launch.layer, launch.ids, launch.weights,
                                               launch.send, launch.cached, launch.dispatcher, launch.handle)
            return launches[id(launch)]

        self._pending_dispatch = [moved(p) for p in pending]
        self._combines = [[_Combine(c.due + shift, moved(c.launch), c.handle) for c in layer] for layer in combines]
        self._held = [None if r is None else SlotResult(r.source + shift, r.ids, r.weights, r.out) for r in held]

    # -- accounting ------------------------------------------------------------------------

    def live_buffers(self) -> dict[str, int]:
        """What the schedule holds now, in (T x K)-row buffers: dispatches in flight or
        waiting for experts, combines in flight, held results (the cache)."""
        dispatch = sum(p is not None for p in self._pending_dispatch) + len(self._queue)
        combine = sum(len(c) for c in self._combines)
        held = sum(r is not None for r in self._held)
        return dict(dispatch=dispatch, combine=combine, held=held, total=dispatch + combine + held)

    def _note_buffers(self) -> None:
        for key, value in self.live_buffers().items():
            self._peak[key] = max(self._peak[key], value)

    def stats(self) -> dict:
        """Rows and bytes sent per step (one host read), sources used, peak buffers."""
        rows = self._rows.cpu() if self._rows is not None else torch.zeros(self.plan.num_steps, 2, dtype=torch.int64)
        H = self.shape.hidden
        itemsize = self.experts[0].w13.dtype.itemsize
        return dict(rows_remote=rows[:, 0].tolist(), rows_local=rows[:, 1].tolist(),
                    bytes_remote=[int(r) * H * itemsize * 2 for r in rows[:, 0].tolist()],  # dispatch + combine
                    sources=[list(r) for r in self.sources], peak_buffers=dict(self._peak))

    def check(self) -> None:
        """After a run: each dispatcher's own deferred check (a fixed-capacity exchange's
        overflow flag: one host read), outside the steps."""
        for d in self._used.values():
            check = getattr(d, "check", None)
            if check is not None:
                check()

    def close(self) -> None:
        self.executor.close()


def _is_factory(dispatcher) -> bool:
    """A ``(layer, parity) -> Dispatcher`` callable rather than a Dispatcher."""
    return callable(dispatcher) and not hasattr(dispatcher, "dispatch")


def _check_local_experts(local_experts, num_layers: int, experts_per_rank: int) -> list:
    local_experts = list(local_experts)
    if len(local_experts) != num_layers:
        raise ValueError(f"local_experts must list one module per layer ({num_layers}), got {len(local_experts)}")
    for layer, module in enumerate(local_experts):
        n = getattr(module, "num_experts", None)
        if n != experts_per_rank:
            raise ValueError(f"local_experts[{layer}] must hold this rank's {experts_per_rank} experts, "
                             f"got num_experts={n!r}")
    return local_experts


def _make_experts(kind: str, w13: torch.Tensor, w2: torch.Tensor):
    if kind == "torch":
        return SwiGLUExperts(w13, w2)
    if kind == "rowwise":
        return RowwiseExperts(w13, w2)
    from moekit.moe.fused_experts import FusedExperts

    return FusedExperts(w13, w2)
