"""Ranks fail together, on 2 and 4 gloo ranks, for every dispatcher.

One launch per world size (shared with the other multi-rank tests: tests/rank_pool.py) runs
every recoverable scenario on the same objects:

* configuration: one rank builds a dispatcher with another E, H, K, max tokens, dtype,
  capacity, mode, combine order or receive capacity, or a bad argument, or another class:
  every rank raises the same ValueError, which names the field and each rank's value;
* bad input on one rank (bad ids, T > max, dtypes, shapes, a list for x, ...): every rank
  raises the same ValueError naming that rank, in the same step; the bad rank catches it
  and goes on, and the next (good) step of every rank equals the loop reference, so no
  rank paired one step with another (also for the rank combine order, whose counts message
  carries more, and for the low-latency layer with a bounded receive buffer, whose spill
  rounds run before the error is raised);
* the CUDA-graph path (capture stood in for on the CPU): bad ids on one rank are masked and
  flagged on the device, and ``check_replay`` raises the same error on every rank.

A bad ``expert_out`` on one rank in combine (wrong shape, H, dtype, not a tensor) runs as a
job of its own: every rank raises the same ValueError in that combine, none waits for its
timeout, and the next step pairs up; with the statuses not readable for free (CUDA, stood in
for on the CPU) the bad rank raises at once and every rank at the next dispatch.

A dead or silent peer ends the group, so those run one launch each: a rank that kills
itself, or stops calling, gives the others a PeerError within the dispatcher's timeout,
and ``launch`` raises promptly, naming the dead rank. Every launch runs under a hard
deadline (tests/ep/deadline.py), so a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import moekit.ep.capspill as capspill
from moekit.ep import (AllToAllDispatcher, CapacityOverflowError, CapAndSpillDispatcher, EPLowLatencyAllToAll,
                       MaxCountsDispatcher, PeerError, RankFailedError)
from moekit.ep.reference import expected_dispatch
from tests.ep.cases import expected_combine, fake_experts, uniform_ids
from tests.ep.deadline import run_ranks

T_MAX, K, H = 6, 2, 8
STEP_TIMEOUT = 20.0  # the dispatchers' bound on a wait for peers in the recoverable scenarios
KINDS = ["alltoall", "maxcounts", "capspill", "capspill-cond", "lowlatency", "alltoall-rank",
         "lowlatency-bounded-rank"]


def num_experts(world_size: int) -> int:
    return 2 * world_size


def build(kind: str, E: int, *, hidden=H, top_k=K, max_tokens=T_MAX, dtype=torch.float32, capacity=None,
          conditional=None, timeout=STEP_TIMEOUT, combine_order=None, recv_capacity=None):
    """One dispatcher of ``kind`` (every argument can be varied per rank)."""
    order = combine_order or ("rank" if kind.endswith("-rank") else "slot")
    if kind in ("alltoall", "alltoall-rank"):
        return AllToAllDispatcher(E, hidden=hidden, top_k=top_k, max_tokens=max_tokens, dtype=dtype, timeout=timeout,
                                  combine_order=order)
    if kind == "alltoall-free":  # no limits: H and dtype may differ per step, but not across ranks
        return AllToAllDispatcher(E, timeout=timeout)
    if kind == "maxcounts":
        return MaxCountsDispatcher(E, T_MAX * K if capacity is None else capacity, max_tokens, top_k=top_k,
                                   hidden=hidden, dtype=dtype, timeout=timeout)
    if kind == "maxcounts-free":
        return MaxCountsDispatcher(E, T_MAX * K, T_MAX, top_k=K, timeout=timeout)
    if kind in ("capspill", "capspill-cond"):
        cond = (kind == "capspill-cond") if conditional is None else conditional
        return CapAndSpillDispatcher(E, 1 if capacity is None else capacity, max_tokens, top_k=top_k, hidden=hidden,
                                     dtype=dtype, conditional=cond, timeout=timeout)
    if kind == "lowlatency":
        return EPLowLatencyAllToAll(max_tokens, hidden, top_k, E, dtype=dtype, online_fp8=False, timeout=timeout,
                                    combine_order=order, recv_capacity=recv_capacity)
    if kind == "lowlatency-bounded-rank":  # one row per source: nearly every step spills
        return EPLowLatencyAllToAll(max_tokens, hidden, top_k, E, dtype=dtype, online_fp8=False, timeout=timeout,
                                    combine_order=order, recv_capacity=1 if recv_capacity is None else recv_capacity,
                                    spill_rows=1)
    raise AssertionError(kind)


def good_step(world_size: int, seed: int):
    """Every rank's inputs of one step: distinct experts per token, T in [0, T_MAX]."""
    g = torch.Generator().manual_seed(1000 + seed)
    E = num_experts(world_size)
    xs, ids, ws = [], [], []
    for _ in range(world_size):
        T = int(torch.randint(0, T_MAX + 1, (1,), generator=g))
        i = uniform_ids(g, T, E, K)
        w = torch.rand(T, K, generator=g) + 0.05
        xs.append(torch.randn(T, H, generator=g))
        ids.append(i.to(torch.int64))
        ws.append(w / w.sum(1, keepdim=True))
    return xs, ids, ws


