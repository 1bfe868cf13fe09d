"""Balls-bins-buckets: tokens (balls) -> experts (bins) -> GPUs (buckets), with padding.

Seed 003, section 5.2: classic balls-and-bins bounds miss two things about MoE routing,
the second level of imbalance (experts live on GPUs) and kernel padding. This module
simulates both, batch by batch, with numpy and no Python loop over tokens:

1. routing: uniform random top-K, popularity-skewed top-K, or given top-k ids
   (an ``[..., T, K]`` array with -1 for a masked slot, or any object with
   ``.topk_ids`` and ``.num_experts`` such as ``moekit.routing.trace.RoutingTrace``);
2. tokens per expert N, split among the expert's replicas (a ``Placement``);
3. per GPU g: routed work R_g, padded work P_g and activated slots E_g;
4. the straggler ratio max_g R_g / (mK / n_ep) and its padded version.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moekit.routing.stats import expert_counts  # [..., T, K] -> [..., E], -1 ignored

from .padding import SCHEMES, max_load_bounds, padded_work

# Keep any temporary [rows, E] float matrix under ~32 MB.
_CHUNK_ELEMS = 4_000_000


# --------------------------------------------------------------------------- routing input


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

    ``popularity=None`` is the seed's uniform random routing. Otherwise ``popularity[E]``
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


# --------------------------------------------------------------------------- placement


@dataclass(frozen=True, eq=False)
class Placement:
    """Which logical expert each physical expert slot of each GPU holds.

    ``slots[g, j]`` is the logical expert in slot j of GPU g; every GPU has the same
    number of slots and every logical expert appears at least once. An expert with r
    replicas has its tokens divided among them by ``split``:

    * ``"even"``: N // r each, the first N % r replicas (in slot order, GPU-major) get
      one more token. This is what EPLB assumes.
    * ``"block"``: in whole kernel blocks of ``block_size`` tokens: ceil(N/B) blocks are
      dealt evenly (the first replicas get the extra block) and filled in order, so only
      the last non-empty replica holds a partial block. Splitting then adds no padding,
      and a replica is activated only when there is a block for it.
    """

    slots: np.ndarray
    num_experts: int
    split: str = "even"
    block_size: int = 1
    name: str = ""
    ranks: np.ndarray | None = None  # [n, s] replica index of each slot; None: slot order
    _slot_rank: np.ndarray = field(init=False, repr=False, compare=False)
    _replicas: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        slots = np.asarray(self.slots, dtype=np.int64)
        if slots.ndim != 2 or slots.size == 0:
            raise ValueError(f"Placement.slots must be a non-empty [n_gpus, slots_per_gpu] array, got {slots.shape}")
        if slots.min() < 0 or slots.max() >= self.num_experts:
            raise ValueError(f"Placement.slots must hold expert ids in [0, {self.num_experts - 1}]")
        replicas = np.bincount(slots.ravel(), minlength=self.num_experts)
        if np.any(replicas == 0):
            missing = np.flatnonzero(replicas == 0)[:8].tolist()
            raise ValueError(f"Placement leaves logical experts {missing} without a slot")
        if self.split not in ("even", "block"):
            raise ValueError(f"Placement.split must be 'even' or 'block', got {self.split!r}")
        if self.block_size < 1:
            raise ValueError(f"Placement.block_size must be >= 1, got {self.block_size}")
        flat = slots.ravel()
        if self.ranks is None:
            # Rank of each slot among the replicas of its expert, in slot order.
            order = np.argsort(flat, kind="stable")
            starts = np.concatenate(([0], np.cumsum(replicas)[:-1]))
            rank = np.empty_like(flat)
            rank[order] = np.arange(flat.size) - starts[flat[order]]
        else:
            rank = np.asarray(self.ranks, dtype=np.int64).ravel()
            if rank.shape != flat.shape:
                raise ValueError(f"Placement.ranks must have the shape of slots {slots.shape}")
            # Each expert's ranks must be exactly 0..r-1: sort by (expert, rank) and compare.
            order = np.lexsort((rank, flat))
            starts = np.concatenate(([0], np.cumsum(replicas)[:-1]))
            expected = np.arange(flat.size) - starts[flat[order]]
            if not np.array_equal(rank[order], expected):
                raise ValueError("Placement.ranks must number each expert's replicas 0..r-1")
        slots.setflags(write=False)
        object.__setattr__(self, "slots", slots)
        object.__setattr__(self, "_slot_rank", rank)
        object.__setattr__(self, "_replicas", replicas)

    @classmethod
    def contiguous(cls, num_experts: int, n_gpus: int) -> "Placement":
        """Expert e on GPU e // (E / n): the default layout of DESIGN.md."""
        if n_gpus < 1 or num_experts % n_gpus:
            raise ValueError(f"n_gpus must divide num_experts={num_experts}, got {n_gpus}")
        return cls(np.arange(num_experts).reshape(n_gpus, -1), num_experts, name="contiguous")

    @property
    def n_gpus(self) -> int:
        return self.slots.shape[0]

    @property
    def slots_per_gpu(self) -> int:
        return self.slots.shape[1]

    @property
    def replicas(self) -> np.ndarray:
        """Replica count per logical expert ``[E]``."""
        return self._replicas.copy()

    def with_split(self, split: str, block_size: int | None = None, name: str | None = None) -> "Placement":
        """The same slots (and replica order) with another token split."""
        return Placement(
            self.slots, self.num_experts, split, block_size or self.block_size,
            self.name if name is None else name, self.slot_ranks(),
        )

    def slot_ranks(self) -> np.ndarray:
        """Replica index of every slot ``[n_gpus, slots_per_gpu]`` (0 takes the first share)."""
        return self._slot_rank.reshape(self.slots.shape).copy()

    def slot_counts(self, counts) -> np.ndarray:
        """Tokens of each physical slot ``[..., n_gpus, slots_per_gpu]`` from N ``[..., E]``."""
        n = np.asarray(counts, dtype=np.int64)
        flat = self.slots.ravel()
        n_slot = n[..., flat]  # the expert's total, per slot
        r = self._replicas[flat]
        j = self._slot_rank
        if self.split == "even":
            share = n_slot // r + (j < n_slot % r)
        else:
            b = self.block_size
            blocks = -(-n_slot // b)
            per, extra = blocks // r, blocks % r
            mine = per + (j < extra)  # blocks dealt to this replica
            before = j * per + np.minimum(j, extra)  # blocks dealt to earlier replicas
            share = np.clip(n_slot - before * b, 0, mine * b)
        return share.reshape(*n.shape[:-1], *self.slots.shape)

    def gpu_of_expert_replicas(self) -> list[np.ndarray]:
        """For each logical expert, the GPUs of its replicas in replica order."""
        flat = self.slots.ravel()
        gpu = np.repeat(np.arange(self.n_gpus), self.slots_per_gpu)
        order = np.lexsort((self._slot_rank, flat))
        bounds = np.cumsum(self._replicas)[:-1]
        return np.split(gpu[order], bounds)


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
        """Means over batches of the quantities the seed plots."""
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
        from .comm import traffic  # comm depends on this module, not the other way round

        stats.sent, stats.received = traffic(ids, placement)
    return stats


def assignment_gpus(ids: np.ndarray, placement: Placement) -> np.ndarray:
    """The GPU each token-expert assignment goes to ``[S, T, K]`` (-1 where masked).

    With replicas, an expert's assignments go to its replicas in token order: replica j
    takes the j-th run of that expert's tokens, of the size ``slot_counts`` gives it, so
    per-GPU totals here always agree with ``loads_from_counts``.
    """
    ids = np.asarray(ids, dtype=np.int64)
    s, t, k = ids.shape
    e = placement.num_experts
    if np.all(placement.replicas == 1):  # one replica each: a lookup table suffices
        gpu_of = np.empty(e, dtype=np.int64)
        gpu_of[placement.slots.ravel()] = np.repeat(np.arange(placement.n_gpus), placement.slots_per_gpu)
        return np.where(ids >= 0, gpu_of[np.maximum(ids, 0)], -1)

    flat = ids.reshape(s, -1)
    valid = flat >= 0
    key = np.where(valid, flat + np.arange(s)[:, None] * e, s * e).ravel()
    order = np.argsort(key, kind="stable")  # stable: token order within an expert
    sizes = np.bincount(key, minlength=s * e + 1)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    rank = np.empty(key.size, dtype=np.int64)
    rank[order] = np.arange(key.size) - starts[key[order]]

    # Cumulative token ends of the replicas of each expert: [S, E, r_max].
    counts = sizes[: s * e].reshape(s, e)
    slot = placement.slot_counts(counts).reshape(s, -1)
    r_max = int(placement.replicas.max())
    ends = np.full((s, e, r_max), np.iinfo(np.int64).max)
    gpus = np.full((e, r_max), -1)
    for ex, replica_gpus in enumerate(placement.gpu_of_expert_replicas()):  # E small; no tokens
        gpus[ex, : replica_gpus.size] = replica_gpus
    flat_slots = placement.slots.ravel()
    rank_of_slot = placement.slot_ranks().ravel()
    per_expert = np.zeros((s, e, r_max), dtype=np.int64)
    per_expert[:, flat_slots, rank_of_slot] = slot
    ends[:] = np.cumsum(per_expert, axis=2)

    rank = rank.reshape(s, -1)
    e_idx = np.where(valid, flat, 0)
    # Replica j is the number of replica ends at or below this assignment's rank.
    my_ends = ends[np.arange(s)[:, None], e_idx]  # [S, T*K, r_max]
    j = (rank[..., None] >= my_ends).sum(axis=-1)
    j = np.minimum(j, r_max - 1)
    out = np.where(valid, gpus[e_idx, j], -1)
    return out.reshape(s, t, k)


# --------------------------------------------------------------------------- bounds


def bbb_bounds(num_tokens, num_experts: int, n_gpus: int, top_k: int) -> dict:
    """The seed's analytical worst-case loads applied at expert and at GPU level.

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
    """One curve of the seed's Figure 10."""

    label: str
    num_experts: int
    n_gpus: int
    top_k: int


# The seed does not say which top-K it simulated; we use each size's model: K=2 for 8
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

