"""fused_moe and fused_moe_expert_major against the float64 reference.

On CPU this runs Triton's interpreter (TRITON_INTERPRET=1, set in tests/kernels/__init__.py),
where tl.dot is exact for fp16/fp32 but garbage for bf16: bf16 is tested on the GPU only
(tests/gpu/test_fused_moe_gpu.py). Shapes are tiny and deliberately not multiples of the tiles,
so every mask is exercised.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moekit.kernels import (FixupPlan, KernelConfig, LaunchPlan, default_config, fused_moe,  # noqa: E402
                            fused_moe_expert_major)
from moekit.moe.experts import MoEWeights, expert_mlp  # noqa: E402
from moekit.moe.reference import reference_moe  # noqa: E402
from moekit.routing.generate import synthetic_routing  # noqa: E402
from moekit.shapes import MoEShape  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 1e-2, torch.float32: 1e-4}
SHAPE = MoEShape("tiny", num_experts=4, top_k=2, hidden=48, intermediate=40)

# A representative sample: each form, every bm, split-K on (even and uneven shares) and off,
# GROUP_M on and off, tiles smaller and larger than H and N.
CONFIGS = [
    KernelConfig(bm=16, bn=32, bk=32, group_m=1, split_k=1, form="two_launch"),
    KernelConfig(bm=32, bn=16, bk=64, group_m=4, split_k=1, form="two_launch"),
    KernelConfig(bm=16, bn=32, bk=16, group_m=1, split_k=2, form="two_launch"),
    KernelConfig(bm=64, bn=64, bk=16, group_m=8, split_k=4, form="two_launch"),
    KernelConfig(bm=16, bn=32, bk=32, group_m=1, form="fused"),
    KernelConfig(bm=32, bn=16, bk=16, group_m=4, form="fused"),
    KernelConfig(bm=128, bn=64, bk=64, group_m=1, form="fused"),
]
# "two_launch_sk1": under direct addressing (M <= bm) this is the decode schedule, whose GEMM2
# sums a token's experts in registers (no atomics, no float32 buffer, no cast).
FORMS = {"two_launch": CONFIGS[2], "two_launch_sk1": CONFIGS[1], "fused": CONFIGS[5]}


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all()
    return ((y.double().cpu() - ref).norm() / ref.norm()).item()


def _case(M, seed, *, zipf=None, dtype=torch.float16):
    w = MoEWeights.random(SHAPE, seed=seed, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(M, SHAPE.hidden, generator=g)
    ids, tw = synthetic_routing(M, SHAPE.num_experts, SHAPE.top_k, zipf=zipf, seed=seed)
    return x, w, ids, tw


def _check(x, w, ids, tw, cfg, dtype, alignment="auto", plan=None):
    # The reference sees the same rounded inputs as the kernel.
    xd, w13, w2 = (t.to(dtype) for t in (x, w.w13, w.w2))
    ref = reference_moe(xd, MoEWeights(w.router, w13, w2), ids, tw)
    y = fused_moe(xd.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), ids.to(DEVICE), tw.to(DEVICE), cfg,
                  alignment=alignment, plan=plan)
    assert y.shape == x.shape and y.dtype == dtype
    err = _rel_err(y, ref)
    assert err < TOL[dtype], (cfg, dtype, alignment, err)
    return y


# M = 13 fits one block of every bm, so both addressings run: "sort" (the token alignment)
# and "direct" (no alignment; what "auto" picks when M <= bm). float32 for every config (the
# tighter bound); float16 once per form here, and in test_single_token / test_expert_major.
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.form}-bm{c.bm}-bn{c.bn}-bk{c.bk}-g{c.group_m}-sk{c.split_k}")
@pytest.mark.parametrize("alignment", ["sort", "direct"])
def test_configs_uniform_routing(cfg, alignment):
    x, w, ids, tw = _case(13, seed=1)
    _check(x, w, ids, tw, cfg, torch.float32, alignment)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("alignment", ["sort", "direct"])
def test_configs_uniform_routing_float16(form, alignment):
    x, w, ids, tw = _case(13, seed=1)
    _check(x, w, ids, tw, FORMS[form], torch.float16, alignment)


# Shapes that are multiples of the tiles take the unmasked main loops (only padding rows of
# the activations masked); GEMM2's chunk mask stays where split-K leaves a split short.
EVEN_SHAPE = MoEShape("tiny-even", num_experts=4, top_k=2, hidden=64, intermediate=32)
EVEN_CONFIGS = [
    KernelConfig(bm=16, bn=16, bk=32, split_k=1, form="two_launch"),
    KernelConfig(bm=16, bn=16, bk=16, split_k=2, form="two_launch"),  # 2 chunks, 2 splits: whole
    KernelConfig(bm=16, bn=16, bk=16, split_k=4, form="two_launch"),  # 2 chunks, 4 splits: masked
    KernelConfig(bm=32, bn=16, bk=32, bn2=32, form="two_launch"),  # GEMM2's own, wider tile
    KernelConfig(bm=16, bn=32, bk=16, bn2=64, split_k=2, form="two_launch"),
    KernelConfig(bm=16, bn=16, bk=32, form="fused"),
]


@pytest.mark.parametrize("cfg", EVEN_CONFIGS, ids=lambda c: f"{c.form}-bn{c.bn}-bk{c.bk}-sk{c.split_k}-n{c.bn2}")
@pytest.mark.parametrize("alignment", ["sort", "direct"])
def test_whole_tiles_and_gemm2_tile(cfg, alignment):
    w = MoEWeights.random(EVEN_SHAPE, seed=5, dtype=torch.float32)
    g = torch.Generator().manual_seed(105)
    x = torch.randn(13, EVEN_SHAPE.hidden, generator=g)
    ids, tw = synthetic_routing(13, EVEN_SHAPE.num_experts, EVEN_SHAPE.top_k, seed=5)
    _check(x, w, ids, tw, cfg, torch.float32, alignment)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_direct_and_sorted_addressing_agree(form):
    """Same blocks, same tiles, rows in another order: equal up to float32 summation order."""
    x, w, ids, tw = _case(11, seed=8)
    ids[2, 0], ids[5, 1] = -1, -1
    y_sort = _check(x, w, ids, tw, FORMS[form], torch.float32, "sort")
    y_direct = _check(x, w, ids, tw, FORMS[form], torch.float32, "direct")
    torch.testing.assert_close(y_direct, y_sort, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("alignment", ["sort", "direct"])
def test_expert_named_twice_by_one_token(form, alignment):
    """Duplicate slots count twice (the reference sums both): direct addressing adds the two
    weights on one row, sorted addressing keeps two rows."""
    x, w, ids, tw = _case(7, seed=9)
    ids[3, 1] = ids[3, 0]
    ids[6, :] = 2
    _check(x, w, ids, tw, FORMS[form], torch.float32, alignment)


def test_direct_addressing_needs_one_block():
    x, w, ids, tw = _case(20, seed=10)
    with pytest.raises(ValueError, match="direct addressing"):
        fused_moe(x.to(DEVICE), w.w13.to(DEVICE), w.w2.to(DEVICE), ids.to(DEVICE), tw.to(DEVICE), CONFIGS[0],
                  alignment="direct")
    with pytest.raises(ValueError, match="alignment"):
        fused_moe(x.to(DEVICE), w.w13.to(DEVICE), w.w2.to(DEVICE), ids.to(DEVICE), tw.to(DEVICE), CONFIGS[0],
                  alignment="bucket")


@pytest.mark.parametrize("form", sorted(FORMS))
def test_skewed_routing_with_empty_expert(form):
    x, w, ids, tw = _case(19, seed=2, zipf=50.0)  # nearly all tokens on the 2 favourite experts
    ids[ids == int(ids[0, 0])] = int(ids[0, 1])  # ... then empty one expert entirely
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % 4, ids[:, 1])
    used = set(ids.reshape(-1).tolist())
    assert len(used) < SHAPE.num_experts
    _check(x, w, ids, tw, FORMS[form], torch.float16)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("alignment", ["sort", "direct"])
def test_masked_slots(form, alignment):
    x, w, ids, tw = _case(9, seed=3)
    ids[0, 1] = -1
    ids[4, 0] = -1
    ids[7] = -1  # a token with no expert at all gives 0
    y = _check(x, w, ids, tw, FORMS[form], torch.float32, alignment)
    assert (y[7] == 0).all()


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("alignment", ["sort", "direct"])
def test_bad_ids_make_their_tokens_nan(form, alignment):
    """Only -1 masks a slot. Ids E and -2, and an int64 2**40 that would wrap onto expert 0 in
    int32, make exactly their tokens' rows NaN (no host read); the other rows are exact."""
    x, w, ids, tw = _case(9, seed=5)
    ids[2, 1] = -1  # masked: fine
    bad = {3: SHAPE.num_experts, 5: -2, 8: 2**40}
    good = [t for t in range(9) if t not in bad]
    ref = reference_moe(x[good], w, ids[good], tw[good])
    for t, value in bad.items():
        ids[t, 0] = value
    y = fused_moe(x.to(DEVICE), w.w13.to(DEVICE), w.w2.to(DEVICE), ids.to(DEVICE), tw.to(DEVICE), FORMS[form],
                  alignment=alignment).cpu()
    assert torch.isnan(y[sorted(bad)]).all(dim=1).all(), y[sorted(bad)]
    assert _rel_err(y[good], ref) < TOL[torch.float32]


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("alignment", ["sort", "direct"])
def test_all_slots_masked(form, alignment):
    x, w, ids, tw = _case(5, seed=12)
    ids[:] = -1
    y = fused_moe(x.to(DEVICE), w.w13.to(DEVICE), w.w2.to(DEVICE), ids.to(DEVICE), tw.to(DEVICE), FORMS[form],
                  alignment=alignment)
    assert (y == 0).all()


