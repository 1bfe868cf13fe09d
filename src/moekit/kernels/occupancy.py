"""What the kernels ask of a device: its SMs, its compute capability, how many CTAs of a
compiled Triton kernel one SM holds at once, and so the grid of a persistent kernel
(:func:`resident_grid`).

Cooperative (persistent) kernels size their grid with it: every program must be resident at
the same time, or a program spinning on a barrier or a signal could keep one that must arrive
from ever running. The device's properties are looked up once per device index (every launch
asks), with ``"cuda"`` resolved to the current device at each call, not at the first.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def _cuda_properties(device: torch.device):
    """The properties of CUDA ``device`` (``cuda`` without an index: the current device)."""
    return _properties(torch.cuda.current_device() if device.index is None else device.index)


def sm_count(device: torch.device) -> int:
    """The SMs of ``device``; 132 (an H100 / H200) off the GPU, where Triton's interpreter runs."""
    if device.type == "cuda":
        return _cuda_properties(device).multi_processor_count
    return 132


def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of CUDA ``device``."""
    props = _cuda_properties(device)
    return props.major, props.minor


def resident_ctas_per_sm(compiled, device: torch.device, cap: int) -> int:
    """CTAs of ``compiled`` (a Triton CompiledKernel) resident per SM of ``device``, by its
    shared memory, registers and threads; at least 1, at most ``cap``."""
    compiled._init_handles()  # loads the binary: fills n_regs
    props = _cuda_properties(device)
    warps = compiled.metadata.num_warps
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    by_smem = smem_sm // (compiled.metadata.shared + 1024)  # 1 KB per CTA is the system's
    regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256  # allocated in units of 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // regs_per_warp // warps
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    return max(1, min(by_smem, by_regs, by_threads, cap))


_RESIDENT_GRIDS: dict[tuple, int] = {}  # resident_grid's answer per binary


def binary_key(kernel, args: tuple, const: dict, cap: int) -> tuple:
    """What decides the binary ``kernel`` compiles to for ``args`` and ``const`` (and so its
    registers and shared memory): per tensor its dtype and whether its address is 16-byte
    aligned (Triton specializes pointers on that), every other argument by value (the
    constexpr sizes, and the integers Triton specializes on == 1 and multiples of 16; keying
    on values is finer than that, never coarser), the constants and the cap. Two shapes with
    the same constants can compile to binaries of different sizes, and a cooperative grid
    sized for the smaller one fails to launch with the larger."""
    spec = tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    return (kernel.fn.__name__, device, spec, cap, tuple(sorted(const.items())))


def resident_grid(kernel, args: tuple, const: dict, cap: int) -> int:
    """As many programs of the Triton ``kernel`` (compiled for ``args`` and the constexprs /
    launch options ``const``) as the device's SMs hold at once, at most ``cap`` per SM: the grid
    of a kernel whose programs loop over work units. The answer depends only on the binary, so
    it is looked up once per :func:`binary_key`: an eager call does not pay the compile-cache
    lookup twice."""
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    key = binary_key(kernel, args, const, cap)
    grid = _RESIDENT_GRIDS.get(key)
    if grid is None:
        compiled = kernel.warmup(*args, grid=(1,), **const)
        grid = _RESIDENT_GRIDS[key] = sm_count(device) * resident_ctas_per_sm(compiled, device, cap)
    return grid
