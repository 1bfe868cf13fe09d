"""One launch per world size for the multi-rank tests that opt in (``@pytest.mark.ranks``).

Spawning a rank costs seconds (a fresh interpreter imports torch and joins the gloo group),
often more than the rank's work: on a 2-core machine the spawns were a large part of the
suite's time. A test marked ``@pytest.mark.ranks(job)`` calls the ``pooled_launch`` fixture
(tests/conftest.py) for the per-rank results of its job; the first such call at a world size
runs the jobs of every selected test of that world size (``-k`` and the like select as
usual), in collection order, in one ``launch`` (``run_jobs``: each rank calls each job's
function in turn), and hands each test its own results. Each job builds its own dispatchers
and data, as in a launch of its own; the ranks share only the process group (and the
intra-op thread count, restored after every job).

``job(**params) -> (fn, *args)``: ``fn(rank, world_size, *args)`` is the module-level
function a launch of its own would run; ``job`` is called with the test's parameters that it
names (``world_size`` is the test's parameter or the marker's ``world_size=`` keyword).
The marker's ``deadline`` (seconds, the hard bound of tests/ep/deadline.py) bounds the job
inside the shared launch too: each rank arms it around the job.

Under pytest-xdist (the README's ``-n 2``) each worker sees every collected test but runs only
some, so there each marked test runs its job in a launch of its own.

If the shared launch fails (a rank raised, died, or a job ran past its deadline), each test
then runs its job in a launch of its own, so that the failure is reported by the test whose
job failed, with its own traceback, and the other tests still pass or fail on their own.
"""

from __future__ import annotations

import inspect
import os
import signal
import warnings
from typing import Any, Callable

import torch


class JobHungError(AssertionError):
    """A job of the shared launch ran past its deadline (on some rank)."""


def _alarm(key: str, seconds: float):
    def fire(signum, frame):
        raise JobHungError(f"{key} did not finish within {seconds:g} s: a hang")
    return fire


def run_jobs(rank: int, world_size: int, jobs: list[tuple[str, Callable[..., Any], tuple, float]]) -> dict[str, Any]:
    """On every rank: each job's ``fn(rank, world_size, *args)`` in turn, each under its
    deadline -> {key: result}."""
    threads = torch.get_num_threads()
    out = {}
    for key, fn, args, deadline in jobs:
        previous = signal.signal(signal.SIGALRM, _alarm(key, deadline))
        signal.setitimer(signal.ITIMER_REAL, deadline)
        try:
            out[key] = fn(rank, world_size, *args)
        except BaseException as error:
            raise RuntimeError(f"{key}: {type(error).__name__}: {error}") from error
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            torch.set_num_threads(threads)
    return out


class RankPool:
    """Per world size: the results of every marked test's job, from one launch (see the module docstring)."""

    def __init__(self):
        self.results: dict[str, list[Any]] = {}  # nodeid -> per-rank results, until the test takes them
        self.launched: set[int] = set()  # world sizes whose shared launch ran (or failed)

    @staticmethod
    def job(item) -> tuple[int, Callable[..., Any], tuple, dict]:
        """(world_size, fn, args, launch options) of a marked test."""
        marker = item.get_closest_marker("ranks")
        params = dict(item.callspec.params) if hasattr(item, "callspec") else {}
        if marker.kwargs.get("world_size") is not None:
            params["world_size"] = marker.kwargs["world_size"]
        world_size, job = params["world_size"], marker.args[0]
        fn, *args = job(**{name: params[name] for name in inspect.signature(job).parameters})
        options = dict(deadline=float(marker.kwargs.get("deadline", 900.0)),
                       timeout=float(marker.kwargs.get("timeout", 300.0)))
        return world_size, fn, tuple(args), options

    def take(self, item) -> list[Any]:
        from moekit.ep import RankFailedError
        from tests.ep.deadline import HungError, run_ranks

        world_size, fn, args, options = self.job(item)
        # Under pytest-xdist every worker sees every test: a shared launch would run the jobs of
        # tests other workers run. Each test runs its own launch there (the fork server keeps
        # that cheap).
        if world_size not in self.launched and not os.environ.get("PYTEST_XDIST_WORKER"):
            self.launched.add(world_size)
            jobs, deadline, timeout = [], 0.0, 0.0
            for other in item.session.items:
                if other.get_closest_marker("ranks") is None:
                    continue
                ws, f, a, o = self.job(other)
                if ws == world_size:
                    jobs.append((other.nodeid, f, a, o["deadline"]))
                    deadline, timeout = deadline + o["deadline"], max(timeout, o["timeout"])
            try:
                # Each rank bounds each job by its own deadline; the sum bounds the launch.
                per_rank, _ = run_ranks(run_jobs, world_size, jobs, deadline=deadline, timeout=timeout)
            except (RankFailedError, HungError) as error:
                # Every test runs its own launch below: the one whose job failed reports it. Said
                # here too, in case no job fails alone (then the jobs interfered in the shared one).
                warnings.warn(f"the shared {world_size}-rank launch failed; each test runs its own: "
                              f"{str(error).strip().splitlines()[-1]}", stacklevel=1)
            else:
                for key, *_ in jobs:
                    self.results[key] = [r[key] for r in per_rank]
        if item.nodeid in self.results:
            return self.results.pop(item.nodeid)
        results, _ = run_ranks(fn, world_size, *args, **options)
        return results
