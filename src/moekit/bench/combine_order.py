"""`moekit bench combine-order`: how far the two combine orders are from a float64 combine.

Both orders start from the same expert outputs (random rows, one per (token, slot), rounded
to the activations' dtype as an expert's output is) and the same routing (synthetic, at a
preset's E and K, balancedness ``beta``); the float64 reference is ``sum_k w_k * out_k``
of those rounded outputs in float64, so what is measured is the combine's own rounding:

* ``combine_order="slot"`` (:func:`moekit.ep.weighted_slot_sum`): a float32 sum, one rounding;
* ``combine_order="rank"`` (:func:`moekit.ep.weighted_rank_sum`): one rounding of each
  rank's partial, then a float32 sum of the partials and one more rounding.

Reported per (shape, world size, dtype): max absolute error, normwise relative error
``||y - exact|| / ||exact||``, the largest error in units of the dtype's rounding unit
``u`` relative to the row's largest value, the share of outputs where the two orders
differ, and the share of tokens whose slots all sit on one rank (there the orders are
bitwise equal). Single process, CPU; nothing is timed.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moekit.bench.report import DEFAULT_OUT_DIR, format_table, write_record
from moekit.ep.dispatcher import weighted_rank_sum, weighted_slot_sum
from moekit.ep.lowlatency.buffers import DEFAULT_BETA
from moekit.outputs import check_output_dir
from moekit.routing import synthetic_routing
from moekit.shapes import get_shape

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def rounding_unit(dtype: torch.dtype) -> float:
    """u = 2^-p, half the distance from 1 to the next value (bf16: 2^-8, fp16: 2^-11)."""
    return torch.finfo(dtype).eps / 2


def order_distance(shape: str, world_size: int, tokens: int, dtype: torch.dtype, *, beta: float = DEFAULT_BETA,
                   seed: int = 0) -> dict:
    """The errors of both orders against float64 on one routing (see the module docstring)."""
    s = get_shape(shape)
    H, K, E = s.hidden, s.top_k, s.num_experts
    if E % world_size:
        raise ValueError(f"world_size={world_size} must divide num_experts={E} of {shape}")
    ids, w = synthetic_routing(tokens, E, K, beta=beta, seed=seed)
    out = torch.randn(tokens, K, H, generator=torch.Generator().manual_seed(seed)).to(dtype)
    exact = (out.double() * w.double().unsqueeze(2)).sum(1)
    scale = exact.abs().amax(1, keepdim=True).clamp(min=1e-30)  # the row's largest value
    u = rounding_unit(dtype)
    results = {}
    by = {"slot": weighted_slot_sum(out, ids, w, dtype),
          "rank": weighted_rank_sum(out, ids, w, dtype, num_experts=E, world_size=world_size)}
    for order, y in by.items():
        err = (y.double() - exact).abs()
        results[order] = dict(max_abs=float(err.max()), rel_norm=float(err.norm() / exact.norm()),
                              max_in_u=float((err / scale).max() / u))
    owner = ids // (E // world_size)
    one_rank = (owner == owner[:, :1]).all(1)
    return dict(shape=shape, world_size=world_size, tokens=tokens, dtype=str(dtype).removeprefix("torch."),
                hidden=H, top_k=K, num_experts=E, beta=beta, u=u, slot=results["slot"], rank=results["rank"],
                differ=float((by["slot"] != by["rank"]).double().mean()),
                tokens_on_one_rank=float(one_rank.double().mean()))


def format_distances(rows: list[dict]) -> str:
    table = [dict(shape=r["shape"], P=r["world_size"], dtype=r["dtype"],
                  slot_max_abs=f"{r['slot']['max_abs']:.2e}", rank_max_abs=f"{r['rank']['max_abs']:.2e}",
                  slot_rel=f"{r['slot']['rel_norm']:.2e}", rank_rel=f"{r['rank']['rel_norm']:.2e}",
                  slot_u=f"{r['slot']['max_in_u']:.2f}", rank_u=f"{r['rank']['max_in_u']:.2f}",
                  differ=f"{r['differ']:.1%}", one_rank=f"{r['tokens_on_one_rank']:.1%}") for r in rows]
    cols = ["shape", "P", "dtype", "slot_max_abs", "rank_max_abs", "slot_rel", "rank_rel", "slot_u", "rank_u",
            "differ", "one_rank"]
    return (format_table(table, cols) + "\nmax_abs / rel (normwise) against float64; *_u: the largest error over "
            "the row's largest value, in units of u (bf16 2^-8, fp16 2^-11); differ: outputs where the orders "
            "differ; one_rank: tokens whose slots all sit on one rank (bitwise equal there)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moekit bench combine-order", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["deepseek-v3", "qwen3-30b-a3b"], metavar="SHAPE",
                   help="model shape presets (default: %(default)s)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8, 64],
                   help="ranks the experts are spread over, each dividing E (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=256, help="tokens, >= 1 (default %(default)s)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES),
                   help="activation dtypes (default: %(default)s)")
    p.add_argument("--beta", type=float, default=DEFAULT_BETA,
                   help="routing balancedness in (0, 1] (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of routing and outputs, >= 0 (default %(default)s)")
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where the JSON record goes (default %(default)s)")
    p.add_argument("--no-record", action="store_true", help="write no record")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tokens < 1 or args.seed < 0 or any(p < 1 for p in args.world_sizes):
        raise ValueError("--tokens and --world-sizes must be >= 1, --seed >= 0")
    if not 0 < args.beta <= 1:
        raise ValueError(f"--beta must be in (0, 1], got {args.beta}")
    if not args.no_record:
        check_output_dir(args.out_dir, "--out-dir")
    rows = []
    for shape in args.shapes:
        for P in args.world_sizes:
            for name in args.dtypes:
                print(f"[bench combine-order] {shape}, {P} ranks, {name}", file=sys.stderr, flush=True)
                rows.append(order_distance(shape, P, args.tokens, DTYPES[name], beta=args.beta, seed=args.seed))
    print(format_distances(rows))
    if not args.no_record:
        params = dict(shapes=args.shapes, world_sizes=args.world_sizes, tokens=args.tokens, dtypes=args.dtypes,
                      beta=args.beta, seed=args.seed, device="cpu (single process, nothing timed)")
        print(f"record: {write_record('combine-order', params, {'rows': rows}, out_dir=args.out_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
