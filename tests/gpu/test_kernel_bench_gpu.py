"""`moekit bench kernel` and ``time_cold`` on a GPU: the timing method, then a small real run.

Bounds come from arithmetic and the device's own measured ceilings, not from expected
timings: a kernel cannot read HBM faster than the measured copy bandwidth allows (else the
events missed work or the data came from L2), and a flushed L2 must make an L2-sized read
slower than an unflushed one. Prints a compact summary (run with -s to see it).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    # Skip before importing moekit.kernels (on a CPU machine it must be imported under
    # TRITON_INTERPRET=1, which the CPU test modules set).
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytest.importorskip("triton")

from moekit.bench.kernel import KernelBench, KernelBenchConfig, measure_ceilings  # noqa: E402
from moekit.bench.kernel_report import summarize_table  # noqa: E402
from moekit.bench.stats import summarize  # noqa: E402
from moekit.bench.timing import L2Flusher, time_cold  # noqa: E402


@pytest.fixture(scope="module")
def ceilings():
    return measure_ceilings(torch.device("cuda"), torch.bfloat16, 1 << 30, 8192)


def test_flush_makes_an_l2_sized_read_cold():
    """Summing a buffer of a third of the L2: served from L2 when not flushed, from HBM after a flush."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    buf = torch.randn(l2 // 3 // 4, device="cuda")  # a third: well inside L2 even if it is split in two
    out = torch.empty((), device="cuda")
    fn = lambda: torch.sum(buf, dim=0, out=out)  # noqa: E731
    warm = summarize(time_cold(fn, iters=50, warmup=5, flush_bytes=0))["median"]
    cold = summarize(time_cold(fn, iters=50, warmup=5, flusher=L2Flusher()))["median"]
    print(f"\nread of {buf.numel() * 4 / 1e6:.0f} MB: {warm:.1f} µs with warm L2, {cold:.1f} µs after a flush")
    assert cold > 1.15 * warm


def test_graph_replay_removes_launch_gaps():
    """200 tiny kernels: eager calls are host-bound (~10 µs a launch here), one graph replay is not."""
    x = torch.zeros(1, device="cuda")

    def many():
        for _ in range(200):
            x.add_(1.0)

    eager = summarize(time_cold(many, iters=20, warmup=3, capture=False, flush_bytes=0))["median"]
    graph = summarize(time_cold(many, iters=20, warmup=3, capture=True, flush_bytes=0))["median"]
    print(f"\n200 tiny kernels: eager {eager:.0f} µs, one graph replay {graph:.0f} µs")
    assert graph < 0.7 * eager


def test_small_real_run(ceilings):
    """olmoe at M = 4 and 256, two betas, every 24th config: all pass the check against the
    torch baseline, and no time beats the device's measured HBM bandwidth over the weights."""
    cfg = KernelBenchConfig(models=("olmoe-1b-7b",), m_values=(4, 256), betas=(1.0, 0.5), config_stride=24,
                            iters=20, compile_workers=4)
    table = KernelBench(cfg, log=print).run()
    assert table["points"] and not table["incomplete"]
    rows = summarize_table(table)["rows"]
    for p, row in zip(table["points"], rows):
        assert p["errors"] == {}, p["errors"]
        assert p["baseline"]["rel_err_vs_reference"] < 1e-2
        assert all(t is not None for t in p["median_us"])
        # The weights of the touched experts must come from HBM at most at the measured rate.
        assert row["best_us"] >= 0.9 * p["weight_bytes"] / (ceilings["hbm_gbps"] * 1e3), row
        print(f"{row['shape']} M={row['M']} beta={row['beta']}: best {row['best']} {row['best_us']:.1f} µs "
              f"({row['hbm%']:.0f}% HBM, {row['tc%']:.1f}% TC), baseline {row['baseline_us']:.1f} µs "
              f"({p['baseline']['impl']}), default {row['default_us']:.1f} µs")
