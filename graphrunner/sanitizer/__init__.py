"""The padding sanitizer: checks around each replay that a step writes nothing
it does not own (and guarded state of one's own: :class:`GuardedTensor`),
nor a KV page requests share by prefix (:mod:`graphrunner.sanitizer.shared`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from graphrunner.sanitizer.shared import (
        SharedPages,
        check_cache_consistency,
        check_shared_writes,
        mapped_pages,
    )

#: The shared-page checks (prefix caching) load on first use.
_SHARED = ("SharedPages", "check_cache_consistency", "check_shared_writes", "mapped_pages")

__all__ = [
    "CapturedState",
    "EagerComparison",
    "GuardedTensor",
    "PaddingSanitizer",
    "PaddingViolation",
    "SanitizerStats",
    "SharedPages",
    "SlotOwner",
    "check_against_eager",
    "check_cache_consistency",
    "check_shared_writes",
    "live_ints",
    "mapped_pages",
]


def __getattr__(name: str) -> object:
    if name in _SHARED:
        from graphrunner.sanitizer import shared

        return getattr(shared, name)
    raise AttributeError(f"module 'graphrunner.sanitizer' has no attribute {name!r}")
