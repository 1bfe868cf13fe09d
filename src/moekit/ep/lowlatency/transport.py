"""The transport interface of the low-latency layer.

A transport moves the bytes: dispatch delivers every source's tokens (once per destination
rank), routing and token count into this rank's :class:`~moekit.ep.lowlatency.layout.RecvBuffers`;
combine sends each expert output row back to the slots of its source token. The layout
work on either side (postprocess, fan-out, top-k reduce) is plain torch in
:mod:`moekit.ep.lowlatency.layout`; a transport may override it with fused kernels as long
as results stay bitwise the same.

Implementations: :class:`~moekit.ep.lowlatency.gloo.GlooTransport` (CPU, gloo collectives,
the semantics in CI) and ``SymmMemTransport`` in ``moekit.ep.lowlatency.cuda`` (Triton over
torch symmetric memory; GPU).

Profiling. ``stamps`` is an int64 tensor ``[num_phases, 2]`` (start, end in ns of the
transport's clock) on the transport's device, or None when not profiling. The transport
fills its own phases (GPU kernels take min start / max end over their programs); the layer
stamps the phases it runs itself (postprocess, topk_reduce) with :meth:`Transport.stamp`,
merging (earliest start, latest end; -1 = unset) unless the transport sets
``stamps_layer_phases = True`` because its kernels stamp those phases themselves.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

import torch

from moekit.ep.lowlatency import layout as _layout
from moekit.ep.lowlatency.layout import LowLatencyLayout, LowLatencyMeta, RecvBuffers

# Row index of each phase in a stamps tensor. The transport fills the first ones; the layer
# fills the last one of each call (POSTPROCESS, TOPK_REDUCE).
DISPATCH_PHASES = ("quant_and_put", "count_put", "wait", "postprocess")
COMBINE_PHASES = ("copy_and_put", "recv_wait", "topk_reduce")
QUANT_AND_PUT, COUNT_PUT, WAIT, POSTPROCESS = range(4)
COPY_AND_PUT, RECV_WAIT, TOPK_REDUCE = range(3)
START, END = 0, 1


def new_stamps(num_phases: int, device: torch.device | str) -> torch.Tensor:
    """A stamps tensor with every entry -1 (a phase that never ran stays -1)."""
    return torch.full((num_phases, 2), -1, dtype=torch.int64, device=device)


@runtime_checkable
class Transport(Protocol):
    """What :class:`~moekit.ep.lowlatency.EPLowLatencyAllToAll` needs from a transport."""

    layout: LowLatencyLayout
    # Optional attribute: True when the transport's own kernels stamp POSTPROCESS and
    # TOPK_REDUCE (e.g. the fan-out runs inside its receive kernel); the layer then leaves
    # those rows alone. Absent or False: the layer stamps them around the calls.
    # stamps_layer_phases: bool
    # Optional attribute: True when dispatch takes ``status=`` (this rank's step status,
    # ``[STATUS_WORDS]`` int64, see moekit.ep.agreement) and returns every rank's in
    # ``RecvBuffers.status``; the layer then checks all ranks' inputs together, in the one
    # exchange. Absent or False: the layer validates on the host before calling dispatch.
    # exchanges_status: bool
    # Optional attribute: True when combine also takes ``status=`` and then returns (slot rows,
    # every rank's status [world, STATUS_WORDS]); a rank with bad combine arguments calls
    # combine(None, None, None, status=...) to still take part (it gets the statuses only).
    # Absent or False: the layer checks combine's arguments on the host, rank by rank.
    # combine_exchanges_status: bool
    # Optional method dispatch_unchecked(x, topk_ids, num_experts, stamps) -> (RecvBuffers,
    # int32 ids, device bool): dispatch with ids of any int dtype, those outside [-1, E) treated
    # as -1 (returned masked), and whether there were any: what the layer needs under CUDA-graph
    # capture, where the host cannot read the ids. Absent: the layer masks with torch ops.

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, stamps: torch.Tensor | None) -> RecvBuffers:
        """Send token t once to every rank hosting one of its experts (quantized when
        ``layout.online_fp8``), and topk_ids (all T rows) and T to every rank, itself included;
        return when every source's data of this step has arrived. Alternates phases internally.

        ``x [T, H]`` ``layout.dtype`` contiguous, ``topk_ids [T, K]`` int32 contiguous, T <= max_m,
        ids in [-1, E) (the layer validates before calling). A transport that supports
        ``combine_order="rank"`` also takes ``weights=`` (``[T, K]`` float) and delivers them in
        ``RecvBuffers.weights``.
        """
        ...

    def combine(self, expert_out: torch.Tensor, meta: LowLatencyMeta, stamps: torch.Tensor | None) -> torch.Tensor:
        """For each valid received row (e, r) write ``expert_out[e, r]`` to rank ``src_rank``'s
        slot rows ``[src_token, k]`` for every k in ``slot_bits``; return this rank's slot rows
        ``[max_m, K, H]`` (``layout.dtype``) once all have arrived. Slots that no rank served
        (masked, or t >= T) hold unspecified values. With ``layout.combine_order == "rank"``
        it sends each source token's partial (:func:`~moekit.ep.lowlatency.layout.rank_partials`)
        instead and returns ``[max_m, world, H]``, row (t, d) from rank d.

        ``expert_out [E_local, capacity, H]`` ``layout.dtype``.
        """
        ...

    def postprocess(self, recv: RecvBuffers) -> LowLatencyMeta: ...

    def fan_out(self, recv: RecvBuffers, meta: LowLatencyMeta) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def topk_reduce(self, slot_rows: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor: ...

    def stamp(self, stamps: torch.Tensor | None, index: int, which: int) -> None:
        """Write "now" (ns, the transport's clock) into ``stamps[index, which]``; no-op on None."""
        ...

    def close(self) -> None: ...


class TransportDefaults:
    """The layout steps in plain torch, for transports to inherit (or override with kernels)."""

    layout: LowLatencyLayout

    def postprocess(self, recv: RecvBuffers) -> LowLatencyMeta:
        return _layout.postprocess(recv, self.layout)

    def fan_out(self, recv: RecvBuffers, meta: LowLatencyMeta) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _layout.fan_out(recv, meta, self.layout)

    def topk_reduce(self, slot_rows: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
        """The K-slot sum (``combine_order="slot"``), or, in the rank order, the sum of the
        ranks' partials (``slot_rows`` are then ``[max_m, world, H]``: row (t, d) from rank d)."""
        if self.layout.combine_order == "rank":
            return _layout.rank_reduce(slot_rows, topk_ids, self.layout, out_dtype)
        return _layout.topk_reduce(slot_rows, topk_ids, topk_weights, out_dtype)


def host_stamp(stamps: torch.Tensor | None, index: int, which: int) -> None:
    """The CPU clock (``time.perf_counter_ns``) into ``stamps[index, which]``."""
    if stamps is not None:
        stamps[index, which] = time.perf_counter_ns()
