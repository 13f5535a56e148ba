"""The logits processors a sampled step runs before its sampler, in order:
the penalties and logit bias (:mod:`graphrunner.sampling.penalties`), the
``min_tokens`` hold of the end tokens (:mod:`graphrunner.sampling.min_tokens`),
then a grammar's token bitmask (:mod:`graphrunner.sampling.bitmask`). Loaded
only by a step that runs one, so a plain sampled step never imports them."""

from __future__ import annotations

from typing import Any

import torch

from graphrunner.sampling.bitmask import apply_token_bitmask
from graphrunner.sampling.min_tokens import hold_end_tokens
from graphrunner.sampling.penalties import TokenCounts, penalize

__all__ = ["process_logits"]


def process_logits(
    logits: torch.Tensor,
    b: Any,
    req_pool_indices: torch.Tensor,
    position: torch.Tensor,
    counts: TokenCounts | None,
    bitmask: torch.Tensor | None,
) -> torch.Tensor:
    """``logits`` (float ``[n, V]``) as the sampler reads them: with
    ``counts``, penalized and biased (``b``'s penalty buffers, the counts of
    rows ``req_pool_indices`` int64 ``[n]``) and the end tokens held where
    ``position`` (int64 ``[n]``) is short of ``min_tokens``; with
    ``bitmask`` (a grammar's, int32 ``[n, ceil(V / 32)]``), only the tokens
    it allows. Float32 ``[n, V]``; graph-safe."""
    x = logits
    if counts is not None:
        x = hold_end_tokens(penalize(x, counts, req_pool_indices, b), position, b)
    if bitmask is not None:
        x = apply_token_bitmask(x, bitmask)
    return x
