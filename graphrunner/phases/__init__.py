"""The phases, each a value (:class:`Phase`: buffers, outputs, forward, backend
hooks, tokens per row) derived from the one decode declaration, and the thin
runner bindings of the speculative ones: target verify, EAGLE draft extend and
draft decode, frozen-KV MTP; several decode steps per launch."""

from __future__ import annotations

from graphrunner.phases.base import Phase, PhaseArgs, SpecBatch
from graphrunner.phases.decode import decode_phase
from graphrunner.phases.eagle import (
    EagleDraftDecodeRunner,
    EagleDraftExtendRunner,
    eagle_draft_decode_phase,
    eagle_draft_extend_phase,
    eagle_draft_extend_specs,
)
from graphrunner.phases.mtp import (
    FrozenKvMtpRunner,
    frozen_kv_mtp_phase,
    frozen_kv_sanitizer,
    mtp_buffer_specs,
)
from graphrunner.phases.multistep import multistep_phase
from graphrunner.phases.verify import TargetVerifyRunner, verify_buffer_specs, verify_phase

__all__ = [
    "EagleDraftDecodeRunner",
    "EagleDraftExtendRunner",
    "FrozenKvMtpRunner",
    "Phase",
    "PhaseArgs",
    "SpecBatch",
    "TargetVerifyRunner",
    "decode_phase",
    "eagle_draft_decode_phase",
    "eagle_draft_extend_phase",
    "eagle_draft_extend_specs",
    "frozen_kv_mtp_phase",
    "frozen_kv_sanitizer",
    "mtp_buffer_specs",
    "multistep_phase",
    "verify_buffer_specs",
    "verify_phase",
]
