"""Benchmark records, tables and figures.

A benchmark run writes one JSON record::

    {"kind": ..., "environment": {...}, "params": {...}, "results": {...}}

where ``environment`` says where the numbers came from (device, GPU count, torch, CUDA
and Triton versions, git commit, time), so that a number quoted anywhere can be traced to
the device it was measured on. Records load with :func:`load_record`, which parses JSON
only: reading a record never runs code from it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from moekit.jsonfile import read_json
from moekit.outputs import DEFAULT_OUT_DIR  # noqa: F401  (re-exported: the records' default folder)

RECORD_KEYS = ("kind", "environment", "params", "results")

# --------------------------------------------------------------------------- environment


def _cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:  # triton is an optional extra
        return None
    return getattr(triton, "__version__", None)


def _git(args: list[str], cwd: Path) -> str | None:
    """stdout of ``git <args>`` in ``cwd``, or None if git is missing or fails."""
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit(path: str | Path | None = None) -> str | None:
    """HEAD of the git checkout holding ``path`` (default: moekit's own source).

    ``"<sha>-dirty"`` when tracked files differ from HEAD (untracked files don't count,
    as with ``git describe --dirty``); None outside a git checkout or before the first
    commit. ``MOEKIT_GIT_COMMIT`` in the environment wins: a copy of the tree with no
    ``.git`` (a remote GPU run) is told its commit that way.
    """
    if os.environ.get("MOEKIT_GIT_COMMIT"):
        return os.environ["MOEKIT_GIT_COMMIT"]
    cwd = Path(path) if path is not None else Path(__file__).resolve().parent
    commit = _git(["rev-parse", "--verify", "--quiet", "HEAD"], cwd)
    if not commit:
        return None
    changes = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
    return f"{commit}-dirty" if changes else commit


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def environment() -> dict:
    """Where a benchmark ran: devices, versions, commit and UTC time (no hostname).

    ``device`` is the first GPU's name, or the CPU's model name when there is no GPU;
    ``devices`` lists every GPU's name (empty without CUDA).
    """
    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = [torch.cuda.get_device_name(index) for index in range(gpu_count)]
    return {
        "device": gpus[0] if gpus else _cpu_name(),
        "devices": gpus,
        "gpu_count": gpu_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "git_commit": git_commit(),
        "timestamp_utc": _utc_now(),
    }


def cpu_smoke_line(ignore: str) -> str:
    """The one line a command prints when it runs on the CPU, where its sizes are toys and its numbers
    say nothing about a GPU: ``ignore`` names the numbers to disregard (e.g. "timings")."""
    return f"CPU smoke run at toy size: it checks that the command works end to end; ignore its {ignore}"


# -------------------------------------------------------------------------------- records


def to_jsonable(value, _where: str = "record"):
    """Convert ``value`` into plain JSON types, recursively.

    numpy and torch scalars become Python numbers, arrays and tensors nested lists,
    dtypes/devices/paths strings, dataclasses (e.g. :class:`moekit.shapes.MoEShape`)
    dicts. Non-finite floats become None, because strict JSON has no NaN or infinity.
    Anything else raises :class:`TypeError` naming where in the record it was.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value, _where)
    if isinstance(value, (bool, np.bool_)):  # before int: bool is an int subclass
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return to_jsonable(value.tolist(), _where)
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value), _where)
    if isinstance(value, dict):
        return {str(key): to_jsonable(item, f"{_where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(item, f"{_where}[{index}]") for index, item in enumerate(value)]
    raise TypeError(f"{_where}: cannot write {type(value).__name__} to JSON")


def _slug(text: str) -> str:
    """Lower-case letters, digits and single dashes: safe in any file name."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def record_filename(kind: str, env: dict) -> str:
    """``{kind}-{device}-{gpu_count}x-{timestamp}.json``, e.g. ``alltoall-nvidia-h200-2x-...``."""
    device = _slug(env["device"]) if env["gpu_count"] else "cpu"
    stamp = env["timestamp_utc"].replace("-", "").replace(":", "")
    return f"{_slug(kind)}-{device}-{env['gpu_count']}x-{stamp}.json"


def write_record(
    kind: str,
    params: dict,
    results: dict,
    out_dir: str | Path = DEFAULT_OUT_DIR,
    name: str | None = None,
) -> Path:
    """Write a benchmark record as JSON and return its path.

    ``out_dir`` (relative to the working directory) is created if needed. Without
    ``name`` the file is named by :func:`record_filename` and never overwrites an earlier
    record (a ``-1``, ``-2``... suffix is added within the same second); with ``name``
    (a bare file name, ``.json`` added if missing) an existing file of that name is
    replaced.
    """
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"kind must be a non-empty string, got {kind!r}")
    env = environment()
    record = to_jsonable(
        {"kind": kind, "environment": env, "params": params, "results": results}
    )
    text = json.dumps(record, indent=2, allow_nan=False) + "\n"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if name is not None:
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"name must be a bare file name without folders, got {name!r}")
        path = out_dir / (name if name.endswith(".json") else f"{name}.json")
        path.write_text(text, encoding="utf-8")
        return path
    return _write_new_file(out_dir / record_filename(kind, env), text)


def _write_new_file(path: Path, text: str) -> Path:
    """Write ``text`` to ``path``, or to ``path`` with a counter if that name is taken."""
    for attempt in range(1000):
        candidate = path if attempt == 0 else path.with_name(f"{path.stem}-{attempt}.json")
        try:
            with open(candidate, "x", encoding="utf-8") as file:  # "x": never overwrite
                file.write(text)
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"{path}: too many records with this name")


def load_record(record: str | Path | dict, kind: str | None = None) -> dict:
    """A record written by :func:`write_record`, read from its path (or checked as given).

    Only parses JSON (:func:`moekit.jsonfile.read_json`: never runs code from the file). A
    file that cannot be read, is not UTF-8 JSON, or is not an object with ``kind`` (a
    string) and ``environment``, ``params``, ``results`` (objects) raises
    :class:`ValueError` naming the file and what is wrong; so does a record of another
    ``kind`` than the one asked for.
    """
    if isinstance(record, dict):
        where, data = "record", record
    else:
        where, data = str(record), read_json(record, "a benchmark record")
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
    missing = [key for key in RECORD_KEYS if key not in data]
    if missing:
        raise ValueError(f"{where}: record is missing {', '.join(missing)}")
    if not isinstance(data["kind"], str):
        raise ValueError(f"{where}: 'kind' must be a string")
    for key in RECORD_KEYS[1:]:
        if not isinstance(data[key], dict):
            raise ValueError(f"{where}: '{key}' must be a JSON object")
    if kind is not None and data["kind"] != kind:
        raise ValueError(f"{where}: expected a {kind!r} record, got kind {data['kind']!r}")
    return data


# --------------------------------------------------------------------------------- tables


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _cell(row: dict, column: str, floatfmt: str) -> str:
    """One cell as text: floats through ``floatfmt``, a missing value as ``-``."""
    value = row.get(column)
    if value is None:
        return "-"
    if isinstance(value, (float, np.floating)):
        return format(float(value), floatfmt)
    return str(value)


def _numeric_columns(rows: Sequence[dict], columns: Sequence[str]) -> set[str]:
    """Columns whose present values are all numbers; these are right-aligned."""
    numeric = set()
    for column in columns:
        values = [row.get(column) for row in rows if row.get(column) is not None]
        if values and all(_is_number(value) for value in values):
            numeric.add(column)
    return numeric


def _cells(rows, columns, floatfmt) -> list[list[str]]:
    return [[_cell(row, column, floatfmt) for column in columns] for row in rows]


def format_table(rows: Sequence[dict], columns: Sequence[str], floatfmt: str = ".1f") -> str:
    """An aligned plain-text table for the terminal.

    ``columns`` names the keys to show, in order, and heads the table; numeric columns
    are right-aligned, others left-aligned; floats are formatted with ``floatfmt``
    (a :func:`format` spec such as ``".1f"`` or ``".3g"``); a missing value shows as ``-``.
    """
    cells = _cells(rows, columns, floatfmt)
    numeric = _numeric_columns(rows, columns)
    widths = [
        max([len(column)] + [len(texts[i]) for texts in cells]) for i, column in enumerate(columns)
    ]

    def line(texts: Sequence[str]) -> str:
        padded = [
            text.rjust(width) if column in numeric else text.ljust(width)
            for text, width, column in zip(texts, widths, columns)
        ]
        return "  ".join(padded).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(columns), rule] + [line(texts) for texts in cells])


def markdown_table(rows: Sequence[dict], columns: Sequence[str], floatfmt: str = ".1f") -> str:
    """The same table as GitHub-flavoured Markdown, numeric columns right-aligned."""
    cells = _cells(rows, columns, floatfmt)
    numeric = _numeric_columns(rows, columns)

    def line(texts: Sequence[str]) -> str:
        # A literal "|" would end the cell early.
        return "| " + " | ".join(text.replace("|", "\\|") for text in texts) + " |"

    align = ["---:" if column in numeric else "---" for column in columns]
    return "\n".join([line(columns), "|" + "|".join(align) + "|"] + [line(t) for t in cells])


# -------------------------------------------------------------------------------- figures

_PLOT_HINT = "plotting needs matplotlib: pip install 'moekit[plot]'"


def _matplotlib():
    """Import matplotlib on first use: it is an optional extra."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(_PLOT_HINT) from error
    return Figure, FigureCanvasAgg


def new_figure(nrows: int = 1, ncols: int = 1, *, subplots: dict | None = None, **figure_kwargs):
    """A matplotlib ``(figure, axes)`` drawn by the Agg backend.

    ``figure_kwargs`` go to the Figure (e.g. ``figsize``), ``subplots`` to its ``subplots``
    (e.g. ``squeeze``, ``sharex``, ``gridspec_kw``). The figure is made without pyplot, so it
    needs no display, changes no global backend, and is freed when dropped.
    """
    Figure, FigureCanvasAgg = _matplotlib()
    figure = Figure(**figure_kwargs)
    FigureCanvasAgg(figure)
    return figure, figure.subplots(nrows, ncols, **(subplots or {}))


def save_figure(fig, path: str | Path, dpi: int = 150) -> Path:
    """Save ``fig`` to ``path`` (format from the suffix, e.g. ``.png``), making folders.

    Raster formats are rendered by Agg whatever backend made the figure, so this works
    without a display. A pyplot figure is closed afterwards: pyplot keeps every figure
    alive until it is closed. (Figures from :func:`new_figure` need no closing.)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close(fig)
    return path
