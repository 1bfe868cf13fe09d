import json
import sys
import time

import pytest

from moekit.tax.report import DEFAULT_BATCH_SIZES, tax_report


def test_default_report_is_fast_and_complete():
    start = time.perf_counter()
    text = tax_report()
    assert time.perf_counter() - start < 10
    assert "mixtral-8x7b" in text and "H200" in text
    for phase in ("prefill", "decode"):
        assert f"\n{phase}\n" in text
    for par in ("TP+TP", "TP+EP", "DP+EP"):
        assert par in text
    rows = [line for line in text.splitlines() if line.strip().startswith("4096 ")]
    assert len(rows) == 2  # one per phase
    assert DEFAULT_BATCH_SIZES == tuple(2**i for i in range(13))


def test_json_report_has_every_point():
    data = json.loads(tax_report("qwen2-moe", "H100", batch_sizes=(1, 32, 1024), as_json=True))
    assert data["model"] == "qwen2-moe" and data["hardware"]["name"] == "H100"
    assert len(data["points"]) == 3 * 2 * 3
    for p in data["points"]:
        assert p["regime"] in ("memory-bound", "transition", "compute-bound")
        assert sum(p["sources"].values()) == pytest.approx(p["tau"] - 1, abs=1e-9)


def test_parallelisms_that_do_not_fit_are_skipped():
    text = tax_report("mixtral-8x7b", "A100", batch_sizes=(8,), n_gpus=3)
    assert "skipped TP+EP, DP+EP" in text


def test_hardware_from_a_json_file(tmp_path):
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"base": "H200", "net_latency": 45e-6}))
    data = json.loads(tax_report(hardware=str(path), batch_sizes=(16,), as_json=True))
    assert data["hardware"]["net_latency"] == 45e-6


def test_figures_are_written(tmp_path):
    text = tax_report("qwen2-moe", batch_sizes=(1, 16, 256, 4096), out_dir=str(tmp_path))
    names = {"decode_tax.png", "prefill_tax.png", "expert_activation.png", "simulated_load.png"}
    assert {p.name for p in tmp_path.iterdir()} == names
    for name in names:
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert "figures:" in text


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now fails
    with pytest.raises(ImportError, match="moekit\\[plot\\]"):
        tax_report(batch_sizes=(1,), out_dir=str(tmp_path))
