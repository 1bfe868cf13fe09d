"""This rank's view of its peers: rank, world size, the device collectives use, and the
collectives themselves with a bounded wait.

Every dispatcher talks to its peers through a :class:`PeerGroup`, so the rules live in one
place:

* with one rank and no process group, a collective is a copy (the single-process mode);
* a collective on CPU tensors (gloo) waits at most ``timeout`` seconds for the peers, then
  raises :class:`PeerError`. Without this a rank whose peer stopped calling (it hangs, or
  caught an error and went on elsewhere) would wait for the process group's timeout, which
  is often many minutes. CUDA tensors (NCCL) keep the process group's own timeout: waiting
  on them from the host would add a host sync to every step and break CUDA-graph capture;
  :func:`moekit.ep.launch` sets that timeout;
* any failure of a collective (a dead peer closes its sockets, a wait times out) becomes a
  :class:`PeerError` that says what was being done, so the survivors of a crashed rank get
  a clear error instead of a backend message.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from moekit.ep.checks import check_timeout


class PeerError(RuntimeError):
    """A collective with the other ranks failed or timed out (a peer died, hangs, or stopped
    calling this dispatcher). The process group is not usable after this."""


class PeerGroup:
    """Rank, world size and collectives of one process group (or of a single process)."""

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: float | None = None, *,
                 owner: str = "dispatcher"):
        self.group = group
        self.owner = owner
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        backend = str(dist.get_backend(group)) if self.distributed else ""
        # A pure NCCL group moves only CUDA tensors; a mixed "cpu:gloo,cuda:nccl" one moves both.
        self.needs_cuda = "nccl" in backend and "gloo" not in backend
        self.timeout = check_timeout(timeout)

    @property
    def device(self) -> torch.device:
        """Where this group's small messages (configuration, step status) live."""
        if self.needs_cuda:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def set_timeout(self, timeout: float | None) -> None:
        self.timeout = check_timeout(timeout)

    # -- collectives -----------------------------------------------------------------------

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None, *, what: str = "all-to-all") -> torch.Tensor:
        """``all_to_all_single`` into ``out`` (equal splits unless given); returns ``out``."""
        if self.world_size == 1:
            return out.copy_(inp)
        self._run(what, inp, lambda async_op: dist.all_to_all_single(
            out, inp.contiguous(), out_splits, in_splits, group=self.group, async_op=async_op))
        return out

    def all_gather(self, t: torch.Tensor, *, what: str = "all-gather") -> torch.Tensor:
        """``[world_size, *t.shape]``: row r is rank r's ``t`` (an all-to-all of ``t`` sent to
        every rank, which every backend supports in every torch version we run on)."""
        row = t.reshape(1, -1)
        out = row.new_empty(self.world_size, row.shape[1])
        self.all_to_all(out, row.expand(self.world_size, row.shape[1]), what=what)
        return out.view(self.world_size, *t.shape)

    def all_reduce_max(self, t: torch.Tensor, *, what: str = "all-reduce") -> torch.Tensor:
        if self.world_size > 1:
            self._run(what, t, lambda async_op: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group,
                                                                async_op=async_op))
        return t

    def _run(self, what: str, t: torch.Tensor, start) -> None:
        bounded = self.timeout is not None and t.device.type == "cpu"
        try:
            work = start(bounded)
            if bounded:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as error:  # DistBackendError and gloo's errors are RuntimeErrors
            raise self._peer_error(what, error) from error

    def _peer_error(self, what: str, error: BaseException) -> PeerError:
        text = str(error).strip()
        cause = text.splitlines()[0] if text else type(error).__name__
        bound = (f"the timeout of {self.timeout:g} s" if self.timeout is not None
                 else "the process group's timeout")
        return PeerError(
            f"{self.owner} on rank {self.rank} of {self.world_size}: the {what} with the other ranks failed "
            f"(a peer died, hangs, or stopped calling this {self.owner} in step with the others; waits are "
            f"bounded by {bound}): {cause}")