def check_good_step(d, rank: int, world_size: int, seed: int, where: str) -> list[str]:
    """Dispatch + fake experts + combine of a good step, against the loop reference."""
    xs, ids, ws = good_step(world_size, seed)
    E = num_experts(world_size)
    dispatched = d.dispatch(xs[rank], ids[rank], ws[rank])
    bad = []
    for e, want in enumerate(expected_dispatch(xs, ids, E, rank)):
        n = int(dispatched.counts[e])
        if n != want["tokens"].shape[0] or not torch.equal(dispatched.tokens[e, :n], want["tokens"]):
            bad.append(f"{where}: received rows of expert {e} differ from the reference")
    y = d.combine(fake_experts(dispatched.tokens, rank), dispatched)
    if not torch.equal(y, expected_combine(xs, ids, ws, E, torch.float32, d.combine_order)[rank]):
        bad.append(f"{where}: combine differs from the reference")
    return bad


# -- bad input on one rank --------------------------------------------------------------------

def _with_bad_id(ids, value):
    ids = ids.clone()
    if ids.numel():
        ids[0, -1] = value
    return ids


def _bad_id_step(x, ids, w, E, value):
    """This rank's step with one id set to ``value`` (a one-token step if it had no tokens)."""
    if not ids.numel():
        x, ids, w = torch.randn(1, H), torch.zeros(1, K, dtype=torch.int64), torch.full((1, K), 0.5)
    return x, _with_bad_id(ids, value), w


def _long_step(E):
    g = torch.Generator().manual_seed(7)
    T = T_MAX + 1
    return torch.randn(T, H, generator=g), uniform_ids(g, T, E, K), torch.full((T, K), 0.5)


# name: (change(x, ids, w, E) -> bad inputs, fragment every rank's message must hold, kinds it applies to)
BAD_INPUTS = {
    "id >= E": (lambda x, i, w, E: _bad_id_step(x, i, w, E, E), lambda E: f"topk_ids must be in [-1, {E - 1}]"),
    "id < -1": (lambda x, i, w, E: _bad_id_step(x, i, w, E, -2), lambda E: f"topk_ids must be in [-1, {E - 1}]"),
    "T > max": (lambda x, i, w, E: _long_step(E), lambda E: f"x has T={T_MAX + 1} tokens"),
    "integer x": (lambda x, i, w, E: (x.to(torch.int32), i, w), lambda E: "x must be a floating-point tensor"),
    "float64 x": (lambda x, i, w, E: (x.double(), i, w), lambda E: "x must have dtype torch.float32"),
    "3-d x": (lambda x, i, w, E: (x.unsqueeze(0), i, w), lambda E: "x must be a 2-D tensor"),
    "wrong H": (lambda x, i, w, E: (x[:, :H - 2], i, w), lambda E: f"x must have hidden size H={H}"),
    "x is a list": (lambda x, i, w, E: (x.tolist(), i, w), lambda E: "x must be a 2-D tensor [T, H], got list"),
    "weights shape": (lambda x, i, w, E: (x, i, w[:, :1]), lambda E: "topk_weights must have the shape"),
    "float ids": (lambda x, i, w, E: (x, i.float(), w), lambda E: "topk_ids must be int32 or int64"),
    "wrong K": (lambda x, i, w, E: (x, i[:, :1], w[:, :1]), lambda E: f"topk_ids must have K={K} columns"),
}
# Without configured limits a rank's H or dtype is only wrong relative to its peers'.
MISMATCHES = {
    "H differs": lambda x: x.new_zeros(x.shape[0], H + 4),
    "dtype differs": lambda x: x.to(torch.bfloat16),
}


