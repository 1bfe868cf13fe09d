"""Benchmark infrastructure shared by every ``moekit bench ...`` command.

Time with :mod:`~moekit.bench.timing` (per-iteration microseconds, warm-up excluded),
summarize with :mod:`~moekit.bench.stats`, and record, tabulate and plot with
:mod:`~moekit.bench.report`. Importing this package needs neither a GPU nor matplotlib.
"""

from moekit.bench.report import (
    environment,
    format_table,
    git_commit,
    load_record,
    markdown_table,
    new_figure,
    save_figure,
    to_jsonable,
    write_record,
)
from moekit.bench.stats import geomean, ratio, summarize
from moekit.bench.timing import (
    DistributedTimes,
    PhaseTimer,
    capture_graph,
    queue_timed,
    time_distributed,
    time_fn,
    time_graph_replay,
)

__all__ = [
    "DistributedTimes",
    "PhaseTimer",
    "capture_graph",
    "queue_timed",
    "environment",
    "format_table",
    "geomean",
    "git_commit",
    "load_record",
    "markdown_table",
    "new_figure",
    "ratio",
    "save_figure",
    "summarize",
    "time_distributed",
    "time_fn",
    "time_graph_replay",
    "to_jsonable",
    "write_record",
]
