"""The padding sanitizer: checks around each replay that a step writes nothing
it does not own (and guarded state of one's own: :class:`GuardedTensor`)."""

from __future__ import annotations

from graphrunner.sanitizer.captured import CapturedState
from graphrunner.sanitizer.checks import live_ints
from graphrunner.sanitizer.padding import (
    GuardedTensor,
    PaddingSanitizer,
    PaddingViolation,
    SanitizerStats,
    SlotOwner,
)

__all__ = [
    "CapturedState",
    "GuardedTensor",
    "PaddingSanitizer",
    "PaddingViolation",
    "SanitizerStats",
    "SlotOwner",
    "live_ints",
]
