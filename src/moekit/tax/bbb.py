"""Balls-bins-buckets: tokens (balls) -> experts (bins) -> GPUs (buckets), with padding.

The MoE-tax paper, section 5.2: classic balls-and-bins bounds miss two things about MoE routing,
the second level of imbalance (experts live on GPUs) and kernel padding. This module
simulates both, batch by batch, with numpy and no Python loop over tokens:

1. routing: uniform random top-K, popularity-skewed top-K, or given top-k ids
   (an ``[..., T, K]`` array with -1 for a masked slot, or any object with
   ``.topk_ids`` and ``.num_experts`` such as ``moekit.routing.trace.RoutingTrace``;
   :mod:`moekit.tax.topk`);
2. tokens per expert N, split among the expert's replicas (a ``Placement``, from
   :mod:`moekit.tax.placement`);
3. per GPU g: routed work R_g, padded work P_g and activated slots E_g;
4. the straggler ratio max_g R_g / (mK / n_ep) and its padded version.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moekit.routing.stats import expert_counts  # [..., T, K] -> [..., E], -1 ignored

from .comm import traffic
from .padding import SCHEMES, max_load_bounds, padded_work
from .placement import Placement
from .topk import as_topk_array, sample_routing


# --------------------------------------------------------------------------- simulation


@dataclass
class LoadStats:
    """Per-batch, per-GPU loads from the simulator (S batches, n GPUs)."""

    counts: np.ndarray  # [S, E] tokens per logical expert (N)
    slot_counts: np.ndarray  # [S, n, s] tokens per physical slot
    routed: np.ndarray  # [S, n] R_g, token-expert assignments per GPU
    padded: np.ndarray  # [S, n] P_g, rows the kernel computes
    active: np.ndarray  # [S, n] E_g, activated slots per GPU
    total: np.ndarray  # [S] valid assignments (m*K when nothing is masked)
    block_size: int
    scheme: str
    sent: np.ndarray | None = None  # [S, n] S_g, assignments sent to other GPUs
    received: np.ndarray | None = None  # [S, n] assignments received from other GPUs

    @property
    def n_gpus(self) -> int:
        return self.routed.shape[1]

    def mean_load(self) -> np.ndarray:
        """mK / n_ep per batch."""
        return self.total / self.n_gpus

    def straggler(self) -> np.ndarray:
        """max_g R_g / (mK / n_ep) per batch (1.0 = perfectly balanced)."""
        return _ratio(self.routed.max(axis=1), self.mean_load())

    def padded_straggler(self) -> np.ndarray:
        """max_g P_g / (mK / n_ep): the straggler ratio of the work the kernel really does."""
        return _ratio(self.padded.max(axis=1), self.mean_load())

    def e_active(self) -> np.ndarray:
        """Logical experts with at least one token, per batch."""
        return (self.counts > 0).sum(axis=1)

    def eta_g(self) -> np.ndarray:
        """P_g / R_g per GPU (1 where a GPU got nothing)."""
        return np.where(self.routed > 0, self.padded / np.maximum(self.routed, 1), 1.0)

    def summary(self) -> dict:
        """Means over batches of the quantities the paper plots."""
        return {
            "straggler": float(self.straggler().mean()),
            "padded_straggler": float(self.padded_straggler().mean()),
            "balance": float((1.0 / self.straggler()).mean()),
            "padded_balance": float((1.0 / self.padded_straggler()).mean()),
            "e_active": float(self.e_active().mean()),
            "max_active_per_gpu": float(self.active.max(axis=1).mean()),
            "mean_active_per_gpu": float(self.active.mean()),
            "max_padded": float(self.padded.max(axis=1).mean()),
            "padding_overhead": float(_ratio(self.padded.sum(axis=1), self.total).mean()),
        }


def _ratio(num, den) -> np.ndarray:
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)


def loads_from_counts(
    counts, placement: Placement, block_size: int = 1, scheme: str = "blockwise"
) -> LoadStats:
    """R_g, P_g, E_g for token distributions N ``[S, E]`` under a placement."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    counts = np.atleast_2d(np.asarray(counts, dtype=np.int64))
    if counts.shape[-1] != placement.num_experts:
        raise ValueError(f"counts must have {placement.num_experts} experts on the last axis, got {counts.shape}")
    slot = placement.slot_counts(counts)
    return LoadStats(
        counts=counts,
        slot_counts=slot,
        routed=slot.sum(axis=-1),
        padded=padded_work(slot, block_size, scheme),
        active=(slot > 0).sum(axis=-1),
        total=counts.sum(axis=-1),
        block_size=block_size,
        scheme=scheme,
    )


