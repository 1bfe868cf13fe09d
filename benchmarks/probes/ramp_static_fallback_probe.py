"""What should RaMP's default run where no fitted model exists? (CPU, committed records)

The default (``config=None`` of ``FusedExperts`` / ``MoELayer`` / the transformers patch) never
reads the routing without a model, so its choice must be static per token count (or capacity).
Two static candidates, scored by their regret against the best measured config at each point:

* ``default``: the kernel's own ``default_config`` / ``expert_major_default`` (what ships);
* ``static fallback``: the region-analysis templates' least *mean* analytic estimate over the
  selector's routing sweep (8 betas, 4 Zipf exponents) at that token count (for expert-major
  kernels: at the capacity, 256 in the records);

beside the dynamic fallback (the same estimate on the live histogram: ``config="auto"``
without a model, which pays a read). Sets: the H200 dataset (bf16, 28 points a shape), the
H100 held-out evaluations and the H100 profiles (25 points a shape, FP8 included).

    python benchmarks/probes/ramp_static_fallback_probe.py
"""

from __future__ import annotations

import glob
import gzip
import json
from types import SimpleNamespace

import numpy as np
import torch

from moekit.kernels.configs import default_config
from moekit.kernels.expert_major import expert_major_default
from moekit.ramp.dataset import from_kernel_table
from moekit.ramp.fallback import estimate_us, fallback_choice, templates
from moekit.ramp.graphs import routing_sweep
from moekit.bench.ramp_profile import load_any_timings
from moekit.ramp.regions import hardware_for

H200 = "benchmarks/results/kernel-nvidia-h200/kernel-nvidia-h200-1x-20261123T053014Z-table.json.gz"
SHAPES = ("olmoe-1b-7b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3-tp8", "deepseek-v3-ep32")
CAPACITY = 256  # the expert-major records' capacity


def sweep(shape, routed: int, M: int) -> list[np.ndarray]:
    """The selector's routing sweep (one seed) for a shape without a selector."""
    return routing_sweep(SimpleNamespace(shape=shape), M, seeds=1, routed=routed)


def score(t, hw, expert_major: bool) -> dict:
    fp8 = "float8" in t.dtype
    dt, elem = (torch.float8_e4m3fn, 1) if fp8 else (torch.bfloat16, 2)
    cands = [c for c in templates(t.shape, hw, dt, t.routed_experts) if not expert_major or c.split_k == 1]
    index = {c: i for i, c in enumerate(t.configs)}
    static: dict = {}
    rows = []
    for j, p in enumerate(t.points):
        key = CAPACITY if expert_major else p.M
        if key not in static:
            hists = sweep(t.shape, t.routed_experts, key)
            est = np.array([[estimate_us(t.shape, c, h, key, hw, elem) for c in cands] for h in hists])
            static[key] = cands[int(np.argmin(est.mean(axis=0)))]
            static[(key, "rel")] = cands[int(np.argmin((est / est.min(axis=1, keepdims=True)).mean(axis=0)))]
        chosen = {"default": expert_major_default(CAPACITY, fp8) if expert_major else default_config(p.M, t.shape, dtype=dt),
                  "static fallback": static[key],
                  "static, relative": static[(key, "rel")],
                  "dynamic fallback": fallback_choice(t.shape, p.counts, p.M, hw, dt, cands)}
        best = np.nanmin(t.times[j])
        rows.append({k: t.times[j, index[c]] / best - 1 if c in index else np.nan for k, c in chosen.items()})
    out = {}
    for k in rows[0]:
        r = np.array([row[k] for row in rows])
        out[k] = f"{100 * np.nanmean(r):5.1f} % (max {100 * np.nanmax(r):4.0f})"
    return out


def main() -> None:
    sets = []
    table = json.load(gzip.open(H200))
    sets += [(f"H200 dataset {s}", from_kernel_table(table, s), hardware_for("h200"), False) for s in SHAPES]
    for pattern in ("eval-*timings.json.gz", "profile-*timings.json.gz"):
        for f in sorted(glob.glob(f"benchmarks/results/ramp-nvidia-h100/*/{pattern}")):
            t, _ = load_any_timings(f)
            name = f.split("/")[-1].split("-timings")[0].replace("-h100-", " ")
            sets.append((f"H100 {name}", t, hardware_for("h100"), "expert_major" in f))
    print(f"{'set':60} {'default':>18} {'static fallback':>18} {'static, relative':>18} {'dynamic fallback':>18}")
    for name, t, hw, em in sets:
        s = score(t, hw, em)
        print(f"{name:60} " + " ".join(f"{v:>18}" for v in s.values()))


if __name__ == "__main__":
    main()
