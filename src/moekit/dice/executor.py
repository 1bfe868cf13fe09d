"""Where a schedule's communication runs: in order, on a side stream, or on a worker thread.

``submit(fn, inputs)`` starts ``fn()`` (a dispatch or a combine) and returns a handle;
``wait(handle)`` returns its result, ready for the caller's next work.

* :class:`InlineExecutor` runs ``fn`` at submit: everything in program order. The results
  are the same as with the other executors — only the overlap is lost.
* :class:`StreamExecutor` (``"stream"``) issues ``fn`` at submit, from the caller's
  thread, on a communication stream: the communication stream first waits for an event
  the caller's stream records (the inputs are ready), ``fn`` queues its work there, and an
  event recorded after it is what ``wait`` makes the caller's stream wait for. No host
  thread waits anywhere, so this is the executor for dispatchers that never read the
  host (:class:`moekit.dice.stale.StaleExchange`, or any dispatcher inside a CUDA graph):
  the caller queues the next layers' compute right after the issue, and the GPU runs it
  beside the transfer. Submit and wait are only event records and waits, so they can
  be captured: a graph of a step holds the fork and join. On a CPU ``fn`` runs at submit.
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

EXECUTORS = ("inline", "stream", "async")


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


class _Issued:
    def __init__(self, value, done, generation: int = 0):
        self.value, self.done, self.generation = value, done, generation


def _cuda_device(device) -> torch.device:
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device} but CUDA is not available")
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    return device


class StreamExecutor:
    """Issues every call on one communication stream, ordered by CUDA events (no thread).

    ``on_issue`` / ``on_wait`` (optional callables taking the handle) are told when a call
    is issued and when its result is taken: a test uses them to watch the window between.

    Inside a CUDA-graph capture (:meth:`begin_capture` ... :meth:`end_capture`, one per
    captured step) the same records and waits become the graph's fork and join edges.
    A captured graph must end with every side-stream branch joined, so :meth:`join` makes
    the capturing stream wait for the communication stream at the end of the step; a
    handle issued before the capture (another generation) is then already complete when
    it is waited for, and its event is not waited on inside the graph.
    """

    name = "stream"

    def __init__(self, device: torch.device | str | None = None, stream: "torch.cuda.Stream | None" = None):
        self.device = _cuda_device(device)
        if self.device.type == "cuda":
            self.stream = stream if stream is not None else torch.cuda.Stream(self.device)
        else:
            self.stream = None
        self.on_issue = self.on_wait = None
        self.generation = 0
        self._capturing = self._forked = False
        self._keep: list = []

    def begin_capture(self) -> None:
        self.generation += 1
        self._capturing, self._forked, self._keep = True, False, []

    def join(self) -> None:
        """Inside a capture: the capturing stream waits for the communication stream."""
        if self._capturing and self._forked:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._forked = False

    def end_capture(self) -> None:
        self.join()
        self._capturing, self._keep = False, []
        self.generation += 1

    def submit(self, fn: Callable[[], Any], inputs: Any = ()) -> _Issued:
        if self.stream is None:
            handle = _Issued(None, None, self.generation)
            if self.on_issue is not None:
                self.on_issue(handle)
            handle.value = fn()
            return handle
        caller = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(caller)
        for t in tensors_in(inputs):
            if t.is_cuda:
                t.record_stream(self.stream)
        if self._capturing:  # kept alive until the capture's join (the graph's memory is stream-ordered there)
            self._forked = True
            self._keep.append(inputs)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            handle = _Issued(None, torch.cuda.Event(), self.generation)
            if self.on_issue is not None:
                self.on_issue(handle)
            handle.value = fn()
            handle.done.record(self.stream)
        return handle

    def wait(self, handle: _Issued) -> Any:
        if handle.done is not None and handle.generation == self.generation:
            caller = torch.cuda.current_stream(self.device)
            caller.wait_event(handle.done)
            for t in tensors_in(handle.value):
                if t.is_cuda:
                    t.record_stream(caller)
        if self.on_wait is not None:
            self.on_wait(handle)
        return handle.value

    def close(self) -> None:
        pass


def make_executor(kind: str, device: torch.device | str | None = None):
    """``"inline"``, ``"stream"`` or ``"async"`` (see the module docstring)."""
    if kind == "inline":
        return InlineExecutor()
    if kind == "stream":
        return StreamExecutor(device)
    if kind == "async":
        return AsyncExecutor(device)
    raise ValueError(f"executor must be one of {EXECUTORS}, got {kind!r}")
