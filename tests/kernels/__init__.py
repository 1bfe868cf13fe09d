"""Kernel tests. Without a GPU they run Triton's interpreter on the CPU (slow: tiny shapes).

TRITON_INTERPRET is read when a kernel is decorated (at import of moekit.kernels),
so it is set here, before any test module of this package imports the kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
