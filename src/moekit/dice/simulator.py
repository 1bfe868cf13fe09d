"""The staleness simulator: a schedule executed on one process, exactly.

It runs the whole batch (every rank's samples) through the model with the MoE layers
computed directly — no dispatcher, no handles, no threads — and decides which step's
activations each layer's experts see from :meth:`SchedulePlan.source_step`, a table
written independently of the runner's pipeline:

* a synchronous (t, l) computes every slot's expert output on this step's tokens;
* an asynchronous (t, l) that launches computes the slots it would send on this step's
  tokens and takes the others from the result the layer held at the end of step t - 1
  (conditional communication's cache), keyed by the step;
* every (t, l) then uses the result of ``source_step(t, l)``.

The routed output is :func:`moekit.ep.weighted_slot_sum` of those slot outputs (float32,
slot order) with the stale or latest router weights, plus the always-fresh shared expert.
With ``batch_invariant=True`` (and the model in the same mode) each row's arithmetic is
independent of its batch, so the distributed runner on any number of ranks must match
this simulation bitwise; ``tests/dice`` checks that on 2 and 4 gloo ranks.

``row_rank[T]`` (optional) names the rank each token row lives on, to count the rows a
schedule sends to other ranks exactly as the runner does.
"""

from __future__ import annotations

import torch

from moekit.dice.dit_moe import route
from moekit.dice.exact import expert_mlp
from moekit.dice.runner import SlotResult, assemble, scale, send_mask
from moekit.dice.schedules import ScheduleConfig, SchedulePlan
from moekit.moe.experts import MoEWeights
from moekit.shapes import MoEShape


class StalenessSimulator:
    """A drop-in for :class:`~moekit.dice.runner.ScheduledMoE` on one process (same hooks:
    ``begin_step``, ``runner(layer, h)``, ``end_step``, ``stats``)."""

    def __init__(self, weights: list[MoEWeights], shape: MoEShape, schedule: ScheduleConfig, num_steps: int, *,
                 batch_invariant: bool = False, world_size: int = 1, row_rank: torch.Tensor | None = None):
        if not weights:
            raise ValueError("weights must list at least one layer's MoEWeights")
        self.plan = SchedulePlan(schedule, num_steps, len(weights))
        self.schedule, self.shape, self.weights = schedule, shape, weights
        self.E_local = shape.experts_per_rank(world_size)
        self.batch_invariant = batch_invariant
        self.row_rank = row_rank
        self.step: int | None = None
        self._results: list[dict[int, SlotResult]] = [{} for _ in weights]
        self.sources = [[-1] * len(weights) for _ in range(num_steps)]
        self._rows = torch.zeros(num_steps, 2, dtype=torch.int64)

    def begin_step(self, step: int) -> None:
        if not 0 <= step < self.plan.num_steps:
            raise ValueError(f"step must be in [0, {self.plan.num_steps - 1}], got {step}")
        self.step = step

    def end_step(self) -> None:
        self.step = None

    def __call__(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        t, plan, w = self.step, self.plan, self.weights[layer]
        if t is None:
            raise RuntimeError("call begin_step(step) before running the layers")
        probs, weights, ids = route(h, w.router, self.shape.top_k, batch_invariant=self.batch_invariant)
        results = self._results[layer]
        if not plan.is_async(t, layer):
            results[t] = self._compute(t, h, ids, weights, w, asynchronous=False, cache=None)
        elif plan.launches(t, layer):
            cache = results.get(plan.source_step(t - 1, layer)) if t > 0 else None
            results[t] = self._compute(t, h, ids, weights, w, asynchronous=True, cache=cache)
        source = plan.source_step(t, layer)
        if source not in results:
            raise RuntimeError(f"layer {layer} at step {t}: no result of step {source} was computed")
        self.sources[t][layer] = source
        y = scale(results[source], probs, self.schedule.scores, h.dtype)
        for old in [s for s in results if s < source]:  # sources never go back: forget older results
            del results[old]
        if w.shared_w13 is not None:
            y = y + expert_mlp(h, w.shared_w13, w.shared_w2, batch_invariant=self.batch_invariant).to(y.dtype)
        return y

    def _compute(self, t: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: MoEWeights, *,
                 asynchronous: bool, cache: SlotResult | None) -> SlotResult:
        """Slot outputs for the data of step t: fresh where sent, cached elsewhere."""
        send, cached = send_mask(self.plan, t, 0, ids, cache, asynchronous)
        T, K = ids.shape
        fresh = torch.zeros(T, K, h.shape[1], dtype=w.w13.dtype, device=h.device)
        for e in torch.unique(ids[send]).tolist():
            token, slot = torch.nonzero(send & (ids == e), as_tuple=True)
            fresh[token, slot] = expert_mlp(h[token].to(w.w13.dtype), w.w13[e], w.w2[e],
                                            batch_invariant=self.batch_invariant)
        if self.row_rank is not None:
            owner = torch.div(ids, self.E_local, rounding_mode="floor")
            remote = owner != self.row_rank.to(ids.device).view(T, 1)
            self._rows[t, 0] += int((send & remote).sum())
            self._rows[t, 1] += int((send & ~remote).sum())
        return SlotResult(t, ids, weights, assemble(fresh, send, cached))

    def stats(self) -> dict:
        return dict(rows_remote=self._rows[:, 0].tolist(), rows_local=self._rows[:, 1].tolist(),
                    sources=[list(r) for r in self.sources])

    def close(self) -> None:
        pass
