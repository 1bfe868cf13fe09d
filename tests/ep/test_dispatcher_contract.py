"""The Dispatcher contract, for every dispatcher, through the protocol alone.

Every dispatcher — AllToAllDispatcher, MaxCountsDispatcher, CapAndSpillDispatcher in both
forms, and the low-latency layer on its gloo transport — is driven only through
``dispatch(x, topk_ids, topk_weights) -> Dispatched`` and ``combine(expert_out,
dispatched)``, over the adversarial routings of ``tests/ep/cases.py``
(``ADVERSARIAL_CASES``: all tokens to one expert, all to one rank, a rank with T = 0,
T = max, K = 1 and K = E, fully and partly masked rows, duplicate ids within a row, ...),
on one process (no process group: the single-process mode) and on 2 and 4 gloo ranks, in
both combine orders (``combine_order="slot"`` and ``"rank"``). The objects of a K are built
once and run every case of that K in turn, more than 20 changing steps on one object.

The local dispatcher (one process, :class:`moekit.ep.local.LocalDispatcher`) delivers the
other layout, token-major: it is held to the same combine references on the same routings,
with the per-slot expert outputs ``[T, K, H]`` (NaN on masked slots) in both orders, and to
passing a ``[T, H]`` output of experts that sum the slots themselves through unchanged.

Each step is compared with ``torch.equal`` against the single-process loop reference:
the received rows and their handle against ``moekit.ep.reference.expected_dispatch``
(one row per (token, slot); the low-latency layer keeps one row per (token, expert), the
first slot naming it, and sends its output to every such slot), and the combine of a
per-row expert function against ``moekit.moe.reference.reference_slot_sum`` of the same
function applied token by token (the slot order), or against
``moekit.ep.dispatcher.weighted_rank_sum`` of those slot outputs (the rank order). Rows past
``counts`` are NaN in ``expert_out``: combine must never read them.

One launch per world size runs everything (shared with the other multi-rank tests:
tests/rank_pool.py), to keep the spawn cost out of the case count.
"""

from __future__ import annotations

import functools

import pytest
import torch

from moekit.ep import (COMBINE_ORDERS, AllToAllDispatcher, CapAndSpillDispatcher, Dispatcher, EPLowLatencyAllToAll,
                       MaxCountsDispatcher, weighted_rank_sum)
from moekit.ep.dispatcher import TOKEN_MAJOR
from moekit.ep.local import LocalDispatcher
from moekit.ep.reference import expected_dispatch
from moekit.moe.reference import reference_slot_sum
from tests.ep.cases import ADVERSARIAL_CASES, MAX_TOKENS, build_case
from tests.ep.deadline import hard_deadline

SEEDS = (0, 1, 2)
# On 4 ranks each step costs several times what it costs on 2 (more collectives and ranks on the
# same cores): two draws of every routing there, still more than 20 changing steps on one object.
SEEDS_ON = {4: (0, 1)}


def seeds(world_size: int) -> tuple[int, ...]:
    return SEEDS_ON.get(world_size, SEEDS)
BF16_CASES = ("skewed", "duplicates", "t_max")  # the rest run in float32


def dispatchers(num_experts: int, top_k: int, dtypes, combine_order: str = "slot") -> dict:
    """Every dispatcher, by name, for one (E, K) and combine order; ``per_token_rows`` marks
    the layer that keeps one row per (token, expert). The low-latency layer runs with the
    worst-case receive buffer and with a bounded one (one row per source: nearly every step
    spills)."""
    T, K, order = MAX_TOKENS, top_k, combine_order
    out = {
        "alltoall": AllToAllDispatcher(num_experts, top_k=K, max_tokens=T, combine_order=order),
        "maxcounts": MaxCountsDispatcher(num_experts, T * K, T, top_k=K, combine_order=order),
        "capspill(C=1)": CapAndSpillDispatcher(num_experts, 1, T, top_k=K, combine_order=order),
        "capspill-conditional(C=3)": CapAndSpillDispatcher(num_experts, 3, T, top_k=K, conditional=True,
                                                           combine_order=order),
    }
    for dtype in dtypes:
        name = str(dtype)[6:]
        out[f"lowlatency({name})"] = EPLowLatencyAllToAll(T, 24, K, num_experts, dtype=dtype, online_fp8=False,
                                                          combine_order=order)
        out[f"lowlatency-bounded(C=1)({name})"] = EPLowLatencyAllToAll(
            T, 24, K, num_experts, dtype=dtype, online_fp8=False, combine_order=order, recv_capacity=1)
    return {f"{key} [{order}]": d for key, d in out.items()}


def per_token_rows(name: str) -> bool:
    return name.startswith("lowlatency")


def steps_by_top_k(world_size: int) -> dict[int, list[tuple[str, int]]]:
    """The (case, seed) steps of each K, in the order one object runs them."""
    groups: dict[int, list[tuple[str, int]]] = {}
    for seed in seeds(world_size):
        for name in ADVERSARIAL_CASES:
            _, ids, _, _ = build_case(name, world_size, seed)
            groups.setdefault(ids[0].shape[1], []).append((name, seed))
    return groups


