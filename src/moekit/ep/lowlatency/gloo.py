"""The low-latency layer over gloo (CPU): the same API, layout and results as the GPU
transport, so the semantics are tested in CI.

gloo has no symmetric memory and no list-form all-to-all, so each step is one
``all_to_all_single`` of fixed-size per-destination messages (equal splits):

* dispatch: message to rank d = ``[T, step status | ids (max_m x K) int32 | x rows |
  scales]`` as raw bytes. The step status (:mod:`moekit.ep.agreement`) rides in the same
  collective, so a rank with bad input still sends a well-formed message (T = 0) that
  tells every peer, and all ranks raise together after this one exchange. Row t of x holds token t (FP8 via :func:`moekit.fp8.quantize_groups` when
  ``online_fp8``) only if one of its experts lives on d; every other row is *poisoned* (NaN
  bytes), and ids rows past T hold one of d's own experts, so a receiver that reads a row
  it was not sent gets NaN or a wrong count, and the tests see it. Sending a fixed
  ``max_m`` rows per destination costs bytes the GPU path does not spend; on the CPU that
  only costs time, never results.
* combine: message to rank s = ``[max_m, K, H]`` slot rows: the expert output serving each
  slot of s's tokens that names one of this rank's experts, NaN elsewhere. Rank s takes
  slot (t, k) from the owner of expert ``topk_ids[t, k]``.

Buffers are allocated once per phase (two phases, alternating like the GPU double buffer),
so a :class:`RecvBuffers` stays valid until the same phase is used again, two calls later.
Bytes are copied, never converted, so results are bitwise those of the reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.ep.agreement import STATUS_WORDS
from moekit.ep.lowlatency.layout import LowLatencyLayout, LowLatencyMeta, RecvBuffers, bits_view, destinations
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


class GlooTransport(TransportDefaults):
    """Transport over a gloo process group (or a plain copy when there is one rank and no group).

    ``timeout``: seconds an exchange waits for the peers before raising
    :class:`~moekit.ep.PeerError` (None: the process group's timeout).
    """

    exchanges_status = True  # dispatch(..., status=) carries every rank's step status

    def __init__(self, layout: LowLatencyLayout, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu", *, timeout: float | None = None):
        self.layout, self.group, self.device = layout, group, torch.device(device)
        self.peers = PeerGroup(group, timeout, owner="EPLowLatencyAllToAll")
        world, rank = self.peers.world_size, self.peers.rank
        if (world, rank) != (layout.world_size, layout.rank):
            raise ValueError(f"layout says rank {layout.rank} of {layout.world_size}, but the process group "
                             f"is rank {rank} of {world}")
        L = layout
        # Message segments, in bytes: count (int32) and step status (int64 words), ids, x, scales.
        self._count_bytes = _ALIGN + STATUS_WORDS * 8
        self._ids_bytes = _aligned(L.max_m * L.topk * 4)
        self._x_bytes = _aligned(L.max_m * L.hidden * L.wire_dtype.itemsize)
        self._scale_bytes = _aligned(L.max_m * L.num_groups * 4) if L.online_fp8 else 0
        self.message_bytes = self._count_bytes + self._ids_bytes + self._x_bytes + self._scale_bytes
        P, dev = L.world_size, self.device
        self._send = [torch.zeros(P, self.message_bytes, dtype=torch.uint8, device=dev) for _ in range(2)]
        self._recv = [torch.zeros(P, self.message_bytes, dtype=torch.uint8, device=dev) for _ in range(2)]
        self._combine_send = [torch.empty(P, L.max_m, L.topk, L.hidden, dtype=L.dtype, device=dev) for _ in range(2)]
        self._combine_recv = [torch.empty_like(b) for b in self._combine_send]
        self._dispatch_calls = 0
        self._combine_calls = 0
        self._closed = False

    # -- message segments (typed views of a [P, message_bytes] byte buffer) ------------------

    def _segments(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor | None]:
        L, P = self.layout, self.layout.world_size
        a = self._count_bytes
        b = a + self._ids_bytes
        c = b + self._x_bytes
        count = buf[:, :4].view(torch.int32).view(P)
        status = buf[:, _ALIGN:a].view(torch.int64).view(P, STATUS_WORDS)
        ids = buf[:, a:a + L.max_m * L.topk * 4].view(torch.int32).view(P, L.max_m, L.topk)
        x = buf[:, b:b + L.max_m * L.hidden * L.wire_dtype.itemsize].view(L.wire_dtype).view(P, L.max_m, L.hidden)
        scales = None
        if L.online_fp8:
            scales = buf[:, c:c + L.max_m * L.num_groups * 4].view(torch.float32).view(P, L.max_m, L.num_groups)
        return count, status, ids, x, scales

    def _exchange(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> None:
        self.peers.all_to_all(out, inp, what=what)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this transport was closed (finalize() was called)")

    # -- dispatch --------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, stamps: torch.Tensor | None,
                 status: torch.Tensor | None = None) -> RecvBuffers:
        """The Transport's dispatch; ``status`` (``[STATUS_WORDS]`` int64, optional) is this
        rank's step status, delivered to every rank as ``RecvBuffers.status``."""
        self._check_open()
        L = self.layout
        phase = self._dispatch_calls % 2
        self._dispatch_calls += 1
        T, P, M = x.shape[0], L.world_size, L.max_m
        send, recv = self._send[phase], self._recv[phase]
        count, status_out, ids, xs, scales = self._segments(send)

        host_stamp(stamps, QUANT_AND_PUT, START)
        if L.online_fp8:
            payload, payload_scales = quantize_groups(x, L.group_size)
        else:
            payload, payload_scales = x, None
        needed = destinations(topk_ids, L).t()  # [P, T]: token t goes to rank d
        poison = _poison_bits(L.wire_dtype, x.device)
        xs_bits = bits_view(xs)
        xs_bits.fill_(poison)
        xs_bits[:, :T] = torch.where(needed.unsqueeze(2), bits_view(payload).unsqueeze(0), poison)
        if scales is not None:
            scales.fill_(float("nan"))
            scales[:, :T] = torch.where(needed.unsqueeze(2), payload_scales.unsqueeze(0), scales[:, :T])
        # Rows past T name the destination's first expert: a receiver that forgets to stop at
        # T would take them for real tokens.
        ids.copy_((torch.arange(P, dtype=torch.int32, device=x.device) * L.experts_per_rank).view(P, 1, 1)
                  .expand(P, M, L.topk))
        ids[:, :T] = topk_ids.to(torch.int32).unsqueeze(0)
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
        r_count, r_status, r_ids, r_x, r_scales = self._segments(recv)
        host_stamp(stamps, WAIT, END)
        return RecvBuffers(x=r_x, scales=r_scales, ids=r_ids, num_tokens=r_count,
                           status=None if status is None else r_status)

    # -- combine ---------------------------------------------------------------------------

    def combine(self, expert_out: torch.Tensor, meta: LowLatencyMeta, stamps: torch.Tensor | None) -> torch.Tensor:
        self._check_open()
        L = self.layout
        phase = self._combine_calls % 2
        self._combine_calls += 1
        send, recv = self._combine_send[phase], self._combine_recv[phase]
        P, M, K, H = L.world_size, L.max_m, L.topk, L.hidden

        host_stamp(stamps, COPY_AND_PUT, START)
        flat = bits_view(expert_out).reshape(-1, H)
        rows = flat.index_select(0, meta.slot_row.clamp(min=0).view(-1)).view(P, M, K, H)
        serves = (meta.slot_row >= 0).unsqueeze(3)
        bits_view(send).copy_(torch.where(serves, rows, _poison_bits(L.dtype, send.device)))
        self._exchange(recv, send, "combine exchange")
        host_stamp(stamps, COPY_AND_PUT, END)

        host_stamp(stamps, RECV_WAIT, START)
        # Slot (t, k) of this rank's token came from the owner of expert ids[t, k].
        own_ids = meta.recv.ids[L.rank].to(torch.int64)  # our own routing, as we sent it
        owner = torch.div(own_ids.clamp(0, L.num_experts - 1), L.experts_per_rank, rounding_mode="floor")
        index = owner.view(1, M, K, 1).expand(1, M, K, H)
        slot_rows = bits_view(recv).gather(0, index).view(M, K, H).view(L.dtype)
        host_stamp(stamps, RECV_WAIT, END)
        return slot_rows

    def stamp(self, stamps: torch.Tensor | None, index: int, which: int) -> None:
        host_stamp(stamps, index, which)

    def close(self) -> None:
        self._send = self._recv = self._combine_send = self._combine_recv = []
        self._closed = True
