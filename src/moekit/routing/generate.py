"""Synthetic routing with a chosen skew, and a preset that mimics Mixtral-8x7B traces.

Both generators draw from a numpy ``Generator`` seeded with ``seed``: the same arguments
always give the same routing. Experts of one token are always distinct: a token takes
the top-k of ``log(popularity) + Gumbel noise``, which samples k experts without
replacement with probabilities proportional to popularity (the Gumbel-top-k trick).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .trace import RoutingTrace

# -- synthetic_routing ----------------------------------------------------------------

# Bisection on the popularity exponent: doublings to bracket the target, then halvings.
_MAX_DOUBLINGS = 60
_MAX_HALVINGS = 40
_BETA_TOLERANCE = 1e-4  # stop once the realized beta is this close to the target


def synthetic_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    beta: float = 1.0,
    zipf: float | None = None,
    seed: int = 0,
    weights: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random top-k routing of ``num_tokens`` tokens with a target skew.

    Returns ``(topk_ids int64 [T, K], topk_weights float32 [T, K])``; ``topk_weights`` is
    None when ``weights=False``. Slot 0 holds a token's most preferred expert and weights
    are sorted descending, positive and renormalized to sum to 1 per token.

    Skew. Expert popularity follows a Zipf law, ``popularity ∝ 1 / rank**a`` over a random
    permutation of the experts (``a = 0`` is uniform), and each token samples its
    ``top_k`` distinct experts in proportion to popularity.

    * ``zipf=a`` fixes the exponent directly (heavy-tailed load).
    * Otherwise ``beta`` in (0, 1] is the target balancedness: the normalized entropy
      ``H(load) / log(E)`` of the realized per-expert load histogram (load_e = number of
      (token, slot) pairs routed to e), as in the RaMP paper; 1 = uniform. The exponent is
      found by bisection on the *realized* histogram with fixed random numbers, so the
      returned routing has a beta close to the target when ``T * K`` is reasonably
      large (measured within 3e-4 for T*K >= 2048; coarser for tiny T*K, whose load
      histogram can take only a few values). Each bisection step re-routes all tokens,
      so the cost is ~20-40 top-k passes over a [T, E] array.

    Limits (not errors): with K distinct experts per token, the load can at most be
    concentrated on K experts, so the smallest achievable beta is ``log(K) / log(E)``
    (0 for K = 1); below that the most skewed routing (every token on the same K
    experts) is returned. At the other end, beta = 1 gives uniformly random routing,
    whose realized beta is slightly below 1 from sampling noise (noticeably so at tiny
    T); a target above the uniform routing's beta returns that routing. Use
    ``moekit.routing.balancedness(expert_counts(ids, E))`` to read the realized value.

    Raises ValueError for ``num_tokens < 0``, ``num_experts < 1``, ``top_k`` outside
    ``[1, num_experts]``, ``beta`` outside (0, 1], a negative or non-finite ``zipf``, or
    both ``zipf`` and a ``beta`` other than 1 given.
    """
    _check_int("num_tokens", num_tokens, low=0)
    _check_int("num_experts", num_experts, low=1)
    _check_int("top_k", top_k, low=1, high=num_experts)
    _check_int("seed", seed, low=0)
    beta = _check_beta(beta)
    if zipf is not None:
        zipf = _check_zipf(zipf)
        if beta != 1.0:
            raise ValueError(f"give either beta or zipf, not both (beta={beta}, zipf={zipf})")
    T, E, K = num_tokens, num_experts, top_k
    rng = np.random.default_rng(seed)
    # Common random numbers: every candidate exponent reuses the same permutation and
    # noise, so the realized beta changes smoothly with the exponent and bisection works.
    log_rank = _zipf_log_profile(rng, E)
    noise = rng.gumbel(size=(T, E)).astype(np.float32)
    exponent = zipf if zipf is not None else _exponent_for_beta(beta, log_rank, noise, K)
    ids = _route(exponent, log_rank, noise, K)
    topk_ids = torch.from_numpy(ids.astype(np.int64))
    if not weights:
        return topk_ids, None
    return topk_ids, torch.from_numpy(_random_weights(rng, (T, K)))


