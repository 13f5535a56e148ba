"""sampling: per-request sampling parameters as declared buffers, a
counter-based random stream, a branch-free in-graph sampler, and the
penalties, logit bias and ``min_tokens`` hold it applies first (per-request
token counts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphrunner.sampling.params import (
    MAX_LOGIT_BIAS,
    SAMPLING_FIELD_NAMES,
    SAMPLING_FIELDS,
    SamplingParams,
    check_seed,
    request_seed,
    sampling_tensors,
)
from graphrunner.sampling.random import uniform
from graphrunner.sampling.sample import (
    Logprobs,
    filtered_probs,
    logprobs,
    rows_probs,
    sample,
    sample_rows,
)
from graphrunner.sampling.speculative import deterministic_probs, draft_sample, rejection_sample

if TYPE_CHECKING:
    from graphrunner.sampling.min_tokens import (
        HOLD_FIELDS,
        MAX_HOLD_TOKENS,
        hold_end_tokens,
        hold_tensors,
    )
    from graphrunner.sampling.penalties import (
        PENALTY_FIELD_NAMES,
        PENALTY_FIELDS,
        TokenCounts,
        penalize,
        penalty_tensors,
    )

__all__ = [
    "HOLD_FIELDS",
    "MAX_HOLD_TOKENS",
    "MAX_LOGIT_BIAS",
    "PENALTY_FIELDS",
    "PENALTY_FIELD_NAMES",
    "SAMPLING_FIELDS",
    "SAMPLING_FIELD_NAMES",
    "Logprobs",
    "SamplingParams",
    "TokenCounts",
    "check_seed",
    "deterministic_probs",
    "draft_sample",
    "filtered_probs",
    "hold_end_tokens",
    "hold_tensors",
    "logprobs",
    "penalize",
    "penalty_tensors",
    "rejection_sample",
    "request_seed",
    "rows_probs",
    "sample",
    "sample_rows",
    "sampling_tensors",
    "uniform",
]

#: Loaded on first use: a step without penalties never imports them.
_PENALTIES = ("PENALTY_FIELDS", "PENALTY_FIELD_NAMES", "TokenCounts", "penalize", "penalty_tensors")
_MIN_TOKENS = ("HOLD_FIELDS", "MAX_HOLD_TOKENS", "hold_end_tokens", "hold_tensors")


def __getattr__(name: str) -> object:
    if name in _PENALTIES:
        from graphrunner.sampling import penalties

        return getattr(penalties, name)
    if name in _MIN_TOKENS:
        from graphrunner.sampling import min_tokens

        return getattr(min_tokens, name)
    raise AttributeError(f"module 'graphrunner.sampling' has no attribute {name!r}")
