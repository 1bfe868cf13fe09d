"""Metrics of the quality recipe, the PNG writer, the digits, and the recipe end to end (tiny)."""

from __future__ import annotations

import json
import math
import struct
import zlib

import numpy as np
import pytest
import torch

from moekit.dice.evaluate import QualityConfig, run_quality
from moekit.dice.quality import (frechet_distance, image_grid, load_digits, png_bytes, psnr, train_classifier,
                                 write_grid_png)
from moekit.dice.train import TrainConfig


def test_frechet_distance_of_gaussians():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(20000, 2, generator=g, dtype=torch.float64)
    b = torch.randn(20000, 2, generator=g, dtype=torch.float64) * torch.tensor([2.0, 0.5]) + torch.tensor([1.0, -3.0])
    # closed form for diagonal covariances: |mu|^2 + sum (sigma_a - sigma_b)^2
    expected = (1.0 + 9.0) + (1 - 2) ** 2 + (1 - 0.5) ** 2
    assert abs(frechet_distance(a, b) - expected) < 0.1
    assert frechet_distance(a, a) < 1e-6
    with pytest.raises(ValueError, match="same d"):
        frechet_distance(a, b[:, :1])


def test_psnr():
    assert psnr(0.0) == math.inf
    assert psnr(4.0) == 0.0 and abs(psnr(0.04) - 20.0) < 1e-12


def _decode_png(data: bytes) -> np.ndarray:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(tag + body)
        if tag == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif tag == b"IDAT":
            idat += body
        pos += 12 + length
    w, h = size
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(h, w + 1)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:]


def test_png_grid_round_trips(tmp_path):
    images = torch.linspace(-1, 1, 3 * 64).view(3, 1, 8, 8)
    grid = image_grid(images, nrow=2, scale=2, pad=1)
    assert grid.shape == (2 * 17 + 1, 2 * 17 + 1)
    assert grid[1, 1] == 0 and grid[1 + 17 + 15, 1 + 15] == 255  # first pixel black, the third image's last white
    assert grid[0, 0] == 128  # padding gray
    path = write_grid_png(images, tmp_path / "g.png", nrow=2, scale=2)
    assert np.array_equal(_decode_png(path.read_bytes()), image_grid(images, nrow=2, scale=2))
    with pytest.raises(ValueError, match="uint8"):
        png_bytes(np.zeros((2, 2), dtype=np.float32))


def test_digits_and_classifier():
    data = load_digits()
    assert data.train_x.shape[1:] == (1, 8, 8) and data.train_x.shape[0] + data.test_x.shape[0] == 1797
    assert data.train_x.min() == -1 and data.train_x.max() == 1
    assert set(data.test_y.tolist()) == set(range(10))
    torch.manual_seed(0)
    clf, acc = train_classifier(data, epochs=8)
    assert acc > 0.9


def test_quality_recipe_end_to_end(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        qc = QualityConfig(train=TrainConfig(steps=4, log_every=2), schedules=("sync", "displaced", "dice"),
                           per_class=1, sample_steps=4, classifier_epochs=2)
        record = run_quality(qc, device="cpu", out_dir=tmp_path, progress=lambda m: None)
    finally:
        torch.set_num_threads(threads)
    rows = {r["schedule"]: r for r in record["results"]["rows"]}
    assert set(rows) == {"sync", "displaced", "dice"}
    assert rows["sync"]["mse_sync"] == 0 and rows["sync"]["fd_sync"] < 1e-6
    assert rows["displaced"]["staleness_mean"] > rows["dice"]["staleness_mean"] > 0
    for r in rows.values():
        assert r["runner_vs_simulator_max_abs"] == 0.0 and r["sources_match_plan"]
        assert r["peak_buffers"] == r["peak_buffers_model"]
        assert (tmp_path / f"samples-{r['schedule']}.png").exists()
    saved = json.loads((tmp_path / "quality.json").read_text())
    assert saved["kind"] == "dice-quality" and saved["results"]["rows"][0]["psnr_sync"] is None  # inf -> null
    assert "| schedule |" in (tmp_path / "quality.md").read_text()
    with pytest.raises(ValueError, match="must include 'sync'"):
        QualityConfig(schedules=("dice",))
    with pytest.raises(ValueError, match="unknown schedules"):
        QualityConfig(schedules=("sync", "fast"))
