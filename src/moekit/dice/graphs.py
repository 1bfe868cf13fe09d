"""Whole denoising steps as CUDA graphs, exchanges on the side stream inside them.

A step of a schedule is the same sequence of kernels, collectives and stream edges at
every step whose decisions are the same (:func:`step_signature`: per layer whether it is
asynchronous, launches, receives, keeps its result, which step's data it uses, and
whether conditional communication refreshes every slot). Over a dispatcher that never
reads the host (:class:`moekit.dice.stale.StaleExchange`, whose shapes are fixed) and the
side-stream executor (:class:`moekit.dice.executor.StreamExecutor`), such a step can be
captured: the executor's event record / wait pairs become the graph's fork and join
edges, so inside the graph the exchanges still run on the communication stream beside
the next layers' compute.

:class:`GraphedSampler` runs the Euler sampler of :func:`moekit.dice.sampler.sample`:

* it finds the schedule's steady cycle (:func:`find_cycle`: ``p`` consecutive step
  signatures that repeat, with one full cycle run eagerly before it, which also compiles
  every kernel the capture will record);
* runs the steps before it eagerly, then captures the ``p`` steps of one cycle as ``p``
  graphs (one memory pool), without running them;
* replays the cycle while the signatures repeat, and runs what is left (the cool-down,
  the last steps that launch nothing) eagerly.

State between steps. What one step leaves for the next (displaced dispatches in flight,
combines in flight, held results: :meth:`ScheduledMoE.state`) lives in tensors. Inside the
cycle graph ``j`` reads what graph ``j - 1`` wrote, at the addresses of the capture; the
last graph copies the state it leaves into the tensors the first graph read (the state
before the cycle), so the cycle closes on fixed addresses. Leaving the replays, the
runner's state is that same set of tensors with its step numbers moved on
(:meth:`ScheduledMoE.set_state`). The latent and the time are fixed input buffers.

A captured graph must join every side-stream branch before it ends, so each step's last
exchange is waited for at the end of its graph: the exchanges a step leaves in flight
overlap that step's remaining layers, not the next step's first ones.

If the state a cycle leaves is not shaped like the state it found (a schedule whose
pattern the signature misses), nothing is replayed: the run goes on eagerly and
``self.fallback`` says why.
"""

from __future__ import annotations

import dataclasses

import torch

from moekit.dice.schedules import SchedulePlan

MAX_PERIOD = 4


def step_signature(plan: SchedulePlan, step: int) -> tuple:
    """Everything that decides what a step's capture records."""
    layers = tuple((plan.is_async(step, layer), plan.launches(step, layer), plan.arrives(step, layer),
                    plan.keeps_result(step, layer), plan.source_step(step, layer) - step)
                   for layer in range(plan.num_layers))
    return layers, plan.refresh_all(step)


def find_cycle(plan: SchedulePlan, max_period: int = MAX_PERIOD) -> tuple[int, int] | None:
    """``(start, period)``: the first step from which ``period`` signatures repeat at least
    once more, with one full cycle of the same signatures just before ``start`` (run
    eagerly: it warms up what the capture records); None if there is none."""
    n = plan.num_steps
    sig = [step_signature(plan, t) for t in range(n)]
    for start in range(1, n):
        for p in range(1, max_period + 1):
            if start - p < 0 or start + 2 * p > n:
                continue
            if all(sig[start + j] == sig[start + j + p] for j in range(-p, p)):
                return start, p
    return None


# ----------------------------------------------------------------------------- state tensors


def _walk(obj, out: list, depth: int = 0) -> None:
    """Tensors of a dispatch result: tensors, dataclasses, dicts, lists and tuples (never
    arbitrary objects: a dispatcher's own buffers are not step state)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth > 12 or obj is None:
        return
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _walk(getattr(obj, f.name), out, depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk(v, out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, out, depth + 1)
    elif hasattr(obj, "meta") and hasattr(obj, "state"):  # a low-latency handle: its meta and state
        _walk(vars(obj), out, depth + 1)


def _launch_tensors(launch, with_dispatch: bool) -> list:
    out = [launch.ids, launch.weights, launch.send]
    if launch.cached is not None:
        out.append(launch.cached)
    if with_dispatch:
        _walk(getattr(launch.handle, "value", None), out)
    return out


def state_tensors(state: tuple) -> list[torch.Tensor]:
    """The tensors of :meth:`ScheduledMoE.state`, in a fixed order."""
    pending, combines, held = state
    out: list[torch.Tensor] = []
    for launch in pending:
        if launch is not None:
            out += _launch_tensors(launch, with_dispatch=True)
    for layer in combines:
        for c in layer:
            _walk(getattr(c.handle, "value", None), out)
            out += _launch_tensors(c.launch, with_dispatch=False)
    for r in held:
        if r is not None:
            out += [r.ids, r.weights, r.out]
    return out


def state_skeleton(state: tuple, step: int) -> tuple:
    """The state's shape: which entries exist, their step numbers relative to ``step``,
    and every tensor's shape and dtype."""
    pending, combines, held = state
    return (tuple(None if p is None else p.step - step for p in pending),
            tuple(tuple((c.due - step, c.launch.step - step) for c in layer) for layer in combines),
            tuple(None if r is None else r.source - step for r in held),
            tuple((tuple(t.shape), t.dtype) for t in state_tensors(state)))


