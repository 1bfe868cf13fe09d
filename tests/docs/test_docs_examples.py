"""Every code example in README.md and docs/*.md runs as written.

What runs, found by these rules in each page (fences start at the first column):

* every fenced ```python block: the block is written to ``example.py`` in an empty temporary
  directory and run there by a fresh interpreter (``python example.py``, so an
  ``if __name__ == "__main__":`` block and spawned ranks behave as for a user's script). It must
  exit with status 0.
* a fenced ```bash (or ```sh) block whose previous line is the marker ``<!-- runnable -->``: the
  block runs as one bash script with ``set -ex -o pipefail`` (it stops at the first failing
  command, and the log shows which one). Blocks without the marker do not run: installation
  lines, GPU recipes of several minutes, commands with placeholders such as ``DIR``. Mark only
  commands that take seconds on a CPU, at their smallest sizes.
* a fenced ```console block whose previous line is ``<!-- runnable -->``: each ``$ command`` line
  runs, and the lines shown after it (up to the next ``$`` line) must be what it prints.
* a fenced ```text block whose previous line is ``<!-- output-of: COMMAND -->``: COMMAND runs, and
  the block must be what it prints.

Outputs are compared line by line with trailing white space ignored. The markers are HTML
comments, invisible in the rendered page.

GPU-only examples say so in a comment on their first line, ``# GPU only`` (anything may follow:
``# GPU only: the fused kernels in bf16``). Without CUDA they are skipped; where CUDA is
available they run like the others. Every other example must run on a CPU.

Shell commands run in an empty temporary directory that holds the repository's ``src/`` and
``benchmarks/`` (linked; ``benchmarks/results/`` is a fresh folder of links to the records, so a
command that writes a new record there leaves the repository alone), with this interpreter's
``bin/`` first on ``PATH`` (the ``moekit`` command of the environment under test). Python
examples get no ``TRITON_INTERPRET`` from the test's environment: an example that needs the
interpreter on a CPU sets it itself, as a user would.

The examples run side by side, one per CPU core (at most 8), all started when the first test of
this module asks for its result (under pytest-xdist, one at a time in each worker); each has a timeout (``MOEKIT_DOCS_TIMEOUT`` seconds, default
600). On 2 CPU cores the whole module takes about two minutes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
RUNNABLE = "<!-- runnable -->"
OUTPUT_OF = re.compile(r"^<!-- output-of: (.+?) -->$")
GPU_ONLY = re.compile(r"^\s*#\s*GPU only\b", re.IGNORECASE)
FENCE = re.compile(r"^```(\w*)\s*$")
TIMEOUT = float(os.environ.get("MOEKIT_DOCS_TIMEOUT", "600"))
CUDA = torch.cuda.is_available()


@dataclass(frozen=True)
class Example:
    page: str
    line: int  # of the opening fence, 1-based
    kind: str  # "python", "bash", "console" or "output"
    code: str
    command: str = ""  # "output": the command whose output the block shows

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def gpu_only(self) -> bool:
        first = self.code.lstrip("\n").split("\n", 1)[0]
        return bool(GPU_ONLY.match(first))


def blocks(page: str):
    """(line of the opening fence, its language, the line before it, the block's text) of a page."""
    lines = (ROOT / page).read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            yield i + 1, m.group(1), lines[i - 1].strip() if i else "", "\n".join(lines[i + 1:j]) + "\n"
            i = j
        i += 1


def examples() -> list[Example]:
    found = []
    for page in PAGES:
        for line, lang, before, code in blocks(page):
            if lang == "python":
                found.append(Example(page, line, "python", code))
            elif lang in ("bash", "sh", "console") and before == RUNNABLE:
                found.append(Example(page, line, "console" if lang == "console" else "bash", code))
            elif lang == "text" and OUTPUT_OF.match(before):
                found.append(Example(page, line, "output", code, OUTPUT_OF.match(before).group(1)))
    return found


EXAMPLES = examples()


def _env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("MPLBACKEND", "Agg")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _workdir(tmp: Path) -> Path:
    """``tmp`` with the repository's src/ and benchmarks/ in it (see the module docstring)."""
    (tmp / "src").symlink_to(ROOT / "src", target_is_directory=True)
    bench = tmp / "benchmarks"
    bench.mkdir()
    for child in (ROOT / "benchmarks").iterdir():
        if child.name == "results":
            (bench / "results").mkdir()
            for record in child.iterdir():
                (bench / "results" / record.name).symlink_to(record, target_is_directory=record.is_dir())
        else:
            (bench / child.name).symlink_to(child, target_is_directory=child.is_dir())
    return tmp


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().split("\n")]


