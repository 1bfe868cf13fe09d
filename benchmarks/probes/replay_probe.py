"""Where the host time of a fused experts call goes, and what replaying it from its recorded
launches saves (one GPU, OLMoE-1B-7B dimensions, bf16).

For M = 1 / 16 / 64 / 256: host µs per call (median, GPU idle before each) of the bare
``moekit.ops.fused_moe`` call, of the patched transformers experts module and of transformers'
own, with replay (``moekit.kernels.recipe``) on and off; whether the replayed output equals the
ordinary path's (bitwise where the schedule is deterministic); a cProfile of the patched call;
and the host cost of the primitives a call is made of.

    python benchmarks/probes/host_path_probe.py [--iters 300]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def per_call_us(fn, n: int = 20000) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    from moekit.bench.experts_call import _routing, host_us
    from moekit.integrations.lm.presets import random_model
    from moekit.integrations.transformers import moe_blocks, patch
    from moekit.kernels import bound, recipe
    from moekit.ops import fused_moe
    from moekit.ops.calls import signature

    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--ms", type=int, nargs="+", default=[1, 16, 64, 256])
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"device: {torch.cuda.get_device_name(device)}; replay enabled at import: {recipe.ENABLED}")
    model = random_model("olmoe-1b-7b", layers=1, dtype=torch.bfloat16, device=device, seed=0)
    experts = moe_blocks(model)[0][1].experts
    E, two_n, H = experts.gate_up_proj.shape
    K = model.config.num_experts_per_tok
    w13, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()
    torch.set_grad_enabled(False)

    calls = {}
    for M in args.ms:
        x = torch.randn(M, H, device=device, dtype=torch.bfloat16)
        ids, w = _routing(M, E, K, M, device)
        calls[M] = (x, ids, w)
        print(f"\nM={M}: transformers experts host {host_us(lambda: experts(x, ids, w), args.iters):8.1f} us")
    patch(model, experts="fused")
    for M, (x, ids, w) in calls.items():
        results = {}
        for replay in (False, True):
            recipe.ENABLED = replay
            recipe.forget()
            op = lambda: fused_moe(x, w13, w2, ids, w)  # noqa: E731
            patched = lambda: experts(x, ids, w)  # noqa: E731
            for _ in range(3):
                op(), patched()
            outs = (op().clone(), patched().clone())
            torch.cuda.synchronize()
            results[replay] = outs
            print(f"M={M} replay={'on ' if replay else 'off'}: op host {host_us(op, args.iters):8.1f} us, "
                  f"patched host {host_us(patched, args.iters):8.1f} us, recipes {recipe.recipe_count()}")
        for name, a, b in zip(("op", "patched"), results[False], results[True]):
            same = torch.equal(a, b)
            diff = (a.float() - b.float()).abs().max().item()
            print(f"M={M} {name}: replay output equal to ordinary: {same} (max |diff| {diff:.3g})")

    recipe.ENABLED = True
    recipe.forget()
    for M in (1, 64):
        if M not in calls:
            continue
        x, ids, w = calls[M]
        for _ in range(5):
            experts(x, ids, w)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            experts(x, ids, w)
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(28)
        print(f"\ncProfile, patched experts call, M={M}, 500 calls, replay on:\n{s.getvalue()}")

    x, ids, w = calls[args.ms[0]]
    prims = {
        "torch.empty([1, 2048] bf16)": lambda: torch.empty((1, 2048), dtype=torch.bfloat16, device=device),
        "x.data_ptr()": x.data_ptr,
        "x.shape / x.stride() / x.dtype / x.device": lambda: (x.shape, x.stride(), x.dtype, x.device),
        "signature(8 args)": lambda: signature(x, w13, w2, ids, w, None, None, None),
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "bound.current_stream()": bound.current_stream,
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "torch.is_grad_enabled()": torch.is_grad_enabled,
        "x.view(-1)": lambda: x.view(-1),
    }
    print("\nprimitives (host us per call):")
    for name, fn in prims.items():
        print(f"  {name:45s} {per_call_us(fn):7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