def _zipf_log_profile(rng: np.random.Generator, num_experts: int) -> np.ndarray:
    """``-log(rank)`` of every expert under a random ranking (rank 1 = most popular)."""
    ranks = rng.permutation(num_experts) + 1
    return (-np.log(ranks)).astype(np.float32)


def _route(exponent: float, log_rank: np.ndarray, noise: np.ndarray, k: int) -> np.ndarray:
    """Top-k of ``exponent * log_rank + noise`` per token; ``inf`` = the k most popular."""
    if math.isinf(exponent):
        favourites = np.argsort(-log_rank, kind="stable")[:k]
        return np.broadcast_to(favourites, (noise.shape[0], k)).copy()
    return _top_k(exponent * log_rank + noise, k)


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores of every row, largest first."""
    part = np.argpartition(-scores, k - 1, axis=-1)[..., :k]
    order = np.argsort(-np.take_along_axis(scores, part, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(part, order, axis=-1)


def _realized_beta(ids: np.ndarray, num_experts: int) -> float:
    load = np.bincount(ids.reshape(-1), minlength=num_experts).astype(np.float64)
    p = load[load > 0] / load.sum()
    return float(-(p * np.log(p)).sum() / math.log(num_experts))


def _exponent_for_beta(target: float, log_rank: np.ndarray, noise: np.ndarray, k: int) -> float:
    """The Zipf exponent whose routing's realized beta is closest to ``target``.

    Realized beta falls (not always strictly) as the exponent grows, from about 1 at
    exponent 0 to ``log(k)/log(E)`` at infinity. Bracket the target by doubling, then
    bisect, remembering the best exponent seen since the realized curve is a step
    function of finitely many samples.
    """
    E, T = log_rank.shape[0], noise.shape[0]
    if T == 0 or E == 1 or k == E:
        return 0.0  # every exponent gives the same load histogram

    def beta_at(a: float) -> float:
        return _realized_beta(_route(a, log_rank, noise, k), E)

    uniform = beta_at(0.0)
    if uniform <= target:
        return 0.0  # cannot be more uniform than uniform sampling
    if beta_at(math.inf) >= target:
        return math.inf  # target below the most skewed achievable routing
    best = (uniform - target, 0.0)  # (distance to target, exponent)
    low, high = 0.0, 1.0
    for _ in range(_MAX_DOUBLINGS):
        b = beta_at(high)
        best = min(best, (abs(b - target), high))
        if b <= target:
            break
        low, high = high, 2.0 * high
    else:
        return math.inf
    for _ in range(_MAX_HALVINGS):
        if best[0] <= _BETA_TOLERANCE:
            break
        mid = 0.5 * (low + high)
        b = beta_at(mid)
        best = min(best, (abs(b - target), mid))
        if b > target:
            low = mid
        else:
            high = mid
    return best[1]


def _random_weights(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Positive float32 weights over the last dim, sorted descending, summing to 1.

    A softmax of standard-normal logits, like a router's renormalized top-k softmax.
    """
    logits = -np.sort(-rng.standard_normal(shape), axis=-1)
    w = np.exp(logits - logits[..., :1]).astype(np.float32)
    return w / w.sum(axis=-1, keepdims=True)


# -- Mixtral-8x7B preset for Cap-and-Spill ----------------------------------------------

MIXTRAL_WORLD_SIZE = 8  # P ranks, one expert each
MIXTRAL_NUM_EXPERTS = 8
MIXTRAL_TOP_K = 2
MIXTRAL_MEAN_LENGTH = 164.0  # Weibull mean of the sequence length, before clipping
MIXTRAL_LENGTH_SHAPE = 2.2  # Weibull shape k of the sequence length
MIXTRAL_MIN_LENGTH = 8
MIXTRAL_MAX_LENGTH = 344  # = 43 tokens per rank; longer sequences are truncated
MIXTRAL_ALPHA_MEDIAN = 20.0  # Dirichlet concentration per (sequence, layer): median ...
MIXTRAL_ALPHA_LOG_STD = 1.6  # ... and std of its log


