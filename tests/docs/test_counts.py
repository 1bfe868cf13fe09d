"""Counts the docs state that the package can compute are checked against the package.

* Shipped RaMP model files: the total and the count per GPU, as written in README.md, docs/*.md and
  benchmarks/results/README.md ("28 shipped models (24 H100, 4 H200)", "**Twenty-eight model
  files ship** ... On the **H100**, twenty-four", "the 24 shipped H100 models", ...), against the
  files in the package's model directory (``moekit/ramp/models/*.json``, per GPU by their
  ``"gpu"`` field). Numbers may be digits or English words.
* Shipped tax-model calibrations: the GPUs named after "shipped calibrations:" against
  ``moekit/tax/calibrations/*.json`` (their ``"gpu"`` field), and every calibration file the docs
  name exists.
* Claims that nothing ships ("none is shipped yet", "no `moekit tax calibrate` has run on a GPU
  yet") are absent while something does.

Historical sentences ("Fourteen model files now ship", at the commit they describe) are not
checked: the patterns match only the present-tense phrases above.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moekit.ramp.modelfile import SHIPPED as RAMP_MODELS
from moekit.tax.report import SHIPPED_CALIBRATIONS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
        "benchmarks/results/README.md"]

_UNITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
          "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
WORDS = {w: i for i, w in enumerate(_UNITS)}
for t, tens in enumerate(_TENS):
    if tens:
        WORDS[tens] = 10 * t
        for u in range(1, 10):
            WORDS[f"{tens}-{_UNITS[u]}"] = 10 * t + u
N = r"(\d+|" + "|".join(sorted(WORDS, key=len, reverse=True)) + r")"
GPU = r"(H100|H200|B200|A100)"


def number(text: str) -> int:
    return int(text) if text.isdigit() else WORDS[text.lower()]


def _flat(doc: str) -> str:
    """The page as one line: emphasis markers dropped, runs of white space made one space."""
    text = (ROOT / doc).read_text(encoding="utf-8").replace("**", "")
    return re.sub(r"\s+", " ", text)


def shipped_models() -> tuple[int, dict[str, int]]:
    per_gpu: dict[str, int] = {}
    files = sorted(RAMP_MODELS.glob("*.json"))
    for path in files:
        gpu = json.loads(path.read_text())["gpu"].upper()
        per_gpu[gpu] = per_gpu.get(gpu, 0) + 1
    return len(files), per_gpu


def shipped_calibration_gpus() -> set[str]:
    return {json.loads(p.read_text())["gpu"].upper() for p in SHIPPED_CALIBRATIONS.glob("*.json")}


# (pattern, what its groups are): "total" -> (N,), "gpu" -> (N, GPU) or (GPU, N), "pair" -> (N, GPU, N, GPU)
MODEL_PATTERNS = [
    (rf"\b{N} shipped (?:RaMP )?models\b", "total"),
    (rf"\b{N} model files ship\b", "total"),
    (rf"\bcomplete and shipped, {N} model files\b", "total"),
    (rf"\bmodel files now ship \({N} in all\)", "total"),
    (rf"\(\s*{N} {GPU}, {N} {GPU}\)", "pair"),
    (rf"\b{N} shipped {GPU} models\b", "gpu"),
    (rf"\b{N} {GPU} model files\b", "gpu"),
    (rf"\bOn the {GPU}, {N}\b(?!\.\d|-| ?%| of\b| [µmk]?s\b)", "gpu_after"),  # not "On the H100, 3.0 TB/s"
]


def stated_model_counts():
    """Every (doc, phrase, what, stated) for the shipped RaMP models."""
    found = []
    for doc in DOCS:
        text = _flat(doc)
        for pattern, what in MODEL_PATTERNS:
            for m in re.finditer(pattern, text, flags=re.IGNORECASE):
                g = m.groups()
                if what == "total":
                    found.append((doc, m.group(0), None, number(g[0])))
                elif what == "pair":
                    found.append((doc, m.group(0), g[1].upper(), number(g[0])))
                    found.append((doc, m.group(0), g[3].upper(), number(g[2])))
                elif what == "gpu":
                    found.append((doc, m.group(0), g[1].upper(), number(g[0])))
                else:
                    found.append((doc, m.group(0), g[0].upper(), number(g[1])))
    return found


def test_shipped_model_counts_match_the_package():
    total, per_gpu = shipped_models()
    assert total > 0 and sum(per_gpu.values()) == total
    found = stated_model_counts()
    # The README's summary and ramp.md's status are where the counts live: they must be found.
    assert any(doc == "README.md" and gpu is None for doc, _, gpu, _ in found), "README.md: no 'N shipped models'"
    assert any(doc == "docs/ramp.md" and gpu is None for doc, _, gpu, _ in found), "docs/ramp.md: no 'N model files ship'"
    assert {gpu for doc, _, gpu, _ in found if doc == "README.md" and gpu} == set(per_gpu), found
    wrong = [f"{doc}: {phrase!r} says {n}, the package ships {total if gpu is None else per_gpu.get(gpu, 0)}"
             f"{'' if gpu is None else ' for the ' + gpu}"
             for doc, phrase, gpu, n in found if n != (total if gpu is None else per_gpu.get(gpu, 0))]
    assert not wrong, "\n".join(wrong)


def test_shipped_calibrations_match_the_package():
    gpus = shipped_calibration_gpus()
    stated = []
    for doc in DOCS:
        for m in re.finditer(r"\bshipped calibrations?: ((?:[A-Z]\d{3}(?:, | and )?)+)", _flat(doc), flags=re.IGNORECASE):
            stated.append((doc, set(re.findall(r"[A-Z]\d{3}", m.group(1)))))
    assert any(doc == "README.md" for doc, _ in stated), "README.md names no shipped calibrations"
    assert any(doc == "docs/tax.md" for doc, _ in stated), "docs/tax.md names no shipped calibrations"
    wrong = [f"{doc}: names {sorted(named)}, the package ships {sorted(gpus)}" for doc, named in stated if named != gpus]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("doc", DOCS)
def test_named_calibration_files_exist(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    for name in re.findall(r"tax/calibrations/([\w.-]+\.json)", text):
        assert (SHIPPED_CALIBRATIONS / name).is_file(), f"{doc} names tax/calibrations/{name}, which does not ship"


STALE_WHILE_MODELS_SHIP = [r"\bnone (?:is )?shipped yet\b", r"\bnone ships yet\b", r"\bno model (?:file )?ships\b",
                           r"\bno model file shipped\b", r"\bno RaMP model (?:file )?ships\b"]
STALE_WHILE_CALIBRATIONS_SHIP = [r"\bno `?moekit tax calibrate`? has run on a GPU\b", r"\bno calibration ships\b"]


@pytest.mark.parametrize("doc", DOCS)
def test_no_claim_that_nothing_ships(doc):
    text = _flat(doc)
    stale = []
    if shipped_models()[0]:
        stale += [m.group(0) for p in STALE_WHILE_MODELS_SHIP for m in re.finditer(p, text, flags=re.IGNORECASE)]
    if shipped_calibration_gpus():
        stale += [m.group(0) for p in STALE_WHILE_CALIBRATIONS_SHIP for m in re.finditer(p, text, flags=re.IGNORECASE)]
    assert not stale, f"{doc}: {stale}"


@pytest.mark.parametrize("text, value", [("28", 28), ("Twenty-eight", 28), ("four", 4), ("nineteen", 19)])
def test_number_words(text, value):
    assert re.fullmatch(N, text, flags=re.IGNORECASE) and number(text) == value
