"""The executors on the CPU: submission order, results, errors, and the tensor walk."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import torch

from moekit.dice.executor import AsyncExecutor, InlineExecutor, make_executor, tensors_in


def test_async_executor_runs_in_submission_order_off_the_callers_thread():
    executor = AsyncExecutor()
    order, threads = [], set()

    def job(i, pause):
        time.sleep(pause)
        order.append(i)
        threads.add(threading.get_ident())
        return i * i

    handles = [executor.submit(lambda i=i: job(i, 0.02 if i == 0 else 0.0)) for i in range(5)]
    assert [executor.wait(h) for h in reversed(handles)] == [16, 9, 4, 1, 0]
    assert order == [0, 1, 2, 3, 4]  # one worker: the slow first job does not let the others pass
    assert threads and threading.get_ident() not in threads
    executor.close()
    executor.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        executor.submit(lambda: 1)


def test_async_executor_overlaps_the_caller_on_the_cpu():
    executor = AsyncExecutor()
    start = time.perf_counter()
    handle = executor.submit(lambda: time.sleep(0.2))
    time.sleep(0.2)  # the caller's "compute"
    executor.wait(handle)
    assert time.perf_counter() - start < 0.35
    executor.close()


def test_errors_surface_at_wait():
    for executor in (InlineExecutor(), AsyncExecutor()):
        def bad():
            raise ValueError("x must be a 2-D tensor")
        if isinstance(executor, InlineExecutor):
            with pytest.raises(ValueError, match="2-D"):
                executor.submit(bad)
        else:
            handle = executor.submit(bad)
            with pytest.raises(ValueError, match="2-D"):
                executor.wait(handle)
        executor.close()


def test_make_executor_names():
    assert isinstance(make_executor("inline"), InlineExecutor)
    ex = make_executor("async", "cpu")
    assert isinstance(ex, AsyncExecutor) and ex.stream is None
    ex.close()
    with pytest.raises(ValueError, match="executor must be one of"):
        make_executor("threads")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            AsyncExecutor("cuda")


def test_tensors_in_walks_records():
    @dataclass
    class Rec:
        a: torch.Tensor
        rest: dict

    class Handle:
        def __init__(self):
            self.meta = [torch.zeros(1), (torch.ones(2), "x")]

    t = [torch.full((3,), float(i)) for i in range(2)]
    found = tensors_in(Rec(t[0], {"h": Handle(), "n": 3, "t": t[1]}))
    assert len(found) == 4 and any(f is t[0] for f in found) and any(f is t[1] for f in found)
