"""Warnings that point at the application's line, not at graphrunner's."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

__all__ = ["warn_at_caller"]

_PACKAGE_DIR = str(Path(__file__).resolve().parents[1]) + os.sep
logger = logging.getLogger("graphrunner")


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside graphrunner, as seen
    from the function that calls ``warnings.warn`` (our caller's caller):
    counted, so no call path has to hard-code its depth."""
    frame = sys._getframe(2)  # the caller of warn_at_caller
    level = 2
    while frame.f_back is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(
        _PACKAGE_DIR
    ):
        frame = frame.f_back
        level += 1
    return level


def warn_at_caller(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warn (and log) at the first stack frame outside the graphrunner package."""
    warnings.warn(message, category, stacklevel=_caller_stacklevel())
    logger.warning(message)