def mixtral_capspill_trace(
    steps: int = 1000, layers: int = 32, seed: int = 0, *, weights: bool = False
) -> RoutingTrace:
    """A synthetic Mixtral-8x7B trace with the per-peer count statistics of the Cap-and-Spill paper.

    The paper measured Mixtral-8x7B-Instruct (E=8, top-2) on P=8 ranks over 32 layers
    and 1000 sequences (~2M per-peer counts): mean 5.1, std 3.6, Q99 16, max 43 (and, in
    its Table 2, Q90 10, Q95 12, Q99.5 18). With the defaults this generator gives, over
    seeds 0-9, mean 5.10, std 3.56-3.58, Q90/Q95/Q99/Q99.5 = 10/12/16/18 and max 42-43.
    Not tuned for, but also matching: the fraction of sends (one source rank, one layer,
    one step) with some peer over capacity C = 10/12/16/18 is 32.0/18.6/5.2/2.7%, against
    the 31.1/18.5/5.4/2.7% "Overflow" column of the paper's Table 2
    (``TraceStats.overflow_send_fraction``).

    Model. Each step is one sequence; each layer routes every token of it:

    * Length L ~ Weibull(shape 2.2, mean 164), rounded and clipped to [8, 344]. Lengths
      are drawn by stratified sampling (one draw per 1/steps quantile band, shuffled), so
      the handful of long sequences that decide the maximum count is the same from seed to
      seed. The sequence is split into 8 near-equal contiguous chunks, one per rank,
      ``L // 8`` or ``L // 8 + 1`` tokens each.
    * Per (sequence, layer), expert popularity p ~ Dirichlet(alpha, ..., alpha) with
      log(alpha) ~ Normal(log 20, 1.6): most layers are nearly balanced (as Mixtral's
      load-balancing loss encourages), a few percent are dominated by one or two experts
      (topic- or token-specific routing), which makes the heavy tail.
    * Every token picks 2 distinct experts with probability ∝ p (Gumbel-top-2).

    The trace has ``tokens = 344`` rows per step laid out rank-major (rank r owns rows
    ``[43 r, 43 r + 43)``); rows beyond a rank's share of the sequence are ``-1``. Its
    metadata records ``world_size = 8`` and the parameters. ``weights=True`` adds
    softmax-like top-2 weights (88 MB for the default size; off by default).
    """
    _check_int("steps", steps, low=1)  # a trace without (step, layer) observations has no statistics
    _check_int("layers", layers, low=1)
    _check_int("seed", seed, low=0)
    P, E, K = MIXTRAL_WORLD_SIZE, MIXTRAL_NUM_EXPERTS, MIXTRAL_TOP_K
    rows_per_rank = MIXTRAL_MAX_LENGTH // P
    rng = np.random.default_rng(seed)
    lengths = _stratified_weibull_lengths(rng, steps)
    step_of_token, row_of_token = _token_rows(lengths, P, rows_per_rank)
    log_popularity = _log_dirichlet(rng, steps, layers, E)  # [steps, layers, E]
    ids = np.full((steps, layers, P * rows_per_rank, K), -1, dtype=np.int16)
    for layer in range(layers):  # one layer at a time keeps the noise array small
        scores = rng.gumbel(size=(step_of_token.size, E)) + log_popularity[step_of_token, layer]
        ids[step_of_token, layer, row_of_token] = _top_k(scores, K)
    topk_weights = None
    if weights:
        topk_weights = np.zeros(ids.shape, dtype=np.float32)
        valid = ids[..., 0] >= 0
        topk_weights[valid] = _random_weights(rng, (int(valid.sum()), K))
    metadata: dict[str, Any] = {
        "generator": "moekit.routing.mixtral_capspill_trace",
        "seed": seed,
        "world_size": P,
        "length": {
            "distribution": "weibull, stratified",
            "mean": MIXTRAL_MEAN_LENGTH,
            "shape": MIXTRAL_LENGTH_SHAPE,
            "min": MIXTRAL_MIN_LENGTH,
            "max": MIXTRAL_MAX_LENGTH,
        },
        "popularity": {
            "distribution": "dirichlet per (step, layer), lognormal alpha",
            "alpha_median": MIXTRAL_ALPHA_MEDIAN,
            "alpha_log_std": MIXTRAL_ALPHA_LOG_STD,
        },
    }
    return RoutingTrace(
        topk_ids=ids, num_experts=E, topk_weights=topk_weights,
        name="mixtral-8x7b-capspill-synthetic", metadata=metadata,
    )


