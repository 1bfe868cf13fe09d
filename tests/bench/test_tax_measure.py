"""`moekit tax --measure` at tiny sizes: the whole pipeline (blocks, config choice, timing,
model, record, figure) under Triton's interpreter on the CPU; with CUDA the same tests run
on the GPU.

The blocks are checked against plain float64 references; the model side against the
paper's roofline written out here from first principles.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Kernels are decorated for the interpreter only if this is set before their import.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from moekit.moe.experts import MoEWeights  # noqa: E402
from moekit.moe.reference import reference_moe  # noqa: E402
from moekit.routing.stats import balancedness, expert_counts  # noqa: E402
from moekit.shapes import MoEShape, get_shape  # noqa: E402
from moekit.bench import tax_blocks as tb  # noqa: E402
from moekit.bench import tax_measure as tm  # noqa: E402
from moekit.bench import tax_report as tr  # noqa: E402
from moekit.tax.hardware import load_hardware  # noqa: E402
from moekit.tax.model import REGIMES  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TINY = MoEShape("tiny-shared", num_experts=4, top_k=2, hidden=32, intermediate=32,
                num_shared_experts=1, shared_intermediate=32)


# --------------------------------------------------------------------------- pure pieces


def test_dense_equivalents_follow_seed_table_2():
    # The MoE-tax paper, Table 2: Mixtral N=14336, E=8, K=2; Qwen2-MoE N=2560, E=64, K=8, 8 shared of 2560.
    assert tb.dense_intermediates(get_shape("mixtral-8x7b")) == {"densefa": 2 * 14336, "densepa": 8 * 14336}
    assert tb.dense_intermediates(get_shape("qwen2-moe")) == {"densefa": 8 * 2560 + 8 * 2560,
                                                             "densepa": 64 * 2560 + 8 * 2560}
    # The size check: DensePA of Mixtral is 114688 x 4096 x 3 bf16 matrices = 2.8 GB.
    assert tb.block_memory(get_shape("mixtral-8x7b"), "densepa", 0, 2, 0) == 114688 * 4096 * 3 * 2


def test_parse_batch_sizes():
    assert tm.parse_batch_sizes("4,1, 2,4") == (1, 2, 4)
    assert tm.parse_batch_sizes([8, 2]) == (2, 8)
    for bad in ("", "1,x", "0", [3.5], [True], "70000"):
        with pytest.raises(ValueError, match="batch_sizes"):
            tm.parse_batch_sizes(bad)


def test_memory_check_names_block_and_size():
    shape = get_shape("qwen2-moe")
    tb.check_memory(shape, [1, 4096], 2, 5, 200 * 2**30)  # fits an H200
    with pytest.raises(ValueError, match=r"qwen2-moe densepa at m=4096 needs about"):
        tb.check_memory(shape, [1, 4096], 2, 5, 20 * 2**30)  # the MoE block fits, DensePA does not


def test_bad_config_is_a_clear_error():
    for kwargs, match in (({"beta": 1.5}, "beta"), ({"models": "no-such-model"}, "unknown shape"),
                          ({"configs": -1}, "configs"), ({"iters": 0}, "iters"), ({"dtype": "int8"}, "dtype")):
        with pytest.raises(ValueError, match=match):
            tm._resolve(tm.MeasureConfig(**kwargs))
    if not ON_GPU:
        with pytest.raises(ValueError, match="bfloat16"):
            tm._resolve(tm.MeasureConfig(dtype="bfloat16"))


def test_candidates_default_first_then_nearest_hints_then_sample():
    from moekit.kernels import KernelConfig, default_config

    shape = get_shape("mixtral-8x7b")
    hint = KernelConfig(bm=32, bn=64, bk=64, form="fused")
    sample = [KernelConfig(bm=64), default_config(64, shape)]  # a duplicate of the default
    got = tm.candidate_configs(shape, 64, sample, {16: [KernelConfig(bm=16)], 128: [hint]})
    assert got[0] == default_config(64, shape)
    assert got[1] == hint  # 128 is nearer to 64 than 16 in log2 distance (1 vs 2)
    assert got == list(dict.fromkeys(got)) and len(got) == 3


def test_config_hints_file(tmp_path):
    rec = {"kind": "kernel", "results": {"best": [
        {"model": "mixtral-8x7b", "m": 8, "config": {"bm": 16, "bn": 64, "bk": 128, "split_k": 4}},
        {"model": "qwen2-moe", "m": 8, "config": {"bm": 32}},
        {"m": 64, "config": {"bm": 64, "form": "fused"}},
    ]}}
    path = tmp_path / "best.json"
    path.write_text(json.dumps(rec))
    hints = tm.load_config_hints(str(path), get_shape("mixtral-8x7b"))
    assert sorted(hints) == [8, 64]
    assert hints[8][0].split_k == 4 and hints[64][0].form == "fused"
    # the CPU's shrunk copy of a preset takes the preset's hints
    assert sorted(tm.load_config_hints(str(path), tm.tiny_shape(get_shape("qwen2-moe")))) == [8, 64]

    for text, match in (("{not json", "not valid JSON"), (json.dumps([{"m": 1, "config": {"bm": 17}}]), "bad kernel"),
                        (json.dumps([{"m": 1, "config": {"bq": 1}}]), "unknown fields")):
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(path.name) + ": .*" + match):
            tm.load_config_hints(str(path), get_shape("mixtral-8x7b"))
    with pytest.raises(ValueError, match="cannot read"):
        tm.load_config_hints(str(tmp_path / "missing.json"), get_shape("mixtral-8x7b"))


def test_skew_bias_reaches_the_target_balancedness():
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(512, 16, generator=gen) for _ in range(2)]
    zero, uniform_beta = tb.skew_bias(logits, 2, None, seed=1)
    assert torch.equal(zero, torch.zeros(16)) and uniform_beta > 0.98
    bias, realized = tb.skew_bias(logits, 2, 0.7, seed=1)
    ids = torch.topk(torch.cat(logits) + bias, 2, dim=-1).indices.numpy()
    assert realized == pytest.approx(float(balancedness(expert_counts(ids, 16))))
    assert abs(realized - 0.7) < 0.02


# --------------------------------------------------------------------------- the timed blocks


def test_moe_block_matches_float64_reference():
    kernels = tm.load_kernels(DEVICE)
    w = tb.make_moe_weights(TINY, DTYPE, DEVICE, seed=3)
    x = torch.randn(5, TINY.hidden, generator=torch.Generator().manual_seed(4)).to(DEVICE, DTYPE)
    bias = torch.tensor([2.0, 0.0, -1.0, 0.5], device=DEVICE)  # skewed routing
    cfg = kernels.default_config(5, TINY)
    y = tb.moe_block(x, bias, w, TINY.top_k, cfg, kernels)
    # Independent routing in float64: softmax of the biased logits, top-2, renormalized.
    logits = x.double() @ w.router.double().t() + bias.double()
    p = torch.softmax(logits, dim=-1)
    tw, ids = torch.topk(p, 2, dim=-1)
    tw = tw / tw.sum(-1, keepdim=True)
    ref = reference_moe(x.cpu(), MoEWeights(w.router.cpu(), w.w13.cpu(), w.w2.cpu(), w.shared_w13.cpu(),
                                            w.shared_w2.cpu()), ids.cpu(), tw.cpu(), dtype=torch.float64)
    err = (y.cpu().double() - ref).norm() / ref.norm()
    assert err < tm.TOLERANCE[DTYPE], float(err)


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("measure")
    cfg = tm.MeasureConfig(models=[TINY], batch_sizes=(1, 4), configs=1, iters=2, warmup=0, select_iters=1,
                           input_sets=2, beta=0.6, copy_mib=4, matmul_n=64, seed=5, breakdown=False)
    return tm.run_measure(cfg, out_dir=str(out), log=None), out


def _roofline(shape, hw, widths, rows, elem):
    """The MoE-tax paper's eq. 2 for one device: max(alpha*widths + alpha_act*rows, beta*rows)."""
    h, n = shape.hidden, shape.intermediate
    w_e, d_act, f_e = 3 * h * n * elem, (2 * h + 6 * n) * elem, 6 * h * n
    return max((w_e * widths + d_act * rows) / hw["hbm_bw"], f_e * rows / hw["peak_flops"])