def test_decode_column_tile():
    """32 columns, 64 only where 32 alone would exceed 2 CTAs per SM (132 SMs assumed on CPU)."""
    from moekit.kernels.plan import decode_column_tile as _decode_column_tile

    cpu = torch.device("cpu")
    assert [_decode_column_tile(H, cpu) for H in (48, 2048, 4096, 7168, 8448, 8480, 16384)] == [32] * 5 + [64] * 2


def test_decode_gemm2_plan():
    """The decode GEMM2 splits the named experts until the grid has ~2 CTAs per SM (at most one
    split per block), and widens the config's bk towards 16 KB of w2 per chunk (capped by N,
    and by the config's stages fitting 192 KB shared by the CTAs of an SM); FP8 (1-byte
    elements) by whole 128-wide scale groups, with bm <= 32 towards 32 KB counting stages - 1
    copies of the tiles."""
    from moekit.kernels.plan import decode_gemm2_plan as _decode_gemm2_plan

    cpu = torch.device("cpu")  # 132 SMs
    # olmoe, qwen3: 64 column tiles -> 4 splits (256 CTAs, 96 KB each): 4 stages of 16 KB chunks
    assert _decode_gemm2_plan(2048, 1024, 16, 128, 4, 2, 8, cpu) == (32, 256, 4)
    assert _decode_gemm2_plan(2048, 768, 16, 128, 4, 2, 8, cpu) == (32, 256, 4)
    assert _decode_gemm2_plan(2048, 1024, 16, 128, 4, 2, 1, cpu) == (32, 256, 1)  # one block: no split
    assert _decode_gemm2_plan(4096, 14336, 16, 128, 3, 2, 8, cpu) == (32, 256, 2)  # mixtral: 128 tiles
    assert _decode_gemm2_plan(7168, 256, 16, 64, 3, 2, 8, cpu) == (32, 256, 1)  # 224 tiles; N caps it
    assert _decode_gemm2_plan(16384, 4096, 16, 256, 3, 2, 8, cpu) == (64, 256, 1)  # never below bk
    assert _decode_gemm2_plan(2048, 1024, 64, 64, 4, 2, 8, cpu) == (32, 128, 4)  # 4 of 48 KB would not fit
    assert _decode_gemm2_plan(48, 40, 16, 32, 3, 2, 8, cpu) == (32, 64, 8)  # the tests' tiny shape
    assert _decode_gemm2_plan(2048, 1024, 16, 128, 3, 1, 8, cpu) == (32, 1024, 4)  # FP8: 8 groups of 128
    assert _decode_gemm2_plan(2048, 768, 16, 128, 2, 1, 8, cpu) == (32, 1024, 4)  # FP8: N = 768 in one chunk
    assert _decode_gemm2_plan(2048, 1024, 16, 128, 4, 1, 8, cpu) == (32, 512, 4)  # 3 copies of 48 KB: no
    assert _decode_gemm2_plan(2048, 1024, 32, 128, 3, 1, 8, cpu) == (32, 512, 4)  # 2 copies of 64 KB: no
    assert _decode_gemm2_plan(2048, 1024, 64, 128, 3, 1, 8, cpu) == (32, 256, 4)  # bm = 64: the bf16 rule
    assert _decode_gemm2_plan(7168, 256, 16, 128, 4, 1, 8, cpu) == (32, 256, 1)  # FP8, N caps it: 2 groups


