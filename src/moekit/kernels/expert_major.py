"""The experts on a Dispatcher's expert-major layout: ``[E_local, capacity, H]`` + ``counts``.

A dispatcher's receive buffer is sized for the worst case: ``capacity`` rows for every local
expert (the low-latency layer's is ``world * max_m``). At decode most of it is empty: one
token per rank of deepseek-v3 on 2 ranks leaves about 8 valid rows in 128 x 256. The work
must therefore follow the valid rows, and the call must not read them back to the host
(no sync, CUDA-graph capturable).

The default form, two_launch with ``split_k = 1``, runs two persistent kernels that need no
alignment at all:

* Every program loads ``counts`` (at most a few hundred ints) and numbers the **live blocks**
  of ``bm`` rows expert after expert: expert ``e`` has ``ceil(counts[e] / bm)`` of them, and a
  running sum gives where its run starts (``_em_blocks``). Block ``b``'s expert is the number
  of runs that end at or before ``b`` (``_em_block``).
* The grid is as many programs as the SMs hold at once, and each program walks the work units
  ``pid, pid + grid, ...`` up to (live blocks) x (column tiles), a bound it computed itself.
  Nothing is launched for the empty part of the buffer. (Launching one program per possible
  block and letting the empty ones exit costs more than the experts at decode: at one token
  per rank of qwen3-30b-a3b, 64 experts x 4 blocks x 12 tiles = 3072 programs of which 108
  have work; docs/kernel.md.)
* GEMM1 (``_em_gemm1_kernel``) writes SwiGLU(x @ w13[e].T) for the live blocks into a compact
  intermediate (block ``b`` at rows ``b * bm ...``); GEMM2 (``_em_gemm2_kernel``) multiplies it
  by ``w2[e].T`` and stores each valid row once, in the output dtype, at its place in the
  layout. Every output row has one writer: no zeroed float32 copy, no atomics, no cast, and
  the result is deterministic. Rows at or past ``counts[e]`` are not written (unspecified).

The other forms (the fused form, split-K) keep the token path's kernels over
``align.align_expert_major``'s fixed block table: they add into a zeroed float32 copy of the
whole layout, so their cost grows with the capacity. They are there for completeness and
for the tests; after a dispatcher use the default.
"""

from __future__ import annotations

import torch

from moekit.kernels import pdl
from moekit.kernels.align import align_expert_major
from moekit.kernels.backend import HAVE_TRITON, check_device, interpreting, require_triton, tl, triton
from moekit.kernels.bound import launch as bound_launch
from moekit.kernels.bound import remembered
from moekit.kernels.configs import KernelConfig
from moekit.kernels.inputs import (FP8, SUPPORTED, check_config, check_scale, check_weights, fp8_activations,
                                   fp8_weight_scales, is_fp8_weights, no_scales)
from moekit.kernels.launch import intermediate, precision, run_blocks, scale_args
from moekit.kernels.occupancy import resident_grid
from moekit.kernels.plan import DEFAULT_PLAN, LaunchPlan, check_plan
from moekit.kernels.quant import FP8_GROUP

