"""The phases, each a value (:class:`Phase`: buffers, outputs, forward, backend
hooks, tokens per row) derived from the one decode declaration (target
verify, EAGLE draft extend and draft decode, frozen-KV MTP, several decode
steps per launch), and the two runners named by their phase (EAGLE draft
extend, frozen-KV MTP)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from graphrunner.phases.base import Phase, SpecBatch
from graphrunner.phases.decode import decode_phase
from graphrunner.phases.eagle import (
    EagleDraftExtendRunner,
    eagle_draft_decode_phase,
    eagle_draft_extend_phase,
    eagle_draft_extend_specs,
)
from graphrunner.phases.models import EagleDraftModel, MtpDraftModel, VerifyModel
from graphrunner.phases.mtp import (
    FrozenKvMtpRunner,
    frozen_kv_mtp_phase,
    frozen_kv_sanitizer,
    mtp_buffer_specs,
)
from graphrunner.phases.multistep import (
    MAX_STEPS_PER_LAUNCH,
    STEPS_LEFT,
    check_steps_per_launch,
    multistep_phase,
)
from graphrunner.phases.sampled import LOGPROB_OUTPUTS, SAMPLED_OUTPUTS, with_sampling
from graphrunner.phases.verify import verify_buffer_specs, verify_phase

if TYPE_CHECKING:
    from graphrunner.phases.token_batch import (
        token_batch_inputs,
        token_batch_phase,
        token_batch_specs,
    )

__all__ = [
    "LOGPROB_OUTPUTS",
    "MAX_STEPS_PER_LAUNCH",
    "SAMPLED_OUTPUTS",
    "STEPS_LEFT",
    "EagleDraftModel",
    "EagleDraftExtendRunner",
    "FrozenKvMtpRunner",
    "MtpDraftModel",
    "Phase",
    "SpecBatch",
    "VerifyModel",
    "check_steps_per_launch",
    "decode_phase",
    "eagle_draft_decode_phase",
    "eagle_draft_extend_phase",
    "eagle_draft_extend_specs",
    "frozen_kv_mtp_phase",
    "frozen_kv_sanitizer",
    "mtp_buffer_specs",
    "multistep_phase",
    "token_batch_inputs",
    "token_batch_phase",
    "token_batch_specs",
    "verify_buffer_specs",
    "verify_phase",
    "with_sampling",
]

_TOKEN_BATCH = {"token_batch_inputs", "token_batch_phase", "token_batch_specs"}


def __getattr__(name: str) -> Any:
    # The token-batch phase loads when first named: a decode engine's import
    # does not read it (tests/test_public_api.py's line budget).
    if name in _TOKEN_BATCH:
        from graphrunner.phases import token_batch

        return getattr(token_batch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
