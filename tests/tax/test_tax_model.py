import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from moekit.shapes import MoEShape, get_shape
from moekit.tax.hardware import PRESETS, Hardware
from moekit.tax.model import PARALLELISMS, TaxModel, compare, format_compare, unit_costs

H200 = PRESETS["H200"]
# Knobs that switch off everything but the expert GEMMs, to test the paper's limits.
BARE = dict(f=1.0, anc_kernels=0, kernel_latency=0.0, padding="none")


def hw(**kw):
    base = dict(name="test", hbm_bw=4e12, peak_flops=800e12, net_bw=1e30, net_latency=0.0)
    base.update(kw)
    return Hardware(**base)


def test_unit_costs_by_hand():
    shape = get_shape("mixtral-8x7b")
    c = unit_costs(shape, H200)
    w_e = 3 * 4096 * 14336 * 2
    assert c.expert_bytes == w_e
    assert c.alpha == pytest.approx(w_e / 4.3e12)
    assert c.alpha_act == pytest.approx((2 * 4096 + 6 * 14336) * 2 / 4.3e12)
    assert c.beta == pytest.approx(6 * 4096 * 14336 / 790e12)
    assert c.gamma_dispatch == pytest.approx(4096 * 2 / 372e9)
    assert c.k_shared == 0
    assert unit_costs(get_shape("qwen2-moe"), H200).k_shared == 8
    assert unit_costs(get_shape("qwen2-moe"), H200, include_shared=False).k_shared == 0


def test_memory_bound_limit_is_e_active_over_k():
    # Infinite FLOP/s: everything is memory-bound. Eq. 4 / eq. 2 reduce to
    # (alpha*E_active + alpha_act*mK) / (alpha*K + alpha_act*mK) -> E/K once saturated.
    shape = get_shape("mixtral-8x7b")
    tm = TaxModel(shape, hw(peak_flops=1e30), 8, **BARE)
    c = tm.costs
    for m in (1, 4, 64):
        p = tm.point(m, "decode", "TP+TP")
        e_act = 8 * (1 - (1 - 2 / 8) ** m)
        moe = (c.alpha * e_act + c.alpha_act * m * 2) / 8 + tm.ancillary(m)  # T_anc: HBM traffic only
        dense = (c.alpha * 2 + c.alpha_act * m * 2) / 8
        assert p.regime == "memory-bound"
        assert p.tau == pytest.approx(moe / dense, rel=1e-9)
        assert p.compute_ratio == pytest.approx((moe - tm.ancillary(m)) / dense, rel=1e-9)
    # Saturated (E_active ~ E) while activation I/O is still small next to weights.
    assert tm.point(24, "decode", "TP+TP").tau == pytest.approx(8 / 2, rel=0.02)
    assert tm.point(1, "decode", "TP+TP").tau == pytest.approx(1.0, rel=1e-3)  # E_active = K
    assert tm.point(64, "decode", "TP+TP").regime_ratio == pytest.approx(4.0, rel=1e-6)


def test_compute_bound_limit_is_eta():
    # Infinite bandwidth: compute-bound; T_MoE,c / T_FFN,c = eta, the padding overhead.
    shape = get_shape("qwen2-moe").scaled(num_shared_experts=0, shared_intermediate=0)
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.permutation(64)[:8] for _ in range(300)]) for _ in range(4)])
    tm = TaxModel(shape, hw(hbm_bw=1e30), 8, block_size=64, f=1.0, anc_kernels=0, kernel_latency=0.0)
    p = tm.point(300, "prefill", "TP+TP", routing=ids)
    etas = []
    for batch in ids:  # padding by hand
        counts = np.bincount(batch.ravel(), minlength=64)
        etas.append(sum(math.ceil(n / 64) * 64 for n in counts) / (300 * 8))
    assert p.regime == "compute-bound"
    assert p.tau == pytest.approx(np.mean(etas), rel=1e-9)
    assert p.eta == pytest.approx(np.mean(etas), rel=1e-9)
    assert p.tau > 1.0


def test_transition_regime_ratio():
    # MoE memory-bound, DenseFA compute-bound: ratio ~ alpha*E_active / (beta*m*K).
    shape = get_shape("mixtral-8x7b")
    tm = TaxModel(shape, H200, 8, **BARE)
    p = tm.point(256, "prefill", "TP+TP")
    c = tm.costs
    assert p.regime == "transition"
    e_act = 8 * (1 - 0.75**256)
    mk = 256 * 2
    assert p.compute_ratio == pytest.approx((c.alpha * e_act + c.alpha_act * mk) / (c.beta * mk), rel=1e-9)
    assert p.regime_ratio == pytest.approx(c.alpha * e_act / (c.beta * mk), rel=1e-9)