if HAVE_TRITON:
    from moekit.kernels.pdl import pdl_prologue
    from moekit.kernels.tiles import block_coords, down_tile, store_act, swiglu_tile

    # The counts change every call; their bounds must not select a binary.
    _NO_SPECIALIZE_EM = ["num_experts", "capacity"]

    @triton.jit
    def _em_blocks(counts_ptr, num_experts, capacity, BM: tl.constexpr, EP: tl.constexpr):
        """(valid rows per expert, end of each expert's run of live blocks, number of live
        blocks): counts clamped to [0, capacity], ends = inclusive cumsum of ceil(rows / BM).
        EP is a power of two >= num_experts."""
        e = tl.arange(0, EP)
        rows = tl.load(counts_ptr + e, mask=e < num_experts, other=0).to(tl.int32)
        rows = tl.minimum(tl.maximum(rows, 0), capacity)
        ends = tl.cumsum((rows + BM - 1) // BM, 0)
        return rows, ends, tl.max(ends, 0)

    @triton.jit
    def _em_block(b, rows, ends, capacity, BM: tl.constexpr, EP: tl.constexpr):
        """Live block ``b``: (expert, its rows of the layout [BM] int64, row_ok). The runs of
        the experts before it are those ending at or before ``b`` (ends never decrease)."""
        before = ends <= b
        expert = tl.sum(before.to(tl.int32), 0)
        first = tl.max(tl.where(before, ends, 0), 0)  # the expert's first live block
        valid = tl.sum(tl.where(tl.arange(0, EP) == expert, rows, 0), 0)
        r = (b - first) * BM + tl.arange(0, BM)
        row_ok = r < valid
        layout_rows = tl.where(row_ok, expert.to(tl.int64) * capacity + r, 0)
        return expert, layout_rows, row_ok

    @triton.jit(do_not_specialize=_NO_SPECIALIZE_EM)
    def _em_gemm1_kernel(
        x_ptr, w13_ptr, inter_ptr, counts_ptr, num_experts, capacity, H: tl.constexpr, N: tl.constexpr,
        stride_xm, stride_we, stride_wn, stride_wk, stride_im,
        xs_ptr, ws_ptr, is_ptr, stride_xsm, stride_wse, stride_wsn, stride_wsk, stride_ism,
        EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
        PRECISION: tl.constexpr, FP8: tl.constexpr, SWAP_AB: tl.constexpr, SOFT_ROUND: tl.constexpr,
        PDL: tl.constexpr, EARLY: tl.constexpr,
    ):
        """inter[b * BM + i] = SwiGLU(x[row i of live block b] @ w13[e].T), over the units
        (live block, N tile) pid, pid + grid, ...; padding rows get zeros (their A rows are
        masked to 0). FP8: inter is e4m3 with [rows, N/128] scales (``store_act``). PDL, EARLY:
        ``pdl``."""
        pdl_prologue(PDL, EARLY)
        rows, ends, num_m = _em_blocks(counts_ptr, num_experts, capacity, BM, EP)
        num_n = tl.cdiv(N, BN)
        u = tl.program_id(0)
        while u < num_m * num_n:
            pid_m, pid_n = block_coords(u, num_m, num_n, GROUP_M)
            expert, a_rows, row_ok = _em_block(pid_m, rows, ends, capacity, BM, EP)
            offs_n = pid_n * BN + tl.arange(0, BN)
            act = swiglu_tile(x_ptr, w13_ptr, a_rows, row_ok, expert, offs_n, H, N,
                               stride_xm, stride_we, stride_wn, stride_wk,
                               xs_ptr, ws_ptr, stride_xsm, stride_wse, stride_wsn, stride_wsk,
                               BM, BN, BK, PRECISION, FP8, SWAP_AB)
            store_act(inter_ptr, is_ptr, pid_m * BM + tl.arange(0, BM), pid_n, act, stride_im, stride_ism, N,
                       BM, BN, FP8, SOFT_ROUND)
            u += tl.num_programs(0)

    @triton.jit(do_not_specialize=_NO_SPECIALIZE_EM)
    def _em_gemm2_kernel(
        inter_ptr, w2_ptr, out_ptr, counts_ptr, num_experts, capacity, H: tl.constexpr, N: tl.constexpr,
        stride_im, stride_we, stride_wh, stride_wk, stride_om,
        is_ptr, ws_ptr, stride_ism, stride_wse, stride_wsh, stride_wsk,
        EP: tl.constexpr, WHOLE_CHUNKS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GROUP_M: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, SWAP_AB: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """out[row] = inter[b * BM + i] @ w2[e].T for the valid rows of live block b, stored
        once in the output's dtype, over the units (live block, H tile) pid, pid + grid, ...
        PDL: waits for GEMM1."""
        pdl_prologue(PDL, False)
        rows, ends, num_m = _em_blocks(counts_ptr, num_experts, capacity, BM, EP)
        num_n = tl.cdiv(H, BN)
        u = tl.program_id(0)
        while u < num_m * num_n:
            pid_m, pid_n = block_coords(u, num_m, num_n, GROUP_M)
            expert, out_rows, row_ok = _em_block(pid_m, rows, ends, capacity, BM, EP)
            offs_h = pid_n * BN + tl.arange(0, BN)
            acc = down_tile(inter_ptr, w2_ptr, is_ptr, ws_ptr, pid_m * BM + tl.arange(0, BM), row_ok, expert,
                             offs_h, 0, H, N, stride_im, stride_we, stride_wh, stride_wk,
                             stride_ism, stride_wse, stride_wsh, stride_wsk, (N + BK - 1) // BK, BM, BN, BK,
                             PRECISION, FP8, WHOLE_CHUNKS, SWAP_AB)
            o_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_h[None, :]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_h < H)[None, :])
            u += tl.num_programs(0)