def _bad_input_scenarios(rank, world_size, dispatchers, messages, failures, checks):
    E = num_experts(world_size)
    seed = 0
    for kind, d in dispatchers.items():
        for index, (case, (change, fragment)) in enumerate(BAD_INPUTS.items()):
            bad_rank = (index + len(kind)) % world_size  # vary which rank is at fault
            xs, ids, ws = good_step(world_size, seed)
            x, i, w = xs[rank], ids[rank], ws[rank]
            if rank == bad_rank:
                x, i, w = change(x, i, w, E)
            key = f"{kind} / {case} on rank {bad_rank}"
            try:
                d.dispatch(x, i, w)
            except ValueError as error:  # the bad rank catches it too, and goes on
                messages[key] = str(error)
                if f"rank {bad_rank}: " not in str(error) or fragment(E) not in str(error):
                    failures.append(f"{key}: unexpected message {error}")
            else:
                failures.append(f"{key}: rank {rank} did not raise")
            seed += 1
            failures += check_good_step(d, rank, world_size, seed, f"{key}, next step")
            checks.append(key)
            seed += 1
    for kind in ("alltoall-free", "maxcounts-free"):
        d = build(kind, E)
        for case, change in MISMATCHES.items():
            bad_rank = world_size - 1
            xs, ids, ws = good_step(world_size, seed)
            x = change(xs[rank]) if rank == bad_rank else xs[rank]
            key = f"{kind} / {case} on rank {bad_rank}"
            try:
                d.dispatch(x, ids[rank], ws[rank])
            except ValueError as error:
                messages[key] = str(error)
                if "different hidden sizes or dtypes" not in str(error) or f"rank {bad_rank}" not in str(error):
                    failures.append(f"{key}: unexpected message {error}")
            else:
                failures.append(f"{key}: rank {rank} did not raise")
            seed += 1
            failures += check_good_step(d, rank, world_size, seed, f"{key}, next step")
            checks.append(key)
            seed += 1


def _overflow_scenario(rank, world_size, messages, failures, checks):
    """MaxCounts overflow on one rank only: every rank raises before anything is sent."""
    E = num_experts(world_size)
    d = MaxCountsDispatcher(E, 2, T_MAX, top_k=K, timeout=STEP_TIMEOUT)
    x = torch.randn(T_MAX, H)
    heavy = torch.tensor([[E - 1, E - 2]] * T_MAX) if rank == 0 else torch.full((T_MAX, K), -1)
    try:
        d.dispatch(x, heavy, torch.full((T_MAX, K), 0.5))
    except CapacityOverflowError as error:
        messages["maxcounts overflow"] = str(error)
    else:
        failures.append(f"maxcounts overflow: rank {rank} did not raise")
    checks.append("maxcounts overflow")


# -- the CUDA-graph path (stood in for on the CPU) -----------------------------------------------

def _graph_flag_scenarios(rank, world_size, messages, failures, checks):
    E = num_experts(world_size)
    real = capspill._capturing
    capspill._capturing = lambda t: True  # nothing is read on the host, as inside a capture
    try:
        for kind, d in (("maxcounts", build("maxcounts", E)), ("capspill", build("capspill", E, conditional=False))):
            bad_rank = world_size - 1
            xs, ids, ws = good_step(world_size, 50)
            x, i, w = xs[rank], ids[rank], ws[rank]
            if rank == bad_rank:
                x, i, w = _bad_id_step(x, i, w, E, E + 3)
            dispatched = d.dispatch(x, i, w)
            d.combine(fake_experts(dispatched.tokens, rank), dispatched)  # the rest of the captured step
            key = f"graph {kind} / bad id on rank {bad_rank}"
            try:
                d.check_replay(dispatched)
            except ValueError as error:
                messages[key] = str(error)
                if f"rank {bad_rank} of {world_size}" not in str(error):
                    failures.append(f"{key}: unexpected message {error}")
            else:
                failures.append(f"{key}: check_replay did not raise on rank {rank}")
            xs, ids, ws = good_step(world_size, 51)
            good = d.dispatch(xs[rank], ids[rank], ws[rank])
            d.check_replay(good)
            y = d.combine(fake_experts(good.tokens, rank), good)
            if not torch.equal(y, expected_combine(xs, ids, ws, E, torch.float32)[rank]):
                failures.append(f"{key}: the next replayed step differs from the reference")
            checks.append(key)
    finally:
        capspill._capturing = real