@pytest.fixture(params=["split", "unsplit"])
def decode_splits(request):
    """The decode GEMM2 with the named experts split over several CTAs per column tile (the
    tests' tiny H gives few tiles, so the default plan splits), or forced to one CTA per tile:
    the LaunchPlan fields that say so."""
    return dict(decode_ctas_per_sm=0) if request.param == "unsplit" else {}


@pytest.fixture(params=["persistent", "persistent-split", "two-kernel"])
def decode_impl(request):
    """The decode schedule as one persistent kernel (in the interpreter: its two phases, 5
    programs), the same with 40 programs (more than the GEMM1 tiles, so each tile's reduction
    is split into shares whose partials the last share adds), or as two kernels: the LaunchPlan
    fields that say so."""
    fields = dict(decode_persistent=request.param != "two-kernel")
    if request.param == "persistent-split":
        fields["interpret_grid"] = 40
    return fields


@pytest.mark.parametrize("M", [1, 9])
def test_decode_schedule_split_and_unsplit(decode_impl, decode_splits, M):
    """Every way of running the decode schedule matches the reference, with a -1 slot and
    skewed routing."""
    x, w, ids, tw = _case(M, seed=14, zipf=1.5)
    ids[0, -1] = -1
    _check(x, w, ids, tw, FORMS["two_launch_sk1"], torch.float32, alignment="direct",
           plan=LaunchPlan(**decode_impl, **decode_splits))