def _em_grid(kernel, args: tuple, const: dict, units_bound: int, plan: LaunchPlan) -> int:
    """The persistent grid: the programs the SMs hold at once (at most
    ``plan.expert_major_ctas_per_sm`` per SM), never more than the most units there can be
    (``units_bound``); ``plan.expert_major_interpret_grid`` in the interpreter, which runs the
    programs one after another, so a few walk every unit."""
    if interpreting():
        return max(1, min(units_bound, plan.expert_major_interpret_grid))
    resident = remembered((kernel, "grid"), lambda: resident_grid(kernel, args, const, plan.expert_major_ctas_per_sm))
    return max(1, min(units_bound, resident))


def _run_stored(a: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor, capacity: int,
                out_dtype: torch.dtype, c: KernelConfig, scales, plan: LaunchPlan = DEFAULT_PLAN) -> torch.Tensor:
    """two_launch with split_k = 1 over the live blocks (the module docstring): ``[E * capacity, H]``."""
    E, H, N = counts.shape[0], a.shape[1], w2.shape[2]
    fp8 = scales is not None
    out = torch.empty(E * capacity, H, dtype=out_dtype, device=a.device)
    max_blocks = E * triton.cdiv(capacity, c.bm)
    inter, is_args = intermediate(max_blocks * c.bm, N, a.dtype, fp8, out)
    xs_args, w13s_args, w2s_args = scale_args(scales, out)
    on = pdl.pdl_on(a.device, plan)
    common = dict(EP=triton.next_power_of_2(E), BM=c.bm, BK=c.bk, GROUP_M=c.group_m, PRECISION=precision(a.dtype),
                  FP8=fp8, SWAP_AB=c.swap_ab, PDL=on, num_warps=c.num_warps,
                  num_stages=c.num_stages, **pdl.launch_options(on))

    args1 = (a, w13, inter, counts, E, capacity, H, N, a.stride(0), *w13.stride(), inter.stride(0),
             xs_args[0], w13s_args[0], is_args[0], xs_args[1], *w13s_args[1:], is_args[1])
    # GEMM2 never launches at GEMM1's start: GEMM1 is no short kernel (moekit.kernels.pdl).
    const1 = dict(common, BN=c.bn, SOFT_ROUND=fp8 and interpreting(), EARLY=False)
    grid1 = _em_grid(_em_gemm1_kernel, args1, const1, max_blocks * triton.cdiv(N, c.bn), plan)
    bound_launch(_em_gemm1_kernel, (grid1,), *args1, **const1)

    args2 = (inter, w2, out, counts, E, capacity, H, N, inter.stride(0), *w2.stride(), out.stride(0),
             is_args[0], w2s_args[0], is_args[1], *w2s_args[1:])
    const2 = dict(common, BN=c.gemm2_bn, WHOLE_CHUNKS=N % c.bk == 0)
    grid2 = _em_grid(_em_gemm2_kernel, args2, const2, max_blocks * triton.cdiv(H, c.gemm2_bn), plan)
    bound_launch(_em_gemm2_kernel, (grid2,), *args2, **const2)
    return out


