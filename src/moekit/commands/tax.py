"""`moekit tax`: the MoE tax model, its calibration on this GPU, and its check against measurements."""

from __future__ import annotations

import sys

from moekit.commands import check_float, check_int
from moekit.outputs import DEFAULT_OUT_DIR

ALL_MODELS_HELP = "all = qwen3-30b-a3b, olmoe-1b-7b, deepseek-v3-tp8, mixtral-8x7b, qwen2-moe"
# The hardware presets (moekit.tax.hardware.PRESETS), named here so that `moekit --help` imports no library
# package (moekit.tax loads numpy and torch).
HARDWARE = ("A100", "H100", "H200", "B200")
MAX_GPUS = 65536  # `--gpus`: the largest system the model is asked about


def _calibrations(spec: str | None) -> list:
    from moekit.bench.tax_measure import load_calibrations

    return load_calibrations(spec)


def _positive(flag: str, value) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{flag} must be > 0, got {value!r}")


def run(args) -> int:
    from moekit.outputs import check_output_dir

    check_int("--gpus", args.gpus, 1, MAX_GPUS)
    _positive("--deadline", args.deadline)
    # Numbers of the modes not chosen are checked too: a NaN is a mistake whatever the mode.
    check_float("--beta", args.beta, 0.0, 1.0)
    check_float("--hbm-bw", args.hbm_bw, 0.0)
    check_float("--peak-tflops", args.peak_tflops, 0.0)
    if args.figures is not None:
        check_output_dir(args.figures, "--figures")
    if args.measure:
        check_output_dir(args.out_dir, "--out-dir")
    if args.recompare:  # the model side of saved --measure records, with other hardware numbers or a calibration
        from moekit.bench.tax_report import error_table, format_recompare, recompare

        files = [f.strip() for f in args.recompare.split(",") if f.strip()]
        cals = _calibrations(args.hardware_file)
        rows = []
        for path in files:
            print(f"== {path}")
            file_rows = recompare(path, hbm_bw=args.hbm_bw and args.hbm_bw * 1e9,
                                  peak_flops=args.peak_tflops and args.peak_tflops * 1e12, calibrations=cals or None,
                                  ramp=not args.no_ramp)
            print(format_recompare(file_rows))
            rows += file_rows
        print()
        print(error_table(rows=rows))  # the recomputed numbers of both models
        return 0
    if args.measure:  # time MoE / DenseFA / DensePA blocks here and check the model (moekit.bench.tax_measure)
        from moekit.bench.tax_measure import ALL_MODELS, MeasureConfig, run_measure
        from moekit.bench.tax_report import format_measure

        check_int("--configs", args.configs, 0)
        check_int("--iters", args.iters, 1)
        check_int("--compile-workers", args.compile_workers, 0)
        models = ",".join(ALL_MODELS) if args.model == "all" else args.model
        record = run_measure(MeasureConfig(models=models, batch_sizes=args.batch_sizes, hardware=args.hardware,
                                           configs=args.configs, configs_from=args.configs_from, beta=args.beta,
                                           iters=args.iters, calibration=args.hardware_file, ramp=not args.no_ramp,
                                           deadline_s=args.deadline, compile_workers=args.compile_workers),
                             out_dir=args.out_dir, log=lambda line: print(line, file=sys.stderr, flush=True))
        print(format_measure(record))
        return 0 if record["results"]["verified"] else 1
    from moekit.tax.report import tax_report

    if args.model == "all":
        raise ValueError("--model all is for --measure; give one model")
    print(tax_report(model=args.model, hardware=args.hardware, n_gpus=args.gpus, out_dir=args.figures,
                     as_json=args.json, calibrations=_calibrations(args.hardware_file)))
    return 0


def run_calibrate(args) -> int:
    from moekit.bench.tax_calibrate import CalibrateConfig, run_calibrate as calibrate

    check_int("--configs", args.configs, 0)
    check_int("--iters", args.iters, 1)
    check_int("--compile-workers", args.compile_workers, 0)
    _positive("--deadline", args.deadline)
    from moekit.outputs import check_output_dir

    check_output_dir(args.out_dir, "--out-dir")
    cal, path = calibrate(CalibrateConfig(hardware=args.hardware, configs=args.configs, grouped=not args.no_grouped,
                                          iters=args.iters, deadline_s=args.deadline,
                                          compile_workers=args.compile_workers),
                          out_dir=args.out_dir, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"calibration of {cal.name}: {path}")
    for part, source in cal.sources.items():
        print(f"  {part}: {source}")
    return 0


