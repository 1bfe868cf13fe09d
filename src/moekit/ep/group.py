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
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LOCALHOST = "127.0.0.1"


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
           timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results by rank."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return [_run_under_torchrun(fn, world_size, args, backend, timeout_s)]
    backend = backend or default_backend(world_size)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((LOCALHOST, 0))
        listener.listen()
        port = listener.getsockname()[1]
        # The store server runs in this process on the socket bound above; ranks connect to it.
        store = dist.TCPStore(LOCALHOST, port, world_size + 1, is_master=True, wait_for_workers=False,
                              master_listen_fd=listener.fileno(), timeout=datetime.timedelta(seconds=timeout_s))
        context = mp.start_processes(_worker, args=(world_size, port, backend, timeout_s, fn, args, queue),
                                     nprocs=world_size, join=False, start_method="spawn")
        results = _collect(context, queue, world_size)
    del store
    return results


def _collect(context, queue, world_size: int) -> list[Any]:
    # Drain the queue while the ranks run: a result larger than the pipe's buffer blocks
    # its sender until read, so joining first would deadlock.
    results: list[Any] = [None] * world_size
    received = 0
    while received < world_size:
        if not queue.empty():
            rank, payload = queue.get()
            results[rank] = pickle.loads(payload)
            received += 1
        elif context.join(timeout=0.05):  # all exited (a failed rank raises here)
            if queue.empty():
                break
    while not context.join():
        pass
    if received < world_size:
        raise RuntimeError(f"only {received} of {world_size} ranks returned a result")
    return results


def _worker(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
            fn: Callable[..., Any], args: tuple, queue) -> None:
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
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(LOCALHOST, port, world_size + 1, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device_id)
    result = fn(rank, world_size, *args)
    # Plain pickle copies tensors by value; torch's queue pickler would share memory
    # that dies with this process.
    queue.put((rank, pickle.dumps(result)))
    # Only on success: after a failure, peers may be inside a collective and tearing the
    # group down could block; the process exits and the parent reports the error.
    _close_group()


def _run_under_torchrun(fn, world_size: int, args: tuple, backend: str | None, timeout_s: float) -> Any:
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise ValueError(f"world_size={world_size} but torchrun started WORLD_SIZE={env_world}")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    created = not dist.is_initialized()
    if created:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
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