def case_dtype(name: str) -> torch.dtype:
    return torch.bfloat16 if name in BF16_CASES else torch.float32


def expert_fn(rows: torch.Tensor, expert: int) -> torch.Tensor:
    """A stand-in expert: a function of the row and the expert only (so it is the same
    wherever a dispatcher places the row), computed in float32, cast back."""
    return (rows.float() * (expert + 1) + 0.25 * expert).to(rows.dtype)


def expert_outputs(dispatched, rank: int) -> torch.Tensor:
    """expert_fn on every received row, NaN on padding rows (which combine must not read)."""
    tokens = dispatched.tokens
    E_local = tokens.shape[0]
    out = torch.stack([expert_fn(tokens[e], rank * E_local + e) for e in range(E_local)]) if E_local else tokens
    valid = torch.arange(tokens.shape[1]).unsqueeze(0) < dispatched.counts.long().unsqueeze(1)
    return torch.where(valid.unsqueeze(2), out, torch.full_like(out, float("nan")))


def reference_combine(x, ids, w, dtype, combine_order: str = "slot", *, num_experts: int = 0,
                      world_size: int = 1) -> torch.Tensor:
    """The combine of expert_fn for one rank's tokens, slot by slot, on one process."""
    T, K = ids.shape
    slot_out = torch.zeros(T, K, x.shape[1], dtype=dtype)
    for t in range(T):
        for k in range(K):
            if int(ids[t, k]) >= 0:
                slot_out[t, k] = expert_fn(x[t:t + 1], int(ids[t, k]))[0]
    if combine_order == "rank":
        return weighted_rank_sum(slot_out, ids, w, dtype, num_experts=num_experts, world_size=world_size)
    return reference_slot_sum(slot_out, ids, w, dtype)


def reference_rows(xs, ids, num_experts: int, rank: int, one_per_token: bool) -> list[dict]:
    """expected_dispatch, or, for one row per (token, expert), its first row of each token."""
    rows = expected_dispatch(xs, ids, num_experts, rank)
    if not one_per_token:
        return rows
    out = []
    for r in rows:
        seen, keep = set(), []
        for j, key in enumerate(zip(r["src_rank"].tolist(), r["src_token"].tolist())):
            if key not in seen:
                seen.add(key)
                keep.append(j)
        index = torch.tensor(keep, dtype=torch.int64)
        out.append({k: v[index] for k, v in r.items()})
    return out


@functools.lru_cache(maxsize=8)
def _references(case: str, seed: int, world_size: int, rank: int, one_per_token: bool, combine_order: str):
    """The step's inputs and both references, built once for all the dispatchers that run it
    (each gets clones of the inputs)."""
    dtype = case_dtype(case)
    xs, ids, ws, E = build_case(case, world_size, seed, dtype=dtype)
    rows = reference_rows(xs, ids, E, rank, one_per_token)
    y = reference_combine(xs[rank], ids[rank], ws[rank], dtype, combine_order, num_experts=E, world_size=world_size)
    return xs[rank], ids[rank], ws[rank], rows, y


def check_step(name: str, d, rank: int, case: str, seed: int, world_size: int) -> list[str]:
    x, ids, w, rows, want = _references(case, seed, world_size, rank, per_token_rows(name), d.combine_order)
    where = f"{name}, {case} (seed {seed}), rank {rank} of {world_size}"
    dispatched = d.dispatch(x.clone(), ids.clone(), w.clone())
    bad = []
    for e, want_rows in enumerate(rows):
        n = int(dispatched.counts[e])
        if n != want_rows["tokens"].shape[0]:
            bad.append(f"{where}: expert {e} received {n} rows, the reference {want_rows['tokens'].shape[0]}")
            continue
        if not torch.equal(dispatched.tokens[e, :n], want_rows["tokens"]):
            bad.append(f"{where}: expert {e}'s rows differ from the reference")
        for key in ("src_rank", "src_token", "src_slot"):
            got = getattr(dispatched.handle, key)
            if not torch.equal(got[e, :n], want_rows[key]) or not bool((got[e, n:] == -1).all()):
                bad.append(f"{where}: expert {e}'s {key} differs from the reference")
    y = d.combine(expert_outputs(dispatched, rank), dispatched)
    if not torch.equal(y, want):
        bad.append(f"{where}: combine differs from the reference")
    return bad


def run_contract(rank: int, world_size: int) -> dict:
    """Every dispatcher on every step of its K, in both combine orders; the mismatches and
    what was compared."""
    failures, compared = [], []
    for top_k, steps in steps_by_top_k(world_size).items():
        E = 4 * world_size
        # Sorted: a set of dtypes iterates in a per-process order, and every rank must build
        # its dispatchers in the same order (the configuration check caught exactly that).
        dtypes = sorted({case_dtype(case) for case, _ in steps}, key=str)
        made = {name: d for order in COMBINE_ORDERS for name, d in dispatchers(E, top_k, dtypes, order).items()}
        for name, d in made.items():
            assert isinstance(d, Dispatcher), name
        for case, seed in steps:
            for name, d in made.items():
                if per_token_rows(name) and f"({str(case_dtype(case))[6:]}) [" not in name:
                    continue  # a low-latency layer takes one dtype
                failures += check_step(name, d, rank, case, seed, world_size)
                compared.append((name, case, seed))
    return dict(failures=failures, compared=compared)


