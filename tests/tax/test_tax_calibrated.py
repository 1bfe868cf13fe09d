"""The calibrated model's blocks: each block is the launches it runs, at the calibration's
efficiencies. Checked against the launches written out by hand (an ideal calibration makes
every launch its own roofline), the kernel-cost hook, the what-if report, and that the tax
package stays a pure model."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import moekit.tax
from moekit.shapes import MoEShape, get_shape
from moekit.tax import TaxModel, tax_report
from moekit.tax.efficiency import CMP_KNOTS, MEM_KNOTS, Calibration, Curve, LaunchCost, RouterCost, StreamCost
from moekit.tax.hardware import PRESETS, Hardware
from moekit.tax.model import tax_shape

BW, PEAK = 4.0e12, 800e12
SHAPE = MoEShape("small-shared", num_experts=8, top_k=2, hidden=512, intermediate=256, num_shared_experts=1,
                 shared_intermediate=384)
ROUTER = (5e-6, 1e-9, 0.0, 0.0, 0.0)


def ideal(sorted_fixed: float = 7e-6, grouped: bool = True) -> Calibration:
    """Every launch exactly at its roofline (efficiency 1, no fixed cost, a sharp corner);
    elementwise launches cost 1 us + bytes at the copy rate."""
    one_m, one_c = Curve(MEM_KNOTS, (1.0,) * len(MEM_KNOTS)), Curve(CMP_KNOTS, (1.0,) * len(CMP_KNOTS))
    roof = LaunchCost(0.0, one_m, one_c, gamma=0.0, p=400.0)
    g = LaunchCost(0.0, one_m, one_c, gamma=0.0, p=400.0, sorted_fixed=sorted_fixed) if grouped else None
    return Calibration("NVIDIA H200", "h200", 132, BW, PEAK, 372e9, 1e-6, dense=roof,
                       stream=StreamCost(1e-6, one_m), grouped=g, router=RouterCost(ROUTER))


def hw() -> Hardware:
    return Hardware("NVIDIA H200", BW, PEAK, 372e9, 1e-6, sms=132)


def roof(nbytes: float, flops: float) -> float:
    return max(nbytes / BW, flops / PEAK)


def stream(nbytes: float) -> float:
    return 1e-6 + nbytes / BW


def dense_block_by_hand(m: int, width: int, h: int) -> float:
    """x @ W13.T, silu, * up, @ W2.T: two GEMMs at their roofline and two elementwise passes."""
    g1 = roof(2 * (m * h + 2 * width * h + m * 2 * width), 2 * m * 2 * width * h)
    g2 = roof(2 * (m * width + h * width + m * h), 2 * m * h * width)
    return g1 + g2 + stream(2 * 2 * m * width) + stream(2 * 3 * m * width)


@pytest.mark.parametrize("m", [1, 3, 64, 1000])
def test_dense_ffn_is_two_gemms_and_two_elementwise_passes(m):
    tm = TaxModel(SHAPE, hw(), n_gpus=1, f=1.0, calibration=ideal())
    width = SHAPE.top_k * SHAPE.intermediate + SHAPE.shared_intermediate  # DenseFA: K N + S
    assert tm.dense_ffn(m) == pytest.approx(dense_block_by_hand(m, width, SHAPE.hidden), rel=1e-9)
    pa = SHAPE.num_experts * SHAPE.intermediate + SHAPE.shared_intermediate
    assert tm.dense_ffn(m, SHAPE.num_experts) == pytest.approx(dense_block_by_hand(m, pa, SHAPE.hidden), rel=1e-9)


@pytest.mark.parametrize("m, bm", [(4, 16), (40, 16), (300, 64)])
def test_moe_block_is_router_experts_and_shared_experts(m, bm):
    rng = np.random.default_rng(m)
    ids = np.stack([np.stack([rng.choice(SHAPE.num_experts, SHAPE.top_k, replace=False) for _ in range(m)])
                    for _ in range(3)])  # [sets, m, K]
    tm = TaxModel(SHAPE, hw(), n_gpus=1, f=1.0, block_size=bm, calibration=ideal())
    p = tm.point(m, "decode", "TP+TP", routing=ids)

    h, n, s = SHAPE.hidden, SHAPE.intermediate, SHAPE.shared_intermediate
    experts = []
    for batch in ids:
        counts = np.bincount(batch.ravel(), minlength=SHAPE.num_experts)
        active, padded = int((counts > 0).sum()), int((np.ceil(counts / bm) * bm).sum())
        nbytes = 2 * (active * 3 * h * n + padded * (2 * h + 2 * n) + 2 * m * h)
        t = roof(nbytes, padded * 6 * h * n)
        if m > bm:  # sorted path: alignment, zeroed float32 output, cast back
            t += 7e-6 + stream(4 * m * h) + stream((4 + 2) * m * h)
        experts.append(t)
    router = ROUTER[0] + ROUTER[1] * m
    shared = dense_block_by_hand(m, s, h) + stream(2 * 3 * m * h)
    t_moe = router + np.mean(experts) + shared
    t_fa = dense_block_by_hand(m, SHAPE.top_k * n + s, h)
    assert p.t_moe == pytest.approx(t_moe, rel=1e-9)
    assert p.t_dense == pytest.approx(t_fa, rel=1e-9)
    assert p.tau == pytest.approx(t_moe / t_fa, rel=1e-9)
    assert "calibrated" in p.cost_model and "grouped-kernel curve" in p.cost_model


def test_without_a_grouped_curve_the_dense_curve_prices_the_experts():
    tm = TaxModel(SHAPE, hw(), n_gpus=1, f=1.0, calibration=ideal(grouped=False), block_size=16)
    p = tm.point(8, "decode", "TP+TP")
    assert "dense curve" in p.cost_model and math.isfinite(p.tau) and p.tau > 0


def test_a_kernel_cost_replaces_the_curve_where_it_covers_every_sample():
    calls = []

    def cost(counts, tokens):
        calls.append((counts.copy(), tokens))
        return 100e-6

    base = TaxModel(SHAPE, hw(), n_gpus=1, f=1.0, block_size=16, calibration=ideal())
    hooked = TaxModel(SHAPE, hw(), n_gpus=1, f=1.0, block_size=16, calibration=ideal(), kernel_cost=cost,
                      kernel_name="test model")
    p0, p1 = base.point(32, "decode", "TP+TP"), hooked.point(32, "decode", "TP+TP")
    router = ROUTER[0] + ROUTER[1] * 32
    shared = dense_block_by_hand(32, SHAPE.shared_intermediate, SHAPE.hidden) + stream(2 * 3 * 32 * SHAPE.hidden)
    assert p1.t_moe == pytest.approx(router + 100e-6 + shared, rel=1e-9)
    assert "test model" in p1.cost_model and p1.t_moe != pytest.approx(p0.t_moe)
    assert calls and all(c.sum() == 32 * SHAPE.top_k and t == 32 for c, t in calls)

    partial = TaxModel(SHAPE, hw(), n_gpus=1, f=1.0, block_size=16, calibration=ideal(),
                       kernel_cost=lambda c, t: None if c[0] > 3 else 100e-6, kernel_name="partial")
    assert "grouped-kernel curve" in partial.point(32, "decode", "TP+TP").cost_model


def test_every_parallelism_runs_calibrated():
    shape = get_shape("qwen2-moe")
    tm = TaxModel(shape, PRESETS["H200"], n_gpus=8, calibration=ideal(), trials=8)
    for p in tm.sweep([1, 64, 4096]):
        assert math.isfinite(p.tau) and p.tau > 0 and p.regime in moekit.tax.REGIMES
        assert abs(sum(p.sources.values()) - (p.tau - 1)) < 1e-9


def test_tax_shape_tensor_parallel_shard():
    s = tax_shape("deepseek-v3-tp8")
    base = get_shape("deepseek-v3")
    assert (s.num_experts, s.top_k, s.hidden) == (base.num_experts, base.top_k, base.hidden)
    assert (s.intermediate, s.shared_intermediate, s.num_shared_experts) == (256, 256, 1)
    assert tax_shape("mixtral-8x7b") == get_shape("mixtral-8x7b")
    with pytest.raises(ValueError, match="tp3 must divide"):
        tax_shape("deepseek-v3-tp3")
    with pytest.raises(ValueError, match="unknown shape"):
        tax_shape("nonsense-tp8")


def test_report_puts_both_models_side_by_side_and_says_what_is_moved():
    text = tax_report("olmoe-1b-7b", "B200", batch_sizes=(1, 512), calibrations=[ideal()])
    assert "calibrated model: B200 (scaled from NVIDIA H200)" in text
    assert "datasheet" in text and "applied unchanged" in text and "not calibrated (both models)" in text
    data = json.loads(tax_report("olmoe-1b-7b", "H200", batch_sizes=(1, 512), calibrations=[ideal()], as_json=True))
    assert data["calibration"]["name"] == "NVIDIA H200"
    assert len(data["points_calibrated"]) == len(data["points"]) and data["points_calibrated"][0]["cost_model"] != \
        data["points"][0]["cost_model"]
    plain = tax_report("olmoe-1b-7b", "H200", batch_sizes=(1,))
    assert "no calibration for this GPU" in plain


# --------------------------------------------------------------------------- purity


FORBIDDEN = ("moekit.bench", "moekit.moe", "moekit.kernels", "moekit.ramp")


def test_tax_package_imports_no_measurement_or_kernel_code():
    package = Path(moekit.tax.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level == 2:  # from ..x import y
                    module = f"moekit.{module}" if module else "moekit"
                    names = [f"{module}.{a.name}" for a in node.names] if module == "moekit" else [module]
                elif node.level == 0:
                    names = [module]
            for name in names:
                assert not name.startswith(FORBIDDEN), f"{path.name} imports {name}"


def test_using_the_calibrated_model_loads_no_measurement_or_kernel_module():
    code = ("import sys, moekit.tax as t\n"
            "from tests.tax.test_tax_calibrated import ideal\n"
            "t.TaxModel('qwen3-30b-a3b', 'H100', calibration=ideal(), trials=4).sweep([1, 64])\n"
            f"bad = [m for m in sys.modules if m.startswith({FORBIDDEN!r})]\n"
            "assert not bad, bad\n")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": f"{root / 'src'}:{root}", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr


@pytest.mark.shipped_calibrations
def test_every_shipped_calibration_loads_and_serves_its_gpu():
    from moekit.tax.report import SHIPPED_CALIBRATIONS, shipped_calibrations

    files = sorted(SHIPPED_CALIBRATIONS.glob("*.json"))
    cals = shipped_calibrations()
    assert len(cals) == len(files)
    for cal in cals:  # each was measured on a GPU and names it
        assert "NVIDIA" in cal.name
    if any("H100" in c.name for c in cals):
        text = tax_report("olmoe-1b-7b", "H100", batch_sizes=(1,))
        assert "calibrated model: NVIDIA H100" in text and "no calibration for this GPU" not in text
