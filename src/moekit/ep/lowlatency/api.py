"""``EPLowLatencyAllToAll``: the low-latency expert-parallel layer.

Two APIs over one implementation:

* the Dispatcher protocol (docs/architecture.md) — ``d = layer.dispatch(x, topk_ids, topk_weights)``
  returns a :class:`LowLatencyDispatched` (a :class:`~moekit.ep.Dispatched`) and
  ``layer.combine(expert_out, d)`` returns ``[T, H]``;
* the low-latency paper's API — ``recv_token, recv_scale, counts, meta = layer.dispatch(x, topk_ids)``
  (the result unpacks into those four) and
  ``layer.combine(expert_out, topk_ids, topk_weights, meta, zero_copy=False)``.

Ranks fail together (:mod:`moekit.ep.agreement`). Building a layer checks once, in one
small collective before the transport allocates anything, that every rank passed the same
sizes, dtype, FP8 settings and device type. In ``dispatch``, what happens to a bad input
(T > max_m, shapes, dtypes, devices, expert ids outside [-1, E)) depends on the transport:

* both transports carry step statuses (``exchanges_status``): the bad rank still takes
  part in the step's exchange with an empty, well-formed message carrying its error (the
  gloo message; on the GPU, a status row stored into every rank's buffer by the dispatch
  kernel), and every rank raises the same ValueError, naming the bad rank, after that one
  exchange; the next step pairs up normally.

``combine`` on a transport that carries statuses there too (``combine_exchanges_status``:
the gloo one) fails together the same way: a rank with bad arguments (``expert_out`` of
another shape, dtype or device, routing that does not match the dispatch, ...) sends a
poisoned message with its error in front, and every rank raises the same ValueError after
the exchange. On the GPU transport the combine kernel carries no status: the bad rank still
runs its combine with NaN rows (nobody waits on it) and raises at once, and its error travels
with its next dispatch's status, where every rank raises it (the peers' combine results hold
NaN where its rows belonged).

Inside a CUDA-graph capture nothing can be read on the host: out-of-range ids are treated
as masked, ``state["invalid_ids"]`` says whether any rank had one and
``state["invalid_by_rank"]`` which (the symmetric-memory kernels send each rank's flag with
its tokens); :meth:`EPLowLatencyAllToAll.check_replay` is the host check after a replay,
the same error on every rank.

Two options change what crosses the wire (:mod:`moekit.ep.lowlatency.layout`):
``combine_order="rank"`` sends one partial row per (token, rank) back instead of one row per
slot, and ``recv_capacity`` bounds the receive buffer to that many rows per source, the
rest travelling in spill rounds. Both transports implement both.

The transport moves the bytes: :class:`~moekit.ep.lowlatency.gloo.GlooTransport` on CPU
tensors, ``SymmMemTransport`` (``moekit.ep.lowlatency.cuda``, Triton over torch symmetric
memory) on CUDA tensors with an NCCL group.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from moekit.ep.agreement import StepCheck, agree_on_config, raise_for_flagged_ranks
from moekit.ep.checks import check_bool
from moekit.ep.dispatcher import Dispatched, DispatchHandle, validate_routing
from moekit.ep.lowlatency.layout import LowLatencyLayout, LowLatencyMeta
from moekit.ep.lowlatency.pool import check_slot
from moekit.ep.lowlatency.transport import (COMBINE_PHASES, DISPATCH_PHASES, END, POSTPROCESS, START, TOPK_REDUCE,
                                            Transport, new_stamps)
from moekit.ep.peers import PeerGroup
from moekit.perfetto import phase_events, trace_document, write_trace

MAX_PROFILED_CALLS = 4096  # stamps kept per call type when profiling (the oldest are dropped)


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s work is being recorded into a CUDA graph (no host reads allowed)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class LowLatencyHandle(DispatchHandle):
    """The Dispatcher protocol's handle, backed by :class:`LowLatencyMeta`.

    ``src_rank`` / ``src_token`` / ``src_slot`` are the meta's int32 tensors as int64 (the
    protocol's dtype), converted when read, so dispatch pays nothing for them.
    """

    def __init__(self, meta: LowLatencyMeta, state: dict[str, Any]):  # noqa: D107 (no dataclass init)
        self.meta = meta
        self.state = state

    @property
    def src_rank(self) -> torch.Tensor:  # type: ignore[override]
        return self.meta.src_rank.to(torch.int64)

    @property
    def src_token(self) -> torch.Tensor:  # type: ignore[override]
        return self.meta.src_token.to(torch.int64)

    @property
    def src_slot(self) -> torch.Tensor:  # type: ignore[override]
        return self.meta.src_slot.to(torch.int64)


@dataclass
class LowLatencyDispatched(Dispatched):
    """A :class:`~moekit.ep.Dispatched` that also unpacks as the low-latency paper's 4-tuple:
    ``recv_token, recv_scale, expert_recv_count, dispatch_meta = layer.dispatch(...)``.

    ``counts`` is int32 (the meta's), ``scales`` None when ``online_fp8=False``.
    """

    meta: LowLatencyMeta | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.tokens, self.scales, self.counts, self.meta))


class EPLowLatencyAllToAll:
    """Low-latency dispatch/combine for expert parallelism with online FP8.

    ``max_m``: most tokens per rank per call; ``hidden``, ``topk``, ``num_experts``: the
    MoE shape (experts placed contiguously, ``E / world_size`` per rank); ``rank``,
    ``world_size``, ``local_world_size`` default to the process group's (one node);
    ``fp8_group_size``: columns per FP8 scale; ``dtype``: activations' dtype;
    ``online_fp8``: tokens cross as e4m3 + float32 scales (else in ``dtype``, bitwise);
    ``profile``: record per-phase timestamps for :meth:`dump_dispatch_trace` /
    :meth:`dump_combine_trace`. ``group``/``device``/``transport`` pick the process group,
    device and transport (default: the current device; symmetric memory on CUDA, gloo on CPU).
    ``timeout``: seconds the gloo transport's exchanges wait for the peers before raising
    :class:`~moekit.ep.PeerError` (None: the process group's timeout, which the GPU
    transport always uses). ``combine_order``: ``"slot"`` (default) or ``"rank"``;
    ``recv_capacity`` / ``spill_rows``: the bounded receive buffer (None: ``max_m`` rows per
    source, nothing spills). In
    the rank order the expert ranks weight the outputs, so ``dispatch`` needs
    ``topk_weights`` and a ``combine(expert_out, topk_ids, topk_weights, meta)`` must pass
    the same weights.

    ``buffer_slot``: the layers of one process share their receive buffers (one per slot,
    sized by the largest layer: :mod:`moekit.ep.lowlatency.pool`); layers on one slot run
    their exchanges one after the other, in the same order on every rank; exchanges that
    may run at the same time (two streams) need two slots. None: a buffer of the layer's own.

    Results live in buffers the layer reuses: the tokens, scales, counts and meta of a
    dispatch are valid until the layer's next dispatch, and combine's output until its next
    combine (the GPU transport writes them in place; copy what must live longer). Combine
    each dispatch before the layer's next dispatch; other layers' dispatches and combines
    may come in between (dispatch A, dispatch B, combine A, combine B). The receive views
    (``meta.recv``'s tokens and scales) are valid until the second dispatch after this one
    on the slot.
    """

    def __init__(self, max_m: int, hidden: int, topk: int, num_experts: int, rank: int | None = None,
                 world_size: int | None = None, local_world_size: int | None = None, fp8_group_size: int = 128,
                 dtype: torch.dtype = torch.bfloat16, online_fp8: bool = True, profile: bool = False, *,
                 group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                 transport: Transport | None = None, timeout: float | None = None, combine_order: str = "slot",
                 recv_capacity: int | None = None, spill_rows: int | None = None, buffer_slot: int | None = 0):
        check_slot(buffer_slot)
        self.buffer_slot = buffer_slot
        self.peers = PeerGroup(group, owner="EPLowLatencyAllToAll")
        self.group = group

        def build() -> None:
            self.peers.set_timeout(timeout)
            group_rank, group_world = self.peers.rank, self.peers.world_size
            my_rank = group_rank if rank is None else rank
            world = group_world if world_size is None else world_size
            if (my_rank, world) != (group_rank, group_world):
                raise ValueError(f"rank={my_rank}, world_size={world} do not match the process group "
                                 f"(rank {group_rank} of {group_world})")
            check_bool("profile", profile)
            self.layout = LowLatencyLayout(
                max_m=max_m, hidden=hidden, topk=topk, num_experts=num_experts, rank=my_rank, world_size=world,
                local_world_size=world if local_world_size is None else local_world_size,
                group_size=fp8_group_size, dtype=dtype, online_fp8=online_fp8, combine_order=combine_order,
                recv_capacity=recv_capacity, spill_rows=spill_rows)
            if self.layout.topk > self.layout.num_experts:  # a router picks K distinct experts of E
                raise ValueError(f"topk must be an int in [1, num_experts={num_experts}], got {topk!r}")
            self.device = _resolve_device(device, group, self.peers.distributed)

        agree_on_config(self.peers, "EPLowLatencyAllToAll", dict(
            max_m=max_m, hidden=hidden, topk=topk, num_experts=num_experts, world_size=world_size,
            local_world_size=local_world_size, fp8_group_size=fp8_group_size, dtype=dtype, online_fp8=online_fp8,
            device_type=_device_type(device, group, self.peers.distributed), placement="contiguous",
            transport="default" if transport is None else type(transport).__name__, combine_order=combine_order,
            recv_capacity=recv_capacity, spill_rows=spill_rows, buffer_slot=buffer_slot), build)
        self.transport = transport if transport is not None else make_transport(
            self.layout, group, self.device, timeout=self.peers.timeout, slot=buffer_slot)
        if transport is not None:  # a transport given by the caller: this rank checks it alone
            _check_transport_options(self.layout, transport)
        L = self.layout
        self.step = StepCheck("EPLowLatencyAllToAll", self.peers, L.num_experts, hidden=L.hidden, top_k=L.topk,
                              max_tokens=L.max_m, dtype=L.dtype, device=self.device)
        self.profile = profile
        self._stamps: dict[str, collections.deque] = {
            "dispatch": collections.deque(maxlen=MAX_PROFILED_CALLS),
            "combine": collections.deque(maxlen=MAX_PROFILED_CALLS)}
        self._captured_stamps: dict[str, torch.Tensor] = {}  # written by every replay of a graph
        self._closed = False
        # The last eager dispatch not yet combined (meta, ids, weights): what a rank whose combine
        # arguments are bad still sends on a transport whose combine carries no status.
        self._uncombined: tuple | None = None
        self._combine_problem: str | None = None  # such a rank's error, sent with its next dispatch

    # -- sizes -----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def num_experts(self) -> int:
        return self.layout.num_experts

    @property
    def experts_per_rank(self) -> int:
        return self.layout.experts_per_rank

    @property
    def capacity(self) -> int:
        return self.layout.capacity

    @property
    def combine_order(self) -> str:
        return self.layout.combine_order

    # -- dispatch --------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor | None = None) -> LowLatencyDispatched:
        """Send each token once to every rank hosting one of its experts; fan it out there.

        ``x [T, H]`` (``dtype``, T <= max_m), ``topk_ids [T, K]`` int32/int64 (-1 = masked
        slot), ``topk_weights [T, K]`` (optional; kept for the protocol's combine).
        Returns tokens ``[E_local, world * max_m, H]`` (FP8 e4m3 with ``scales``
        ``[E_local, world * max_m, H / group]`` float32, or ``dtype``), ``counts [E_local]``
        int32 and the meta combine needs. Rows past ``counts[e]`` are unspecified.
        """
        self._check_open()
        L = self.layout
        T = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
        K = topk_ids.shape[1] if isinstance(topk_ids, torch.Tensor) and topk_ids.dim() == 2 else L.topk
        weights = topk_weights
        if weights is None:  # the protocol's checks want weights: an unread stand-in of the right shape
            weights = torch.empty((), dtype=torch.float32, device=getattr(x, "device", None)).expand(T, K)
        capturing = isinstance(x, torch.Tensor) and _capturing(x)
        invalid = flagged_ranks = None
        by_rank = L.combine_order == "rank"
        if getattr(self.transport, "exchanges_status", False) and not capturing:
            # Every rank's input is checked together, in the dispatch exchange itself.
            problem = None
            if by_rank and topk_weights is None:
                problem = ("topk_weights: combine_order='rank' weights the expert outputs on the expert ranks, so "
                           "dispatch needs the routing weights; pass dispatch(x, topk_ids, topk_weights)")
            if problem is None and self._combine_problem is not None:
                problem = self._combine_problem  # every rank learns of the last combine's bad arguments here
            self._combine_problem = None
            status = self.step.inspect(x, topk_ids, weights, problem=problem)
            if status.ok:
                x, ids = x.contiguous(), topk_ids.to(torch.int32).contiguous()
                w = topk_weights.contiguous() if by_rank else None
            else:  # an empty, well-formed step that carries the error to the peers
                x = torch.empty(0, L.hidden, dtype=L.dtype, device=self.device)
                ids = torch.empty(0, L.topk, dtype=torch.int32, device=self.device)
                w = torch.empty(0, L.topk, dtype=torch.float32, device=self.device) if by_rank else None
            stamps = self._new_stamps("dispatch", len(DISPATCH_PHASES))
            extra = dict(weights=w) if by_rank else {}
            recv = self.transport.dispatch(x, ids, stamps, status=status.words, **extra)
            self.step.settle_gathered(recv.status)
            return self._finish_dispatch(recv, ids, topk_weights, T, invalid, stamps)
        validate_routing(x, topk_ids, weights, L.num_experts, hidden=L.hidden, top_k=L.topk, max_tokens=L.max_m,
                         check_ids=not capturing)
        self._check_tensor("x", x, L.dtype)
        stamps = self._new_stamps("dispatch", len(DISPATCH_PHASES))
        if hasattr(self.transport, "dispatch_unchecked"):  # the masking below, inside its dispatch kernel
            if by_rank and topk_weights is None:
                raise ValueError("topk_weights: combine_order='rank' weights the expert outputs on the expert ranks, "
                                 "so dispatch needs the routing weights; pass dispatch(x, topk_ids, topk_weights)")
            extra = dict(weights=topk_weights.contiguous()) if by_rank else {}
            recv, ids, device_invalid = self.transport.dispatch_unchecked(
                x.contiguous(), topk_ids.contiguous(), L.num_experts, stamps, **extra)
            if capturing:
                invalid = device_invalid
                flagged_ranks = getattr(self.transport, "invalid_ranks", None)
        else:
            ids = topk_ids.to(torch.int32)
            if capturing:  # ids could not be checked: treat out-of-range ids as masked, and say so
                bad = (ids < -1) | (ids >= L.num_experts)
                ids = torch.where(bad, -1, ids)
                invalid = bad.any()
            recv = self.transport.dispatch(x.contiguous(), ids.contiguous(), stamps)
        return self._finish_dispatch(recv, ids, topk_weights, T, invalid, stamps, flagged_ranks)

    def _finish_dispatch(self, recv, ids: torch.Tensor, topk_weights: torch.Tensor | None, T: int,
                         invalid: torch.Tensor | None, stamps: torch.Tensor | None,
                         flagged_ranks: torch.Tensor | None = None) -> LowLatencyDispatched:
        """Receiver side of dispatch: the expert-major bookkeeping and the fan-out."""
        self._stamp(stamps, POSTPROCESS, START)
        meta = self.transport.postprocess(recv)
        tokens, scales = self.transport.fan_out(recv, meta)
        self._stamp(stamps, POSTPROCESS, END)
        meta.num_dispatched = T
        state = dict(topk_ids=ids, topk_weights=topk_weights, num_tokens=T, invalid_ids=invalid,
                     invalid_by_rank=flagged_ranks)
        self._uncombined = (meta, ids, topk_weights)
        if self.layout.bounded:  # counted on the device: tokens that came in spill rounds, and the rounds
            state.update(overflow_tokens=recv.overflow.sum(), spill_rounds=recv.spill_rounds)
        return LowLatencyDispatched(tokens=tokens, counts=meta.counts, handle=LowLatencyHandle(meta, state),
                                    scales=scales, meta=meta)

    def check_replay(self, dispatched: LowLatencyDispatched) -> None:
        """The host check after replaying a captured dispatch (one host read): a ValueError
        when a rank's ids held values outside [-1, E), which the graph treated as masked.

        The symmetric-memory kernels send each rank's flag with its tokens, so every rank
        raises the same error naming the bad ranks. A transport without such kernels masks
        with torch ops, and only the bad rank knows (and raises).
        """
        state = dispatched.handle.state
        if state["invalid_ids"] is None:
            return
        by_rank = state.get("invalid_by_rank")
        flags = [bool(v) for v in (by_rank if by_rank is not None else state["invalid_ids"].view(1)).tolist()]
        raise_for_flagged_ranks("EPLowLatencyAllToAll", flags,
                                f"topk_ids held ids outside [-1, {self.num_experts - 1}] (-1 = masked slot) in "
                                "the replayed step; the graph treated them as masked slots")

    # -- combine ---------------------------------------------------------------------------

    def combine(self, expert_out: torch.Tensor, topk_ids: torch.Tensor | Dispatched,
                topk_weights: torch.Tensor | None = None, dispatch_meta: LowLatencyMeta | Dispatched | None = None,
                zero_copy: bool = False, *, follows_dispatch: bool | None = None) -> torch.Tensor:
        """Send expert outputs back and sum each token's K slots: ``[T, H]`` in ``dtype``.

        Either ``combine(expert_out, dispatched)`` (the Dispatcher protocol; routing as
        given to dispatch) or ``combine(expert_out, topk_ids, topk_weights, dispatch_meta)``
        (the low-latency paper's). ``expert_out [E_local, world * max_m, H]`` in ``dtype``; only its
        valid rows are read. The slots are accumulated in float32 in slot order
        (docs/architecture.md), so the result is bitwise that of every other dispatcher.

        ``zero_copy`` is accepted for the paper's API and changes nothing here: the paper's layer
        stages ``expert_out`` into a symmetric buffer first unless it is already there;
        this layer's put step reads ``expert_out`` wherever it lives and writes straight
        into the source rank's buffer, so there is no staging copy to skip.

        ``follows_dispatch``: on the GPU a combine that directly follows another combine on
        the shared buffer's slot synchronizes with every peer (:mod:`moekit.ep.lowlatency.pool`);
        the host decides from the calls it has seen (None). True promises that when this call
        runs — e.g. a captured graph replayed in alternation with a captured dispatch — a
        dispatch on the slot came after the previous combine, so the synchronization is left out.
        """
        self._check_open()
        if follows_dispatch is not None and not isinstance(follows_dispatch, bool):
            raise ValueError(f"follows_dispatch must be a bool or None, got {follows_dispatch!r}")
        shared = getattr(self.transport, "shared", None)
        if follows_dispatch and shared is not None:
            shared.after_combine = False
        capturing = isinstance(expert_out, torch.Tensor) and _capturing(expert_out)  # asked once per call
        together = getattr(self.transport, "combine_exchanges_status", False) and not capturing
        try:
            expert_out, ids, weights, meta, stamps = self._combine_args(expert_out, topk_ids, topk_weights,
                                                                        dispatch_meta, zero_copy, capturing)
        except ValueError as error:
            if not together:
                if self._send_nan_rows(topk_ids, capturing, str(error)):
                    raise ValueError(f"EPLowLatencyAllToAll: {error} (this rank's rows went out as NaN; every "
                                     "rank raises at its next dispatch)") from error
                raise
            # Still take part in the exchange (a poisoned message), carrying the error to every rank.
            _, statuses = self.transport.combine(None, None, None, status=self.step.problem_status(str(error),
                                                                                                    self.device))
            self.step.settle_gathered(statuses, "this combine")
            raise  # settle raised already: this rank's status is bad
        if together:
            slot_rows, statuses = self.transport.combine(expert_out, meta, stamps,
                                                         status=self.step.problem_status(None, self.device))
            self.step.settle_gathered(statuses, "this combine")
        else:
            slot_rows = self.transport.combine(expert_out, meta, stamps)
        self._stamp(stamps, TOPK_REDUCE, START)
        y = self.transport.topk_reduce(slot_rows, ids, weights, self.layout.dtype)
        self._stamp(stamps, TOPK_REDUCE, END)
        self._uncombined = None
        return y

    def _send_nan_rows(self, dispatched, capturing: bool, problem: str) -> bool:
        """A rank whose combine arguments are bad, on a transport whose combine carries no status
        (the GPU's): it still runs the combine of its dispatch (the ``dispatched`` it was given,
        else its last one not combined yet) with NaN rows, so its peers do not wait on its
        rows, and its error goes to every rank with its next dispatch's status (all raise
        there, as the all-to-all's ranks do; the peers' results hold NaN where its rows
        belonged). Nothing to send with one rank, inside a capture, or with no dispatch open
        (False)."""
        if isinstance(dispatched, LowLatencyDispatched) and dispatched.meta is not None:
            state = dispatched.handle.state
            step = (dispatched.meta, state["topk_ids"], state["topk_weights"])
        else:
            step = self._uncombined
        if self.layout.world_size == 1 or capturing or step is None:
            return False
        meta, ids, weights = step
        L = self.layout
        nan_rows = torch.full((L.experts_per_rank, L.capacity, L.hidden), float("nan"), dtype=L.dtype,
                              device=self.device)
        if weights is None:
            weights = torch.ones(ids.shape, dtype=torch.float32, device=self.device)
        slot_rows = self.transport.combine(nan_rows, meta, None)
        self.transport.topk_reduce(slot_rows, ids, weights, L.dtype)
        self._uncombined = None
        self._combine_problem = f"{problem} (found in the previous combine, whose results hold NaN where this " \
                                "rank's rows belonged)"
        return True

    def _combine_args(self, expert_out, topk_ids, topk_weights, dispatch_meta, zero_copy, capturing=False):
        """combine's arguments checked (ValueError) and resolved: (expert_out, ids, weights,
        meta, stamps)."""
        L = self.layout
        if not isinstance(zero_copy, bool):
            raise ValueError(f"zero_copy must be a bool, got {zero_copy!r}")
        from_dispatch = isinstance(topk_ids, Dispatched)
        if from_dispatch:
            if topk_weights is not None or dispatch_meta is not None:
                raise ValueError("combine(expert_out, dispatched) takes the routing from dispatched; "
                                 "pass either a Dispatched or (topk_ids, topk_weights, dispatch_meta)")
            meta, state = _meta_of(topk_ids), topk_ids.handle.state
            ids, weights = state["topk_ids"], state["topk_weights"]
            if weights is None:
                raise ValueError("topk_weights: dispatch was called without weights; pass them to combine as "
                                 "combine(expert_out, topk_ids, topk_weights, dispatch_meta)")
        else:
            if dispatch_meta is None:
                raise ValueError("dispatch_meta is required with combine(expert_out, topk_ids, topk_weights, "
                                 "dispatch_meta)")
            meta, ids, weights = _meta_of(dispatch_meta), topk_ids, topk_weights
        self._check_combine_args(expert_out, ids, weights, meta)
        if L.combine_order == "rank" and not from_dispatch and not capturing:
            self._check_rank_order_weights(weights, meta)
        # Mask what dispatch masked, without reading ids on the host (ids that come from the
        # dispatch are masked already).
        if capturing and not from_dispatch:
            ids = torch.where((ids < -1) | (ids >= L.num_experts), -1, ids)
        return expert_out.contiguous(), ids, weights, meta, self._new_stamps("combine", len(COMBINE_PHASES))

    # -- lifetime, traces ------------------------------------------------------------------

    def finalize(self) -> None:
        """Release the transport's buffers (symmetric memory on the GPU). Idempotent."""
        if not self._closed:
            self._closed = True
            self.transport.close()

    def __enter__(self) -> "EPLowLatencyAllToAll":
        return self

    def __exit__(self, *exc) -> None:
        self.finalize()

    def dump_dispatch_trace(self, path: str | Path | None = None) -> Path:
        """Write the dispatch phases of every profiled call as Chrome/Perfetto trace JSON.

        Default path: ``prof/ll_dispatch_RANK_{rank}.json`` (the paper's). Reads the stamps
        back to the host: call it after the work, e.g. after a barrier.
        """
        return self._dump("dispatch", DISPATCH_PHASES, path)

    def dump_combine_trace(self, path: str | Path | None = None) -> Path:
        """Like :meth:`dump_dispatch_trace` for combine (``prof/ll_combine_RANK_{rank}.json``)."""
        return self._dump("combine", COMBINE_PHASES, path)

    def clear_stamps(self) -> None:
        """Forget the profiled calls recorded so far (e.g. warm-up calls); a captured graph's
        calls stay captured (see :meth:`snapshot_stamps`)."""
        for deque in self._stamps.values():
            deque.clear()

    def snapshot_stamps(self) -> None:
        """Keep what the latest CUDA-graph replay recorded, as one more profiled call.

        A call captured in a graph stamps the same tensor at every replay, so the traces would
        show only the last replay. Call this after each replay has finished (e.g. after
        ``torch.cuda.synchronize()``): it appends a copy of the stamps of the dispatch and
        combine captured last. Without a captured call it does nothing.
        """
        for call, stamps in self._captured_stamps.items():
            self._stamps[call].append(stamps.clone())

    def _dump(self, call: str, phases: tuple[str, ...], path: str | Path | None) -> Path:
        if not self.profile:
            raise RuntimeError(f"nothing to dump: this layer was made with profile=False; "
                               f"pass profile=True to record {call} phases")
        path = Path(path) if path is not None else Path("prof") / f"ll_{call}_RANK_{self.rank}.json"
        stamps = [s.cpu() for s in self._stamps[call]]
        tid = 0 if call == "dispatch" else 1
        events = phase_events(stamps, phases, pid=self.rank, tid=tid, thread_name=call,
                              process_name=f"rank {self.rank}")
        clock = "cpu perf_counter_ns" if self.device.type == "cpu" else "gpu globaltimer"
        return write_trace(path, trace_document(events, metadata=dict(
            call=call, rank=self.rank, world_size=self.world_size, calls=len(stamps), clock=clock,
            max_m=self.layout.max_m, hidden=self.layout.hidden, topk=self.layout.topk,
            num_experts=self.layout.num_experts, online_fp8=self.layout.online_fp8)))

    # -- helpers ---------------------------------------------------------------------------

    def _new_stamps(self, call: str, num_phases: int) -> torch.Tensor | None:
        if not self.profile:
            return None
        stamps = new_stamps(num_phases, self.device)
        self._stamps[call].append(stamps)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._captured_stamps[call] = stamps
        return stamps

    def _stamp(self, stamps: torch.Tensor | None, index: int, which: int) -> None:
        """Stamp a phase the layer runs (postprocess, topk_reduce) unless the transport stamps it.

        A transport whose kernels do that work stamp it themselves (min start / max end over
        their programs) and say so with ``stamps_layer_phases = True``. Otherwise the stamp is
        merged, not stored: the earliest start and the latest end win, and -1 means unset,
        so a transport that fills the phase without saying so keeps its kernel's start.
        """
        if stamps is None or getattr(self.transport, "stamps_layer_phases", False):
            return
        now = new_stamps(1, stamps.device)
        self.transport.stamp(now, 0, which)
        t, current = now[0, which], stamps[index, which]
        if which == START:
            stamps[index, which] = torch.where(current < 0, t, torch.minimum(current, t))
        else:
            stamps[index, which] = torch.maximum(current, t)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this EPLowLatencyAllToAll was finalized; make a new one")

    def _check_tensor(self, name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
        if t.dtype != dtype:
            raise ValueError(f"{name} must have dtype {dtype} (the layer's dtype), got {t.dtype}")
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device}, but this layer's buffers are on {self.device}")

    def _check_rank_order_weights(self, weights: torch.Tensor, meta: LowLatencyMeta) -> None:
        """In the rank order the expert ranks weighted the outputs with the weights sent at
        dispatch; combine's ``topk_weights`` must be those (one host read, eager only)."""
        sent = meta.recv.weights[self.rank, :meta.num_dispatched] if meta.recv is not None else None
        if sent is None or not torch.equal(weights.to(torch.float32), sent):
            raise ValueError("topk_weights: combine_order='rank' sums the weighted outputs on the expert ranks with "
                             "the weights given to dispatch; combine got different weights (pass the same ones, or "
                             "use combine(expert_out, dispatched))")

    def _check_combine_args(self, expert_out, ids, weights, meta: LowLatencyMeta) -> None:
        L = self.layout
        want = (L.experts_per_rank, L.capacity, L.hidden)
        if not isinstance(expert_out, torch.Tensor) or tuple(expert_out.shape) != want:
            raise ValueError(f"expert_out must be [E_local, world * max_m, H] = {list(want)}, got "
                             f"{tuple(expert_out.shape) if isinstance(expert_out, torch.Tensor) else type(expert_out)}")
        self._check_tensor("expert_out", expert_out, L.dtype)
        T = meta.num_dispatched
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or tuple(ids.shape) != (T, L.topk):
            raise ValueError(f"topk_ids must be [T, K] = [{T}, {L.topk}] as in the dispatch, got "
                             f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_ids must be int32 or int64, got dtype {ids.dtype}")
        if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (T, L.topk) \
                or not weights.is_floating_point():
            raise ValueError(f"topk_weights must be a floating-point tensor [T, K] = [{T}, {L.topk}], got "
                             f"{tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__}")
        for name, t in (("topk_ids", ids), ("topk_weights", weights)):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, but this layer's buffers are on {self.device}")


def _meta_of(obj: LowLatencyMeta | Dispatched) -> LowLatencyMeta:
    if isinstance(obj, LowLatencyDispatched) and obj.meta is not None:
        return obj.meta
    if isinstance(obj, LowLatencyMeta):
        return obj
    raise ValueError(f"dispatch_meta must be the LowLatencyMeta (or the result) of this layer's dispatch, "
                     f"got {type(obj).__name__}")


def _default_device(group, distributed: bool) -> torch.device:
    if distributed and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _resolve_device(device, group, distributed: bool) -> torch.device:
    """The layer's device: ``device`` (a bare "cuda" is the current GPU) or the group's default."""
    if device is None:
        return _default_device(group, distributed)
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be a torch.device or a device string, got {device!r} ({error})") from None
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _device_type(device, group, distributed: bool) -> str:
    """The device type ranks must agree on (the index differs from rank to rank, by design)."""
    try:
        return _resolve_device(device, group, distributed).type
    except (ValueError, RuntimeError, AssertionError):
        return repr(device)


def _check_transport_options(layout: LowLatencyLayout, transport) -> None:
    orders = getattr(transport, "combine_orders", ("slot",))
    if layout.combine_order not in orders:
        raise ValueError(f"combine_order={layout.combine_order!r}: the transport {type(transport).__name__} offers "
                         f"{list(orders)}")
    if layout.bounded and not getattr(transport, "bounded_receive", False):
        raise ValueError(f"recv_capacity={layout.recv_capacity}: the transport {type(transport).__name__} has no "
                         "bounded receive buffers")


def make_transport(layout: LowLatencyLayout, group, device: torch.device, *,
                   timeout: float | None = None, slot: int | None = 0) -> Transport:
    """Symmetric memory (Triton) for CUDA devices, gloo collectives for the CPU (``timeout``:
    the gloo transport's bound on a wait for the peers). ``slot``: the shared buffer the
    transport's receive regions live in (:mod:`moekit.ep.lowlatency.pool`; None: its own)."""
    if device.type == "cuda":
        try:
            from moekit.ep.lowlatency.cuda import SymmMemTransport
        except ModuleNotFoundError as error:
            if error.name != "moekit.ep.lowlatency.cuda":
                raise
            raise RuntimeError("the GPU transport (moekit.ep.lowlatency.cuda) is not available in this "
                               "checkout; use CPU tensors (gloo) instead") from error
        return SymmMemTransport(layout, group, device, slot=slot)
    if device.type != "cpu":
        raise ValueError(f"device must be a CUDA device or the CPU, got {device}")
    from moekit.ep.lowlatency.gloo import GlooTransport

    return GlooTransport(layout, group, device, timeout=timeout, slot=slot)
