"""Small utilities an engine built on graphrunner may share: optional extras
named when missing, single-owner guards, files written whole or not at all."""

from __future__ import annotations

from graphrunner.util.atomic import write_atomically
from graphrunner.util.exclusive import ConcurrentUseError, Exclusive
from graphrunner.util.extras import MissingExtraError, needs_extra
from graphrunner.util.temp import remove_stale_temps, temp_path

__all__ = [
    "ConcurrentUseError",
    "Exclusive",
    "MissingExtraError",
    "needs_extra",
    "remove_stale_temps",
    "temp_path",
    "write_atomically",
]
