"""Records, environment, tables and figures of moekit.bench.report."""

import dataclasses
import gzip
import json
import platform
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from moekit.bench import report
from moekit.bench.report import (
    environment,
    format_table,
    git_commit,
    load_record,
    markdown_table,
    new_figure,
    save_figure,
    write_record,
)

ENV_KEYS = {
    "device",
    "devices",
    "gpu_count",
    "torch",
    "cuda",
    "triton",
    "python",
    "platform",
    "git_commit",
    "timestamp_utc",
}


def test_environment_keys_and_types():
    env = environment()
    assert set(env) == ENV_KEYS
    assert isinstance(env["device"], str) and env["device"]
    assert env["gpu_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert len(env["devices"]) == env["gpu_count"]
    assert env["torch"] == torch.__version__
    assert env["cuda"] == torch.version.cuda
    assert env["triton"] is None or isinstance(env["triton"], str)
    assert env["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}(-dirty)?", env["git_commit"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", env["timestamp_utc"])
    json.dumps(env)  # plain JSON already


def test_environment_has_no_hostname(monkeypatch):
    # A distinctive name through both usual routes, so the check works on any host.
    fake = "moekit-test-hostname-7f3a"
    monkeypatch.setattr(socket, "gethostname", lambda: fake)
    monkeypatch.setattr(platform, "node", lambda: fake)
    text = json.dumps(environment())
    assert fake not in text


def _git(repo, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=repo,
        check=True,
        capture_output=True,
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")
def test_git_commit_clean_dirty_and_outside(tmp_path, monkeypatch):
    # Keep git from finding a repository above tmp_path.
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    repo = tmp_path / "repo"
    repo.mkdir()
    assert git_commit(repo) is None  # not a checkout
    _git(repo, "init", "-q")
    assert git_commit(repo) is None  # a checkout without commits has no HEAD
    (repo / "a.txt").write_text("one\n")
    _git(repo, "add", "a.txt")
    _git(repo, "commit", "-q", "-m", "first")
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert git_commit(repo) == head
    (repo / "untracked.txt").write_text("new\n")
    assert git_commit(repo) == head  # untracked files don't make the tree dirty
    (repo / "a.txt").write_text("two\n")
    assert git_commit(repo) == f"{head}-dirty"


@dataclasses.dataclass
class Shape:
    hidden: int
    top_k: int


def test_write_and_load_round_trip(tmp_path):
    params = {
        "shape": Shape(hidden=4096, top_k=np.int64(2)),
        "dtype": torch.bfloat16,
        "tokens": [np.int32(1), 2, torch.tensor(3)],
        "flag": np.bool_(True),
    }
    results = {
        "samples_us": np.array([1.5, 2.5], dtype=np.float32),
        "matrix": torch.arange(4).reshape(2, 2),
        "median_us": np.float64(12.25),
        "speedup": float("nan"),  # strict JSON has no NaN: written as null
    }
    path = write_record("alltoall", params, results, out_dir=tmp_path / "new" / "dir")
    assert path.parent == tmp_path / "new" / "dir"
    record = load_record(path)
    assert record["kind"] == "alltoall"
    assert set(record["environment"]) == ENV_KEYS
    assert record["params"] == {
        "shape": {"hidden": 4096, "top_k": 2},
        "dtype": "torch.bfloat16",
        "tokens": [1, 2, 3],
        "flag": True,
    }
    assert record["results"] == {
        "samples_us": [1.5, 2.5],
        "matrix": [[0, 1], [2, 3]],
        "median_us": 12.25,
        "speedup": None,
    }


def test_record_file_name_and_no_overwrite(tmp_path):
    first = write_record("cap spill/dispatch", {}, {}, out_dir=tmp_path)
    second = write_record("cap spill/dispatch", {}, {}, out_dir=tmp_path)
    env = environment()
    device = re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")
    if env["gpu_count"] == 0:
        device = "cpu"
    stamp = r"\d{8}T\d{6}Z"
    pattern = rf"cap-spill-dispatch-{device}-{env['gpu_count']}x-{stamp}(-\d+)?\.json"
    assert re.fullmatch(pattern, first.name), first.name
    assert re.fullmatch(pattern, second.name), second.name
    assert first != second
    assert load_record(first)["kind"] == load_record(second)["kind"] == "cap spill/dispatch"


def test_record_given_name(tmp_path):
    path = write_record("k", {"a": 1}, {}, out_dir=tmp_path, name="latest")
    assert path == tmp_path / "latest.json"
    path = write_record("k", {"a": 2}, {}, out_dir=tmp_path, name="latest.json")
    assert load_record(path)["params"] == {"a": 2}
    with pytest.raises(ValueError, match="bare file name"):
        write_record("k", {}, {}, out_dir=tmp_path, name="../escape")


def test_write_record_names_what_cannot_be_written(tmp_path):
    with pytest.raises(TypeError, match=r"\['params'\]\['bad'\].*object"):
        write_record("k", {"bad": object()}, {}, out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"{not json", "not valid JSON"),
        (b"\x80\x04\x95pickle", "not a UTF-8"),
        (b"[1, 2]", "expected a JSON object"),
        (b'{"kind": "x", "params": {}, "results": {}}', "missing environment"),
        (b'{"kind": 3, "environment": {}, "params": {}, "results": {}}', "'kind' must be"),
        (b'{"kind": "x", "environment": {}, "params": [], "results": {}}', "'params' must be"),
    ],
)
def test_load_record_rejects_malformed_files(tmp_path, content, problem):
    path = tmp_path / "broken.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(problem)) as error:
        load_record(path)
    assert str(path) in str(error.value)


ROWS = [
    {"method": "MaxCounts", "median_us": 1077.04, "p99_us": 1500.0, "cap": 43},
    {"method": "Cap|Spill", "median_us": 712.0, "cap": 16},
]


def test_format_table_aligns_columns():
    text = format_table(ROWS, ["method", "median_us", "p99_us", "cap"])
    assert text == "\n".join(
        [
            "method     median_us  p99_us  cap",
            "---------  ---------  ------  ---",
            "MaxCounts     1077.0  1500.0   43",
            "Cap|Spill      712.0       -   16",
        ]
    )


def test_format_table_float_format_and_empty():
    assert format_table(ROWS, ["median_us"], floatfmt=".3g").splitlines()[2:] == [
        " 1.08e+03",
        "      712",
    ]
    assert format_table([], ["a", "bb"]) == "a  bb\n-  --"


def test_markdown_table():
    text = markdown_table(ROWS, ["method", "median_us", "p99_us"], floatfmt=".2f")
    assert text == "\n".join(
        [
            "| method | median_us | p99_us |",
            "|---|---:|---:|",
            "| MaxCounts | 1077.04 | 1500.00 |",
            "| Cap\\|Spill | 712.00 | - |",
        ]
    )


def test_save_figure_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    figure, axes = new_figure(figsize=(3, 2))
    axes.plot([1, 2, 3], [3, 1, 2])
    path = save_figure(figure, tmp_path / "figs" / "latency.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plotting_without_matplotlib_says_how_to_install(monkeypatch):
    for module in [name for name in sys.modules if name.split(".")[0] == "matplotlib"]:
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'moekit[plot]'")):
        report.new_figure()


def test_importing_moekit_bench_does_not_import_matplotlib():
    code = "import sys, moekit.bench; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_load_record_of_a_kind_gzip_and_missing_files(tmp_path):
    path = write_record("dispatch", {"a": 1}, {"b": 2}, out_dir=tmp_path, name="r")
    assert load_record(path, kind="dispatch")["results"] == {"b": 2}
    with pytest.raises(ValueError, match=re.escape(f"{path}: expected a 'tax-measure' record, got kind 'dispatch'")):
        load_record(path, kind="tax-measure")
    packed = tmp_path / "r.json.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as fh:
        fh.write(path.read_text())
    assert load_record(packed) == load_record(path)
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="bad.json.gz: not a gzip file"):
        load_record(tmp_path / "bad.json.gz")
    with pytest.raises(ValueError, match="missing.json: cannot read"):
        load_record(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="'kind' must be"):
        load_record({"kind": 1, "environment": {}, "params": {}, "results": {}})
