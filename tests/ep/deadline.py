"""A hard wall-clock bound for multi-rank tests, independent of the code under test.

``launch`` bounds its own waits, but a test of that bound must not trust it: if the bound
were broken, a hang would block CI. ``hard_deadline`` arms SIGALRM in the test process; the
handler raises inside whatever the parent is waiting in (``launch`` waits in ``select``,
which Python interrupts for signal handlers), ``launch`` stops its ranks on the way out,
and the test fails with a message saying it hung.
"""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager

from moekit.ep import launch


class HungError(AssertionError):
    """A multi-rank test did not finish within its hard deadline."""


@contextmanager
def hard_deadline(seconds: float, what: str):
    def fire(signum, frame):
        raise HungError(f"{what} did not finish within {seconds:g} s: a hang")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_ranks(fn, world_size: int, *args, deadline: float = 300.0, timeout: float = 60.0):
    """``launch(fn, world_size, *args)`` on gloo, failing the test if it takes over ``deadline`` s.

    Returns (results, seconds). The deadline is generous (spawning ranks on a loaded CI
    machine is slow); it exists to turn a hang into a failure, not to time anything.
    """
    start = time.monotonic()
    with hard_deadline(deadline, f"launch({fn.__name__}, {world_size})"):
        results = launch(fn, world_size, *args, backend="gloo", timeout=timeout)
    return results, time.monotonic() - start