def _stratified_weibull_lengths(rng: np.random.Generator, steps: int) -> np.ndarray:
    """``steps`` sequence lengths, one from each of ``steps`` equal-probability bands."""
    u = (rng.permutation(steps) + rng.random(steps)) / steps
    k = MIXTRAL_LENGTH_SHAPE
    scale = MIXTRAL_MEAN_LENGTH / math.gamma(1.0 + 1.0 / k)
    lengths = np.round(scale * (-np.log1p(-u)) ** (1.0 / k))  # inverse Weibull CDF
    return np.clip(lengths, MIXTRAL_MIN_LENGTH, MIXTRAL_MAX_LENGTH).astype(np.int64)


def _token_rows(lengths: np.ndarray, ranks: int, rows_per_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(step, row) of every token when each sequence is split evenly over ``ranks``."""
    r = np.arange(ranks)
    per_rank = lengths[:, None] // ranks + (r < lengths[:, None] % ranks)  # [steps, ranks]
    used = np.arange(rows_per_rank) < per_rank[..., None]  # [steps, ranks, rows_per_rank]
    step, rank, slot = np.nonzero(used)
    return step, rank * rows_per_rank + slot


def _log_dirichlet(rng: np.random.Generator, steps: int, layers: int, num_experts: int) -> np.ndarray:
    """log of Dirichlet(alpha) draws (up to a per-row constant) with a lognormal alpha.

    Gamma(alpha) underflows to 0 for small alpha, so sample its log instead:
    Gamma(a) = Gamma(a + 1) * U**(1/a). The missing normalization does not change which
    experts the Gumbel-top-k picks.
    """
    alpha = np.exp(rng.normal(math.log(MIXTRAL_ALPHA_MEDIAN), MIXTRAL_ALPHA_LOG_STD, (steps, layers, 1)))
    alpha = np.broadcast_to(alpha, (steps, layers, num_experts))
    return np.log(rng.standard_gamma(alpha + 1.0)) + np.log(rng.random(alpha.shape)) / alpha


# -- argument checks ----------------------------------------------------------------------


def _check_int(name: str, value: Any, low: int | None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise ValueError(f"{name} must be in {bounds}, got {value}")


def _check_beta(beta: Any) -> float:
    if isinstance(beta, bool) or not isinstance(beta, (int, float, np.floating, np.integer)):
        raise ValueError(f"beta must be a number in (0, 1], got {beta!r}")
    if not 0.0 < float(beta) <= 1.0:  # also rejects nan
        raise ValueError(f"beta must be in (0, 1], got {beta}")
    return float(beta)


def _check_zipf(zipf: Any) -> float:
    if isinstance(zipf, bool) or not isinstance(zipf, (int, float, np.floating, np.integer)):
        raise ValueError(f"zipf must be a number in [0, inf), got {zipf!r}")
    if not (math.isfinite(float(zipf)) and float(zipf) >= 0.0):
        raise ValueError(f"zipf must be in [0, inf), got {zipf}")
    return float(zipf)
