"""`moekit lm serve-bench`'s pieces on one CPU process: the units it plans, the ratio to the best
transformers option, and one rank's run writing its record (the multi-rank path is the same code
with the collectives: tests/integrations/test_expert_parallel_lm.py serves the model on gloo ranks)."""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from moekit.integrations.lm.serve import ServeSpec, _with_ratios, plan_units, run_rank, serve_args_to_spec  # noqa: E402


def test_units_single_gpu_first_and_multi_gpu_only_with_ranks():
    spec = ServeSpec(experts=("fused", "fused_fp8"))
    two = plan_units(spec, 2)
    assert [u.label for u in two[:3]] == ["moekit 1 GPU bf16", "moekit 1 GPU fp8", "transformers 1 GPU"]
    assert {u.impl for u in two} == set(spec.implementations)
    assert all(u.gpus == 2 for u in two if u.impl in ("moekit-ep", "transformers-tp", "transformers-ep"))
    assert [u.inputs for u in two if u.impl == "moekit-ep"] == ["per-rank", "per-rank"]
    assert {u.impl for u in plan_units(spec, 1)} == {"moekit-1gpu", "transformers-1gpu"}


def test_ratio_to_the_best_transformers_option_at_the_same_gpus_and_batch():
    def row(impl, label, gpus, batch, tps, mode="eager"):
        return dict(impl=impl, implementation=label, model="m", phase="decode", mode=mode, gpus=gpus, batch=batch,
                    tokens_per_s=tps)

    rows = _with_ratios([row("transformers-tp", "tp", 2, 16, 100.0), row("transformers-ep", "ep", 2, 16, 50.0),
                         row("moekit-ep", "ours", 2, 16, 300.0), row("moekit-ep", "ours", 2, 64, 10.0),
                         row("transformers-ep", "ep", 2, 64, None), row("moekit-1gpu", "one", 1, 16, 7.0),
                         row("moekit-ep", "ours", 2, 16, 30.0, mode="compiled")])
    assert rows[2]["vs_best_transformers"] == pytest.approx(3.0) and rows[2]["best_transformers"] == "tp"
    assert rows[1]["vs_best_transformers"] == pytest.approx(0.5)
    assert rows[3]["vs_best_transformers"] is None  # the only transformers row at batch 64 has no number
    assert rows[5]["vs_best_transformers"] is None  # no transformers option on one GPU here
    assert rows[6]["vs_best_transformers"] is None  # another mode


def test_one_rank_run_records_rows_with_agreement(tmp_path):
    torch.set_num_threads(1)
    spec = ServeSpec(models=("tiny-olmoe",), layers=1, batches=(1, 2), implementations=("moekit-1gpu", "transformers-1gpu"),
                     experts=("torch",), modes=("eager",), new_tokens=3, prompt_tokens=4, prefill_tokens=8,
                     prefill_batch=1, repeats=1, out_dir=str(tmp_path), record_name="run.json", device="cpu",
                     smoke=True)
    rows = run_rank(0, 1, asdict(spec))
    record = json.loads((tmp_path / "lm-serve-cpu-1x" / "run.json").read_text())
    assert record["results"]["complete"] and record["params"]["note"].startswith("CPU smoke run")
    assert len(rows) == len(record["results"]["rows"]) == 6  # 2 units x (2 decode batches + 1 prefill)
    for r in record["results"]["rows"]:
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["ttft_s"] > 0 and r["gpus"] == 1
    theirs = [r for r in rows if r["impl"] == "transformers-1gpu"]
    ours = [r for r in rows if r["impl"] == "moekit-1gpu"]
    # fp32: moekit's experts and transformers' own generate the same greedy tokens.
    assert all(r["prefix_share"] == 1.0 and r["agreement_reference"] == "moekit 1 GPU torch experts (eager)" for r in theirs)
    for r in ours:
        match = next(t for t in theirs if (t["phase"], t["batch"]) == (r["phase"], r["batch"]))
        assert r["vs_best_transformers"] == pytest.approx(r["tokens_per_s"] / match["tokens_per_s"])


def _args(**over):
    base = dict(cpu=True, out_dir="moekit-results", models=None, model_batches=None, experts=None, gpus=None,
                batches="1,16", implementations="moekit-ep,transformers-tp", modes=None, compiled_batches=None,
                new_tokens=4, prompt_tokens=8, prefill_tokens=16, prefill_batch=1, repeats=1, seed=0, layers=None,
                checkpoint_dir="/tmp/x", timeout=60.0)
    return SimpleNamespace(**dict(base, **over))


def test_cli_options_are_checked_before_any_work():
    spec, gpus = serve_args_to_spec(_args(model_batches="tiny-qwen3=2,4"))
    assert spec.smoke and gpus == 2 and spec.models == ("tiny-olmoe", "tiny-qwen3") and spec.experts == ("torch",)
    assert spec.batches_of("tiny-qwen3") == (2, 4) and spec.batches_of("tiny-olmoe") == (1, 16)
    for bad, match in ((dict(models="gpt-5"), "--models"), (dict(experts="fused"), "need a GPU"),
                       (dict(implementations="vllm"), "--implementations"), (dict(batches="0"), "--batches"),
                       (dict(model_batches="olmoe-1b-7b=4"), "--model-batches"), (dict(new_tokens=0), "--new-tokens")):
        with pytest.raises(ValueError, match=match):
            serve_args_to_spec(_args(**bad))
