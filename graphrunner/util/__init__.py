"""Utilities an engine built on graphrunner may share: optional extras named when missing,
single-owner guards, files written whole or not at all, warnings at the application's line;
loaded on first use, calls kept off a stack chunk's end and Ctrl-C held to a step boundary."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from graphrunner.util.atomic import write_atomically
from graphrunner.util.exclusive import ConcurrentUseError, Exclusive
from graphrunner.util.extras import MissingExtraError, needs_extra
from graphrunner.util.temp import remove_stale_temps, temp_path
from graphrunner.util.warn import warn_at_caller

if TYPE_CHECKING:
    from graphrunner.util.interrupts import deferred_interrupts
    from graphrunner.util.stack_chunks import ChunkSafeCall

__all__ = [
    "ChunkSafeCall",
    "ConcurrentUseError",
    "Exclusive",
    "MissingExtraError",
    "deferred_interrupts",
    "needs_extra",
    "remove_stale_temps",
    "temp_path",
    "warn_at_caller",
    "write_atomically",
]


def __getattr__(name: str) -> object:
    module = {"ChunkSafeCall": "stack_chunks", "deferred_interrupts": "interrupts"}.get(name)
    if module is not None:
        return getattr(importlib.import_module(f"graphrunner.util.{module}"), name)
    raise AttributeError(f"module 'graphrunner.util' has no attribute {name!r}")
