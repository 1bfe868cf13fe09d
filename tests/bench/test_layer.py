"""`moekit bench layer` on 2 CPU ranks (gloo, Triton's interpreter, the tiny float32 shape):
the record end to end, the check against float64 (and that it catches a wrong output), the
command line and its errors."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the fused kernels are decorated for the interpreter at import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from moekit.bench.layer import (CPU_SHAPE, DEFAULT_VARIANTS, FP8_DIFF, REL_TOL, LayerBenchConfig,  # noqa: E402
                                _Inputs, _References, _results, format_layer_bench, parse_variant,
                                run_layer_bench)
from moekit.bench.report import load_record  # noqa: E402
from moekit.cli import main  # noqa: E402
from moekit.kernels import expert_major_default  # noqa: E402
from moekit.moe import MoEWeights, reference_moe  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run (tests/gpu has the GPU one)")

VARIANTS = DEFAULT_VARIANTS + ("ll-fp8+fused+static", "ll-fp8+fused+ramp", "ll-bf16+torch")
TOKENS = (1, 3)


@pytest.fixture(scope="module")
def cpu_record(tmp_path_factory):
    out = tmp_path_factory.mktemp("layer")
    cfg = LayerBenchConfig(tokens=TOKENS, variants=VARIANTS, iters=2, warmup=1, routings=2)
    return run_layer_bench(cfg, out_dir=str(out))


def test_every_variant_and_T_is_timed_and_checked(cpu_record):
    saved = load_record(cpu_record["path"], kind="layer")
    p, r = saved["params"], saved["results"]
    assert p["backend"] == "gloo" and p["graph"] is False and p["dtype"] == "float32"
    assert p["shape_name"] == CPU_SHAPE.name and p["shape"]["hidden"] == CPU_SHAPE.hidden
    assert [(row["variant"], row["T"]) for row in r["rows"]] == [(v, T) for v in VARIANTS for T in TOKENS]
    for row in r["rows"]:
        assert row["mode"] == "eager" and row["n"] == 2
        assert 0 < row["min_us"] <= row["median_us"] <= row["p95_us"]
        # a real comparison happened (not 0) and is inside the variant's bound
        fp8 = row["variant"].split("+")[1] == "fused_fp8"
        assert row["metric"] == ("calc_diff" if fp8 else "rel_err")
        assert row["bound"] == (FP8_DIFF if fp8 else REL_TOL[torch.float32])
        assert 0 < row["error"] < row["bound"] and row["ok"], row
    assert r["checks_passed"]
    base = {row["T"]: row["median_us"] for row in r["rows"] if row["variant"] == VARIANTS[0]}
    for row in r["rows"]:
        assert row["vs_first"] == pytest.approx(row["median_us"] / base[row["T"]])


def test_the_record_names_the_kernel_configs_and_the_choice(cpu_record):
    r = load_record(cpu_record["path"])["results"]
    by = {(row["variant"], row["T"]): row for row in r["rows"]}
    ll_capacity = 2 * max(TOKENS)  # world * max_m rows per local expert
    static_fp8 = expert_major_default(ll_capacity, True).id
    for T in TOKENS:
        for rank in ("0", "1"):
            assert by["ll-fp8+fused_fp8+static", T]["configs"][rank] == {static_fp8: 3}  # warm-up + 2 timed
            assert sum(by["ll-fp8+fused_fp8+auto", T]["configs"][rank].values()) == 3
            assert by["ll-bf16+torch", T]["configs"][rank] == {}
            assert by["ll-fp8+fused+static", T]["configs"][rank] == {expert_major_default(ll_capacity, False).id: 3}
            # the layer's default off the GPU (and without a model file): the kernel's default
            assert by["ll-fp8+fused+ramp", T]["configs"][rank] == {expert_major_default(ll_capacity, False).id: 3}
    assert "region-analysis fallback" in r["choices"]["ll-fp8+fused_fp8+auto"]
    assert r["choices"]["ll-fp8+fused_fp8+static"].startswith("static")
    assert r["choices"]["ll-fp8+fused+ramp"].startswith("ramp (the default): no RaMP model file")
    assert r["modes"] == {v: "eager" for v in VARIANTS}
    text = format_layer_bench(cpu_record)
    for v in VARIANTS:
        assert v in text
    assert "all variants within their bounds" in text
    assert "checks the command" in cpu_record["params"]["timing"]  # (the command prints the one CPU line)
    if "figures" in cpu_record:  # matplotlib is optional
        assert os.path.getsize(cpu_record["figures"][0]) > 0


def test_the_check_catches_a_wrong_output():
    """The reference and its metric flag an output that is off in one token, for either metric."""
    weights = MoEWeights.random(CPU_SHAPE, seed=3)
    inputs = _Inputs(CPU_SHAPE, 4, routings=2, seed=5, device="cpu", dtype=torch.float32)
    refs = _References(weights, "cpu")
    for name in ("ll-bf16+fused+static", "alltoall+fused_fp8+static"):
        v = parse_variant(name)
        w = refs.weights_for(v)
        x = inputs.x
        if v.quantizes_tokens:
            from moekit.fp8 import dequantize_groups, quantize_groups

            x = dequantize_groups(*quantize_groups(x, 128))
        good = reference_moe(x, w, inputs.ids, inputs.w, dtype=torch.float32)
        bad = good.clone()
        bad[2] = 0  # one token's output lost
        metric = "calc_diff" if v.fp8_experts else "rel_err"
        bound = FP8_DIFF if v.fp8_experts else REL_TOL[torch.float32]
        assert refs.error(v, good, inputs)[metric] < bound
        assert refs.error(v, bad, inputs)[metric] > 10 * bound
        # the FP8 experts' reference differs from the plain one: weights and tokens as the kernel sees them
        if v.fp8_experts:
            plain = reference_moe(inputs.x, weights, inputs.ids, inputs.w, dtype=torch.float32)
            assert refs.error(v, plain, inputs)[metric] > 1e-6 > refs.error(v, good, inputs)[metric]


def test_a_failed_check_fails_the_run_and_says_which():
    cfg = LayerBenchConfig(tokens=(1,), variants=("ll-bf16+torch",), iters=1, warmup=0, graph=False)
    rank = dict(samples={"ll-bf16+torch": {1: [5.0]}}, configs={"ll-bf16+torch": {1: {}}},
                errors={"ll-bf16+torch": {1: dict(rel_err=0.5, calc_diff=0.2)}}, modes={"ll-bf16+torch": "eager"},
                choices={"ll-bf16+torch": "no kernel (torch experts)"}, device="cpu")
    results = _results(cfg, (parse_variant("ll-bf16+torch"),), [rank, rank], torch.float32)
    assert not results["checks_passed"] and not results["rows"][0]["ok"]
    params = dict(world_size=2, backend="gloo", device="cpu", dtype="float32", shape_name="x", iters=1, warmup=0,
                  variants=["ll-bf16+torch"], shape=dict(num_experts=4, top_k=2, hidden=128, intermediate=128))
    text = format_layer_bench({"params": params, "results": results})
    assert "FAILED: ll-bf16+torch T=1" in text


def test_cli_runs_and_prints_progress(capfd, tmp_path):
    assert main(["bench", "layer", "--tokens", "2", "--iters", "1", "--warmup", "0", "--variants",
                 "ll-bf16+torch", "alltoall+torch", "--no-record"]) == 0
    out, err = capfd.readouterr()  # the ranks' progress lines come from their own processes
    assert "[bench layer] ll-bf16+torch T=2: eager" in err and "[bench layer] alltoall+torch T=2" in err
    assert "ll-bf16+torch" in out and "alltoall+torch" in out and "record:" not in out
    assert list(tmp_path.iterdir()) == []


def test_cpu_run_says_it_is_a_smoke_run_and_gives_no_gpu_advice(capfd):
    """One line says what a CPU run is; RaMP's advice to profile the shape "on this GPU" (printed by each
    rank: twice) is not given on the CPU."""
    assert main(["bench", "layer", "--tokens", "1", "--iters", "1", "--warmup", "0", "--routings", "1",
                 "--variants", "ll-fp8+fused_fp8+auto", "--no-record"]) == 0
    out, err = capfd.readouterr()
    assert out.splitlines()[0].startswith("CPU smoke run at toy size") and "ignore its timings" in out
    assert sum("CPU smoke run" in line for line in (out + err).splitlines()) == 1, out + err
    assert "on this GPU" not in out + err and "profile" not in out + err, out + err


@pytest.mark.parametrize("argv, words", [
    (["--variants", "ll-fp9+torch"], ["--variants", "WIRE+EXPERTS"]),
    (["--variants", "ll-fp8+fused"], ["--variants", "+auto, +ramp or +static"]),
    (["--variants", "ll-fp8+torch+auto"], ["--variants", "no kernel CONFIG"]),
    (["--variants", "ll-bf16+torch", "ll-bf16+torch"], ["--variants", "at most once"]),
    (["--tokens", "0"], ["--tokens", ">= 1"]),
    (["--tokens", "2", "2"], ["--tokens", "at most once"]),
    (["--iters", "0"], ["--iters", ">= 1"]),
    (["--warmup", "-1"], ["--warmup", ">= 0"]),
    (["--world-size", "0"], ["--world-size", ">= 1"]),
    (["--world-size", "3"], ["--world-size 3", "divide"]),
    (["--routings", "0"], ["--routings", ">= 1"]),
    (["--graph"], ["--graph", "CUDA"]),
    (["--shape", "mixtral-8x7b", "--variants", "ll-bf16+torch", "--world-size", "3"], ["--world-size 3"]),
])
def test_bad_options_are_one_line_naming_the_option(argv, words, capsys, tmp_path):
    assert main(["bench", "layer", "--out-dir", str(tmp_path)] + argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moekit: error:"), err
    assert all(w in lines[0] for w in words), err
    assert list(tmp_path.iterdir()) == []


def test_fp8_variants_need_shapes_in_blocks_of_128():
    from moekit.bench.layer import check_shape, parse_variants
    from moekit.shapes import MoEShape

    odd = MoEShape("odd", num_experts=4, top_k=2, hidden=96, intermediate=128)
    with pytest.raises(ValueError, match="H=96 must be a multiple of 128"):
        check_shape(odd, 2, parse_variants(["ll-fp8+torch"]))
    check_shape(odd, 2, parse_variants(["ll-bf16+fused+static", "alltoall+torch"]))  # nothing quantizes


def test_cli_default_variants_are_the_library_defaults():
    from moekit.cli import build_parser

    from moekit.bench.layer import CPU_DEFAULTS, GPU_DEFAULTS

    args = build_parser().parse_args(["bench", "layer"])
    assert tuple(args.variants) == DEFAULT_VARIANTS and args.graph is None and args.shape is None
    parser = next(a for a in build_parser()._actions if a.dest == "command").choices["bench"]
    layer = next(a for a in parser._actions if a.dest == "bench_command").choices["layer"]
    text = " ".join(layer.format_help().split())
    for d, where in ((GPU_DEFAULTS, "on GPUs"), (CPU_DEFAULTS, "on the CPU")):  # the help states the library's
        assert f"{' '.join(map(str, d['tokens']))} {where}" in text and f"{d['iters']} {where}" in text
        assert f"{d['warmup']} {where}" in text and f"{d['shape']} {where}" in text
