"""The analytical MoE-tax model of the MoE-tax paper (Demystifying the MoE Serving Tax), section 5 (equations 1-7).

tau = T(MoE, m) / T(DenseFA, m) for one transformer layer; both models share the
non-FFN work T_other, so (eq. 3) tau = 1 + (T_MoE / T_FFN - 1) * f under TP attention.

Per-unit costs (Table 3), in seconds:

    alpha     = W_e / BW_HBM       load one expert's weights
    alpha_act = d_act / BW_HBM     activation I/O of one token-expert pair
    beta      = F_e / FLOPS_peak   compute of one token-expert pair
    gamma     = d_model * s / BW_net   move one token's row over the network

Block times (per layer, critical path):

    DenseFA  (eq. 2)  T_FFN,c = max(alpha*K + alpha_act*mK, beta*mK) / n_tp;  + T_AR
    TP+TP    (eq. 4)  T_MoE,c = max(alpha*E_active + alpha_act*eta*mK, beta*eta*mK) / n_tp;
                      + T_anc + T_AR
    TP+EP    (eq. 5)  max_g max(alpha*E_g + alpha_act*P_g, beta*P_g) + T_anc + T_AR
    DP+EP    (eq. 7)  max_g (T_a2a_d,g + T_c,g + T_a2a_c,g) + T_anc, with T_other on m/n
                      tokens and no AllReduce (eq. 6)

with P_g = eta_g * R_g the padded work of GPU g. Shared experts (not in the paper's
equations) ride along as ``k_shared`` always-active expert-equivalents in both the MoE
and DenseFA. ``docs/tax.md`` lists every choice the paper leaves open.

Everything random (E_active, eta, R_g, S_g) is either an exact expectation under uniform
routing (TP, blockwise padding) or an average over Monte Carlo / traced batches.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Mapping

import numpy as np

from ..jsonfile import read_json
from ..shapes import MoEShape, get_shape
from . import comm
from .bbb import expert_counts, loads_from_counts
from .calibrated import CalibratedBlocks, KernelCost, default_tile_n
from .efficiency import Calibration
from .hardware import Hardware, get_hardware
from .padding import expected_active_experts, expected_eta
from .placement import Placement
from .topk import as_topk_array, sample_routing

PARALLELISMS = ("TP+TP", "TP+EP", "DP+EP")
PHASES = ("prefill", "decode")
REGIMES = ("memory-bound", "transition", "compute-bound")


# --------------------------------------------------------------------------- shapes


def tax_shape(name: str | MoEShape) -> MoEShape:
    """A preset MoE shape by name, or ``<preset>-tp<n>``: one GPU's shard of the preset under n-way
    tensor parallelism (every routed and shared expert ``n`` times narrower, e.g.
    ``deepseek-v3-tp8``: N = 2048 / 8 = 256). ValueError for an unknown name or an n that does
    not divide the widths."""
    if isinstance(name, MoEShape):
        return name
    text = str(name).strip()
    base, sep, tp = text.rpartition("-tp")
    if sep and base and tp.isdigit():
        shape, n = get_shape(base), int(tp)
        if n < 1 or shape.intermediate % n or shape.shared_intermediate % n:
            raise ValueError(f"{text}: tp{n} must divide the expert widths of {base} "
                             f"({shape.intermediate}, shared {shape.shared_intermediate})")
        return shape.scaled(name=text, intermediate=shape.intermediate // n,
                            shared_intermediate=shape.shared_intermediate // n)
    return get_shape(text)


# --------------------------------------------------------------------------- unit costs


@dataclass(frozen=True)
class UnitCosts:
    """Table 3's per-unit costs (seconds) and the quantities behind them."""

    alpha: float  # per expert: weight load
    alpha_act: float  # per token-expert: activation I/O
    beta: float  # per token-expert: FLOPs
    gamma_dispatch: float  # per token: network, dispatch dtype
    gamma_combine: float  # per token: network, combine dtype
    expert_bytes: float  # W_e
    act_bytes_per_pair: float  # d_act
    flops_per_pair: float  # F_e
    k_shared: float  # shared-expert width in routed-expert units (0 if none)


