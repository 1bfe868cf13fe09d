"""The paper's figures as PNG files (matplotlib is optional: ``pip install moekit[plot]``).

* ``decode_tax.png``: tau vs batch size in decode, per parallelism, with DensePA
  (the paper's Figure 3 bell curve);
* ``prefill_tax.png``: the same for prefill (Figure 2's decrease);
* ``expert_activation.png``: E_active vs batch size, the uniform-routing formula, a
  Monte Carlo check and a Zipf-skewed router (Figure 7);
* ``simulated_load.png``: balls-bins-buckets balance, raw and padded (Figure 10).
"""

from __future__ import annotations

import os

import numpy as np

from .bbb import FIG10_CONFIGS, expert_counts, figure10_data
from .padding import expected_active_experts
from .topk import sample_routing, zipf_popularity


def _pyplot():
    """Import matplotlib only when a figure is drawn, with a clear message if absent."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "drawing the MoE-tax figures needs matplotlib: pip install 'moekit[plot]' "
            "(or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


def _tax_figure(points, phase: str, title: str, path: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    pts = [p for p in points if p.phase == phase]
    for par in dict.fromkeys(p.parallelism for p in pts):
        row = sorted((p for p in pts if p.parallelism == par), key=lambda p: p.m)
        ax.plot([p.m for p in row], [p.tau for p in row], marker="o", label=f"MoE {par}")
    ref = sorted({p.m: p for p in pts}.values(), key=lambda p: p.m)
    ax.plot([p.m for p in ref], [p.tau_densepa for p in ref], "k--", label="DensePA")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (tokens)")
    ax.set_ylabel("tax  T(MoE) / T(DenseFA)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def decode_tax_figure(points, path: str, title: str = "decode tax") -> str:
    return _tax_figure(points, "decode", title, path)


def prefill_tax_figure(points, path: str, title: str = "prefill tax") -> str:
    return _tax_figure(points, "prefill", title, path)


def activation_figure(shape, batch_sizes, path: str, trials: int = 32, zipf: float = 1.2, seed: int = 0) -> str:
    """E_active: the formula, uniform Monte Carlo, and a Zipf-skewed router."""
    plt = _pyplot()
    e, k = shape.num_experts, shape.top_k
    ms = np.asarray(sorted(batch_sizes))
    mc, skew = [], []
    popularity = zipf_popularity(e, zipf, seed)
    for m in ms:
        mc.append((expert_counts(sample_routing(int(m), e, k, trials, seed=seed), e) > 0).sum(1).mean())
        ids = sample_routing(int(m), e, k, trials, popularity, seed=seed + 1)
        skew.append((expert_counts(ids, e) > 0).sum(1).mean())
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ms, expected_active_experts(e, k, ms), "k-", label="E(1-(1-K/E)^m)")
    ax.plot(ms, mc, "o", label="uniform (simulated)")
    ax.plot(ms, skew, "s", label=f"Zipf {zipf} (simulated)")
    ax.axhline(e, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (tokens)")
    ax.set_ylabel("activated experts")
    ax.set_title(f"expert activation: {shape.name} (E={e}, K={k})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def simulated_load_figure(path: str, batch_sizes=(16, 64, 256, 1024, 4096), trials: int = 200, seed: int = 0) -> str:
    """Figure 10: mean/max GPU load (1.0 = balanced), raw and padded, per config."""
    plt = _pyplot()
    rows = figure10_data(batch_sizes, FIG10_CONFIGS, trials=trials, seed=seed)
    fig, ax = plt.subplots(figsize=(6, 4))
    for cfg in FIG10_CONFIGS:
        mine = [r for r in rows if r["config"] == cfg.label]
        line = ax.plot([r["m"] for r in mine], [r["balance"] for r in mine], marker="o", label=f"{cfg.label}")
        ax.plot([r["m"] for r in mine], [r["padded_balance"] for r in mine], marker="x", ls="--",
                color=line[0].get_color(), label=f"{cfg.label}, padded")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("batch size (tokens)")
    ax.set_ylabel("mean / max GPU load")
    ax.set_title(f"simulated load, uniform routing ({trials} runs)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw_all(points, shape, batch_sizes, out_dir: str, trials: int = 200) -> list[str]:
    """All four figures into ``out_dir``; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    name = shape.name
    return [
        decode_tax_figure(points, os.path.join(out_dir, "decode_tax.png"), f"decode tax: {name}"),
        prefill_tax_figure(points, os.path.join(out_dir, "prefill_tax.png"), f"prefill tax: {name}"),
        activation_figure(shape, batch_sizes, os.path.join(out_dir, "expert_activation.png")),
        simulated_load_figure(os.path.join(out_dir, "simulated_load.png"), trials=trials),
    ]
