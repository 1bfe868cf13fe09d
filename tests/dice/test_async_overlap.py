"""The overlapping path of the DICE runner on gloo ranks: the stream executor over the stale
(fixed-capacity) exchange.

* every schedule equals the single-process staleness simulator bitwise on 2 and 4 ranks
  (batch-invariant arithmetic; one rank holds no sample on 4), the step each (step, layer)
  used is the plan's table, and the rows sent to other ranks are what the simulator counts;
* between a call's issue and the use of its result nothing reads a tensor on the host:
  ``Tensor.item`` / ``tolist`` / ``cpu`` / ``numpy`` / ``__bool__`` / ``__int__`` /
  ``__float__`` raise inside that window. The same guard around the eager all-to-all
  (which reads its receive sizes once per dispatch) does raise, so the guard can fail;
* a capacity below a step's per-peer count is reported after the run, on every rank.
"""

from __future__ import annotations

import pytest
import torch

from moekit.dice import ScheduledMoE, SchedulePlan, sample
from moekit.dice.executor import StreamExecutor
from moekit.dice.schedules import ScheduleConfig
from moekit.dice.stale import StaleExchange, balanced_capacity, exchange_group
from moekit.ep import AllToAllDispatcher
from moekit.ep.capspill import CapacityOverflowError
from tests.dice.cases import (CFG_SCALE, CONFIG, STEPS, check_ranks_against_simulator, global_batch, rank_slice,
                              tiny_model)
from tests.ep.deadline import run_ranks

WORLDS = {2: [3, 1], 4: [1, 2, 0, 1]}  # samples per rank; 4 in all, one rank empty on 4
SCHEDULES = {
    "sync": ScheduleConfig("sync", warmup=0),
    "displaced": ScheduleConfig("displaced"),
    "displaced-cond2-latest": ScheduleConfig("displaced", cond_every=2, scores="latest"),
    "interweaved": ScheduleConfig("interweaved"),
    "interweaved-every2": ScheduleConfig("interweaved", sync_every=2, cooldown=1),
    "dice": ScheduleConfig("interweaved", async_layers="shallow", cond_every=2, warmup=2),
}
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


class HostReadInWindow(AssertionError):
    pass


class _Guard:
    """Makes the host reads of ``HOST_READS`` raise while any issued call is not yet waited for."""

    def __init__(self, executor: StreamExecutor):
        self.open: set[int] = set()
        executor.on_issue = lambda h: self.open.add(id(h))
        executor.on_wait = lambda h: self.open.discard(id(h))
        self.saved = {}

    def __enter__(self):
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self.saved[name] = original

            def guarded(t, *args, _name=name, _original=original, **kwargs):
                if self.open:
                    raise HostReadInWindow(f"Tensor.{_name} between the issue of an exchange and its wait")
                return _original(t, *args, **kwargs)

            setattr(torch.Tensor, name, guarded)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


def _max_rows(sizes: list[int]) -> int:
    """Rows per call of the biggest rank: guidance doubles the batch, one row per (token, slot)."""
    return max(2 * max(sizes) * CONFIG.tokens_per_image * CONFIG.top_k, 1)


def _stale(sizes, group, **kwargs) -> StaleExchange:
    shape = CONFIG.moe_shape
    return StaleExchange(shape.num_experts, _max_rows(sizes), hidden=shape.hidden, group=group, **kwargs)


def _run(model, weights, schedule, dispatcher, executor, noise, labels, guard: bool):
    runner = ScheduledMoE(weights, CONFIG.moe_shape, schedule, STEPS, dispatcher=dispatcher, executor=executor,
                          experts="rowwise", batch_invariant=True)
    steps = []
    if guard:
        with _Guard(executor):
            sample(model, noise, labels, steps=STEPS, cfg_scale=CFG_SCALE, moe=runner,
                   on_step=lambda i, z: steps.append(z.clone()))
    else:
        sample(model, noise, labels, steps=STEPS, cfg_scale=CFG_SCALE, moe=runner,
               on_step=lambda i, z: steps.append(z.clone()))
    runner.check()
    runner.close()
    return dict(traj=torch.stack(steps), stats=runner.stats())


