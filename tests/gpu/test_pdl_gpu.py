"""Programmatic dependent launch (moekit.kernels.pdl) on the GPU: the chains of the fused MoE
calls give the same results with PDL on and off.

Where the call is deterministic (the decode schedule, persistent or two kernels; FP8 too; the
expert-major kernels) the outputs must be equal bit for bit, eagerly and in CUDA-graph replays
with the routing redrawn before each (a kernel that started before its predecessor finished
would read a stale intermediate, counter or x and show up as a difference). The forms that add
with float32 atomics (the fused form, sorted two_launch) are compared with the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    # Skip before importing moekit.kernels: on a CPU machine its kernels must be decorated
    # under TRITON_INTERPRET=1, which tests/kernels sets when it is imported.
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytest.importorskip("triton")

from moekit.fp8 import quantize_blocks  # noqa: E402
from moekit.kernels import (KernelConfig, LaunchPlan, expert_major_default, fused_moe,  # noqa: E402
                            fused_moe_expert_major, pdl)
from moekit.moe.experts import MoEWeights  # noqa: E402
from moekit.moe.reference import reference_moe  # noqa: E402
from moekit.routing.generate import synthetic_routing  # noqa: E402
from moekit.shapes import MoEShape  # noqa: E402

HOPPER = torch.cuda.get_device_capability() >= (9, 0)
SHAPE = MoEShape("gpu-pdl", num_experts=32, top_k=4, hidden=1024, intermediate=384)
DECODE = KernelConfig(bm=16, bn=32, bk=128, num_stages=4, split_k=1, form="two_launch")
FP8_DECODE = KernelConfig(bm=16, bn=128, bk=128, num_stages=3, split_k=1, form="two_launch", swap_ab=True)


# PDL on and off, whatever MOEKIT_PDL says (a plan with pdl=None would follow it).
PDL = {True: LaunchPlan(pdl=True), False: LaunchPlan(pdl=False)}


def test_pdl_is_on_where_the_gpu_has_it():
    assert pdl.pdl_on(torch.device("cuda"), PDL[True]) == HOPPER
    assert pdl.pdl_on(torch.device("cuda", torch.cuda.current_device()), PDL[True]) == HOPPER
    assert not pdl.pdl_on(torch.device("cuda"), PDL[False])


def test_device_facts_follow_the_device():
    """occupancy's cached capability and SM count: "cuda" is the current device, "cuda:i" device i."""
    from moekit.kernels.occupancy import capability, sm_count

    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        assert capability(torch.device("cuda", i)) == torch.cuda.get_device_capability(i)
        assert sm_count(torch.device("cuda", i)) == props.multi_processor_count
        with torch.cuda.device(i):
            assert capability(torch.device("cuda")) == torch.cuda.get_device_capability(i)
            assert sm_count(torch.device("cuda")) == props.multi_processor_count


def test_zeros_and_cast_bitwise_torch():
    """The zeroing over memory that held other values, and float32 -> bf16 / fp16 casts of
    values across both ranges (overflow to inf included), bit for bit torch's."""
    junk = torch.full((300_000,), 7.0, device="cuda")
    del junk  # the allocator hands this block to the next tensor of the size
    z = pdl.zeros((300_000,), torch.float32, torch.device("cuda"), PDL[True])
    assert torch.equal(z, torch.zeros_like(z))
    g = torch.Generator(device="cuda").manual_seed(1)
    src = torch.randn(100_003, generator=g, device="cuda") * torch.logspace(-30, 30, 100_003, device="cuda")
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(pdl.cast(src, dtype, PDL[True]), src.to(dtype))


def _weights(seed: int):
    w = MoEWeights.random(SHAPE, seed=seed, dtype=torch.float32)
    return w, w.w13.bfloat16(), w.w2.bfloat16()


def _routing(tokens: int, step: int):
    ids, tw = synthetic_routing(tokens, SHAPE.num_experts, SHAPE.top_k, zipf=1.3 if step % 2 else None,
                                seed=200 + step)
    if step % 3 == 0:
        ids[0, -1] = -1
    return ids, tw


def _both_ways(call):
    """call(plan) without PDL and with it."""
    return call(PDL[False]), call(PDL[True])


