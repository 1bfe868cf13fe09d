"""RoutingTrace: the routing decisions of a model over many steps and layers.

A trace holds ``topk_ids[steps, layers, tokens, K]``: for every forward step (a batch or
a sequence), every MoE layer, every token row and every top-k slot, the expert the token
was sent to. ``-1`` marks a masked slot (no token in that row, or a dropped slot), as in
DeepEP, so steps with different token counts share one fixed-size array.

File format (``.npz``, written by :meth:`RoutingTrace.save`, version 1)
-----------------------------------------------------------------------
An uncompressed-or-compressed numpy ``.npz`` archive with these members:

==============  ==========================  =============================================
key             dtype / shape               meaning
==============  ==========================  =============================================
format          str, 0-d                    always ``"moekit.routing_trace"``
version         int64, 0-d                  format version, currently 1
topk_ids        signed int, 4-d             ``[steps, layers, tokens, K]``, values in
                                            ``[-1, num_experts)``
num_experts     int64, 0-d                  E
topk_weights    float32, 4-d (optional)     same shape as ``topk_ids``
name            str, 0-d                    free text ("" when unnamed)
metadata        str, 0-d                    a JSON object (``"{}"`` when empty)
==============  ==========================  =============================================

Loading never runs code from the file: :meth:`RoutingTrace.load` uses
``np.load(path, allow_pickle=False)`` and every problem with the file (not a regular file,
not an npz, a member whose bytes fail the archive's CRC or do not decompress, a missing
key, wrong dtypes or dims, ids out of range, an unknown version, object arrays) is
reported as a ``ValueError`` that names the file and what is wrong. Only a path that does
not exist stays a ``FileNotFoundError``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

FORMAT_NAME = "moekit.routing_trace"
FORMAT_VERSION = 1
_ZIP_MAGIC = b"PK\x03\x04"  # every .npz is a zip archive


def as_numpy(x: Any) -> np.ndarray:
    """A numpy view/copy of a torch tensor or array-like (host side; syncs a GPU tensor)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


