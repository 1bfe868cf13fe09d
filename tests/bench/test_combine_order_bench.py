"""`moekit bench combine-order`: the distance of both combine orders from float64 (CPU, small)."""

from __future__ import annotations

import torch

from moekit.bench.combine_order import order_distance, rounding_unit
from moekit.bench.report import load_record
from moekit.cli import main as cli_main


def test_one_rank_makes_the_orders_equal():
    r = order_distance("qwen3-30b-a3b", 1, 16, torch.bfloat16)
    assert r["tokens_on_one_rank"] == 1.0 and r["differ"] == 0.0 and r["slot"] == r["rank"]


def test_distances_on_8_ranks():
    r = order_distance("qwen3-30b-a3b", 8, 32, torch.bfloat16, seed=1)
    assert rounding_unit(torch.bfloat16) == 2 ** -8 and rounding_unit(torch.float16) == 2 ** -11
    assert r["differ"] > 0 and r["tokens_on_one_rank"] < 1
    # the slot order rounds once: within one u of the row's largest value (plus float32 noise)
    assert 0 < r["slot"]["max_in_u"] <= 1.01
    # the rank order rounds once more per rank: larger, still a few u
    assert r["rank"]["rel_norm"] > r["slot"]["rel_norm"] and r["rank"]["max_in_u"] < 8


def test_cli_record(tmp_path, capsys):
    assert cli_main(["bench", "combine-order", "--shapes", "qwen3-30b-a3b", "--world-sizes", "2", "--tokens", "8",
                     "--dtypes", "float16", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b" in out and "float16" in out and "record:" in out
    rows = load_record(next(tmp_path.glob("*.json")))["results"]["rows"]
    assert len(rows) == 1 and rows[0]["world_size"] == 2 and rows[0]["dtype"] == "float16"
    assert cli_main(["bench", "combine-order", "--world-sizes", "3", "--no-record"]) == 2
    assert "world_size=3 must divide num_experts" in capsys.readouterr().err
