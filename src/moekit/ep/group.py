"""Process groups and local launches.

``launch(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on every rank and
returns the per-rank results:

* from a plain ``python`` process it spawns ``world_size`` local processes, with gloo on
  CPU, or NCCL (one GPU per rank) when there are at least ``world_size`` GPUs. The parent
  hosts the rendezvous store on a socket it binds to 127.0.0.1 itself (so nothing listens
  on other interfaces, and no port is picked and then lost to a race), and the ranks'
  own sockets use the loopback interface;
* under ``torchrun`` (RANK / WORLD_SIZE in the environment) every process calls
  ``launch`` itself: the group is initialized from the environment, ``fn`` runs once in
  this process, and the returned list holds only this rank's result.

Results travel back to the parent pickled by value, so return tensors, numbers or dicts
of them; keep them small.

Failures are bounded. The parent watches every rank: a rank that raises sends its error
back, a rank that dies (a crash, ``os._exit``, a signal) is seen through its process
handle. After the first failure the other ranks get ``timeout`` seconds to finish or to
fail on their own (a collective with a dead peer fails: gloo at once when the peer's
sockets close, NCCL within the process group's timeout, which is ``timeout`` too); the ones
still running then are stopped, and :class:`RankFailedError` reports what happened on every
rank, the first failure first.

Ranks never outlive their launcher. Each rank asks the kernel to kill it when the launching
process goes (``PR_SET_PDEATHSIG`` on Linux), and a thread of it watches ``os.getppid()``,
so a launcher killed outright (SIGKILL) takes its ranks with it; and while ``launch`` waits
in the main thread with SIGTERM at its default action, a SIGTERM first stops the ranks, then
ends the launcher as SIGTERM would have.
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekit.ep.checks import check_timeout
from moekit.ep.peers import PeerError

LOCALHOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 300.0
_STOP_GRACE_S = 5.0  # how long a rank that was asked to stop (SIGTERM) has before SIGKILL
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): the signal this process gets when its parent dies
_FORK_SERVER_ENV: dict | None = None  # the import-time variables of the first launch through the fork server
# Environment variables that torch, Triton, their libraries and moekit may read at import time.
_IMPORT_TIME_PREFIXES = ("TRITON", "MOEKIT", "TORCH", "PYTORCH", "NCCL", "GLOO", "OMP", "MKL", "KMP", "CUDA",
                         "LD_", "PYTHON")
_PARENT_POLL_S = 0.5  # how often a rank looks for a new parent (the fallback of PR_SET_PDEATHSIG)


class RankFailedError(mp.ProcessRaisedException):
    """One or more ranks of a :func:`launch` failed: raised, died, or were stopped.

    ``failures``: rank -> one line saying what happened to it; ``results``: the results of
    the ranks that finished (None elsewhere). The message ends with one summary line, the
    first failure first, after the first failed rank's traceback (when it raised). A
    subclass of torch's ``ProcessRaisedException``, so code that catches that keeps working.
    """

    def __init__(self, message: str, first_rank: int, first_pid: int, failures: dict[int, str],
                 results: list[Any]):
        super().__init__(message, first_rank, first_pid)
        self.failures = failures
        self.results = results

    def __reduce__(self):
        return (type(self), (self.msg, self.error_index, self.pid, self.failures, self.results))


def default_backend(world_size: int) -> str:
    """NCCL when every rank can have its own GPU, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
           timeout: float = DEFAULT_TIMEOUT_S, timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results by rank.

    ``fn`` must be importable by a fresh interpreter (a module-level function): the ranks
    start from a clean process, not as copies of this one (spawned for NCCL; for gloo forked
    from a fork server that has imported torch and moekit, see :func:`_start_context`). Each
    rank has joined the default process group (``backend``: gloo or NCCL, default
    :func:`default_backend`) before ``fn`` is called; under NCCL its current CUDA device is
    ``cuda:rank``.

    ``timeout`` (seconds): the process group's timeout (rendezvous and every collective
    without a shorter bound of its own), and, once a rank has failed, how long the others
    may take to finish or fail before they are stopped. ``timeout_s`` is its older name.

    Raises :class:`RankFailedError` when any rank raised, died or had to be stopped;
    ValueError for a bad ``world_size`` or ``timeout``.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    timeout = check_timeout(timeout if timeout_s is None else timeout_s)
    if timeout is None:
        raise ValueError("timeout must be a positive, finite number of seconds, got None")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return [_run_under_torchrun(fn, world_size, args, backend, timeout)]
    backend = backend or default_backend(world_size)
    ctx = _start_context(backend)
    forked = ctx.get_start_method() == "forkserver"
    store, port = _rendezvous_store(world_size, timeout)
    ranks = []
    sigterm = _SigtermGuard()
    try:
        sigterm.install()
        for rank in range(world_size):
            receiver, sender = ctx.Pipe(duplex=False)  # one pipe per rank: a dying rank corrupts nothing shared
            process = ctx.Process(target=_worker, name=f"moekit-rank-{rank}",
                                  args=(rank, world_size, port, backend, timeout, fn, args, sender, os.getpid(),
                                        dict(os.environ), _LauncherStreams() if forked else None))
            process.start()
            sender.close()  # the parent keeps only the reading end, so a dead rank reads as EOF
            ranks.append(_Rank(rank, process, receiver))
        return _supervise(ranks, timeout)
    except _Terminated:
        pass  # the ranks are stopped below; then SIGTERM does what it would have done
    finally:
        sigterm.stopping = True  # a SIGTERM from here on waits until the ranks are stopped
        for r in ranks:  # nothing outlives launch, whatever interrupted it
            _stop(r.process)
            r.receiver.close()
        del store  # now, not whenever an exception's frame is collected: it closes its socket
        sigterm.restore()
    raise SystemExit(128 + signal.SIGTERM)  # only if the SIGTERM could not be delivered at once


