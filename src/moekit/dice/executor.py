"""Where a schedule's communication runs: in order, or on a worker thread and its own stream.

``submit(fn, inputs)`` starts ``fn()`` (a dispatch or a combine) and returns a handle;
``wait(handle)`` returns its result, ready for the caller's next work.

* :class:`InlineExecutor` runs ``fn`` at submit: everything in program order. The results
  are the same as with the asynchronous executor — only the overlap is lost.
* :class:`AsyncExecutor` runs every ``fn`` on one worker thread, in submission order (so
  all ranks issue their collectives in the same order). On a GPU the worker works on a
  communication stream of its own: at submit the caller's stream records an event the
  communication stream waits for (the inputs are ready), and at wait the caller's stream
  waits for an event recorded after ``fn`` (the outputs are ready). Nothing blocks the
  caller's stream in between, so the next layer's or step's compute overlaps the
  transfer. The thread matters because a dispatcher may read sizes back to the host (the
  eager all-to-all does, once per dispatch); on the worker that host read stalls only the
  worker, while the caller keeps queuing compute. On the CPU the worker runs gloo
  collectives beside the caller's compute.

Tensors cross streams, so the CUDA caching allocator is told (``record_stream``): inputs
are in use on the communication stream until its work is done, outputs on the caller's.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

EXECUTORS = ("inline", "async")


def tensors_in(obj: Any, _depth: int = 0) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj`` through dataclass fields, dicts, lists, tuples and
    plain objects' attributes (a dispatcher's Dispatched and handle)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if _depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.dtype, torch.device)):
        return []
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = vars(obj).values()
    else:
        return []
    found = []
    for item in items:
        found.extend(tensors_in(item, _depth + 1))
    return found


class _Done:
    def __init__(self, value):
        self.value = value


class InlineExecutor:
    """Runs each submitted call at once, in program order."""

    name = "inline"

    def submit(self, fn: Callable[[], Any], inputs: Any = ()) -> _Done:
        return _Done(fn())

    def wait(self, handle: _Done) -> Any:
        return handle.value

    def close(self) -> None:
        pass


class _Pending:
    def __init__(self, future: Future):
        self.future = future


class AsyncExecutor:
    """One worker thread (and on CUDA one communication stream) for a schedule's transfers."""

    name = "async"

    def __init__(self, device: torch.device | str | None = None):
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={device} but CUDA is not available")
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moekit-dice-comm")

    def submit(self, fn: Callable[[], Any], inputs: Any = ()) -> _Pending:
        if self._pool is None:
            raise RuntimeError("this AsyncExecutor was closed")
        if self.stream is None:
            return _Pending(self._pool.submit(lambda: (fn(), None)))
        caller = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(caller)
        for t in tensors_in(inputs):
            if t.is_cuda:
                t.record_stream(self.stream)
        stream, device = self.stream, self.device

        def job():
            with torch.cuda.device(device), torch.cuda.stream(stream):
                stream.wait_event(ready)
                out = fn()
                done = torch.cuda.Event()
                done.record(stream)
            return out, done

        return _Pending(self._pool.submit(job))

    def wait(self, handle: _Pending) -> Any:
        out, done = handle.future.result()  # re-raises what the call raised
        if done is not None:
            caller = torch.cuda.current_stream(self.device)
            caller.wait_event(done)
            for t in tensors_in(out):
                if t.is_cuda:
                    t.record_stream(caller)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __del__(self):  # a forgotten close() must not leave the worker thread behind
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)


def make_executor(kind: str, device: torch.device | str | None = None):
    """``"inline"`` or ``"async"`` (see the module docstring)."""
    if kind == "inline":
        return InlineExecutor()
    if kind == "async":
        return AsyncExecutor(device)
    raise ValueError(f"executor must be one of {EXECUTORS}, got {kind!r}")
