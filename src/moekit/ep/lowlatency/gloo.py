"""The low-latency layer over gloo (CPU): the same API, layout and results as the GPU
transport, so the semantics are tested in CI.

gloo has no symmetric memory and no list-form all-to-all, so each step is one
``all_to_all_single`` of fixed-size per-destination messages (equal splits), whose segments
are the layout's receive regions (:meth:`LowLatencyLayout.receive_region_bytes`):

* dispatch: message to rank d = ``[T, step status | ids (max_m x K) int32 | weights
  (max_m x K) float32, rank order only | x rows | scales]`` as raw bytes. The step status
  (:mod:`moekit.ep.agreement`) rides in the same collective, so a rank with bad input still
  sends a well-formed message (T = 0) that tells every peer, and all ranks raise together
  after this one exchange. With the worst-case layout row t of x holds token t (FP8 via
  :func:`moekit.fp8.quantize_groups` when ``online_fp8``) only if one of its experts lives on
  d; with a bounded layout (``recv_capacity`` C) row j holds the j-th token that goes to d,
  j < C, and the rest follow in spill rounds of ``[spill_rows]`` rows per destination, each
  fanned out into the expert-major result before the next one. Every row that carries no
  token is *poisoned* (NaN bytes), and ids rows past T hold one of d's own experts, so a
  receiver that reads a row it was not sent gets NaN or a wrong count, and the tests see it.
  Sending a fixed number of rows per destination costs bytes the GPU path does not spend;
  on the CPU that only costs time, never results.
* combine, ``combine_order="slot"``: message to rank s = ``[max_m, K, H]`` slot rows: the
  expert output serving each slot of s's tokens that names one of this rank's experts, NaN
  elsewhere. Rank s takes slot (t, k) from the owner of expert ``topk_ids[t, k]``.
  ``combine_order="rank"``: message to rank s = ``[max_m, H]``, the partial sum of each of
  s's tokens over its slots here (K times fewer bytes), NaN where it has none; rank s adds
  the partials of the ranks its token names, in rank order. Either message starts with the
  sender's step status (``STATUS_WORDS`` int64), so a rank with bad combine arguments still
  sends a well-formed (all NaN) message that tells every peer, and all ranks raise together.

The messages are allocated once per phase (two phases, alternating like the GPU double
buffer) in the slot's shared buffer (:mod:`moekit.ep.lowlatency.pool`), sized by the largest
layer on the slot and used by all of them in turn, so a :class:`RecvBuffers`' tokens stay
valid until the same phase is used again, two dispatches later on the slot; its routing
rows, weights, counts and statuses are the layer's own copies (its combine reads them).
Bytes are copied, never converted, so results are bitwise those of the reference.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moekit.ep.agreement import STATUS_WORDS
from moekit.ep.lowlatency import layout as _layout
from moekit.ep.lowlatency.layout import (LowLatencyLayout, LowLatencyMeta, RecvBuffers, bits_view, destinations,
                                         fan_out_window, rank_partials, received_streams, spill_rounds, stream_counts,
                                         window_tokens)
from moekit.ep.lowlatency.pool import SharedBuffer, device_key, group_key, merge_sizes, shared_buffer
from moekit.ep.lowlatency.transport import (COPY_AND_PUT, COUNT_PUT, END, QUANT_AND_PUT, RECV_WAIT, START, WAIT,
                                            TransportDefaults, host_stamp)
from moekit.ep.peers import PeerGroup
from moekit.fp8 import quantize_groups

_ALIGN = 16  # every segment of a message starts on a 16-byte boundary (so typed views work)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _poison_bits(dtype: torch.dtype, device) -> torch.Tensor:
    """A NaN of ``dtype`` as a 0-d tensor of its integer view (see ``bits_view``).

    float8_e4m3fn has no infinity and NaN = 0x7F/0xFF; for the wider formats, a float NaN.
    """
    if dtype.itemsize == 1:
        return torch.tensor(0x7F, dtype=torch.uint8, device=device)
    return bits_view(torch.tensor([float("nan")], dtype=dtype, device=device))[0]


class _Rows:
    """Segments of a ``[P, bytes]`` message that carry token rows: x and (FP8) scales."""

    def __init__(self, layout: LowLatencyLayout, rows: int, offset: int):
        self.layout, self.rows, self.offset = layout, rows, offset
        self.x_bytes = _aligned(rows * layout.hidden * layout.wire_dtype.itemsize)
        self.scale_bytes = _aligned(rows * layout.num_groups * 4) if layout.online_fp8 else 0
        self.nbytes = self.x_bytes + self.scale_bytes

    def views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        L, P, a = self.layout, self.layout.world_size, self.offset
        x = buf[:, a:a + self.rows * L.hidden * L.wire_dtype.itemsize].view(L.wire_dtype).view(P, self.rows, L.hidden)
        scales = None
        if L.online_fp8:
            b = a + self.x_bytes
            scales = buf[:, b:b + self.rows * L.num_groups * 4].view(torch.float32).view(P, self.rows, L.num_groups)
        return x, scales


class GlooTransport(TransportDefaults):
    """Transport over a gloo process group (or a plain copy when there is one rank and no group).

    ``timeout``: seconds an exchange waits for the peers before raising
    :class:`~moekit.ep.PeerError` (None: the process group's timeout). Supports both
    combine orders and the bounded layout (``layout.recv_capacity``).
    """

    exchanges_status = True  # dispatch(..., status=) carries every rank's step status
    combine_exchanges_status = True  # combine(..., status=) too
    combine_orders = ("slot", "rank")
    bounded_receive = True  # layout.recv_capacity < max_m: spill rounds

    def __init__(self, layout: LowLatencyLayout, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu", *, timeout: float | None = None, slot: int | None = None):
        self.layout, self.group, self.device = layout, group, torch.device(device)
        self.peers = PeerGroup(group, timeout, owner="EPLowLatencyAllToAll")
        world, rank = self.peers.world_size, self.peers.rank
        if (world, rank) != (layout.world_size, layout.rank):
            raise ValueError(f"layout says rank {layout.rank} of {layout.world_size}, but the process group "
                             f"is rank {rank} of {world}")
        L = layout
        # Message segments, in bytes: count (int32) and step status (int64 words), ids,
        # weights (rank order), then the token rows.
        self._count_bytes = _ALIGN + STATUS_WORDS * 8
        self._ids_bytes = _aligned(L.max_m * L.topk * 4)
        self._weight_bytes = _aligned(L.max_m * L.topk * 4) if L.combine_order == "rank" else 0
        self._main = _Rows(L, L.recv_rows, self._count_bytes + self._ids_bytes + self._weight_bytes)
        self._spill = _Rows(L, L.spill_rows_per_round, 0)
        self.message_bytes = self._main.offset + self._main.nbytes
        P, dev = L.world_size, self.device
        # Combine message: the step status (int64 words), then the rows ([max_m, K, H] or [max_m, H]).
        per_token = (L.topk,) if L.combine_order == "slot" else ()
        self._combine_rows = (L.max_m, *per_token, L.hidden)
        self._combine_bytes = STATUS_WORDS * 8 + _aligned(L.max_m * math.prod(per_token) * L.hidden * L.dtype.itemsize)
        # The messages live in the slot's shared buffer (moekit.ep.lowlatency.pool), sized by the
        # largest layer on it; this layer uses a prefix of each. What outlives the exchange (the
        # routing rows and weights this layer's combine reads) is copied into the layer's own.
        self.slot = slot
        sizes = dict(msg=self.message_bytes, spill=self._spill.nbytes, comb=self._combine_bytes)
        if slot is None:
            self.shared = GlooSharedBuffer(None, P, dev)
        else:
            key = ("gloo", group_key(group), device_key(dev), P, slot)
            self.shared = shared_buffer(key, lambda: GlooSharedBuffer(key, P, dev))
        self.shared.reserve(sizes)
        self._ids_local = torch.zeros(P, L.max_m, L.topk, dtype=torch.int32, device=dev)
        self._weights_local = (torch.zeros(P, L.max_m, L.topk, dtype=torch.float32, device=dev)
                               if self._weight_bytes else None)
        self._built: tuple[RecvBuffers, LowLatencyMeta, torch.Tensor, torch.Tensor | None] | None = None
        self._closed = False

    # -- message segments (typed views of a [P, message_bytes] byte buffer) ------------------

    def _segments(self, buf: torch.Tensor):
        L, P = self.layout, self.layout.world_size
        a = self._count_bytes
        b = a + self._ids_bytes
        count = buf[:, :4].view(torch.int32).view(P)
        status = buf[:, _ALIGN:a].view(torch.int64).view(P, STATUS_WORDS)
        ids = buf[:, a:a + L.max_m * L.topk * 4].view(torch.int32).view(P, L.max_m, L.topk)
        weights = None
        if self._weight_bytes:
            weights = buf[:, b:b + L.max_m * L.topk * 4].view(torch.float32).view(P, L.max_m, L.topk)
        x, scales = self._main.views(buf)
        return count, status, ids, weights, x, scales

    @property
    def _combine_recv(self) -> list[torch.Tensor]:
        """The rows segment of each phase's combine receive message (typed views)."""
        return [self._combine_segments(self.shared.view("comb_recv", p, self._combine_bytes))[1] for p in (0, 1)]

    def _exchange(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> None:
        self.peers.all_to_all(out, inp, what=what)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this transport was closed (finalize() was called)")

    # -- dispatch --------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, stamps: torch.Tensor | None,
                 status: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> RecvBuffers:
        """The Transport's dispatch; ``status`` (``[STATUS_WORDS]`` int64, optional) is this
        rank's step status, delivered to every rank as ``RecvBuffers.status``; ``weights``
        (``[T, K]``, the rank order only) travel beside the ids."""
        self._check_open()
        L = self.layout
        phase = self.shared.note_dispatch()
        T, P, M = x.shape[0], L.world_size, L.max_m
        send, recv = self.shared.view("send", phase, self.message_bytes), self.shared.view("recv", phase,
                                                                                          self.message_bytes)
        count, status_out, ids, weights_out, xs, scales = self._segments(send)

        host_stamp(stamps, QUANT_AND_PUT, START)
        if L.online_fp8:
            payload, payload_scales = quantize_groups(x, L.group_size)
        else:
            payload, payload_scales = x, None
        needed = destinations(topk_ids, L)  # [T, P]: token t goes to rank d
        if L.bounded:
            self._put_window(xs, scales, payload, payload_scales, window_tokens(needed, 0, L.recv_rows))
        else:
            poison = _poison_bits(L.wire_dtype, x.device)
            xs_bits = bits_view(xs)
            xs_bits.fill_(poison)
            xs_bits[:, :T] = torch.where(needed.t().unsqueeze(2), bits_view(payload).unsqueeze(0), poison)
            if scales is not None:
                scales.fill_(float("nan"))
                scales[:, :T] = torch.where(needed.t().unsqueeze(2), payload_scales.unsqueeze(0), scales[:, :T])
        # Rows past T name the destination's first expert: a receiver that forgets to stop at
        # T would take them for real tokens.
        ids.copy_((torch.arange(P, dtype=torch.int32, device=x.device) * L.experts_per_rank).view(P, 1, 1)
                  .expand(P, M, L.topk))
        ids[:, :T] = topk_ids.to(torch.int32).unsqueeze(0)
        if weights_out is not None:
            weights_out.fill_(float("nan"))
            if weights is not None:
                weights_out[:, :T] = weights.to(torch.float32).unsqueeze(0)
        host_stamp(stamps, QUANT_AND_PUT, END)

        host_stamp(stamps, COUNT_PUT, START)
        count.fill_(T)
        if status is None:
            status_out.zero_()
        else:
            status_out.copy_(status.view(1, STATUS_WORDS).expand(P, STATUS_WORDS))
        self._exchange(recv, send, "dispatch exchange")  # one collective carries tokens, ids, counts and status
        host_stamp(stamps, COUNT_PUT, END)

        host_stamp(stamps, WAIT, START)  # gloo returned: everything has arrived
        r_count, r_status, r_ids, r_weights, r_x, r_scales = self._segments(recv)
        # The routing rows and weights are read again by this layer's combine, after other
        # layers may have reused the shared messages: the layer keeps its own copy.
        self._ids_local.copy_(r_ids)
        if r_weights is not None:
            self._weights_local.copy_(r_weights)
        received = RecvBuffers(x=r_x, scales=r_scales, ids=self._ids_local, num_tokens=r_count.clone(),
                               status=None if status is None else r_status.clone(), weights=self._weights_local)
        host_stamp(stamps, WAIT, END)
        self._built = None
        if L.bounded:
            self._receive_bounded(received, needed, payload, payload_scales, phase)
        return received

    def _put_window(self, xs: torch.Tensor, scales: torch.Tensor | None, payload: torch.Tensor,
                    payload_scales: torch.Tensor | None, table: torch.Tensor) -> None:
        """Row i of destination d's segment = token ``table[d, i]``, poison where it is -1."""
        L = self.layout
        poison = _poison_bits(L.wire_dtype, xs.device)
        filled = (table >= 0).unsqueeze(2)
        token = table.clamp(min=0)
        source = bits_view(payload)
        if source.shape[0] == 0:  # T = 0: nothing to read, every row is poison
            bits_view(xs).fill_(poison)
            if scales is not None:
                scales.fill_(float("nan"))
            return
        bits_view(xs).copy_(torch.where(filled, source[token], poison))
        if scales is not None:
            scales.copy_(torch.where(filled, payload_scales[token], torch.full_like(scales, float("nan"))))

    def _receive_bounded(self, recv: RecvBuffers, needed: torch.Tensor, payload: torch.Tensor,
                         payload_scales: torch.Tensor | None, phase: int) -> None:
        """Fan out the first C rows of every source, then run the spill rounds (each fanned
        out before the next one reuses the spill buffers). The number of rounds follows from
        the routing rows every rank received, so every rank runs the same rounds."""
        L = self.layout
        meta = _layout.postprocess(recv, L)
        streams = received_streams(recv, L)  # [max_m, world]: what each source sent here
        spare = L.experts_per_rank * L.capacity
        tokens = bits_view(recv.x).new_empty(spare + 1, L.hidden)
        scales = recv.scales.new_empty(spare + 1, L.num_groups) if L.online_fp8 else None

        def fan_out(x: torch.Tensor, x_scales: torch.Tensor | None, table: torch.Tensor) -> None:
            fan_out_window(tokens, bits_view(x), table, meta, L)
            if scales is not None:
                fan_out_window(scales, x_scales, table, meta, L)

        fan_out(recv.x, recv.scales, window_tokens(streams, 0, L.recv_rows))
        counts = stream_counts(recv, L)  # [source, destination] tokens, the same on every rank
        recv.overflow = (counts[:, L.rank] - L.recv_rows).clamp(min=0)
        recv.spill_rounds = rounds = int(spill_rounds(counts, L))  # gloo runs on the host anyway
        S = L.spill_rows_per_round
        send, into = (self.shared.view("spill_send", phase, self._spill.nbytes),
                      self.shared.view("spill_recv", phase, self._spill.nbytes))
        for r in range(rounds):
            first = L.recv_rows + r * S
            xs, x_scales = self._spill.views(send)
            self._put_window(xs, x_scales, payload, payload_scales, window_tokens(needed, first, S))
            self._exchange(into, send, f"spill round {r + 1} of {rounds}")
            got, got_scales = self._spill.views(into)
            fan_out(got, got_scales, window_tokens(streams, first, S))
        shape = (L.experts_per_rank, L.capacity)
        self._built = (recv, meta, tokens[:spare].view(*shape, L.hidden).view(L.wire_dtype),
                       scales[:spare].view(*shape, L.num_groups) if scales is not None else None)

    def postprocess(self, recv: RecvBuffers) -> LowLatencyMeta:
        if self._built is not None and self._built[0] is recv:  # built while the spill rounds ran
            return self._built[1]
        return super().postprocess(recv)

    def fan_out(self, recv: RecvBuffers, meta: LowLatencyMeta) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._built is not None and self._built[0] is recv:
            return self._built[2], self._built[3]
        return super().fan_out(recv, meta)

    # -- combine ---------------------------------------------------------------------------

    def _combine_segments(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(status ``[P, STATUS_WORDS]`` int64, rows ``[P, *rows]`` in the layer's dtype) of a combine message."""
        L, P = self.layout, self.layout.world_size
        status = buf[:, :STATUS_WORDS * 8].view(torch.int64)
        count = math.prod(self._combine_rows)
        rows = buf[:, STATUS_WORDS * 8:STATUS_WORDS * 8 + count * L.dtype.itemsize].view(L.dtype)
        return status, rows.view(P, *self._combine_rows)

    def combine(self, expert_out: torch.Tensor | None, meta: LowLatencyMeta | None, stamps: torch.Tensor | None,
                status: torch.Tensor | None = None):
        """The Transport's combine; with ``status`` (this rank's step status, ``[STATUS_WORDS]``
        int64) it returns (the slot rows, every rank's status ``[P, STATUS_WORDS]``). A rank
        whose combine arguments were bad passes ``expert_out=None, meta=None`` and its error in
        ``status``: it sends NaN rows and gets no rows back (None), only the statuses."""
        self._check_open()
        L = self.layout
        phase, _ = self.shared.note_combine()  # gloo's collectives order the steps: no extra sync needed
        send_buf = self.shared.view("comb_send", phase, self._combine_bytes)
        recv_buf = self.shared.view("comb_recv", phase, self._combine_bytes)
        status_out, send = self._combine_segments(send_buf)
        r_status, recv = self._combine_segments(recv_buf)
        P, M, K, H = L.world_size, L.max_m, L.topk, L.hidden
        poison = _poison_bits(L.dtype, send.device)
        if status is None:
            status_out.zero_()
        else:
            status_out.copy_(status.view(1, STATUS_WORDS).expand(P, STATUS_WORDS))
        if expert_out is None:  # bad arguments here: a well-formed message that carries the error
            bits_view(send).fill_(poison)
            self._exchange(recv_buf, send_buf, "combine exchange")
            return None, r_status

        host_stamp(stamps, COPY_AND_PUT, START)
        if L.combine_order == "rank":
            # One partial row per source token with slots here: K times fewer bytes.
            serves = (meta.slot_row >= 0).any(2, keepdim=True)  # [P, M, 1]
            bits_view(send).copy_(torch.where(serves, bits_view(rank_partials(expert_out, meta, L)), poison))
        else:
            flat = bits_view(expert_out).reshape(-1, H)
            rows = flat.index_select(0, meta.slot_row.clamp(min=0).view(-1)).view(P, M, K, H)
            serves = (meta.slot_row >= 0).unsqueeze(3)
            bits_view(send).copy_(torch.where(serves, rows, poison))
        self._exchange(recv_buf, send_buf, "combine exchange")
        host_stamp(stamps, COPY_AND_PUT, END)

        host_stamp(stamps, RECV_WAIT, START)
        if L.combine_order == "rank":
            slot_rows = recv.transpose(0, 1)  # [M, P, H]: token t's partial from every rank
        else:
            # Slot (t, k) of this rank's token came from the owner of expert ids[t, k].
            own_ids = meta.recv.ids[L.rank].to(torch.int64)  # our own routing, as we sent it
            owner = torch.div(own_ids.clamp(0, L.num_experts - 1), L.experts_per_rank, rounding_mode="floor")
            index = owner.view(1, M, K, 1).expand(1, M, K, H)
            slot_rows = bits_view(recv).gather(0, index).view(M, K, H).view(L.dtype)
        host_stamp(stamps, RECV_WAIT, END)
        return slot_rows if status is None else (slot_rows, r_status)

    def stamp(self, stamps: torch.Tensor | None, index: int, which: int) -> None:
        host_stamp(stamps, index, which)

    def close(self) -> None:
        if self._closed:
            return
        self._built = None
        self._closed = True
        self.shared.release()


class GlooSharedBuffer(SharedBuffer):
    """The gloo transport's messages of one slot (two phases each): dispatch send / receive,
    spill send / receive, combine send / receive, each a flat byte buffer as large as the
    largest layer's message to all ranks. A layer views a prefix as ``[P, its bytes]``
    (contiguous: ``all_to_all_single`` takes it as is). Growing reallocates locally; every
    rank grows alike since every rank builds the same layers."""

    NAMES = ("send", "recv", "spill_send", "spill_recv", "comb_send", "comb_recv")
    SIZE_OF = dict(send="msg", recv="msg", spill_send="spill", spill_recv="spill", comb_send="comb",
                   comb_recv="comb")

    def __init__(self, key, world_size: int, device: torch.device):
        super().__init__(key)
        self.world_size, self.device = world_size, device
        self.buffers: dict[str, list[torch.Tensor]] = {}

    def reserve(self, sizes: dict[str, int]) -> None:
        grown = merge_sizes(self.sizes, sizes)
        if grown != self.sizes:
            P = self.world_size
            self.buffers = {name: [torch.zeros(P * max(grown[self.SIZE_OF[name]], 1), dtype=torch.uint8,
                                               device=self.device) for _ in range(2)] for name in self.NAMES}
            self.sizes = grown
            self.generation += 1
        self.users += 1

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for bufs in self.buffers.values() for b in bufs)

    def view(self, name: str, phase: int, nbytes: int) -> torch.Tensor:
        """``[P, nbytes]`` bytes at the front of phase ``phase`` of message ``name``."""
        return self.buffers[name][phase][:self.world_size * nbytes].view(self.world_size, nbytes)

    def free(self) -> None:
        self.buffers = {}
