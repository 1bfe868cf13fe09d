"""Quality of the schedules, measured on a trained model: the digits data, a feature
classifier, a Fréchet distance in its feature space (an FID analogue), accuracy, MSE / PSNR.

The data is scikit-learn's bundled 8 x 8 handwritten digits (1797 images, 10 classes;
``pip install 'moekit[dice]'``), shipped with the package: nothing is downloaded. Images
are scaled from 0..16 to [-1, 1].

The FID analogue: FID compares Inception-v3 features of generated and real images; here the
features are the penultimate layer of a small classifier trained on the same digits, and the
distance is the same Fréchet distance between Gaussians fitted to the two feature sets,
``|mu_a - mu_b|^2 + tr(C_a + C_b - 2 (C_a^1/2 C_b C_a^1/2)^1/2)``, in float64. Its values
are not comparable with FID numbers; only the ordering of schedules is.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

DIGITS_MAX = 16.0  # pixel values of the bundled digits are 0..16


@dataclass
class Digits:
    """Images [N, 1, 8, 8] in [-1, 1] (float32) and labels [N] (int64), split once, seeded."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @property
    def all_x(self) -> torch.Tensor:
        return torch.cat([self.train_x, self.test_x])


def load_digits(*, seed: int = 0, test_fraction: float = 0.2) -> Digits:
    """scikit-learn's bundled digits, split into train / test with a seeded permutation."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as error:
        raise RuntimeError("the digits data comes with scikit-learn: pip install 'moekit[dice]'") from error
    bunch = sk_load_digits()
    x = torch.from_numpy(np.asarray(bunch.images, dtype=np.float32)).unsqueeze(1) / DIGITS_MAX * 2 - 1
    y = torch.from_numpy(np.asarray(bunch.target, dtype=np.int64))
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
    n_test = int(round(x.shape[0] * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Digits(x[train], y[train], x[test], y[test])


# ------------------------------------------------------------------------------ classifier


class FeatureClassifier(nn.Module):
    """An MLP on the 64 pixels: 64 -> 256 -> ``feature_dim`` (the features) -> 10 classes."""

    def __init__(self, pixels: int = 64, feature_dim: int = 64, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(pixels, 256), nn.ReLU(), nn.Linear(256, feature_dim),
                                  nn.ReLU())
        self.head = nn.Linear(feature_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def train_classifier(data: Digits, *, epochs: int = 60, batch: int = 128, lr: float = 2e-3, seed: int = 0,
                     device: torch.device | str = "cpu", progress=None) -> tuple[FeatureClassifier, float]:
    """Train the feature classifier on the train split (with light pixel noise, so that it
    judges slightly imperfect samples sensibly); returns it and its test accuracy."""
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an int >= 1, got {epochs!r}")
    torch.manual_seed(seed)
    g = torch.Generator(device="cpu").manual_seed(seed)
    clf = FeatureClassifier().to(device)
    opt = torch.optim.Adam(clf.parameters(), lr=lr)
    x, y = data.train_x.to(device), data.train_y.to(device)
    for epoch in range(epochs):
        clf.train()
        order = torch.randperm(x.shape[0], generator=g).to(device)
        for i in range(0, x.shape[0], batch):
            idx = order[i:i + batch]
            noisy = x[idx] + 0.1 * torch.randn(x[idx].shape, generator=g).to(device)
            loss = F.cross_entropy(clf(noisy), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if progress is not None and (epoch + 1) % max(1, epochs // 4) == 0:
            progress(f"classifier epoch {epoch + 1}/{epochs}: loss {loss.item():.4f}")
    clf.eval()
    acc = accuracy(clf, data.test_x.to(device), data.test_y.to(device))
    return clf, acc


@torch.no_grad()
def accuracy(clf: FeatureClassifier, x: torch.Tensor, y: torch.Tensor) -> float:
    return (clf(x.float()).argmax(dim=1) == y).float().mean().item()


@torch.no_grad()
def features(clf: FeatureClassifier, x: torch.Tensor, batch: int = 4096) -> torch.Tensor:
    return torch.cat([clf.features(x[i:i + batch].float()) for i in range(0, x.shape[0], batch)]).double().cpu()


# -------------------------------------------------------------------------------- metrics


def _sqrtm_psd(m: torch.Tensor) -> torch.Tensor:
    """Square root of a symmetric positive semi-definite matrix (eigenvalues clamped at 0)."""
    vals, vecs = torch.linalg.eigh((m + m.T) / 2)
    return (vecs * vals.clamp(min=0).sqrt()) @ vecs.T


def frechet_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fréchet distance between Gaussians fitted to feature sets a [n, d] and b [m, d] (float64)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a and b must be [n, d] and [m, d] with the same d, got {tuple(a.shape)}, {tuple(b.shape)}")
    if a.shape[0] < 2 or b.shape[0] < 2:
        raise ValueError("a and b need at least 2 rows each (a covariance)")
    a, b = a.double(), b.double()
    mu_a, mu_b = a.mean(0), b.mean(0)
    ca, cb = torch.cov(a.T), torch.cov(b.T)
    root_a = _sqrtm_psd(ca)
    cross = _sqrtm_psd(root_a @ cb @ root_a)
    value = (mu_a - mu_b).pow(2).sum() + torch.trace(ca) + torch.trace(cb) - 2 * torch.trace(cross)
    return max(0.0, value.item())


def mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).pow(2).mean().item()


def psnr(mse_value: float, data_range: float = 2.0) -> float:
    """Peak signal-to-noise ratio in dB for images spanning ``data_range`` ([-1, 1]: 2);
    infinite for identical images."""
    return math.inf if mse_value == 0 else 10.0 * math.log10(data_range ** 2 / mse_value)


# -------------------------------------------------------------------------------- images


def png_bytes(gray: np.ndarray) -> bytes:
    """An 8-bit grayscale PNG of ``gray`` [h, w] uint8 (zlib, no other dependency)."""
    if gray.dtype != np.uint8 or gray.ndim != 2:
        raise ValueError(f"gray must be a 2-D uint8 array, got {gray.dtype} {gray.shape}")
    h, w = gray.shape
    raw = b"".join(b"\x00" + gray[row].tobytes() for row in range(h))  # filter type 0 per row

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def image_grid(images: torch.Tensor, nrow: int, *, scale: int = 4, pad: int = 1) -> np.ndarray:
    """Tile images [n, 1, S, S] in [-1, 1] into a uint8 grid, ``nrow`` images per row,
    each pixel ``scale`` x ``scale``, ``pad`` gray pixels between tiles."""
    if images.dim() != 4 or images.shape[1] != 1:
        raise ValueError(f"images must be [n, 1, S, S], got {tuple(images.shape)}")
    n, _, S, _ = images.shape
    rows = -(-n // nrow)
    pix = ((images[:, 0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy()
    pix = pix.repeat(scale, axis=1).repeat(scale, axis=2)
    cell = S * scale + pad
    grid = np.full((rows * cell + pad, nrow * cell + pad), 128, dtype=np.uint8)
    for i in range(n):
        r, c = divmod(i, nrow)
        grid[pad + r * cell: pad + r * cell + S * scale, pad + c * cell: pad + c * cell + S * scale] = pix[i]
    return grid


def write_grid_png(images: torch.Tensor, path: str | Path, nrow: int, *, scale: int = 4) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png_bytes(image_grid(images, nrow, scale=scale)))
    return path