@dataclass(eq=False, repr=False)
class RoutingTrace:
    """Routing of ``num_layers`` MoE layers over ``num_steps`` forward steps.

    ``topk_ids`` is a signed integer array ``[steps, layers, tokens, K]`` with values in
    ``[-1, num_experts)``; ``topk_weights`` (optional) is float32 of the same shape.
    Torch tensors are accepted and converted to numpy; float weights of another dtype are
    cast to float32. Everything is validated here, so a trace that exists is well formed.
    """

    topk_ids: np.ndarray
    num_experts: int
    topk_weights: np.ndarray | None = None
    name: str = ""
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.topk_ids = as_numpy(self.topk_ids)
        if self.topk_weights is not None:
            self.topk_weights = as_numpy(self.topk_weights)
            if np.issubdtype(self.topk_weights.dtype, np.floating):
                self.topk_weights = self.topk_weights.astype(np.float32, copy=False)
        problem = _find_problem(
            self.topk_ids, self.topk_weights, self.num_experts, self.name, self.metadata
        )
        if problem:
            raise ValueError(f"RoutingTrace: {problem}")

    # -- shape helpers ------------------------------------------------------------

    @property
    def num_steps(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def num_layers(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def num_tokens(self) -> int:
        """Token rows per (step, layer), including masked padding rows."""
        return self.topk_ids.shape[2]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[3]

    def valid_mask(self) -> np.ndarray:
        """Boolean ``[steps, layers, tokens, K]``: True where a slot routes to an expert."""
        return self.topk_ids >= 0

    def num_valid_slots(self) -> int:
        """How many (token, slot) pairs are routed somewhere (not ``-1``)."""
        return int(np.count_nonzero(self.topk_ids >= 0))

    def routing(self, step: int, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(topk_ids int64 [T, K], topk_weights float32 [T, K] or None)`` of one layer call,
        as torch tensors ready to feed a dispatcher (masked rows stay ``-1``)."""
        ids = torch.from_numpy(self.topk_ids[step, layer].astype(np.int64))
        if self.topk_weights is None:
            return ids, None
        return ids, torch.from_numpy(self.topk_weights[step, layer].copy())

    def __repr__(self) -> str:
        weights = "with weights" if self.topk_weights is not None else "no weights"
        name = f"{self.name!r}, " if self.name else ""
        return (
            f"RoutingTrace({name}steps={self.num_steps}, layers={self.num_layers}, "
            f"tokens={self.num_tokens}, top_k={self.top_k}, num_experts={self.num_experts}, "
            f"{weights})"
        )

    # -- file format --------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write the trace to ``path`` exactly (no suffix is added) in the format above."""
        arrays = {
            "format": np.asarray(FORMAT_NAME),
            "version": np.asarray(FORMAT_VERSION, dtype=np.int64),
            "topk_ids": self.topk_ids,
            "num_experts": np.asarray(self.num_experts, dtype=np.int64),
            "name": np.asarray(self.name),
            "metadata": np.asarray(json.dumps(self.metadata)),
        }
        if self.topk_weights is not None:
            arrays["topk_weights"] = self.topk_weights
        # Writing through a file object stops numpy from appending ".npz" to the name.
        with open(path, "wb") as f:
            np.savez_compressed(f, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RoutingTrace":
        """Read a trace written by :meth:`save`; a malformed file raises ``ValueError``."""
        where = os.fspath(path)
        if os.path.isdir(where):
            raise ValueError(f"{where}: is a directory, not a routing trace file (.npz)")
        # Open the file here (a missing file stays FileNotFoundError) so that it is closed
        # even when numpy gives up half-way through a corrupt archive.
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise
        except OSError as err:
            raise ValueError(f"{where}: cannot be read as a routing trace ({err.strerror or err})") from None
        with f:
            # Look at the signature first: numpy's own error for a non-archive file
            # suggests allow_pickle=True, which is exactly what must not be done here.
            magic = f.read(len(_ZIP_MAGIC))
            f.seek(0)
            if magic != _ZIP_MAGIC:
                kind = "a single .npy array" if magic.startswith(b"\x93NUM") else "no zip signature"
                raise ValueError(f"{where}: not a readable .npz routing trace ({kind})")
            try:
                archive = np.load(f, allow_pickle=False)
            except Exception as err:  # noqa: BLE001 (whatever a broken archive raises, it is the file's fault)
                raise ValueError(f"{where}: not a readable .npz routing trace ({_short(err)})") from None
            with archive:
                try:
                    _check_integrity(archive)
                    fields = _read_fields(archive)
                except _FileProblem as problem:
                    raise ValueError(f"{where}: {problem}") from None
                except Exception as err:  # noqa: BLE001 (zlib.error, BadZipFile, numpy's header errors, ...)
                    raise ValueError(f"{where}: {_member_problem(err)}") from None
        problem = _find_problem(
            fields["topk_ids"], fields["topk_weights"], fields["num_experts"],
            fields["name"], fields["metadata"],
        )
        if problem:
            raise ValueError(f"{where}: {problem}")
        return cls(**fields)


class _FileProblem(Exception):
    """Something wrong with the archive's structure (turned into a ValueError by load)."""


def _member_problem(err: Exception) -> str:
    """Why an archive member could not be read, without numpy's hint to unpickle."""
    if "pickle" in str(err) or "Object arrays" in str(err):
        return "a member is an object array (pickled data); traces are never unpickled"
    return f"a member is corrupt or unreadable ({_short(err)})"


def _short(err: Exception) -> str:
    """The error's type and first line, without numpy's hint to unpickle."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if "allow_pickle" in text:
        text = "a member is an object array (pickled data); traces are never unpickled"
    kind = type(err).__name__ if type(err).__module__ == "builtins" else f"{type(err).__module__}.{type(err).__name__}"
    return f"{kind}: {text}" if text else kind


def _check_integrity(archive: np.lib.npyio.NpzFile) -> None:
    """Every member decompresses and matches its CRC. numpy reads only the bytes an array
    needs and never reaches the CRC check at a member's end, so flipped bytes inside a
    member could otherwise load as wrong values without any error."""
    bad = archive.zip.testzip()
    if bad is not None:
        raise _FileProblem(f"member {bad!r} is corrupt (its bytes do not match the archive's CRC)")


def _read_fields(archive: np.lib.npyio.NpzFile) -> dict:
    """The constructor arguments stored in an archive, checking keys, kinds and version."""
    keys = set(archive.files)
    required = {"format", "version", "topk_ids", "num_experts"}
    missing = sorted(required - keys)
    if missing:
        raise _FileProblem(f"missing key(s) {missing}; found {sorted(keys)}")
    if _scalar(archive, "format", str) != FORMAT_NAME:
        raise _FileProblem(f"'format' must be {FORMAT_NAME!r}")
    version = _scalar(archive, "version", int)
    if version != FORMAT_VERSION:
        raise _FileProblem(f"unsupported format version {version} (this moekit reads {FORMAT_VERSION})")
    # The weights' dtype is checked (not cast) by _find_problem before construction.
    weights = _array(archive, "topk_weights") if "topk_weights" in keys else None
    metadata_text = _scalar(archive, "metadata", str) if "metadata" in keys else "{}"
    try:
        metadata = json.loads(metadata_text)
    except json.JSONDecodeError as err:
        raise _FileProblem(f"'metadata' is not valid JSON ({err})") from None
    return {
        "topk_ids": _array(archive, "topk_ids"),
        "num_experts": _scalar(archive, "num_experts", int),
        "topk_weights": weights,
        "name": _scalar(archive, "name", str) if "name" in keys else "",
        "metadata": metadata,
    }


def _array(archive: np.lib.npyio.NpzFile, key: str) -> np.ndarray:
    """A member as an array (numpy hands back the raw bytes of a member that is not .npy)."""
    value = archive[key]
    if not isinstance(value, np.ndarray):
        raise _FileProblem(f"member {key!r} is not a .npy array")
    return value


def _scalar(archive: np.lib.npyio.NpzFile, key: str, kind: type) -> Any:
    """A 0-d member as a Python int or str, or a _FileProblem saying why it is not one."""
    value = _array(archive, key)
    if value.ndim != 0:
        raise _FileProblem(f"{key!r} must be a scalar, got shape {value.shape}")
    if kind is int and np.issubdtype(value.dtype, np.integer):
        return int(value)
    if kind is str and value.dtype.kind == "U":
        return str(value)
    raise _FileProblem(f"{key!r} must be a {kind.__name__}, got dtype {value.dtype}")


def _find_problem(ids, weights, num_experts, name, metadata) -> str | None:
    """What is wrong with these trace fields, or None when they are well formed."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        return f"num_experts must be an int >= 1, got {num_experts!r}"
    if not isinstance(ids, np.ndarray) or ids.dtype.kind != "i":
        return f"topk_ids must be a signed integer array, got {getattr(ids, 'dtype', type(ids))}"
    if ids.ndim != 4:
        return f"topk_ids must have 4 dims [steps, layers, tokens, K], got shape {ids.shape}"
    if ids.shape[3] < 1:
        return f"topk_ids must have K >= 1 slots, got shape {ids.shape}"
    if ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < -1 or high >= num_experts:
            return (
                f"topk_ids values must be in [-1, {num_experts - 1}] (num_experts={num_experts}), "
                f"found range [{low}, {high}]"
            )
    if weights is not None:
        if weights.dtype != np.float32:
            return f"topk_weights must be float32, got {weights.dtype}"
        if weights.shape != ids.shape:
            return f"topk_weights shape {weights.shape} must equal topk_ids shape {ids.shape}"
    if not isinstance(name, str):
        return f"name must be a str, got {type(name).__name__}"
    if not isinstance(metadata, dict):
        return f"metadata must be a dict, got {type(metadata).__name__}"
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as err:
        return f"metadata must be JSON-serializable ({err})"
    return None
