"""Where experts live, as the tax model sees it: which logical expert each physical slot of
each GPU holds (:class:`Placement`, replicas allowed), and which GPU each token-expert
assignment goes to (:func:`assignment_gpus`).

The dispatchers (``moekit.ep``) place experts one way only: contiguously, expert e on rank
e // (E / P), one replica each (``moekit.ep.layout.ExpertPlacement``). That is one case of
:class:`Placement`; the model also describes replicated and reordered
placements (EPLB), which the dispatchers do not run. :meth:`Placement.from_expert_placement`
and :meth:`Placement.to_expert_placement` convert between the two where they meet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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
        """Expert e on GPU e // (E / n): the dispatchers' layout."""
        if n_gpus < 1 or num_experts % n_gpus:
            raise ValueError(f"n_gpus must divide num_experts={num_experts}, got {n_gpus}")
        return cls(np.arange(num_experts).reshape(n_gpus, -1), num_experts, name="contiguous")

    @classmethod
    def from_expert_placement(cls, placement) -> "Placement":
        """The model's view of a dispatcher's ``moekit.ep.layout.ExpertPlacement`` (anything
        with ``num_experts`` and ``world_size``): :meth:`contiguous`."""
        return cls.contiguous(int(placement.num_experts), int(placement.world_size))

    @property
    def is_contiguous(self) -> bool:
        """Whether this is :meth:`contiguous`: one replica per expert, in expert order."""
        return bool(np.array_equal(self.slots.ravel(), np.arange(self.num_experts)))

    def to_expert_placement(self):
        """This placement as the dispatchers hold it (``moekit.ep.layout.ExpertPlacement``).

        Only a contiguous placement has one: the dispatchers place expert e on rank
        e // (E / P) and run no replicas. Anything else raises ValueError saying why.
        """
        if not self.is_contiguous:
            raise ValueError(f"placement {self.name or '(unnamed)'} has replicas or a reordered layout; the "
                             "dispatchers only run the contiguous placement (Placement.contiguous)")
        from moekit.ep.layout import ExpertPlacement  # the runtime side; the model itself needs no torch

        return ExpertPlacement(self.num_experts, self.n_gpus)

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
