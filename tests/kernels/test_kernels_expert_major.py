"""fused_moe_expert_major's own schedule (moekit.kernels.expert_major) against float64 experts.

Triton's interpreter on CPU (fp16/fp32; bf16 and FP8 are tested on the GPU). The persistent
kernels run with a small grid here (``LaunchPlan.expert_major_interpret_grid``), so programs walk several units; the
shapes are not multiples of the tiles, and the counts put 0, 1, partial and several blocks in
one call.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moekit.kernels import KernelConfig, LaunchPlan, fused_moe_expert_major  # noqa: E402
from moekit.kernels.align import align_expert_major  # noqa: E402
from moekit.moe.experts import MoEWeights, expert_mlp  # noqa: E402
from moekit.shapes import MoEShape  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # tests/kernels also runs natively on GPUs
SHAPE = MoEShape("tiny", num_experts=5, top_k=2, hidden=48, intermediate=40)
TOL = {torch.float16: 1e-2, torch.float32: 1e-4}
STORED = [  # two_launch, split_k = 1: the expert-major schedule
    KernelConfig(bm=16, bn=32, bk=32, group_m=1, form="two_launch"),
    KernelConfig(bm=32, bn=16, bk=16, group_m=4, form="two_launch"),
    KernelConfig(bm=16, bn=64, bk=64, group_m=8, bn2=32, form="two_launch"),
]


def _case(cap: int, counts: list[int], dtype: torch.dtype, seed: int = 0):
    w = MoEWeights.random(SHAPE, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randn(SHAPE.num_experts, cap, SHAPE.hidden, generator=g).to(dtype)
    return tokens.to(DEVICE), torch.tensor(counts, device=DEVICE), MoEWeights(w.router, w.w13.to(DEVICE), w.w2.to(DEVICE))


def _check_rows(y, tokens, counts, w, dtype):
    assert y.shape == tokens.shape and y.dtype == dtype
    y, tokens = y.cpu(), tokens.cpu()
    for e, n in enumerate(counts.tolist()):
        if n:
            ref = expert_mlp(tokens[e, :n].double(), w.w13[e].double().cpu(), w.w2[e].double().cpu())
            err = ((y[e, :n].double() - ref).norm() / ref.norm()).item()
            assert err < TOL[dtype], (e, n, err)


@pytest.mark.parametrize("cfg", STORED, ids=lambda c: f"bm{c.bm}-bn{c.bn}-bk{c.bk}-g{c.group_m}-n2{c.gemm2_bn}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("grid", [1, 3, 64])
def test_stored_schedule_against_float64(cfg, dtype, grid):
    """Experts with 0 rows, 1 row, a partial block, several blocks and the whole capacity;
    one program walking every unit, a few, and more programs than units."""
    tokens, counts, w = _case(37, [0, 1, 37, 17, 32], dtype)
    y = fused_moe_expert_major(tokens, counts, w.w13, w.w2, cfg, plan=LaunchPlan(expert_major_interpret_grid=grid))
    _check_rows(y, tokens, counts, w, dtype)


@pytest.mark.parametrize("counts", [[0, 0, 0, 0, 0], [3, 0, 0, 0, 0], [0, 0, 0, 0, 20]], ids=["empty", "first", "last"])
def test_stored_schedule_sparse_counts(counts):
    """All experts empty (nothing written, nothing to check but that it runs), or one live
    expert at either end of the table; int32 counts as the low-latency layer hands them."""
    tokens, c, w = _case(20, counts, torch.float32, seed=3)
    y = fused_moe_expert_major(tokens, c.to(torch.int32), w.w13, w.w2, STORED[0])
    _check_rows(y, tokens, c, w, torch.float32)


@pytest.mark.parametrize("cfg", STORED[:2], ids=["bm16", "bm32-g4"])
def test_stored_schedule_equals_the_aligned_token_kernels(cfg):
    """Bitwise: each output row has one writer in both, and both reduce in the same chunk
    order, so the live-block schedule must equal the token path's kernels run over
    ``align_expert_major``'s fixed block table (atomics into zeros, then a cast)."""
    from moekit.kernels.launch import run_blocks

    tokens, counts, w = _case(37, [5, 0, 37, 16, 33], torch.float32, seed=5)
    E, cap, H = tokens.shape
    y = fused_moe_expert_major(tokens, counts, w.w13, w.w2, cfg)
    al = align_expert_major(counts, cap, cfg.bm)
    ref = run_blocks(tokens.reshape(E * cap, H), w.w13, w.w2, None, al, E * cap, torch.float32, a_div=1,
                     out_div=1, config=cfg).reshape(E, cap, H)
    for e, n in enumerate(counts.tolist()):
        assert torch.equal(y[e, :n], ref[e, :n]), e


def test_counts_past_capacity_are_clamped():
    """A count above the capacity (never from a dispatcher) serves the capacity, not more."""
    tokens, counts, w = _case(8, [8, 2, 0, 1, 3], torch.float32, seed=7)
    y = fused_moe_expert_major(tokens, torch.tensor([99, 2, -4, 1, 3], device=DEVICE), w.w13, w.w2, STORED[0])
    _check_rows(y, tokens, counts, w, torch.float32)


def test_bad_counts():
    tokens, counts, w = _case(8, [1, 1, 1, 1, 1], torch.float32)
    with pytest.raises(ValueError, match="int32 or int64"):
        fused_moe_expert_major(tokens, counts.float(), w.w13, w.w2, STORED[0])
    with pytest.raises(ValueError, match="counts must be"):
        fused_moe_expert_major(tokens, counts[:4], w.w13, w.w2, STORED[0])


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("capacity", [1, 63, 256, 257, 4096])
def test_expert_major_default_is_in_every_presets_space(fp8, capacity):
    from moekit.kernels import config_space, expert_major_default
    from moekit.shapes import PRESETS

    cfg = expert_major_default(capacity, fp8)
    assert cfg.form == "two_launch" and cfg.split_k == 1  # the live-block schedule
    assert cfg.bm == (16 if capacity <= 256 else 64)
    for shape in PRESETS.values():
        assert cfg in config_space(shape, None, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16), shape.name
