"""Expert placement: DeepSeek's EPLB, and the padding-aware balancer the MoE-tax paper proposes.

Both produce a ``Placement``: ``slots[g, j]`` = the logical expert held by physical slot
j of GPU g, the same number of slots on every GPU, every logical expert at least once.

EPLB (written from its public description, no code copied):

1. replicate: start with one replica per expert and give each extra slot to the expert
   with the highest load per replica;
2. pack: sort the replicas by load per replica, heaviest first, and put each on the
   lightest GPU that still has a free slot;
3. hierarchical mode (when the nodes divide the expert groups): first pack expert
   groups onto nodes the same way, then replicate and pack inside every node, so a
   group's traffic stays in its node.

EPLB balances raw tokens R_g and assumes an expert's tokens are split evenly among its
replicas. The MoE tax paper (section 6.1) notes that the kernel's cost is the padded work
P_g = eta_g * R_g, and that replication activates more experts (more weight loading in
decode); a balancer of P_g that is aware of activation "would more effectively minimize
straggler compute time", and nobody has built one. ``padding_aware_placement`` is ours:

* the tokens of a replicated expert are split in whole kernel blocks (``split="block"``),
  so replication adds no padding and a replica is activated only when there is at least
  a block for it (idle replicas cost no weight loading);
* replicas go to the expert whose heaviest replica has the most expected *padded* work;
* packing and a swap-based local search minimise the mean over calibration batches of the
  slowest GPU's cost: its padded work, or, given ``UnitCosts``, its roofline time
  max(alpha*E_g + alpha_act*P_g, beta*P_g), which also counts activated experts.
"""

from __future__ import annotations

import numpy as np

from .bbb import LoadStats, loads_from_counts
from .placement import Placement

# --------------------------------------------------------------------------- EPLB


def replicate_experts(loads, num_slots: int) -> np.ndarray:
    """Replica count per expert: each extra slot goes to the max load-per-replica expert.

    This greedy choice minimises max_e load_e / r_e for the given total (each step lowers
    the current maximum as much as a single replica can). Ties go to the lower id.
    """
    loads = np.asarray(loads, dtype=np.float64)
    e = loads.size
    if num_slots < e:
        raise ValueError(f"num_slots={num_slots} must be >= num_experts={e}")
    replicas = np.ones(e, dtype=np.int64)
    for _ in range(num_slots - e):  # one step per extra slot; no loop over tokens
        replicas[np.argmax(loads / replicas)] += 1
    return replicas


