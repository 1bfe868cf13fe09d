"""The project's text speaks of the project, not of the process that built it.

Checked: README.md, docs/*.md, benchmarks/results/README.md, benchmarks/probes/README.md (the
whole file, code blocks included), and the strings the command line prints: every string literal
under src/moekit except docstrings, plus the first line of each module docstring (some
``moekit bench`` commands use it as their ``--help`` description). Comments and the rest of the
docstrings are not output and are not checked.

Every rule is a case-insensitive regular expression with word boundaries. What each catches, and
what it deliberately lets through:

* ``device call(s)``, ``device budget``, ``session(s)``, ``lent``, ``main job``, ``$OUT``,
  ``VM`` (``this VM``, ``the device VM``), ``development machine``, ``the issue`` / ``this issue``
  (``as the issue states``): words for how work was run, not for what the project does. None
  has an ordinary use in this project's text. (A time budget of a command, e.g. "the 4-minute
  budget" of ``moekit lm train``, is not caught: only ``device budget`` is.)
* the torch wheel on local disk: ``local disk``, ``from a local file`` / ``wheel``, ``this
  project's ... machines``.
* ``kind`` only where it means a kind of machine: ``device kind``, ``machine kind``, ``kind of
  machine`` / ``device``, ``N-GPU kind`` and ``machines of the same kind``. Ordinary English
  ("a routing kind", "that kind of launch") passes, and so does ``GPU kind``: the package's
  own term for a GPU model (H100, H200), by which RaMP model files and tax calibrations are
  keyed.
* docs only: a machine-kind name used as the name of a GPU, ``nvidia-h100-x1``,
  ``nvidia-h200-x2``, ``nvidia-h200`` standing alone (in backticks, in a table cell, in a
  comment). Say "one H100", "2 × H200". The same letters inside a path or a file name pass:
  ``benchmarks/results/capspill-nvidia-h200-x2/``, ``kernel-nvidia-h200-1x-<time>.json``,
  ``calibrations/nvidia-h100.json`` (preceded by ``-``, ``/`` or ``.``, or followed by ``/``,
  ``-``, ``.``). Folder names of records keep their names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
        "benchmarks/results/README.md", "benchmarks/probes/README.md"]

PROCESS_WORDS = {
    "device call": r"\bdevice[- ]calls?\b",
    "device budget": r"\bdevice budgets?\b",
    "session": r"\bsessions?\b",
    "lent": r"\blent\b",
    "main job": r"\bmain job\b",
    "$OUT": r"\$OUT\b",
    "VM": r"\bVMs?\b",
    "development machine": r"\bdevelopment machines?\b",
    "the issue": r"\b(?:the|this) issue\b",
    "local disk": r"\blocal disk\b|\bfrom a local (?:file|wheel)\b|\bthis project's (?:\w+ )?machines\b",
    "machine kind": (r"\b(?:device|machine) kinds?\b|\bkinds? of (?:device|machine)s?\b|\b\d+-GPU kinds?\b"
                     r"|\bmachines? of the same kind\b"),
}
# A machine-kind name standing alone (not part of a path or file name): docs only.
KIND_NAME = r"(?<![\w./-])nvidia-h[12]00(?:-x\d+)?(?![\w/.-])"


def _hits(text: str, rules: dict[str, str]) -> list[tuple[int, str, str]]:
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for name, rule in rules.items():
            for m in re.finditer(rule, line, flags=re.IGNORECASE):
                found.append((lineno, name, m.group(0)))
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_docs_speak_of_the_project(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    lines = text.splitlines()
    hits = _hits(text, {**PROCESS_WORDS, "machine-kind name as a GPU name": KIND_NAME})
    assert not hits, "\n".join(f"{doc}:{n}: {name} ({word!r}): {lines[n - 1].strip()}" for n, name, word in hits)


def _output_strings(path: Path) -> list[tuple[int, str]]:
    """String literals of one module that can reach the user: no docstrings, except the first
    line of the module's own (used as a command's description)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                docstrings.add(id(body[0].value))
    out = []
    module_doc = ast.get_docstring(tree, clean=False)
    if module_doc:
        out.append((1, module_doc.strip().split("\n")[0]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            out.append((node.lineno, node.value))
    return out


def test_cli_output_strings_speak_of_the_project():
    src = ROOT / "src" / "moekit"
    problems = []
    for path in sorted(src.rglob("*.py")):
        for lineno, s in _output_strings(path):
            for _, name, word in _hits(s, PROCESS_WORDS):
                problems.append(f"{path.relative_to(ROOT)}:{lineno}: {name} ({word!r}) in {s.strip()[:120]!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text, caught", [
    ("split over device calls", True), ("in one device call", True), ("not investigated this session", True),
    ("an 8-GPU machine, which has not been lent", True), ("No 8-GPU kind has been lent yet", True),
    ("on this VM", True), ("the device VM's host", True), ("results under `$OUT`", True),
    ("as the issue states", True), ("run the main job", True), ("the device budget", True),
    ("the development machine's CPU", True), ("machines of the same kind", True),
    ("that CPU build on local disk", True),
    # ordinary English and the package's own terms pass
    ("every routing kind eagerly", False), ("that kind of launch", False), ("one per GPU kind", False),
    ("the 4-minute budget", False), ("a lenient bound", False), ("$OUTPUT", False),
])
def test_rules_catch_process_words_not_prose(text, caught):
    assert bool(_hits(text, PROCESS_WORDS)) is caught


@pytest.mark.parametrize("text, caught", [
    ("one H100 (`nvidia-h100-x1`)", True), ("| nvidia-h200-x2 |", True), ("# nvidia-h200, split", True),
    ("On `nvidia-h200-x8`,", True),
    ("`benchmarks/results/capspill-nvidia-h200-x2/`", False), ("kernel-nvidia-h200-1x-2026.json", False),
    ("src/moekit/tax/calibrations/nvidia-h100.json", False), ("`nvidia-h100.json`", False),
    ("`lowlatency-nvidia-h200-x2`", False), ("tax-calibration-nvidia-h100-80gb-hbm3-1x", False),
])
def test_kind_name_rule(text, caught):
    assert bool(re.search(KIND_NAME, text, flags=re.IGNORECASE)) is caught
