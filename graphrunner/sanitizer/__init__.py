"""The padding sanitizer: checks around each replay that a step writes nothing
it does not own (and guarded state of one's own: :class:`GuardedTensor`)."""

from __future__ import annotations

from graphrunner.sanitizer.captured import CapturedState
from graphrunner.sanitizer.checks import live_ints
from graphrunner.sanitizer.eager_check import EagerComparison, check_against_eager
from graphrunner.sanitizer.padding import (
    GuardedTensor,
    PaddingSanitizer,
    PaddingViolation,
    SanitizerStats,
    SlotOwner,
)

__all__ = [
    "CapturedState",
    "EagerComparison",
    "GuardedTensor",
    "PaddingSanitizer",
    "PaddingViolation",
    "SanitizerStats",
    "SlotOwner",
    "check_against_eager",
    "live_ints",
]
