"""`moekit tax`: the MoE tax model, and its check against measurements."""

from __future__ import annotations

import sys

from moekit.commands import check_int


def run(args) -> int:
    check_int("--gpus", args.gpus, 1)
    if args.recompare:  # the model side of a saved --measure record, with other hardware numbers
        from moekit.bench.tax_report import format_recompare, recompare

        print(format_recompare(recompare(args.recompare, hbm_bw=args.hbm_bw and args.hbm_bw * 1e9,
                                         peak_flops=args.peak_tflops and args.peak_tflops * 1e12)))
        return 0
    if args.measure:  # time MoE / DenseFA / DensePA blocks here and check the model (moekit.bench.tax_measure)
        from moekit.bench.tax_measure import MeasureConfig, run_measure
        from moekit.bench.tax_report import format_measure

        check_int("--configs", args.configs, 0)
        check_int("--iters", args.iters, 1)
        record = run_measure(MeasureConfig(models=args.model, batch_sizes=args.batch_sizes, hardware=args.hardware,
                                           configs=args.configs, configs_from=args.configs_from, beta=args.beta,
                                           iters=args.iters), out_dir=args.out_dir,
                             log=lambda line: print(line, file=sys.stderr, flush=True))
        print(format_measure(record))
        return 0 if record["results"]["verified"] else 1
    from moekit.tax.report import tax_report

    print(tax_report(model=args.model, hardware=args.hardware, n_gpus=args.gpus, out_dir=args.figures,
                     as_json=args.json))
    return 0


def register(sub) -> None:
    from moekit.shapes import PRESETS
    from moekit.tax.hardware import PRESETS as HARDWARE

    models, devices = ", ".join(sorted(PRESETS)), ", ".join(HARDWARE)
    x = sub.add_parser("tax", help="the MoE tax model: tau per batch size, dominant tax source, figures")
    x.add_argument("--model", default="mixtral-8x7b",
                   help=f"model shape preset: {models} (default %(default)s; --measure: several, comma-separated)")
    x.add_argument("--hardware", default="H200",
                   help=f"hardware preset ({devices}) or a JSON file of its numbers (default %(default)s)")
    x.add_argument("--gpus", type=int, default=8, help="GPUs the model is spread over, >= 1 (default 8)")
    x.add_argument("--figures", default=None, help="directory to draw the paper's figures into (PNG)")
    x.add_argument("--json", action="store_true", help="print the table as JSON")
    x.add_argument("--measure", action="store_true", help="time the MoE, DenseFA and DensePA blocks on this device "
                   "and compare tau with the model (needs Triton; on the CPU it runs tiny shapes in the interpreter)")
    x.add_argument("--batch-sizes", default=None,
                   help="--measure: comma-separated m in [1, 65536] (default 1,2,4,...,4096; CPU 1,4,16)")
    x.add_argument("--out-dir", default="benchmarks/results", help="--measure: JSON record, PNG, hardware file go here")
    x.add_argument("--configs", type=int, default=6, help="--measure: kernel configs tried per m besides the default, "
                   ">= 0 (default 6)")
    x.add_argument("--configs-from", default=None, help="--measure: JSON of measured best kernel configs per m")
    x.add_argument("--beta", type=float, default=None,
                   help="--measure: also time routing of this balancedness, in (0, 1)")
    x.add_argument("--iters", type=int, default=None, help="--measure: timed replays per block, >= 1 (GPU 100, CPU 3)")
    x.add_argument("--recompare", default=None, metavar="FILE", help="recompute the model side of a --measure record")
    x.add_argument("--hbm-bw", type=float, default=None, help="--recompare: HBM GB/s, > 0 (default: the record's)")
    x.add_argument("--peak-tflops", type=float, default=None,
                   help="--recompare: matmul TFLOP/s, > 0 (default: the record's)")
    x.set_defaults(func=run)
