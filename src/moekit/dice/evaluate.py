"""The quality recipe: train (or load) the digits DiT-MoE and its feature classifier, sample
with every schedule from the same noise, and measure each against ``sync``.

Sampling runs each schedule for real: a :class:`~moekit.dice.runner.ScheduledMoE` over the
eager all-to-all dispatcher on this one process (world size 1), with the asynchronous
executor on a GPU (its own thread and CUDA stream). With ``check_simulator`` the staleness
simulator samples the same schedule too and the largest latent difference is reported
(zero up to the rounding of batched vs per-expert matmuls).

Per schedule: the FID analogue (Fréchet distance of classifier features) against the real
digits and against the sync samples, the classifier's accuracy on the class-conditional
samples, latent MSE and PSNR against sync, the mean staleness, the (token, slot) rows sent
per step relative to sync, and the buffers held (measured peak and the model's).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moekit.dice import accounting
from moekit.dice.executor import make_executor
from moekit.dice.quality import (Digits, accuracy, features, frechet_distance, load_digits, mse, psnr,
                                 train_classifier, write_grid_png)
from moekit.dice.runner import ScheduledMoE
from moekit.dice.sampler import sample
from moekit.dice.schedules import PRESET_NAMES, SchedulePlan, preset
from moekit.dice.simulator import StalenessSimulator
from moekit.dice.train import TrainConfig, load_checkpoint, save_checkpoint, train_dit


@dataclass
class QualityConfig:
    """What ``moekit dice quality`` runs (CPU defaults: seconds)."""

    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: str | None = None  # load this model instead of training
    schedules: tuple[str, ...] = PRESET_NAMES
    per_class: int = 4
    sample_steps: int = 10
    cfg_scale: float = 1.5
    classifier_epochs: int = 20
    seed: int = 0
    check_simulator: bool = True
    grid_per_class: int = 8

    def __post_init__(self) -> None:
        for name in ("per_class", "sample_steps", "classifier_epochs", "grid_per_class"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        unknown = [s for s in self.schedules if s not in PRESET_NAMES]
        if unknown:
            raise ValueError(f"unknown schedules {unknown}; known: {', '.join(PRESET_NAMES)}")
        if "sync" not in self.schedules:
            raise ValueError("schedules must include 'sync' (every metric is relative to it)")
        if not (math.isfinite(self.cfg_scale) and self.cfg_scale >= 1.0):  # NaN passes `< 1`
            raise ValueError(f"cfg_scale must be >= 1 and finite, got {self.cfg_scale}")


def class_noise(num_classes: int, per_class: int, shape: tuple[int, ...], seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared starting noise and labels (class-major: per_class samples of class 0, then 1, ...)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(num_classes * per_class, *shape, generator=g)
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    return noise.to(device), labels.to(device)


def evaluate_schedules(model, clf, data: Digits, qc: QualityConfig, *, device, out_dir: Path | None = None,
                       progress=print) -> list[dict]:
    """Sample with every schedule of ``qc`` from the same noise and measure (see the module docstring)."""
    cfg = model.config
    device = torch.device(device)
    noise, labels = class_noise(cfg.num_classes, qc.per_class, (cfg.in_channels, cfg.input_size, cfg.input_size),
                                qc.seed, device)
    real = features(clf, data.all_x.to(device))
    weights = [w.to(device=device) for w in model.moe_weights()]
    T = 2 * noise.shape[0] * cfg.tokens_per_image  # CFG doubles the batch
    samples: dict[str, torch.Tensor] = {}
    rows = []
    for name in ("sync",) + tuple(s for s in qc.schedules if s != "sync"):
        schedule = preset(name, qc.sample_steps)
        plan = SchedulePlan(schedule, qc.sample_steps, cfg.depth)
        runner = ScheduledMoE(weights, cfg.moe_shape, schedule, qc.sample_steps,
                              executor=make_executor("async" if device.type == "cuda" else "inline", device))
        start = time.perf_counter()
        z = sample(model, noise, labels, steps=qc.sample_steps, cfg_scale=qc.cfg_scale, moe=runner)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        stats = runner.stats()
        runner.close()
        samples[name] = z
        row = dict(schedule=name, config=schedule.describe(), sample_seconds=seconds)
        if qc.check_simulator:
            sim = StalenessSimulator(weights, cfg.moe_shape, schedule, qc.sample_steps)
            z_sim = sample(model, noise, labels, steps=qc.sample_steps, cfg_scale=qc.cfg_scale, moe=sim)
            row["runner_vs_simulator_max_abs"] = (z - z_sim).abs().max().item()
            row["sources_match_plan"] = stats["sources"] == plan.source_table == sim.stats()["sources"]
        feats = features(clf, z)
        sync_z = samples["sync"]
        err = mse(z, sync_z)
        rows_sent = sum(stats["rows_local"]) + sum(stats["rows_remote"])
        row.update(
            fd_data=frechet_distance(feats, real),
            fd_sync=frechet_distance(feats, features(clf, sync_z)),
            accuracy=accuracy(clf, z, labels),
            mse_sync=err, psnr_sync=psnr(err),
            staleness_mean=plan.staleness()["mean"], async_share=plan.staleness()["async_share"],
            rows_per_step=rows_sent / qc.sample_steps,
            peak_buffers=stats["peak_buffers"]["total"], peak_buffers_model=accounting.peak_buffers(plan),
            buffer_bytes=accounting.buffer_bytes(plan, T, cfg.top_k, cfg.hidden, weights[0].w13.dtype.itemsize),
        )
        rows.append(row)
        if out_dir is not None:
            pick = torch.cat([torch.arange(c * qc.per_class, c * qc.per_class + min(qc.per_class, qc.grid_per_class))
                              for c in range(cfg.num_classes)])
            write_grid_png(z[pick], out_dir / f"samples-{name.replace('+', '-')}.png",
                           nrow=min(qc.per_class, qc.grid_per_class))
        progress(f"{name:20s} FD(data) {row['fd_data']:8.3f}  FD(sync) {row['fd_sync']:8.3f}  "
                 f"acc {row['accuracy']:.3f}  PSNR(sync) {row['psnr_sync']:6.2f} dB  ({seconds:.1f} s)")
    sync_rows = rows[0]["rows_per_step"]
    for row in rows:
        row["rows_vs_sync"] = row["rows_per_step"] / sync_rows if sync_rows else float("nan")
    return rows


QUALITY_COLUMNS = ("schedule", "fd_data", "fd_sync", "accuracy", "mse_sync", "psnr_sync", "staleness_mean",
                   "rows_vs_sync", "peak_buffers")


def run_quality(qc: QualityConfig, *, device, out_dir: str | Path, progress=print) -> dict:
    """The whole recipe; writes ``quality.json``, ``quality.md``, the checkpoints and one PNG
    grid per schedule into ``out_dir`` and returns the record."""
    device = torch.device(device)
    if device.type != "cpu":
        return _run_quality(qc, device=device, out_dir=out_dir, progress=progress)
    # On the CPU one intra-op thread: the model's ops are tiny, and threads that wait for each other on a
    # busy machine made the recipe ten times slower (minutes instead of seconds).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_quality(qc, device=device, out_dir=out_dir, progress=progress)
    finally:
        torch.set_num_threads(threads)


def _run_quality(qc: QualityConfig, *, device: torch.device, out_dir: str | Path, progress) -> dict:
    from moekit.bench.report import environment, markdown_table

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    data = load_digits(seed=qc.seed)
    progress(f"digits: {data.train_x.shape[0]} train / {data.test_x.shape[0]} test images on {device}")
    if qc.checkpoint:
        model, meta = load_checkpoint(qc.checkpoint, device)
        train_log = meta.get("log", [])
        progress(f"loaded {qc.checkpoint}")
    else:
        model, train_log = train_dit(qc.train, data, device=device, progress=progress)
        save_checkpoint(model, out_dir / "dit-moe-digits.pt", meta=dict(log=train_log))
    model.eval()
    clf, clf_acc = train_classifier(data, epochs=qc.classifier_epochs, seed=qc.seed, device=device,
                                    progress=progress)
    progress(f"classifier test accuracy {clf_acc:.3f}")
    floor = frechet_distance(features(clf, data.train_x.to(device)), features(clf, data.test_x.to(device)))
    write_grid_png(data.test_x[:80], out_dir / "real-digits.png", nrow=10)
    rows = evaluate_schedules(model, clf, data, qc, device=device, out_dir=out_dir, progress=progress)
    record = dict(kind="dice-quality", environment=environment(),
                  params=dict(quality=asdict(qc), model=asdict(model.config)),
                  results=dict(rows=rows, classifier_test_accuracy=clf_acc, fd_train_vs_test=floor,
                               train_log=train_log, seconds=time.perf_counter() - start))
    (out_dir / "quality.json").write_text(json.dumps(_finite(record), indent=2) + "\n", encoding="utf-8")
    table = markdown_table(rows, QUALITY_COLUMNS, floatfmt=".4g")
    (out_dir / "quality.md").write_text(
        f"FID analogue floor (classifier features, train vs test digits): {floor:.4g}; "
        f"classifier test accuracy {clf_acc:.3f}\n\n{table}\n", encoding="utf-8")
    return record


def _finite(value):
    """JSON has no infinity: an infinite PSNR (identical latents) is written as null."""
    if isinstance(value, float) and not (value == value and abs(value) != float("inf")):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