def _worker(rank, world_size, sizes):
    torch.set_num_threads(1)
    model = tiny_model()
    weights = model.moe_weights()
    noise, labels = global_batch(sizes)
    mine = rank_slice(sizes, rank)
    group = exchange_group(device_type="cpu")  # the stale exchanges' own group
    out = {}
    for name, schedule in SCHEDULES.items():
        # Asynchronous layers on their own group, synchronous ones on the default group: both stale.
        side, main = _stale(sizes, group), _stale(sizes, None)
        plan = SchedulePlan(schedule, STEPS, CONFIG.depth)
        choose = (lambda layer, parity, plan=plan, side=side, main=main:
                  side if plan.config.layer_is_async(layer, CONFIG.depth) else main)
        out[name] = _run(model, weights, schedule, choose, StreamExecutor(), noise[mine], labels[mine], guard=True)
    # The guard fails the eager all-to-all, which reads its receive sizes on the host.
    eager = AllToAllDispatcher(CONFIG.moe_shape.num_experts, hidden=CONFIG.hidden, top_k=1)
    try:
        _run(model, weights, SCHEDULES["interweaved"], eager, StreamExecutor(), noise[mine], labels[mine], guard=True)
        out["eager_guard"] = "no host read seen"
    except HostReadInWindow as error:
        out["eager_guard"] = str(error)
    # A capacity too small for the routing: delivered rows only, and every rank raises after the run.
    tight = _stale(sizes, group, capacity=1)
    try:
        _run(model, weights, SCHEDULES["displaced"], tight, StreamExecutor(), noise[mine], labels[mine], guard=False)
        out["overflow"] = None
    except CapacityOverflowError as error:
        out["overflow"] = str(error)
    return out


@pytest.mark.parametrize("world_size", sorted(WORLDS))
def test_stream_executor_over_stale_exchange_matches_simulator(world_size):
    sizes = WORLDS[world_size]
    results, _ = run_ranks(_worker, world_size, sizes, deadline=600.0)
    model = tiny_model()
    noise, labels = global_batch(sizes)
    for name, schedule in SCHEDULES.items():
        check_ranks_against_simulator(results, name, schedule, sizes, model, noise, labels)
    for rank in range(world_size):
        assert results[rank]["eager_guard"].endswith("between the issue of an exchange and its wait"), \
            results[rank]["eager_guard"]  # its host read of the receive sizes (item, tolist or cpu)
        assert results[rank]["overflow"] is not None and "capacity=1" in results[rank]["overflow"]


def _pair_worker(rank, world_size, seed):
    """One dispatch + combine of random routing (K = 2, random weights) through the stale
    exchange and through the eager all-to-all, with the same expert function on both."""
    torch.set_num_threads(1)
    E, H, T, K = 8, 16, 5 + 3 * rank, 2
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[0, 1] = -1  # a masked slot
    w = torch.rand(T, K, generator=g)
    scale = torch.randn(E, H, generator=torch.Generator().manual_seed(seed))
    results = []
    for d in (StaleExchange(E, 16, top_k=K, hidden=H), AllToAllDispatcher(E, hidden=H, top_k=K)):
        disp = d.dispatch(x, ids, w)
        E_local = disp.tokens.shape[0]
        local = scale[rank * E_local:(rank + 1) * E_local]
        out = torch.tanh(disp.tokens * local.unsqueeze(1))
        results.append(d.combine(out, disp))
    # float64 reference on this process: sum_k w * tanh(x * scale[id])
    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            if ids[t, k] >= 0:
                ref[t] += w[t, k].double() * torch.tanh(x[t] * scale[ids[t, k]]).double()
    return dict(stale=results[0], eager=results[1], ref=ref)


@pytest.mark.parametrize("world_size", [2, 4])
def test_stale_exchange_equals_eager_alltoall(world_size):
    results, _ = run_ranks(_pair_worker, world_size, 3)
    for r in results:
        assert torch.equal(r["stale"], r["eager"])
        torch.testing.assert_close(r["stale"].double(), r["ref"], rtol=1e-5, atol=1e-6)


def test_balanced_capacity():
    assert balanced_capacity(100, 4, None) == 100
    assert balanced_capacity(100, 4, 1.0) == 25
    assert balanced_capacity(100, 4, 1.5) == 38
    assert balanced_capacity(100, 4, 10.0) == 100
    assert balanced_capacity(3, 4, 0.1) == 1
    for bad in (0, -1.0, float("nan"), "2"):
        with pytest.raises(ValueError, match="capacity_factor"):
            balanced_capacity(100, 4, bad)


