"""Does a shortlist from another measurement of the shape cost regret? (RaMP profiling)

For each shape with complete H100 timings (profile + held-out evaluation), restrict the
exhaustive search to the configs within F of some point's best in (a) the same shape on the
H200 dataset, (b) a greedy cover of every *other* shape on both GPUs, (c) the union of the
qwen3-30b-a3b and olmoe-1b-7b H100 profiles (bf16 and FP8: what ``--shortlist-any-shape``
would time for the other presets), and report the regret of the restricted best against the
full best. CPU only: reads the committed records.

    python benchmarks/probes/ramp_shortlist_probe.py
"""

from __future__ import annotations

import glob

import numpy as np

from moekit.bench.ramp_profile import load_any_timings, prune_configs

H200 = "benchmarks/results/kernel-nvidia-h200/kernel-nvidia-h200-1x-20261123T053014Z-table.json.gz"
SHAPES = ("olmoe-1b-7b", "qwen3-30b-a3b", "deepseek-v3-tp8", "deepseek-v3-ep32", "mixtral-8x7b")


def near(t, factor: float) -> set:
    return {t.configs[i] for i in prune_configs(t, factor)}


def restricted_regret(t, keep: set) -> tuple[float, float]:
    """Mean and max % of the best among ``keep`` over the best of all, over t's points."""
    cols = [i for i, c in enumerate(t.configs) if c in keep]
    r = np.nanmin(t.times[:, cols], axis=1) / np.nanmin(t.times, axis=1) - 1
    return float(np.nanmean(r) * 100), float(np.nanmax(r) * 100)


def greedy_cover(ts, eps: float) -> set:
    """A small set (greedy) with every point of ``ts`` within ``eps`` of its best."""
    pool = sorted({c for t in ts for c in t.configs}, key=repr)
    chosen: set = set()

    def gaps(keep):
        out = []
        for t in ts:
            cols = [i for i, c in enumerate(t.configs) if c in keep]
            rb = np.nanmin(t.times[:, cols], axis=1) if cols else np.full(len(t.points), np.inf)
            out.append(rb / np.nanmin(t.times, axis=1) - 1)
        return np.concatenate(out)

    while np.nanmax(gaps(chosen)) > eps:
        chosen.add(min(pool, key=lambda c: np.nansum(np.minimum(gaps(chosen | {c}), 1.0))))
    return chosen


def main() -> None:
    data = {("h200", s): load_any_timings(H200, s)[0] for s in SHAPES}
    for f in sorted(glob.glob("benchmarks/results/ramp-nvidia-h100/*-bf16/*-token-timings.json.gz")):
        t, _ = load_any_timings(f)
        data[("h100-eval" if "/eval-" in f else "h100-profile", t.shape.name)] = t
    print("(a) the same shape's H200 shortlist, regret on the H100 timings (mean / max %)")
    for s in SHAPES:
        for factor in (1.03, 1.05, 1.10):
            keep = near(data[("h200", s)], factor)
            rows = [f"{k[0]} {'%.2f / %.1f' % restricted_regret(t, keep)}" for k, t in data.items()
                    if k[1] == s and k[0] != "h200"]
            print(f"  {s:17s} {factor:.2f}x: {len(keep):3d} configs; {'; '.join(rows) or 'no H100 timings'}")
    print("(b) a greedy cover of the other shapes (both GPUs) within 2 %, regret on this shape")
    for s in SHAPES:
        keep = greedy_cover([t for k, t in data.items() if k[1] != s], 0.02)
        rows = [f"{k[0]} {'%.2f / %.1f' % restricted_regret(t, keep)}" for k, t in data.items() if k[1] == s]
        print(f"  {s:17s} {len(keep):3d} configs; {'; '.join(rows)}")
    print("(c) --shortlist-any-shape: the union of qwen3-30b-a3b's and olmoe-1b-7b's H100 profiles (F x),")
    print("    regret on the other H100 profiles, over the configs they timed (mean / max %)")
    for dtype in ("bf16", "fp8"):
        profiles = {}
        for f in sorted(glob.glob(f"benchmarks/results/ramp-nvidia-h100/*-{dtype}/profile-*-token-timings.json.gz")):
            t, _ = load_any_timings(f)
            profiles[t.shape.name] = t
        base = [profiles[s] for s in ("qwen3-30b-a3b", "olmoe-1b-7b") if s in profiles]
        for factor in (1.10, 1.20):
            keep = set().union(*(near(t, factor) for t in base))
            rows = [f"{s} {'%.2f / %.1f' % restricted_regret(t, keep)}" for s, t in profiles.items()
                    if s not in ("qwen3-30b-a3b", "olmoe-1b-7b")]
            pair = [f"{a}->{b} {'%.2f / %.1f' % restricted_regret(profiles[b], near(profiles[a], factor))}"
                    for a, b in (("qwen3-30b-a3b", "olmoe-1b-7b"), ("olmoe-1b-7b", "qwen3-30b-a3b"))
                    if a in profiles and b in profiles]
            print(f"  {dtype} {factor:.2f}x: {len(keep):3d} configs; {'; '.join(rows + pair)}")


if __name__ == "__main__":
    main()
