"""`moekit ramp ...`: RaMP's region analysis, profiling and model files."""

from __future__ import annotations

import json

SHAPE_NAMES = ("olmoe-1b-7b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3-tp8", "deepseek-v3-ep32")


def run_regions(args) -> int:
    from moekit.bench.ramp_profile import resolve_shape
    from moekit.ramp.regions import HARDWARE, predict_modes

    hw = HARDWARE[args.gpu]
    elem = 1 if args.dtype == "fp8" else 2
    rows = []
    for name in args.shape or SHAPE_NAMES:
        shape, routed = resolve_shape(name)
        pm = predict_modes(shape, hw, elem, routed)
        rows.append({"shape": name, "E": shape.num_experts, "K": shape.top_k, "H": shape.hidden,
                     "N": shape.intermediate, "region": pm["region"], "lam": round(pm["lam"], 3),
                     "kappa": pm["kappa"], "n_tiles_256": pm["n_tiles"], "decode_grid": pm["decode_grid"],
                     "modes": " + ".join(pm["modes"])})
    if args.json:
        print(json.dumps({"gpu": hw.to_dict(), "dtype": args.dtype, "shapes": rows}, indent=1))
        return 0
    from moekit.bench.report import format_table

    print(f"Performance regions on {hw.key} ({hw.sms} SMs, L2 {hw.l2_bytes >> 20} MiB, effective "
          f"{hw.l2_effective / 2**20:.1f} MiB), {args.dtype}")
    print(format_table(rows, list(rows[0]), floatfmt=".3f"))
    print("lam: one expert's GEMM1 weights / effective L2 (> 1: region B, GROUP_M); kappa: bk = 64 chunks of "
          "GEMM2's reduction (split-K needs >= 32); decode_grid: GEMM2 CTAs of one token at the widest tile "
          "(split-K needs x 4 <= SMs). docs/ramp.md")
    return 0


def run_check(args) -> int:
    from moekit.bench.kernel_report import load_table
    from moekit.ramp import analysis
    from moekit.ramp.dataset import from_kernel_table
    from moekit.ramp.regions import HARDWARE

    hw = HARDWARE[args.gpu]
    table = load_table(args.table)
    names = args.shape or list(table["shapes"])
    report = {"table": args.table, "gpu": args.gpu, "environment": table.get("environment", {}), "shapes": {}}
    for name in names:
        t = from_kernel_table(table, name, args.table)
        rc = analysis.region_check(t, hw)
        fit_t, test_t = analysis.split_points(t, args.fit_m)
        entry = {"region": {k: v for k, v in rc.items() if k != "points"}, "fallback": analysis.fallback_check(t, hw)}
        if test_t.points:
            entry["ablation"] = analysis.ablation(fit_t, test_t, hw, analysis.ABLATION_FORMS)
            entry["phi"] = analysis.ablation(fit_t, test_t, hw, analysis.PHI_FORMS)
        report["shapes"][name] = entry
        print(f"== {name}: region {rc['region']} (lam {rc['lam']:.2f}, kappa {rc['kappa']}), predicted: "
              f"{' + '.join(rc['modes'])}")
        for mode, s in rc["summary"].items():
            print(f"   {mode:9s} predicted at {s['pred_win'] + s['pred_lose']:2d} points (won at {s['pred_win']}), "
                  f"not at {s['nopred_win'] + s['nopred_lose']:2d} (won at {s['nopred_win']}): agree "
                  f"{s['agree'] * 100:.0f} %")
        fb = entry["fallback"]
        print(f"   fallback: regret mean {fb['mean'] * 100:.1f} %, max {fb['max'] * 100:.0f} %; vs the torch "
              f"baseline min {fb.get('vs_baseline_min', float('nan')):.2f}x")
        for key in ("ablation", "phi"):
            for form, r in entry.get(key, {}).items():
                print(f"   {form:38s} held-out mean {r['mean'] * 100:6.2f} % max {r['max'] * 100:6.1f} %  "
                      f"(fit points: {r['fit_mean'] * 100:.2f} / {r['fit_max'] * 100:.1f} %)")
    if args.out:
        _write_report(report, args.out)
    return 0


def _write_report(report: dict, path: str) -> None:
    from moekit.bench.report import to_jsonable

    with open(path, "w") as f:
        json.dump(to_jsonable(report), f, indent=1)
    print(f"written: {path}")


