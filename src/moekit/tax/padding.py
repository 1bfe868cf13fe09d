"""Kernel padding and expert activation (the MoE-tax paper, sections 5.1 and 5.2).

Notation follows the paper: ``N`` is the token distribution (tokens per expert, summing to
m*K), ``B`` the kernel block size, ``P`` the padded work (rows the kernel really computes).

Two padding schemes:

* blockwise - every expert's tokens are rounded up to a multiple of B on their own
  (Triton FusedMoE, DeepGEMM contiguous prefill). Spread distributions waste the most.
* max - every active expert is padded to the largest count rounded up to B (DeepGEMM
  masked decode). Concentrated distributions waste the most.

All functions take counts with any leading batch dimensions ``[..., E]`` and reduce over
the last axis, so one call handles thousands of simulated batches.
"""

from __future__ import annotations

import math

import numpy as np

SCHEMES = ("blockwise", "max", "none")


def _check_block(block_size: int) -> int:
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    return int(block_size)


def round_up(counts, block_size: int) -> np.ndarray:
    """ceil(N / B) * B, elementwise (0 stays 0: an idle expert launches no block)."""
    b = _check_block(block_size)
    n = np.asarray(counts, dtype=np.int64)
    return -(-n // b) * b


def padded_work(counts, block_size: int, scheme: str = "blockwise") -> np.ndarray:
    """P for one group of experts (one GPU, or all experts under TP): reduces axis -1.

    blockwise: sum_i ceil(N_i/B)*B.  max: E_active * ceil(max_i N_i / B) * B.
    none: sum_i N_i (the kernel needs no alignment).
    """
    n = np.asarray(counts, dtype=np.int64)
    if scheme == "blockwise":
        return round_up(n, block_size).sum(axis=-1)
    if scheme == "max":
        active = (n > 0).sum(axis=-1)
        return active * round_up(n.max(axis=-1, initial=0), block_size)
    if scheme == "none":
        return n.sum(axis=-1)
    raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")


def eta(counts, block_size: int, scheme: str = "blockwise") -> np.ndarray:
    """Padding overhead eta = P / (sum N) >= 1 (TP: the group is all E experts).

    An empty batch has no padding: eta = 1 there rather than 0/0.
    """
    n = np.asarray(counts, dtype=np.int64)
    real = n.sum(axis=-1)
    padded = padded_work(n, block_size, scheme)
    return np.where(real > 0, padded / np.maximum(real, 1), 1.0)


def active_experts(counts) -> np.ndarray:
    """E_active: experts that received at least one token (reduces axis -1)."""
    return (np.asarray(counts) > 0).sum(axis=-1)


def expected_active_experts(num_experts: int, top_k: int, m) -> np.ndarray:
    """E[E_active] = E * (1 - (1 - K/E)^m) under uniform random top-K routing.

    Exact, not an approximation: a token picks K distinct experts uniformly, so a given
    expert is missed by one token with probability 1 - K/E, independently across tokens.
    """
    _check_ek(num_experts, top_k)
    m = np.asarray(m, dtype=np.float64)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** m)


def _check_ek(num_experts: int, top_k: int) -> None:
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")


def binomial_pmf(n: int, p: float) -> np.ndarray:
    """P[X = k] for k = 0..n, X ~ Binomial(n, p), computed in log space (no scipy)."""
    if n < 0 or not 0.0 <= p <= 1.0:
        raise ValueError(f"need n >= 0 and 0 <= p <= 1, got n={n}, p={p}")
    if p == 0.0 or p == 1.0:
        pmf = np.zeros(n + 1)
        pmf[0 if p == 0.0 else n] = 1.0
        return pmf
    k = np.arange(n + 1)
    # log C(n, k) = sum_{j=1..k} log((n - j + 1) / j), a running sum.
    steps = np.log(np.arange(n, 0, -1, dtype=np.float64)) - np.log(np.arange(1, n + 1, dtype=np.float64))
    log_comb = np.concatenate(([0.0], np.cumsum(steps)))
    log_pmf = log_comb + k * math.log(p) + (n - k) * math.log1p(-p)
    return np.exp(log_pmf)


def expected_padded_work(num_experts: int, top_k: int, m: int, block_size: int, scheme: str = "blockwise") -> float:
    """E[P] over all E experts under uniform routing (the TP case).

    Each expert's count is Binomial(m, K/E), so for blockwise padding
    E[P] = E * sum_k pmf(k) * ceil(k/B)*B exactly. Max padding depends on the joint
    distribution (the max over experts); use the Monte Carlo in ``moekit.tax.bbb``.
    """
    _check_ek(num_experts, top_k)
    if scheme == "none":
        return float(m * top_k)
    if scheme != "blockwise":
        raise ValueError("expected_padded_work has a closed form for 'blockwise' and 'none' only")
    pmf = binomial_pmf(int(m), top_k / num_experts)
    per_expert = float(np.dot(pmf, round_up(np.arange(m + 1), block_size)))
    return num_experts * per_expert


def expected_eta(num_experts: int, top_k: int, m: int, block_size: int, scheme: str = "blockwise") -> float:
    """E[P] / (m*K): the expected padding overhead under uniform routing (>= 1)."""
    if m <= 0:
        return 1.0
    return expected_padded_work(num_experts, top_k, m, block_size, scheme) / (m * top_k)


def max_load_bounds(balls, bins: int) -> dict:
    """The balls-and-bins expressions the paper quotes for the expected maximum bin load.

    ``balls`` is the number of independent assignments (for experts: m*K token-expert
    pairs; the paper writes m, which is the K = 1 case), ``bins`` the number of bins.

    * ``light`` (balls ~ bins, decode): log(bins) / log(log(bins)). This is an order of
      growth, not an upper bound with constant 1; for small bins it undershoots.
    * ``heavy`` (balls >> bins, prefill): balls/bins + sqrt(2 * balls * log(bins) / bins),
      the leading terms of the maximum load, which the mean maximum stays below.
    """
    balls = np.asarray(balls, dtype=np.float64)
    if bins < 2:
        return {"light": np.ones_like(balls) * balls, "heavy": balls.copy(), "mean": balls.copy()}
    log_n = math.log(bins)
    light = log_n / math.log(log_n) if log_n > 1 else float("nan")
    heavy = balls / bins + np.sqrt(2.0 * balls * log_n / bins)
    return {"light": np.full_like(balls, light), "heavy": heavy, "mean": balls / bins}