# -- configuration ------------------------------------------------------------------------------

def _config_cases(world_size: int):
    """(name, kind, args for most ranks, args for the odd rank, fragments of the message)."""
    E = num_experts(world_size)
    cases = []
    for kind in KINDS:
        varied = [("num_experts", E, 2 * E), ("hidden", H, H + 8), ("top_k", K, 1), ("max_tokens", T_MAX, T_MAX + 1),
                  ("dtype", torch.float32, torch.bfloat16)]
        if kind in ("maxcounts", "capspill", "capspill-cond"):
            varied.append(("capacity", 3, 5))
        if kind.startswith("capspill"):
            varied.append(("conditional", False, True))
        if kind in ("alltoall", "lowlatency"):
            varied.append(("combine_order", "slot", "rank"))
        if kind == "lowlatency":
            varied.append(("recv_capacity", None, 2))
        ll = kind.startswith("lowlatency")  # the layer's own names: max_m, topk
        for field, mine, theirs in varied:
            name = {"top_k": "topk", "max_tokens": "max_m"}.get(field, field) if ll else field
            cases.append((f"{kind}: {field}", kind, {field: mine}, {field: theirs},
                          [f"{name} differs across ranks", repr(mine), repr(theirs)]))
        cases.append((f"{kind}: max_tokens=-1 on one rank", kind, {}, {"max_tokens": -1},
                      ["max_m" if ll else "max_tokens", "-1"]))
        cases.append((f"{kind}: num_experts=8.0 on one rank", kind, {}, {"num_experts": 8.0}, ["num_experts", "8.0"]))
        cases.append((f"{kind}: top_k=0 on one rank", kind, {}, {"top_k": 0}, ["topk" if ll else "top_k"]))
        if ll:  # the layer's own check of K against E, in the constructor the ranks agree on
            cases.append((f"{kind}: top_k > num_experts on one rank", kind, {}, {"top_k": E + 1},
                          [f"topk must be an int in [1, num_experts={E}]"]))
        cases.append((f"{kind}: timeout=-1 on one rank", kind, {}, {"timeout": -1}, ["timeout", "-1"]))
        cases.append((f"{kind}: E not divisible by the world size", kind, {"num_experts": E + 1},
                      {"num_experts": E + 1}, [f"num_experts={E + 1}", f"world_size={world_size}"]))
    cases.append(("different classes", "alltoall", {}, {"kind": "maxcounts"},
                  ["ranks built different objects", "AllToAllDispatcher", "MaxCountsDispatcher"]))
    return cases


def _config_scenarios(rank, world_size, messages, failures, checks):
    E = num_experts(world_size)
    for index, (name, kind, mine, theirs, fragments) in enumerate(_config_cases(world_size)):
        odd = index % world_size
        args = dict(theirs if rank == odd else mine)
        my_kind = args.pop("kind", kind)
        E_arg = args.pop("num_experts", E)
        try:
            build(my_kind, E_arg, **args)
        except ValueError as error:
            messages[f"config {name}"] = str(error)
            missing = [f for f in fragments if f not in str(error)]
            if missing:
                failures.append(f"config {name}: message lacks {missing}: {error}")
        else:
            failures.append(f"config {name}: rank {rank} built it")
        checks.append(f"config {name}")


def _recoverable_worker(rank, world_size):
    messages, failures, checks = {}, [], []
    E = num_experts(world_size)
    _config_scenarios(rank, world_size, messages, failures, checks)
    dispatchers = {kind: build(kind, E) for kind in KINDS}
    _bad_input_scenarios(rank, world_size, dispatchers, messages, failures, checks)
    _overflow_scenario(rank, world_size, messages, failures, checks)
    _graph_flag_scenarios(rank, world_size, messages, failures, checks)
    for kind, d in dispatchers.items():  # still in step after all that
        failures += check_good_step(d, rank, world_size, 99, f"{kind}: last step")
    return dict(messages=messages, failures=failures, checks=checks)


