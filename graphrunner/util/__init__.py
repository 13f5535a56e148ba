"""Small utilities an engine built on graphrunner may share: optional extras
named when missing, single-owner guards, files written whole or not at all,
warnings that point at the application's line."""

from __future__ import annotations

from graphrunner.util.atomic import write_atomically
from graphrunner.util.exclusive import ConcurrentUseError, Exclusive
from graphrunner.util.extras import MissingExtraError, needs_extra
from graphrunner.util.temp import remove_stale_temps, temp_path
from graphrunner.util.warn import warn_at_caller

__all__ = [
    "ConcurrentUseError",
    "Exclusive",
    "MissingExtraError",
    "needs_extra",
    "remove_stale_temps",
    "temp_path",
    "warn_at_caller",
    "write_atomically",
]