# ------------------------------------------------------------------ the graphs' step state


def _closed_cycle_run(model, runner, noise, labels, steps):
    """The sampler with the cycle closed as a captured cycle closes it, but eagerly: at the
    end of the cycle the state it leaves is copied into the tensors it found, and the
    runner goes on from those (step numbers moved on). Any step state the copy misses
    changes the result."""
    from moekit.dice.graphs import GraphedSampler, _closing_copies, find_cycle, state_skeleton, state_tensors

    start, period = find_cycle(runner.plan)
    body = GraphedSampler(model, runner, steps=steps, cfg_scale=CFG_SCALE)
    z, t = noise.clone(), torch.empty(noise.shape[0], dtype=noise.dtype)
    trajectory, closed = [], 0
    for i in range(steps):
        if i == start:
            before = runner.state()
            before_tensors = state_tensors(before)
        t.fill_((steps - i) / steps)
        body._step(i, z, t, labels)
        if i == start + period - 1:
            after = runner.state()
            assert state_skeleton(after, i + 1) == state_skeleton(before, start)
            copies = _closing_copies(before_tensors, state_tensors(after))
            assert not isinstance(copies, str), copies
            for dst, src in copies:
                dst.copy_(src)
            closed = len(copies)
            runner.set_state(before, shift=period)
        trajectory.append(z.clone())
    return torch.stack(trajectory), (start, period, closed)


GRAPH_STEPS = 14


@pytest.mark.parametrize("name", ["sync", "displaced", "displaced-cond2-latest", "interweaved", "dice"])
def test_closing_a_cycle_on_the_state_it_found_changes_nothing(name):
    from moekit.dice.schedules import preset

    schedule = preset("dice", GRAPH_STEPS) if name == "dice" else SCHEDULES[name]
    model = tiny_model()
    weights = model.moe_weights()
    noise, labels = global_batch([2])

    def runner():
        d = StaleExchange(CONFIG.moe_shape.num_experts, _max_rows([2]), hidden=CONFIG.hidden)
        return ScheduledMoE(weights, CONFIG.moe_shape, schedule, GRAPH_STEPS, dispatcher=d,
                            executor=StreamExecutor(), experts="rowwise", batch_invariant=True)

    plain = []
    sample(model, noise, labels, steps=GRAPH_STEPS, cfg_scale=CFG_SCALE, moe=runner(),
           on_step=lambda i, z: plain.append(z.clone()))
    closed, (start, period, copies) = _closed_cycle_run(model, runner(), noise, labels, GRAPH_STEPS)
    assert torch.equal(closed, torch.stack(plain))
    assert start + 2 * period <= GRAPH_STEPS
    if name != "sync":  # an asynchronous schedule carries state over the boundary: the copy is not vacuous
        assert copies > 0
    if name == "dice":
        assert period == 2  # conditional communication every 2 steps


def test_find_cycle_of_the_presets():
    from moekit.dice.graphs import find_cycle, step_signature
    from moekit.dice.schedules import preset

    for name in ("sync", "displaced", "interweaved", "dice", "dice+sync", "interweaved+cond"):
        plan = SchedulePlan(preset(name, 20), 20, 4)
        start, period = find_cycle(plan)
        sig = [step_signature(plan, t) for t in range(20)]
        for j in range(-period, period):
            assert sig[start + j] == sig[start + j + period]
        # the first such start: no earlier one works with any period up to 4
        for s in range(1, start):
            for p in range(1, 5):
                if s - p >= 0 and s + 2 * p <= 20:
                    assert not all(sig[s + j] == sig[s + j + p] for j in range(-p, p)), (name, s, p)
    # a run too short to repeat has no cycle
    assert find_cycle(SchedulePlan(preset("dice", 3), 3, 4)) is None


# ------------------------------------------------------------------ the figures and the goals


