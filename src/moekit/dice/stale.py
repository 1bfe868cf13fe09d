"""The stale exchange: a fixed-capacity dispatch / combine that never reads the host.

An asynchronous schedule hides an exchange only if nothing on the host waits for it
between issue and use. The eager all-to-all reads the receive sizes on the host once per
dispatch, which stalls the host until every exchange queued before it has finished, so
the next layers' compute is queued late and the exchange is not hidden. This dispatcher
sends fixed-capacity per-peer buffers instead: ``capacity`` rows to every peer, whatever
the routing, so every shape is known when the exchange is issued and the whole path is a
sequence of device operations (and can be captured in a CUDA graph).

It is built on the public phases of :class:`moekit.ep.MaxCountsDispatcher` (``plan`` and
``pack``, or ``plan_and_pack`` where the dispatcher has it; ``exchange``, ``unpack``) with
none of its eager host checks:

* :meth:`StaleExchange.issue` plans and packs this rank's rows and starts the exchange;
  what it returns (:class:`Issued`) is only the received bytes ``[P, capacity, ...]`` and
  the plan, the smallest thing to hold across a step boundary;
* :meth:`StaleExchange.receive` unpacks them into the expert-major layout, on the stream
  that runs the experts, when they are about to run;
* :meth:`StaleExchange.combine` sends the expert outputs back along the same rows and
  places each returned row at its (token, slot).

Overflow. A per-peer count above ``capacity`` cannot be delivered in a fixed buffer. The
exact bound ``capacity = max_tokens * top_k`` never overflows (default). A smaller
capacity (``capacity_factor`` times the balanced share) sends fewer bytes; each dispatch
then ORs its overflow flag into :attr:`StaleExchange.overflowed` (a device tensor, the
same on every rank, since every row carries its sender's largest count), and
:meth:`check` reads it once, after the run, and raises
:class:`~moekit.ep.CapacityOverflowError`: never silent, never on the critical path.

Results are bitwise those of the eager all-to-all: rows travel as bytes, the expert-major
rows are in canonical (source rank, token, slot) order, and combine ends with
:func:`moekit.ep.weighted_slot_sum`, as every dispatcher's combine does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.ep.capspill import CapacityOverflowError, FixedPlan, MaxCountsDispatcher
from moekit.ep.dispatcher import Dispatched, weighted_slot_sum


@dataclass
class Issued:
    """A stale dispatch in flight: the plan of this rank's rows, the received bytes, and the
    input's hidden size and dtype (for the unpack)."""

    plan: FixedPlan
    received: torch.Tensor
    like: torch.Tensor  # an empty [0, H] tensor like the input: dtype, device and H for the unpack


def balanced_capacity(max_rows: int, world_size: int, factor: float | None) -> int:
    """Rows per peer: ``factor`` times the balanced share ``max_rows / P``, clamped to
    [1, max_rows]; None gives the exact bound ``max_rows`` (nothing can overflow)."""
    if factor is None:
        return max_rows
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        raise ValueError(f"capacity_factor must be a positive number or None, got {factor!r}")
    return max(1, min(max_rows, math.ceil(factor * max_rows / world_size)))


