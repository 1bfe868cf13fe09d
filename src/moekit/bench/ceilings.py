"""The device's ceilings, measured: HBM bandwidth and dense matmul throughput.

Benchmarks report a block's time against what the device can do, measured in the same run:

* HBM bandwidth: an elementwise multiply by 1.0 of a large float32 buffer into another, which
  reads and writes every byte once (both counted). An SM kernel on purpose, not
  ``dst.copy_(src)``: inside a CUDA graph a same-device copy becomes a memcpy node that a
  copy engine runs, which is slower than the SMs, and the blocks these ceilings are compared
  with read their weights with SM kernels.
* Matmul throughput: ``torch.matmul`` of two random n x n matrices in the run's dtype
  (2 n^3 FLOP).

Both are timed as eager calls with :func:`moekit.bench.timing.time_fn` (CUDA events on a GPU):
each call is long (a 1 GiB copy, an 8192^3 product take about a millisecond), so the host's
launch time is negligible. Units: GB/s (1e9 bytes per second) and TFLOP/s (1e12).
"""

from __future__ import annotations

import torch

from moekit.bench.stats import summarize
from moekit.bench.timing import time_fn


def measure_ceilings(device: torch.device | str, dtype: torch.dtype, copy_bytes: int, matmul_n: int,
                     iters: int = 20, warmup: int = 5) -> dict:
    """HBM bandwidth (``hbm_gbps``, GB/s, read + write) over ``copy_bytes`` and matmul
    throughput (``matmul_tflops``, TFLOP/s) at ``matmul_n``^3 in ``dtype``, the medians of
    ``iters`` timed calls each after ``warmup``; with the sizes and the timing summaries
    (``copy_us``, ``matmul_us``)."""
    device = torch.device(device)
    if not isinstance(copy_bytes, int) or copy_bytes < 4:
        raise ValueError(f"copy_bytes must be an int >= 4, got {copy_bytes!r}")
    if not isinstance(matmul_n, int) or matmul_n < 1:
        raise ValueError(f"matmul_n must be an int >= 1, got {matmul_n!r}")
    gen = torch.Generator(device=device).manual_seed(12345)
    nbytes = copy_bytes // 4 * 4
    copy_us = _copy_us(device, nbytes, gen, iters, warmup)  # its buffers are freed before the matmul's
    mm_us = _matmul_us(device, dtype, matmul_n, gen, iters, warmup)
    return {"hbm_gbps": 2 * nbytes / (copy_us["median"] * 1e-6) / 1e9, "copy_bytes": nbytes,
            "matmul_tflops": 2 * matmul_n**3 / (mm_us["median"] * 1e-6) / 1e12, "matmul_n": matmul_n,
            "matmul_dtype": str(dtype), "copy_us": copy_us, "matmul_us": mm_us}


def _copy_us(device: torch.device, nbytes: int, gen: torch.Generator, iters: int, warmup: int) -> dict:
    """Timing summary of reading and writing ``nbytes`` once each (float32, an SM kernel)."""
    src = torch.rand(nbytes // 4, generator=gen, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return summarize(time_fn(lambda: torch.mul(src, 1.0, out=dst), iters=iters, warmup=warmup, device=device))


def _matmul_us(device: torch.device, dtype: torch.dtype, n: int, gen: torch.Generator, iters: int,
               warmup: int) -> dict:
    """Timing summary of one n x n x n matmul of random data in ``dtype``."""
    a = torch.randn(n, n, generator=gen, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, generator=gen, device=device, dtype=torch.float32).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    return summarize(time_fn(lambda: torch.matmul(a, b, out=c), iters=iters, warmup=warmup, device=device))
