"""Where the host time of one fused-MoE call goes, and whether a compiled patched model replays
CUDA graphs (one GPU).

1. Host microseconds per call of a bare torch launch (``torch.add``), a trivial Triton kernel, the
   bare ``moekit.ops.fused_moe`` call (bound launches, ``moekit.kernels.bound``) beside the same
   kernels by Triton's own launch, and a patched block's experts call at M = 1 and 64
   (OLMoE-1B-7B dimensions), then a cProfile of 300 calls of each moekit call (top entries by
   own time).
2. A 4-layer OLMoE-1B-7B model (``PROBE_PRESET`` names another preset) patched with ``fused``, greedy generation at batch 1 under a
   static cache and ``torch.compile(fullgraph=True, mode="reduce-overhead")``, with inductor's
   CUDA-graph decisions logged (the lines that say a graph was skipped, and why).

Usage (GPU machine, repo root): python benchmarks/probes/host_path_probe.py
"""

from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, "src")


def host_us(call, iters=300):
    from moekit.bench.experts_call import host_us as median_host_us

    for _ in range(20):
        call()
    return median_host_us(call, iters)


def profile(call, title, iters=300):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        call()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(f"---- cProfile: {title} ({iters} calls)")
    print("\n".join(s.getvalue().splitlines()[:45]))


def part1():
    import triton
    import triton.language as tl

    from moekit.integrations.lm.presets import random_model
    from moekit.integrations.transformers import moe_blocks, patch
    from moekit.kernels import fused_moe as triton_fused_moe
    from moekit.ops import fused_moe
    from moekit.ops.policy import token_config

    @triton.jit
    def _noop(ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(ptr + offs, tl.load(ptr + offs, mask=offs < n), mask=offs < n)

    a = torch.ones(16, device="cuda")
    print(f"torch.add: {host_us(lambda: torch.add(a, a)):.1f} us")
    print(f"trivial triton kernel: {host_us(lambda: _noop[(1,)](a, 16, BLOCK=16)):.1f} us")
    model = random_model("olmoe-1b-7b", layers=1, device="cuda")
    experts = moe_blocks(model)[0][1].experts
    w13, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()
    for M in (1, 64):
        x = torch.randn(M, 2048, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(M, 64).argsort(1)[:, :8].cuda()
        w = torch.rand(M, 8, device="cuda")
        with torch.no_grad():
            print(f"transformers experts M={M}: {host_us(lambda: experts(x, ids, w)):.1f} us")
            op = lambda: fused_moe(x, w13, w2, ids, w)  # noqa: E731
            print(f"fused_moe op M={M}: {host_us(op):.1f} us")
            config = token_config("static", ids, w13, w2)
            unbound = lambda: triton_fused_moe(x, w13, w2, ids, w, config)  # noqa: E731
            print(f"the same kernels by Triton's launch M={M}: {host_us(unbound):.1f} us")
            profile(op, f"fused_moe op M={M}")
    patch(model, experts="fused")
    for M in (1, 64):
        x = torch.randn(M, 2048, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(M, 64).argsort(1)[:, :8].cuda()
        w = torch.rand(M, 8, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            call = lambda: experts(x, ids, w)  # noqa: E731
            print(f"patched experts M={M}: {host_us(call):.1f} us")
            profile(call, f"patched experts M={M}")


def part2():
    from transformers import CompileConfig

    from moekit.integrations.lm.presets import random_model, random_prompts
    from moekit.integrations.transformers import patch

    torch._logging.set_logs(perf_hints=True, cudagraphs=True)
    logging.getLogger("torch").propagate = False
    records, full = [], []

    class Keep(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if "skipping" in msg.lower() or "Recording function" in msg or "Re-recording" in msg:
                records.append(msg.split(", inputs")[0][:200])
                if "Re-recording" in msg and len(full) < 2:
                    full.append(msg[:4000])  # with the stack trace of the input that changed

    keep = Keep()
    for name in ("torch._inductor", "torch._inductor.cudagraph_trees", "torch._dynamo"):
        logging.getLogger(name).addHandler(keep)
    preset = os.environ.get("PROBE_PRESET", "olmoe-1b-7b")
    print(f"part 2: {preset}, 4 layers, batch 1")
    model = random_model(preset, layers=4, device="cuda")
    ids = random_prompts(model.config.vocab_size, 1, 64).cuda()
    for name in ("transformers", "fused"):
        if name == "fused":
            patch(model, experts="fused")
        cfg = CompileConfig(fullgraph=True, mode="reduce-overhead")

        def run():
            with torch.no_grad():
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                                      do_sample=False, pad_token_id=0, cache_implementation="static",
                                      compile_config=cfg)

        run()
        run()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        print(f"compiled {name} batch 1: {32 / (time.perf_counter() - t0):.1f} tok/s")
        from torch.profiler import ProfilerActivity, profile as tprofile

        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
        model.__dict__.pop("_compiled_call", None)
        torch._dynamo.reset()
    print("---- inductor's CUDA-graph messages:")
    from collections import Counter

    for r, n in Counter(records).most_common(30):
        print(f"{n:5d} x {r}")
    for msg in full:
        print("---- a re-recording message in full:")
        print(msg)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["1", "2"]
    if "1" in parts:
        part1()
    if "2" in parts:
        part2()