def run_fit(args) -> int:
    from moekit.ramp.costmodel import ModelForm, fit, regret
    from moekit.ramp.modelfile import model_filename, save_model
    from moekit.bench.ramp_profile import load_any_timings
    from moekit.ramp.regions import HARDWARE

    hw = HARDWARE[args.gpu]
    t, meta = load_any_timings(args.timings, args.shape)
    family, capacity = meta["family"], meta["capacity"]
    if args.fit_m:
        t = t.select_points(lambda p: p.M in set(args.fit_m))
    model = fit(t, hw, ModelForm(), family=family, capacity=capacity)
    r = regret(model, t)
    path = save_model(model, f"{args.out_dir}/{model_filename(hw.key, t.shape, t.dtype, family)}", dtype=t.dtype,
                      routed_experts=t.routed_experts,
                      profile={"from": args.timings, "points": len(t.points), "fit_regret_mean": r.mean,
                               "fit_regret_complete_mean": r.complete_mean},
                      environment=t.environment)
    print(f"fitted {len(model.variants)} variants on {len(t.points)} points; regret on them: {r.describe()}\n"
          f"model: {path}")
    if args.held_out:
        from moekit.ramp.analysis import held_out

        report = {"timings": args.timings, "gpu": hw.key, "in_sample": {
            "mean": r.mean, "max": r.max, "complete_mean": r.complete_mean, "complete_max": r.complete_max}}
        for by, what in (("M", "token count"), ("beta", "balancedness")):
            h = report[f"leave_one_{by}_out"] = held_out(t, hw, by=by, family=family, capacity=capacity)
            complete = h["points"] - h["partial"]
            print(f"leave one {what} out: mean {h['mean'] * 100:.2f} %, max {h['max'] * 100:.1f} % over {h['points']} "
                  f"points; over the {complete} complete ones: mean {h['complete_mean'] * 100:.2f} %, "
                  f"max {h['complete_max'] * 100:.1f} %")
            for g, row in h["groups"].items():
                note = f" ({row['partial']} partial, choice unmeasured at {row['unmeasured_choices']})" \
                    if row["partial"] else ""
                print(f"   {by} = {g:>6s} held out: mean {row['mean'] * 100:6.2f} %, max {row['max'] * 100:6.1f} % "
                      f"({row['points']} points){note}")
        if args.report:
            _write_report(report, args.report)
    return 0


def run_profile(args) -> int:
    from moekit.bench.ramp_profile import ProfileSpec, profile

    hidden, inter = args.hidden, args.intermediate
    if args.tiny:
        hidden, inter = hidden or 64, inter or 32
    spec = ProfileSpec(shape=args.shape, experts=args.experts, top_k=args.top_k, hidden=hidden,
                       intermediate=inter, routed_experts=args.routed_experts, dtype=args.dtype,
                       family=args.family, capacity=args.capacity, m_values=tuple(args.m), betas=tuple(args.betas),
                       iters=args.iters, seed=args.seed, compile_workers=args.compile_workers,
                       deadline_s=args.deadline_s, prune=args.prune, shortlist=args.shortlist,
                       shortlist_factor=args.shortlist_factor, shortlist_any_shape=args.shortlist_any_shape,
                       config_stride=args.config_stride,
                       config_offset=args.config_offset, resume=args.resume)
    profile(spec, args.out_dir, lambda s: print(s, flush=True))
    return 0


def run_show(args) -> int:
    from moekit.ramp.modelfile import load_model

    model, meta = load_model(args.model, check_space=not args.no_space_check)
    s = model.shape
    print(f"{args.model}: {s.name} (E={s.num_experts} K={s.top_k} H={s.hidden} N={s.intermediate}) {meta['dtype']} "
          f"{model.family} on {model.hardware.key}; {len(model.configs)} configs, {len(model.variants)} variants; "
          f"form {model.form.to_dict()}")
    print(f"profiled: {json.dumps(meta['profile'])}")
    print(f"environment: {json.dumps(meta['environment'])}")
    return 0


def run_models(args) -> int:
    from moekit.ramp.modelfile import SHIPPED, list_models

    rows = list_models(args.gpu)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("gpu   dtype          family        E    K  H      N      cap  configs  fit mean/max   commit   file")
    for r in rows:
        where = "" if r["dir"] == str(SHIPPED) else f"  ({r['dir']})"
        if "error" in r:
            print(f"-- {r['file']}{where}: does not load: {r['error']}")
            continue
        E, K, H, N = r["shape"]
        fit = "" if r["fit_regret_mean"] is None else f"{100 * r['fit_regret_mean']:.2f}/{100 * r['fit_regret_max']:.1f} %"
        shadow = "  (shadowed)" if r["shadowed"] else ""
        print(f"{r['gpu']:<5} {r['dtype']:<14} {r['family']:<13} {E:<4} {K:<2} {H:<6} {N:<6} {r['capacity'] or '-':<4} "
              f"{r['configs']:<8} {fit:<14} {r['commit'] or '-':<8} {r['file']}{where}{shadow}")
    print(f"{len(rows)} model files (searched: MOEKIT_RAMP_MODELS, then the shipped ones)")
    return 0


