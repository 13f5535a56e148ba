"""Writing a file so that it is either complete or untouched, never half-written."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

__all__ = ["write_atomically"]


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a new file beside ``path``, then rename it over ``path``:
    ``path`` is either untouched or complete, never half-written."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