# One launch per world size, shared with the other multi-rank tests (tests/rank_pool.py): every
# scenario here leaves the group in step (that is what it tests).
@pytest.mark.ranks(lambda: (_recoverable_worker,), deadline=600, timeout=60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_raises_the_same_error_and_stays_in_step(world_size, pooled_launch):
    results = pooled_launch()
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}: {result['failures'][:6]}"
    checks = results[0]["checks"]
    assert len(checks) == len(_config_cases(world_size)) + len(KINDS) * len(BAD_INPUTS) + 2 * len(MISMATCHES) + 3
    assert all(r["checks"] == checks for r in results)
    for key in results[0]["messages"]:  # the same error text on every rank
        texts = {r["messages"].get(key) for r in results}
        assert len(texts) == 1, (key, texts)
    assert set(results[0]["messages"]) == set(checks)


# -- a bad expert_out on one rank, in combine ---------------------------------------------------

COMBINE_KINDS = ["alltoall", "alltoall-rank", "maxcounts", "capspill", "capspill-cond", "lowlatency",
                 "lowlatency-bounded-rank"]
# name: (change(expert_out) on the bad rank, fragment every rank's message must hold)
BAD_EXPERT_OUT = {
    "one row too many": (lambda out: out.new_zeros(out.shape[0], out.shape[1] + 1, out.shape[2]), "expert_out must"),
    "wrong H": (lambda out: out[..., :-1], "expert_out must"),
    "2-d": (lambda out: out.reshape(-1, out.shape[-1]), "expert_out must"),
    "float64": (lambda out: out.double(), "expert_out must have dtype"),
    "a list": (lambda out: out.tolist(), "expert_out must"),
}
# With the statuses on a CUDA device (stood in for on the CPU): read at the next dispatch. The
# low-latency layer's GPU transport carries no status in combine (stood in for by the gloo one
# told so): the bad rank sends NaN rows and its error goes with its next dispatch.
DEFERRED_KINDS = ["alltoall", "alltoall-rank", "maxcounts", "capspill-cond", "lowlatency"]


def _bad_expert_out_worker(rank, world_size):
    from moekit.ep import agreement

    messages, failures, checks, waits = {}, [], [], []
    E = num_experts(world_size)
    seed = 200
    for kind in COMBINE_KINDS:
        d = build(kind, E)
        for index, (case, (change, fragment)) in enumerate(BAD_EXPERT_OUT.items()):
            bad_rank = (index + len(kind)) % world_size  # vary which rank is at fault
            xs, ids, ws = good_step(world_size, seed)
            dispatched = d.dispatch(xs[rank], ids[rank], ws[rank])
            out = fake_experts(dispatched.tokens, rank)
            if rank == bad_rank:
                out = change(out)
            key = f"{kind} / {case} on rank {bad_rank}"
            start = time.monotonic()
            try:
                d.combine(out, dispatched)
            except ValueError as error:  # the bad rank catches it too, and goes on
                messages[key] = str(error)
                if f"rank {bad_rank}: " not in str(error) or fragment not in str(error) \
                        or "this combine" not in str(error):
                    failures.append(f"{key}: unexpected message {error}")
            else:
                failures.append(f"{key}: rank {rank} did not raise")
            waits.append(time.monotonic() - start)
            seed += 1
            failures += check_good_step(d, rank, world_size, seed, f"{key}, next step")
            checks.append(key)
            seed += 1
    real = agreement.host_readable
    agreement.host_readable = lambda t: False  # as with CUDA tensors: no free host read in combine
    try:
        for kind in DEFERRED_KINDS:
            d = build(kind, E)
            if kind == "lowlatency":
                d.transport.combine_exchanges_status = False
            bad_rank = world_size - 1
            key = f"deferred {kind} / wrong H on rank {bad_rank}"
            xs, ids, ws = good_step(world_size, seed)
            dispatched = d.dispatch(xs[rank], ids[rank], ws[rank])
            out = fake_experts(dispatched.tokens, rank)
            try:
                d.combine(out[..., :-1] if rank == bad_rank else out, dispatched)
            except ValueError as error:
                if rank != bad_rank or "expert_out must be" not in str(error):
                    failures.append(f"{key}: combine raised {error}")
            else:
                if rank == bad_rank:
                    failures.append(f"{key}: the bad rank's combine did not raise")
            seed += 1
            xs, ids, ws = good_step(world_size, seed)
            try:  # every rank learns it here, from the statuses that came with the combine
                d.dispatch(xs[rank], ids[rank], ws[rank])
            except ValueError as error:
                messages[key] = str(error)
                if f"rank {bad_rank}: expert_out must be" not in str(error) or "previous combine" not in str(error):
                    failures.append(f"{key}: unexpected message {error}")
            else:
                failures.append(f"{key}: the next dispatch of rank {rank} did not raise")
            seed += 1
            failures += check_good_step(d, rank, world_size, seed, f"{key}, next step")
            checks.append(key)
            seed += 1
    finally:
        agreement.host_readable = real
    return dict(messages=messages, failures=failures, checks=checks, longest_wait=max(waits))