@pytest.mark.parametrize("cfg", [KernelConfig(bm=16, bn=16, bk=16, form="two_launch"),
                                 KernelConfig(bm=32, bn=32, bk=32, form="two_launch")], ids=["bk16", "bk32"])
@pytest.mark.parametrize("grid", [1, 7, 64])
def test_persistent_decode_grids(cfg, grid):
    """The persistent decode kernel with one program (it walks every unit), a few, and more
    programs than GEMM1 tiles (reduction shares: 3 for bk = 16, 2 for bk = 32 over H = 48),
    fp16 and fp32, against the reference; a token naming one expert twice and a -1 slot."""
    plan = LaunchPlan(decode_persistent=True, interpret_grid=grid)
    x, w, ids, tw = _case(5, seed=21, zipf=1.2)
    ids[1, 1] = ids[1, 0]
    ids[3, 0] = -1
    for dtype in (torch.float16, torch.float32):
        _check(x, w, ids, tw, cfg, dtype, alignment="direct", plan=plan)


def test_fixup_plan():
    """FP8 split tiles: every share sums its row blocks on the GPU, the last share all of them in
    the interpreter; 16-bit tiles: the last share, the whole tile; never more blocks than rows."""
    from moekit.kernels.plan import fixup_plan

    assert fixup_plan(True, 16, interp=False) == (True, 4)
    assert fixup_plan(True, 16, interp=True) == (False, 4)
    assert fixup_plan(False, 16, interp=False) == (False, 1)
    assert fixup_plan(True, 2, interp=False) == (True, 2)


def test_persistent_split_tiles_summed_in_row_blocks():
    """The split phase-1 tiles summed and stored in 2 and in 4 row blocks (as FP8 tiles are on the
    GPU; here the last share does every block, float32 in the interpreter) match the reference and,
    bit for bit, the whole tile summed at once."""
    plan = LaunchPlan(decode_persistent=True, interpret_grid=40)  # more programs than tiles: split reductions
    x, w, ids, tw = _case(9, seed=23, zipf=1.3)
    ids[2, 0] = -1
    cfg = KernelConfig(bm=16, bn=16, bk=16, form="two_launch")
    whole = _check(x, w, ids, tw, cfg, torch.float32, alignment="direct", plan=plan)
    for blocks in (2, 4):
        in_blocks = plan.replace(fixup_16bit=FixupPlan(shared=False, row_blocks=blocks))
        assert torch.equal(_check(x, w, ids, tw, cfg, torch.float32, alignment="direct", plan=in_blocks), whole), blocks


