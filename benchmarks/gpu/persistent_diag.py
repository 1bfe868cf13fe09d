"""Temporary diagnostic: persistent decode (split / unsplit) vs two-kernel vs float64 reference."""
import importlib
import torch
import torch.nn.functional as F
from moekit.kernels import KernelConfig, fused_moe
from moekit.routing.generate import synthetic_routing

fm = importlib.import_module("moekit.kernels.fused_moe")
dev = torch.device("cuda")


def ref64(x, w13, w2, ids, tw):
    M, K = ids.shape
    N = w2.shape[2]
    out = torch.zeros(M, x.shape[1], dtype=torch.float64, device=dev)
    for m in range(M):
        for k in range(K):
            e = int(ids[m, k])
            if e < 0:
                continue
            h = x[m].double() @ w13[e].double().T
            a = (F.silu(h[:N]) * h[N:]).to(x.dtype).double()
            out[m] += float(tw[m, k]) * (a @ w2[e].double().T)
    return out


def err(y, r):
    return float((y.double() - r).norm() / r.norm())


for (E, K, H, N, M) in ((256, 8, 7168, 256, 1), (256, 8, 7168, 256, 4), (64, 8, 2048, 256, 1), (64, 8, 2048, 1024, 1)):
    g = torch.Generator(device=dev).manual_seed(1)
    w13 = (torch.randn(E, 2 * N, H, generator=g, device=dev) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, N, generator=g, device=dev) * N ** -0.5).bfloat16()
    x = torch.randn(M, H, generator=g, device=dev).bfloat16()
    ids, tw = synthetic_routing(M, E, K, seed=3)
    ids, tw = ids.to(dev), tw.to(dev)
    r = ref64(x, w13, w2, ids, tw)
    for bk in (128, 256):
        cfg = KernelConfig(bm=16, bn=32, bk=bk, num_stages=3, form="two_launch")
        res = {}
        for name, pers, maxs in (("two", False, 8), ("pers", True, 8), ("pers-nosplit", True, 1), ("pers-s2", True, 2)):
            fm.DECODE_PERSISTENT = pers
            fm.PERSISTENT_MAX_SPLITS = maxs
            res[name] = fused_moe(x, w13, w2, ids, tw, cfg, alignment="direct")
        fm.PERSISTENT_MAX_SPLITS = 8
        fm.DECODE_PERSISTENT = True
        line = "  ".join(f"{k} {err(v, r):.2e}" for k, v in res.items())
        d = (res["pers"].float() - res["two"].float()).abs()
        print(f"E={E} H={H} N={N} M={M} bk={bk}: {line}  | pers-two maxdiff {d.max():.3e} nz {(d > 0).sum().item()}/{d.numel()}",
              flush=True)