@pytest.mark.ranks(lambda: (_bad_expert_out_worker,), world_size=2, deadline=400, timeout=60)
def test_a_bad_expert_out_on_one_rank_fails_every_rank_in_the_same_combine(pooled_launch):
    results = pooled_launch()
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}: {result['failures'][:6]}"
    checks = results[0]["checks"]
    assert len(checks) == len(COMBINE_KINDS) * len(BAD_EXPERT_OUT) + len(DEFERRED_KINDS)
    assert all(r["checks"] == checks for r in results) and set(results[0]["messages"]) == set(checks)
    for key in checks:  # the same error text on every rank
        texts = {r["messages"].get(key) for r in results}
        assert len(texts) == 1, (key, texts)
    # Nobody waited for a peer that had given up: every combine ended well within the timeout.
    assert max(r["longest_wait"] for r in results) < STEP_TIMEOUT / 4, results


# -- a dead or silent peer ------------------------------------------------------------------------

PEER_TIMEOUT = 3.0  # the dispatchers' timeout in the dead-peer tests
LAUNCH_TIMEOUT = 20.0


def _dead_peer_worker(rank, world_size, kind, how):
    """One good step, then the last rank dies (or stalls); the others dispatch again and
    report how their dispatch ended and how long it took."""
    E = num_experts(world_size)
    d = build(kind, E, timeout=PEER_TIMEOUT)
    assert check_good_step(d, rank, world_size, 0, kind) == []
    xs, ids, ws = good_step(world_size, 1)
    if rank == world_size - 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(PEER_TIMEOUT + 4)  # stalls: alive, but never joins the step
        os._exit(0)
    start = time.monotonic()
    try:
        d.dispatch(xs[rank], ids[rank], ws[rank])
    except PeerError as error:
        return dict(error=str(error), seconds=time.monotonic() - start)
    return dict(error=None, seconds=time.monotonic() - start)


@pytest.mark.parametrize("world_size, kind, how", [(2, "maxcounts", "kill"), (4, "alltoall", "kill"),
                                                   (2, "lowlatency", "stall"), (4, "capspill-cond", "stall")])
def test_a_dead_or_silent_peer_gives_a_bounded_error(world_size, kind, how):
    with pytest.raises(RankFailedError) as info:
        run_ranks(_dead_peer_worker, world_size, kind, how, deadline=240, timeout=LAUNCH_TIMEOUT)
    error = info.value
    dead = world_size - 1
    summary = str(error).strip().splitlines()[-1]
    assert f"rank {dead}: died without a result" in summary, summary
    assert ("killed by signal SIGKILL" if how == "kill" else "exited with code 0") in error.failures[dead]
    for rank in range(dead):
        survivor = error.results[rank]
        assert survivor is not None and survivor["error"] is not None, (rank, error.failures)
        assert f"on rank {rank} of {world_size}" in survivor["error"]
        # A dead peer's sockets close at once; a silent one is waited for up to the timeout.
        bound = PEER_TIMEOUT + 2.0
        assert survivor["seconds"] <= bound, survivor
        if how == "stall":
            assert survivor["seconds"] >= PEER_TIMEOUT - 0.5 and "timeout of 3 s" in survivor["error"], survivor
