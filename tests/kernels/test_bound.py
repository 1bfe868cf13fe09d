"""moekit.kernels.bound: a launch inside a call scope is Triton's the first time, then the binary's,
with every parameter's value in signature order (the defaults of those not passed)."""

from __future__ import annotations

import pytest

from moekit.kernels import bound


def _kernel_fn(x, y, n, A: int = 3, B: int = 4):  # stands for a @triton.jit function
    pass


class FakeBinary:
    """Triton's CompiledKernel as bound.launch uses it: ``run`` is its launcher."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit, *values):
        assert (function, metadata, launch_metadata, enter, exit) == ("function", "metadata", None, None, None)
        self.log.append(("binary", (g0, g1, g2), values))


class FakeKernel:
    """Triton's JITFunction as bound.launch uses it: ``[grid](*args, **kwargs)`` returns the binary."""

    fn = staticmethod(_kernel_fn)

    def __init__(self):
        self.log = []
        self.binary = FakeBinary(self.log)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return self.binary
        return run


@pytest.fixture
def compiled_mode(monkeypatch):
    monkeypatch.setattr(bound, "KERNELS_INTERPRETED", False)
    monkeypatch.setattr(bound, "current_stream", lambda: "stream")
    monkeypatch.setattr(bound, "_BOUND", {})
    monkeypatch.setattr(bound, "_REMEMBERED", {})


def test_second_launch_of_a_key_goes_to_the_binary_in_signature_order(compiled_mode):
    k1, k2 = FakeKernel(), FakeKernel()
    for _ in range(2):
        with bound.call(("sig", 1)):
            bound.launch(k1, (5,), "x", "y", 7, B=9, num_warps=4)
            bound.launch(k2, (2, 3), "p", "q", 1)
    assert [e[0] for e in k1.log] == ["triton", "binary"]
    assert k1.log[1] == ("binary", (5, 1, 1), ("x", "y", 7, 3, 9))  # A's default, B passed; num_warps is no parameter
    assert k2.log[1] == ("binary", (2, 3, 1), ("p", "q", 1, 3, 4))
    assert bound.bound_count() == 2


def test_other_keys_and_no_scope_use_triton(compiled_mode):
    k = FakeKernel()
    with bound.call(("sig", 1)):
        bound.launch(k, (1,), "x", "y", 1)
    with bound.call(("sig", 2)):  # another signature: bound afresh
        bound.launch(k, (1,), "x", "y", 1)
    bound.launch(k, (1,), "x", "y", 1)  # outside a scope
    with bound.call(None):  # a scope without a key
        bound.launch(k, (1,), "x", "y", 1)
    assert [e[0] for e in k.log] == ["triton"] * 4


def test_a_different_kernel_at_a_bound_place_is_bound_again(compiled_mode):
    k1, k2 = FakeKernel(), FakeKernel()
    with bound.call("key"):
        bound.launch(k1, (1,), "x", "y", 1)
    with bound.call("key"):
        bound.launch(k2, (1,), "x", "y", 1)
    with bound.call("key"):
        bound.launch(k2, (1,), "x", "y", 2)
    assert [e[0] for e in k1.log] == ["triton"]
    assert [e[0] for e in k2.log] == ["triton", "binary"]


def test_the_interpreter_never_binds(monkeypatch):
    monkeypatch.setattr(bound, "KERNELS_INTERPRETED", True)
    k = FakeKernel()
    for _ in range(2):
        with bound.call("key"):
            bound.launch(k, (1,), "x", "y", 1)
    assert [e[0] for e in k.log] == ["triton", "triton"]


def test_remembered_once_per_key(compiled_mode):
    calls = []
    for key in ("a", "a", "b"):
        with bound.call(key):
            assert bound.remembered("grid", lambda: calls.append(key) or len(calls)) == (1 if key == "a" else 2)
    assert bound.remembered("grid", lambda: 99) == 99  # outside a scope: computed every time
    assert calls == ["a", "b"]


def test_a_launch_hook_keeps_tritons_launch(compiled_mode, monkeypatch):
    class Runtime:  # a profiler's hook is set: every launch must reach it
        launch_enter_hook, launch_exit_hook = (lambda metadata: None), None

    monkeypatch.setattr(bound, "_knobs", type("Knobs", (), {"runtime": Runtime}))
    k = FakeKernel()
    for _ in range(2):
        with bound.call("key"):
            bound.launch(k, (1,), "x", "y", 1)
    assert [e[0] for e in k.log] == ["triton", "triton"]
