"""A grammar's token bitmask as a declared buffer of the step.

Structured output (a JSON schema, a regex, a grammar) allows each row a set
of next tokens that the host's grammar matcher knows; the step reads it as
one more per-row buffer, ``token_bitmask`` int32 ``[bs, ceil(V / 32)]``, bit
``t % 32`` of word ``t // 32`` set where token ``t`` is allowed (xgrammar's
layout), and sets the others' logits to ``-inf`` before the sampler
(:func:`apply_token_bitmask`). The host fills it for the live rows before
each step; an unconstrained row, and every padded row (the pad rule: FILL
-1, all bits set), allows every token, so masking and sampling stay in the
captured step whatever the batch holds.
"""

from __future__ import annotations

import torch

from graphrunner.declare.buffers import BufferSpec, PadRule

__all__ = [
    "ALLOW_ALL",
    "TOKEN_BITMASK",
    "apply_token_bitmask",
    "bitmask_spec",
    "bitmask_words",
]

#: The buffer's name.
TOKEN_BITMASK = "token_bitmask"
#: A word with every bit set: its 32 tokens allowed (the pad value).
ALLOW_ALL = -1


def bitmask_words(vocab: int) -> int:
    """The int32 words of one row's bitmask over ``vocab`` tokens."""
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"vocab={vocab!r}; expected an int >= 1")
    return (vocab + 31) // 32


def bitmask_spec(vocab: int) -> BufferSpec:
    """``token_bitmask``: int32 ``[bs, bitmask_words(vocab)]``, padded rows
    all ones (every token allowed)."""
    return BufferSpec(
        TOKEN_BITMASK,
        torch.int32,
        PadRule.FILL,
        fill_value=ALLOW_ALL,
        extra_shape=(bitmask_words(vocab),),
    )


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` (float ``[n, V]``) with ``-inf`` at every token whose bit
    is clear in ``bitmask`` (int32 ``[n, ceil(V / 32)]``); a row of all ones
    passes unchanged. Graph-safe: no branch on data."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # flatten, not view(n, -1): the batch stays one symbol in a compiled program
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(-2)[..., :vocab]
    return logits.masked_fill(allowed == 0, float("-inf"))