SMALL_CAPACITY = 256  # the largest capacity the defaults below were chosen at


def expert_major_default(capacity: int, fp8: bool) -> KernelConfig:
    """The config ``fused_moe_expert_major`` runs without one (two_launch, split_k = 1).

    Capacities up to ``SMALL_CAPACITY`` (decode: a low-latency layer's ``world * max_m``) take
    16-row blocks, picked with ``benchmarks/probes/expert_major_probe.py`` (qwen3-30b-a3b, a
    rank of a 2-rank layer: 64 experts, capacity 256, 9 to 1032 valid rows, at most 122 per
    expert) as the config with the smallest worst ratio to the best of its precision over the
    loads; FP8's with its dots swapped (``swap_ab``: faster at every load; docs/kernel.md).
    Larger capacities, where an expert can get thousands of rows, take 64-row blocks (not
    measured on this path at such loads)."""
    if capacity <= SMALL_CAPACITY:
        if fp8:
            return KernelConfig(bm=16, bn=128, bk=128, num_warps=4, num_stages=3, group_m=8, swap_ab=True)
        return KernelConfig(bm=16, bn=64, bk=128, num_warps=4, num_stages=3, group_m=8)
    return KernelConfig(bm=64, bn=128, bk=128, num_warps=8, num_stages=4) if fp8 else \
        KernelConfig(bm=64, bn=128, bk=64, num_warps=4, num_stages=4)


def fused_moe_expert_major(tokens: torch.Tensor, counts: torch.Tensor, w13_local: torch.Tensor,
                           w2_local: torch.Tensor, config: KernelConfig, *,
                           w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                           token_scales: torch.Tensor | None = None,
                           plan: LaunchPlan | None = None) -> torch.Tensor:
    """The experts on a Dispatcher's expert-major layout: [E_local, capacity, H] -> same shape.

    Row r of expert e gets expert_e(tokens[e, r]) for r < counts[e], unweighted (the
    dispatcher's combine applies the routing weights in slot order). Rows at or past counts[e]
    are unspecified, as the dispatcher's own rows there (no combine reads them; zeroing them
    would cost a pass over the whole layout). float32 accumulation, cast once to the tokens'
    dtype. two_launch with split_k = 1 (the default) is the form whose cost follows the valid
    rows (module docstring); the fused form and split-K add into a zeroed float32 copy of the
    whole layout and cast it.

    FP8 W8A8: weights and scales as for :func:`fused_moe`. tokens either 16/32-bit (quantized
    here; the result has their dtype) or, as a low-latency dispatcher hands them over, e4m3
    with ``token_scales`` [E_local, capacity, H/128] float32 (the result is bf16).

    ``config``: the :class:`KernelConfig` to run (:func:`expert_major_default` is the kernel's
    own pick for a capacity; the policies that choose one, RaMP's among them, live in
    :mod:`moekit.ops`).

    ``plan``: how the call is launched (:class:`~moekit.kernels.plan.LaunchPlan`; None: the
    library's defaults; this entry reads its expert-major and PDL fields, and the decode fields
    where the config is not two_launch with split_k = 1).
    """
    check_fused_moe_expert_major(tokens, counts, w13_local, w2_local, config, w13_scale=w13_scale,
                                 w2_scale=w2_scale, token_scales=token_scales, plan=plan)
    return run_fused_moe_expert_major(tokens, counts, w13_local, w2_local, config, w13_scale=w13_scale,
                                      w2_scale=w2_scale, token_scales=token_scales, plan=plan)


