"""RaMP tests. Kernels run in Triton's interpreter without a GPU (set before any import of them)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
