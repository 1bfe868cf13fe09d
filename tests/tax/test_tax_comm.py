import numpy as np
import pytest

from moekit.shapes import get_shape
from moekit.tax.comm import (
    allreduce_time,
    alltoall_time,
    api_volume_ratio,
    network_volume_ratio,
    network_volumes,
    token_sources,
    traffic,
)
from moekit.tax.hardware import PRESETS
from moekit.tax.placement import Placement
from moekit.tax.topk import sample_routing


def test_network_volume_ratio_for_deepseek_v3_on_8_gpus():
    k = get_shape("deepseek-v3").top_k
    assert api_volume_ratio(k) == 8
    assert network_volume_ratio(k, 8) == pytest.approx(64 / 14)
    assert round(network_volume_ratio(k, 8), 1) == 4.6  # the paper's number


def test_network_volumes_both_readings():
    h, k, n = 7168, 8, 8
    seed_reading = network_volumes(100, h, k, n)
    assert seed_reading["api_ratio"] == pytest.approx(k)
    assert seed_reading["network_ratio"] == pytest.approx(network_volume_ratio(k, n))
    assert seed_reading["allreduce_network"] == pytest.approx(100 * h * 2 * 1.75)
    local_discount = network_volumes(100, h, k, n, exclude_local=True)
    assert local_discount["network_ratio"] == pytest.approx(k / 2)
    with pytest.raises(ValueError):
        network_volume_ratio(8, 1)


def brute_traffic(ids, placement):
    n = placement.n_gpus
    s, t, k = ids.shape
    gpu_of = {int(x): g for g in range(n) for x in placement.slots[g]}
    src = token_sources(t, n)
    sent = np.zeros((s, n), int)
    recv = np.zeros((s, n), int)
    for b in range(s):
        for i in range(t):
            for j in range(k):
                x = ids[b, i, j]
                if x < 0:
                    continue
                d = gpu_of[int(x)]
                if d != src[i]:
                    sent[b, src[i]] += 1
                    recv[b, d] += 1
    return sent, recv


def test_traffic_matches_a_loop():
    rng = np.random.default_rng(0)
    ids = sample_routing(37, 16, 4, samples=3, seed=5)
    ids = np.where(rng.random(ids.shape) < 0.1, -1, ids)
    placement = Placement(rng.permutation(16).reshape(4, 4), 16)
    sent, recv = traffic(ids, placement)
    bs, br = brute_traffic(ids, placement)
    np.testing.assert_array_equal(sent, bs)
    np.testing.assert_array_equal(recv, br)
    assert sent.sum() == recv.sum() > 0


def test_token_sources_are_contiguous_and_balanced():
    src = token_sources(10, 4)
    assert src.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]


def test_collective_times():
    hw = PRESETS["H200"]
    g = 7168 * 2 / hw.net_bw
    t = alltoall_time([10, 0], [3, 20], g, hw, 8)
    np.testing.assert_allclose(t, [7 * hw.net_latency + 10 * g, 7 * hw.net_latency + 20 * g])
    ar = allreduce_time(64, 4096, 2, hw, 8)
    assert ar == pytest.approx(14 * hw.net_latency + 1.75 * 64 * 4096 * 2 / hw.net_bw)
    assert allreduce_time(64, 4096, 2, hw, 1) == 0.0
