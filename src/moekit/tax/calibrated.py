"""The calibrated model's block times: the MoE-tax blocks as the launches they run, each at its
calibrated efficiency (``moekit.tax.efficiency``).

Where the MoE-tax paper's roofline charges a block ``max(bytes / BW, FLOPs / peak)``, this
charges what the block runs on one GPU:

* **dense FFN** (DenseFA, DensePA, the shared experts) of width ``w`` on ``t`` tokens:
  ``x @ W13.T`` (a GEMM of t x 2w x H), SwiGLU's two elementwise passes (``silu`` of the gate:
  2 t w elements moved; times ``up``: 3 t w), ``@ W2.T`` (t x H x w): two launches of the dense
  GEMM curve and two of the elementwise one;
* **the experts** (moekit's fused kernel): one grouped launch with the active experts' weights,
  the padded rows (routing padded to the kernel's token block ``bm``) and the GEMM1 tiles
  (``padded / bm`` blocks x ``ceil(N / bn)`` columns: the wave quantization), at the grouped
  kernel's own calibrated curve (the dense curve where the calibration has none); its sorted
  path (more tokens than ``bm``) adds the alignment's fixed cost and the float32 output's
  zeroing and cast. Where a routing-aware kernel cost model covers the call (``kernel_cost``,
  e.g. a RaMP model file through ``moekit.bench.tax_ramp``), its time replaces the curve's;
* **the router** (gate matmul, softmax, top-k) at its calibrated cost, the MoE block's
  ancillary time, and the residual add of the shared experts' output (elementwise).

The memory and compute sides of every launch are summed separately to place a block in the
paper's regimes. Nothing here times anything: the numbers come from a :class:`Calibration`.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ..shapes import MoEShape
from .efficiency import Calibration, LaunchCost, gemm_features, grouped_features, smooth_max

# A routing-aware cost of the expert kernel: (tokens per expert [E], tokens) -> seconds, or
# None where it does not cover the call.
KernelCost = Callable[[np.ndarray, int], "float | None"]


def default_tile_n(bm: int) -> int:
    """The column tile of moekit's default kernel configs: 128 from bm = 64 on, else 64."""
    return 128 if bm >= 64 else 64


class CalibratedBlocks:
    """Block times of one shape on the GPU of ``cal`` (seconds; numpy arrays broadcast).

    ``kernel_cost``: optional routing-aware cost of the expert kernel for the full shape on
    one GPU (see module docstring); ``kernel_name`` says what it is, for the report.
    """

    def __init__(self, cal: Calibration, shape: MoEShape, elem: float = 2.0, kernel_cost: KernelCost | None = None,
                 kernel_name: str | None = None) -> None:
        self.cal, self.shape, self.elem = cal, shape, float(elem)
        self.kernel_cost, self.kernel_name = kernel_cost, kernel_name
        self.experts_curve: LaunchCost = cal.grouped or cal.dense

    @property
    def experts_source(self) -> str:
        curve = "grouped-kernel curve" if self.cal.grouped else "dense GEMM curve applied to the grouped GEMMs"
        return f"{self.kernel_name} where it covers the call, else the {curve}" if self.kernel_cost else curve

    # ------------------------------------------------------------------ launches

    def _launch(self, cost: LaunchCost, nbytes, flops, tiles):
        cal = self.cal
        mem, cmp = cost.sides(nbytes, flops, tiles, cal.hbm_bw, cal.peak_flops, cal.sms)
        return cost.fixed + smooth_max(mem, cmp, cost.p), mem, cmp

    def gemm(self, m, n, k):
        """(t, mem side, compute side) of ``x[m, k] @ w[n, k].T`` at the dense curve."""
        return self._launch(self.cal.dense, *gemm_features(m, n, k, self.elem))

    def stream(self, nbytes):
        return self.cal.stream.time(nbytes, self.cal.hbm_bw)

    # ------------------------------------------------------------------ blocks

    def dense(self, tokens, width):
        """A SwiGLU FFN of intermediate ``width`` on ``tokens`` tokens: (t, mem, compute)."""
        h, e = self.shape.hidden, self.elem
        tokens = np.asarray(tokens, dtype=np.float64)
        t1, m1, c1 = self.gemm(tokens, 2.0 * width, h)
        t2, m2, c2 = self.gemm(tokens, h, width)
        ew = self.stream(2.0 * tokens * width * e) + self.stream(3.0 * tokens * width * e)
        return t1 + t2 + ew, m1 + m2 + ew, c1 + c2

    def shared(self, tokens, width):
        """The shared experts (one dense FFN of their total width) and the add of their output."""
        tokens = np.asarray(tokens, dtype=np.float64)
        if width <= 0:
            zero = np.zeros_like(tokens)
            return zero, zero, zero
        t, mem, cmp = self.dense(tokens, width)
        add = self.stream(3.0 * tokens * self.shape.hidden * self.elem)
        return t + add, mem + add, cmp

    def experts(self, active, padded, tokens, width, bm: int, bn: int | None = None):
        """The grouped expert call: (t, mem, compute) from the active experts, the padded rows and
        the tokens it sees, each expert ``width`` wide (N, or N / n under TP)."""
        bn = bn or default_tile_n(bm)
        tokens = np.asarray(tokens, dtype=np.float64)
        nbytes, flops, tiles = grouped_features(active, padded, tokens, self.shape.hidden, width, bm, bn, self.elem)
        t, mem, cmp = self._launch(self.experts_curve, nbytes, flops, tiles)
        # The sorted path (more tokens than one block): alignment, zeroed float32 output, cast.
        sort = tokens > bm
        out = tokens * self.shape.hidden
        extra = np.where(sort, self.experts_curve.sorted_fixed + self.stream(4.0 * out) + self.stream(
            (4.0 + self.elem) * out), 0.0)
        return t + extra, mem + extra, cmp

    def router(self, tokens):
        """Gate matmul, softmax and top-k on ``tokens`` tokens."""
        tokens = np.asarray(tokens, dtype=np.float64)
        if self.cal.router is not None:
            return self.cal.router.time(tokens, self.shape.hidden, self.shape.num_experts)
        # Not calibrated: four elementwise-sized launches over the activations and the logits.
        return 4.0 * self.stream(tokens * (self.shape.hidden + 2.0 * self.shape.num_experts) * 4.0)

    def moe(self, active, padded, tokens, width, shared_width, shared_tokens, bm: int, bn: int | None = None,
            counts: np.ndarray | None = None):
        """The MoE FFN block on one GPU without its router: experts + shared experts.

        Returns (t, mem, compute, how) with ``how`` naming what gave the experts' time.
        ``counts`` [samples, E] (tokens per expert, full shape on one GPU): passed to the
        routing-aware kernel cost, whose time replaces the curve's where it covers every sample.
        """
        t, mem, cmp = self.experts(active, padded, tokens, width, bm, bn)
        how = "grouped-kernel curve" if self.cal.grouped else "dense curve"
        if self.kernel_cost is not None and counts is not None:
            tok = np.broadcast_to(np.asarray(tokens), (counts.shape[0],))
            times = [self.kernel_cost(np.asarray(c), int(round(float(n)))) for c, n in zip(counts, tok)]
            if all(x is not None and math.isfinite(x) and x > 0 for x in times):
                t = np.asarray(times, dtype=np.float64).reshape(np.shape(t)) if np.ndim(t) else float(np.mean(times))
                how = self.kernel_name or "kernel cost model"
        ts, ms, cs = self.shared(shared_tokens, shared_width)
        return t + ts, mem + ms, cmp + cs, how
