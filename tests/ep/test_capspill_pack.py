"""The one-launch Triton phases of MaxCounts and Cap-and-Spill against their torch phases, bitwise.

On the CPU the dispatchers run their torch phases; the kernels of ``moekit.ep.capspill_pack``
run wherever the tensors are CUDA. Here the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``) and every tensor they produce is compared with ``torch.equal``
against the torch phase's:

* pack (plan + pass 1, one launch): the send buffer byte for byte (headers, payloads, empty
  rows) and every plan tensor combine reads;
* compact (the spill pass): the spill buffer;
* unpack (one launch): the whole expert-major result (padding rows included), counts, the
  handle, and the state combine and ``check_replay`` read (each received row's slot, the
  largest count, the overflow and bad-id flags; in the rank order the row weights and tokens).

The P ranks are simulated in one process (the exchange is a transpose of the send buffers),
so every rank's unpack sees exactly what an all-to-all would deliver, with and without the
spill pass. Routings are random with masked slots, ids outside [-1, E), empty ranks, all
pairs to one peer and repeated experts. Last, two gloo ranks run whole dispatch + combine
steps with ``packing="triton"`` against the eager all-to-all.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton's interpreter, set before the kernels are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moekit.ep.capacity import expert_capacity, spill_capacity  # noqa: E402
from moekit.ep.capspill import CapAndSpillDispatcher, MaxCountsDispatcher  # noqa: E402
from moekit.ep.layout import ExpertPlacement  # noqa: E402
from moekit.kernels.backend import HAVE_TRITON, KERNELS_INTERPRETED  # noqa: E402

pytestmark = pytest.mark.skipif(not HAVE_TRITON or not (KERNELS_INTERPRETED or torch.cuda.is_available()),
                                reason="needs Triton, compiled for a GPU or run by its interpreter")

PLAN_FIELDS = ("ids", "weights", "invalid", "sorted_pair", "sorted_local", "rank_counts", "rank_start", "pair_rank",
               "pair_pos", "max_count")
STATE_FIELDS = ("dest", "largest_count", "overflow", "invalid_ids", "invalid_by_rank")
RANK_STATE_FIELDS = ("row_weight", "row_token", "src_rank", "src_token", "src_slot")


def rank_view(cls, world_size: int, rank: int, num_experts: int, capacity: int, max_tokens: int, top_k: int,
              combine_order: str, packing: str):
    """rank ``rank``'s dispatcher of a ``world_size``-rank group, without the group: what the
    constructor derives, set directly (pack and unpack are local; only exchange needs peers)."""
    d = object.__new__(cls)
    d.world_size, d.rank, d.placement = world_size, rank, ExpertPlacement(num_experts, world_size)
    d.capacity, d.max_tokens, d.top_k, d.combine_order = capacity, max_tokens, top_k, combine_order
    d.header_bytes = 32 if combine_order == "rank" else 16
    d.spill_rows = spill_capacity(max_tokens, top_k, capacity) if cls._spills else 0
    d.expert_capacity = expert_capacity(world_size, max_tokens, top_k, capacity + d.spill_rows)
    d.packing = packing
    return d


def routing(g: torch.Generator, kind: str, world_size: int, T_max: int, E: int, K: int, H: int,
            dtype: torch.dtype):
    """Every rank's (x, ids, weights) for one step of ``kind``."""
    out = []
    for rank in range(world_size):
        T = int(torch.randint(0, T_max + 1, (1,), generator=g))
        if kind in ("one_peer", "repeat"):
            T = T_max
        if kind == "empty_rank" and rank == 0:
            T = 0
        ids = torch.randint(0, E, (T, K), generator=g)
        if kind == "one_peer":  # every pair to the last rank's experts
            ids = E - 1 - torch.randint(0, E // world_size, (T, K), generator=g)
        if kind == "repeat":  # both slots name one expert
            ids[:, 1:] = ids[:, :1]
        if kind in ("masked", "bad_ids", "empty_rank"):
            ids = torch.where(torch.rand(T, K, generator=g) < 0.3, torch.full_like(ids, -1), ids)
        if kind == "bad_ids" and T:  # outside [-1, E): masked and flagged (the graph path)
            ids[0, 0] = E + 3
            ids[-1, -1] = -5
        w = torch.rand(T, K, generator=g) + 0.05
        out.append((torch.randn(T, H, generator=g).to(dtype), ids, w / w.sum(1, keepdim=True)))
    return out


def send_rows(x: torch.Tensor) -> torch.Tensor:
    return x.new_zeros(1, x.shape[1]) if x.shape[0] == 0 else x.contiguous()


def transpose(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """What an all-to-all delivers: rank r receives slice r of every sender's buffer, by source."""
    return [torch.stack([b[r] for b in buffers]) for r in range(len(buffers))]


def check_step(cls, world_size, capacity, T_max, E, K, order, inputs) -> list[str]:
    bad = []
    torch_side = [rank_view(cls, world_size, r, E, capacity, T_max, K, order, "torch") for r in range(world_size)]
    kern_side = [rank_view(cls, world_size, r, E, capacity, T_max, K, order, "triton") for r in range(world_size)]
    plans, sends, spills = {}, {}, {}
    for side, ds in (("torch", torch_side), ("triton", kern_side)):
        plans[side], sends[side], spills[side] = [], [], []
        for d, (x, ids, w) in zip(ds, inputs):
            plan, buf = d.plan_and_pack(send_rows(x), ids, w)
            plans[side].append(plan)
            sends[side].append(buf)
            spills[side].append(d.compact(send_rows(x), plan) if d.spill_rows else None)
    for r in range(world_size):
        for f in PLAN_FIELDS:
            a, b = getattr(plans["torch"][r], f), getattr(plans["triton"][r], f)
            if a.dtype != b.dtype or not torch.equal(a, b):
                bad.append(f"rank {r} plan.{f}")
        if not torch.equal(sends["torch"][r], sends["triton"][r]):
            bad.append(f"rank {r} pass-1 buffer")
        if spills["torch"][r] is not None and not torch.equal(spills["torch"][r], spills["triton"][r]):
            bad.append(f"rank {r} spill buffer")
    passes = [[sends["torch"]]] + ([[sends["torch"], spills["torch"]]] if torch_side[0].spill_rows else [])
    for bufs in passes:
        received = list(zip(*[transpose(b) for b in bufs]))  # per rank: its one or two passes
        unpacked = []
        for r in range(world_size):
            x = send_rows(inputs[r][0])
            want = torch_side[r].unpack(plans["torch"][r], list(received[r]), x)
            got = kern_side[r].unpack(plans["triton"][r], list(received[r]), x)
            unpacked.append((want, got))
            what = f"rank {r} unpack of {len(bufs)} pass(es)"
            for name, a, b in (("tokens", want.tokens, got.tokens), ("counts", want.counts, got.counts),
                               ("src_rank", want.handle.src_rank, got.handle.src_rank),
                               ("src_token", want.handle.src_token, got.handle.src_token),
                               ("src_slot", want.handle.src_slot, got.handle.src_slot)):
                if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                    bad.append(f"{what}: {name}")
            fields = STATE_FIELDS + (RANK_STATE_FIELDS if order == "rank" else ())
            for f in fields:
                a, b = want.handle.state[f], got.handle.state[f]
                if a.dtype != b.dtype or not torch.equal(a.reshape(-1), b.reshape(-1)):
                    bad.append(f"{what}: state[{f}]")
            if want.handle.state["pass_rows"] != got.handle.state["pass_rows"]:
                bad.append(f"{what}: pass_rows")
        if order == "slot" and _kernel_dtype(inputs[0][0].dtype):
            bad += check_combine(torch_side, plans, kern_side, unpacked)
    return bad


def _kernel_dtype(dtype) -> bool:
    """Whether combine's kernel can do float math in this dtype here (the interpreter has no bf16)."""
    return dtype != torch.bfloat16 or torch.cuda.is_available()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaN included."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def expert_rows(d) -> torch.Tensor:
    """A per-row function of the received tokens, NaN on padding rows (combine must not read them)."""
    tokens = d.tokens
    valid = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0) < d.counts.unsqueeze(1)
    return torch.where(valid.unsqueeze(2), tokens * 3 - 1, torch.full_like(tokens, float("nan")))


def check_combine(torch_side, plans, kern_side, unpacked) -> list[str]:
    """Combine's two halves in the slot order: the rows sent back per pass (``gather_back``) and
    the source's sum (``combine_slots``) against the torch path's index_select, ``_take_returned``
    and ``weighted_slot_sum``, on the exchange the simulated ranks would make."""
    from moekit.ep import capspill_pack
    from moekit.ep.dispatcher import weighted_slot_sum

    bad = []
    P = len(torch_side)
    backs = {"torch": [], "triton": []}
    for r, (want, got) in enumerate(unpacked):
        flat = expert_rows(want).reshape(-1, want.tokens.shape[2])
        spare = flat.shape[0]
        first, per_pass = 0, {"torch": [], "triton": []}
        for rows in want.handle.state["pass_rows"]:
            dest = want.handle.state["dest"]
            per_pass["torch"].append(flat.index_select(0, dest[:, first:first + rows].clamp(max=spare - 1)
                                                       .reshape(-1)).view(P, rows, -1))
            per_pass["triton"].append(capspill_pack.gather_back(expert_rows(got).reshape(flat.shape),
                                                                got.handle.state["dest"], first, rows))
            if not same_bits(per_pass["torch"][-1], per_pass["triton"][-1]):
                bad.append(f"rank {r} combine rows of the pass at {first}")
            first += rows
        for side in backs:
            backs[side].append(per_pass[side])
    for r in range(P):
        want, _ = unpacked[r]
        plan_t, plan_k = plans["torch"][r], plans["triton"][r]
        H = want.tokens.shape[2]
        slot_out = torch.zeros(plan_t.ids.numel(), H, dtype=want.tokens.dtype, device=want.tokens.device)
        returned, first = [], 0
        for i, rows in enumerate(want.handle.state["pass_rows"]):
            ret_t = torch.stack([backs["torch"][s][i][r] for s in range(P)])
            if rows:
                slot_out, _ = torch_side[r]._take_returned(slot_out, None, ret_t, plan_t, first)
                returned.append((torch.stack([backs["triton"][s][i][r] for s in range(P)]), first))
            first += rows
        T, K = plan_t.ids.shape
        y_want = weighted_slot_sum(slot_out.view(T, K, H), plan_t.ids, plan_t.weights, want.tokens.dtype)
        y_got = capspill_pack.combine_slots(returned, plan_k, P, want.tokens.dtype, H)
        if not same_bits(y_want[:plan_t.num_tokens], y_got):
            bad.append(f"rank {r} combine sum")
    return bad


KINDS = ("uniform", "masked", "bad_ids", "empty_rank", "one_peer", "repeat")
# (class, capacity): MaxCounts roomy and tight (overflowing on heavy steps); Cap-and-Spill with C = 0
# (pass 1 empty), small C (spilling) and C = T_max * K (an empty spill pass).
DISPATCHERS = [(MaxCountsDispatcher, "T*K"), (MaxCountsDispatcher, 3), (CapAndSpillDispatcher, 0),
               (CapAndSpillDispatcher, 1), (CapAndSpillDispatcher, 4), (CapAndSpillDispatcher, "T*K")]


def _check_kinds(world_size, order, per_kind, T_max=7, K=2, H=10, seed=0) -> list[str]:
    """Every routing kind (dtypes in turn) through ``per_kind`` of the dispatchers (rotating, so
    each dispatcher meets several kinds): the interpreter is slow, the pairing keeps it short."""
    E = 2 * world_size
    g = torch.Generator().manual_seed(seed)
    bad = []
    for i, kind in enumerate(KINDS):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        inputs = routing(g, kind, world_size, T_max, E, K, H, dtype)
        for j in range(per_kind):
            cls, C = DISPATCHERS[(i + j * 3 + (i // 2)) % len(DISPATCHERS)]
            C = T_max * K if C == "T*K" else C
            bad += [f"{kind} {dtype} {cls.__name__}(C={C}): {b}"
                    for b in check_step(cls, world_size, C, T_max, E, K, order, inputs)]
    return bad


@pytest.mark.parametrize("order", ["slot", "rank"])
def test_kernels_equal_torch_phases_two_ranks(order):
    assert _check_kinds(2, order, per_kind=2) == []


def test_kernels_equal_torch_phases_four_ranks():
    assert _check_kinds(4, "slot", per_kind=1, seed=4) == []


def test_kernels_with_many_programs(monkeypatch):
    """Blocks of 4 rows: many programs, each scanning the ids and searching the streams on its own
    (the GPU's launch shape; the interpreter otherwise runs one block)."""
    from moekit.ep import capspill_pack

    monkeypatch.setattr(capspill_pack, "BLOCK_OVERRIDE", 4)
    g = torch.Generator().manual_seed(7)
    for kind, order, (cls, C) in (("masked", "rank", (CapAndSpillDispatcher, 2)),
                                  ("one_peer", "slot", (MaxCountsDispatcher, 5))):
        inputs = routing(g, kind, 4, 7, 8, 2, 6, torch.float32)
        assert check_step(cls, 4, C, 7, 8, 2, order, inputs) == [], kind


@pytest.mark.parametrize("hidden, dtype", [(5, torch.float16), (3, torch.float32), (8, torch.bfloat16)])
def test_row_widths(hidden, dtype):
    """Rows copied as 2-, 4- and 8-byte words; an odd H in fp16 leaves rows of 2-byte words
    whose headers are read byte by byte."""
    g = torch.Generator().manual_seed(hidden)
    inputs = routing(g, "masked", 2, 6, 4, 2, hidden, dtype)
    assert check_step(CapAndSpillDispatcher, 2, 2, 6, 4, 2, "rank", inputs) == []


def test_one_rank():
    """P = 1 (no process group): one peer, three experts, ids outside [-1, E) flagged."""
    g = torch.Generator().manual_seed(11)
    inputs = routing(g, "bad_ids", 1, 6, 3, 2, 4, torch.float32)
    for cls, C in ((MaxCountsDispatcher, 4), (CapAndSpillDispatcher, 3)):
        assert check_step(cls, 1, C, 6, 3, 2, "slot", inputs) == []


def _gloo_worker(rank, world_size):
    from tests.ep.test_capspill import K, T_MAX, capspill_steps, compare, expert_outputs, num_experts

    from moekit.ep import AllToAllDispatcher

    steps = capspill_steps(world_size, 8)  # every routing kind once
    E = num_experts(world_size)
    eager = AllToAllDispatcher(E)
    made = {"maxcounts": MaxCountsDispatcher(E, T_MAX * K, T_MAX, top_k=K),
            "capspill(C=1)": CapAndSpillDispatcher(E, 1, T_MAX, top_k=K),
            "capspill-cond(C=3)": CapAndSpillDispatcher(E, 3, T_MAX, top_k=K, conditional=True),
            "capspill-rank(C=3)": CapAndSpillDispatcher(E, 3, T_MAX, top_k=K, combine_order="rank")}
    eager_rank = AllToAllDispatcher(E, combine_order="rank")
    for d in made.values():
        d.packing = "triton"
    mismatches, used = [], []
    for i, (_, dtype, xs, ids, ws) in enumerate(steps):
        if not _kernel_dtype(dtype):  # combine's float math: no bf16 in the interpreter (the GPU tests run it)
            continue
        for name, d in made.items():
            ref = eager_rank if d.combine_order == "rank" else eager
            want = ref.dispatch(xs[rank], ids[rank], ws[rank])
            y_want = ref.combine(expert_outputs(want), want)
            got = d.dispatch(xs[rank], ids[rank], ws[rank])
            mismatches += compare(name, i, got, want, d.combine(expert_outputs(got), got), y_want)
            used.append(d.uses_kernels(xs[rank]))
    return dict(mismatches=mismatches, used=all(used))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo ranks run the kernels in the interpreter")
def test_dispatchers_with_kernels_on_gloo_ranks():
    from tests.ep.deadline import run_ranks

    results, _ = run_ranks(_gloo_worker, 2, deadline=600.0, timeout=300.0)
    for result in results:
        assert result["used"]
        assert result["mismatches"] == [], result["mismatches"][:10]
