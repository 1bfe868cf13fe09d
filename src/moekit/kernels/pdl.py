"""Programmatic dependent launch (PDL) between the kernels of one fused-MoE call.

A decode call is a chain of short kernels (the zeroing of the output or of the counters, the
FP8 quantization of x, the experts, the cast of the float32 sums), and in a CUDA graph each
kernel boundary costs a gap on top of the kernels themselves (docs/kernel.md, "Decode: the
fixed cost"). On compute capability 9.0 and newer a kernel
launched with PDL (Triton's ``launch_pdl=True``, the programmatic-stream-serialization
attribute) may be placed on the SMs while the kernel before it in the stream is still running,
as soon as every CTA of that one has executed ``griddepcontrol.launch_dependents`` (or exited);
``griddepcontrol.wait`` then returns once the previous kernel has completed and its writes are
visible. What is gained is the launch: the CTAs are resident and waiting when the previous
kernel ends, rather than starting after it.

Two rules make any chain of these kernels correct, whatever runs before or after them:

* every kernel launched here waits (:func:`gdc_wait`) before its first load or store of memory
  another kernel may have written or may still be reading -- in practice at its start, since
  even a freshly allocated output may be memory the previous kernel still reads (the caching
  allocator reuses a block as soon as its last use is queued) -- so a kernel never exits before
  the one before it has completed, and completion stays transitive along the chain;
* a kernel lets its dependents launch (:func:`gdc_launch_dependents`) at its start only where
  :func:`early` says so: its role allows it (:data:`EARLY`) and its grid has no more programs
  than the GPU has SMs (a short kernel of a decode call). Otherwise the dependents launch as its
  programs exit, which still saves their launch.

Why the second rule: an early launch before a long kernel makes the call slower, since the
dependents' programs sit resident on the SMs, waiting, while the long kernel still needs them
(GEMM1 before GEMM2, the expert-major GEMM1, the zeroing of a large output); before a short
kernel it saves the launch (docs/kernel.md has the measurements).

A kernel launched without PDL (torch's, the user's) follows the whole previous kernel as usual,
and a kernel that is not preceded by a PDL-aware one simply waits for nothing, so a chain can
start and end anywhere. ``griddepcontrol`` is a no-op without PDL, so the kernels stay correct
when launched without it; the Triton interpreter and GPUs before sm_90 never use it.
"""

from __future__ import annotations

import os
from types import MappingProxyType

import torch

from moekit.kernels.backend import HAVE_TRITON, interpreting, tl, triton
from moekit.kernels.bound import launch as bound_launch
from moekit.kernels.occupancy import capability, sm_count
from moekit.kernels.plan import DEFAULT_PLAN, PDL_EARLY_ROLES, PDL_ROLES, LaunchPlan


def enabled_by(environ) -> bool:
    """Whether ``environ``'s ``MOEKIT_PDL`` leaves PDL on: unset, ``1``/``on``/``true``/``yes``
    on; ``0``/``off``/``false``/``no`` off (case-insensitive); anything else is an error."""
    value = environ.get("MOEKIT_PDL", "1").strip().lower()
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"MOEKIT_PDL must be 1/on/true/yes or 0/off/false/no, got {environ['MOEKIT_PDL']!r}")


# The environment's choice, what ``LaunchPlan(pdl=None)`` (the default) follows: MOEKIT_PDL=0 turns
# PDL off (to run under a tool that does not follow it); a plan with pdl=True / False decides itself.
ENABLED = enabled_by(os.environ)
# The default per kernel role of whether its dependents may launch at its start (the second rule),
# read-only: a caller chooses its own with ``LaunchPlan(pdl_early=...)``.
EARLY = MappingProxyType({role: role in PDL_EARLY_ROLES for role in PDL_ROLES})
_BLOCK = 1024  # elements per program of the fill and cast kernels


def pdl_on(device: torch.device, plan: LaunchPlan = DEFAULT_PLAN) -> bool:
    """Whether the kernels of a call on ``device`` launch with PDL: ``plan.pdl`` (None:
    :data:`ENABLED`), a CUDA device of compute capability 9.0 or newer, and not Triton's
    interpreter."""
    wanted = ENABLED if plan.pdl is None else plan.pdl
    return wanted and device.type == "cuda" and not interpreting() and capability(device) >= (9, 0)


def early(role: str, pdl: bool, grid: int, device: torch.device, plan: LaunchPlan = DEFAULT_PLAN) -> bool:
    """The ``EARLY`` constexpr of a kernel of ``role`` (one of ``PDL_ROLES``; another is a
    KeyError) launched with or without PDL over ``grid`` programs: ``plan.pdl_early`` has its
    role and the grid is at most one program per SM. False without PDL (the trigger is then a
    no-op: keep a single binary)."""
    if role not in EARLY:
        raise KeyError(role)
    return pdl and role in plan.pdl_early and grid <= sm_count(device)


def launch_options(pdl: bool) -> dict:
    """The launch options of a kernel that keeps the rules above (empty without PDL)."""
    return dict(launch_pdl=True) if pdl else {}


if HAVE_TRITON:

    @triton.jit
    def gdc_wait(PDL: tl.constexpr):
        """Wait until the previous kernel in the stream has completed and its writes are visible
        (nothing without PDL)."""
        if PDL:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def gdc_launch_dependents(PDL: tl.constexpr):
        """Let the next kernel in the stream be placed on the SMs now (nothing without PDL)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def pdl_prologue(PDL: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr):
        """The start of a kernel that keeps the rules above: let the dependents launch (where
        what follows is small), then wait for the previous kernel."""
        if LAUNCH_DEPENDENTS:
            gdc_launch_dependents(PDL)
        gdc_wait(PDL)

    @triton.jit
    def _fill_zero_kernel(ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
        """ptr[:n] = 0 (a zeroing precedes the experts)."""
        pdl_prologue(PDL, EARLY)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(ptr + offs, tl.zeros((BLOCK,), dtype=ptr.dtype.element_ty), mask=offs < n)

    @triton.jit
    def _cast_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """dst[:n] = src[:n] in dst's dtype (round to nearest even, as torch's cast)."""
        pdl_prologue(PDL, False)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=ok).to(dst_ptr.dtype.element_ty), mask=ok)


def zeros(shape: tuple, dtype: torch.dtype, device: torch.device, plan: LaunchPlan = DEFAULT_PLAN) -> torch.Tensor:
    """``torch.zeros(shape)``; under PDL a kernel that keeps the rules above (torch's fill is
    not launched with PDL, so the kernel after it could not start early)."""
    if not pdl_on(device, plan):
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.numel():
        grid = triton.cdiv(t.numel(), _BLOCK)
        bound_launch(_fill_zero_kernel, (grid,), t, t.numel(), BLOCK=_BLOCK, PDL=True,
                     EARLY=early("zero", True, grid, device, plan), **launch_options(True))
    return t


def cast(src: torch.Tensor, dtype: torch.dtype, plan: LaunchPlan = DEFAULT_PLAN) -> torch.Tensor:
    """``src.to(dtype)`` of a contiguous ``src``; under PDL a kernel launched with it, waiting for
    the kernel that wrote ``src``."""
    if src.dtype == dtype or not pdl_on(src.device, plan):
        return src.to(dtype)
    if not src.is_contiguous():
        raise ValueError("cast needs a contiguous tensor")
    dst = torch.empty(src.shape, dtype=dtype, device=src.device)
    if src.numel():
        bound_launch(_cast_kernel, (triton.cdiv(src.numel(), _BLOCK),), src, dst, src.numel(), BLOCK=_BLOCK, PDL=True,
                     **launch_options(True))
    return dst