def register(sub) -> None:
    r = sub.add_parser("ramp", help="RaMP: performance regions, profiling and the routing-aware config choice")
    rs = r.add_subparsers(dest="ramp_command", required=True)
    g = rs.add_parser("regions", help="the region variables and predicted modes of the preset shapes")
    g.add_argument("--shape", nargs="*", default=None, help=f"default: {', '.join(SHAPE_NAMES)}")
    g.add_argument("--gpu", default="h200", choices=["h200", "h100"], help="the GPU whose constants (SMs, L2, shared memory) are used: h200 or h100")
    g.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"], help="the kernel space: bf16 or fp8 (W8A8)")
    g.add_argument("--json", action="store_true", help="print the regions as JSON")
    g.set_defaults(func=run_regions)
    c = rs.add_parser("check", help="the region predictions, cost-model ablation and fallback on a measured "
                      "moekit bench kernel table (CPU)")
    c.add_argument("table", help="a -table.json.gz of moekit bench kernel")
    c.add_argument("--shape", nargs="*", default=None, help="shapes of the table to check (default: all of them)")
    c.add_argument("--gpu", default="h200", choices=["h200", "h100"], help="the GPU the table was measured on")
    c.add_argument("--fit-m", type=int, nargs="+", default=[1, 16, 64, 256, 4096],
                   help="token counts the model is fitted on; the rest are held out")
    c.add_argument("--out", default=None, help="write the report as JSON here")
    c.set_defaults(func=run_check)
    f = rs.add_parser("fit", help="fit a model file from saved timings (a profile's or a bench kernel table)")
    f.add_argument("timings", help="timings JSON of moekit ramp profile, or a moekit bench kernel -table.json.gz")
    f.add_argument("--shape", default=None, help="with a bench kernel table: which shape")
    f.add_argument("--gpu", default="h200", choices=["h200", "h100"], help="the GPU the timings were measured on")
    f.add_argument("--fit-m", type=int, nargs="*", default=None, help="token counts to fit on (default: all of them)")
    f.add_argument("--out-dir", default=".", help="where the model file goes")
    f.add_argument("--held-out", action="store_true",
                   help="also the regret with one token count / one balancedness left out of the fit")
    f.add_argument("--report", default=None, help="with --held-out: write the regrets as JSON here")
    f.set_defaults(func=run_fit)
    p = rs.add_parser("profile", help="time every config at 25 points on this GPU, fit, write a model file")
    p.add_argument("--shape", default=None, help=f"{', '.join(SHAPE_NAMES)} or a moekit.shapes preset")
    p.add_argument("--experts", type=int, default=None, help="... or the dimensions (E, K, H, N)")
    p.add_argument("--top-k", type=int, default=None, help="K, with --experts")
    p.add_argument("--hidden", type=int, default=None, help="H, with --experts")
    p.add_argument("--intermediate", type=int, default=None, help="N (per expert), with --experts")
    p.add_argument("--routed-experts", type=int, default=None, help="EP shard: the experts the router picks from")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"], help="the kernel space: bf16 or fp8 (W8A8)")
    p.add_argument("--family", default="token", choices=["token", "expert_major"],
                   help="token: fused_moe after a router; expert_major: the kernels after a dispatcher")
    p.add_argument("--capacity", type=int, default=256, help="expert_major: rows per local expert")
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256, 2048], help="the 5 token counts")
    p.add_argument("--betas", type=float, nargs="+", default=[1.0, 0.85, 0.7, 0.55, 0.4],
                   help="the 5 routing balancedness levels in (0, 1]")
    p.add_argument("--iters", type=int, default=10, help="timed replays per (config, point)")
    p.add_argument("--seed", type=int, default=0, help="seed of the routing and the weights")
    p.add_argument("--compile-workers", type=int, default=None, help="processes compiling kernels ahead (default: the cores)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no config after this many seconds (what was timed is saved: --resume goes on)")
    p.add_argument("--prune", type=float, default=None, help="keep configs within this factor of some point's best")
    p.add_argument("--shortlist", default=None, metavar="TIMINGS", action="append",
                   help="time only the configs within --shortlist-factor of some point's best in these timings "
                        "(the same shape measured elsewhere: a profile timings file or a bench kernel table); "
                        "repeat it for several (their union)")
    p.add_argument("--shortlist-factor", type=float, default=1.10, help="see --shortlist (default 1.10)")
    p.add_argument("--shortlist-any-shape", action="store_true",
                   help="the --shortlist timings may be of other shapes (same dtype and family)")
    p.add_argument("--config-stride", type=int, default=1, help="time every n-th config (to split a profile over calls)")
    p.add_argument("--config-offset", type=int, default=0, help="... starting at this one")
    p.add_argument("--resume", default=None, metavar="TIMINGS",
                   help="the timings file of an earlier run of this profile cut short by its deadline: "
                        "keep the token counts it completed, time the rest")
    p.add_argument("--tiny", action="store_true", help="CPU: H=64, N=32 in Triton's interpreter")
    p.add_argument("--out-dir", default=".", help="where the timings and the model file go")
    p.set_defaults(func=run_profile)
    s = rs.add_parser("show", help="what a model file holds")
    s.add_argument("model", help="a model file (JSON)")
    s.add_argument("--no-space-check", action="store_true",
                   help="do not check that every config of the file is in this kernel version's config space")
    s.set_defaults(func=run_show)
    m = rs.add_parser("models", help="the model files selection finds (MOEKIT_RAMP_MODELS, then the shipped ones)")
    m.add_argument("--gpu", choices=("h100", "h200"), help="only this GPU's")
    m.add_argument("--json", action="store_true", help="the rows as JSON")
    m.set_defaults(func=run_models)

