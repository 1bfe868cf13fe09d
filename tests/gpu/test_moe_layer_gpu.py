"""MoELayer with the fused Triton experts on GPUs, against float64 references.

1. One GPU: ``FusedExperts`` on a Dispatcher's expert-major layout (bf16: relative error
   < 1e-2; W8A8 on the weights it quantizes: ``calc_diff`` < 1e-3 against the dequantized
   weights), with bf16 tokens and with e4m3 tokens + group scales, on the valid rows (rows
   past the counts are unspecified). ``MoELayer(experts="fused")`` over the single-process
   all-to-all.
2. Two GPUs (NCCL): ``MoELayer`` over the low-latency layer with the FP8 wire, with each expert
   compute (``torch`` dequantizes the tokens, ``fused`` too, ``fused_fp8`` takes them as they
   are), against the float64 block on the tokens as the wire quantized them; then the whole
   layer (dispatch, fused FP8 experts, combine) captured in one CUDA graph and replayed with new
   tokens and routing written into the same buffers, bitwise equal to eager calls.
3. Two GPUs: ``moekit bench layer`` at this file's shape (graph-captured and eager variants, the
   eager all-to-all): every (variant, T) in the record, in its mode, within its bound of the
   float64 block, with the kernel configs it ran.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Skip before importing moekit.kernels: on a CPU machine its kernels must be decorated
    # under TRITON_INTERPRET=1, which the CPU test modules set.
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytest.importorskip("triton")

from moekit.ep import EPLowLatencyAllToAll, current_device, launch  # noqa: E402
from moekit.fp8 import calc_diff, dequantize_blocks, dequantize_groups, quantize_blocks, quantize_groups  # noqa: E402
from moekit.moe import FusedExperts, MoELayer, MoEWeights, expert_mlp, reference_moe  # noqa: E402
from moekit.routing.generate import synthetic_routing  # noqa: E402
from moekit.shapes import MoEShape  # noqa: E402

SHAPE = MoEShape("gpu-layer", num_experts=16, top_k=4, hidden=1024, intermediate=512)
BF16_TOL, FP8_DIFF = 1e-2, 1e-3
MAX_M, GRAPH_STEPS = 64, 20


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all()
    return ((y.double().cpu() - ref.cpu()).norm() / ref.cpu().norm()).item()


def _dequantized(weights: MoEWeights) -> MoEWeights:
    """The weights as the W8A8 kernel sees them (128 x 128 block scales)."""
    return MoEWeights(weights.router, *(dequantize_blocks(*quantize_blocks(t, 128)) for t in (weights.w13, weights.w2)))


# -- 1. one GPU ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("fp8_tokens", [False, True], ids=["bf16-tokens", "fp8-tokens"])
def test_fused_experts_on_the_gpu(fp8, fp8_tokens):
    w = MoEWeights.random(SHAPE, seed=1)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randn(SHAPE.num_experts, 48, SHAPE.hidden, generator=g)
    counts = torch.randint(0, 49, (SHAPE.num_experts,), generator=g)
    counts[0], counts[1] = 0, 48
    q, s = quantize_groups(tokens.to(torch.bfloat16), 128)
    experts = FusedExperts(w.w13.to("cuda", torch.bfloat16), w.w2.to("cuda", torch.bfloat16), fp8=fp8)
    if fp8_tokens:
        out = experts(q.cuda(), counts.cuda(), s.cuda())
        # the W8A8 kernel takes them as they are; the bf16 one after a dequantize to bf16
        x = dequantize_groups(q, s) if fp8 else dequantize_groups(q, s, torch.bfloat16).float()
    else:
        out = experts(tokens.to("cuda", torch.bfloat16), counts.cuda())
        x = tokens.to(torch.bfloat16).float()
        if fp8:  # the kernel quantizes the tokens per 128 columns
            x = dequantize_groups(*quantize_groups(tokens.to(torch.bfloat16), 128))
    ref_w = _dequantized(w) if fp8 else MoEWeights(w.router, *(t.to(torch.bfloat16) for t in (w.w13, w.w2)))
    out = out.cpu()
    assert out.dtype == torch.bfloat16
    valid, ref = [], []
    for e, c in enumerate(counts.tolist()):
        valid.append(out[e, :c])
        ref.append(expert_mlp(x[e, :c].double(), ref_w.w13[e].double(), ref_w.w2[e].double()))
    valid, ref = torch.cat(valid), torch.cat(ref)
    if fp8:
        assert calc_diff(valid, ref) < FP8_DIFF
    else:
        assert _rel_err(valid, ref) < BF16_TOL


def test_layer_with_fused_experts_on_one_gpu():
    weights = MoEWeights.random(SHAPE, seed=3, dtype=torch.bfloat16, device="cuda")
    layer = MoELayer(SHAPE, weights, experts="fused")
    x = torch.randn(37, SHAPE.hidden, generator=torch.Generator().manual_seed(4)).to("cuda", torch.bfloat16)
    ids, w = layer.router(x)
    y = layer(x, ids, w)
    ref = reference_moe(x.cpu(), MoEWeights.random(SHAPE, seed=3, dtype=torch.bfloat16).to(torch.float64),
                        ids.cpu(), w.cpu())
    assert y.dtype == torch.bfloat16
    assert _rel_err(y, ref) < BF16_TOL


# -- 2. two GPUs, the low-latency layer's FP8 wire -----------------------------------------------

def _layer_over_lowlatency(rank: int, world_size: int) -> dict:
    device = current_device()
    weights = MoEWeights.random(SHAPE, seed=5, dtype=torch.bfloat16, device=device)
    ll = EPLowLatencyAllToAll(MAX_M, SHAPE.hidden, SHAPE.top_k, SHAPE.num_experts, dtype=torch.bfloat16,
                              online_fp8=True)
    layers = {kind: MoELayer(SHAPE, weights, dispatcher=ll, experts=kind) for kind in ("torch", "fused", "fused_fp8")}
    g = torch.Generator().manual_seed(60 + rank)
    T = [MAX_M, 23][rank]
    x = torch.randn(T, SHAPE.hidden, generator=g).to(device, torch.bfloat16)
    ids, w = synthetic_routing(T, SHAPE.num_experts, SHAPE.top_k, zipf=1.2, seed=70 + rank)
    ids[0, -1] = -1  # a masked slot
    ids, w = ids.to(device), w.to(device, torch.float32)
    out = dict(x=x.cpu(), ids=ids.cpu(), w=w.cpu())
    for kind, layer in layers.items():
        out[kind] = layer(x, ids, w).clone().cpu()  # the layer reuses its buffers: copy

    # The whole layer in one graph, replayed with new inputs written into its buffers.
    layer = layers["fused_fp8"]
    sx, sids, sw = x.clone(), ids.clone(), w.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            layer(sx, sids, sw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sy = layer(sx, sids, sw)
    mismatches = 0
    for step in range(GRAPH_STEPS):
        gx = torch.randn(T, SHAPE.hidden, generator=g).to(device, torch.bfloat16)
        gids, gw = synthetic_routing(T, SHAPE.num_experts, SHAPE.top_k, zipf=[None, 1.0, 2.0][step % 3],
                                     seed=1000 * rank + step)
        sx.copy_(gx)
        sids.copy_(gids)
        sw.copy_(gw)
        graph.replay()
        replayed = sy.clone()
        eager = layer(gx, gids.to(device), gw.to(device, torch.float32))
        mismatches += int(not torch.equal(replayed, eager))
    torch.cuda.synchronize()
    out["graph_mismatches"] = mismatches
    ll.finalize()
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_layer_over_the_lowlatency_fp8_wire():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (inherited by the ranks)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    results = launch(_layer_over_lowlatency, 2, backend="nccl")
    weights = MoEWeights.random(SHAPE, seed=5, dtype=torch.bfloat16)
    ref_w = {"plain": weights.to(torch.float64), "w8a8": _dequantized(weights).to(torch.float64)}
    for rank, r in enumerate(results):
        # the tokens as the wire quantized them (the GPU quantizer may differ from the CPU's
        # by one e4m3 step in a few elements: far inside the bounds below)
        xq = dequantize_groups(*quantize_groups(r["x"], 128))
        for kind in ("torch", "fused"):
            err = _rel_err(r[kind], reference_moe(xq, ref_w["plain"], r["ids"], r["w"]))
            assert err < BF16_TOL, (rank, kind, err)
        diff = calc_diff(r["fused_fp8"], reference_moe(xq, ref_w["w8a8"], r["ids"], r["w"]))
        assert diff < FP8_DIFF, (rank, diff)
        assert r["graph_mismatches"] == 0, (rank, r["graph_mismatches"])
        print(f"rank {rank}: fused_fp8 calc_diff {diff:.2e}; {GRAPH_STEPS} graph replays bitwise equal to eager")


# -- 3. `moekit bench layer` on two GPUs ---------------------------------------------------------

@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_bench_layer_on_two_gpus(tmp_path):
    """The benchmark at this file's small shape: every (variant, T) timed in its mode (graphs for
    the low-latency layer, eager for the all-to-all and @eager), each within its bound of the
    float64 block, and the kernel configs each ran named in the record."""
    from moekit.bench.layer import DEFAULT_VARIANTS, LayerBenchConfig, format_layer_bench, run_layer_bench
    from moekit.bench.report import load_record
    from moekit.kernels import expert_major_default

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (inherited by the ranks)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    variants = DEFAULT_VARIANTS + ("ll-fp8+fused_fp8+auto@eager", "ll-bf16+fused+static")
    tokens, iters, warmup = (1, 16), 20, 3
    record = run_layer_bench(LayerBenchConfig(shape=SHAPE, tokens=tokens, variants=variants, iters=iters,
                                              warmup=warmup, routings=4), out_dir=str(tmp_path))
    print(format_layer_bench(record))
    saved = load_record(record["path"], kind="layer")
    p, r = saved["params"], saved["results"]
    assert p["backend"] == "nccl" and p["graph"] is True and p["dtype"] == "bfloat16"
    assert p["device"] == torch.cuda.get_device_name(0) and saved["environment"]["gpu_count"] >= 2
    assert [(row["variant"], row["T"]) for row in r["rows"]] == [(v, T) for v in variants for T in tokens]
    eager = {"alltoall+fused_fp8+static", "ll-fp8+fused_fp8+auto@eager"}
    assert r["modes"] == {v: "eager" if v in eager else "graph" for v in variants}
    capacity = 2 * max(tokens)  # the low-latency layer's rows per local expert
    for row in r["rows"]:
        assert row["n"] == iters and 0 < row["median_us"] <= row["p95_us"], row
        assert 0 < row["error"] < row["bound"] and row["ok"], row
        for rank in ("0", "1"):
            ids = row["configs"][rank]
            if row["mode"] == "graph":  # the one config the graph holds
                assert sum(ids.values()) == 1, row
            else:
                assert sum(ids.values()) == iters + warmup, row
    by = {(row["variant"], row["T"]): row for row in r["rows"]}
    static = expert_major_default(capacity, True).id
    assert by["ll-fp8+fused_fp8+static", 16]["configs"]["0"] == {static: 1}
    assert by["ll-bf16+fused+static", 16]["configs"]["0"] == {expert_major_default(capacity, False).id: 1}
    assert "inside a CUDA graph" in r["choices"]["ll-fp8+fused_fp8+auto"]
    assert "per forward" in r["choices"]["ll-fp8+fused_fp8+auto@eager"]
    if "fallback" in r["choices"]["ll-fp8+fused_fp8+auto"]:  # no model file: the graph holds the default
        assert by["ll-fp8+fused_fp8+auto", 16]["configs"]["0"] == {static: 1}
    assert r["checks_passed"]