def _graph(call):
    """``call`` with PDL on, captured in a CUDA graph (warmed up on a side stream first): (graph, output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(PDL[True])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = call(PDL[True])
    return graph, y


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "two-kernel"])
@pytest.mark.parametrize("tokens", [1, 16])
def test_decode_schedule_bitwise_with_and_without_pdl(precision, persistent, tokens):
    """The decode schedule's chain (zeroing, FP8 quantization of x, the kernel or kernels):
    eager calls with PDL on and off give the same bits, and so do 20 replays of a graph
    captured with PDL on, each with new routing, against eager calls without PDL."""
    w, w13, w2 = _weights(11)
    kw, cfg = {}, DECODE
    if precision == "fp8":
        (w13, s13), (w2, s2) = quantize_blocks(w13, 128), quantize_blocks(w2, 128)
        kw, cfg = dict(w13_scale=s13.cuda(), w2_scale=s2.cuda()), FP8_DECODE
    x = torch.randn(tokens, SHAPE.hidden, generator=torch.Generator().manual_seed(12)).bfloat16().cuda()
    w13, w2 = w13.cuda(), w2.cuda()
    ids0, tw0 = _routing(tokens, 0)
    ids_buf, tw_buf = ids0.cuda(), tw0.cuda()

    def call(plan):
        return fused_moe(x, w13, w2, ids_buf, tw_buf, cfg, alignment="direct", **kw,
                         plan=plan.replace(decode_persistent=persistent))

    off, on = _both_ways(call)
    assert torch.equal(off, on)
    if precision == "bf16":
        ref = reference_moe(x.cpu(), MoEWeights(w.router, w13.cpu(), w2.cpu()), ids0, tw0)
        assert ((on.double().cpu() - ref).norm() / ref.norm()).item() < 1e-2
    graph, y = _graph(call)
    for step in range(1, 21):
        ids, tw = _routing(tokens, step)
        ids_buf.copy_(ids)
        tw_buf.copy_(tw)
        graph.replay()
        eager_off = call(PDL[False])
        torch.cuda.synchronize()
        assert torch.equal(y, eager_off), step


@pytest.mark.parametrize("cfg", [
    KernelConfig(bm=16, bn=64, bk=128, num_stages=4, form="fused"),
    KernelConfig(bm=16, bn=64, bk=64, split_k=2, form="two_launch"),
], ids=["fused", "split-k"])
def test_atomic_forms_with_pdl_match_the_reference(cfg):
    """The forms that zero a float32 buffer, add into it with atomics and cast it (three or four
    kernels in a chain): 20 graph replays with new routing, each against the float64
    reference, at 40 tokens (sorted addressing, the alignment's kernels first)."""
    w, w13, w2 = _weights(13)
    tokens = 40
    x = torch.randn(tokens, SHAPE.hidden, generator=torch.Generator().manual_seed(14)).bfloat16()
    ids0, tw0 = _routing(tokens, 0)
    xd, w13d, w2d, ids_buf, tw_buf = x.cuda(), w13.cuda(), w2.cuda(), ids0.cuda(), tw0.cuda()
    graph, y = _graph(lambda plan: fused_moe(xd, w13d, w2d, ids_buf, tw_buf, cfg, plan=plan))
    ref_w = MoEWeights(w.router, w13, w2)
    for step in range(1, 21):
        ids, tw = _routing(tokens, step)
        ids_buf.copy_(ids)
        tw_buf.copy_(tw)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_moe(x, ref_w, ids, tw)
        assert ((y.double().cpu() - ref).norm() / ref.norm()).item() < 1e-2, step


def test_expert_major_bitwise_with_and_without_pdl():
    """GEMM1 then GEMM2 over the live blocks of an expert-major buffer: bitwise the same with
    PDL on and off, eagerly and in 20 graph replays with new counts."""
    _, w13, w2 = _weights(15)
    E, cap = 8, 48
    w13, w2 = w13[:E].contiguous().cuda(), w2[:E].contiguous().cuda()
    tokens = torch.randn(E, cap, SHAPE.hidden, generator=torch.Generator().manual_seed(16)).bfloat16().cuda()
    counts = torch.tensor([0, 1, 16, 17, 48, 3, 0, 30], device="cuda")

    def call(plan):
        return fused_moe_expert_major(tokens, counts, w13, w2, expert_major_default(cap, False), plan=plan)

    def valid(y):
        return torch.cat([y[e, :int(n)] for e, n in enumerate(counts.tolist())])

    off, on = _both_ways(call)
    assert torch.equal(valid(off), valid(on))
    graph, y = _graph(call)
    g = torch.Generator().manual_seed(17)
    for step in range(20):
        counts.copy_(torch.randint(0, cap + 1, (E,), generator=g))
        graph.replay()
        eager_off = call(PDL[False])
        torch.cuda.synchronize()
        assert torch.equal(valid(y), valid(eager_off)), step