class _Terminated(BaseException):
    """SIGTERM arrived while :func:`launch` waited: unwinds it so that it stops its ranks."""


class _SigtermGuard:
    """While ``launch`` runs, SIGTERM stops the ranks before it ends the process.

    Installed only over SIGTERM's default action and in the main thread (Python runs
    signal handlers there only); a handler the caller installed, or SIG_IGN, is theirs. The
    first SIGTERM raises :class:`_Terminated` where ``launch`` waits; one that arrives once
    the ranks are being stopped is held; :meth:`restore` then puts the default action back
    and delivers it.
    """

    def __init__(self) -> None:
        self.previous = None
        self.stopping = False
        self.received = False

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self.previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True
        if not self.stopping:
            self.stopping = True
            raise _Terminated()

    def restore(self) -> None:
        if self.previous is None:
            return
        signal.signal(signal.SIGTERM, self.previous)
        if self.received:
            os.kill(os.getpid(), signal.SIGTERM)


def _rendezvous_store(world_size: int, timeout: float):
    """The rendezvous store, served from this process on a socket bound to 127.0.0.1 here
    (so nothing listens on other interfaces, and no port is picked and then lost to a race)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOCALHOST, 0))
        listener.listen()
        port = listener.getsockname()[1]
        store = dist.TCPStore(LOCALHOST, port, world_size + 1, is_master=True, wait_for_workers=False,
                              master_listen_fd=listener.fileno(), timeout=datetime.timedelta(seconds=timeout))
    except BaseException:
        listener.close()
        raise
    # The store owns the socket from here on and closes it when it goes; closing it here too
    # would close a descriptor number some later file may have been given.
    listener.detach()
    return store, port


class _Rank:
    """The parent's handle on one rank: its process, its result pipe, and what it reported."""

    def __init__(self, rank: int, process, receiver):
        self.rank, self.process, self.receiver = rank, process, receiver
        # ("ok", result) | ("error", line, traceback, is_peer_error) | ("died", line) | ("stopped", line)
        self.outcome: tuple | None = None
        self.failed_at: float | None = None

    def read(self) -> None:
        """Take this rank's report from the pipe; a closed pipe with no report means it died."""
        try:
            kind, *payload = pickle.loads(self.receiver.recv_bytes())
        except (EOFError, OSError):
            self.process.join(_STOP_GRACE_S)
            self.outcome = ("died", _death(self.process))
        else:
            self.outcome = (kind, *payload)
        if self.outcome[0] != "ok":
            self.failed_at = time.monotonic()