def _expected_compared(world_size: int) -> int:
    # per order: four dispatchers and the two low-latency layers of the step's dtype
    per_step = len(COMBINE_ORDERS) * (4 + 2)
    return sum(len(steps) * per_step for steps in steps_by_top_k(world_size).values())


def test_single_process():
    """No process group: every collective is a copy, the contract is the same."""
    with hard_deadline(300, "the single-process contract run"):
        result = run_contract(0, 1)
    assert result["failures"] == [], result["failures"][:8]
    assert len(result["compared"]) == _expected_compared(1)


# One launch per world size, shared with the other multi-rank tests (tests/rank_pool.py).
@pytest.mark.ranks(lambda: (run_contract,), deadline=900)
@pytest.mark.parametrize("world_size", [2, 4])
def test_on_gloo_ranks(world_size, pooled_launch):
    results = pooled_launch()
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}: {result['failures'][:8]}"
        assert len(result["compared"]) == _expected_compared(world_size)


def test_battery_covers_the_adversarial_routings():
    """The routings the contract promises are in the battery, with the shapes they claim."""
    for world_size in (1, 2, 4):
        groups = steps_by_top_k(world_size)
        assert set(groups) == {1, 2, 4 * world_size}  # K = 1, the usual K, and K = E
        longest = max(len(steps) for steps in groups.values())
        assert longest >= 20  # changing steps on one object
    P = 2
    E = 4 * P
    facts = {}
    for name in ADVERSARIAL_CASES:
        xs, ids, _, _ = build_case(name, P, 0)
        flat = torch.cat([i.reshape(-1) for i in ids])
        rows = torch.cat(ids)
        facts[name] = dict(
            tokens=[x.shape[0] for x in xs],
            experts=set(flat[flat >= 0].tolist()),
            masked_rows=bool(((rows == -1).all(1)).any()) if rows.numel() else False,
            partly_masked=bool((((rows == -1).any(1)) & ~((rows == -1).all(1))).any()) if rows.numel() else False,
            duplicates=any(len(set(r.tolist()) - {-1}) < int((r >= 0).sum()) for r in rows),
        )
    assert len(facts["one_expert"]["experts"]) == 1 and len(facts["one_expert_every_slot"]["experts"]) == 1
    assert facts["rank0_only"]["experts"] <= set(range(E // P))  # all to one rank
    assert facts["one_rank_empty"]["tokens"][-1] == 0 and facts["empty"]["tokens"] == [0] * P
    assert facts["t_max"]["tokens"] == [MAX_TOKENS] * P
    assert facts["masked_rows"]["masked_rows"] and facts["masked_rows"]["partly_masked"]
    assert facts["masked"]["partly_masked"]
    assert facts["duplicates"]["duplicates"] and facts["one_expert_every_slot"]["duplicates"]


def token_major_slot_outputs(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """expert_fn on every (token, slot) of the token-major layout, NaN on masked slots (which
    combine must not read)."""
    T, K = ids.shape
    out = torch.full((T, K, x.shape[1]), float("nan"), dtype=x.dtype)
    for t in range(T):
        for k in range(K):
            if int(ids[t, k]) >= 0:
                out[t, k] = expert_fn(x[t:t + 1], int(ids[t, k]))[0]
    return out


@pytest.mark.parametrize("combine_order", COMBINE_ORDERS)
def test_local_dispatcher_token_major(combine_order):
    """The token-major layout: the tokens and routing pass through as given (no copy), and the
    combine of the slot outputs equals the references bitwise on every adversarial routing."""
    compared = 0
    for seed in SEEDS:
        for case in ADVERSARIAL_CASES:
            dtype = case_dtype(case)
            xs, ids, ws, E = build_case(case, 1, seed, dtype=dtype)
            d = LocalDispatcher(E, top_k=ids[0].shape[1], max_tokens=MAX_TOKENS, combine_order=combine_order)
            assert isinstance(d, Dispatcher)
            got = d.dispatch(xs[0], ids[0], ws[0])
            assert got.layout == TOKEN_MAJOR and got.counts is None and got.handle is None and got.scales is None
            assert got.tokens is xs[0] and got.topk_ids is ids[0] and got.topk_weights is ws[0]
            y = d.combine(token_major_slot_outputs(xs[0], ids[0]), got)
            want = reference_combine(xs[0], ids[0], ws[0], dtype, combine_order, num_experts=E, world_size=1)
            assert torch.equal(y, want), (case, seed)
            summed = torch.randn(xs[0].shape, dtype=torch.float32).to(dtype)
            assert d.combine(summed, got) is summed  # experts that weighted and summed: finalize only
            compared += 1
    assert compared == len(SEEDS) * len(ADVERSARIAL_CASES)