def test_hidden_share_counts_only_compute_on_the_compute_stream():
    """Side-stream packing kernels beside a transfer hide nothing; model kernels on the compute
    stream do; a transfer on the compute stream itself is exposed."""
    from moekit.dice.overlap import trace_overlap

    def kernel(name, ts, dur, stream):
        return dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur, tid=stream, args=dict(stream=stream))

    compute, side, nccl = 7, 20, 30
    events = [
        kernel("gemm", 0, 100, compute), kernel("gemm", 150, 100, compute),  # the model: 200 us
        kernel("ncclDevKernel_SendRecv", 50, 100, nccl),  # 50 us beside the first gemm, 50 beside nothing
        kernel("index_select", 100, 40, side),  # packing on the side stream: not compute
        kernel("ncclDevKernel_SendRecv", 300, 20, compute),  # a synchronous layer's: exposed
    ]
    out = trace_overlap(events)
    assert out["compute_stream"] == compute
    assert out["transfer_ms"] == pytest.approx(0.120)
    assert out["overlap_ms"] == pytest.approx(0.050)
    assert out["overlap_fraction"] == pytest.approx(50 / 120)
    assert out["by_stream"][str(nccl)]["overlap_fraction"] == pytest.approx(0.5)
    assert out["by_stream"][str(compute)]["overlap_fraction"] == 0.0


def _row(model, batch, dispatcher, schedule, ms, gib=1.0):
    return dict(model=model, batch=batch, dispatcher=dispatcher, schedule=schedule, median_ms=ms, peak_gib=gib)


def test_best_dispatcher_and_goals():
    from moekit.dice.verdicts import best_rows, format_verdict, verdicts

    rows = [_row("xl", 8, "alltoall", "sync", 160.0), _row("xl", 8, "lowlatency", "sync", 100.0),
            _row("xl", 8, "alltoall", "dice", 150.0), _row("xl", 8, "stale", "dice", 80.0, 2.5),
            _row("xl", 32, "alltoall", "sync", 300.0), _row("xl", 32, "stale", "dice", 260.0),
            _row("xl", 4, "alltoall", "sync", 100.0), _row("xl", 4, "stale", "dice", 50.0),
            dict(model="xl", batch=32, dispatcher="lowlatency", schedule="sync", skipped="memory")]
    best = {(b["model"], b["batch"]): b for b in best_rows(rows, ("sync", "dice"))}
    assert best[("xl", 8)]["sync on"] == "lowlatency" and best[("xl", 8)]["dice on"] == "stale"
    assert best[("xl", 8)]["dice x"] == pytest.approx(100.0 / 80.0)
    assert best[("xl", 8)]["dice GiB"] == 2.5
    trace = dict(schedule="dice", dispatcher="stale", overlap=dict(overlap_fraction=0.7, transfer_ms=10.0,
                                                                   overlap_ms=7.0))
    results = dict(rows=rows, traces=[dict(trace, rank=0), dict(trace, rank=1, overlap=dict(
        overlap_fraction=0.4, transfer_ms=10.0, overlap_ms=4.0))])
    speed, overlap = verdicts(results, 4)
    assert speed["met"] is False  # batch 32: 300 / 260 = 1.15 < 1.2 (batch 4 is outside the goal's range)
    assert "xl b32: 1.15x" in speed["detail"] and "b4" not in speed["detail"]
    assert overlap["met"] is False and "55.0%" in overlap["detail"]  # the mean of the ranks: 0.55 < 0.6
    rows[5] = _row("xl", 32, "stale", "dice", 240.0)
    results["traces"][1]["overlap"]["overlap_fraction"] = 0.6
    speed, overlap = verdicts(results, 4)
    assert speed["met"] is True and overlap["met"] is True
    speed, _ = verdicts(results, 2)
    assert speed["met"] is None and "not measured" in format_verdict(speed)
    assert verdicts(dict(rows=rows, traces=[]), 4)[1]["met"] is None


def test_goals_over_several_records(tmp_path):
    import json

    from moekit.dice.verdicts import combined

    def record(name, world, rows, traces=()):
        path = tmp_path / name
        path.write_text(json.dumps(dict(params=dict(world_size=world), results=dict(rows=rows, traces=list(traces)))))
        return path

    a = record("a.json", 4, [_row("xl", 8, "lowlatency", "sync", 100.0), _row("xl", 8, "stale-graph", "dice", 80.0)])
    b = record("b.json", 4, [_row("g", 32, "alltoall", "sync", 400.0), _row("g", 32, "stale-graph", "dice", 350.0)])
    speed, overlap = combined([a, b])
    assert speed["met"] is False and "xl b8: 1.25x" in speed["detail"] and "g b32: 1.14x" in speed["detail"]
    assert overlap["met"] is None
    with pytest.raises(ValueError, match="one world size"):
        combined([a, record("c.json", 2, [])])