def _closing_copies(before: list[torch.Tensor], after: list[torch.Tensor]) -> list[tuple] | str:
    """``(destination, source)`` pairs that put the state a cycle leaves into the tensors
    it found; a reason string when the pairing is not one-to-one."""
    target: dict[int, torch.Tensor] = {}
    pairs = []
    for b, a in zip(before, after):
        if id(b) in target:
            if target[id(b)] is not a:
                return "one tensor of the state before the cycle stands for two different tensors after it"
            continue
        target[id(b)] = a
        if a is not b:
            pairs.append((b, a))
    storages = {b.untyped_storage().data_ptr() for b in before}
    # A source that shares memory with the state before is read before any destination is written.
    return [(b, a.clone() if a.untyped_storage().data_ptr() in storages else a) for b, a in pairs]


class GraphedSampler:
    """The Euler sampler with guidance (``moekit.dice.sampler.sample``) with the steady
    steps of ``runner``'s schedule replayed from CUDA graphs (module docstring)."""

    def __init__(self, model, runner, *, steps: int, cfg_scale: float):
        if steps != runner.plan.num_steps:
            raise ValueError(f"steps={steps} must be the runner's num_steps={runner.plan.num_steps}")
        self.model, self.runner, self.steps, self.cfg_scale = model, runner, steps, cfg_scale
        self.plan = runner.plan
        self.cycle = find_cycle(self.plan)
        self.graphs: list = []
        self.replayed_steps = 0
        self.fallback: str | None = None if self.cycle is not None else "the schedule has no repeating steps"

    def _step(self, i: int, z: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> None:
        """One step, in place on ``z`` (``t`` holds this step's time): the body of ``sample``."""
        self.runner.begin_step(i)
        v = self.model.forward_with_cfg(z, t, labels, self.cfg_scale, moe=self.runner)
        self.runner.end_step()
        z.copy_(z - v / self.steps)

    def _time(self, i: int) -> float:
        return (self.steps - i) / self.steps

    @torch.no_grad()
    def run(self, noise: torch.Tensor, labels: torch.Tensor, on_step=None) -> torch.Tensor:
        """The sampler's final latent; ``on_step(i, z)`` sees the latent after each step."""
        runner = self.runner
        z = noise.clone()
        t = torch.empty(noise.shape[0], dtype=noise.dtype, device=noise.device)
        start, period = self.cycle if self.cycle is not None else (self.steps, 0)
        signatures = [step_signature(self.plan, j) for j in range(self.steps)]
        before = None  # the state the cycle starts from (the graphs' fixed addresses)
        i = 0
        while i < self.steps:
            if i == start and not self.graphs and self.fallback is None:
                before = runner.state()
                self._capture(start, period, z, t, labels, before)
            replay = (self.graphs and i >= start and i + period <= self.steps
                      and signatures[i:i + period] == signatures[start:start + period])
            if replay:
                for j, graph in enumerate(self.graphs):
                    t.fill_(self._time(i + j))
                    graph.replay()
                    runner.settle_rows(i + j)
                    runner.sources[i + j] = [s + i - start for s in self._sources[j]]
                    if on_step is not None:
                        on_step(i + j, z)
                self.replayed_steps += period
                i += period
                continue
            if self.graphs and i > start and before is not None:  # leaving the replays: the state, moved on
                runner.set_state(before, shift=i - start)
                before = None
            t.fill_(self._time(i))
            self._step(i, z, t, labels)
            if on_step is not None:
                on_step(i, z)
            i += 1
        return z

    def _capture(self, start: int, period: int, z, t, labels, before: tuple) -> None:
        """Record steps start .. start + period - 1 (nothing runs), or set ``fallback``."""
        runner, executor = self.runner, self.runner.executor
        if z.device.type != "cuda":
            self.fallback = "CUDA graphs need CUDA tensors"
            return
        before_tensors = state_tensors(before)
        graphs, sources, pool = [], [], None
        runner.capturing = True
        try:
            for j in range(period):
                graph = torch.cuda.CUDAGraph()
                if hasattr(executor, "begin_capture"):
                    executor.begin_capture()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._step(start + j, z, t, labels)
                    if hasattr(executor, "join"):  # the side stream's results are read below
                        executor.join()
                    if j == period - 1:
                        after = runner.state()
                        if state_skeleton(after, start + period) != state_skeleton(before, start):
                            self.fallback = "the state a cycle leaves is not shaped like the state it found"
                        else:
                            copies = _closing_copies(before_tensors, state_tensors(after))
                            if isinstance(copies, str):
                                self.fallback = copies
                            else:
                                for dst, src in copies:
                                    dst.copy_(src)
                    if hasattr(executor, "end_capture"):
                        executor.end_capture()
                pool = graph.pool()
                graphs.append(graph)
                sources.append(list(runner.sources[start + j]))
        except RuntimeError as error:  # an operation a capture refuses: run eagerly instead, on every rank alike
            self.fallback = f"capture failed: {str(error).strip().splitlines()[0] if str(error).strip() else error!r}"
            if getattr(executor, "_capturing", False):
                executor.end_capture()
            runner.step, runner._queue = None, []  # the step the capture was recording never happened
            torch.cuda.synchronize(z.device)
        finally:
            runner.capturing = False
        runner.set_state(before)  # the capture ran nothing: the state is still the one before the cycle
        if self.fallback is None:
            self.graphs, self._sources = graphs, sources


__all__ = ["GraphedSampler", "find_cycle", "state_skeleton", "state_tensors", "step_signature"]
