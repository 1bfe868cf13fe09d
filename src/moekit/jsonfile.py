"""Reading JSON files safely: parsed with :mod:`json` only (nothing in a file is ever run, no
pickle), plain or gzip-compressed (a ``.gz`` suffix), and every problem with the file is a
ValueError that names it. Records, tables, hardware files and traces all load through here.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from typing import Any

# The largest file (after decompression) read. The biggest files moekit writes (kernel tables)
# are a few MiB; the bound keeps a file that never ends (/dev/zero, a FIFO, a gzip bomb) from
# filling the memory before anything can be said about it.
MAX_BYTES = 64 << 20


def read_json(path: str | os.PathLike, what: str = "a JSON file", *, gzipped: bool | None = None) -> Any:
    """The JSON value in ``path``, gzip-decompressed if ``gzipped`` (None: if the name ends in ``.gz``).

    ``what`` says what the file should be, for the message when it cannot be read
    ("cannot read <what>"). Every failure (missing or unreadable file, not gzip, larger than
    :data:`MAX_BYTES`, not UTF-8, not JSON, nested too deeply for the parser) raises
    ValueError starting with the path.
    """
    path = os.fspath(path)
    if gzipped is None:
        gzipped = str(path).endswith(".gz")
    try:
        with (gzip.open(path, "rb") if gzipped else open(path, "rb")) as fh:
            data = fh.read(MAX_BYTES + 1)
    except gzip.BadGzipFile as exc:
        raise ValueError(f"{path}: not a gzip file ({exc})") from None
    except (EOFError, zlib.error) as exc:  # a truncated or corrupted gzip stream
        raise ValueError(f"{path}: not a gzip file (damaged: {exc})") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read {what} ({exc})") from None
    if len(data) > MAX_BYTES:
        raise ValueError(f"{path}: cannot read {what} (larger than {MAX_BYTES >> 20} MiB"
                         f"{' decompressed' if gzipped else ''})")
    return parse_json(data, path)


def parse_json(data: bytes | str, where: str) -> Any:
    """``data`` (UTF-8 bytes or text) parsed with :mod:`json`; any problem is a ValueError
    starting with ``where``."""
    try:
        return json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not a UTF-8 text file ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:  # the parser recurses once per nested array or object
        raise ValueError(f"{where}: not valid JSON (arrays or objects nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer literal of more digits than Python converts
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
