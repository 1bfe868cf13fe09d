"""One MoE block's experts call, as a transformers model makes it, on moekit and on transformers.

``moekit bench experts``: for a model preset at real dimensions (:mod:`moekit.integrations.lm.presets`,
one decoder layer, bf16) and each token count M, the experts module of its MoE block is called
as the model calls it (``experts(hidden_states [M, H], top_k_index [M, K], top_k_weights [M, K])``):

* ``transformers``: the module as loaded (transformers' default experts implementation);
* ``moekit fused`` / ``moekit fused_fp8``: the same module after
  :func:`moekit.integrations.transformers.patch` (the local dispatcher and the token-major
  fused kernel);
* ``fused_moe op``: :func:`moekit.ops.fused_moe` alone on the same weights (the floor of what the
  patched call can cost).

Per side and M: ``launches`` (GPU kernels and copies of one call, from ``torch.profiler``),
``host_us`` (median wall time of the call on the host, the GPU idle before it: the time until
the host can issue the next thing, which includes any wait for the GPU inside the call),
``eager_us`` (median GPU time per call in a loop of eager calls, CUDA events: what a model pays
when the host is the bottleneck), ``graph_us`` (median GPU time of one CUDA-graph replay with a
cold L2, where the call can be captured: the GPU work alone) and ``host_syncs`` (whether one
call passes ``torch.cuda.set_sync_debug_mode("error")``). At M = 1 the record also has the HBM
time of the bytes of the experts the routing touched, at the copy bandwidth measured in the same
run (``floor_us``).
"""

from __future__ import annotations

import statistics
import time

import torch

from moekit.bench.stats import summarize

SIDES = ("transformers", "moekit fused", "moekit fused_fp8", "fused_moe op")
DEFAULT_MS = (1, 16, 64, 256, 512)


def _routing(M: int, E: int, K: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(M, E, generator=g)
    weights, ids = torch.softmax(scores, -1).topk(K, dim=-1)
    return ids.to(device), (weights / weights.sum(-1, keepdim=True)).to(device)


def count_launches(call) -> int:
    """GPU kernels, copies and fills of one ``call()`` (torch.profiler, after a warm-up call)."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def host_us(call, iters: int) -> float:
    """Median host wall time of one call, the GPU idle before each."""
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def syncs_ok(call) -> bool:
    """Whether one call runs under ``torch.cuda.set_sync_debug_mode("error")``."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def measure_side(call, *, iters: int, warmup: int) -> dict:
    from moekit.bench.timing import time_cold, time_fn

    row = dict(launches=count_launches(call), host_us=host_us(call, iters), host_syncs=not syncs_ok(call),
               eager_us=summarize(time_fn(call, iters=iters, warmup=warmup))["median"])
    try:
        row["graph_us"] = summarize(time_cold(call, iters=iters, warmup=warmup))["median"]
    except RuntimeError:  # not capturable (a host sync inside)
        row["graph_us"] = None
    return row


def bench_experts_call(preset: str = "olmoe-1b-7b", *, ms=DEFAULT_MS, sides=SIDES, iters: int = 50,
                       warmup: int = 10, seed: int = 0, log=print) -> dict:
    """The comparison for one preset; ``{"params", "rows"}`` (one row per side and M)."""
    from moekit.bench.ceilings import measure_ceilings
    from moekit.integrations.lm.presets import random_model
    from moekit.integrations.transformers import moe_blocks, patch, unpatch
    from moekit.ops import fused_moe

    for side in sides:
        if side not in SIDES:
            raise ValueError(f"sides must be among {SIDES}, got {side!r}")
    if not torch.cuda.is_available():
        raise ValueError("moekit bench experts times GPU calls: it needs a GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    model = random_model(preset, layers=1, dtype=torch.bfloat16, device=device, seed=seed)
    experts = moe_blocks(model)[0][1].experts
    E, two_n, H = experts.gate_up_proj.shape
    N = two_n // 2
    K = model.config.num_experts_per_tok
    hbm_gbps = measure_ceilings(device, torch.bfloat16, 1 << 30, 4096)["hbm_gbps"]
    rows = []
    for side in sides:
        kind = side.split()[-1]
        if side.startswith("moekit"):
            patch(model, experts=kind)
        try:
            for M in ms:
                x = torch.randn(M, H, device=device, dtype=torch.bfloat16)
                ids, w = _routing(M, E, K, seed + M, device)
                if side == "fused_moe op":
                    w13, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()

                    def call():
                        return fused_moe(x, w13, w2, ids, w)
                else:
                    def call():
                        return experts(x, ids, w)
                with torch.no_grad():
                    row = dict(side=side, M=M, **measure_side(call, iters=iters, warmup=warmup))
                if M == 1:
                    touched = int(torch.unique(ids).numel())
                    row["floor_us"] = touched * 3 * H * N * 2 / (hbm_gbps * 1e3)
                    row["touched_experts"] = touched
                rows.append(row)
                log(f"{preset} {side:>18} M={M:4d}: {row['launches']:3d} launches, host {row['host_us']:8.1f} us, "
                    f"eager {row['eager_us']:8.1f} us, graph {row['graph_us'] or float('nan'):8.1f} us"
                    + (" (host syncs)" if row["host_syncs"] else ""))
        finally:
            if side.startswith("moekit"):
                unpatch(model)
    params = dict(preset=preset, num_experts=E, top_k=K, hidden=H, intermediate=N, ms=list(ms), iters=iters,
                  warmup=warmup, hbm_gbps=hbm_gbps, device_name=torch.cuda.get_device_name(device),
                  transformers_experts_implementation=model.config._experts_implementation)
    return {"params": params, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    """``moekit bench experts``: the comparison for each preset named, one JSON record."""
    import argparse

    from moekit.bench.report import format_table, write_record
    from moekit.outputs import DEFAULT_OUT_DIR, check_output_dir

    p = argparse.ArgumentParser(prog="moekit bench experts", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="olmoe-1b-7b,qwen3-30b-a3b,mixtral-8x7b",
                   help="comma-separated model presets (moekit.integrations.lm.presets)")
    p.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)), help="comma-separated token counts")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, among {', '.join(SIDES)}")
    p.add_argument("--iters", type=int, default=50, help="timed calls per measurement (median reported)")
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="folder for the JSON record (default %(default)s/)")
    args = p.parse_args(argv)
    check_output_dir(args.out_dir, "--out-dir")
    ms = tuple(int(m) for m in args.ms.split(","))
    if any(not 1 <= m <= 65536 for m in ms):
        raise ValueError(f"--ms must be token counts in [1, 65536], got {args.ms!r}")
    if not 5 <= args.iters <= 100000:
        raise ValueError(f"--iters must be in [5, 100000], got {args.iters}")
    results = [bench_experts_call(preset, ms=ms, sides=tuple(args.sides.split(",")), iters=args.iters,
                                  warmup=max(3, args.iters // 5)) for preset in args.presets.split(",")]
    rows = [dict(preset=r["params"]["preset"], **row) for r in results for row in r["rows"]]
    print(format_table(rows, ["preset", "side", "M", "launches", "host_us", "eager_us", "graph_us", "floor_us",
                              "host_syncs"], floatfmt=".1f"))
    path = write_record("experts-call", {"presets": [r["params"] for r in results]}, {"rows": rows},
                        out_dir=args.out_dir)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
