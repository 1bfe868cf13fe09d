"""The Python standard library's source as a text corpus, the same way on every machine.

Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` except installed packages
(``site-packages``, ``dist-packages``), ordered by their path relative to that folder (POSIX
separators), so the order does not depend on the file system. A file is held out for
validation when ``crc32(relative path) % holdout_every == 0``: a property of its name, so
the split does not move when files are added or removed elsewhere. The corpus depends on
the Python version; :func:`describe` fingerprints it (file count, bytes, a hash of the names)
for the records.

Files are read as bytes and decoded as UTF-8 with replacement (a few test files hold
deliberately invalid bytes), so every machine reads the same text from the same file.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")


@dataclass(frozen=True)
class Corpus:
    """The files of one split: ``root`` and their relative paths in corpus order."""

    root: Path
    files: tuple[str, ...]

    def texts(self, max_bytes: int | None = None):
        """The files' texts in order; with ``max_bytes``, stop once that many bytes were read."""
        read = 0
        for rel in self.files:
            if max_bytes is not None and read >= max_bytes:
                return
            data = (self.root / rel).read_bytes()
            read += len(data)
            yield data.decode("utf-8", errors="replace")

    def num_bytes(self) -> int:
        return sum((self.root / rel).stat().st_size for rel in self.files)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path | str | None = None) -> list[str]:
    """Relative POSIX paths of the corpus files under ``root`` (default: the stdlib), sorted."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise ValueError(f"corpus root {root} is not a directory")
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]) or not path.is_file():
            continue
        files.append(rel.as_posix())
    if not files:
        raise ValueError(f"corpus root {root} holds no .py files")
    return sorted(files)


def is_held_out(rel: str, holdout_every: int) -> bool:
    return zlib.crc32(rel.encode("utf-8")) % holdout_every == 0


def split(root: Path | str | None = None, holdout_every: int = 50) -> tuple[Corpus, Corpus]:
    """(training files, held-out files) of the corpus under ``root`` (default: the stdlib)."""
    if isinstance(holdout_every, bool) or not isinstance(holdout_every, int) or holdout_every < 2:
        raise ValueError(f"holdout_every must be an int >= 2, got {holdout_every!r}")
    root = Path(root) if root is not None else stdlib_root()
    files = list_files(root)
    held = tuple(f for f in files if is_held_out(f, holdout_every))
    train = tuple(f for f in files if not is_held_out(f, holdout_every))
    if not held or not train:
        raise ValueError(f"the split of {len(files)} files under {root} left a side empty "
                         f"(holdout_every={holdout_every})")
    return Corpus(root, train), Corpus(root, held)


def describe(train: Corpus, held_out: Corpus) -> dict:
    """A fingerprint of the corpus for records: Python version, counts, bytes, a hash of the file names."""
    names = hashlib.sha256("\n".join(train.files + ("--",) + held_out.files).encode()).hexdigest()
    return {
        "source": "python standard library (*.py)",
        "python": sys.version.split()[0],
        "root": str(train.root),
        "train_files": len(train.files),
        "held_out_files": len(held_out.files),
        "train_bytes": train.num_bytes(),
        "held_out_bytes": held_out.num_bytes(),
        "file_list_sha256": names,
    }
