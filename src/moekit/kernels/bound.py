"""Launching Triton kernels without Triton's per-call binding, once a call's shape is known.

``kernel[grid](*args, **kwargs)`` costs more host time than the kernel runs at decode sizes:
Triton binds the arguments to the signature, specializes every one (dtype, 16-byte alignment,
integer divisibility), hashes the result and looks the binary up, at every launch (about 19 µs
on an H100 host against 7 µs for ``torch.add``; docs/integrations.md). For one fused-MoE call
all of that is decided by the call's signature: the shapes, strides, dtypes and alignments of
its tensors, the config and the launch plan. So a caller that knows such a key opens a
:func:`call` scope with it; inside, the n-th :func:`launch` of the scope is bound, the first
time, by Triton's own launch (which compiles and returns the binary), and afterwards launched
straight from that binary with the values in signature order (the binary's ``run``, Triton's
launcher, with the current stream).

The key must decide every launch of the scope: the same kernels, in the same order, with the
same constexprs and specializations. The kernels of one call are chosen from shapes and the
config alone (nothing is read back from the device), which is what makes the call signature
such a key; a launch whose kernel differs from the bound one is bound again. Outside a scope,
in Triton's interpreter, or while Triton's launch hooks are set (a profiler such as Proton),
:func:`launch` is Triton's launch.

Inside a :func:`recording` scope every launch is also appended to a list, with its binary, grid
and whole argument list in signature order (``moekit.kernels.recipe`` replays calls from it).
"""

from __future__ import annotations

import inspect
from contextvars import ContextVar

from moekit.kernels.backend import HAVE_TRITON, KERNELS_INTERPRETED

_SCOPE: ContextVar[list | None] = ContextVar("moekit_bound_scope", default=None)
_RECORDING: ContextVar[list | None] = ContextVar("moekit_bound_recording", default=None)
_BOUND: dict[tuple, tuple] = {}  # (call key, launch index) -> (kernel, binary, names after the positional args)
_REMEMBERED: dict[tuple, object] = {}  # (call key, what) -> a value the key decides
_MISSING = object()
_MAX_BOUND = 8192
_ONES = {1: (1, 1), 2: (1,), 3: ()}  # a binary's launch takes a 3-D grid

if HAVE_TRITON:
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
else:  # pragma: no cover - the kernels need Triton
    _knobs = _driver = None


class call:
    """``with call(key):`` the launches inside are bound per (key, launch index). ``key`` None
    (or Triton's interpreter): a plain scope, every launch is Triton's."""

    __slots__ = ("key", "token")

    def __init__(self, key):
        self.key = None if KERNELS_INTERPRETED else key

    def __enter__(self):
        self.token = _SCOPE.set(None if self.key is None else [self.key, 0])
        return self

    def __exit__(self, *exc):
        _SCOPE.reset(self.token)
        return False


def _active(hook) -> bool:
    """Whether a launch hook of Triton's is set (newer Tritons keep a chain, empty when unused)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooked() -> bool:
    runtime = _knobs.runtime
    return _active(runtime.launch_enter_hook) or _active(runtime.launch_exit_hook)


def current_stream() -> int:
    """The raw handle of the current device's current stream (what a launch runs on)."""
    device = _driver.active.get_current_device()
    return _driver.active.get_current_stream(device)


class recording:
    """``with recording(events):`` every launch inside (of a :func:`call` scope) appends
    ``("launch", binary, grid, arguments in signature order)`` to ``events``, or ``("refuse",)``
    where it has no binary to launch from (Triton's launch hooks are set)."""

    __slots__ = ("events", "token")

    def __init__(self, events: list):
        self.events = events

    def __enter__(self):
        self.token = _RECORDING.set(self.events)
        return self

    def __exit__(self, *exc):
        _RECORDING.reset(self.token)
        return False


def _note(binary, grid: tuple, values) -> None:
    events = _RECORDING.get()
    if events is not None:
        events.append(("launch", binary, grid, tuple(values)) if binary is not None else ("refuse",))


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``; inside a :func:`call` scope, bound once per (key,
    launch index) and then launched from the binary directly (the module docstring)."""
    scope = _SCOPE.get()
    if scope is None:
        kernel[grid](*args, **kwargs)
        _note(None, grid, ())
        return
    where = (scope[0], scope[1])
    scope[1] += 1
    bound = _BOUND.get(where)
    if bound is None or bound[0] is not kernel or _hooked():
        binary = kernel[grid](*args, **kwargs)
        if binary is not None and hasattr(binary, "packed_metadata") and not _hooked():
            if len(_BOUND) >= _MAX_BOUND:
                _BOUND.clear()
            tail = _tail(kernel, len(args))
            _BOUND[where] = (kernel, binary, tail)
            _note(binary, grid, (*args, *_values(tail, kwargs)))
        else:
            _note(None, grid, ())
        return
    _, binary, tail = bound
    values = (*args, *_values(tail, kwargs))
    run = binary.run  # (loads the binary if it is not yet)
    # Triton's launcher: the grid, the stream, the binary, no launch metadata and no hooks, then
    # every parameter in signature order (the constexprs too; the launcher skips them).
    run(*(grid + _ONES[len(grid)]), current_stream(), binary.function, binary.packed_metadata, None, None, None,
        *values)
    _note(binary, grid, values)


def _values(tail: tuple, kwargs: dict) -> list:
    """The values of the parameters ``tail`` names: from ``kwargs``, else their defaults."""
    return [kwargs[name] if name in kwargs else default for name, default in tail]


def remembered(what, compute):
    """``compute()``, once per call key inside a :func:`call` scope (a value that the key
    decides, such as a persistent kernel's grid); outside a scope, every time."""
    scope = _SCOPE.get()
    if scope is None:
        return compute()
    where = (scope[0], what)
    value = _REMEMBERED.get(where, _MISSING)
    if value is _MISSING:
        if len(_REMEMBERED) >= _MAX_BOUND:
            _REMEMBERED.clear()
        value = _REMEMBERED[where] = compute()
    return value


def _tail(kernel, positional: int) -> tuple:
    """(name, default) of the kernel's parameters after the first ``positional``, in order."""
    return tuple((name, p.default) for name, p in list(inspect.signature(kernel.fn).parameters.items())[positional:])


def bound_count() -> int:
    """How many launches are bound (for tests)."""
    return len(_BOUND)