def unit_costs(
    shape: MoEShape,
    hw: Hardware,
    *,
    weight_bytes: float = 2.0,
    act_bytes: float = 2.0,
    dispatch_bytes: float = 2.0,
    combine_bytes: float = 2.0,
    include_shared: bool = True,
) -> UnitCosts:
    """alpha, alpha_act, beta, gamma for one SwiGLU expert H -> 2N -> N -> H.

    d_act counts what one token-expert pair moves through HBM around the two GEMMs:
    read x (H), write and read the gate/up output (2N each way), write and read the
    activated N, write the output (H): 2H + 6N elements.
    """
    h, n = shape.hidden, shape.intermediate
    w_e = 3.0 * h * n * weight_bytes
    d_act = (2.0 * h + 6.0 * n) * act_bytes
    f_e = 2.0 * 3.0 * h * n  # two GEMMs of 2N and N columns: 2 FLOPs per MAC
    k_shared = 0.0
    if include_shared and shape.num_shared_experts:
        k_shared = shape.num_shared_experts * shape.shared_intermediate / n
    return UnitCosts(
        alpha=w_e / hw.hbm_bw,
        alpha_act=d_act / hw.hbm_bw,
        beta=f_e / hw.peak_flops,
        gamma_dispatch=comm.gamma(h, dispatch_bytes, hw),
        gamma_combine=comm.gamma(h, combine_bytes, hw),
        expert_bytes=w_e,
        act_bytes_per_pair=d_act,
        flops_per_pair=f_e,
        k_shared=k_shared,
    )


# --------------------------------------------------------------------------- non-FFN work


@dataclass(frozen=True)
class AttentionSpec:
    """What the non-FFN part of one layer (T_other) costs: attention, roughly.

    ``params``: projection weights (Q, K, V, O or MLA's); ``kv_elems``: KV-cache elements
    per token; ``score_dim``: width of the QK^T and PV products per token (4 * score_dim
    FLOPs per attended token).
    """

    params: int
    kv_elems: int
    score_dim: int


# Not in the paper: taken from the models' public configurations, to give T_other (and
# so f) a plausible size. Override with TaxModel(attention=...) or give f directly.
_ATTENTION = {
    # 32 query heads, 8 KV heads, head dim 128
    "mixtral-8x7b": AttentionSpec(params=2 * 4096 * 4096 + 2 * 4096 * 1024, kv_elems=2 * 1024, score_dim=4096),
    # 28 query heads, 4 KV heads, head dim 128
    "qwen2-moe": AttentionSpec(params=2 * 3584 * 3584 + 2 * 3584 * 512, kv_elems=2 * 512, score_dim=3584),
    # MLA: q_a, q_b, kv_a, kv_b, o projections; 512 + 64 cached elements; 128 heads x 192
    "deepseek-v3": AttentionSpec(
        params=7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168,
        kv_elems=576,
        score_dim=128 * 192,
    ),
}


def attention_spec(shape: MoEShape) -> AttentionSpec:
    """The attention of a preset model; multi-head attention of width H otherwise."""
    if shape.name in _ATTENTION:
        return _ATTENTION[shape.name]
    h = shape.hidden
    return AttentionSpec(params=4 * h * h, kv_elems=2 * h, score_dim=h)


# --------------------------------------------------------------------------- results


@dataclass
class TaxPoint:
    """The model's prediction for one (phase, parallelism, batch size)."""

    model: str
    hardware: str
    phase: str
    parallelism: str
    m: int
    n_gpus: int
    tau: float
    tau_densepa: float  # T(DensePA)/T(DenseFA): the paper's lower-bound curve
    regime: str
    dominant: str  # the tax source with the largest share of tau - 1
    sources: dict  # source -> its share of tau - 1 (they sum to tau - 1)
    t_moe: float  # MoE block time, s (eq. 4/5/7 incl. T_anc, T_AR, AllToAll)
    t_dense: float  # DenseFA block time T_FFN^TP, s
    t_other_moe: float  # non-FFN time beside the MoE block (TP or DP attention), s
    t_other_dense: float  # non-FFN time beside DenseFA (TP attention), s
    f: float  # T_FFN / (T_other + T_FFN) of DenseFA
    e_active: float
    eta: float  # padded / real routed work (global)
    straggler: float  # max_g R_g / (mK/n) (1 under TP)
    padded_straggler: float  # max_g P_g / (mK/n) (eta under TP)
    block_size: int
    regime_ratio: float  # the paper's closed form of T_MoE,c/T_FFN,c for this regime
    compute_ratio: float  # T_MoE,c / T_FFN,c as computed (no T_anc, T_AR, AllToAll)
    cost_model: str = "100% peaks"  # what priced the blocks: the paper's roofline, or the calibration

    def as_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- the model


