"""Triton's presence and mode for the kernels: whether it is installed, whether the kernels run
in its CPU interpreter, and what a caller on a machine without a GPU gets.

Every kernel module imports this one first, and it imports nothing of moekit: it is the leaf
that the others (``pdl``, ``quant``, ``align``, the fused-MoE modules) share.

Triton decides at decoration (``@triton.jit``, when a module is imported) whether a kernel is
compiled for the GPU or run by its interpreter (``TRITON_INTERPRET=1``). On a machine without a
CUDA GPU, where compiled kernels cannot run, this module sets ``TRITON_INTERPRET=1`` for the
process when it is imported, unless the variable is already set or Triton was already imported
(then its own jit helpers, ``tl.zeros`` and the like, are compiled-mode objects that the
interpreter cannot call, so setting it here would break every kernel): the kernels then run,
slowly, and the first call says so once (:func:`check_device`). Where they were decorated for
the GPU, a call with CPU tensors raises one clear error instead.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

_TRITON_ALREADY_IMPORTED = "triton" in sys.modules


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _auto_interpret() -> bool:
    """Set TRITON_INTERPRET=1 where no GPU can run compiled kernels (the module docstring)."""
    if "TRITON_INTERPRET" in os.environ or _TRITON_ALREADY_IMPORTED or torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


AUTO_INTERPRET = _auto_interpret()  # True: this module turned the interpreter on

try:  # Triton is optional: the package imports without it, the kernels need it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = tl = None
    HAVE_TRITON = False

# The mode the kernels were decorated in: they are decorated as this package is imported, right
# after this module.
KERNELS_INTERPRETED = HAVE_TRITON and interpreting()
_noted = False


def require_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("moekit.kernels needs Triton: pip install 'moekit[triton]'")


def check_device(device: torch.device, name: str = "x") -> None:
    """Before a kernel launch on ``device`` (the device of argument ``name``): on the CPU the
    kernels must have been decorated for the interpreter (else one clear ValueError); where this
    module turned the interpreter on, a one-time note that it is slow."""
    global _noted
    if device.type == "cuda":
        return
    if not KERNELS_INTERPRETED:
        raise ValueError(
            f"{name} is on {device}, but moekit's Triton kernels were set up for the GPU (TRITON_INTERPRET is not 1 "
            "where moekit.kernels was imported): pass CUDA tensors, or set TRITON_INTERPRET=1 before importing "
            "moekit and Triton to run the kernels, slowly, in Triton's CPU interpreter")
    if AUTO_INTERPRET and not _noted:
        _noted = True
        warnings.warn("moekit: no CUDA GPU here, so the fused-MoE kernels run in Triton's CPU interpreter "
                      "(TRITON_INTERPRET=1, set by moekit.kernels): correct but slow, keep the shapes small",
                      RuntimeWarning, stacklevel=3)


def _bool_masks_for_the_interpreter() -> None:
    """Triton's interpreter from 3.7 on rejects a load/store/atomic mask whose data is not bool
    ("mask has unsupported dtype"), while its comparisons keep their operands' handle type, so a
    scalar condition (``live``, ``t < splits``) broadcast to a block's mask arrives as int32
    data. The compiled kernels are typed correctly (i1); only the interpreter's memory ops need
    the mask as bool, so they get it here: the values are the same (nonzero = True)."""
    try:
        import numpy as np
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover - a Triton without the interpreter module
        return
    builder = getattr(interp, "InterpreterBuilder", None)
    handle = getattr(interp, "TensorHandle", None)
    if builder is None or handle is None or getattr(builder, "_moekit_bool_masks", False):
        return

    def as_bool(mask):
        data = getattr(mask, "data", None)
        if data is None or data.dtype == np.bool_:
            return mask
        return handle(data.astype(np.bool_), mask.dtype)

    load, store, rmw = (getattr(builder, n, None) for n in ("create_masked_load", "create_masked_store",
                                                             "create_atomic_rmw"))
    if load is not None:
        builder.create_masked_load = lambda self, ptrs, mask, *a: load(self, ptrs, as_bool(mask), *a)
    if store is not None:
        builder.create_masked_store = lambda self, ptrs, value, mask, *a: store(self, ptrs, value, as_bool(mask), *a)
    if rmw is not None:
        builder.create_atomic_rmw = lambda self, op, ptr, val, mask, *a: rmw(self, op, ptr, val, as_bool(mask), *a)
    builder._moekit_bool_masks = True


if KERNELS_INTERPRETED:
    _bool_masks_for_the_interpreter()
