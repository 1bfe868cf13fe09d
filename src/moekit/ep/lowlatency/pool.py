"""One low-latency buffer per process: the receive regions every layer shares.

The receive regions of a low-latency layer (what the peers write into: dispatch tokens,
scales, routing rows, counts, statuses, the combine slot rows and the arrival counters)
are only live *during* an exchange: the dispatch kernel fans the received rows out into
the layer's own expert-major result before it returns, and the combine reduces the slot
rows into the layer's own output. So every layer of a model can use the same regions, one
exchange after the other, as DeepEP's one ``Buffer`` per process does: the memory no
longer grows with the number of layers. What stays per layer is what outlives an exchange
(the expert-major tokens, the meta, the combine output: a dispatch's result must survive
other layers' dispatches, e.g. DICE's displaced schedule runs a layer's experts a step
after its dispatch).

A :class:`SharedBuffer` belongs to one (transport kind, process group, device, slot). A
slot is one sequence of exchanges: layers on one slot must run their dispatches and
combines on one stream, in the same order on every rank (as any collective must). Two
exchanges that may run at the same time (two streams) need two slots. Inside a slot the
regions are double-buffered by a step counter shared by all its layers (the phase of an
exchange is its index on the slot modulo 2), so a layer's dispatch may be followed by
other layers' dispatches and combines before its own combine (dispatch A, dispatch B,
combine A, combine B). The rules (docs/lowlatency.md, "One buffer per process"):

* a dispatch's result (tokens, scales, counts, meta, output of its combine) lives until the
  same layer's next dispatch (combine), as before;
* the :class:`~moekit.ep.lowlatency.layout.RecvBuffers` views of a dispatch live until the
  second dispatch after it on the slot, by any layer;
* on the GPU, a combine that follows another combine with no dispatch between them
  synchronizes with every peer (one more signal per peer), so that no rank can run two
  combines ahead of another; a combine after a dispatch does not need to.

Sizing and growth. The regions are laid out for the largest layer of the slot: each region
is as large as the largest layer needs (:func:`symm_region_bytes`), and each layer reads
and writes a prefix of it. A layer larger than the current buffer grows it, which on the
GPU is a collective: symmetric memory is allocated and exchanged (rendezvous) by every rank
together. Layers are built by every rank in the same order (their construction is
collective already), and the registration all-reduces (max) the region sizes over the
group, so every rank grows to the same size at the same point; growing waits for the
device and the peers, frees the old buffer and resets the slot's step counters. A CUDA
graph captured before a growth points at the old buffer: build every layer first, then
capture.

:func:`buffer_report` says what a configuration allocates per rank, with a buffer per layer
and with one shared buffer (``moekit bench lowlatency --memory``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moekit.ep.agreement import STATUS_WORDS
from moekit.ep.lowlatency.layout import LowLatencyLayout

ALIGN = 256  # every region starts at a multiple of 256 bytes (16-byte vector accesses in the kernels)
STATUS_ROW = STATUS_WORDS + 1  # one status row per source: the step status words, then the masked-id flag
TOK_STRIDE = 32  # the combine's per-token arrival counters: int32, one per 128-byte line
# Regions with two phases, in buffer order; then the counters (dcnt: dispatch arrivals, tok:
# combine per-token arrivals (two phases), scnt: spill-round arrivals, ccnt: combine barrier).
PHASED = ("x", "s", "i", "t", "w", "st", "c")
SPILL = ("sx", "ss")


def _round_up(n: int, m: int = ALIGN) -> int:
    return -(-int(n) // m) * m


def symm_region_bytes(layout: LowLatencyLayout) -> dict[str, int]:
    """Bytes of one phase of each symmetric region a layer needs (``tok``: the combine's
    arrival counters, one phase; ``cnt``: the dispatch, spill and combine-barrier counters,
    both phases)."""
    L = layout
    W, M, H, K = L.world_size, L.max_m, L.hidden, L.topk
    x_elem = 1 if L.online_fp8 else L.dtype.itemsize
    ng = L.num_groups if L.online_fp8 else 0
    C, S = L.recv_rows, max(L.spill_rows_per_round, 1)
    by_rank = L.combine_order == "rank"
    return dict(
        x=_round_up(W * C * H * x_elem), s=_round_up(max(W * C * ng * 4, 1)),
        i=_round_up(W * M * K * 4), t=_round_up(W * 4), w=_round_up(W * M * K * 4 if by_rank else 1),
        st=_round_up(W * STATUS_ROW * 8), c=_round_up(M * (W if by_rank else K) * H * L.dtype.itemsize),
        sx=_round_up(W * S * H * x_elem if L.bounded else 1), ss=_round_up(max(W * S * ng * 4, 1) if L.bounded else 1),
        tok=_round_up(M * TOK_STRIDE * 4), cnt=_round_up(2 * W * 8))


def merge_sizes(a: dict[str, int] | None, b: dict[str, int]) -> dict[str, int]:
    """Region by region, the larger of two layouts' needs (the shared buffer's sizes)."""
    return dict(b) if a is None else {k: max(a[k], b[k]) for k in b}


@dataclass(frozen=True)
class SymmOffsets:
    """Where each region's phase 0 starts in a symmetric buffer of region sizes ``sizes``
    (phase 1 follows at ``+ sizes[name]``), and the buffer's bytes."""

    sizes: dict
    offsets: dict
    nbytes: int

    @staticmethod
    def of(sizes: dict[str, int]) -> "SymmOffsets":
        off, at = {}, 0
        for name in PHASED:
            off[name] = at
            at += 2 * sizes[name]
        off["dcnt"] = at
        at += sizes["cnt"]
        off["tok"] = at
        at += 2 * sizes["tok"]
        for name in SPILL:
            off[name] = at
            at += 2 * sizes[name]
        off["scnt"] = at
        at += sizes["cnt"]
        off["ccnt"] = at
        at += sizes["cnt"]
        return SymmOffsets(sizes=dict(sizes), offsets=off, nbytes=at)