def test_record_and_figure_are_written(run):
    record, out = run
    assert Path(record["paths"]["json"]).parent == out and Path(record["paths"]["png"]).stat().st_size > 1000
    on_disk = json.loads(Path(record["paths"]["json"]).read_text())
    assert on_disk["kind"] == "tax-measure" and on_disk["environment"]["torch"] == torch.__version__
    assert on_disk["results"]["models"]["tiny-shared"]["routings"].keys() == {"uniform", "beta=0.6"}
    assert on_disk["results"] == record["results"]
    # The measured ceilings, as a hardware file the model (and `moekit tax --hardware`) reads.
    hw = load_hardware(record["paths"]["hardware"])
    ceilings = record["results"]["ceilings"]
    assert (hw.hbm_bw, hw.peak_flops) == (ceilings["hbm_gbps"] * 1e9, ceilings["matmul_tflops"] * 1e12)


def test_points_hold_measured_and_predicted_tau(run):
    record, _ = run
    res = record["results"]
    hw = res["hardware"]
    assert hw["hbm_bw"] == res["ceilings"]["hbm_gbps"] * 1e9
    assert hw["peak_flops"] == res["ceilings"]["matmul_tflops"] * 1e12
    assert res["verified"]
    elem = torch.empty((), dtype=DTYPE).element_size()
    k_s = TINY.num_shared_experts * TINY.shared_intermediate / TINY.intermediate
    for label, rres in res["models"]["tiny-shared"]["routings"].items():
        assert [p["m"] for p in rres["points"]] == [1, 4]
        for p in rres["points"]:
            m, mod = p["m"], p["model"]
            t_moe, t_fa = p["t_moe_us"]["median"], p["t_densefa_us"]["median"]
            assert p["t_moe_us"]["n"] == 2 and t_moe > 0 and t_fa > 0
            assert p["tau_measured"] == pytest.approx(t_moe / t_fa)
            assert p["rel_error"]["tau"] == pytest.approx(mod["tau"] / p["tau_measured"] - 1)
            # DenseFA and DensePA predictions: the roofline of K + k_s and E + k_s expert widths.
            fa = _roofline(TINY, hw, TINY.top_k + k_s, m * (TINY.top_k + k_s), elem)
            pa = _roofline(TINY, hw, TINY.num_experts + k_s, m * (TINY.num_experts + k_s), elem)
            assert mod["t_densefa_us"] == pytest.approx(fa * 1e6, rel=1e-9)
            assert mod["t_densepa_us"] == pytest.approx(pa * 1e6, rel=1e-9)
            assert mod["tau_densepa"] == pytest.approx(pa / fa, rel=1e-9)
            # The model was given the timed routing and the chosen kernel's block size.
            assert mod["e_active"] == pytest.approx(p["e_active_timed"])
            assert mod["block_size"] == p["config"]["bm"]
            assert mod["regime"] in REGIMES
            assert p["verify_rel_error"] < tm.TOLERANCE[DTYPE]
            assert len(p["candidates"]) == 2 and p["config_id"] in {c["config"] for c in p["candidates"]}
            assert p["breakdown_us"] == {}  # breakdown=False (test_cli_measure times the parts)
        errors = [abs(p["rel_error"]["tau"]) for p in rres["points"]]
        assert rres["max_abs_error"] == max(errors) and rres["within_target"] == (max(errors) <= 0.3)
        assert f"m={rres['worst_m']}" in rres["explanation"]


