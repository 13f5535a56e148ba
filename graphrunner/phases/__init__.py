"""Speculative decoding phases, each one :class:`~graphrunner.GraphRunner`
subclass of declarations (buffers, outputs, forward) on every mechanism:
target verify, EAGLE draft extend, frozen-KV MTP."""

from __future__ import annotations

from graphrunner.phases.base import SpecBatch, WidthRunner, batch_width
from graphrunner.phases.eagle import EagleDraftExtendRunner, eagle_draft_extend_specs
from graphrunner.phases.mtp import FrozenKvMtpRunner, frozen_kv_sanitizer, mtp_buffer_specs
from graphrunner.phases.verify import TargetVerifyRunner, verify_buffer_specs

__all__ = [
    "EagleDraftExtendRunner",
    "FrozenKvMtpRunner",
    "SpecBatch",
    "TargetVerifyRunner",
    "WidthRunner",
    "batch_width",
    "eagle_draft_extend_specs",
    "frozen_kv_sanitizer",
    "mtp_buffer_specs",
    "verify_buffer_specs",
]