def symm_bytes(layouts: list[LowLatencyLayout]) -> int:
    """Bytes of ONE symmetric buffer sized for all of ``layouts`` (what a shared slot holds)."""
    sizes = None
    for layout in layouts:
        sizes = merge_sizes(sizes, symm_region_bytes(layout))
    return SymmOffsets.of(sizes).nbytes if sizes is not None else 0


def layer_local_bytes(layout: LowLatencyLayout) -> int:
    """Bytes a layer holds on its own on the GPU whatever the sharing: the expert-major result
    (tokens, scales, meta), the combine output and small per-layer state (what
    :meth:`LowLatencyLayout.buffer_bytes` calls ``result``, plus the output and the masked ids)."""
    L = layout
    extra = L.max_m * L.hidden * L.dtype.itemsize + L.max_m * L.topk * 4 * (2 if L.combine_order == "rank" else 1)
    if L.combine_order == "rank":
        extra += L.world_size * L.max_m * L.topk * 4  # the received weights, kept for the combine
    return L.buffer_bytes()["result"] + extra


def buffer_report(layouts: list[LowLatencyLayout], slots: int = 1) -> dict[str, int]:
    """Device bytes per rank the low-latency layers of a model allocate (``expert_out``, the
    caller's, not counted): ``per_layer``: a symmetric buffer per layer (the layout before the
    shared buffer); ``shared``: ``slots`` shared buffers sized by the largest layer;
    ``symm_per_layer`` / ``symm_shared``: their symmetric parts; ``local``: what every layer
    keeps on its own either way."""
    if not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be an int >= 1, got {slots!r}")
    symm_each = sum(symm_bytes([layout]) for layout in layouts)
    symm_shared = slots * symm_bytes(layouts)
    local = sum(layer_local_bytes(layout) for layout in layouts)
    return dict(layers=len(layouts), slots=slots, symm_per_layer=symm_each, symm_shared=symm_shared, local=local,
                per_layer=symm_each + local, shared=symm_shared + local)


# --------------------------------------------------------------------------- the registry


class SharedBuffer:
    """The receive regions of one slot, shared by every layer on it (subclassed by each
    transport). ``users``: layers holding it; ``sizes``: region sizes it is laid out for;
    ``dispatch_calls``: dispatches on the slot so far (the host's phase count);
    ``after_combine``: whether the latest exchange on the slot was a combine."""

    def __init__(self, key):
        self.key = key
        self.users = 0
        self.sizes: dict[str, int] | None = None
        self.generation = 0  # bumped at every (re)allocation
        self.dispatch_calls = 0
        self.combine_calls = 0
        self.after_combine = False

    def reserve(self, sizes: dict[str, int]) -> None:
        """Make room for a layer needing ``sizes`` (a collective on the GPU); then count it as a user."""
        raise NotImplementedError

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.free()
            _POOLS.pop(self.key, None)

    def free(self) -> None:
        raise NotImplementedError

    def note_dispatch(self) -> int:
        """A dispatch is starting: its phase (0/1)."""
        phase = self.dispatch_calls % 2
        self.dispatch_calls += 1
        self.after_combine = False
        return phase

    def note_combine(self) -> tuple[int, bool]:
        """A combine is starting: (its phase, whether it follows another combine directly)."""
        phase = self.combine_calls % 2
        self.combine_calls += 1
        follows = self.after_combine
        self.after_combine = True
        return phase, follows


_POOLS: dict = {}


def shared_buffer(key, make: Callable[[], SharedBuffer]) -> SharedBuffer:
    """The process's shared buffer for ``key``, made by ``make()`` the first time."""
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = make()
    return pool


def live_buffers() -> dict:
    """The shared buffers alive in this process: key -> (users, bytes or None)."""
    return {k: (p.users, getattr(p, "nbytes", None)) for k, p in _POOLS.items()}


def check_slot(slot) -> None:
    if slot is not None and (isinstance(slot, bool) or not isinstance(slot, int) or slot < 0):
        raise ValueError(f"buffer_slot must be an int >= 0 (layers on one slot share the buffer) or None (a "
                         f"buffer of the layer's own), got {slot!r}")


def group_key(group) -> str:
    """A name for the process group that is the same on every rank."""
    import torch.distributed as dist

    if group is None:
        return "world" if dist.is_available() and dist.is_initialized() else "none"
    return str(getattr(group, "group_name", id(group)))


def device_key(device: torch.device) -> str:
    return str(device)
