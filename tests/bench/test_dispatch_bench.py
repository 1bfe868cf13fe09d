"""`moekit bench dispatch` on 2 CPU ranks (tiny sizes): the record holds environment, parameters, summaries."""

from __future__ import annotations

from moekit.bench.dispatch import DispatchBenchConfig, format_dispatch_bench, run_dispatch_bench
from moekit.bench.report import load_record


def test_dispatch_bench_record(tmp_path):
    cfg = DispatchBenchConfig(shape="deepseek-v3", tokens_per_rank=8, world_size=2, hidden=64,
                              iters=20, warmup=2, pool=3)
    record = run_dispatch_bench(cfg, out_dir=str(tmp_path))
    saved = load_record(record["path"])
    for key in ("dispatch", "combine", "dispatch+combine"):
        summary = saved["results"][key]
        assert summary["n"] == 20
        assert 0 < summary["min"] <= summary["median"] <= summary["p99"] <= summary["max"]
    # 8 tokens x top-8 per rank, every pair a row: 64 rows of 64 float32.
    assert saved["results"]["rows_sent_per_rank_mean"] == 64
    assert saved["results"]["bytes_sent_per_rank_mean"] == 64 * 64 * 4
    env = saved["environment"]
    assert env["torch"] and env["device"] and "git_commit" in env
    assert "dispatch+combine" in format_dispatch_bench(record)


def test_device_defaults_and_bad_config():
    import pytest

    from moekit.bench.dispatch import CPU_DEFAULTS, GPU_DEFAULTS

    assert DispatchBenchConfig().for_device(True).iters == GPU_DEFAULTS["iters"] == 1000
    assert DispatchBenchConfig(warmup=7).for_device(False) == DispatchBenchConfig(iters=CPU_DEFAULTS["iters"], warmup=7)
    for kwargs, name in (({"tokens_per_rank": -3}, "tokens_per_rank"), ({"iters": 0}, "iters"),
                         ({"world_size": 0}, "world_size")):
        with pytest.raises(ValueError, match=f"{name} must be an int >= "):
            run_dispatch_bench(DispatchBenchConfig(**kwargs), out_dir=None)


def test_both_combine_orders_in_one_run(tmp_path):
    """--combine-order both: both orders timed, and the rows each combine returns: one per
    (token, slot) in the slot order, one per (token, rank) in the rank order, counted here
    from the benchmark's own routing pool."""
    import pytest

    from moekit.routing import synthetic_routing

    cfg = DispatchBenchConfig(shape="deepseek-v3", tokens_per_rank=4, world_size=2, hidden=32, top_k=4,
                              num_experts=8, iters=3, warmup=1, pool=3, combine_order="both")
    record = run_dispatch_bench(cfg, out_dir=str(tmp_path))
    r = load_record(record["path"])["results"]
    for key in ("dispatch", "combine", "dispatch+combine", "dispatch [rank]", "combine [rank]",
                "dispatch+combine [rank]"):
        assert r[key]["n"] == 3
    groups = []
    for i in range(cfg.pool):
        ids, _ = synthetic_routing(2 * 4, 8, 4, beta=1.0, seed=i)
        owner = ids // 4  # 4 experts per rank
        groups.append(sum(int((owner == d).any(1).sum()) for d in range(2)) / 2)  # per rank
    assert r["combine_rows_per_rank_mean"] == 4 * 4  # every (token, slot)
    assert r["combine_rows_per_rank_mean [rank]"] == sum(groups) / len(groups)
    assert r["combine_bytes_per_rank_mean [rank]"] == r["combine_rows_per_rank_mean [rank]"] * 32 * 4
    text = format_dispatch_bench(record)
    assert "combine, rank order:" in text and "dispatch+combine [rank]" in text
    with pytest.raises(ValueError, match="combine_order must be one of"):
        run_dispatch_bench(DispatchBenchConfig(combine_order="tokens"), out_dir=None)
