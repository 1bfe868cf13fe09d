"""Does a fused-MoE call give the same result eagerly, replayed from a CUDA graph, and under
torch.compile(mode="reduce-overhead")?  And a patched model, eager against compiled?

Part "kernel": one call per token count M on fresh inputs each time (graph: static buffers
copied in, replayed), compared with the eager call on the same inputs.
Part "model": a small OLMoE (64 experts, top-8, bf16) patched with the fused experts: greedy
tokens and logits eagerly and compiled (static cache, reduce-overhead), against transformers'
own experts the same two ways.
Usage (one GPU): python benchmarks/probes/compiled_decode_probe.py [kernel] [model]
"""

from __future__ import annotations

import sys

import torch


def _inputs(M, E, K, H, g):
    x = (torch.randn(M, H, generator=g) * 0.5).to(torch.bfloat16).cuda()
    ids = torch.rand(M, E, generator=g).argsort(1)[:, :K].cuda()
    w = torch.rand(M, K, generator=g)
    return x, ids, (w / w.sum(1, keepdim=True)).cuda()


def _diff(a, b):
    return f"max|d| {(a.float() - b.float()).abs().max().item():.3e} (max|y| {b.float().abs().max().item():.3e})"


def kernel_part():
    from moekit.ops import fused_moe

    for E, K, H, N in ((64, 8, 512, 256), (64, 8, 2048, 1024)):
        g = torch.Generator().manual_seed(0)
        w13 = (torch.randn(E, 2 * N, H, generator=g) * H ** -0.5).to(torch.bfloat16).cuda()
        w2 = (torch.randn(E, H, N, generator=g) * N ** -0.5).to(torch.bfloat16).cuda()
        for M in (1, 2, 4, 16, 64):
            sx, sids, sw = _inputs(M, E, K, H, g)
            fused_moe(sx, w13, w2, sids, sw)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fused_moe(sx, w13, w2, sids, sw)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                sy = fused_moe(sx, w13, w2, sids, sw)
            compiled = torch.compile(lambda a, b, c: fused_moe(a, w13, w2, b, c), mode="reduce-overhead",
                                     fullgraph=True)
            worst_g = worst_c = 0.0
            for trial in range(4):
                x, ids, w = _inputs(M, E, K, H, g)
                want = fused_moe(x, w13, w2, ids, w)
                sx.copy_(x), sids.copy_(ids), sw.copy_(w)
                graph.replay()
                got_c = compiled(x, ids, w).clone()
                torch.cuda.synchronize()
                worst_g = max(worst_g, (sy.float() - want.float()).abs().max().item())
                worst_c = max(worst_c, (got_c.float() - want.float()).abs().max().item())
            scale = want.float().abs().max().item()
            print(f"E{E} H{H} N{N} M={M:3d}: graph replay max|d| {worst_g:.3e}, compiled max|d| {worst_c:.3e} "
                  f"(max|y| {scale:.3e})", flush=True)
            torch._dynamo.reset()


def model_part():
    from moekit.integrations.transformers import patch, unpatch
    from tests.gpu.test_local_path_gpu import _greedy  # eager, or static cache + reduce-overhead
    from tests.integrations.tiny_models import build, prompts

    model = build("olmoe", device="cuda", dtype=torch.bfloat16, hidden=512, intermediate=256, experts=64, top_k=8)
    for batch in (1, 4):
        ids = prompts(batch=batch, length=16, seed=3).cuda()
        for name in ("transformers", "fused"):
            if name == "fused":
                patch(model, experts="fused")
            e_tok, e_log = _greedy(model, ids, False)
            c_tok, c_log = _greedy(model, ids, True)
            c_tok2, c_log2 = _greedy(model, ids, True)
            agree = (e_tok == c_tok).float().mean().item()
            print(f"batch {batch} {name:12s}: tokens agree {agree:.3f} (replay {(e_tok == c_tok2).float().mean().item():.3f}); "
                  f"step-0 logits {_diff(c_log[:, 0], e_log[:, 0])}; replay {_diff(c_log2[:, 0], e_log[:, 0])}",
                  flush=True)
            model.__dict__.pop("_compiled_call", None)
            model.__dict__.pop("_last_compile_config", None)
            torch._dynamo.reset()
            if name == "fused":
                unpatch(model)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["kernel", "model"]
    print(torch.cuda.get_device_name(), flush=True)
    if "kernel" in parts:
        kernel_part()
    if "model" in parts:
        model_part()
