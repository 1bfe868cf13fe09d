"""fused_moe on a GPU: EVERY config of the space in bf16 against the float64 reference.

One shape whose H and N are not multiples of the wide tiles (masks exercised) and whose
power-of-two rounding keeps every tile family in the space; skewed routing with masked slots
and an empty expert. Each config compiles its kernels once (~1 s each), so the full space
takes minutes: set MOEKIT_GPU_SHARD=i/n to run the i-th of n interleaved shards.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Skip before importing moekit.kernels: on a CPU machine its kernels must be decorated
    # under TRITON_INTERPRET=1, which tests/kernels sets when it is imported.
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytest.importorskip("triton")

from moekit.kernels import KernelConfig, LaunchPlan, config_space, fused_moe, fused_moe_expert_major  # noqa: E402
from moekit.moe.experts import MoEWeights, expert_mlp  # noqa: E402
from moekit.moe.reference import reference_moe  # noqa: E402
from moekit.routing.generate import synthetic_routing  # noqa: E402
from moekit.shapes import MoEShape  # noqa: E402

SHAPE = MoEShape("gpu-small", num_experts=8, top_k=2, hidden=320, intermediate=288)
M = 45
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def _shard(configs):
    spec = os.environ.get("MOEKIT_GPU_SHARD")
    if not spec:
        return configs
    i, n = (int(v) for v in spec.split("/"))
    return configs[i::n]


SPACE = config_space(SHAPE, "cuda")
CONFIGS = _shard(SPACE)


def _cid(c: KernelConfig) -> str:
    return f"{c.form}-bm{c.bm}-bn{c.bn}-bk{c.bk}-w{c.num_warps}-s{c.num_stages}-g{c.group_m}-sk{c.split_k}"


def _make_case(m: int, seed: int):
    w = MoEWeights.random(SHAPE, seed=0, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, SHAPE.hidden, generator=g)
    ids, tw = synthetic_routing(m, SHAPE.num_experts, SHAPE.top_k, zipf=1.5, seed=seed + 1)
    ids[ids == 7] = -1  # expert 7 gets no tokens; those slots become masked
    ids[3, 0] = -1
    return x, w, ids, tw


@pytest.fixture(scope="module")
def case():
    return _make_case(M, 1)


@pytest.fixture(scope="module")
def small_case():
    """12 tokens: one block of every bm, so the direct addressing (no alignment) runs too."""
    return _make_case(12, 5)


def _run_and_check(case, cfg, dtype, alignment="auto"):
    x, w, ids, tw = case
    xd, w13, w2 = (t.to(dtype) for t in (x, w.w13, w.w2))
    ref = reference_moe(xd, MoEWeights(w.router, w13, w2), ids, tw)
    y = fused_moe(xd.cuda(), w13.cuda(), w2.cuda(), ids.cuda(), tw.cuda(), cfg, alignment=alignment)
    torch.cuda.synchronize()
    y = y.double().cpu()
    assert torch.isfinite(y).all()
    err = ((y - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], (cfg, alignment, err)


def test_space_size():
    assert len(SPACE) >= 100


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cid)
def test_every_config_bf16(case, small_case, cfg):
    """45 tokens through the token alignment, and 12 tokens through both addressings."""
    _run_and_check(case, cfg, torch.bfloat16, "sort")
    _run_and_check(small_case, cfg, torch.bfloat16, "sort")
    _run_and_check(small_case, cfg, torch.bfloat16, "direct")


@pytest.mark.parametrize("form", ["two_launch", "fused"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(case, form, dtype):
    _run_and_check(case, KernelConfig(bm=32, bn=64, bk=64, form=form), dtype)


@pytest.mark.parametrize("form", ["two_launch", "fused"])
def test_expert_major_bf16(form):
    E, cap = 4, 70
    w = MoEWeights.random(SHAPE.scaled(num_experts=E), seed=3, dtype=torch.bfloat16)
    tokens = torch.randn(E, cap, SHAPE.hidden, generator=torch.Generator().manual_seed(4)).bfloat16()
    counts = torch.tensor([70, 0, 1, 33])
    y = fused_moe_expert_major(tokens.cuda(), counts.cuda(), w.w13.cuda(), w.w2.cuda(),
                               KernelConfig(bm=32, bn=64, bk=64, form=form)).cpu()
    for e in range(E):
        n = int(counts[e])
        if n:
            ref = expert_mlp(tokens[e, :n].double(), w.w13[e].double(), w.w2[e].double())
            assert ((y[e, :n].double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("cfg", [None, KernelConfig(bm=16, bn=64, bk=64, group_m=4)], ids=["default", "bm16-g4"])
def test_expert_major_graph_replay_with_new_counts(cfg):
    """The expert-major schedule reads the counts on the device: one captured call, replayed
    with new tokens and counts (sparse, empty, full), equals an eager call bitwise on the
    valid rows (one writer per row, a fixed reduction order) and the float64 experts."""
    E, cap = SHAPE.num_experts, 70
    w = MoEWeights.random(SHAPE.scaled(num_experts=E), seed=5, dtype=torch.bfloat16)
    w13, w2 = w.w13.cuda(), w.w2.cuda()
    g = torch.Generator().manual_seed(6)
    tokens = torch.empty(E, cap, SHAPE.hidden, dtype=torch.bfloat16, device="cuda")
    counts = torch.zeros(E, dtype=torch.int32, device="cuda")
    fused_moe_expert_major(tokens.normal_(), counts.fill_(3), w13, w2, cfg)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = fused_moe_expert_major(tokens, counts, w13, w2, cfg)
    steps = [[70, 0, 1, 33, 64, 65, 0, 2], [0] * E, [0, 0, 0, 0, 0, 0, 0, 1], [70] * E, [1, 0, 0, 5, 0, 0, 9, 0]]
    for c in steps:
        x = torch.randn(E, cap, SHAPE.hidden, generator=g).bfloat16()
        tokens.copy_(x)
        counts.copy_(torch.tensor(c))
        graph.replay()
        eager = fused_moe_expert_major(tokens, counts, w13, w2, cfg)
        torch.cuda.synchronize()
        for e, n in enumerate(c):
            if n:
                assert torch.equal(y_graph[e, :n], eager[e, :n]), (c, e)
                ref = expert_mlp(x[e, :n].double(), w.w13[e].double(), w.w2[e].double())
                assert ((y_graph[e, :n].double().cpu() - ref).norm() / ref.norm()).item() < 1e-2, (c, e)


@pytest.mark.parametrize("form", ["two_launch", "two_launch_sk1", "fused"])
@pytest.mark.parametrize("tokens", [M, 12], ids=["sorted", "direct"])  # bm = 16: alignment "auto"
def test_cuda_graph_replay_with_new_routing(case, small_case, form, tokens):
    """No host sync: the whole call (alignment included) captures into a CUDA graph, and a
    replay with new routing written into the same input buffers matches an eager call."""
    x, w, ids, tw = case if tokens == M else small_case
    # two_launch_sk1 over 12 tokens is the decode schedule (no atomics)
    cfg = KernelConfig(bm=16, bn=64, bk=64, split_k=4 if form == "two_launch" else 1, form=form.split("_sk")[0])
    xd, w13, w2 = x.bfloat16().cuda(), w.w13.bfloat16().cuda(), w.w2.bfloat16().cuda()
    ids_buf, tw_buf = ids.cuda(), tw.cuda()
    fused_moe(xd, w13, w2, ids_buf, tw_buf, cfg)  # compile and warm up outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(xd, w13, w2, ids_buf, tw_buf, cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = fused_moe(xd, w13, w2, ids_buf, tw_buf, cfg)
    new_ids, new_tw = synthetic_routing(tokens, SHAPE.num_experts, SHAPE.top_k, seed=9)
    ids_buf.copy_(new_ids)
    tw_buf.copy_(new_tw)
    graph.replay()
    torch.cuda.synchronize()
    eager = fused_moe(xd, w13, w2, ids_buf, tw_buf, cfg)
    # atomics: equal up to float32 summation order, then one bf16 rounding
    torch.testing.assert_close(y_graph.float(), eager.float(), rtol=1e-2, atol=1e-2)
    ref = reference_moe(x.bfloat16(), MoEWeights(w.router, w.w13.bfloat16(), w.w2.bfloat16()), new_ids, new_tw)
    assert ((y_graph.double().cpu() - ref).norm() / ref.norm()).item() < 1e-2


DECODE_SHAPE = MoEShape("gpu-decode", num_experts=16, top_k=4, hidden=2048, intermediate=512)


@pytest.mark.parametrize("ctas_per_sm", [0, 2, 16], ids=["unsplit", "default", "split16"])
def test_decode_gemm2_splits_exact_and_deterministic(ctas_per_sm):
    """The decode GEMM2 at H = 2048 on 132 SMs: unsplit (32 tiles of 64 columns, as the plan
    picks with decode_ctas_per_sm = 0), the default (64 tiles x 4 splits) and 64 tiles x 16
    splits. Each matches the reference, and 50 graph replays give the bits of the eager call:
    the last CTA of a tile adds the partials only after all are written (a race would show as
    a wrong or varying sum)."""
    plan = LaunchPlan(decode_ctas_per_sm=ctas_per_sm)
    w = MoEWeights.random(DECODE_SHAPE, seed=3, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, DECODE_SHAPE.hidden, generator=g)
    ids, tw = synthetic_routing(4, DECODE_SHAPE.num_experts, DECODE_SHAPE.top_k, zipf=1.2, seed=5)
    ids[1, 2] = -1
    xd, w13, w2 = (t.bfloat16() for t in (x, w.w13, w.w2))
    ref = reference_moe(xd, MoEWeights(w.router, w13, w2), ids, tw)
    cfg = KernelConfig(bm=16, bn=32, bk=128, split_k=1, form="two_launch")
    args = (xd.cuda(), w13.cuda(), w2.cuda(), ids.cuda(), tw.cuda(), cfg)
    eager = fused_moe(*args, alignment="direct", plan=plan)
    assert ((eager.double().cpu() - ref).norm() / ref.norm()).item() < 1e-2
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(*args, alignment="direct", plan=plan)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused_moe(*args, alignment="direct", plan=plan)
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, eager)


NARROW_SHAPE = MoEShape("gpu-narrow", num_experts=64, top_k=8, hidden=2048, intermediate=256)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "two-kernel"])
@pytest.mark.parametrize("tokens", [1, 16])
def test_decode_schedule_graph_replays_with_new_routing(persistent, tokens):
    """The decode schedule under CUDA-graph replay, routing redrawn before every replay, on a
    shape whose GEMM1 has few tiles (N = 256: 8 tiles of 32 per named expert), so the
    persistent kernel splits each tile's reduction into shares (a cooperative grid of ~2 CTAs
    per SM). 30 replays: each matches the float64 reference and gives the bits of an eager
    call on the same routing (counts and the barrier start from zero in every replay)."""
    plan = LaunchPlan(decode_persistent=persistent)
    w = MoEWeights.random(NARROW_SHAPE, seed=6, dtype=torch.float32)
    x = torch.randn(tokens, NARROW_SHAPE.hidden, generator=torch.Generator().manual_seed(7)).bfloat16()
    w13, w2 = w.w13.bfloat16(), w.w2.bfloat16()
    ids, tw = synthetic_routing(tokens, NARROW_SHAPE.num_experts, NARROW_SHAPE.top_k, zipf=1.3, seed=8)
    cfg = KernelConfig(bm=16, bn=32, bk=128, num_stages=4, split_k=1, form="two_launch")
    xd, w13d, w2d, ids_buf, tw_buf = x.cuda(), w13.cuda(), w2.cuda(), ids.cuda(), tw.cuda()
    fused_moe(xd, w13d, w2d, ids_buf, tw_buf, cfg, alignment="direct", plan=plan)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(xd, w13d, w2d, ids_buf, tw_buf, cfg, alignment="direct", plan=plan)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused_moe(xd, w13d, w2d, ids_buf, tw_buf, cfg, alignment="direct", plan=plan)
    ref_w = MoEWeights(w.router, w13, w2)
    for step in range(30):
        new_ids, new_tw = synthetic_routing(tokens, NARROW_SHAPE.num_experts, NARROW_SHAPE.top_k,
                                            zipf=1.3 if step % 2 else None, seed=100 + step)
        if step % 3 == 0:
            new_ids[0, -1] = -1
        ids_buf.copy_(new_ids)
        tw_buf.copy_(new_tw)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_moe(x, ref_w, new_ids, new_tw)
        assert ((y.double().cpu() - ref).norm() / ref.norm()).item() < 1e-2, step
        assert torch.equal(y, fused_moe(xd, w13d, w2d, ids_buf, tw_buf, cfg, alignment="direct", plan=plan)), step


@pytest.mark.parametrize("tokens", [1, 16])
def test_persistent_stamps_change_nothing(tokens):
    """The probes' timestamps (``LaunchPlan.stamps``): with them the persistent decode kernel gives
    the same bits, and each program's stamps are in the order of its phases (start <= routing
    done <= phase 1 done <= barrier left <= end; a program's last phase-1 unit between routing
    and phase 1 done; a summing share's sum between the two), with every program past the barrier
    after the last one reached it."""
    w = MoEWeights.random(NARROW_SHAPE, seed=6, dtype=torch.float32)
    x = torch.randn(tokens, NARROW_SHAPE.hidden, generator=torch.Generator().manual_seed(7)).bfloat16().cuda()
    w13, w2 = w.w13.bfloat16().cuda(), w.w2.bfloat16().cuda()
    ids, tw = synthetic_routing(tokens, NARROW_SHAPE.num_experts, NARROW_SHAPE.top_k, zipf=1.3, seed=8)
    cfg = KernelConfig(bm=16, bn=32, bk=128, num_stages=4, split_k=1, form="two_launch")
    plain = fused_moe(x, w13, w2, ids.cuda(), tw.cuda(), cfg, alignment="direct")
    stamps = torch.zeros(8 * 1024, dtype=torch.int64, device="cuda")
    stamped = fused_moe(x, w13, w2, ids.cuda(), tw.cuda(), cfg, alignment="direct", plan=LaunchPlan(stamps=stamps))
    torch.cuda.synchronize()
    assert torch.equal(plain, stamped)
    t = stamps.view(-1, 8).cpu()
    t = t[t[:, 0] > 0]
    assert t.shape[0] >= torch.cuda.get_device_properties(0).multi_processor_count
    assert (t[:, :5].diff(dim=1) >= 0).all()
    assert t[:, 3].min() >= t[:, 2].max()  # nobody leaves the barrier before everybody reached it
    unit = t[:, 5] > 0
    assert unit.any()
    assert ((t[unit, 5] >= t[unit, 1]) & (t[unit, 5] <= t[unit, 6]) & (t[unit, 6] <= t[unit, 2])).all()
    summed = t[:, 7] > 0  # the shares that summed a split tile: between their loop's end and epilogue's
    assert ((t[summed, 7] >= t[summed, 5]) & (t[summed, 7] <= t[summed, 6])).all()
