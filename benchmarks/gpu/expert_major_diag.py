"""Developer probe: where the expert-major kernels' time goes at decode (not the dataset).

A rank of a 2-rank qwen3-30b-a3b layer (64 local experts, capacity 256) at T = 1 and 16 tokens
per rank, bf16 and FP8 W8A8, the default configs (``expert_major_default``):

1. the compiled kernels: registers, shared memory, and counts of the PTX instructions that
   tell how the dots run (``mma.sync`` / ``wgmma``, fp8 -> fp16 conversions ``cvt...e4m3x2``,
   ``cp.async``), with FP8's swapped dots on and off (``KernelConfig.swap_ab``);
2. per kernel GPU µs (profiler, eager, 256 MB L2 flush before each call) with the persistent
   grids capped at 1, 2, 4 and 8 programs per SM (``EM_CTAS_PER_SM``), swapped and not;
3. the bar for those µs: a kernel that only reads as many bytes as GEMM1 (w13 of the touched
   experts) or GEMM2 (their w2) must stream, timed the same way.

    PYTHONPATH=src:benchmarks/gpu python3 benchmarks/gpu/expert_major_diag.py
"""

from __future__ import annotations

import dataclasses
import re

import torch
from decode_overhead import _stream_kernel
from expert_major_probe import _counts, _inputs
from probe_common import ceilings_and_flusher, kernel_breakdown

from moekit.kernels import expert_major, fused_moe_expert_major
from moekit.shapes import get_shape

PTX_COUNTS = (r"mma\.sync", r"wgmma\.mma_async", r"cvt\.rn\.f16x2\.e4m3x2", r"cp\.async\.c", r"atom\.")


def main() -> None:
    dev = torch.device("cuda")
    shape = get_shape("qwen3-30b-a3b")
    _, flusher = ceilings_and_flusher(dev)
    seen = {}
    grid_of = expert_major._em_grid

    def spy(kernel, args, const, bound):  # records each launch's grid and compiled binary
        grid = grid_of(kernel, args, const, bound)
        seen[kernel.fn.__name__] = (grid, kernel.warmup(*args, grid=(1,), **const))
        return grid

    expert_major._em_grid = spy
    for precision in ("bf16", "fp8"):
        inp = _inputs(shape, dev, precision)
        for T in (1, 16):
            counts = _counts(shape, T, None, seed=T).to(dev)
            touched = int((counts > 0).sum())

            for swap in ((True, False) if precision == "fp8" else (False,)):
                cfg = dataclasses.replace(expert_major.expert_major_default(256, precision == "fp8"), swap_ab=swap)

                def call(cfg=cfg):
                    return fused_moe_expert_major(inp["tokens"], counts, inp["w13"], inp["w2"], cfg, **inp["kw"])
                for ctas in (1, 2, 4, 8):
                    expert_major.EM_CTAS_PER_SM = ctas
                    seen.clear()
                    per_kernel = kernel_breakdown(call, flusher)
                    print(f"{precision} T{T} ({touched} experts) swap={swap} ctas/SM<={ctas}: "
                          + ", ".join(f"{name} {us:.1f} us (grid {seen[name][0]})" for name, us in per_kernel.items()
                                      if name in seen), flush=True)
                if T == 1:
                    for name, (_, binary) in seen.items():
                        ptx = binary.asm["ptx"]
                        counts_ptx = {k.replace("\\", ""): len(re.findall(k, ptx)) for k in PTX_COUNTS}
                        print(f"    {name}: {binary.n_regs} registers, {binary.metadata.shared} B shared, "
                              f"PTX {counts_ptx}", flush=True)
            expert_major.EM_CTAS_PER_SM = 4
            elem = 1 if precision == "fp8" else 2
            for what, nbytes in (("w13", touched * 2 * shape.intermediate * shape.hidden * elem),
                                 ("w2", touched * shape.intermediate * shape.hidden * elem)):
                src = inp["w13"].view(torch.uint8).view(-1)[:nbytes].view(torch.float16)
                grid = 132 * 4
                out = torch.empty(grid, device=dev)
                per_kernel = kernel_breakdown(lambda: _stream_kernel[(grid,)](src, out, src.numel(), BLOCK=8192),
                                              flusher)
                us = sum(v for k, v in per_kernel.items() if "stream" in k)
                print(f"  a plain read of {what}'s bytes ({nbytes / 1e6:.1f} MB): {us:.1f} us "
                      f"({nbytes / us / 1e6:.2f} TB/s)", flush=True)


if __name__ == "__main__":
    main()
