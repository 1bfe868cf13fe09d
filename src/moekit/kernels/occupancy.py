"""What the kernels ask of a device: its SMs, its compute capability, and how many CTAs of a
compiled Triton kernel one SM holds at once.

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
