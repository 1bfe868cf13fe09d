"""Launching a config's kernels over token blocks: the buffers, the grids and the launches of
``token_kernels`` and ``decode_kernels`` for one call (:func:`run_blocks`, and
:func:`run_persistent` for the decode schedule's single launch). The choices that are not the
config's come from a :class:`~moekit.kernels.plan.LaunchPlan`.
"""

from __future__ import annotations

import torch

from moekit.kernels import pdl
from moekit.kernels.align import Alignment, DirectBlocks
from moekit.kernels.bound import launch as bound_launch
from moekit.kernels.bound import remembered
from moekit.kernels.backend import HAVE_TRITON, interpreting, triton
from moekit.kernels.configs import KernelConfig
from moekit.kernels.inputs import FP8
from moekit.kernels.occupancy import resident_grid
from moekit.kernels.plan import DEFAULT_PLAN, LaunchPlan, decode_gemm2_plan, fixup_plan
from moekit.kernels.quant import FP8_GROUP

if HAVE_TRITON:
    from moekit.kernels.decode_kernels import gemm2_decode_kernel, persistent_decode_kernel
    from moekit.kernels.token_kernels import fused_kernel, gemm1_swiglu_kernel, gemm2_kernel


def precision(dtype: torch.dtype) -> str:
    # float32 inputs: exact float32 products ("ieee"), not tf32, so fp32 runs can be checked
    # to 1e-4 and serve as a precise path; 16-bit inputs use the tensor cores as they are.
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_schedule(config: KernelConfig, al: Alignment | DirectBlocks) -> bool:
    """two_launch over direct addressing without split-K: GEMM2 sums a token's experts in
    registers (``decode_kernels``), so there are no atomics, no zeroed float32 buffer and no
    final cast."""
    return config.form == "two_launch" and config.split_k == 1 and isinstance(al, DirectBlocks)


def scale_args(scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, unused: torch.Tensor):
    """The kernels' FP8 scale arguments: (x scales, stride), (w13 scales, 3 strides), (w2 scales,
    3 strides). Without FP8 they are never read: any pointer (``unused``) and zero strides."""
    if scales is None:
        return (unused, 0), (unused, 0, 0, 0), (unused, 0, 0, 0)
    xs, w13s, w2s = scales
    return (xs, xs.stride(0)), (w13s, *w13s.stride()), (w2s, *w2s.stride())


