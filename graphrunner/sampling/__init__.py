"""sampling: per-request parameters as declared buffers, a counter-based random stream, an
in-graph sampler and what it applies first: penalties, logit bias, min_tokens, a bitmask."""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphrunner.sampling.argmax import row_argmax
from graphrunner.sampling.params import (
    MAX_LOGIT_BIAS,
    MAX_SEED,
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

if TYPE_CHECKING:
    from graphrunner.sampling.bitmask import (
        ALLOW_ALL,
        TOKEN_BITMASK,
        apply_token_bitmask,
        bitmask_words,
    )
    from graphrunner.sampling.min_tokens import MAX_HOLD_TOKENS, hold_end_tokens
    from graphrunner.sampling.penalties import (
        PENALTY_FIELD_NAMES,
        PENALTY_FIELDS,
        TokenCounts,
        penalize,
        penalty_tensors,
    )
    from graphrunner.sampling.speculative import deterministic_probs, draft_sample, rejection_sample

__all__ = [
    "ALLOW_ALL",
    "MAX_HOLD_TOKENS",
    "MAX_LOGIT_BIAS",
    "MAX_SEED",
    "PENALTY_FIELDS",
    "PENALTY_FIELD_NAMES",
    "SAMPLING_FIELDS",
    "SAMPLING_FIELD_NAMES",
    "Logprobs",
    "SamplingParams",
    "TOKEN_BITMASK",
    "TokenCounts",
    "apply_token_bitmask",
    "bitmask_words",
    "check_seed",
    "deterministic_probs",
    "draft_sample",
    "filtered_probs",
    "hold_end_tokens",
    "logprobs",
    "penalize",
    "penalty_tensors",
    "rejection_sample",
    "request_seed",
    "row_argmax",
    "rows_probs",
    "sample",
    "sample_rows",
    "sampling_tensors",
    "uniform",
]

#: Loaded on first use (a step without them never imports them): name -> module.
_LAZY = dict.fromkeys(("MAX_HOLD_TOKENS", "hold_end_tokens"), "min_tokens")
_LAZY |= dict.fromkeys(
    ("ALLOW_ALL", "TOKEN_BITMASK", "apply_token_bitmask", "bitmask_words"), "bitmask"
)
_LAZY |= dict.fromkeys(("PENALTY_FIELDS", "PENALTY_FIELD_NAMES", "TokenCounts"), "penalties")
_LAZY |= dict.fromkeys(("penalize", "penalty_tensors"), "penalties")
_LAZY |= dict.fromkeys(("deterministic_probs", "draft_sample", "rejection_sample"), "speculative")


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(__import__(f"graphrunner.sampling.{_LAZY[name]}", fromlist=[name]), name)
    raise AttributeError(f"module 'graphrunner.sampling' has no attribute {name!r}")