def balanced_packing(weights, num_packs: int) -> np.ndarray:
    """Pack index per item: heaviest first onto the lightest pack with room.

    Every pack gets exactly len(weights) / num_packs items.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if num_packs < 1 or weights.size % num_packs:
        raise ValueError(f"num_packs={num_packs} must divide the number of items {weights.size}")
    capacity = weights.size // num_packs
    pack = np.empty(weights.size, dtype=np.int64)
    load = np.zeros(num_packs)
    count = np.zeros(num_packs, dtype=np.int64)
    for item in np.argsort(-weights, kind="stable"):
        open_load = np.where(count < capacity, load, np.inf)
        p = int(np.argmin(open_load))
        pack[item] = p
        load[p] += weights[item]
        count[p] += 1
    return pack


def _mean_loads(loads) -> np.ndarray:
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim == 2:  # [samples, E]: balance the average
        loads = loads.mean(axis=0)
    if loads.ndim != 1 or np.any(loads < 0) or not np.all(np.isfinite(loads)):
        raise ValueError("loads must be finite, non-negative, shape [E] or [samples, E]")
    return loads


def _pack_replicas(loads, replicas, expert_ids, num_gpus: int, slots_per_gpu: int) -> np.ndarray:
    """Slots [num_gpus, slots_per_gpu] from replica counts, by balanced packing."""
    item_expert = np.repeat(expert_ids, replicas)
    item_load = np.repeat(loads / replicas, replicas)
    gpu = balanced_packing(item_load, num_gpus)
    order = np.lexsort((np.arange(gpu.size), gpu))  # by GPU; stable inside a GPU
    return item_expert[order].reshape(num_gpus, slots_per_gpu)


def eplb_placement(
    loads,
    num_gpus: int,
    slots_per_gpu: int,
    *,
    num_groups: int | None = None,
    num_nodes: int = 1,
    mode: str = "auto",
) -> Placement:
    """DeepSeek's EPLB: replicate the heaviest experts, pack replicas to GPUs.

    ``loads``: tokens per expert ``[E]`` (or ``[samples, E]``, averaged). ``mode``:
    "global", "hierarchical" (needs ``num_groups`` divisible by ``num_nodes``), or
    "auto" (hierarchical when possible, as DeepSeek does for prefill). Tokens are split
    evenly among replicas (``split="even"``).
    """
    loads = _mean_loads(loads)
    e = loads.size
    slots = num_gpus * slots_per_gpu
    if num_gpus < 1 or slots_per_gpu < 1 or slots < e:
        raise ValueError(f"need num_gpus * slots_per_gpu >= num_experts={e}, got {num_gpus} x {slots_per_gpu}")
    hierarchical_ok = (
        num_groups is not None and num_groups >= 1 and e % num_groups == 0
        and num_nodes >= 1 and num_groups % num_nodes == 0 and num_gpus % num_nodes == 0
        and slots % num_nodes == 0 and e // num_nodes <= slots // num_nodes
    )
    if mode == "hierarchical" and not hierarchical_ok:
        raise ValueError(
            "hierarchical EPLB needs num_groups dividing num_experts, num_nodes dividing "
            "num_groups and num_gpus, and enough slots per node"
        )
    if mode not in ("auto", "global", "hierarchical"):
        raise ValueError(f"mode must be 'auto', 'global' or 'hierarchical', got {mode!r}")
    if mode == "global" or (mode == "auto" and not hierarchical_ok):
        reps = replicate_experts(loads, slots)
        table = _pack_replicas(loads, reps, np.arange(e), num_gpus, slots_per_gpu)
        return Placement(table, e, split="even", name="eplb-global")

    # Hierarchical: groups -> nodes, then replicate and pack inside each node.
    group_size = e // num_groups
    group_loads = loads.reshape(num_groups, group_size).sum(axis=1)
    node_of_group = balanced_packing(group_loads, num_nodes)
    gpus_per_node, slots_per_node = num_gpus // num_nodes, slots // num_nodes
    rows = []
    for node in range(num_nodes):  # a handful of nodes
        groups = np.flatnonzero(node_of_group == node)
        experts = (groups[:, None] * group_size + np.arange(group_size)).ravel()
        reps = replicate_experts(loads[experts], slots_per_node)
        rows.append(_pack_replicas(loads[experts], reps, experts, gpus_per_node, slots_per_gpu))
    return Placement(np.concatenate(rows), e, split="even", name="eplb-hierarchical")


# --------------------------------------------------------------------------- padding-aware


def _block_split_work(counts, replicas: int, block_size: int) -> np.ndarray:
    """Padded work of each of ``replicas`` replicas under the block split: [..., replicas]."""
    blocks = -(-np.asarray(counts, dtype=np.int64) // block_size)
    j = np.arange(replicas)
    mine = blocks[..., None] // replicas + (j < blocks[..., None] % replicas)
    before = j * (blocks[..., None] // replicas) + np.minimum(j, blocks[..., None] % replicas)
    tokens = np.clip(counts[..., None] - before * block_size, 0, mine * block_size)
    return -(-tokens // block_size) * block_size


def _gpu_cost(active, work, costs) -> np.ndarray:
    """The cost the balancer minimises for GPUs with ``active`` slots and ``work`` rows."""
    if costs is None:
        return work
    return np.maximum(costs.alpha * active + costs.alpha_act * work, costs.beta * work)


def padding_aware_placement(
    counts,
    num_gpus: int,
    slots_per_gpu: int,
    block_size: int,
    *,
    costs=None,
    max_moves: int = 500,
) -> Placement:
    """Balance padded work P_g (and activated experts, given ``costs``).

    ``counts``: tokens per expert in calibration batches ``[samples, E]`` (a single
    ``[E]`` works, but the search then fits that one batch). ``costs``: a ``UnitCosts``
    to minimise the slowest GPU's roofline time instead of P_g alone. The objective is
    the mean over batches of the slowest GPU's cost. Two starting points (our padded
    replication with a batch-aware greedy packing, and EPLB's placement) are improved by
    swapping replicas between GPUs; the better one is returned, with ``split="block"``.
    """
    counts = np.atleast_2d(np.asarray(counts, dtype=np.int64))
    if counts.ndim != 2 or np.any(counts < 0):
        raise ValueError("counts must be non-negative, shape [E] or [samples, E]")
    e = counts.shape[1]
    slots = num_gpus * slots_per_gpu
    if num_gpus < 1 or slots_per_gpu < 1 or slots < e:
        raise ValueError(f"need num_gpus * slots_per_gpu >= num_experts={e}, got {num_gpus} x {slots_per_gpu}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")

    starts = [_greedy_start(counts, num_gpus, slots_per_gpu, block_size, costs)]
    eplb = eplb_placement(counts, num_gpus, slots_per_gpu, mode="global")
    starts.append(_items_of(eplb))
    best = None
    for item_expert, item_rank, gpu in starts:
        replicas = np.bincount(item_expert, minlength=e)
        work, active = _item_work(counts, item_expert, item_rank, replicas, block_size)
        gpu = _improve_by_swaps(gpu, work, active, num_gpus, slots_per_gpu, costs, max_moves)
        score = _objective(gpu, work, active, num_gpus, costs)
        if best is None or score < best[0] - 1e-12:
            best = (score, item_expert, item_rank, gpu)
    _, item_expert, item_rank, gpu = best
    order = np.lexsort((np.arange(slots), gpu))  # by GPU, item order inside a GPU
    shape = (num_gpus, slots_per_gpu)
    return Placement(
        item_expert[order].reshape(shape), e, split="block", block_size=block_size,
        name="padding-aware", ranks=item_rank[order].reshape(shape),
    )


def _items_of(placement: Placement):
    """(expert, replica rank, GPU) of every slot of a placement."""
    gpu = np.repeat(np.arange(placement.n_gpus), placement.slots_per_gpu)
    return placement.slots.ravel().copy(), placement.slot_ranks().ravel(), gpu


def _item_work(counts, item_expert, item_rank, replicas, block_size) -> tuple[np.ndarray, np.ndarray]:
    """Work of each replica in every batch under the block split: ([S, items], active).

    The work is the padded rows plus a tie-break of epsilon * real rows: among
    placements with the same padded work, the search then prefers the one with less
    raw imbalance. epsilon * (m*K) stays below a quarter block over the number of
    batches, so it can never outweigh one block of padded work in the mean objective.
    """
    n = counts[:, item_expert]
    r = replicas[item_expert]
    blocks = -(-n // block_size)
    per, extra = blocks // r, blocks % r
    mine = per + (item_rank < extra)
    before = item_rank * per + np.minimum(item_rank, extra)
    tokens = np.clip(n - before * block_size, 0, mine * block_size)
    padded = (-(-tokens // block_size) * block_size).astype(np.float64)
    eps = block_size / (4.0 * counts.shape[0] * max(1, int(counts.sum(axis=1).max())))
    return padded + eps * tokens, (padded > 0).astype(np.float64)


def _greedy_start(counts, num_gpus, slots_per_gpu, block_size, costs):
    """Our replication (by padded work) and a batch-aware greedy packing."""
    s_samples, e = counts.shape
    slots = num_gpus * slots_per_gpu
    # Replicate: the extra slot goes where the heaviest replica is heaviest (padded).
    replicas = np.ones(e, dtype=np.int64)
    blocks = -(-counts // block_size)
    for _ in range(slots - e):
        heaviest = (-(-blocks // replicas)).mean(axis=0)  # E[ceil(blocks / r)] blocks
        replicas[np.argmax(heaviest)] += 1
    item_expert = np.repeat(np.arange(e), replicas)
    item_rank = np.arange(slots) - np.repeat(np.cumsum(replicas) - replicas, replicas)
    work, active = _item_work(counts, item_expert, item_rank, replicas, block_size)

    # Heaviest expected item first, to the GPU whose choice keeps the mean (over
    # batches) of the slowest GPU's cost lowest.
    gpu = np.empty(slots, dtype=np.int64)
    gpu_work = np.zeros((num_gpus, s_samples))
    gpu_active = np.zeros((num_gpus, s_samples))
    count = np.zeros(num_gpus, dtype=np.int64)
    for item in np.argsort(-_gpu_cost(active, work, costs).mean(axis=0), kind="stable"):
        cur = _gpu_cost(gpu_active, gpu_work, costs)  # [n, S]
        new = _gpu_cost(gpu_active + active[:, item], gpu_work + work[:, item], costs)
        score = np.maximum(new, _max_excluding_each(cur)).mean(axis=1)
        score = np.where(count < slots_per_gpu, score, np.inf)
        # Ties (common early on): the GPU with the least expected cost so far.
        g = int(np.lexsort((cur.mean(axis=1), score))[0])
        gpu[item] = g
        gpu_work[g] += work[:, item]
        gpu_active[g] += active[:, item]
        count[g] += 1
    return item_expert, item_rank, gpu


def _max_excluding_each(cost: np.ndarray) -> np.ndarray:
    """For every row g, the column-wise max over the other rows (top-2 trick)."""
    if cost.shape[0] == 1:
        return np.full_like(cost, -np.inf)
    top2 = np.sort(cost, axis=0)[-2:]
    first, second = top2[1], top2[0]
    return np.where(cost >= first, second, first)


def _gpu_totals(gpu, work, active, num_gpus):
    gw = np.zeros((num_gpus, work.shape[0]))
    ga = np.zeros_like(gw)
    np.add.at(gw, gpu, work.T)
    np.add.at(ga, gpu, active.T)
    return gw, ga


def _objective(gpu, work, active, num_gpus, costs) -> float:
    gw, ga = _gpu_totals(gpu, work, active, num_gpus)
    return float(_gpu_cost(ga, gw, costs).max(axis=0).mean())


def _improve_by_swaps(gpu, work, active, num_gpus, slots_per_gpu, costs, max_moves) -> np.ndarray:
    """Swap two replicas on different GPUs while the objective drops.

    Each round tries the GPUs in order of how often they are the slowest, and applies
    the best swap of one of its replicas with any replica elsewhere.
    """
    gpu = gpu.copy()
    best = _objective(gpu, work, active, num_gpus, costs)
    for _ in range(max_moves):
        gw, ga = _gpu_totals(gpu, work, active, num_gpus)
        cost = _gpu_cost(ga, gw, costs)
        hot_count = np.bincount(cost.argmax(axis=0), minlength=num_gpus)
        moved = False
        for hot in np.argsort(-hot_count, kind="stable")[: max(1, int((hot_count > 0).sum()))]:
            mine = np.flatnonzero(gpu == hot)
            theirs = np.flatnonzero(gpu != hot)
            if theirs.size == 0:
                break
            # Every swap (a on hot, b elsewhere) at once: [len(mine), len(theirs), S].
            dw = work[:, theirs].T[None] - work[:, mine].T[:, None]
            da = active[:, theirs].T[None] - active[:, mine].T[:, None]
            hot_new = _gpu_cost(ga[hot] + da, gw[hot] + dw, costs)
            other_g = gpu[theirs]
            oth_new = _gpu_cost(ga[other_g][None] - da, gw[other_g][None] - dw, costs)
            rest = _max_excluding_pair(cost, int(hot), other_g)  # GPUs outside the swap
            obj = np.maximum(np.maximum(hot_new, oth_new), rest[None]).mean(axis=-1)
            i, j = np.unravel_index(int(np.argmin(obj)), obj.shape)
            if obj[i, j] < best - 1e-9 * max(abs(best), 1e-30):
                best = float(obj[i, j])
                a, b = mine[i], theirs[j]
                gpu[a], gpu[b] = gpu[b], gpu[a]
                moved = True
                break
        if not moved:
            break
    return gpu


def _max_excluding_pair(cost: np.ndarray, hot: int, others: np.ndarray) -> np.ndarray:
    """Column-wise max over all GPUs but ``hot`` and ``others[k]``: [len(others), S]."""
    n = cost.shape[0]
    masked = cost.copy()
    masked[hot] = -np.inf
    if n <= 2:
        return np.full((others.size, cost.shape[1]), -np.inf)
    top = np.sort(masked, axis=0)[-2:]  # hot is -inf, so these are the best two others
    first, second = top[1], top[0]
    return np.where(masked[others] >= first[None], second[None], first[None])


# --------------------------------------------------------------------------- comparison


def evaluate_placement(placement: Placement, counts, block_size: int, scheme: str = "blockwise", costs=None) -> dict:
    """Straggler ratios, padded work and activated experts of a placement on batches."""
    stats: LoadStats = loads_from_counts(counts, placement, block_size, scheme)
    out = {"placement": placement.name or "placement", "split": placement.split, **stats.summary()}
    out["mean_padded"] = float(stats.padded.mean())
    out["activated_slots"] = float(stats.active.sum(axis=1).mean())
    if costs is not None:
        t = _gpu_cost(stats.active, stats.padded, costs).max(axis=1)
        out["compute_time_s"] = float(t.mean())
    return out


def compare_balancers(
    calibration,
    evaluation,
    num_gpus: int,
    slots_per_gpu: int,
    block_size: int,
    *,
    scheme: str = "blockwise",
    costs=None,
) -> list[dict]:
    """Fit on ``calibration`` counts [S, E], report on ``evaluation`` counts [S', E].

    Rows: contiguous (no replicas; when E = n * slots), EPLB (even split), EPLB with our
    block split (to separate the split's effect from the placement's), padding-aware.
    """
    calibration = np.atleast_2d(calibration)
    e = calibration.shape[1]
    placements = []
    if e == num_gpus * slots_per_gpu:
        placements.append(Placement.contiguous(e, num_gpus))
    eplb = eplb_placement(calibration, num_gpus, slots_per_gpu, mode="global")
    placements.append(eplb)
    placements.append(eplb.with_split("block", block_size, name="eplb+block-split"))
    placements.append(padding_aware_placement(calibration, num_gpus, slots_per_gpu, block_size, costs=costs))
    return [evaluate_placement(p, evaluation, block_size, scheme, costs) for p in placements]
