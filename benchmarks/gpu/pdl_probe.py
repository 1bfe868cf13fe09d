"""Does programmatic dependent launch shorten a decode-like chain in a CUDA graph? (developer probe)

A chain shaped like the fused form's decode call -- zero a float32 [16, H] buffer, a kernel that
streams ``--mb`` MB of weights from 2 CTAs per SM and adds into the buffer with atomics, cast the
buffer to bf16 -- timed as the bench times (graph replay, L2 flushed before each, median), with
and without PDL (moekit.kernels.pdl), a cooperative launch of the streaming kernel too, and the
streaming kernel alone as the floor. Run from the repo root: PYTHONPATH=src python benchmarks/gpu/pdl_probe.py
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from moekit.kernels import pdl
from probe_common import ceilings_and_flusher, median_us


@triton.jit
def _stream_kernel(w_ptr, out_ptr, n_per_prog, OUT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                   TRIGGER: tl.constexpr):
    if TRIGGER:
        pdl.gdc_launch_dependents(PDL)
    pdl.gdc_wait(PDL)
    base = w_ptr + tl.program_id(0).to(tl.int64) * n_per_prog
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, n_per_prog, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)) % OUT
    tl.atomic_add(out_ptr + offs, acc, sem="relaxed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[37.7, 75.5])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    dev = torch.device("cuda")
    _, flusher = ceilings_and_flusher(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grid, block, rows, H = 2 * sms, 2048, 16, 2048
    for mb in args.mb:
        n_per_prog = int(mb * 2**20 / 2 / grid) // block * block
        w = torch.randn(grid * n_per_prog, device=dev, dtype=torch.bfloat16)

        def chain(on: bool, coop: bool = False, zero: bool = True, cast: bool = True):
            def fn():
                pdl.ENABLED = on
                out = pdl.zeros((rows, H), torch.float32, dev) if zero else torch.empty(rows, H, device=dev)
                _stream_kernel[(grid,)](w, out, n_per_prog, OUT=rows * H, BLOCK=block, PDL=on, TRIGGER=cast,
                                        launch_cooperative_grid=coop, **pdl.launch_options(on), num_warps=4)
                return pdl.cast(out, torch.bfloat16) if cast else out
            return fn

        variants = {
            "torch zero + stream + torch cast": chain(False),
            "PDL zero + stream + cast": chain(True),
            "torch zero + cooperative stream": chain(False, coop=True, cast=False),
            "PDL zero + cooperative stream": chain(True, coop=True, cast=False),
            "stream alone": chain(False, zero=False, cast=False),
        }
        for _ in range(2):  # twice, interleaved: the spread between the rounds is the noise
            for name, fn in variants.items():
                print(f"{mb:6.1f} MB  {name:36s} {median_us(fn, flusher, args.iters):7.2f} us", flush=True)
    pdl.ENABLED = True


if __name__ == "__main__":
    sys.exit(main())
