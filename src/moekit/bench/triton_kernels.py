"""``moekit.kernels`` for a benchmark, ready to run on the device at hand, or one clear error.

Triton decorates the kernels when ``moekit.kernels`` is imported; on a machine without a GPU
they can only run in Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``)
before that import. A benchmark that times the kernels needs Triton itself (an optional
dependency): without it the kernels cannot run at all, and saying so beats timing nothing.
"""

from __future__ import annotations

import os
import sys

import torch

TRITON_HINT = "pip install 'moekit[triton]'"


def load_kernels(device: torch.device | str | None = None, what: str = "this benchmark"):
    """``moekit.kernels``, imported for ``device`` (default: CUDA if available, else the CPU,
    where the interpreter is switched on first). ValueError naming ``what`` if Triton is
    missing, or if the kernels were imported earlier without the interpreter on a CPU run."""
    cpu = (torch.device(device).type != "cuda") if device is not None else not torch.cuda.is_available()
    if cpu and "moekit.kernels" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import moekit.kernels as kernels

    if not kernels.HAVE_TRITON:
        raise ValueError(f"{what} needs Triton, which is not installed ({TRITON_HINT})")
    if cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{what} runs the kernels in Triton's interpreter on the CPU, but moekit.kernels was "
                         "imported without TRITON_INTERPRET=1; set it before importing moekit.kernels")
    return kernels