def _supervise(ranks: list[_Rank], timeout: float) -> list[Any]:
    """Collect every rank's report; once one failed, give the others ``timeout`` s, then stop them.

    A rank that reported its result still closes the group with the others; if that fails
    (it exits non-zero), a peer never got there, which starts the same deadline.
    """
    pending = {r.rank: r for r in ranks}
    closing = {}  # ranks that reported a result and have not exited yet
    deadline: float | None = None
    while pending:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        waitables = {}
        for r in pending.values():
            waitables[r.receiver] = r
            waitables[r.process.sentinel] = r
        for r in closing.values():
            waitables[r.process.sentinel] = r
        ready = multiprocessing.connection.wait(list(waitables), timeout=wait)
        if not ready:  # the deadline passed
            for r in pending.values():
                _stop(r.process)
                r.outcome = ("stopped", f"still running {timeout:g} s after another rank failed or gave up on "
                                        "it; stopped")
            break
        for obj in ready:
            r = waitables[obj]
            if r.rank in closing:
                r.process.join(_STOP_GRACE_S)
                if not r.process.is_alive():
                    del closing[r.rank]
                    if r.process.exitcode and deadline is None:
                        deadline = time.monotonic() + timeout
                continue
            if r.rank not in pending:
                continue
            if obj is r.receiver or r.receiver.poll():
                r.read()
            else:  # exited without writing a report
                r.process.join(_STOP_GRACE_S)  # its sentinel fires before it can be reaped
                r.outcome = ("died", _death(r.process))
                r.failed_at = time.monotonic()
            del pending[r.rank]
            if r.outcome[0] == "ok":
                closing[r.rank] = r
            elif deadline is None:
                deadline = r.failed_at + timeout
    failed = [r for r in ranks if r.outcome[0] != "ok"]
    # Successful ranks leave after a barrier; give them time to close cleanly (one shared
    # allowance: with a failed peer their barrier cannot succeed, and launch stops them).
    until = time.monotonic() + (_STOP_GRACE_S if failed else timeout)
    for r in ranks:
        if r.outcome[0] == "ok":
            r.process.join(max(0.0, until - time.monotonic()))
    results = [r.outcome[1] if r.outcome[0] == "ok" else None for r in ranks]
    if not failed:
        return results
    raise _failure(ranks, failed, results)


def _failure(ranks: list[_Rank], failed: list[_Rank], results: list[Any]) -> RankFailedError:
    order = sorted(failed, key=lambda r: (_rank_of_cause(r), r.failed_at or float("inf"), r.rank))
    first = order[0]
    lines = {r.rank: _describe(r) for r in failed}
    summary = (f"launch: {len(failed)} of {len(ranks)} ranks failed; "
               + "; ".join(f"rank {r.rank}: {lines[r.rank]}" for r in order))
    message = summary
    raised = next((r for r in order if r.outcome[0] == "error"), None)
    if raised is not None:  # the traceback of the first rank that raised
        message = f"rank {raised.rank} raised:\n{raised.outcome[2].rstrip()}\n\n{summary}"
    return RankFailedError(message, first.rank, first.process.pid or -1, lines, results)


def _rank_of_cause(r: _Rank) -> int:
    """Likely causes first: a rank that died, then one that raised on its own, then one
    whose collective failed because of a peer, then one that had to be stopped."""
    kind = r.outcome[0]
    if kind == "died":
        return 0
    if kind == "error":
        return 2 if r.outcome[3] else 1
    return 3


def _describe(r: _Rank) -> str:
    kind = r.outcome[0]
    if kind == "error":
        return r.outcome[1]
    if kind == "died":
        return f"died without a result ({r.outcome[1]})"
    return r.outcome[1]


def _death(process) -> str:
    code = process.exitcode
    if code is None:
        return "it closed its result pipe without a result and did not exit"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _stop(process) -> None:
    """End a rank that is still running: SIGTERM, then SIGKILL."""
    if process.is_alive():
        process.terminate()
        process.join(_STOP_GRACE_S)
    if process.is_alive():
        process.kill()
        process.join()


def _worker(rank: int, world_size: int, port: int, backend: str, timeout: float,
            fn: Callable[..., Any], args: tuple, sender, parent: int, environment: dict, streams) -> None:
    # ``streams`` (a _LauncherStreams, or None) did its work when the arguments were unpickled.
    _die_with_parent(parent)
    if os.environ != environment:  # a rank of the fork server: the launcher's environment, as spawned
        os.environ.clear()
        os.environ.update(environment)
    try:
        result = _run_rank(rank, world_size, port, backend, timeout, fn, args)
        # Plain pickle copies tensors by value; torch's pickler would share memory that
        # dies with this process.
        report = pickle.dumps(("ok", result))
    except BaseException as error:  # noqa: BLE001 (everything goes back to the parent)
        line = f"{type(error).__name__}: {error}".strip().splitlines()[0] if str(error) else type(error).__name__
        # A PeerError is a consequence (a peer failed first): the parent lists causes first.
        sender.send_bytes(pickle.dumps(("error", line, traceback.format_exc(), isinstance(error, PeerError))))
        sender.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave at once: a peer may be stuck in a collective with us, and tearing the group
        # down (or the interpreter's exit handlers) could block on it.
        os._exit(1)
    sender.send_bytes(report)
    sender.close()
    # Only on success, all ranks together: a gloo rank whose peer has already closed its
    # sockets aborts. If a peer failed, this fails too, after the result was delivered:
    # exit non-zero, which tells the parent a peer never arrived.
    try:
        _close_group()
    except BaseException:  # noqa: BLE001
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)