def test_skewed_routing_was_timed(run):
    record, _ = run
    routings = record["results"]["models"]["tiny-shared"]["routings"]
    # 4 tokens x 2 sets x top-2 = 16 pairs: beta can only be hit coarsely, but it must drop.
    uni, skew = routings["uniform"]["points"][1], routings["beta=0.6"]["points"][1]
    assert skew["realized_beta"] < uni["realized_beta"]


def test_format_names_every_point(run):
    record, _ = run
    text = tr.format_measure(record)
    assert "tiny-shared, routing uniform" in text and "tiny-shared, routing beta=0.6" in text
    assert text.count("max |error|") == 2 and record["paths"]["json"] in text


def test_cli_measure(tmp_path, capsys):
    from moekit.cli import main

    rc = main(["tax", "--measure", "--model", "mixtral-8x7b", "--batch-sizes", "1", "--iters", "1",
               "--configs", "0", "--out-dir", str(tmp_path)])
    text = capsys.readouterr().out
    assert rc == 0, text
    name = "mixtral-8x7b" if ON_GPU else "mixtral-8x7b-tiny"
    assert f"{name}, routing uniform" in text
    (path,) = (p for p in tmp_path.glob("tax-measure-*.json") if not p.name.endswith("-hardware.json"))
    record = json.loads(path.read_text())
    assert record["params"]["batch_sizes"] == [1]
    (point,) = record["results"]["models"][name]["routings"]["uniform"]["points"]
    assert math.isfinite(point["tau_measured"]) and point["candidates"][0]["median_us"] is None  # no choice
    parts = point["breakdown_us"]
    assert set(parts) == {"router", "experts"} and all(v > 0 for v in parts.values())


