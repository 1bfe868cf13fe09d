"""Where commands write: the default results folder, and checks of output paths made before any work.

A command that runs for minutes and then cannot write its file has wasted those minutes, so
every command checks its output paths first (:func:`check_output_file`,
:func:`check_output_dir`) and refuses a bad one with a ``ValueError`` naming the option.
This module imports nothing heavy: ``moekit --help`` and the parsers use it.
"""

from __future__ import annotations

import os
from pathlib import Path

# Benchmark records go here by default: a folder of the current directory, not
# benchmarks/results/ (which holds the records measured on GPUs that the repository keeps).
DEFAULT_OUT_DIR = "moekit-results"


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (``.`` for a relative path with none)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def _check_creatable(path: Path, name: str, what: str) -> None:
    """ValueError unless the missing ``path`` (a file or folder) can be made: its nearest existing
    ancestor is a folder this process may write into (the folders between are then created)."""
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise ValueError(f"{name}: cannot write {what} {path}: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: cannot write {what} {path}: directory {base} is not writable")


def check_output_file(path: str | os.PathLike, name: str, *, overwrite: bool = False) -> Path:
    """Check, before any work, that a file can be written at ``path``; return it as a Path.

    ``name`` is the option or argument that gave the path (``--out``, ``OUT``): every
    ValueError starts with it. Refused: a directory; an existing file unless ``overwrite``
    (and then one that is not writable); a path whose nearest existing folder is a file or not
    writable. Folders that do not exist yet are allowed (the writer creates them).
    """
    p = Path(path)
    if str(path) == "" or p.is_dir():
        raise ValueError(f"{name} must be a file path, got a directory: {str(path) or '(empty)'!r}")
    if p.exists() or p.is_symlink():
        if not overwrite:
            raise ValueError(f"{name}: {p} exists already; remove it or choose another path")
        if not os.access(p, os.W_OK):
            raise ValueError(f"{name}: {p} exists and is not writable")
        return p
    _check_creatable(p, name, "file")
    return p


def check_output_dir(path: str | os.PathLike, name: str) -> Path:
    """Check, before any work, that files can be written into the folder ``path`` (existing, or
    to be created with its missing parents); return it as a Path.

    ``name`` is the option that gave it (``--out-dir``): every ValueError starts with it.
    Refused: an existing file (not a folder), a folder that is not writable, a missing folder
    whose nearest existing ancestor is a file or not writable.
    """
    p = Path(path)
    if str(path) == "":
        raise ValueError(f"{name} must be a directory path, got ''")
    if p.exists():
        if not p.is_dir():
            raise ValueError(f"{name}: {p} is a file, not a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ValueError(f"{name}: directory {p} is not writable")
        return p
    _check_creatable(p, name, "into directory")
    return p
