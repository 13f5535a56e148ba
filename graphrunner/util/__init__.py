"""Small utilities an engine built on graphrunner may share: optional extras
named when missing, single-owner guards, files written whole or not at all,
warnings that point at the application's line, calls kept off a stack
chunk's end (:class:`ChunkSafeCall`, loaded on first use)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphrunner.util.atomic import write_atomically
from graphrunner.util.exclusive import ConcurrentUseError, Exclusive
from graphrunner.util.extras import MissingExtraError, needs_extra
from graphrunner.util.temp import remove_stale_temps, temp_path
from graphrunner.util.warn import warn_at_caller

if TYPE_CHECKING:
    from graphrunner.util.stack_chunks import ChunkSafeCall

__all__ = [
    "ChunkSafeCall",
    "ConcurrentUseError",
    "Exclusive",
    "MissingExtraError",
    "needs_extra",
    "remove_stale_temps",
    "temp_path",
    "warn_at_caller",
    "write_atomically",
]


def __getattr__(name: str) -> object:
    if name == "ChunkSafeCall":
        from graphrunner.util import stack_chunks

        return stack_chunks.ChunkSafeCall
    raise AttributeError(f"module 'graphrunner.util' has no attribute {name!r}")
