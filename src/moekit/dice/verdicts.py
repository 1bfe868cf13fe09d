"""What ``moekit dice step`` concludes from its measurements: the best dispatcher of each
schedule, the share of the exchange each schedule hid, and the DICE goals, met or not.

Goals (the DICE paper's claim, on this project's hardware):

* speed: at local batch 8 to 32 on 4 GPUs, DICE (the ``dice`` schedule, on its best
  dispatcher) takes at most 1 / 1.2 of the fastest synchronous run (``sync`` on its best
  dispatcher), for every model and batch measured;
* overlap: in the profiled case, at least 60 % of the exchange's time (transfer kernels)
  ran beside the model's compute on the compute stream, for the ``dice`` schedule (the
  mean over ranks).

A goal whose measurements are missing (another world size, no trace) is "not measured",
never met.
"""

from __future__ import annotations

SPEED_GOAL = 1.2
OVERLAP_GOAL = 0.60
SPEED_BATCHES = (8, 32)  # inclusive range of local batches the speed goal covers
SPEED_WORLD = 4


def best_rows(rows: list[dict], schedules) -> list[dict]:
    """Per (model, batch): each schedule's fastest dispatcher, its ms, its speedup over the
    fastest synchronous run (any dispatcher), and its peak memory per rank."""
    cases: dict = {}
    for r in rows:
        if "skipped" in r:
            continue
        key = (r["model"], r["batch"])
        best = cases.setdefault(key, {}).get(r["schedule"])
        if best is None or r["median_ms"] < best["median_ms"]:
            cases[key][r["schedule"]] = r
    out = []
    for (model, batch), best in cases.items():
        line = dict(model=model, batch=batch)
        sync = best.get("sync")
        for name in schedules:
            r = best.get(name)
            if r is None:
                continue
            line[f"{name} ms"] = r["median_ms"]
            line[f"{name} on"] = r["dispatcher"]
            if name != "sync" and sync is not None:
                line[f"{name} x"] = sync["median_ms"] / r["median_ms"]
            if r.get("peak_gib") is not None:
                line[f"{name} GiB"] = r["peak_gib"]
        out.append(line)
    return out


def hidden_share(traces: list[dict]) -> dict[str, dict]:
    """Per (dispatcher, schedule) profiled: the mean over ranks of the share of the exchange
    hidden, and the exchange and hidden ms of the profiled steps (mean over ranks)."""
    groups: dict = {}
    for t in traces:
        if "skipped" in t or t.get("overlap", {}).get("overlap_fraction") is None:
            continue
        groups.setdefault((t.get("dispatcher"), t["schedule"]), []).append(t["overlap"])
    out = {}
    for (dispatcher, schedule), overlaps in groups.items():
        n = len(overlaps)
        # Per rank the transfer stream (communicator) whose exchanges were hidden best: for dice
        # the stale group's, apart from the synchronous half's, which is exposed by design.
        best = [max((v["overlap_fraction"] for v in o.get("by_stream", {}).values()
                     if v["overlap_fraction"] is not None), default=None) for o in overlaps]
        best = [b for b in best if b is not None]
        out[schedule] = dict(dispatcher=dispatcher, ranks=n,
                             hidden=sum(o["overlap_fraction"] for o in overlaps) / n,
                             exchange_ms=sum(o["transfer_ms"] for o in overlaps) / n,
                             hidden_ms=sum(o["overlap_ms"] for o in overlaps) / n,
                             best_stream_hidden=sum(best) / len(best) if best else None)
    return out


def verdicts(results: dict, world_size: int) -> list[dict]:
    """The goals, each with ``met`` (True / False / None when not measured) and the numbers."""
    out = []
    lo, hi = SPEED_BATCHES
    if world_size != SPEED_WORLD:
        out.append(dict(goal=f"dice >= {SPEED_GOAL}x the fastest sync at batch {lo}-{hi} on {SPEED_WORLD} GPUs",
                        met=None, detail=f"this run has {world_size} ranks"))
    else:
        lines = [r for r in best_rows(results["rows"], ("sync", "dice")) if lo <= r["batch"] <= hi]
        measured = [r for r in lines if "dice x" in r]
        detail = ", ".join(f"{r['model']} b{r['batch']}: {r['dice x']:.2f}x ({r['dice on']} vs sync on {r['sync on']})"
                           for r in measured)
        met = bool(measured) and all(r["dice x"] >= SPEED_GOAL for r in measured)
        out.append(dict(goal=f"dice >= {SPEED_GOAL}x the fastest sync at batch {lo}-{hi} on {SPEED_WORLD} GPUs",
                        met=met if measured else None, detail=detail or "no dice and sync pair at these batches"))
    hidden = hidden_share(results.get("traces", []))
    dice = hidden.get("dice")
    if dice is None:
        out.append(dict(goal=f"dice hides >= {OVERLAP_GOAL:.0%} of the exchange", met=None,
                        detail="no profiled dice run (pass --trace DIR)"))
    else:
        out.append(dict(goal=f"dice hides >= {OVERLAP_GOAL:.0%} of the exchange", met=dice["hidden"] >= OVERLAP_GOAL,
                        detail=f"{dice['hidden']:.1%} of {dice['exchange_ms']:.2f} ms of transfers hidden "
                               f"({dice['dispatcher']}, mean of {dice['ranks']} ranks)" + (
                                   "" if dice["best_stream_hidden"] is None else
                                   f"; the best-hidden communicator's stream alone: {dice['best_stream_hidden']:.1%}")))
    return out


def format_verdict(v: dict) -> str:
    word = {True: "met", False: "NOT met", None: "not measured"}[v["met"]]
    return f"goal {v['goal']}: {word} — {v['detail']}"


def combined(paths) -> list[dict]:
    """The goals over several ``dice-step`` records of one world size (one launch per model or
    batch range): their rows and traces together."""
    import json
    from pathlib import Path

    rows, traces, worlds = [], [], set()
    for path in paths:
        record = json.loads(Path(path).read_text())
        worlds.add(record["params"]["world_size"])
        rows += record["results"]["rows"]
        traces += record["results"].get("traces", [])
    if len(worlds) != 1:
        raise ValueError(f"the records must share one world size, got {sorted(worlds)}")
    return verdicts(dict(rows=rows, traces=traces), worlds.pop())


def main(argv=None) -> int:
    """``python -m moekit.dice.verdicts RECORD.json ...``: the goals over those records."""
    import sys

    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m moekit.dice.verdicts dice-step-*.json ...")
        return 2
    for v in combined(paths):
        print(format_verdict(v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["OVERLAP_GOAL", "SPEED_GOAL", "best_rows", "combined", "format_verdict", "hidden_share", "verdicts"]