def check_fused_moe_expert_major(tokens: torch.Tensor, counts: torch.Tensor, w13_local: torch.Tensor,
                                 w2_local: torch.Tensor, config: KernelConfig | None, *,
                                 w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                                 token_scales: torch.Tensor | None = None, plan: LaunchPlan | None = None) -> None:
    """Every check of :func:`fused_moe_expert_major`'s arguments; ``config`` None: all but the
    config. Reads nothing from the device."""
    require_triton()
    plan = check_plan(plan)
    if tokens.dim() != 3 or tokens.dtype not in SUPPORTED + (FP8,):
        raise ValueError(f"tokens must be a 3-D {SUPPORTED + (FP8,)} tensor [E_local, capacity, H], "
                         f"got {tuple(tokens.shape)} {tokens.dtype}")
    E, cap, H = tokens.shape
    fp8 = is_fp8_weights(w13_local, w2_local)
    if tokens.dtype == FP8 and not fp8:
        raise ValueError(f"tokens in {FP8} need FP8 weights (w13_local, w2_local in {FP8}), got {w13_local.dtype}")
    E_w, N = check_weights(w13_local, w2_local, H, FP8 if fp8 else tokens.dtype, tokens.device)
    if E_w != E:
        raise ValueError(f"tokens has E_local={E} experts but the weights have {E_w}")
    if counts.dim() != 1 or counts.shape[0] != E or counts.device != tokens.device:
        raise ValueError(f"counts must be [E_local={E}] on {tokens.device}, got {tuple(counts.shape)} on {counts.device}")
    if counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"counts must be int32 or int64, got {counts.dtype}")
    if config is not None:
        if not isinstance(config, KernelConfig):
            raise ValueError(f"config must be a moekit.kernels.KernelConfig (moekit.ops picks one by policy), "
                             f"got {config!r}")
        check_config(config, fp8)
    if fp8:
        fp8_weight_scales(E, N, H, w13_scale, w2_scale, tokens.device)
        if tokens.dtype == FP8:
            check_scale("token_scales", token_scales, (E, cap, H // FP8_GROUP), tokens.device)
        elif token_scales is not None:
            raise ValueError(f"token_scales is only for {FP8} tokens; the tokens are {tokens.dtype}")
    else:
        no_scales(w13_scale=w13_scale, w2_scale=w2_scale, token_scales=token_scales)
    check_device(tokens.device, "tokens")


def run_fused_moe_expert_major(tokens: torch.Tensor, counts: torch.Tensor, w13_local: torch.Tensor,
                               w2_local: torch.Tensor, config: KernelConfig, *,
                               w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                               token_scales: torch.Tensor | None = None,
                               plan: LaunchPlan | None = None) -> torch.Tensor:
    """:func:`fused_moe_expert_major` on arguments its check accepted (not checked again)."""
    plan = DEFAULT_PLAN if plan is None else plan
    E, cap, H = tokens.shape
    fp8 = w13_local.dtype == FP8
    out_dtype = torch.bfloat16 if tokens.dtype == FP8 else tokens.dtype
    if not E * cap:
        return torch.zeros(E, cap, H, dtype=out_dtype, device=tokens.device)
    a = tokens.contiguous().reshape(E * cap, H)
    scales = None
    if fp8:  # quantizing 16/32-bit tokens checks their device itself
        ts = token_scales.reshape(E * cap, H // FP8_GROUP) if token_scales is not None else None
        a, xs = fp8_activations(a, ts, "token_scales", plan)
        scales = (xs, w13_scale, w2_scale)
    if config.form == "two_launch" and config.split_k == 1:
        out = _run_stored(a, w13_local, w2_local, counts.contiguous(), cap, out_dtype, config, scales, plan)
    else:
        al = align_expert_major(counts, cap, config.bm)
        out = run_blocks(a, w13_local, w2_local, None, al, E * cap, out_dtype, a_div=1, out_div=1, config=config,
                         scales=scales, plan=plan)
    return out.reshape(E, cap, H)
