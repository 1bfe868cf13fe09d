"""Replaying a fused-MoE call from its recorded launches: the host path of a call seen before.

What a fused-MoE call launches (which kernels, their grids, constexprs and integer arguments, the
shapes of the buffers it allocates) is decided by its key (:func:`moekit.kernels.bound.call`:
the shapes, strides, dtypes, devices and alignments of its tensors, the config and the plan).
From one call of a key to the next only the addresses of its tensors change. So the second call
of a key runs the ordinary path once more while recording what it does: every kernel launch with
its whole argument list (:func:`moekit.kernels.bound.launch`), and every torch operator it runs
(a ``TorchDispatchMode``). If the call did nothing but allocate buffers, take views and launch
Triton kernels, the record becomes a :class:`Recipe`: per launch, the binary's launcher, its grid
and its arguments, each tensor replaced by where its address comes from (an input of the call,
the output, or a workspace). Later calls of the key allocate the output, read the inputs'
addresses and call the launchers directly, with addresses as integers (Triton's launcher takes an
integer as the address itself): no argument binding, no shape logic, no workspace allocation.

Workspaces (the buffers a call allocates and does not return) are allocated once per recipe and
stream, and reused: the kernels of one stream run in order, and every kernel launched here waits
for the one before it to complete before it touches memory (under programmatic dependent launch
too, see :mod:`moekit.kernels.pdl`), so no call writes a workspace an earlier call still reads.
A call whose workspaces pass ``MAX_WORKSPACE_BYTES`` is not replayed (at such sizes the GPU's
time dominates), and the workspaces kept in all stay under ``MAX_HELD_BYTES`` (past it the
recipes are dropped and recorded again as calls come).

A call made while a CUDA graph is being captured takes the ordinary path (the graph owns its
buffers), and so does every call of the custom operators (:mod:`moekit.ops.library`), which run
inside compiled graphs: torch.compile's CUDA graphs also run them once, uncaptured, with their
allocations going to the graphs' memory pool, where a workspace kept here would not belong. A
call that does anything else (a torch kernel such as a fill or a copy, a tensor argument whose
address is neither an input's nor an allocation's, a launch hook) is never replayed: it takes
the ordinary path every time.

``MOEKIT_REPLAY=0`` in the environment (read at import) turns replay off.
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moekit.kernels import bound

_RECIPES: dict = {}  # call key -> Recipe, or _NEVER
_SEEN: set = set()  # keys called once (bound, not yet recorded)
_NEVER = object()
_MAX_RECIPES = 512
_MAX_SEEN = 4096
MAX_WORKSPACE_BYTES = 64 << 20  # a call whose workspaces are larger is not replayed (large M: the GPU dominates)
MAX_HELD_BYTES = 512 << 20  # workspaces kept in all; past it every recipe is dropped and recorded again
_held = [0]  # bytes of workspaces kept now
ENABLED = os.environ.get("MOEKIT_REPLAY", "1").strip().lower() not in ("0", "off", "false", "no")
_ALLOCATING = frozenset(("empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"))
_CONSTANTS = (int, float, bool, str, type(None))
_capturing = torch.cuda.is_current_stream_capturing


def run(key, inputs: tuple, ordinary, *, replay: bool = True):
    """The result of a call: ``ordinary()`` (its ordinary path, launching through
    :func:`bound.launch`) or its replay. ``key`` decides every launch of the call (None: never
    replayed); ``inputs``: its tensors (None where absent), in a fixed order per key.
    ``replay=False``: the ordinary path (bound launches), neither recorded nor replayed."""
    recipe = _RECIPES.get(key) if key is not None and replay else _NEVER
    if recipe is None:
        recipe = _NEVER if not ENABLED or bound.KERNELS_INTERPRETED else None
    if recipe is not _NEVER and not _capturing():
        if recipe is not None:
            return recipe.replay(inputs)
        if key in _SEEN:
            return _record(key, inputs, ordinary)
        if len(_SEEN) >= _MAX_SEEN:  # many distinct token counts (prefill): forget them as they come
            _SEEN.clear()
        _SEEN.add(key)
    with bound.call(key):
        return ordinary()


def recipe_count() -> int:
    """How many calls are replayed (for tests and benchmarks)."""
    return sum(1 for r in _RECIPES.values() if r is not _NEVER)


def forget() -> None:
    """Drop every recipe and its workspaces (calls are recorded again as they come)."""
    _RECIPES.clear()
    _SEEN.clear()
    _held[0] = 0


def held_bytes() -> int:
    """Bytes of workspaces the recipes keep now (bounded by ``MAX_HELD_BYTES``)."""
    return _held[0]


class _Watch(TorchDispatchMode):
    """Logs the call's allocations into ``events``; anything but an allocation or a view makes
    the call not replayable (``refused`` names it)."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events
        self.refused = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _ALLOCATING and isinstance(out, torch.Tensor):
            self.events.append(("alloc", out))
        elif not func.is_view and name != "detach" and self.refused is None:
            self.refused = str(func)
        return out


def _record(key, inputs: tuple, ordinary):
    events: list = []
    watch = _Watch(events)
    with bound.call(key), bound.recording(events), watch:
        out = ordinary()
    recipe = None if watch.refused else Recipe.build(key, inputs, out, events)
    if len(_RECIPES) >= _MAX_RECIPES:
        forget()
    _RECIPES[key] = _NEVER if recipe is None else recipe
    return out


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the bytes a tensor's elements span."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return start, start + span * t.element_size()


