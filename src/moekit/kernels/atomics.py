"""Adding a float32 tile into memory with atomics, four columns per instruction where it can.

The fused form and the token path's GEMM2 add their ``[BM, BK]`` float32 partial sums into the
output with ``tl.atomic_add``. Triton 3.6 lowers that, on sm_90, to one scalar
``red.global.add.f32`` per element (checked in the compiled SASS: ``REDG.E.ADD.F32``), so a
decode call with 16 tokens issues about four million of them at olmoe-1b-7b's shape (every
(expert, N-tile) program adds a whole ``[M, H]`` tile). Hopper has a vector form,
``red.global.add.v4.f32`` (PTX ISA 8.1, sm_90): one instruction adds four consecutive floats.
:func:`add_tile` emits it through inline PTX where :func:`vector_on` allows, and falls back to
``tl.atomic_add`` elsewhere (the interpreter, older GPUs, an odd row length).

Either way each element receives the same additions, in an order the hardware chooses: the
result is as (non-)deterministic as before, no more.
"""

from __future__ import annotations

import torch

from moekit.kernels.quant import interpreting

try:  # Triton is optional: the package imports without it, the kernels need it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = tl = None
    HAVE_TRITON = False

# The switch: False keeps the scalar atomics everywhere (to measure one against the other).
ENABLED = True


def vector_on(out: torch.Tensor, device: torch.device) -> bool:
    """Whether a kernel adding into the 2-D float32 ``out`` may use the four-wide instruction:
    :data:`ENABLED`, a CUDA device of compute capability 9.0 or newer, not the interpreter, and
    rows whose every group of four columns starts 16-byte aligned (``out``'s base and row
    stride a multiple of four floats, its row length too, so that a group is wholly inside
    or wholly outside a row)."""
    return (ENABLED and device.type == "cuda" and not interpreting() and out.dtype == torch.float32
            and out.dim() == 2 and out.stride(1) == 1 and out.shape[1] % 4 == 0 and out.stride(0) % 4 == 0
            and out.data_ptr() % 16 == 0 and torch.cuda.get_device_capability(device) >= (9, 0))


if HAVE_TRITON:

    @triton.jit
    def _red_v4(ptrs, v0, v1, v2, v3, ok):
        """``ptrs[i][0:4] += (v0, v1, v2, v3)[i]`` where ``ok``: one ``red.global.add.v4.f32`` per
        element of ``ptrs`` (each 16-byte aligned). The int32 result is a dummy: an inline-asm
        element needs one."""
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .pred p;
            setp.ne.b32 p, $6, 0;
            @p red.global.gpu.relaxed.add.v4.f32 [$1], {$2, $3, $4, $5};
            mov.b32 $0, 0;
            }""",
            constraints="=r,l,f,f,f,f,r",
            args=[ptrs.to(tl.int64, bitcast=True), v0, v1, v2, v3, ok.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1,
        )

    @triton.jit
    def add_tile(out_ptr, rows, stride_om, col0, vals, row_ok, cols_left,
                 BM: tl.constexpr, BK: tl.constexpr, VECTOR: tl.constexpr):
        """``out[rows[i], col0 + j] += vals[i, j]`` for ``row_ok[i]`` and ``j < cols_left``,
        atomically. ``vals`` is ``[BM, BK]`` float32; VECTOR (see :func:`vector_on`; then
        ``col0`` and ``cols_left`` are multiples of four) adds four columns per instruction."""
        if VECTOR:
            # Column 4g + 2a + b of vals is element (g, a, b): split b, then a.
            even, odd = tl.split(tl.reshape(vals, [BM, BK // 4, 2, 2]))
            v0, v2 = tl.split(even)
            v1, v3 = tl.split(odd)
            groups = 4 * tl.arange(0, BK // 4)
            ptrs = out_ptr + rows[:, None] * stride_om + (col0 + groups)[None, :]
            _red_v4(ptrs, v0, v1, v2, v3, row_ok[:, None] & (groups < cols_left)[None, :])
        else:
            offs = tl.arange(0, BK)
            ptrs = out_ptr + rows[:, None] * stride_om + (col0 + offs)[None, :]
            tl.atomic_add(ptrs, vals, mask=row_ok[:, None] & (offs < cols_left)[None, :], sem="relaxed")
