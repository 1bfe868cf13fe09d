"""DICE schedules: which denoising step's activations each MoE layer's experts work on.

A schedule is a :class:`ScheduleConfig` (what the user picks) and, for a run of
``num_steps`` denoising steps over ``num_layers`` MoE layers, a :class:`SchedulePlan` (the
decisions that follow from it). The same plan drives the distributed runner
(:class:`moekit.dice.runner.ScheduledMoE`, over any Dispatcher) and the single-process
staleness simulator (:class:`moekit.dice.simulator.StalenessSimulator`).

Modes (the DICE paper's Algorithms 1-3):

* ``sync`` — expert parallelism as usual: dispatch, experts, combine, all blocking.
* ``displaced`` — dispatch and combine are launched without waiting; a layer's experts
  work on the tokens dispatched one step earlier and its output comes from the combine
  launched one step earlier: the layer uses expert outputs of step ``t - 2`` (staleness 2).
* ``interweaved`` — the dispatch of layer l is consumed by the experts in layer l+1's slot
  of the *same* step, and their combine by layer l one step later: step ``t - 1``
  (staleness 1). Only the combine crosses a step boundary, so one dispatch buffer is
  enough for the whole model (displaced keeps one per layer).

Options, each a field of :class:`ScheduleConfig`:

* ``async_layers`` (selective synchronization): which layers run asynchronously —
  ``all``; ``shallow`` (the first half, the deep half synchronized); ``deep`` (the second
  half); ``interleaved`` (odd-numbered layers: every other layer synchronized).
* ``warmup`` (the first steps synchronous — at least 1 for an asynchronous mode, since the
  first step has nothing earlier to reuse), ``cooldown`` (the last steps synchronous),
  ``sync_every`` (steps ``t`` with ``t % sync_every == 0`` synchronous).
* ``cond_every`` (conditional communication, Algorithm 4): in an asynchronous layer, each
  token's top-1 slot is always sent; its other slots are sent only at steps ``t`` with
  ``t % cond_every == 0`` and otherwise reuse the expert output the token got for that
  expert the last time (the layer's held result — a slot whose expert is not in it is sent
  anyway). ``cond_every=1`` sends everything; None turns it off.
* ``scores``: the router weights that scale a stale expert output — ``stale`` (those of the
  step whose activations the experts saw; the paper's choice) or ``latest`` (this step's
  router probabilities for the same experts).

Pipeline rules (shared by runner and simulator; the :meth:`SchedulePlan.source_step` table
states their result independently of the runner's mechanics):

* a synchronous (step, layer) computes fresh expert outputs and holds them;
* an asynchronous one launches its dispatch only when the result will be consumed
  (``launches``), i.e. when the layer stays asynchronous for the next ``lag`` steps;
* an asynchronous one consumes the combine launched ``lag - 1`` steps earlier if there is
  one (data of step ``t - lag``), else the result it holds (the freshest it has).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

MODES = ("sync", "displaced", "interweaved")
ASYNC_LAYERS = ("all", "shallow", "deep", "interleaved")
SCORES = ("stale", "latest")
LAG = {"displaced": 2, "interweaved": 1}  # steps between a dispatch and the use of its result


def _check_int(name: str, value, lo: int, hi: int | None = None, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        allowed = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        extra = " or None" if optional else ""
        raise ValueError(f"{name} must be an int {allowed}{extra}, got {value!r}")


@dataclass(frozen=True)
class ScheduleConfig:
    """One DICE schedule (see the module docstring for every field)."""

    mode: str = "sync"
    async_layers: str = "all"
    warmup: int = 1
    cooldown: int = 0
    sync_every: int | None = None
    cond_every: int | None = None
    scores: str = "stale"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.async_layers not in ASYNC_LAYERS:
            raise ValueError(f"async_layers must be one of {ASYNC_LAYERS}, got {self.async_layers!r}")
        if self.scores not in SCORES:
            raise ValueError(f"scores must be one of {SCORES}, got {self.scores!r}")
        _check_int("warmup", self.warmup, 1 if self.is_async else 0)
        _check_int("cooldown", self.cooldown, 0)
        _check_int("sync_every", self.sync_every, 1, optional=True)
        _check_int("cond_every", self.cond_every, 1, optional=True)

    @property
    def is_async(self) -> bool:
        return self.mode != "sync"

    @property
    def lag(self) -> int:
        """Steps from a dispatch to the use of its result (0 for sync)."""
        return LAG.get(self.mode, 0)

    def layer_is_async(self, layer: int, num_layers: int) -> bool:
        """Selective synchronization: does this layer run asynchronously (outside sync steps)?"""
        if not self.is_async:
            return False
        if self.async_layers == "all":
            return True
        if self.async_layers == "shallow":
            return layer < (num_layers + 1) // 2
        if self.async_layers == "deep":
            return layer >= num_layers // 2
        return layer % 2 == 1  # interleaved

    def step_is_sync(self, step: int, num_steps: int) -> bool:
        """Warm-up, cool-down and periodic synchronization: is the whole step synchronous?"""
        return (step < self.warmup or step >= num_steps - self.cooldown
                or (self.sync_every is not None and step % self.sync_every == 0))

    def check_run(self, num_steps: int, num_layers: int) -> None:
        """Raise ValueError when this schedule cannot run ``num_steps`` steps over ``num_layers`` layers."""
        _check_int("num_steps", num_steps, 1)
        _check_int("num_layers", num_layers, 1)
        if self.warmup + self.cooldown > num_steps:
            raise ValueError(f"warmup + cooldown must be at most num_steps={num_steps} (the run is shorter than "
                             f"its synchronous steps), got warmup={self.warmup}, cooldown={self.cooldown}")

    def with_(self, **changes) -> "ScheduleConfig":
        return replace(self, **changes)

    def describe(self) -> str:
        """A short label, e.g. ``interweaved layers=shallow warmup=5 cond=2``."""
        if not self.is_async:
            return "sync"
        parts = [self.mode]
        if self.async_layers != "all":
            parts.append(f"layers={self.async_layers}")
        parts.append(f"warmup={self.warmup}")
        if self.cooldown:
            parts.append(f"cooldown={self.cooldown}")
        if self.sync_every:
            parts.append(f"sync_every={self.sync_every}")
        if self.cond_every:
            parts.append(f"cond={self.cond_every}")
        if self.scores != "stale":
            parts.append(f"scores={self.scores}")
        return " ".join(parts)


class SchedulePlan:
    """The decisions of one schedule for ``num_steps`` steps over ``num_layers`` layers."""

    def __init__(self, config: ScheduleConfig, num_steps: int, num_layers: int):
        if not isinstance(config, ScheduleConfig):
            raise ValueError(f"config must be a ScheduleConfig, got {type(config).__name__}")
        config.check_run(num_steps, num_layers)
        self.config, self.num_steps, self.num_layers = config, num_steps, num_layers

    def _check(self, step: int, layer: int) -> None:
        if not 0 <= step < self.num_steps:
            raise ValueError(f"step must be in [0, {self.num_steps - 1}], got {step}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers - 1}], got {layer}")

    def is_async(self, step: int, layer: int) -> bool:
        """Does (step, layer) run asynchronously?"""
        self._check(step, layer)
        return (self.config.layer_is_async(layer, self.num_layers)
                and not self.config.step_is_sync(step, self.num_steps))

    def launches(self, step: int, layer: int) -> bool:
        """Does (step, layer) launch an asynchronous dispatch? Only when its result will be
        used: the layer stays asynchronous through step + lag."""
        lag = self.config.lag
        if not self.config.is_async or step + lag >= self.num_steps:
            return False
        return all(self.is_async(s, layer) for s in range(step, step + lag + 1))

    def arrives(self, step: int, layer: int) -> bool:
        """Does a result launched earlier arrive for (step, layer)?"""
        start = step - self.config.lag
        return self.config.is_async and start >= 0 and self.launches(start, layer)

    def refresh_all(self, step: int) -> bool:
        """Conditional communication: is ``step`` one where every slot is sent?"""
        n = self.config.cond_every
        return n is None or step % n == 0

    @cached_property
    def source_table(self) -> list[list[int]]:
        """``table[t][l]``: the step whose activations the experts used for (t, l).

        Written as a recurrence over the table (not over the runner's handles), so that the
        runner's pipeline can be checked against it.
        """
        table: list[list[int]] = []
        lag = self.config.lag
        for t in range(self.num_steps):
            row = []
            for layer in range(self.num_layers):
                if not self.is_async(t, layer):
                    row.append(t)
                elif t - lag >= 0 and all(self.is_async(s, layer) for s in range(t - lag, t + 1)):
                    row.append(t - lag)  # the dispatch of t - lag was launched and is arriving now
                else:
                    row.append(table[t - 1][layer])  # nothing arrives: the held result
            table.append(row)
        return table

    def source_step(self, step: int, layer: int) -> int:
        self._check(step, layer)
        return self.source_table[step][layer]

    def keeps_result(self, step: int, layer: int) -> bool:
        """Must the result consumed at (step, layer) be held past this step? Yes when step + 1
        is asynchronous here and either nothing arrives then or conditional communication
        will read it as its cache."""
        if step + 1 >= self.num_steps or not self.is_async(step + 1, layer):
            return False
        return not self.arrives(step + 1, layer) or (self.config.cond_every is not None
                                                     and self.launches(step + 1, layer))

    def staleness(self) -> dict[str, float]:
        """Mean and maximum of t - source over all (step, layer), and the share of
        (step, layer) run asynchronously."""
        lags = [t - self.source_table[t][layer] for t in range(self.num_steps) for layer in range(self.num_layers)]
        asynchronous = sum(self.is_async(t, layer) for t in range(self.num_steps) for layer in range(self.num_layers))
        return dict(mean=sum(lags) / len(lags), max=max(lags), async_share=asynchronous / len(lags))


# ------------------------------------------------------------------------------- presets


def extra_sync_steps(num_steps: int) -> int:
    """Warm-up steps of the "with extra sync" presets: a tenth of the run (at least 2)."""
    return min(num_steps, max(2, round(num_steps / 10)))


PRESET_NAMES = ("sync", "displaced", "displaced+sync", "interweaved", "interweaved+sync", "dice", "dice+sync",
                "dice-deep", "dice-interleaved", "interweaved+cond", "interweaved+latest")


def preset(name: str, num_steps: int = 50) -> ScheduleConfig:
    """A named schedule, the rows of the quality table.

    "+sync" adds the extra synchronization (a warm-up of :func:`extra_sync_steps`); without
    it, only the first step is synchronous. ``dice``: interweaved, the deep half of the
    layers synchronized, conditional communication every 2 steps. ``dice-deep`` keeps the
    deep half asynchronous instead, ``dice-interleaved`` every other layer.
    """
    _check_int("num_steps", num_steps, 1)
    extra = extra_sync_steps(num_steps)
    dice = ScheduleConfig("interweaved", async_layers="shallow", cond_every=2)
    table = {
        "sync": ScheduleConfig("sync", warmup=0),
        "displaced": ScheduleConfig("displaced"),
        "displaced+sync": ScheduleConfig("displaced", warmup=extra),
        "interweaved": ScheduleConfig("interweaved"),
        "interweaved+sync": ScheduleConfig("interweaved", warmup=extra),
        "dice": dice,
        "dice+sync": dice.with_(warmup=extra),
        "dice-deep": dice.with_(async_layers="deep"),
        "dice-interleaved": dice.with_(async_layers="interleaved"),
        "interweaved+cond": ScheduleConfig("interweaved", cond_every=2),
        "interweaved+latest": ScheduleConfig("interweaved", scores="latest"),
    }
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(PRESET_NAMES)}") from None