class TaxModel:
    """tau for one model on one kind of GPU, per phase, parallelism and batch size.

    Options (all keyword):

    * ``padding``: "blockwise" (default), "max" or "none"; ``block_size``: kernel block
      B, or None for "auto" (the smallest of 16/32/64 covering the mean tokens per active
      expert, as tuned FusedMoE configs pick smaller M-blocks for small batches);
    * ``eta``: None to derive padding from routing, or a constant (float, or a mapping
      phase -> float, e.g. the paper's validation {"decode": 1.05, "prefill": 1.25});
    * ``f``: None to derive T_other from ``attention`` (an AttentionSpec), or the FFN
      fraction of DenseFA time (float or callable(m, phase));
    * ``context_len``: KV tokens each decode sequence reads; ``prompt_len``: prefill tokens
      per sequence (a prefill batch of m tokens is m / prompt_len prompts);
    * ``anc_kernels``, ``kernel_latency``: T_anc = kernels * latency + the HBM traffic of
      router and output sum; ``weight_bytes``, ``act_bytes``, ``dispatch_bytes``,
      ``combine_bytes``; ``include_shared``;
    * ``trials``, ``seed``: Monte Carlo batches for expert parallelism under uniform routing;
    * ``calibration``: a :class:`~moekit.tax.efficiency.Calibration` for this GPU (already moved
      to it, see ``adapt_calibration``): blocks are priced as the launches they run at their
      calibrated efficiencies (``moekit.tax.calibrated``) instead of at 100 % of the peaks;
      ``kernel_cost`` (with ``kernel_name``): a routing-aware cost of the expert kernel that
      replaces the grouped curve where it covers the call; ``tile_n``: the kernel's column
      tile (None: moekit's default for the token block). Without a calibration the model is
      the paper's roofline and these are ignored.
    """

    def __init__(
        self,
        shape: MoEShape | str,
        hardware: Hardware | str,
        n_gpus: int = 8,
        *,
        padding: str = "blockwise",
        block_size: int | None = None,
        eta: float | Mapping[str, float] | None = None,
        f: float | Callable[[int, str], float] | None = None,
        attention: AttentionSpec | None = None,
        context_len: int = 512,
        prompt_len: int = 512,
        anc_kernels: int = 4,
        kernel_latency: float = 2e-6,
        weight_bytes: float = 2.0,
        act_bytes: float = 2.0,
        dispatch_bytes: float = 2.0,
        combine_bytes: float = 2.0,
        include_shared: bool = True,
        trials: int = 64,
        seed: int = 0,
        calibration: Calibration | None = None,
        kernel_cost: KernelCost | None = None,
        kernel_name: str | None = None,
        tile_n: int | None = None,
    ) -> None:
        self.shape = tax_shape(shape)
        self.hw = get_hardware(hardware)
        if n_gpus < 1:
            raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
        self.n = int(n_gpus)
        if padding not in ("blockwise", "max", "none"):
            raise ValueError(f"padding must be 'blockwise', 'max' or 'none', got {padding!r}")
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1 or None, got {block_size}")
        self.padding, self.block_size, self.eta, self.f = padding, block_size, eta, f
        self.attention = attention or attention_spec(self.shape)
        self.context_len, self.prompt_len = int(context_len), max(1, int(prompt_len))
        self.anc_kernels, self.kernel_latency = anc_kernels, kernel_latency
        self.weight_bytes, self.act_bytes = weight_bytes, act_bytes
        self.costs = unit_costs(
            self.shape, self.hw, weight_bytes=weight_bytes, act_bytes=act_bytes,
            dispatch_bytes=dispatch_bytes, combine_bytes=combine_bytes, include_shared=include_shared,
        )
        self.trials, self.seed = int(trials), seed
        self._mc_cache: dict = {}
        if tile_n is not None and tile_n < 1:
            raise ValueError(f"tile_n must be >= 1 or None, got {tile_n}")
        self.tile_n = tile_n
        self.calibration = calibration
        self.blocks = None if calibration is None else CalibratedBlocks(
            calibration, self.shape, elem=weight_bytes, kernel_cost=kernel_cost, kernel_name=kernel_name)
        self.cost_model = "100% peaks" if calibration is None else f"calibrated ({calibration.name})"

    # ----------------------------------------------------------------- building blocks

    def _roofline(self, weights, rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """max(alpha*weights + alpha_act*rows, beta*rows) and its two sides."""
        c = self.costs
        mem = c.alpha * np.asarray(weights, dtype=np.float64) + c.alpha_act * np.asarray(rows, dtype=np.float64)
        comp = c.beta * np.asarray(rows, dtype=np.float64)
        return np.maximum(mem, comp), mem, comp

    def block_size_for(self, m: int, e_active: float | None = None) -> int:
        if self.block_size is not None:
            return self.block_size
        e_active = e_active or float(expected_active_experts(self.shape.num_experts, self.shape.top_k, m))
        per_expert = m * self.shape.top_k / max(e_active, 1.0)
        # 1e-6 slack: E[E_active] is a hair under E once saturated, which must not
        # push 16.0 tokens per expert into the next block size.
        return next((b for b in (16, 32) if per_expert <= b * (1 + 1e-6)), 64)

    def allreduce(self, m: float) -> float:
        """T_AR: one ring AllReduce of the m x H layer output over the TP group."""
        return comm.allreduce_time(m, self.shape.hidden, self.act_bytes, self.hw, self.n)

    def ancillary(self, m: float) -> float:
        """T_anc: router, top-k, align, sum: launch latency plus their HBM traffic (calibrated:
        the router's measured cost; the alignment and sum are in the expert kernel's)."""
        if self.blocks is not None:
            return float(self.blocks.router(m))
        traffic = self.act_bytes * m * self.shape.hidden * (self.shape.top_k + 2)
        return self.anc_kernels * self.kernel_latency + traffic / self.hw.hbm_bw

    def dense_ffn(self, m: float, experts: float | None = None) -> float:
        """T_FFN^TP (eq. 2 + T_AR): a dense FFN of ``experts`` expert widths, TP-sharded.

        experts = K gives DenseFA, E gives DensePA (shared experts added to both).
        """
        width = (self.shape.top_k if experts is None else experts) + self.costs.k_shared
        t, _, _ = self._dense_sides(m, width)
        return float(t) + self.allreduce(m)

    def _dense_sides(self, m: float, width: float):
        """(t, mem, compute) of a dense FFN of ``width`` expert widths on one of the n GPUs."""
        if self.blocks is not None:
            return self.blocks.dense(m, width * self.shape.intermediate / self.n)
        return self._roofline(width / self.n, m * width / self.n)

    def _moe_sides(self, active, padded, tokens, shards: int, shared_w, shared_rows, block: int, counts=None):
        """(t, mem, compute, how) of the expert computation on one GPU: ``active`` routed experts
        of width N / ``shards``, ``padded`` rows, and the shared experts as ``shared_w``
        expert-equivalents of weights over ``shared_rows`` rows (the paper's roofline), or the
        same launches at their calibrated cost (``tokens``: what the expert kernel sees);
        ``how`` says what priced the experts."""
        if self.blocks is None:
            t, mem, comp = self._roofline(np.asarray(active) / shards + shared_w,
                                          np.asarray(padded) / shards + shared_rows)
            return t, mem, comp, self.cost_model
        n_e = self.shape.intermediate
        shared_tokens = np.asarray(shared_rows) / shared_w if shared_w else np.zeros_like(np.asarray(tokens, float))
        return self.blocks.moe(active, padded, tokens, n_e / shards, shared_w * n_e, shared_tokens,
                               block, self.tile_n or default_tile_n(block), counts)

    def attention_time(self, m: float, phase: str, shards: int) -> float:
        """Non-FFN time of one layer for m tokens, attention weights split ``shards`` ways."""
        _check_phase(phase)
        a, hw = self.attention, self.hw
        if m <= 0:
            return 0.0
        mem = a.params * self.weight_bytes
        flops = 2.0 * a.params * m
        if phase == "decode":  # m sequences, each reading context_len cached tokens
            mem += m * self.context_len * a.kv_elems * self.act_bytes
            flops += 4.0 * m * self.context_len * a.score_dim
        else:  # prompts of prompt_len tokens; causal: a token sees (L+1)/2 on average
            length = min(self.prompt_len, m)
            mem += m * a.kv_elems * self.act_bytes
            flops += 4.0 * m * (length + 1) / 2.0 * a.score_dim
        return max(mem / hw.hbm_bw, flops / hw.peak_flops) / shards

    def other_times(self, m: int, phase: str) -> tuple[float, float]:
        """(T_other^TP, T_other^DP). TP attention also pays its AllReduce; DP does not."""
        tp_model = self.attention_time(m, phase, self.n) + self.allreduce(m)
        dp = self.attention_time(math.ceil(m / self.n), phase, 1)
        if self.f is None:
            return tp_model, dp
        f = self.f(m, phase) if callable(self.f) else float(self.f)
        if not 0.0 < f <= 1.0:
            raise ValueError(f"f must be in (0, 1], got {f}")
        tp = self.dense_ffn(m) * (1.0 - f) / f  # eq. 3: f = T_FFN / (T_other + T_FFN)
        return tp, dp * (tp / tp_model if tp_model > 0 else 1.0)

    def _eta_const(self, phase: str) -> float | None:
        if self.eta is None:
            return None
        value = self.eta[phase] if isinstance(self.eta, Mapping) else self.eta
        if value < 1.0:
            raise ValueError(f"eta must be >= 1, got {value}")
        return float(value)

    # ----------------------------------------------------------------- routing samples

    def _samples(self, m: int, routing=None):
        """Token distributions for batches of m tokens: counts [S, E] and their ids."""
        e, k = self.shape.num_experts, self.shape.top_k
        if routing is not None:
            ids, e_r = as_topk_array(routing, e)
            if e_r != e:
                raise ValueError(f"routing has {e_r} experts, the model {e}")
            ids = rebatch(ids, m)
            return expert_counts(ids, e), ids
        key = (m, self.trials, self.seed)
        if key not in self._mc_cache:
            ids = sample_routing(m, e, k, samples=self.trials, seed=self.seed + m)
            self._mc_cache[key] = (expert_counts(ids, e), ids)
        return self._mc_cache[key]

    # ----------------------------------------------------------------- predictions

    def point(self, m: int, phase: str = "decode", parallelism: str = "TP+TP", routing=None) -> TaxPoint:
        """tau and its decomposition for a batch of m tokens.

        ``routing``: optional top-k ids [..., T, K] or a trace; its tokens are cut into
        batches of m (see ``rebatch``) in place of uniform random routing.
        """
        _check_phase(phase)
        if parallelism not in PARALLELISMS:
            raise ValueError(f"parallelism must be one of {PARALLELISMS}, got {parallelism!r}")
        if not isinstance(m, (int, np.integer)) or m < 1:
            raise ValueError(f"m must be an int >= 1, got {m!r}")
        m = int(m)
        if parallelism != "TP+TP" and self.shape.num_experts % self.n:
            raise ValueError(f"n_gpus={self.n} must divide num_experts={self.shape.num_experts} for EP")
        if parallelism == "TP+TP":
            parts = self._tp_tp(m, phase, routing)
        else:
            parts = self._ep(m, phase, routing, dp=parallelism == "DP+EP")
        return self._finish(m, phase, parallelism, parts)

    def sweep(self, batch_sizes: Iterable[int], phases=PHASES, parallelisms=PARALLELISMS, routing=None) -> list[TaxPoint]:
        """Points for every combination; parallelisms that do not fit n_gpus are skipped."""
        out = []
        for par in parallelisms:
            if par != "TP+TP" and self.shape.num_experts % self.n:
                continue
            for phase in phases:
                out.extend(self.point(int(m), phase, par, routing) for m in batch_sizes)
        return out

    # TP+TP: every GPU holds 1/n of every expert and sees all m tokens (eq. 4).
    def _tp_tp(self, m: int, phase: str, routing) -> dict:
        shp, c = self.shape, self.costs
        mk = m * shp.top_k
        eta_const = self._eta_const(phase)
        counts = None
        # A routing-aware kernel cost needs token counts per expert, so it samples them.
        exact = not (self.blocks is not None and self.blocks.kernel_cost is not None and self.n == 1)
        if routing is None and self.padding in ("blockwise", "none") and eta_const is None and exact:
            e_act = np.array([expected_active_experts(shp.num_experts, shp.top_k, m)])
            block = self.block_size_for(m, float(e_act[0]))
            eta = np.array([expected_eta(shp.num_experts, shp.top_k, m, block, self.padding)])
        else:
            counts, _ = self._samples(m, routing)
            e_act = (counts > 0).sum(axis=1).astype(np.float64)
            block = self.block_size_for(m, float(e_act.mean()))
            if eta_const is not None:
                eta = np.full(e_act.shape, eta_const)
            else:
                stats = loads_from_counts(counts, Placement.contiguous(shp.num_experts, 1), block, self.padding)
                eta = stats.padded[:, 0] / np.maximum(stats.total, 1)
            mk = counts.sum(axis=1).astype(np.float64)

        how = self.cost_model
        if self.blocks is None:
            weights = (e_act + c.k_shared) / self.n  # eq. 4: 1/n_tp of every loaded expert
            t_full, mem, comp = self._roofline(weights, (eta * mk + c.k_shared * m) / self.n)
            t_nopad, _, _ = self._roofline(weights, (mk + c.k_shared * m) / self.n)
        else:  # every GPU runs 1/n of every expert's columns on all m tokens
            shared = (c.k_shared / self.n, c.k_shared * m / self.n)
            t_full, mem, comp, how = self._moe_sides(e_act, eta * mk, m, self.n, *shared, block,
                                                     counts if self.n == 1 else None)
            t_nopad, _, _, _ = self._moe_sides(e_act, mk, m, self.n, *shared, block)
        anc, ar = self.ancillary(m), self.allreduce(m)
        t_other_tp, _ = self.other_times(m, phase)
        steps = {  # sequential removal of each source; the remainder is weight loading
            "padding": float(np.mean(t_full - t_nopad)),
            "ancillary": anc,
        }
        return dict(
            t_moe=float(np.mean(t_full)) + anc + ar, t_other_moe=t_other_tp, steps=steps,
            moe_mem=float(np.mean(mem)), moe_comp=float(np.mean(comp)),
            e_active=float(np.mean(e_act)), eta=float(np.mean(eta)), straggler=1.0,
            padded_straggler=float(np.mean(eta)), block=block,
            moe_compute=float(np.mean(t_full)), how=how,
        )

    # TP+EP (eq. 5) and DP+EP (eqs. 6-7): GPU g holds E/n experts; the slowest GPU sets
    # the time.
    def _ep(self, m: int, phase: str, routing, dp: bool) -> dict:
        shp, c, n = self.shape, self.costs, self.n
        counts, ids = self._samples(m, routing)
        e_act = (counts > 0).sum(axis=1).astype(np.float64)
        block = self.block_size_for(m, float(e_act.mean()))
        placement = Placement.contiguous(shp.num_experts, n)
        eta_const = self._eta_const(phase)
        stats = loads_from_counts(counts, placement, block, self.padding)
        routed = stats.routed.astype(np.float64)
        padded = routed * eta_const if eta_const is not None else stats.padded.astype(np.float64)
        active = stats.active.astype(np.float64)
        total = stats.total.astype(np.float64)[:, None]
        tokens = ids.shape[1]

        if dp:  # each GPU runs its own tokens' shared experts with full (replicated) weights
            m_g = np.bincount(comm.token_sources(tokens, n), minlength=n).astype(np.float64)[None, :]
            shared_w, shared_rows = c.k_shared, c.k_shared * m_g
            sent, received = comm.traffic(ids, placement)
            a2a_d = comm.alltoall_time(sent, received, c.gamma_dispatch, self.hw, n)
            a2a_c = comm.alltoall_time(received, sent, c.gamma_combine, self.hw, n)
        else:  # TP+EP: shared experts stay TP-sharded over the n GPUs
            shared_w, shared_rows = c.k_shared / n, c.k_shared * m / n
            a2a_d = a2a_c = np.zeros_like(routed)

        def per_gpu(active_, padded_, a2a_d_, a2a_c_, shared=(shared_w, shared_rows)):
            # The expert kernel of GPU g sees the rows routed to it (as a dispatcher delivers them).
            t, mem, comp, _ = self._moe_sides(active_, padded_, np.maximum(padded_, 1.0), 1, shared[0], shared[1],
                                              block)
            return t + a2a_d_ + a2a_c_, t, mem, comp

        full, t_c, mem, comp = per_gpu(active, padded, a2a_d, a2a_c)
        nopad, _, _, _ = per_gpu(active, routed, a2a_d, a2a_c)
        # Balanced: every GPU gets the mean of everything (E_active/n experts, mK/n pairs,
        # m/n tokens of its own, the mean AllToAll).
        mean_active = active.mean(axis=1, keepdims=True)
        mean_routed = total / n
        mean_shared = (shared_w, c.k_shared * m / n if dp else shared_rows)
        mean_a2a_d = a2a_d.mean(axis=1, keepdims=True)
        mean_a2a_c = a2a_c.mean(axis=1, keepdims=True)
        balanced, _, _, _ = per_gpu(mean_active, mean_routed, mean_a2a_d, mean_a2a_c, mean_shared)
        no_comm, _, _, _ = per_gpu(mean_active, mean_routed, 0.0, 0.0, mean_shared)
        # DenseFA-like sharing: shared experts TP-sharded instead of replicated per DP rank.
        sharded, _, _, _ = per_gpu(mean_active, mean_routed, 0.0, 0.0, (c.k_shared / n, c.k_shared * m / n))

        worst = full.argmax(axis=1)
        rows = np.arange(full.shape[0])
        anc = self.ancillary(math.ceil(m / n) if dp else m)
        t_other_tp, t_other_dp = self.other_times(m, phase)
        ar = self.allreduce(m)
        t_full = full.max(axis=1)
        steps = {
            "padding": float(np.mean(t_full - nopad.max(axis=1))),
            "straggler": float(np.mean(nopad.max(axis=1) - balanced.max(axis=1))),
        }
        if dp:
            # What the MoE's AllToAlls cost beyond the AllReduce that DenseFA pays.
            steps["communication"] = float(np.mean(balanced.max(axis=1) - no_comm.max(axis=1))) - ar
            steps["ancillary"] = anc
            # Attention and shared experts replicated on every DP rank vs TP-sharded.
            steps["DP replication"] = (t_other_dp - t_other_tp) + float(
                np.mean(no_comm.max(axis=1) - sharded.max(axis=1))
            )
            t_moe = float(np.mean(t_full)) + anc
        else:
            steps["ancillary"] = anc
            t_moe = float(np.mean(t_full)) + anc + ar
        return dict(
            t_moe=t_moe, t_other_moe=t_other_dp if dp else t_other_tp, steps=steps,
            moe_mem=float(np.mean(mem[rows, worst])), moe_comp=float(np.mean(comp[rows, worst])),
            e_active=float(e_act.mean()),
            eta=float(padded.sum() / max(total.sum(), 1.0)),
            straggler=float(np.mean(stats.straggler())),
            padded_straggler=float(np.mean(padded.max(axis=1) / np.maximum(total[:, 0] / n, 1e-300))),
            block=block, moe_compute=float(np.mean(t_c.max(axis=1))),
        )

    def _finish(self, m: int, phase: str, parallelism: str, parts: dict) -> TaxPoint:
        shp, c = self.shape, self.costs
        t_ffn = self.dense_ffn(m)
        t_other_tp, _ = self.other_times(m, phase)
        dense_total = t_other_tp + t_ffn
        moe_total = parts["t_other_moe"] + parts["t_moe"]
        tau = moe_total / dense_total
        t_pa = self.dense_ffn(m, experts=shp.num_experts)
        tau_pa = (t_other_tp + t_pa) / dense_total

        # Dense FFN sides, for the regime (the 1/n_tp cancels in the comparisons).
        width = shp.top_k + c.k_shared
        _, dense_mem, dense_comp = self._dense_sides(m, width)
        moe_mem_bound = parts["moe_mem"] >= parts["moe_comp"]
        dense_mem_bound = float(dense_mem) >= float(dense_comp)
        if moe_mem_bound:
            regime = "memory-bound" if dense_mem_bound else "transition"
        else:  # MoE compute-bound (with a memory-bound DenseFA only through padding)
            regime = "compute-bound"

        # Shares of tau - 1: each removed source, then the remainder (weight loading
        # E_active vs K: "weight amplification" when memory-bound, "batch subdivision"
        # in the transition; near zero when compute-bound).
        steps = dict(parts["steps"])
        remainder = (moe_total - dense_total) - sum(steps.values())
        steps["weight amplification" if regime == "memory-bound" else "batch subdivision"] = remainder
        sources = {k: v / dense_total for k, v in steps.items()}
        dominant = max(sources, key=sources.get)
        if sources[dominant] <= 0:
            dominant = "none"

        e_act, eta = parts["e_active"], parts["eta"]
        mk = m * shp.top_k
        if regime == "memory-bound":
            regime_ratio = e_act / shp.top_k
        elif regime == "transition":
            regime_ratio = c.alpha * e_act / (c.beta * mk)
        else:
            regime_ratio = eta
        dense_c = float(np.maximum(dense_mem, dense_comp))
        return TaxPoint(
            model=shp.name, hardware=self.hw.name, phase=phase, parallelism=parallelism, m=m,
            n_gpus=self.n, tau=tau, tau_densepa=tau_pa, regime=regime, dominant=dominant,
            sources=sources, t_moe=parts["t_moe"], t_dense=t_ffn, t_other_moe=parts["t_other_moe"],
            t_other_dense=t_other_tp, f=t_ffn / dense_total, e_active=e_act, eta=eta,
            straggler=parts["straggler"], padded_straggler=parts["padded_straggler"],
            block_size=int(parts["block"]), regime_ratio=regime_ratio,
            compute_ratio=parts["moe_compute"] / dense_c,
            cost_model=self.cost_model if self.blocks is None else
            f"{self.cost_model}; experts: {parts.get('how') or self.blocks.experts_source}",
        )


def _check_phase(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")


def rebatch(ids: np.ndarray, m: int) -> np.ndarray:
    """Cut routing ``[S, T, K]`` into batches of m tokens: all tokens in order, chunked.

    A trace's batches are concatenated (step-major) and cut every m tokens; a final
    partial batch is dropped. Too few tokens for one batch is a ValueError.
    """
    ids = np.asarray(ids)
    k = ids.shape[-1]
    flat = ids.reshape(-1, k)
    batches = flat.shape[0] // m
    if batches == 0:
        raise ValueError(f"routing holds {flat.shape[0]} tokens, fewer than one batch of m={m}")
    return flat[: batches * m].reshape(batches, m, k)


# --------------------------------------------------------------------------- measured


def compare(predicted: Iterable[TaxPoint], measured) -> list[dict]:
    """Per-point error of predictions against measurements.

    ``measured``: an iterable of mappings (or a JSON file holding a list of them) with
    ``phase``, ``parallelism``, ``m`` and any of ``tau``, ``t_moe`` (MoE block seconds),
    ``t_dense`` (DenseFA block seconds). Each measured quantity gives one row with
    predicted, measured and relative error (predicted / measured - 1). Measurements
    with no matching prediction are reported with predicted = None.
    """
    if isinstance(measured, (str, os.PathLike)):
        measured = _load_measured(measured)
    index = {(p.phase, p.parallelism, p.m): p for p in predicted}
    rows = []
    for i, rec in enumerate(measured):
        try:
            key = (rec["phase"], rec["parallelism"], int(rec["m"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"measured[{i}] needs phase, parallelism and m ({exc})") from None
        point = index.get(key)
        for quantity in ("tau", "t_moe", "t_dense"):
            if quantity not in rec:
                continue
            meas = float(rec[quantity])
            pred = getattr(point, quantity) if point is not None else None
            err = pred / meas - 1.0 if pred is not None and meas != 0 else None
            rows.append({"phase": key[0], "parallelism": key[1], "m": key[2], "quantity": quantity,
                         "predicted": pred, "measured": meas, "rel_error": err})
    return rows


def _load_measured(path) -> list:
    path = os.fspath(path)
    data = read_json(path, "measurements")
    if isinstance(data, dict) and "points" in data:
        data = data["points"]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path}: expected a list of objects (or {{'points': [...]}})")
    return data


def format_compare(rows: list[dict]) -> str:
    """The compare() table as text."""
    lines = [f"{'phase':8} {'parallelism':11} {'m':>6} {'quantity':8} {'predicted':>12} {'measured':>12} {'error':>8}"]
    for r in rows:
        pred = "-" if r["predicted"] is None else f"{r['predicted']:.4g}"
        err = "-" if r["rel_error"] is None else f"{100 * r['rel_error']:+.1f}%"
        lines.append(f"{r['phase']:8} {r['parallelism']:11} {r['m']:>6} {r['quantity']:8} {pred:>12} {r['measured']:>12.4g} {err:>8}")
    return "\n".join(lines)
