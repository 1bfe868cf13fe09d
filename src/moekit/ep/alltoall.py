"""Eager expert-parallel dispatch/combine over ``all_to_all_single``, at the rate of the wire.

Dispatch, per step:

1. this rank's (token, slot) pairs are sorted by destination expert on the device
   (:func:`moekit.ep.layout.plan_send`) and ONE small all-to-all exchanges the
   per-(rank, expert) counts together with every rank's step status
   (:mod:`moekit.ep.agreement`: ranks fail together on a bad input);
2. ONE host read brings back what was received (message sizes, capacity, statuses), the
   only host read of a step: the layout tables the kernels need are computed from it on the
   host and go back to the device in one asynchronous copy;
3. ONE kernel (:func:`moekit.ep.pack.pack_dispatch`) writes the rows in send order, each
   followed by its (token, slot) metadata, so rows and indices travel in ONE exchange;
4. ONE kernel (:func:`moekit.ep.pack.unpack_dispatch`) lays the received rows out expert-major
   ``[E_local, capacity, H]`` and writes the handle and the tables combine needs.

Combine reads nothing on the host: ONE kernel gathers the expert outputs into the send
buffer (behind each peer's status rows), one exchange sends them home, and ONE kernel
(:func:`moekit.ep.pack.weighted_row_sum`) unpacks and reduces them. With
``combine_order="rank"`` the rank that ran the experts first sums each token's slots it
holds (float32, slot order, rounded once; the same reduction kernel) and sends ONE row per
(token, rank); the token's rank adds those partials in rank order
(:func:`moekit.ep.dispatcher.weighted_rank_sum`). Both orders are bitwise the contract's.

The communication buffers (both directions' send and receive rows, the counts messages) are
kept by the dispatcher and grown when a step needs more, never allocated per call. What a
dispatch returns (tokens, handle, the tables in its state) is allocated per call from the
caching allocator, so several dispatched steps can be combined in any order.

The input checks run in full only when the inputs' shapes, dtypes or devices change; the
expert-id range, which depends on the values, is computed on the device every step and
travels in the counts message. Works on gloo (CPU) and NCCL (GPU); a single process with no
process group runs the same code with the collectives replaced by copies. The kernels are
Triton on CUDA and plain torch on the CPU (bit for bit the same, :mod:`moekit.ep.pack`).

This path sizes everything exactly, so it pads nothing, but it synchronizes with the host
once per dispatch and cannot be captured in a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moekit.ep.agreement import (ID_MAX, ID_MIN, NUMERIC_WORDS, STATUS_BYTES, STATUS_WORDS, StepCheck,
                                  agree_on_config, expert_out_problem, status_rows, statuses_from_rows)
from moekit.ep import agreement
from moekit.ep.checks import check_optional_int
from moekit.ep.dispatcher import Dispatched, DispatchHandle, check_combine_order
from moekit.ep.layout import ExpertPlacement, PlacedExperts, plan_send
from moekit.ep.pack import copy_rows, dispatch_row_bytes, pack_dispatch, unpack_dispatch, weighted_row_sum
from moekit.ep.peers import PeerGroup
from moekit.ep.rank_order import rank_hits


class AllToAllDispatcher(PlacedExperts):
    """Eager dispatcher: exact-size messages, expert-major output with dynamic capacity.

    ``capacity`` of the result is the largest number of rows any local expert received.
    One host read per dispatch (message sizes and every rank's step status); combine reads
    nothing.

    ``hidden``, ``top_k``, ``max_tokens``, ``dtype``: optional limits on the inputs (None:
    any). ``timeout``: seconds a collective on CPU tensors waits for the peers before
    raising :class:`~moekit.ep.PeerError` (None: the process group's timeout; NCCL always
    uses that one, see :mod:`moekit.ep.peers`). ``combine_order``: ``"slot"`` (default) or
    ``"rank"`` (module docstring); the rows combine sends are in ``handle.state["combine_rows"]``.

    Ranks fail together (:mod:`moekit.ep.agreement`): building one checks, in one small
    collective, that every rank passed the same configuration. In ``dispatch``, a bad
    input on any rank (malformed arguments, expert ids outside [-1, E), T > ``max_tokens``,
    x of another H or dtype than the other ranks') travels to every peer in the counts
    message, which that rank still sends, so *every* rank raises the same ValueError naming
    the rank at fault, before any token moves, and the next step pairs up normally.
    ``combine`` likewise: a rank whose ``expert_out`` is not the dispatched tokens' shape and
    dtype still sends its rows (NaN) with its status in front of them, and every rank raises
    the same ValueError (on CPU tensors in that combine; on CUDA tensors at the next dispatch,
    whose host read carries the statuses, see :mod:`moekit.ep.agreement`).
    """

    def __init__(self, num_experts: int, *, group: dist.ProcessGroup | None = None,
                 hidden: int | None = None, top_k: int | None = None, max_tokens: int | None = None,
                 dtype: torch.dtype | None = None, timeout: float | None = None, combine_order: str = "slot"):
        self.peers = PeerGroup(group, owner="AllToAllDispatcher")
        self.group, self.rank, self.world_size = group, self.peers.rank, self.peers.world_size

        def build() -> None:
            self.peers.set_timeout(timeout)
            self.placement = ExpertPlacement(num_experts, self.world_size)
            self.hidden = check_optional_int("hidden", hidden, 1)
            self.top_k = check_optional_int("top_k", top_k, 1)
            self.max_tokens = check_optional_int("max_tokens", max_tokens, 0)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"dtype must be None or a floating-point torch.dtype, got {dtype!r}")
            self.dtype = dtype
            self.combine_order = check_combine_order(combine_order)

        agree_on_config(self.peers, "AllToAllDispatcher", dict(
            num_experts=num_experts, hidden=hidden, top_k=top_k, max_tokens=max_tokens, dtype=dtype,
            world_size=self.world_size, placement="contiguous", combine_order=combine_order), build)
        self.step = StepCheck("AllToAllDispatcher", self.peers, self.num_experts, hidden=self.hidden,
                              top_k=self.top_k, max_tokens=self.max_tokens, dtype=self.dtype)

        self._buffers = RowBuffers()
        self._checked: tuple | None = None  # the inputs' description when the full check last passed
        self._status_words: torch.Tensor | None = None  # that step's status, id range left to each step
        self._ok_rows: dict = {}  # "ok" combine status rows per (device, row bytes)

    @property
    def needs_cuda(self) -> bool:
        return self.peers.needs_cuda

    # -- dispatch ----------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        P, E_local = self.world_size, self.experts_per_rank
        by_rank = self.combine_order == "rank"
        ok, words = self._status(x, topk_ids, topk_weights)
        device = words.device
        width = E_local + 1 + STATUS_WORDS
        message = self._buffers.get("message", device, P, width * 8).view(torch.int64)
        plan = hit = None
        if ok:
            plan = plan_send(topk_ids, self.placement)
            message[:, :E_local] = plan.counts
        else:  # still take part in the step: an empty contribution that carries the error
            message[:, :E_local] = 0
        # Rank order: the partial rows combine will return, one per (token, rank); each rank
        # learns how many it sends back to each source in the same counts message.
        if by_rank and ok:
            owner = self.placement.rank_of(topk_ids.to(torch.int64))
            hit = rank_hits(torch.where((topk_ids >= 0) & (topk_ids < self.num_experts), owner, -1), P)  # [T, P]
            message[:, E_local] = hit.sum(0)
        else:
            message[:, E_local] = 0
        message[:, E_local + 1:] = words
        if ok and topk_ids.numel():  # the id range, on the device, checked by every rank below
            message[:, E_local + 1 + ID_MIN:E_local + 2 + ID_MAX] = torch.stack(torch.aminmax(topk_ids)).to(torch.int64)
        received = self._buffers.get("message_in", device, P, width * 8).view(torch.int64)
        self.peers.all_to_all(received, message, what="counts exchange")  # row s: what rank s sends us

        # The one host read of a step: what every rank sends us (with its status), what we
        # send, and a previous combine's statuses still to be read (CUDA).
        pending = self.step.pending_flags()
        parts = [received.reshape(-1), message[:, :E_local + 1].reshape(-1)]
        host = torch.cat(parts + ([] if pending is None else [pending.to(torch.int64)])).cpu().numpy()
        if pending is not None:
            self.step.raise_pending(host[-P:].tolist())
        got = host[:P * width].reshape(P, width)
        sent = host[P * width:P * width + P * (E_local + 1)].reshape(P, E_local + 1)
        statuses = torch.from_numpy(got[:, E_local + 1:].copy())
        self.step.settle(got[:, E_local + 1:E_local + 1 + NUMERIC_WORDS].tolist(),
                         lambda s: statuses[s, NUMERIC_WORDS:])
        T, H = x.shape
        K = topk_ids.shape[1]
        sizes = StepSizes(got[:, :E_local], got[:, E_local], sent[:, :E_local].sum(1), sent[:, E_local],
                          self._head_rows(H * x.element_size()), by_rank)
        table = _upload(sizes.table(), device)
        layout, counts, group_start, head_send, head_recv, rank_base = sizes.split(table)

        # Rows in send order, with their metadata; one exchange.
        row_bytes = dispatch_row_bytes(H, x.element_size())
        send = self._buffers.get("send", device, sizes.num_send, row_bytes)
        slot_row = None if by_rank else torch.full((T * K,), -1, dtype=torch.int64, device=device)
        group_of = weights32 = None
        if by_rank:
            as_int = hit.to(torch.int64)
            group_of = torch.cumsum(as_int, 0) - as_int  # [T, P]: t's group among the tokens it sends d
            weights32 = topk_weights.reshape(-1).to(torch.float32)
        pack_dispatch(x, plan.order, sizes.num_send, topk_ids, E_local, sizes.head_rows, send, slot_row,
                      group_of, weights32)
        recv = self._buffers.get("recv", device, sizes.num_recv, row_bytes)
        self.peers.all_to_all(recv, send, sizes.recv_splits, sizes.send_splits, what="token exchange")

        # Expert-major result, handle, and combine's tables: one kernel.
        capacity = sizes.capacity
        tokens = torch.empty(E_local, capacity, H, dtype=x.dtype, device=device)
        handle = torch.empty(3, E_local, capacity, dtype=torch.int64, device=device)
        back = torch.empty(2, sizes.num_recv, dtype=torch.int64, device=device)
        cells = cell_weights = part_dst = None
        if by_rank:
            G = sizes.num_groups
            cells = torch.full((G * K,), -1, dtype=torch.int64, device=device)
            cell_weights = torch.empty(G * K, dtype=torch.float32, device=device)
            part_dst = torch.empty(G, dtype=torch.int64, device=device)
        unpack_dispatch(recv, layout, P, E_local, capacity, H, x.dtype, K, sizes.head_rows, tokens=tokens,
                        handle=handle, back_src=back[0], back_dst=back[1], cells=cells, cell_weights=cell_weights,
                        part_dst=part_dst, group_start=group_start)

        # The weights are kept by reference (the slot order reads them in combine); which slots
        # combine sums was fixed here, in slot_row / rank_row.
        state = dict(top_k=K, num_tokens=T, topk_ids=topk_ids, topk_weights=topk_weights, sizes=sizes,
                     send_splits=sizes.send_splits, recv_splits=sizes.recv_splits, back=back,
                     head_send=head_send, head_recv=head_recv,
                     combine_rows=sizes.num_groups if by_rank else sizes.num_recv)
        if by_rank:
            state.update(return_splits=sizes.return_splits, partial_splits=sizes.group_splits, cells=cells,
                         cell_weights=cell_weights, part_dst=part_dst,
                         rank_row=torch.where(hit, rank_base.unsqueeze(0) + group_of, -1))
        else:
            state.update(slot_row=slot_row)
        return Dispatched(tokens, counts, DispatchHandle(handle[0], handle[1], handle[2], state))

    # -- combine -----------------------------------------------------------------------------

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """[T, H] in the dispatched tokens' dtype. ``expert_out``: their shape and dtype.

        With several ranks every rank's status travels in front of its rows (one status per
        peer: ``STATUS_WORDS`` int64), so a bad ``expert_out`` on one rank fails every rank
        together (class docstring). No host read."""
        state = dispatched.handle.state
        tokens = dispatched.tokens
        sizes: StepSizes = state["sizes"]
        problem = expert_out_problem(expert_out, tokens)
        if self.world_size == 1 and problem is not None:  # no peer waits for this rank
            raise ValueError(problem)
        if problem is not None:  # still take part, with rows nobody will use
            expert_out = torch.full_like(tokens, float("nan"))
        E_local, capacity, H = tokens.shape
        dtype, device = tokens.dtype, tokens.device
        row_bytes = H * tokens.element_size()
        expert_rows = expert_out.contiguous().view(E_local * capacity, H)
        by_rank = "cells" in state
        hr, P = sizes.head_rows, self.world_size

        # Rows home, behind each peer's status rows.
        out_rows = sizes.num_groups if by_rank else sizes.num_recv
        send = self._buffers.get("combine_send", device, out_rows + P * hr, row_bytes)
        if by_rank:  # this rank's partial sum per (token, this rank), straight into the send buffer
            K = state["top_k"]
            weighted_row_sum(expert_rows, state["cells"].view(-1, K), state["cell_weights"].view(-1, K),
                             send.view(dtype), out_row=state["part_dst"])
        else:
            back = state["back"]
            copy_rows(expert_rows.view(torch.uint8), back[0], send, back[1], sizes.num_recv)
        if hr:
            send[state["head_send"]] = self._status_rows(problem, device, row_bytes).repeat(P, 1)
        in_splits = sizes.return_splits if by_rank else sizes.send_splits
        out_splits = sizes.group_splits if by_rank else sizes.recv_splits
        received = self._buffers.get("combine_recv", device, sum(in_splits) + P * hr, row_bytes)
        self.peers.all_to_all(received, send, [n + hr for n in in_splits], [n + hr for n in out_splits],
                              what="token exchange")
        if hr:
            self._settle_combine(statuses_from_rows(received[state["head_recv"]].view(P, hr, row_bytes)), problem)

        # Unpack and reduce: one kernel.
        T, K = state["num_tokens"], state["top_k"]
        y = torch.empty(T, H, dtype=dtype, device=device)
        if by_rank:
            return weighted_row_sum(received.view(dtype), state["rank_row"], None, y)
        return weighted_row_sum(received.view(dtype), state["slot_row"].view(T, K), state["topk_weights"], y)

    # -- helpers -----------------------------------------------------------------------------

    def _status(self, x, topk_ids, topk_weights) -> tuple[bool, torch.Tensor]:
        """(ok, this rank's ``STATUS_WORDS`` status with the id range still to be written).

        The full check (:meth:`StepCheck.inspect`) runs when the inputs' shapes, dtypes or
        devices differ from the last ones that passed it; what it checks depends on nothing
        else, so a step like the last passes it again."""
        key = _describe_inputs(x, topk_ids, topk_weights)
        if key is not None and key == self._checked:
            return True, self._status_words
        status = self.step.inspect(x, topk_ids, topk_weights)
        if not status.ok:
            self._checked = None
            return False, status.words
        words = status.words.clone()
        words[ID_MIN:ID_MAX + 1] = -1
        self._checked, self._status_words = key, words
        return True, words

    def _head_rows(self, row_bytes: int) -> int:
        """Status rows in front of each peer's rows in combine (none with one rank)."""
        return 0 if self.world_size == 1 else -(-STATUS_BYTES // row_bytes)

    def _status_rows(self, problem: str | None, device: torch.device, row_bytes: int) -> torch.Tensor:
        """This rank's combine status as rows of ``row_bytes`` bytes; the "ok" one is kept."""
        if problem is not None:
            return status_rows(self.step.problem_status(problem, device), row_bytes)
        key = (device, row_bytes)
        if key not in self._ok_rows:
            self._ok_rows[key] = status_rows(self.step.problem_status(None, device), row_bytes)
        return self._ok_rows[key]

    def _settle_combine(self, statuses: torch.Tensor, problem: str | None) -> None:
        """Every rank's combine status: in host memory (gloo) read it here, as numpy (it is
        already on the host: no copy, no sync), and raise on every rank together; on the
        device leave it for the next dispatch's host read (:meth:`StepCheck.settle_combine`)."""
        if agreement.host_readable(statuses):  # (looked up at call time: tests stand in for CUDA)
            numeric = statuses[:, :NUMERIC_WORDS].numpy().tolist()
            self.step.settle(numeric, lambda s: statuses[s, NUMERIC_WORDS:], "this combine")
        else:
            self.step.settle_combine(statuses, problem)


class StepSizes:
    """A step's sizes, on the host, from the counts every rank sent (numpy int64).

    ``recv_counts [P, E_local]``: rows from source s for local expert e; ``recv_groups [P]``:
    rank-order partials this rank returns to s; ``send_rows [P]`` / ``send_groups [P]``: the
    rows this rank sends to d / the partials d returns. ``head_rows``: status rows in front of
    each peer's rows in combine; ``by_rank``: the combine order is "rank".
    """

    def __init__(self, recv_counts: np.ndarray, recv_groups: np.ndarray, send_rows: np.ndarray,
                 send_groups: np.ndarray, head_rows: int, by_rank: bool):
        self.recv_counts = recv_counts
        self.head_rows, self.by_rank = head_rows, by_rank
        self.P, self.E = recv_counts.shape
        self.send_splits = send_rows.tolist()
        self.recv_splits = recv_counts.sum(1).tolist()
        self.return_splits = send_groups.tolist()  # partials coming back from each rank
        self.group_splits = recv_groups.tolist()  # partials going back to each source
        self.num_send, self.num_recv = sum(self.send_splits), sum(self.recv_splits)
        self.num_groups = sum(self.group_splits)
        self.expert_counts = recv_counts.sum(0)
        self.capacity = int(self.expert_counts.max()) if self.expert_counts.size else 0

    def table(self) -> np.ndarray:
        """Everything the kernels need, as one int64 array (one copy to the device): ``layout
        [3, P, E]`` (count, start inside the expert, first received row, of every (source,
        expert)), the expert counts ``[E]``, each source's first group ``[P]``, combine's
        status rows in its send and its receive buffer ``[P * head_rows]`` each, and where
        each rank's partials begin in the rank order's receive buffer ``[P]``."""
        c, hr = self.recv_counts, self.head_rows
        flat = c.reshape(-1)
        start = np.cumsum(c, 0) - c
        row = (np.cumsum(flat) - flat).reshape(c.shape)
        groups = np.asarray(self.group_splits, dtype=np.int64)
        back_out = np.asarray(self.group_splits if self.by_rank else self.recv_splits, dtype=np.int64)
        back_in = np.asarray(self.return_splits if self.by_rank else self.send_splits, dtype=np.int64)
        rank_base = np.cumsum(back_in + hr) - back_in  # = rows of earlier ranks + this rank's status rows
        steps = np.arange(hr, dtype=np.int64)

        def heads(n: np.ndarray) -> np.ndarray:  # peer s's status rows follow the rows of the peers before it
            base = np.cumsum(n + hr) - (n + hr)
            return (base[:, None] + steps[None, :]).reshape(-1)

        return np.concatenate([c, start, row, self.expert_counts, np.cumsum(groups) - groups, heads(back_out),
                               heads(back_in), rank_base], axis=None).astype(np.int64)

    def split(self, table: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """:meth:`table`'s parts, as views of the device copy."""
        P, E, hr = self.P, self.E, self.head_rows
        layout, counts, group_start, head_send, head_recv, rank_base = table.split(
            [3 * P * E, E, P, P * hr, P * hr, P])
        return layout.view(3, P, E), counts, group_start, head_send, head_recv, rank_base


class RowBuffers:
    """Byte buffers kept across calls, by name: a call gets a ``[rows, row_bytes]`` uint8 view
    of the named buffer, which is replaced by a larger one only when it is too small (by at
    least a quarter more, so a slowly growing size does not reallocate every step)."""

    def __init__(self):
        self._held: dict[str, torch.Tensor] = {}

    def get(self, name: str, device: torch.device, rows: int, row_bytes: int) -> torch.Tensor:
        need = rows * row_bytes
        held = self._held.get(name)
        if held is None or held.device != device or held.numel() < need:
            size = need if held is None or held.device != device else max(need, held.numel() + held.numel() // 4)
            held = self._held[name] = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
        return held[:need].view(rows, row_bytes)


def _upload(table: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host table on ``device`` without a sync: through pinned memory, asynchronously (the
    caching host allocator keeps the pinned copy until the transfer is done)."""
    host = torch.from_numpy(table)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _describe_inputs(x, topk_ids, topk_weights) -> tuple | None:
    """What the full input check depends on (shapes, dtypes, devices), or None when an input
    is not a tensor."""
    if not all(isinstance(t, torch.Tensor) for t in (x, topk_ids, topk_weights)):
        return None
    return tuple((tuple(t.shape), t.dtype, t.device) for t in (x, topk_ids, topk_weights))
