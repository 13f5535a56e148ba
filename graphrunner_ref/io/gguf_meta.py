"""Reading a GGUF file's header: the reader, its metadata values, its error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphrunner.util import needs_extra
from graphrunner_ref.model.config import CheckpointError

__all__ = ["GGUFImportError", "field", "open_gguf"]


class GGUFImportError(CheckpointError):
    """A GGUF file cannot be converted: missing, truncated, or a model or tensor
    type this importer does not handle."""


def open_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path``; :class:`GGUFImportError` when the file
    is missing or not a readable GGUF file (truncated, wrong magic)."""
    with needs_extra("gguf", f"reading the GGUF file {str(path)!r}"):
        import gguf

    file = Path(path)
    if not file.is_file():
        raise GGUFImportError(f"GGUF file {str(file)!r} not found")
    try:
        return gguf.GGUFReader(file)
    except Exception as e:  # the reader raises ValueError, struct and numpy errors alike
        raise GGUFImportError(f"{file} is not a readable GGUF file: {e}") from None


def field(reader: Any, key: str, default: Any = None) -> Any:
    """The value of metadata ``key`` (a scalar, string or list), or ``default``."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()
