"""moekit.kernels.recipe: from the third call of a key on, a call is replayed from its recorded
launches with the new inputs' addresses, a fresh output and workspaces kept per stream; a call
that does anything but allocate, take views and launch is never replayed."""

from __future__ import annotations

import pytest
import torch

from moekit.kernels import bound, recipe


def _kernel_fn(x, ws, out, n, BLOCK: int = 4):  # stands for a @triton.jit function
    pass


class FakeLauncher:
    """Triton's launcher: called as bound.launch calls it, or its compiled ``launch`` as a replay does."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, log):
        self.log = log

    def __call__(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit, *values):
        self.log.append(("launcher", stream, (g0, g1, g2), values))

    def launch(self, g0, g1, g2, stream, function, cooperative, pdl, scratch, profile_scratch, metadata,
               launch_metadata, enter, exit, *values):
        assert (function, cooperative, pdl, scratch, profile_scratch, metadata) == ("f", False, True, None, None, "m")
        self.log.append(("native", stream, (g0, g1, g2), values))


class FakeBinary:
    function, packed_metadata = "f", "m"

    def __init__(self, log):
        self.run = FakeLauncher(log)


class FakeKernel:
    fn = staticmethod(_kernel_fn)

    def __init__(self):
        self.log = []
        self.binary = FakeBinary(self.log)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", None, grid, args))
            return self.binary
        return run


@pytest.fixture
def compiled_mode(monkeypatch):
    monkeypatch.setattr(bound, "KERNELS_INTERPRETED", False)
    monkeypatch.setattr(bound, "_BOUND", {})
    monkeypatch.setattr(bound, "_REMEMBERED", {})
    monkeypatch.setattr(bound, "current_stream", lambda: 11)
    monkeypatch.setattr(recipe, "_RECIPES", {})
    monkeypatch.setattr(recipe, "_SEEN", set())
    monkeypatch.setattr(recipe, "ENABLED", True)
    monkeypatch.setattr(recipe, "_capturing", lambda: False)


def _call(k1, k2, x, *, extra=None):
    """A call's ordinary path: a workspace, an output, two launches (the second on a view)."""
    def ordinary():
        ws = torch.empty(8)
        out = torch.empty(x.shape)
        bound.launch(k1, (2,), x, ws, out, x.numel(), BLOCK=16)
        bound.launch(k2, (1, 3), ws[2:], out, x[1:], 3)
        if extra is not None:
            extra(out)
        return out
    return recipe.run(("key", tuple(x.shape)), (x,), ordinary)


def test_the_third_call_is_replayed_with_its_own_addresses(compiled_mode):
    k1, k2 = FakeKernel(), FakeKernel()
    outs = []
    for i in range(4):
        x = torch.randn(5, 3)
        out = _call(k1, k2, x)
        assert out.shape == x.shape and out.dtype == torch.float32
        outs.append((x, out))
    assert [e[0] for e in k1.log] == ["triton", "launcher", "native", "native"]
    assert recipe.recipe_count() == 1
    (_, s3, g13, v13), (_, _, _, v14) = k1.log[2:]
    (_, _, g23, v23), (_, _, _, v24) = k2.log[2:]
    assert (s3, g13, g23) == (11, (2, 1, 1), (1, 3, 1))
    for (x, out), v1, v2 in zip(outs[2:], (v13, v14), (v23, v24)):
        ws = v1[1]
        assert v1 == (x.data_ptr(), ws, out.data_ptr(), 15, 16)
        assert v2 == (ws + 2 * 4, out.data_ptr(), x.data_ptr() + 3 * 4, 3, 4)  # views keep their offsets
    assert v13[1] == v14[1]  # one workspace per stream, reused
    assert outs[2][1].data_ptr() != outs[3][1].data_ptr()  # a fresh output per call


def test_each_stream_has_its_workspaces(compiled_mode, monkeypatch):
    k1, k2 = FakeKernel(), FakeKernel()
    x = torch.randn(5, 3)
    for _ in range(3):
        _call(k1, k2, x)
    monkeypatch.setattr(bound, "current_stream", lambda: 22)
    _call(k1, k2, x)
    (_, s1, _, v1), (_, s2, _, v2) = k1.log[2:]
    assert (s1, s2) == (11, 22) and v1[1] != v2[1]


