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


def read_json(path: str | os.PathLike, what: str = "a JSON file", *, gzipped: bool | None = None) -> Any:
    """The JSON value in ``path``, gzip-decompressed if ``gzipped`` (None: if the name ends in ``.gz``).

    ``what`` says what the file should be, for the message when it cannot be read
    ("cannot read <what>"). Every failure (missing or unreadable file, not gzip, not UTF-8,
    not JSON) raises ValueError starting with the path.
    """
    path = os.fspath(path)
    if gzipped is None:
        gzipped = str(path).endswith(".gz")
    try:
        if gzipped:
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                return json.load(fh)
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except gzip.BadGzipFile as exc:
        raise ValueError(f"{path}: not a gzip file ({exc})") from None
    except (EOFError, zlib.error) as exc:  # a truncated or corrupted gzip stream
        raise ValueError(f"{path}: not a gzip file (damaged: {exc})") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read {what} ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 text file ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