# --------------------------------------------------------------------------- recompare


def test_recompare_with_the_records_hardware_reproduces_its_model(run):
    record, _ = run
    rows = tr.recompare(record["paths"]["json"])
    points = [(label, p) for label, rres in record["results"]["models"]["tiny-shared"]["routings"].items()
              for p in rres["points"]]
    assert [(r["routing"], r["m"]) for r in rows] == [(label, p["m"]) for label, p in points]
    for r, (_, p) in zip(rows, points):
        assert r["tau_measured"] == p["tau_measured"]
        # Mean E_active and eta stand in for the ids: exact unless the sets straddle the ridge,
        # which moves tau by less than the spread of the two roofline sides.
        assert r["tau_model"] == pytest.approx(p["model"]["tau"], rel=0.05)
        assert r["model_drift"] == pytest.approx(r["tau_model"] / p["model"]["tau"] - 1, abs=1e-12)
        assert r["error"] == pytest.approx(r["tau_model"] / r["tau_measured"] - 1)
        assert r["regime"] in REGIMES


def test_recompare_with_other_hardware_follows_the_roofline(run):
    record, _ = run
    res = record["results"]
    old = res["hardware"]
    new = {"hbm_bw": old["hbm_bw"] * 3.0, "peak_flops": old["peak_flops"] / 2.0}
    rows = tr.recompare(record, hbm_bw=new["hbm_bw"], peak_flops=new["peak_flops"])
    elem = torch.empty((), dtype=DTYPE).element_size()
    k_s = TINY.num_shared_experts * TINY.shared_intermediate / TINY.intermediate
    by_key = {(r["routing"], r["m"]): r for r in rows}
    for label, rres in res["models"]["tiny-shared"]["routings"].items():
        for p in rres["points"]:
            m, mod, r = p["m"], p["model"], by_key[label, p["m"]]
            mk = m * TINY.top_k
            # T_anc: the recorded launch part plus its HBM traffic at the new bandwidth.
            traffic = elem * m * TINY.hidden * (TINY.top_k + 2)
            anc = mod["t_anc_us"] * 1e-6 - traffic / old["hbm_bw"] + traffic / new["hbm_bw"]
            moe = _roofline(TINY, new, mod["e_active"] + k_s, mod["eta"] * mk + k_s * m, elem) + anc
            fa = _roofline(TINY, new, TINY.top_k + k_s, m * (TINY.top_k + k_s), elem)
            assert r["tau_model"] == pytest.approx(moe / fa, rel=1e-9)
            assert r["t_densefa_error"] == pytest.approx(fa * 1e6 / p["t_densefa_us"]["median"] - 1, rel=1e-9)
            assert r["hbm_bw"] == new["hbm_bw"] and r["peak_flops"] == new["peak_flops"]


def test_recompare_rejects_bad_input(run, tmp_path):
    record, _ = run
    for bad in (0.0, -1.0, float("nan"), "4199"):
        with pytest.raises(ValueError, match="hbm_bw"):
            tr.recompare(record, hbm_bw=bad)
    with pytest.raises(ValueError, match="peak_flops"):
        tr.recompare(record, peak_flops=0)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"kind": "kernel", "results": {}}))
    with pytest.raises(ValueError, match="record"):
        tr.recompare(str(other))
    with pytest.raises(ValueError, match="record"):
        tr.recompare(str(tmp_path / "missing.json"))


def test_cli_recompare(run, capsys):
    from moekit.cli import main

    record, _ = run
    hbm = record["results"]["hardware"]["hbm_bw"] * 2 / 1e9
    assert main(["tax", "--recompare", record["paths"]["json"], "--hbm-bw", str(hbm)]) == 0
    text = capsys.readouterr().out
    rows = tr.recompare(record, hbm_bw=hbm * 1e9)
    assert text.count("| 1 |") == 2 and text.count("| 4 |") == 2 and "tiny-shared, routing beta=0.6" in text
    assert f"{rows[0]['tau_model']:.2f}" in text and f"HBM {hbm:.0f} GB/s" in text