def register(sub) -> None:
    from moekit.shapes import PRESETS

    models, devices = ", ".join(sorted(PRESETS)), ", ".join(HARDWARE)
    x = sub.add_parser("tax", help="the MoE tax model: tau per batch size, dominant tax source, figures")
    x.add_argument("--model", default="mixtral-8x7b",
                   help=f"model shape preset: {models}, or <preset>-tp<n> for one GPU's tensor-parallel shard "
                        f"(default %(default)s; --measure: several, comma-separated, or {ALL_MODELS_HELP})")
    x.add_argument("--hardware", default="H200",
                   help=f"hardware preset ({devices}) or a JSON file of its numbers (default %(default)s)")
    x.add_argument("--hardware-file", default=None, metavar="FILE[,FILE]",
                   help="calibration file(s) from `moekit tax calibrate`: the calibrated model is reported beside "
                        "the 100 %% peaks (the one of the --hardware GPU, else the nearest, moved to it); "
                        "shipped calibrations are used without it")
    x.add_argument("--gpus", type=int, default=8,
                   help=f"GPUs the model is spread over, in [1, {MAX_GPUS}] (default 8)")
    x.add_argument("--figures", default=None, metavar="DIR",
                   help="directory to draw the paper's figures into (PNG; made if missing)")
    x.add_argument("--json", action="store_true", help="print the table as JSON")
    x.add_argument("--measure", action="store_true", help="time the MoE, DenseFA and DensePA blocks on this device "
                   "and compare tau with the model (needs Triton; on the CPU it runs tiny shapes in the interpreter)")
    x.add_argument("--batch-sizes", default=None,
                   help="--measure: comma-separated m in [1, 65536] (default 1,2,4,...,4096; CPU 1,4,16)")
    x.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                   help="--measure: JSON record, PNG, hardware file go here (default %(default)s)")
    x.add_argument("--configs", type=int, default=6, help="--measure: kernel configs tried per m besides the default, "
                   ">= 0 (default 6)")
    x.add_argument("--configs-from", default=None, help="--measure: JSON of measured best kernel configs per m")
    x.add_argument("--beta", type=float, default=None,
                   help="--measure: also time routing of this balancedness, in (0, 1)")
    x.add_argument("--iters", type=int, default=None, help="--measure: timed replays per block, >= 1 (GPU 100, CPU 3)")
    x.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="--measure: begin no further model after this many seconds, > 0 (the record keeps what was "
                        "measured)")
    x.add_argument("--no-ramp", action="store_true",
                   help="--measure, --recompare: price the expert kernel by the calibrated curve even where a RaMP "
                        "model file covers the shape")
    x.add_argument("--compile-workers", type=int, default=None,
                   help="--measure: processes filling Triton's cache first, >= 0 (default min(16, cores) on a GPU)")
    x.add_argument("--recompare", default=None, metavar="FILE[,FILE]",
                   help="recompute the model side of --measure records (with --hardware-file: the calibrated model "
                        "too) and print the largest error per model and GPU")
    x.add_argument("--hbm-bw", type=float, default=None, help="--recompare: HBM GB/s, > 0 (default: the record's)")
    x.add_argument("--peak-tflops", type=float, default=None,
                   help="--recompare: matmul TFLOP/s, > 0 (default: the record's)")
    x.set_defaults(func=run)

    tsub = x.add_subparsers(dest="tax_command", metavar="{calibrate}")
    c = tsub.add_parser("calibrate", help="time a fixed set of GEMMs, copies, router calls and expert-kernel calls "
                        "on this GPU and fit the calibrated model's efficiency curves (a few minutes)")
    c.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                   help="where the calibration file (tax-calibration-<device>-1x-<time>.json) goes (default "
                        "%(default)s)")
    c.add_argument("--hardware", default=None,
                   help=f"preset whose network numbers the file carries ({devices}; default: this GPU's kind)")
    c.add_argument("--configs", type=int, default=None,
                   help="kernel configs tried per expert-kernel point besides the default, >= 0 (GPU 4, CPU 0)")
    c.add_argument("--iters", type=int, default=None, help="timed replays per launch, >= 1 (GPU 20, CPU 3)")
    c.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="stop the expert-kernel stage after this many seconds from the start, > 0")
    c.add_argument("--no-grouped", action="store_true",
                   help="do not time the expert kernel (no Triton needed; the dense curve stands in for it)")
    c.add_argument("--compile-workers", type=int, default=None,
                   help="processes filling Triton's cache first, >= 0 (default min(16, cores) on a GPU)")
    c.set_defaults(func=run_calibrate)
