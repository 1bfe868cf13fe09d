"""The region-analysis fallback: valid templates, and on the committed H200 dataset faster than
the torch baseline everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moekit.kernels.configs import config_space, fp8_config_error
from moekit.ramp import fallback as fb
from moekit.ramp.regions import HARDWARE
from moekit.shapes import MoEShape

DATASET = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "kernel-nvidia-h200"
           / "kernel-nvidia-h200-1x-20261123T053014Z-table.json.gz")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("dims", [(64, 8, 2048, 1024), (8, 2, 4096, 14336), (256, 8, 7168, 256), (4, 2, 48, 40)])
def test_templates_are_valid_configs_of_the_space(dtype, dims):
    shape = MoEShape("t", *dims)
    if dtype == torch.float8_e4m3fn and (shape.hidden % 128 or shape.intermediate % 128):
        pytest.skip("FP8 needs multiples of 128")
    ts = fb.templates(shape, HARDWARE["h200"], dtype)
    space = set(config_space(shape, dtype=dtype))
    assert ts and all(c in space for c in ts)
    assert all(c.form == "two_launch" for c in ts) or len(ts) == 1
    if dtype == torch.float8_e4m3fn:
        assert all(fp8_config_error(c) is None for c in ts)
    if dims == (8, 2, 4096, 14336) and dtype == torch.bfloat16:  # region B: swizzled, and split-K variants
        assert any(c.group_m > 1 for c in ts) and any(c.split_k > 1 for c in ts)
    if dims == (64, 8, 2048, 1024):  # region A: no swizzle, no split-K
        assert all(c.group_m == 1 and c.split_k == 1 for c in ts)


def test_estimate_grows_with_the_work():
    shape = MoEShape("e", 64, 8, 2048, 1024)
    hw = HARDWARE["h200"]
    c = fb.templates(shape, hw)[-1]
    few = [0] * 64
    few[0] = 8
    many = [64] * 64
    assert fb.estimate_us(shape, c, many, 512, hw) > fb.estimate_us(shape, c, few, 512, hw) > 0


def test_fallback_never_slower_than_the_torch_baseline_on_the_dataset():
    from moekit.bench.kernel_report import load_table
    from moekit.ramp.analysis import fallback_check
    from moekit.ramp.dataset import from_kernel_table

    table = load_table(DATASET)
    for name in table["shapes"]:
        r = fallback_check(from_kernel_table(table, name), HARDWARE["h200"])
        assert r["not_timed"] == 0
        assert r["slower_than_baseline"] == 0 and r["vs_baseline_min"] > 1.0, (name, r)