def _start_context(backend: str):
    """How ranks start. NCCL ranks are spawned (a fresh interpreter each). gloo ranks on Linux
    are forked from a fork server, a clean process started once (the first launch) that has
    imported torch and moekit, so a rank starts in a fraction of a second instead of importing
    torch again (seconds per rank on a small CPU); like a spawned one, it starts from that
    clean state, not from a copy of the launcher. Each rank takes the launcher's environment
    (:func:`_worker`); but what torch, Triton and moekit read when they are imported was read in
    the server, so a launch whose variables of that kind (:data:`_IMPORT_TIME_PREFIXES`) differ
    from the server's spawns its ranks instead."""
    global _FORK_SERVER_ENV
    if backend == "nccl" or not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    environment = {k: v for k, v in os.environ.items() if k.startswith(_IMPORT_TIME_PREFIXES)}
    if _FORK_SERVER_ENV is None:
        _FORK_SERVER_ENV = environment
    elif environment != _FORK_SERVER_ENV:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "moekit.ep"])
    return ctx


class _LauncherStreams:
    """The launcher's standard output and error as they are when it starts a rank, for a rank of
    the fork server (whose own are the server's): pickled as the two file descriptors, which the
    rank puts in place of its own when it is unpickled there (:func:`_use_streams`)."""

    def __reduce__(self):
        from multiprocessing import reduction

        sys.stdout.flush()
        sys.stderr.flush()
        return _use_streams, (reduction.DupFd(1), reduction.DupFd(2))


def _use_streams(out, err) -> None:
    os.dup2(out.detach(), 1)
    os.dup2(err.detach(), 2)


def _die_with_parent(launcher: int) -> None:
    """End this rank as soon as ``launcher`` (the launching process) is gone, however it went:
    a rank left behind would hold its GPU, its sockets and its share of the cores forever.

    The rank's parent is the launcher (spawned ranks) or the fork server, which exits when the
    launcher does (the server reads the end of a pipe from it). Linux: the kernel sends SIGKILL
    when the parent exits (``PR_SET_PDEATHSIG``). Everywhere, also a daemon thread that polls
    ``os.getppid()``, which changes when the parent goes, and whether the launcher still runs:
    the fallback where prctl is missing or not honoured (some sandboxes), at the cost of one
    wake-up per half second.
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent or not _running(launcher):  # it went before the kernel was told to watch it
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent, launcher), name="moekit-parent-watch", daemon=True).start()


def _watch_parent(parent: int, launcher: int) -> None:
    while os.getppid() == parent and _running(launcher):
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _run_rank(rank: int, world_size: int, port: int, backend: str, timeout: float,
              fn: Callable[..., Any], args: tuple) -> Any:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # rank-to-rank sockets stay on loopback
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    device_id = None
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    else:
        # CPU ranks share the machine's cores: without a cap each would start one
        # intra-op thread per core and they would all fight over them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    delta = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(LOCALHOST, port, world_size + 1, is_master=False, timeout=delta)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=delta,
                            device_id=device_id)
    return fn(rank, world_size, *args)


def _run_under_torchrun(fn, world_size: int, args: tuple, backend: str | None, timeout: float) -> Any:
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise ValueError(f"world_size={world_size} but torchrun started WORLD_SIZE={env_world}")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    created = not dist.is_initialized()
    if created:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    result = fn(rank, world_size, *args)
    if created:  # a group we made, we take down, all ranks together (see _close_group)
        _close_group()
    return result


def _close_group() -> None:
    """Barrier, then destroy: a gloo rank whose peer has already closed its sockets aborts."""
    dist.barrier()
    dist.destroy_process_group()


def current_device() -> torch.device:
    """The device this rank's tensors belong on: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