class StaleExchange:
    """Fixed-capacity dispatch / combine for ``top_k``-slot rows (the runner sends one row per
    (token, slot), so ``top_k=1``) of at most ``max_tokens`` tokens per call.

    ``capacity``: rows per peer (default the exact bound, ``max_tokens * top_k``), or
    ``capacity_factor``: that many times the balanced share. ``packing``: the fixed-buffer
    phases' implementation where the dispatcher offers a choice (``"auto"``, ``"torch"``,
    ``"triton"``; None: its default). ``group``: the process group
    (a separate one keeps these exchanges off the communicator the synchronous layers use,
    so they do not queue behind each other; see :func:`exchange_group`).
    """

    def __init__(self, num_experts: int, max_tokens: int, *, top_k: int = 1, hidden: int | None = None,
                 dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None,
                 capacity: int | None = None, capacity_factor: float | None = None, packing: str | None = None):
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        bound = max_tokens * top_k
        if capacity is None:
            capacity = balanced_capacity(bound, world, capacity_factor)
        self.fixed = MaxCountsDispatcher(num_experts, capacity, max_tokens, top_k=top_k, group=group, hidden=hidden,
                                         dtype=dtype, raise_on_overflow=False)
        if packing is not None:  # the fixed-buffer phases as torch ops or one-launch kernels (same bytes)
            if not hasattr(self.fixed, "packing"):
                raise ValueError("packing: this MaxCountsDispatcher has no packing choice")
            self.fixed.packing = packing
        self.rank, self.world_size = self.fixed.rank, self.fixed.world_size
        self.num_experts, self.experts_per_rank = num_experts, self.fixed.experts_per_rank
        self.capacity, self.max_tokens, self.top_k = self.fixed.capacity, max_tokens, top_k
        self.overflowed: torch.Tensor | None = None

    # -- the split path (the runner's) -------------------------------------------------------

    def issue(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Issued:
        """Plan, pack and exchange: device work only, on the current stream."""
        if x.shape[0] == 0:  # fixed-shape gathers need a row to read
            x = x.new_zeros(1, x.shape[1])
        x = x.contiguous()
        plan_and_pack = getattr(self.fixed, "plan_and_pack", None)  # one launch where the dispatcher has it
        if plan_and_pack is not None:
            plan, buf = plan_and_pack(x, topk_ids, topk_weights)
        else:
            plan = self.fixed.plan(topk_ids, topk_weights)
            buf = self.fixed.pack(x, plan)
        received = self.fixed.exchange(buf)
        return Issued(plan, received, x.new_empty((0, x.shape[1])))  # not a view: x need not outlive the issue

    def receive(self, issued: Issued) -> Dispatched:
        """The expert-major result of an issued dispatch (device work only)."""
        dispatched = self.fixed.unpack(issued.plan, [issued.received], issued.like)
        flag = dispatched.handle.state["overflow"]
        if self.overflowed is None:
            self.overflowed = flag.clone()
        else:  # in place: a captured step keeps ORing into the same flag at every replay
            self.overflowed |= flag
        return dispatched

    # -- the Dispatcher protocol -------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        return self.receive(self.issue(x, topk_ids, topk_weights))

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """``[T, H]``: every (token, slot)'s expert output, weighted and summed in slot order."""
        state = dispatched.handle.state
        plan: FixedPlan = state["plan"]
        E_local, cap, H = expert_out.shape
        P, rows = self.world_size, state["pass_rows"][0]
        flat = expert_out.reshape(E_local * cap, H)
        # Empty rows point at the spare row past the end: send any real row, its owner never reads it.
        dest = state["dest"].clamp(0, E_local * cap - 1)
        back = flat.index_select(0, dest.reshape(-1)).view(P, rows, H)
        returned = self.fixed.exchange(back).reshape(P * rows, H)
        delivered = (plan.pair_rank < P) & (plan.pair_pos < rows)
        index = plan.pair_rank.clamp(max=P - 1) * rows + plan.pair_pos.clamp(0, rows - 1)
        slot_out = torch.where(delivered.unsqueeze(1), returned.index_select(0, index), returned.new_zeros(()))
        T, K = plan.ids.shape
        y = weighted_slot_sum(slot_out.view(T, K, H), plan.ids, plan.weights, expert_out.dtype)
        return y[:plan.num_tokens]

    def check(self) -> None:
        """One host read, after a run: raise when any dispatch since the last check overflowed."""
        if self.overflowed is not None and bool(self.overflowed):
            self.overflowed = None
            raise CapacityOverflowError(
                f"StaleExchange overflow: a rank routed more than capacity={self.capacity} rows to one peer in some "
                f"dispatch of this run (every rank sees this); raise capacity_factor, or leave it None for the exact "
                f"bound")
        self.overflowed = None

    def message_bytes(self, hidden: int, dtype: torch.dtype) -> int:
        """Bytes one dispatch sends (every peer's buffer, own slice included)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return self.world_size * self.capacity * (self.fixed.header_bytes + hidden * itemsize)


def exchange_group(comm_sms: int | None = None, *, device_type: str = "cuda") -> dist.ProcessGroup | None:
    """A process group of every rank for the stale exchanges (a collective: every rank calls it).

    On NCCL ``comm_sms`` caps the thread blocks (so SMs) each of its collectives may use
    (``ncclConfig_t.maxCTAs`` through ``pg_options``; NCCL 2.17 or later); None leaves NCCL's
    own choice. A separate communicator also has its own stream, so the stale exchanges
    do not queue behind the synchronous layers' or the reverse. On gloo (CPU) a plain new group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if comm_sms is not None and (isinstance(comm_sms, bool) or not isinstance(comm_sms, int) or comm_sms < 1):
        raise ValueError(f"comm_sms must be an int >= 1 or None, got {comm_sms!r}")
    if device_type != "cuda":
        return dist.new_group(backend="gloo")
    options = None
    if comm_sms is not None:
        options = dist.ProcessGroupNCCL.Options()
        options.config.max_ctas = comm_sms  # NCCL's minCTAs defaults to 1, below any cap
    return dist.new_group(backend="nccl", pg_options=options)


__all__ = ["Issued", "StaleExchange", "balanced_capacity", "exchange_group"]