# --------------------------------------------------------------------------- the calibrated model beside it


def _calibration_for_this_device():
    """A calibration of this very device (same name), every launch at its roofline: enough to
    check the plumbing; the numbers themselves are checked in tests/tax."""
    from moekit.bench.report import environment
    from moekit.tax.efficiency import CMP_KNOTS, MEM_KNOTS, Calibration, Curve, LaunchCost, RouterCost, StreamCost
    from moekit.tax.hardware import gpu_key

    name = torch.cuda.get_device_name(0) if ON_GPU else environment()["device"]
    one_m, one_c = Curve(MEM_KNOTS, (1.0,) * len(MEM_KNOTS)), Curve(CMP_KNOTS, (1.0,) * len(CMP_KNOTS))
    roof = LaunchCost(1e-6, one_m, one_c, 0.0, 8.0, 2e-6)
    return Calibration(name, gpu_key(name), 132, 1e12, 1e14, 1e11, 1e-6, dense=roof, stream=StreamCost(1e-6, one_m),
                       grouped=roof, router=RouterCost((5e-6, 0.0, 0.0, 0.0, 0.0)))


@pytest.fixture(scope="module")
def calibrated_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("measure-calibrated")
    cfg = tm.MeasureConfig(models=[TINY], batch_sizes=(1, 4), configs=0, iters=2, warmup=0, select_iters=1,
                           input_sets=2, beta=0.6, copy_mib=4, matmul_n=64, seed=3, breakdown=False,
                           calibration=[_calibration_for_this_device()])
    return tm.run_measure(cfg, out_dir=str(out), log=None), out


def test_every_point_has_both_models(calibrated_run):
    record, _ = calibrated_run
    res = record["results"]
    assert res["calibration"]["name"] == _calibration_for_this_device().name and res["complete"]
    for rres in res["models"]["tiny-shared"]["routings"].values():
        for p in rres["points"]:
            cal, err = p["model_calibrated"], p["rel_error_calibrated"]
            assert err["tau"] == pytest.approx(cal["tau"] / p["tau_measured"] - 1)
            assert err["t_moe"] == pytest.approx(cal["t_moe_us"] / p["t_moe_us"]["median"] - 1)
            assert cal["tau"] == pytest.approx(cal["t_moe_us"] / cal["t_densefa_us"])
            assert "calibrated" in cal["cost_model"] and p["model"]["tau"] != pytest.approx(cal["tau"])
            # The timed routing, per input set, is in the record: m K assignments each.
            assert len(p["expert_counts"]) == 2 and all(sum(c) == p["m"] * TINY.top_k for c in p["expert_counts"])
        errors = [abs(p["rel_error_calibrated"]["tau"]) for p in rres["points"]]
        assert rres["max_abs_error_calibrated"] == max(errors)
    text = tr.format_measure(record)
    assert text.count("calibrated: max |error|") == 2 and "| tiny-shared |" in text


def test_recompare_from_the_records_counts_gives_the_records_calibrated_tau(calibrated_run):
    record, _ = calibrated_run
    rows = tr.recompare(record, calibrations=[_calibration_for_this_device()])
    points = [p for rres in record["results"]["models"]["tiny-shared"]["routings"].values() for p in rres["points"]]
    for r, p in zip(rows, points):
        assert r["tau_calibrated"] == pytest.approx(p["model_calibrated"]["tau"], rel=1e-9)


def test_deadline_skips_models_and_keeps_a_record(tmp_path):
    cfg = tm.MeasureConfig(models=[TINY], batch_sizes=(1,), configs=0, iters=1, warmup=0, select_iters=1,
                           input_sets=1, copy_mib=1, matmul_n=32, deadline_s=1e-9)
    record = tm.run_measure(cfg, out_dir=str(tmp_path), log=None)
    assert record["results"]["skipped_models"] == ["tiny-shared"] and record["results"]["models"] == {}
    assert "png" not in record["paths"] and Path(record["paths"]["json"]).exists()
    assert "not measured (deadline): tiny-shared" in tr.format_measure(record)
