"""`moekit bench dispatch` times the bare all-to-all of the same bytes (the floor) and reports
ours against it, on 2 CPU ranks (gloo) at tiny sizes."""

from __future__ import annotations

import pytest

from moekit.bench.dispatch import DEEPEP_NORMAL_GBPS, DispatchBenchConfig, format_dispatch_bench, run_dispatch_bench


def test_floor_in_record_and_report():
    cfg = DispatchBenchConfig(shape="deepseek-v3", tokens_per_rank=4, world_size=2, hidden=32, top_k=4,
                              num_experts=8, iters=4, warmup=1, pool=2, combine_order="both")
    record = run_dispatch_bench(cfg, out_dir=None)
    r = record["results"]
    for order in ("", " [rank]"):
        floor = r["nccl_floor" + order]
        for phase in ("dispatch", "combine"):
            assert floor[phase]["n"] == 4 and 0 < floor[phase]["min"] <= floor[phase]["median"]
        assert floor["n"] == 4 and floor["median"] > 0
        ours = r["dispatch+combine" + order]["median"]
        assert r["vs_floor" + order] == pytest.approx(ours / floor["median"])
        sent = r["rows_sent_per_rank_mean"] * 32 * 4 + r["combine_bytes_per_rank_mean" + order]
        assert floor["bytes_per_rank"] == pytest.approx(sent)
        assert r["gbps_per_rank" + order] == pytest.approx(sent / ours / 1e3)
    # the rank order sends fewer rows back, so its floor moves fewer bytes
    assert r["nccl_floor [rank]"]["bytes_per_rank"] < r["nccl_floor"]["bytes_per_rank"]
    assert r["deepep_normal_gbps_reference"] == DEEPEP_NORMAL_GBPS
    text = format_dispatch_bench(record)
    assert "x the floor" in text and "bare all-to-all dispatch+combine [rank]" in text and "DeepEP" in text
