"""trace_report on synthetic traces, against plain loops over the trace (independent of moekit.ep / tax)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moekit.cli import main
from moekit.integrations.trace_report import balancer_table, capspill_table, layer_table, trace_report
from moekit.routing import RoutingTrace, mixtral_capspill_trace, synthetic_routing


def _skewed_trace(steps=12, layers=3, tokens=64, experts=16, top_k=4) -> RoutingTrace:
    ids = np.stack([np.stack([synthetic_routing(tokens, experts, top_k, zipf=0.3 + 0.4 * layer,
                                                seed=100 * s + layer, weights=False)[0].numpy()
                              for layer in range(layers)]) for s in range(steps)])
    return RoutingTrace(topk_ids=ids, num_experts=experts, name="skewed")


def _peer_counts_by_loops(trace: RoutingTrace, P: int) -> np.ndarray:
    S, L, T, K = trace.topk_ids.shape
    per_rank, e_local = T // P, trace.num_experts // P
    c = np.zeros((S, L, P, P), dtype=np.int64)
    for s in range(S):
        for layer in range(L):
            for t in range(T):
                for k in range(K):
                    e = trace.topk_ids[s, layer, t, k]
                    if e >= 0:
                        c[s, layer, t // per_rank, e // e_local] += 1
    return c


def test_layer_table_matches_direct_counts():
    trace = _skewed_trace()
    rows = layer_table(trace, 4)
    for layer, row in enumerate(rows):
        betas, active = [], []
        for s in range(trace.num_steps):
            load = np.bincount(trace.topk_ids[s, layer].ravel(), minlength=16).astype(float)
            p = load[load > 0] / load.sum()
            betas.append(-(p * np.log(p)).sum() / math.log(16))
            active.append((load > 0).mean())
        assert row["beta"] == pytest.approx(np.mean(betas)) and row["beta_min"] == pytest.approx(min(betas))
        assert row["active_share"] == pytest.approx(np.mean(active))
        assert row["peer_count_mean"] == pytest.approx(64 * 4 / 16)
    assert rows[0]["beta"] > rows[-1]["beta"]  # the layers were drawn with rising skew


def test_capspill_table_matches_loops():
    trace = mixtral_capspill_trace(steps=40, layers=2, seed=3)
    c = _peer_counts_by_loops(trace, 8)
    rows = {r["quantile"]: r for r in capspill_table(trace, 8)}
    for q, label in ((0.9, "Q90"), (0.99, "Q99"), (1.0, "Q100")):
        r = rows[label]
        C = int(math.ceil(np.quantile(c, q)))
        assert r["capacity"] == C and r["spill_capacity"] == 43 * 2 - C
        sends = [(c[s, layer, i] > C).any() for s in range(40) for layer in range(2) for i in range(8)]
        assert r["overflow_send_pct"] == pytest.approx(100 * np.mean(sends))
        spilled = np.maximum(c - C, 0)
        assert r["spill_pair_pct"] == pytest.approx(100 * spilled.sum() / c.sum())
        per_send = spilled.sum(-1)
        expected = per_send[per_send > 0].mean() if (per_send > 0).any() else 0.0
        assert r["spilled_per_overflowing_send"] == pytest.approx(expected)
    assert rows["Q100"]["overflow_send_pct"] == 0 and rows["Q90"]["overflow_send_pct"] > 10


def test_balancer_table_rows():
    trace = _skewed_trace(steps=16, tokens=256)
    table = balancer_table(trace, num_gpus=4, block_size=16)
    assert table["slots_per_gpu"] == 5 and table["fit_steps"] == 8 and table["eval_steps"] == 8
    rows = {r["balancer"]: r for r in table["rows"]}
    assert set(rows) == {"contiguous", "eplb-global", "eplb+block-split", "padding-aware"}
    for r in rows.values():
        assert r["layers"] == 3 and r["straggler"] >= 1.0 and r["padded_straggler"] >= 1.0
    # replicas spread the skewed load: EPLB's raw-token straggler beats one expert per slot
    assert rows["eplb-global"]["straggler"] < rows["contiguous"]["straggler"]
    with pytest.raises(ValueError, match="num_gpus must divide num_experts=16"):
        balancer_table(trace, num_gpus=3)


def test_report_checks_and_cli(tmp_path, capsys):
    trace = _skewed_trace()
    with pytest.raises(ValueError, match="world_size=3 must divide"):
        trace_report(trace, 3)
    path = tmp_path / "t.npz"
    trace.save(path)
    assert main(["trace", "report", str(path), "--world-size", "4", "--json"]) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    assert [r["layer"] for r in report["layers"]] == [0, 1, 2] and len(report["capspill"]) == 6
    assert main(["trace", "report", str(path), "--world-size", "3"]) == 2
    assert "must divide" in capsys.readouterr().err


def test_one_step_trace_skips_the_balancers():
    trace = _skewed_trace(steps=1)
    report = trace_report(trace, 4)
    assert report["balancers"] is None and len(report["capspill"]) == 6
    from moekit.integrations.trace_report import format_report

    assert "Balancers: not compared" in format_report(report)
