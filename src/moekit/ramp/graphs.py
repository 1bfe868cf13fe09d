"""Routing-aware choice inside a CUDA graph, where no value may be read back to the host.

A graph is captured for one token count M, so what varies between replays is only the routing.
:class:`GraphedMoE` captures, for that M, the selection (the cost model on the device, restricted
to a few *candidate* configurations: those the model picks at M over a sweep of routings,
:func:`graph_candidates`) followed by the candidates' calls, one of which runs:

* ``conditional``: each candidate's call sits in a CUDA-graph conditional (IF) node whose
  predicate is ``choice == k``, written by the selection on the device; the others are skipped
  by the GPU at no cost beyond the node. Needs torch's ``CUDAGraph.begin_capture_to_if_node``
  (CUDA >= 12.4); the captured call must be legal in a conditional body (kernels, memsets,
  copies -- Triton launches qualify).
* ``masked``: every candidate runs, the ones not chosen on routing whose every slot is masked
  (-1), so their kernels find no token block and exit at once; the chosen one's output is
  picked by index on the device. Works in any graph; costs the candidates' launches.
* ``static``: one configuration, the one the model predicts best at M over the routing sweep
  (the least mean predicted time): no choice at run time. What a batch-keyed tuner would use,
  and the graph path's answer when choosing does not pay.

``mode="auto"`` tries ``conditional``, then ``masked``. Which one pays is measured by
``moekit bench ramp`` (the graph section; docs/ramp.md).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from moekit.kernels.configs import KernelConfig
from moekit.ramp.select import Selector, choose_device, device_model
from moekit.routing import synthetic_routing

MODES = ("auto", "conditional", "masked", "static")
SWEEP_BETAS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
SWEEP_ZIPF = (0.6, 1.0, 1.4, 2.0)


def routing_sweep(selector: Selector, M: int, seeds: int = 3, routed: int | None = None) -> list[np.ndarray]:
    """Expert histograms of M tokens over a sweep of skews (betas and Zipf exponents) and seeds."""
    shape = selector.shape
    routed = routed or shape.num_experts
    out = []
    for seed in range(seeds):
        for kw in [dict(beta=b) for b in SWEEP_BETAS] + [dict(zipf=z) for z in SWEEP_ZIPF]:
            ids, _ = synthetic_routing(M, routed, shape.top_k, seed=1000 + seed, weights=False, **kw)
            ids = ids[ids < shape.num_experts]
            out.append(np.bincount(ids.numpy(), minlength=shape.num_experts))
    return out


def graph_candidates(selector: Selector, M: int, k: int = 3, histograms: list[np.ndarray] | None = None
                     ) -> tuple[list[int], int, dict]:
    """(the k configs the model picks most often at M over the routing sweep, the static config:
    least mean predicted time, facts): indices into ``selector.configs``. ``facts``: how often
    each was picked and the predicted mean loss of choosing among the k only, or of the static one."""
    if selector.fallback:
        raise ValueError("graph candidates need a fitted model")
    hists = histograms if histograms is not None else routing_sweep(selector, M)
    preds = np.stack([selector.model.predict(h, M) for h in hists])  # [routings, configs]
    preds = np.where(np.isfinite(preds), preds, np.inf)
    picks = Counter(selector.model.choose_predicted(h, M, p) for h, p in zip(hists, preds))
    cands = [i for i, _ in picks.most_common(k)]
    static = int(np.argmin(preds.mean(axis=0)))
    if static not in cands:
        cands = cands[: k - 1] + [static] if k > 1 else [static]
    best = preds.min(axis=1)
    loss_k = float(np.mean(preds[:, cands].min(axis=1) / best - 1))
    loss_static = float(np.mean(preds[:, static] / best - 1))
    return cands, static, {"picks": {str(i): n for i, n in picks.items()}, "predicted_loss_candidates": loss_k,
                           "predicted_loss_static": loss_static, "routings": len(hists)}


def conditional_nodes_available() -> bool:
    return hasattr(torch.cuda, "CUDAGraph") and hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")


class GraphedMoE:
    """``fused_moe`` for the static buffers ``x`` [M, H], ``topk_ids``, ``topk_weights`` in one
    CUDA graph, the configuration chosen on the device (see the module docstring). Write new
    routing into ``topk_ids`` / ``topk_weights`` and :meth:`replay`; the result is ``self.out``
    and ``self.choice`` (0-dim int32: the position in ``self.candidates``) says which config ran.
    """

    def __init__(self, selector: Selector, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, k: int = 3, mode: str = "auto",
                 candidates: list[int] | None = None, static: int | None = None, **scales):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.selector = selector
        self.M = x.shape[0]
        self.args = (x, w13, w2, topk_ids, topk_weights)
        self.scales = scales
        if candidates is None or static is None:
            cands, stat, self.facts = graph_candidates(selector, self.M, k)
            candidates = candidates if candidates is not None else cands
            static = static if static is not None else stat
        else:
            self.facts = {}
        self.candidates = list(candidates)
        self.static = static
        self.configs: list[KernelConfig] = [selector.configs[i] for i in self.candidates]
        dm = device_model(selector.model, selector.device, selector.capacity, configs=self.candidates)
        self._dm = dm
        pos = {c: p for p, c in enumerate(self.candidates)}
        self._pos_of_row = torch.tensor([pos[c] for c in dm.rows], dtype=torch.int32, device=selector.device)
        self.out = torch.empty_like(x if x.dtype != torch.float8_e4m3fn else x.to(torch.bfloat16))
        self.choice = torch.zeros((), dtype=torch.int32, device=selector.device)
        self.mode = mode
        self.graph = None

    # -- the captured body -------------------------------------------------------------

    def _choose(self) -> torch.Tensor:
        x, w13, w2, ids, w = self.args
        row, _ = choose_device(self._dm, self.M, topk_ids=ids, num_experts=self.selector.shape.num_experts,
                               use_triton=self.selector.use_triton)
        return self._pos_of_row.index_select(0, row.reshape(1).long())[0]

    def _call(self, config: KernelConfig, ids=None):
        from moekit.kernels import fused_moe

        x, w13, w2, ids0, w = self.args
        return fused_moe(x, w13, w2, ids0 if ids is None else ids, w, config, **self.scales)

    def run_masked(self) -> torch.Tensor:
        """The masked form, eagerly (also what the captured ``masked`` graph does)."""
        choice = self._choose()
        self.choice.copy_(choice)
        ids = self.args[3]
        ys = [self._call(c, torch.where(choice == k, ids, torch.full_like(ids, -1)))
              for k, c in enumerate(self.configs)]
        self.out.copy_(torch.stack(ys).index_select(0, choice.reshape(1).long())[0])
        return self.out

    def _body_conditional(self, graph) -> None:
        choice = self._choose()
        self.choice.copy_(choice)
        for k, c in enumerate(self.configs):
            pred = self.choice == k
            graph.begin_capture_to_if_node(pred)
            self.out.copy_(self._call(c))
            graph.end_capture_to_conditional_node()

    def _body_static(self) -> None:
        self.choice.fill_(self.candidates.index(self.static) if self.static in self.candidates else -1)
        self.out.copy_(self._call(self.selector.configs[self.static]))

    # -- capture / replay --------------------------------------------------------------

    def capture(self) -> "GraphedMoE":
        """Warm every candidate up (compiles, allocations) and capture the graph."""
        if not torch.cuda.is_available() or self.selector.device.type != "cuda":
            raise ValueError("GraphedMoE.capture needs a CUDA device")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._choose()
            for c in self.configs + [self.selector.configs[self.static]]:
                self._call(c)
            self.run_masked()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        modes = [self.mode] if self.mode != "auto" else (
            ["conditional", "masked"] if conditional_nodes_available() else ["masked"])
        last = None
        for mode in modes:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    if mode == "conditional":
                        self._body_conditional(graph)
                    elif mode == "masked":
                        self.run_masked()
                    else:
                        self._body_static()
            except (RuntimeError, AttributeError) as error:
                last = error
                torch.cuda.synchronize()
                continue
            self.graph, self.mode = graph, mode
            return self
        raise RuntimeError(f"capturing the routing-aware graph failed in every mode {modes}: {last}")

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            raise ValueError("call capture() first")
        self.graph.replay()
        return self.out
