"""The dataset of `moekit bench kernel` (every config's time at every point) and its report.

The *table* is the full dataset, saved as gzip-compressed JSON (``.json.gz``, read back
without pickle by :func:`load_table`)::

    {"format": "moekit-kernel-table", "version": 1,
     "environment": {...},            # where it was measured (moekit.bench.report.environment)
     "params": {...},                 # the run's options
     "configs": [{"id", "form", "bm", "bn", "bk", "num_warps", "num_stages", "group_m", "split_k", "bn2",
                  "swap_ab"}],
     "shapes": {name: {"num_experts", "top_k", "hidden", "intermediate", "routed_experts",
                       "space_size", "configs": [indices into "configs"],
                       "default": {str(M): index}}},
     "points": [{"shape", "M", "beta", "realized_beta", "expert_counts", "pairs",
                 "touched_experts", "tokens_routed", "weight_bytes", "bytes", "flops", "l2_flush",
                 "ceilings": {"hbm_gbps", "matmul_tflops"},
                 "baseline": {"impl", "median_us", "p95_us", "rel_err_vs_reference"},
                 "align_us": {str(bm): µs},
                 "median_us": [...], "p95_us": [...], "min_us": [...],   # aligned with the shape's configs
                 "iters": [...],                                         # timed replays behind each median
                 "errors": {str(config index): message}}],
     "incomplete": [{"shape", "M", "reason"}]}

``median_us[i]`` is null where config i was not timed at that point (failed its check, did
not compile, or the run stopped at its deadline). :func:`summarize_table` turns the table into
the per-point report and the summary (goals, how often the best config changes with beta);
:func:`merge_tables` joins tables of runs that were split over several device calls.
"""

from __future__ import annotations

import gzip
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from moekit.bench.report import format_table, new_figure, save_figure, to_jsonable
from moekit.bench.stats import geomean
from moekit.jsonfile import read_json

TABLE_FORMAT = "moekit-kernel-table"
TABLE_VERSION = 1
TABLE_KEYS = ("environment", "params", "configs", "shapes", "points")
SAMPLE_COLUMNS = ("median_us", "p95_us", "min_us", "iters")  # per point, one value per config of its shape

# The fused kernel's goals on an H200 (benchmark goals, not tests).
GOAL_SMALL_M = 16  # "at M <= 16 ..."
GOAL_HBM_FRACTION = 0.70  # "... the best config reaches 70% of measured HBM bandwidth"
GOAL_TC_SHAPE, GOAL_TC_M, GOAL_TC_FRACTION = "mixtral-8x7b", 4096, 0.50
GOAL_GEOMEAN = 1.2
# A change of the best config with beta counts as material when keeping the best config of
# the most balanced routing (what a static, batch-size-only dispatch would do) costs more than
# this at another beta; smaller differences are within run-to-run noise.
MATERIAL_REGRET = 0.03

ROW_COLUMNS = ["shape", "M", "beta", "beta_real", "experts", "best", "best_us", "GB/s", "hbm%", "TFLOP/s", "tc%",
               "worst_us", "default_us", "def/best", "baseline_us", "speedup", "align_us"]


# ------------------------------------------------------------------------------ file I/O