def _find(ptr: int, spans: list) -> tuple[int, int] | None:
    """(source, offset) of the one span holding ``ptr`` (None where none or several do)."""
    hits = [(src, ptr - lo) for src, lo, hi in spans if lo <= ptr < hi]
    return hits[0] if len(hits) == 1 else None


class Recipe:
    """A call's launches with the sources of their addresses (the module docstring)."""

    __slots__ = ("key", "launches", "output", "workspaces", "inputs", "per_stream")

    def __init__(self, key, launches, output, workspaces, inputs: int):
        self.key = key
        self.launches = launches  # [(binary, grid3, base args, [(position, source, offset)])]
        self.output = output  # (shape, stride, dtype, device)
        self.workspaces = workspaces  # {source: (shape, stride, dtype, device)}
        self.inputs = inputs  # sources 0..inputs-1 are the inputs, `inputs` the output, more workspaces
        self.per_stream: dict = {}

    @classmethod
    def build(cls, key, inputs: tuple, out, events: list) -> Recipe | None:
        """The recipe of a recorded call, or None where it cannot be replayed."""
        if not isinstance(out, torch.Tensor) or any(out is t for t in inputs if t is not None):
            return None
        n = len(inputs)
        spans = [(i, *_extent(t)) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.numel()]
        allocs: list[torch.Tensor] = []
        live: list = []  # (source, start, end) of the allocations, the latest first
        launches = []
        for event in events:
            if event[0] == "refuse":
                return None
            if event[0] == "alloc":
                t = event[1]
                allocs.append(t)
                live.insert(0, (n + len(allocs), *_extent(t)))
                continue
            _, binary, grid, args = event
            base, dynamic = [], []
            for position, value in enumerate(args):
                if isinstance(value, torch.Tensor):
                    where = _find(value.data_ptr(), spans)
                    if where is None:
                        where = next(((src, value.data_ptr() - lo) for src, lo, hi in live
                                      if lo <= value.data_ptr() < hi), None)
                    if where is None:
                        return None
                    dynamic.append((position, *where))
                    base.append(0)
                elif isinstance(value, _CONSTANTS):
                    base.append(value)
                else:
                    return None
            launches.append((binary, grid, base, dynamic))
        # The output: one allocation, returned whole (as it is or as a view of all of it); it is
        # allocated afresh, in the returned shape, at every replay.
        found = [i for i, t in enumerate(allocs) if _extent(t) == _extent(out) and t.dtype == out.dtype]
        if len(found) != 1:
            return None
        out_source = n + 1 + found[0]
        used = {src for _, _, _, dynamic in launches for _, src, _ in dynamic}
        workspaces = {n + 1 + i: (tuple(t.shape), t.stride(), t.dtype, t.device) for i, t in enumerate(allocs)
                      if n + 1 + i in used and n + 1 + i != out_source}
        if sum(_bytes(*spec) for spec in workspaces.values()) > MAX_WORKSPACE_BYTES:
            return None
        # Sources renumbered: inputs 0..n-1, the output n, workspaces after.
        launches = [(binary, grid, base, [(p, n if s == out_source else s, o) for p, s, o in dynamic])
                    for binary, grid, base, dynamic in launches]
        return cls(key, launches, (tuple(out.shape), out.stride(), out.dtype, out.device), workspaces, n)

    def _prepare(self, stream: int) -> list:
        """The launches for ``stream``: its workspaces allocated and their addresses filled in.
        Past ``MAX_HELD_BYTES`` in all, every other recipe is dropped first (prefill with many
        distinct lengths would otherwise keep a workspace per length)."""
        need = sum(_bytes(*spec) for spec in self.workspaces.values())
        if _held[0] + need > MAX_HELD_BYTES:
            forget()
            self.per_stream.clear()
            _RECIPES[self.key] = self
        _held[0] += need
        held = {src: torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for src, (shape, stride, dtype, device) in self.workspaces.items()}
        prepared = []
        for binary, grid, base, dynamic in self.launches:
            base = list(base)
            per_call = []
            for position, src, offset in dynamic:
                if src in held:
                    base[position] = held[src].data_ptr() + offset
                else:
                    per_call.append((position, src, offset))
            prepared.append((*_launcher(binary, grid), base, tuple(per_call)))
        self.per_stream[stream] = (prepared, held)
        return prepared

    def replay(self, inputs: tuple) -> torch.Tensor:
        stream = bound.current_stream()
        entry = self.per_stream.get(stream)
        prepared = entry[0] if entry is not None else self._prepare(stream)
        shape, stride, dtype, device = self.output
        out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        ptrs = [0 if t is None else t.data_ptr() for t in inputs]
        ptrs.append(out.data_ptr())
        for launch, head, tail, base, per_call in prepared:
            args = base.copy()
            for position, src, offset in per_call:
                args[position] = ptrs[src] + offset
            launch(*head, stream, *tail, *args)
        return out


def _bytes(shape, stride, dtype, device) -> int:
    if any(n == 0 for n in shape):
        return 0
    return (sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * dtype.itemsize


def _launcher(binary, grid: tuple) -> tuple:
    """(callable, arguments before the stream, arguments after it) that launch ``binary``: its
    launcher's compiled function where the kernel needs no scratch memory, else the launcher."""
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    run = binary.run
    native = getattr(run, "launch", None)
    simple = (native is not None and not getattr(run, "global_scratch_size", 1)
              and not getattr(run, "profile_scratch_size", 1))
    if simple:
        return native, grid3, (binary.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                               binary.packed_metadata, None, None, None)
    return run, grid3, (binary.function, binary.packed_metadata, None, None, None)