def test_resident_grid_key_tells_binaries_apart():
    """The persistent grids are cached per binary: a size passed as an argument (H, N are
    constexprs passed positionally), an integer's value and a pointer's 16-byte alignment
    (both specialized by Triton) each change the key; equal arguments give the same key."""
    from moekit.kernels import occupancy

    kernel = type("K", (), {"fn": _case})  # only its name is read
    buf = torch.zeros(8, dtype=torch.float32)
    const = dict(BM=16, num_warps=4)

    def key(*args, cap=2, **extra):
        return occupancy.binary_key(kernel, args, {**const, **extra}, cap)

    base = key(buf, 2048, 768, 1)
    assert key(buf.clone(), 2048, 768, 1) == base
    assert key(buf, 7168, 768, 1) != base  # another H
    assert key(buf, 2048, 768, 16) != base  # an integer Triton specializes differently
    assert key(buf[1:], 2048, 768, 1) != base  # 4 bytes in: no longer 16-byte aligned
    assert key(buf.half(), 2048, 768, 1) != base
    assert key(buf, 2048, 768, 1, BM=32) != base
    assert key(buf, 2048, 768, 1, cap=4) != base


def test_decode_schedule_is_deterministic(decode_impl, decode_splits):
    """No atomic adds in the decode schedule (split partials are added in split order): the
    same call gives the same bits."""
    x, w, ids, tw = _case(9, seed=13)
    args = [t.to(DEVICE) for t in (x, w.w13, w.w2, ids, tw)]
    plan = LaunchPlan(**decode_impl, **decode_splits)
    y1 = fused_moe(*args, FORMS["two_launch_sk1"], alignment="direct", plan=plan)
    y2 = fused_moe(*args, FORMS["two_launch_sk1"], alignment="direct", plan=plan)
    assert torch.equal(y1, y2)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_single_token(form, dtype):
    x, w, ids, tw = _case(1, seed=4)
    _check(x, w, ids, tw, FORMS[form], dtype, "sort")
    _check(x, w, ids, tw, FORMS[form], dtype, "direct")


def test_int32_ids_and_default_config():
    x, w, ids, tw = _case(6, seed=5)
    _check(x, w, ids.to(torch.int32), tw, default_config(6, SHAPE), torch.float32)


def test_zero_tokens():
    w = MoEWeights.random(SHAPE, dtype=torch.float16)
    x = torch.empty(0, SHAPE.hidden, dtype=torch.float16, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    y = fused_moe(x, w.w13.to(DEVICE), w.w2.to(DEVICE), ids, torch.empty(0, 2, device=DEVICE), CONFIGS[0])
    assert y.shape == (0, SHAPE.hidden)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_expert_major(form, dtype):
    E, cap, H = 3, 21, SHAPE.hidden
    w = MoEWeights.random(SHAPE.scaled(num_experts=E), seed=6, dtype=dtype)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randn(E, cap, H, generator=g).to(dtype)
    counts = torch.tensor([5, 0, 21])
    y = fused_moe_expert_major(tokens.to(DEVICE), counts.to(DEVICE), w.w13.to(DEVICE), w.w2.to(DEVICE), FORMS[form])
    assert y.shape == (E, cap, H) and y.dtype == dtype
    y = y.cpu()
    for e in range(E):
        n = int(counts[e])
        if n:
            ref = expert_mlp(tokens[e, :n].double(), w.w13[e].double(), w.w2[e].double())
            assert _rel_err(y[e, :n], ref) < TOL[dtype]


def test_bad_inputs():
    w = MoEWeights.random(SHAPE, dtype=torch.float16)
    x = torch.randn(4, SHAPE.hidden, dtype=torch.float16)
    ids, tw = synthetic_routing(4, 4, 2)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x, w.w13.float(), w.w2, ids, tw, CONFIGS[0])
    with pytest.raises(ValueError, match="w13"):
        fused_moe(x, w.w13[:, :, :8], w.w2, ids, tw, CONFIGS[0])
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, w.w13, w.w2, ids, tw[:, :1], CONFIGS[0])
    with pytest.raises(NotImplementedError, match="FP8"):
        fused_moe(x, w.w13.to(torch.float8_e4m3fn), w.w2, ids, tw, CONFIGS[0])