def save_table(table: dict, path: str | Path) -> Path:
    """Write ``table`` as gzip-compressed strict JSON (non-finite numbers become null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(to_jsonable(table), allow_nan=False, separators=(",", ":"))
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(text)
    return path


def load_table(path: str | Path) -> dict:
    """Read a table written by :func:`save_table` (JSON only: nothing in it is executed).

    A file that is not gzip, not JSON, or not a kernel table raises ``ValueError`` naming the
    file and what is wrong.
    """
    path = Path(path)
    table = read_json(path, "a kernel table", gzipped=True)
    if not isinstance(table, dict) or table.get("format") != TABLE_FORMAT:
        raise ValueError(f"{path}: not a {TABLE_FORMAT} file")
    if table.get("version") != TABLE_VERSION:
        raise ValueError(f"{path}: version {table.get('version')!r}, this moekit reads {TABLE_VERSION}")
    missing = [key for key in TABLE_KEYS if key not in table]
    if missing:
        raise ValueError(f"{path}: table is missing {', '.join(missing)}")
    _check_points(table, path)
    return table


def _check_points(table: dict, where) -> None:
    """Every point names a known shape and has one value per config of that shape."""
    n_configs = len(table["configs"])
    for shape in table["shapes"].values():
        if any(not isinstance(i, int) or not 0 <= i < n_configs for i in shape.get("configs", [None])):
            raise ValueError(f"{where}: a shape lists a config index outside [0, {n_configs})")
    for p in table["points"]:
        shape = table["shapes"].get(p.get("shape"))
        if shape is None:
            raise ValueError(f"{where}: point of unknown shape {p.get('shape')!r}")
        for key in SAMPLE_COLUMNS[:3]:
            if len(p.get(key, ())) != len(shape["configs"]):
                raise ValueError(f"{where}: point {p['shape']} M={p.get('M')} beta={p.get('beta')}: "
                                 f"{key} has {len(p.get(key, ()))} values for {len(shape['configs'])} configs")


# ------------------------------------------------------------------------------ per point


def _timed(table: dict, point: dict) -> list[tuple[int, float]]:
    """(global config index, median µs) of every config timed at ``point``."""
    idx = table["shapes"][point["shape"]]["configs"]
    return [(i, t) for i, t in zip(idx, point["median_us"]) if t is not None]


def _time_of(table: dict, point: dict, config_index: int) -> float | None:
    idx = table["shapes"][point["shape"]]["configs"]
    try:
        return point["median_us"][idx.index(config_index)]
    except ValueError:
        return None


def point_row(table: dict, point: dict) -> dict:
    """One line of the report: best config, its µs and rates, the spread, the baseline."""
    cfgs = table["configs"]
    timed = _timed(table, point)
    row = {"shape": point["shape"], "M": point["M"], "beta": point["beta"], "beta_real": point["realized_beta"],
           "experts": point["touched_experts"], "weight_bytes": point["weight_bytes"], "timed": len(timed),
           "failed": len(point.get("errors", {}))}
    base = point.get("baseline") or {}
    row["baseline_us"] = base.get("median_us")
    if not timed:
        return row
    best_i, best_us = min(timed, key=lambda it: it[1])
    worst_us = max(t for _, t in timed)
    default_i = table["shapes"][point["shape"]]["default"].get(str(point["M"]))
    default_us = _time_of(table, point, default_i) if default_i is not None else None
    ceil = point["ceilings"]
    gbps = point["bytes"] / (best_us * 1e-6) / 1e9
    tflops = point["flops"] / (best_us * 1e-6) / 1e12
    row |= {
        "best": cfgs[best_i]["id"], "best_index": best_i, "best_us": best_us,
        "GB/s": gbps, "hbm%": 100.0 * gbps / ceil["hbm_gbps"],
        "TFLOP/s": tflops, "tc%": 100.0 * tflops / ceil["matmul_tflops"],
        "worst_us": worst_us, "spread": worst_us / best_us,
        "default": cfgs[default_i]["id"] if default_i is not None else None, "default_us": default_us,
        "def/best": default_us / best_us if default_us else None,
        "speedup": row["baseline_us"] / best_us if row["baseline_us"] else None,
        "align_us": point.get("align_us", {}).get(str(cfgs[best_i]["bm"])),
    }
    return row


# ------------------------------------------------------------------------------- summary


def _goal(passed: bool | None, text: str, **extra) -> dict:
    return {"passed": passed, "text": text, **extra}


def _goals(rows: list[dict], geo: float | None) -> dict:
    # Points whose routing touches no local expert (an EP shard at tiny M) have no weights to stream.
    small = [r for r in rows if r["M"] <= GOAL_SMALL_M and "best_us" in r and r["weight_bytes"] > 0]
    small_fail = [r for r in small if r["hbm%"] < 100 * GOAL_HBM_FRACTION]
    big = [r for r in rows if r["shape"] == GOAL_TC_SHAPE and r["M"] == GOAL_TC_M and "best_us" in r]
    big_fail = [r for r in big if r["tc%"] < 100 * GOAL_TC_FRACTION]
    vs = [r for r in rows if r.get("speedup") is not None]
    slower = [r for r in vs if r["speedup"] < 1.0]

    def where(rs):
        return [f"{r['shape']} M={r['M']} beta={r['beta']:g}" for r in rs]

    return {
        "hbm_small_m": _goal(
            (not small_fail) if small else None,
            f"M <= {GOAL_SMALL_M}: best config >= {GOAL_HBM_FRACTION:.0%} of measured HBM GB/s over touched weights",
            points=len(small), passing=len(small) - len(small_fail),
            min_pct=min((r["hbm%"] for r in small), default=None), failing=where(small_fail)),
        "tc_mixtral_4096": _goal(
            (not big_fail) if big else None,
            f"{GOAL_TC_SHAPE} M={GOAL_TC_M}: best config >= {GOAL_TC_FRACTION:.0%} of measured bf16 matmul TFLOP/s",
            points=len(big), passing=len(big) - len(big_fail),
            min_pct=min((r["tc%"] for r in big), default=None), failing=where(big_fail)),
        "beats_baseline": _goal(
            (not slower) if vs else None, "best config at least as fast as the torch baseline at every point",
            points=len(vs), passing=len(vs) - len(slower), failing=where(slower)),
        "geomean": _goal(None if geo is None else geo >= GOAL_GEOMEAN,
                         f"geometric mean of baseline / best >= {GOAL_GEOMEAN}", value=geo),
    }


def beta_sensitivity(table: dict) -> dict:
    """How often the best config changes with beta at fixed (shape, M), and what it is worth.

    Groups are (shape, M) with at least two betas. A group's routings can only differ if the
    sorted expert-load histograms differ (at M = 1 every beta gives K distinct experts with
    one pair each: nothing for the config to adapt to); ``groups_with_distinct_routing``
    counts those. ``changed``: groups whose best config is not the same at every beta.
    ``material``: groups where the *static* choice, the best config at the group's highest
    beta (what a batch-size-only dispatch tuned on balanced routing picks), is more than
    ``MATERIAL_REGRET`` slower than the best at some other beta. ``static_geomean``: geometric
    mean over those other points of static / best (RaMP's "routing-aware vs static" ratio).
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for p in table["points"]:
        if _timed(table, p):
            groups[(p["shape"], p["M"])].append(p)
    multi = {k: sorted(v, key=lambda p: -p["beta"]) for k, v in groups.items() if len(v) >= 2}
    changed, material, distinct, ratios, examples = 0, 0, 0, [], []
    for (shape, M), pts in sorted(multi.items()):
        loads = {tuple(sorted(p["expert_counts"])) for p in pts}
        distinct += len(loads) > 1
        bests = [min(_timed(table, p), key=lambda it: it[1]) for p in pts]
        if len({i for i, _ in bests}) > 1:
            changed += 1
            examples.append({"shape": shape, "M": M, "best": {f"{p['beta']:g}": table["configs"][i]["id"]
                                                              for p, (i, _) in zip(pts, bests)}})
        static_i = bests[0][0]
        worst_regret = 0.0
        for p, (_, best_us) in zip(pts[1:], bests[1:]):
            static_us = _time_of(table, p, static_i)
            if static_us is not None:
                ratios.append(static_us / best_us)
                worst_regret = max(worst_regret, static_us / best_us - 1.0)
        material += worst_regret > MATERIAL_REGRET
    return {"groups": len(multi), "groups_with_distinct_routing": distinct, "changed": changed,
            "material": material, "material_threshold": MATERIAL_REGRET,
            "static_geomean": geomean(ratios) if ratios else None,
            "static_max": max(ratios) if ratios else None, "examples": examples[:12]}


def summarize_table(table: dict) -> dict:
    """Per-point rows and the summary of a table (see the module docstring for the fields)."""
    rows = [point_row(table, p) for p in table["points"]]
    speedups = [r["speedup"] for r in rows if r.get("speedup")]
    geo = geomean(speedups) if speedups else None
    timed = sum(r["timed"] for r in rows)
    return {
        "rows": rows,
        "summary": {
            "device": table["environment"].get("device"),
            "on_gpu": bool(table["environment"].get("gpu_count")),
            "points": len(rows), "configs_timed": timed, "failures": sum(r["failed"] for r in rows),
            "geomean_speedup_vs_baseline": geo,
            "baseline_impls": sorted({(p.get("baseline") or {}).get("impl") for p in table["points"]} - {None}),
            "ceilings": _ceilings(table),
            "goals": _goals(rows, geo),
            "beta_sensitivity": beta_sensitivity(table),
            "incomplete": table.get("incomplete", []),
        },
    }


def _ceilings(table: dict) -> list[dict]:
    seen = []
    for p in table["points"]:
        if p["ceilings"] not in seen:
            seen.append(p["ceilings"])
    return seen


def _pass(value) -> str:
    return {True: "PASS", False: "FAIL", None: "not measured"}[value]


def format_summary(summary: dict) -> str:
    """The summary block printed last (so it is the tail of a long log)."""
    s = summary
    impls = ", ".join(s["baseline_impls"]) or "-"
    lines = [f"device: {s['device']}; {s['points']} points, {s['configs_timed']} (config, point) timings, "
             f"{s['failures']} not timed (failed check, compile or capture); torch baseline: {impls}"]
    for c in s["ceilings"]:
        lines.append(f"ceilings: HBM copy {c['hbm_gbps']:.0f} GB/s (read + write), "
                     f"matmul {c['matmul_tflops']:.1f} TFLOP/s")
    geo = s["geomean_speedup_vs_baseline"]
    lines.append(f"geomean speedup of the best config over the torch baseline: {'-' if geo is None else f'{geo:.2f}x'}")
    # The goals are a GPU's: a CPU run (Triton's interpreter) says nothing about them.
    for g in s["goals"].values() if s.get("on_gpu", True) else ():
        detail = ""
        if "points" in g:
            detail = f" ({g['passing']}/{g['points']} points"
            if g.get("min_pct") is not None:
                detail += f", lowest {g['min_pct']:.0f}%"
            detail += ")"
        if g.get("value") is not None:
            detail = f" ({g['value']:.2f})"
        lines.append(f"goal {_pass(g['passed'])}: {g['text']}{detail}")
        if g.get("failing"):
            lines.append(f"    failing: {', '.join(g['failing'][:8])}{' ...' if len(g['failing']) > 8 else ''}")
    b = s["beta_sensitivity"]
    static = "-" if b["static_geomean"] is None else f"{b['static_geomean']:.3f}x (max {b['static_max']:.2f}x)"
    lines.append(f"best config changes with beta at fixed (shape, M): {b['changed']}/{b['groups']} groups "
                 f"({b['groups_with_distinct_routing']} with distinct routings); material (> "
                 f"{100 * b['material_threshold']:.0f}% regret for the static beta=max choice): {b['material']}; "
                 f"static / best geomean {static}")
    for item in s["incomplete"]:
        lines.append(f"NOT MEASURED: {item['shape']} M={item['M']} ({item['reason']})")
    return "\n".join(lines)


def format_kernel_report(summary: dict) -> str:
    """The per-point table, then the summary."""
    table = format_table(summary["rows"], ROW_COLUMNS, floatfmt=".3g")
    return "\n".join([table, "", format_summary(summary["summary"])])


# ------------------------------------------------------------------------------- merging


def merge_tables(tables: list[dict]) -> dict:
    """One table from several runs (e.g. one device call per model, or per config offset).

    Configs are matched by id and shapes by name (their dimensions must agree); a point
    (shape, M, beta) measured by several runs gets every config timed by any of them, the
    first run's value where two timed the same config, and the first run's baseline.
    """
    if not tables:
        raise ValueError("merge_tables needs at least one table")
    configs, by_id = [], {}
    for t in tables:
        for c in t["configs"]:
            if c["id"] not in by_id:
                by_id[c["id"]] = len(configs)
                configs.append(c)
    shapes: dict[str, dict] = {}
    # Not dimensions: the configs, the default per M, and the size of the space the run
    # enumerated (a later space may have more configs; the merge keeps the largest).
    own = ("configs", "default", "space_size")
    for t in tables:
        for name, s in t["shapes"].items():
            remap = [by_id[t["configs"][i]["id"]] for i in s["configs"]]
            dims = {k: v for k, v in s.items() if k not in own}
            if name not in shapes:
                shapes[name] = dims | {"configs": [], "default": {}}
            elif {k: v for k, v in shapes[name].items() if k not in own} != dims:
                raise ValueError(f"cannot merge: shape {name!r} has different dimensions in two tables")
            merged = shapes[name]
            if "space_size" in s:
                merged["space_size"] = max(merged.get("space_size", 0), s["space_size"])
            merged["configs"] += [i for i in remap if i not in merged["configs"]]
            for M, i in s["default"].items():
                merged["default"].setdefault(M, by_id[t["configs"][i]["id"]])
    points: dict[tuple, dict] = {}
    values: dict[tuple, dict[int, tuple]] = defaultdict(dict)  # point key -> config -> (median, p95, min)
    for t in tables:
        for p in t["points"]:
            key = (p["shape"], p["M"], p["beta"])
            points.setdefault(key, p | {"errors": {}})
            own = t["shapes"][p["shape"]]["configs"]
            columns = [p.get(c) or [None] * len(own) for c in SAMPLE_COLUMNS]
            for i, *vals in zip(own, *columns):
                if vals[0] is not None:
                    values[key].setdefault(by_id[t["configs"][i]["id"]], tuple(vals))
            for i, msg in p.get("errors", {}).items():
                points[key]["errors"].setdefault(str(by_id[t["configs"][int(i)]["id"]]), msg)
    out_points = []
    for key, p in points.items():
        order, vals = shapes[p["shape"]]["configs"], values[key]
        for k, column in enumerate(SAMPLE_COLUMNS):
            p[column] = [vals[i][k] if i in vals else None for i in order]
        # A config that failed in one run but was timed in another keeps its timing.
        p["errors"] = {i: msg for i, msg in p["errors"].items() if int(i) not in vals}
        out_points.append(p)
    return {"format": TABLE_FORMAT, "version": TABLE_VERSION, "environment": tables[0]["environment"],
            "params": tables[0]["params"], "parts": [{"environment": t["environment"], "params": t["params"]}
                                                     for t in tables],
            "configs": configs, "shapes": shapes, "points": out_points,
            "incomplete": _merged_incomplete(tables, out_points, shapes)}


def _merged_incomplete(tables: list[dict], points: list[dict], shapes: dict) -> list[dict]:
    """The (shape, M) groups the merged parts still miss: skipped in every part that reached
    them (one entry, however many parts skipped it), or measured with configs of the space
    that no part timed or recorded an error for."""
    out, seen = [], set()
    for p in points:
        group = (p["shape"], p["M"])
        order = shapes[p["shape"]]["configs"]
        total = max(len(order), shapes[p["shape"]].get("space_size", 0))
        covered = sum(v is not None or str(i) in p["errors"] for i, v in zip(order, p["median_us"]))
        if covered < total and group not in seen:
            seen.add(group)
            out.append({"shape": p["shape"], "M": p["M"], "reason": f"partial: {covered}/{total} configs in the parts"})
    measured = {(p["shape"], p["M"]) for p in points}
    for item in (item for t in tables for item in t.get("incomplete", [])):
        group = (item["shape"], item["M"])
        if group not in measured and group not in seen:
            seen.add(group)
            out.append(item)
    return out


# ------------------------------------------------------------------------------- figures


def draw_kernel_figures(table: dict, summary: dict, stem: str | Path) -> list[Path]:
    """``{stem}-latency.png`` (best / baseline / default µs vs M per shape and beta) and
    ``{stem}-winners.png`` (which config wins at each (M, beta), per shape)."""
    rows = [r for r in summary["rows"] if "best_us" in r]
    if not rows:
        return []
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    device = table["environment"].get("device", "?")
    return [_latency_figure(rows, shapes, device, Path(f"{stem}-latency.png")),
            _winners_figure(table, rows, shapes, device, Path(f"{stem}-winners.png"))]


def _grid(n: int) -> tuple[int, int]:
    cols = min(n, 3)
    return math.ceil(n / cols), cols


def _latency_figure(rows, shapes, device, path: Path) -> Path:
    nr, nc = _grid(len(shapes))
    fig, axes = new_figure(nr, nc, figsize=(5.2 * nc, 4.0 * nr), layout="constrained")
    axes = np.atleast_1d(axes).ravel()
    betas = sorted({r["beta"] for r in rows}, reverse=True)
    colors = {b: c for b, c in zip(betas, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
                                           "tab:brown", "tab:pink", "tab:gray"] * 4)}
    for ax, shape in zip(axes, shapes):
        for b in betas:
            rs = sorted((r for r in rows if r["shape"] == shape and r["beta"] == b), key=lambda r: r["M"])
            if not rs:
                continue
            ms = [r["M"] for r in rs]
            ax.plot(ms, [r["best_us"] for r in rs], "o-", color=colors[b], label=f"best, beta={b:g}")
            base = [(r["M"], r["baseline_us"]) for r in rs if r.get("baseline_us")]
            if base:
                ax.plot(*zip(*base), "x--", color=colors[b], alpha=0.7, label=f"torch, beta={b:g}")
            if b == betas[0]:
                dflt = [(r["M"], r["default_us"]) for r in rs if r.get("default_us")]
                if dflt:
                    ax.plot(*zip(*dflt), "s:", color="k", alpha=0.6, label=f"default_config, beta={b:g}")
        ax.set(xscale="log", yscale="log", xlabel="M (tokens)", ylabel="µs (median)", title=shape)
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[len(shapes):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Fused MoE kernel: best config vs torch baseline ({device})")
    return save_figure(fig, path)


def _short(cfg: dict) -> str:
    """A config as a cell label: form + bm, tiles, then only the modes that are on."""
    lines = [f"{'F' if cfg['form'] == 'fused' else 'T'}{cfg['bm']}", f"{cfg['bn']}x{cfg['bk']}"]
    if cfg["split_k"] > 1:
        lines.append(f"k{cfg['split_k']}")
    if cfg["group_m"] > 1:
        lines.append(f"g{cfg['group_m']}")
    if cfg.get("bn2"):  # (tables written before bn2 existed have no such key)
        lines.append(f"n{cfg['bn2']}")
    if cfg.get("swap_ab"):  # (nor swap_ab)
        lines.append("x")
    return "\n".join(lines)


def _winners_figure(table, rows, shapes, device, path: Path) -> Path:
    nr, nc = _grid(len(shapes))
    fig, axes = new_figure(nr, nc, figsize=(5.6 * nc, 4.2 * nr), layout="constrained")
    axes = np.atleast_1d(axes).ravel()
    for ax, shape in zip(axes, shapes):
        rs = [r for r in rows if r["shape"] == shape]
        ms = sorted({r["M"] for r in rs})
        bs = sorted({r["beta"] for r in rs}, reverse=True)
        winners = list(dict.fromkeys(r["best_index"] for r in rs))
        grid = np.full((len(bs), len(ms)), np.nan)
        for r in rs:
            grid[bs.index(r["beta"]), ms.index(r["M"])] = winners.index(r["best_index"])
        ax.imshow(grid, cmap="tab20", vmin=0, vmax=19, aspect="auto")
        for r in rs:
            ax.text(ms.index(r["M"]), bs.index(r["beta"]), _short(table["configs"][r["best_index"]]),
                    ha="center", va="center", fontsize=6.5)
        ax.set_xticks(range(len(ms)), [str(m) for m in ms])
        ax.set_yticks(range(len(bs)), [f"{b:g}" for b in bs])
        ax.set(xlabel="M", ylabel="beta (target)", title=f"{shape}: {len(winners)} winning configs")
    for ax in axes[len(shapes):]:
        ax.set_visible(False)
    fig.suptitle(f"Winning config per point ({device})\nT/F = two_launch/fused + bm, bn x bk, k = split-K, "
                 "g = GROUP_M, n = GEMM2's own tile")
    return save_figure(fig, path)