def _shell(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def run_example(ex: Example) -> str | None:
    """None if the example ran as written, else what went wrong."""
    with tempfile.TemporaryDirectory(prefix="moekit-docs-") as tmp:
        tmp = Path(tmp)
        try:
            if ex.kind == "python":
                (tmp / "example.py").write_text(ex.code, encoding="utf-8")
                done = subprocess.run([sys.executable, "example.py"], cwd=tmp, env=_env(), capture_output=True,
                                      text=True, timeout=TIMEOUT)
                if done.returncode:
                    return f"exit status {done.returncode}\n{_tail(done.stdout)}\n{_tail(done.stderr)}"
                return None
            work = _workdir(tmp)
            if ex.kind == "bash":
                (work / "example.sh").write_text("set -ex -o pipefail\n" + ex.code, encoding="utf-8")
                done = subprocess.run(["bash", "example.sh"], cwd=work, env=_env(), capture_output=True, text=True,
                                      timeout=TIMEOUT)
                if done.returncode:
                    return f"exit status {done.returncode}\n{_tail(done.stdout)}\n{_tail(done.stderr)}"
                return None
            if ex.kind == "output":
                steps = [(ex.command, ex.code)]
            else:  # console: "$ command" lines, each followed by what it prints
                steps = [(m.group(1), m.group(2)) for m in
                         re.finditer(r"^\$ (.*)\n((?:(?!\$ ).*\n)*)", ex.code, flags=re.MULTILINE)]
                if not steps:
                    return "a runnable console block without a '$ command' line"
            for command, shown in steps:
                done = _shell(command, work)
                if done.returncode:
                    return f"{command}: exit status {done.returncode}\n{_tail(done.stdout)}\n{_tail(done.stderr)}"
                if _lines(done.stdout) != _lines(shown):
                    import difflib

                    diff = "\n".join(difflib.unified_diff(_lines(shown), _lines(done.stdout), "as written",
                                                          "as printed now", lineterm=""))
                    return f"{command}: the output differs from the page (update the page):\n{_tail(diff)}"
            return None
        except subprocess.TimeoutExpired as e:
            return f"timed out after {TIMEOUT:.0f} s\n{_tail(str(e.stdout or ''))}\n{_tail(str(e.stderr or ''))}"


def _weight(ex: Example) -> int:
    """Longest first, so the side-by-side runs end together: spawned ranks, training, transformers."""
    return sum(word in ex.code for word in ("launch(", "lm train", "trace record", "transformers", "TRITON_INTERPRET"))


class _RunWhenAsked(dict):
    """{id: future} whose example runs when its test asks for it (under pytest-xdist)."""

    def __missing__(self, key: str) -> Future:
        done = Future()
        done.set_result(run_example(next(ex for ex in EXAMPLES if ex.id == key)))
        return done


@pytest.fixture(scope="module")
def started(request):
    """Every selected example that can run here, started side by side: {id: future}. Under
    pytest-xdist the workers are the parallelism and each runs only the examples it is given
    (every worker sees every selected test, so a pool here would run each example twice)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield _RunWhenAsked()
        return
    this = Path(__file__).resolve()
    wanted = []
    for item in request.session.items:
        ex = getattr(getattr(item, "callspec", None), "params", {}).get("example")
        if isinstance(ex, Example) and Path(str(item.path)).resolve() == this and (CUDA or not ex.gpu_only):
            wanted.append(ex)
    workers = max(1, min(8, os.cpu_count() or 1))
    pool = ThreadPoolExecutor(max_workers=workers)
    futures = {ex.id: pool.submit(run_example, ex) for ex in sorted(wanted, key=_weight, reverse=True)}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("example", EXAMPLES, ids=[ex.id for ex in EXAMPLES])
def test_example_runs_as_written(example, started):
    if example.gpu_only and not CUDA:
        pytest.skip("GPU only (its first line says so); no CUDA here")
    problem = started[example.id].result()
    assert problem is None, f"{example.id} ({example.kind}{': ' + example.command if example.command else ''}):\n{problem}"


def test_markers_sit_on_a_block():
    """A marker that is not right above a block of its kind would silently run nothing."""
    wrong = []
    for page in PAGES:
        lines = (ROOT / page).read_text(encoding="utf-8").split("\n")
        for i, line in enumerate(lines):
            stripped = line.strip()
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if stripped == RUNNABLE and not re.match(r"^```(bash|sh|console)\s*$", nxt):
                wrong.append(f"{page}:{i + 1}: {RUNNABLE} is not right above a bash, sh or console block")
            if OUTPUT_OF.match(stripped) and not re.match(r"^```text\s*$", nxt):
                wrong.append(f"{page}:{i + 1}: output-of is not right above a text block")
            if stripped.startswith("<!-- runnable") and stripped != RUNNABLE:
                wrong.append(f"{page}:{i + 1}: write the marker exactly as {RUNNABLE}")
    assert not wrong, "\n".join(wrong)


def test_the_examples_are_found():
    kinds = {ex.kind for ex in EXAMPLES}
    assert {"python", "bash", "console", "output"} <= kinds, kinds
    assert sum(ex.kind == "python" for ex in EXAMPLES) >= 10
    assert any(ex.page == "README.md" and ex.kind == "python" for ex in EXAMPLES)
