"""sampling: per-request sampling parameters as declared buffers, a
counter-based random stream, and a branch-free in-graph sampler."""

from __future__ import annotations

from graphrunner.sampling.params import (
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

__all__ = [
    "SAMPLING_FIELDS",
    "SAMPLING_FIELD_NAMES",
    "Logprobs",
    "SamplingParams",
    "check_seed",
    "deterministic_probs",
    "draft_sample",
    "filtered_probs",
    "logprobs",
    "rejection_sample",
    "request_seed",
    "rows_probs",
    "sample",
    "sample_rows",
    "sampling_tensors",
    "uniform",
]