def test_regimes_in_order_along_batch_size():
    tm = TaxModel("mixtral-8x7b", H200, 8)
    regimes = [tm.point(m, "decode", "TP+TP").regime for m in (1, 16, 256, 512, 4096)]
    assert regimes[0] == "memory-bound" and regimes[-1] == "compute-bound"
    order = ["memory-bound", "transition", "compute-bound"]
    assert [order.index(r) for r in regimes] == sorted(order.index(r) for r in regimes)


def test_eq3_with_a_given_f():
    tm_bare = TaxModel("mixtral-8x7b", H200, 8, f=1.0)
    tm = TaxModel("mixtral-8x7b", H200, 8, f=0.6)
    for m in (1, 32, 1024):
        ratio = tm_bare.point(m, "decode", "TP+TP").tau  # T_MoE / T_FFN
        assert tm.point(m, "decode", "TP+TP").tau == pytest.approx(1 + (ratio - 1) * 0.6, rel=1e-9)


def test_seed_validation_setup_gives_bell_and_decrease():
    # Section 5.3: A100, constant eta (1.05 decode, 1.25 prefill), uniform E_active.
    tm = TaxModel("mixtral-8x7b", "A100", 8, eta={"decode": 1.05, "prefill": 1.25})
    ms = [1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    decode = [tm.point(m, "decode", "TP+TP").tau for m in ms]
    peak = int(np.argmax(decode))
    assert 0 < peak < len(ms) - 1  # a bell: rises, peaks at a medium batch, falls
    assert decode[0] < 1.3 and max(decode) > 1.8
    prefill = [tm.point(m, "prefill", "TP+TP").tau for m in ms[-4:]]
    assert all(a > b for a, b in zip(prefill, prefill[1:]))  # prefill tax decreases
    assert tm.point(4096, "prefill", "TP+TP").eta == 1.25


def test_sources_sum_to_tau_minus_one():
    for name in ("mixtral-8x7b", "qwen2-moe"):
        tm = TaxModel(name, H200, 8, trials=16)
        for par in PARALLELISMS:
            for m in (1, 64, 2048):
                p = tm.point(m, "decode", par)
                assert sum(p.sources.values()) == pytest.approx(p.tau - 1, abs=1e-9)
                assert p.dominant in p.sources
                assert p.regime in ("memory-bound", "transition", "compute-bound")


def _tiny():
    shape = MoEShape("tiny", num_experts=4, top_k=2, hidden=64, intermediate=128)
    ids = np.array([[[0, 1], [0, 2], [0, 3], [1, 0], [3, 2], [0, -1]]])  # 6 tokens, one masked slot
    return shape, ids


def _roof(c, weights, rows):
    return max(c.alpha * weights + c.alpha_act * rows, c.beta * rows)


def test_tp_ep_block_time_by_hand():
    shape, ids = _tiny()
    tm = TaxModel(shape, H200, 2, block_size=4, anc_kernels=0, kernel_latency=0.0)
    p = tm.point(6, "prefill", "TP+EP", routing=ids)
    c = tm.costs
    counts = [0, 0, 0, 0]
    for x in ids.ravel():
        if x >= 0:
            counts[x] += 1
    times = []
    for g in range(2):  # experts 2g, 2g+1
        mine = counts[2 * g: 2 * g + 2]
        active = sum(1 for n in mine if n)
        padded = sum(math.ceil(n / 4) * 4 for n in mine)
        times.append(_roof(c, active, padded))
    expected = max(times) + tm.ancillary(6) + tm.allreduce(6)
    assert p.t_moe == pytest.approx(expected, rel=1e-12)
    assert p.straggler == pytest.approx(max(sum(counts[:2]), sum(counts[2:])) / (11 / 2))


def test_dp_ep_block_time_by_hand():
    shape, ids = _tiny()
    tm = TaxModel(shape, H200, 2, block_size=4, anc_kernels=1, kernel_latency=1e-6)
    p = tm.point(6, "decode", "DP+EP", routing=ids)
    c = tm.costs
    gpu_of = [0, 0, 1, 1]
    src = [0, 0, 0, 1, 1, 1]  # 3 tokens per DP rank
    counts = [0] * 4
    sent = [0, 0]
    recv = [0, 0]
    for t, row in enumerate(ids[0]):
        for x in row:
            if x < 0:
                continue
            counts[x] += 1
            if gpu_of[x] != src[t]:
                sent[src[t]] += 1
                recv[gpu_of[x]] += 1
    totals = []
    for g in range(2):
        mine = counts[2 * g: 2 * g + 2]
        t_c = _roof(c, sum(1 for n in mine if n), sum(math.ceil(n / 4) * 4 for n in mine))
        lat = H200.net_latency  # n - 1 = 1 peer message per phase
        d = lat + c.gamma_dispatch * max(sent[g], recv[g])
        k = lat + c.gamma_combine * max(recv[g], sent[g])
        totals.append(d + t_c + k)
    expected = max(totals) + tm.ancillary(3)
    assert p.t_moe == pytest.approx(expected, rel=1e-12)
    # Eq. 6: DP attention beside the MoE, TP attention beside DenseFA.
    assert p.t_other_moe == pytest.approx(tm.attention_time(3, "decode", 1))
    assert p.tau == pytest.approx((p.t_other_moe + p.t_moe) / (p.t_other_dense + p.t_dense))


def test_trace_objects_and_rebatching():
    rng = np.random.default_rng(0)
    topk = np.stack([[rng.permutation(8)[:2] for _ in range(64)] for _ in range(4)]).reshape(2, 2, 64, 2)
    trace = SimpleNamespace(topk_ids=topk, num_experts=8)
    tm = TaxModel("mixtral-8x7b", H200, 8)
    p = tm.point(32, "decode", "TP+EP", routing=trace)  # 256 tokens -> 8 batches of 32
    assert p.m == 32 and 1 <= p.straggler
    with pytest.raises(ValueError, match="fewer than one batch"):
        tm.point(512, "decode", "TP+EP", routing=trace)


def test_skewed_routing_lowers_decode_tax():
    # Seed 4.3: concentrating tokens on fewer experts helps memory-bound decode.
    rng = np.random.default_rng(1)
    tm = TaxModel("qwen2-moe", H200, 8)
    p = 1.0 / np.arange(1, 65) ** 1.5
    keys = np.log(p / p.sum()) - np.log(-np.log(rng.random((32 * 16, 64))))
    skewed = np.argsort(-keys, axis=1)[:, :8].reshape(16, 32, 8)
    uniform = np.stack([np.stack([rng.permutation(64)[:8] for _ in range(32)]) for _ in range(16)])
    t_skew = tm.point(32, "decode", "TP+TP", routing=skewed)
    t_unif = tm.point(32, "decode", "TP+TP", routing=uniform)
    assert t_skew.e_active < t_unif.e_active
    assert t_skew.tau < t_unif.tau


def test_bad_arguments():
    tm = TaxModel("mixtral-8x7b", H200, 8)
    with pytest.raises(ValueError, match="phase"):
        tm.point(8, "training")
    with pytest.raises(ValueError, match="parallelism"):
        tm.point(8, "decode", "PP")
    with pytest.raises(ValueError, match="m must be"):
        tm.point(0)
    with pytest.raises(ValueError, match="divide"):
        TaxModel("mixtral-8x7b", H200, 3).point(8, "decode", "TP+EP")
    with pytest.raises(ValueError, match="unknown shape"):
        TaxModel("gpt-5", H200)


def test_compare_against_measurements(tmp_path):
    tm = TaxModel("mixtral-8x7b", H200, 8)
    pts = tm.sweep([16, 256], phases=("decode",), parallelisms=("TP+TP",))
    p16 = pts[0]
    measured = [
        {"phase": "decode", "parallelism": "TP+TP", "m": 16, "tau": p16.tau * 1.25, "t_moe": p16.t_moe / 2},
        {"phase": "decode", "parallelism": "DP+EP", "m": 16, "tau": 2.0},
    ]
    rows = compare(pts, measured)
    assert [r["quantity"] for r in rows] == ["tau", "t_moe", "tau"]
    assert rows[0]["rel_error"] == pytest.approx(1 / 1.25 - 1)
    assert rows[1]["rel_error"] == pytest.approx(1.0)
    assert rows[2]["predicted"] is None and rows[2]["rel_error"] is None
    assert "TP+TP" in format_compare(rows)
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"points": measured}))
    assert compare(pts, path) == rows
    bad = tmp_path / "broken.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="broken.json"):
        compare(pts, bad)
    with pytest.raises(ValueError, match="measured\\[0\\]"):
        compare(pts, [{"tau": 1.0}])
