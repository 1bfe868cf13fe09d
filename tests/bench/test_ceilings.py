"""moekit.bench.ceilings on the CPU: the units follow from the timed medians and the sizes."""

import pytest
import torch

from moekit.bench.ceilings import measure_ceilings


def test_ceilings_follow_from_their_timings():
    c = measure_ceilings("cpu", torch.float32, 1 << 20, 32, iters=3, warmup=1)
    assert c["copy_bytes"] == 1 << 20 and c["matmul_n"] == 32 and c["matmul_dtype"] == "torch.float32"
    assert c["copy_us"]["n"] == c["matmul_us"]["n"] == 3
    # read + write of every byte, in GB/s; 2 n^3 FLOP, in TFLOP/s
    assert c["hbm_gbps"] == pytest.approx(2 * (1 << 20) / (c["copy_us"]["median"] * 1e-6) / 1e9)
    assert c["matmul_tflops"] == pytest.approx(2 * 32**3 / (c["matmul_us"]["median"] * 1e-6) / 1e12)


@pytest.mark.parametrize("kwargs, match", [(dict(copy_bytes=2), "copy_bytes"), (dict(matmul_n=0), "matmul_n")])
def test_ceilings_reject_bad_sizes(kwargs, match):
    args = dict(copy_bytes=1024, matmul_n=8) | kwargs
    with pytest.raises(ValueError, match=match):
        measure_ceilings("cpu", torch.float32, **args)