def intermediate(rows: int, N: int, dtype: torch.dtype, fp8: bool, unused: torch.Tensor):
    """two_launch's intermediate ``[rows, N]`` (e4m3 under FP8, else ``dtype``) and its scale
    arguments (FP8: the [rows, N/128] float32 scales and their row stride; else never read).
    Uninitialised: GEMM1 writes every row of every block it runs, GEMM2 reads only those."""
    inter = torch.empty(rows, N, dtype=FP8 if fp8 else dtype, device=unused.device)
    if not fp8:
        return inter, (unused, 0)
    inter_s = torch.empty(rows, N // FP8_GROUP, dtype=torch.float32, device=unused.device)
    return inter, (inter_s, inter_s.stride(0))


def run_blocks(x2d: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor | None,
               al: Alignment | DirectBlocks, out_rows: int, out_dtype: torch.dtype, a_div: int, out_div: int,
               config: KernelConfig, scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               plan: LaunchPlan = DEFAULT_PLAN, accumulator: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernels of ``config`` over the token blocks of ``al``: the ``[out_rows, H]``
    output in ``out_dtype``.

    ``al`` is an alignment (sorted addressing) or :class:`DirectBlocks` (direct addressing,
    no alignment). ``scales`` = (x_scale [rows of x2d, H/128], w13_scale, w2_scale) selects
    the FP8 kernels (x2d, w13, w2 then e4m3); None the bf16/fp16/fp32 ones. Except in the
    decode schedule (:func:`decode_schedule`), the kernels add into a zeroed float32 buffer with
    atomics, cast once at the end (``expert_major`` has the expert-major layout's own
    two_launch kernels, which store each row once). ``accumulator``: that float32 buffer
    ``[out_rows, H]``, already zeroed by the caller (the alignment's launch zeroes it); None:
    zeroed here.
    """
    H = x2d.shape[1]
    N = w2.shape[2]
    device = x2d.device
    num_m = al.max_blocks
    decode = decode_schedule(config, al)
    if num_m == 0:
        return torch.zeros(out_rows, H, dtype=out_dtype, device=device)
    if decode:
        out = torch.empty(out_rows, H, dtype=out_dtype, device=device)
    else:
        out = accumulator if accumulator is not None else pdl.zeros((out_rows, H), torch.float32, device, plan)
    fp8 = scales is not None
    prec = precision(x2d.dtype)
    c = config
    mul_weight = weights is not None
    wptr = weights if mul_weight else out  # any pointer; never read when MUL_WEIGHT is False
    addr, addr_const = al.kernel_args()
    on = pdl.pdl_on(device, plan)
    launch = dict(num_warps=c.num_warps, num_stages=c.num_stages, PDL=on, **pdl.launch_options(on))
    xs_args, w13s_args, w2s_args = scale_args(scales, out)
    soft = fp8 and interpreting()
    if c.form == "fused":
        grid = (num_m * triton.cdiv(N, c.bn),)
        bound_launch(fused_kernel, grid,
            x2d, w13, w2, out, wptr, *addr, num_m, H, N,
            x2d.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
            w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
            xs_args[0], w13s_args[0], w2s_args[0], xs_args[1], *w13s_args[1:], *w2s_args[1:],
            A_DIV=a_div, OUT_DIV=out_div, **addr_const, MUL_WEIGHT=mul_weight,
            BM=c.bm, BN=c.bn, BK=c.bk, GROUP_M=c.group_m, PRECISION=prec, FP8=fp8, SOFT_ROUND=soft,
            SWAP_AB=c.swap_ab, EARLY=pdl.early("fused", on, grid[0], device, plan), **launch,
        )
        return pdl.cast(out, out_dtype, plan)
    # Padding rows of blocks past the real end are never written nor read; rows inside real
    # blocks are all written by GEMM1, so empty() is safe.
    inter, is_args = intermediate(al.capacity, N, x2d.dtype, fp8, out)
    if decode and plan.decode_persistent:
        run_persistent(x2d, w13, w2, wptr, inter, out, al, config, fp8, prec, soft,
                       xs_args, w13s_args, w2s_args, is_args, plan)
        return out
    if decode:
        bn2, bk2, splits = decode_gemm2_plan(H, N, c.bm, c.bk, c.num_stages, inter.element_size(), num_m, device,
                                             plan)
        tiles = triton.cdiv(H, bn2)
        # Split partials and arrival counts (zeroed by GEMM1) only where the experts are split.
        part = torch.empty(splits, c.bm, H, dtype=torch.float32, device=device) if splits > 1 else out
        count = torch.empty(tiles, dtype=torch.int32, device=device) if splits > 1 else out
        counters = triton.next_power_of_2(tiles) if splits > 1 else 0
    else:
        count, tiles, counters = out, 0, 0
    grid1 = (num_m * triton.cdiv(N, c.bn),)
    bound_launch(gemm1_swiglu_kernel, grid1,
        x2d, w13, inter, count, tiles, *addr, num_m, H, N,
        x2d.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), inter.stride(0),
        xs_args[0], w13s_args[0], is_args[0], xs_args[1], *w13s_args[1:], is_args[1],
        A_DIV=a_div, **addr_const, BM=c.bm, BN=c.bn, BK=c.bk, COUNTERS=counters, GROUP_M=c.group_m,
        PRECISION=prec, FP8=fp8, SOFT_ROUND=soft, SWAP_AB=c.swap_ab,
        EARLY=pdl.early("gemm1", on, grid1[0], device, plan), **launch,
    )
    if decode:
        ids, num_tokens, top_k, num_experts = addr[4:]
        bound_launch(gemm2_decode_kernel, (tiles, splits),
            inter, w2, out, part, count, wptr, ids, num_tokens, top_k, num_experts, H, N,
            inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
            is_args[0], w2s_args[0], is_args[1], *w2s_args[1:],
            MAX_BLOCKS=num_m, N_CHUNKS=triton.cdiv(N, bk2), SPLITS=splits, RUNTIME_TRIP=not interpreting(),
            KP=addr_const["KP"], BINS=addr_const["BINS"],
            BM=c.bm, BN=bn2, BK=bk2, PRECISION=prec, FP8=fp8, **launch,
        )
        return out
    grid2 = (num_m * triton.cdiv(H, c.gemm2_bn), c.split_k)
    per_split = triton.cdiv(triton.cdiv(N, c.bk), c.split_k)  # whole BK chunks per split
    bound_launch(gemm2_kernel, grid2,
        inter, w2, out, wptr, *addr, num_m, H, N,
        inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
        is_args[0], w2s_args[0], is_args[1], *w2s_args[1:],
        OUT_DIV=out_div, **addr_const, MUL_WEIGHT=mul_weight,
        PER_SPLIT=per_split, WHOLE_CHUNKS=N % c.bk == 0 and per_split * c.split_k == N // c.bk,
        BM=c.bm, BN=c.gemm2_bn, BK=c.bk, GROUP_M=c.group_m, PRECISION=prec, FP8=fp8,
        SWAP_AB=c.swap_ab, EARLY=pdl.early("gemm2", on, grid2[0] * grid2[1], device, plan), **launch,
    )
    return pdl.cast(out, out_dtype, plan)


def run_persistent(x2d, w13, w2, wptr, inter, out, al: DirectBlocks, c: KernelConfig, fp8: bool, prec: str,
                   soft: bool, xs_args, w13s_args, w2s_args, is_args, plan: LaunchPlan = DEFAULT_PLAN) -> None:
    """The decode schedule as ``persistent_decode_kernel``: one cooperative launch on the GPU
    (a grid as large as the SMs hold, so its barrier cannot wait on a CTA that is not running);
    two launches, one per phase, in the interpreter. Writes ``out``."""
    H, N = x2d.shape[1], w2.shape[2]
    device = x2d.device
    num_m = al.max_blocks
    bn2, bk2, splits2 = decode_gemm2_plan(H, N, c.bm, c.bk, c.num_stages, inter.element_size(), num_m, device, plan)
    tiles2 = triton.cdiv(H, bn2)
    max_splits1 = max(1, min(triton.cdiv(H, c.bk), plan.persistent_max_splits))
    addr, addr_const = al.kernel_args()
    ids, num_tokens, top_k, num_experts = addr[4:]
    interp = interpreting()
    on = pdl.pdl_on(device, plan)
    stamped = plan.stamps is not None
    # (MAX_BLOCKS bounds only the interpreter's loops: 0 on the GPU, so every M shares a binary)
    shared_fixup, fix_blocks = fixup_plan(fp8, c.bm, interp, plan)
    const = dict(MAX_BLOCKS=num_m if interp else 0, MAX_SPLITS1=max_splits1, SPLITS2=splits2,
                 RUNTIME_TRIP=not interp, KP=addr_const["KP"], BINS=addr_const["BINS"], BM=c.bm, BN1=c.bn,
                 BK1=c.bk, BN2=bn2, BK2=bk2, PRECISION=prec, FP8=fp8, SOFT_ROUND=soft,
                 SWAP_AB=c.swap_ab, SHARED_FIXUP=shared_fixup, FIX_BLOCKS=fix_blocks, STAMPS=stamped, PDL=on,
                 num_warps=c.num_warps, num_stages=c.num_stages, **pdl.launch_options(on))

    def args(sync, part1, part2):
        return (x2d, w13, w2, inter, out, part1, part2, sync, stamps, wptr, ids, num_tokens, top_k, num_experts,
                H, N, x2d.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), w2.stride(0), w2.stride(1),
                w2.stride(2), inter.stride(0), out.stride(0),
                xs_args[0], w13s_args[0], w2s_args[0], is_args[0], xs_args[1], *w13s_args[1:], *w2s_args[1:],
                is_args[1])

    f32 = torch.empty(1, dtype=torch.float32, device=device)  # the partials' pointers where there are none
    stamps = plan.stamps if stamped else f32
    if interp:
        grid = plan.interpret_grid
        launches = [dict(PHASES=1), dict(PHASES=2)]
    else:
        launches = [dict(PHASES=3, launch_cooperative_grid=True)]
        grid = remembered("persistent grid", lambda: resident_grid(
            persistent_decode_kernel, args(torch.empty(1, dtype=torch.int32, device=device), f32, f32),
            {**launches[0], **const}, plan.persistent_ctas_per_sm))
    # [0] the barrier, then phase 1's tile counts (fewer than the grid), then phase 2's.
    sync = pdl.zeros((1 + grid + tiles2,), torch.int32, device, plan)
    part1 = torch.empty(grid, c.bm, 2 * c.bn, dtype=torch.float32, device=device) if max_splits1 > 1 else f32
    part2 = torch.empty(splits2, c.bm, H, dtype=torch.float32, device=device) if splits2 > 1 else f32
    for launch in launches:
        bound_launch(persistent_decode_kernel, (grid,), *args(sync, part1, part2), **launch, **const)