def simulate(
    num_experts: int,
    n_gpus: int,
    num_tokens: int,
    top_k: int,
    *,
    trials: int = 100,
    block_size: int = 128,
    scheme: str = "blockwise",
    routing=None,
    placement: Placement | None = None,
    popularity=None,
    with_traffic: bool = False,
    seed: int | None = 0,
) -> LoadStats:
    """Balls-bins-buckets Monte Carlo of per-GPU load, with kernel padding.

    Without ``routing``, draws ``trials`` batches of ``num_tokens`` tokens (uniform, or
    skewed by ``popularity``). With ``routing`` (ids ``[..., T, K]`` or a trace), every
    batch in it is used as is and ``num_tokens``/``top_k``/``trials`` are ignored.
    ``with_traffic`` also counts the AllToAll traffic of DP attention (tokens spread over
    the GPUs in contiguous chunks; see ``moekit.tax.comm.traffic``).
    """
    placement = placement or Placement.contiguous(num_experts, n_gpus)
    if placement.num_experts != num_experts or placement.n_gpus != n_gpus:
        raise ValueError(
            f"placement is for {placement.num_experts} experts on {placement.n_gpus} GPUs, "
            f"not {num_experts} on {n_gpus}"
        )
    if routing is None:
        ids = sample_routing(num_tokens, num_experts, top_k, trials, popularity, seed)
    else:
        ids, e = as_topk_array(routing, num_experts)
        if e != num_experts:
            raise ValueError(f"routing has {e} experts, expected {num_experts}")
    stats = loads_from_counts(expert_counts(ids, num_experts), placement, block_size, scheme)
    if with_traffic:
        stats.sent, stats.received = traffic(ids, placement)
    return stats


# --------------------------------------------------------------------------- bounds


def bbb_bounds(num_tokens, num_experts: int, n_gpus: int, top_k: int) -> dict:
    """The paper's analytical worst-case loads applied at expert and at GPU level.

    Balls are the m*K token-expert assignments. At the expert level they fall into E
    bins, at the GPU level into n buckets (a GPU's load is the sum of its E/n experts,
    so the buckets see the same balls). Returns expected maximum loads and the straggler
    ratio bound max_g R_g / (mK/n) (the ``heavy``/prefill expression; meaningful for
    m*K >> n).
    """
    balls = np.asarray(num_tokens, dtype=np.float64) * top_k
    expert = max_load_bounds(balls, num_experts)
    gpu = max_load_bounds(balls, n_gpus)
    return {
        "expert_max_heavy": expert["heavy"],
        "expert_max_light": expert["light"],
        "gpu_max_heavy": gpu["heavy"],
        "straggler_bound": np.where(balls > 0, gpu["heavy"] / np.maximum(gpu["mean"], 1e-300), 1.0),
    }


# --------------------------------------------------------------------------- Figure 10


@dataclass(frozen=True)
class BBBConfig:
    """One curve of the paper's Figure 10."""

    label: str
    num_experts: int
    n_gpus: int
    top_k: int


# The paper does not say which top-K it simulated; we use each size's model: K=2 for 8
# experts (Mixtral), K=8 for 64 experts (Qwen2-MoE). 64E on 32G is "DP attention".
FIG10_CONFIGS = (
    BBBConfig("8E, 4G", 8, 4, 2),
    BBBConfig("64E, 4G", 64, 4, 8),
    BBBConfig("64E, 32G", 64, 32, 8),
)
# DeepGEMM's contiguous grouped GEMM aligns every expert's rows to 128.
DEEPGEMM_BLOCK = 128


def figure10_data(
    batch_sizes=(16, 64, 256, 1024, 4096),
    configs=FIG10_CONFIGS,
    trials: int = 1000,
    block_size: int = DEEPGEMM_BLOCK,
    seed: int = 0,
) -> list[dict]:
    """Balance (mean / max GPU load, 1.0 = perfect) with and without padding, per config."""
    rows = []
    for cfg in configs:
        for m in batch_sizes:
            st = simulate(cfg.num_experts, cfg.n_gpus, m, cfg.top_k, trials=trials, block_size=block_size, seed=seed)
            summary = st.summary()
            rows.append({"config": cfg.label, "m": int(m), **summary})
    return rows

