"""Routing as the tax model takes it: top-k expert ids ``[S, T, K]`` (S batches of T tokens,
-1 for a masked slot), given (an array, or a trace with ``.topk_ids`` and ``.num_experts``
such as ``moekit.routing.trace.RoutingTrace``) or sampled (uniform random top-K, or skewed by
an expert popularity).
"""

from __future__ import annotations

import numpy as np

# Keep any temporary [rows, E] float matrix under ~32 MB.
_CHUNK_ELEMS = 4_000_000


def as_topk_array(routing, num_experts: int | None = None) -> tuple[np.ndarray, int]:
    """Normalise routing to ``(ids[S, T, K] int64, E)``; S collects all leading dims.

    ``routing`` is an array ``[..., T, K]`` (needs ``num_experts``) or an object with
    ``.topk_ids`` and ``.num_experts`` (a RoutingTrace: [steps, layers, tokens, K] becomes
    steps*layers batches of ``tokens`` tokens). -1 marks a masked slot.
    """
    if hasattr(routing, "topk_ids") and hasattr(routing, "num_experts"):
        ids, num_experts = routing.topk_ids, int(routing.num_experts)
    else:
        ids = routing
        if num_experts is None:
            raise ValueError("num_experts is required when routing is a plain array")
    if hasattr(ids, "detach"):  # a torch tensor
        ids = ids.detach().cpu().numpy()
    ids = np.asarray(ids)
    if ids.ndim < 2:
        raise ValueError(f"topk_ids must have shape [..., T, K], got shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"topk_ids must be an integer array, got dtype {ids.dtype}")
    if not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if ids.size and (ids.min() < -1 or ids.max() >= num_experts):
        raise ValueError(
            f"topk_ids must lie in [-1, {num_experts - 1}] (-1 = masked), "
            f"got range [{ids.min()}, {ids.max()}]"
        )
    t, k = ids.shape[-2:]
    return ids.reshape(-1, t, k).astype(np.int64, copy=False), int(num_experts)


def sample_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    samples: int = 1,
    popularity=None,
    seed: int | np.random.Generator | None = 0,
) -> np.ndarray:
    """Random top-K routing ``[samples, num_tokens, K]``: K distinct experts per token.

    ``popularity=None`` is the MoE-tax paper's uniform random routing. Otherwise ``popularity[E]``
    (any positive weights) draws the K experts without replacement in proportion to it,
    by the Gumbel-top-k trick: the K largest of log(p) + Gumbel noise.
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    if num_tokens < 0 or samples < 1:
        raise ValueError(f"need num_tokens >= 0 and samples >= 1, got {num_tokens}, {samples}")
    rng = np.random.default_rng(seed)
    rows = samples * num_tokens
    if popularity is None and top_k * top_k <= 4 * num_experts:
        out = _uniform_by_rejection(rows, num_experts, top_k, rng)
    else:
        logits = _log_popularity(popularity, num_experts)
        out = _gumbel_top_k(rows, logits, top_k, rng)
    return out.reshape(samples, num_tokens, top_k)


def _log_popularity(popularity, num_experts: int) -> np.ndarray:
    if popularity is None:
        return np.zeros(num_experts)
    p = np.asarray(popularity, dtype=np.float64)
    if p.shape != (num_experts,) or not np.all(np.isfinite(p)) or np.any(p <= 0):
        raise ValueError(f"popularity must be {num_experts} positive finite weights, got shape {p.shape}")
    return np.log(p / p.sum())


def _uniform_by_rejection(rows: int, num_experts: int, top_k: int, rng) -> np.ndarray:
    # Draw K ids per token and redraw the rows that repeat an id. When K^2 <= 4E, few
    # rows repeat, so this costs O(rows*K) instead of the O(rows*E) of a full shuffle.
    ids = rng.integers(0, num_experts, size=(rows, top_k))
    bad = _rows_with_duplicates(ids)
    while bad.any():
        idx = np.flatnonzero(bad)
        ids[idx] = rng.integers(0, num_experts, size=(idx.size, top_k))
        sub = _rows_with_duplicates(ids[idx])
        bad = np.zeros(rows, dtype=bool)
        bad[idx[sub]] = True
    return ids


def _rows_with_duplicates(ids: np.ndarray) -> np.ndarray:
    if ids.shape[1] < 2:
        return np.zeros(ids.shape[0], dtype=bool)
    s = np.sort(ids, axis=1)
    return (s[:, 1:] == s[:, :-1]).any(axis=1)


def _gumbel_top_k(rows: int, logits: np.ndarray, top_k: int, rng) -> np.ndarray:
    num_experts = logits.size
    out = np.empty((rows, top_k), dtype=np.int64)
    step = max(1, _CHUNK_ELEMS // num_experts)
    for start in range(0, rows, step):  # chunks of rows, to bound memory
        n = min(step, rows - start)
        keys = logits - np.log(-np.log(rng.random((n, num_experts))))
        out[start : start + n] = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
    return out


def zipf_popularity(num_experts: int, exponent: float, seed: int | None = 0) -> np.ndarray:
    """Expert popularity p_e ~ 1 / rank^exponent, ranks shuffled over expert ids."""
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    p = ranks ** -float(exponent)
    return np.random.default_rng(seed).permutation(p / p.sum())