@pytest.mark.parametrize("case", ["torch kernel", "foreign tensor", "returns an input", "capturing", "disabled"])
def test_calls_that_cannot_be_replayed_keep_their_ordinary_path(compiled_mode, monkeypatch, case):
    k1, k2 = FakeKernel(), FakeKernel()
    foreign = torch.empty(4)
    x = torch.randn(5, 3)
    if case == "capturing":
        monkeypatch.setattr(recipe, "_capturing", lambda: True)
    if case == "disabled":
        monkeypatch.setattr(recipe, "ENABLED", False)

    def ordinary():
        out = torch.empty(x.shape)
        bound.launch(k1, (1,), x, foreign if case == "foreign tensor" else out, out, 1)
        if case == "torch kernel":
            out.zero_()
        return x if case == "returns an input" else out

    for _ in range(4):
        recipe.run("key", (x,), ordinary)
    assert [e[0] for e in k1.log] == ["triton", "launcher", "launcher", "launcher"]
    assert recipe.recipe_count() == 0


def test_a_launch_hook_is_never_replayed(compiled_mode, monkeypatch):
    class Runtime:  # a profiler's hook: every launch must reach it through Triton's launch
        launch_enter_hook, launch_exit_hook = (lambda metadata: None), None

    monkeypatch.setattr(bound, "_knobs", type("Knobs", (), {"runtime": Runtime}))
    k1, k2 = FakeKernel(), FakeKernel()
    x = torch.randn(5, 3)
    for _ in range(4):
        _call(k1, k2, x)
    assert [e[0] for e in k1.log] == ["triton"] * 4
    assert recipe.recipe_count() == 0


def test_the_interpreter_never_replays(monkeypatch):
    monkeypatch.setattr(bound, "KERNELS_INTERPRETED", True)
    monkeypatch.setattr(recipe, "_RECIPES", {})
    monkeypatch.setattr(recipe, "_SEEN", set())
    k1, k2 = FakeKernel(), FakeKernel()
    x = torch.randn(5, 3)
    for _ in range(3):
        _call(k1, k2, x)
    assert [e[0] for e in k1.log] == ["triton"] * 3
    assert recipe.recipe_count() == 0


def test_an_output_returned_as_a_view_of_its_allocation(compiled_mode):
    k = FakeKernel()
    x = torch.randn(6, 4)

    def ordinary():
        flat = torch.empty(24)
        bound.launch(k, (1,), x, flat, flat, 24)
        return flat.view(2, 3, 4)

    outs = [recipe.run("key", (x,), ordinary) for _ in range(3)]
    assert [e[0] for e in k.log] == ["triton", "launcher", "native"]
    assert outs[2].shape == (2, 3, 4) and outs[2].is_contiguous()
    assert k.log[2][3][:3] == (x.data_ptr(), outs[2].data_ptr(), outs[2].data_ptr())


def test_replay_false_keeps_the_ordinary_path(compiled_mode):
    k1, k2 = FakeKernel(), FakeKernel()
    x = torch.randn(5, 3)

    def ordinary():
        out = torch.empty(x.shape)
        bound.launch(k1, (1,), x, out, out, 1)
        return out

    for _ in range(4):
        recipe.run("key", (x,), ordinary, replay=False)
    assert [e[0] for e in k1.log] == ["triton", "launcher", "launcher", "launcher"]
    assert recipe.recipe_count() == 0


def test_workspaces_past_the_budget_drop_the_other_recipes(compiled_mode, monkeypatch):
    """Each call keeps a 32-byte workspace; with room for one, preparing the second key's drops
    the first's recipe, which is then recorded again and replayed with a workspace of its own."""
    monkeypatch.setattr(recipe, "MAX_HELD_BYTES", 40)
    k1, k2 = FakeKernel(), FakeKernel()
    a, b = torch.randn(5, 3), torch.randn(4, 3)
    for x in (a, a, a, b, b, b):
        _call(k1, k2, x)
    assert recipe.recipe_count() == 1 and recipe.held_bytes() == 32
    for _ in range(3):
        _call(k1, k2, a)  # recorded again (two ordinary calls), then replayed
    assert [e[0] for e in k1.log] == ["triton", "launcher", "native"] + ["triton", "launcher", "native"] + \
        ["launcher", "launcher", "native"]
    assert recipe.held_bytes() == 32
